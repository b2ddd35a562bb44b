"""Structured outputs: a request's output held to a JSON schema, any JSON object, a regex, a choice of
strings or a grammar, by a token bitmask applied to its logits before sampling.

The grammar engine is xgrammar (vLLM's default). Measured here on the default model's 49,152-token
vocabulary with a 50-field schema (docs/BENCHMARKS.md has the bench's figures): compile 12 ms; the
masks of 16 requests 0.02 ms a step (median), 0.18 ms at p95 — against llguidance's 4 ms and 0.39 /
3.9 ms, whose masks would have cost the batch a tenth of a decode step at p95.

* `Grammars` (one per engine) compiles a constraint once and keeps it (xgrammar's cache, keyed by the
  constraint). A worker compiles in its thread pool before the request reaches the engine thread
  (`Grammars.compile`, bounded by ``COMPILE_TIMEOUT_S``), so the batch never waits for a compile; the
  engine thread then finds it cached.
* `Constraint` (one per request) is its matcher. It is built from the constraint and the request's
  output so far — the first token a prefill worker sampled, the tokens a migrated request resumes —
  so the grammar's state travels with the request by replaying them: a handoff or a migration
  continues exactly where it was.
* JSON is generated compact (no free whitespace), so a schema's output cannot run on in spaces; and
  since compact JSON never holds a raw control character (inside a string one is escaped), tokens
  whose text holds one are masked too — xgrammar's JSON strings admit them, and a strict parser
  (Python's `json.loads`) refuses them (seen with the tiny random model at temperature 1).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from core.errors import InvalidRequest
from core.request import OutputConstraint
from core.sampling_params import StructuredOutput
from engine import cpu_ops

log = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0  # a worker answers 400 for a constraint that takes longer to compile
_JSON_SEPARATORS = (",", ":")


def _xgr() -> Any:
    import xgrammar  # imported on first use: it loads its native library and transformers (~2 s)

    return xgrammar


def vocab_type(tokenizer_json: dict[str, Any]) -> str:
    """How a Hugging Face tokenizer.json spells its tokens: byte_level (GPT-2 style: Llama 3, Qwen2,
    SmolLM2), byte_fallback (SentencePiece with <0xNN> tokens: Llama 2, Mistral) or raw."""
    decoder = tokenizer_json.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {d.get("type") for d in parts if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL"
    if "ByteFallback" in kinds:
        return "BYTE_FALLBACK"
    return "RAW"


class Grammars:
    """The engine's constraint compiler over its tokenizer's vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._json_allowed: torch.Tensor | None = None  # a bitmask row: tokens without control chars
        self._lock = threading.Lock()  # built once, by whichever thread asks first

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = _xgr()
                data = json.loads(self._tokenizer_json)
                vocab: dict[str, int] = data["model"]["vocab"]
                for added in data.get("added_tokens", []):
                    vocab[added["content"]] = added["id"]
                encoded = [""] * self.vocab_size
                for text, i in vocab.items():
                    if 0 <= i < self.vocab_size:
                        encoded[i] = text
                info = xgr.TokenizerInfo(
                    encoded,
                    getattr(xgr.VocabType, vocab_type(data)),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids,
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def _json_tokens(self) -> torch.Tensor:
        """The bitmask row of the tokens that may appear in compact JSON: none with a raw control
        character in its text."""
        with self._lock:
            if self._json_allowed is None:
                import tokenizers

                backend = tokenizers.Tokenizer.from_str(self._tokenizer_json)
                allowed = torch.ones(self.vocab_size, dtype=torch.bool)
                for i in range(min(self.vocab_size, backend.get_vocab_size(with_added_tokens=True))):
                    text = backend.decode([i], skip_special_tokens=False)
                    if any(ord(c) < 0x20 for c in text):
                        allowed[i] = False
                self._json_allowed = _pack_bits(allowed)
            return self._json_allowed

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar (cached); InvalidRequest saying what is wrong with the constraint."""
        compiler = self._get_compiler()
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec, any_whitespace=False, separators=_JSON_SEPARATORS)
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, separators=_JSON_SEPARATORS
                )
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec))
            if "::=" in spec:
                return compiler.compile_grammar(spec)
            return compiler.compile_lark(spec)
        except InvalidRequest:
            raise
        except Exception as e:  # xgrammar's own errors (RuntimeError, ValueError, InvalidJSONError)
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequest(f"the {_NAMES[kind]} cannot be compiled: {reason[:300]}") from None

    def constraint(self, constraint: StructuredOutput, output_so_far: Sequence[int]) -> Constraint:
        """A request's matcher, advanced over the tokens it already generated."""
        matcher = _xgr().GrammarMatcher(self.compile(constraint))
        for i, token in enumerate(output_so_far):
            if not matcher.accept_token(token):
                raise InvalidRequest(
                    f"output token {i} ({token}) does not match the request's {_NAMES[constraint.kind]}"
                )
        json_kind = constraint.kind in ("json", "json_object")
        return Constraint(matcher, self._json_tokens() if json_kind else None)


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


def choice_grammar(spec: str) -> str:
    """EBNF for exactly one of the strings in the JSON list ``spec``."""
    try:
        choices = json.loads(spec)
    except ValueError:
        raise InvalidRequest("a choice constraint must be a JSON list of strings") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequest("a choice constraint must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Constraint:
    """One request's grammar state: which tokens may come next, advanced by each sampled token."""

    def __init__(self, matcher: Any, allowed: torch.Tensor | None = None) -> None:
        self._matcher = matcher
        self._allowed = allowed  # a bitmask row ANDed with the grammar's (None: the grammar's alone)
        self.broken = False  # a token outside the grammar was taken (cannot happen unless forced)

    @property
    def done(self) -> bool:
        """The grammar took its stop token: nothing more to enforce."""
        return self.broken or bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._allowed is not None:
            bitmask[row] &= self._allowed

    def accept(self, token_id: int) -> None:
        if not self.done and not self._matcher.accept_token(token_id):
            log.warning("a sampled token (%d) is outside the request's grammar: no longer enforced", token_id)
            self.broken = True


def apply_masks(
    logits: torch.Tensor, constrained: list[tuple[int, OutputConstraint]], vocab_size: int
) -> None:
    """Sets to -inf, in place, every logit a row's grammar does not allow next (rows of ``logits``)."""
    rows = [(r, c) for r, c in constrained if not c.done]
    if not rows:
        return
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab_size)
    for r, c in rows:
        c.fill(bitmask, r)
    if logits.device.type == "cpu":  # Baton's kernel: xgrammar's CPU path took 3 ms for 16 rows here
        cpu_ops.apply_token_bitmask(logits, bitmask, [r for r, _ in rows])
    else:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=[r for r, _ in rows])


def _pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """A bool per token as xgrammar's bitmask row: int32 words, bit i of word w = token 32·w + i."""
    n = allowed.numel()
    padded = torch.zeros((n + 31) // 32 * 32, dtype=torch.int64)
    padded[:n] = allowed.to(torch.int64)
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (padded.view(-1, 32) * weights).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
