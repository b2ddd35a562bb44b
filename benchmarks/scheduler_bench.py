"""The "Scheduler" section of `make bench`: how fast one scheduler replica decides.

A real redis-server and a real `baton scheduler` process (each pinned to its own core when there are
two); 64 workers registered through the scheduler's own RPCs with 10k published prefix hashes in
all (registrations only: 64 worker processes do not fit on this machine, and placement reads nothing
else from them). The client sends `Place` requests for 512-token prompts whose leading blocks some
workers hold, and records the client-side latency and the server-side `decision_ms`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from benchmarks.report import MachineInfo, provenance

NUM_WORKERS = 64
TOTAL_HASHES = 10_000
PROMPT_TOKENS = 512
BLOCK_SIZE = 16
# The registered workers are not real, so their queues never drain: admission limits would turn the
# run into a queueing test. This section measures the decision itself.
NO_ADMISSION_LIMITS = ("--max-prefill-queue", "1000000", "--max-decode-queue", "1000000")


def _pin(core: int | None) -> Callable[[], None] | None:
    if core is None:
        return None
    return lambda: os.sched_setaffinity(0, {core})


def _heartbeats(address: str, loads: dict[str, tuple[int, int, int]], first_round: Any) -> None:
    """The registered workers' load-only heartbeats, each worker's every half second, until terminated.
    Spread evenly over the half second, as independent workers' heartbeats are (not all 64 at once)."""
    import grpc

    from baton.v1 import scheduler_pb2, scheduler_pb2_grpc

    async def beat() -> None:
        stub = scheduler_pb2_grpc.SchedulerStub(grpc.aio.insecure_channel(address))
        gap = 0.5 / len(loads)
        next_at = time.perf_counter()
        while True:
            for addr, (free, running, waiting) in loads.items():
                await stub.Heartbeat(
                    scheduler_pb2.HeartbeatRequest(
                        address=addr,
                        load_only=True,
                        load=(scheduler_pb2.WorkerLoad(free_blocks=free, running=running, waiting=waiting)),
                    )
                )
                next_at = max(next_at + gap, time.perf_counter() - 0.5)  # behind by a round at most
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            first_round.set()

    asyncio.run(beat())


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(
    address: str, scheduler_pid: int, quick: bool, log: Callable[[str], None]
) -> dict[str, float]:
    import grpc

    from baton.v1 import scheduler_pb2, scheduler_pb2_grpc
    from scheduler.placing import prompt_hashes
    from scheduler.tenants import TenantConfig, cache_salt
    from services.gateway.router import CallStream

    rng = random.Random(7)
    channel = grpc.aio.insecure_channel(address)
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    version = "bench-v1"
    salt = cache_salt(TenantConfig("default"), version)
    prefixes = [[rng.randrange(3, 40_000) for _ in range(PROMPT_TOKENS)] for _ in range(16)]
    per_worker = TOTAL_HASHES // NUM_WORKERS
    for i in range(NUM_WORKERS):
        addr = f"10.0.{i // 250}.{i % 250}:9000"
        role = "prefill" if i % 4 == 0 else "decode"
        record = scheduler_pb2.WorkerRecord(
            address=addr,
            role=role,
            model="bench",
            version=version,
            num_blocks=4096,
            block_size=BLOCK_SIZE,
            max_model_len=8192,
            kv_backend="nixl",
        )
        load = scheduler_pb2.WorkerLoad(
            free_blocks=rng.randrange(1000, 4096), running=rng.randrange(0, 32), waiting=rng.randrange(0, 4)
        )
        await stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(worker=record, load=load))
        # Each worker holds the chains of a few shared prefixes plus private blocks: 10k hashes in all.
        held = prompt_hashes(prefixes[i % len(prefixes)], BLOCK_SIZE, salt)
        held += [f"{rng.getrandbits(128):032x}" for _ in range(per_worker - len(held))]
        await stub.Heartbeat(
            scheduler_pb2.HeartbeatRequest(address=addr, load=load, cached_block_hashes=held)
        )
    log(f"[scheduler] registered {NUM_WORKERS} workers, {per_worker * NUM_WORKERS} prefix hashes")

    def request(n: int) -> scheduler_pb2.PlaceRequest:
        prompt = list(prefixes[n % len(prefixes)])
        prompt[-rng.randrange(1, 200) :] = [rng.randrange(3, 40_000) for _ in range(len(prompt[-1:]))]
        return scheduler_pb2.PlaceRequest(
            request_id=f"b{n}", model="bench", prompt_token_ids=prompt, max_tokens=128
        )

    loads = {
        f"10.0.{i // 250}.{i % 250}:9000": (
            rng.randrange(1000, 4096),
            rng.randrange(0, 32),
            rng.randrange(0, 4),
        )
        for i in range(NUM_WORKERS)
    }
    # Like live workers, in a process of their own (as workers are): a load-only heartbeat from each
    # every half second (their load stays the same), so the placements this replica counts against a
    # worker age out as they do in a cluster.
    ctx = multiprocessing.get_context("spawn")
    first_round = ctx.Event()
    beating = ctx.Process(target=_heartbeats, args=(address, loads, first_round), daemon=True)
    beating.start()
    if not first_round.wait(60):  # measure once it runs, not while it starts up
        raise RuntimeError("the heartbeat process did not start")
    # The gateway's path: its one `Calls` stream (services.gateway.router.CallStream), as SchedulerRouter uses it.
    calls = CallStream(stub, address)

    async def streamed(req: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        reply: scheduler_pb2.PlaceResponse = await calls.call(30.0, place=req)
        return reply

    async def unary(req: scheduler_pb2.PlaceRequest) -> scheduler_pb2.PlaceResponse:
        reply: scheduler_pb2.PlaceResponse = await stub.Place(req)
        return reply

    warm, sequential = (20, 100) if quick else (200, 2000)
    for n in range(warm):
        await streamed(request(n))
    client_ms: list[float] = []
    server_ms: list[float] = []
    cpu0 = _cpu_seconds(scheduler_pid)
    for n in range(warm, warm + sequential):
        t0 = time.perf_counter()
        reply = await streamed(request(n))
        client_ms.append((time.perf_counter() - t0) * 1e3)
        server_ms.append(reply.decision_ms)
    cpu_ms = (_cpu_seconds(scheduler_pid) - cpu0) * 1e3 / sequential

    duration = 1.0 if quick else 5.0
    concurrency = 32
    counter = iter(range(10**9))

    async def rate(
        place: Callable[[scheduler_pb2.PlaceRequest], Awaitable[scheduler_pb2.PlaceResponse]],
    ) -> float:
        done = 0
        stop_at = time.perf_counter() + duration

        async def loop() -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                await place(request(1_000_000 + next(counter)))
                done += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.perf_counter() - t0)

    stream_rate = await rate(streamed)
    unary_rate = await rate(unary)
    beating.terminate()
    beating.join(5)
    await calls.close()
    await channel.close()
    return {
        "client_p50": statistics.median(client_ms),
        "client_p99": _percentile(client_ms, 99),
        "server_p50": statistics.median(server_ms),
        "server_p99": _percentile(server_ms, 99),
        "cpu_ms": cpu_ms,
        "rate": stream_rate,
        "unary_rate": unary_rate,
        "concurrency": concurrency,
        "sequential": sequential,
    }


