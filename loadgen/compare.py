"""`loadgen compare`: chosen metrics of several result files side by side, each with its ratio to the
first file's, as a console table, a markdown table and a bar chart."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.workload import LoadgenError

DEFAULT_METRICS = (
    "completed",
    "failed",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
)


@dataclass(frozen=True, slots=True)
class Row:
    """One metric across the runs, and each value's ratio to the first run's (None where undefined)."""

    metric: str
    values: tuple[float | None, ...]

    @property
    def ratios(self) -> tuple[float | None, ...]:
        first = self.values[0]
        if first is None or first == 0:
            return tuple(None for _ in self.values)
        return tuple(None if v is None else v / first for v in self.values)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def compare_rows(results: Sequence[dict[str, Any]], metrics: Sequence[str] | None = None) -> list[Row]:
    """A row per metric. Without ``metrics``: the default set, minus those no result has. A metric asked
    for by name that no result has is an error."""
    chosen = list(metrics) if metrics else list(DEFAULT_METRICS)
    rows = [Row(m, tuple(_number(r.get(m)) for r in results)) for m in chosen]
    missing = [row.metric for row in rows if all(v is None for v in row.values)]
    if metrics and missing:
        raise LoadgenError(f"no result file has a numeric {', '.join(repr(m) for m in missing)}")
    return [row for row in rows if row.metric not in missing]


def run_labels(
    paths: Sequence[Path], results: Sequence[dict[str, Any]], labels: Sequence[str] | None
) -> list[str]:
    """``--labels`` if given, else each result's label, else its file name."""
    if labels:
        if len(labels) != len(paths):
            raise LoadgenError(f"--labels has {len(labels)} names for {len(paths)} files")
        return list(labels)
    return [str(r.get("label") or p.stem) for p, r in zip(paths, results, strict=True)]


def _cell(value: float | None, ratio: float | None, first: bool) -> str:
    if value is None:
        return "-"
    text = f"{value:.2f}" if not value.is_integer() else f"{value:.0f}"
    return text if first or ratio is None else f"{text} ({ratio:.2f}x)"


def _cells(row: Row) -> list[str]:
    return [_cell(v, r, i == 0) for i, (v, r) in enumerate(zip(row.values, row.ratios, strict=True))]


def format_table(labels: Sequence[str], rows: Sequence[Row]) -> str:
    """Plain columns for a terminal."""
    table = [["metric", *labels], *([row.metric, *_cells(row)] for row in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = [_aligned(line, widths) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _aligned(line: Sequence[str], widths: Sequence[int]) -> str:
    """The metric name left-aligned, the values right-aligned."""
    values = (cell.rjust(width) for cell, width in zip(line[1:], widths[1:], strict=True))
    return "  ".join([line[0].ljust(widths[0]), *values])


def format_markdown(labels: Sequence[str], rows: Sequence[Row]) -> str:
    """A GitHub markdown table; ratios to the first run in parentheses."""
    lines = ["| metric | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for row in rows:
        lines.append(f"| {row.metric} | " + " | ".join(_cells(row)) + " |")
    return "\n".join(lines) + "\n"


def plot_compare(labels: Sequence[str], rows: Sequence[Row], path: Path) -> None:
    """One bar chart per metric, a bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(rows)) or 1
    nrows = math.ceil(len(rows) / cols) or 1
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(labels))]
    for ax, row in zip(axes.flat, rows, strict=False):
        ax.bar(range(len(labels)), [v or 0.0 for v in row.values], color=colors)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(row.metric, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(rows) :]:
        ax.set_visible(False)
    fig.tight_layout()
    from loadgen.plots import save_figure

    save_figure(fig, path)
