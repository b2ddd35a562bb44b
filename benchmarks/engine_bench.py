"""The "Engine" section: Baton against transformers' static ``generate``, transformers' continuous
batching (``generate_batch``) and a bare torch decode loop (the ceiling), plus where a Baton decode step
goes (`benchmarks.step_profile`).

Every contender runs in its own fresh process (no shared allocator state or threads), on the same seeded
random prompts: a small warm-up of its own, then ``repeats`` timed runs of which the fastest counts.
Run one alone; it prints its result as JSON:

    python -m benchmarks.engine_bench --contender baton --requests 4 --prompt-len 16 --output-len 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks import step_floor
from benchmarks.report import REPO_ROOT, MachineInfo, emit_result, provenance, table
from benchmarks.step_profile import measure_step_breakdown, random_prompts

_PAGE_SIZE = 16  # tokens per KV block, Baton's default; generate_batch is fastest here with it too


@dataclass(frozen=True, slots=True)
class Workload:
    """``num_requests`` prompts of ``prompt_len`` seeded random token ids → ``output_len`` greedy tokens."""

    num_requests: int = 16
    prompt_len: int = 128
    output_len: int = 128
    seed: int = 0
    num_threads: int = 2  # torch intra-op threads of each contender process
    repeats: int = 2  # timed runs per contender process; the fastest counts (the machines are noisy)

    def prompts(self, vocab_size: int) -> list[list[int]]:
        return random_prompts(self.num_requests, self.prompt_len, vocab_size, self.seed)

    def warmup(self) -> Workload:
        """A small run of the same code path, so lazy initialisation is not timed."""
        return replace(
            self,
            num_requests=min(2, self.num_requests),
            prompt_len=min(16, self.prompt_len),
            output_len=min(4, self.output_len),
            seed=self.seed + 1,
        )

    def argv(self) -> list[str]:
        return [
            "--requests",
            str(self.num_requests),
            "--prompt-len",
            str(self.prompt_len),
            "--output-len",
            str(self.output_len),
            "--seed",
            str(self.seed),
            "--threads",
            str(self.num_threads),
            "--repeats",
            str(self.repeats),
        ]


@dataclass(slots=True)
class ContenderResult:
    """One contender's timed run (model loaded and warmed up before the clock starts)."""

    name: str
    wall_s: float | None = None  # prompts in → every token out
    decode_s: float | None = None  # from the moment every request has its first token to the end
    load_s: float | None = None
    token_ids: list[list[int]] = field(default_factory=list)
    error: str | None = None
    others_cpu_pct: float | None = None  # the machine's CPU time other processes took during the run
    detail: dict[str, Any] = field(default_factory=dict)

    def output_tok_s(self, w: Workload) -> float | None:
        return w.num_requests * w.output_len / self.wall_s if self.wall_s else None

    def decode_tok_s(self, w: Workload) -> float | None:
        return w.num_requests * (w.output_len - 1) / self.decode_s if self.decode_s else None


# ------------------------------------------------------------------ the contenders (run in a child)
def _model_dir() -> Path:
    from engine.gguf_convert import prepare_default_model

    return prepare_default_model()


