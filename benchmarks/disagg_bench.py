"""The "Disaggregation" section: how steadily short chat requests decode while long prompts arrive, with
prefill and decode disaggregated onto separate cores against one colocated worker on the same two cores
(with and without chunked prefill); and the serving overhead, the gateway against the offline engine.

Every configuration runs as real processes started the way a user starts them (``python -m services.cli
worker …`` and ``python -m services.cli gateway …`` with static placement), one configuration after
another in the same run. This process sends the same seeded workload to the gateway's gRPC ``Generate``
stream and notes, client-side, when each token delta arrives. torch lives only in the children; the
offline engine runs in one too (``python -m benchmarks.disagg_bench offline …``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.disagg_report import Summary, render_section, summary_line
from benchmarks.report import MachineInfo, provenance
from benchmarks.serving_harness import (
    BATON,
    REQUEST_TIMEOUT_S,
    RequestSpec,
    Trace,
    cpu_ticks,
    drive,
    others_cpu_pct,
    pinned,
    spawn,
    stop_all,
    wait_quiet,
    wait_serving,
)
from core.units import parse_bytes

FIRST_PLAIN_ID = 17  # SmolLM2's special tokens are ids 0-16; the random prompts avoid them


@dataclass(frozen=True, slots=True)
class DisaggPlan:
    """The workload and the flags of one run."""

    num_slots: int = 8  # short requests in flight at once; a slot sends its next when one ends
    rounds: int = 3  # short requests per slot
    short_prompt_lens: tuple[int, int] = (32, 64)  # drawn per request, inclusive
    short_output_lens: tuple[int, int] = (64, 96)
    long_prompt_len: int = 2048
    long_output_len: int = 8
    # After the first short request is sent; ~9 s apart, about one 2k prefill on one core, so the long prompts
    # meet decoding short requests, not a queue of each other.
    long_arrivals_s: tuple[float, ...] = (2.0, 11.0, 20.0)
    overhead_requests: int = 16  # the serving-overhead burst: short requests sent at once
    overhead_repeats: int = 3  # bursts each way (fresh prompts each time); the fastest counts
    seed: int = 0
    threads: int = 2  # colocated worker and offline engine; each disaggregated worker gets one core's share
    local_prefill_threshold: int = 256  # gateway: shorter prompts prefill on the decode worker
    chunk: int = 256  # colocated with chunked prefill: --long-prefill-chunk
    chunk_budget: int = 512  # … and --max-num-batched-tokens
    no_chunk: int = 8192  # colocated without: both flags, so a whole prompt prefills in one step
    kv_cache_memory: int = 512 << 20  # per worker
    max_quiet_wait_s: float = 60.0  # before each measured phase, wait this long at most for a quiet machine

    def quick(self) -> DisaggPlan:
        return replace(
            self,
            num_slots=2,
            rounds=1,
            short_prompt_lens=(16, 24),
            short_output_lens=(8, 8),
            long_prompt_len=256,
            long_output_len=4,
            long_arrivals_s=(0.3,),
            overhead_requests=2,
            overhead_repeats=1,
            chunk=64,
            chunk_budget=128,
            max_quiet_wait_s=0.0,
        )


def short_requests(plan: DisaggPlan, vocab_size: int, seed: int, count: int) -> list[RequestSpec]:
    """``count`` chat-sized requests: prompt and output lengths drawn from the plan's ranges."""
    rng = random.Random(seed)
    specs = []
    for i in range(count):
        n = rng.randint(*plan.short_prompt_lens)
        ids = tuple(rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(n))
        specs.append(RequestSpec(f"short{i}", ids, rng.randint(*plan.short_output_lens)))
    return specs


def long_requests(plan: DisaggPlan, vocab_size: int, seed: int) -> list[RequestSpec]:
    """One long prompt per arrival time of the plan."""
    rng = random.Random(seed)
    return [
        RequestSpec(
            f"long{i}",
            tuple(rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(plan.long_prompt_len)),
            plan.long_output_len,
            "long",
            at,
        )
        for i, at in enumerate(plan.long_arrivals_s)
    ]


