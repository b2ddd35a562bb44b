"""The Autoscaling section of `make bench`: `baton up --autoscale` (starting with one prefill and one
decode worker, at most two decode workers) against fixed 1P1D and 1P2D clusters on the same step load —
a few streams, then many, then a few again (closed-loop clients, greedy, the default model) — on this
machine. Per configuration: SLO attainment and TTFT / inter-token p95 per phase, decode worker-seconds
(what the capacity cost), failed streams; for the autoscaler its reaction times (load up → decision →
new worker serving; load down → worker drained and removed); and a plot of decode workers and SLO
attainment over time.

What two cores allow: every worker runs one torch thread and the cluster shares the machine's two
cores, so a second decode worker adds *capacity* far more than speed. Capacity here is KV memory, as on
a GPU: each worker has a 16 MiB KV cache (about 45 blocks of the default model in bf16, five of these
streams), and the high phase runs 8 streams. (A decode worker's ``--max-num-seqs`` does not cap the
requests handed to it by a prefill worker — they join its batch at once — so slots cannot be the limit
in a P/D cluster today: docs/AUTOSCALING.md.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import REPO_ROOT, MachineInfo, provenance
from benchmarks.serving_harness import RequestSpec, Trace, generate, percentile, spawn, stop_all

PLOT_PATH = REPO_ROOT / "docs" / "img" / "autoscaling.png"
TTFT_SLO_MS = 1000.0
TPOT_SLO_MS = 100.0  # a request meets its SLO with TTFT and mean time per output token under these
CAPACITY = ("--kv-cache-memory", "16MiB")  # every worker's: a decode worker holds ~5 of these streams
BUCKET_S = 5.0


@dataclass(frozen=True, slots=True)
class Plan:
    """The step load: (clients, seconds) per phase, and each request's size."""

    phases: tuple[tuple[int, float], ...] = ((2, 40.0), (8, 80.0), (2, 80.0))
    prompt_tokens: int = 64
    output_tokens: int = 64

    def quick(self) -> Plan:
        return Plan(((1, 5.0), (4, 10.0), (1, 10.0)), 40, 16)

    @property
    def duration_s(self) -> float:
        return sum(s for _, s in self.phases)

    def clients_at(self, t: float) -> int:
        for clients, seconds in self.phases:
            if t < seconds:
                return clients
            t -= seconds
        return 0

    def phase_of(self, t: float) -> int:
        for i, (_, seconds) in enumerate(self.phases):
            if t < seconds:
                return i
            t -= seconds
        return len(self.phases) - 1


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    flags: tuple[str, ...]
    autoscale: bool = False


CONFIGS = (
    Config(
        "baton up --autoscale (1P1D → at most 1P2D)",
        (
            *("--autoscale", "--max-decode", "2", "--max-prefill", "1"),
            *("--ttft-slo-ms", str(TTFT_SLO_MS), "--itl-slo-ms", str(TPOT_SLO_MS)),
            *("--autoscale-interval-s", "2", "--autoscale-window-s", "10"),
            *("--scale-up-window-s", "4", "--scale-down-window-s", "30"),
        ),
        autoscale=True,
    ),
    Config("fixed 1P1D", ("--decode-workers", "1")),
    Config("fixed 1P2D", ("--decode-workers", "2")),
)


@dataclass(slots=True)
class Run:
    """One configuration's measurements."""

    config: Config
    traces: list[Trace] = field(default_factory=list)
    t0: float = 0.0  # perf_counter at the load's start
    replicas: list[tuple[float, float]] = field(default_factory=list)  # (s since t0, decode workers serving)
    decisions: list[str] = field(default_factory=list)
    error: str = ""

    def meets(self, t: Trace) -> bool:
        if t.error or t.done_at is None or not t.arrivals or t.ttft_s is None:
            return False
        tokens = sum(t.sizes)
        tpot = (t.arrivals[-1] - t.arrivals[0]) / max(1, tokens - 1)
        return t.ttft_s * 1e3 <= TTFT_SLO_MS and tpot * 1e3 <= TPOT_SLO_MS

    def in_phase(self, plan: Plan, phase: int) -> list[Trace]:
        return [t for t in self.traces if plan.phase_of(t.sent_at - self.t0) == phase]

    def attainment(self, traces: Sequence[Trace]) -> float | None:
        return sum(self.meets(t) for t in traces) / len(traces) if traces else None

    def worker_seconds(self, duration_s: float) -> float:
        """Decode workers serving, integrated over the load's duration."""
        points = [(0.0, self.replicas[0][1])] if self.replicas else []
        points += [p for p in self.replicas if p[0] <= duration_s] + [(duration_s, 0.0)]
        return sum((b[0] - a[0]) * a[1] for a, b in zip(points, points[1:], strict=False))

    def first(self, after_s: float, test: Callable[[float], bool]) -> float | None:
        """Seconds after ``after_s`` until the decode workers serving first pass ``test``."""
        for t, n in self.replicas:
            if t >= after_s and test(n):
                return t - after_s
        return None


