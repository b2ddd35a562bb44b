"""`serve_calls`' orphans: the requests a `Calls` stream placed and did not finish, once the stream has
ended (its gateway died), go to the ledger after a grace — unless another live stream holds them —
and with the real `QuotaLedger` keep their id in flight for the retention, then give the slot back."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_runner import Clock, run

from baton.v1 import scheduler_pb2 as pb
from core.errors import DuplicateRequest
from scheduler.calls import Handler, Placed, serve_calls
from scheduler.quota import QuotaLedger
from scheduler.tenants import TenantConfig

pytestmark = pytest.mark.unit

GRACE_S = 0.2


class Recorded:
    """An `Orphans` that records what it is given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str], float]] = []

    async def orphan(self, tenant: str, request_ids: Sequence[str], retention_s: float) -> int:
        self.calls.append((tenant, sorted(request_ids), retention_s))
        return len(request_ids)


async def place(request: pb.PlaceRequest) -> pb.PlaceResponse:
    if request.request_id.startswith("dup"):
        raise DuplicateRequest(f"request id {request.request_id!r} is already in flight")
    return pb.PlaceResponse(tenant=request.api_key or "acme")


async def finish(request: pb.FinishRequest) -> pb.FinishResponse:
    return pb.FinishResponse()


HANDLERS: dict[str, Handler] = {"place": place, "finish": finish}


class Gateway:
    """One `Calls` stream driven as a gateway drives it: one call at a time, then a half-close or a
    death (the RPC cancelled while the scheduler waits for replies, as grpc.aio does when the
    connection breaks)."""

    def __init__(self, handlers: dict[str, Handler], orphans: Any, grace_s: float = GRACE_S) -> None:
        self._outbox: asyncio.Queue[pb.SchedulerCalls | None] = asyncio.Queue()
        self._ids = itertools.count(1)
        self.stream = serve_calls(self._batches(), handlers, orphans, grace_s, 120.0)

    async def _batches(self) -> AsyncIterator[pb.SchedulerCalls]:
        while (batch := await self._outbox.get()) is not None:
            yield batch

    async def call(self, **call: Any) -> pb.SchedulerReply:
        self._outbox.put_nowait(pb.SchedulerCalls(calls=[pb.SchedulerCall(call_id=next(self._ids), **call)]))
        [reply] = (await anext(self.stream)).replies
        return reply

    async def place(self, rid: str, tenant: str = "") -> str:
        """The reply's kind: place or error."""
        reply = await self.call(place=pb.PlaceRequest(request_id=rid, api_key=tenant))
        return str(reply.WhichOneof("reply"))

    async def finish(self, rid: str) -> None:
        await self.call(finish=pb.FinishRequest(request_id=rid, tenant="acme"))

    async def die(self) -> None:
        waiting = asyncio.ensure_future(anext(self.stream))
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    async def half_close(self) -> None:
        self._outbox.put_nowait(None)
        assert [r async for r in self.stream] == []


async def until(check: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "not within the timeout"
        await asyncio.sleep(0.01)


def test_a_dead_streams_unfinished_placements_are_orphaned_after_the_grace() -> None:
    async def body() -> None:
        orphans = Recorded()
        gw = Gateway(HANDLERS, orphans)
        for rid in ("a", "b", "c"):
            assert await gw.place(rid) == "place"
        assert await gw.place("x", tenant="other") == "place"
        assert await gw.place("dup-1") == "error"  # refused: not this stream's request
        await gw.place("a")  # placed again (a migration): still one request
        await gw.finish("b")
        await gw.die()
        loop = asyncio.get_running_loop()
        died_at = loop.time()
        assert orphans.calls == [] and not Placed.held
        await until(lambda: len(orphans.calls) == 2)
        assert loop.time() - died_at >= GRACE_S * 0.9
        assert sorted(orphans.calls) == [("acme", ["a", "c"], 120.0), ("other", ["x"], 120.0)]

    asyncio.run(body())


def test_a_request_another_live_stream_holds_is_not_orphaned() -> None:
    """A gateway that lost its stream but lives places its request again (resent) or resumes it on its
    new stream: the old stream's end leaves it alone; the new one's end orphans it."""

    async def body() -> None:
        orphans = Recorded()
        old, new = Gateway(HANDLERS, orphans), Gateway(HANDLERS, orphans)
        assert await old.place("a") == "place"
        assert await old.place("b") == "place"
        await old.die()
        assert await new.place("a") == "place"
        await until(lambda: len(orphans.calls) == 1)
        await asyncio.sleep(GRACE_S)
        assert orphans.calls == [("acme", ["b"], 120.0)]
        await new.die()
        await until(lambda: len(orphans.calls) == 2)
        assert orphans.calls[1] == ("acme", ["a"], 120.0) and not Placed.held

    asyncio.run(body())


def test_a_half_closed_stream_with_every_request_finished_orphans_nothing() -> None:
    async def body() -> None:
        orphans = Recorded()
        gw = Gateway(HANDLERS, orphans, grace_s=0.0)
        for rid in ("a", "b"):
            assert await gw.place(rid) == "place"
            await gw.finish(rid)
        await gw.finish("never-placed")  # idempotent, and nothing to forget
        await gw.half_close()
        await asyncio.sleep(0.1)
        assert orphans.calls == [] and not Placed.held
        # Without a ledger to tell, a dead stream's requests are simply left to expire.
        bare = Gateway(HANDLERS, None, grace_s=0.0)
        assert await bare.place("c") == "place"
        await bare.die()
        assert not Placed.held

    asyncio.run(body())


def test_with_the_ledger_a_dead_gateways_request_keeps_its_id_then_frees_its_slot(url: str) -> None:
    """End to end on the real ledger: the orphan stays a duplicate for the retention, the tenant's
    slot and blocks come back after it (not after the hour-long request TTL)."""

    async def body(r: aioredis.Redis) -> None:
        clock = Clock()
        quota = QuotaLedger(r, clock=clock)
        tenant = TenantConfig("acme", max_concurrent=2, max_kv_blocks=8)

        async def admit(request: pb.PlaceRequest) -> pb.PlaceResponse:  # as the Decider admits
            admission = await quota.admit(tenant, request.request_id, 10, 10, 4)
            if admission.already_admitted and not request.resent:
                raise DuplicateRequest(f"request id {request.request_id!r} is already in flight")
            return pb.PlaceResponse(tenant=tenant.name)

        async def finished(request: pb.FinishRequest) -> pb.FinishResponse:
            await quota.finish(tenant, request.request_id, 10, 10)
            return pb.FinishResponse()

        handlers: dict[str, Handler] = {"place": admit, "finish": finished}
        gw = Gateway(handlers, quota, grace_s=0.01)
        assert await gw.place("served") == "place"
        assert await gw.place("cut") == "place"
        await gw.finish("served")
        await gw.die()
        await until(lambda: not asyncio.all_tasks() - {asyncio.current_task()})
        assert await r.zscore("baton:quota:{acme}:inflight", "cut") == pytest.approx(clock.now + 120)
        assert ((u := await quota.usage(tenant)).concurrent, u.kv_blocks) == (1, 4)
        # A client re-sends it to a gateway that lives: refused, not generated twice.
        again = Gateway(handlers, quota)
        assert await again.place("cut") == "error"
        clock.now += 121
        assert ((u := await quota.usage(tenant)).concurrent, u.kv_blocks) == (0, 0)
        assert await again.place("cut") == "place"  # the retention is over: a request like any other
        await again.finish("cut")
        await again.half_close()

    run(url, body)
