"""The tenancy benchmark's arrivals, arithmetic and Markdown on hand-built traces (no processes)."""

from __future__ import annotations

import pytest

from benchmarks.report import MachineInfo
from benchmarks.serving_harness import Trace
from benchmarks.tenancy_bench import PhaseResult, TenancyPlan, arrivals, render

pytestmark = pytest.mark.unit


def test_arrivals_are_a_seeded_poisson_stream_within_the_phase() -> None:
    plan = TenancyPlan(duration_s=100.0)
    a = arrivals(plan, 2.0, 1, 1000, "quiet")
    assert a == arrivals(plan, 2.0, 1, 1000, "quiet")  # seeded
    assert 150 < len(a) < 250  # ≈ rate × duration
    assert all(0 < x.start_s < 100 for x in a) and [x.start_s for x in a] == sorted(x.start_s for x in a)
    assert all(32 <= len(x.prompt_ids) <= 64 and x.max_tokens == plan.output_len for x in a)
    again = arrivals(plan, 2.0, 1, 1000, "quiet", token_seed=2)  # the same stream, other prompts
    assert [(x.start_s, len(x.prompt_ids)) for x in again] == [(x.start_s, len(x.prompt_ids)) for x in a]
    assert all(x.prompt_ids != y.prompt_ids for x, y in zip(a, again, strict=True))


def _trace(name: str, ttft_s: float, error: str | None = None) -> Trace:
    t = Trace(name, "x", sent_at=0.0, error=error)
    if error is None:
        t.arrivals, t.token_ids, t.done_at = [ttft_s, ttft_s + 0.1], [1, 2], ttft_s + 0.1
    return t


def test_render_reports_the_ratio_of_p95s_and_the_flood_outcomes() -> None:
    solo = PhaseResult({"quiet": [_trace(f"q{i}", 0.2) for i in range(20)]}, wall_s=10.0)
    flood = PhaseResult(
        {
            "quiet": [_trace(f"q{i}", 0.25) for i in range(20)],
            "flood": [_trace("f0", 1.0), _trace("f1", 0.0, "RESOURCE_EXHAUSTED: over quota")],
        },
        wall_s=10.0,
    )
    machine = MachineInfo.probe(num_threads=1)
    text = render(TenancyPlan(), machine, "cmd", ["baton up"], solo, flood)
    assert "**1.25×**" in text and "**met**" in text
    assert "RESOURCE_EXHAUSTED 1" in text
    assert (
        "| quiet, under the flood | 20 | 20 | 250 | 250 | 250 | 100 / 100 |" in text
    )  # each trace's gap: 0.1 s
    worse = PhaseResult({"quiet": [_trace(f"q{i}", 0.5) for i in range(20)]}, wall_s=10.0)
    assert "**not met**" in render(TenancyPlan(), machine, "cmd", [], solo, worse)


def test_rounds_of_one_side_are_pooled() -> None:
    a = PhaseResult({"quiet": [_trace("q0", 0.2)]}, wall_s=10.0, cpu_pct={"decode": 90.0})
    b = PhaseResult(
        {"quiet": [_trace("q1", 0.4)], "flood": [_trace("f0", 1.0)]},
        wall_s=30.0,
        cpu_pct={"decode": 50.0, "prefill": 40.0},
    )
    a.add(b)
    assert [t.name for t in a.traces["quiet"]] == ["q0", "q1"] and len(a.traces["flood"]) == 1
    assert a.wall_s == 40.0
    assert a.cpu_pct == pytest.approx({"decode": 60.0, "prefill": 30.0})  # weighted by each block's time
    assert a.tokens_per_s("quiet") == pytest.approx(4 / 40.0)
