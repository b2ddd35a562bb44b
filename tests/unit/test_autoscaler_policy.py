"""`autoscaler.policy` and `autoscaler.controller` without a cluster: the policy is a pure function of
the time, the signals, the pools and its history, so its properties are checked directly — bounds,
monotonicity in load, no oscillation under a steady load, the N − 1 check before a scale-down, no
scale-up while replicas are pending, nothing done on missing signals, the stabilisation windows and
step caps — and the controller is driven over an in-memory scaler."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.config import PolicyConfig
from autoscaler.controller import Autoscaler
from autoscaler.policy import UP_REASONS, History, ReactivePolicy, Reason
from autoscaler.scaling import PoolState, ScalerError
from autoscaler.signals import PoolSignals, Signals

pytestmark = pytest.mark.unit

CONFIG = PolicyConfig(
    ttft_slo_ms=250, itl_slo_ms=30, min_decode=1, max_decode=6, min_prefill=1, max_prefill=4,
    scale_up_window_s=10, scale_down_window_s=60, max_step_up=2, max_step_down=1,
)  # fmt: skip


def signals(
    itl_ms: float | None = 10.0,
    ttft_ms: float | None = 100.0,
    kv: float = 0.2,
    running: int = 4,
    waiting: int = 0,
    queued: int = 0,
    depth: int = 0,
    prefill_queue: int = 0,
    arrivals: float = 2.0,
    refused: float = 0.0,
    workers: int = 1,
) -> Signals:
    blocks = 1000 * workers
    return Signals(
        window_s=30,
        arrival_rate=arrivals,
        refused_rate=refused,
        completed=int(arrivals * 30),
        ttft_p95_s=None if ttft_ms is None else ttft_ms / 1e3,
        itl_p95_s=None if itl_ms is None else itl_ms / 1e3,
        queue_depth=depth + prefill_queue,
        queue_for_prefill=prefill_queue,
        queue_for_decode=depth,
        prefill=PoolSignals(workers=1, queued_tokens=queued, kv_blocks=500, kv_blocks_free=500),
        decode=PoolSignals(
            workers=workers,
            running=running,
            waiting=waiting,
            kv_blocks=blocks,
            kv_blocks_free=int(blocks * (1 - kv)),
        ),
    )


def pools(decode: int = 1, prefill: int = 1, pending: int = 0) -> dict[str, PoolState]:
    return {"prefill": PoolState(prefill, prefill, 0), "decode": PoolState(decode, decode - pending, pending)}


def decode_decision(
    policy: ReactivePolicy, now: float, s: Signals | None, p: dict[str, PoolState], h: History
):
    decisions, h = policy.decide(now, s, p, h)
    return next(d for d in decisions if d.pool == "decode"), h


def test_an_itl_breach_grows_decode_once_it_has_held_for_the_up_window() -> None:
    policy, h = ReactivePolicy(CONFIG), History()
    d, h = decode_decision(policy, 0, signals(itl_ms=10), pools(1), h)
    assert d.desired == 1 and d.reason is Reason.STEADY
    d, h = decode_decision(policy, 5, signals(itl_ms=45), pools(1), h)
    assert d.recommended == 2 and d.reason is Reason.ITL_SLO and d.desired == 1  # t=0 said 1: not yet
    d, h = decode_decision(policy, 11, signals(itl_ms=45), pools(1), h)
    assert d.desired == 2 and d.direction == "up" and "ITL p95 45.0 ms > 30 ms" in d.detail


def test_a_big_breach_is_capped_by_the_step_and_the_maximum() -> None:
    policy = ReactivePolicy(CONFIG)
    d, _ = decode_decision(policy, 0, signals(itl_ms=300), pools(1), History())
    assert d.recommended == 10 and d.desired == 1 + CONFIG.max_step_up
    d, _ = decode_decision(policy, 0, signals(itl_ms=300), pools(5), History())
    assert d.desired == CONFIG.max_decode


def test_kv_pressure_and_waiting_requests_grow_decode_too() -> None:
    policy = ReactivePolicy(CONFIG)
    assert decode_decision(policy, 0, signals(kv=0.95), pools(2), History())[0].reason is Reason.KV_PRESSURE
    assert (
        decode_decision(policy, 0, signals(waiting=3), pools(2), History())[0].reason is Reason.DECODE_QUEUE
    )
    assert decode_decision(policy, 0, signals(depth=4), pools(2), History())[0].reason is Reason.DECODE_QUEUE
    # Requests waiting in the scheduler's queue for a prefill worker are prefill's to fix, not decode's.
    waits = signals(prefill_queue=4, ttft_ms=900, queued=10 * CONFIG.queue_tokens_high)
    decisions, _ = policy.decide(0, waits, pools(2), History())
    by_pool = {d.pool: d for d in decisions}
    assert by_pool["decode"].direction != "up" and by_pool["prefill"].reason is Reason.PREFILL_BACKLOG
    # Refusals alone (a tenant's quota refuses too) grow nothing, but no pool shrinks while they come.
    refusing = signals(itl_ms=5, kv=0.05, refused=0.5, workers=2)
    assert decode_decision(policy, 0, refusing, pools(2), History())[0].reason is Reason.STEADY


def test_a_ttft_breach_grows_prefill_only_with_a_prefill_backlog() -> None:
    policy = ReactivePolicy(CONFIG)
    decisions, _ = policy.decide(
        0, signals(ttft_ms=900, queued=CONFIG.queue_tokens_high), pools(1), History()
    )
    prefill = next(d for d in decisions if d.pool == "prefill")
    assert prefill.reason is Reason.TTFT_SLO and prefill.desired >= 2
    decisions, _ = policy.decide(0, signals(ttft_ms=900, queued=0), pools(1), History())
    assert next(d for d in decisions if d.pool == "prefill").direction == "hold"
    decisions, _ = policy.decide(0, signals(ttft_ms=900, prefill_queue=3), pools(1), History())
    assert next(d for d in decisions if d.pool == "prefill").reason is Reason.TTFT_SLO


def test_no_scale_up_while_replicas_are_pending() -> None:
    policy = ReactivePolicy(CONFIG)
    d, _ = decode_decision(policy, 0, signals(itl_ms=90), pools(2, pending=1), History())
    assert d.reason is Reason.PENDING and d.desired == 2 and "ITL p95" in d.detail


def test_missing_signals_change_nothing() -> None:
    policy = ReactivePolicy(CONFIG)
    for s in (None, replace(signals(itl_ms=90), sources_down=("http://gw/metrics",))):
        d, _ = decode_decision(policy, 0, s, pools(3), History())
        assert d.reason is Reason.NO_SIGNAL and d.desired == 3


def test_scale_down_checks_the_pool_with_one_replica_fewer() -> None:
    """The 2 ↔ 1 oscillation: at 2 replicas ITL p95 is 20 ms (under the 30 ms target), but the same load
    on 1 replica would be ~40 ms. A planner that checks only the present removes one and adds it back."""
    policy = ReactivePolicy(CONFIG)
    d, _ = decode_decision(policy, 0, signals(itl_ms=20, workers=2), pools(2), History())
    assert d.reason is Reason.STEADY and d.desired == 2 and "at 1: ITL p95 ~40.0 ms" in d.detail
    d, _ = decode_decision(policy, 0, signals(itl_ms=8, kv=0.1, workers=2), pools(2), History())
    assert d.reason is Reason.UNDERUSED and d.desired == 1
    d, _ = decode_decision(policy, 0, signals(itl_ms=8, kv=0.5, workers=2), pools(2), History())
    assert d.reason is Reason.STEADY, "KV usage 0.5 on two replicas is 1.0 on one"


def test_scale_down_waits_for_the_down_window_and_goes_one_at_a_time() -> None:
    policy, h = ReactivePolicy(CONFIG), History()
    d, h = decode_decision(policy, 0, signals(itl_ms=40), pools(4), h)  # recently it needed more
    idle = signals(itl_ms=None, ttft_ms=None, running=0, arrivals=0.0)
    for t in (10, 30, 59):
        d, h = decode_decision(policy, t, idle, pools(4), h)
        assert d.reason is Reason.IDLE and d.desired == 4, t
    d, h = decode_decision(policy, 61, idle, pools(4), h)
    assert d.desired == 3 and d.direction == "down"


@settings(max_examples=200, deadline=None)
@given(
    itl=st.one_of(st.none(), st.floats(1, 500)),
    ttft=st.one_of(st.none(), st.floats(1, 5000)),
    kv=st.floats(0, 1),
    waiting=st.integers(0, 50),
    queued=st.integers(0, 100_000),
    depth=st.integers(0, 50),
    decode=st.integers(0, 10),
    prefill=st.integers(0, 10),
    pending=st.integers(0, 3),
)
def test_the_decision_stays_within_bounds_and_steps(
    itl: float | None,
    ttft: float | None,
    kv: float,
    waiting: int,
    queued: int,
    depth: int,
    decode: int,
    prefill: int,
    pending: int,
) -> None:
    policy = ReactivePolicy(CONFIG)
    s = signals(itl_ms=itl, ttft_ms=ttft, kv=kv, waiting=waiting, queued=queued, depth=depth)
    p = pools(decode, prefill, min(pending, decode))
    decisions, _ = policy.decide(0, s, p, History())
    for d in decisions:
        low, high = policy.bounds(d.pool)
        assert low <= d.desired <= high
        if low <= d.current <= high:
            assert d.current - CONFIG.max_step_down <= d.desired <= d.current + CONFIG.max_step_up
        if d.desired > d.current and low <= d.current:
            assert d.reason in UP_REASONS and not p[d.pool].pending


@settings(max_examples=200, deadline=None)
@given(
    itl=st.floats(1, 200),
    more_itl=st.floats(0, 200),
    kv=st.floats(0, 0.99),
    more_kv=st.floats(0, 0.5),
    waiting=st.integers(0, 5),
    n=st.integers(1, 6),
)
def test_more_decode_load_never_asks_for_fewer_replicas(
    itl: float, more_itl: float, kv: float, more_kv: float, waiting: int, n: int
) -> None:
    policy = ReactivePolicy(CONFIG)
    light = signals(itl_ms=itl, kv=kv, waiting=waiting, workers=n)
    heavy = signals(itl_ms=itl + more_itl, kv=min(1.0, kv + more_kv), waiting=waiting + 1, workers=n)
    rec = policy.recommend("decode", light, PoolState(n, n, 0))
    assert policy.recommend("decode", heavy, PoolState(n, n, 0)).replicas >= rec.replicas


@settings(max_examples=100, deadline=None)
@given(itl=st.floats(1, 200), kv=st.floats(0, 0.99), n=st.integers(1, 6))
def test_a_steady_load_never_oscillates(itl: float, kv: float, n: int) -> None:
    """The load per replica follows the replicas (the same total load spread over more or fewer), as
    the real signals would: the replica count may move one way to its level, never back."""
    policy, h, current = ReactivePolicy(CONFIG), History(), n
    itl_total, kv_total = itl * n, kv * n  # ITL and KV usage per replica scale as 1 / replicas
    seen = [current]
    for t in range(0, 600, 5):
        s = signals(itl_ms=itl_total / current, kv=min(1.0, kv_total / current), workers=current)
        d, h = decode_decision(policy, t, s, pools(current), h)
        current = d.desired
        seen.append(current)
    moves = [b - a for a, b in zip(seen, seen[1:], strict=False) if b != a]
    assert all(m > 0 for m in moves) or all(m < 0 for m in moves), seen


class MemoryScaler:
    """An in-memory `Scaler`: pools that become ready when told."""

    def __init__(self, decode: int = 1, prefill: int = 1) -> None:
        self.desired = {"decode": decode, "prefill": prefill}
        self.ready = dict(self.desired)
        self.calls: list[tuple[str, int]] = []
        self.refuse = False

    def state(self, pool: str) -> PoolState:
        return PoolState(self.desired[pool], self.ready[pool], max(0, self.desired[pool] - self.ready[pool]))

    def scale(self, pool: str, replicas: int) -> None:
        if self.refuse:
            raise ScalerError("forbidden")
        self.calls.append((pool, replicas))
        self.desired[pool] = replicas

    def close(self) -> None:
        """Nothing to close."""


class FixedSource:
    def __init__(self, s: Signals) -> None:
        self.signals = s

    def read(self) -> Signals:
        return self.signals


def test_the_controller_scales_exports_and_survives_a_refusal() -> None:
    t = [0.0]
    scaler = MemoryScaler()
    source = FixedSource(signals(itl_ms=80))
    loop = Autoscaler(
        source, ReactivePolicy(replace(CONFIG, scale_up_window_s=0)), scaler, clock=lambda: t[0]
    )  # type: ignore[arg-type]
    loop.step()
    assert scaler.calls == [("decode", 3)]  # 80 ms on one replica: ~3 wanted, +2 at most
    registry = loop.metrics.registry
    assert registry.get_sample_value("baton_autoscaler_desired_replicas", {"pool": "decode"}) == 3
    assert registry.get_sample_value("baton_autoscaler_signal", {"name": "itl_p95_seconds"}) == pytest.approx(
        0.08
    )
    t[0] = 5
    loop.step()  # the new replicas are pending: no second scale-up
    assert scaler.calls == [("decode", 3)]
    assert registry.get_sample_value(
        "baton_autoscaler_decisions_total", {"pool": "decode", "direction": "hold", "reason": "pending"}
    )
    scaler.ready["decode"] = 3
    scaler.refuse = True
    source.signals = signals(itl_ms=200, workers=3)
    t[0] = 10
    loop.step()  # asks for more, is refused: counted, logged, and the loop goes on
    assert registry.get_sample_value("baton_autoscaler_scale_errors_total", {"pool": "decode"}) == 1


def test_without_a_scaler_it_only_advises() -> None:
    loop = Autoscaler(FixedSource(signals(itl_ms=80, workers=2)), ReactivePolicy(CONFIG), None)  # type: ignore[arg-type]
    (prefill, decode) = loop.step()
    assert (decode.current, decode.desired) == (2, 4) and not loop.actuate
    assert (
        loop.metrics.registry.get_sample_value("baton_autoscaler_desired_replicas", {"pool": "decode"}) == 4
    )


def test_a_pool_is_not_shrunk_below_the_capacity_it_queued_at() -> None:
    """Requests queued for decode when one replica held 5: the policy remembers it. With two replicas
    and 8 streams nothing queues and latency is fine — but one replica would have to hold 8, past the 5
    it queued at, so it stays at two (scaling down would only bring the queue back: N ↔ N − 1)."""
    policy = ReactivePolicy(CONFIG)
    lagging = signals(running=2, waiting=1, depth=3, workers=1)  # a heartbeat behind: reads low
    d, h = decode_decision(policy, 0, lagging, pools(1), History())
    assert d.reason is Reason.DECODE_QUEUE and h.saturated_at("decode") == 3
    saturated = signals(running=4, waiting=1, depth=3, workers=1)
    d, h = decode_decision(policy, 1, saturated, pools(1), h)
    assert h.saturated_at("decode") == 5 and len(h.saturation) == 1  # the highest reading is kept
    busy = signals(itl_ms=5, kv=0.05, running=8, workers=2)
    d, h = decode_decision(policy, 100, busy, pools(2), h)
    assert d.reason is Reason.STEADY and "8.0 requests each (it queued at 5.0)" in d.detail
    light = signals(itl_ms=5, kv=0.05, running=2, workers=2)
    d, h = decode_decision(policy, 200, light, pools(2), h)
    assert d.reason is Reason.UNDERUSED and d.desired == 1


def test_the_n_minus_1_latency_is_read_off_what_was_seen_once_there_is_enough() -> None:
    """ITL p95 20 ms on two replicas with 2 streams: in proportion one replica would be at 40 ms (over
    0.7 × 30 ms), so with nothing seen yet the pool stays. Once decode latency was seen flat from 1 to 4
    requests per replica (a memory-bound step), one replica is projected at ~20 ms, and it shrinks."""
    policy = ReactivePolicy(CONFIG)
    two = signals(itl_ms=20, kv=0.05, running=2, workers=2)
    d, _ = decode_decision(policy, 0, two, pools(2), History())
    assert d.reason is Reason.STEADY and "ITL p95 ~40.0 ms" in d.detail
    seen = History(itl_points=((0, 1.0, 0.0195), (1, 2.0, 0.020), (2, 4.0, 0.0205)))
    assert seen.itl_at(2.0) == pytest.approx(0.020, abs=2e-4)
    d, h = decode_decision(policy, 3, two, pools(2), seen)
    assert d.reason is Reason.UNDERUSED and "ITL p95 ~20.0 ms" in d.detail
    assert h.itl_points[-1] == (3, 1.0, 0.020)  # what it saw now joins the points
    # A steep line is read as steep: 10 ms more per request in the batch.
    steep = History(itl_points=((0, 1.0, 0.010), (1, 2.0, 0.020), (2, 3.0, 0.030)))
    d, _ = decode_decision(policy, 3, two, pools(2), steep)
    assert d.reason is Reason.STEADY
