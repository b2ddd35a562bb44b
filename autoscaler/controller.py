"""`Autoscaler`: the control loop — every interval, read the signals, read the pools, decide
(`autoscaler.policy`), log each decision with its inputs and reason, export it, and (when it actuates)
ask the scaler for the new replica counts. It runs on its own thread: `baton autoscale` as a process of
its own (a Deployment in the chart), or inside `baton up --autoscale` over the local scaler."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from autoscaler.policy import Decision, History, Policy
from autoscaler.scaling import POOLS, PoolState, Scaler, ScalerError
from autoscaler.signals import MetricsSource, Signals

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AutoscalerMetrics:
    """What `baton autoscale` exports on its /metrics (docs/METRICS.md): an HPA or KEDA may act on
    ``baton_autoscaler_desired_replicas`` instead of the autoscaler itself."""

    registry: CollectorRegistry = field(default_factory=lambda: CollectorRegistry(auto_describe=True))
    desired: Gauge = field(init=False)
    current: Gauge = field(init=False)
    ready: Gauge = field(init=False)
    decisions: Counter = field(init=False)
    scale_errors: Counter = field(init=False)
    signal: Gauge = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.desired = Gauge(
            "baton_autoscaler_desired_replicas",
            "Replicas the policy wants for a pool (stabilised and within bounds).",
            ["pool"],
            registry=r,
        )
        self.current = Gauge(
            "baton_autoscaler_current_replicas",
            "Replicas asked for a pool now (its spec).",
            ["pool"],
            registry=r,
        )
        self.ready = Gauge(
            "baton_autoscaler_ready_replicas", "A pool's replicas ready now.", ["pool"], registry=r
        )
        self.decisions = Counter(
            "baton_autoscaler_decisions",
            "Decisions by pool, direction (up, down, hold) and reason.",
            ["pool", "direction", "reason"],
            registry=r,
        )
        self.scale_errors = Counter(
            "baton_autoscaler_scale_errors", "Pool reads or changes the scaler refused.", ["pool"], registry=r
        )
        self.signal = Gauge(
            "baton_autoscaler_signal",
            "The inputs of the last decision: arrival_rate, refused_rate (requests/s), ttft_p95_seconds, "
            "itl_p95_seconds, queue_depth, decode_kv_usage, prefill_queued_tokens.",
            ["name"],
            registry=r,
        )

    def observe(self, signals: Signals | None, decisions: list[Decision]) -> None:
        for d in decisions:
            self.desired.labels(d.pool).set(d.desired)
            self.current.labels(d.pool).set(d.current)
            self.ready.labels(d.pool).set(d.ready)
            self.decisions.labels(d.pool, d.direction, str(d.reason)).inc()
        if signals is None:
            return
        values = {
            "arrival_rate": signals.arrival_rate,
            "refused_rate": signals.refused_rate,
            "ttft_p95_seconds": signals.ttft_p95_s,
            "itl_p95_seconds": signals.itl_p95_s,
            "queue_depth": float(signals.queue_depth),
            "decode_kv_usage": signals.decode.kv_usage,
            "prefill_queued_tokens": float(signals.prefill.queued_tokens),
        }
        for name, value in values.items():
            if value is not None:
                self.signal.labels(name).set(value)


class Autoscaler:
    """Reads, decides and acts, one `step` per interval. ``scaler`` None: the pools are what the
    scheduler sees registered, and nothing is changed (the desired replicas are only exported)."""

    def __init__(
        self,
        source: MetricsSource,
        policy: Policy,
        scaler: Scaler | None,
        actuate: bool = True,
        metrics: AutoscalerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_decision: Callable[[Decision], object] | None = None,
    ) -> None:
        self.source = source
        self.policy = policy
        self.scaler = scaler
        self.actuate = actuate and scaler is not None
        self.metrics = metrics or AutoscalerMetrics()
        self.clock = clock
        self.on_decision = on_decision  # hears every decision that changes a pool (baton up prints them)
        self.history = History()
        self.last: list[Decision] = []

    def pools(self, signals: Signals | None) -> dict[str, PoolState]:
        if self.scaler is None:  # what is registered is what there is
            if signals is None:
                return {}
            return {p: PoolState(signals.pool(p).workers, signals.pool(p).workers, 0) for p in POOLS}
        states = {}
        for pool in POOLS:
            try:
                states[pool] = self.scaler.state(pool)
            except ScalerError as e:
                self.metrics.scale_errors.labels(pool).inc()
                log.warning("cannot read the %s pool: %s", pool, e)
        return states

    def step(self) -> list[Decision]:
        try:
            signals: Signals | None = self.source.read()
        except Exception:  # a bug reading the metrics must not end the loop: decide on nothing
            log.exception("reading the signals failed")
            signals = None
        decisions, self.history = self.policy.decide(self.clock(), signals, self.pools(signals), self.history)
        self.metrics.observe(signals, decisions)
        for d in decisions:
            changing = d.desired != d.current
            log.log(logging.INFO if changing else logging.DEBUG, "decision: %s", d.describe())
            if not changing:
                continue
            if self.on_decision is not None:
                self.on_decision(d)
            if self.actuate and self.scaler is not None:
                try:
                    self.scaler.scale(d.pool, d.desired)
                except ScalerError as e:
                    self.metrics.scale_errors.labels(d.pool).inc()
                    log.warning("cannot scale %s to %d: %s", d.pool, d.desired, e)
        self.last = decisions
        return decisions

    def run(self, interval_s: float, stop: threading.Event) -> None:
        """Steps every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            started = self.clock()
            self.step()
            stop.wait(max(0.0, interval_s - (self.clock() - started)))
