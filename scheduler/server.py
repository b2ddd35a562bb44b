"""A scheduler replica's process: `serve_scheduler` (gRPC server with health and reflection, the
reaper) and the `baton scheduler` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass, fields
from typing import Any

import grpc
import redis.asyncio as aioredis

from baton.v1 import scheduler_pb2 as pb
from baton.v1 import scheduler_pb2_grpc
from scheduler.service import ClusterSchedulerConfig, SchedulerServicer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerServer:
    """A running replica: its gRPC server, Redis client and background reaper."""

    server: grpc.aio.Server
    servicer: SchedulerServicer
    client: aioredis.Redis
    reaper: asyncio.Task[None]
    address: str

    async def stop(self, grace_s: float = 2.0) -> None:
        self.reaper.cancel()
        await self.server.stop(grace_s)
        await self.client.aclose()


async def serve_scheduler(config: ClusterSchedulerConfig) -> SchedulerServer:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1._async import HealthServicer
    from grpc_reflection.v1alpha import reflection

    client = aioredis.Redis.from_url(config.redis_url, decode_responses=True, socket_timeout=2.0,
                                     socket_connect_timeout=2.0)
    servicer = SchedulerServicer(config, client)
    await servicer.ensure_default_tenant()
    server = grpc.aio.server()
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [pb.DESCRIPTOR.services_by_name["Scheduler"].full_name, "grpc.health.v1.Health", reflection.SERVICE_NAME],
        server)
    await server.start()
    for name in ("", "baton.v1.Scheduler"):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    reaper = asyncio.create_task(servicer.reap_forever(), name="lease-reaper")
    address = f"{config.host}:{port}"
    log.info("scheduler ready on %s (redis %s)", address, config.redis_url)
    return SchedulerServer(server, servicer, client, reaper, address)


def add_scheduler_parser(sub: Any) -> None:
    d = {f.name: f.default for f in fields(ClusterSchedulerConfig)}
    p = sub.add_parser("scheduler", help="run a scheduler replica (gRPC; state in Redis)")
    p.add_argument("--redis-url", default=d["redis_url"])
    p.add_argument("--host", default=d["host"])
    p.add_argument("--port", type=int, default=d["port"])
    p.add_argument("--prefix", default=d["prefix"], help="Redis key prefix (one per cluster)")
    p.add_argument("--heartbeat-timeout-s", type=float, default=d["heartbeat_timeout_s"])
    p.add_argument("--lease-ttl-s", type=float, default=d["lease_ttl_s"])
    p.add_argument("--queue-timeout-s", type=float, default=d["queue_timeout_s"])
    p.add_argument("--default-tenant", default=d["default_tenant"],
                   help="tenant of requests without an API key ('' = API keys required)")
    p.add_argument("--accept-any-key", action="store_true",
                   help="unknown API keys use the default tenant (a local cluster; OpenAI clients always send one)")
    p.add_argument("--local-prefill-threshold", type=int, default=d["local_prefill_threshold"])
    p.add_argument("--max-prefill-queue", type=int, default=d["max_prefill_queue"],
                   help="prompts a prefill worker holds (prefilling or queued) before requests wait here")
    p.add_argument("--max-decode-queue", type=int, default=d["max_decode_queue"],
                   help="requests a decode worker holds waiting or pulling before requests wait here")
    p.add_argument("--burst-credit-tokens", type=float, default=d["burst_credit_tokens"],
                   help="fair queue: tokens of credit a tenant may bank while idle (0 = plain VTC)")
    p.add_argument("--local-when-prefill-full", action="store_true",
                   help="every prefill worker's queue full: prefill on the decode worker instead of waiting")
    p.set_defaults(func=run_scheduler)


def run_scheduler(args: argparse.Namespace) -> int:
    names = {f.name for f in fields(ClusterSchedulerConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["default_tenant"] = values.get("default_tenant") or None
    asyncio.run(_serve_until_signal(ClusterSchedulerConfig(**values)))
    return 0


async def _serve_until_signal(config: ClusterSchedulerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = await serve_scheduler(config)
    print(f"baton scheduler serving on {server.address} (redis {config.redis_url})", flush=True)
    await stop.wait()
    await server.stop()
