"""Faults a shared cluster must survive (issue 18), on real processes: a real redis-server, `baton
scheduler` replicas, a prefill and a decode worker (tiny model, tcp KV transport) and a gateway that
places every request with the scheduler.

* **One of two scheduler replicas killed under load**: the gateway and the workers are given both
  replicas' addresses. SIGKILL the one they use while streams run: every stream that had been placed
  completes with exactly the offline tokens (placed work never depended on the replica), a request
  whose placement was on the dead replica's stream at that moment ends with an explicit UNAVAILABLE —
  never a hang, never a silent duplicate — and every request after it is placed by the survivor. At the
  end no worker holds a block, lease or request.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import (
    GatewayThread,
    SchedulerProcess,
    Scrape,
    WorkerProcess,
    eventually,
    offline_tokens,
    own_database,
    running_workers,
)

from baton.v1 import common_pb2, gateway_pb2
from services.gateway.server import GatewayConfig

pytestmark = [pytest.mark.integration, pytest.mark.redis]

MAX_TOKENS = 48
PROMPTS = [f"Request number {i} asks the cluster to keep talking about the sea and the sky" for i in range(6)]


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[list[int]]:
    return offline_tokens(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture
def two_replicas(
    redis_server: Any, tiny_llama: Path, tmp_path: Path
) -> Iterator[tuple[list[SchedulerProcess], list[WorkerProcess], GatewayThread]]:
    redis_url = own_database(redis_server.url, 12)
    replicas = [SchedulerProcess(redis_url, tmp_path, "--heartbeat-timeout-s", "2") for _ in range(2)]
    try:
        for replica in replicas:
            replica.wait_ready(time.monotonic() + 60)
        both = ",".join(r.address for r in replicas)
        flags = ("--kv-transport", "tcp", "--scheduler", both, "--redis-url", redis_url)
        with running_workers(tiny_llama, tmp_path, "prefill", "decode", flags=flags) as workers:
            eventually(lambda: replicas[1].num_workers() == 2, 30, "both workers registered")
            config = GatewayConfig(
                scheduler=both, model=str(tiny_llama), grpc_port=0, http_port=0, startup_timeout=60
            )
            with GatewayThread(config) as gw:
                yield replicas, workers, gw
    finally:
        for replica in replicas:
            replica.stop()


def _decisions(replica: SchedulerProcess) -> float:
    """Placements this replica decided, from its /metrics."""
    url = re.search(r"metrics on (http://\S+)", replica.log_path.read_text())
    assert url, "the scheduler printed no metrics URL"
    page = Scrape(url.group(1))
    return sum(
        page.value("baton_scheduler_decisions_total", outcome=o) for o in ("prefill_pool", "local_prefill")
    )


def _generate(gw: GatewayThread, i: int) -> tuple[str, list[int]]:
    """One greedy stream of prompt ``i % len(PROMPTS)``: ("ok", its tokens) or (the status name, [])."""
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPTS[i % len(PROMPTS)],
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
    )
    ids: list[int] = []
    try:
        for msg in gw.stub.Generate(request, timeout=120):
            if msg.HasField("delta"):
                ids += msg.delta.token_ids
    except grpc.RpcError as e:
        print("FAILED", e.code().name, e.details())
        return e.code().name, ids
    return "ok", ids


def test_one_of_two_scheduler_replicas_killed_under_load_placements_go_on(
    two_replicas: tuple[list[SchedulerProcess], list[WorkerProcess], GatewayThread], offline: list[list[int]]
) -> None:
    replicas, workers, gw = two_replicas
    assert _generate(gw, 0) == ("ok", offline[0])  # warm: the channels have chosen the first replica
    assert _decisions(replicas[0]) == 1 and _decisions(replicas[1]) == 0
    results: dict[int, tuple[str, list[int]]] = {}
    killed = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = {}
        for i in range(36):  # a steady arrival of streams, the kill a third of the way in
            futures[pool.submit(_generate, gw, i)] = i
            if i == 12:
                replicas[0].kill()
                killed.set()
            time.sleep(0.05)
        for future in concurrent.futures.as_completed(futures, timeout=300):
            results[futures[future]] = future.result()
    assert killed.is_set()
    for i, (status, ids) in results.items():
        if status == "ok":  # 0 lost, 0 duplicated: exactly the offline tokens
            assert ids == offline[i % len(PROMPTS)], i
        else:  # an explicit error, only for a placement the dead replica held; nothing was streamed
            assert status == "UNAVAILABLE" and ids == [], (i, status, len(ids))
    failed = [i for i, (status, _) in results.items() if status != "ok"]
    assert len(failed) <= 6, failed
    print(
        f"scheduler replica killed: {len(results) - len(failed)} streams exact, {len(failed)} UNAVAILABLE"
    )  # at most what was in placement at the moment of the kill
    # Placements go on, on the survivor: every request after the kill is served.
    survivor = _decisions(replicas[1])
    after = [_generate(gw, i) for i in range(6)]
    assert after == [("ok", offline[i]) for i in range(6)]
    assert _decisions(replicas[1]) >= survivor + 6  # placed by the survivor
    for worker in workers:
        worker.wait_all_free()
