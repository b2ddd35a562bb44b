"""The OpenAI API as vLLM users call it, through the official `openai` client and raw HTTP, against a
real gateway over real worker processes on the disaggregated path (prefill worker → KV handoff →
decode worker, tiny model): several choices (``n``, ``best_of``), batched prompts, ``echo``,
``stream_options`` with continuous usage, fields this server does not know. Bad values of these fields
are in test_gateway.py's table of bad HTTP inputs."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from conftest import make_tiny_checkpoint
from harness import GatewayThread, Scrape, WorkerProcess, free_port, http_json, running_workers, sse_events

from services.gateway.server import GatewayConfig

pytestmark = pytest.mark.integration

PROMPT = "Parallel sampling shares one prompt between several choices"
# Long enough for several full KV blocks, so that the prefix cache has something to share.
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))
PROMPTS = ["The quick brown fox", "def add(a, b):", "Paris is the capital of"]


@pytest.fixture(scope="module")
def tiny_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 2,048-token context: tools in a prompt take a few hundred of the tiny
    tokenizer's tokens."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def workers(
    tiny_long: Path, tmp_path_factory: pytest.TempPathFactory, metrics_port: int
) -> Iterator[tuple[WorkerProcess, WorkerProcess]]:
    log_dir = tmp_path_factory.mktemp("openai-workers")
    with (
        running_workers(tiny_long, log_dir, "prefill", flags=("--metrics-port", str(metrics_port))) as (p,),
        running_workers(tiny_long, log_dir, "decode") as (d,),
    ):
        yield p, d


@pytest.fixture(scope="module")
def gateway(tiny_long: Path, workers: tuple[WorkerProcess, WorkerProcess]) -> Iterator[GatewayThread]:
    p, d = workers
    config = GatewayConfig(
        model=str(tiny_long),
        grpc_port=0,
        http_port=0,
        prefill_workers=(p.address,),
        decode_workers=(d.address,),
        local_prefill_threshold=0,  # every prompt is prefilled on the prefill worker and handed off
        max_output_tokens=400,
        startup_timeout=60,
    )
    with GatewayThread(config) as gw:
        yield gw


@pytest.fixture(scope="module")
def client(gateway: GatewayThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)


def _settled(workers: tuple[WorkerProcess, WorkerProcess]) -> None:
    for w in workers:
        w.wait_all_free()


def test_n_seeded_choices_equal_separate_requests_with_their_seeds(
    client: openai.OpenAI, gateway: GatewayThread, workers: tuple[WorkerProcess, WorkerProcess]
) -> None:
    """vLLM's rule: choice j of a call seeded s samples as a single request seeded s + j."""
    kw: dict[str, Any] = dict(model=gateway.model, prompt=PROMPT, max_tokens=12, temperature=1.0)
    call = client.completions.create(n=3, seed=11, **kw)
    assert [c.index for c in call.choices] == [0, 1, 2]
    singles = [client.completions.create(seed=11 + j, **kw) for j in range(3)]
    assert [c.text for c in call.choices] == [s.choices[0].text for s in singles]
    assert len({c.text for c in call.choices}) > 1  # sampled, not copies of one another
    assert call.usage is not None
    assert call.usage.prompt_tokens == singles[0].usage.prompt_tokens  # type: ignore[union-attr]
    assert call.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)  # type: ignore[union-attr]

    stream = client.completions.create(n=3, seed=11, stream=True, **kw)
    texts = ["", "", ""]
    finishes = [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.text for c in call.choices] and None not in finishes
    _settled(workers)


def test_n_choices_of_a_chat_stream_each_with_its_index(
    client: openai.OpenAI, gateway: GatewayThread
) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    kw: dict[str, Any] = dict(model=gateway.model, messages=messages, max_tokens=10, temperature=1.0, seed=5)
    whole = client.chat.completions.create(n=2, **kw)
    stream = client.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **kw)
    texts, roles, usage = ["", ""], [None, None], None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] = c.delta.role or roles[c.index]
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in whole.choices] and roles == ["assistant", "assistant"]
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_prompt_is_computed_once_for_n_choices(
    client: openai.OpenAI,
    gateway: GatewayThread,
    workers: tuple[WorkerProcess, WorkerProcess],
    metrics_port: int,
) -> None:
    """Read from the prefill worker's prefix-cache counters: the other choices find every full block
    of the prompt cached there, and compute only its last partial block."""
    block_size = workers[0].info().block_size
    page = f"http://127.0.0.1:{metrics_port}/metrics"
    before = Scrape(page)
    n = 4
    call = client.completions.create(
        model=gateway.model, prompt=LONG_PROMPT + " once", n=n, max_tokens=6, temperature=1.0, seed=3
    )
    assert call.usage is not None
    num_prompt = call.usage.prompt_tokens
    assert num_prompt > 3 * block_size
    after = Scrape(page)
    queried = after.value("baton_worker_prefix_cache_queries_total") - before.value(
        "baton_worker_prefix_cache_queries_total"
    )
    hits = after.value("baton_worker_prefix_cache_hits_total") - before.value(
        "baton_worker_prefix_cache_hits_total"
    )
    cacheable = (num_prompt - 1) // block_size * block_size  # the last token is always computed
    assert queried == n * num_prompt
    assert hits == (n - 1) * cacheable, (hits, num_prompt, block_size)
    _settled(workers)


