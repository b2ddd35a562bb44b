"""The gateway's and the workers' Prometheus metrics, defined in one place (docs/METRICS.md lists each
with its type, unit and labels).

The gateway's live in their own registry (`REGISTRY`), not prometheus-client's global one, so that its
``/metrics`` shows exactly Baton's series and several gateways in one test process share them without
double registration. A worker's live in a `WorkerMetrics` of its own, with its identity (model,
version, role, worker) as labels; the engine's state is counted in plain ints on the engine thread and
read into a `WorkerStats` only when scraped, so the step loop never calls prometheus-client.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series (as vLLM)
REGISTRY = CollectorRegistry(auto_describe=True)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Segments and waits that are often far below a step (a queue that is empty, a client that keeps up).
SEGMENT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)

_REQUEST = ["model", "version", "tenant"]  # the labels of a gateway request's metrics
_SEGMENT = ["model", "version"]

# --------------------------------------------------------------------------- gateway: requests

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
IN_FLIGHT = Gauge("baton_gateway_requests_in_flight", "Requests accepted and not yet ended.", registry=REGISTRY)
TTFT = Histogram(
    "baton_gateway_ttft_seconds", "Completed requests: accepted -> first token handed to the client's stream.",
    _REQUEST, buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
E2E = Histogram(
    "baton_gateway_e2e_seconds", "Completed requests: accepted -> final message.",
    _REQUEST, buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
ITL = Histogram(
    "baton_gateway_itl_seconds",
    "Inter-token latency: the gap between two successive token deliveries to a client's stream (one per "
    "streamed message after the first).",
    _SEGMENT, buckets=ITL_BUCKETS, registry=REGISTRY,
)
QUEUE = Histogram(
    "baton_gateway_queue_seconds",
    "Completed requests: accepted -> the first worker call (validation, tokenization, placement and any "
    "wait in the scheduler's fair queue).",
    _SEGMENT, buckets=SEGMENT_BUCKETS, registry=REGISTRY,
)
PREFILL = Histogram(
    "baton_gateway_prefill_seconds",
    "Completed requests: prefill as the workers measured it (the worker's own queue included).",
    _SEGMENT, buckets=SEGMENT_BUCKETS, registry=REGISTRY,
)
TRANSFER = Histogram(
    "baton_gateway_transfer_seconds",
    "Completed requests: the KV pull on the decode worker (0 when prefilled there).",
    _SEGMENT, buckets=SEGMENT_BUCKETS, registry=REGISTRY,
)
DECODE = Histogram(
    "baton_gateway_decode_seconds",
    "Completed requests: the decode worker's first token -> its last token.",
    _SEGMENT, buckets=SEGMENT_BUCKETS, registry=REGISTRY,
)
CLIENT_WAIT = Histogram(
    "baton_gateway_client_wait_seconds",
    "Per request: how long output that was ready waited for the client to take it (a slow reader).",
    ["model"], buckets=SEGMENT_BUCKETS, registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "baton_gateway_prompt_tokens",
    "Prompt tokens of the requests placed on a worker (completed, cancelled or failed), by tenant.",
    _REQUEST, registry=REGISTRY,
)
GENERATION_TOKENS = Counter(
    "baton_gateway_generation_tokens",
    "Tokens generated for clients (the usage a completed request reports; a cancelled one: what it was sent).",
    _REQUEST, registry=REGISTRY,
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
    SHADOW_PAIR, registry=REGISTRY,
)
SHADOW_TOP1_AGREED = Counter(
    "baton_gateway_shadow_top1_agreed",
    "Of the compared positions, those where primary and shadow put the same token first "
    "(top-1 agreement = this / baton_gateway_shadow_positions_total).",
    SHADOW_PAIR, registry=REGISTRY,
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
    "baton_gateway_shadow_ttft_seconds", "Shadow request started -> its first token (local prefill included).",
    SHADOW_PAIR, buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
SHADOW_ITL = Histogram(
    "baton_gateway_shadow_itl_seconds", "A shadow request's mean gap between tokens (first to last).",
    SHADOW_PAIR, buckets=LATENCY_BUCKETS, registry=REGISTRY,
)
SHADOW_E2E = Histogram(
    "baton_gateway_shadow_e2e_seconds", "Shadow request started -> its last token.",
    SHADOW_PAIR, buckets=LATENCY_BUCKETS, registry=REGISTRY,
)


def render() -> tuple[bytes, str]:
    """The gateway's exposition text and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST


