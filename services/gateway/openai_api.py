"""The OpenAI wire format, without I/O: request bodies of /v1/completions and /v1/chat/completions
parsed and validated into `GenerationRequest`s, and responses, stream chunks and errors shaped exactly
like OpenAI's (plus vLLM's sampling extras: top_k, min_p, min_tokens, repetition_penalty, ignore_eos,
stop_token_ids, skip_special_tokens)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound, ServingError
from core.outputs import FinishReason
from core.sampling_params import SamplingParams
from services.gateway.admission import GenerationRequest
from services.gateway.request_stream import Delta, Finished, TokenLogprob, Usage

# Sampling fields passed to SamplingParams as they are (it checks their types and ranges).
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "ignore_eos",
    "skip_special_tokens",
    "stop",
    "stop_token_ids",
)
# Fields we accept only at their "off" value: anything else would silently change the meaning.
_ONLY_DEFAULT: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "store": (None, False),
}
_IGNORED = ("user", "metadata", "parallel_tool_calls", "service_tier")
_COMMON = {"model", "max_tokens", "stream", "stream_options", *_SAMPLING_FIELDS, *_ONLY_DEFAULT, *_IGNORED}
COMPLETION_FIELDS = frozenset({*_COMMON, "prompt", "logprobs"})
CHAT_FIELDS = frozenset({*_COMMON, "messages", "max_completion_tokens", "logprobs", "top_logprobs"})
# The OpenAI API's spelling of a finish reason; a cancelled request is vLLM's "abort".
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


@dataclass(frozen=True, slots=True)
class OpenAICall:
    """A parsed OpenAI request: what to generate and how to answer."""

    chat: bool
    request: GenerationRequest
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top alternatives per token to return; None = no logprobs


def parse_completion(body: Any, request_id: str | None = None) -> OpenAICall:
    """A /v1/completions body; InvalidRequest naming the field that is wrong."""
    fields = _check_object(body, COMPLETION_FIELDS)
    prompt, prompt_ids = _parse_prompt(fields.get("prompt"))
    params = _sampling(fields, fields.get("max_tokens"), fields.get("logprobs"))
    request = GenerationRequest(
        params=params,
        prompt=prompt,
        prompt_token_ids=prompt_ids,
        request_id=request_id,
        model=_model(fields),
        api="http",
    )
    stream, include_usage = _stream_flags(fields)
    return OpenAICall(False, request, stream, include_usage, params.logprobs)


def parse_chat(body: Any, request_id: str | None = None) -> OpenAICall:
    """A /v1/chat/completions body; without a max_tokens the answer may fill the context."""
    fields = _check_object(body, CHAT_FIELDS)
    messages = _parse_messages(fields.get("messages"))
    max_tokens = fields.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = fields.get("max_tokens")
    logprobs, top = fields.get("logprobs"), fields.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest(f"logprobs must be a boolean, got {logprobs!r}")
    if top is not None and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true")
    num_logprobs = (0 if top is None else top) if logprobs else None
    params = _sampling(fields, max_tokens, num_logprobs)
    request = GenerationRequest(
        params=params,
        messages=messages,
        request_id=request_id,
        model=_model(fields),
        max_tokens_to_context=max_tokens is None,
        api="http",
    )
    stream, include_usage = _stream_flags(fields)
    return OpenAICall(True, request, stream, include_usage, params.logprobs)


def _check_object(body: Any, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        raise InvalidRequest(f"unknown field(s): {', '.join(unknown)}")
    for name, allowed in _ONLY_DEFAULT.items():
        if name in body and not any(body[name] == a and type(body[name]) is type(a) for a in allowed):
            raise InvalidRequest(f"{name} is not supported (only {allowed[-1]!r}), got {body[name]!r}")
    return body


def _model(fields: Mapping[str, Any]) -> str:
    model = fields.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise InvalidRequest(f"model must be a string, got {model!r}")
    return model


def _stream_flags(fields: Mapping[str, Any]) -> tuple[bool, bool]:
    stream, options = fields.get("stream"), fields.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be a boolean, got {stream!r}")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise InvalidRequest("stream_options must be an object with only include_usage")
        if not stream:
            raise InvalidRequest("stream_options is only allowed with stream: true")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise InvalidRequest(f"stream_options.include_usage must be a boolean, got {include_usage!r}")
    return bool(stream), include_usage


def _sampling(fields: Mapping[str, Any], max_tokens: Any, logprobs: Any) -> SamplingParams:
    values = {name: fields[name] for name in _SAMPLING_FIELDS if fields.get(name) is not None}
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    elif isinstance(values.get("min_tokens"), int):
        values["max_tokens"] = max(16, values["min_tokens"])  # the default, raised to fit min_tokens
    if logprobs is not None:
        values["logprobs"] = logprobs
    return SamplingParams(**values)


def _parse_prompt(prompt: Any) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("prompt must not be empty")
        return prompt, None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return None, tuple(prompt)
    if prompt is None:
        raise InvalidRequest("prompt is required")
    if isinstance(prompt, list) and not prompt:
        raise InvalidRequest("prompt must not be empty")
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise InvalidRequest(f"prompt: one prompt per request is supported, got {len(prompt)}")
    raise InvalidRequest("prompt must be a string or a list of token ids")


def _parse_messages(messages: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise InvalidRequest(f"messages[{i}]: unknown field(s): {', '.join(unknown)}")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string")
        parsed.append({"role": role, "content": _text_content(i, content)})
    return tuple(parsed)


def _text_content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequest(f"messages[{i}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")


# --- responses -----------------------------------------------------------------------------------

TokenText = Callable[[int], str]


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(finished: Finished | None) -> str | None:
    return None if finished is None else _FINISH_REASONS[finished.finish_reason]


def logprobs_json(call: OpenAICall, logprobs: Sequence[TokenLogprob], token_text: TokenText) -> Any:
    """OpenAI's logprobs object for these tokens: the chat shape or the legacy completions shape."""
    if call.logprobs is None:
        return None
    if call.chat:
        return {
            "content": [
                {
                    **_chat_logprob(lp.token_id, lp.logprob, token_text),
                    "top_logprobs": [
                        _chat_logprob(t, v, token_text)
                        for t, v in sorted(lp.top.items(), key=lambda kv: -kv[1])
                    ],
                }
                for lp in logprobs
            ]
        }
    texts = [token_text(lp.token_id) for lp in logprobs]
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{token_text(t): v for t, v in lp.top.items()} for lp in logprobs],
        "text_offset": offsets,
    }


