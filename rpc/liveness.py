"""How a peer that stops answering is noticed on a gRPC connection that stays open.

A process that dies closes its sockets, and every call on them fails at once. One that hangs (SIGSTOP,
a stuck host) or sits behind a partition does not: its kernel may still hold the connection open, and a
stream waiting for its next token would wait forever. So every internal channel sends HTTP/2 PINGs
while it has calls in flight (``KEEPALIVE_S`` apart, even when no data moves), and a PING not answered
within twice that closes the connection: its calls fail UNAVAILABLE, and the gateway goes
on elsewhere as for a dead worker (a stream migrates token-exactly). The PING is answered by gRPC's
transport, not by the engine, so a busy worker is not mistaken for a hung one. Servers must accept
PINGs that often (gRPC's default is one per five minutes, and a client that pings more is cut off):
every Baton server is built with `SERVER_OPTIONS`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

log = logging.getLogger(__name__)

KEEPALIVE_S = 2.0  # the gateway's --worker-keepalive-s default


def keepalive_options(every_s: float) -> tuple[tuple[str, int], ...]:
    """A client's options: PING every ``every_s`` while calls are in flight (without limit on PINGs
    between data frames); one unanswered for twice that closes the connection."""
    return (
        ("grpc.keepalive_time_ms", round(every_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(every_s * 2000)),
        ("grpc.http2.ping_timeout_ms", round(every_s * 2000)),  # what gRPC 1.6x+ waits for the ack by
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.http2.max_pings_without_data", 0),
    )


# Every internal channel's (rpc.tls.channel), unless its caller gives its own.
CLIENT_OPTIONS = keepalive_options(KEEPALIVE_S)

# Servers: accept a client's PINGs down to half the interval (never a strike that closes it).
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_recv_ping_interval_without_data_ms", round(KEEPALIVE_S * 500)),
    ("grpc.http2.max_ping_strikes", 0),
)


async def shutdown_step(what: str, step: Awaitable[object], limit_s: float) -> None:
    """One step of a server's shutdown, given up after ``limit_s`` seconds (with a warning naming it).

    A deadline that gRPC enforces (a call's ``timeout``, ``server.stop(grace)``) is delivered to the
    event loop by gRPC's own poller; in 2 of 108 runs of one test on a loaded machine a completion never
    arrived and ``stop()`` waited forever with nothing else pending. Bounded here by an asyncio timer,
    a shutdown always ends and says which step overran."""
    try:
        await asyncio.wait_for(step, limit_s)
    except TimeoutError:
        log.warning("shutdown: %s did not finish in %g s; going on without it", what, limit_s)
