"""Failover through the cluster scheduler: a real redis-server, a real `baton scheduler`, real worker
processes (tiny model, tcp KV transport) that register and heartbeat there and listen on the
cancellation bus, and a gateway that places every request with the scheduler.

* A decode worker killed mid-stream: its streams migrate (the new worker recomputes the tokens already
  sent) and every client still gets exactly the offline output; the other worker's streams never notice;
  the dead worker leaves placement within the heartbeat timeout.
* A prefill worker killed with prefills queued: they run on the other one; outputs equal offline.
* Redis killed: the stream in flight finishes, a new request gets a clear 503 / UNAVAILABLE, and once
  Redis is back (empty) the workers re-register and service resumes without restarting anything.
* The scheduler killed: the same, until it is started again.
* Cancels reach the workers through the scheduler's cancellation bus.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import harness
import jsonschema
import pytest
from conftest import make_tiny_checkpoint
from harness import (
    SLACK_S,
    GatewayThread,
    SchedulerProcess,
    SessionClient,
    WorkerProcess,
    eventually,
    free_port,
    grpc_generate,
    http_json,
    metric,
    on_redis,
)

from baton.v1 import common_pb2, gateway_pb2, scheduler_pb2, worker_pb2
from core.sampling_params import SamplingParams
from rpc.liveness import KEEPALIVE_S
from scheduler.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.redis]

HEARTBEAT_TIMEOUT_S = 2.0  # the scheduler's; workers heartbeat every third of it
MIGRATE_TOKENS = 450  # long enough that every stream is still running when its worker dies
NUM_STREAMS = 8
PREFILL_TOKENS = 16
LONG_PROMPT_WORDS = 200  # about 250 tokens
# A probe's Place answers in milliseconds when a worker is free; 2 s lets a busy scheduler answer too.
PROBE_TIMEOUT_S = 2.0
FROZEN_S = 120.0  # the gateway's keepalive where a test freezes a worker before it kills it


def _prompt(i: int) -> str:
    return f"Request {i}: continuous batching keeps accelerators busy while sequences come and go."


def _long_prompt(i: int) -> str:
    words = "the quick brown fox jumps over the lazy dog Paris Berlin capital France Germany".split()
    return f"Long prompt {i}: " + " ".join(words[(i * 7 + k) % len(words)] for k in range(LONG_PROMPT_WORDS))


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


# --- the cluster -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a 2,048-token context: an OpenAI call with tools carries a few hundred tokens
    of tool descriptions in the tiny tokenizer's tokens."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-long"), "llama", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    """This module's own redis-server: a test kills it."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def scheduler(redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    # A burst is dispatched to the workers at once (no prefill admission limit), so that a worker dies
    # with work queued on it; the admission limits are unit-tested and measured by the Tenancy benchmark.
    proc = SchedulerProcess(
        redis.url,
        tmp_path_factory.mktemp("scheduler"),
        "--port",
        str(free_port()),  # a fixed port, so that a test can restart it where workers look for it
        "--heartbeat-timeout-s",
        str(HEARTBEAT_TIMEOUT_S),
        "--local-prefill-threshold",
        "8",
        "--max-prefill-queue",
        "64",
    )
    try:
        proc.wait_ready(time.monotonic() + 60)
        yield proc
    finally:
        proc.stop()


class Cluster(harness.Cluster):
    """Workers registered with the module's scheduler (which outlives them), and a gateway that places
    through it."""

    def __init__(self, scheduler: SchedulerProcess, redis: RedisServer, model: Path, log_dir: Path) -> None:
        super().__init__(redis.url, log_dir, scheduler=scheduler)
        self.redis, self.model = redis, model

    def start(self, *roles: str, flags: tuple[str, ...] = (), keepalive_s: float = FROZEN_S) -> GatewayThread:
        """Workers of ``roles`` and a gateway. A worker that tests freeze (SIGSTOP) before they kill it
        must not be found lost while frozen: by default the gateway's keepalive outlasts the freeze
        (what those tests show is a kill); the hung-worker test gives it the default's."""
        self.add_workers(self.model, *roles, flags=flags)
        return self.start_gateway(
            self.model,
            max_output_tokens=MIGRATE_TOKENS + 50,
            max_session_requests=32,
            worker_keepalive_s=keepalive_s,
        )

    def stop(self) -> None:
        super().stop()
        # The next test starts from an empty placement (stopped workers drain, then expire).
        eventually(
            lambda: self.scheduler.num_workers() == 0, HEARTBEAT_TIMEOUT_S + SLACK_S, "workers expired"
        )


@pytest.fixture
def cluster(
    scheduler: SchedulerProcess, redis: RedisServer, tiny_model: Path, tmp_path: Path
) -> Iterator[Cluster]:
    with Cluster(scheduler, redis, tiny_model, tmp_path) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> dict[str, Any]:
    """What the engine produces offline for the same prompts (greedy, ignore_eos)."""
    from engine import LLM

    llm = LLM(str(tiny_model), kv_cache_memory=32 << 20, dtype="float32", num_threads=1)
    streams = llm.generate(
        [_prompt(i) for i in range(NUM_STREAMS)],
        SamplingParams(max_tokens=MIGRATE_TOKENS, temperature=0, ignore_eos=True),
    )
    # Long prompts whose first output token is a whole character: a P → D handoff whose first token is
    # part of one shows that token's text twice, failover or not (test_gateway's xfail).
    firsts = llm.generate([_long_prompt(i) for i in range(64)], SamplingParams(max_tokens=1, temperature=0))
    whole = [i for i, o in enumerate(firsts) if "\ufffd" not in o.text][:NUM_STREAMS]
    long = llm.generate(
        [_long_prompt(i) for i in whole],
        SamplingParams(max_tokens=PREFILL_TOKENS, temperature=0, ignore_eos=True),
    )
    return {
        "streams": [(o.token_ids, o.text) for o in streams],
        "long_prompts": [_long_prompt(i) for i in whole],
        "long": [(o.token_ids, o.text) for o in long],
        "long_prompt_tokens": [len(llm.tokenizer.encode(_long_prompt(i))) for i in whole],
    }