def _prompt(rng: random.Random, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, vocab - 100) for _ in range(n))


async def _load(address: str, plan: Plan, vocab: int, run: Run) -> None:
    """Closed-loop clients: client i sends back to back while the phase has more than i clients."""
    import grpc

    from baton.v1 import gateway_pb2_grpc

    rng = random.Random(7)
    most = max(c for c, _ in plan.phases)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        warm = [RequestSpec(f"warm{i}", _prompt(rng, vocab, plan.prompt_tokens), 4) for i in range(most)]
        await asyncio.gather(*(generate(stub, s, f"as-{s.name}-{os.getpid()}") for s in warm))  # not measured
        run.t0 = time.perf_counter()

        async def client(i: int) -> None:
            n = 0
            while (now := time.perf_counter() - run.t0) < plan.duration_s:
                if i >= plan.clients_at(now):
                    await asyncio.sleep(0.05)
                    continue
                n += 1
                spec = RequestSpec(f"c{i}-{n}", _prompt(rng, vocab, plan.prompt_tokens), plan.output_tokens)
                run.traces.append(await generate(stub, spec, f"as-{i}-{n}-{os.getpid()}"))

        await asyncio.gather(*(client(i) for i in range(most)))


def _start(config: Config, log_dir: Path, threads: int) -> tuple[object, str, str]:
    """`baton up` with the config's flags; returns (process, gRPC address, autoscaler /metrics URL or "")."""
    out = log_dir / "up.out"
    argv = [sys.executable, "-m", "services.cli", "up", "--grpc-port", "0", "--http-port", "0"]
    argv += ["--threads", str(threads), "--log-dir", str(log_dir / "logs"), *CAPACITY, *config.flags]
    proc = spawn(argv, None, out)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = out.read_text(errors="replace") if out.exists() else ""
        if "Press Ctrl-C" in text:
            grpc_address = re.search(r"gRPC\s+: (\S+)", text)
            scaler = re.search(r"autoscaler=(http://\S+/metrics)", text)
            assert grpc_address is not None
            return proc, grpc_address.group(1), scaler.group(1) if scaler else ""
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop_all([proc])
    raise RuntimeError(f"baton up did not start: {out.read_text(errors='replace')[-2000:]}")


def _decode_serving(metrics_url: str, log_dir: Path) -> float:
    """Decode workers serving now: the autoscaler's view, else baton up's own process list."""
    if metrics_url:
        with urllib.request.urlopen(metrics_url, timeout=2) as r:
            m = re.search(r'baton_autoscaler_ready_replicas\{pool="decode"\} (\S+)', r.read().decode())
        if m:
            return float(m.group(1))
    state = json.loads((log_dir / "logs" / "processes.json").read_text())
    return float(sum(1 for p in state if p["pool"] == "decode" and not p["retiring"]))


def run_config(
    config: Config, plan: Plan, vocab: int, threads: int, tmp: Path, log: Callable[[str], None]
) -> Run:
    run = Run(config)
    log_dir = tmp / re.sub(r"\W+", "-", config.name)
    log_dir.mkdir(parents=True)
    log(f"[autoscaling] {config.name}")
    try:
        proc, address, metrics_url = _start(config, log_dir, threads)
    except RuntimeError as e:
        run.error = str(e).splitlines()[0]
        return run
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            # A scrape that fails (a process restarting, a file being replaced) is one sample fewer.
            with contextlib.suppress(OSError, ValueError):
                n = _decode_serving(metrics_url, log_dir)
                run.replicas.append((time.perf_counter() - run.t0 if run.t0 else 0.0, n))
            stop.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        asyncio.run(_load(address, plan, vocab, run))
    finally:
        stop.set()
        watcher.join(5)
        stop_all([proc], grace_s=20)
    decisions = log_dir / "logs" / "autoscaler.log"
    run.decisions = decisions.read_text().splitlines() if decisions.exists() else []
    return run


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.0f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x * 100:.0f}%"


