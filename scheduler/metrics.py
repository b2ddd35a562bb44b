"""The scheduler's own metrics (docs/METRICS.md); the plumbing every process shares is `rpc.metrics`.

The scheduler's request metrics are module globals in `REGISTRY` (``scheduler.placing`` observes them
through `record_place` and `record_queue_wait`); the cluster state a replica reads from Redis at
scrape time (leases, the fair queue, the workers) comes from one `ClusterStateCollector` per server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core.errors import ServingError
from rpc.metrics import NONE, BoundedLabel

log = logging.getLogger(__name__)

disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series (as vLLM)

DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

REGISTRY = CollectorRegistry(auto_describe=True)
TENANTS = BoundedLabel()  # `baton scheduler --metrics-max-tenants` sets its limit

DECISION_SECONDS = Histogram(
    "baton_scheduler_decision_seconds",
    "Place: received -> answered, fair-queue wait included, by outcome (prefill_pool, local_prefill, or the "
    "refusal's gRPC code).",
    ["outcome"],
    buckets=DECISION_BUCKETS,
    registry=REGISTRY,
)
DECISIONS = Counter(
    "baton_scheduler_decisions",
    "Place calls answered, by model, version, tenant and outcome (prefill_pool, local_prefill, or the "
    "refusal's gRPC code: RESOURCE_EXHAUSTED for a quota or a queue timeout, UNAUTHENTICATED, NOT_FOUND, "
    "UNAVAILABLE, CANCELLED when the gateway gave up).",
    ["model", "version", "tenant", "outcome"],
    registry=REGISTRY,
)
QUEUE_WAIT_SECONDS = Histogram(
    "baton_scheduler_queue_wait_seconds",
    "Time a Place waited in the tenant-fair queue for worker capacity (only those that waited), by tenant "
    "and outcome (placed, timeout, abandoned).",
    ["tenant", "outcome"],
    buckets=DECISION_BUCKETS,
    registry=REGISTRY,
)


def place_outcome(placed_with_prefill: bool | None, error: BaseException | None = None) -> str:
    """The ``outcome`` label of one Place: how it placed, or the gRPC code it was refused with."""
    if error is None:
        return "prefill_pool" if placed_with_prefill else "local_prefill"
    if isinstance(error, ServingError):
        return error.grpc_code
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED"
    from redis.exceptions import RedisError

    return "UNAVAILABLE" if isinstance(error, RedisError) else "INTERNAL"


def record_place(
    seconds: float,
    model: str,
    tenant: str = "",
    version: str = "",
    placed_with_prefill: bool | None = None,
    error: BaseException | None = None,
) -> None:
    """One Place answered (``error`` None) or refused: its latency and its outcome."""
    outcome = place_outcome(placed_with_prefill, error)
    DECISION_SECONDS.labels(outcome).observe(seconds)
    DECISIONS.labels(model or NONE, version or NONE, TENANTS(tenant), outcome).inc()


def record_queue_wait(seconds: float, tenant: str, outcome: str) -> None:
    """One Place's wait in the fair queue ended: ``placed``, ``timeout`` or ``abandoned``."""
    QUEUE_WAIT_SECONDS.labels(TENANTS(tenant), outcome).observe(seconds)


@dataclass(slots=True)
class PoolLoad:
    """The summed load of one role's serving workers (draining ones left out), as of their heartbeats."""

    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0
    kv_blocks: int = 0
    kv_blocks_free: int = 0

    def add(
        self, running: int, waiting: int, queued_tokens: int, kv_blocks: int, kv_blocks_free: int
    ) -> None:
        self.running += running
        self.waiting += waiting
        self.queued_tokens += queued_tokens
        self.kv_blocks += kv_blocks
        self.kv_blocks_free += kv_blocks_free