def _hf_config(model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
    return config


def _kv_cache_memory(w: Workload, cfg: dict[str, Any]) -> int:
    """Twice the fp32 KV bytes the workload needs: room for block rounding, never a preemption."""
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    per_token = int(cfg["num_hidden_layers"]) * 2 * int(cfg["num_key_value_heads"]) * head_dim * 4
    return 2 * w.num_requests * (w.prompt_len + w.output_len + _PAGE_SIZE) * per_token


def _timed(
    name: str, load_s: float, once: Callable[[Workload], ContenderResult], w: Workload
) -> ContenderResult:
    once(w.warmup())
    before = _cpu_ticks()
    runs = [once(w) for _ in range(max(1, w.repeats))]
    result = min(runs, key=lambda r: r.wall_s or float("inf"))
    result.name, result.load_s, result.others_cpu_pct = name, load_s, _others_cpu_pct(before, _cpu_ticks())
    result.detail["wall_s_runs"] = [r.wall_s for r in runs]
    return result


def _cpu_ticks() -> tuple[int, int, int] | None:
    """(busy ticks of the whole machine, all ticks, this process's ticks), from /proc; None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total, int(own[11]) + int(own[12])  # utime + stime


def _others_cpu_pct(before: tuple[int, int, int] | None, after: tuple[int, int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    busy, total, own = (a - b for a, b in zip(after, before, strict=True))
    return max(0.0, 100.0 * (busy - own) / total)


def run_baton(w: Workload, dtype: str = "auto", name: str = "baton") -> ContenderResult:
    from core.sampling_params import SamplingParams
    from engine.llm import LLM

    model_dir = _model_dir()
    t0 = time.perf_counter()
    llm = LLM(
        model=None,
        kv_cache_memory=_kv_cache_memory(w, _hf_config(model_dir)),
        max_num_seqs=w.num_requests,
        num_threads=w.num_threads,
        dtype=dtype,
    )
    load_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size

    def once(wl: Workload) -> ContenderResult:
        params = SamplingParams(max_tokens=wl.output_len, temperature=0, ignore_eos=True)
        prompts = wl.prompts(vocab)
        with _first_token_clock(llm.engine, wl.num_requests) as clock:
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            end = time.perf_counter()
        return ContenderResult(
            name, end - start, end - clock["all_first"], token_ids=[o.token_ids for o in outs]
        )

    result = _timed(name, load_s, once, w)
    result.detail["dtype"] = str(llm.engine.runner.dtype).removeprefix("torch.")
    return result


def run_baton_fp32(w: Workload) -> ContenderResult:
    return run_baton(w, dtype="float32", name="baton_fp32")


@contextmanager
def _first_token_clock(engine: Any, num_requests: int) -> Iterator[dict[str, float]]:
    """Notes when every request has produced its first token, by wrapping ``engine.step``."""
    seen: set[str] = set()
    clock: dict[str, float] = {}
    inner = engine.step

    def step() -> Any:
        outs = inner()
        seen.update(o.request_id for o in outs)
        if "all_first" not in clock and len(seen) >= num_requests:
            clock["all_first"] = time.perf_counter()
        return outs

    engine.step = step
    try:
        yield clock
    finally:
        del engine.step


def _load_hf(dtype: torch.dtype = torch.float32) -> tuple[Any, float, int]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(_model_dir(), dtype=dtype).eval()
    # EOS off for real: an eos_token_id=None in a GenerationConfig argument is refilled from the model's.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model, time.perf_counter() - t0, model.config.vocab_size


def run_hf_generate(
    w: Workload, dtype: torch.dtype = torch.float32, name: str = "hf_generate"
) -> ContenderResult:
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    model, load_s, vocab = _load_hf(dtype)

    class Stamps(StoppingCriteria):  # called once per generated token: notes when, never stops
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def once(wl: Workload) -> ContenderResult:
        ids = torch.tensor(wl.prompts(vocab))  # [B, P]: equal lengths, so left padding adds nothing
        config = GenerationConfig(
            do_sample=False, max_new_tokens=wl.output_len, min_new_tokens=wl.output_len, pad_token_id=0
        )
        stamps = Stamps()
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stamps]),
        )
        end = time.perf_counter()
        return ContenderResult(
            "", end - start, end - stamps.times[0], token_ids=out[:, wl.prompt_len :].tolist()
        )

    return _timed(name, load_s, once, w)


def run_hf_generate_bf16(w: Workload) -> ContenderResult:
    return run_hf_generate(w, torch.bfloat16, "hf_generate_bf16")


def run_hf_generate_batch(w: Workload) -> ContenderResult:
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model, load_s, vocab = _load_hf()
    if not hasattr(model, "generate_batch"):
        raise RuntimeError(f"transformers {transformers.__version__} has no generate_batch")

    def once(wl: Workload) -> ContenderResult:
        # Sized by hand: its automatic sizing reads GPU memory. eos_token_id=-1 never matches a token.
        pages = (wl.prompt_len + wl.output_len + _PAGE_SIZE - 1) // _PAGE_SIZE
        cb = ContinuousBatchingConfig(
            num_blocks=2 * wl.num_requests * pages,
            page_size=_PAGE_SIZE,
            max_batch_tokens=max(wl.num_requests * wl.prompt_len, 256),
        )
        config = GenerationConfig(
            do_sample=False, max_new_tokens=wl.output_len, eos_token_id=-1, pad_token_id=0
        )
        prompts = wl.prompts(vocab)
        start = time.perf_counter()
        res = model.generate_batch(
            prompts, generation_config=config, continuous_batching_config=cb, record_timestamps=True
        )
        end = time.perf_counter()
        outs = sorted(res.values(), key=lambda o: int(o.request_id.rsplit("_", 1)[-1]))
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"generate_batch request failed: {errors[0]}")
        all_first = max(o.timestamps[0] for o in outs if o.timestamps)
        return ContenderResult(
            "", end - start, end - all_first, token_ids=[list(o.generated_tokens) for o in outs]
        )

    return _timed("hf_generate_batch", load_s, once, w)


def run_bare_loop(w: Workload) -> ContenderResult:
    model, load_s, vocab = _load_hf()

    def once(wl: Workload) -> ContenderResult:
        ids = torch.tensor(wl.prompts(vocab))
        start = time.perf_counter()
        tokens, all_first = bare_greedy(model, ids, wl.output_len)
        end = time.perf_counter()
        return ContenderResult("", end - start, end - all_first, token_ids=tokens)

    return _timed("bare_loop", load_s, once, w)


@torch.inference_mode()
def bare_greedy(model: Any, prompt_ids: torch.Tensor, num_new: int) -> tuple[list[list[int]], float]:
    """Greedy decoding with a Hugging Face Llama's modules called directly and one contiguous
    [B, KVH, P + num_new, D] cache per layer: one batched prefill, then one step per token. Returns the
    new tokens and the time (perf_counter) the first token of every row was out."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cfg = model.config
    b, p = prompt_ids.shape
    h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    caches = [
        (torch.empty(b, kvh, p + num_new, d), torch.empty(b, kvh, p + num_new, d)) for _ in model.model.layers
    ]
    ids, start, new, all_first = prompt_ids, 0, [], 0.0
    for step in range(num_new):
        n = ids.shape[1]
        x = model.model.embed_tokens(ids)  # [B, n, hidden]
        cos, sin = model.model.rotary_emb(x, torch.arange(start, start + n).unsqueeze(0))  # [1, n, D]
        for layer, (k_cache, v_cache) in zip(model.model.layers, caches, strict=True):
            attn = layer.self_attn
            hs = layer.input_layernorm(x)
            q = attn.q_proj(hs).view(b, n, h, d).transpose(1, 2)  # [B, H, n, D]
            k = attn.k_proj(hs).view(b, n, kvh, d).transpose(1, 2)  # [B, KVH, n, D]
            v = attn.v_proj(hs).view(b, n, kvh, d).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_cache[:, :, start : start + n] = k
            v_cache[:, :, start : start + n] = v
            o = F.scaled_dot_product_attention(  # causal only matters for the prefill, which starts at 0
                q, k_cache[:, :, : start + n], v_cache[:, :, : start + n], is_causal=n > 1, enable_gqa=True
            )
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, n, h * d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = model.lm_head(model.model.norm(x[:, -1]))  # [B, V]
        ids = logits.argmax(-1, keepdim=True)  # [B, 1]
        new.append(ids)
        start += n
        if step == 0:
            all_first = time.perf_counter()
    return torch.cat(new, dim=1).tolist(), all_first


def run_profile(w: Workload) -> ContenderResult:
    from engine.llm import LLM

    llm = LLM(
        model=None,
        kv_cache_memory=_kv_cache_memory(w, _hf_config(_model_dir())),
        max_num_seqs=w.num_requests,
        num_threads=w.num_threads,
    )
    steps = 20 if w.output_len >= 64 else 5
    breakdown = measure_step_breakdown(
        llm, num_steps=steps, batch_size=w.num_requests, prompt_len=w.prompt_len, seed=w.seed
    )
    return ContenderResult("profile", detail=asdict(breakdown))


CONTENDERS: dict[str, tuple[str, Callable[[Workload], ContenderResult]]] = {
    "baton": ("Baton `LLM.generate` (dtype auto)", run_baton),
    "baton_fp32": ("Baton `LLM.generate`, float32", run_baton_fp32),
    "hf_generate": ("transformers static `generate`", run_hf_generate),
    "hf_generate_bf16": ("transformers static `generate`, bfloat16", run_hf_generate_bf16),
    "hf_generate_batch": ("transformers `generate_batch` (continuous batching)", run_hf_generate_batch),
    "bare_loop": ("bare torch decode loop (the ceiling)", run_bare_loop),
}
_CHILD_JOBS = {**{k: fn for k, (_, fn) in CONTENDERS.items()}, "profile": run_profile}


def child_main(argv: list[str] | None = None) -> int:
    """Runs one contender in this process and writes its `ContenderResult` as JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contender", choices=sorted(_CHILD_JOBS), required=True)
    d = Workload()
    p.add_argument("--requests", type=int, default=d.num_requests)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.num_threads)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--out", type=Path, help="write the JSON result here (default: stdout)")
    args = p.parse_args(argv)
    w = Workload(args.requests, args.prompt_len, args.output_len, args.seed, args.threads, args.repeats)
    torch.set_num_threads(w.num_threads)
    try:
        result = _CHILD_JOBS[args.contender](w)
    except Exception as e:  # a peer that fails is a row with its error, not a failed benchmark
        traceback.print_exc()
        result = ContenderResult(args.contender, error=f"{type(e).__name__}: {e}")
    return emit_result(result, args.out)


# ------------------------------------------------------------------ the parent: one run, side by side
def run_contender(name: str, w: Workload, timeout_s: float) -> tuple[ContenderResult, str]:
    """Runs ``name`` in a fresh interpreter; returns its result and the command that reproduces it."""
    args = ["-m", "benchmarks.engine_bench", "--contender", name, *w.argv()]
    command = " ".join(["python", *args])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        try:  # the child's output goes to our stderr, as progress
            proc = subprocess.run(
                [sys.executable, *args, "--out", str(out)],
                cwd=REPO_ROOT,
                stdout=sys.stderr,
                stderr=sys.stderr,
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return ContenderResult(name, error=f"timed out after {timeout_s:.0f} s"), command
        if not out.exists():
            return ContenderResult(name, error=f"process exited with code {proc.returncode}"), command
        return ContenderResult(**json.loads(out.read_text())), command


def default_threads() -> int:
    return max(1, min(2, len(os.sched_getaffinity(0))))


def run_section(
    quick: bool, command: str, threads: int | None = None, log: Callable[[str], None] = print
) -> str:
    """Measures every contender and the profile; returns the section's Markdown."""
    w = Workload(num_threads=threads or default_threads())
    if quick:
        w = replace(w, num_requests=4, prompt_len=16, output_len=16, repeats=1)
    machine = MachineInfo.probe(num_threads=w.num_threads)
    timeout_s = 120.0 if quick else 600.0
    results: dict[str, ContenderResult] = {}
    commands: dict[str, str] = {}
    for name in [*CONTENDERS, "profile"]:
        log(
            f"[engine] {name}: {w.num_requests} requests x {w.prompt_len} prompt x {w.output_len} output tokens"
        )
        t0 = time.perf_counter()
        results[name], commands[name] = run_contender(name, w, timeout_s)
        r = results[name]
        status = r.error or (f"{r.output_tok_s(w):.1f} tok/s" if r.wall_s else "done")
        log(f"[engine] {name}: {status} ({time.perf_counter() - t0:.0f} s with load and warm-up)")
    floor, floor_command = step_floor.run_all(w.num_threads, 8 if quick else 48, timeout_s, log)
    return (
        render_section(w, results, commands, provenance(machine, command), os.getloadavg(), quick)
        + "\n"
        + step_floor.render(floor, floor_command)
    )


# ------------------------------------------------------------------ the Markdown
def render_section(
    w: Workload,
    results: dict[str, ContenderResult],
    commands: dict[str, str],
    header: str,
    load_end: tuple[float, float, float],
    quick: bool,
) -> str:
    import transformers

    tok = {k: results[k].output_tok_s(w) for k in CONTENDERS}
    rows = []
    for name, (label, _) in CONTENDERS.items():
        r = results[name]
        if r.error or r.wall_s is None:
            rows.append([label, "failed", "—", "—", "—", "—", "—", _cell(r.error or "no result")])
            continue
        rows.append(
            [
                label,
                _walls(r),
                _num(tok[name]),
                _num(r.decode_tok_s(w)),
                _ratio(tok[name], tok["hf_generate"]),
                _ratio(tok[name], tok["bare_loop"]),
                _num(r.others_cpu_pct),
                "(reference)" if name == "hf_generate" else _agreement(r, results["hf_generate"]),
            ]
        )
    load = "/".join(f"{x:.2f}" for x in load_end)
    quick_note = " (quick smoke run: tiny sizes, not representative)" if quick else ""
    return "\n".join(
        [
            f"## Engine: offline batch throughput on CPU{quick_note}",
            "",
            header.rstrip("\n")
            + f"  \nLoad average at the end: {load}. transformers {transformers.__version__}.",
            "",
            f"Workload: the default model (SmolLM2-135M-Instruct; Baton in its default dtype and in fp32, "
            f"transformers in fp32 and bf16); {w.num_requests} requests x "
            f"{w.prompt_len} prompt tokens (random ids, seed {w.seed}, the same for every contender) x "
            f"{w.output_len} output tokens, greedy, EOS ignored. Each contender ran in its own fresh process with "
            f"`torch.set_num_threads({w.num_threads})`, one after another: a small warm-up run, then "
            f"{w.repeats} timed run(s), the fastest counts (the others in parentheses). The clock covers prompts in "
            "to all tokens out (prefill included, model load excluded).",
            "",
            table(
                [
                    "contender",
                    "wall s",
                    "output tok/s",
                    "decode tok/s",
                    "x static generate",
                    "x bare loop",
                    "other CPU %",
                    "same greedy tokens as static generate",
                ],
                rows,
                "lrrrrrrl",
            ),
            "*decode tok/s*: the tokens after each request's first, timed from the moment every request had its "
            "first token (prefill excluded). *other CPU %*: the share of the machine's CPU time that other "
            "processes used during the timed run (a busy neighbour slows everything down; compare rows with "
            "similar values). Greedy fp32 near-ties may flip a late token between implementations.",
            "",
            _goals(tok["baton"], tok["hf_generate"], tok["bare_loop"]),
            _dtype_goals(tok, results["baton"].detail.get("dtype")),
            "",
            "The contenders, each reproducible alone (the command prints its result as JSON):",
            "",
            *[f"- **{label}**: {_HOW[name]} `{commands[name]}`" for name, (label, _) in CONTENDERS.items()],
            "",
            _render_profile(w, results["profile"], commands["profile"]),
        ]
    )


def _render_profile(w: Workload, r: ContenderResult, command: str) -> str:
    head = f"### Where a Baton decode step goes (batch {w.num_requests})\n\nCommand: `{command}`\n"
    if r.error or not r.detail:
        return head + f"\nProfile failed: {r.error or 'no result'}\n"
    b = r.detail
    plain, timed = b["plain_step_ms"], b["timed_step_ms"]
    cats = [[_cell(name), f"{100 * ms / timed:.1f}", f"{ms:.2f}"] for name, ms in b["categories"]]
    ops = [[f"`{_cell(op)}`", f"{pct:.1f}", f"{calls:.0f}"] for op, pct, calls in b["top_ops"]]
    return "\n".join(
        [
            head,
            f"{b['batch_size']} requests past their {w.prompt_len}-token prefill: {plain:.1f} ms per step "
            f"({b['batch_size'] * 1e3 / plain:.1f} tok/s) without instrumentation. Then {b['num_steps']} steps "
            f"with an exclusive timer around every component ({timed:.1f} ms per step with the timers in); "
            "`benchmarks.step_profile.profile_engine_step(llm)` returns the same breakdown."
            + (
                f" Not found in this engine, so inside their callers' rows: {', '.join(b['untimed'])}."
                if b.get("untimed")
                else ""
            ),
            "",
            table(["category", "% of step", "ms per step"], cats),
            "Top ops by self CPU time (torch.profiler, % of the profiled steps' wall time, profiler overhead "
            "included):",
            "",
            table(["op", "% of step", "calls per step"], ops) if ops else "(none recorded)\n",
        ]
    )


_HOW = {
    "baton": "`LLM(model=None, max_num_seqs=N).generate(token_ids, SamplingParams(max_tokens, temperature=0, "
    "ignore_eos=True))`, KV cache sized to twice the workload, default token budget.",
    "baton_fp32": 'the same with `dtype="float32"`.',
    "hf_generate_bf16": "the same as static `generate` with the weights loaded in bfloat16.",
    "hf_generate": "`AutoModelForCausalLM.generate` on one [N, P] batch, `do_sample=False`, "
    "`min_new_tokens = max_new_tokens`, EOS cleared from the model's generation config, "
    "default (dynamic) cache, SDPA attention.",
    "hf_generate_batch": "`generate_batch` with `eos_token_id=-1`, `page_size=16`, `num_blocks` twice the "
    "workload, `max_batch_tokens = N x P` (sized by hand: its automatic sizing reads GPU "
    "memory).",
    "bare_loop": "the same HF modules called directly (`benchmarks.engine_bench.bare_greedy`): one contiguous "
    "[B, KVH, T, D] cache per layer, one batched prefill, then one SDPA decode step per token under "
    "`torch.inference_mode()`; no scheduler, no paging, no sampler.",
}


def _walls(r: ContenderResult) -> str:
    others = [x for x in r.detail.get("wall_s_runs", []) if x is not None and x != r.wall_s]
    return f"{r.wall_s:.1f}" + (f" ({', '.join(f'{x:.1f}' for x in others)})" if others else "")


def _goals(baton: float | None, static: float | None, bare: float | None) -> str:
    def goal(target: float, ref: float | None, what: str) -> str:
        if baton is None or ref is None:
            return f"Baton >= {target}x {what}: **not measured**."
        ratio = baton / ref
        return f"Baton >= {target}x {what}: **{'met' if ratio >= target else 'not met'}** ({ratio:.2f}x)."

    return "Goals: " + goal(1.5, static, "static generate") + " " + goal(0.8, bare, "the bare loop")


def _dtype_goals(tok: dict[str, float | None], baton_dtype: str | None) -> str:
    """Issue 14's throughput goals: Baton at 16 x 128 x 128 against static generate in each dtype."""

    def goal(ours: str, ref: str, target: float) -> str:
        if tok.get(ours) is None or tok.get(ref) is None:
            return f"**not measured** ({ours} or {ref} failed)"
        ratio = tok[ours] / tok[ref]  # type: ignore[operator]
        return f"**{'met' if ratio >= target else 'not met'}** ({ratio:.2f}x, goal >= {target}x)"

    return (
        "Baton (dtype auto = "
        + (baton_dtype or "?")
        + ") ÷ static generate in fp32: "
        + goal("baton", "hf_generate", 3.0)
        + ". Baton ÷ static generate in bf16: "
        + goal("baton", "hf_generate_bf16", 1.5)
        + "."
    )


def _agreement(r: ContenderResult, ref: ContenderResult) -> str:
    if ref.error or not ref.token_ids:
        return "—"
    same = sum(a == b for a, b in zip(r.token_ids, ref.token_ids, strict=False))
    firsts = [_first_difference(a, b) for a, b in zip(r.token_ids, ref.token_ids, strict=False) if a != b]
    where = f" (first difference at output token {', '.join(map(str, sorted(firsts)))})" if firsts else ""
    return f"{same}/{len(ref.token_ids)}{where}"


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _ratio(x: float | None, ref: float | None) -> str:
    return f"{x / ref:.2f}" if x is not None and ref else "—"


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")[:300]


if __name__ == "__main__":
    sys.exit(child_main())
