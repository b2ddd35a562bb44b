"""Redis URLs → clients: the one place every process that talks to Redis (scheduler, its `RedisPipe`,
the cancellation bus, workers, `baton tenants`) turns ``--redis-url`` into a connection.

The URLs (docs/SECURITY.md, "Redis"):

* ``redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]`` — plaintext TCP (port 6379, database 0 by default).
  ``USER:PASSWORD`` logs in as a Redis 6 ACL user (``AUTH user password``); ``:PASSWORD`` alone is the
  ``default`` user's password (``requirepass``). Reserved characters in either are %-encoded.
* ``rediss://…`` — the same over TLS. Query options: ``ssl_ca_certs=FILE`` (the CA that signs the
  server's certificate; default: the system's), ``ssl_certfile=FILE`` and ``ssl_keyfile=FILE`` (a client
  certificate, for a server with ``tls-auth-clients yes``), ``ssl_cert_reqs=required|optional|none`` and
  ``ssl_check_hostname=true|false``.
* ``unix:///PATH/redis.sock[?db=DB]`` — a local socket (credentials as above).
* ``redis+sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]…]/MASTER[/DB]`` — Redis Sentinel: the
  hosts are sentinels (port 26379 by default), ``MASTER`` the name they monitor (``sentinel monitor
  MASTER …``). Every new connection asks a sentinel where the master is now, so after a failover
  clients reconnect to the promoted replica. The credentials are the data nodes'; sentinels that
  require their own take ``?sentinel_username=…&sentinel_password=…``. ``rediss+sentinel://`` is TLS
  to the sentinels and the data nodes alike, with the ``ssl_*`` options above.

A malformed URL, an unknown option or a TLS option on a plaintext URL is a `BadRedisUrl` (a
`ValueError`) that says what is wrong, raised before anything connects; messages and logs show a URL
through `redact` (no password). Clients get the scheduler's defaults: 2 s socket timeouts (a hung Redis
shows in 2 s) and one retry of a command whose connection was dropped (after a Redis restart or a
failover the pool's idle connections are dead).
"""

from __future__ import annotations

import re
import ssl
from dataclasses import dataclass, field, replace
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel as syncsentinel
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry as SyncRetry

SCHEMES = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
TIMEOUT_S = 2.0
# The values ssl_cert_reqs and ssl_check_hostname take.
_CERT_REQS = {"required": ssl.CERT_REQUIRED, "optional": ssl.CERT_OPTIONAL, "none": ssl.CERT_NONE}
_BOOLS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}
# The query options (redis-py's keyword arguments of the same names): TLS ones, for rediss URLs only.
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """A parsed Redis URL: where to connect, as whom, and how (`parse_redis_url`)."""

    url: str
    scheme: str
    host: str = ""
    port: int = DEFAULT_PORT
    path: str = ""  # a unix socket
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = ""  # the name the sentinels monitor
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: dict[str, Any] = field(default_factory=dict)  # redis-py's ssl_* keyword arguments

    @property
    def is_sentinel(self) -> bool:
        return self.scheme.endswith("+sentinel")

    @property
    def uses_tls(self) -> bool:
        return self.scheme.startswith("rediss")

    @property
    def redacted(self) -> str:
        """The URL with its passwords replaced by ``***``: what logs and error messages show."""
        return redact(self.url)

    def auth_kwargs(self) -> dict[str, Any]:
        """The data nodes' credentials, database and TLS, as redis-py's keyword arguments."""
        kwargs: dict[str, Any] = {"db": self.db}
        if self.password is not None:
            kwargs["password"] = self.password
            if self.username is not None:
                kwargs["username"] = self.username
        if self.uses_tls:
            kwargs.update(ssl=True, **self.tls)
        return kwargs

    def sentinel_kwargs(
        self, socket_timeout: float | None, socket_connect_timeout: float | None
    ) -> dict[str, Any]:
        """How to connect to a sentinel: no retry (the next sentinel is the retry), the same timeouts."""
        kwargs: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_connect_timeout,
        }
        if self.sentinel_password is not None:
            kwargs["password"] = self.sentinel_password
            if self.sentinel_username is not None:
                kwargs["username"] = self.sentinel_username
        if self.uses_tls:
            kwargs.update(ssl=True, **self.tls)
        return kwargs


def redact(url: str) -> str:
    """``url`` with any password (the data nodes' or the sentinels') replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")  # as `parse_redis_url` reads it: the last @
    if sep and at and ":" in userinfo:
        url = f"{scheme}://{userinfo.partition(':')[0]}:***@{hosts}{slash}{tail}"
    return re.sub(r"([?&]sentinel_password=)[^&#]*", r"\1***", url)


class BadRedisUrl(ValueError):
    """A Redis URL that cannot be used as written; the message names the problem."""


def _bad(url: str, problem: str) -> BadRedisUrl:
    return BadRedisUrl(f"bad Redis URL {redact(url)!r}: {problem}")


def _port(url: str, text: str, default: int) -> int:
    if not text:
        return default
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise _bad(url, f"port {text!r} is not a number from 1 to 65535")
    return int(text)


def _host_port(url: str, text: str, default: int) -> tuple[str, int]:
    """``HOST[:PORT]`` or ``[IPV6][:PORT]``."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise _bad(url, f"{text!r} is not [IPV6]:PORT")
        port_text = rest[1:]
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise _bad(url, f"no host in {text!r}" if text else "no host")
    return unquote(host), _port(url, port_text, default)


