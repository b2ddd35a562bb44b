"""`RedisPipe`: one pipelined Redis connection for the scheduler's per-request scripts.

Why not redis-py's asyncio client for these: measured on this machine, one `EVALSHA` of the quota
script costs about 100 µs of the scheduler's CPU through redis-py (its stream reader, connection pool,
retry and timeout wrappers, and pure-Python command packing) and 25 µs through this class (hiredis
packs the command and parses the reply in C; replies are matched to callers in order on an
`asyncio.Protocol`). The quota charge is the one Redis round trip of a placement decision, so that is a
quarter of the decision's CPU (docs/SCHEDULER.md, "Decision latency"). A lease's pin and end, the
other Redis scripts every request runs, go through it too.

What it keeps of redis-py's behaviour, so callers handle failures the same way:
* errors are redis-py's classes: `ConnectionError` when Redis cannot be reached or the connection
  drops (every call in flight fails with it), `TimeoutError` when a reply takes longer than
  ``timeout_s`` (the connection is then closed: a hung Redis must not hold later calls), and
  `ResponseError` / `NoScriptError` for error replies;
* a call after a failure connects again, so service resumes by itself when Redis is back; callers
  that arrive while an attempt is under way share it (a partition costs each one connect timeout);
* replies are decoded as UTF-8 strings (``decode_responses=True``).

A caller cancelled while its reply is on the way loses nothing: the reply is read in its turn and
dropped, and the connection stays in step. ``redis://``, ``unix://`` and ``redis+sentinel://`` URLs
are served (`supports`; `rpc.redis_url` reads them); TLS (``rediss://``) stays on redis-py. With a
sentinel URL each new connection goes to the master the sentinels name at that moment, and a reply
saying the server is a read-only replica now (the master it was connected to was demoted) closes the
connection like a drop: the next call finds the new master.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis import exceptions as rx  # not the builtins of the same names

from core.expiry import Expired, expire_later
from rpc.redis_url import MasterLocator, parse_redis_url

_Waiter = asyncio.Future[Any]
# The error a write gets from a replica: the master this connection went to was demoted.
_READ_ONLY = "READONLY You can't write against a read only replica"
Script = Callable[..., Awaitable[Any]]  # called as script(keys=[...], args=[...])


class PipeScript:
    """A Lua script run by its SHA1 (`EVALSHA`), loaded again when Redis does not know it."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


def register_script(client: aioredis.Redis, pipe: RedisPipe | None, source: str) -> Script:
    """``source`` as a script run through ``pipe`` if there is one, else through ``client`` (redis-py)."""
    if pipe is None:
        script = client.register_script(source)
        return lambda keys, args: script(keys=keys, args=args)
    piped = PipeScript(source)
    return lambda keys, args: pipe.evalsha(piped, keys, args)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(encoding="utf-8")
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.transport: asyncio.Transport | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as e:
                self.close(rx.ConnectionError(f"Redis sent a malformed reply: {e}"))
                return
            except UnicodeDecodeError as e:  # that reply alone is consumed and fails; the rest stay in step
                reply = rx.ResponseError(f"Redis replied with bytes that are not UTF-8 text: {e}")
            if reply is False:
                return
            if not self.waiters:  # a reply nobody asked for: out of step, start again
                self.close(rx.ConnectionError("Redis sent a reply nobody was waiting for"))
                return
            waiter = self.waiters.popleft()
            if waiter.done():  # its caller gave up (cancelled or timed out): the reply is dropped
                continue
            if isinstance(reply, hiredis.ReplyError):
                message = str(reply)
                waiter.set_exception(
                    rx.NoScriptError(message) if message.startswith("NOSCRIPT") else rx.ResponseError(message)
                )
            elif isinstance(reply, rx.ResponseError):
                waiter.set_exception(reply)
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail_all(rx.ConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}"))

    def close(self, error: Exception) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.abort()
        self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        waiters, self.waiters = self.waiters, collections.deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(error)


