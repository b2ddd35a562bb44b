"""RedisPipe against a real redis-server: replies matched to callers, errors as redis-py raises
them, cancellation and timeouts that keep the connection in step, and an outage it heals from."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis import exceptions as rx

from scheduler.redis_pipe import PipeScript, RedisPipe
from scheduler.redis_server import RedisServer, redis_binary

pytestmark = pytest.mark.unit


def test_commands_get_their_own_replies_when_many_are_in_flight(url: str) -> None:
    async def body() -> None:
        pipe = RedisPipe(url)
        assert await pipe.execute("SET", "k", "v") == "OK"
        assert await pipe.execute("GET", "k") == "v"
        assert await pipe.execute("GET", "missing") is None
        assert await pipe.execute("INCRBY", "n", 5) == 5
        assert await pipe.execute("RPUSH", "l", "a", 1, 2.5) == 3
        assert await pipe.execute("LRANGE", "l", 0, -1) == ["a", "1", "2.5"]
        # 300 callers on one connection at once: each gets the reply to its own command.
        replies = await asyncio.gather(*(pipe.execute("ECHO", f"call-{i}") for i in range(300)))
        assert replies == [f"call-{i}" for i in range(300)]
        await pipe.close()

    asyncio.run(body())


def test_an_error_reply_raises_and_the_connection_stays_usable(url: str) -> None:
    async def body() -> None:
        pipe = RedisPipe(url)
        await pipe.execute("SET", "s", "text")
        with pytest.raises(rx.ResponseError, match="not an integer"):
            await pipe.execute("INCR", "s")
        with pytest.raises(rx.ResponseError, match="unknown command"):
            await pipe.execute("NOSUCHCOMMAND")
        assert await pipe.execute("GET", "s") == "text"
        await pipe.close()

    asyncio.run(body())


def test_a_script_redis_does_not_know_is_loaded_and_run(url: str, redis_client: redis.Redis) -> None:
    script = PipeScript("return {KEYS[1], ARGV[1], redis.call('INCRBY', KEYS[1], ARGV[1])}")

    async def body() -> None:
        pipe = RedisPipe(url)
        assert await pipe.evalsha(script, ["counter"], [3]) == ["counter", "3", 3]
        redis_client.script_flush()  # as after a restart of Redis
        assert await pipe.evalsha(script, ["counter"], [4]) == ["counter", "4", 7]
        with pytest.raises(rx.ResponseError):  # a script error is the caller's, not a reload
            await pipe.evalsha(PipeScript("return redis.call('INCR', KEYS[1], 'one too many')"), ["x"], [])
        await pipe.close()

    asyncio.run(body())


def test_a_cancelled_caller_leaves_the_replies_in_step(url: str) -> None:
    async def body() -> None:
        pipe = RedisPipe(url)
        blocked = asyncio.create_task(pipe.execute("BLPOP", "empty-list", 0.3))  # holds the connection 0.3 s
        await asyncio.sleep(0.05)
        after = asyncio.create_task(pipe.execute("ECHO", "after"))  # queued behind it on the connection
        await asyncio.sleep(0.05)
        blocked.cancel()  # its reply (nil) still comes, first: it must not go to the next caller
        assert await after == "after"
        assert await pipe.execute("ECHO", "again") == "again"
        with pytest.raises(asyncio.CancelledError):
            await blocked
        await pipe.close()

    asyncio.run(body())


def test_a_reply_that_takes_too_long_times_out_and_the_next_call_reconnects(url: str) -> None:
    async def body() -> None:
        pipe = RedisPipe(url, timeout_s=0.2)
        slow = asyncio.create_task(pipe.execute("BLPOP", "empty-list", 1))
        await asyncio.sleep(0.02)
        behind = asyncio.create_task(pipe.execute("ECHO", "behind"))
        with pytest.raises(rx.TimeoutError, match="did not answer"):
            await slow
        with pytest.raises(rx.RedisError):  # its connection was given up: the call behind fails too
            await behind
        assert await pipe.execute("ECHO", "fresh") == "fresh"  # a new connection
        await pipe.close()

    asyncio.run(body())


@pytest.mark.redis  # a redis-server of its own
def test_an_outage_fails_the_calls_and_service_resumes_when_redis_is_back() -> None:
    server = RedisServer().start()

    async def body() -> None:
        pipe = RedisPipe(server.url, timeout_s=1.0)
        assert await pipe.execute("SET", "k", "1") == "OK"
        in_flight = asyncio.create_task(pipe.execute("BLPOP", "empty-list", 5))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(server.kill)
        with pytest.raises(rx.ConnectionError):
            await in_flight
        with pytest.raises(rx.ConnectionError, match="cannot reach Redis"):
            await pipe.execute("GET", "k")
        await asyncio.to_thread(server.start)
        assert await pipe.execute("SET", "k", "2") == "OK"  # reconnected by itself
        await pipe.close()

    try:
        asyncio.run(body())
    finally:
        server.stop()


def test_the_url_names_the_database(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    other = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/3", decode_responses=True)
    other.flushdb()

    async def body() -> None:
        pipe = RedisPipe(redis_server.url.rsplit("/", 1)[0] + "/3")
        await pipe.execute("SET", "in-db-3", "yes")
        await pipe.close()

    asyncio.run(body())
    assert other.get("in-db-3") == "yes" and redis_client.get("in-db-3") is None
    other.flushdb()
    other.close()
    assert RedisPipe.supports("unix:///tmp/redis.sock") and not RedisPipe.supports("rediss://host:6380/0")
    with pytest.raises(ValueError, match="redis:// and unix://"):
        RedisPipe("rediss://host:6380/0")


@pytest.mark.redis  # a redis-server of its own
def test_a_unix_socket_url(tmp_path: Path) -> None:
    socket_path = tmp_path / "redis.sock"
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            "0",
            "--unixsocket",
            str(socket_path),
            "--save",
            "",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not socket_path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

        async def body() -> str:
            pipe = RedisPipe(f"unix://{socket_path}")
            await pipe.execute("SET", "k", "over a unix socket")
            reply: str = await pipe.execute("GET", "k")
            await pipe.close()
            return reply

        assert asyncio.run(body()) == "over a unix socket"
    finally:
        proc.terminate()
        proc.wait(5)


def test_callers_during_an_outage_share_one_connection_attempt() -> None:
    """A partitioned network (connects that hang until their timeout) cannot be made on this machine:
    `_open` is replaced by one that takes 0.3 s to fail. 20 callers then fail together after one
    attempt, not one after another (20 × 0.3 s); one caller giving up does not end the attempt."""

    class Partitioned(RedisPipe):
        attempts = 0

        async def _open(self) -> Any:
            Partitioned.attempts += 1
            await asyncio.sleep(0.3)
            raise rx.ConnectionError("cannot reach Redis: timed out")

    async def body() -> float:
        pipe = Partitioned("redis://10.255.255.1:6379/0")
        impatient = asyncio.create_task(pipe.execute("GET", "k"))
        await asyncio.sleep(0.05)
        impatient.cancel()
        t0 = time.monotonic()
        results = await asyncio.gather(*(pipe.execute("GET", "k") for _ in range(20)), return_exceptions=True)
        assert all(isinstance(r, rx.ConnectionError) for r in results), results
        return time.monotonic() - t0

    took = asyncio.run(body())
    assert Partitioned.attempts == 1 and took < 1.0, (Partitioned.attempts, took)


def test_a_bad_argument_fails_its_own_call_only(url: str) -> None:
    async def body() -> None:
        pipe = RedisPipe(url)
        await pipe.execute("SET", "a", "A")
        await pipe.execute("SET", "b", "B")
        bad = asyncio.create_task(pipe.execute("SET", "x", True))  # type: ignore[arg-type]
        replies = await asyncio.gather(pipe.execute("GET", "a"), pipe.execute("GET", "b"))
        with pytest.raises(rx.DataError, match="str, bytes, int or float"):
            await bad
        assert replies == ["A", "B"]  # each caller still gets its own reply
        await pipe.close()

    asyncio.run(body())


def test_a_closed_pipe_refuses_calls_also_when_closed_while_connecting(url: str) -> None:
    async def body() -> None:
        pipe = RedisPipe(url)
        connecting = asyncio.create_task(pipe.execute("PING"))
        await asyncio.sleep(0)  # the attempt to connect is under way
        await pipe.close()
        with pytest.raises(rx.ConnectionError, match="closed"):
            await connecting
        with pytest.raises(rx.ConnectionError, match="closed"):
            await pipe.execute("PING")
        assert pipe._protocol is None  # nothing left open

    asyncio.run(body())


@pytest.mark.redis  # a redis-server of its own
def test_the_schedulers_redis_py_client_survives_a_restart_of_redis() -> None:
    """The scheduler's redis-py client (scheduler.server.redis_client): after Redis restarts, the idle
    connections in its pool are dead; each command on one is retried once on a new connection instead
    of failing. The pipe, whose connection saw the close, reconnects by itself."""
    from scheduler.server import redis_client

    server = RedisServer().start()

    async def body() -> None:
        client, pipe = redis_client(server.url), RedisPipe(server.url)
        await asyncio.gather(*(client.blpop(["empty"], 0.05) for _ in range(8)))  # 8 pooled connections
        await pipe.execute("PING")
        await asyncio.to_thread(server.kill)
        await asyncio.to_thread(server.start)
        assert await asyncio.gather(*(client.set(f"k{i}", i) for i in range(8))) == [True] * 8
        assert await pipe.execute("GET", "k3") == "3"
        await client.aclose()
        await pipe.close()

    try:
        asyncio.run(body())
    finally:
        server.stop()
