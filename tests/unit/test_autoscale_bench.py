"""The Autoscaling benchmark's arithmetic, on hand-made traces: the step load's phases, SLO attainment
per request, decode worker-seconds, the autoscaler's reaction times, and the rendered table."""

from __future__ import annotations

import pytest

from benchmarks.autoscale_bench import CONFIGS, TPOT_SLO_MS, TTFT_SLO_MS, Plan, Run, render
from benchmarks.serving_harness import Trace

pytestmark = pytest.mark.unit

PLAN = Plan(((2, 10.0), (8, 20.0), (2, 20.0)), 64, 16)


def trace(sent: float, ttft_s: float, gap_s: float, tokens: int = 16, error: str | None = None) -> Trace:
    t = Trace("r", "short", sent_at=sent)
    if error is None:
        t.arrivals = [sent + ttft_s + i * gap_s for i in range(tokens)]
        t.sizes = [1] * tokens
        t.done_at = t.arrivals[-1]
    else:
        t.error = error
    return t


def test_the_step_load_and_its_phases() -> None:
    assert [PLAN.clients_at(t) for t in (0, 9.9, 10, 29.9, 30, 49.9, 50)] == [2, 2, 8, 8, 2, 2, 0]
    assert [PLAN.phase_of(t) for t in (0, 15, 45, 99)] == [0, 1, 2, 2]
    assert PLAN.duration_s == 50


def test_a_request_meets_the_slo_with_both_its_ttft_and_its_time_per_token() -> None:
    run = Run(CONFIGS[0])
    ok = trace(0, TTFT_SLO_MS / 2e3, TPOT_SLO_MS / 2e3)
    slow_first = trace(0, TTFT_SLO_MS * 2 / 1e3, TPOT_SLO_MS / 2e3)
    slow_tokens = trace(0, TTFT_SLO_MS / 2e3, TPOT_SLO_MS * 2 / 1e3)
    failed = trace(0, 0, 0, error="UNAVAILABLE")
    assert [run.meets(t) for t in (ok, slow_first, slow_tokens, failed)] == [True, False, False, False]
    assert run.attainment([ok, slow_first, slow_tokens, failed]) == 0.25 and run.attainment([]) is None


def test_worker_seconds_and_reaction_times_follow_the_replica_samples() -> None:
    run = Run(CONFIGS[0], replicas=[(0.0, 1), (12.0, 1), (14.0, 2), (33.0, 2), (35.0, 1)])
    assert run.worker_seconds(50) == pytest.approx(14 * 1 + 21 * 2 + 15 * 1)
    assert run.first(10, lambda n: n >= 2) == pytest.approx(4.0)
    assert run.first(30, lambda n: n <= 1) == pytest.approx(5.0)
    assert run.first(40, lambda n: n >= 2) is None


def test_the_section_shows_every_configuration_its_phases_and_the_reaction() -> None:
    scaled = Run(CONFIGS[0], t0=0.0, replicas=[(0.0, 1), (14.0, 2), (35.0, 1)], decisions=["decode 1 -> 2"])
    scaled.traces = [trace(1, 0.1, 0.02), trace(12, 1.5, 0.02), trace(20, 0.1, 0.02), trace(40, 0.1, 0.02)]
    fixed = Run(CONFIGS[1], t0=0.0, replicas=[(0.0, 1)], traces=[trace(1, 0.1, 0.02)])
    broken = Run(CONFIGS[2], error="baton up did not start")
    text = render(PLAN, [scaled, fixed, broken], "Measured now.\n", "img/autoscaling.png")
    assert "| baton up --autoscale (1P1D → at most 1P2D) | 100% / 50% / 100% / 75% |" in text
    assert "| fixed 1P2D | error: baton up did not start |" in text
    assert (
        "a second decode worker serving 4.0 s after the load rose; one drained and removed 5.0 s after it fell"
        in text
    )
    assert (
        "    decode 1 -> 2" in text
        and "![decode workers and SLO attainment over time](img/autoscaling.png)" in text
    )
