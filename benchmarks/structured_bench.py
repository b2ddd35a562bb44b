"""`make bench` section "structured": what a structured-output constraint costs the engine.

* **Decode step with a JSON schema vs without, batch 16** (the goal: ≤ 1.1×): the default model, 16
  requests decoding side by side — all constrained by one JSON schema (an array of 100 numbers: long
  enough that none ends inside the window), or all free — timed over the same window of decode steps
  after every prompt is in. The two batches alternate, ``ROUNDS`` times, and the medians are compared,
  so machine noise hits both alike.
* **Grammar compile time** of a 50-field schema (a new schema each time: no cache hit), and the
  grammar's work per step: the masks of 16 requests, filled and applied.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.report import MachineInfo, provenance, table

ROUNDS = 3
BATCH = 16
WARM_STEPS = 4  # decode steps skipped after the prompts are in
STEPS = 32  # decode steps timed per round
LONG_ARRAY = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 100,
    "maxItems": 100,
}


def fifty_fields(salt: int) -> dict[str, Any]:
    """A 50-field object schema (integers, bounded strings, number arrays, enums); ``salt`` makes each
    one new to the compiler's cache."""
    kinds: list[dict[str, Any]] = [
        {"type": "integer"},
        {"type": "string", "maxLength": 20},
        {"type": "array", "items": {"type": "number"}},
        {"enum": ["red", "green", "blue"]},
    ]
    props = {f"field_{i}_{salt}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class Result:
    free_step_ms: float  # median decode step, batch 16, unconstrained
    schema_step_ms: float  # the same, every request held to the JSON schema
    compile_ms: float  # median compile of a new 50-field schema
    mask_ms: float  # median fill + apply of 16 masks for one step
    rounds: int
    steps: int


def _decode_steps_ms(engine: Any, structured: Any, steps: int, round_: int) -> list[float]:
    from core.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=WARM_STEPS + steps + 8, temperature=1.0, ignore_eos=True, structured=structured
    )
    prompt = engine.tokenizer.encode("Write a long list of numbers as JSON:")
    for i in range(BATCH):
        engine.add_request(f"r{round_}-{i}", prompt, params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(WARM_STEPS):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    assert len(engine.scheduler.running) == BATCH, "a request ended inside the timed window"
    while engine.has_unfinished:
        engine.step()
    return times


def measure(quick: bool, log: Callable[[str], None]) -> Result:
    import torch

    from core.sampling_params import StructuredOutput
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.structured import apply_masks

    engine = LLMEngine(EngineConfig(kv_cache_memory=256 << 20))
    schema = StructuredOutput("json", json.dumps(LONG_ARRAY))
    rounds, steps = (1, 4) if quick else (ROUNDS, STEPS)
    free: list[float] = []
    constrained: list[float] = []
    for r in range(rounds):
        free += _decode_steps_ms(engine, None, steps, 2 * r)
        constrained += _decode_steps_ms(engine, schema, steps, 2 * r + 1)
        log(
            f"[structured] round {r + 1}/{rounds}: free {statistics.median(free):.1f} ms, "
            f"schema {statistics.median(constrained):.1f} ms per step"
        )
    compiles = []
    for salt in range(3 if quick else 7):
        spec = StructuredOutput("json", json.dumps(fifty_fields(salt)))
        t0 = time.perf_counter()
        engine.grammars.compile(spec)
        compiles.append((time.perf_counter() - t0) * 1e3)
    vocab = engine.model_config.vocab_size
    constraints = [(i, engine.grammars.constraint(schema, [])) for i in range(BATCH)]
    logits = torch.randn(BATCH, vocab)
    masks = []
    for _ in range(20):
        t0 = time.perf_counter()
        apply_masks(logits, constraints, vocab)  # type: ignore[arg-type]
        masks.append((time.perf_counter() - t0) * 1e3)
    return Result(
        statistics.median(free),
        statistics.median(constrained),
        statistics.median(compiles[1:] or compiles),  # the first also builds the vocabulary's tables
        statistics.median(masks),
        rounds,
        steps,
    )


def render_section(result: Result, machine_line: str, quick: bool = False) -> str:
    ratio = result.schema_step_ms / result.free_step_ms
    verdict = "met" if ratio <= 1.1 else "not met"
    rows = [
        ["decode step, batch 16, free", f"{result.free_step_ms:.1f} ms", ""],
        [
            "decode step, batch 16, JSON schema",
            f"{result.schema_step_ms:.1f} ms",
            f"{ratio:.2f}× (goal ≤ 1.1×: {verdict})",
        ],
        ["the grammar's share: 16 masks filled and applied", f"{result.mask_ms:.2f} ms", ""],
        ["compile a new 50-field schema", f"{result.compile_ms:.1f} ms", ""],
    ]
    return (
        "## Structured outputs\n\n"
        + machine_line
        + "\nThe default model; 16 requests decoding together, all held to one JSON schema (an array of 100 "
        f"numbers) or all free; the median of {result.rounds} alternating rounds of {result.steps} decode steps"
        + (" (quick: smoke sizes)" if quick else "")
        + ". The grammar engine is xgrammar (engine/structured.py says why).\n\n"
        + table(["what", "time", "ratio"], rows, "lrl")
    )


def run_section(quick: bool, command: str, threads: int | None, log: Callable[[str], None]) -> str:
    import torch

    if threads:
        torch.set_num_threads(threads)
    machine = MachineInfo.probe(num_threads=torch.get_num_threads())
    result = measure(quick, log)
    return render_section(result, provenance(machine, command), quick)
