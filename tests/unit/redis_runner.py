"""Shared by the scheduler's unit tests: run an async test body against the session's real
redis-server, with fresh `redis.asyncio` clients, and a hand-moved clock."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis

T = TypeVar("T")


def run(url: str, body: Callable[..., Awaitable[Any]], clients: int = 1) -> Any:
    """``asyncio.run(body(client, …))`` with ``clients`` connections, closed afterwards."""

    async def main() -> Any:
        rs = [aioredis.Redis.from_url(url, decode_responses=True) for _ in range(clients)]
        try:
            return await body(*rs)
        finally:
            for r in rs:
                await r.aclose()

    return asyncio.run(main())


class Clock:
    """A hand-moved clock, so time-based arithmetic (buckets, deadlines) is exact."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


TRANSPORTS = ["redis-py", "pipe"]  # where a ledger's per-request scripts run (scheduler.redis_pipe)


def on_transport(ledger: Callable[..., T], transport: str, url: str) -> Callable[..., T]:
    """``ledger(client, ...)`` with its per-request scripts on redis-py, or on a RedisPipe to ``url``."""
    from scheduler.redis_pipe import RedisPipe

    def make(client: aioredis.Redis, **options: Any) -> T:
        return ledger(client, pipe=RedisPipe(url) if transport == "pipe" else None, **options)

    return make
