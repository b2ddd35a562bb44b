"""The gateway end to end: real worker processes (prefill, decode, and one `both`) on the tiny model,
real gateways (in this process, on their own event loop) and real clients — grpc, HTTP, the official
openai client. Greedy outputs must equal `LLM.generate` offline on the disaggregated (P → D), the
colocated (one `both` worker) and the scheduled (P → D placed by a real `baton scheduler` over a real
redis-server) paths; cancellations must free every block; bad inputs get clear errors; the
scheduler's verdicts (API keys, quotas) reach the client as their status. Failover: test_failover.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import (
    Cluster,
    GatewayThread,
    SchedulerProcess,
    SessionClient,
    WorkerProcess,
    add_tenants,
    eventually,
    grpc_generate,
    grpc_raw_cancel,
    grpc_raw_generate,
    grpc_raw_session,
    http_json,
    metric,
    running_workers,
    sse_events,
)

from baton.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from core.errors import CapacityExceeded, Unavailable
from core.sampling_params import SamplingParams
from services.gateway.admission import GenerationRequest
from services.gateway.request_stream import RequestStream
from services.gateway.server import GatewayConfig, serve_gateway

pytestmark = pytest.mark.integration

PROMPTS = [
    "The quick brown fox jumps over",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):",
]
CHAT = [{"role": "user", "content": "Continuous batching keeps accelerators busy"}]
MAX_TOKENS = 12
LONG = 400  # tokens of a request that is still running when it is cancelled
MAX_REQUEST_BYTES = 64 << 10
API_KEY = "sk-test-default"  # a key of the scheduler's default tenant (the static gateways ignore keys)
TINY_KEY = "sk-test-tiny"  # a tenant allowed one request at a time
PAIR_KEY = "sk-test-pair"  # a tenant allowed two


@pytest.fixture(scope="module")
def workers(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, WorkerProcess]]:
    roles = ("prefill", "decode", "both")
    with running_workers(tiny_llama, tmp_path_factory.mktemp("gateway-workers"), *roles) as procs:
        yield dict(zip(roles, procs, strict=True))


def _config(tiny_llama: Path, **kw: Any) -> GatewayConfig:
    defaults: dict[str, Any] = dict(
        model=str(tiny_llama),
        grpc_port=0,
        http_port=0,
        max_output_tokens=LONG + 50,
        max_request_bytes=MAX_REQUEST_BYTES,
        max_session_requests=3,
        startup_timeout=60,
    )
    return GatewayConfig(**{**defaults, **kw})


@pytest.fixture(scope="module")
def disaggregated(workers: dict[str, WorkerProcess], tiny_llama: Path) -> Iterator[GatewayThread]:
    with GatewayThread(
        _config(
            tiny_llama,
            prefill_workers=(workers["prefill"].address,),
            decode_workers=(workers["decode"].address,),
            local_prefill_threshold=0,
        )
    ) as gw:
        yield gw


@pytest.fixture(scope="module")
def colocated(workers: dict[str, WorkerProcess], tiny_llama: Path) -> Iterator[GatewayThread]:
    with GatewayThread(_config(tiny_llama, decode_workers=(workers["both"].address,))) as gw:
        yield gw


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> dict[str, Any]:
    """What the engine produces offline for the same prompts (greedy)."""
    from engine import LLM

    llm = LLM(str(tiny_llama), kv_cache_memory=16 << 20, dtype="float32", num_threads=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate(PROMPTS, params)
    chat = llm.chat(CHAT, params)[0]
    candidates = [f"{i}: the lazy dog" for i in range(64)]
    firsts = llm.generate(candidates, SamplingParams(max_tokens=1, temperature=0))
    partial = next(c for c, o in zip(candidates, firsts, strict=True) if "\ufffd" in o.text)
    partial_out = llm.generate([partial], params)[0]
    return {
        "prompts": [(o.token_ids, o.text) for o in outs],
        "chat": (chat.token_ids, chat.text),
        "long_prompt_ids": llm.tokenizer.encode(PROMPTS[1]),
        "partial_first_char": (partial, partial_out.token_ids, partial_out.text),
    }


@pytest.fixture(scope="module")
def short_prompts_local(workers: dict[str, WorkerProcess], tiny_llama: Path) -> Iterator[GatewayThread]:
    """P and D configured, but every prompt is under the threshold: D prefills it itself."""
    with GatewayThread(
        _config(
            tiny_llama,
            prefill_workers=(workers["prefill"].address,),
            decode_workers=(workers["decode"].address,),
            local_prefill_threshold=10_000,
        )
    ) as gw:
        yield gw


@pytest.fixture(scope="module")
def scheduler(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    """A real redis-server and `baton scheduler`, a prefill and a decode worker registered there, and
    two API keys: one of the default tenant, one of a tenant allowed a single request at a time."""
    from scheduler.redis_server import RedisServer
    from scheduler.tenants import TenantConfig

    with (
        RedisServer() as redis,
        Cluster(redis.url, tmp_path_factory.mktemp("scheduled"), "--local-prefill-threshold", "1") as c,
    ):
        c.add_workers(tiny_llama, "prefill", "decode", kv_transport=None)
        add_tenants(
            redis.url,
            [TenantConfig("tiny", max_concurrent=1), TenantConfig("pair", max_concurrent=2)],
            {API_KEY: "default", TINY_KEY: "tiny", PAIR_KEY: "pair"},
        )
        yield c.scheduler


@pytest.fixture(scope="module")
def scheduled(scheduler: SchedulerProcess, tiny_llama: Path) -> Iterator[GatewayThread]:
    with GatewayThread(_config(tiny_llama, scheduler=scheduler.address)) as gw:
        gw.disaggregated = True  # every prompt is over the scheduler's local-prefill threshold
        yield gw


@pytest.fixture(
    params=[
        "disaggregated",
        "colocated",
        "short_prompts_local",
        pytest.param("scheduled", marks=pytest.mark.redis),
    ]
)
def gateway(request: pytest.FixtureRequest) -> GatewayThread:
    gw: GatewayThread = request.getfixturevalue(request.param)
    return gw


# --- clients ---------------------------------------------------------------------------------------


def greedy(max_tokens: int = MAX_TOKENS, **kw: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


# --- greedy parity ---------------------------------------------------------------------------------


def test_generate_equals_offline(gateway: GatewayThread, offline: dict[str, Any]) -> None:
    for prompt, (ids, text) in zip(PROMPTS, offline["prompts"], strict=True):
        got_ids, got_text, completion = grpc_generate(
            gateway, gateway_pb2.GenerateRequest(prompt=prompt, sampling=greedy())
        )
        assert (got_ids, got_text) == (ids, text), prompt
        assert completion.usage.completion_tokens == len(ids)
        assert completion.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
        t = completion.timings
        assert 0 < t.ttft_ms <= t.e2e_ms and t.queue_ms >= 0 and t.prefill_ms > 0 and t.decode_ms > 0
        assert (t.transfer_ms > 0) == gateway.disaggregated  # the KV really moved from P to D


def test_session_equals_offline(gateway: GatewayThread, offline: dict[str, Any]) -> None:
    session = SessionClient(gateway)
    for i, prompt in enumerate(PROMPTS):  # all at once, multiplexed
        session.generate(f"s{i}-{id(gateway)}", prompt, greedy())
    got: dict[str, list[Any]] = {}
    completions: dict[str, Any] = {}
    while len(completions) < len(PROMPTS):
        msg = session.next()
        assert not msg.HasField("error"), msg
        if msg.HasField("delta"):
            got.setdefault(msg.request_id, [[], ""])
            got[msg.request_id][0] += msg.delta.token_ids
            got[msg.request_id][1] += msg.delta.text
        else:
            completions[msg.request_id] = msg.completion
    assert session.close() == []
    for i, (ids, text) in enumerate(offline["prompts"]):
        assert tuple(got[f"s{i}-{id(gateway)}"]) == (ids, text)


def test_http_equals_offline(gateway: GatewayThread, offline: dict[str, Any]) -> None:
    for prompt, (ids, text) in zip(PROMPTS, offline["prompts"], strict=True):
        body = {"model": gateway.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        status, headers, out = http_json(gateway, "/v1/completions", body)
        assert status == 200, out
        assert out["object"] == "text_completion" and out["choices"][0]["text"] == text
        assert out["usage"]["completion_tokens"] == len(ids) and headers["X-Request-Id"] == out["id"]
        conn, events = sse_events(gateway, "/v1/completions", {**body, "stream": True})
        chunks = list(events)
        conn.close()
        assert chunks[-1] == "[DONE]"
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == text
        assert chunks[-2]["usage"]["completion_tokens"] == len(ids)  # usage in the last chunk
    ids, text = offline["chat"]
    chat = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, _, out = http_json(gateway, "/v1/chat/completions", chat)
    assert status == 200 and out["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_openai_client_streams_a_chat(gateway: GatewayThread, offline: dict[str, Any]) -> None:
    import openai

    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(
        model=gateway.model,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == offline["chat"][1]
    assert finish in ("length", "stop") and usage is not None
    assert usage.completion_tokens == len(offline["chat"][0])
    assert [m.id for m in client.models.list()] == [gateway.model]


# --- service plumbing ------------------------------------------------------------------------------


def test_reflection_health_models_metrics(disaggregated: GatewayThread) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    services = set(ProtoReflectionDescriptorDatabase(disaggregated.channel).get_services())
    assert {
        "baton.v1.Gateway",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= services
    health = health_pb2_grpc.HealthStub(disaggregated.channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Gateway")).status == 1  # SERVING
    models = disaggregated.stub.ListModels(gateway_pb2.ListModelsRequest()).models
    assert len(models) == 1 and models[0].name == disaggregated.model and models[0].max_model_len > 0
    status, _, body = http_json(disaggregated, "/health")
    assert status == 200 and body["status"] == "ok"
    with urllib.request.urlopen(disaggregated.url + "/metrics") as r:
        text = r.read().decode()
    assert "baton_gateway_requests_total" in text and "baton_gateway_ttft_seconds_bucket" in text


def test_start_up_waits_for_workers_then_fails_clearly(tiny_llama: Path) -> None:
    async def start() -> None:
        await serve_gateway(_config(tiny_llama, decode_workers=("127.0.0.1:1",), startup_timeout=0.5))

    with pytest.raises(Unavailable, match=r"did not answer within 0.5 s: 127.0.0.1:1"):
        asyncio.run(start())


def test_a_dead_worker_makes_health_503_and_requests_unavailable(tiny_llama: Path, tmp_path: Path) -> None:
    with (
        running_workers(tiny_llama, tmp_path, "both") as (worker,),
        GatewayThread(_config(tiny_llama, decode_workers=(worker.address,))) as gw,
    ):
        assert http_json(gw, "/health")[0] == 200
        worker.stop()
        status, _, body = http_json(gw, "/health")
        assert status == 503 and body["status"] == "unavailable" and body["workers"][worker.address] != "ok"
        status, _, out = http_json(gw, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
        assert status == 503 and out["error"]["type"] == "unavailable", out
        with pytest.raises(grpc.RpcError) as info:
            grpc_generate(gw, gateway_pb2.GenerateRequest(prompt="a b", sampling=greedy(2)))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and worker.address in info.value.details()


def test_a_failed_kv_transfer_is_retried_with_a_fresh_prefill(
    workers: dict[str, WorkerProcess], tiny_llama: Path, tmp_path: Path, offline: dict[str, Any]
) -> None:
    """The first prefill worker's leases expire before D can pull (a real KVTransferFailed on D); the
    gateway releases that lease, prefills again on the next worker, and the client's stream goes on
    from the first token it already has: the output still equals the offline one."""
    with (
        running_workers(tiny_llama, tmp_path, "prefill", flags=("--lease-ttl-s", "0.001")) as (expiring,),
        GatewayThread(
            _config(
                tiny_llama,
                prefill_workers=(expiring.address, workers["prefill"].address),
                decode_workers=(workers["decode"].address,),
                local_prefill_threshold=0,
            )
        ) as gw,
    ):
        before = metric("baton_gateway_kv_transfer_retries_total")
        ids, text, completion = grpc_generate(
            gw, gateway_pb2.GenerateRequest(prompt=PROMPTS[2], sampling=greedy())
        )
        assert (ids, text) == offline["prompts"][2]
        assert completion.usage.completion_tokens == len(ids)
        assert metric("baton_gateway_kv_transfer_retries_total") == before + 1
        for worker in (expiring, workers["prefill"], workers["decode"]):
            worker.wait_all_free()


@pytest.mark.redis
def test_scheduler_verdicts_reach_the_client(scheduled: GatewayThread, scheduler: SchedulerProcess) -> None:
    """API keys from `Authorization: Bearer`, `x-api-key` and gRPC metadata; an unknown key is 401 /
    UNAUTHENTICATED; a tenant over its concurrency quota gets 429 with Retry-After / RESOURCE_EXHAUSTED;
    /health reports the scheduler."""
    body = {"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0}
    assert (
        http_json(scheduled, "/v1/completions", body, headers={"Authorization": f"Bearer {API_KEY}"})[0]
        == 200
    )
    assert http_json(scheduled, "/v1/completions", body, headers={"x-api-key": API_KEY})[0] == 200
    status, _, out = http_json(
        scheduled, "/v1/completions", body, headers={"Authorization": "Bearer sk-nobody"}
    )
    assert status == 401 and out["error"] == {
        "message": "invalid API key",
        "type": "authentication_error",
        "param": None,
        "code": None,
    }
    request = gateway_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=greedy(2))
    assert grpc_generate(scheduled, request)[2].usage.completion_tokens == 2  # no key: the default tenant
    with pytest.raises(grpc.RpcError) as info:
        list(scheduled.stub.Generate(request, timeout=30, metadata=(("x-api-key", "sk-nobody"),)))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    held = scheduled.stub.Generate(
        gateway_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=greedy(LONG, ignore_eos=True)),
        timeout=60,
        metadata=(("authorization", f"Bearer {TINY_KEY}"),),
    )
    assert next(held).HasField("delta")
    status, headers, out = http_json(scheduled, "/v1/completions", body, headers={"x-api-key": TINY_KEY})
    assert (
        status == 429 and int(headers["Retry-After"]) >= 1 and out["error"]["type"] == "rate_limit_error"
    ), out
    with pytest.raises(grpc.RpcError) as info:
        list(scheduled.stub.Generate(request, timeout=30, metadata=(("x-api-key", TINY_KEY),)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    held.cancel()
    eventually(  # the gateway's Finish gives the tenant its slot back
        lambda: http_json(scheduled, "/v1/completions", body, headers={"x-api-key": TINY_KEY})[0] == 200,
        10,
        "the tenant's slot given back",
        interval_s=0.05,
    )
    status, _, health = http_json(scheduled, "/health")
    assert status == 200 and health["scheduler"] == "ok" and sum(health["workers_per_version"].values()) == 2


def test_a_first_token_that_is_part_of_a_character_is_sent_once(
    disaggregated: GatewayThread, offline: dict[str, Any]
) -> None:
    prompt, ids, text = offline["partial_first_char"]
    got_ids, got_text, _ = grpc_generate(
        disaggregated, gateway_pb2.GenerateRequest(prompt=prompt, sampling=greedy())
    )
    assert got_ids == ids
    assert got_text == text  # P holds the partial character back at the handoff; D emits it once


# --- cancellation ----------------------------------------------------------------------------------


def test_session_cancel_frees_blocks(
    disaggregated: GatewayThread, workers: dict[str, WorkerProcess], offline: dict[str, Any]
) -> None:
    """Two requests on one Session; the long one is cancelled midway, the other completes."""
    session = SessionClient(disaggregated)
    session.generate("victim", PROMPTS[0], greedy(LONG, ignore_eos=True))
    session.generate("survivor", PROMPTS[1], greedy())
    victim_tokens, survivor_ids, ended = 0, [], {}
    cancelled_at = None
    while len(ended) < 2:
        msg = session.next()
        assert not msg.HasField("error"), msg
        if msg.HasField("delta") and msg.request_id == "victim":
            victim_tokens += len(msg.delta.token_ids)
            if cancelled_at is None and victim_tokens >= 3:
                session.cancel("victim")
                cancelled_at = time.perf_counter()
        elif msg.HasField("delta"):
            survivor_ids += msg.delta.token_ids
        else:
            ended[msg.request_id] = msg.completion
    assert session.close() == []
    assert ended["victim"].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert victim_tokens < LONG
    assert ended["survivor"].finish_reason != common_pb2.FINISH_REASON_CANCELLED
    assert survivor_ids == offline["prompts"][1][0]
    assert cancelled_at is not None
    for role in ("decode", "prefill"):
        workers[role].wait_all_free()
    print(
        f"\nSession cancel -> blocks free on P and D in {(time.perf_counter() - cancelled_at) * 1e3:.1f} ms"
    )


def test_cancel_rpc_and_deadline(disaggregated: GatewayThread, workers: dict[str, WorkerProcess]) -> None:
    assert not disaggregated.stub.Cancel(gateway_pb2.CancelRequest(request_id="nobody")).found
    responses = disaggregated.stub.Generate(
        gateway_pb2.GenerateRequest(
            request_id="to-cancel", prompt=PROMPTS[0], sampling=greedy(LONG, ignore_eos=True)
        ),
        timeout=60,
    )
    first = next(responses)
    assert first.request_id == "to-cancel" and first.HasField("delta")
    assert disaggregated.stub.Cancel(gateway_pb2.CancelRequest(request_id="to-cancel")).found
    last = list(responses)[-1]
    assert last.completion.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    workers["decode"].wait_all_free()
    workers["prefill"].wait_all_free()
    # A passed deadline cancels the request: the client sees DEADLINE_EXCEEDED from its own timer, or
    # (when the gateway's timer wins the race) a last Completion with FINISH_REASON_CANCELLED.
    try:
        *_, last = disaggregated.stub.Generate(
            gateway_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=greedy(LONG, ignore_eos=True)),
            timeout=0.05,
        )
        assert last.completion.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    workers["decode"].wait_all_free()
    workers["prefill"].wait_all_free()


def test_a_cancelled_grpc_call_frees_blocks(
    disaggregated: GatewayThread, workers: dict[str, WorkerProcess]
) -> None:
    before = metric("baton_gateway_cancellations_total", {"reason": "client"})
    responses = disaggregated.stub.Generate(
        gateway_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=greedy(LONG, ignore_eos=True)), timeout=60
    )
    assert next(responses).HasField("delta")
    responses.cancel()
    workers["decode"].wait_all_free()
    workers["prefill"].wait_all_free()
    eventually(
        lambda: metric("baton_gateway_cancellations_total", {"reason": "client"}) == before + 1,
        10,
        "the gateway counted the cancellation",
    )


def test_sse_disconnect_frees_blocks(disaggregated: GatewayThread, workers: dict[str, WorkerProcess]) -> None:
    body = {"messages": CHAT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    conn, events = sse_events(disaggregated, "/v1/chat/completions", body)
    for _ in range(4):
        next(events)
    conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    conn.close()
    closed_at = time.perf_counter()
    workers["decode"].wait_all_free()
    workers["prefill"].wait_all_free()
    print(f"\nSSE disconnect -> blocks free on D in {(time.perf_counter() - closed_at) * 1e3:.1f} ms")
    with urllib.request.urlopen(disaggregated.url + "/metrics") as r:
        assert 'baton_gateway_cancellations_total{reason="disconnect"}' in r.read().decode()


def test_session_limits(disaggregated: GatewayThread) -> None:
    session = SessionClient(disaggregated)
    for rid in ("a", "b", "a"):  # the second "a" duplicates one in flight
        session.generate(rid, PROMPTS[0], greedy(LONG, ignore_eos=True))
    for rid in ("c", "d"):  # "c" fills the session (3), "d" is over it
        session.generate(rid, PROMPTS[0], greedy(LONG, ignore_eos=True))
    errors: dict[str, Any] = {}
    while len(errors) < 2:
        msg = session.next()
        if msg.HasField("error"):
            errors[msg.request_id] = msg.error
    assert (
        errors["a"].code == grpc.StatusCode.ALREADY_EXISTS.value[0]
        and "already in flight" in errors["a"].message
    )
    assert errors["d"].code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and errors["d"].retry_after_s > 0
    for rid in ("a", "b", "c"):
        session.cancel(rid)
    ended = {m.request_id for m in session.close() if m.HasField("completion")}
    assert ended == {"a", "b", "c"}


def test_a_client_that_does_not_read_fails_alone(
    workers: dict[str, WorkerProcess], tiny_llama: Path, offline: dict[str, Any]
) -> None:
    """A request whose client never reads fails with RESOURCE_EXHAUSTED once its bounded buffer is full;
    its blocks are freed and another request on the same gateway and worker is not held up."""
    with GatewayThread(
        _config(tiny_llama, decode_workers=(workers["both"].address,), max_buffered_tokens=8)
    ) as gw:

        async def submit_unread() -> RequestStream:
            return gw.server.dispatcher.submit(
                GenerationRequest(
                    params=SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True),
                    prompt=PROMPTS[0],
                    request_id="never-read",
                )
            )

        async def drain(stream: RequestStream) -> BaseException | None:
            try:
                async for _ in stream:
                    pass
            except CapacityExceeded as e:
                return e
            return None

        stream = gw._call(submit_unread(), 10)
        ids, text, _ = grpc_generate(gw, gateway_pb2.GenerateRequest(prompt=PROMPTS[1], sampling=greedy()))
        assert (ids, text) == offline["prompts"][1]
        error = gw._call(drain(stream), 30)
        assert isinstance(error, CapacityExceeded) and "did not read its stream" in error.message
        workers["both"].wait_all_free()


# --- bad inputs ------------------------------------------------------------------------------------

INVALID, NOT_FOUND, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
GRPC_BAD = [
    ("zero max_tokens", dict(prompt="a b", sampling=greedy(0)), INVALID, "max_tokens must be >= 1"),
    (
        "huge max_tokens",
        dict(prompt="a b", sampling=greedy(10**6)),
        INVALID,
        "over the limit of 450 output tokens",
    ),
    (
        "prompt over the context",
        dict(prompt_token_ids=gateway_pb2.TokenIds(ids=[5] * 600), sampling=greedy()),
        INVALID,
        "the prompt has 600 tokens",
    ),
    (
        "prompt + max_tokens over the context",
        dict(prompt_token_ids=gateway_pb2.TokenIds(ids=[5] * 300), sampling=greedy(300)),
        INVALID,
        "over the model's context of",
    ),
    (
        "unknown model",
        dict(model="gpt-17", prompt="a", sampling=greedy()),
        NOT_FOUND,
        "'gpt-17' is not served",
    ),
    ("empty prompt", dict(prompt="", sampling=greedy()), INVALID, "prompt must not be empty"),
    ("no input", dict(sampling=greedy()), INVALID, "needs one of prompt"),
    (
        "temperature out of range",
        dict(prompt="a", sampling=common_pb2.SamplingParams(temperature=-1)),
        INVALID,
        "temperature must be in",
    ),
    ("top_p zero", dict(prompt="a", sampling=common_pb2.SamplingParams(top_p=0)), INVALID, "top_p"),
    (
        "token id outside the vocabulary",
        dict(prompt_token_ids=gateway_pb2.TokenIds(ids=[1, 10**6]), sampling=greedy()),
        INVALID,
        "prompt token ids must be in",
    ),
    (
        "stop id outside the vocabulary",
        dict(prompt="a", sampling=greedy(stop_token_ids=[10**6])),
        INVALID,
        "outside the vocabulary",
    ),
    ("too many logprobs", dict(prompt="a", sampling=greedy(logprobs=99)), INVALID, "logprobs must be in"),
    ("bad request id", dict(request_id="has space", prompt="a", sampling=greedy()), INVALID, "request_id"),
    (
        "empty messages",
        dict(messages=gateway_pb2.ChatMessages(), sampling=greedy()),
        INVALID,
        "messages must not be empty",
    ),
    (
        "message without a role",
        dict(
            messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(content="hi")]),
            sampling=greedy(),
        ),
        INVALID,
        "messages[0].role must be a non-empty string",
    ),
    (
        "oversized message",
        dict(prompt="x" * (MAX_REQUEST_BYTES + 10), sampling=greedy()),
        EXHAUSTED,
        "larger than",
    ),
]


@pytest.mark.parametrize("case", GRPC_BAD, ids=[c[0] for c in GRPC_BAD])
def test_bad_grpc_inputs(disaggregated: GatewayThread, case: tuple[str, dict[str, Any], Any, str]) -> None:
    _, fields, code, needle = case
    with pytest.raises(grpc.RpcError) as info:
        list(disaggregated.stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=30))
    assert info.value.code() == code, info.value.details()
    assert needle in info.value.details()
    assert http_json(disaggregated, "/health")[0] == 200


def test_grpc_messages_that_are_not_utf8(disaggregated: GatewayThread, offline: dict[str, Any]) -> None:
    """A string field with bytes that are not UTF-8 (protobuf refuses the message): INVALID_ARGUMENT naming
    the field for Generate and Cancel, an error for that request alone in a Session, which goes on."""
    good = gateway_pb2.GenerateRequest(request_id="utf8-good", prompt=PROMPTS[0], sampling=greedy())
    bad = (
        gateway_pb2.GenerateRequest(request_id="utf8-bad", prompt="cafe", sampling=greedy())
        .SerializeToString()
        .replace(b"cafe", b"caf\xe9")
    )  # Latin-1, not UTF-8
    with pytest.raises(grpc.RpcError) as info:
        grpc_raw_generate(disaggregated, bad)
    assert info.value.code() == INVALID, info.value.details()
    assert info.value.details().startswith("prompt is not valid UTF-8 (byte 0xe9 at offset 3)")
    with pytest.raises(grpc.RpcError) as info:
        grpc_raw_cancel(
            disaggregated,
            gateway_pb2.CancelRequest(request_id="re").SerializeToString().replace(b"re", b"r\xe9"),
        )
    assert info.value.code() == INVALID and "request_id is not valid UTF-8" in info.value.details()

    session = grpc_raw_session(
        disaggregated,
        [
            gateway_pb2.SessionRequest(generate=good).SerializeToString(),
            gateway_pb2.SessionRequest(
                generate=gateway_pb2.GenerateRequest(request_id="utf8-bad", prompt="xx", sampling=greedy())
            )
            .SerializeToString()
            .replace(b"xx", b"\xffx"),
        ],
    )
    errors = {m.request_id: m.error for m in session if m.HasField("error")}
    assert list(errors) == ["utf8-bad"] and errors["utf8-bad"].code == INVALID.value[0]
    assert "generate.prompt is not valid UTF-8" in errors["utf8-bad"].message
    ids = [
        t for m in session if m.request_id == "utf8-good" and m.HasField("delta") for t in m.delta.token_ids
    ]
    assert ids == offline["prompts"][0][0]  # the other request of the session was served
    assert grpc_generate(disaggregated, good)[:2] == offline["prompts"][0]  # and the server keeps serving
    assert http_json(disaggregated, "/health")[0] == 200


CHAT_OK = {"messages": CHAT, "max_tokens": 4}
HTTP_BAD: list[tuple[str, str, Any, int, str]] = [
    ("malformed JSON", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("body not an object", "/v1/completions", [1, 2], 400, "must be a JSON object"),
    ("n over the cap", "/v1/chat/completions", {**CHAT_OK, "n": 65}, 400, "n must be an integer in [1, 64]"),
    (
        "a body nested too deeply",
        "/v1/chat/completions",
        (
            '{"messages": [{"role": "user", "content": "x"}], "metadata": ' + "[" * 5000 + "]" * 5000 + "}"
        ).encode(),
        400,
        "nested deeper than 64 levels",
    ),
    (
        "a body nested deeper than the limit, within the parser's stack",
        "/v1/completions",
        ('{"prompt": "x", "metadata": ' + "[" * 80 + "]" * 80 + "}").encode(),
        400,
        "nested deeper than 64 levels",
    ),
    (
        "an unknown tool in tool_choice",
        "/v1/chat/completions",
        {
            **CHAT_OK,
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        400,
        "tool_choice names 'g', which is not one of the tools",
    ),
    (
        "a response_format of an unknown type",
        "/v1/chat/completions",
        {**CHAT_OK, "response_format": {"type": "xml"}},
        400,
        "response_format must be",
    ),
    (
        "two output constraints",
        "/v1/completions",
        {"prompt": "a", "guided_regex": "a+", "guided_choice": ["b"]},
        400,
        "only one output constraint per request",
    ),
    (
        "a schema nested too deeply",
        "/v1/completions",
        {"prompt": "a", "guided_json": '{"a": ' + "[" * 70 + "]" * 70 + "}"},
        400,
        "guided_json is nested deeper than 64 levels",
    ),
    (
        "a batch with one prompt over the context",
        "/v1/completions",
        {"prompt": ["a", [5] * 600], "max_tokens": 2},
        400,
        "the prompt has 600 tokens",
    ),
    (
        "negative max_tokens",
        "/v1/completions",
        {"prompt": "a", "max_tokens": -5},
        400,
        "max_tokens must be >= 1",
    ),
    ("huge max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 10**9}, 400, "over the limit of"),
    (
        "max_tokens of the wrong type",
        "/v1/completions",
        {"prompt": "a", "max_tokens": "8"},
        400,
        "max_tokens must be an integer",
    ),
    ("prompt over the context", "/v1/completions", {"prompt": [5] * 600}, 400, "the prompt has 600 tokens"),
    ("unknown model", "/v1/chat/completions", {**CHAT_OK, "model": "gpt-17"}, 404, "is not served here"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt must not be empty"),
    ("bad stop type", "/v1/completions", {"prompt": "a", "stop": 7}, 400, "stop must be a list of str"),
    (
        "temperature out of range",
        "/v1/completions",
        {"prompt": "a", "temperature": -0.5},
        400,
        "temperature must be in",
    ),
    ("no messages", "/v1/chat/completions", {"max_tokens": 3}, 400, "messages must be a non-empty list"),
    ("oversized body", "/v1/completions", {"prompt": "x" * (MAX_REQUEST_BYTES + 10)}, 413, "body size"),
    (
        "body not UTF-8",
        "/v1/completions",
        b'{"prompt": "caf\xe9", "max_tokens": 2}',
        400,
        "the request body is not valid UTF-8: byte 0xe9 at offset 15",
    ),
    (
        "unpaired surrogate in the prompt",
        "/v1/completions",
        b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        400,
        "prompt is not valid Unicode: an unpaired surrogate U+D800",
    ),
    (
        "unpaired surrogate in a message",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}',
        400,
        "messages[0].content is not valid Unicode",
    ),
    ("unknown route", "/v1/nothing", {}, 404, "Not Found"),
]


@pytest.mark.parametrize("case", HTTP_BAD, ids=[c[0] for c in HTTP_BAD])
def test_bad_http_inputs(disaggregated: GatewayThread, case: tuple[str, str, Any, int, str]) -> None:
    _, path, body, status, needle = case
    raw = body if isinstance(body, bytes) else None
    got, _, out = http_json(disaggregated, path, None if raw else body, raw=raw, method="POST")
    assert got == status, out
    error = out["error"]
    assert needle in error["message"] and set(error) == {"message", "type", "param", "code"}
    assert http_json(disaggregated, "/health")[0] == 200


def test_stream_error_before_first_token_is_an_http_status(disaggregated: GatewayThread) -> None:
    status, _, out = http_json(
        disaggregated, "/v1/completions", {"prompt": [5] * 300, "max_tokens": 300, "stream": True}
    )
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"


# --- a gateway that stops (SIGTERM, a rolling update) drains ---------------------------------------


def test_a_stopping_gateway_drains_its_streams_and_refuses_new_ones(
    workers: dict[str, WorkerProcess], tiny_llama: Path, offline: dict[str, Any]
) -> None:
    """From the stop on, health says NOT_SERVING (a readiness probe fails), a new request gets
    UNAVAILABLE / 503, and a stream in flight completes normally within the drain time; the gateway
    then stops without waiting the rest of it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    gw = GatewayThread(_config(tiny_llama, decode_workers=(workers["both"].address,)))
    channel = grpc.insecure_channel(gw.server.grpc_address)  # gw.stop closes gw.channel first
    health = health_pb2_grpc.HealthStub(channel)
    body = {"prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    conn, events = sse_events(gw, "/v1/completions", body)
    next(events)  # it runs
    stopped = threading.Thread(target=gw.stop, kwargs={"grace_s": 60.0}, daemon=True)
    stop_at = time.monotonic()
    stopped.start()
    eventually(lambda: gw.server.dispatcher.draining, 10, "the drain begun")
    status = health.Check(health_pb2.HealthCheckRequest(service="baton.v1.Gateway")).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert http_json(gw, "/health")[0] == 503
    refused, _, out = http_json(gw, "/v1/completions", {"prompt": "a b", "max_tokens": 2})
    assert refused == 503 and out["error"]["type"] == "unavailable", out
    with pytest.raises(grpc.RpcError) as info:
        list(
            gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateRequest(prompt="a b", sampling=greedy(2)), timeout=30
            )
        )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
    channel.close()
    rest = list(events)  # the stream in flight ends as usual
    conn.close()
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length", rest[-2:]
    stopped.join(30)
    assert not stopped.is_alive() and time.monotonic() - stop_at < 30  # not the whole 60 s drain
    workers["both"].wait_all_free()


