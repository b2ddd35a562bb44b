"""The OpenAI wire format's answers, without I/O: whole responses, stream chunks, the usage chunk and
error bodies, shaped exactly like OpenAI's (a request's parsing is `services.gateway.openai_api`)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from core.errors import ContextLengthExceeded, ModelNotFound, ServingError
from core.outputs import FinishReason
from services.gateway.openai_api import CHAT_FIELDS, COMPLETION_FIELDS, OpenAICall
from services.gateway.request_stream import Delta, Finished, TokenLogprob, Usage
from services.gateway.tools import parse_output

TokenText = Callable[[int], str]
Echo = tuple[
    Sequence[int], Sequence[TokenLogprob]
]  # a prompt's token ids and their logprobs (after the first)
# The OpenAI API's spelling of a finish reason; a cancelled request is vLLM's "abort".
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}

# --- responses -----------------------------------------------------------------------------------


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def finish_reason(finished: Finished | None) -> str | None:
    return None if finished is None else _FINISH_REASONS[finished.finish_reason]


def tool_finish_reason(call: OpenAICall, reason: str | None) -> str | None:
    """The finish reason of an output that called tools: "tool_calls", as OpenAI says it — except for
    a named tool (OpenAI says "stop") or an output cut at max_tokens."""
    if reason == "stop" and call.tools is not None and call.tools.choice != "named":
        return "tool_calls"
    return reason


def logprobs_json(
    call: OpenAICall, logprobs: Sequence[TokenLogprob], token_text: TokenText, echo: Echo | None = None
) -> Any:
    """OpenAI's logprobs object for these tokens: the chat shape or the legacy completions shape —
    with ``echo``, the prompt's tokens first (the first one without a logprob)."""
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
    ids = [lp.token_id for lp in logprobs]
    values: list[float | None] = [lp.logprob for lp in logprobs]
    tops: list[dict[str, float] | None] = [{token_text(t): v for t, v in lp.top.items()} for lp in logprobs]
    if echo is not None:
        prompt_ids, prompt_lps = echo
        ids = [*prompt_ids, *ids]
        values = [None, *(lp.logprob for lp in prompt_lps), *values]
        tops = [None, *({token_text(t): v for t, v in lp.top.items()} for lp in prompt_lps), *tops]
    texts = [token_text(t) for t in ids]
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(echo: Echo, token_text: TokenText) -> list[Any]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, then {token id: {logprob,
    decoded_token}} for the token and its best alternatives."""
    prompt_ids, prompt_lps = echo
    out: list[Any] = [None]
    for token, lp in zip(prompt_ids[1:], prompt_lps, strict=False):
        entry = {str(t): {"logprob": v, "decoded_token": token_text(t)} for t, v in lp.top.items()}
        entry[str(token)] = {"logprob": lp.logprob, "decoded_token": token_text(token)}
        out.append(entry)
    return out


def _chat_logprob(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


@dataclass(slots=True)
class ChoiceOutput:
    """One choice's whole output, for the non-streaming answer."""

    index: int
    delta: Delta
    finished: Finished
    echo: str = ""  # the prompt's text, before the output (echo)
    prompt_ids: Sequence[int] = ()  # with echo and logprobs, or prompt_logprobs


def response_json(
    call: OpenAICall,
    rid: str,
    model: str,
    created: int,
    choices: Sequence[ChoiceOutput],
    usage: Usage,
    token_text: TokenText,
) -> dict[str, Any]:
    """The non-streaming response body: every choice in index order, the call's usage."""
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        choice: dict[str, Any] = {"index": c.index}
        reason = finish_reason(c.finished)
        if call.chat and call.tools is not None:
            content, calls = parse_output(call.tools, c.delta.text)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = [t.json() for t in calls]
                reason = tool_finish_reason(call, reason)
        elif call.chat:
            choice["message"] = {"role": "assistant", "content": c.delta.text}
        else:
            choice["text"] = c.echo + c.delta.text
        prompt: Echo = (c.prompt_ids, c.delta.prompt_logprobs or [])
        choice["logprobs"] = logprobs_json(call, c.delta.logprobs, token_text, prompt if call.echo else None)
        choice["finish_reason"] = reason
        if call.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(prompt, token_text)
        out.append(choice)
    return {
        "id": rid,
        "object": "chat.completion" if call.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": out,
        "usage": usage_json(usage),
    }


def chunk_json(
    call: OpenAICall,
    rid: str,
    model: str,
    created: int,
    index: int,
    delta: Delta | None,
    finished: Finished | None,
    token_text: TokenText,
    role: bool = False,
    usage: Usage | None = None,
    text: str | None = None,
    message: dict[str, Any] | None = None,
    reason: str | None = None,
    prompt: Echo | None = None,
) -> dict[str, Any]:
    """One stream chunk of choice ``index``: a delta, the role opener (chat) or the finish chunk (empty
    delta). ``usage`` is sent when given (continuous usage, or the last finish chunk); ``text``
    replaces the delta's text (an echoed prompt before it); ``message`` the chat delta (tool calls),
    ``reason`` the finish reason; ``prompt`` the prompt's ids and logprobs, on a choice's first chunk."""
    choice: dict[str, Any] = {"index": index}
    if text is None:
        text = delta.text if delta is not None else ""
    if call.chat:
        if message is None:
            message = {"role": "assistant", "content": ""} if role else ({"content": text} if delta else {})
        choice["delta"] = message
    else:
        choice["text"] = text
    echo = prompt if call.echo else None
    choice["logprobs"] = logprobs_json(call, delta.logprobs, token_text, echo) if delta is not None else None
    choice["finish_reason"] = reason or finish_reason(finished)
    if prompt is not None and call.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(prompt, token_text)
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if call.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if usage is not None:
        chunk["usage"] = usage_json(usage)
    elif call.include_usage:
        chunk["usage"] = None
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