def test_best_of_returns_the_most_likely_choices(client: openai.OpenAI, gateway: GatewayThread) -> None:
    kw: dict[str, Any] = dict(model=gateway.model, prompt=PROMPT, max_tokens=8, temperature=1.0)
    best = client.completions.create(n=1, best_of=3, seed=21, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # ranked by logprobs not asked for
    answers = [client.completions.create(seed=21 + j, logprobs=0, **kw) for j in range(3)]
    scores = [sum(a.choices[0].logprobs.token_logprobs) for a in answers]  # type: ignore[union-attr, arg-type]
    assert best.choices[0].text == answers[scores.index(max(scores))].choices[0].text
    assert best.usage is not None  # every candidate's tokens count, as OpenAI bills them
    assert best.usage.completion_tokens == sum(a.usage.completion_tokens for a in answers)  # type: ignore[union-attr]


def test_batched_prompts_are_answered_in_order(client: openai.OpenAI, gateway: GatewayThread) -> None:
    kw: dict[str, Any] = dict(model=gateway.model, max_tokens=8, temperature=0)
    singles = [client.completions.create(prompt=p, **kw).choices[0].text for p in PROMPTS]
    batch = client.completions.create(prompt=PROMPTS, **kw)
    assert [c.index for c in batch.choices] == [0, 1, 2] and [c.text for c in batch.choices] == singles
    texts = ["", "", ""]
    for chunk in client.completions.create(prompt=PROMPTS, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == singles
    # token-id prompts, with n: index = prompt × n + choice
    ids = [[5, 6, 7, 8], [9, 10, 11]]
    both = client.completions.create(prompt=ids, n=2, **kw)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text  # greedy: the same for both choices
    assert both.usage is not None and both.usage.prompt_tokens == 7


def test_echo_puts_the_prompt_before_the_text(client: openai.OpenAI, gateway: GatewayThread) -> None:
    kw: dict[str, Any] = dict(model=gateway.model, max_tokens=6, temperature=0)
    plain = client.completions.create(prompt=PROMPTS[0], **kw).choices[0].text
    echoed = client.completions.create(prompt=PROMPTS[0], echo=True, **kw).choices[0].text
    assert echoed == PROMPTS[0] + plain
    streamed = "".join(
        c.text
        for chunk in client.completions.create(prompt=PROMPTS[0], echo=True, stream=True, **kw)
        for c in chunk.choices
    )
    assert streamed == echoed


def test_unknown_fields_are_ignored_and_named(gateway: GatewayThread) -> None:
    """A client written for another server keeps working; the header says what was ignored."""
    body = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": "hi", "weight": 1}],
        "max_tokens": 3,
        "frobnicate": {"deep": [1, 2]},
        "stop": None,
    }
    status, headers, out = http_json(gateway, "/v1/chat/completions", body)
    assert status == 200, out
    assert headers["X-Baton-Ignored-Fields"] == "frobnicate, messages[0].weight"
    assert out["choices"][0]["finish_reason"] in ("stop", "length")


def test_continuous_usage_stats_in_every_chunk(gateway: GatewayThread) -> None:
    """guidellm asks for these: the usage so far in every chunk, and the total at the end."""
    body = {
        "model": gateway.model,
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    conn, events = sse_events(gateway, "/v1/completions", body)
    chunks = [e for e in events if e != "[DONE]"]
    conn.close()
    with_choices = [c for c in chunks if c["choices"]]
    assert all(c["usage"] is not None for c in with_choices)
    used = [c["usage"]["completion_tokens"] for c in with_choices]
    assert used == sorted(used) and used[-1] == 8
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {chunks[-1]["usage"]["prompt_tokens"]}


def test_a_disconnect_cancels_every_choice(
    gateway: GatewayThread, workers: tuple[WorkerProcess, WorkerProcess]
) -> None:
    body = {
        "model": gateway.model,
        "prompt": PROMPT,
        "n": 3,
        "max_tokens": 350,
        "ignore_eos": True,
        "stream": True,
    }
    conn, events = sse_events(gateway, "/v1/completions", body)
    seen: set[int] = set()
    deadline = time.monotonic() + 30
    for e in events:
        seen.update(c["index"] for c in e["choices"])
        if seen == {0, 1, 2} or time.monotonic() > deadline:
            break
    assert seen == {0, 1, 2}  # every choice was running
    conn.close()
    _settled(workers)


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "size", "kind"],
    "additionalProperties": False,
}


