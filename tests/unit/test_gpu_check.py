"""The GPU check's report, rendered from the run recorded on an H200 (benchmarks/results/): the numbers in
docs/BENCHMARKS.md's GPU section come from that JSON, not from hand-typed text. No GPU needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.gpu_check import ATTENTION_SHAPES, SHAPES, render

pytestmark = pytest.mark.unit

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_check_h200.json"


def test_the_recorded_h200_run_renders_every_case_and_every_engine_row() -> None:
    r = json.loads(RUN.read_text())
    text = render(r)
    cases = r["attention_correctness"]
    assert len(cases) == len(ATTENTION_SHAPES) * 2 * 2  # two dtypes, two block sizes
    assert all(c["ok"] for c in cases.values())
    assert text.count("| ok |") == len(cases) and "**over**" not in text
    for a in r["attention_bandwidth"]:
        assert f"| {a['batch']} | {a['ctx']} | {a['ms']:.3f} |" in text
    for shape in SHAPES:
        for b, x in r[f"engine {shape}"]["batches"].items():
            assert f"| {b} | {x['step_ms']:.1f} |" in text
    assert f"{r['copy_gb_s']:,.0f} GB/s" in text


def test_a_failed_section_is_a_row_with_its_error_not_a_crash() -> None:
    r = json.loads(RUN.read_text())
    first = next(iter(r["attention_correctness"]))
    r["attention_correctness"][first] = {"error": "RuntimeError: out of resources"}
    r["attention_bandwidth"][0] = {"error": "RuntimeError: boom"}
    r[f"engine {next(iter(SHAPES))}"] = {"error": "ValueError: bad"}
    text = render(r)
    assert "RuntimeError: out of resources | | failed |" in text
    assert "RuntimeError: boom" in text and "ValueError: bad" in text
