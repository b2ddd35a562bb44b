"""The autoscaling policy: from `Signals` and the pools' `PoolState`, the replicas each pool should have,
and why. Pure: no clock, no I/O — the time and the history of earlier recommendations are arguments,
the new history a result — so it is tested without a cluster, a clock or a model.

`ReactivePolicy` sizes the prefill and decode pools apart:

* **decode** grows on an inter-token latency p95 over its target, KV cache usage over ``kv_high``, or
  requests waiting for decode capacity (on the workers, or in the scheduler's queue because no decode
  worker had room); **prefill** grows on a backlog of prompt tokens over ``queue_tokens_high`` per
  replica, or a TTFT p95 over its target while prompts wait for it (a backlog, or requests in the
  scheduler's queue because every prefill worker was full). Demand is counted on arrival, refused
  requests included, and a pool with refusals is never shrunk (an autoscaler that reads completions
  only never sees an overload it causes; refusals alone do not grow a pool: a tenant's quota refuses
  too).
* A pool shrinks by one only if, **with one replica fewer**, its projected p95 and KV usage stay under
  ``headroom`` of their targets: the load of N replicas spread over N − 1, latency assumed to grow in
  proportion (an overestimate where a batch step is memory-bound, so a safe one). A replica removed
  must not be the one the next decision adds back (the N ↔ N − 1 oscillation of planners that check
  only the present).
* No pool grows while replicas it asked for are still pending (starting, pulling an image, loading the
  model): they are capacity already on its way.
* **Stabilisation**, as Kubernetes' HPA: a pool grows only to the lowest recommendation of the last
  ``scale_up_window_s`` (the need must hold), shrinks only to the highest of the last
  ``scale_down_window_s`` (every recent decision must agree), by at most ``max_step_up`` /
  ``max_step_down`` replicas a decision, within ``min`` / ``max``.

Another policy (a predictive planner) plugs in through `Policy`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from autoscaler.config import PolicyConfig
from autoscaler.scaling import POOLS, PoolState
from autoscaler.signals import Signals


class Reason(StrEnum):
    """Why a pool should have the replicas recommended (the ``reason`` label of the decisions)."""

    ITL_SLO = "itl_slo"  # inter-token latency p95 over its target
    TTFT_SLO = "ttft_slo"  # time to first token p95 over its target, with a prefill backlog
    KV_PRESSURE = "kv_pressure"  # decode KV cache usage over kv_high
    DECODE_QUEUE = "decode_queue"  # requests waiting for decode capacity
    PREFILL_BACKLOG = "prefill_backlog"  # prompt tokens queued per prefill replica over the limit
    PENDING = "pending"  # replicas asked for are not ready yet: wait for them
    NO_SIGNAL = "no_signal"  # the metrics could not be read: change nothing
    BELOW_MIN = "below_min"  # fewer replicas than the minimum
    ABOVE_MAX = "above_max"  # more replicas than the maximum
    UNDERUSED = "underused"  # one replica fewer would still meet the targets with headroom
    IDLE = "idle"  # no traffic in the window
    STEADY = "steady"  # within targets, and one fewer would not be


UP_REASONS = frozenset(
    {
        Reason.ITL_SLO,
        Reason.TTFT_SLO,
        Reason.KV_PRESSURE,
        Reason.DECODE_QUEUE,
        Reason.PREFILL_BACKLOG,
        Reason.BELOW_MIN,
    }
)


@dataclass(frozen=True, slots=True)
class Recommendation:
    """What the signals alone ask of one pool now (before stabilisation)."""

    replicas: int
    reason: Reason
    detail: str


@dataclass(frozen=True, slots=True)
class Decision:
    """One decision for one pool: the replicas asked for now (``current``), the replicas it should have
    (``desired``, stabilised and capped) and the recommendation behind it."""

    pool: str
    current: int
    ready: int
    desired: int
    recommended: int
    reason: Reason
    detail: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"

    def describe(self) -> str:
        change = f"{self.current} -> {self.desired}" if self.desired != self.current else f"{self.current}"
        return f"{self.pool} {change} ({self.reason}; recommended {self.recommended}): {self.detail}"


@dataclass(frozen=True, slots=True)
class History:
    """What the policy remembers from one decision to the next (given and returned: it stays pure)."""

    recommendations: tuple[tuple[float, str, int], ...] = ()  # (time, pool, replicas), oldest first
    # (time, pool, requests per replica) whenever requests queued for the pool: what a replica held
    # when it was full, which a scale-down must leave room for (a pool that queued at 5 per replica
    # must not be shrunk to hold 8 on one). Heartbeats lag, so one reading may be low: the highest of
    # the last SATURATION_MEMORY_S is the pool's capacity as seen.
    saturation: tuple[tuple[float, str, float], ...] = ()
    # (time, requests per decode replica, ITL p95 s): what decode latency was at what batch, for the
    # N − 1 projection (ITL grows with the batch, but far less than in proportion where a step is
    # memory-bound: projecting in proportion keeps a pool large it could shrink).
    itl_points: tuple[tuple[float, float, float], ...] = ()

    def saturated_at(self, pool: str) -> float | None:
        return max((v for _, p, v in self.saturation if p == pool), default=None)

    def itl_at(self, batch: float) -> float | None:
        """The decode ITL p95 at ``batch`` requests per replica, from a least-squares line through what
        was seen (its slope at least 0); None with fewer than 3 points or batches less than 1 apart."""
        points = [(b, v) for _, b, v in self.itl_points]
        if len(points) < 3 or max(b for b, _ in points) - min(b for b, _ in points) < 1:
            return None
        mean_b = sum(b for b, _ in points) / len(points)
        mean_v = sum(v for _, v in points) / len(points)
        var = sum((b - mean_b) ** 2 for b, _ in points)
        slope = max(0.0, sum((b - mean_b) * (v - mean_v) for b, v in points) / var)
        return mean_v + slope * (batch - mean_b)


SATURATION_MEMORY_S = 1800.0  # how long a pool's capacity as seen is remembered (a config may change)
MAX_ITL_POINTS = 120  # the ITL-vs-batch points the projection fits (the newest)


class Policy(Protocol):
    """Decides every pool's replicas; pure (the time and the history are given and returned)."""

    def decide(
        self, now: float, signals: Signals | None, pools: Mapping[str, PoolState], history: History
    ) -> tuple[list[Decision], History]: ...


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


