"""PNG plots of a result (matplotlib, Agg backend, no display): latency CDFs and throughput over time.

They read only the result JSON's fields, so `loadgen` can redraw them from a saved file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window

import matplotlib.pyplot as plt  # noqa: E402 (the backend must be chosen first)
import numpy as np  # noqa: E402

from loadgen.workload import LoadgenError  # noqa: E402

LATENCY_CDF = "latency_cdf.png"
THROUGHPUT = "throughput.png"


def _cdf(ax: Any, values_ms: list[float], label: str | None = None) -> None:
    if not values_ms:
        return
    xs = np.sort(np.asarray(values_ms))
    ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)


def _latencies(result: dict[str, Any], tenant: str | None = None) -> dict[str, list[float]]:
    """Per-request TTFT and E2EL and pooled ITL in ms, of successful requests (of one tenant)."""
    tenants = result.get("tenants") or [None] * len(result["errors"])
    keep = [
        not error and (tenant is None or t == tenant)
        for error, t in zip(result["errors"], tenants, strict=True)
    ]
    ttfts = [t * 1000 for t, k in zip(result["ttfts"], keep, strict=True) if k]
    itls = [g * 1000 for gaps, k in zip(result["itls"], keep, strict=True) if k for g in gaps]
    e2els = [t * 1000 for t, k in zip(result.get("e2els", []), keep, strict=False) if k]
    return {"TTFT": ttfts, "ITL": itls, "E2E latency": e2els}


def plot_latency_cdfs(result: dict[str, Any], path: Path) -> None:
    """TTFT, ITL and end-to-end latency CDFs side by side (one line per tenant when there are tenants)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    tenants = sorted(result.get("per_tenant") or {})
    groups: list[str | None] = [*tenants] if tenants else [None]
    for tenant in groups:
        for ax, (name, values) in zip(axes, _latencies(result, tenant).items(), strict=True):
            _cdf(ax, values, tenant)
            ax.set_title(name)
    for ax in axes:
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if ax is axes[0] else "fraction")
        ax.grid(alpha=0.3)
        if tenants:
            ax.legend()
    name = result.get("label") or result["backend"]
    fig.suptitle(f"{name} · {result['model_id']} · {result['completed']} requests")
    fig.tight_layout()
    save_figure(fig, path)


def plot_throughput(result: dict[str, Any], path: Path) -> None:
    """Output tokens/s and completed (and failed) requests/s over the run."""
    timeline = result["throughput_timeline"]
    t = np.asarray(timeline["t"]) + timeline["interval_s"] / 2
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.plot(t, timeline["output_tokens_per_s"], color="tab:blue", label="output tokens/s")
    ax.set_xlabel("seconds since the first measured request")
    ax.set_ylabel("output tokens/s", color="tab:blue")
    ax.grid(alpha=0.3)
    requests_ax = ax.twinx()
    requests_ax.plot(t, timeline["completed_per_s"], color="tab:green", label="completed requests/s")
    if any(timeline["failed_per_s"]):
        requests_ax.plot(t, timeline["failed_per_s"], color="tab:red", label="failed requests/s")
    requests_ax.set_ylabel("requests/s")
    lines = ax.get_lines() + requests_ax.get_lines()
    ax.legend(lines, [str(line.get_label()) for line in lines], loc="upper left", fontsize=8)
    fig.suptitle(f"Throughput over time ({timeline['interval_s']:.2g} s bins)")
    fig.tight_layout()
    save_figure(fig, path)


def write_plots(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Both plots into ``out_dir``; their paths."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LoadgenError(f"cannot create {str(out_dir)!r}: {e.strerror or e}") from None
    paths = [out_dir / LATENCY_CDF, out_dir / THROUGHPUT]
    plot_latency_cdfs(result, paths[0])
    plot_throughput(result, paths[1])
    return paths


def save_figure(fig: Any, path: Path) -> None:
    """Writes a figure as PNG and closes it; a path that cannot be written is a LoadgenError."""
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise LoadgenError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