def test_a_json_schema_holds_through_the_disaggregated_path(
    client: openai.OpenAI, gateway: GatewayThread, workers: tuple[WorkerProcess, WorkerProcess]
) -> None:
    """The prefill worker samples the first token under the grammar, the decode worker replays it and
    goes on: 20 seeded samples at temperature 1, every one parses and validates; streamed the same."""
    response_format: Any = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    kw: dict[str, Any] = dict(model=gateway.model, max_tokens=120, temperature=1.0)
    messages = [{"role": "user", "content": "A pet as JSON"}]
    call = client.chat.completions.create(
        messages=messages, n=20, seed=1, response_format=response_format, **kw
    )
    texts = [c.message.content or "" for c in call.choices]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 5
    streamed = ""
    stream = client.chat.completions.create(
        messages=messages, seed=1, response_format=response_format, stream=True, **kw
    )
    for chunk in stream:
        streamed += "".join(c.delta.content or "" for c in chunk.choices)
    assert streamed == texts[0]
    _settled(workers)


def test_json_object_regex_and_choice_constraints(client: openai.OpenAI, gateway: GatewayThread) -> None:
    kw: dict[str, Any] = dict(model=gateway.model, prompt=PROMPT, temperature=1.0, seed=4)
    obj = client.completions.create(
        max_tokens=80, extra_body={"response_format": {"type": "json_object"}}, **kw
    )
    text = obj.choices[0].text
    assert text.startswith("{") and (
        obj.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    )
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{2}"
    regex = client.completions.create(max_tokens=20, n=5, extra_body={"guided_regex": pattern}, **kw)
    assert all(re.fullmatch(pattern, c.text) for c in regex.choices), [c.text for c in regex.choices]
    options = ["red", "green", "blue"]
    choice = client.completions.create(
        max_tokens=5, n=8, extra_body={"structured_outputs": {"choice": options}}, **kw
    )
    assert {c.text for c in choice.choices} <= set(options)


def test_a_schema_the_engine_cannot_compile_is_a_400(client: openai.OpenAI, gateway: GatewayThread) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            out = client.completions.create(
                model=gateway.model, prompt="x", max_tokens=5, stream=stream, extra_body={"guided_json": bad}
            )
            if stream:
                list(out)  # type: ignore[arg-type]
        assert "JSON schema cannot be compiled" in str(info.value)
    assert client.completions.create(model=gateway.model, prompt="x", max_tokens=2).choices  # still serving


WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 15},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def test_tool_choice_required_returns_parseable_calls(
    client: openai.OpenAI, gateway: GatewayThread, workers: tuple[WorkerProcess, WorkerProcess]
) -> None:
    """Enforced through the grammar: every choice calls tools, with arguments that follow their schema."""
    messages: Any = [{"role": "user", "content": "What is the weather in Oslo this week?"}]
    kw: dict[str, Any] = dict(
        model=gateway.model, messages=messages, tools=TOOLS, max_tokens=150, temperature=1.0
    )
    call = client.chat.completions.create(tool_choice="required", n=8, seed=2, **kw)
    names = set()
    for choice in call.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for tool_call in choice.message.tool_calls:
            arguments = json.loads(tool_call.function.arguments)  # type: ignore[union-attr]
            names.add(tool_call.function.name)  # type: ignore[union-attr]
            if tool_call.function.name == "get_weather":  # type: ignore[union-attr]
                jsonschema.validate(arguments, WEATHER_PARAMS)
            assert tool_call.id.startswith("call_") and tool_call.type == "function"
    assert names <= {"get_weather", "get_time"}

    # The same, streamed: the calls arrive whole at the end, with the same arguments.
    stream = client.chat.completions.create(tool_choice="required", seed=2, stream=True, **kw)
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                entry = streamed.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""  # type: ignore[union-attr]
                entry["arguments"] += d.function.arguments or ""  # type: ignore[union-attr]
            finish = c.finish_reason or finish
    first = call.choices[0].message.tool_calls or []
    assert finish == "tool_calls"
    assert [(e["name"], json.loads(e["arguments"])) for e in streamed.values()] == [
        (t.function.name, json.loads(t.function.arguments))
        for t in first  # type: ignore[union-attr]
    ]
    _settled(workers)


