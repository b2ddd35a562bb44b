"""Where a Baton decode step goes: per-component exclusive timers and torch.profiler's top ops.

`profile_engine_step(llm)` gives the share of each category; `measure_step_breakdown` the full
`StepBreakdown` that the engine benchmark renders (``python -m benchmarks.engine_bench --contender profile``).
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

_FIRST_PLAIN_ID = 17  # SmolLM2's special tokens are ids 0-16; prompts avoid them (any id would do)


def random_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_prompts`` prompts of ``prompt_len`` token ids drawn with ``random.Random(seed)``."""
    rng = random.Random(seed)
    return [
        [rng.randrange(_FIRST_PLAIN_ID, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)
    ]


CAT_LINEAR = "linear layers (qkv, o, gate_up, down)"
CAT_LM_HEAD = "lm_head (logits GEMM)"
CAT_SDPA = "attention: SDPA"
CAT_GATHER = "attention: paged decode + glue"
CAT_ROPE = "RoPE + KV write"
CAT_NORM = "RMSNorm"
CAT_ACT = "MLP SiLU x up"
CAT_LAYER = "layer glue (residual adds, qkv split, views)"
CAT_STACK = "decoder layers in one C++ call (GEMMs, attention, norms, RoPE, SiLU)"
CAT_EMBED = "embedding"
CAT_PREP = "input prep (ids, positions, block tables, masks)"
CAT_SAMPLER = "sampler"
CAT_SCHED = "scheduler (schedule + update)"
CAT_POST = "postprocess (detokenize, outputs)"
CAT_OTHER = "other Python (step / execute glue)"
_MODULE_CATEGORIES = {
    "Linear": CAT_LINEAR,
    "RMSNorm": CAT_NORM,
    "RotaryEmbedding": CAT_ROPE,
    "MLP": CAT_ACT,
    "Attention": CAT_LAYER,
    "DecoderLayer": CAT_LAYER,
    "LlamaForCausalLM": CAT_STACK,
    "Embedding": CAT_EMBED,
}


@dataclass(slots=True)
class StepBreakdown:
    """Where Baton's decode steps go at one batch size (see `measure_step_breakdown`)."""

    batch_size: int
    num_steps: int
    plain_step_ms: float  # mean step time without instrumentation
    timed_step_ms: float  # with the timers in (the difference is their overhead)
    categories: list[tuple[str, float]]  # (category, ms per step), largest first; sums to timed_step_ms
    top_ops: list[tuple[str, float, float]]  # torch.profiler: (op, % of step wall time, calls per step)
    untimed: list[str] = field(default_factory=list)  # components not found, so not timed on their own

    def shares(self) -> list[tuple[str, float]]:
        total = sum(ms for _, ms in self.categories) or 1.0
        return [(name, 100.0 * ms / total) for name, ms in self.categories]


def profile_engine_step(
    llm: Any, num_steps: int = 20, batch_size: int = 16, prompt_len: int = 128, seed: int = 0
) -> list[tuple[str, float]]:
    """(category, % of decode step time), largest first, for ``llm`` (an idle `engine.LLM`) decoding
    ``batch_size`` random prompts of ``prompt_len`` tokens. Categories: linear layers, lm_head, SDPA,
    paged KV gather, KV write, RoPE, RMSNorm, MLP activation, layer glue, input prep, sampler, scheduler,
    postprocess, and the rest of the step's Python."""
    return measure_step_breakdown(llm, num_steps, batch_size, prompt_len, seed, profiler_steps=0).shares()


def measure_step_breakdown(
    llm: Any,
    num_steps: int = 20,
    batch_size: int = 16,
    prompt_len: int = 128,
    seed: int = 0,
    profiler_steps: int = 5,
) -> StepBreakdown:
    """Prefills ``batch_size`` requests (untimed); times ``num_steps`` plain decode steps (half before,
    half after) and ``num_steps`` with an exclusive timer around every engine component (torch runs ops
    synchronously on CPU, so wall time around a call is its cost); then ``profiler_steps`` under
    torch.profiler for the top ops."""
    engine = llm.engine
    warm = 3
    timers = _ExclusiveTimers()
    with _decoding_batch(engine, batch_size, prompt_len, 2 + warm + 2 * num_steps + profiler_steps, seed):
        for _ in range(warm):
            engine.step()
        plain_s = _time_steps(engine, num_steps // 2)
        undo = _instrument(engine, timers)
        try:
            for _ in range(num_steps):
                engine.step()
        finally:
            for u in reversed(undo):
                u()
        plain_s += _time_steps(engine, num_steps - num_steps // 2)  # before and after: drift averages out
        top = _top_ops(engine, profiler_steps) if profiler_steps else []
    cats = sorted(((c, s * 1e3 / num_steps) for c, s in timers.totals.items()), key=lambda c: -c[1])
    return StepBreakdown(
        batch_size, num_steps, plain_s * 1e3 / num_steps, sum(ms for _, ms in cats), cats, top, timers.untimed
    )


def _time_steps(engine: Any, num_steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    return time.perf_counter() - t0


@contextmanager
def _decoding_batch(
    engine: Any, batch_size: int, prompt_len: int, max_tokens: int, seed: int
) -> Iterator[None]:
    """``batch_size`` requests past their prefill for the block's duration; aborted afterwards."""
    from core.sampling_params import SamplingParams

    prompts = random_prompts(batch_size, prompt_len, engine.model_config.vocab_size, seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"profile-{seed}-{i}" for i in range(batch_size)]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    started: set[str] = set()
    while len(started) < batch_size:
        started.update(o.request_id for o in engine.step())
    try:
        yield
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished:
            engine.step()


class _ExclusiveTimers:
    """Per-category self time of nested calls: a call's time minus that of the timed calls inside it."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.untimed: list[str] = []  # components the engine no longer has (their time is in the caller's)
        self._stack: list[list[Any]] = []  # [category, start, time in timed children]

    def wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame: list[Any] = [category, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[1]
                self.totals[category] += spent - frame[2]
                if self._stack:
                    self._stack[-1][2] += spent

        return timed


def _instrument(llm_engine: Any, timers: _ExclusiveTimers) -> list[Callable[[], None]]:
    """Wraps the engine's components in timers; returns the undo functions. A component that is not
    there (the engine changed) is skipped and its time lands in its caller's category."""
    import engine.attention as attention_module
    import engine.cpu_ops as ops_module
    import engine.model as model_module

    runner = getattr(llm_engine, "runner", None)
    model = getattr(runner, "model", None)
    scheduler = getattr(llm_engine, "scheduler", None)
    targets: list[tuple[Any, str, str]] = [
        (llm_engine, "step", CAT_OTHER),
        (runner, "execute", CAT_OTHER),
        (scheduler, "schedule", CAT_SCHED),
        (scheduler, "update", CAT_SCHED),
        (llm_engine, "_postprocess", CAT_POST),
        (runner, "_prepare", CAT_PREP),
        (runner, "sampler", CAT_SAMPLER),
        (model, "compute_logits", CAT_LM_HEAD),
        (ops_module, "rope_and_cache", CAT_ROPE),
        (model_module, "paged_attention", CAT_GATHER),
        (attention_module, "sdpa", CAT_SDPA),
        (attention_module, "paged_decode_attention", CAT_GATHER),
        (ops_module, "silu_and_mul", CAT_ACT),
    ]
    if isinstance(model, torch.nn.Module):
        for module in model.modules():
            category = CAT_LM_HEAD if module is getattr(model, "lm_head", None) else None
            category = category or _MODULE_CATEGORIES.get(type(module).__name__)
            if category:
                targets.append((module, "forward", category))
            if category == CAT_ROPE and hasattr(module, "lookup"):  # cos/sin once per step
                targets.append((module, "lookup", CAT_ROPE))
    undo = []
    for obj, attr, cat in targets:
        u = _patch(obj, attr, timers, cat)
        if u is not None:
            undo.append(u)
        elif obj is not None and not isinstance(obj, torch.nn.Module):
            timers.untimed.append(f"{getattr(obj, '__name__', type(obj).__name__)}.{attr}")
    return undo


def _patch(obj: Any, attr: str, timers: _ExclusiveTimers, category: str) -> Callable[[], None] | None:
    if obj is None or not hasattr(obj, attr):
        return None
    original = getattr(obj, attr)
    own = attr in getattr(obj, "__dict__", {})
    try:
        setattr(obj, attr, timers.wrap(original, category))
    except (AttributeError, TypeError):  # slotted or read-only: leave it untimed
        return None
    return (lambda: setattr(obj, attr, original)) if own else (lambda: delattr(obj, attr))


def _top_ops(engine: Any, num_steps: int, k: int = 10) -> list[tuple[str, float, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall_us = (time.perf_counter() - t0) * 1e6
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:k]
    return [(e.key, 100.0 * e.self_cpu_time_total / wall_us, e.count / num_steps) for e in events]
