"""Admission of one client request, before it touches a worker: its id, its fields against the served
model and the gateway's limits, and its tokenization (chat template included) in a thread pool.

`GenerationRequest` is what every frontend (gRPC Session and Generate, HTTP) parses a request into;
`RequestValidator.prepare` turns it into prompt token ids and the `SamplingParams` the workers run,
or raises the `ServingError` the client sees.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError, ModelNotFound
from core.sampling_params import MAX_SEED, SamplingParams
from engine.tokenizer import Tokenizer
from services.gateway.tools import Tools, prompt_messages

_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # printable ASCII, no spaces: it travels in logs and headers


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model version, as read from the workers at start-up."""

    name: str
    version: str  # the workers' model digest
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits that protect the gateway's and the workers' memory and queues."""

    max_prompt_tokens: int | None  # None: the model's context
    max_output_tokens: int
    max_buffered_tokens: int  # tokens a slow client may leave unread before its request fails
    max_migrations: int = 2  # decodes moved to another worker mid-stream before the request fails


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One client request as a frontend parsed it; exactly one of prompt, prompt_token_ids, messages."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    request_id: str | None = None  # the client's idempotency key; None = a new UUID
    model: str = ""  # empty = the served model
    max_tokens_to_context: bool = False  # max_tokens was not given: fill the context (chat)
    timeout_s: float | None = None  # the client's deadline, from now
    api: str = "grpc"  # for metrics: grpc | http
    api_key: str = ""  # the client's API key ("" = the scheduler's default tenant)
    tools: Tools | None = None  # chat: the tools to put in the prompt (services.gateway.tools)
    siblings: tuple[str, ...] = ()  # the call's other choices: charged with this request, before any runs
    precharged: bool = False  # a call's other choice: its quota was charged with the first one's


def request_id_problem(request_id: str) -> str | None:
    """Why a client's request id cannot be used, or None."""
    if _REQUEST_ID.fullmatch(request_id):
        return None
    return "request_id must be 1 to 128 printable ASCII characters without spaces"


def check_unicode(field: str, text: str) -> None:
    """InvalidRequest when ``text`` is not valid Unicode: a JSON body may escape an unpaired surrogate
    (``"\\ud800"``), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequest(
            f"{field} is not valid Unicode: an unpaired surrogate U+{ord(text[e.start]):04X} at character {e.start}"
        ) from None


class RequestValidator:
    """Checks a request against the served model and the limits, and tokenizes it off the event loop."""

    def __init__(self, tokenizer: Tokenizer, model: ModelInfo, limits: Limits, executor: Executor) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits
        self._executor = executor

    async def prepare(self, request: GenerationRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params to run, seeded; raises the error the client sees."""
        if request.model and request.model != self.model.name:
            raise ModelNotFound(
                f"model {request.model!r} is not served here; the model is {self.model.name!r}"
            )
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(self._executor, self.tokenize, request)
        return prompt_ids, self.check_limits(len(prompt_ids), request)

    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt as token ids (a thread-pool thread: templates and long prompts take a while)."""
        if request.messages is not None:
            _check_messages(request.messages)
            messages, tools = prompt_messages(request.messages, request.tools, self.tokenizer.knows_tools)
            try:
                ids = self.tokenizer.encode_chat(messages, tools=tools)
            except ModelLoadError as e:
                raise InvalidRequest(e.message) from None
        elif request.prompt is not None:
            check_unicode("prompt", request.prompt)
            ids = self.tokenizer.encode(request.prompt) if request.prompt else []
        elif request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt token ids must be in [0, {self.model.vocab_size}); got {bad[0]}"
                )
        else:
            raise InvalidRequest("the request needs a prompt, prompt token ids or messages")
        if not ids:
            raise InvalidRequest("the prompt must not be empty")
        return ids

    def check_limits(self, num_prompt: int, request: GenerationRequest) -> SamplingParams:
        """The request's params within the limits and the context, with max_tokens and seed filled in."""
        params, limits, context = request.params, self.limits, self.model.max_model_len
        max_prompt = min(limits.max_prompt_tokens or context, context)
        if num_prompt > max_prompt:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt} tokens, over the limit of {max_prompt} prompt tokens"
            )
        if request.max_tokens_to_context:
            room = max(1, min(limits.max_output_tokens, context - num_prompt))
            params = replace(params, max_tokens=max(room, params.min_tokens))
        if params.max_tokens > limits.max_output_tokens:
            raise InvalidRequest(
                f"max_tokens is {params.max_tokens}, over the limit of {limits.max_output_tokens} output tokens"
            )
        if num_prompt + params.max_tokens > context:
            raise ContextLengthExceeded(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{num_prompt + params.max_tokens} tokens, over the model's context of {context} tokens"
            )
        params.validate_for_vocab(self.model.vocab_size)
        if params.seed is None:
            # Seeded here, not on the worker: a decode retried after a failed KV transfer, moved to
            # another worker mid-stream, or mirrored to a shadow version, then samples exactly the
            # random stream the client is reading.
            params = replace(params, seed=secrets.randbelow(MAX_SEED))
        return params


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if not messages:
        raise InvalidRequest("messages must not be empty")
    for i, m in enumerate(messages):
        for key in ("role", "content"):
            value = m.get(key)
            if isinstance(value, str):
                check_unicode(f"messages[{i}].{key}", value)
        if not m.get("role"):
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string")


# --- the tokenizer -------------------------------------------------------------------------------


async def load_tokenizer(model: str | None, executor: Executor) -> tuple[Path, Tokenizer]:
    """The model directory and its tokenizer, loaded in the thread pool (a GGUF is converted once)."""
    loop = asyncio.get_running_loop()
    model_dir = await loop.run_in_executor(executor, resolve_tokenizer_dir, model)
    return model_dir, await loop.run_in_executor(executor, Tokenizer.from_dir, model_dir)


def resolve_tokenizer_dir(model: str | None) -> Path:
    """The model directory whose tokenizer the gateway uses, resolved without torch (as
    `engine.loader.resolve_model_dir` does, which imports torch)."""
    from engine import gguf_convert

    if model is None:
        return gguf_convert.prepare_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_convert.prepare_gguf_model(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a model directory or a .gguf file")
    return path


def vocab_size(model_dir: Path, tokenizer: Tokenizer) -> int:
    """The model's vocabulary size (its config's, which may pad the tokenizer's)."""
    config = model_dir / "config.json"
    try:
        return int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return tokenizer.vocab_size
