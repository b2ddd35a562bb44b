"""The disaggregation benchmark's workload, commands, arithmetic and Markdown, on hand-built traces (no
torch, no processes)."""

from __future__ import annotations

import pytest

from benchmarks.disagg_bench import DisaggPlan, OfflineResult, SetupResult, Workload, setups
from benchmarks.disagg_report import Summary, render_section, same_tokens
from benchmarks.serving_harness import Trace, others_cpu_pct, percentile, pinned, throughput

pytestmark = pytest.mark.unit

PLAN = DisaggPlan()


def trace(
    name: str,
    gaps_s: list[float],
    sent_at: float = 0.0,
    ttft_s: float = 0.1,
    kind: str = "short",
    tokens: list[int] | None = None,
    sizes: list[int] | None = None,
) -> Trace:
    arrivals = [sent_at + ttft_s]
    for g in gaps_s:
        arrivals.append(arrivals[-1] + g)
    sizes = sizes or [1] * len(arrivals)
    return Trace(
        name, kind, sent_at, arrivals, sizes, tokens or list(range(sum(sizes))), done_at=arrivals[-1]
    )


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    xs = [float(i) for i in range(1, 101)]  # 1..100
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile(list(reversed(xs)), 0) == 1.0 and percentile(xs, 100) == 100.0


def test_summary_splits_short_and_long_and_counts_merged_deltas() -> None:
    shorts = [trace("short0", [0.1] * 9), trace("short1", [0.1] * 8 + [5.0], sizes=[1] * 9 + [2])]
    longs = [trace("long0", [0.1], ttft_s=4.0, kind="long"), trace("long1", [], ttft_s=6.0, kind="long")]
    s = Summary.of([*shorts, *longs])
    assert s.num_gaps == 18 and s.num_multi == 1
    assert s.itl_ms[0] == pytest.approx(100.0)
    assert s.itl_ms[2] == pytest.approx(100 + 0.83 * 4900, rel=1e-6)  # p99 of 17 x 100 ms and one 5 s stall
    assert s.short_ttft_ms == (pytest.approx(100.0), pytest.approx(100.0))
    assert s.long_ttft_ms == (pytest.approx(5000.0), pytest.approx(6000.0))
    # long0 decodes from 4.0 s to 4.1 s, long1 is done at its first token: no short gap ends inside
    assert s.itl_long_decoding_ms is None and s.itl_otherwise_ms == pytest.approx(100.0)


def test_summary_separates_steps_with_a_long_context_in_the_batch() -> None:
    short = trace("short0", [0.1, 0.1, 0.4, 0.4, 0.1], ttft_s=0.0)  # deltas at 0, .1, .2, .6, 1.0, 1.1
    long = trace("long0", [0.4, 0.4], ttft_s=0.2, kind="long")  # decodes from 0.2 s to 1.0 s
    s = Summary.of([short, long])
    assert s.itl_long_decoding_ms == pytest.approx(400.0) and s.itl_otherwise_ms == pytest.approx(100.0)


def test_throughput_is_every_token_over_first_send_to_last_completion() -> None:
    a = trace("a", [0.5] * 3, sent_at=0.0)  # 4 tokens, done at 1.6 s
    b = trace("b", [0.5] * 5, sent_at=1.0)  # 6 tokens, done at 3.6 s
    assert throughput([a, b]) == pytest.approx(10 / 3.6)
    assert throughput([]) is None


def test_same_tokens_compares_by_request_name() -> None:
    ref = [trace("a", [0.1], tokens=[1, 2]), trace("b", [0.1], tokens=[3, 4])]
    got = [trace("a", [0.1], tokens=[1, 2]), trace("b", [0.1], tokens=[3, 5]), trace("c", [0.1])]
    assert same_tokens(got, ref) == (1, 2)


def test_others_cpu_share() -> None:
    # (busy ticks of the machine, all ticks, ours): 100 ticks passed, 80 busy, 50 of them ours
    assert others_cpu_pct((0, 0, 0), (80, 100, 50)) == pytest.approx(30.0)
    assert others_cpu_pct((0, 0, 0), (50, 100, 60)) == 0.0  # never negative (sampling skew)
    assert others_cpu_pct(None, (1, 2, 3)) is None