class RedisPipe:
    """One connection, many callers: each call writes its command at once and waits for its reply,
    which Redis sends in order. Not a general client: the scheduler keeps redis-py for everything else
    (pub/sub, scans, pipelines of many commands)."""

    def __init__(self, url: str, timeout_s: float = 2.0, connect_timeout_s: float = 2.0) -> None:
        target = parse_redis_url(url)  # a malformed URL: ValueError naming the problem
        if not self.supports(url):
            raise ValueError(
                f"RedisPipe serves redis:// and unix:// URLs (and redis+sentinel://), not {target.redacted!r}"
            )
        self.url = target.redacted  # for messages: no password
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._target = target
        self._locator = MasterLocator(target, connect_timeout_s)
        self._protocol: _Protocol | None = None
        self._opening: asyncio.Future[_Protocol] | None = None  # the connection attempt under way
        self._closed = False

    @staticmethod
    def supports(url: str) -> bool:
        return url.startswith(("redis://", "unix://", "redis+sentinel://"))

    async def execute(self, *args: str | int | float | bytes) -> Any:
        """One command's reply (``execute("GET", "key")``)."""
        if self._closed:
            raise rx.ConnectionError("the pipe was closed")
        protocol = self._protocol
        if protocol is None or protocol.lost:
            protocol = await self._connect()
        return await self._send(protocol, args)

    async def evalsha(self, script: PipeScript, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)
        except rx.NoScriptError:  # a restarted or flushed Redis: load it and run it again
            await self.execute("SCRIPT", "LOAD", script.source)
            return await self.execute("EVALSHA", script.sha, len(keys), *keys, *args)

    async def close(self) -> None:
        """Fails the calls in flight and refuses later ones (a connection being opened is closed once open)."""
        self._closed = True
        if self._protocol is not None:
            self._protocol.close(rx.ConnectionError("the pipe was closed"))
            self._protocol = None
        await self._locator.aclose()

    async def _send(self, protocol: _Protocol, args: tuple[Any, ...]) -> Any:
        assert protocol.transport is not None
        try:
            command = hiredis.pack_command(args)  # before the waiter joins the queue: a bad argument fails
        except TypeError as e:  # this call alone (redis-py raises DataError for such arguments too)
            raise rx.DataError(f"a Redis argument must be str, bytes, int or float: {e}") from None
        if protocol.lost:  # lost while this caller waited for it: no reply would ever come
            raise rx.ConnectionError("connection to Redis lost")
        loop = asyncio.get_running_loop()
        waiter: _Waiter = loop.create_future()
        protocol.waiters.append(waiter)
        protocol.transport.write(command)
        timer = expire_later(waiter, self.timeout_s)
        try:
            return await waiter
        except Expired:
            # Redis did not answer in time: later replies cannot be trusted to come; start afresh.
            protocol.close(rx.TimeoutError(f"Redis did not answer in {self.timeout_s:g} s"))
            raise rx.TimeoutError(f"Redis did not answer {args[0]} in {self.timeout_s:g} s") from None
        except rx.ResponseError as e:
            if self._target.is_sentinel and _READ_ONLY in str(e):  # demoted by a failover
                protocol.close(rx.ConnectionError("the Redis master became a replica"))
                raise rx.ConnectionError(f"the Redis master became a replica (a failover): {e}") from None
            raise
        finally:
            timer.cancel()

    async def _connect(self) -> _Protocol:
        """The connection, opened if there is none. Callers that find an attempt under way share its
        outcome: during an outage each waits for one attempt at most, not for every caller's before it."""
        opening = self._opening
        if opening is None:
            opening = self._opening = asyncio.ensure_future(self._open())
            opening.add_done_callback(self._opened)
        return await asyncio.shield(opening)  # one caller given up does not give up the others' attempt

    def _opened(self, opening: asyncio.Future[_Protocol]) -> None:
        if self._opening is opening:
            self._opening = None
        if not opening.cancelled():
            opening.exception()  # retrieved: every caller of it may have given up

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        t = self._target
        where = self.url
        try:
            if t.path:
                opening = loop.create_unix_connection(_Protocol, t.path)
            else:
                host, port = await self._locator.address()  # a sentinel URL: the master of the moment
                if t.is_sentinel:
                    where = f"{host}:{port} (the master of {self.url})"
                opening = loop.create_connection(_Protocol, host, port)
            _, protocol = await asyncio.wait_for(opening, self.connect_timeout_s)
        except (OSError, TimeoutError) as e:  # the builtins
            raise rx.ConnectionError(f"cannot reach Redis at {where}: {e or type(e).__name__}") from None
        try:
            if t.password is not None:
                auth = (t.username, t.password) if t.username is not None else (t.password,)
                try:
                    await self._send(protocol, ("AUTH", *auth))
                except rx.ResponseError as e:  # as redis-py says it: a ConnectionError, not a reply
                    raise rx.AuthenticationError(f"Redis at {where} refused the login: {e}") from None
            if t.db:
                await self._send(protocol, ("SELECT", t.db))
        except BaseException:
            protocol.close(rx.ConnectionError("the connection's set-up failed"))
            raise
        if self._closed:  # closed while connecting
            protocol.close(rx.ConnectionError("the pipe was closed"))
            raise rx.ConnectionError("the pipe was closed")
        self._protocol = protocol
        return protocol
