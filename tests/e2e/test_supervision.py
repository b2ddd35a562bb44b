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
from harness import BatonUp, Scrape, eventually, offline_tokens, on_redis, start_baton_up

from baton.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.supervisor import is_serving

pytestmark = pytest.mark.e2e

NUM_STREAMS = 8
MAX_TOKENS = 400  # long enough that streams still run when the kill comes
# Long enough to be prefilled on the prefill worker (the scheduler's local-prefill threshold is 32).
PROMPTS = [
    f"Stream {i}: " + "the quick brown fox jumps over the lazy dog " * (3 + i % 3) for i in range(NUM_STREAMS)
]


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[list[int]]:
    return offline_tokens(tiny_llama, PROMPTS, MAX_TOKENS)


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


GRACE_S = 10.0  # what baton up gives a child to stop; a pod's terminationGracePeriodSeconds is longer


def _alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text().lower()
    except OSError:
        return False


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


DECODERS = {"decode worker": "decode", "decode worker 2": "decode_2"}  # name → its /metrics in the banner


def _registered(cluster: BatonUp) -> int:
    """How many workers the registry holds now (live, draining ones included)."""
    from scheduler.registry import WorkerRegistry

    return len(on_redis(cluster.redis, lambda client: WorkerRegistry(client).all_workers()))


def _streams_on(cluster: BatonUp) -> dict[str, float]:
    return {
        name: Scrape(cluster.metrics[page]).value("baton_worker_requests_running")
        for name, page in DECODERS.items()
    }


@pytest.mark.parametrize(
    ("victim", "how"),
    [
        ("busiest decode worker", signal.SIGKILL),
        ("idlest decode worker", signal.SIGKILL),  # with the busiest: either decode worker, whatever it holds
        ("prefill worker", signal.SIGKILL),
        ("scheduler", signal.SIGKILL),
        ("busiest decode worker", signal.SIGTERM),  # a drain: it leaves placement, its streams end or move on
    ],
    ids=["kill-decode-busiest", "kill-decode-idlest", "kill-prefill", "kill-scheduler", "term-decode"],
)
def test_a_killed_process_comes_back_and_every_stream_completes_token_exactly(
    up: tuple[BatonUp, Path], offline: list[list[int]], victim: str, how: signal.Signals
) -> None:
    cluster, log_dir = up
    # Every worker registered first: the case before may have restarted the scheduler or a worker, and
    # a worker re-registers after its backoff (up to 5 s). A drain with no other decode worker registered
    # has nowhere to move its streams: they end UNAVAILABLE, rightly, but that is not this case.
    eventually(lambda: _registered(cluster) == 3, 30, "every worker registered", 0.1)
    migrations = Scrape(cluster.metrics["gateway"]).value("baton_gateway_migrations_total")
    with grpc.insecure_channel(cluster.grpc) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for _round in range(5):  # a round whose streams all ended before the kill could come is run again
            streams = [Stream(stub, p) for p in PROMPTS]
            for s in streams:
                s.start()
            if not victim.endswith("decode worker"):
                eventually(
                    lambda ss=streams: all(s.token_ids or s.error for s in ss),
                    60,
                    "every stream placed",
                    0.005,
                )
                break
            # Placement is KV-aware (these prompts share a prefix): which decode worker holds the streams
            # is its choice; the test kills the one holding most (its streams must move) or fewest. The
            # decode workers are read as soon as streams run there: on a busy machine the prompts are
            # prefilled one after another, and the first streams may end before the last one starts.
            on: dict[str, float] = {}

            def running_there(ss: list[Stream] = streams, seen: dict[str, float] = on) -> bool:
                seen.update(_streams_on(cluster))
                return sum(seen.values()) >= 1 or all(s.finish is not None or s.error for s in ss)

            eventually(running_there, 60, "streams on a decode worker, or every stream ended", 0.005)
            if sum(on.values()) >= 1:
                pick = max if victim.startswith("busiest") else min
                victim = pick(on, key=lambda name: on[name])
                break
            for s in streams:
                s.join(180)
        else:
            raise AssertionError("the streams always ended before a decode worker could be killed")
        before = processes(log_dir)[victim]
        held = _streams_on(cluster).get(victim, 0.0) if victim in DECODERS else 0.0
        os.kill(before["pid"], how)
        killed_at = time.monotonic()
        running = sum(s.finish is None and s.error is None for s in streams)
        if how == signal.SIGTERM:  # it drains and exits within its grace period (baton up then restarts it)
            exited_in = eventually(
                lambda: processes(log_dir)[victim]["pid"] != before["pid"] or not _alive(before["pid"]),
                GRACE_S,
                f"{victim} exiting after SIGTERM",
            )
            print(f"{victim}: exited {exited_in:.1f} s after SIGTERM")
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
        if how == signal.SIGKILL and held >= 1:  # its streams (running when it died) went on elsewhere
            moved = Scrape(cluster.metrics["gateway"]).value("baton_gateway_migrations_total") - migrations
            assert moved >= 1, f"no stream migrated off the killed {victim} (it ran {held:g})"

        # And the cluster serves a new request (once the restarted process has registered again).
        def serves() -> bool:
            again = Stream(stub, PROMPTS[0])
            again.run()
            return again.error is None and again.token_ids == offline[0]

        eventually(serves, 30, "a new request served after the restart", interval_s=0.5)

    # No worker holds a block any more (a migrated stream's blocks were freed where it left).
    def no_blocks_held() -> bool:
        pages = [Scrape(cluster.metrics[k]) for k in ("prefill", "decode", "decode_2")]
        return all(p.value("baton_worker_kv_blocks_used") == 0 for p in pages)

    eventually(no_blocks_held, 30, "every worker's blocks back in its pool", interval_s=0.2)
    assert cluster.proc.poll() is None, "baton up itself must keep running"
