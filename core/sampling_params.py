"""`SamplingParams`: how one request's tokens are chosen and when it stops, validated at construction."""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from core.errors import InvalidRequest

MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1
MAX_STRUCTURED_SPEC_BYTES = 64 << 10  # a schema, regex, choice list or grammar, as UTF-8
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match: ``kind`` json (``spec`` a JSON schema, as JSON text), json_object (any
    JSON object; no spec), regex, choice (``spec`` a JSON list of the allowed strings) or grammar (EBNF
    with ``root ::=``, or Lark). Compiled and enforced by the engine (engine.structured)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise InvalidRequest("a structured output's spec must be a string")
        if len(self.spec.encode("utf-8", "replace")) > MAX_STRUCTURED_SPEC_BYTES:
            raise InvalidRequest(
                f"the {self.kind} constraint is over the limit of {MAX_STRUCTURED_SPEC_BYTES} bytes"
            )
        if self.kind != "json_object" and not self.spec:
            raise InvalidRequest(f"the {self.kind} constraint must not be empty")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI / vLLM names and meanings).

    temperature 0 means greedy. top_k 0 or -1 disables top-k. `seed` makes sampling reproducible
    per request and position, whatever else is in the batch; None lets the engine pick one.
    `logprobs` is the number of top alternatives to return per token (0 = only the sampled one).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # top alternatives per prompt token (vLLM); None = not computed
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured: StructuredOutput | None = None  # the output held to a schema, regex, choice or grammar

    def __post_init__(self) -> None:
        # Accept a bare string or any iterable for the two list fields; store tuples (hashable, frozen).
        object.__setattr__(self, "stop", _as_tuple("stop", self.stop, str))
        object.__setattr__(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids, int))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        _check_number("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        _check_number("top_p", self.top_p, 0.0, 1.0)
        if self.top_p == 0.0:
            raise InvalidRequest("top_p must be in (0, 1], got 0")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY)
        if self.repetition_penalty == 0.0:
            raise InvalidRequest("repetition_penalty must be > 0, got 0")
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for s in self.stop:
            if not s:
                raise InvalidRequest("stop strings must not be empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(f"a stop string must be at most {MAX_STOP_STRING_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed")
        for t in self.stop_token_ids:
            if t < 0:
                raise InvalidRequest(f"stop_token_ids must be non-negative, got {t}")

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Checks what depends on the model: token ids must exist in its vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise InvalidRequest(f"stop token id {t} is outside the vocabulary (size {vocab_size})")


def _as_tuple(name: str, value: Any, kind: type) -> tuple[Any, ...]:
    if value is None:
        return ()
    if kind is str and isinstance(value, str):
        return (value,)
    # A sequence, not any iterable: a JSON object ({} → its keys) or a set is a client's mistake.
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, AbstractSet)):
        raise InvalidRequest(f"{name} must be a list of {kind.__name__}, got {type(value).__name__}")
    items = tuple(value)
    for item in items:
        ok = _is_int(item) if kind is int else isinstance(item, kind)
        if not ok:
            raise InvalidRequest(f"{name} must contain only {kind.__name__} values, got {item!r}")
    return items


def _check_int(name: str, value: object, lo: int, hi: int | None) -> None:
    if not _is_int(value):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    assert isinstance(value, int)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidRequest(f"{name} must be {bound}, got {value}")


def _check_number(name: str, value: object, lo: float, hi: float) -> None:
    if not _is_number(value):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    assert isinstance(value, (int, float))
    if not (lo <= value <= hi):  # also rejects NaN
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}")
