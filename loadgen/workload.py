"""What loadgen sends: prompts and output lengths, drawn per request from a seeded workload.

A `Workload` turns a request index into a `RequestSpec` deterministically (its own `random.Random`
seeded by the run's seed and the index), so a run is reproducible whatever the arrival order. Random
prompts are exact token-id sequences when a tokenizer is given (sent as ids where the target accepts
them, else decoded to text and re-fitted), else runs of common English words (≈ one token each).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.tokenizer import Tokenizer


class LoadgenError(Exception):
    """Bad input or an unreachable target: the CLI prints the message on one line and exits 2."""


# Common English words that are one token in most byte-level BPE vocabularies (with a leading space).
_WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had by word but what "
    "some we can out other were all there when up use your how said an each she which do their time if will "
    "way about many then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who may down side been "
    "now find any new work part take get place made live where after back little only round man year came "
    "show every good me give our under name very through just form great think say help low line before"
).split()


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A token count drawn uniformly from [lo, hi] (lo == hi: fixed). Written ``N`` or ``LO:HI``."""

    lo: int
    hi: int

    @classmethod
    def parse(cls, text: str, minimum: int = 1) -> LengthSpec:
        lo_text, sep, hi_text = text.partition(":")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if sep else lo
        except ValueError:
            raise ValueError(f"expected N or LO:HI (integers), got {text!r}") from None
        if lo < minimum or hi < lo:
            raise ValueError(f"expected {minimum} <= LO <= HI, got {text!r}")
        return cls(lo, hi)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def __str__(self) -> str:
        return str(self.lo) if self.lo == self.hi else f"{self.lo}:{self.hi}"


DEFAULT_OUTPUT_LEN = LengthSpec(128, 128)


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant of a multi-tenant mix: its share of the requests and the API key it sends."""

    name: str
    share: float
    api_key: str

    @classmethod
    def parse(cls, text: str) -> Tenant:
        """``NAME:SHARE[:KEY]`` (the key may itself contain colons)."""
        name, _, rest = text.partition(":")
        share_text, _, key = rest.partition(":")
        try:
            share = float(share_text)
        except ValueError:
            raise ValueError(f"expected NAME:SHARE[:KEY] with a numeric share, got {text!r}") from None
        if not name or not share > 0 or math.isinf(share):
            raise ValueError(f"expected NAME:SHARE[:KEY] with a name and a share > 0, got {text!r}")
        return cls(name, share, key)


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Every knob of the workload; the `loadgen run` workload flags by the same names."""

    dataset: str = "random"  # random | sharegpt
    dataset_path: Path | None = None
    input_len: LengthSpec = LengthSpec(128, 128)  # random: tokens after the shared prefix
    output_len: LengthSpec | None = None  # None: 128 for random, the gpt turn's length for ShareGPT
    prefix_groups: int = 0  # random: requests fall into this many groups, each with a shared prefix
    prefix_len: int = 0  # tokens of each group's shared prefix
    long_share: float = 0.0  # random: this share of requests uses the long lengths
    long_input_len: LengthSpec = LengthSpec(2048, 2048)
    long_output_len: LengthSpec = LengthSpec(256, 256)
    tenants: tuple[Tenant, ...] = ()
    api_key: str = ""  # sent by requests of no tenant
    max_total_len: int | None = None  # ShareGPT: skip conversations whose prompt + output exceed it
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request to send: the prompt (text, and exact ids when known) and its forced output length."""

    index: int
    prompt: str
    prompt_token_ids: tuple[int, ...] | None  # exact ids of a random prompt (with a tokenizer)
    prompt_len: int  # tokens: exact with a tokenizer, else an estimate (words, or characters / 4)
    output_len: int
    tenant: str | None
    api_key: str
    group: int | None  # shared-prefix group


@dataclass(frozen=True, slots=True)
class Conversation:
    """A ShareGPT entry reduced to what a request needs."""

    prompt: str
    prompt_len: int
    output_len: int


def estimate_tokens(text: str) -> int:
    """Token count without a tokenizer: OpenAI's rule of thumb of four characters a token."""
    return max(1, math.ceil(len(text) / 4))


