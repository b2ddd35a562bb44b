"""The soak: hours of a shared cluster's life in ``--minutes``. The real cluster of `tenancy_bench`
(redis-server, the scheduler, a prefill and a decode worker on the default model with NIXL, the gateway;
each a process as a user starts it) takes a steady Poisson stream of ``--requests`` requests from two
tenants — mixed prompt and output lengths, 5% cancelled by their client part-way — while every
process's resident memory and open file descriptors are sampled.

It reports what a leak would move: each process's RSS slope after warm-up (least squares over the
samples of the last three quarters, MB per minute) and its descriptors' range; and once the load has
stopped and the cluster is idle, whether every KV block is free with no lease or request left on either
worker, and whether Redis holds no more keys than before the load (the leases, reservations and fair
queue entries all gone). `benchmarks.chaos` runs it and writes the figures into docs/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.serving_harness import RequestSpec, generate
from benchmarks.tenancy_bench import KEYS, TenancyPlan, cluster

SAMPLE_EVERY_S = 15.0
CANCEL_SHARE = 0.05
# Chat-sized requests the 2-core P + D cluster serves at the soak's 8.3 requests/s without queueing
# past the scheduler's queue timeout (a soak measures leaks, not the capacity).
PROMPT_LENS = (8, 96)
OUTPUT_LENS = (2, 24)


@dataclass(slots=True)
class Soak:
    """The figures of one soak."""

    minutes: float
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # status → count (not the cancelled)
    rss_mb: dict[str, list[float]] = field(default_factory=dict)  # process → samples
    fds: dict[str, list[int]] = field(default_factory=dict)
    sample_times_s: list[float] = field(default_factory=list)
    slope_mb_per_min: dict[str, float] = field(default_factory=dict)
    idle_free: dict[str, str] = field(default_factory=dict)  # worker → "all N free" or what is held
    redis_keys: tuple[int, int] = (0, 0)  # before the load, after it (idle)
    lasting_keys: dict[str, int] = field(default_factory=dict)  # added keys without an expiry, by shape
    keys_at_idle: int = 0  # right after the load (records within their retention windows included)
    max_ttl_s: float = 0.0  # the longest expiry among the added keys then
    commands: list[str] = field(default_factory=list)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def slope(times_s: list[float], values: list[float]) -> float:
    """Least-squares slope of ``values`` over ``times_s``, per minute."""
    n = len(times_s)
    if n < 2:
        return 0.0
    mt, mv = sum(times_s) / n, sum(values) / n
    var = sum((t - mt) ** 2 for t in times_s)
    return (
        0.0 if var == 0 else 60 * sum((t - mt) * (v - mv) for t, v in zip(times_s, values, strict=True)) / var
    )


def workload(
    requests: int, minutes: float, seed: int = 0, vocab_size: int = 49152, tag: str = "soak"
) -> list[tuple[str, RequestSpec, bool]]:
    """(tenant, request, cancelled) at Poisson times over ``minutes``: the two tenants alternate."""
    rng = random.Random(seed)
    rate = requests / (minutes * 60)
    out, t = [], 0.0
    for i in range(requests):
        t += rng.expovariate(rate)
        prompt = tuple(rng.randrange(3, vocab_size) for _ in range(rng.randint(*PROMPT_LENS)))
        spec = RequestSpec(f"{tag}-{i}", prompt, rng.randint(*OUTPUT_LENS), start_s=t)
        out.append((list(KEYS)[i % 2], spec, rng.random() < CANCEL_SHARE))
    return out


async def _one(channel: Any, tenant: str, spec: RequestSpec, cancel: bool, t0: float) -> str:
    """Sends one request at its time; a cancelled one is dropped by its client after its first token."""
    from baton.v1 import gateway_pb2_grpc

    await asyncio.sleep(max(0.0, t0 + spec.start_s - time.perf_counter()))
    stub = gateway_pb2_grpc.GatewayStub(channel)
    metadata = (("x-api-key", KEYS[tenant]),)
    if not cancel:
        trace = await generate(stub, spec, spec.name, metadata=metadata)
        return "ok" if trace.error is None else trace.error.split(":", 1)[0]
    import grpc

    from baton.v1 import common_pb2, gateway_pb2

    call = stub.Generate(
        gateway_pb2.GenerateRequest(
            request_id=spec.name,
            prompt_token_ids=gateway_pb2.TokenIds(ids=spec.prompt_ids),
            sampling=common_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True),
        ),
        metadata=metadata,
        timeout=600,
    )
    try:
        async for _ in call:
            call.cancel()
            break
    except grpc.aio.AioRpcError as e:  # refused or failed before its first token
        return e.code().name
    return "cancelled"


async def _load(
    address: str, plan: list[tuple[str, RequestSpec, bool]], soak: Soak, pids: dict[str, int]
) -> None:
    import grpc

    async with grpc.aio.insecure_channel(address) as channel:
        t0 = time.perf_counter()

        async def sample() -> None:
            while True:
                soak.sample_times_s.append(time.perf_counter() - t0)
                for name, pid in pids.items():
                    soak.rss_mb.setdefault(name, []).append(_rss_mb(pid))
                    soak.fds.setdefault(name, []).append(_fds(pid))
                await asyncio.sleep(SAMPLE_EVERY_S)

        sampler = asyncio.ensure_future(sample())
        outcomes = await asyncio.gather(*(_one(channel, t, s, c, t0) for t, s, c in plan))
        sampler.cancel()
    soak.requests = len(outcomes)
    for outcome in outcomes:
        if outcome == "ok":
            soak.completed += 1
        elif outcome == "cancelled":
            soak.cancelled += 1
        else:
            soak.errors[outcome] = soak.errors.get(outcome, 0) + 1


def _redis_keys(url: str) -> int:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return int(client.dbsize())
    finally:
        client.close()


def _lasting_keys(url: str, before: set[str]) -> dict[str, int]:
    """Keys added since ``before`` that have no expiry, by their shape (ids replaced by *): a leak;
    keys with an expiry go away on their own."""
    import re

    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        shapes: dict[str, int] = {}
        for key in client.scan_iter(count=1000):
            if key not in before and client.ttl(key) == -1:
                shape = re.sub(r"[0-9a-f]{8,}|soak-\d+|\d+", "*", key)
                shapes[shape] = shapes.get(shape, 0) + 1
        return shapes
    finally:
        client.close()


def _max_ttl(url: str, before: set[str]) -> float:
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        ttls = [client.ttl(k) for k in client.scan_iter(count=1000) if k not in before]
        return float(max((t for t in ttls if t > 0), default=0))
    finally:
        client.close()


def _key_set(url: str) -> set[str]:
    import redis

    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        return set(client.scan_iter(count=1000))
    finally:
        client.close()


def _idle_workers(log_dir: Path) -> dict[str, str]:
    """Each worker's blocks once idle, from its Info (found through the scheduler's registry)."""
    import grpc

    from baton.v1 import worker_pb2, worker_pb2_grpc

    out = {}
    for role in ("prefill", "decode"):
        text = (log_dir / f"{role}.log").read_text()
        address = text.split("serving on ", 1)[1].split()[0]
        with grpc.insecure_channel(address) as channel:
            info = worker_pb2_grpc.WorkerStub(channel).Info(worker_pb2.InfoRequest(), timeout=10)
        held = info.num_blocks - info.num_free_blocks
        busy = (held, info.num_leases, info.num_running, info.num_waiting, info.num_transfers)
        out[role] = (
            f"all {info.num_blocks} blocks free, no lease or request"
            if not any(busy)
            else f"held {held} blocks, {info.num_leases} leases, {info.num_running + info.num_waiting} requests"
        )
    return out


def run(
    minutes: float, requests: int, log_dir: Path, settle_s: float = 700.0, log: Callable[[str], None] = print
) -> Soak:
    soak = Soak(minutes)
    plan = TenancyPlan(max_concurrent=256)
    log_dir.mkdir(parents=True, exist_ok=True)
    with cluster(plan, tuple(sorted(os.sched_getaffinity(0)))[:2], log_dir, log) as (address, commands, pids):
        soak.commands = commands
        redis_url = (log_dir / "redis.url").read_text().strip() if (log_dir / "redis.url").exists() else ""
        warm = workload(
            6, 0.05, seed=1, tag="warm"
        )  # ids of their own: a cancel is remembered  # one cancelled: the cancel bus's index exists before, too
        asyncio.run(_load(address, [(t, s, i == 5) for i, (t, s, _) in enumerate(warm)], Soak(0), {}))
        before = _redis_keys(redis_url) if redis_url else 0
        baseline = _key_set(redis_url) if redis_url else set()
        log(f"[soak] {requests} requests over {minutes:g} min; {before} Redis keys before")
        asyncio.run(_load(address, workload(requests, minutes), soak, pids))
        time.sleep(5)  # the last reports land
        soak.idle_free = _idle_workers(log_dir)
        if redis_url:
            soak.keys_at_idle = _redis_keys(redis_url)
            soak.lasting_keys = _lasting_keys(redis_url, baseline)
            # Finished leases and cancels are kept for their retention windows (scheduler.leases,
            # scheduler.cancel), then expire: wait them out, up to settle_s.
            soak.max_ttl_s = _max_ttl(redis_url, baseline)
            time.sleep(min(settle_s, soak.max_ttl_s + 2))
            soak.redis_keys = (before, _redis_keys(redis_url))
    warm_from = len(soak.sample_times_s) // 4  # the first quarter is warm-up
    for name, values in soak.rss_mb.items():
        soak.slope_mb_per_min[name] = slope(soak.sample_times_s[warm_from:], values[warm_from:])
    return soak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--log-dir", default="/tmp/baton-soak")
    p.add_argument("--settle-s", type=float, default=700.0, help="longest wait for Redis keys to expire")
    p.add_argument("--json", default=None, help="write the figures here as JSON")
    args = p.parse_args(argv)
    soak = run(args.minutes, args.requests, Path(args.log_dir), args.settle_s)
    text = json.dumps(asdict(soak), indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(
        json.dumps(
            {k: v for k, v in asdict(soak).items() if k not in ("rss_mb", "fds", "sample_times_s")}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
