"""benchmarks.structured_bench's report: the ratio against the issue's goal, and schemas that defeat the
compiler's cache (the measurement itself is `make bench`'s)."""

from __future__ import annotations

import pytest

from benchmarks.structured_bench import Result, fifty_fields, render_section

pytestmark = pytest.mark.unit


def test_the_report_judges_the_ratio_against_the_goal() -> None:
    met = render_section(Result(40.0, 43.0, 12.0, 0.3, 3, 32), "Measured here.\n")
    assert "| decode step, batch 16, JSON schema | 43.0 ms | 1.07× (goal ≤ 1.1×: met) |" in met
    assert "| compile a new 50-field schema | 12.0 ms |" in met
    assert "1.25× (goal ≤ 1.1×: not met)" in render_section(Result(40.0, 50.0, 12.0, 0.3, 3, 32), "")


def test_each_fifty_field_schema_is_new() -> None:
    a, b = fifty_fields(0), fifty_fields(1)
    assert len(a["properties"]) == 50 and a["required"] == list(a["properties"])
    assert set(a["properties"]).isdisjoint(b["properties"])
