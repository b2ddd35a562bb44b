"""CancellationBus against a real redis-server: idempotent cancels, delivery, and surviving an outage."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_runner import run

from scheduler.cancel import CancellationBus

pytestmark = pytest.mark.unit


class Received:
    """Collects (request_id, reason) from a listener; `wait_for` polls briefly instead of sleeping long."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    async def __call__(self, request_id: str, reason: str) -> None:
        self.items.append((request_id, reason))

    async def wait_for(self, n: int, timeout_s: float = 3.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.items) < n:
                await asyncio.sleep(0.01)


def test_cancel_is_idempotent(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        bus = CancellationBus(r, ttl_s=30)
        assert not await bus.is_cancelled("req-1")
        assert await bus.cancel("req-1", reason="client")
        assert not await bus.cancel("req-1", reason="deadline")  # already cancelled: nothing published again
        assert await bus.is_cancelled("req-1")
        assert await r.get("baton:cancelled:req-1") == "client"
        assert 0 < await r.pttl("baton:cancelled:req-1") <= 30_000
        assert not await bus.is_cancelled("req-2")

    run(url, body)


def test_a_listener_receives_cancels_from_another_client(url: str) -> None:
    async def body(r1: aioredis.Redis, r2: aioredis.Redis) -> None:
        listener, publisher = CancellationBus(r1), CancellationBus(r2)
        got = Received()
        listener.listen(got)
        assert await listener.wait_subscribed(3)
        assert await publisher.cancel("req-1")
        assert await publisher.cancel("req-2", reason="disconnect")
        assert not await publisher.cancel("req-1")
        await got.wait_for(2)
        await asyncio.sleep(0.05)
        assert got.items == [("req-1", "client"), ("req-2", "disconnect")]
        await listener.stop()
        assert not listener.subscribed

    run(url, body, clients=2)


def test_a_failing_or_sync_callback_does_not_end_the_listener(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        bus = CancellationBus(r)
        seen: list[str] = []

        def callback(request_id: str, reason: str) -> None:
            seen.append(request_id)
            if request_id == "boom":
                raise RuntimeError("callback bug")

        task = bus.listen(callback)
        with pytest.raises(RuntimeError, match="already listening"):
            bus.listen(callback)
        assert await bus.wait_subscribed(3)
        await bus.cancel("boom")
        await bus.cancel("after")
        async with asyncio.timeout(3):
            while len(seen) < 2:
                await asyncio.sleep(0.01)
        assert seen == ["boom", "after"] and not task.done()
        await bus.stop()
        assert task.done()

    run(url, body)


def test_a_listener_cut_off_alone_replays_what_it_missed(url: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="scheduler.cancel")

    async def body(r1: aioredis.Redis, r2: aioredis.Redis) -> None:
        # A slow first reconnect leaves a window in which the cancel below is published to nobody.
        listener = CancellationBus(r1, reconnect_min_s=0.4, reconnect_max_s=0.4)
        publisher = CancellationBus(r2)
        got = Received()
        listener.listen(got)
        assert await listener.wait_subscribed(3)
        await r2.client_kill_filter(_type="pubsub")  # Redis stays up; only the listener's connection drops
        assert await publisher.cancel("missed")
        await got.wait_for(1)
        assert got.items == [("missed", "client")]
        assert any("replaying 1 cancels" in rec.getMessage() for rec in caplog.records)
        assert await publisher.cancel("live")
        await got.wait_for(2)
        await asyncio.sleep(0.05)
        assert got.items == [("missed", "client"), ("live", "client")]  # each exactly once
        await listener.stop()

    run(url, body, clients=2)


def test_a_listener_survives_a_redis_outage(
    url: str, redis_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="scheduler.cancel")

    async def body(r: aioredis.Redis) -> None:
        listener = CancellationBus(r, reconnect_min_s=0.05, reconnect_max_s=0.1)
        got = Received()
        task = listener.listen(got)
        assert await listener.wait_subscribed(3)
        redis_server.kill()
        try:
            async with asyncio.timeout(3):
                while listener.subscribed:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
        finally:
            redis_server.start()
        attempts = sum("still no Redis" in rec.getMessage() for rec in caplog.records)
        assert 2 <= attempts <= 25  # it kept trying, with backoff, not in a busy loop
        assert not task.done()
        assert await listener.wait_subscribed(5)

        publisher_client = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            assert await CancellationBus(publisher_client).cancel("after-outage", reason="client")
        finally:
            await publisher_client.aclose()
        await got.wait_for(1)
        assert got.items == [("after-outage", "client")]
        assert any("resubscribed" in rec.getMessage() for rec in caplog.records)
        await listener.stop()

    run(url, body)