def sample_sum(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of a sample over every series whose labels include ``labels`` (tests and tools: a metric's
    total whatever its other labels)."""
    total = 0.0
    for family in registry.collect():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# --------------------------------------------------------------------------- workers

@dataclass(slots=True)
class WorkerStats:
    """A worker's engine state, read on its engine thread when scraped. Counters are monotonic."""

    num_running: int = 0
    num_waiting: int = 0
    num_transfers: int = 0  # KV pulls in flight
    num_blocks: int = 0
    num_free_blocks: int = 0  # free or evictable (cached, unreferenced)
    num_pinned_blocks: int = 0  # held for a peer (leases) or for a cancelled pull to settle
    num_leases: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_evictions: int = 0
    preemptions: int = 0
    steps: int = 0
    scheduled_tokens: int = 0
    sampled_tokens: int = 0
    slow_reader_aborts: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    leases_aborted: int = 0


class _WorkerStatsCollector(Collector):
    """The scrape-time gauges and counters of one worker, from its last `WorkerStats`."""

    def __init__(self, label_names: list[str], label_values: list[str]) -> None:
        self.names = label_names
        self.values = label_values
        self.stats = WorkerStats()

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self.names)
        g.add_metric(self.values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self.names)
        c.add_metric(self.values, value)
        return c

    def collect(self) -> Iterable[Metric]:
        s, g, c = self.stats, self._gauge, self._counter
        leases = CounterMetricFamily("baton_worker_leases_ended",
                                     "KV leases this prefill worker ended, by how (released by the decode "
                                     "worker, expired, aborted).", labels=[*self.names, "outcome"])
        for outcome, n in (("released", s.leases_released), ("expired", s.leases_expired),
                           ("aborted", s.leases_aborted)):
            leases.add_metric([*self.values, outcome], n)
        return [
            g("baton_worker_requests_running", "Requests in the running batch.", s.num_running),
            g("baton_worker_requests_waiting", "Requests waiting for blocks or a batch slot (preempted included).",
              s.num_waiting),
            g("baton_worker_transfers_in_flight", "KV pulls in flight on this (decode) worker.", s.num_transfers),
            g("baton_worker_kv_blocks", "KV cache blocks in total.", s.num_blocks),
            g("baton_worker_kv_blocks_free", "KV blocks an allocation may take now (free or cached, unreferenced).",
              s.num_free_blocks),
            g("baton_worker_kv_blocks_used", "KV blocks referenced by requests or pinned.",
              s.num_blocks - s.num_free_blocks),
            g("baton_worker_kv_blocks_pinned", "KV blocks pinned for a peer's pull (leases) or a cancelled pull.",
              s.num_pinned_blocks),
            g("baton_worker_leases_held", "KV leases this prefill worker holds for decode workers.", s.num_leases),
            leases,
            c("baton_worker_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
              s.prefix_query_tokens),
            c("baton_worker_prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hit_tokens),
            c("baton_worker_prefix_cache_evictions", "Cached blocks evicted to make room.", s.prefix_evictions),
            c("baton_worker_preemptions", "Requests preempted (blocks freed, recomputed later) under memory "
              "pressure.", s.preemptions),
            c("baton_worker_steps", "Engine steps run.", s.steps),
            c("baton_worker_scheduled_tokens", "Tokens run through the model (prompt chunks and decodes).",
              s.scheduled_tokens),
            c("baton_worker_sampled_tokens", "Tokens sampled.", s.sampled_tokens),
            c("baton_worker_slow_reader_aborts", "Requests ended because their reader fell behind "
              "(--max-pending-outputs).", s.slow_reader_aborts),
        ]


class WorkerMetrics:
    """One worker's metrics, in a registry of its own, every series labelled with its identity."""

    LABELS = ["model", "version", "role", "worker"]

    def __init__(self, model: str, version: str, role: str, worker: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ident = [model, version, role, worker]
        names, r = self.LABELS, self.registry
        self._ident = ident
        self.requests = Counter(
            "baton_worker_requests", "Prefill and Decode calls that ended, by rpc (prefill, decode) and outcome "
            "(ok, cancelled, or the error's gRPC code).", [*names, "rpc", "outcome"], registry=r)
        self.queue = Histogram(
            "baton_worker_queue_seconds", "Added to the engine -> first scheduled (requests this worker "
            "prefills; a handed-off decode joins the batch directly).", names, buckets=SEGMENT_BUCKETS,
            registry=r).labels(*ident)
        self.prefill = Histogram(
            "baton_worker_prefill_seconds", "First scheduled -> first token (the prompt's forward passes).",
            names, buckets=SEGMENT_BUCKETS, registry=r).labels(*ident)
        self.decode = Histogram(
            "baton_worker_decode_seconds", "Completed decodes: this worker's first token -> its last.",
            names, buckets=LATENCY_BUCKETS, registry=r).labels(*ident)
        self.transfer = Histogram(
            "baton_worker_kv_transfer_seconds", "KV pulls from a peer (prefill worker): started -> landed.",
            [*names, "peer"], buckets=SEGMENT_BUCKETS, registry=r)
        self.transfer_bytes = Counter(
            "baton_worker_kv_transfer_bytes", "KV bytes pulled from a peer (blocks the local prefix cache lacked).",
            [*names, "peer"], registry=r)
        self.transfer_failures = Counter(
            "baton_worker_kv_transfer_failures", "KV handoffs from a peer that failed (metadata, pull, timeout).",
            [*names, "peer"], registry=r)
        self.aborts = Counter(
            "baton_worker_aborts", "Requests aborted here (a cancelled call, Abort, the cancellation bus).",
            names, registry=r).labels(*ident)
        self.abort_seconds = Histogram(
            "baton_worker_abort_seconds", "Abort asked -> the request dropped and its blocks back in the pool "
            "(a cancelled pull's blocks drain later, not counted).", names, buckets=SEGMENT_BUCKETS,
            registry=r).labels(*ident)
        self.engine = _WorkerStatsCollector(names, ident)
        r.register(self.engine)

    def request_ended(self, rpc: str, outcome: str) -> None:
        self.requests.labels(*self._ident, rpc, outcome).inc()

    def transfer_landed(self, peer: str, seconds: float, num_bytes: int) -> None:
        self.transfer.labels(*self._ident, peer).observe(seconds)
        self.transfer_bytes.labels(*self._ident, peer).inc(num_bytes)

    def transfer_failed(self, peer: str) -> None:
        self.transfer_failures.labels(*self._ident, peer).inc()

    def aborted(self, seconds: float) -> None:
        """Engine thread (once per abort, not per step): the request is gone and its blocks free."""
        self.aborts.inc()
        self.abort_seconds.observe(seconds)