class ReactivePolicy:
    """Reacts to the present signals (see the module docstring); ``config`` holds the targets."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    def bounds(self, pool: str) -> tuple[int, int]:
        c = self.config
        return (c.min_prefill, c.max_prefill) if pool == "prefill" else (c.min_decode, c.max_decode)

    # --- what the signals ask for --------------------------------------------------------------

    def recommend(
        self, pool: str, signals: Signals | None, state: PoolState, memory: History | None = None
    ) -> Recommendation:
        """What the signals ask of ``pool`` now; ``memory`` (the policy's history) informs the N − 1
        projection: the capacity a replica showed, and decode latency against the batch."""
        low, high = self.bounds(pool)
        n = state.desired
        if n < low:
            return Recommendation(low, Reason.BELOW_MIN, f"{n} replicas, the minimum is {low}")
        if n > high:
            return Recommendation(high, Reason.ABOVE_MAX, f"{n} replicas, the maximum is {high}")
        if signals is None or signals.sources_down:
            down = ", ".join(signals.sources_down) if signals is not None else "all"
            return Recommendation(n, Reason.NO_SIGNAL, f"metrics unreadable: {down}")
        up = self._decode_up(signals, n) if pool == "decode" else self._prefill_up(signals, n)
        if up is not None:
            if state.pending:
                return Recommendation(
                    n, Reason.PENDING, f"{state.pending} replicas not ready yet; {up.detail}"
                )
            return up
        if state.pending:
            return Recommendation(n, Reason.PENDING, f"{state.pending} replicas not ready yet")
        return self._down(pool, signals, n, low, memory or History())

    def _decode_up(self, s: Signals, n: int) -> Recommendation | None:
        """The largest of what each breached target asks for (the binding one names the reason)."""
        c, d = self.config, s.decode
        slo_s = c.itl_slo_ms / 1e3
        need = max(1, n)
        asks = []
        if s.itl_p95_s is not None and s.itl_p95_s > slo_s:
            want = math.ceil(need * s.itl_p95_s / slo_s)
            detail = f"ITL p95 {_ms(s.itl_p95_s)} > {c.itl_slo_ms:g} ms; {d.running} running on {d.workers} workers"
            asks.append(Recommendation(max(want, n + 1), Reason.ITL_SLO, detail))
        if d.kv_blocks and d.kv_usage > c.kv_high:
            want = math.ceil(need * d.kv_usage / c.kv_high)
            detail = f"KV usage {d.kv_usage:.2f} > {c.kv_high:g}"
            asks.append(Recommendation(max(want, n + 1), Reason.KV_PRESSURE, detail))
        if d.waiting or s.queue_for_decode:
            detail = (
                f"{d.waiting} waiting on the decode workers, {s.queue_for_decode} in the scheduler's queue "
                "for want of a decode worker with room"
            )
            asks.append(Recommendation(n + 1, Reason.DECODE_QUEUE, detail))
        return max(asks, key=lambda r: r.replicas, default=None)

    def _prefill_up(self, s: Signals, n: int) -> Recommendation | None:
        c, p = self.config, s.prefill
        per_replica = p.queued_tokens / max(1, n)
        asks = []
        if per_replica > c.queue_tokens_high:
            want = math.ceil(p.queued_tokens / c.queue_tokens_high)
            detail = f"{p.queued_tokens} prompt tokens queued on {n} replicas (> {c.queue_tokens_high} each)"
            asks.append(Recommendation(max(want, n + 1), Reason.PREFILL_BACKLOG, detail))
        slo_s = c.ttft_slo_ms / 1e3
        backlogged = per_replica > c.queue_tokens_high / 4 or s.queue_for_prefill > 0
        if s.ttft_p95_s is not None and s.ttft_p95_s > slo_s and (backlogged or n == 0):
            want = math.ceil(max(1, n) * s.ttft_p95_s / slo_s)
            detail = (
                f"TTFT p95 {_ms(s.ttft_p95_s)} > {c.ttft_slo_ms:g} ms with {p.queued_tokens} prompt tokens "
                f"queued and {s.queue_for_prefill} requests waiting for a prefill worker"
            )
            asks.append(Recommendation(max(want, n + 1), Reason.TTFT_SLO, detail))
        return max(asks, key=lambda r: r.replicas, default=None)

    def _down(self, pool: str, s: Signals, n: int, low: int, memory: History) -> Recommendation:
        """The load of n replicas on n − 1: a replica goes only if the targets still hold with headroom,
        and the requests each would hold stay under ``headroom`` of what a replica held when requests
        last queued for the pool (unknown until they have). Decode ITL at N − 1 is read off the line
        through the ITL-vs-batch points seen (never below today's), or, before there is one, assumed
        to grow in proportion."""
        c = self.config
        if n <= low:
            return Recommendation(n, Reason.STEADY, f"at the minimum ({low})")
        idle = s.arrival_rate == 0 and s.completed == 0 and not s.pool(pool).running
        if idle:
            return Recommendation(n - 1, Reason.IDLE, f"no request in the last {s.window_s:.0f} s")
        grow = n / (n - 1)
        if pool == "decode":
            d = s.decode
            itl = None if s.itl_p95_s is None else s.itl_p95_s * grow  # in proportion: the safe guess
            fitted = memory.itl_at(d.running / (n - 1))
            if s.itl_p95_s is not None and fitted is not None:
                itl = max(s.itl_p95_s, fitted)  # the line through what was seen, never below now
            kv = d.kv_usage * grow
            fits = (
                (itl is None or itl <= c.headroom * c.itl_slo_ms / 1e3)
                and kv <= c.headroom * c.kv_high
                and not d.waiting
                and not s.queue_for_decode
                and not s.refused_rate
            )
            detail = f"at {n - 1}: ITL p95 ~{_ms(itl)} (target {c.itl_slo_ms:g} ms), KV usage ~{kv:.2f}"
        else:
            p = s.prefill
            ttft = None if s.ttft_p95_s is None else s.ttft_p95_s * grow
            per_replica = p.queued_tokens / (n - 1)
            fits = (
                (ttft is None or ttft <= c.headroom * c.ttft_slo_ms / 1e3)
                and per_replica <= c.headroom * c.queue_tokens_high / 4
                and not s.queue_for_prefill
                and not s.refused_rate
            )
            detail = f"at {n - 1}: TTFT p95 ~{_ms(ttft)} (target {c.ttft_slo_ms:g} ms), {per_replica:.0f} tokens queued each"
        load = s.pool(pool)
        held = (load.running + load.waiting) / (n - 1)
        saturated_at = memory.saturated_at(pool)
        if saturated_at is not None:
            fits = fits and held <= c.headroom * saturated_at
            detail += f", {held:.1f} requests each (it queued at {saturated_at:.1f})"
        if fits:
            return Recommendation(n - 1, Reason.UNDERUSED, detail)
        return Recommendation(n, Reason.STEADY, detail)

    # --- stabilised -------------------------------------------------------------------------------

    def decide(
        self, now: float, signals: Signals | None, pools: Mapping[str, PoolState], history: History
    ) -> tuple[list[Decision], History]:
        c = self.config
        horizon = now - max(c.scale_up_window_s, c.scale_down_window_s)
        kept = [h for h in history.recommendations if h[0] >= horizon]
        saturation = [s for s in history.saturation if s[0] >= now - SATURATION_MEMORY_S]
        itl_points = [p for p in history.itl_points if p[0] >= now - SATURATION_MEMORY_S][-MAX_ITL_POINTS:]
        if signals is not None and not signals.sources_down and signals.itl_p95_s is not None:
            d = signals.decode
            if d.workers and d.running:
                itl_points = [
                    *itl_points[1 - MAX_ITL_POINTS :],
                    (now, d.running / d.workers, signals.itl_p95_s),
                ]
        decisions = []
        for pool in POOLS:
            state = pools.get(pool)
            if state is None:
                continue
            if signals is not None and not signals.sources_down:
                load = signals.pool(pool)
                queued = signals.queue_for_decode if pool == "decode" else signals.queue_for_prefill
                if (queued or load.waiting) and load.workers:
                    held = (load.running + load.waiting) / load.workers
                    # An older, lower reading can never be the highest again: drop it (the list stays short).
                    saturation = [s for s in saturation if s[1] != pool or s[2] > held]
                    saturation.append((now, pool, held))
            memory = History((), tuple(saturation), tuple(itl_points))
            rec = self.recommend(pool, signals, state, memory)
            kept.append((now, pool, rec.replicas))
            mine = [(t, r) for t, p, r in kept if p == pool]
            n, low, high = state.desired, *self.bounds(pool)
            desired = n
            if rec.reason in (Reason.BELOW_MIN, Reason.ABOVE_MAX):
                desired = rec.replicas  # out of bounds: no window to wait for
            else:
                floor = min(r for t, r in mine if t >= now - c.scale_up_window_s)
                ceiling = max(r for t, r in mine if t >= now - c.scale_down_window_s)
                if floor > n:
                    desired = min(floor, n + c.max_step_up)
                elif ceiling < n:
                    desired = max(ceiling, n - c.max_step_down)
            desired = max(low, min(high, desired))
            decisions.append(Decision(pool, n, state.ready, desired, rec.replicas, rec.reason, rec.detail))
        return decisions, History(tuple(kept), tuple(saturation), tuple(itl_points))
