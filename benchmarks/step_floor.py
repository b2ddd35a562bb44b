"""A decode step against its floor: the same step's weight GEMMs alone, same dtype, same batch, one run.

For each precision (fp32, bf16, int8 weight-only) a fresh process loads the default model, then, with
the model's own projection modules (the kernels the engine calls) and ``F.linear`` on the same weights
in the same dtype, times one step's worth of products on random activations — the faster of the two is
the floor — and times real engine decode steps at batch 1 and 16 (128-token prompts), in turn with the
products (a round of 3 steps, a round of 3 step's worth of products, and again), the fastest round of
each kept. It also times a batch of short requests with and without one 2048-token request among them
(two engines, stepped in turn), and reads the resident memory. Run one precision alone (prints JSON):

    python -m benchmarks.step_floor --precision bf16
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.report import emit_result
from benchmarks.step_profile import random_prompts

PRECISIONS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("bfloat16", "int8")}
BATCHES = (1, 16)
PROMPT_LEN = 128
LONG_CONTEXT = 2048


@dataclass(slots=True)
class FloorResult:
    precision: str
    dtype: str = ""
    step_ms: dict[str, float] = field(default_factory=dict)  # batch → engine decode step
    floor_ms: dict[str, float] = field(default_factory=dict)  # batch → the faster of the two GEMM loops
    own_gemm_ms: dict[str, float] = field(default_factory=dict)  # batch → the engine's projection modules
    f_linear_ms: dict[str, float] = field(default_factory=dict)  # batch → F.linear, same weights and dtype
    short_ms: float | None = None  # 15 short requests decoding
    with_long_ms: float | None = None  # the same 15 and one request at 2048 tokens of context
    rss_mib: float | None = None  # resident memory after loading, the KV cache's bytes not counted
    weight_mib: float | None = None
    kernels: bool = False
    rounds: int = 0  # rounds of 3 steps (and of 3 product loops) taken in turn; the fastest counts
    error: str | None = None


def _projections(model: Any) -> list[tuple[torch.nn.Module, torch.Tensor]]:
    """(module, plain weight in the run's dtype) for every projection a decode step multiplies by."""
    from engine.linear import Bf16DotLinear, Int8Linear, PackedLinear

    out = []
    for m in [*model.layers.modules(), model.lm_head]:
        if isinstance(m, torch.nn.Linear):
            out.append((m, m.weight.detach()))
        elif isinstance(m, Int8Linear):
            out.append((m, m.dequantized().to(m.scales.dtype)))
        elif isinstance(m, (PackedLinear, Bf16DotLinear)):
            out.append((m, torch.empty(m.out_features, m.in_features, dtype=torch.bfloat16).normal_(0, 0.02)))
    return out


def gemm_rounds(
    model: Any, dtype: torch.dtype, batch: int, int8: bool, reps: int
) -> dict[str, Callable[[], float]]:
    """One round each (ms per step's worth of products, the mean of ``reps``) of the model's own projection
    kernels (``own``: the decoder layers' in one C++ call as the engine's decode stack calls them, where
    it does — a Python call per product would add its dispatch to the floor — and the logits head) and,
    but for int8 (F.linear has no int8 weights), ``F.linear`` on the same weights in
    the same dtype (``plain``), on random activations of ``batch`` rows."""
    proj = _projections(model)
    xs = {k: torch.randn(batch, k, dtype=dtype) for k in {m_w[1].shape[1] for m_w in proj}}

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        @torch.inference_mode()
        def one_round() -> float:
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            return (time.perf_counter() - t0) / reps * 1e3

        return one_round

    plan = model._decode_plan()
    # The decoder layers' products in one C++ call, as the one-call decode stack makes them.
    if plan is not None:
        layer = next(iter(model.decoder_layers()))
        ins = [
            m.in_features
            for m in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        per_kind = [torch.randn(batch, k, dtype=dtype) for k in ins]
        head_x = torch.randn(batch, model.lm_head.in_features, dtype=dtype)

        def own() -> Any:
            return torch.ops.baton.project_layers(per_kind, plan[1], plan[0]), model.lm_head(head_x)

    else:

        def own() -> Any:
            return [m(xs[w.shape[1]]) for m, w in proj]

    rounds = {"own": timed(own)}
    if not int8:
        rounds["plain"] = timed(lambda: [F.linear(xs[w.shape[1]], w) for _, w in proj])
    return rounds


def _alternate(blocks: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Runs the blocks in turn, ``rounds`` times over (after one untimed turn), and keeps each one's fastest
    round. In turn, because this machine is shared: a neighbour's load lands on every block alike instead of
    on whichever one happened to run then (measured here, blocks timed one after the other: the same
    products 1.5x slower in one run than in the next, a ratio of two such figures off by as much)."""
    for fn in blocks.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in blocks}
    for _ in range(rounds):
        for name, fn in blocks.items():
            times[name].append(fn())
    return {name: min(ts) for name, ts in times.items()}


class _Batch:
    """Requests of the given prompt lengths decoding in an engine: `step_round` times a few steps."""

    def __init__(self, engine: Any, prompt_lens: list[int], max_steps: int, seed: int) -> None:
        from core.sampling_params import SamplingParams

        self.engine = engine
        vocab = engine.model_config.vocab_size
        prompts = [random_prompts(1, n, vocab, seed + i)[0] for i, n in enumerate(prompt_lens)]
        params = SamplingParams(max_tokens=max_steps + 8, temperature=0, ignore_eos=True)
        self.ids = [f"floor-{seed}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(self.ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        started: set[str] = set()
        while len(started) < len(self.ids):
            started.update(o.request_id for o in engine.step())
        for _ in range(2):
            engine.step()

    def step_round(self, num_steps: int) -> float:
        """ms per engine step, the mean of ``num_steps``; every request must still be running."""
        t0 = time.perf_counter()
        for _ in range(num_steps):
            done = [o.request_id for o in self.engine.step() if o.finished]
            if done:
                raise RuntimeError(
                    f"{done[0]} finished before the timed steps did: they must time the whole batch"
                )
        return (time.perf_counter() - t0) / num_steps * 1e3

    def close(self) -> None:
        for rid in self.ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished:
            self.engine.step()


def _decode_steps_ms(engine: Any, prompt_lens: list[int], num_steps: int, seed: int) -> float:
    from core.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    prompts = [random_prompts(1, n, vocab, seed + i)[0] for i, n in enumerate(prompt_lens)]
    params = SamplingParams(max_tokens=num_steps + 8, temperature=0, ignore_eos=True)
    ids = [f"floor-{seed}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    started: set[str] = set()
    while len(started) < len(ids):
        started.update(o.request_id for o in engine.step())
    for _ in range(2):
        engine.step()
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        done = [o.request_id for o in engine.step() if o.finished]
        times.append(time.perf_counter() - t0)
        if done:
            raise RuntimeError(
                f"{done[0]} finished before the timed steps did: they must time the whole batch"
            )
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished:
        engine.step()
    times.sort()
    return (
        1e3 * sum(times[: len(times) // 2 + 1]) / (len(times) // 2 + 1)
    )  # the faster half: noise is one-sided


def _rss_mib() -> float | None:
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmRSS"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


def run_precision(precision: str, num_threads: int, num_steps: int = 48) -> FloorResult:
    from engine import cpu_ops
    from engine.llm import LLM

    dtype_name, quantization = PRECISIONS[precision]
    r = FloorResult(precision)
    # No cap on prompt tokens beside decodes: the timed steps are decode steps of every request together,
    # and the cap would hold the 2k prompt back while the short ones decode (and finish).
    make_llm = functools.partial(
        LLM,
        model=None,
        dtype=dtype_name,
        quantization=quantization,
        kv_cache_memory=512 << 20,
        max_num_seqs=64,
        num_threads=num_threads,
        mixed_prefill_tokens=0,
    )
    llm = make_llm()
    engine, model = llm.engine, llm.engine.runner.model
    kv_mib = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() / 2**20
    rss = _rss_mib()
    r.dtype, r.kernels = str(engine.runner.dtype).removeprefix("torch."), cpu_ops.kernels_enabled()
    r.rss_mib = None if rss is None else rss - kv_mib
    r.weight_mib = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20
    per_round = 3  # engine steps per round, and GEMM repetitions: rounds of about the same length
    rounds = max(4, num_steps // per_round)
    r.rounds = rounds
    for b in BATCHES:
        batch = _Batch(engine, [PROMPT_LEN] * b, rounds * per_round + per_round, seed=b)
        blocks: dict[str, Callable[[], float]] = {"step": functools.partial(batch.step_round, per_round)}
        blocks.update(gemm_rounds(model, engine.runner.dtype, b, quantization == "int8", per_round))
        best = _alternate(blocks, rounds)
        batch.close()
        r.step_ms[str(b)], r.own_gemm_ms[str(b)] = best["step"], best["own"]
        if "plain" in best:
            r.f_linear_ms[str(b)] = best["plain"]
        r.floor_ms[str(b)] = min(best["own"], best.get("plain", best["own"]))
    # The 2k row: a second engine of the same configuration holds the batch with the long request, so the
    # two batches decode in turn (the long prompt is prefilled once).
    other = make_llm().engine
    short = _Batch(engine, [PROMPT_LEN] * 15, rounds * per_round + per_round, seed=100)
    with_long = _Batch(other, [PROMPT_LEN] * 15 + [LONG_CONTEXT], rounds * per_round + per_round, seed=100)
    best = _alternate(
        {"short": lambda: short.step_round(per_round), "long": lambda: with_long.step_round(per_round)},
        rounds,
    )
    short.close()
    with_long.close()
    r.short_ms, r.with_long_ms = best["short"], best["long"]
    return r


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", choices=sorted(PRECISIONS), required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        result = run_precision(args.precision, args.threads, args.steps)
    except Exception as e:  # a failed precision is a row with its error
        result = FloorResult(args.precision, error=f"{type(e).__name__}: {e}")
    return emit_result(result, args.out)


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------------ the parent: one run, side by side
def run_all(
    threads: int, steps: int, timeout_s: float, log: Callable[[str], None]
) -> tuple[dict[str, FloorResult], str]:
    """Each precision in a fresh process, one after another; returns the results and the command pattern."""
    import subprocess
    import tempfile

    from benchmarks.report import REPO_ROOT

    results: dict[str, FloorResult] = {}
    for precision in PRECISIONS:
        log(f"[engine] step floor: {precision}")
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "floor.json"
            args = [
                "-m",
                "benchmarks.step_floor",
                "--precision",
                precision,
                "--threads",
                str(threads),
                "--steps",
                str(steps),
                "--out",
                str(out),
            ]
            try:
                subprocess.run(
                    [sys.executable, *args],
                    cwd=REPO_ROOT,
                    stdout=sys.stderr,
                    stderr=sys.stderr,
                    timeout=timeout_s,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                results[precision] = FloorResult(precision, error=f"timed out after {timeout_s:.0f} s")
                continue
            results[precision] = (
                FloorResult(**json.loads(out.read_text()))
                if out.exists()
                else FloorResult(precision, error="no result")
            )
    return results, f"python -m benchmarks.step_floor --precision P --threads {threads} --steps {steps}"


def render(results: dict[str, FloorResult], command: str) -> str:
    from benchmarks.report import table

    rows, goals = [], []
    for name, r in results.items():
        if r.error:
            rows.append([name, "failed", *["—"] * 7, r.error[:200]])
            continue
        for b in map(str, BATCHES):
            ratio = r.step_ms[b] / r.floor_ms[b]
            own, plain = r.own_gemm_ms[b], r.f_linear_ms.get(b)
            rows.append(
                [
                    name,
                    r.dtype,
                    b,
                    f"{r.step_ms[b]:.1f}",
                    f"{own:.1f}",
                    "—" if plain is None else f"{plain:.1f}",
                    f"{r.floor_ms[b]:.1f}",
                    f"**{ratio:.2f}**",
                    f"{r.rss_mib or 0:.0f} / {r.weight_mib or 0:.0f}",
                    "yes" if r.kernels else "no",
                ]
            )
            goals.append(f"{name} batch {b}: {ratio:.2f} ({'met' if ratio <= 1.3 else 'not met'})")
    long = [
        f"{n}: {r.with_long_ms / r.short_ms:.2f}x ({r.short_ms:.1f} → {r.with_long_ms:.1f} ms)"
        for n, r in results.items()
        if not r.error and r.short_ms and r.with_long_ms
    ]
    rounds = max((r.rounds for r in results.values()), default=0)
    return "\n".join(
        [
            "### A decode step against its floor (the same step's weight GEMMs alone)",
            "",
            f"Command: `{command}` (P = "
            + ", ".join(PRECISIONS)
            + f"). Each precision in its own process: {PROMPT_LEN}-token "
            "prompts decoding; *step*: an engine step (scheduling, sampling and detokenizing included); "
            "*own GEMMs*: one step's products through the model's own projection modules (the kernels the engine "
            f"calls) on random activations of the batch's rows; each the fastest of {rounds} rounds of 3, the rounds of "
            "steps and of products taken in turn so that a shared machine's noise lands on both alike; "
            "*F.linear*: the same products with `F.linear` on plain weights of the same dtype; *floor*: the "
            "faster of the two, so that a slow GEMM path cannot make the ratio look good. *RSS / weights*: the "
            "process's resident memory after loading, less its KV cache (MiB), and the bytes of the model's weights "
            "and buffers (bf16 keeps a plain embedding for the lookup beside the packed logits head; int8 keeps "
            "its logits head and embedding in bf16).",
            "",
            table(
                [
                    "precision",
                    "dtype",
                    "batch",
                    "step ms",
                    "own GEMMs ms",
                    "F.linear ms",
                    "floor ms",
                    "step ÷ floor",
                    "RSS less KV / weights MiB",
                    "C++ kernels",
                ],
                rows,
                "llrrrrrrrl",
            ),
            "Goal step ÷ floor <= 1.3: " + "; ".join(goals) + ".",
            "",
            "15 short requests (128-token prompts) decoding, alone and with one request at "
            f"{LONG_CONTEXT} tokens of context in the batch (two engines of the same configuration, stepped in "
            f"turn, the fastest of {rounds} rounds of 3 steps each; goal <= 1.2x): " + "; ".join(long) + ".",
            "",
        ]
    )