class Streams:
    """Many requests multiplexed on one gRPC Session: tokens, text, completion or error per request."""

    def __init__(self, gw: GatewayThread) -> None:
        self.session = SessionClient(gw)
        self.ids: dict[str, list[int]] = {}
        self.text: dict[str, str] = {}
        self.completions: dict[str, Any] = {}
        self.errors: dict[str, Any] = {}

    def start(self, rid: str, prompt: str, sampling: common_pb2.SamplingParams) -> None:
        self.ids[rid], self.text[rid] = [], ""
        self.session.generate(rid, prompt, sampling)

    def read_until(self, done: Callable[[], bool]) -> None:
        while not done():
            msg = self.session.next()
            if msg.HasField("delta"):
                self.ids[msg.request_id] += msg.delta.token_ids
                self.text[msg.request_id] += msg.delta.text
            elif msg.HasField("completion"):
                self.completions[msg.request_id] = msg.completion
            else:
                self.errors[msg.request_id] = msg.error

    def ended(self) -> bool:
        return len(self.completions) + len(self.errors) == len(self.ids)

    def finish(self) -> None:
        self.read_until(self.ended)
        assert self.session.close() == []


def set_draining(redis_url: str, address: str, draining: bool) -> None:
    """Sets the scheduler's drain flag of a worker: placement sends it no new requests while set."""
    from scheduler.registry import WorkerRegistry

    assert on_redis(redis_url, lambda client: WorkerRegistry(client).set_draining(address, draining))


def probe_place(scheduler: SchedulerProcess, exclude: str = "") -> str:
    """The decode worker the scheduler would pick now (a placement it is told at once is finished)."""
    assert scheduler.stub is not None
    rid = f"probe-{time.monotonic_ns()}"
    time.sleep(0.05)  # past the scheduler's freshness window, so that probing refreshes its view
    try:  # a Place that finds no worker waits in the scheduler's queue: give up at once
        placed = scheduler.stub.Place(
            scheduler_pb2.PlaceRequest(
                request_id=rid,
                prompt_token_ids=[1] * 20,
                max_tokens=1,
                exclude_workers=[exclude] if exclude else [],
            ),
            timeout=PROBE_TIMEOUT_S,
        )
    except grpc.RpcError:
        return ""
    scheduler.stub.Finish(
        scheduler_pb2.FinishRequest(request_id=rid, tenant=placed.tenant, prompt_tokens=20), timeout=5
    )
    return str(placed.decode_worker)


def steer(cluster: Cluster, to: WorkerProcess, away: WorkerProcess) -> None:
    """New requests go to ``to``: ``away`` is drained until the next steer (placement reads the flag)."""
    set_draining(cluster.redis.url, away.address, True)
    set_draining(cluster.redis.url, to.address, False)
    eventually(
        lambda: probe_place(cluster.scheduler) == to.address,
        5 + SLACK_S,
        "the scheduler sees the drain flags",
    )


def ledgers(redis_url: str) -> dict[str, Any]:
    """What the scheduler's ledgers say: leases ever pinned, leases still active, cancels published,
    and the default tenant's requests in flight."""
    from scheduler.leases import LeaseLedger, LeaseState
    from scheduler.quota import QuotaLedger
    from scheduler.tenants import TenantDirectory

    async def read(client: Any) -> dict[str, Any]:
        leases = LeaseLedger(client)
        counts, totals = await leases.counts(), await leases.totals()
        tenant = await TenantDirectory(client).get_tenant("default")
        assert tenant is not None
        return {
            "pinned_ever": totals[LeaseState.PINNED],
            "active": counts[LeaseState.PINNED] + counts[LeaseState.PULLING],
            "ended": {s.value: counts[s] for s in LeaseState if not s.active},
            "in_flight": (await QuotaLedger(client).usage(tenant)).concurrent,
        }

    return on_redis(redis_url, read)


def is_cancelled(redis_url: str, request_id: str) -> bool:
    from scheduler.cancel import CancellationBus

    return on_redis(redis_url, lambda client: CancellationBus(client).is_cancelled(request_id))


