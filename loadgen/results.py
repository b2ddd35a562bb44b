"""From request records to the result: vLLM `bench serve` metrics and JSON field names, Baton extras,
and the console table.

Definitions (vLLM's `benchmark_serving.py` / `vllm bench serve`), over successful requests:
TTFT = send → first output chunk; TPOT = (E2EL − TTFT) / (output_tokens − 1), per request with more than
one output token; ITL = every gap between successive output chunks, all requests pooled; E2EL = send →
end of stream. Throughputs divide by the run's duration: first measured send → last measured end.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.record import RequestRecord

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)
_SEGMENTS = ("queue_ms", "prefill_ms", "transfer_ms", "decode_ms", "ttft_ms", "e2e_ms")


def parse_slo(text: str) -> dict[str, float]:
    """``ttft:MS,itl:MS,...`` → {metric: ms}; metrics ttft, tpot, itl, e2el (``e2e`` is accepted)."""
    slo: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition(":")
        name = "e2el" if name == "e2e" else name
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or name not in SLO_METRICS or not ms > 0 or math.isinf(ms):
            raise ValueError(
                f"expected METRIC:MS with METRIC in {', '.join(SLO_METRICS)} and MS > 0, got {item!r}"
            )
        slo[name] = ms
    if not slo:
        raise ValueError("expected at least one METRIC:MS")
    return slo


def parse_percentiles(text: str) -> tuple[float, ...]:
    """``50,90,95,99`` → (50.0, 90.0, 95.0, 99.0); each in (0, 100]."""
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"expected percentiles in (0, 100], got {text!r}")
    return tuple(sorted(set(values)))


def percentile_word(p: float) -> str:
    """vLLM's key spelling: 99 → "99", 99.9 → "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def output_len(record: RequestRecord) -> int:
    """The server's count when it gave one, else the tokens seen in chunks (one per HTTP chunk)."""
    return record.output_tokens if record.output_tokens is not None else sum(record.chunk_tokens)


def input_len(record: RequestRecord) -> int:
    """The server's prompt count (chat templates included) when it gave one, else the workload's."""
    return record.server_prompt_tokens if record.server_prompt_tokens is not None else record.prompt_len


def tpot(record: RequestRecord) -> float | None:
    """(E2EL − TTFT) / (output tokens − 1), seconds; None with one output token or fewer."""
    n = output_len(record)
    return (record.latency - record.ttft) / (n - 1) if n > 1 else None


