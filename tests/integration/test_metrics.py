"""Every process's /metrics after a short run: `baton up` on the tiny model (Redis, scheduler, prefill
worker, decode worker and gateway as separate processes), a few requests of two tenants over HTTP and
gRPC, one of them cancelled; then each metric documented in docs/METRICS.md is scraped from its
process and its values checked against what the clients saw and against each other."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import (
    ROOT,
    BatonUp,
    Scrape,
    add_tenants,
    eventually,
    http_json,
    loadgen,
    sse_events,
    start_baton_up,
)
from harness import grpc_generate as generate

from baton.v1 import common_pb2, gateway_pb2
from scheduler.tenants import TenantConfig

pytestmark = pytest.mark.integration

ROW = re.compile(r"^\| `(baton_\w+)` \| (\w+) \|")
ACME_KEY = "key-of-acme"
LONG_PROMPT = (
    "Continuous batching keeps accelerators busy while sequences come and go, and the quick brown fox "
    "jumps over the lazy dog near Paris, the capital of France, while Berlin is the capital of Germany."
)
SHORT_PROMPT = "def add(a, b):"
PROCESSES = ("gateway", "scheduler", "prefill", "decode", "autoscaler")  # each serves its own /metrics
ADDED_TENANTS: set[str] = set()  # acme, once the first test added it (a test run alone finds none)


@pytest.fixture(scope="module")
def up(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatonUp]:
    cluster = start_baton_up(
        tmp_path_factory.mktemp("metrics-up"),
        "--model",
        str(tiny_llama),
        "--kv-cache-memory",
        "16MiB",
        "--kv-transport",
        "tcp",
        # an autoscaler held at one replica per pool: it reads, decides and exports, and changes nothing
        *("--autoscale", "--min-decode", "1", "--max-decode", "1", "--max-prefill", "1"),
        timeout_s=180,
        metrics_of=PROCESSES,
    )
    try:
        yield cluster
    finally:
        cluster.shut_down()


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def complete(up: BatonUp, prompt: str, key: str | None, max_tokens: int = 12) -> dict[str, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    status, _, out = http_json(up, "/v1/completions", body, headers=_auth(key))
    assert status == 200, out
    usage: dict[str, int] = out["usage"]
    return usage


def stream(
    up: BatonUp, prompt: str, key: str | None, max_tokens: int, stop_after: int | None = None
) -> dict[str, int]:
    """An SSE completion with usage; with ``stop_after``, the connection closes after that many chunks."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn, events = sse_events(up, "/v1/completions", body, headers=_auth(key))
    usage: dict[str, int] = {}
    chunks = 0
    for chunk in events:
        if chunk == "[DONE]":
            continue
        usage = chunk.get("usage") or usage
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            break
    conn.close()
    return usage


def grpc_generate(up: BatonUp, prompt: str, key: str, max_tokens: int) -> dict[str, int]:
    req = gateway_pb2.GenerateRequest(
        prompt=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )
    _, _, completion = generate(up, req, metadata=(("x-api-key", key),))
    assert completion is not None, "no completion"
    u = completion.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}


