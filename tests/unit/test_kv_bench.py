"""The KV transfer benchmark's arithmetic and Markdown, on hand-built results (no torch, no processes)."""

from __future__ import annotations

import pytest

from benchmarks.kv_bench import (
    BACKENDS,
    KVBenchPlan,
    LengthResult,
    PullStats,
    blocks_for,
    gb_per_s,
    render_section,
)

pytestmark = pytest.mark.unit

BLOCK_BYTES = 737_280


def length(
    num_tokens: int,
    prefill_s: float,
    pull_s: dict[str, float],
    descriptors: int = 1,
    per_block_s: float | None = None,
    failed: str | None = None,
) -> LengthResult:
    n = blocks_for(num_tokens)
    pulls = []
    for b in BACKENDS:
        merged = PullStats(b, False, descriptors, [pull_s[b]] * 3, verified=True)
        single = PullStats(b, True, n, [per_block_s or pull_s[b]] * 3, verified=True)
        if b == failed:
            merged = PullStats(b, False, descriptors, error="puller: KVTransferFailed: boom | bang")
        pulls += [merged, single]
    return LengthResult(
        num_tokens, n, n * BLOCK_BYTES, prefill_s, [0.01, 0.01, 0.02], pulls, {b: 12 for b in BACKENDS}
    )


def render(results: list[LengthResult]) -> str:
    return render_section(KVBenchPlan(), results, "Measured now.\n", quick=False)


def test_blocks_and_bandwidth() -> None:
    assert blocks_for(2048) == 128 and blocks_for(8000) == 500 and blocks_for(8001) == 501
    assert gb_per_s(2_000_000_000, 0.5) == pytest.approx(4.0)
    assert gb_per_s(1, None) is None and gb_per_s(1, 0.0) is None


def test_pull_stats_median() -> None:
    assert PullStats("nixl", False, times_s=[3.0, 1.0, 2.0]).median_s == 2.0
    assert PullStats("nixl", False).median_s is None


def test_goals_met_with_the_figures() -> None:
    r = length(2048, prefill_s=10.0, pull_s={"nixl": 0.02, "shm": 0.01, "tcp": 0.05})
    text = render([r])
    assert text.startswith("## KV transfer: prefill → decode on CPU\n")
    # memcpy: 128 blocks in 10 ms; nixl in 20 ms = 0.50x; 20 ms of a 10 s prefill = 0.20%.
    assert "NIXL >= 0.3x memcpy bandwidth: **met** (0.50x at 2048 tokens)" in text
    assert "of the prefill time at 2048 tokens: **met** (nixl 0.20%, shm 0.10%, tcp 0.50%)" in text
    assert "| 2048 | 128 (90) | 10.00 | memcpy (one process) |" in text
    assert "**NO**" not in text


def test_goals_not_met_and_partly_met() -> None:
    slow = {"nixl": 1.0, "shm": 0.01, "tcp": 0.05}
    text = render([length(2048, 10.0, slow)])
    assert "memcpy bandwidth: **not met** (0.01x at 2048 tokens)" in text
    assert "at 2048 tokens: **not met** (nixl 10.0%" in text
    text = render([length(512, 1.0, {"nixl": 0.01, "shm": 0.01, "tcp": 0.01}), length(2048, 10.0, slow)])
    assert "memcpy bandwidth: **met at 512 tokens only**" in text


def test_a_failed_backend_is_a_row_not_a_crash() -> None:
    text = render([length(2048, 10.0, {"nixl": 0.02, "shm": 0.01, "tcp": 0.05}, failed="nixl")])
    assert "| nixl | 1 | failed |" in text
    assert "boom \\| bang" in text  # the pipe is escaped inside the table
    assert "memcpy bandwidth: **not measured** (NIXL failed)" in text


def test_merge_note_and_fragmented_descriptors() -> None:
    r = length(8000, 60.0, {"nixl": 0.05, "shm": 0.04, "tcp": 0.1}, descriptors=160, per_block_s=0.1)
    text = render([r])
    assert "8000 tokens: 500 blocks → 160" in text and "descending order" in text
    assert "reached 0.50–0.50x the merged bandwidth: a cost of up to 50%" in text
    assert "expected 12 per backend each): nixl 12, shm 12, tcp 12" in text
