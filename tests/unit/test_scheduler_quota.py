"""QuotaLedger against a real redis-server: each limit, all-or-nothing, refunds, self-healing, races."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_runner import TRANSPORTS, Clock, on_transport, run

from core.errors import CapacityExceeded, InvalidRequest
from scheduler.quota import QuotaLedger, TenantUsage
from scheduler.tenants import TenantConfig

pytestmark = pytest.mark.unit


@pytest.fixture(params=TRANSPORTS)
def ledger(request: pytest.FixtureRequest, url: str) -> Callable[..., QuotaLedger]:
    """QuotaLedger(client, ...) with its admissions and finishes on redis-py, and on the
    scheduler's RedisPipe: every test runs on both."""
    return on_transport(QuotaLedger, request.param, url)


def tenant(**limits: Any) -> TenantConfig:
    defaults: dict[str, Any] = {"requests_per_s": 100.0, "tokens_per_s": 10_000.0, "burst_s": 1.0}
    return TenantConfig("acme", **{**defaults, **limits})


def test_request_rate_refuses_with_its_deficit(url: str, ledger: Callable[..., QuotaLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q, t = ledger(r, clock=clock), tenant(requests_per_s=2.0)
        await q.admit(t, "a", 10, 10, 1)
        await q.admit(t, "b", 10, 10, 1)
        with pytest.raises(CapacityExceeded, match=r"request rate over 2/s") as e:
            await q.admit(t, "c", 10, 10, 1)
        assert e.value.retry_after_s == pytest.approx(0.5)
        assert e.value.grpc_code == "RESOURCE_EXHAUSTED" and e.value.http_status == 429
        clock.now += 0.25
        with pytest.raises(CapacityExceeded) as e:
            await q.admit(t, "c", 10, 10, 1)
        assert e.value.retry_after_s == pytest.approx(0.25)
        clock.now += 0.25
        await q.admit(t, "c", 10, 10, 1)

    run(url, body)


def test_token_rate_charges_prompt_plus_max_tokens(url: str, ledger: Callable[..., QuotaLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q, t = ledger(r, clock=clock), tenant(tokens_per_s=1000.0)
        adm = await q.admit(t, "a", 100, 500, 2)
        assert (adm.tokens_charged, adm.kv_blocks, adm.already_admitted) == (600, 2, False)
        assert adm.expires_at_s == pytest.approx(clock.now + q.request_ttl_s)
        with pytest.raises(
            CapacityExceeded, match=r"token rate over 1000/s \(600 tokens requested, 400 av"
        ) as e:
            await q.admit(t, "b", 300, 300, 2)
        assert e.value.retry_after_s == pytest.approx(0.2)
        clock.now += 0.2
        await q.admit(t, "b", 300, 300, 2)
        assert (await q.usage(t)).tokens_available == pytest.approx(0.0, abs=1e-6)

    run(url, body)


def test_concurrency_and_kv_limits_refuse_with_a_constant_retry_after(
    url: str, ledger: Callable[..., QuotaLedger]
) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = ledger(r, clock=Clock(), busy_retry_after_s=0.75)
        t = tenant(max_concurrent=2, max_kv_blocks=10)
        await q.admit(t, "a", 1, 1, 6)
        with pytest.raises(
            CapacityExceeded,
            match=r"6 KV blocks held and 5 more requested "
            r"\(max_kv_blocks=10\)",
        ) as e:
            await q.admit(t, "b", 1, 1, 5)
        assert e.value.retry_after_s == 0.75
        await q.admit(t, "b", 1, 1, 4)
        with pytest.raises(CapacityExceeded, match=r"2 requests in flight \(max_concurrent=2\)") as e:
            await q.admit(t, "c", 1, 1, 0)
        assert e.value.retry_after_s == 0.75
        assert "KV" not in e.value.message and "rate" not in e.value.message

    run(url, body)


def test_refusal_charges_nothing_and_names_every_limit(url: str, ledger: Callable[..., QuotaLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        q = ledger(r, clock=Clock(), busy_retry_after_s=0.1)
        t = tenant(requests_per_s=2.0, tokens_per_s=1000.0, max_concurrent=2, max_kv_blocks=8)
        await q.admit(t, "a", 400, 400, 4)
        await q.admit(t, "b", 50, 50, 4)
        before = await q.usage(t)
        assert before == TenantUsage("acme", 2, 8, 0.0, 100.0)
        with pytest.raises(CapacityExceeded) as e:
            await q.admit(t, "c", 300, 300, 1)
        for limit in ("max_concurrent=2", "max_kv_blocks=8", "request rate", "token rate"):
            assert limit in e.value.message
        assert e.value.retry_after_s == pytest.approx(0.5)  # the longest wait: (600 - 100) / 1000
        assert await q.usage(t) == before
        # Only the bucket is short: still nothing is charged.
        await q.finish(t, "a", 400, 400)
        await q.finish(t, "b", 50, 50)
        before = await q.usage(t)
        with pytest.raises(CapacityExceeded, match="request rate"):
            await q.admit(t, "d", 1, 1, 1)
        assert await q.usage(t) == before

    run(url, body)


def test_requests_that_can_never_fit_are_invalid(url: str, ledger: Callable[..., QuotaLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        q, t = ledger(r, clock=Clock()), tenant(tokens_per_s=100.0, max_kv_blocks=4)
        with pytest.raises(InvalidRequest, match="needs 101 tokens .* at most 100 at once"):
            await q.admit(t, "a", 1, 100, 1)
        with pytest.raises(InvalidRequest, match="needs 5 KV blocks"):
            await q.admit(t, "a", 1, 1, 5)
        with pytest.raises(ValueError):
            await q.admit(t, "a", -1, 1, 1)
        assert await q.usage(t) == TenantUsage("acme", 0, 0, 100.0, 100.0)

    run(url, body)


def test_finish_refunds_unused_tokens_and_is_idempotent(url: str, ledger: Callable[..., QuotaLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        q, t = ledger(r, clock=Clock()), tenant(tokens_per_s=1000.0)
        await q.admit(t, "a", 100, 500, 3)
        assert await q.usage(t) == TenantUsage("acme", 1, 3, 99.0, 400.0)
        assert await q.finish(t, "a", 100, 50) == 450
        assert await q.usage(t) == TenantUsage("acme", 0, 0, 99.0, 850.0)
        assert await q.finish(t, "a", 100, 50) is None
        assert await q.finish(t, "never-admitted", 1, 1) is None
        assert await q.usage(t) == TenantUsage("acme", 0, 0, 99.0, 850.0)
        # A request that used all it was charged is refunded nothing; overuse is not charged extra.
        await q.admit(t, "b", 100, 100, 1)
        assert await q.finish(t, "b", 100, 150) == 0
        # A refund never fills the bucket past its capacity.
        await q.admit(t, "c", 0, 10, 0)
        clock_refill = ledger(r, clock=Clock(1_000_100.0))
        assert await clock_refill.finish(t, "c", 0, 0) == 10
        assert (await clock_refill.usage(t)).tokens_available == 1000.0

    run(url, body)


def test_readmitting_an_admitted_request_charges_nothing(
    url: str, ledger: Callable[..., QuotaLedger]
) -> None:
    async def body(r: aioredis.Redis) -> None:
        q, t = ledger(r, clock=Clock()), tenant(tokens_per_s=1000.0)
        first = await q.admit(t, "a", 100, 100, 2)
        again = await q.admit(t, "a", 100, 100, 2)
        assert again.already_admitted and (again.tokens_charged, again.kv_blocks) == (200, 2)
        assert again.expires_at_s == pytest.approx(first.expires_at_s)
        assert await q.usage(t) == TenantUsage("acme", 1, 2, 99.0, 800.0)

    run(url, body)


def test_unfinished_requests_expire_and_give_back_their_slots(
    url: str, ledger: Callable[..., QuotaLedger]
) -> None:
    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q, t = ledger(r, request_ttl_s=60.0, clock=clock), tenant(max_concurrent=2, max_kv_blocks=10)
        await q.admit(t, "crashed-1", 1, 1, 5)
        clock.now += 30
        await q.admit(t, "crashed-2", 1, 1, 5)
        with pytest.raises(CapacityExceeded, match="max_concurrent"):
            await q.admit(t, "c", 1, 1, 1)
        clock.now += 31  # crashed-1 is past its lifetime, crashed-2 is not
        await q.admit(t, "c", 1, 1, 1)
        assert (u := await q.usage(t)).concurrent == 2 and u.kv_blocks == 6
        assert await q.finish(t, "crashed-1", 1, 1) is None  # too late: already forgotten
        clock.now += 120
        assert (u := await q.usage(t)).concurrent == 0 and u.kv_blocks == 0
        # Nothing is left behind for an idle tenant but keys that expire on their own.
        for key in await r.keys("baton:quota:*"):
            assert await r.pttl(key) > 0

    run(url, body)


def test_orphaned_requests_keep_their_ids_for_the_retention_then_give_back_their_slots(
    url: str, ledger: Callable[..., QuotaLedger]
) -> None:
    """A dead gateway's requests (scheduler.calls): brought forward to expire ``retention_s`` from now —
    never later than they would anyway — and until then still in flight: the same id re-admitted is a
    duplicate, and the tenant's slot and blocks are held; after it, both come back."""

    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q, t = ledger(r, clock=clock), tenant(max_concurrent=3, max_kv_blocks=10)
        await q.admit(t, "orphan-1", 1, 1, 2)
        await q.admit(t, "orphan-2", 1, 1, 2)
        await q.admit(t, "finished", 1, 1, 2)
        await q.finish(t, "finished", 1, 1)
        await q.admit(t, "short", 1, 1, 2)
        # Only those still in flight count; none is given more time than it had (LT).
        assert await q.orphan("acme", ["orphan-1", "orphan-2", "finished", "never"], 120.0) == 2
        assert await q.orphan("acme", ["orphan-1"], 600.0) == 0
        assert await q.orphan("acme", [], 120.0) == 0
        assert await r.zscore("baton:quota:{acme}:inflight", "orphan-1") == pytest.approx(clock.now + 120)
        clock.now += 119
        again = await q.admit(t, "orphan-1", 1, 1, 2)
        assert again.already_admitted  # the placement refuses it: DuplicateRequest
        assert ((u := await q.usage(t)).concurrent, u.kv_blocks) == (3, 6)
        clock.now += 2
        assert ((u := await q.usage(t)).concurrent, u.kv_blocks) == (1, 2)  # only "short" is left
        assert await q.finish(t, "orphan-2", 1, 1) is None  # a late Finish: idempotent
        fresh = await q.admit(t, "orphan-1", 1, 1, 2)
        assert not fresh.already_admitted and fresh.expires_at_s == pytest.approx(clock.now + q.request_ttl_s)

    run(url, body)


def test_server_time_refills_the_buckets(url: str, ledger: Callable[..., QuotaLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        q, t = ledger(r), tenant(requests_per_s=100.0, burst_s=0.05)
        for i in range(5):
            await q.admit(t, f"r{i}", 1, 1, 0)
        with pytest.raises(CapacityExceeded, match="request rate") as e:
            await q.admit(t, "r5", 1, 1, 0)
        assert 0 < e.value.retry_after_s <= 0.011
        time.sleep(e.value.retry_after_s + 0.005)
        await q.admit(t, "r5", 1, 1, 0)

    run(url, body)


def test_concurrent_admits_never_exceed_max_concurrent(url: str, ledger: Callable[..., QuotaLedger]) -> None:
    async def body(r: aioredis.Redis) -> None:
        other = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            ledgers = [ledger(r), ledger(other)]  # two replicas
            t = tenant(max_concurrent=10)

            async def attempt(i: int) -> bool:
                try:
                    await ledgers[i % 2].admit(t, f"r{i}", 10, 10, 1)
                    return True
                except CapacityExceeded:
                    return False

            results = await asyncio.gather(*(attempt(i) for i in range(50)))
            assert sum(results) == 10
            assert (await ledgers[0].usage(t)).concurrent == 10
        finally:
            await other.aclose()

    run(url, body)


def test_a_calls_choices_are_charged_together_before_any_runs(
    url: str, ledger: Callable[..., QuotaLedger]
) -> None:
    """An OpenAI call of n choices: the first choice's admission charges all n — a slot, the tokens and
    the blocks each — or none; the others' reservations are claimed by their own placements, or lapse."""

    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        q = ledger(r, clock=clock, reservation_ttl_s=30.0)
        t = tenant(max_concurrent=4, max_kv_blocks=20, tokens_per_s=1000.0)
        adm = await q.admit(t, "c-0", 100, 100, 2, siblings=("c-1", "c-2"))
        assert adm.tokens_charged == 200
        u = await q.usage(t)
        assert (u.concurrent, u.kv_blocks) == (3, 6) and u.tokens_available == pytest.approx(400.0)
        with pytest.raises(CapacityExceeded, match=r"max_concurrent=4"):  # 3 + 2 > 4: all or nothing
            await q.admit(t, "d-0", 1, 1, 1, siblings=("d-1",))
        assert (await q.usage(t)).concurrent == 3
        with pytest.raises(InvalidRequest, match=r"the request's 5 choices need 5 requests at once"):
            await q.admit(t, "e-0", 1, 1, 1, siblings=("e-1", "e-2", "e-3", "e-4"))
        assert await q.claim(t, "c-1")  # its own placement came
        clock.now += 31  # c-2's never did: its reservation lapses, giving back its slot and blocks
        assert ((u := await q.usage(t)).concurrent, u.kv_blocks) == (2, 4)
        assert not await q.claim(t, "c-2")
        assert await q.finish(t, "c-1", 100, 40) == 60  # a claimed choice ends like any request
        assert await q.finish(t, "c-0", 100, 100) == 0
        assert (await q.usage(t)).concurrent == 0

    run(url, body)
