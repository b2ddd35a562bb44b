"""The GPU path on one CUDA device, in one run: the Triton paged-attention kernel against the torch
reference on real model shapes, the kernel's read bandwidth, and engine decode steps at batch 1/16/64
against their floors (the step's weight GEMMs alone, and its bytes at the measured copy bandwidth).

Weights are random (``load_format="dummy"``) in the shapes of the default model and of a Llama-3.1-8B:
a GPU machine here cannot fetch checkpoints, and a decode step's time depends on the shapes and bytes,
not on the values. Prints a JSON object (and writes it to ``--out``); exits 1 if a correctness case
fails. Needs CUDA; on a machine without it, it says so and exits 2. ``--report`` renders such a JSON into
docs/BENCHMARKS.md's GPU section (on any machine: the GPU is lent for minutes, the docs are written here).

    python -m benchmarks.gpu_check --tokenizer-dir DIR --out gpu_check.json   # on the GPU machine
    python -m benchmarks.gpu_check --report benchmarks/results/gpu_check_h200.json   # here
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# The model shapes timed: the default model (SmolLM2-135M) and a Llama-3.1-8B, as their config.json say.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "eos_token_id": 2,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "eos_token_id": 128001,
    },
}
# (name, query heads, KV heads, head dim, sliding window) for the kernel's correctness cases.
ATTENTION_SHAPES = [
    ("smollm2-135m", 9, 3, 64, None),
    ("llama-3.1-8b", 32, 8, 128, None),
    ("qwen2-7b", 28, 4, 128, None),
    ("mistral-7b window 1024", 32, 8, 128, 1024),
]
BATCHES = (1, 16, 64)
DEVICE = "cuda"  # a smoke test on CPU sets "cpu" (and TRITON_INTERPRET=1) and DTYPE "float32"
DTYPE = "bfloat16"
PROMPT_LEN = 128


def cuda_ms(fn: Callable[[], Any], reps: int = 10, rounds: int = 5) -> float:
    """The fastest round's mean time of ``fn`` on the GPU, by CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, bytes read plus written per second (GB/s)."""
    src = torch.empty(1 << 30, dtype=torch.int16, device=DEVICE).random_()
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda: dst.copy_(src), reps=5)
    return 2 * src.numel() * src.element_size() / ms / 1e6


# ------------------------------------------------------------------ the kernel against the reference
def _cache(num_blocks: int, block_size: int, kvh: int, d: int, dtype: torch.dtype, gen: torch.Generator):
    """K and V views of layer 1 of a 2-layer block-major cache, as the engine passes them (strided)."""
    kv = torch.randn(num_blocks, 2, 2, block_size, kvh, d, device=DEVICE, generator=gen).to(dtype)
    return kv[:, 1, 0], kv[:, 1, 1]


