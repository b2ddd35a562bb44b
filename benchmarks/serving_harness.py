"""Real processes and a gRPC client for benchmarks of the serving stack: start a `baton` process on
chosen cores (as ``taskset -c`` would) and stop it for sure, wait for its gRPC health check, account for
the CPU time other processes take on this shared machine, and drive ``baton.v1.Gateway/Generate``
streams while noting, client-side, when every token delta arrives. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import REPO_ROOT

READY_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 600.0
QUIET_PCT = 10.0  # other processes' share of the CPU below which the machine counts as quiet
BATON = [sys.executable, "-m", "services.cli"]


# ------------------------------------------------------------------ the client
@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request: prompt token ids and how many tokens to generate (greedy, EOS ignored)."""

    name: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    kind: str = "short"  # the workload's own label (short, long …), carried into the trace
    start_s: float = 0.0  # for a late request: when it is sent, from the start of the phase


@dataclass(slots=True)
class Trace:
    """What the client saw of one request: when it was sent and when each token delta arrived."""

    name: str
    kind: str
    sent_at: float = 0.0  # time.perf_counter()
    arrivals: list[float] = field(default_factory=list)  # one per delta that carried tokens
    sizes: list[int] = field(default_factory=list)  # tokens per such delta
    token_ids: list[int] = field(default_factory=list)
    done_at: float | None = None  # the final Completion
    server_ttft_ms: float | None = None  # the gateway's own ttft_ms
    server_queue_ms: float | None = None  # … its queue_ms (accepted → a worker started it)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.arrivals[0] - self.sent_at if self.arrivals else None

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def generate(
    stub: Any, spec: RequestSpec, request_id: str, metadata: tuple[tuple[str, str], ...] = ()
) -> Trace:
    """One streamed ``Gateway.Generate`` call (or, with a ``Worker`` stub, ``Worker.Decode`` without a
    handle: the worker prefills locally); errors are recorded in the trace, never raised. ``metadata``
    goes with the call (an API key)."""
    import grpc

    from baton.v1 import common_pb2, gateway_pb2, worker_pb2, worker_pb2_grpc

    sampling = common_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    if isinstance(stub, worker_pb2_grpc.WorkerStub):
        call = stub.Decode(
            worker_pb2.DecodeRequest(
                request_id=request_id, prompt_token_ids=spec.prompt_ids, sampling=sampling
            ),
            timeout=REQUEST_TIMEOUT_S,
            metadata=metadata,
        )
    else:
        call = stub.Generate(
            gateway_pb2.GenerateRequest(
                request_id=request_id,
                prompt_token_ids=gateway_pb2.TokenIds(ids=spec.prompt_ids),
                sampling=sampling,
            ),
            timeout=REQUEST_TIMEOUT_S,
            metadata=metadata,
        )
    trace = Trace(spec.name, spec.kind, sent_at=time.perf_counter())
    try:
        async for msg in call:
            _note(trace, msg, time.perf_counter())
    except grpc.aio.AioRpcError as e:
        trace.error = f"{e.code().name}: {e.details()}"
    if trace.error is None and len(trace.token_ids) != spec.max_tokens:
        trace.error = f"got {len(trace.token_ids)} tokens, expected {spec.max_tokens}"
    return trace


def _note(trace: Trace, msg: Any, now: float) -> None:
    """A ``GenerateResponse`` or a ``DecodeResponse`` (whose last message carries ``finish_reason``)."""
    if msg.HasField("delta") and msg.delta.token_ids:
        trace.arrivals.append(now)
        trace.sizes.append(len(msg.delta.token_ids))
        trace.token_ids.extend(msg.delta.token_ids)
    if hasattr(msg, "completion"):
        if msg.HasField("completion"):
            timings = msg.completion.timings
            trace.done_at, trace.server_ttft_ms, trace.server_queue_ms = (
                now,
                timings.ttft_ms,
                timings.queue_ms,
            )
    elif msg.finish_reason:
        trace.done_at = now


async def drive(
    address: str,
    tag: str,
    slots: Sequence[Sequence[RequestSpec]],
    late: Sequence[RequestSpec] = (),
    worker: bool = False,
) -> list[Trace]:
    """Each slot sends its requests one after another; each late request is sent at its ``start_s``.
    To a gateway's ``Generate``, or with ``worker`` straight to a worker's ``Decode``."""
    import grpc

    from baton.v1 import gateway_pb2_grpc, worker_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel) if worker else gateway_pb2_grpc.GatewayStub(channel)
        t0 = time.perf_counter()

        async def run_slot(specs: Sequence[RequestSpec]) -> list[Trace]:
            return [await generate(stub, s, f"{tag}-{s.name}") for s in specs]

        async def run_late(spec: RequestSpec) -> list[Trace]:
            await asyncio.sleep(max(0.0, t0 + spec.start_s - time.perf_counter()))
            return [await generate(stub, spec, f"{tag}-{spec.name}")]

        groups = await asyncio.gather(*map(run_slot, slots), *map(run_late, late))
    return [t for g in groups for t in g]