def test_a_named_tool_streams_its_arguments(client: openai.OpenAI, gateway: GatewayThread) -> None:
    messages: Any = [{"role": "user", "content": "Weather in Rome for 3 days"}]
    stream = client.chat.completions.create(
        model=gateway.model,
        messages=messages,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=1.0,
        seed=9,
        stream=True,
    )
    pieces: list[str] = []
    names, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function and d.function.name else []
                pieces += [d.function.arguments] if d.function and d.function.arguments else []
            finish = c.finish_reason or finish
    assert names == ["get_weather"] and len(pieces) > 1  # the arguments came in pieces, as generated
    jsonschema.validate(json.loads("".join(pieces)), WEATHER_PARAMS)
    assert finish == "stop"  # OpenAI's finish reason for a named tool


def test_a_conversation_with_earlier_calls_and_results(client: openai.OpenAI, gateway: GatewayThread) -> None:
    """An assistant turn with only tool_calls (no content) and the tool's result are accepted and
    rendered; tool_choice auto leaves the model free (the tiny model answers in text)."""
    messages: Any = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C and rain"},
    ]
    out = client.chat.completions.create(
        model=gateway.model, messages=messages, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage is not None and out.usage.prompt_tokens > 50  # the tools are in the prompt


def test_echo_with_logprobs_through_the_disaggregated_path(
    client: openai.OpenAI, gateway: GatewayThread, tiny_long: Path
) -> None:
    """The prefill worker computes the prompt's logprobs (every position, none from the prefix cache)
    and they come back with the first token: the echoed tokens carry them, equal to the engine's
    offline; streamed, the first chunk carries the prompt and its logprobs."""
    from core.sampling_params import SamplingParams
    from engine import LLM

    kw: dict[str, Any] = dict(model=gateway.model, prompt=PROMPTS[2], max_tokens=4, temperature=0, logprobs=2)
    whole = client.completions.create(echo=True, **kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert whole.choices[0].text.startswith(PROMPTS[2])
    num_prompt = whole.usage.prompt_tokens  # type: ignore[union-attr]
    assert len(lp.tokens) == num_prompt + 4 and lp.token_logprobs[0] is None
    assert "".join(lp.tokens[:num_prompt]) == PROMPTS[2]  # the echoed prompt, token by token
    llm = LLM(str(tiny_long), kv_cache_memory=4 << 20, dtype="float32", num_threads=1)
    offline = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    assert offline.prompt_logprobs is not None
    expected = [e.logprob for e in offline.prompt_logprobs[1:] if e is not None]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:num_prompt], expected, strict=True)) < 1e-4  # type: ignore[operator]

    first = next(iter(client.completions.create(echo=True, stream=True, **kw)))
    assert first.choices[0].text.startswith(PROMPTS[2])
    assert first.choices[0].logprobs is not None and first.choices[0].logprobs.tokens is not None
    assert len(first.choices[0].logprobs.tokens) >= num_prompt + 1

    # vLLM's spelling, on chat too: per prompt token, None first, then {token id: {logprob, decoded_token}}.
    body = {
        "model": gateway.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "prompt_logprobs": 1,
    }
    status, _, out = http_json(gateway, "/v1/chat/completions", body)
    assert status == 200, out
    prompt_lps = out["choices"][0]["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == out["usage"]["prompt_tokens"]
    assert all(1 <= len(entry) <= 2 for entry in prompt_lps[1:])


@pytest.mark.parametrize(
    "path, body, needle",
    [
        ("/v1/completions", {"prompt": "x", "guided_regex": "a" * 70_000}, "over the limit of 65536 bytes"),
        ("/v1/completions", {"prompt": "x", "n": 65}, "n must be an integer in [1, 64]"),
        ("/v1/completions", {"prompt": ["x"] * 3, "n": 50}, "over the limit of 128 choices"),
        ("/v1/completions", {"prompt": "x", "best_of": 2, "n": 3}, "best_of must be >= n"),
        ("/v1/completions", {"prompt": "x", "guided_grammar": "root ::= nope"}, "grammar cannot be compiled"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "(("}, "regex cannot be compiled"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            "tool_choice needs tools",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "bad name"}}],
            },
            "tools[0].function.name must be",
        ),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 99}, "prompt_logprobs must be in [0, 20]"),
    ],
)
def test_bad_values_of_the_new_fields(
    gateway: GatewayThread, path: str, body: dict[str, Any], needle: str
) -> None:
    """Each a 400 with the reason, and the server keeps serving."""
    status, _, out = http_json(gateway, path, {**body, "max_tokens": 3})
    assert status == 400, out
    assert needle in out["error"]["message"] and out["error"]["type"] == "invalid_request_error"
    assert http_json(gateway, "/health")[0] == 200