def documented() -> dict[str, tuple[str, str]]:
    """Exposed metric name → (family name, type), from docs/METRICS.md's tables."""
    out = {}
    for line in (ROOT / "docs" / "METRICS.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            name, kind = m.groups()
            out[name] = (name.removesuffix("_total") if kind == "counter" else name, kind)
    return out


def wait_idle(up: BatonUp, timeout_s: float = 15.0) -> dict[str, Scrape]:
    """Scrapes until both workers are idle with every block free and no lease held."""
    scrapes: dict[str, Scrape] = {}

    def idle() -> bool:
        scrapes.update({name: Scrape(up.metrics[name]) for name in ("prefill", "decode")})
        return all(
            s.value("baton_worker_kv_blocks_free") == s.value("baton_worker_kv_blocks") > 0
            and s.value("baton_worker_leases_held") == s.value("baton_worker_requests_running") == 0
            and s.value("baton_worker_transfers_in_flight") == 0
            for s in scrapes.values()
        )

    eventually(idle, timeout_s, "the workers did not free every block", interval_s=0.05)
    return scrapes


def wait_gateway_idle(up: BatonUp, timeout_s: float = 10.0) -> Scrape:
    """The gateway counts a cancelled request once its worker aborts have landed."""
    pages: list[Scrape] = []

    def idle() -> bool:
        pages.append(Scrape(up.metrics["gateway"]))
        return pages[-1].value("baton_gateway_requests_in_flight") == 0

    eventually(idle, timeout_s, "requests still in flight at the gateway", interval_s=0.05)
    return pages[-1]


def settled_scheduler(up: BatonUp, handoffs: float, timeout_s: float = 10.0) -> Scrape:
    """The scheduler's page once the gateway's fire-and-forget lease reports have landed (every handoff's
    lease pinned, none still active) and both workers are in placement: the gateway counts a request done
    before its last report reaches the scheduler, and a worker that missed heartbeats on a busy machine
    re-registers. After ``timeout_s`` the page as it is (the test's asserts say what is off)."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = Scrape(up.metrics["scheduler"])
        settled = (
            page.value("baton_scheduler_leases_total", state="pinned") == handoffs
            and page.value("baton_scheduler_leases_active") == 0
            and all(
                page.value("baton_scheduler_workers", role=r, state="serving") == 1
                for r in ("prefill", "decode")
            )
        )
        if settled or time.monotonic() > deadline:
            return page
        time.sleep(0.05)


def test_every_documented_metric_is_scraped_with_values_that_agree(up: BatonUp) -> None:
    add_tenants(up.redis, [TenantConfig("acme")], {ACME_KEY: "acme"})
    ADDED_TENANTS.add("acme")
    # acme: a new long prompt (disaggregated), the same again (a prefix hit), one streamed, one over gRPC.
    acme = [
        complete(up, LONG_PROMPT, ACME_KEY),
        complete(up, LONG_PROMPT, ACME_KEY),
        stream(up, LONG_PROMPT + " again", ACME_KEY, 10),
        grpc_generate(up, LONG_PROMPT + " twice", ACME_KEY, 8),
    ]
    # the default tenant: a short prompt (prefilled on the decode worker) and a long one.
    default = [complete(up, SHORT_PROMPT, None), complete(up, "Paris " + LONG_PROMPT, None, max_tokens=6)]
    cancelled = stream(up, "Berlin " + LONG_PROMPT, None, 200, stop_after=3)
    assert not cancelled, "the cancelled stream got no usage"
    completed = acme + default
    n_completed = len(completed)
    workers = wait_idle(up)
    gateway = wait_gateway_idle(up)
    prefill, decode = workers["prefill"], workers["decode"]
    scheduler = settled_scheduler(
        up, prefill.value("baton_worker_requests_total", rpc="prefill", outcome="ok")
    )

    # Every documented metric is served by its process, with its documented type.
    for name, (family, kind) in documented().items():
        component = name.split("_")[1]
        pages = {
            "gateway": [gateway],
            "scheduler": [scheduler],
            "worker": [prefill, decode],
            "autoscaler": [Scrape(up.metrics["autoscaler"])],
        }[component]
        for page in pages:
            assert family in page.families, f"{name} is documented but not served by the {component}"
            assert page.families[family].type == kind, f"{name}: served as {page.families[family].type}"

    # Gateway: outcomes, per-request histograms of the completed requests, tokens per tenant.
    assert gateway.value("baton_gateway_requests_total", outcome="ok", code="OK") == n_completed
    assert gateway.value("baton_gateway_requests_total", api="grpc") == 1
    assert gateway.value("baton_gateway_requests_total", outcome="cancelled") == 1
    assert gateway.value("baton_gateway_cancellations_total", reason="disconnect") == 1
    assert gateway.value("baton_gateway_requests_in_flight") == 0
    for hist in ("ttft", "e2e", "queue", "prefill", "transfer", "decode"):
        assert gateway.value(f"baton_gateway_{hist}_seconds_count") == n_completed, hist
    e2e = gateway.value("baton_gateway_e2e_seconds_sum")
    segments = sum(
        gateway.value(f"baton_gateway_{s}_seconds_sum") for s in ("queue", "prefill", "transfer", "decode")
    )
    assert 0 < segments <= e2e
    assert 0 < gateway.value("baton_gateway_ttft_seconds_sum") < e2e
    assert gateway.value("baton_gateway_transfer_seconds_sum") > 0, "no request was handed off"
    gaps = sum(u["completion_tokens"] - 1 for u in completed)
    assert gaps <= gateway.value("baton_gateway_itl_seconds_count") <= gaps + 200
    assert gateway.value("baton_gateway_client_wait_seconds_count") == n_completed
    assert gateway.labels("baton_gateway_ttft_seconds_count", "tenant") == {"acme", "default"}
    version = gateway.labels("baton_gateway_ttft_seconds_count", "version").pop()
    assert gateway.value("baton_gateway_prompt_tokens_total", tenant="acme") == sum(
        u["prompt_tokens"] for u in acme
    )
    assert gateway.value("baton_gateway_generation_tokens_total", tenant="acme") == sum(
        u["completion_tokens"] for u in acme
    )
    default_out = sum(u["completion_tokens"] for u in default)
    assert (
        default_out + 2
        <= gateway.value("baton_gateway_generation_tokens_total", tenant="default")
        < default_out + 200
    )
    assert gateway.value("baton_gateway_prompt_tokens_total", tenant="default") > sum(
        u["prompt_tokens"] for u in default
    )

    # Workers: their identity, one handoff per prefill, every block back, the cancel timed.
    assert prefill.labels("baton_worker_kv_blocks", "version") == {version}
    assert prefill.labels("baton_worker_kv_blocks", "role") == {"prefill"}
    handoffs = prefill.value("baton_worker_requests_total", rpc="prefill", outcome="ok")
    assert handoffs >= 2
    assert prefill.value("baton_worker_queue_seconds_count") == prefill.value(
        "baton_worker_prefill_seconds_count"
    )
    assert prefill.value("baton_worker_prefill_seconds_count") == handoffs
    # Each lease ends once. The cancelled request's may end "aborted": the gateway's abort can reach the
    # prefill worker before it has polled the decode worker's release notification.
    released = prefill.value("baton_worker_leases_ended_total", outcome="released")
    aborted = prefill.value("baton_worker_leases_ended_total", outcome="aborted")
    assert released + aborted == handoffs and aborted <= 1, (released, aborted)
    assert prefill.value("baton_worker_leases_ended_total", outcome="expired") == 0
    peers = decode.labels("baton_worker_kv_transfer_bytes_total", "peer")
    assert peers == prefill.labels("baton_worker_kv_blocks", "worker")
    assert decode.value("baton_worker_kv_transfer_seconds_count") == handoffs
    assert decode.value("baton_worker_kv_transfer_bytes_total") > 0
    assert decode.value("baton_worker_kv_transfer_failures_total") == 0
    local = decode.value("baton_worker_prefill_seconds_count")
    assert local >= 1 and local + handoffs == n_completed + 1  # every request prefilled once, the cancel too
    assert decode.value("baton_worker_decode_seconds_count") == n_completed
    assert decode.value("baton_worker_requests_total", rpc="decode", outcome="cancelled") == 1
    assert decode.value("baton_worker_aborts_total") >= 1
    assert decode.value("baton_worker_abort_seconds_count") == decode.value("baton_worker_aborts_total")
    assert decode.value("baton_worker_abort_seconds_sum") < 1.0
    for page in (prefill, decode):
        assert page.value("baton_worker_kv_blocks_used") == page.value("baton_worker_kv_blocks_pinned") == 0
        assert page.value("baton_worker_prefix_cache_hits_total") <= page.value(
            "baton_worker_prefix_cache_queries_total"
        )
        assert page.value("baton_worker_sampled_tokens_total") <= page.value(
            "baton_worker_scheduled_tokens_total"
        )
        assert page.value("baton_worker_steps_total") > 0
        assert (
            page.value("baton_worker_preemptions_total")
            == page.value("baton_worker_slow_reader_aborts_total")
            == 0
        )
    # The repeated prompt hit a prefix cache somewhere.
    assert (
        prefill.value("baton_worker_prefix_cache_hits_total")
        + decode.value("baton_worker_prefix_cache_hits_total")
        > 0
    )

    # Scheduler: the cluster state it reads from Redis.
    assert scheduler.value("baton_scheduler_redis_up") == 1
    assert scheduler.value("baton_scheduler_leases_total", state="pinned") == handoffs
    assert scheduler.value("baton_scheduler_leases_total", state="released") == handoffs
    assert (
        scheduler.value("baton_scheduler_leases_active")
        == scheduler.value("baton_scheduler_stranded_blocks")
        == 0
    )
    assert scheduler.value("baton_scheduler_workers", role="prefill", state="serving") == 1
    assert scheduler.value("baton_scheduler_workers", role="decode", state="serving") == 1
    assert (
        scheduler.value("baton_scheduler_queue_depth")
        == scheduler.value("baton_scheduler_queue_waiting")
        == 0
    )


def test_scheduler_decisions_are_counted_per_tenant(up: BatonUp) -> None:
    """Needs the hooks in scheduler.placing (`metrics.record_place`): one decision per request placed."""
    complete(up, SHORT_PROMPT, ACME_KEY if "acme" in ADDED_TENANTS else None)
    wait_idle(up)
    gateway = wait_gateway_idle(up)
    scheduler = Scrape(up.metrics["scheduler"])
    placed = gateway.value("baton_gateway_requests_total") - gateway.value(
        "baton_gateway_requests_total", tenant="none"
    )
    assert placed > 0
    decisions = scheduler.value("baton_scheduler_decisions_total")
    assert decisions == scheduler.value("baton_scheduler_decision_seconds_count") == placed
    assert scheduler.value("baton_scheduler_decisions_total", outcome="prefill_pool") == scheduler.value(
        "baton_scheduler_leases_total", state="pinned"
    )
    assert scheduler.labels("baton_scheduler_decisions_total", "tenant") >= {"default"}
    assert scheduler.value("baton_scheduler_decision_seconds_sum") < placed * 1.0


def test_loadgen_against_baton_up_writes_its_json_table_and_plots(
    up: BatonUp, tiny_llama: Path, tmp_path: Path
) -> None:
    """`loadgen run` (a real subprocess, as a user runs it) against this `baton up` cluster, over gRPC and
    HTTP: the vLLM-compatible JSON, the console table and the PNG plots; every request the gateway
    counted as a completed TTFT sample is one loadgen completed. (After the metric checks above, which
    count this module's own requests exactly.)"""
    before = wait_gateway_idle(up).value("baton_gateway_ttft_seconds_count")
    for target in (f"grpc://{up.grpc}", up.http):
        out = tmp_path / target.split(":")[0]
        proc = loadgen(
            "run",
            "--target",
            target,
            "--tokenizer",
            str(tiny_llama),
            "--input-len",
            "16:24",
            "--output-len",
            "6",
            "--ignore-eos",
            "--num-requests",
            "6",
            "--arrival",
            "closed",
            "--concurrency",
            "3",
            "--result-file",
            str(out / "result.json"),
            "--plot-dir",
            str(out / "plots"),
            "--no-progress",
        )
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert "Serving Benchmark Result" in proc.stdout and "TTFT" in proc.stdout
        result = json.loads((out / "result.json").read_text())
        assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 36)
        assert {
            "request_throughput",
            "output_throughput",
            "mean_ttft_ms",
            "p99_itl_ms",
            "ttfts",
            "itls",
        } <= set(result)
        for png in ("latency_cdf.png", "throughput.png"):
            assert (out / "plots" / png).read_bytes()[:4] == b"\x89PNG"
    assert wait_gateway_idle(up).value("baton_gateway_ttft_seconds_count") == before + 12