# ------------------------------------------------------------------ processes
def _libc() -> ctypes.CDLL | None:
    """libc, for prctl."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None  # not Linux: the children are still stopped by this process's ``finally``


def spawn(argv: list[str], cores: tuple[int, ...] | None, log_path: Path) -> subprocess.Popen[bytes]:
    """Starts ``argv`` on ``cores`` (like ``taskset -c``), SIGTERMed if this process dies (PR_SET_PDEATHSIG).
    libc is loaded here, not in the forked child: this process has gRPC threads, so the child runs no more
    than two system calls before exec."""
    libc = _libc()

    def in_child() -> None:
        if cores is not None:
            os.sched_setaffinity(0, cores)
        if libc is not None:
            libc.prctl(1, signal.SIGTERM)

    with open(log_path, "wb") as out:
        return subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=in_child,
        )


def pinned(argv: Sequence[str], cores: tuple[int, ...] | None) -> str:
    """The shell command a user types for ``argv`` on ``cores``."""
    words = ["python", *argv[1:]] if argv and argv[0] == sys.executable else list(argv)
    prefix = f"taskset -c {','.join(map(str, cores))} " if cores is not None else ""
    return prefix + " ".join(words)


def wait_serving(name: str, proc: subprocess.Popen[bytes], address: str, log_path: Path) -> None:
    """Returns once ``address`` answers the gRPC health check with SERVING; raises with the tail of the
    process's log if it exits first or takes longer than READY_TIMEOUT_S."""
    from services.launcher import is_serving

    deadline = time.monotonic() + READY_TIMEOUT_S
    while not is_serving(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            state = (
                f"exited with code {proc.returncode}" if proc.poll() is not None else "not serving in time"
            )
            raise RuntimeError(f"the {name} {state}:\n{tail}")
        time.sleep(0.2)


def stop_all(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM the last started first (the gateway), then SIGKILL whatever outlives the grace."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait(5)


# ------------------------------------------------------------------ the machine
def cpu_ticks(pids: Sequence[int]) -> tuple[int, int, int] | None:
    """(busy ticks of the whole machine, all its ticks, the ticks of ``pids``), from /proc; None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        ours = 0
        for pid in pids:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ours += int(stat[11]) + int(stat[12])  # utime + stime, every thread
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total, ours


def others_cpu_pct(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    """The share of the machine's CPU time that processes other than ours used between two samples."""
    if before is None or after is None or after[1] == before[1]:
        return None
    busy, total, ours = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, 100.0 * (busy - ours) / total)


def wait_quiet(pids: Sequence[int], max_wait_s: float, log: Callable[[str], None]) -> float | None:
    """Waits (at most ``max_wait_s``) until processes other than ``pids`` use under QUIET_PCT of the CPU
    for a second: this machine is shared, and a neighbour's test run would slow down whichever
    configuration it overlaps. Returns the last share measured."""
    start = time.monotonic()
    while True:
        before = cpu_ticks(pids)
        time.sleep(1.0)
        pct = others_cpu_pct(before, cpu_ticks(pids))
        waited = time.monotonic() - start
        if pct is None or pct < QUIET_PCT:
            if waited > 1.5:
                log(f"quiet after {waited:.0f} s")
            return pct
        if waited >= max_wait_s:
            if max_wait_s > 0:
                log(f"other processes still use {pct:.0f}% of the CPU after {waited:.0f} s; measuring anyway")
            return pct
        if waited < 1.5:
            log(
                f"other processes use {pct:.0f}% of the CPU; waiting up to {max_wait_s:.0f} s for a quiet moment"
            )


# ------------------------------------------------------------------ statistics
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between the closest ranks; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def throughput(traces: Sequence[Trace]) -> float | None:
    """Output tokens per second from the first request sent to the last completion."""
    done = [t.done_at for t in traces if t.done_at is not None]
    if not traces or not done:
        return None
    wall = max(done) - min(t.sent_at for t in traces)
    return sum(len(t.token_ids) for t in traces) / wall if wall > 0 else None
