"""The gateway's Prometheus metrics, defined in one place (docs/METRICS.md lists each with its type,
unit and labels).

They live in their own registry (`REGISTRY`), not prometheus-client's global one, so that the gateway's
``/metrics`` shows exactly Baton's series and several gateways in one test process share them without
double registration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from rpc.metrics import LATENCY_BUCKETS, SEGMENT_BUCKETS

if TYPE_CHECKING:
    from services.gateway.job import Job
    from services.gateway.request_stream import Finished

REGISTRY = CollectorRegistry(auto_describe=True)

ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)

_REQUEST = ["model", "version", "tenant"]  # the labels of a gateway request's metrics
_SEGMENT = ["model", "version"]

# --------------------------------------------------------------------------- gateway: requests

AUTH_REFUSED = Counter(
    "baton_gateway_auth_refused",
    "Calls refused for want of a valid API key (--require-api-key), by surface (http, grpc) and reason "
    "(missing, invalid).",
    ["surface", "reason"],
    registry=REGISTRY,
)

ARRIVALS = Counter(
    "baton_gateway_arrivals",
    "Requests received, counted on arrival whatever becomes of them (refused, failed, cancelled or "
    "served): the demand an autoscaler sizes the pools for.",
    ["model", "api"],
    registry=REGISTRY,
)
REQUESTS = Counter(
    "baton_gateway_requests",
    "Requests that ended, by model, version, tenant, API (grpc, http), outcome (ok, cancelled, error) and "
    "code (the gRPC status code: OK, CANCELLED, or the error's).",
    [*_REQUEST, "api", "outcome", "code"],
    registry=REGISTRY,
)
CANCELLATIONS = Counter(
    "baton_gateway_cancellations",
    "Requests cancelled before they finished, by reason (client, cancel_rpc, session, disconnect, "
    "deadline, slow_reader, shutdown).",
    ["reason"],
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "baton_gateway_requests_in_flight", "Requests accepted and not yet ended.", registry=REGISTRY
)
TTFT = Histogram(
    "baton_gateway_ttft_seconds",
    "Completed requests: accepted -> first token handed to the client's stream.",
    _REQUEST,
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
E2E = Histogram(
    "baton_gateway_e2e_seconds",
    "Completed requests: accepted -> final message.",
    _REQUEST,
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "baton_gateway_itl_seconds",
    "Inter-token latency: the gap between two successive token deliveries to a client's stream (one per "
    "streamed message after the first).",
    _SEGMENT,
    buckets=ITL_BUCKETS,
    registry=REGISTRY,
)
QUEUE = Histogram(
    "baton_gateway_queue_seconds",
    "Completed requests: accepted -> the first worker call (validation, tokenization, placement and any "
    "wait in the scheduler's fair queue).",
    _SEGMENT,
    buckets=SEGMENT_BUCKETS,
    registry=REGISTRY,
)
PREFILL = Histogram(
    "baton_gateway_prefill_seconds",
    "Completed requests: prefill as the workers measured it (the worker's own queue included).",
    _SEGMENT,
    buckets=SEGMENT_BUCKETS,
    registry=REGISTRY,
)
TRANSFER = Histogram(
    "baton_gateway_transfer_seconds",
    "Completed requests: the KV pull on the decode worker (0 when prefilled there).",
    _SEGMENT,
    buckets=SEGMENT_BUCKETS,
    registry=REGISTRY,
)
DECODE = Histogram(
    "baton_gateway_decode_seconds",
    "Completed requests: the decode worker's first token -> its last token.",
    _SEGMENT,
    buckets=SEGMENT_BUCKETS,
    registry=REGISTRY,
)
CLIENT_WAIT = Histogram(
    "baton_gateway_client_wait_seconds",
    "Per request: how long output that was ready waited for the client to take it (a slow reader).",
    ["model"],
    buckets=SEGMENT_BUCKETS,
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "baton_gateway_prompt_tokens",
    "Prompt tokens of the requests placed on a worker (completed, cancelled or failed), by tenant.",
    _REQUEST,
    registry=REGISTRY,
)
GENERATION_TOKENS = Counter(
    "baton_gateway_generation_tokens",
    "Tokens generated for clients (the usage a completed request reports; a cancelled one: what it was sent).",
    _REQUEST,
    registry=REGISTRY,
)
KV_TRANSFER_RETRIES = Counter(
    "baton_gateway_kv_transfer_retries",
    "Decodes retried with a fresh prefill after a failed KV handoff (the pull failed, or D was unreachable).",
    registry=REGISTRY,
)
MIGRATIONS = Counter(
    "baton_gateway_migrations",
    "Decodes moved to another worker mid-stream after their worker failed (the tokens already sent are "
    "recomputed there, not sent again).",
    registry=REGISTRY,
)
WORKER_RETRIES = Counter(
    "baton_gateway_worker_retries",
    "Requests routed again after their worker failed before streaming anything, by stage (prefill, decode).",
    ["stage"],
    registry=REGISTRY,
)

# --------------------------------------------------------------------------- gateway: shadow traffic

SHADOW_REQUESTS = Counter(
    "baton_gateway_shadow_requests",
    "Requests mirrored to a shadow version, by outcome: identical / diverged (the shadow's tokens equal / "
    "differ from the client's), skipped (too many shadows in flight), cancelled (with the primary), "
    "primary_failed, failed (the shadow worker failed), timeout, shutdown.",
    ["outcome"],
    registry=REGISTRY,
)
SHADOW_IN_FLIGHT = Gauge("baton_gateway_shadow_in_flight", "Shadow requests running now.", registry=REGISTRY)
# Per version pair: "version" is the primary's (what clients got), "shadow_version" the candidate's.
SHADOW_PAIR = ["version", "shadow_version"]
SHADOW_AGREEMENT = Histogram(
    "baton_gateway_shadow_agreement",
    "Per shadowed request: the share of token positions where the shadow's output equals the client's "
    "(a position only one reached counts as a disagreement).",
    SHADOW_PAIR,
    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0),
    registry=REGISTRY,
)
SHADOW_POSITIONS = Counter(
    "baton_gateway_shadow_positions",
    "Next-token distributions compared on the shared prefix of primary and shadow outputs.",
    SHADOW_PAIR,
    registry=REGISTRY,
)
SHADOW_TOP1_AGREED = Counter(
    "baton_gateway_shadow_top1_agreed",
    "Of the compared positions, those where primary and shadow put the same token first "
    "(top-1 agreement = this / baton_gateway_shadow_positions_total).",
    SHADOW_PAIR,
    registry=REGISTRY,
)
SHADOW_KL = Histogram(
    "baton_gateway_shadow_kl_nats",
    "Per shadowed request: mean KL(primary || shadow) of the next-token distributions over the shared "
    "prefix, in nats (estimated from both sides' top-20 logprobs).",
    SHADOW_PAIR,
    buckets=(0.0001, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0),
    registry=REGISTRY,
)
SHADOW_TTFT = Histogram(
    "baton_gateway_shadow_ttft_seconds",
    "Shadow request started -> its first token (local prefill included).",
    SHADOW_PAIR,
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SHADOW_ITL = Histogram(
    "baton_gateway_shadow_itl_seconds",
    "A shadow request's mean gap between tokens (first to last).",
    SHADOW_PAIR,
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
SHADOW_E2E = Histogram(
    "baton_gateway_shadow_e2e_seconds",
    "Shadow request started -> its last token.",
    SHADOW_PAIR,
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)


def render() -> tuple[bytes, str]:
    """The gateway's exposition text and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def count_ended(
    labels: tuple[str, str, str],
    api: str,
    outcome: str,
    reason: str,
    finished: Finished | None,
    job: Job | None,
) -> None:
    """The metrics of a request that ended: ``labels`` (model, version, tenant); ``outcome`` ok,
    cancelled (``reason`` says why) or the error's gRPC code; ``job`` only if it was placed on a worker
    (its tokens are counted), ``finished`` only if it completed (its latencies are observed)."""
    model, version, tenant = labels
    if outcome == "ok":
        code = "OK"
    elif outcome == "cancelled":
        code = "DEADLINE_EXCEEDED" if reason == "deadline" else "CANCELLED"
    else:
        outcome, code = "error", outcome
    REQUESTS.labels(model, version, tenant, api, outcome, code).inc()
    if job is None:
        return
    PROMPT_TOKENS.labels(model, version, tenant).inc(len(job.prompt_ids))
    completion = (
        finished.usage.completion_tokens if finished is not None and code == "OK" else len(job.sent_ids)
    )
    GENERATION_TOKENS.labels(model, version, tenant).inc(completion)
    if code != "OK" or finished is None:
        return
    t = finished.timings
    TTFT.labels(model, version, tenant).observe(t.ttft_ms / 1e3)
    E2E.labels(model, version, tenant).observe(t.e2e_ms / 1e3)
    for segment, ms in (
        (QUEUE, t.queue_ms),
        (PREFILL, t.prefill_ms),
        (TRANSFER, t.transfer_ms),
        (DECODE, t.decode_ms),
    ):
        segment.labels(model, version).observe(ms / 1e3)