@dataclass(frozen=True, slots=True)
class Workload:
    """Every request of one run, the same for each configuration."""

    slots: list[list[RequestSpec]]
    longs: list[RequestSpec]
    bursts: list[list[RequestSpec]]  # the serving-overhead bursts, fresh prompts each
    direct_bursts: list[list[RequestSpec]]  # the same shapes, other ids: straight to the worker's Decode
    warmup: tuple[RequestSpec, RequestSpec]  # a local prefill and one through the prefill worker

    @classmethod
    def build(cls, plan: DisaggPlan, vocab_size: int) -> Workload:
        shorts = short_requests(plan, vocab_size, plan.seed, plan.num_slots * plan.rounds)
        slots = [shorts[i :: plan.num_slots] for i in range(plan.num_slots)]
        bursts = [
            [
                replace(s, name=f"burst{r}-{s.name}")
                for s in short_requests(plan, vocab_size, plan.seed + 1000 + r, plan.overhead_requests)
            ]
            for r in range(plan.overhead_repeats)
        ]
        span = vocab_size - FIRST_PLAIN_ID
        direct = [
            [
                replace(
                    s,
                    name=f"direct-{s.name}",
                    prompt_ids=tuple(FIRST_PLAIN_ID + (i - FIRST_PLAIN_ID + 1) % span for i in s.prompt_ids),
                )
                for s in b
            ]
            for b in bursts
        ]
        rng = random.Random(plan.seed + 2000)
        warm = [
            tuple(rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(n))
            for n in (16, plan.local_prefill_threshold + 16)
        ]
        return cls(
            slots,
            long_requests(plan, vocab_size, plan.seed + 1),
            bursts,
            direct,
            (RequestSpec("warm-short", warm[0], 4), RequestSpec("warm-long", warm[1], 2)),
        )


