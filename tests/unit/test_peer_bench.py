"""The peer comparison's arithmetic: which rates count as sustained, and the verdict it prints."""

from __future__ import annotations

import pytest

from benchmarks.peer_bench import Point, System, mission_rate, render, sustained_rate
from benchmarks.report import MachineInfo

pytestmark = pytest.mark.unit


def point(rate: float, good_share: float, failed: int = 0, n: int = 40) -> Point:
    duration = n / rate
    return Point(
        rate,
        result={
            "num_prompts": n,
            "failed": failed,
            "completed": n - failed,
            "duration": duration,
            "request_goodput": good_share * n / duration,
            "output_throughput": 10.0,
        },
    )


def test_a_rate_is_sustained_when_nine_in_ten_meet_the_slo_and_none_fail() -> None:
    assert point(1.0, 0.95).sustained and point(1.0, 0.9).sustained
    assert not point(1.0, 0.85).sustained
    assert not point(1.0, 1.0, failed=1).sustained
    assert not Point(1.0, error="loadgen exited with 2").sustained
    assert sustained_rate([point(0.5, 1.0), point(1.0, 0.92), point(2.0, 0.4)]) == 1.0
    assert sustained_rate([point(0.5, 0.3)]) == 0.0


def test_the_verdict_is_baton_over_the_best_peer_and_names_missing_peers() -> None:
    machine = MachineInfo.probe(num_threads=2)
    baton, tf, llama = (System(name, [], 0, []) for name in ("Baton", "transformers", "llama.cpp"))
    text = render(
        machine,
        "cmd",
        [
            (baton, [point(0.5, 1.0), point(1.5, 0.95)]),
            (tf, [point(0.5, 0.2)]),
            (llama, [point(0.25, 1.0), point(0.5, 0.6)]),
        ],
    )
    assert "Baton's best ÷ best peer, loose SLO: **6.00×** (goal ≥ 2×: **met** on this grid of rates)" in text
    assert "ratio lies between" not in text  # Baton's sweep never failed: no upper bound to state
    text = render(
        machine,
        "cmd",
        [
            (baton, [point(0.5, 1.0), point(1.5, 0.95), point(2.0, 0.3)]),
            (tf, [point(0.5, 0.2)]),
            (llama, [point(0.25, 1.0), point(0.5, 0.6)]),
        ],
    )
    assert "**6.00×**" in text and "the ratio lies between 3.00× and 8.00×" in text
    llama.missing = "not installed (`make peers`)"
    text = render(machine, "cmd", [(baton, [point(0.5, 1.0)]), (tf, [point(0.25, 1.0)]), (llama, [])])
    assert "Baton's best ÷ best peer, loose SLO: **2.00×**" in text and "not run: not installed" in text


def test_the_mission_slo_asks_for_p95_ttft_under_250_ms_and_p95_itl_under_30_ms() -> None:
    def timed(rate: float, ttft: float, itl: float, failed: int = 0) -> Point:
        p = point(rate, 1.0, failed)
        assert p.result is not None
        p.result.update({"p95_ttft_ms": ttft, "p95_itl_ms": itl})
        return p

    assert timed(1.0, 200, 25).mission_sustained
    assert not timed(1.0, 260, 25).mission_sustained and not timed(1.0, 200, 31).mission_sustained
    assert not timed(1.0, 200, 25, failed=1).mission_sustained
    assert mission_rate([timed(1, 100, 10), timed(2, 240, 29), timed(4, 400, 35)]) == 2
    machine = MachineInfo.probe(num_threads=2)
    text = render(machine, "cmd", [(System("Baton (up)", [], 0, []), [timed(1, 100, 10), timed(2, 300, 20)])])
    assert "mission SLO sustained 1 req/s, goal ≥ 6: **not met**" in text


def test_single_stream_tpot_comes_from_the_closed_loop_and_is_never_a_rate() -> None:
    def tpot(p: Point, ms: float, itl_p95: float = 10) -> Point:
        assert p.result is not None
        p.result.update({"median_tpot_ms": ms, "p95_ttft_ms": 100, "p95_itl_ms": itl_p95})
        return p

    single = tpot(point(1.0, 1.0), 8.3)
    single.rate, single.single_stream = 0.0, True
    rated = [tpot(point(0.5, 1.0), 11.1), tpot(point(1.0, 0.4), 30.0, itl_p95=45)]
    assert sustained_rate([single, *rated]) == 0.5 and mission_rate([single, *rated]) == 0.5
    machine = MachineInfo.probe(num_threads=2)
    text = render(machine, "cmd", [(System("Baton (up)", [], 0, []), [single, *rated])])
    assert "single-stream TPOT p50 8.3 ms, goal ≤ 10 ms: **met** (TPOT p50 at 0.5 req/s: 11.1 ms)" in text
    assert "| Baton (up) | 1 stream |" in text
    text = render(machine, "cmd", [(System("Baton (up)", [], 0, []), [tpot(single, 10.4), *rated])])
    assert "single-stream TPOT p50 10.4 ms, goal ≤ 10 ms: **not met**" in text
    text = render(machine, "cmd", [(System("Baton (up)", [], 0, []), rated)])
    assert "single-stream TPOT **not measured**" in text
