"""loadgen.results and loadgen.report on hand-made timelines: TTFT, TPOT, ITL, E2EL, goodput and
throughputs by vLLM's definitions, vLLM's JSON field names, the Baton extras, and the console table."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadgen.record import RequestRecord
from loadgen.report import format_table
from loadgen.results import RunInfo, build_result, meets_slo, parse_percentiles, parse_slo, tpot

pytestmark = pytest.mark.unit

INFO = RunInfo(
    date="20250101-000000",
    backend="openai",
    model_id="m",
    tokenizer_id=None,
    request_rate=4.0,
    burstiness=1.0,
    max_concurrency=None,
)
# Every field vLLM's `bench serve` writes for these options (the per-percentile ones follow the choice).
VLLM_FIELDS = {
    "date",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
    *(
        f"{stat}_{metric}_ms"
        for stat in ("mean", "median", "std", "p50", "p99", "p99.9")
        for metric in ("ttft", "tpot", "itl", "e2el")
    ),
}


def _record(
    index: int,
    start: float,
    chunks: list[float],
    end: float,
    tokens: int | None = None,
    error: str = "",
    kind: str = "",
    warmup: bool = False,
    **kw: object,
) -> RequestRecord:
    r = RequestRecord(
        index,
        prompt_len=10,
        max_tokens=8,
        warmup=warmup,
        start=start,
        end=end,
        chunk_times=chunks,
        chunk_tokens=[1] * len(chunks),
        generated_text="x" * len(chunks),
        output_tokens=tokens,
        error=error,
        error_kind=kind,
    )
    for name, value in kw.items():
        setattr(r, name, value)
    return r


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        # TTFT 100 ms, gaps 50 and 100 ms, E2EL 300 ms, 3 tokens: TPOT (300 - 100) / 2 = 100 ms
        _record(0, 0.00, [0.10, 0.15, 0.25], 0.30, tokens=3),
        # TTFT 200 ms, one token: no TPOT, no gap; its count comes from its one chunk
        _record(1, 0.05, [0.25], 0.25),
        _record(2, 0.10, [], 0.20, error="HTTP 500: boom", kind="http:500"),
        _record(3, 0.20, [0.30, 0.40], 0.40, error="HTTP 429: slow down", kind="http:429"),
        _record(9, -5.0, [-4.0], -3.0, tokens=1, warmup=True),  # warm-up: left out of everything
    ]


def test_latency_metrics_follow_vllms_definitions(records: list[RequestRecord]) -> None:
    assert records[0].ttft == pytest.approx(0.1) and records[0].itl == pytest.approx([0.05, 0.1])
    assert tpot(records[0]) == pytest.approx(0.1) and tpot(records[1]) is None
    result = build_result(records, INFO, percentiles=(50, 99))
    assert result["num_prompts"] == 4 and (result["completed"], result["failed"]) == (2, 2)
    assert result["duration"] == pytest.approx(0.40), "first measured send → last measured end"
    assert result["mean_ttft_ms"] == pytest.approx(150.0) and result["median_ttft_ms"] == pytest.approx(150.0)
    assert result["std_ttft_ms"] == pytest.approx(50.0), "population std, as numpy"
    assert result["p99_ttft_ms"] == pytest.approx(float(np.percentile([100.0, 200.0], 99)))
    assert result["mean_tpot_ms"] == pytest.approx(100.0), "only requests with more than one token"
    assert result["mean_itl_ms"] == pytest.approx(75.0) and result["p50_itl_ms"] == pytest.approx(75.0)
    assert result["mean_e2el_ms"] == pytest.approx(250.0)
    assert (result["total_input_tokens"], result["total_output_tokens"]) == (20, 4)
    assert result["request_throughput"] == pytest.approx(2 / 0.4)
    assert result["output_throughput"] == pytest.approx(4 / 0.4)
    assert result["total_token_throughput"] == pytest.approx(24 / 0.4)
    assert result["request_goodput"] is None, "no SLO, no goodput (as vLLM)"
    assert result["max_concurrent_requests"] == 3 and result["max_output_tokens_per_s"] == 4.0


def test_per_request_lists_and_errors(records: list[RequestRecord]) -> None:
    result = build_result(records, INFO)
    assert result["input_lens"] == [10, 10, 10, 10] and result["output_lens"] == [3, 1, 0, 0]
    assert result["ttfts"] == pytest.approx([0.1, 0.2, 0.0, 0.0]) and result["itls"][1:] == [[], [], []]
    assert result["errors"] == ["", "", "HTTP 500: boom", "HTTP 429: slow down"]
    assert result["errors_by_kind"] == {"http:429": 1, "http:500": 1}
    assert result["e2els"] == pytest.approx([0.3, 0.2, 0.0, 0.0]) and result["start_times"][0] == 0.0


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        ("ttft:150", 1),
        ("ttft:250", 2),
        ("tpot:99", 1),
        ("tpot:100", 2),
        ("itl:60", 1),
        ("itl:100", 2),
        ("e2e:250", 1),
        ("e2el:300,ttft:100", 1),
        ("ttft:50", 0),
    ],
)
def test_goodput_counts_requests_that_meet_every_slo(
    records: list[RequestRecord], slo: str, good: int
) -> None:
    result = build_result(records, INFO, slo=parse_slo(slo))
    assert result["request_goodput"] == pytest.approx(good / 0.4)
    assert meets_slo(records[1], {"tpot": 1.0}), "one token: TPOT counts as 0, as vLLM does"


def test_field_names_are_vllms_and_the_extras_are_apart(records: list[RequestRecord]) -> None:
    result = build_result(records, INFO, percentiles=(50, 99, 99.9), slo={"ttft": 500.0})
    assert VLLM_FIELDS <= set(result)
    extras = set(result) - VLLM_FIELDS
    assert extras == {"e2els", "start_times", "errors_by_kind", "throughput_timeline", "loadgen"}
    assert "p90_ttft_ms" not in result, "only the chosen percentiles"
    json.dumps(result, allow_nan=False)  # plain JSON


def test_baton_segments_cached_tokens_and_tenants(records: list[RequestRecord]) -> None:
    timings = {
        "queue_ms": 1.0,
        "prefill_ms": 20.0,
        "transfer_ms": 5.0,
        "decode_ms": 150.0,
        "ttft_ms": 90.0,
        "e2e_ms": 290.0,
    }
    records[0].server_timings = timings
    records[1].server_timings = {**timings, "ttft_ms": 190.0}
    records[0].cached_tokens, records[1].cached_tokens = 16, 0
    records[0].tenant, records[1].tenant, records[2].tenant, records[3].tenant = "a", "b", "b", "a"
    result = build_result(records, INFO, percentiles=(99,))
    segments = result["baton_segments"]
    assert segments["ttft_ms"]["mean"] == pytest.approx(140.0) and segments["prefill_ms"]["p99"] == 20.0
    assert segments["client_minus_server_ttft_ms"]["mean"] == pytest.approx(10.0)
    assert result["total_cached_tokens"] == 16
    assert result["tenants"] == ["a", "b", "b", "a"]
    assert result["per_tenant"]["b"]["completed"] == 1 and result["per_tenant"]["b"]["failed"] == 1
    assert result["per_tenant"]["a"]["mean_ttft_ms"] == pytest.approx(100.0)


def test_throughput_timeline_bins_tokens_and_completions(records: list[RequestRecord]) -> None:
    timeline = build_result(records, INFO)["throughput_timeline"]
    interval = timeline["interval_s"]
    assert interval == pytest.approx(0.05) and len(timeline["t"]) == 8
    assert sum(timeline["output_tokens_per_s"]) * interval == pytest.approx(4)
    assert sum(timeline["completed_per_s"]) * interval == pytest.approx(2)
    assert sum(timeline["failed_per_s"]) * interval == pytest.approx(2)


def test_an_empty_run_has_zeros_not_errors() -> None:
    result = build_result([], INFO)
    assert result["completed"] == 0 and result["mean_ttft_ms"] == 0.0 and result["request_throughput"] == 0.0


@pytest.mark.parametrize("bad", ["ttft", "ttft:0", "ttft:x", "latency:5", "", "itl:inf"])
def test_bad_slos_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="expected"):
        parse_slo(bad)


def test_percentiles_parse_and_refuse() -> None:
    assert parse_percentiles("99,50,99.9") == (50.0, 99.0, 99.9)
    for bad in ("0", "101", "x", ""):
        with pytest.raises(ValueError):
            parse_percentiles(bad)


def test_console_table(records: list[RequestRecord]) -> None:
    records[0].server_timings = {
        "queue_ms": 1.0,
        "prefill_ms": 2.0,
        "transfer_ms": 3.0,
        "decode_ms": 4.0,
        "ttft_ms": 5.0,
        "e2e_ms": 6.0,
    }
    table = format_table(build_result(records, INFO, (50, 95), {"ttft": 150.0}), (50, 95))
    for line in (
        "Successful requests:                     2",
        "Failed requests:                         2",
        "Request goodput (req/s):",
        "Mean TTFT (ms):                          150.00",
        "P95 ITL (ms):",
        "Mean TPOT (ms):                          100.00",
        "Baton segments",
        "http:500:",
        "prefill_ms",
    ):
        assert line in table, line
