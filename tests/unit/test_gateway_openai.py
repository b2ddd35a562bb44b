"""services.gateway.openai_api: OpenAI request bodies → GenerationRequest, and the response / chunk / error shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from core.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from services.gateway.openai_api import parse_chat, parse_completion
from services.gateway.openai_responses import (
    ChoiceOutput,
    chunk_json,
    error_json,
    response_json,
    usage_chunk_json,
)
from services.gateway.request_stream import Delta, Finished, Timings, TokenLogprob, Usage

pytestmark = pytest.mark.unit


def test_completion_fields_become_sampling_params() -> None:
    call = parse_completion(
        {
            "model": "m",
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "stop": "\n",
            "seed": 3,
            "presence_penalty": 0.1,
            "frequency_penalty": -0.1,
            "top_k": 5,
            "min_p": 0.1,
            "min_tokens": 2,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "logprobs": 2,
            "user": "u",
            "logit_bias": {},
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        "rid-1",
    )
    p = call.request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.top_k, p.min_tokens) == (
        7,
        0,
        0.5,
        ("\n",),
        3,
        5,
        2,
    )
    assert p.ignore_eos and p.logprobs == 2 and call.logprobs == 2
    assert call.request.prompt == "hi" and call.request.request_id == "rid-1" and call.request.model == "m"
    assert call.stream and call.include_usage and not call.chat
    assert not call.request.max_tokens_to_context


@pytest.mark.parametrize(
    "prompt, text, ids",
    [("abc", "abc", None), (["abc"], "abc", None), ([1, 2, 3], None, (1, 2, 3)), ([[4, 5]], None, (4, 5))],
)
def test_completion_prompt_forms(prompt: object, text: str | None, ids: tuple[int, ...] | None) -> None:
    call = parse_completion({"prompt": prompt})
    assert call.request.prompt == text and call.request.prompt_token_ids == ids
    assert call.request.params.max_tokens == 16  # OpenAI's default for completions


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"prompt": "a", "n": 0}, "n must be an integer in [1, 64]"),
        ({"prompt": "a", "n": 65}, "n must be an integer in [1, 64]"),
        ({"prompt": "a", "n": True}, "n must be an integer"),
        ({"prompt": "a", "n": 3, "best_of": 2}, "best_of must be >= n"),
        ({"prompt": ["a"] * 3, "n": 50}, "over the limit of 128 choices"),
        ({"prompt": ["a"] * 65}, "at most 64 prompts"),
        ({"prompt": ["a", ""]}, "prompt[1] must not be empty"),
        ({"prompt": ["a", [1, "b"]]}, "prompt[1] must be a string or a list of token ids"),
        ({"prompt": "a", "best_of": 2, "stream": True}, "best_of greater than n cannot be streamed"),
        ({"prompt": "a", "echo": 1}, "echo must be a boolean"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20]"),
        ({"prompt": "a", "stream": True, "stream_options": []}, "stream_options must be an object"),
        (
            {"prompt": "a", "stream": True, "stream_options": {"continuous_usage_stats": "y"}},
            "stream_options.continuous_usage_stats must be a boolean",
        ),
        ({"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias is not supported"),
        ({"prompt": ""}, "prompt must not be empty"),
        ({"prompt": []}, "prompt must not be empty"),
        ({}, "prompt is required"),
        ({"prompt": 5}, "prompt must be a string or a list of token ids"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens must be >= 1"),
        ({"prompt": "a", "max_tokens": "9"}, "max_tokens must be an integer"),
        ({"prompt": "a", "temperature": 500}, "temperature must be in"),
        ({"prompt": "a", "temperature": "hot"}, "temperature must be a number"),
        ({"prompt": "a", "stop": 5}, "stop must be a list of str"),
        ({"prompt": "a", "stop": [1]}, "stop must contain only str"),
        ({"prompt": "a", "stream": "yes"}, "stream must be a boolean"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "only allowed with stream: true"),
        ({"prompt": "a", "model": 3}, "model must be a string"),
        ({"prompt": "a", "logprobs": 99}, "logprobs must be in"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_completion_rejects(body: object, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=None) as info:
        parse_completion(body)
    assert needle in info.value.message


def test_chat_messages_max_tokens_and_logprobs() -> None:
    call = parse_chat(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 9,
            "max_tokens": 100,
            "logprobs": True,
            "top_logprobs": 3,
        }
    )
    assert call.chat and call.request.messages == (
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    )
    assert call.request.params.max_tokens == 9 and call.logprobs == 3
    unbounded = parse_chat({"messages": [{"role": "user", "content": "x"}], "min_tokens": 40})
    assert unbounded.request.max_tokens_to_context and unbounded.logprobs is None
    assert unbounded.request.params.max_tokens >= 40


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": "hi"}, "messages must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, "messages[0].content must be a string"),
        ({"messages": [{"role": "", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 99}, "n must be an integer in [1, 64]"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "requires logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs must be a boolean"),
    ],
)
def test_chat_rejects(body: object, needle: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_chat(body)
    assert needle in info.value.message


FINISHED = Finished("length", Usage(4, 3, 2), Timings())


def _text(token_id: int) -> str:
    return f"<{token_id}>"


def test_response_shapes() -> None:
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 1})
    delta = Delta([5, 6], "ab", [TokenLogprob(5, -0.5, {5: -0.5}), TokenLogprob(6, -1.0, {6: -1.0})])
    body = response_json(chat, "r", "m", 1, [ChoiceOutput(0, delta, FINISHED)], FINISHED.usage, _text)
    assert body["object"] == "chat.completion" and body["id"] == "r"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "ab"} and choice["finish_reason"] == "length"
    assert choice["logprobs"]["content"][0] == {
        "token": "<5>",
        "logprob": -0.5,
        "bytes": list(b"<5>"),
        "top_logprobs": [{"token": "<5>", "logprob": -0.5, "bytes": list(b"<5>")}],
    }
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    completion = parse_completion({"prompt": "x", "logprobs": 1})
    legacy = response_json(
        completion, "r", "m", 1, [ChoiceOutput(0, delta, FINISHED)], FINISHED.usage, _text
    )["choices"][0]
    assert legacy["text"] == "ab" and legacy["logprobs"]["tokens"] == ["<5>", "<6>"]
    assert legacy["logprobs"]["text_offset"] == [0, 3]


def test_response_lists_choices_in_index_order_with_echo() -> None:
    call = parse_completion({"prompt": ["p0", "p1"], "n": 2, "echo": True})
    outs = [ChoiceOutput(i, Delta([i], f"t{i}"), FINISHED, f"p{i // 2}") for i in (3, 0, 2, 1)]
    body = response_json(call, "r", "m", 1, outs, Usage(8, 4), _text)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "p0t0"),
        (1, "p0t1"),
        (2, "p1t2"),
        (3, "p1t3"),
    ]
    assert body["usage"]["total_tokens"] == 12


def test_chunks_carry_usage_when_given() -> None:
    plain = parse_chat({"messages": [{"role": "user", "content": "x"}], "stream": True})
    opener = chunk_json(plain, "r", "m", 1, 0, None, None, _text, role=True)
    assert opener["choices"][0]["delta"] == {"role": "assistant", "content": ""} and "usage" not in opener
    last = chunk_json(plain, "r", "m", 1, 2, None, FINISHED, _text, usage=FINISHED.usage)
    assert last["choices"][0]["delta"] == {} and last["usage"]["total_tokens"] == 7
    assert last["choices"][0]["index"] == 2
    asked = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert chunk_json(asked, "r", "m", 1, 0, Delta([1], "a"), None, _text)["usage"] is None
    tail = usage_chunk_json(asked, "r", "m", 1, FINISHED.usage)
    assert tail["choices"] == [] and tail["usage"]["completion_tokens"] == 3
    cancelled = Finished("cancelled", Usage(1, 1), Timings())
    assert chunk_json(asked, "r", "m", 1, 0, None, cancelled, _text)["choices"][0]["finish_reason"] == "abort"
    echo = parse_completion({"prompt": "x", "echo": True, "stream": True})
    assert chunk_json(echo, "r", "m", 1, 1, None, None, _text, text="x")["choices"][0]["text"] == "x"


def test_choices_batches_and_stream_options() -> None:
    call = parse_completion(
        {"prompt": ["a", [1, 2]], "n": 2, "best_of": 3, "seed": 7, "stream_options": None}
    )
    assert [(r.prompt, r.prompt_token_ids) for r in call.requests] == [("a", None), (None, (1, 2))]
    assert (call.n, call.best_of, call.num_choices) == (2, 3, 4)
    assert call.requests[0].params.logprobs == 0 and call.logprobs is None  # ranked by logprobs, not shown
    guidellm = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    )
    assert guidellm.include_usage and guidellm.continuous_usage and guidellm.ignored == ()


def test_fields_this_server_does_not_know_are_ignored_and_named() -> None:
    """vLLM's rule: a client written for another server keeps working; the call names what was ignored."""
    call = parse_chat(
        {
            "messages": [{"role": "user", "content": "x", "weight": 2}],
            "frobnicate": True,
            "stream": True,
            "stream_options": {"include_usage": True, "chunk_size": 4},
            "stop": None,
        }
    )
    assert call.ignored == ("frobnicate", "messages[0].weight", "stream_options.chunk_size")
    assert call.request.messages == ({"role": "user", "content": "x"},)
    assert parse_completion({"prompt": "a", "bogus": 1, "zzz": 2}).ignored == ("bogus", "zzz")