def test_streams_a_gateway_cuts_at_the_end_of_its_drain_end_with_an_error(
    workers: dict[str, WorkerProcess], tiny_llama: Path
) -> None:
    """A stream still running when the drain time is over ends with UNAVAILABLE — over gRPC a status,
    over SSE an error event — never with a finish the client would take for a complete answer; its
    blocks are freed on the workers."""
    gw = GatewayThread(_config(tiny_llama, decode_workers=(workers["both"].address,)))
    body = {"prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True, "stream": True}
    conn, events = sse_events(gw, "/v1/completions", body)
    next(events)
    channel = grpc.insecure_channel(gw.server.grpc_address)  # gw.stop closes gw.channel first
    call = gateway_pb2_grpc.GatewayStub(channel).Generate(
        gateway_pb2.GenerateRequest(prompt=PROMPTS[1], sampling=greedy(LONG)), timeout=60
    )
    assert next(call).HasField("delta")
    gw.stop(grace_s=0.0)
    with pytest.raises(grpc.RpcError) as info:
        list(call)  # read to its end: the error comes with the status
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "gateway shut down" in info.value.details()
    channel.close()
    rest = list(events)
    conn.close()
    errors = [e for e in rest if isinstance(e, dict) and "error" in e]
    assert errors and errors[0]["error"]["type"] == "unavailable", rest[-3:]
    assert not any(
        e["choices"][0].get("finish_reason") for e in rest if isinstance(e, dict) and "choices" in e
    )
    workers["both"].wait_all_free()


# --- several choices over gRPC ---------------------------------------------------------------------


def test_grpc_generate_and_session_stream_n_choices_by_index(
    disaggregated: GatewayThread, workers: dict[str, WorkerProcess]
) -> None:
    """``n`` on the gRPC API, as on HTTP: each choice streams with its index, choice j equals a single
    request seeded s + j, and one Cancel (or a Session cancel) by the request id ends every choice."""
    sampling = common_pb2.SamplingParams(max_tokens=10, temperature=1.0, seed=40, ignore_eos=True)
    msg = gateway_pb2.GenerateRequest(request_id="grpc-n", prompt=PROMPTS[0], sampling=sampling, n=3)
    ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    completions = {}
    for r in disaggregated.stub.Generate(msg, timeout=60):
        assert r.request_id == "grpc-n"
        if r.HasField("delta"):
            ids[r.index] += r.delta.token_ids
        else:
            completions[r.index] = r.completion
    assert sorted(completions) == [0, 1, 2]
    for j in range(3):
        single = common_pb2.SamplingParams(max_tokens=10, temperature=1.0, seed=40 + j, ignore_eos=True)
        alone, _, _ = grpc_generate(
            disaggregated, gateway_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=single)
        )
        assert ids[j] == alone, j
        assert completions[j].usage.completion_tokens == 10

    with pytest.raises(grpc.RpcError) as info:
        list(
            disaggregated.stub.Generate(
                gateway_pb2.GenerateRequest(prompt="x", sampling=sampling, n=65), timeout=30
            )
        )
    assert info.value.code() == INVALID and "n must be an integer in [1, 64]" in (info.value.details() or "")

    # Cancel by the request id: every choice ends, each with its own completion (cancelled).
    long = common_pb2.SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True)
    call = disaggregated.stub.Generate(
        gateway_pb2.GenerateRequest(request_id="grpc-n-cancel", prompt=PROMPTS[1], sampling=long, n=2),
        timeout=60,
    )
    cancelled = False
    ended = {}
    for r in call:  # cancelled at the first token: the second choice may not have started yet
        if r.HasField("delta") and not cancelled:
            assert disaggregated.stub.Cancel(gateway_pb2.CancelRequest(request_id="grpc-n-cancel")).found
            cancelled = True
        elif r.HasField("completion"):
            ended[r.index] = r.completion.finish_reason
    assert ended == {0: common_pb2.FINISH_REASON_CANCELLED, 1: common_pb2.FINISH_REASON_CANCELLED}

    # A Session runs it beside a plain request, and cancels it by id.
    session = SessionClient(disaggregated)
    session.generate("s-plain", PROMPTS[2], greedy())
    session.generate("s-n", PROMPTS[1], long, n=2)
    got: list[gateway_pb2.SessionResponse] = []
    while {r.index for r in got if r.request_id == "s-n" and r.HasField("delta")} != {0, 1}:
        got.append(session.next())
    session.cancel("s-n")
    got += session.close()
    ends = {(r.request_id, r.index): r.completion.finish_reason for r in got if r.HasField("completion")}
    assert ends[("s-n", 0)] == ends[("s-n", 1)] == common_pb2.FINISH_REASON_CANCELLED
    assert ends[("s-plain", 0)] in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
    for worker in (workers["prefill"], workers["decode"]):
        worker.wait_all_free()