POOL_SERIES = (  # (name, help, PoolLoad field): the load autoscaling reads, one scrape of any replica
    (
        "baton_scheduler_pool_requests_running",
        "Requests in the running batches of a role's serving workers.",
        "running",
    ),
    (
        "baton_scheduler_pool_requests_waiting",
        "Requests waiting for a batch slot or blocks on a role's serving workers.",
        "waiting",
    ),
    (
        "baton_scheduler_pool_queued_tokens",
        "Prompt tokens still to compute on a role's serving workers (queued and part-way prefills).",
        "queued_tokens",
    ),
    ("baton_scheduler_pool_kv_blocks", "KV cache blocks of a role's serving workers, in total.", "kv_blocks"),
    (
        "baton_scheduler_pool_kv_blocks_free",
        "KV cache blocks free (or cached and unreferenced) on a role's serving workers.",
        "kv_blocks_free",
    ),
)


@dataclass(slots=True)
class ClusterState:
    """What a replica reads from Redis at scrape time (cluster-wide: every replica reports the same)."""

    redis_up: bool = False
    leases_active: dict[str, int] = field(default_factory=dict)  # state → leases in it now
    leases_total: dict[str, int] = field(default_factory=dict)  # state → leases that ever entered it
    stranded_blocks: int = 0
    queue_depth: int = 0  # requests in the fair queue, every replica's
    waiting_here: int = 0  # this replica's requests in the fair queue
    waiting_for: dict[str, int] = field(default_factory=dict)  # of those, by the pool that had no room
    workers: dict[tuple[str, str, str, str], int] = field(
        default_factory=dict
    )  # (model, version, role, state)
    pools: dict[str, PoolLoad] = field(default_factory=dict)  # role → its serving workers' load


class ClusterStateCollector(Collector):
    """The scheduler's scrape-time gauges and counters from the last `ClusterState` read."""

    def __init__(self) -> None:
        self.state = ClusterState()

    def collect(self) -> Iterable[Metric]:
        s = self.state
        up = GaugeMetricFamily("baton_scheduler_redis_up", "1 when the last scrape could read Redis, else 0.")
        up.add_metric([], 1.0 if s.redis_up else 0.0)
        here = GaugeMetricFamily(
            "baton_scheduler_queue_waiting", "This replica's Place calls waiting in the queue."
        )
        here.add_metric([], s.waiting_here)
        waiting_for = GaugeMetricFamily(
            "baton_scheduler_queue_waiting_for",
            "This replica's Place calls waiting in the queue, by the pool (prefill, decode) that had no room "
            "at their last look.",
            labels=["pool"],
        )
        for pool, n in sorted(s.waiting_for.items()):
            waiting_for.add_metric([pool], n)
        if not s.redis_up:  # no cluster-wide series rather than zeros that look real
            return [up, here, waiting_for]
        active = GaugeMetricFamily(
            "baton_scheduler_leases_active",
            "KV leases held now (cluster-wide), by state (pinned, pulling).",
            labels=["state"],
        )
        for state in ("pinned", "pulling"):
            active.add_metric([state], s.leases_active.get(state, 0))
        total = CounterMetricFamily(
            "baton_scheduler_leases",
            "KV leases that entered each state since Redis started (cluster-wide): pinned (created), pulling, "
            "released, expired, aborted.",
            labels=["state"],
        )
        for state in ("pinned", "pulling", "released", "expired", "aborted"):
            total.add_metric([state], s.leases_total.get(state, 0))
        stranded = GaugeMetricFamily(
            "baton_scheduler_stranded_blocks",
            "KV blocks of leases past their expiry and not yet reaped (should read 0).",
        )
        stranded.add_metric([], s.stranded_blocks)
        depth = GaugeMetricFamily(
            "baton_scheduler_queue_depth", "Requests waiting in the tenant-fair queue, every replica's."
        )
        depth.add_metric([], s.queue_depth)
        workers = GaugeMetricFamily(
            "baton_scheduler_workers",
            "Live registered workers by model, version, role and state (serving, draining).",
            labels=["model", "version", "role", "state"],
        )
        for key, n in sorted(s.workers.items()):
            workers.add_metric(list(key), n)
        pools = []
        for name, text, attr in POOL_SERIES:
            family = GaugeMetricFamily(name, text + " (cluster)", labels=["role"])
            for role, load in sorted(s.pools.items()):
                family.add_metric([role], getattr(load, attr))
            pools.append(family)
        return [up, active, total, stranded, depth, here, waiting_for, workers, *pools]