def run_section(quick: bool, command: str, threads: int | None, log: Callable[[str], None]) -> str:
    from scheduler.redis_server import RedisServer
    from services.launcher import free_port, is_serving

    two_cores = len(os.sched_getaffinity(0)) >= 2
    machine = MachineInfo.probe(num_threads=threads or 1)
    redis = RedisServer().start()
    proc: subprocess.Popen[bytes] | None = None
    try:
        if two_cores and redis.proc is not None:
            os.sched_setaffinity(redis.proc.pid, {1})
        port = free_port()
        log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"baton-bench-scheduler-{port}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.cli",
                    "scheduler",
                    "--redis-url",
                    redis.url,
                    "--port",
                    str(port),
                    "--heartbeat-timeout-s",
                    "600",
                    *NO_ADMISSION_LIMITS,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_pin(0 if two_cores else None),
            )
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not is_serving(address):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the scheduler did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.1)
        if two_cores:
            os.sched_setaffinity(0, {1})  # the client shares Redis's core, not the scheduler's
        r = asyncio.run(_measure(address, proc.pid, quick, log))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        redis.stop()
        if two_cores:
            os.sched_setaffinity(0, set(range(os.cpu_count() or 2)))
    p99_ok = r["client_p99"] < 2.0
    rate_ok = r["rate"] >= 2000
    pinning = (
        "the scheduler on core 0; Redis and this client on core 1"
        if two_cores
        else "one core: everything shares it"
    )
    return "\n".join(
        [
            "## Scheduler: placement decisions per second",
            "",
            provenance(machine, command),
            "",
            f"One `baton scheduler` process and a real redis-server on loopback ({pinning}). {NUM_WORKERS} workers "
            f"registered through `RegisterWorker` / `Heartbeat` ({NUM_WORKERS // 4} prefill, the rest decode; "
            f"{TOTAL_HASHES // NUM_WORKERS * NUM_WORKERS} published prefix hashes). Each `Place` carries a "
            f"{PROMPT_TOKENS}-token prompt whose leading blocks some workers hold, sent the way a gateway sends it: "
            "on its one long-lived `Calls` stream (the client is the gateway's own `CallStream`). The scheduler "
            "resolves the "
            "tenant, picks the version, hashes the prompt with the tenant's salt, reads every worker's load "
            "and prefix overlap, charges the quota and runs the cost function.",
            "",
            "| measure | value | goal |",
            "| --- | ---: | --- |",
            f"| decision latency p50, client side (sequential, {r['sequential']:.0f} calls) | {r['client_p50']:.2f} ms | |",
            f"| decision latency p99, client side | {r['client_p99']:.2f} ms | < 2 ms: **{'met' if p99_ok else 'not met'}** |",
            f"| decision time p50 / p99, inside the scheduler | {r['server_p50']:.2f} / {r['server_p99']:.2f} ms | |",
            f"| scheduler CPU per decision (sequential; with the heartbeats it handles meanwhile) | "
            f"{r['cpu_ms']:.2f} ms | |",
            f"| decisions/s, {r['concurrency']:.0f} in flight on the gateway's `Calls` stream | {r['rate']:.0f} | "
            f"≥ 2,000: **{'met' if rate_ok else 'not met'}** |",
            f"| decisions/s, {r['concurrency']:.0f} in flight as unary `Place` calls (for comparison) | "
            f"{r['unary_rate']:.0f} | |",
            "",
            "Registrations are RPCs, not worker processes: 64 engines do not fit on this machine, and placement "
            "reads only what the registry holds. Each registered worker sends a load-only heartbeat every 0.5 s "
            "during the run, the 64 spread evenly over the half second as independent workers' are (128 "
            "heartbeats/s on the same replica), and the scheduler runs with its admission "
            f"limits off (`{' '.join(NO_ADMISSION_LIMITS)}`): these workers' queues never drain, and queueing is "
            "the Tenancy section's subject.",
        ]
    )
