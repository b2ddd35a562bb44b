"""A scheduler replica's process: `serve_scheduler` (gRPC server with health and reflection, the
reaper, ``GET /metrics`` on its own port) and the `baton scheduler` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Any

import grpc
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from baton.v1 import scheduler_pb2 as pb
from rpc.flags import add_flags, config_from_args
from rpc.liveness import SERVER_OPTIONS, shutdown_step
from rpc.metrics import Forward, MetricsEndpoint
from rpc.redis_url import BadRedisUrl, async_client, parse_redis_url, redact
from rpc.servicer import add_servicer
from rpc.signals import stop_requested
from rpc.tls import add_port
from scheduler import metrics
from scheduler.config import SchedulerProcessConfig
from scheduler.leases import LeaseState
from scheduler.redis_pipe import RedisPipe
from scheduler.service import ClusterSchedulerConfig, SchedulerServicer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerServer:
    """A running replica: its gRPC server, Redis client, background reaper and metrics endpoint."""

    server: grpc.aio.Server
    servicer: SchedulerServicer
    client: aioredis.Redis
    reaper: asyncio.Task[None]
    address: str
    metrics_endpoint: MetricsEndpoint | None = None
    pipe: RedisPipe | None = None

    @property
    def metrics_url(self) -> str:
        return self.metrics_endpoint.url if self.metrics_endpoint is not None else ""

    async def stop(self, grace_s: float = 2.0) -> None:
        self.reaper.cancel()
        if self.metrics_endpoint is not None:
            await shutdown_step("the metrics endpoint", self.metrics_endpoint.stop(), 5.0)
        await shutdown_step("the gRPC server", self.server.stop(grace_s), grace_s + 5.0)
        await shutdown_step("the Redis client", self.client.aclose(), 5.0)
        if self.pipe is not None:
            await self.pipe.close()


class RedisUnusable(RuntimeError):
    """The replica could not start: its Redis refused the login, or could not be reached."""


def redis_client(url: str) -> aioredis.Redis:
    """The replica's redis-py client (everything but the per-request scripts, which use `RedisPipe`),
    from any URL `rpc.redis_url` reads (ACL user, TLS, Sentinel). A command whose connection was dropped
    is retried once on a new connection: after a Redis restart or failover the pool's idle connections
    are dead, and without it the first command on each would fail. Timeouts are not retried: a hung
    Redis must show within the 2 s socket timeout."""
    return async_client(url, decode_responses=True, socket_timeout=2.0, socket_connect_timeout=2.0, retries=1)


async def read_cluster_state(servicer: SchedulerServicer) -> metrics.ClusterState:
    """The cluster state one scrape shows, read from Redis (``redis_up`` False if it cannot be)."""
    state = metrics.ClusterState(waiting_here=servicer.waiting_here, waiting_for=servicer.waiting_for)
    try:
        counts = await servicer.leases.counts()
        totals = await servicer.leases.totals()
        state.stranded_blocks = await servicer.leases.stranded_blocks()
        state.queue_depth = await servicer.queue.depth()
        views = await servicer.registry.all_workers()
    except RedisError as e:
        log.warning("metrics: Redis unavailable (%s)", e)
        return state
    state.redis_up = True
    state.leases_active = {
        s.value: n for s, n in counts.items() if s in (LeaseState.PINNED, LeaseState.PULLING)
    }
    state.leases_total = {s.value: n for s, n in totals.items()}
    for view in views:
        r, load = view.record, view.load
        key = (r.model, r.version, r.role, "draining" if view.draining else "serving")
        state.workers[key] = state.workers.get(key, 0) + 1
        if not view.draining:
            pool = state.pools.setdefault(r.role, metrics.PoolLoad())
            pool.add(load.running, load.waiting, load.queued_tokens, r.num_blocks, load.free_blocks)
    return state


async def serve_scheduler(
    config: ClusterSchedulerConfig, metrics_port: int | None = 0, metrics_max_tenants: int | None = None
) -> SchedulerServer:
    """Starts a replica; ``metrics_port`` None serves no metrics (0: any free port)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer
    from grpc_reflection.v1alpha import reflection

    client = redis_client(config.redis_url)  # a malformed URL: ValueError, before anything starts
    # The per-request quota scripts on a pipelined connection of their own (scheduler.redis_pipe).
    pipe = RedisPipe(config.redis_url, timeout_s=2.0) if RedisPipe.supports(config.redis_url) else None
    servicer = SchedulerServicer(config, client, pipe)
    try:  # the first Redis call: a wrong password or an unreachable Redis refuses now, saying so
        await servicer.ensure_default_tenant()
    except RedisError as e:
        await client.aclose()
        if pipe is not None:
            await pipe.close()
        raise RedisUnusable(
            f"cannot use Redis at {redact(config.redis_url)}: {type(e).__name__}: {e}"
        ) from None
    server = grpc.aio.server(options=SERVER_OPTIONS)  # the clients' keepalive PINGs (rpc.liveness)
    port = add_port(server, f"{config.host}:{config.port}", config.tls.load())  # mutual TLS if configured
    add_servicer(
        servicer, server, pb.DESCRIPTOR.services_by_name["Scheduler"]
    )  # malformed → INVALID_ARGUMENT
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            pb.DESCRIPTOR.services_by_name["Scheduler"].full_name,
            "grpc.health.v1.Health",
            reflection.SERVICE_NAME,
        ],
        server,
    )
    await server.start()
    for name in ("", "baton.v1.Scheduler"):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    reaper = asyncio.create_task(servicer.reaper.reap_forever(), name="lease-reaper")
    address = f"{config.host}:{port}"
    scheduler = SchedulerServer(server, servicer, client, reaper, address, pipe=pipe)
    if metrics_max_tenants is not None:
        metrics.TENANTS.limit = metrics_max_tenants
    if metrics_port is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Forward(metrics.REGISTRY))
        state = metrics.ClusterStateCollector()
        registry.register(state)

        async def refresh() -> None:
            state.state = await read_cluster_state(servicer)

        scheduler.metrics_endpoint = MetricsEndpoint(registry, refresh)
        try:
            await scheduler.metrics_endpoint.start(config.host, metrics_port)
        except BaseException:
            await scheduler.stop(0)
            raise
    log.info(
        "scheduler ready on %s (redis %s, metrics %s)",
        address,
        redact(config.redis_url),
        scheduler.metrics_url or "off",
    )
    return scheduler


def add_scheduler_parser(sub: Any) -> None:
    p = sub.add_parser("scheduler", help="run a scheduler replica (gRPC; state in Redis)")
    add_flags(p, SchedulerProcessConfig)
    p.set_defaults(func=run_scheduler, parser=p)


def run_scheduler(args: argparse.Namespace) -> int:
    config = config_from_args(SchedulerProcessConfig, args, args.parser)
    try:
        parse_redis_url(config.scheduler.redis_url)
        asyncio.run(_serve_until_signal(config.scheduler, config.metrics_port, config.metrics_max_tenants))
    except (RedisUnusable, BadRedisUrl) as e:
        print(f"baton scheduler: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


async def _serve_until_signal(
    config: ClusterSchedulerConfig, metrics_port: int | None, max_tenants: int
) -> None:
    stop = stop_requested()
    server = await serve_scheduler(config, metrics_port, max_tenants)
    print(f"baton scheduler serving on {server.address} (redis {redact(config.redis_url)})", flush=True)
    if server.metrics_url:
        print(f"baton scheduler metrics on {server.metrics_url}", flush=True)
    await stop.wait()
    await server.stop()
