"""The console table of a result (laid out like vLLM's `bench serve` summary) and the JSON file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.results import percentile_word
from loadgen.workload import LoadgenError

_WIDTH = 50
_LATENCIES = (
    ("ttft", "Time to First Token", "TTFT"),
    ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
    ("itl", "Inter-token Latency", "ITL"),
    ("e2el", "End-to-end Latency", "E2EL"),
)


def _row(name: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name:<40} {text:<10}"


def _rule(title: str, fill: str = "-") -> str:
    return f"{title:{fill}^{_WIDTH}}"


def format_table(result: dict[str, Any], percentiles: Sequence[float]) -> str:
    """The summary a person reads after a run."""
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _row("Backend:", result["backend"]),
        _row("Model:", result["model_id"]),
        _row("Successful requests:", result["completed"]),
        _row("Failed requests:", result["failed"]),
        _row("Benchmark duration (s):", result["duration"]),
        _row("Total input tokens:", result["total_input_tokens"]),
        _row("Total generated tokens:", result["total_output_tokens"]),
        _row("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result["request_goodput"] is not None:
        lines.append(_row("Request goodput (req/s):", result["request_goodput"]))
    lines += [
        _row("Output token throughput (tok/s):", result["output_throughput"]),
        _row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]),
        _row("Peak concurrent requests:", result["max_concurrent_requests"]),
        _row("Total token throughput (tok/s):", result["total_token_throughput"]),
    ]
    for key, title, short in _LATENCIES:
        lines.append(_rule(f" {title} "))
        lines.append(_row(f"Mean {short} (ms):", result[f"mean_{key}_ms"]))
        lines.append(_row(f"Median {short} (ms):", result[f"median_{key}_ms"]))
        lines += [
            _row(f"P{percentile_word(p)} {short} (ms):", result[f"p{percentile_word(p)}_{key}_ms"])
            for p in percentiles
        ]
    segments = result.get("baton_segments")
    if segments:
        top = f"p{percentile_word(max(percentiles))}"
        lines.append(_rule(f" Baton segments, ms: mean / {top} "))
        lines += [f"{name:<40} {values['mean']:.2f} / {values[top]:.2f}" for name, values in segments.items()]
    if result["errors_by_kind"]:
        lines.append(_rule(" Errors by kind "))
        lines += [_row(f"{kind}:", count) for kind, count in result["errors_by_kind"].items()]
    for tenant, summary in (result.get("per_tenant") or {}).items():
        lines.append(_rule(f" Tenant {tenant} "))
        lines.append(_row("Successful / failed requests:", f"{summary['completed']} / {summary['failed']}"))
        lines.append(
            _row(
                "Mean / median TTFT (ms):", f"{summary['mean_ttft_ms']:.2f} / {summary['median_ttft_ms']:.2f}"
            )
        )
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    """Writes the result; LoadgenError when the file cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    except OSError as e:
        raise LoadgenError(f"cannot write {str(path)!r}: {e.strerror or e}") from None


def read_json(path: Path) -> dict[str, Any]:
    """A result file written by `loadgen run` (or vLLM's `bench serve`); LoadgenError if it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise LoadgenError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadgenError(f"{str(path)!r} is not a JSON result file: {e}") from None
    if not isinstance(data, dict) or "completed" not in data:
        raise LoadgenError(f"{str(path)!r} is not a benchmark result (no 'completed' field)")
    return data
