"""A worker's Prometheus metrics (docs/METRICS.md lists each with its type, unit and labels).

They live in a `WorkerMetrics` of its own per worker, with its identity (model, version, role, worker) as
labels; the engine's state is counted in plain ints on the engine thread and read into a `WorkerStats`
only when scraped, so the step loop never calls prometheus-client.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rpc.metrics import LATENCY_BUCKETS, SEGMENT_BUCKETS


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
    kv_transfer_refused: int = 0


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
        leases = CounterMetricFamily(
            "baton_worker_leases_ended",
            "KV leases this prefill worker ended, by how (released by the decode worker, expired, aborted).",
            labels=[*self.names, "outcome"],
        )
        for outcome, n in (
            ("released", s.leases_released),
            ("expired", s.leases_expired),
            ("aborted", s.leases_aborted),
        ):
            leases.add_metric([*self.values, outcome], n)
        return [
            g("baton_worker_requests_running", "Requests in the running batch.", s.num_running),
            g(
                "baton_worker_requests_waiting",
                "Requests waiting for blocks or a batch slot (preempted included).",
                s.num_waiting,
            ),
            g(
                "baton_worker_transfers_in_flight",
                "KV pulls in flight on this (decode) worker.",
                s.num_transfers,
            ),
            g("baton_worker_kv_blocks", "KV cache blocks in total.", s.num_blocks),
            g(
                "baton_worker_kv_blocks_free",
                "KV blocks an allocation may take now (free or cached, unreferenced).",
                s.num_free_blocks,
            ),
            g(
                "baton_worker_kv_blocks_used",
                "KV blocks referenced by requests or pinned.",
                s.num_blocks - s.num_free_blocks,
            ),
            g(
                "baton_worker_kv_blocks_pinned",
                "KV blocks pinned for a peer's pull (leases) or a cancelled pull.",
                s.num_pinned_blocks,
            ),
            g(
                "baton_worker_leases_held",
                "KV leases this prefill worker holds for decode workers.",
                s.num_leases,
            ),
            leases,
            c(
                "baton_worker_kv_transfer_refused",
                "Connections to this worker's KV transfer port dropped: no or a wrong credential, a "
                "malformed frame, or a read outside its lease.",
                s.kv_transfer_refused,
            ),
            c(
                "baton_worker_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.prefix_query_tokens,
            ),
            c(
                "baton_worker_prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                s.prefix_hit_tokens,
            ),
            c(
                "baton_worker_prefix_cache_evictions",
                "Cached blocks evicted to make room.",
                s.prefix_evictions,
            ),
            c(
                "baton_worker_preemptions",
                "Requests preempted (blocks freed, recomputed later) under memory pressure.",
                s.preemptions,
            ),
            c("baton_worker_steps", "Engine steps run.", s.steps),
            c(
                "baton_worker_scheduled_tokens",
                "Tokens run through the model (prompt chunks and decodes).",
                s.scheduled_tokens,
            ),
            c("baton_worker_sampled_tokens", "Tokens sampled.", s.sampled_tokens),
            c(
                "baton_worker_slow_reader_aborts",
                "Requests ended because their reader fell behind (--max-pending-outputs).",
                s.slow_reader_aborts,
            ),
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
            "baton_worker_requests",
            "Prefill and Decode calls that ended, by rpc (prefill, decode) and outcome "
            "(ok, cancelled, or the error's gRPC code).",
            [*names, "rpc", "outcome"],
            registry=r,
        )
        self.queue = Histogram(
            "baton_worker_queue_seconds",
            "Added to the engine -> first scheduled (requests this worker "
            "prefills; a handed-off decode joins the batch directly).",
            names,
            buckets=SEGMENT_BUCKETS,
            registry=r,
        ).labels(*ident)
        self.prefill = Histogram(
            "baton_worker_prefill_seconds",
            "First scheduled -> first token (the prompt's forward passes).",
            names,
            buckets=SEGMENT_BUCKETS,
            registry=r,
        ).labels(*ident)
        self.decode = Histogram(
            "baton_worker_decode_seconds",
            "Completed decodes: this worker's first token -> its last.",
            names,
            buckets=LATENCY_BUCKETS,
            registry=r,
        ).labels(*ident)
        self.transfer = Histogram(
            "baton_worker_kv_transfer_seconds",
            "KV pulls from a peer (prefill worker): started -> landed.",
            [*names, "peer"],
            buckets=SEGMENT_BUCKETS,
            registry=r,
        )
        self.transfer_bytes = Counter(
            "baton_worker_kv_transfer_bytes",
            "KV bytes pulled from a peer (blocks the local prefix cache lacked).",
            [*names, "peer"],
            registry=r,
        )
        self.transfer_failures = Counter(
            "baton_worker_kv_transfer_failures",
            "KV handoffs from a peer that failed (metadata, pull, timeout).",
            [*names, "peer"],
            registry=r,
        )
        self.aborts = Counter(
            "baton_worker_aborts",
            "Requests aborted here (a cancelled call, Abort, the cancellation bus).",
            names,
            registry=r,
        ).labels(*ident)
        self.fenced = Counter(
            "baton_worker_fenced",
            "Times this worker was fenced: its registration lapsed (stopped, starved) and the registry "
            "refused its heartbeat, so calls placed on that registration are refused.",
            names,
            registry=r,
        ).labels(*ident)
        self.abort_seconds = Histogram(
            "baton_worker_abort_seconds",
            "Abort asked -> the request dropped and its blocks back in the pool "
            "(a cancelled pull's blocks drain later, not counted).",
            names,
            buckets=SEGMENT_BUCKETS,
            registry=r,
        ).labels(*ident)
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