def summary(values_ms: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean, median, std (population, as numpy) and pXX (numpy's linear interpolation); 0.0 for none."""
    ms = np.asarray(values_ms, dtype=float)
    empty = ms.size == 0
    out = {
        "mean": 0.0 if empty else float(np.mean(ms)),
        "median": 0.0 if empty else float(np.median(ms)),
        "std": 0.0 if empty else float(np.std(ms)),
    }
    for p in percentiles:
        out[f"p{percentile_word(p)}"] = 0.0 if empty else float(np.percentile(ms, p))
    return out


def stats(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """`summary` of seconds, as milliseconds under vLLM's keys: mean_ttft_ms, median_ttft_ms, std_ttft_ms,
    p99_ttft_ms, ..."""
    values = summary([v * 1000.0 for v in values_s], percentiles)
    return {f"{stat}_{name}_ms": value for stat, value in values.items()}


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (ms): TTFT, TPOT (0 for one token, as vLLM), E2EL,
    and ITL meaning every one of its gaps."""
    checks = {
        "ttft": record.ttft,
        "tpot": tpot(record) or 0.0,
        "itl": max(record.itl, default=0.0),
        "e2el": record.latency,
    }
    return all(checks[name] * 1000.0 <= limit for name, limit in slo.items())


@dataclass(frozen=True, slots=True)
class RunInfo:
    """What the result says about the run besides the measurements."""

    date: str
    backend: str
    model_id: str
    tokenizer_id: str | None
    request_rate: float
    burstiness: float | None
    max_concurrency: int | None
    label: str | None = None
    target: str = ""
    endpoint: str = "completions"
    num_warmup: int = 0
    settings: dict[str, Any] | None = None


def build_result(
    records: Sequence[RequestRecord],
    info: RunInfo,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    slo: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The result JSON of the measured (non-warm-up) records."""
    records = sorted((r for r in records if not r.warmup), key=lambda r: r.index)
    ok = [r for r in records if r.ok]
    t0 = min((r.start for r in records), default=0.0)
    duration = max((r.end or r.start for r in records), default=0.0) - t0
    total_input, total_output = sum(input_len(r) for r in ok), sum(output_len(r) for r in ok)
    good = sum(meets_slo(r, slo) for r in ok) if slo else 0

    def per_s(value: float) -> float:
        return value / duration if duration > 0 else 0.0

    result: dict[str, Any] = {
        "date": info.date,
        "backend": info.backend,
        "label": info.label,
        "model_id": info.model_id,
        "tokenizer_id": info.tokenizer_id,
        "num_prompts": len(records),
        "request_rate": info.request_rate if math.isfinite(info.request_rate) else "inf",
        "burstiness": info.burstiness,
        "max_concurrency": info.max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good) if slo else None,
        "output_throughput": per_s(total_output),
        "total_token_throughput": per_s(total_input + total_output),
        "max_output_tokens_per_s": _peak_tokens_per_s(ok, t0),
        "max_concurrent_requests": _peak_concurrency(records),
    }
    result |= stats("ttft", [r.ttft for r in ok], percentiles)
    result |= stats("tpot", [t for r in ok if (t := tpot(r)) is not None], percentiles)
    result |= stats("itl", [gap for r in ok for gap in r.itl], percentiles)
    result |= stats("e2el", [r.latency for r in ok], percentiles)
    result |= {
        "input_lens": [input_len(r) for r in records],
        "output_lens": [output_len(r) if r.ok else 0 for r in records],
        "ttfts": [r.ttft if r.ok else 0.0 for r in records],
        "itls": [r.itl if r.ok else [] for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    result |= _extras(records, ok, info, t0, duration, percentiles, slo)
    return result


def _extras(
    records: Sequence[RequestRecord],
    ok: Sequence[RequestRecord],
    info: RunInfo,
    t0: float,
    duration: float,
    percentiles: Sequence[float],
    slo: dict[str, float] | None,
) -> dict[str, Any]:
    """loadgen's keys beyond vLLM's (none of them is a vLLM name)."""
    extras: dict[str, Any] = {
        "e2els": [r.latency if r.ok else 0.0 for r in records],
        "start_times": [r.start - t0 for r in records],
        "errors_by_kind": dict(sorted(Counter(r.error_kind for r in records if not r.ok).items())),
        "throughput_timeline": throughput_timeline(records, t0, duration),
        "loadgen": {
            "target": info.target,
            "endpoint": info.endpoint,
            "num_warmup": info.num_warmup,
            "percentiles": list(percentiles),
            "slo_ms": slo,
            **(info.settings or {}),
        },
    }
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    if cached:
        extras["total_cached_tokens"] = sum(cached)
    timed = [r for r in ok if r.server_timings]
    if timed:
        extras["baton_segments"] = {
            name: summary([r.server_timings[name] for r in timed if r.server_timings], percentiles)
            for name in _SEGMENTS
        }
        gaps = [r.ttft * 1000.0 - r.server_timings["ttft_ms"] for r in timed if r.server_timings]
        extras["baton_segments"]["client_minus_server_ttft_ms"] = summary(gaps, percentiles)
    if any(r.tenant for r in records):
        extras["tenants"] = [r.tenant for r in records]
        extras["per_tenant"] = {
            name: _tenant_summary([r for r in records if r.tenant == name], percentiles)
            for name in sorted({r.tenant for r in records if r.tenant})
        }
    return extras


def _tenant_summary(records: Sequence[RequestRecord], percentiles: Sequence[float]) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_output_tokens": sum(output_len(r) for r in ok),
    }
    summary |= stats("ttft", [r.ttft for r in ok], percentiles)
    summary |= stats("e2el", [r.latency for r in ok], percentiles)
    summary["mean_itl_ms"] = stats("itl", [g for r in ok for g in r.itl], ())["mean_itl_ms"]
    return summary


def _peak_tokens_per_s(ok: Sequence[RequestRecord], t0: float) -> float:
    """vLLM's peak output throughput: the most output tokens that arrived within one whole second."""
    per_second: Counter[int] = Counter()
    for r in ok:
        for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True):
            per_second[int(t - t0)] += n
    return float(max(per_second.values(), default=0))


def _peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once."""
    events = sorted(
        [(r.start, 1) for r in records] + [(r.end or r.start, -1) for r in records],
        key=lambda e: (e[0], e[1]),
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def throughput_timeline(records: Sequence[RequestRecord], t0: float, duration: float) -> dict[str, Any]:
    """Output tokens/s, completed and failed requests/s in equal bins (1 s, finer for runs under 20 s)."""
    interval = 1.0 if duration >= 20 else max(0.05, duration / 20)
    bins = max(1, math.ceil(duration / interval)) if duration > 0 else 1
    tokens, completed, failed = [0] * bins, [0] * bins, [0] * bins

    def slot(t: float) -> int:
        return min(bins - 1, max(0, int((t - t0) / interval)))

    for r in records:
        if r.ok:
            for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True):
                tokens[slot(t)] += n
        (completed if r.ok else failed)[slot(r.end or r.start)] += 1
    return {
        "interval_s": interval,
        "t": [round(i * interval, 6) for i in range(bins)],
        "output_tokens_per_s": [n / interval for n in tokens],
        "completed_per_s": [n / interval for n in completed],
        "failed_per_s": [n / interval for n in failed],
    }