# ------------------------------------------------------------------ the configurations
@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker of a configuration."""

    name: str  # also its port's placeholder in the printed commands
    role: str
    cores: tuple[int, ...] | None
    threads: int
    flags: tuple[str, ...] = ()

    def argv(self, port: str, kv_cache_memory: int) -> list[str]:
        return [
            *BATON,
            "worker",
            "--role",
            self.role,
            "--port",
            port,
            "--threads",
            str(self.threads),
            "--kv-cache-memory",
            f"{kv_cache_memory >> 20}MiB",
            *self.flags,
        ]


@dataclass(frozen=True, slots=True)
class Setup:
    """One configuration: its workers and how the gateway places requests on them."""

    key: str
    label: str
    workers: tuple[WorkerSpec, ...]
    threshold: int | None = None  # --local-prefill-threshold, with a prefill worker

    def gateway_argv(self, port: str, ports: dict[str, str]) -> list[str]:
        by_role = {w.role: f"127.0.0.1:{ports[w.name]}" for w in self.workers}
        argv = [
            *BATON,
            "gateway",
            "--grpc-port",
            port,
            "--http-port",
            "0",
            "--decode-workers",
            by_role.get("decode", by_role.get("both", "")),
        ]
        if "prefill" in by_role:
            argv += [
                "--prefill-workers",
                by_role["prefill"],
                "--local-prefill-threshold",
                str(self.threshold),
            ]
        return argv

    def commands(self, kv_cache_memory: int) -> list[str]:
        ports = {w.name: f"${w.name.upper()}_PORT" for w in self.workers}
        return [
            *(pinned(w.argv(ports[w.name], kv_cache_memory), w.cores) for w in self.workers),
            pinned(self.gateway_argv("$GATEWAY_PORT", ports), None),
        ]


def setups(plan: DisaggPlan, cores: tuple[int, ...]) -> list[Setup]:
    """The three configurations on the same (two) cores: P and D on one core each, or one worker on both."""
    both = tuple(cores) if cores else None
    p_core, d_core = ((cores[0],), (cores[1],)) if len(cores) >= 2 else (both, both)
    one = max(1, plan.threads // 2)
    return [
        Setup(
            "disagg",
            "disaggregated (P and D on separate cores)",
            (
                WorkerSpec("prefill", "prefill", p_core, one, ("--kv-transport", "nixl")),
                WorkerSpec("decode", "decode", d_core, one, ("--kv-transport", "nixl")),
            ),
            threshold=plan.local_prefill_threshold,
        ),
        Setup(
            "colocated",
            "colocated, no chunked prefill",
            (
                WorkerSpec(
                    "worker",
                    "both",
                    both,
                    plan.threads,
                    (
                        "--long-prefill-chunk",
                        str(plan.no_chunk),
                        "--max-num-batched-tokens",
                        str(plan.no_chunk),
                        "--mixed-prefill-tokens",
                        "0",
                    ),
                ),
            ),
        ),
        Setup(
            "chunked",
            "colocated, chunked prefill",
            (
                WorkerSpec(
                    "worker",
                    "both",
                    both,
                    plan.threads,
                    (
                        "--long-prefill-chunk",
                        str(plan.chunk),
                        "--max-num-batched-tokens",
                        str(plan.chunk_budget),
                        "--mixed-prefill-tokens",
                        "0",
                    ),
                ),
            ),
        ),
    ]


@dataclass(frozen=True, slots=True)
class Cluster:
    """A running configuration: the gateway's and the workers' gRPC addresses and every process id."""

    address: str
    workers: tuple[str, ...]
    pids: tuple[int, ...]


@contextlib.contextmanager
def running(setup: Setup, kv_cache_memory: int, log_dir: Path) -> Iterator[Cluster]:
    """Starts the workers and the gateway (which waits for the workers' Info itself) and waits until each
    answers the gRPC health check with SERVING; stops every process on the way out, an error included."""
    from services.launcher import free_port

    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = {w.name: str(free_port()) for w in setup.workers}
        port = str(free_port())
        names = [*(f"{w.name} worker" for w in setup.workers), "gateway"]
        addresses = [*(f"127.0.0.1:{ports[w.name]}" for w in setup.workers), f"127.0.0.1:{port}"]
        logs = [log_dir / f"{setup.key}-{n.split()[0]}.log" for n in names]
        for w, log_path in zip(setup.workers, logs, strict=False):
            procs.append(spawn(w.argv(ports[w.name], kv_cache_memory), w.cores, log_path))
        procs.append(spawn(setup.gateway_argv(port, ports), None, logs[-1]))
        for name, proc, address, log_path in zip(names, procs, addresses, logs, strict=True):
            wait_serving(name, proc, address, log_path)
        yield Cluster(addresses[-1], tuple(addresses[:-1]), tuple(p.pid for p in procs))
    finally:
        stop_all(procs)


# ------------------------------------------------------------------ measuring
@dataclass(slots=True)
class SetupResult:
    """One configuration's run of the mixed workload (and, for one of them, the overhead bursts)."""

    setup: Setup
    traces: list[Trace] = field(default_factory=list)
    bursts: list[list[Trace]] = field(default_factory=list)  # serving overhead through the gateway
    direct_bursts: list[list[Trace]] = field(default_factory=list)  # … and straight to the worker
    others_cpu_pct: float | None = None  # CPU time other processes took during the mixed run
    burst_others_cpu_pct: list[float | None] = field(default_factory=list)
    direct_others_cpu_pct: list[float | None] = field(default_factory=list)
    error: str | None = None


@dataclass(slots=True)
class OfflineResult:
    """The offline engine's bursts: wall seconds and tokens of each."""

    walls_s: list[float] = field(default_factory=list)
    token_ids: list[list[list[int]]] = field(default_factory=list)
    others_cpu_pct: list[float | None] = field(default_factory=list)
    command: str = ""
    error: str | None = None


def run_setup(
    setup: Setup, plan: DisaggPlan, work: Workload, log_dir: Path, overhead: bool, log: Callable[[str], None]
) -> SetupResult:
    """Starts one configuration, warms it up, runs the mixed workload (and, with ``overhead``, the
    serving-overhead bursts) and stops it; a failure becomes the result's error."""
    result = SetupResult(setup)
    t0 = time.perf_counter()
    try:
        with running(setup, plan.kv_cache_memory, log_dir) as cluster:
            pids = (os.getpid(), *cluster.pids)
            log(
                f"[disaggregation] {setup.key}: serving after {time.perf_counter() - t0:.0f} s; warm-up, then "
                "the mixed workload"
            )
            _raise_errors(
                asyncio.run(drive(cluster.address, f"{setup.key}-warmup", [[w] for w in work.warmup]))
            )
            wait_quiet(pids, plan.max_quiet_wait_s, lambda m: log(f"[disaggregation] {m}"))
            before = cpu_ticks(pids)
            result.traces = asyncio.run(drive(cluster.address, setup.key, work.slots, work.longs))
            result.others_cpu_pct = others_cpu_pct(before, cpu_ticks(pids))
            _raise_errors(result.traces)
            if overhead:
                _overhead_bursts(cluster, pids, plan, work, result, log)
    except (RuntimeError, OSError) as e:
        result.error = str(e)
    log(
        f"[disaggregation] {setup.key}: "
        + (f"failed: {result.error}" if result.error else summary_line(Summary.of(result.traces)))
    )
    return result


def _overhead_bursts(
    cluster: Cluster,
    pids: Sequence[int],
    plan: DisaggPlan,
    work: Workload,
    result: SetupResult,
    log: Callable[[str], None],
) -> None:
    """The overhead bursts, alternately through the gateway and straight to the worker's Decode."""
    for i, (burst, direct) in enumerate(zip(work.bursts, work.direct_bursts, strict=True)):
        for specs, traces, others, to_worker in (
            (burst, result.bursts, result.burst_others_cpu_pct, False),
            (direct, result.direct_bursts, result.direct_others_cpu_pct, True),
        ):
            wait_quiet(pids, plan.max_quiet_wait_s, lambda m: log(f"[disaggregation] {m}"))
            before = cpu_ticks(pids)
            address = cluster.workers[0] if to_worker else cluster.address
            got = asyncio.run(
                drive(address, f"{result.setup.key}-b{i}", [[s] for s in specs], worker=to_worker)
            )
            others.append(others_cpu_pct(before, cpu_ticks(pids)))
            traces.append(got)
            _raise_errors(got)


def _raise_errors(traces: Sequence[Trace]) -> None:
    bad = [f"{t.name}: {t.error}" for t in traces if t.error]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed, e.g. {bad[0]}")


def run_offline(plan: DisaggPlan, work: Workload, cores: tuple[int, ...], log_dir: Path) -> OfflineResult:
    """The overhead bursts through ``LLM.generate`` in a child on the same cores, threads and engine flags."""
    job, out = log_dir / "offline-job.json", log_dir / "offline-result.json"
    job.write_text(
        json.dumps(
            {
                "warmup": [list(work.warmup[0].prompt_ids), work.warmup[0].max_tokens],
                "bursts": [[[list(s.prompt_ids), s.max_tokens] for s in b] for b in work.bursts],
            }
        )
    )
    flags = [
        "--threads",
        str(plan.threads),
        "--kv-cache-memory",
        f"{plan.kv_cache_memory >> 20}MiB",
        "--long-prefill-chunk",
        str(plan.chunk),
        "--max-num-batched-tokens",
        str(plan.chunk_budget),
        "--max-quiet-wait-s",
        f"{plan.max_quiet_wait_s:g}",
    ]
    argv = [sys.executable, "-m", "benchmarks.disagg_bench", "offline", *flags]
    result = OfflineResult(command=pinned([*argv, "--job", "JOB.json"], cores or None))
    proc = spawn([*argv, "--job", str(job), "--out", str(out)], cores or None, log_dir / "offline.log")
    try:
        proc.wait(REQUEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        result.error = f"timed out after {REQUEST_TIMEOUT_S:.0f} s"
    finally:
        stop_all([proc])
    if result.error is None and not out.exists():
        tail = " ".join((log_dir / "offline.log").read_text(errors="replace").splitlines()[-3:])
        result.error = f"exited with code {proc.returncode}: {tail}"
    if result.error is None:
        got = json.loads(out.read_text())
        result.walls_s, result.token_ids, result.others_cpu_pct = (
            got["walls_s"],
            got["token_ids"],
            got["others"],
        )
    return result


def offline_main(argv: Sequence[str]) -> int:
    """``python -m benchmarks.disagg_bench offline``: runs a job's bursts through ``LLM.generate``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.disagg_bench offline")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--kv-cache-memory", type=parse_bytes, required=True)
    p.add_argument("--long-prefill-chunk", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, required=True)
    p.add_argument(
        "--max-quiet-wait-s",
        type=float,
        default=0.0,
        help="before each burst, wait this long at most for other processes to go quiet",
    )
    p.add_argument("--job", type=Path, required=True)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    from core.sampling_params import SamplingParams
    from engine.llm import LLM

    llm = LLM(
        model=None,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.threads,
        long_prefill_chunk=args.long_prefill_chunk,
        max_num_batched_tokens=args.max_num_batched_tokens,
        mixed_prefill_tokens=0,
    )  # as the chunked worker it is compared with
    job = json.loads(args.job.read_text())
    warm_ids, warm_max = job["warmup"]
    llm.generate([warm_ids], SamplingParams(max_tokens=warm_max, temperature=0.0, ignore_eos=True))
    walls, tokens, others = [], [], []
    for burst in job["bursts"]:
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in burst]
        wait_quiet([os.getpid()], args.max_quiet_wait_s, lambda m: print(m, file=sys.stderr, flush=True))
        before = cpu_ticks([os.getpid()])
        t0 = time.perf_counter()
        outs = llm.generate([ids for ids, _ in burst], params)
        walls.append(time.perf_counter() - t0)
        others.append(others_cpu_pct(before, cpu_ticks([os.getpid()])))
        tokens.append([list(o.token_ids) for o in outs])
    text = json.dumps({"walls_s": walls, "token_ids": tokens, "others": others})
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


def _vocab_size() -> int:
    """The default model's vocabulary, converting it first if needed (once, before any worker starts)."""
    from engine.gguf_convert import prepare_default_model

    return int(json.loads((prepare_default_model() / "config.json").read_text())["vocab_size"])


def _cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0))[:2])


def run_section(
    quick: bool, command: str, threads: int | None = None, log: Callable[[str], None] = print
) -> str:
    """Runs the three configurations, the overhead bursts and the offline engine; returns the Markdown."""
    cores = _cores()
    plan = DisaggPlan(threads=threads or len(cores))
    plan = plan.quick() if quick else plan
    header = provenance(MachineInfo.probe(num_threads=plan.threads), command)
    work = Workload.build(plan, _vocab_size())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="baton-disagg-") as tmp:
        results = [run_setup(s, plan, work, Path(tmp), s.key == "chunked", log) for s in setups(plan, cores)]
        log("[disaggregation] offline engine")
        offline = run_offline(plan, work, cores, Path(tmp))
    log(f"[disaggregation] measured in {time.perf_counter() - t0:.0f} s")
    return render_section(plan, cores, results, offline, header, quick)


if __name__ == "__main__":
    if sys.argv[1:2] != ["offline"]:
        sys.exit("usage: python -m benchmarks.disagg_bench offline … (the section runs from benchmarks.run)")
    sys.exit(offline_main(sys.argv[2:]))