def test_a_calls_choices_are_charged_before_any_runs(scheduled: GatewayThread) -> None:
    """The quota of n choices is charged at the first one's placement, before any token: a tenant
    allowed one request at a time cannot start n=2 (a 400 that says so, nothing run); one allowed two
    runs n=2, and while it runs has no slot left — even before its second choice started."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "n": 2}
    status, _, out = http_json(scheduled, "/v1/completions", body, headers={"x-api-key": TINY_KEY})
    assert (
        status == 400 and "2 requests at once but tenant 'tiny' may run at most 1" in out["error"]["message"]
    )
    status, _, out = http_json(scheduled, "/v1/completions", body, headers={"x-api-key": PAIR_KEY})
    assert status == 200 and len(out["choices"]) == 2, out

    held = {**body, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    conn, events = sse_events(scheduled, "/v1/completions", held, headers={"x-api-key": PAIR_KEY})
    next(events)  # the first choice runs; both slots are the call's
    single = {"prompt": PROMPTS[0], "max_tokens": 2}
    status, _, out = http_json(scheduled, "/v1/completions", single, headers={"x-api-key": PAIR_KEY})
    assert status == 429, out
    conn.close()  # the call ends: its choices' slots come back
    eventually(
        lambda: http_json(scheduled, "/v1/completions", single, headers={"x-api-key": PAIR_KEY})[0] == 200,
        10,
        "the call's slots given back",
        interval_s=0.05,
    )
