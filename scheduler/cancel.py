"""`CancellationBus`: request cancels published through Redis, so they reach every worker and gateway replica.

A cancel must reach the worker even when the gateway replica that took the request is gone, so it
is not a call to a known peer but a message on a bus. Keys and channel, prefix ``baton:``:

* ``baton:cancelled:{request_id}`` — STRING (the reason), TTL ``ttl_s``: makes `cancel` idempotent and
  lets a worker ask `is_cancelled` when a request arrives after its cancel.
* ``baton:cancels`` — ZSET of recent cancel messages scored by time (trimmed to ``ttl_s``): after a
  listener reconnects it replays what it may have missed, since pub/sub keeps nothing for the absent.
* channel ``baton:cancel`` — one JSON message ``{"request_id", "reason"}`` per cancel.

Delivery to a listener is at least once per connection gap and de-duplicated by request id, so a
callback normally sees each cancel once; it must still be idempotent (a cancel always is).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import cast

import redis.asyncio as aioredis

from rpc.redis_url import own_pool

log = logging.getLogger(__name__)

CancelCallback = Callable[[str, str], Awaitable[None] | None]

# KEYS: cancelled key, recent zset. ARGV: reason, ttl_ms, now, cutoff, message, channel.
# One script, so a cancel is never recorded without being published (or the reverse).
_CANCEL = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[4])
redis.call('PUBLISH', ARGV[6], ARGV[5])
return 1
"""

# Enough to cover clock skew between the canceller and the listener when replaying after a gap.
_REPLAY_SLACK_S = 2.0
# Request ids already delivered, so that a replay does not call back twice for one cancel.
_SEEN_MAX = 10_000


class CancellationBus:
    """Publish cancels (`cancel`), check them (`is_cancelled`), and receive them (`listen` … `stop`).

    The listener runs on its own connection without redis-py's silent retries, so it knows when it
    was cut off: it then reconnects with jittered exponential backoff, resubscribes and replays the
    cancels it may have missed.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str = "baton:",
        ttl_s: float = 600.0,
        reconnect_min_s: float = 0.05,
        reconnect_max_s: float = 2.0,
    ) -> None:
        if ttl_s <= 0 or reconnect_min_s <= 0 or reconnect_max_s < reconnect_min_s:
            raise ValueError("ttl_s and reconnect_min_s must be positive, reconnect_max_s >= reconnect_min_s")
        self._redis = client
        self._prefix = prefix
        self.ttl_s = ttl_s
        self.channel = f"{prefix}cancel"
        self._recent = f"{prefix}cancels"
        self._reconnect_min_s = reconnect_min_s
        self._reconnect_max_s = reconnect_max_s
        self._cancel = client.register_script(_CANCEL)
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._seen: OrderedDict[str, float] = OrderedDict()  # request id → when delivered (monotonic)

    def _key(self, request_id: str) -> str:
        return f"{self._prefix}cancelled:{request_id}"

    async def cancel(self, request_id: str, reason: str = "client", now: float | None = None) -> bool:
        """Cancel a request cluster-wide; False if it was already cancelled (nothing is published again)."""
        now = time.time() if now is None else now
        message = json.dumps({"request_id": request_id, "reason": reason})
        ok = await self._cancel(
            keys=[self._key(request_id), self._recent],
            args=[reason, round(self.ttl_s * 1000), repr(now), repr(now - self.ttl_s), message, self.channel],
        )
        if ok:
            log.info("request %s cancelled (%s)", request_id, reason)
        return bool(ok)

    async def is_cancelled(self, request_id: str) -> bool:
        return bool(await self._redis.exists(self._key(request_id)))

    @property
    def subscribed(self) -> bool:
        """True while the listener holds a live subscription."""
        return self._subscribed.is_set()

    async def wait_subscribed(self, timeout_s: float | None = None) -> bool:
        """Wait until the listener is subscribed (e.g. before a worker reports ready); False on timeout."""
        try:
            await asyncio.wait_for(self._subscribed.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def listen(self, callback: CancelCallback) -> asyncio.Task[None]:
        """Start a task that calls ``callback(request_id, reason)`` (sync or async) for each cancel."""
        if self._task is not None and not self._task.done():
            raise RuntimeError("this CancellationBus is already listening")
        self._task = asyncio.create_task(self._run(callback), name="cancellation-bus")
        return self._task

    async def stop(self) -> None:
        """End the listener and close its connection."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _listener_client(self) -> aioredis.Redis:
        # A pool of its own with retries off: redis-py would otherwise reconnect and resubscribe inside
        # get_message, and the gap (whose messages are lost) would go unnoticed and unreplayed. On the
        # same server as the bus's client (for a Sentinel URL: the master of the moment, asked again on
        # each reconnect, so a failover is a gap like any other).
        return own_pool(self._redis, max_connections=2, retries=0)

    async def _run(self, callback: CancelCallback) -> None:
        delay = self._reconnect_min_s
        last_ok: float | None = None  # wall clock when the connection was last known good
        outage_since: float | None = None
        while True:
            client = self._listener_client()
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._subscribed.set()
                since, last_ok = last_ok, time.time()
                if outage_since is not None:
                    log.info("cancellation bus: resubscribed after %.2fs", time.monotonic() - outage_since)
                    outage_since = None
                delay = self._reconnect_min_s
                if since is not None:
                    await self._replay(client, since - _REPLAY_SLACK_S, callback)
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    last_ok = time.time()
                    if message is not None and message.get("type") == "message":
                        await self._deliver(message["data"], callback)
            except Exception as e:  # RedisError, OSError, or a surprise: reconnect rather than end the bus
                self._subscribed.clear()
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("cancellation bus: lost Redis (%s: %s); reconnecting", type(e).__name__, e)
                else:
                    log.debug("cancellation bus: still no Redis (%s)", e)
            finally:
                self._subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
                with contextlib.suppress(Exception):
                    await client.aclose(close_connection_pool=True)  # the pool is this listener's own
            # Jitter spreads the reconnects of many workers after a Redis restart.
            await asyncio.sleep(delay * (0.5 + random.random() / 2))
            delay = min(delay * 2, self._reconnect_max_s)

    async def _replay(self, client: aioredis.Redis, since: float, callback: CancelCallback) -> None:
        messages = cast(list[str], await client.zrangebyscore(self._recent, repr(since), "+inf"))
        if messages:
            log.info("cancellation bus: replaying %d cancels from the connection gap", len(messages))
        for data in messages:
            await self._deliver(data, callback)

    async def _deliver(self, data: str, callback: CancelCallback) -> None:
        try:
            body = json.loads(data)
            request_id, reason = str(body["request_id"]), str(body["reason"])
        except (ValueError, KeyError, TypeError):
            log.warning("cancellation bus: malformed message %r", data[:200])
            return
        now = time.monotonic()
        seen_at = self._seen.get(request_id)
        if seen_at is not None and now - seen_at < self.ttl_s:
            return
        # An id cancelled again after its key expired (a reused idempotency key) is a new cancel.
        self._seen[request_id] = now
        self._seen.move_to_end(request_id)
        if len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)
        try:
            result = callback(request_id, reason)
            if inspect.isawaitable(result):
                await result
        except Exception:
            # One failing callback must not end the listener for every later cancel.
            log.exception("cancellation bus: callback failed for request %s", request_id)
