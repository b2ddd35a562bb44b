"""`baton up` supervises its processes as Kubernetes would: kill -9 any one of them — either decode
worker, the prefill worker, the scheduler — while 8 streams decode, and every stream still completes
with exactly the tokens offline generation gives (a decode worker's streams migrate to the other), the
dead process is serving again within seconds, and the cluster keeps serving. Only Ctrl-C stops it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import BatonUp, Scrape, eventually, start_baton_up

from baton.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.supervisor import is_serving

pytestmark = pytest.mark.e2e

NUM_STREAMS = 8
METRICS_OF = {
    "decode worker": "decode",
    "decode worker 2": "decode_2",
    "prefill worker": "prefill",
    "scheduler": "scheduler",
}  # the victim → its /metrics in the banner
MAX_TOKENS = 400  # long enough that every stream still runs when the kill comes
# Long enough to be prefilled on the prefill worker (the scheduler's local-prefill threshold is 32).
PROMPTS = [
    f"Stream {i}: " + "the quick brown fox jumps over the lazy dog " * (3 + i % 3) for i in range(NUM_STREAMS)
]


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[list[int]]:
    from core.sampling_params import SamplingParams
    from engine import LLM

    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=32 << 20, num_threads=1)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def up(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BatonUp, Path]]:
    log_dir = tmp_path_factory.mktemp("supervised") / "logs"
    cluster = start_baton_up(
        log_dir,
        "--model",
        str(tiny_llama),
        "--kv-transport",
        "tcp",
        "--kv-cache-memory",
        "64MiB",
        "--dtype",
        "float32",
        "--decode-workers",
        "2",
    )
    try:
        yield cluster, log_dir
    finally:
        cluster.shut_down()


def processes(log_dir: Path) -> dict[str, dict[str, Any]]:
    """`baton up`'s record of its children: name → pid, address, restarts."""
    state = json.loads((log_dir / "processes.json").read_text())
    return {p["name"]: p for p in state}


class Stream(threading.Thread):
    """One greedy Generate stream: its token ids and how it ended."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, prompt: str) -> None:
        super().__init__(daemon=True)
        self.stub, self.prompt = stub, prompt
        self.token_ids: list[int] = []
        self.finish: int | None = None
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        try:
            for msg in self.stub.Generate(
                gateway_pb2.GenerateRequest(prompt=self.prompt, sampling=sampling), timeout=180
            ):
                if msg.HasField("delta"):
                    self.token_ids.extend(msg.delta.token_ids)
                else:
                    self.finish = msg.completion.finish_reason
        except grpc.RpcError as e:
            self.error = e


@pytest.mark.parametrize("victim", ["decode worker", "decode worker 2", "prefill worker", "scheduler"])
def test_a_killed_process_comes_back_and_every_stream_completes_token_exactly(
    up: tuple[BatonUp, Path], offline: list[list[int]], victim: str
) -> None:
    cluster, log_dir = up
    before = processes(log_dir)[victim]
    assert is_serving(before["address"]), f"{victim} is not serving before the test"
    migrations = Scrape(cluster.metrics["gateway"]).value("baton_gateway_migrations_total")
    with grpc.insecure_channel(cluster.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        streams = [Stream(stub, p) for p in PROMPTS]
        for s in streams:
            s.start()
        # Every stream placed and streaming, and — for a decode worker — some of them on the victim.
        page = METRICS_OF[victim]

        def ready() -> bool:
            placed = all(s.token_ids or s.error for s in streams)
            if not placed or not victim.startswith("decode"):
                return placed
            return Scrape(cluster.metrics[page]).value("baton_worker_requests_running") >= 1

        eventually(ready, 60, f"every stream streaming, some on the {victim}", interval_s=0.005)
        os.kill(before["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        running = sum(s.finish is None and s.error is None for s in streams)
        for s in streams:
            s.join(180)
        for i, s in enumerate(streams):
            assert s.error is None, f"stream {i} failed after {victim} was killed: {s.error}"
            assert s.finish == common_pb2.FINISH_REASON_LENGTH, f"stream {i} ended {s.finish}"
            assert s.token_ids == offline[i], f"stream {i}: not the offline tokens (or some were duplicated)"
        # The dead process is started again (a new pid) and serves within seconds.
        back_in = eventually(
            lambda: processes(log_dir)[victim]["pid"] != before["pid"] and is_serving(before["address"]),
            30,
            f"{victim} serving again",
        )
        print(
            f"{victim}: killed with {running} of {NUM_STREAMS} streams running; all completed; serving again {back_in:.1f} s after "
            f"the last stream ended ({time.monotonic() - killed_at:.1f} s after the kill)"
        )
        assert processes(log_dir)[victim]["restarts"] >= 1
        if victim.startswith("decode"):  # its streams (running when it died) went on elsewhere
            moved = Scrape(cluster.metrics["gateway"]).value("baton_gateway_migrations_total") - migrations
            assert moved >= 1, f"no stream migrated off the killed {victim} ({running} were running)"

        # And the cluster serves a new request (once the restarted process has registered again).
        def serves() -> bool:
            again = Stream(stub, PROMPTS[0])
            again.run()
            return again.error is None and again.token_ids == offline[0]

        eventually(serves, 30, "a new request served after the restart", interval_s=0.5)
    assert cluster.proc.poll() is None, "baton up itself must keep running"