def test_workload_is_seeded_and_fits_the_plan() -> None:
    a, b = Workload.build(PLAN, 49152), Workload.build(PLAN, 49152)
    assert a == b
    shorts = [s for slot in a.slots for s in slot]
    assert len(a.slots) == PLAN.num_slots and len(shorts) == PLAN.num_slots * PLAN.rounds
    assert all(PLAN.short_prompt_lens[0] <= len(s.prompt_ids) <= PLAN.short_prompt_lens[1] for s in shorts)
    assert all(len(s.prompt_ids) < PLAN.local_prefill_threshold for s in shorts)  # prefilled on D
    assert [len(x.prompt_ids) for x in a.longs] == [PLAN.long_prompt_len] * len(PLAN.long_arrivals_s)
    assert all(x.kind == "long" and len(x.prompt_ids) >= PLAN.local_prefill_threshold for x in a.longs)
    assert len(a.warmup[1].prompt_ids) >= PLAN.local_prefill_threshold  # warms the P -> D path
    prompts = [s.prompt_ids for s in shorts] + [s.prompt_ids for burst in a.bursts for s in burst]
    assert len({p[:16] for p in prompts}) == len(prompts)  # no prefix-cache hits between requests


def test_setups_pin_disaggregated_workers_to_separate_cores() -> None:
    disagg, colocated, chunked = setups(PLAN, (0, 1))
    assert [w.cores for w in disagg.workers] == [(0,), (1,)] and [w.threads for w in disagg.workers] == [1, 1]
    assert colocated.workers[0].cores == (0, 1) and colocated.workers[0].threads == 2
    commands = disagg.commands(PLAN.kv_cache_memory)
    assert commands[0].startswith("taskset -c 0 python -m services.cli worker --role prefill")
    assert (
        "--local-prefill-threshold 256" in commands[2]
        and "--prefill-workers 127.0.0.1:$PREFILL_PORT" in commands[2]
    )
    assert (
        "--long-prefill-chunk 8192 --max-num-batched-tokens 8192"
        in colocated.commands(PLAN.kv_cache_memory)[0]
    )
    assert (
        "--long-prefill-chunk 256 --max-num-batched-tokens 512" in chunked.commands(PLAN.kv_cache_memory)[0]
    )
    assert pinned(["python", "-V"], None) == "python -V"


def _results(disagg_stall_s: float) -> tuple[list[SetupResult], OfflineResult]:
    def run(stall_s: float) -> list[Trace]:
        # 2 of the 100 ITL samples are the stall, so p99 is the stall
        return [trace(f"short{i}", [0.1] * 49 + [stall_s], tokens=[i] * 51) for i in range(2)] + [
            trace("long0", [0.1], ttft_s=4.0, kind="long", tokens=[9, 9])
        ]

    disagg, colocated, chunked = setups(PLAN, (0, 1))
    burst = [trace("burst0-short0", [0.1] * 9, tokens=[5] * 10)]
    results = [
        SetupResult(disagg, run(disagg_stall_s), others_cpu_pct=1.0),
        SetupResult(colocated, run(5.0), others_cpu_pct=2.0),
        SetupResult(chunked, run(0.6), bursts=[burst], burst_others_cpu_pct=[0.5]),
    ]
    offline = OfflineResult(walls_s=[1.0], token_ids=[[[5] * 10]], others_cpu_pct=[0.0], command="python …")
    return results, offline


def test_render_states_both_goals() -> None:
    results, offline = _results(disagg_stall_s=0.2)
    text = render_section(PLAN, (0, 1), results, offline, "Measured now.\n", quick=False)
    assert text.startswith("## Disaggregation: decode latency under long prompts\n")
    assert "2/2 short, 1/1 long" in text and "(reference)" in text
    assert "colocated without chunking: **met**" in text
    assert (
        "gateway >= 0.85x the offline engine: **met** (10.0 ÷ 10.0 = 1.00x)" in text
    )  # 10 tokens in 1 s each
    assert "Same greedy tokens through the gateway as offline: 1/1." in text
    assert "Caution" not in text


def test_render_reports_a_missed_goal_a_failure_and_noise() -> None:
    results, offline = _results(disagg_stall_s=5.0)
    results[2] = SetupResult(results[2].setup, error="the worker exited with code 1:\nboom | bang")
    results[0].others_cpu_pct = 55.0
    text = render_section(PLAN, (0, 1), results, offline, "Measured now.\n", quick=True)
    assert "(quick smoke run" in text
    assert "colocated without chunking: **not met**" in text
    assert "| failed |" in text and "boom \\| bang" in text
    assert "offline engine: **not measured**" in text
    assert "**Caution**: other processes took up to 55%" in text
