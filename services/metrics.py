"""The gateway's Prometheus metrics, defined in one place (issue 6 adds the full set).

They live in their own registry, not prometheus-client's global one, so that `/metrics` shows exactly
Baton's series and several gateways in one test process share them without double registration.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

REQUESTS = Counter(
    "baton_gateway_requests",
    "Requests that ended, by API (grpc, http) and outcome (ok, cancelled, or the error's gRPC code).",
    ["api", "outcome"],
    registry=REGISTRY,
)
CANCELLATIONS = Counter(
    "baton_gateway_cancellations",
    "Requests cancelled before they finished, by reason (client, cancel_rpc, session, disconnect, "
    "deadline, slow_reader, shutdown).",
    ["reason"],
    registry=REGISTRY,
)
IN_FLIGHT = Gauge("baton_gateway_requests_in_flight", "Requests accepted and not yet ended.", registry=REGISTRY)
TTFT = Histogram(
    "baton_gateway_ttft_seconds", "Accepted -> first token handed to the client.",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
E2E = Histogram(
    "baton_gateway_e2e_seconds", "Accepted -> final message.", buckets=_LATENCY_BUCKETS, registry=REGISTRY,
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

SHADOW_REQUESTS = Counter(
    "baton_gateway_shadow_requests",
    "Requests mirrored to a shadow version, by outcome: identical / diverged (the shadow's tokens equal / "
    "differ from the client's), skipped (too many shadows in flight), cancelled (with the primary), "
    "primary_failed, failed (the shadow worker failed), timeout, shutdown.",
    ["outcome"],
    registry=REGISTRY,
)
SHADOW_IN_FLIGHT = Gauge("baton_gateway_shadow_in_flight", "Shadow requests running now.", registry=REGISTRY)
SHADOW_AGREEMENT = Histogram(
    "baton_gateway_shadow_agreement",
    "Per shadowed request: the share of token positions where the shadow's output equals the client's "
    "(a position only one reached counts as a disagreement).",
    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0),
    registry=REGISTRY,
)
SHADOW_TTFT = Histogram(
    "baton_gateway_shadow_ttft_seconds", "Shadow request started -> its first token (local prefill included).",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
SHADOW_E2E = Histogram(
    "baton_gateway_shadow_e2e_seconds", "Shadow request started -> its last token.",
    buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)


def render() -> tuple[bytes, str]:
    """The exposition text and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
