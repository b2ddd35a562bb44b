"""The "Tenancy" section of `make bench`: does a flooding tenant hurt a quiet one?

The full local cluster as `baton up` starts it — a real redis-server, a `baton scheduler`, one prefill
and one decode worker (pinned to a core each) and the gateway — with two tenants of identical quotas,
each with its own API key. The quiet tenant sends short chat requests as a Poisson stream at
``quiet_rate``; the flooding tenant sends the same kind of requests ``flood_factor`` times as fast,
far beyond what the decode worker can serve. We measure the quiet tenant's TTFT (client side, request
sent → first token) alone and under the flood, in alternating blocks (alone, flood, alone, flood …)
with the same quiet arrivals in both halves of a round, so that a slow spell of this shared machine
falls on both sides of the ratio rather than on one; and report what happened to the flood's requests.

``python -m benchmarks.tenancy_bench --log-dir D`` keeps every process's log and ``D/traces.json`` (each
request's client TTFT and the gateway's queue time).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.report import MachineInfo, provenance
from benchmarks.serving_harness import (
    BATON,
    RequestSpec,
    Trace,
    generate,
    percentile,
    pinned,
    spawn,
    stop_all,
    wait_serving,
)

GOAL_RATIO = 1.5  # quiet tenant's TTFT p95 under the flood ÷ alone
KEYS = {"quiet": "bench-quiet-key", "flood": "bench-flood-key"}


@dataclass(frozen=True, slots=True)
class TenancyPlan:
    quiet_rate: float = 1.0  # requests/s, Poisson
    flood_factor: float = 10.0  # the flooding tenant's rate ÷ the quiet one's
    duration_s: float = 40.0  # of each block's arrivals
    rounds: int = 2  # blocks per side (about 75 quiet requests each: p95 is their 4th slowest)
    prompt_lens: tuple[int, int] = (32, 64)  # drawn per request, inclusive
    output_len: int = 32
    seed: int = 0
    kv_cache_memory: int = 256 << 20  # per worker
    threads: int = 1  # per worker (each has a core)
    max_concurrent: int = 16  # both tenants' quota of requests in flight
    scheduler_flags: tuple[str, ...] = ()  # extra `baton scheduler` flags
    prefill_flags: tuple[str, ...] = ()  # extra flags of the prefill worker

    def quick(self) -> TenancyPlan:
        return replace(self, quiet_rate=2.0, duration_s=3.0, output_len=8, rounds=1)


@dataclass(slots=True)
class PhaseResult:
    traces: dict[str, list[Trace]] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_pct: dict[str, float] = field(default_factory=dict)  # process → % of one core during the phase

    def ttfts_ms(self, tenant: str) -> list[float]:
        return [
            t.ttft_s * 1e3 for t in self.traces.get(tenant, []) if t.error is None and t.ttft_s is not None
        ]

    def errors(self, tenant: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.traces.get(tenant, []):
            if t.error is not None:
                kind = t.error.split(":", 1)[0]
                out[kind] = out.get(kind, 0) + 1
        return out

    def split_ms(self, tenant: str) -> tuple[list[float], list[float]]:
        """The gateway's own view of TTFT in two: waiting for admission (accepted → a worker started it),
        and the rest (the prefill and the first token's way back)."""
        ok = [
            t
            for t in self.traces.get(tenant, [])
            if t.error is None and t.server_queue_ms is not None and t.server_ttft_ms is not None
        ]
        return (
            [t.server_queue_ms for t in ok if t.server_queue_ms is not None],
            [
                t.server_ttft_ms - t.server_queue_ms
                for t in ok
                if t.server_ttft_ms is not None and t.server_queue_ms is not None
            ],
        )

    def itls_ms(self, tenant: str) -> list[float]:
        return [g * 1e3 for t in self.traces.get(tenant, []) if t.error is None for g in t.gaps_s()]

    def tokens_per_s(self, tenant: str) -> float:
        n = sum(len(t.token_ids) for t in self.traces.get(tenant, []) if t.error is None)
        return n / self.wall_s if self.wall_s > 0 else 0.0

    def add(self, other: PhaseResult) -> None:
        """Pools another block of the same side into this one."""
        total = self.wall_s + other.wall_s
        for name in set(self.cpu_pct) | set(other.cpu_pct):
            self.cpu_pct[name] = (
                (
                    (self.cpu_pct.get(name, 0.0) * self.wall_s + other.cpu_pct.get(name, 0.0) * other.wall_s)
                    / total
                )
                if total > 0
                else 0.0
            )
        for tenant, ts in other.traces.items():
            self.traces.setdefault(tenant, []).extend(ts)
        self.wall_s = total


def arrivals(
    plan: TenancyPlan, rate: float, seed: int, vocab_size: int, tag: str, token_seed: int | None = None
) -> list[RequestSpec]:
    """A Poisson stream of chat-sized requests over ``plan.duration_s``. Times and lengths come from
    ``seed``, token ids from ``token_seed`` (default: ``seed``): the same stream with other prompts (no
    prefix-cache hits on the first run's) for a second run."""
    rng = random.Random(seed)
    tokens = random.Random(seed if token_seed is None else token_seed)
    specs: list[RequestSpec] = []
    t = rng.expovariate(rate)
    while t < plan.duration_s:
        n = rng.randint(*plan.prompt_lens)
        ids = tuple(tokens.randrange(3, vocab_size) for _ in range(n))
        specs.append(RequestSpec(f"{tag}-{len(specs)}", ids, plan.output_len, kind=tag, start_s=t))
        t += rng.expovariate(rate)
    return specs


def _cpu_s(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


async def run_phase(
    address: str, streams: dict[str, list[RequestSpec]], phase: str, pids: dict[str, int] | None = None
) -> PhaseResult:
    """Sends every tenant's requests at their arrival times, each on the tenant's own channel with its
    API key; waits for all of them to end. With ``pids``, notes each process's CPU use meanwhile."""
    import grpc

    from baton.v1 import gateway_pb2_grpc

    result = PhaseResult()
    pids = pids or {}
    cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
    channels = {tenant: grpc.aio.insecure_channel(address) for tenant in streams}
    try:
        t0 = time.perf_counter()

        async def one(tenant: str, spec: RequestSpec) -> Trace:
            await asyncio.sleep(max(0.0, t0 + spec.start_s - time.perf_counter()))
            stub = gateway_pb2_grpc.GatewayStub(channels[tenant])
            return await generate(stub, spec, f"{phase}-{spec.name}", metadata=(("x-api-key", KEYS[tenant]),))

        tasks = {
            tenant: [asyncio.ensure_future(one(tenant, s)) for s in specs]
            for tenant, specs in streams.items()
        }
        for tenant, ts in tasks.items():
            result.traces[tenant] = list(await asyncio.gather(*ts))
        result.wall_s = time.perf_counter() - t0
        result.cpu_pct = {
            name: 100 * (_cpu_s(pid) - cpu0[name]) / result.wall_s for name, pid in pids.items()
        }
    finally:
        for ch in channels.values():
            await ch.close()
    return result


@contextlib.contextmanager
def cluster(
    plan: TenancyPlan, cores: tuple[int, ...], log_dir: Path, log: Callable[[str], None]
) -> Iterator[tuple[str, list[str], dict[str, int]]]:
    """Redis, the scheduler, P on the first core, D on the second, the gateway; yields the gateway's
    address and the commands (as a user types them)."""
    from scheduler.redis_server import RedisServer
    from services.launcher import free_port

    redis = RedisServer(log_path=log_dir / "redis.log").start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        sched = f"127.0.0.1:{free_port()}"
        p_core: tuple[int, ...] | None = (cores[0],) if len(cores) >= 2 else None
        d_core: tuple[int, ...] | None = (cores[1],) if len(cores) >= 2 else None
        common = [
            "--scheduler",
            sched,
            "--redis-url",
            redis.url,
            "--kv-transport",
            "nixl",
            "--threads",
            str(plan.threads),
            "--kv-cache-memory",
            f"{plan.kv_cache_memory >> 20}MiB",
        ]
        gw = f"127.0.0.1:{free_port()}"
        specs: list[tuple[str, list[str], tuple[int, ...] | None, str]] = [
            (
                "scheduler",
                [
                    *BATON,
                    "scheduler",
                    "--redis-url",
                    redis.url,
                    "--port",
                    sched.rsplit(":", 1)[1],
                    *plan.scheduler_flags,
                ],
                None,
                sched,
            )
        ]
        for role, core in (("prefill", p_core), ("decode", d_core)):
            port = str(free_port())
            extra = plan.prefill_flags if role == "prefill" else ()
            specs.append(
                (
                    f"{role} worker",
                    [*BATON, "worker", "--role", role, "--port", port, *common, *extra],
                    core,
                    f"127.0.0.1:{port}",
                )
            )
        specs.append(
            (
                "gateway",
                [
                    *BATON,
                    "gateway",
                    "--scheduler",
                    sched,
                    "--grpc-port",
                    gw.rsplit(":", 1)[1],
                    "--http-port",
                    "0",
                ],
                None,
                gw,
            )
        )
        for name, argv, core, address in specs:
            procs.append(spawn(argv, core, log_dir / f"{name.split()[0]}.log"))
            if name != "prefill worker":  # P and D load their models side by side
                wait_serving(name, procs[-1], address, log_dir / f"{name.split()[0]}.log")
            if name == "scheduler":
                asyncio.run(_add_tenants(redis.url, plan.max_concurrent))
        _wait_registered(redis.url, 2)
        log(f"[tenancy] cluster up: gateway {gw}")
        pids = {name.split()[0]: p.pid for (name, *_), p in zip(specs, procs, strict=True)}
        if redis.proc is not None:
            pids["redis"] = redis.proc.pid
        (log_dir / "redis.url").write_text(redis.url)  # for a caller that reads the cluster's state
        yield gw, [pinned(argv, core) for _, argv, core, _ in specs], pids
    finally:
        stop_all(procs)
        redis.stop()


async def _add_tenants(redis_url: str, max_concurrent: int) -> None:
    import redis.asyncio as aioredis

    from scheduler.tenants import TenantConfig, TenantDirectory

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    try:
        directory = TenantDirectory(client)
        for name, key in KEYS.items():
            await directory.add_tenant(TenantConfig(name, max_concurrent=max_concurrent))  # the same quotas
            await directory.add_api_key(key, name)
    finally:
        await client.aclose()


def _wait_registered(redis_url: str, n: int, timeout_s: float = 120.0) -> None:
    from scheduler.registry import WorkerRegistry

    async def count() -> int:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            return len(await WorkerRegistry(client).all_workers())
        finally:
            await client.aclose()

    deadline = time.monotonic() + timeout_s
    while asyncio.run(count()) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {n} workers registered with the scheduler in {timeout_s:.0f} s")
        time.sleep(0.2)


def run_section(
    quick: bool,
    command: str,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    log_dir: Path | None = None,
    plan: TenancyPlan | None = None,
) -> str:
    import json

    from engine.gguf_convert import prepare_default_model

    plan = plan or (TenancyPlan().quick() if quick else TenancyPlan())
    vocab = int(json.loads((prepare_default_model() / "config.json").read_text())["vocab_size"])
    cores = tuple(sorted(os.sched_getaffinity(0))[:2])
    machine = MachineInfo.probe(num_threads=plan.threads)
    solo, flooded = PhaseResult(), PhaseResult()
    with (
        tempfile.TemporaryDirectory(prefix="baton-bench-tenancy-") as tmp,
        cluster(plan, cores, log_dir or Path(tmp), log) as (address, commands, pids),
    ):
        warm = arrivals(replace(plan, duration_s=2.0), 2.0, plan.seed + 3, vocab, "quiet")
        asyncio.run(run_phase(address, {"quiet": warm}, "warm"))
        for k in range(plan.rounds):
            seed = plan.seed + 10 * k
            # The quiet tenant sends the same stream (times and sizes) on both sides, with other prompts.
            quiet, quiet_again, flood = (
                [replace(x, name=f"{x.name}.r{k}") for x in stream]
                for stream in (
                    arrivals(plan, plan.quiet_rate, seed, vocab, "quiet"),
                    arrivals(plan, plan.quiet_rate, seed, vocab, "quiet", token_seed=seed + 1),
                    arrivals(plan, plan.quiet_rate * plan.flood_factor, seed + 2, vocab, "flood"),
                )
            )
            log(f"[tenancy] round {k + 1}/{plan.rounds}: {len(quiet)} quiet requests alone")
            solo.add(asyncio.run(run_phase(address, {"quiet": quiet}, f"solo{k}", pids)))
            log(
                f"[tenancy] round {k + 1}/{plan.rounds}: {len(quiet_again)} quiet and {len(flood)} flooding requests"
            )
            flooded.add(
                asyncio.run(run_phase(address, {"quiet": quiet_again, "flood": flood}, f"flood{k}", pids))
            )
    if log_dir is not None:
        (log_dir / "traces.json").write_text(
            json.dumps(
                {
                    phase: {
                        tenant: [
                            {
                                "name": t.name,
                                "sent": t.sent_at,
                                "ttft_ms": None if t.ttft_s is None else t.ttft_s * 1e3,
                                "server_ttft_ms": t.server_ttft_ms,
                                "queue_ms": t.server_queue_ms,
                                "error": t.error,
                            }
                            for t in ts
                        ]
                        for tenant, ts in r.traces.items()
                    }
                    for phase, r in (("solo", solo), ("flood", flooded))
                }
            )
        )
    return render(plan, machine, command, commands, solo, flooded)


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:.0f}"


def render(
    plan: TenancyPlan,
    machine: MachineInfo,
    command: str,
    commands: list[str],
    solo: PhaseResult,
    flooded: PhaseResult,
) -> str:
    s, f = solo.ttfts_ms("quiet"), flooded.ttfts_ms("quiet")
    p95_s, p95_f = percentile(s, 95), percentile(f, 95)
    ratio = p95_f / p95_s if p95_s and p95_f else None
    met = ratio is not None and ratio <= GOAL_RATIO and not flooded.errors("quiet")
    flood_traces = flooded.traces.get("flood", [])
    flood_ok = flooded.ttfts_ms("flood")
    errs = flooded.errors("flood")
    rows = [
        ("quiet alone", s, solo.itls_ms("quiet"), solo.errors("quiet"), solo.tokens_per_s("quiet")),
        (
            "quiet, under the flood",
            f,
            flooded.itls_ms("quiet"),
            flooded.errors("quiet"),
            flooded.tokens_per_s("quiet"),
        ),
        ("flooding tenant", flood_ok, flooded.itls_ms("flood"), errs, flooded.tokens_per_s("flood")),
    ]
    lines = [
        "## Tenancy: a flooding tenant next to a quiet one",
        "",
        provenance(machine, command),
        "",
        f"The local cluster (`baton up`'s processes: {', '.join(f'`{c}`' for c in commands)}), two tenants "
        f"with the same quotas ({plan.max_concurrent} requests in flight each, the other limits at their defaults) and their own API keys. The quiet tenant sends {plan.quiet_rate:g} "
        f"request/s (Poisson), the flooding one {plan.quiet_rate * plan.flood_factor:g}/s "
        f"({plan.flood_factor:g}×), each request a {plan.prompt_lens[0]}–{plan.prompt_lens[1]}-token prompt "
        f"and {plan.output_len} greedy output tokens. {plan.rounds} round{'s' if plan.rounds > 1 else ''} of "
        f"{plan.duration_s:g} s of arrivals with the quiet tenant alone, then {plan.duration_s:g} s with the same "
        "quiet arrivals and sizes (other prompts) under the flood; each side's rounds pooled, so that a slow "
        "spell of the machine falls on both sides. TTFT is client side (request sent → first token).",
        "",
        "| who | requests | ok | TTFT p50 ms | TTFT p95 ms | TTFT p99 ms | ITL p50 / p95 ms | errors | output tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    sent = {
        "quiet alone": len(solo.traces.get("quiet", [])),
        "quiet, under the flood": len(flooded.traces.get("quiet", [])),
        "flooding tenant": len(flood_traces),
    }
    for name, ttfts, itls, e, tps in rows:
        err = ", ".join(f"{k} {v}" for k, v in sorted(e.items())) or "none"
        lines.append(
            f"| {name} | {sent[name]} | {len(ttfts)} | {_ms(percentile(ttfts, 50))} | "
            f"{_ms(percentile(ttfts, 95))} | {_ms(percentile(ttfts, 99))} | "
            f"{_ms(percentile(itls, 50))} / {_ms(percentile(itls, 95))} | {err} | {tps:.1f} |"
        )
    (qa, ra), (qf, rf) = solo.split_ms("quiet"), flooded.split_ms("quiet")
    if qa and qf:
        lines += [
            "",
            "Where the quiet tenant's TTFT goes (the gateway's timings, p50 / p95 ms): waiting for "
            f"admission {_ms(percentile(qa, 50))} / {_ms(percentile(qa, 95))} alone, "
            f"{_ms(percentile(qf, 50))} / {_ms(percentile(qf, 95))} under the flood; the rest (prefill "
            f"and the first token's way back) {_ms(percentile(ra, 50))} / {_ms(percentile(ra, 95))} alone, "
            f"{_ms(percentile(rf, 50))} / {_ms(percentile(rf, 95))} under the flood.",
        ]
    if flooded.cpu_pct:
        names = list(flooded.cpu_pct)
        lines += [
            "",
            "CPU use per process, % of one core (the machine has "
            f"{os.cpu_count()}; P and D are pinned to one each, the rest float):",
            "",
            "| phase | " + " | ".join(names) + " |",
            "| --- |" + " ---: |" * len(names),
        ]
        for label, r in (("quiet alone", solo), ("under the flood", flooded)):
            lines.append(f"| {label} | " + " | ".join(f"{r.cpu_pct.get(n, 0.0):.0f}" for n in names) + " |")
    lines += [
        "",
        f"Quiet tenant's TTFT p95 under the flood ÷ alone: **{'—' if ratio is None else f'{ratio:.2f}×'}** "
        f"(goal ≤ {GOAL_RATIO}×, no quiet request failing: **{'met' if met else 'not met'}**).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.tenancy_bench")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--log-dir", type=Path, default=None, help="keep every process's log here")
    p.add_argument("--max-concurrent", type=int, default=TenancyPlan().max_concurrent)
    p.add_argument("--scheduler-flags", default="", help="extra `baton scheduler` flags, one string")
    p.add_argument("--prefill-flags", default="", help="extra prefill worker flags, one string")
    args = p.parse_args(argv)
    plan = TenancyPlan().quick() if args.quick else TenancyPlan()
    plan = replace(
        plan,
        max_concurrent=args.max_concurrent,
        scheduler_flags=tuple(args.scheduler_flags.split()),
        prefill_flags=tuple(args.prefill_flags.split()),
    )
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    print(
        run_section(
            args.quick,
            "python -m benchmarks.tenancy_bench",
            log=lambda m: print(m, file=sys.stderr),
            log_dir=args.log_dir,
            plan=plan,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
