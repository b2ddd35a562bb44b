"""`baton up --autoscale` end to end on this machine (tiny model): the cluster starts with one decode
worker; the load rises past what one decode worker can hold and the TTFT SLO is breached; the
autoscaler adds a decode worker (its reaction time measured) and the SLO recovers under the same load;
the load drops and it drains and removes a decode worker — with every stream of every phase complete
and token-exact (none failed, none duplicated).

Why the breach is decode *capacity* — the scheduler places on a decode worker only while at most one
request waits or pulls there (``--max-decode-queue 1``, with ``--max-num-seqs 4``), so with one decode
worker 8 streams queue in the scheduler "for want of a decode worker with room" (the autoscaler's logged
reason) and with two they do not — and not inter-token latency: on two CPU cores a second decode
worker adds capacity but no compute — both workers share the same cores, and on the tiny model the
gateway's Python, not the decode step, bounds ITL (measured: ITL p95 9.0 ms at 32 streams with one
decode worker or two). Capacity is what a second worker adds here whatever else the machine runs, so
this test holds on a busy machine too; the ITL-driven path of the policy is unit-tested
(tests/unit/test_autoscaler_policy.py) and measured in `make bench`'s Autoscaling section.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from harness import BatonUp, Scrape, eventually, offline_tokens, start_baton_up

from baton.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.e2e

NUM_PROMPTS = 12
# Over the scheduler's local-prefill threshold (32 tokens): prefilled on the prefill worker, handed off.
PROMPTS = [f"Stream {i}: " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(NUM_PROMPTS)]
MAX_TOKENS = 240  # a stream holds its decode slot for a while: a wait for one is a stream's lifetime
TTFT_SLO_MS = 250.0  # the mission's
SLOTS = 4  # --max-num-seqs
LOW, HIGH = 2, 8  # concurrent streams: one decode worker leaves some queued, two do not


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[list[int]]:
    return offline_tokens(tiny_llama, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def up(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BatonUp, Path]]:
    log_dir = tmp_path_factory.mktemp("autoscale") / "logs"
    cluster = start_baton_up(
        log_dir,
        *("--model", str(tiny_llama), "--kv-transport", "tcp", "--dtype", "float32"),
        *("--autoscale", "--decode-workers", "1", "--max-decode", "2", "--max-prefill", "1"),
        *("--max-num-seqs", str(SLOTS), "--max-decode-queue", "1", "--max-prefill-queue", "4"),
        *("--ttft-slo-ms", str(TTFT_SLO_MS), "--itl-slo-ms", "500"),
        *("--autoscale-interval-s", "1", "--autoscale-window-s", "4"),
        *("--scale-up-window-s", "2", "--scale-down-window-s", "8", "--drain-timeout-s", "3"),
    )
    try:
        yield cluster, log_dir
    finally:
        cluster.shut_down()


@dataclass(slots=True)
class Done:
    """One stream: when it started, its time to first token, and whether it matched offline."""

    started: float
    ttft_s: float
    tokens_ok: bool
    error: str = ""


class Load:
    """Closed-loop clients over gRPC, each sending greedy streams back to back; ``clients`` of them are
    active at a time (the phase's load). Every stream is checked against the offline tokens."""

    def __init__(self, grpc_address: str, offline: list[list[int]]) -> None:
        self.channel = grpc.insecure_channel(grpc_address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.offline = offline
        self.active = 0
        self.done: list[Done] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(HIGH)]
        for t in self._threads:
            t.start()

    def _client(self, i: int) -> None:
        n = 0
        sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        while not self._stop.is_set():
            if i >= self.active:
                time.sleep(0.02)
                continue
            k = (i + n * HIGH) % NUM_PROMPTS
            n += 1
            ids: list[int] = []
            started = time.monotonic()
            first = 0.0
            error = ""
            try:
                request = gateway_pb2.GenerateRequest(prompt=PROMPTS[k], sampling=sampling)
                for msg in self.stub.Generate(request, timeout=120):
                    if msg.HasField("delta") and msg.delta.token_ids:
                        first = first or time.monotonic()
                        ids.extend(msg.delta.token_ids)
            except grpc.RpcError as e:
                error = f"{e.code().name}: {e.details()}"
            with self._lock:
                self.done.append(
                    Done(started, (first or time.monotonic()) - started, ids == self.offline[k], error)
                )

    def since(self, t0: float, t1: float = float("inf")) -> list[Done]:
        with self._lock:
            return [d for d in self.done if t0 <= d.started < t1]

    def stop(self) -> None:
        self.active = 0
        self._stop.set()
        for t in self._threads:
            t.join(150)
        self.channel.close()


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else (values[0] if values else 0.0)


def decode_pool(log_dir: Path) -> list[dict[str, object]]:
    return [p for p in json.loads((log_dir / "processes.json").read_text()) if p["pool"] == "decode"]


def test_the_autoscaler_adds_a_decode_worker_under_load_and_drains_one_after(
    up: tuple[BatonUp, Path], offline: list[list[int]]
) -> None:
    cluster, log_dir = up
    autoscaler = cluster.metrics["autoscaler"]

    def decode(sample: str) -> float:
        return Scrape(autoscaler).value(sample, pool="decode")

    load = Load(cluster.grpc, offline)
    try:
        # Low load: one decode worker holds it; nothing is added.
        load.active = LOW
        t_low = time.monotonic()
        time.sleep(6)
        assert decode("baton_autoscaler_desired_replicas") == 1 and len(decode_pool(log_dir)) == 1
        low = load.since(t_low)

        # High load: more streams than one decode worker holds; requests wait for decode capacity.
        load.active = HIGH
        t_high = time.monotonic()
        decided_s = eventually(
            lambda: decode("baton_autoscaler_desired_replicas") == 2, 60, "a scale-up decision"
        )
        ready_s = eventually(
            lambda: decode("baton_autoscaler_ready_replicas") == 2, 60, "the new decode worker ready"
        )
        t_ready = time.monotonic()
        breach = load.since(t_high, t_ready)  # the streams one decode worker had to hold
        up_reason = Scrape(autoscaler).labels("baton_autoscaler_decisions_total", "reason")
        time.sleep(2)  # the new worker registered and placement knows it
        t_after = time.monotonic()
        time.sleep(10)
        after = load.since(t_after)
        on_new = [p for p in decode_pool(log_dir) if p["name"] != "decode worker"]
        assert len(on_new) == 1

        # Low load again: the autoscaler drains and removes a decode worker.
        load.active = LOW
        t_drop = time.monotonic()
        removed_s = eventually(
            lambda: len(decode_pool(log_dir)) == 1, 90, "a decode worker drained and removed"
        )
    finally:
        load.stop()

    everything = load.since(0)
    failed = [d for d in everything if d.error]
    wrong = [d for d in everything if not d.error and not d.tokens_ok]
    ttft_breach = p95([d.ttft_s for d in breach]) * 1e3
    ttft_after = p95([d.ttft_s for d in after]) * 1e3
    print(
        f"\nlow load: {len(low)} streams, TTFT p95 {p95([d.ttft_s for d in low]) * 1e3:.0f} ms; "
        f"high load: scale-up decided {decided_s:.1f} s and the worker ready {decided_s + ready_s:.1f} s after the load "
        f"rose; TTFT p95 {ttft_breach:.0f} ms before, {ttft_after:.0f} ms after (SLO {TTFT_SLO_MS:g} ms, "
        f"{len(after)} streams); drained and removed {removed_s:.1f} s after the load dropped; "
        f"{len(everything)} streams, {len(failed)} failed, {len(wrong)} not token-exact"
    )
    print((log_dir / "autoscaler.log").read_text().strip())
    assert not failed, failed[:3]
    assert not wrong, f"{len(wrong)} streams differ from offline (a token lost or duplicated)"
    assert up_reason & {"decode_queue", "ttft_slo", "itl_slo", "kv_pressure"}, up_reason
    assert len(breach) >= 3 and ttft_breach > TTFT_SLO_MS, "the load did not breach the TTFT SLO"
    # Recovered: under the SLO — or, where this machine is so busy that even the low load's TTFT is near
    # it (seen with one core kept busy: low-load p95 141–601 ms), back to the low load's level: what a
    # second decode worker can give, since the TTFT left is the prefill's and the handoff's.
    ttft_low = p95([d.ttft_s for d in low]) * 1e3
    recovered = ttft_after < max(TTFT_SLO_MS, 1.5 * ttft_low) and ttft_after < ttft_breach / 2
    assert len(after) >= HIGH and recovered, "the SLO did not recover with two decode workers"
    assert t_ready - t_high < 60 and t_drop > t_ready
