"""The OpenAI wire format, without I/O: request bodies of /v1/completions and /v1/chat/completions
parsed and validated into `GenerationRequest`s, and responses, stream chunks and errors shaped exactly
like OpenAI's (plus vLLM's sampling extras: top_k, min_p, min_tokens, repetition_penalty, ignore_eos,
stop_token_ids, skip_special_tokens).

One call may ask for several choices: ``n`` (and ``best_of``) choices per prompt, and on
/v1/completions a list of prompts; `services.gateway.choices` runs them. A field this server does not
know is ignored, as vLLM does, so that clients written for other servers keep working: the call names
it (`OpenAICall.ignored`, logged and sent back in the ``X-Baton-Ignored-Fields`` header); a known field
whose value cannot be honoured is a 400."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from core.errors import InvalidRequest
from core.sampling_params import SamplingParams
from services.gateway.admission import GenerationRequest
from services.gateway.structured import parse_structured
from services.gateway.tools import Tools, parse_tool_message_fields, parse_tools

log = logging.getLogger(__name__)

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
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "store": (None, False),
}
# Known, and without effect on what is generated.
_NO_EFFECT = ("user", "metadata", "service_tier", "guided_decoding_backend", "guided_whitespace_pattern")
# Structured outputs, as OpenAI and as vLLM (older and newer) spell them; at most one per request.
_STRUCTURED = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)
_COMMON = {
    "model",
    "max_tokens",
    "n",
    "stream",
    "stream_options",
    *_STRUCTURED,
    *_SAMPLING_FIELDS,
    *_ONLY_DEFAULT,
    *_NO_EFFECT,
    "prompt_logprobs",
}
COMPLETION_FIELDS = frozenset({*_COMMON, "prompt", "logprobs", "echo", "best_of"})
CHAT_FIELDS = frozenset(
    {
        *_COMMON,
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
MAX_N = 64  # choices per prompt (n, best_of)
MAX_PROMPTS = 64  # prompts in one /v1/completions call
MAX_CHOICES = 128  # choices of one call in all: prompts × best_of


@dataclass(frozen=True, slots=True)
class OpenAICall:
    """A parsed OpenAI request: what to generate — one `GenerationRequest` per prompt, each run as
    ``best_of`` choices of which the ``n`` best are answered — and how to answer."""

    chat: bool
    requests: tuple[GenerationRequest, ...]
    n: int = 1
    best_of: int = 1  # choices generated per prompt; the n with the highest log-probability are returned
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far in every chunk (vLLM's continuous_usage_stats)
    logprobs: int | None = None  # top alternatives per token to return; None = no logprobs
    echo: bool = False  # the prompt's text before each choice's (completions)
    ignored: tuple[str, ...] = ()  # fields in the body this server does not know, ignored
    tools: Tools | None = None  # chat: the tools the model may call, and how
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs, answered per choice

    @property
    def request(self) -> GenerationRequest:
        """The first prompt's request (the only one of a chat call)."""
        return self.requests[0]

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n


def parse_completion(body: Any, request_id: str | None = None) -> OpenAICall:
    """A /v1/completions body; InvalidRequest naming the field that is wrong."""
    fields, ignored = _check_object(body, COMPLETION_FIELDS)
    prompts = _parse_prompts(fields.get("prompt"))
    n, best_of = _choices(fields, len(prompts))
    echo = fields.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidRequest(f"echo must be a boolean, got {echo!r}")
    logprobs = fields.get("logprobs")
    asked = logprobs
    if best_of > n and logprobs is None:
        logprobs = 0  # the choices are ranked by their tokens' log-probabilities
    prompt_logprobs = fields.get("prompt_logprobs")
    if echo and asked is not None and prompt_logprobs is None:
        prompt_logprobs = asked  # the echoed prompt's tokens come with their logprobs
    params = _sampling(fields, fields.get("max_tokens"), logprobs, prompt_logprobs)
    requests = tuple(
        GenerationRequest(
            params=params,
            prompt=text,
            prompt_token_ids=ids,
            request_id=request_id,
            model=_model(fields),
            api="http",
        )
        for text, ids in prompts
    )
    stream, include_usage, continuous = _stream_flags(fields, ignored)
    if stream and best_of > n:
        raise InvalidRequest("best_of greater than n cannot be streamed: the best are known at the end")
    return OpenAICall(
        False,
        requests,
        n,
        best_of,
        stream,
        include_usage,
        continuous,
        asked,
        bool(echo),
        tuple(ignored),
        prompt_logprobs=fields.get("prompt_logprobs"),
    )