def load_sharegpt(
    path: Path, tokenizer: Tokenizer | None, max_total_len: int | None = None
) -> list[Conversation]:
    """The usable conversations of a ShareGPT-format file: the first human turn and the gpt turn after it.

    Entries without such a pair are skipped (as vLLM does); a file that is not a JSON list of objects,
    or has no usable entry, is an error.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LoadgenError(f"cannot read dataset {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise LoadgenError(f"malformed ShareGPT file {str(path)!r}: not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise LoadgenError(
            f"malformed ShareGPT file {str(path)!r}: not JSON ({e.msg} at line {e.lineno})"
        ) from None
    if not isinstance(data, list):
        raise LoadgenError(
            f"malformed ShareGPT file {str(path)!r}: expected a JSON list of "
            f'{{"conversations": [...]}} objects, got {type(data).__name__}'
        )
    conversations: list[Conversation] = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise LoadgenError(
                f"malformed ShareGPT file {str(path)!r}: entry {i} is {type(entry).__name__}, not an object"
            )
        pair = _first_exchange(entry.get("conversations"))
        if pair is None:
            continue
        prompt, answer = pair
        if tokenizer is not None:
            prompt_len, output_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(answer, False))
        else:
            prompt_len, output_len = estimate_tokens(prompt), estimate_tokens(answer)
        if max_total_len is not None and prompt_len + output_len > max_total_len:
            continue
        conversations.append(Conversation(prompt, prompt_len, max(1, output_len)))
    if not conversations:
        limit = f", at most {max_total_len} tokens in all" if max_total_len else ""
        raise LoadgenError(
            f"ShareGPT file {str(path)!r} has no usable conversation (a human turn followed "
            f"by a gpt turn{limit})"
        )
    return conversations


def _first_exchange(turns: object) -> tuple[str, str] | None:
    """The first human turn's text and the gpt turn right after it, if the entry has them."""
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:], strict=False):
        if not (isinstance(turn, dict) and isinstance(reply, dict)):
            return None
        if turn.get("from") == "human" and reply.get("from") == "gpt":
            prompt, answer = turn.get("value"), reply.get("value")
            if isinstance(prompt, str) and prompt and isinstance(answer, str) and answer:
                return prompt, answer
            return None
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer from a Hugging Face model directory, a .gguf file, or ``default`` (Baton's default
    model, prepared once into the cache like the gateway does). No torch is imported."""
    from core.errors import ModelLoadError
    from engine import gguf_convert

    try:
        if spec == "default":
            return Tokenizer.from_dir(gguf_convert.prepare_default_model())
        path = Path(spec).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return Tokenizer.from_dir(gguf_convert.prepare_gguf_model(path))
        if not path.is_dir():
            raise LoadgenError(f"--tokenizer {spec!r} is not a model directory, a .gguf file or 'default'")
        return Tokenizer.from_dir(path)
    except ModelLoadError as e:
        raise LoadgenError(f"cannot load the tokenizer {spec!r}: {e}") from None


class Workload:
    """Draws `RequestSpec`s: random prompts (shared prefixes, a long/short mix) or ShareGPT conversations,
    each request's tenant by share. `ids_ok`: the target accepts token-id prompts."""

    def __init__(self, config: WorkloadConfig, tokenizer: Tokenizer | None, ids_ok: bool) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._ids_ok = ids_ok and tokenizer is not None
        self._conversations: list[Conversation] = []
        if config.dataset == "sharegpt":
            if config.dataset_path is None:
                raise LoadgenError("--dataset sharegpt needs --dataset-path FILE")
            self._conversations = load_sharegpt(config.dataset_path, tokenizer, config.max_total_len)
            random.Random(f"{config.seed}:shuffle").shuffle(self._conversations)
        elif config.dataset != "random":
            raise LoadgenError(f"unknown dataset {config.dataset!r} (random or sharegpt)")
        self._vocab: list[int] = []
        if tokenizer is not None:
            special = tokenizer.all_special_ids
            self._vocab = [i for i in range(tokenizer.vocab_size) if i not in special]
        total_share = sum(t.share for t in config.tenants)
        self._tenant_bounds = [
            sum(t.share for t in config.tenants[: i + 1]) / total_share for i in range(len(config.tenants))
        ]
        self._prefixes = (
            [
                self._random_prompt(random.Random(f"{config.seed}:prefix:{g}"), config.prefix_len)
                for g in range(config.prefix_groups)
            ]
            if config.prefix_len > 0
            else []
        )

    def sample(self, index: int) -> RequestSpec:
        """The request at this position of the run (the same for the same seed and index)."""
        rng = random.Random(f"{self.config.seed}:{index}")
        tenant = self._pick_tenant(rng)
        name = tenant.name if tenant else None
        key = tenant.api_key if tenant and tenant.api_key else self.config.api_key
        if self._conversations:
            c = self._conversations[index % len(self._conversations)]
            output_len = self.config.output_len.sample(rng) if self.config.output_len else c.output_len
            return RequestSpec(index, c.prompt, None, c.prompt_len, output_len, name, key, None)
        long = rng.random() < self.config.long_share
        input_len = (self.config.long_input_len if long else self.config.input_len).sample(rng)
        output_spec = self.config.long_output_len if long else (self.config.output_len or DEFAULT_OUTPUT_LEN)
        output_len = output_spec.sample(rng)
        group = rng.randrange(self.config.prefix_groups) if self.config.prefix_groups else None
        text, ids = self._random_prompt(rng, input_len)
        if group is not None and self._prefixes:
            prefix_text, prefix_ids = self._prefixes[group]
            text = prefix_text + text
            ids = prefix_ids + ids if prefix_ids is not None and ids is not None else None
        if ids is not None:
            return RequestSpec(index, text, ids, len(ids), output_len, name, key, group)
        return RequestSpec(index, text, None, self._count(text), output_len, name, key, group)

    def _pick_tenant(self, rng: random.Random) -> Tenant | None:
        if not self.config.tenants:
            return None
        u = rng.random()
        for tenant, bound in zip(self.config.tenants, self._tenant_bounds, strict=True):
            if u < bound:
                return tenant
        return self.config.tenants[-1]

    def _count(self, text: str) -> int:
        if self._tokenizer is None:
            return len(text.split())
        return len(self._tokenizer.encode(text, add_special_tokens=False))

    def _random_prompt(self, rng: random.Random, num_tokens: int) -> tuple[str, tuple[int, ...] | None]:
        """``num_tokens`` random tokens: exact ids (and their text) when they can be sent as ids; text
        fitted to the length by re-encoding when only text can; else words."""
        if self._tokenizer is None:
            return "".join(" " + rng.choice(_WORDS) for _ in range(num_tokens)), None
        ids = [rng.choice(self._vocab) for _ in range(num_tokens)]
        if self._ids_ok:
            return self._tokenizer.decode(ids), tuple(ids)
        return fit_text(self._tokenizer, ids, num_tokens, rng, self._vocab), None


def fit_text(
    tokenizer: Tokenizer,
    ids: Sequence[int],
    num_tokens: int,
    rng: random.Random,
    vocab: Sequence[int],
    max_rounds: int = 8,
) -> str:
    """Text that re-encodes to ``num_tokens`` tokens (vLLM's random-dataset approach): decode, re-encode,
    truncate or pad with random ids, repeat. Usually exact; else within a few tokens."""
    text = tokenizer.decode(list(ids))
    for _ in range(max_rounds):
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == num_tokens:
            break
        if len(encoded) > num_tokens:
            encoded = encoded[:num_tokens]
        else:
            encoded += [rng.choice(vocab) for _ in range(num_tokens - len(encoded))]
        text = tokenizer.decode(encoded)
    return text
