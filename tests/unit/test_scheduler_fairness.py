"""FairQueue against a real redis-server: token-weighted fairness (VTC), lifting, bounds, timeouts."""

from __future__ import annotations

import random
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_runner import Clock, run

from core.errors import CapacityExceeded
from scheduler.fairness import DEMAND_HALF_LIFE_S, TIE, FairQueue, QueuedRequest
from scheduler.tenants import TenantConfig

pytestmark = pytest.mark.unit

A, B, C = TenantConfig("a"), TenantConfig("b"), TenantConfig("c")


async def serve_while_backlogged(q: FairQueue, tenants: list[TenantConfig]) -> dict[str, int]:
    """Pop while every tenant has requests waiting; tokens served per tenant."""
    served = {t.name: 0 for t in tenants}
    while all([await q.depth(t.name) > 0 for t in tenants]):
        item = await q.pop_next()
        assert item is not None
        served[item.tenant] += item.cost_tokens
    return served


def test_equal_weights_share_tokens_not_requests(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        q, rng = FairQueue(r, clock=Clock()), random.Random(7)
        a, b = TenantConfig("a", max_queue_depth=1000), TenantConfig("b", max_queue_depth=1000)
        max_cost = 100
        # b sends ten times as many requests, and its requests are smaller: per-request fairness would
        # give it far fewer tokens; token fairness gives both the same.
        for i in range(300):
            await q.enqueue(b, f"b{i}", rng.randint(1, max_cost // 2), 60)
            if i % 10 == 0:
                await q.enqueue(a, f"a{i}", rng.randint(max_cost // 2, max_cost), 60)
        served = await serve_while_backlogged(q, [a, b])
        assert served["a"] > 1500 and served["b"] > 1500
        assert abs(served["a"] - served["b"]) <= max_cost
        assert abs(await q.counter("a") - await q.counter("b")) <= max_cost

    run(url, body)


def test_pop_if_next_takes_only_the_request_the_fair_order_puts_first(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = FairQueue(r, clock=Clock())
        for i in range(3):
            await q.enqueue(A, f"a{i}", 50, 60)
        assert await q.pop_if_next("a0")  # a is the only tenant: its oldest goes first
        await q.enqueue(B, "b0", 50, 60)  # b is lifted to (a hair below) a's counter: the tie is b's
        assert not await q.pop_if_next("a1")  # not next: nothing taken
        assert await q.depth() == 3
        assert await q.pop_if_next("b0")
        assert await q.pop_if_next("a1")
        assert await q.pop_if_next("a2")
        assert not await q.pop_if_next("a2") and await q.depth() == 0

    run(url, body)


def test_service_while_nobody_waited_is_no_debt_later(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = FairQueue(r, clock=Clock())
        await q.charge(A, 5000)  # a was admitted a lot while nobody waited
        await q.enqueue(B, "b0", 50, 60)
        await q.enqueue(B, "b1", 50, 60)
        await q.enqueue(A, "a0", 80, 60)  # starts just after b's next request, not 5000 behind it
        await q.enqueue(A, "a1", 80, 60)
        assert await q.counter("a") == pytest.approx(await q.counter("b") + TIE)
        assert [x.request_id for x in [await q.pop_next() for _ in range(4)] if x] == ["b0", "a0", "b1", "a1"]


def test_a_heavy_tenant_that_comes_and_goes_never_overtakes_a_waiting_light_one(url: str) -> None:
    """The flood pattern: the heavy tenant's requests each leave the queue (placed) before its next one
    arrives, so it keeps re-joining while a light tenant's request waits — sometimes just after an
    admission that did not wait, sometimes after a second with nothing of its own waiting (its queue
    empties now and then although it never stops sending). Each time it joins it must line up after
    the light request, keeping a burst's credit of its surplus, not forgiven it; and a light burst goes
    before it."""

    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q = FairQueue(r, clock=clock, burst_credit_tokens=512)
        await q.charge(B, 50_000)  # b, the flood, has had far more service than a
        for i in range(4):
            clock.now += 1.0  # a sends about one request a second
            await q.enqueue(A, f"a{i}", 96, 60)  # a light tenant's request waits alone
            if i % 2 == 0:
                await q.charge(B, 96)  # the flood was admitted without waiting just now...
            await q.enqueue(B, f"b{i}", 96, 60)  # ...or not; either way it joins while a's request waits
            assert await q.counter("b") == pytest.approx(await q.counter("a") + 512)
            assert [(await q.pop_next() or pytest.fail()).request_id for _ in range(2)] == [f"a{i}", f"b{i}"]
        await q.enqueue(B, "b4", 96, 60)  # b waits alone now...
        clock.now += 0.2
        for i in range(4, 8):
            await q.enqueue(A, f"a{i}", 96, 60)  # ...and a light burst arrives
        assert [(await q.pop_next() or pytest.fail()).request_id for _ in range(5)] == [
            "a4",
            "a5",
            "a6",
            "a7",
            "b4",
        ]

    run(url, body)


def test_credit_goes_to_a_tenant_that_asked_for_less_recently_than_the_next_waiter(url: str) -> None:
    """A tenant whose recent demand (tokens it sent, halving every DEMAND_HALF_LIFE_S) is below the next
    waiter's joins up to the whole burst credit below it; one that asked for more recently joins a hair
    below it (plain VTC's lift), even if its counter lags; a tenant that never sent a request has no
    record and no credit."""

    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q = FairQueue(r, clock=clock, burst_credit_tokens=300)
        for i in range(12):
            await q.enqueue(B, f"b{i}", 100, 60)
        for _ in range(10):
            await q.pop_next()  # b: counter 1000, recent demand 1200 (its twelve requests)
        await q.charge(A, 100)  # a was admitted without waiting: counter 100, recent demand 100
        await q.enqueue(A, "a0", 10, 60)
        assert await q.counter("a") == pytest.approx(1000 - 300)  # lifted, less the credit
        await q.remove("a0")
        clock.now += 3 * DEMAND_HALF_LIFE_S  # b's recent demand is 150 now, a's 13.75...
        await q.charge(
            A, 200
        )  # ...and a is admitted for 200: its counter (900) lags b's, its demand does not
        await q.enqueue(A, "a1", 10, 60)
        assert await q.counter("a") == pytest.approx(1000 - TIE)
        await q.enqueue(C, "c0", 10, 60)  # never sent a request: no credit against a, the next waiter
        assert await q.counter("c") == pytest.approx(1000 - 2 * TIE)

    run(url, body)


def test_a_flood_that_just_began_does_not_take_a_light_tenants_turns(url: str) -> None:
    """A light tenant had the cluster to itself (much service, little demand); a flood begins and has
    been served little so far. Demand, not service, decides the credit: the light tenant's next request
    goes after at most the flood's next one, not behind a burst credit's worth of them."""

    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q = FairQueue(r, clock=clock, burst_credit_tokens=512)
        for _ in range(30):  # a: one 80-token request a second for half a minute, each admitted at once
            await q.charge(A, 80)
            clock.now += 1.0
        for i in range(10):  # b: ten requests in half a second
            await q.enqueue(B, f"b{i}", 80, 60)
            clock.now += 0.05
        for _ in range(3):
            await q.pop_next()  # b has been served 240 tokens, a 2400
        await q.enqueue(A, "a0", 80, 60)
        assert [(await q.pop_next() or pytest.fail()).request_id for _ in range(2)] == ["b3", "a0"]

    run(url, body)


def test_light_means_asking_for_less_than_half_of_another_waiting_tenants_demand(url: str) -> None:
    """`is_light`: demand is a rate — a flood a moment old is heavy at once, a light tenant's history
    keeps it light, comparable tenants are not light, and a tenant back after a long silence starts a
    new history."""

    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q = FairQueue(r, clock=clock, burst_credit_tokens=512)
        for _ in range(30):  # a: one 80-token request a second
            await q.charge(A, 80)
            clock.now += 1.0
        assert not await q.is_light("a")  # nobody else asks for anything
        for i in range(3):  # b begins: three requests in 0.3 s (a decayed sum below a's)
            await q.enqueue(B, f"b{i}", 80, 60)
            clock.now += 0.1
        assert await q.is_light("a") and not await q.is_light("b")
        for _ in range(3):
            await q.pop_next()  # b stops waiting: it is compared as the last tenant that left
        assert await q.is_light("a")
        for _ in range(40):  # b keeps asking at the same rate as a for 40 s: neither is light
            await q.charge(A, 80)
            await q.charge(B, 80)
            clock.now += 1.0
        assert not await q.is_light("a") and not await q.is_light("b")
        clock.now += 60.0  # both fall silent; b returns with a burst, a with one request
        await q.charge(A, 80)
        for i in range(3, 6):
            await q.enqueue(B, f"b{i}", 80, 60)
        assert await q.is_light("a") and not await q.is_light("b")

    run(url, body)


def test_a_light_tenants_short_burst_goes_before_a_backlogged_one(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q = FairQueue(r, clock=clock, burst_credit_tokens=200)
        await q.charge(A, 10)  # a was admitted once, then idles
        for i in range(40):
            await q.enqueue(B, f"b{i}", 50, 60)
        for _ in range(20):
            await q.pop_next()  # b was served 1000 tokens while a was idle
        clock.now += 1.0
        for i in range(5):
            await q.enqueue(A, f"a{i}", 50, 60)  # a joins at most 200 tokens below b
        assert await q.counter("a") == pytest.approx(await q.counter("b") - 200)
        order = [x.request_id for x in [await q.pop_next() for _ in range(8)] if x]
        # a's four fit in its credit; at the fifth both counters tie (the name decides); then b's turn
        assert order == ["a0", "a1", "a2", "a3", "a4", "b20", "b21", "b22"]

    run(url, body)


def test_weights_two_to_one_give_two_to_one_shares(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        heavy, light = TenantConfig("heavy", weight=2.0), TenantConfig("light", weight=1.0)
        q = FairQueue(r, clock=Clock())
        for i in range(200):
            await q.enqueue(heavy, f"h{i}", 10, 60)
            await q.enqueue(light, f"l{i}", 10, 60)
        served = {"heavy": 0, "light": 0}
        for _ in range(150):
            item = await q.pop_next()
            assert item is not None
            served[item.tenant] += item.cost_tokens
        assert served == {"heavy": 1000, "light": 500}
        assert await q.counter("heavy") == pytest.approx(await q.counter("light"), abs=10)

    run(url, body)


def test_a_tenant_that_starts_waiting_is_lifted_to_the_minimum(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = FairQueue(r, clock=Clock())
        await q.enqueue(B, "b0", 5, 60)  # b has been served a little, then goes idle
        assert await q.pop_next() == QueuedRequest("b0", "b", 5, 1_000_000.0, 1_000_060.0)
        for i in range(20):
            await q.enqueue(A, f"a{i}", 100, 60)
        # a started waiting when nobody was: it began at the counter of b, the last to leave.
        assert await q.counter("a") == 5.0
        for _ in range(10):
            await q.pop_next()
        assert await q.counter("a") == 1005.0
        # b comes back: without lifting it would win the next ~1000 tokens' worth of turns in a row.
        # It is lifted a hair (TIE) below a, so its first request goes before a's next one.
        await q.enqueue(B, "b1", 100, 60)
        assert await q.counter("b") == pytest.approx(1005.0 - TIE)
        # c is new and lifted too; a is not lowered when others join.
        await q.enqueue(C, "c1", 100, 60)
        assert await q.counter("c") == pytest.approx(1005.0 - 2 * TIE) and await q.counter("a") == 1005.0
        assert [x.tenant for x in [await q.pop_next() for _ in range(4)] if x] == ["c", "b", "a", "a"]
        # With nobody waiting a newcomer starts at the counter of the last tenant that left.
        for _ in range(await q.depth()):  # the 8 still waiting
            assert await q.pop_next() is not None
        last = max([await q.counter(t) for t in "abc"])
        await q.enqueue(TenantConfig("d"), "d1", 1, 60)
        assert await q.counter("d") == last

    run(url, body)


def test_fifo_within_a_tenant_and_charge_corrections(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = FairQueue(r, clock=Clock())
        for i in range(3):
            await q.enqueue(A, f"a{i}", 10, 60)
            await q.enqueue(B, f"b{i}", 10, 60)
        # b joined while a waited, with as much service as a: it starts a hair above a, so a goes first.
        assert [x.request_id for x in [await q.pop_next(), await q.pop_next()] if x] == ["a0", "b0"]
        # a's request stopped early: credit back what it did not use; it is served next.
        assert await q.charge(A, -5) == 5.0
        assert (await q.pop_next() or pytest.fail()).request_id == "a1"
        # b's request ran long: charge the extra; a goes again.
        assert await q.charge(B, 50) == pytest.approx(60.0 + TIE)
        assert (await q.pop_next() or pytest.fail()).request_id == "a2"
        weighted = TenantConfig("a", weight=4.0)
        assert await q.charge(weighted, 8) == 25.0 + 8 / 4  # a0, a1 and a2 cost 30, credit 5

    run(url, body)


def test_bounds_per_tenant_and_global(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = FairQueue(r, clock=Clock(), max_depth=3, retry_after_s=2.0)
        small = TenantConfig("a", max_queue_depth=2)
        await q.enqueue(small, "a0", 1, 60)
        await q.enqueue(small, "a1", 1, 60)
        with pytest.raises(
            CapacityExceeded,
            match=r"tenant 'a' already has 2 requests waiting "
            r"\(max_queue_depth=2\)",
        ) as e:
            await q.enqueue(small, "a2", 1, 60)
        assert e.value.retry_after_s == 2.0 and e.value.http_status == 429
        await q.enqueue(B, "b0", 1, 60)
        with pytest.raises(CapacityExceeded, match=r"the waiting queue is full \(3 requests waiting\)"):
            await q.enqueue(C, "c0", 1, 60)
        assert (await q.depth(), await q.depth("a"), await q.depth("b"), await q.depth("c")) == (3, 2, 1, 0)
        # Re-enqueueing an id that is waiting is not a new request and keeps its place.
        assert (await q.enqueue(small, "a0", 1, 60)).request_id == "a0"
        with pytest.raises(CapacityExceeded, match="max_queue_depth=0"):
            await FairQueue(r, name="other").enqueue(TenantConfig("never", max_queue_depth=0), "n0", 1, 60)

    run(url, body)


def test_timeouts_drop_requests_and_report_them(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q = FairQueue(r, clock=clock, max_depth=3)
        await q.enqueue(A, "short", 1, 5)
        await q.enqueue(A, "long", 1, 100)
        await q.enqueue(B, "b-short", 1, 5)
        clock.now += 10
        assert q.expired() == []
        item = await q.pop_next()
        assert item is not None and item.request_id == "long"
        assert sorted(x.request_id for x in q.expired()) == ["b-short", "short"]
        assert q.expired() == []  # reported once
        assert (await q.depth(), await q.depth("b")) == (0, 0)
        assert await q.pop_next() is None
        # A full queue makes room for new requests as soon as old ones time out.
        for i in range(3):
            await q.enqueue(C, f"c{i}", 1, 1)
        clock.now += 2
        await q.enqueue(A, "fresh", 1, 60)
        assert len(q.expired()) == 3
        await q.enqueue(A, "dies", 1, 1)
        clock.now += 1
        assert [x.request_id for x in await q.reap_expired()] == ["dies"]
        assert await q.depth() == 1

    run(url, body)


def test_remove_takes_a_request_out(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = FairQueue(r, clock=Clock())
        await q.enqueue(A, "a0", 10, 60)
        await q.enqueue(A, "a1", 10, 60)
        removed = await q.remove("a0")
        assert removed is not None and (removed.request_id, removed.tenant) == ("a0", "a")
        assert await q.remove("a0") is None and await q.remove("never") is None
        assert (await q.pop_next() or pytest.fail()).request_id == "a1"
        await q.enqueue(B, "b0", 10, 60)
        await q.remove("b0")  # b's line is empty: it must not stay active
        assert await q.pop_next() is None and await q.depth() == 0

    run(url, body)


def test_queues_with_different_names_are_independent(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        v1, v2 = FairQueue(r, name="v1"), FairQueue(r, name="v2")  # server time
        await v1.enqueue(A, "x", 10, 60)
        assert await v2.pop_next() is None
        item = await v1.pop_next()
        assert item is not None and item.deadline_s == pytest.approx(item.enqueued_at_s + 60)

    run(url, body)


# An operation: ("enqueue", tenant, cost, timeout, count) | ("pop", count) | ("remove", index) |
# ("tick", seconds). Bursts make tenants fall idle and come back, where lifting matters.
OPS = st.one_of(
    st.tuples(
        st.just("enqueue"),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 500),
        st.integers(1, 30),
        st.integers(1, 4),
    ),
    st.tuples(st.just("pop"), st.integers(1, 4)),
    st.tuples(st.just("remove"), st.integers(0, 200)),
    st.tuples(st.just("tick"), st.integers(1, 5)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(OPS, min_size=1, max_size=50),
    weights=st.tuples(
        st.sampled_from([1.0, 2.0, 3.0]), st.sampled_from([1.0, 0.5, 4.0]), st.sampled_from([1.0, 2.5])
    ),
)
def test_vtc_bound_holds_for_any_interleaving(
    redis_server: Any, ops: list[tuple[Any, ...]], weights: tuple[float, float, float]
) -> None:
    """Whenever two tenants both wait, their counters differ by at most the largest cost / weight of a
    request yet enqueued: nobody falls behind by more than one request, whatever the arrival order."""
    tenants = {name: TenantConfig(name, weight=w) for name, w in zip("abc", weights, strict=True)}

    async def body(r: aioredis.Redis) -> None:
        await r.flushdb()
        clock = Clock()
        q = FairQueue(r, clock=clock)
        ids: list[str] = []
        bound = 0.0
        for n, op in enumerate(ops):
            if op[0] == "enqueue":
                t = tenants[op[1]]
                for i in range(op[4]):
                    await q.enqueue(t, f"r{n}.{i}", op[2], op[3])
                    ids.append(f"r{n}.{i}")
                bound = max(bound, op[2] / t.weight)
            elif op[0] == "pop":
                for _ in range(op[1]):
                    await q.pop_next()
            elif op[0] == "remove" and ids:
                await q.remove(ids[op[1] % len(ids)])
            elif op[0] == "tick":
                clock.now += op[1]
                await q.reap_expired()
            waiting = [name for name in tenants if await q.depth(name) > 0]
            counters = [await q.counter(name) for name in waiting]
            if len(counters) > 1:
                # Each newcomer may sit up to TIE below the others (one per tenant that joined).
                assert max(counters) - min(counters) <= bound + len(tenants) * TIE + 1e-6, (
                    op,
                    waiting,
                    counters,
                )

    run(redis_server.url, body)