def _db(url: str, text: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise _bad(url, f"database {text!r} is not a number")
    return int(text)


def parse_redis_url(url: str) -> RedisTarget:
    """Reads a Redis URL (the module's docstring lists the forms); `BadRedisUrl` naming the problem."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise _bad(url, f"the scheme must be one of {', '.join(s + '://' for s in SCHEMES)}")
    rest, _, fragment = rest.partition("#")
    if fragment:
        raise _bad(url, "a Redis URL has no #fragment")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, _, secret = userinfo.partition(":")
        if not secret and user:
            raise _bad(
                url,
                f"user {unquote(user)!r} has no password "
                "(USER:PASSWORD@, or :PASSWORD@ for the default user's)",
            )
        username, password = unquote(user) or None, unquote(secret) or None
    options = dict(parse_qsl(query, keep_blank_values=True))
    allowed = {"db"} if scheme == "unix" else set()
    if scheme.startswith("rediss"):
        allowed |= set(TLS_OPTIONS)
    if scheme.endswith("+sentinel"):
        allowed |= set(SENTINEL_OPTIONS)
    unknown = sorted(set(options) - allowed)
    if unknown:
        tls_on_plain = [o for o in unknown if o in TLS_OPTIONS]
        if tls_on_plain:
            raise _bad(
                url, f"{', '.join(tls_on_plain)} is a TLS option: use rediss:// (or rediss+sentinel://)"
            )
        raise _bad(
            url,
            f"unknown option {', '.join(unknown)} ({scheme}:// takes {', '.join(sorted(allowed)) or 'none'})",
        )
    target = RedisTarget(url, scheme, username=username, password=password, tls=_tls(url, options))
    if scheme == "unix":
        if hosts:
            raise _bad(url, f"a unix URL has no host ({hosts!r}): unix:///path/to/redis.sock")
        if not path:
            raise _bad(url, "no socket path: unix:///path/to/redis.sock")
        return replace(target, path="/" + unquote(path), db=_db(url, options.get("db", "")))
    if scheme.endswith("+sentinel"):
        if not hosts:
            raise _bad(url, "no sentinel: redis+sentinel://HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]")
        sentinels = tuple(_host_port(url, h, DEFAULT_SENTINEL_PORT) for h in hosts.split(","))
        master, _, db = path.partition("/")
        if not master:
            raise _bad(url, "no master name: redis+sentinel://HOST[:PORT][,HOST[:PORT]...]/MASTER[/DB]")
        if "/" in db:
            raise _bad(url, f"{path!r} is not MASTER[/DB]")
        if "sentinel_username" in options and "sentinel_password" not in options:
            raise _bad(url, "sentinel_username without sentinel_password")
        return replace(
            target,
            sentinels=sentinels,
            master=unquote(master),
            db=_db(url, db),
            sentinel_username=options.get("sentinel_username"),
            sentinel_password=options.get("sentinel_password"),
        )
    if "," in hosts:
        raise _bad(url, "several hosts need a redis+sentinel:// URL")
    host, port = _host_port(url, hosts, DEFAULT_PORT)
    if "/" in path:
        raise _bad(url, f"{path!r} is not a database number")
    return replace(target, host=host, port=port, db=_db(url, path))


def _tls(url: str, options: dict[str, str]) -> dict[str, Any]:
    tls: dict[str, Any] = {
        k: options[k] for k in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile") if k in options
    }
    if "ssl_keyfile" in tls and "ssl_certfile" not in tls:
        raise _bad(url, "ssl_keyfile without ssl_certfile (the client certificate it is the key of)")
    if "ssl_cert_reqs" in options:
        reqs = options["ssl_cert_reqs"].lower()
        if reqs not in _CERT_REQS:
            raise _bad(
                url, f"ssl_cert_reqs must be required, optional or none, not {options['ssl_cert_reqs']!r}"
            )
        tls["ssl_cert_reqs"] = _CERT_REQS[reqs]
    if "ssl_check_hostname" in options:
        check = options["ssl_check_hostname"].lower()
        if check not in _BOOLS:
            raise _bad(
                url, f"ssl_check_hostname must be true or false, not {options['ssl_check_hostname']!r}"
            )
        tls["ssl_check_hostname"] = _BOOLS[check]
    elif tls.get("ssl_cert_reqs") == ssl.CERT_NONE:  # no certificate checked: no name to check either
        tls["ssl_check_hostname"] = False
    return tls


def _target(url: str | RedisTarget) -> RedisTarget:
    return url if isinstance(url, RedisTarget) else parse_redis_url(url)


class _SentinelMaster(aioredis.Redis):
    """The master's client of a sentinel URL: closing it also closes its sentinels' connections."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        pool = self.connection_pool
        if isinstance(pool, aiosentinel.SentinelConnectionPool):
            await pool.sentinel_manager.aclose()


class _SyncSentinelMaster(redis.Redis):
    def close(self) -> None:
        super().close()
        pool = self.connection_pool
        if isinstance(pool, syncsentinel.SentinelConnectionPool):
            for sentinel in pool.sentinel_manager.sentinels:
                sentinel.close()


def async_client(
    url: str | RedisTarget,
    *,
    decode_responses: bool = True,
    socket_timeout: float | None = TIMEOUT_S,
    socket_connect_timeout: float | None = TIMEOUT_S,
    retries: int = 1,
) -> aioredis.Redis:
    """A `redis.asyncio` client of ``url``: a command whose connection dropped is tried again
    ``retries`` times on a new connection (which, for a sentinel URL, goes to the master of the
    moment); timeouts are not retried."""
    t = _target(url)
    retry = Retry(NoBackoff(), retries, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = dict(
        decode_responses=decode_responses,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        retry=retry,
        **t.auth_kwargs(),
    )
    if t.is_sentinel:
        sentinel = aiosentinel.Sentinel(
            list(t.sentinels),
            sentinel_kwargs={
                **t.sentinel_kwargs(socket_timeout, socket_connect_timeout),
                "retry": Retry(NoBackoff(), 0),
            },
        )
        return cast(aioredis.Redis, sentinel.master_for(t.master, redis_class=_SentinelMaster, **common))
    if t.path:
        return aioredis.Redis(unix_socket_path=t.path, **common)
    return aioredis.Redis(host=t.host, port=t.port, **common)


def sync_client(
    url: str | RedisTarget,
    *,
    decode_responses: bool = True,
    socket_timeout: float | None = TIMEOUT_S,
    socket_connect_timeout: float | None = TIMEOUT_S,
    retries: int = 1,
) -> redis.Redis:
    """`async_client`'s blocking twin (`redis.Redis`), for tools and probes that are not on an event loop."""
    t = _target(url)
    retry = SyncRetry(NoBackoff(), retries, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = dict(
        decode_responses=decode_responses,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_connect_timeout,
        retry=retry,
        **t.auth_kwargs(),
    )
    if t.is_sentinel:
        sentinel = syncsentinel.Sentinel(
            list(t.sentinels),
            sentinel_kwargs={
                **t.sentinel_kwargs(socket_timeout, socket_connect_timeout),
                "retry": SyncRetry(NoBackoff(), 0),
            },
        )
        master = sentinel.master_for(t.master, redis_class=_SyncSentinelMaster, **common)
        return cast(redis.Redis, master)
    if t.path:
        return redis.Redis(unix_socket_path=t.path, **common)
    return redis.Redis(host=t.host, port=t.port, **common)


def own_pool(client: aioredis.Redis, max_connections: int, retries: int = 0) -> aioredis.Redis:
    """A client to the same Redis as ``client`` (the same master, for a sentinel URL) with a pool of
    its own (closed with ``aclose(close_connection_pool=True)``): a pub/sub listener's, say, whose
    dropped connection must surface rather than be retried."""
    pool = client.connection_pool
    kwargs: dict[str, Any] = {
        **pool.connection_kwargs,
        "retry": Retry(NoBackoff(), retries),
        "max_connections": max_connections,
        "connection_class": pool.connection_class,
    }
    if isinstance(pool, aiosentinel.SentinelConnectionPool):
        kwargs.pop("connection_pool", None)  # the new pool puts itself there
        copy = aiosentinel.SentinelConnectionPool(  # type: ignore[no-untyped-call]  # redis-py, untyped
            pool.service_name, pool.sentinel_manager, **kwargs
        )
        return aioredis.Redis(connection_pool=copy)
    return aioredis.Redis(connection_pool=aioredis.ConnectionPool(**kwargs))


class MasterLocator:
    """Where a raw connection of ``url`` goes now (`RedisPipe`): the URL's host, or for a sentinel URL
    the master the sentinels name at this moment (asked again on every call)."""

    def __init__(self, url: str | RedisTarget, timeout_s: float = TIMEOUT_S) -> None:
        self.target = _target(url)
        self._sentinel: aiosentinel.Sentinel | None = None
        if self.target.is_sentinel:
            self._sentinel = aiosentinel.Sentinel(
                list(self.target.sentinels),
                sentinel_kwargs={
                    **self.target.sentinel_kwargs(timeout_s, timeout_s),
                    "retry": Retry(NoBackoff(), 0),
                },
            )

    async def address(self) -> tuple[str, int]:
        """(host, port) of the master; `redis.exceptions.ConnectionError` (MasterNotFoundError) when no
        sentinel names one."""
        if self._sentinel is None:
            return self.target.host, self.target.port
        host, port = await self._sentinel.discover_master(self.target.master)
        return str(host), int(port)

    async def aclose(self) -> None:
        if self._sentinel is not None:
            await self._sentinel.aclose()