def _chat_logprob(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def response_json(
    call: OpenAICall,
    rid: str,
    model: str,
    created: int,
    delta: Delta,
    finished: Finished,
    token_text: TokenText,
) -> dict[str, Any]:
    """The non-streaming response body for the whole output ``delta``."""
    choice: dict[str, Any] = {"index": 0}
    if call.chat:
        choice["message"] = {"role": "assistant", "content": delta.text}
    else:
        choice["text"] = delta.text
    choice["logprobs"] = logprobs_json(call, delta.logprobs, token_text)
    choice["finish_reason"] = finish_reason(finished)
    return {
        "id": rid,
        "object": "chat.completion" if call.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_json(finished.usage),
    }


def chunk_json(
    call: OpenAICall,
    rid: str,
    model: str,
    created: int,
    delta: Delta | None,
    finished: Finished | None,
    token_text: TokenText,
    role: bool = False,
) -> dict[str, Any]:
    """One stream chunk: a delta, the role opener (chat) or the finish chunk (empty delta)."""
    choice: dict[str, Any] = {"index": 0}
    text = delta.text if delta is not None else ""
    if call.chat:
        choice["delta"] = (
            {"role": "assistant", "content": ""} if role else ({"content": text} if delta else {})
        )
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs_json(call, delta.logprobs, token_text) if delta is not None else None
    choice["finish_reason"] = finish_reason(finished)
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if call.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if call.include_usage:
        chunk["usage"] = None
    elif finished is not None:
        chunk["usage"] = usage_json(finished.usage)  # usage in the last chunk even if not asked for
    return chunk


def usage_chunk_json(call: OpenAICall, rid: str, model: str, created: int, usage: Usage) -> dict[str, Any]:
    """The extra last chunk of stream_options.include_usage: no choices, the usage."""
    return {
        "id": rid,
        "object": "chat.completion.chunk" if call.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_json(usage),
    }


# --- errors --------------------------------------------------------------------------------------

_PARAM = re.compile(r"^(?:unknown field\(s\): )?([a-z_]+)")
_KNOWN_PARAMS = COMPLETION_FIELDS | CHAT_FIELDS


def error_json(error: ServingError) -> dict[str, Any]:
    """OpenAI's error body: {"error": {message, type, param, code}}."""
    m = _PARAM.match(error.message)
    param = m.group(1) if m and m.group(1) in _KNOWN_PARAMS else None
    code = None
    if isinstance(error, ContextLengthExceeded):
        code = "context_length_exceeded"
    elif isinstance(error, ModelNotFound):
        code = "model_not_found"
    return {"error": {"message": error.message, "type": error.error_type, "param": param, "code": code}}