def settled(redis_url: str, before: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ledgers once the gateway's fire-and-forget reports have landed: no active lease and nothing in
    flight — or, given the ledgers ``before`` the test, no more than then (the scheduler-outage test
    loses a request's Finish and lease reports by design: they stay until their TTL and the reaper)."""
    state: dict[str, Any] = {}
    active, in_flight = (before["active"], before["in_flight"]) if before else (0, 0)

    def check() -> bool:
        state.update(ledgers(redis_url))
        return state["active"] <= active and state["in_flight"] <= in_flight

    try:
        eventually(check, 10, "leases ended and quotas credited")
    except AssertionError as e:
        raise AssertionError(f"{e}; ledgers: {state}") from None  # what was left, for the diagnosis
    return state


def routes(gw: GatewayThread, rids: list[str]) -> dict[str, str]:
    """The decode worker each request in flight runs on (read on the gateway's loop)."""

    async def read() -> dict[str, str]:
        out = {}
        for rid in rids:
            route = gw.server.dispatcher.route_of(rid)
            if route is not None:
                out[rid] = route.decode
        return out

    result: dict[str, str] = gw._call(read(), 10)
    return result


def migrations_logged(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    """Request id -> migrations, from the gateway's one log line per finished request."""
    found = {}
    for record in caplog.records:
        match = re.match(r"request (\S+) finished: .* migrations=(\d+)", record.getMessage())
        if match:
            found[match.group(1)] = int(match.group(2))
    return found


# --- a decode worker dies mid-stream ---------------------------------------------------------------


def test_streams_of_a_killed_decode_worker_migrate(
    cluster: Cluster, offline: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.gateway.dispatch")
    gw = cluster.start("prefill", "decode", "decode")
    prefill, *decoders = cluster.workers
    before = metric("baton_gateway_migrations_total")
    streams = Streams(gw)
    rids = [f"m{i}" for i in range(NUM_STREAMS)]
    # Half the streams on each decode worker, steered with the scheduler's drain flag (an operator's
    # tool): requests sent at once would all go to one worker, whose load the scheduler learns only
    # from its next heartbeat. The first wave's worker is then frozen (SIGSTOP) until it is killed: on a
    # quiet machine the tiny model finishes a stream in about a second, sooner than the second wave is
    # steered, and the kill must find its streams running.
    for n, (to, away) in enumerate([decoders, decoders[::-1]]):
        steer(cluster, to, away)
        wave = rids[n * NUM_STREAMS // 2 : (n + 1) * NUM_STREAMS // 2]
        for rid in wave:
            streams.start(rid, _prompt(rids.index(rid)), greedy(MIGRATE_TOKENS))
        streams.read_until(lambda w=wave: all(len(streams.ids[r]) >= 3 for r in w))
        if n == 0:
            os.kill(to.proc.pid, signal.SIGSTOP)
    placed = routes(gw, rids)
    assert set(placed.values()) == {d.address for d in decoders}, (
        f"both decode workers must hold streams: {placed}"
    )
    victim = decoders[0]  # the first wave's (the second wave's worker takes new work)
    on_victim = sorted(r for r, a in placed.items() if a == victim.address)
    tokens_at_kill = {r: len(streams.ids[r]) for r in rids}
    victim.kill()
    killed_at = time.monotonic()

    streams.finish()
    assert streams.errors == {}
    for i, rid in enumerate(rids):  # no duplicated, no missing token
        assert (streams.ids[rid], streams.text[rid]) == offline["streams"][i], rid
        assert streams.completions[rid].usage.completion_tokens == MIGRATE_TOKENS
    assert all(tokens_at_kill[r] < MIGRATE_TOKENS for r in on_victim)
    logged = migrations_logged(caplog)
    assert {r: logged[r] for r in rids} == {r: int(r in on_victim) for r in rids}
    assert metric("baton_gateway_migrations_total") == before + len(on_victim)

    # The dead worker leaves placement by itself; requests then never go there.
    left_s = eventually(
        lambda: cluster.scheduler.num_workers() == 2, HEARTBEAT_TIMEOUT_S + SLACK_S, "eviction"
    )
    left_s = time.monotonic() - killed_at
    ids, text, _ = grpc_generate(
        gw, gateway_pb2.GenerateRequest(prompt=_prompt(0), sampling=greedy(MIGRATE_TOKENS))
    )
    assert (ids, text) == offline["streams"][0]
    for worker in (prefill, *(d for d in decoders if d is not victim)):
        worker.wait_all_free()
    ledger = settled(cluster.redis.url)
    assert ledger["pinned_ever"] >= NUM_STREAMS and ledger["ended"]["released"] >= NUM_STREAMS, ledger
    assert not [r for r in caplog.records if "scheduler" in r.getMessage() and "failed" in r.getMessage()]
    print(
        f"\n{len(on_victim)} of {NUM_STREAMS} streams migrated (killed after "
        f"{min(tokens_at_kill[r] for r in on_victim)}–{max(tokens_at_kill[r] for r in on_victim)} tokens); "
        f"the dead worker left placement {left_s:.2f} s after the kill (heartbeat timeout {HEARTBEAT_TIMEOUT_S} s)"
    )


# --- a decode worker hangs past its heartbeat timeout (SIGSTOP), then wakes (SIGCONT) -------------------


def _epoch(redis_url: str, worker: WorkerProcess) -> int:
    """The epoch of the worker's registration in the registry (0: it has none now)."""
    from scheduler.registry import WorkerRegistry

    view = on_redis(redis_url, lambda client: WorkerRegistry(client).get(worker.address))
    return 0 if view is None else view.epoch


def test_a_hung_decode_worker_is_routed_around_and_fenced_when_it_wakes(
    cluster: Cluster, offline: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A decode worker frozen mid-stream keeps its connections open, so nothing fails: the gateway's
    keepalive finds it lost and each of its streams migrates token-exactly. Woken long past its
    heartbeat timeout, its first heartbeat is refused (the registry evicted it) and it is fenced: it
    ends whatever it still held — nothing of it reaches a client, whose streams went on elsewhere —
    refuses a call placed on its old epoch, and registers again under a new one, which serves."""
    caplog.set_level(logging.INFO, logger="services.gateway.dispatch")
    gw = cluster.start("prefill", "decode", "decode", keepalive_s=KEEPALIVE_S)
    prefill, hung, other = cluster.workers
    epoch = _epoch(cluster.redis.url, hung)
    assert epoch > 0
    before = metric("baton_gateway_migrations_total")
    steer(cluster, hung, other)
    streams = Streams(gw)
    rids = [f"h{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        streams.start(rid, _prompt(i), greedy(MIGRATE_TOKENS))
    streams.read_until(lambda: all(len(streams.ids[r]) >= 3 for r in rids))
    os.kill(hung.proc.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    on_hung = routes(gw, rids)
    tokens_at_stop = {r: len(streams.ids[r]) for r in rids}
    set_draining(cluster.redis.url, other.address, False)  # the other worker takes work again
    streams.finish()
    detected_s = time.monotonic() - stopped_at  # to the end of the last migrated stream
    assert set(on_hung.values()) == {hung.address}, on_hung
    assert streams.errors == {}
    for i, rid in enumerate(rids):  # 0 lost, 0 duplicated
        assert (streams.ids[rid], streams.text[rid]) == offline["streams"][i], rid
    assert all(n < MIGRATE_TOKENS for n in tokens_at_stop.values()), tokens_at_stop
    assert {r: migrations_logged(caplog)[r] for r in rids} == {r: 1 for r in rids}
    assert metric("baton_gateway_migrations_total") == before + len(rids)
    eventually(lambda: cluster.scheduler.num_workers() == 2, HEARTBEAT_TIMEOUT_S + SLACK_S, "eviction")
    assert time.monotonic() - stopped_at > HEARTBEAT_TIMEOUT_S

    os.kill(hung.proc.pid, signal.SIGCONT)
    woke_at = time.monotonic()
    eventually(lambda: _epoch(cluster.redis.url, hung) > epoch, 30, "the woken worker registered again")
    rejoined_s = time.monotonic() - woke_at
    log = hung.log_path.read_text()
    assert f"fenced out of epoch {epoch}" in log, log[-3000:]
    new_epoch = _epoch(cluster.redis.url, hung)
    hung.wait_all_free()  # what the frozen worker held is gone
    url = re.search(r"metrics on (http://\S+)", log)
    assert url is not None
    assert harness.Scrape(url.group(1)).value("baton_worker_fenced_total") == 1

    def late_call(on_epoch: int) -> list[int]:  # a Decode placed on one of the worker's registrations
        assert hung.stub is not None
        request = worker_pb2.DecodeRequest(
            request_id=f"late-{on_epoch}", prompt_token_ids=[5, 6, 7], sampling=greedy(4), epoch=on_epoch
        )
        return [t for m in hung.stub.Decode(request, timeout=30) for t in m.delta.token_ids]

    with pytest.raises(grpc.RpcError) as refused:
        late_call(epoch)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "fenced" in (refused.value.details() or ""), refused.value.details()
    assert len(late_call(new_epoch)) == 4
    steer(cluster, hung, other)  # placement uses it again, on its new registration
    assert (
        grpc_generate(gw, gateway_pb2.GenerateRequest(prompt=_prompt(0), sampling=greedy(MIGRATE_TOKENS)))[:2]
        == offline["streams"][0]
    )
    for worker in cluster.workers:
        worker.wait_all_free()
    settled(cluster.redis.url)
    print(
        f"\nhung decode worker: {len(rids)} streams migrated token-exactly, the last done {detected_s:.1f} s "
        f"after the freeze (keepalive {KEEPALIVE_S:g} s); woken, fenced out of epoch {epoch} and "
        f"registered again as epoch {new_epoch} in {rejoined_s:.2f} s; a call on the old epoch refused"
    )


# Each OpenAI case: its endpoint and body; every output is long enough to be mid-way at the kill.
LONG_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 80,
    "maxItems": 80,
}
# ~380 tokens each with the tiny model's tokenizer (max_tokens is 450): long enough that both choices
# are still decoding when the test looks, even when a loaded machine prefills the second one after the
# first has run for a while (at ~170 tokens a choice could end before its sibling started).
LONG_CHOICES = [" ".join(["alpha beta gamma"] * 28), " ".join(["delta epsilon"] * 32)]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "record",
            # Required: the arguments are long (80 values), never an empty object that ends the call early.
            "parameters": {"type": "object", "properties": {"values": LONG_SCHEMA}, "required": ["values"]},
        },
    }
]
COMPLETION = {"prompt": _prompt(3), "max_tokens": MIGRATE_TOKENS, "temperature": 1.0, "seed": 77}
OPENAI_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "free": ("/v1/completions", {**COMPLETION, "ignore_eos": True}),
    "json-schema": ("/v1/completions", {**COMPLETION, "guided_json": LONG_SCHEMA}),
    "regex": ("/v1/completions", {**COMPLETION, "guided_regex": "([a-z]{3}-[0-9]{2} ){60}"}),
    "choice": ("/v1/completions", {**COMPLETION, "guided_choice": LONG_CHOICES}),
    "echo-logprobs": ("/v1/completions", {**COMPLETION, "ignore_eos": True, "echo": True, "logprobs": 1}),
    "tool-required": (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": _prompt(3)}],
            "max_tokens": MIGRATE_TOKENS,
            "temperature": 1.0,
            "seed": 77,
            "tools": TOOLS,
            "tool_choice": "required",
        },
    ),
}


def _choice_outputs(path: str, events: Iterator[Any]) -> tuple[list[str], Any]:
    """Each choice's text (a chat's content and tool-call arguments) and the last usage, read to [DONE]."""
    texts, usage = ["", ""], None
    for event in events:
        if event == "[DONE]":
            break
        assert "error" not in event, event
        for c in event["choices"]:
            if path == "/v1/completions":
                texts[c["index"]] += c["text"]
            else:
                delta = c["delta"]
                texts[c["index"]] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    texts[c["index"]] += call["function"].get("name", "") + call["function"].get(
                        "arguments", ""
                    )
        usage = event.get("usage") or usage
    return texts, usage


def _single_output(path: str, out: dict[str, Any]) -> str:
    choice = out["choices"][0]
    if path == "/v1/completions":
        return str(choice["text"])
    calls = choice["message"].get("tool_calls") or []
    return (choice["message"]["content"] or "") + "".join(
        c["function"]["name"] + c["function"]["arguments"] for c in calls
    )


def _tokens_so_far(gw: GatewayThread, rids: list[str]) -> list[int]:
    """Tokens each request in flight has produced (read on the gateway's loop), 0 for one not in flight."""

    async def read() -> list[int]:
        streams = gw.server.dispatcher._in_flight
        return [streams[r].num_tokens if r in streams else 0 for r in rids]

    result: list[int] = gw._call(read(), 10)
    return result


@pytest.mark.parametrize("case", list(OPENAI_CASES))
def test_the_choices_of_an_openai_call_migrate_token_exactly(cluster: Cluster, case: str) -> None:
    """An OpenAI call with n=2 seeded choices, sampled at temperature 1, both decoding on a decode worker
    that is killed mid-stream: each choice continues on the other decode worker and the client gets
    exactly what an uninterrupted single request with that choice's seed (s + j) gives. Under a JSON
    schema, a regex, a choice or a required tool call, the grammar's state moves with each choice (the
    new worker replays the tokens sent); with echo and logprobs, the prompt's logprobs came with the
    first token and are not sent again."""
    path, body = OPENAI_CASES[case]
    gw = cluster.start("prefill", "decode", "decode")
    _, first, second = cluster.workers
    steer(cluster, first, second)
    migrations = metric("baton_gateway_migrations_total")
    call_id = f"mig-{case}"
    conn, events = harness.sse_events(gw, path, {**body, "n": 2, "stream": True}, {"X-Request-Id": call_id})
    children = [f"{call_id}-0", f"{call_id}-1"]
    eventually(lambda: min(_tokens_so_far(gw, children)) >= 3, 30, "both choices decoding")
    os.kill(first.proc.pid, signal.SIGSTOP)  # frozen until killed: the tiny model is quick
    _let_back_in(cluster)
    first.kill()
    texts, usage = _choice_outputs(path, events)
    conn.close()
    assert usage is not None
    assert metric("baton_gateway_migrations_total") == migrations + 2  # both choices moved
    for j in range(2):
        status, _, single = http_json(gw, path, {**body, "seed": 77 + j})
        assert status == 200, single
        assert texts[j] == _single_output(path, single), (case, j)
    if case == "free":
        assert usage["completion_tokens"] == 2 * MIGRATE_TOKENS
    if case == "json-schema":
        for text in texts:
            jsonschema.validate(json.loads(text), LONG_SCHEMA)
    if case == "regex":
        assert all(re.fullmatch("([a-z]{3}-[0-9]{2} ){60}", t) for t in texts), texts
    if case == "choice":
        assert set(texts) <= set(LONG_CHOICES)
    if case == "echo-logprobs":
        assert all(t.startswith(_prompt(3)) for t in texts)
    if case == "tool-required":
        assert all(t.startswith("record") for t in texts)
        for t in texts:  # "record" then its arguments: one call each here, or several
            assert json.loads(t.removeprefix("record").split("record")[0]) is not None
    second.wait_all_free()


# --- a prefill worker dies with prefills queued ----------------------------------------------------


def test_prefills_of_a_killed_prefill_worker_run_on_the_other(
    cluster: Cluster, offline: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.gateway.dispatch")
    # A small step budget queues the long prompts on the prefill worker, so it dies with work waiting.
    gw = cluster.start(
        "prefill", "prefill", "decode", flags=("--max-num-batched-tokens", "32", "--max-num-seqs", "8")
    )
    *prefills, decode = cluster.workers
    retries_before = metric("baton_gateway_worker_retries_total", {"stage": "prefill"}) + metric(
        "baton_gateway_kv_transfer_retries_total"
    )
    streams = Streams(gw)
    rids = [f"p{i}" for i in range(NUM_STREAMS)]
    for rid, prompt in zip(rids, offline["long_prompts"], strict=True):
        streams.start(rid, prompt, greedy(PREFILL_TOKENS))
    found: list[tuple[WorkerProcess, int]] = []

    def queued_on_one() -> bool:
        for worker in prefills:
            info = worker.info()
            if info.num_running + info.num_waiting >= 2:
                found.append((worker, info.num_running + info.num_waiting))
                return True
        return False

    # Polled without a pause: the prefills stay queued only while the burst is prefilled.
    eventually(queued_on_one, 10, "no prefill worker ever had prefills queued", interval_s=0)
    victim, queued = found[0]
    victim.kill()

    streams.finish()
    assert streams.errors == {}
    for i, rid in enumerate(rids):
        assert (streams.ids[rid], streams.text[rid]) == offline["long"][i], rid
    survivor = next(p for p in prefills if p is not victim)
    last_prefill = {}
    for record in caplog.records:
        match = re.match(r"request (\S+) placed: prefill=(\S+)", record.getMessage())
        if match:
            last_prefill[match.group(1)] = match.group(2)
    assert {last_prefill[r] for r in rids} == {survivor.address}  # every request ended up prefilled there
    retried = (
        metric("baton_gateway_worker_retries_total", {"stage": "prefill"})
        + metric("baton_gateway_kv_transfer_retries_total")
        - retries_before
    )
    assert retried >= 1
    for worker in (*(p for p in prefills if p is not victim), decode):
        worker.wait_all_free()
    settled(cluster.redis.url)
    print(
        f"\nprefill worker killed with {queued} prefills queued ({min(offline['long_prompt_tokens'])}+ "
        f"token prompts); {retried:.0f} requests re-placed, all {NUM_STREAMS} equal offline"
    )


def test_a_draining_prefill_worker_hands_its_prefills_and_leases_back(
    cluster: Cluster, offline: dict[str, Any]
) -> None:
    """SIGTERM (drain timeout 0) to a prefill worker with prefills queued: what it was computing ends
    with WorkerDraining and is prefilled on the other prefill worker, the leases no decode worker had
    pulled are given up (a pull that then fails gets a fresh prefill), it exits within its grace period
    holding no block, and every request still equals offline."""
    gw = cluster.start(
        "prefill",
        "prefill",
        "decode",
        flags=("--max-num-batched-tokens", "32", "--max-num-seqs", "8", "--drain-timeout-s", "0"),
    )
    *prefills, decode = cluster.workers
    before_ledgers = ledgers(cluster.redis.url)
    retries_before = metric("baton_gateway_worker_retries_total", {"stage": "prefill"}) + metric(
        "baton_gateway_kv_transfer_retries_total"
    )
    streams = Streams(gw)
    rids = [f"q{i}" for i in range(NUM_STREAMS)]
    for rid, prompt in zip(rids, offline["long_prompts"], strict=True):
        streams.start(rid, prompt, greedy(PREFILL_TOKENS))
    found: list[WorkerProcess] = []

    def queued_on_one() -> bool:
        found.extend(w for w in prefills if (i := w.info()).num_running + i.num_waiting >= 2)
        return bool(found)

    eventually(queued_on_one, 10, "no prefill worker ever had prefills queued", interval_s=0)
    victim = found[0]
    exited_s, drained = _terminate(victim, 0.0)

    streams.finish()
    assert streams.errors == {}
    for i, rid in enumerate(rids):
        assert (streams.ids[rid], streams.text[rid]) == offline["long"][i], rid
    retried = (
        metric("baton_gateway_worker_retries_total", {"stage": "prefill"})
        + metric("baton_gateway_kv_transfer_retries_total")
        - retries_before
    )
    handed = re.search(r"(\d+) requests handed back, (\d+) leases given up, 0 of", drained)
    assert handed is not None and int(handed[1]) + int(handed[2]) >= 1, drained  # it held something
    assert retried >= 1
    for worker in (*(p for p in prefills if p is not victim), decode):
        worker.wait_all_free()
    settled(cluster.redis.url, before_ledgers)
    print(
        f"\nprefill worker drained: {drained}; exited {exited_s:.1f} s after SIGTERM; {retried:.0f} re-placed"
    )


# --- cancels go through the bus -------------------------------------------------------------------


def test_cancels_are_published_on_the_bus(cluster: Cluster, offline: dict[str, Any]) -> None:
    """A cancel published on the bus (as another gateway replica, or a gateway whose own call
    cancellation was lost, would) stops the stream at the worker; the gateway's own cancels are
    published there too; leases end and the tenant's quota is credited."""
    gw = cluster.start("prefill", "decode")
    assert cluster.scheduler.stub is not None

    def long_stream(rid: str) -> Any:
        """A stream that the decode worker is running (it streamed tokens after the first)."""
        responses = gw.stub.Generate(
            gateway_pb2.GenerateRequest(request_id=rid, prompt=_prompt(3), sampling=greedy(MIGRATE_TOKENS)),
            timeout=60,
        )
        num_tokens = 0
        while num_tokens < 3:
            num_tokens += len(next(responses).delta.token_ids)
        return responses

    responses = long_stream("via-bus")
    t0 = time.perf_counter()
    assert cluster.scheduler.stub.Cancel(
        scheduler_pb2.SchedulerCancelRequest(request_id="via-bus", reason="test"), timeout=5
    ).first
    last = list(responses)[-1]
    dropped_ms = (time.perf_counter() - t0) * 1e3
    assert last.completion.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert last.completion.usage.completion_tokens < MIGRATE_TOKENS

    responses = long_stream("via-gateway")
    assert gw.stub.Cancel(gateway_pb2.CancelRequest(request_id="via-gateway")).found
    assert list(responses)[-1].completion.finish_reason == common_pb2.FINISH_REASON_CANCELLED
    eventually(lambda: is_cancelled(cluster.redis.url, "via-gateway"), 5, "the gateway's cancel on the bus")
    for worker in cluster.workers:
        worker.wait_all_free()
    ledger = settled(cluster.redis.url)
    print(f"\na cancel from the bus ended the stream at the worker in {dropped_ms:.0f} ms; ledgers: {ledger}")


# --- Redis goes down and comes back ----------------------------------------------------------------


def test_a_redis_outage_stops_admission_and_heals(
    cluster: Cluster, redis: RedisServer, offline: dict[str, Any]
) -> None:
    gw = cluster.start("decode")
    (worker,) = cluster.workers
    in_flight = gw.stub.Generate(
        gateway_pb2.GenerateRequest(prompt=_prompt(1), sampling=greedy(MIGRATE_TOKENS)), timeout=60
    )
    first = next(in_flight)
    assert first.HasField("delta")
    redis.kill()

    t0 = time.monotonic()
    body = {"prompt": _prompt(2), "max_tokens": 4, "temperature": 0}
    status, _, out = http_json(gw, "/v1/completions", body)
    refused_s = time.monotonic() - t0
    assert status == 503 and out["error"]["type"] == "unavailable", out
    assert "cannot place the request now" in out["error"]["message"], out
    with pytest.raises(grpc.RpcError) as info:
        grpc_generate(gw, gateway_pb2.GenerateRequest(prompt=_prompt(2), sampling=greedy(4)))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "scheduler" in (info.value.details() or "")
    assert http_json(gw, "/health")[0] == 503

    rest = list(in_flight)  # the stream in flight finishes untouched
    ids = list(first.delta.token_ids) + [t for m in rest if m.HasField("delta") for t in m.delta.token_ids]
    assert ids == offline["streams"][1][0]
    assert rest[-1].completion.finish_reason == common_pb2.FINISH_REASON_LENGTH

    redis.start()  # empty, on the same port: workers re-register, the scheduler re-creates its tenant
    back_at = time.monotonic()

    seen: list[int] = []  # statuses while the cluster re-forms

    def served() -> bool:
        seen.append(http_json(gw, "/v1/completions", body)[0])
        return seen[-1] == 200 and cluster.scheduler.num_workers() == 1  # re-registered, not a stale view

    resumed_s = eventually(served, 30, "service after Redis came back")
    ids, text, _ = grpc_generate(
        gw, gateway_pb2.GenerateRequest(prompt=_prompt(1), sampling=greedy(MIGRATE_TOKENS))
    )
    assert (ids, text) == offline["streams"][1]
    assert time.monotonic() - back_at < 30
    worker.wait_all_free()
    print(
        f"\nRedis down: a new request was refused (503: {out['error']['message']!r}) in "
        f"{refused_s * 1e3:.0f} ms; the stream in flight finished ({len(ids)} tokens); service resumed "
        f"{resumed_s:.2f} s after Redis came back (statuses meanwhile: {sorted(set(seen))})"
    )


# --- the scheduler goes down and comes back --------------------------------------------------------


def test_a_scheduler_outage_stops_admission_and_heals(cluster: Cluster, offline: dict[str, Any]) -> None:
    gw = cluster.start("prefill", "decode")
    in_flight = gw.stub.Generate(
        gateway_pb2.GenerateRequest(prompt=_prompt(1), sampling=greedy(MIGRATE_TOKENS)), timeout=60
    )
    first = next(in_flight)
    cluster.scheduler.kill()

    body = {"prompt": _prompt(2), "max_tokens": 4, "temperature": 0}
    status, _, out = http_json(gw, "/v1/completions", body)
    assert status == 503 and "cannot place the request now" in out["error"]["message"], out
    assert cluster.scheduler.address in out["error"]["message"]
    rest = list(in_flight)  # the stream in flight finishes untouched (its Finish report is lost)
    ids = list(first.delta.token_ids) + [t for m in rest if m.HasField("delta") for t in m.delta.token_ids]
    assert ids == offline["streams"][1][0]

    cluster.scheduler.restart(time.monotonic() + 60)
    back_at = time.monotonic()
    resumed_s = eventually(
        lambda: http_json(gw, "/v1/completions", body)[0] == 200, 30, "service after restart"
    )
    for worker in cluster.workers:
        worker.wait_all_free()
    print(
        f"\nscheduler down: 503 ({out['error']['message']!r}); the stream in flight finished; service "
        f"resumed {resumed_s:.2f} s after the scheduler came back ({time.monotonic() - back_at:.2f} s)"
    )


# --- a decode worker drains (SIGTERM: a scale-down, a rolling update) ------------------------------

DRAIN_EXIT_SLACK_S = 5.0  # drain timeout + this: the grace period a pod would be given (the chart's margin)


def _all_on_one_decode_worker(
    cluster: Cluster, gw: GatewayThread, rids: list[str], max_tokens: int
) -> Streams:
    """Starts a stream per id, every one on the first decode worker (the second is steered away: call
    `_let_back_in` before the streams need it); returns once each has a few tokens."""
    _, first, second = cluster.workers
    steer(cluster, first, second)
    streams = Streams(gw)
    for i, rid in enumerate(rids):
        streams.start(rid, _prompt(i), greedy(max_tokens))
    streams.read_until(lambda: all(len(streams.ids[r]) >= 3 for r in rids))
    assert set(routes(gw, rids).values()) == {first.address}, routes(gw, rids)
    return streams


def _let_back_in(cluster: Cluster) -> None:
    """The second decode worker takes work again (placement sees it)."""
    _, first, second = cluster.workers
    set_draining(cluster.redis.url, second.address, False)
    eventually(
        lambda: probe_place(cluster.scheduler, exclude=first.address) == second.address,
        5 + SLACK_S,
        "the second decode worker back in placement",
    )


def _terminate(worker: WorkerProcess, drain_timeout_s: float) -> tuple[float, str]:
    """SIGTERM, as Kubernetes sends it; seconds until the process exited, and its drain line."""
    worker.proc.terminate()
    start = time.monotonic()
    worker.proc.wait(drain_timeout_s + DRAIN_EXIT_SLACK_S)  # TimeoutExpired: it overran its grace period
    exited_s = time.monotonic() - start
    match = re.search(r"drained in .*", worker.log_path.read_text())
    assert match is not None, worker.log_path.read_text()[-2000:]
    return exited_s, match.group(0)


def test_a_draining_decode_worker_hands_its_streams_on_token_exactly(
    cluster: Cluster, offline: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Its drain timeout passes with 8 streams mid-way (a timeout of 0: the tiny model finishes a stream
    in about a second): each continues on the other decode worker from the tokens its client has —
    identical to offline, none duplicated — the worker exits within its grace period, and no block is
    left held anywhere."""
    caplog.set_level(logging.INFO, logger="services.gateway.dispatch")
    drain_s = 0.0
    gw = cluster.start("prefill", "decode", "decode", flags=("--drain-timeout-s", str(drain_s)))
    prefill, victim, other = cluster.workers
    before = metric("baton_gateway_migrations_total")
    before_ledgers = ledgers(cluster.redis.url)
    rids = [f"d{i}" for i in range(NUM_STREAMS)]
    streams = _all_on_one_decode_worker(cluster, gw, rids, MIGRATE_TOKENS)
    _let_back_in(cluster)  # before the SIGTERM: with no drain time, the streams move at once
    exited_s, drained = _terminate(victim, drain_s)
    tokens_at_end = {r: len(streams.ids[r]) for r in rids}

    streams.finish()
    assert streams.errors == {}
    for i, rid in enumerate(rids):  # no duplicated, no missing token
        assert (streams.ids[rid], streams.text[rid]) == offline["streams"][i], rid
    moved = [r for r, n in migrations_logged(caplog).items() if r in rids and n == 1]
    assert len(moved) == metric("baton_gateway_migrations_total") - before
    assert moved, f"no stream was handed on (every stream ended within {drain_s} s?): {tokens_at_end}"
    assert re.search(
        rf"{len(moved)} requests handed back, 0 leases given up, 0 of \d+ KV blocks in use", drained
    )
    for worker in (prefill, other):
        worker.wait_all_free()
    settled(cluster.redis.url, before_ledgers)
    print(
        f"\n{len(moved)} of {NUM_STREAMS} streams handed on; the worker exited {exited_s:.1f} s after SIGTERM ({drained})"
    )


def test_a_draining_decode_worker_finishes_its_streams_within_its_grace_period(
    cluster: Cluster, offline: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A drain timeout long enough: its 8 streams finish where they run (nothing moves), it takes no new
    request meanwhile (they go to the other decode worker), and it exits once they have finished."""
    caplog.set_level(logging.INFO, logger="services.gateway.dispatch")
    drain_s = 60.0
    gw = cluster.start("prefill", "decode", "decode", flags=("--drain-timeout-s", str(drain_s)))
    prefill, victim, other = cluster.workers
    before = metric("baton_gateway_migrations_total")
    before_ledgers = ledgers(cluster.redis.url)
    rids = [f"f{i}" for i in range(NUM_STREAMS)]
    streams = _all_on_one_decode_worker(cluster, gw, rids, MIGRATE_TOKENS)
    assert victim.info().num_running == NUM_STREAMS  # ~450 tokens each still to come
    victim.proc.terminate()
    _let_back_in(cluster)
    # Placement leaves it at once: a new request goes to the other decode worker.
    eventually(
        lambda: probe_place(cluster.scheduler) == other.address, 5 + SLACK_S, "the drain seen by placement"
    )
    ids, text, _ = grpc_generate(gw, gateway_pb2.GenerateRequest(prompt=_prompt(0), sampling=greedy(16)))
    assert ids == offline["streams"][0][0][:16]
    streams.finish()
    exited_s, drained = _terminate(victim, drain_s)
    assert streams.errors == {}
    for i, rid in enumerate(rids):
        assert (streams.ids[rid], streams.text[rid]) == offline["streams"][i], rid
    assert metric("baton_gateway_migrations_total") == before
    assert re.search(r"0 requests handed back, 0 leases given up, 0 of \d+ KV blocks in use", drained)
    for worker in (prefill, other):
        worker.wait_all_free()
    settled(cluster.redis.url, before_ledgers)
    print(f"\nall {NUM_STREAMS} streams finished on the draining worker; {drained}")