def _tables(lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    need = [(n + block_size - 1) // block_size for n in lens]
    free = torch.randperm(num_blocks, device=DEVICE, generator=gen)
    tables = torch.randint(0, num_blocks, (len(lens), max(need)), device=DEVICE, generator=gen)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = free[used : used + n]
        used += n
    return tables.to(torch.int32)


def attention_case(
    h: int, kvh: int, d: int, window: int | None, dtype: torch.dtype, block_size: int
) -> dict[str, Any]:
    """A mixed batch: decodes over ragged contexts (1 .. 4100 tokens), a prompt chunk resumed at 500,
    a fresh 37-token prompt. Compared with the reference on the same (rounded) values in fp32."""
    from engine.attention import paged_attention_reference
    from engine.triton_attention import paged_attention_triton

    gen = torch.Generator(device=DEVICE).manual_seed(h * 1000 + d)
    decode_lens = [1, block_size - 1, block_size, block_size + 1, 300, 2049, 4100]
    chunk_start, chunk_len, fresh_len = 500, 64, 37
    lens = [*decode_lens, chunk_start + chunk_len, fresh_len]
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 8
    k, v = _cache(num_blocks, block_size, kvh, d, dtype, gen)
    tables = _tables(lens, block_size, num_blocks, gen)
    seq_ids = [*range(len(decode_lens))]
    positions = [n - 1 for n in decode_lens]
    seq_ids += [len(decode_lens)] * chunk_len + [len(decode_lens) + 1] * fresh_len
    positions += [*range(chunk_start, chunk_start + chunk_len), *range(fresh_len)]
    q = torch.randn(len(positions), h, d, device=DEVICE, generator=gen).to(dtype)
    sid = torch.tensor(seq_ids, device=DEVICE)
    pos = torch.tensor(positions, device=DEVICE)
    scale = d**-0.5
    out = paged_attention_triton(q, k, v, tables, sid, pos, scale, window)
    ref = paged_attention_reference(q.float(), k.float(), v.float(), tables, sid, pos, scale, window)
    err = (out.float() - ref).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: the output is rounded to bf16 (2^-8 relative)
    return {"max_abs_err": err, "tolerance": tol, "ok": err <= tol, "tokens": len(positions)}


def attention_bandwidth(
    h: int, kvh: int, d: int, batch: int, ctx: int, block_size: int = 16
) -> dict[str, Any]:
    """Decode attention of ``batch`` sequences of ``ctx`` tokens each, bf16: K/V bytes read per second."""
    from engine.triton_attention import paged_attention_triton

    gen = torch.Generator(device=DEVICE).manual_seed(7)
    lens = [ctx] * batch
    num_blocks = batch * ((ctx + block_size - 1) // block_size) + 1
    k, v = _cache(num_blocks, block_size, kvh, d, torch.bfloat16, gen)
    tables = _tables(lens, block_size, num_blocks, gen)
    q = torch.randn(batch, h, d, device=DEVICE, generator=gen).to(torch.bfloat16)
    sid = torch.arange(batch, device=DEVICE)
    pos = torch.full((batch,), ctx - 1, device=DEVICE)
    ms = cuda_ms(lambda: paged_attention_triton(q, k, v, tables, sid, pos, d**-0.5, None))
    kv_bytes = batch * ctx * kvh * d * 2 * 2
    return {"batch": batch, "ctx": ctx, "ms": ms, "gb_s": kv_bytes / ms / 1e6}


# ------------------------------------------------------------------ engine decode steps against floors
def _model_dir(root: Path, shape: str, tokenizer_dir: Path) -> Path:
    d = root / shape
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SHAPES[shape]))
    for f in tokenizer_dir.iterdir():
        if f.name != "config.json" and f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    return d


def _gemm_floor_ms(model: torch.nn.Module, batch: int) -> float:
    """One step's weight products alone (every decoder projection and the head), F.linear, its dtype."""
    weights = [m.weight for m in [*model.layers.modules(), model.lm_head] if isinstance(m, torch.nn.Linear)]
    xs = {
        k: torch.randn(batch, k, device=DEVICE, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}
    }
    return cuda_ms(lambda: [F.linear(xs[w.shape[1]], w) for w in weights], reps=5)


def engine_steps(shape: str, tokenizer_dir: Path, bandwidth_gb_s: float, steps: int) -> dict[str, Any]:
    from benchmarks.step_floor import _decode_steps_ms
    from engine.llm import LLM

    cfg = SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_dir(Path(tmp), shape, tokenizer_dir)
        t0 = time.perf_counter()
        llm = LLM(
            model=str(path),
            load_format="dummy",
            device=DEVICE,
            dtype=DTYPE,
            kv_cache_memory=4 << 30,
            max_num_seqs=64,
        )
        build_s = time.perf_counter() - t0
        engine, model = llm.engine, llm.engine.runner.model
        runner = engine.runner
        forward_s: list[float] = []
        execute = runner.execute

        def timed_execute(*a: Any, **kw: Any) -> Any:  # the model's share of a step (forward + sampling)
            t = time.perf_counter()
            r = execute(*a, **kw)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            forward_s.append(time.perf_counter() - t)
            return r

        runner.execute = timed_execute  # type: ignore[method-assign]
        weight_bytes = sum(
            t.numel() * t.element_size() for t in [*model.layers.parameters(), model.lm_head.weight]
        )
        kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
        rows: dict[str, Any] = {}
        for b in BATCHES:
            forward_s.clear()
            step = _decode_steps_ms(engine, [PROMPT_LEN] * b, steps, seed=b)
            fwd = sorted(forward_s[-steps:])
            gemm = _gemm_floor_ms(model, b)
            ctx = PROMPT_LEN + steps  # about the context each timed step reads
            bytes_ms = (weight_bytes + b * ctx * kv_per_token) / bandwidth_gb_s / 1e6
            rows[str(b)] = {
                "step_ms": step,
                "runner_ms": 1e3 * sum(fwd[: len(fwd) // 2 + 1]) / (len(fwd) // 2 + 1),
                "gemm_floor_ms": gemm,
                "bytes_floor_ms": bytes_ms,
                "step_over_gemm": step / gemm,
                "step_over_bytes": step / bytes_ms,
                "tok_s": b / step * 1e3,
            }
        return {
            "weights_gib": weight_bytes / 2**30,
            "build_s": build_s,
            "batches": rows,
            "gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None,
        }


def _guard(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # a failed section is a result with its error; the others still run
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer-dir", type=Path, help="the default model's tokenizer files")
    p.add_argument("--report", type=Path, help="render this run's JSON into docs/BENCHMARKS.md and stop")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.report:
        from benchmarks.report import update_section

        update_section("gpu", render(json.loads(args.report.read_text())))
        return 0
    if args.tokenizer_dir is None:
        p.error("--tokenizer-dir is required to measure")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.backends.cudnn.allow_tf32 = False
    import triton

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "measured": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }
    result["copy_gb_s"] = bw = copy_bandwidth()
    cases: dict[str, Any] = {}
    for name, h, kvh, d, window in ATTENTION_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for bs in (16, 32):
                key = f"{name} {str(dtype).removeprefix('torch.')} block {bs}"
                cases[key] = _guard(
                    lambda h=h, kvh=kvh, d=d, w=window, dt=dtype, b=bs: attention_case(h, kvh, d, w, dt, b)
                )
                print(key, cases[key], flush=True)
    result["attention_correctness"] = cases
    result["attention_bandwidth"] = [
        _guard(lambda b=b, c=c: attention_bandwidth(32, 8, 128, b, c))
        for b, c in ((1, 8192), (16, 4096), (64, 2048))
    ]
    print(json.dumps(result["attention_bandwidth"]), flush=True)
    for shape in SHAPES:
        result[f"engine {shape}"] = _guard(
            lambda s=shape: engine_steps(s, args.tokenizer_dir, bw, args.steps)
        )
        print(shape, json.dumps(result[f"engine {shape}"]), flush=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    failed = [k for k, c in cases.items() if not c.get("ok")]
    return 1 if failed else 0


def render(r: dict[str, Any]) -> str:
    """docs/BENCHMARKS.md's GPU section from one run's JSON."""
    bw = r["copy_gb_s"]
    lines = [
        "## GPU: the engine on CUDA with the Triton paged-attention kernel",
        "",
        f"Measured {r.get('measured', 'on the date of this section')} on one {r['device']}, torch "
        f"{r['torch']}, Triton {r['triton']} (a GPU machine lent for minutes: one prepared run).",
        "Command: `python -m benchmarks.gpu_check --tokenizer-dir DIR --out gpu_check.json` there, then "
        "`python -m benchmarks.gpu_check --report benchmarks/results/gpu_check_h200.json` here (the run is kept "
        "there). Weights are random "
        "(`--load-format dummy`) in the shapes of each model's config.json: a step's time depends on the "
        "shapes and bytes, not the values, and that machine cannot fetch checkpoints.",
        "",
        f"Device-to-device copy: {bw:,.0f} GB/s (bytes read + written), the bandwidth the floors below use.",
        "",
        "**Kernel correctness**, a mixed batch (7 decodes over 1 … 4100-token contexts, a prompt chunk "
        "resumed at 500, a fresh 37-token prompt), against the torch reference in fp32 on the same values:",
        "",
        "| shapes (H/KVH/D) | dtype | block | max abs error | tolerance | |",
        "|---|---|---:|---:|---:|---|",
    ]
    heads = {n: f"{h}/{kvh}/{d}" for n, h, kvh, d, _ in ATTENTION_SHAPES}
    for key, c in r["attention_correctness"].items():
        name, rest = key.rsplit(" ", 3)[0], key.rsplit(" ", 3)[1:]
        if "error" in c:
            lines.append(
                f"| {name} {heads.get(name, '')} | {rest[0]} | {rest[2]} | {c['error']} | | failed |"
            )
            continue
        ok = "ok" if c["ok"] else "**over**"
        lines.append(
            f"| {name} {heads.get(name, '')} | {rest[0]} | {rest[2]} | {c['max_abs_err']:.1e} | {c['tolerance']:g} | {ok} |"
        )
    lines += [
        "",
        "**Decode attention bandwidth** (Llama-3.1-8B heads 32/8/128, bf16, block 16): K/V bytes read per second.",
        "",
        "| batch | context | ms per layer | GB/s | of the copy bandwidth |",
        "|---:|---:|---:|---:|---:|",
    ]
    for a in r["attention_bandwidth"]:
        if "error" in a:
            lines.append(f"| | | {a['error']} | | |")
            continue
        lines.append(
            f"| {a['batch']} | {a['ctx']} | {a['ms']:.3f} | {a['gb_s']:,.0f} | {a['gb_s'] / bw:.0%} |"
        )
    lines += [
        "",
        f"**Engine decode steps** (`LLMEngine.step`, bf16, {PROMPT_LEN}-token prompts, the faster half of "
        "the timed steps) against the step's weight GEMMs alone (`F.linear`, CUDA events) and its bytes "
        "(weights + the K/V read) at the copy bandwidth. *Runner* is the model forward and sampling, the "
        "rest is the engine's scheduling.",
        "",
        "| model | weights GiB | batch | step ms | runner ms | GEMM floor ms | bytes floor ms | step ÷ GEMM | step ÷ bytes | tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    steps: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        e = r.get(f"engine {shape}", {})
        if "error" in e:
            lines.append(f"| {shape} | | | {e['error']} | | | | | | |")
            continue
        for b, x in e["batches"].items():
            steps.setdefault(shape, {})[b] = x["step_ms"]
            lines.append(
                f"| {shape} | {e['weights_gib']:.2f} | {b} | {x['step_ms']:.1f} | {x['runner_ms']:.1f} | "
                f"{x['gemm_floor_ms']:.2f} | {x['bytes_floor_ms']:.2f} | {x['step_over_gemm']:.1f} | "
                f"{x['step_over_bytes']:.1f} | {x['tok_s']:,.0f} |"
            )
    if len(steps) == 2 and all("1" in v for v in steps.values()):
        small, big = (steps[s]["1"] for s in SHAPES)
        lines += [
            "",
            f"Reading: the 8B model's batch-1 step takes {big / small:.2f}× the 135M model's although it "
            "reads 56× the weight bytes, and neither moves with the batch: the eager step is bound by the "
            "host (one Python-launched kernel at a time, per layer), not by the GPU. Capturing the decode "
            "step in a CUDA graph (static input, position and block-table buffers per batch size, as vLLM "
            "and SGLang do) is what closes it; batch-1 attention also needs the context split across "
            "programs (one program per (token, KV head) leaves most of the 132 SMs idle).",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
