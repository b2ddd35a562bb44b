"""LeaseLedger against a real redis-server: legal and illegal transitions, the reaper, stranded blocks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from redis_runner import TRANSPORTS, on_transport, run

from scheduler.leases import Lease, LeaseLedger, LeaseState

pytestmark = pytest.mark.unit


@pytest.fixture(params=TRANSPORTS)
def make_ledger(request: pytest.FixtureRequest, url: str) -> Callable[..., LeaseLedger]:
    """LeaseLedger(client, ...) with its pins and transitions on redis-py, and on the
    scheduler's RedisPipe: every test runs on both."""
    return on_transport(LeaseLedger, request.param, url)


T0 = 1_000_000.0  # a fixed "now" for tests that drive the clock by hand


async def make(
    ledger: LeaseLedger, lease_id: str, num_blocks: int = 4, ttl_s: float = 10.0, now: float = T0
) -> Lease:
    lease = await ledger.create(lease_id, f"req-{lease_id}", "p:1", "d:1", num_blocks, ttl_s, now=now)
    assert lease is not None
    return lease


def test_happy_path_pinned_pulling_released(url: str, make_ledger: Callable[..., LeaseLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        ledger = make_ledger(r)
        lease = await make(ledger, "L1", num_blocks=6)
        assert lease.state is LeaseState.PINNED and lease.expires_at == T0 + 10
        assert await ledger.get("L1") == lease

        assert await ledger.pulling("L1", now=T0 + 1)
        got = await ledger.get("L1")
        assert got is not None and got.state is LeaseState.PULLING and got.updated_at == T0 + 1
        assert await ledger.release("L1", now=T0 + 2)
        got = await ledger.get("L1")
        assert got is not None and got.state is LeaseState.RELEASED and got.expires_at == T0 + 10

        counts = await ledger.counts(now=T0 + 2)
        assert counts == {
            LeaseState.PINNED: 0,
            LeaseState.PULLING: 0,
            LeaseState.RELEASED: 1,
            LeaseState.EXPIRED: 0,
            LeaseState.ABORTED: 0,
        }
        totals = await ledger.totals()
        assert totals[LeaseState.PINNED] == totals[LeaseState.PULLING] == totals[LeaseState.RELEASED] == 1
        assert 0 < await r.pttl("baton:lease:L1") <= 300_000  # a finished lease leaves after the retention

    run(url, body)


def test_illegal_transitions_return_false(url: str, make_ledger: Callable[..., LeaseLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        ledger = make_ledger(r)
        assert not await ledger.pulling("ghost") and not await ledger.release("ghost")
        assert not await ledger.abort("ghost")

        await make(ledger, "L1")
        assert await ledger.create("L1", "other", "p:2", "d:2", 1, 5.0) is None  # ids are unique
        assert await ledger.pulling("L1", now=T0)
        assert not await ledger.pulling("L1", now=T0)  # PULLING → PULLING
        assert await ledger.abort("L1", now=T0)  # PULLING → ABORTED
        for move in (ledger.pulling, ledger.release, ledger.abort):  # nothing leaves a finished state
            assert not await move("L1", now=T0)
        got = await ledger.get("L1")
        assert got is not None and got.state is LeaseState.ABORTED

        await make(ledger, "L2")
        assert await ledger.release("L2", now=T0)  # PINNED → RELEASED: D held every block already
        assert not await ledger.release("L2", now=T0)  # a duplicate release
        assert not await ledger.pulling("L2", now=T0)

        await make(ledger, "L3")
        assert not await ledger.pulling("L3", now=T0 + 10)  # overdue: P may have freed the blocks
        got = await ledger.get("L3")
        assert got is not None and got.state is LeaseState.PINNED  # left for the reaper

        with pytest.raises(ValueError):
            await ledger.create("L4", "r", "p:1", "d:1", 1, ttl_s=0)

    run(url, body)


def test_expire_due_reaps_overdue_active_leases_once(
    url: str, make_ledger: Callable[..., LeaseLedger]
) -> None:
    async def body(r: aioredis.Redis) -> None:
        ledger = make_ledger(r)
        await make(ledger, "pinned")
        await make(ledger, "pulling")
        await make(ledger, "released")
        await make(ledger, "later", ttl_s=60)
        assert await ledger.pulling("pulling", now=T0 + 1)
        assert await ledger.release("released", now=T0 + 1)

        assert await ledger.expire_due(now=T0 + 9) == []
        expired = await ledger.expire_due(now=T0 + 11)
        assert sorted(lease.lease_id for lease in expired) == ["pinned", "pulling"]
        assert all(lease.state is LeaseState.EXPIRED and lease.prefill_worker == "p:1" for lease in expired)
        assert await ledger.expire_due(now=T0 + 11) == []
        assert not await ledger.release("pinned", now=T0 + 12)  # a release after expiry is refused

        counts = await ledger.counts(now=T0 + 11)
        assert counts[LeaseState.EXPIRED] == 2 and counts[LeaseState.PINNED] == 1
        assert counts[LeaseState.RELEASED] == 1 and counts[LeaseState.PULLING] == 0

    run(url, body)


def test_two_reapers_never_get_the_same_lease(url: str, make_ledger: Callable[..., LeaseLedger]) -> None:
    async def body(r1: aioredis.Redis, r2: aioredis.Redis) -> None:
        one, two = make_ledger(r1), make_ledger(r2)
        for i in range(300):
            await make(one, f"L{i}", ttl_s=1 + i % 5)
        for i in range(0, 300, 3):
            assert await two.pulling(f"L{i}", now=T0)

        async def reap(ledger: LeaseLedger) -> list[str]:
            got: list[str] = []
            while batch := await ledger.expire_due(now=T0 + 10, limit=7):
                got.extend(lease.lease_id for lease in batch)
                await asyncio.sleep(0)  # let the other replica in between batches
            return got

        a, b = await asyncio.gather(reap(one), reap(two))
        assert len(a) + len(b) == 300 and set(a) | set(b) == {f"L{i}" for i in range(300)}
        assert a and b  # both replicas really raced

    run(url, body, clients=2)


def test_stranded_blocks_read_zero_after_reaping(url: str, make_ledger: Callable[..., LeaseLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        ledger = make_ledger(r)
        await make(ledger, "A", num_blocks=3, ttl_s=5)
        await make(ledger, "B", num_blocks=5, ttl_s=5)
        await make(ledger, "C", num_blocks=7, ttl_s=50)
        await make(ledger, "D", num_blocks=11, ttl_s=5)
        assert await ledger.pulling("B", now=T0)
        assert await ledger.release("D", now=T0)

        assert await ledger.stranded_blocks(now=T0 + 1) == 0
        assert await ledger.stranded_blocks(now=T0 + 6) == 3 + 5  # D was released, C is not due
        assert len(await ledger.expire_due(now=T0 + 6)) == 2
        assert await ledger.stranded_blocks(now=T0 + 6) == 0
        assert await ledger.stranded_blocks(now=T0 + 60) == 7

    run(url, body)


def test_finished_leases_leave_redis_after_the_retention(
    url: str, make_ledger: Callable[..., LeaseLedger]
) -> None:
    async def body(r: aioredis.Redis) -> None:
        ledger = make_ledger(r, retention_s=0.3)
        now = time.time()
        await make(ledger, "A", ttl_s=60, now=now)
        await make(ledger, "B", ttl_s=60, now=now)
        assert await ledger.abort("A", now=now)
        assert (await ledger.counts())[LeaseState.ABORTED] == 1
        await asyncio.sleep(0.4)
        assert await ledger.get("A") is None
        assert (await ledger.counts())[LeaseState.ABORTED] == 0
        assert (await ledger.totals())[LeaseState.ABORTED] == 1  # the counter outlives the lease
        got = await ledger.get("B")  # an active lease stays until it finishes or expires
        assert got is not None and got.state is LeaseState.PINNED

    run(url, body)


def test_an_orphaned_index_entry_is_dropped_by_the_reaper(
    url: str, make_ledger: Callable[..., LeaseLedger]
) -> None:
    async def body(r: aioredis.Redis) -> None:
        ledger = make_ledger(r)
        await make(ledger, "A")
        await r.delete("baton:lease:A")  # as if its safety TTL had passed with no reaper running
        assert await ledger.expire_due(now=T0 + 11) == []
        assert (await ledger.counts(now=T0 + 11))[LeaseState.PINNED] == 0

    run(url, body)


@pytest.mark.parametrize("end", ["release", "abort"])
def test_an_end_reported_before_the_pin_ends_the_lease(
    url: str, end: str, make_ledger: Callable[..., LeaseLedger]
) -> None:
    """Reports are concurrent calls: the end of a lease can reach Redis before its pin. The pin then
    records the lease as ended, never as an active lease that only its TTL would end."""

    async def body(r: aioredis.Redis) -> None:
        ledger = make_ledger(r)
        assert not await getattr(ledger, end)("L1")  # the pin is still on the way
        await ledger.create("L1", "req-1", "p:1", "d:1", 4, 30.0)
        counts = await ledger.counts()
        target = LeaseState.RELEASED if end == "release" else LeaseState.ABORTED
        assert counts[LeaseState.PINNED] == 0 and counts[target] == 1, counts
        got = await ledger.get("L1")
        assert got is not None and got.state is target
        assert await ledger.stranded_blocks() == 0
        assert await ledger.expire_due(now=got.expires_at + 1) == []  # the reaper has nothing to do
        # The mark is used once: a later lease of the same id is pinned as usual.
        await r.delete("baton:lease:L1")
        assert (await ledger.create("L1", "req-2", "p:1", "d:1", 4, 30.0)) is not None
        assert (await ledger.counts())[LeaseState.PINNED] == 1

    run(url, body)
