"""A gateway that dies (issue 18), on real processes: a real redis-server, `baton scheduler`, a prefill
and a decode worker (tiny model, tcp KV transport) and `baton gateway` as a process of its own, started
the way a user starts it, that places every request with the scheduler.

* **Killed mid-stream**: streams with the client's own request ids run; SIGKILL the gateway. Each
  client gets a clean UNAVAILABLE at once — never a hang — and what it got before is a prefix of the
  offline tokens; the workers free every block. A new gateway process comes up; the same ids re-sent
  are refused ALREADY_EXISTS ("send it again with a new id"), on gRPC and as an HTTP 409 with a JSON
  error body (the HTTP API takes the id from X-Request-Id or Idempotency-Key) — never generated again
  silently — and a new id is served with exactly the offline tokens.
* **Two gateways at once**: the same id sent to two live gateways at the same moment is generated
  once, with exactly the offline tokens; the other gateway's client gets ALREADY_EXISTS and no token.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from harness import (
    GatewayProcess,
    SchedulerProcess,
    WorkerProcess,
    eventually,
    http_json,
    offline_tokens,
    on_redis,
    own_database,
    running_workers,
)

from baton.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from scheduler.calls import ORPHAN_GRACE_S, ORPHAN_RETENTION_S

pytestmark = [pytest.mark.integration, pytest.mark.redis]

MAX_TOKENS = 300  # long enough to be mid-way at the kill, and to overlap at the second gateway
PROMPTS = [
    f"Client {i} keeps its own request id while the gateway talks about rivers and hills" for i in range(4)
]
GREEDY = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
HEARTBEAT_TIMEOUT_S = 60.0
READY_S = 120.0  # a gateway's start on a busy 2-core machine: imports, tokenizer, the scheduler's model


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[list[int]]:
    return offline_tokens(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def cluster(
    redis_server: Any, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[SchedulerProcess, list[WorkerProcess], str, Path]]:
    """A scheduler and a prefill and a decode worker registered with it; the gateways are the tests'."""
    redis_url = own_database(redis_server.url, 14)
    log_dir = tmp_path_factory.mktemp("gateway-death")
    # Not about workers that miss heartbeats: on a machine busy with other tests one may stall for
    # seconds, and must not be evicted (and fenced) for it here.
    scheduler = SchedulerProcess(redis_url, log_dir, "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S))
    try:
        scheduler.wait_ready(time.monotonic() + 60)
        flags = ("--kv-transport", "tcp", "--scheduler", scheduler.address, "--redis-url", redis_url)
        with running_workers(tiny_llama, log_dir, "prefill", "decode", flags=flags) as workers:
            eventually(lambda: scheduler.num_workers() == 2, 30, "both workers registered")
            yield scheduler, workers, redis_url, log_dir
    finally:
        scheduler.stop()


class Stream:
    """One Generate call with the client's own request id, read in a thread of its own: the tokens as
    they come, then how it ended ("ok" or the gRPC status name, and its details)."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub | None, rid: str, prompt: str) -> None:
        assert stub is not None
        self.rid = rid
        self.ids: list[int] = []
        self.status: str | None = None
        self.details = ""
        self.ended_at = 0.0
        request = gateway_pb2.GenerateRequest(request_id=rid, prompt=prompt, sampling=GREEDY)
        self._responses = stub.Generate(request, timeout=120)
        self._thread = threading.Thread(target=self._read, name=f"stream-{rid}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for msg in self._responses:
                if msg.HasField("delta"):
                    self.ids += msg.delta.token_ids
            self.status = "ok"
        except grpc.RpcError as e:
            self.status, self.details = e.code().name, e.details() or ""
        self.ended_at = time.monotonic()

    def wait(self, timeout_s: float = 60.0) -> str:
        self._thread.join(timeout_s)
        assert self.status is not None, f"{self.rid}: no end within {timeout_s} s (a hang)"
        return self.status


def _in_flight(redis_url: str) -> dict[str, float]:
    """The scheduler's quota ledger: every request id still charged, and the seconds until it expires."""

    async def read(client: Any) -> dict[str, float]:
        now = float((await client.time())[0])
        charged: dict[str, float] = {}
        async for key in client.scan_iter(match="*quota:*:inflight"):
            for rid, expiry in await client.zrange(key, 0, -1, withscores=True):
                charged[rid] = expiry - now
        return charged

    return on_redis(redis_url, read)


def test_gateway_killed_mid_stream_clients_get_an_error_and_a_resent_id_is_refused(
    cluster: tuple[SchedulerProcess, list[WorkerProcess], str, Path],
    offline: list[list[int]],
    tiny_llama: Path,
) -> None:
    scheduler, workers, redis_url, log_dir = cluster
    decode = next(w for w in workers if w.role == "decode")
    gw = GatewayProcess(scheduler.address, tiny_llama, log_dir)
    try:
        gw.wait_ready(time.monotonic() + READY_S)
        rids = [f"client-{i}" for i in range(len(PROMPTS))]
        streams = [Stream(gw.stub, rid, PROMPTS[i]) for i, rid in enumerate(rids)]
        eventually(lambda: all(len(s.ids) >= 3 or s.status for s in streams), 60, "every stream under way")
        # Frozen for the instant of the kill, so every stream still running is cut part-way (on a quiet
        # machine the tiny model ends a stream in about a second: one that queued behind the others'
        # prefills may be done already — it must then be exact).
        os.kill(decode.proc.pid, signal.SIGSTOP)
        try:
            gw.kill()
            killed_at = time.monotonic()
        finally:
            os.kill(decode.proc.pid, signal.SIGCONT)

        # Each client cut: a clean UNAVAILABLE at once, after a prefix of exactly the offline tokens.
        for i, s in enumerate(streams):
            if s.wait(30) == "ok":
                assert s.ids == offline[i], s.rid
                continue
            assert s.status == "UNAVAILABLE", (s.rid, s.status, s.details)
            assert 3 <= len(s.ids) < MAX_TOKENS and s.ids == offline[i][: len(s.ids)], (s.rid, len(s.ids))
        cut = [s for s in streams if s.status == "UNAVAILABLE"]
        assert len(cut) >= 2, [(s.rid, s.status) for s in streams]
        rids = [s.rid for s in cut]
        error_after_s = max(s.ended_at for s in cut) - killed_at
        assert error_after_s < 10, error_after_s
        freed_s = max(w.wait_all_free(30) for w in workers)  # 0 leaked blocks, leases, requests

        # The dead gateway never finished them: the ledger still charges each id.
        charged = _in_flight(redis_url)
        assert set(rids) <= set(charged), charged

        # A new gateway process: the same ids are refused, explicitly, and nothing is generated.
        gw.restart(time.monotonic() + READY_S)
        for rid in rids:
            again = Stream(gw.stub, rid, PROMPTS[0])
            assert again.wait() == "ALREADY_EXISTS", (rid, again.status, again.details)
            assert "new id" in again.details and again.ids == [], (again.details, again.ids)
        # The OpenAI HTTP surface takes the client's id from X-Request-Id (or Idempotency-Key): 409.
        for i, header in enumerate(("X-Request-Id", "Idempotency-Key")):
            body = {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            status, _, answer = http_json(cast(Any, gw), "/v1/completions", body, headers={header: rids[i]})
            assert status == 409, (status, answer)
            assert answer["error"]["type"] == "duplicate_request" and "new id" in answer["error"]["message"]
        # A new id is served, with exactly the offline tokens.
        fresh = Stream(gw.stub, "client-0-again", PROMPTS[0])
        assert (fresh.wait(), fresh.ids) == ("ok", offline[0]), fresh.details
        for worker in workers:
            worker.wait_all_free()
        # The scheduler saw the dead gateway's call stream end: after its grace, the orphans' charges
        # expire within the retention window instead of the request TTL (the tenant's slots come back).
        orphaned_s = eventually(
            lambda: max(_in_flight(redis_url).get(r, 0.0) for r in rids) <= ORPHAN_RETENTION_S + 1,
            ORPHAN_GRACE_S + 30,
            "the orphans' charges shortened to the retention window",
        )
        print(
            f"\ngateway killed: {len(cut)} of {len(streams)} streams cut after "
            f"{min(len(s.ids) for s in cut)}–{max(len(s.ids) for s in cut)} of {MAX_TOKENS} tokens, "
            f"each an exact prefix; UNAVAILABLE within {error_after_s:.2f} s; workers free in {freed_s:.2f} s; "
            f"{len(rids)} re-sent ids refused ALREADY_EXISTS (2 over HTTP: 409), still charged for "
            f"{min(charged[r] for r in rids):.0f} s, then for at most {ORPHAN_RETENTION_S:.0f} s once orphaned "
            f"({orphaned_s:.0f} s later); a new id served exactly"
        )
    finally:
        gw.stop()


def test_the_same_id_sent_to_two_gateways_at_once_is_generated_once(
    cluster: tuple[SchedulerProcess, list[WorkerProcess], str, Path],
    offline: list[list[int]],
    tiny_llama: Path,
) -> None:
    scheduler, workers, _, log_dir = cluster
    gateways = [GatewayProcess(scheduler.address, tiny_llama, log_dir) for _ in range(2)]
    try:
        for gw in gateways:
            gw.wait_ready(time.monotonic() + READY_S)
        for n, gw in enumerate(gateways):  # warm: each has its scheduler stream and worker channels
            warm = Stream(gw.stub, f"warm-{n}", PROMPTS[n])
            assert (warm.wait(), warm.ids) == ("ok", offline[n])
        pairs = {f"twin-{k}": [Stream(gw.stub, f"twin-{k}", PROMPTS[k]) for gw in gateways] for k in range(3)}
        for k, (rid, pair) in enumerate(pairs.items()):
            ended = sorted((s.wait(), s.ids == offline[k], len(s.ids)) for s in pair)
            # Exactly one generated it, exactly; the other refused before a token.
            assert ended == [("ALREADY_EXISTS", False, 0), ("ok", True, MAX_TOKENS)], (rid, ended)
            refused = next(s for s in pair if s.status != "ok")
            assert "new id" in refused.details, refused.details
        for worker in workers:
            worker.wait_all_free()
        winners = [next(n for n, s in enumerate(p) if s.status == "ok") for p in pairs.values()]
        print(
            f"\nsame id to two gateways at once: {len(pairs)} ids generated once each (by gateways "
            f"{winners}), the other client refused ALREADY_EXISTS"
        )
    finally:
        for gw in gateways:
            gw.stop()