def render(plan: Plan, runs: Sequence[Run], header: str, plot_file: str | None) -> str:
    phases = " → ".join(f"{c} streams for {s:.0f} s" for c, s in plan.phases)
    lines = [
        "## Autoscaling",
        "",
        header,
        f"Load: {phases}; each stream a {plan.prompt_tokens}-token prompt and {plan.output_tokens} output tokens "
        f"(greedy, EOS ignored), sent back to back by its client over gRPC. A request meets the SLO with TTFT ≤ "
        f"{TTFT_SLO_MS:g} ms and time per output token ≤ {TPOT_SLO_MS:g} ms. Every cluster: `baton up` with the "
        f"default model, one torch thread per worker, `{' '.join(CAPACITY)}` (KV for about five of these "
        "streams on a decode worker).",
        "",
        "| configuration | SLO met: low / high / low / all | TTFT p95 ms: low / high / low | ITL p95 ms: low / high / low "
        "| decode worker-s | streams | failed |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    for run in runs:
        if run.error:
            lines.append(f"| {run.config.name} | error: {run.error} | | | | | |")
            continue
        parts = [run.in_phase(plan, i) for i in range(len(plan.phases))]
        met = " / ".join(_pct(run.attainment(p)) for p in [*parts, run.traces])
        ttft = " / ".join(_ms(percentile([t.ttft_s for t in p if t.ttft_s is not None], 95)) for p in parts)
        itl = " / ".join(_ms(percentile([g for t in p for g in t.gaps_s()], 95)) for p in parts)
        failed = sum(1 for t in run.traces if t.error)
        lines.append(
            f"| {run.config.name} | {met} | {ttft} | {itl} | {run.worker_seconds(plan.duration_s):.0f} "
            f"| {len(run.traces)} | {failed} |"
        )
    scaled = next((r for r in runs if r.config.autoscale and not r.error), None)
    if scaled is not None:
        rise = plan.phases[0][1]
        drop = rise + plan.phases[1][1]
        up = scaled.first(rise, lambda n: n >= 2)
        down = scaled.first(drop, lambda n: n <= 1) if up is not None else None
        rose = (
            f"a second decode worker serving {up:.1f} s after the load rose"
            if up is not None
            else "no second decode worker during the high phase"
        )
        fell = f"one drained and removed {down:.1f} s after it fell" if down is not None else "none removed"
        lines += [
            "",
            f"Autoscaler reaction: {rose}; {fell}.",
            "",
            "Its decisions (baton up's autoscaler.log):",
            "",
            *(f"    {d}" for d in scaled.decisions[:12]),
        ]
    if plot_file:
        lines += ["", f"![decode workers and SLO attainment over time]({plot_file})"]
    return "\n".join(lines) + "\n"


def plot(plan: Plan, runs: Sequence[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for run in runs:
        if run.error:
            continue
        xs = [t for t, _ in run.replicas if t >= 0]
        top.step(xs, [n for t, n in run.replicas if t >= 0], where="post", label=run.config.name)
        edges = [i * BUCKET_S for i in range(int(plan.duration_s / BUCKET_S))]
        share = [
            run.attainment([t for t in run.traces if e <= t.sent_at - run.t0 < e + BUCKET_S]) for e in edges
        ]
        bottom.plot(
            [e + BUCKET_S / 2 for e in edges],
            [100 * (s or 0) for s in share],
            marker=".",
            label=run.config.name,
        )
    top.set_ylabel("decode workers serving")
    bottom.set_ylabel(f"SLO met (%, per {BUCKET_S:g} s)")
    bottom.set_xlabel("seconds")
    t = 0.0
    for clients, seconds in plan.phases:
        for ax in (top, bottom):
            ax.axvline(t, color="grey", lw=0.5)
        top.text(t + 1, 0.03, f"{clients} streams", fontsize=8, transform=top.get_xaxis_transform())
        t += seconds
    top.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run_section(
    quick: bool, command: str, threads: int | None = None, log: Callable[[str], None] = print
) -> str:
    from benchmarks.disagg_bench import _vocab_size

    plan = Plan().quick() if quick else Plan()
    vocab = _vocab_size()
    header = provenance(MachineInfo.probe(num_threads=1), command)
    with tempfile.TemporaryDirectory(prefix="baton-autoscale-") as tmp:
        runs = [run_config(c, plan, vocab, 1, Path(tmp), log) for c in CONFIGS]
    if quick:
        return render(plan, runs, header, None)
    plot(plan, runs, PLOT_PATH)
    return render(plan, runs, header, str(PLOT_PATH.relative_to(PLOT_PATH.parents[1])))