def test_error_json() -> None:
    body = error_json(InvalidRequest("max_tokens must be >= 1, got -1"))["error"]
    assert body == {
        "message": "max_tokens must be >= 1, got -1",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": None,
    }
    assert (
        error_json(ContextLengthExceeded("the prompt (5 tokens) ..."))["error"]["code"]
        == "context_length_exceeded"
    )
    missing = error_json(ModelNotFound("model 'x' is not served here"))["error"]
    assert (
        missing["type"] == "model_not_found"
        and missing["code"] == "model_not_found"
        and missing["param"] == "model"
    )
    assert error_json(InvalidRequest("unknown field(s): foo"))["error"]["param"] is None


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields, kind, spec",
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            "json",
            SCHEMA,
        ),
        ({"guided_json": SCHEMA}, "json", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json", SCHEMA),
        ({"guided_regex": "[a-z]+"}, "regex", "[a-z]+"),
        ({"guided_choice": ["yes", "no"]}, "choice", ["yes", "no"]),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA),
        ({"structured_outputs": {"choice": ["x"]}}, "choice", ["x"]),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
    ],
)
def test_structured_output_spellings(fields: dict[str, Any], kind: str | None, spec: Any) -> None:
    """OpenAI's response_format and vLLM's guided_* and structured_outputs all become one constraint."""
    call = parse_chat({"messages": [{"role": "user", "content": "x"}], **fields})
    got = call.request.params.structured
    if kind is None:
        assert got is None
        return
    assert got is not None and got.kind == kind
    assert (json.loads(got.spec) if kind in ("json", "choice") else got.spec) == spec


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"response_format": {"type": "yaml"}}, "response_format must be"),
        ({"response_format": {"type": "json_schema", "json_schema": []}}, "json_schema must be an object"),
        ({"guided_json": "{nope"}, "guided_json is not valid JSON"),
        ({"guided_json": [1]}, "guided_json must be a JSON schema object"),
        ({"guided_choice": []}, "guided_choice must be a non-empty list"),
        ({"guided_choice": ["a", 3]}, "guided_choice must be a non-empty list"),
        ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "only one output constraint per request"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "only one output constraint"),
        ({"structured_outputs": "json"}, "structured_outputs must be an object"),
        ({"guided_regex": "a" * 70000}, "over the limit of 65536 bytes"),
        ({"guided_json": json.dumps(_nested(40))}, "guided_json is nested deeper than 64 levels"),
    ],
)
def test_bad_structured_outputs(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_completion({"prompt": "x", **fields})
    assert needle in info.value.message


def test_echo_with_logprobs_asks_for_the_prompts_logprobs() -> None:
    echo = parse_completion({"prompt": "a", "echo": True, "logprobs": 2})
    assert echo.request.params.prompt_logprobs == 2 and echo.echo and echo.logprobs == 2
    assert echo.prompt_logprobs is None  # not vLLM's field: the echoed logprobs only
    vllm = parse_chat({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0})
    assert vllm.request.params.prompt_logprobs == 0 and vllm.prompt_logprobs == 0
    call = parse_completion({"prompt": "ab", "echo": True, "logprobs": 1})
    delta = Delta([7], "c", [TokenLogprob(7, -0.7, {7: -0.7})], [TokenLogprob(6, -0.6, {5: -0.1})])
    body = response_json(
        call, "r", "m", 1, [ChoiceOutput(0, delta, FINISHED, "ab", (5, 6))], FINISHED.usage, _text
    )
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"] == "abc"
    assert lp["tokens"] == ["<5>", "<6>", "<7>"] and lp["token_logprobs"] == [None, -0.6, -0.7]
    assert lp["top_logprobs"] == [None, {"<5>": -0.1}, {"<7>": -0.7}] and lp["text_offset"] == [0, 3, 6]