def parse_chat(body: Any, request_id: str | None = None) -> OpenAICall:
    """A /v1/chat/completions body; without a max_tokens the answer may fill the context."""
    fields, ignored = _check_object(body, CHAT_FIELDS)
    messages = _parse_messages(fields.get("messages"), ignored)
    tools = parse_tools(fields)
    n, _ = _choices(fields, 1)
    max_tokens = fields.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = fields.get("max_tokens")
    logprobs, top = fields.get("logprobs"), fields.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequest(f"logprobs must be a boolean, got {logprobs!r}")
    if top is not None and not logprobs:
        raise InvalidRequest("top_logprobs requires logprobs: true")
    num_logprobs = (0 if top is None else top) if logprobs else None
    params = _sampling(fields, max_tokens, num_logprobs, fields.get("prompt_logprobs"))
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if params.structured is not None:
            raise InvalidRequest(
                "tool_choice required or named cannot be combined with another output constraint"
            )
        params = replace(params, structured=forced)
    request = GenerationRequest(
        params=params,
        messages=messages,
        request_id=request_id,
        model=_model(fields),
        max_tokens_to_context=max_tokens is None,
        api="http",
        tools=tools,
    )
    stream, include_usage, continuous = _stream_flags(fields, ignored)
    return OpenAICall(
        True,
        (request,),
        n,
        n,
        stream,
        include_usage,
        continuous,
        params.logprobs,
        False,
        tuple(ignored),
        tools,
        fields.get("prompt_logprobs"),
    )


def _check_object(body: Any, known: frozenset[str]) -> tuple[dict[str, Any], list[str]]:
    """The body's fields, and the names of those this server does not know (ignored)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    for name, allowed in _ONLY_DEFAULT.items():
        if name in body and not any(body[name] == a and type(body[name]) is type(a) for a in allowed):
            raise InvalidRequest(f"{name} is not supported (only {allowed[-1]!r}), got {body[name]!r}")
    return body, sorted(set(body) - known)


def _choices(fields: Mapping[str, Any], num_prompts: int) -> tuple[int, int]:
    """(n, best_of) within the caps."""
    n = _count(fields, "n", 1)
    best_of = _count(fields, "best_of", n)
    if best_of < n:
        raise InvalidRequest(f"best_of must be >= n, got best_of={best_of} and n={n}")
    if num_prompts * best_of > MAX_CHOICES:
        raise InvalidRequest(
            f"n: {num_prompts} prompt(s) × {best_of} choices is {num_prompts * best_of}, "
            f"over the limit of {MAX_CHOICES} choices per request"
        )
    return n, best_of


def _count(fields: Mapping[str, Any], name: str, default: int) -> int:
    value = fields.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_N:
        raise InvalidRequest(f"{name} must be an integer in [1, {MAX_N}], got {value!r}")
    return value


def _model(fields: Mapping[str, Any]) -> str:
    model = fields.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise InvalidRequest(f"model must be a string, got {model!r}")
    return model


def _stream_flags(fields: Mapping[str, Any], ignored: list[str]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream, options = fields.get("stream"), fields.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest(f"stream must be a boolean, got {stream!r}")
    flags = {"include_usage": False, "continuous_usage_stats": False}
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequest(f"stream_options must be an object, got {options!r}")
        if not stream:
            raise InvalidRequest("stream_options is only allowed with stream: true")
        ignored.extend(f"stream_options.{k}" for k in sorted(set(options) - set(flags)))
        for name in flags:
            value = options.get(name)
            if value is not None and not isinstance(value, bool):
                raise InvalidRequest(f"stream_options.{name} must be a boolean, got {value!r}")
            flags[name] = bool(value)
    return bool(stream), flags["include_usage"], flags["continuous_usage_stats"]


def _sampling(
    fields: Mapping[str, Any], max_tokens: Any, logprobs: Any, prompt_logprobs: Any = None
) -> SamplingParams:
    values: dict[str, Any] = {name: fields[name] for name in _SAMPLING_FIELDS if fields.get(name) is not None}
    structured = parse_structured(fields)
    if structured is not None:
        values["structured"] = structured
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    elif isinstance(values.get("min_tokens"), int):
        values["max_tokens"] = max(16, values["min_tokens"])  # the default, raised to fit min_tokens
    if logprobs is not None:
        values["logprobs"] = logprobs
    if prompt_logprobs is not None:
        values["prompt_logprobs"] = prompt_logprobs
    return SamplingParams(**values)


def _parse_prompts(prompt: Any) -> list[tuple[str | None, tuple[int, ...] | None]]:
    """A prompt, or a batch of them: a string, token ids, or a list of either."""
    if prompt is None:
        raise InvalidRequest("prompt is required")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequest(f"prompt: at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
        return [_parse_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_parse_prompt(prompt, "prompt")]


def _parse_prompt(prompt: Any, name: str) -> tuple[str | None, tuple[int, ...] | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest(f"{name} must not be empty")
        return prompt, None
    if isinstance(prompt, list) and not prompt:
        raise InvalidRequest(f"{name} must not be empty")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, tuple(prompt)
    raise InvalidRequest(f"{name} must be a string or a list of token ids")


def _parse_messages(messages: Any, ignored: list[str]) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content")
        ignored.extend(f"messages[{i}].{k}" for k in sorted(set(m) - MESSAGE_FIELDS))
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string")
        turn: dict[str, Any] = {"role": role}
        parse_tool_message_fields(i, m, turn)
        # An assistant turn that only called tools has no content.
        only_calls = content is None and turn.get("tool_calls") is not None
        turn["content"] = None if only_calls else _text_content(i, content)
        if isinstance(m.get("name"), str):
            turn["name"] = m["name"]
        parsed.append(turn)
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
