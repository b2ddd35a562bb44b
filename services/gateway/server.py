"""The gateway process: `GatewayConfig`, `baton gateway`, and `serve_gateway`, which runs the gRPC
`baton.v1.Gateway` service (with health and reflection) and the OpenAI HTTP API on one asyncio loop.

It never imports torch: tokenization and chat templates come from `engine.tokenizer`. Requests are
placed by the cluster scheduler (``--scheduler``), which also tells the served model, its versions and
context length; or, without one, round-robin over configured workers, whose Info tells the model.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.v1 import gateway_pb2
from core.errors import ModelLoadError, Unavailable
from engine.tokenizer import Tokenizer
from rpc.flags import add_flags
from rpc.liveness import SERVER_OPTIONS
from rpc.metrics import BoundedLabel, MetricsEndpoint
from rpc.servicer import add_servicer
from rpc.signals import stop_requested
from rpc.tls import Tls, add_port
from services.gateway import metrics
from services.gateway.admission import Limits, ModelInfo, load_tokenizer, vocab_size
from services.gateway.auth import GrpcKeyInterceptor, KeyCheck
from services.gateway.config import GatewayConfig
from services.gateway.convert import lenient_deserializer
from services.gateway.dispatch import Dispatcher
from services.gateway.http_api import HttpApi
from services.gateway.router import Router, SchedulerRouter, StaticRouter
from services.gateway.servicer import GatewayServicer
from services.gateway.shadow import ShadowTraffic
from services.gateway.worker_clients import WorkerClients

__all__ = ["GatewayConfig", "GatewayServer", "add_gateway_parser", "serve_gateway"]

log = logging.getLogger(__name__)

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
HEALTH_PROBE_INTERVAL_S = 5.0


def add_gateway_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Registers `baton gateway`."""
    p = sub.add_parser("gateway", help="serve the gRPC and OpenAI HTTP APIs in front of the workers")
    add_flags(p, GatewayConfig)
    p.set_defaults(func=run_gateway, parser=p)


class GatewayServer:
    """A running gateway: its bound ports, and `stop()`."""

    def __init__(
        self,
        config: GatewayConfig,
        grpc_server: grpc.aio.Server,
        runner: web.AppRunner,
        grpc_port: int,
        http_port: int,
        dispatcher: Dispatcher,
        workers: WorkerClients,
        executor: ThreadPoolExecutor,
        health_task: asyncio.Task[None],
        router: Router,
        health_servicer: health.aio.HealthServicer,
        metrics_endpoint: MetricsEndpoint,
    ) -> None:
        self.config = config
        self.grpc_port = grpc_port
        self.http_port = http_port
        self.dispatcher = dispatcher
        self._grpc_server = grpc_server
        self._runner = runner
        self._workers = workers
        self._executor = executor
        self._health_task = health_task
        self._router = router
        self._health = health_servicer
        self.metrics_endpoint = metrics_endpoint  # its url is "" unless --metrics-port

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls.tls_dir else "http"
        return f"{scheme}://{self.config.host}:{self.http_port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drains, then stops. At once: the health check says NOT_SERVING (a readiness probe fails, so
        Kubernetes stops sending here) and new requests get UNAVAILABLE; the requests in flight have
        ``grace_s`` seconds (default ``--drain-timeout-s``) to finish, and those still running then end
        with UNAVAILABLE (`Dispatcher.shutdown`)."""
        self._health_task.cancel()
        self.dispatcher.drain()
        for service in ("", GATEWAY_SERVICE):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        grace = self.config.drain_timeout_s if grace_s is None else grace_s
        log.info(
            "gateway draining: %d requests in flight, %g s to finish", self.dispatcher.num_in_flight, grace
        )
        await self.dispatcher.shutdown(grace)
        await self._grpc_server.stop(1.0)  # the streams have ended: this only flushes their last messages
        await self._runner.cleanup()
        await self.metrics_endpoint.stop()
        await self._router.close()
        await self._workers.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("gateway stopped")


Health = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]  # (serving, details for /health)


async def _static_model(
    config: GatewayConfig, workers: WorkerClients, model_dir: Path, tokenizer: Tokenizer
) -> ModelInfo:
    """The model version the configured workers serve (all must agree), from their Info."""
    infos = await workers.wait_ready(
        (*config.prefill_workers, *config.decode_workers), config.startup_timeout
    )
    digests = {info.model_digest for info in infos.values()}
    if len(digests) != 1:
        detail = ", ".join(f"{a}: {i.model_digest}" for a, i in infos.items())
        raise Unavailable(f"the workers serve different model versions ({detail})")
    decode = [infos[a] for a in config.decode_workers]
    return ModelInfo(
        name=config.served_model_name or decode[0].model or model_dir.name,
        version=decode[0].model_digest,
        max_model_len=min(i.max_model_len for i in decode),
        vocab_size=vocab_size(model_dir, tokenizer),
    )


async def _scheduler_model(
    config: GatewayConfig, router: SchedulerRouter, model_dir: Path, tokenizer: Tokenizer
) -> ModelInfo:
    """The served model from the scheduler's ListModelVersions, retried until a worker of it has
    registered (a cluster starts in any order). Its context is the smallest of its versions'."""
    deadline = time.monotonic() + config.startup_timeout
    delay, problem = 0.1, "no worker has registered yet"
    while True:
        try:
            serving = [v for v in await router.list_versions(timeout_s=2.0) if v.num_workers > 0]
            names = sorted({v.model for v in serving})
            if config.served_model_name is None and len(names) > 1:
                raise ModelLoadError(
                    f"the scheduler serves several models ({', '.join(names)}): name the one "
                    "this gateway serves with --served-model-name"
                )
            name = config.served_model_name or (names[0] if names else "")
            versions = [v for v in serving if v.model == name]
            if versions:
                break
            if name:
                problem = f"no worker serving {name!r} has registered"
        except Unavailable as e:
            problem = e.message
        if time.monotonic() >= deadline:
            raise Unavailable(
                f"no worker was ready at the scheduler {router.address} within "
                f"{config.startup_timeout:g} s: {problem}"
            )
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)
    main = max(versions, key=lambda v: (v.weight, v.num_workers, v.version))
    return ModelInfo(
        name=name,
        version=main.version,
        max_model_len=min(v.max_model_len for v in versions),
        vocab_size=vocab_size(model_dir, tokenizer),
    )


def _static_health(workers: WorkerClients, addresses: tuple[str, ...]) -> Health:
    async def check() -> tuple[bool, dict[str, Any]]:
        problems = await workers.probe(addresses)
        ok = all(p is None for p in problems.values())
        return ok, {"workers": {a: "ok" if p is None else p for a, p in problems.items()}}

    return check


def _scheduler_health(router: SchedulerRouter, model: str) -> Health:
    async def check() -> tuple[bool, dict[str, Any]]:
        try:
            versions = await router.list_versions(model, timeout_s=1.0)
        except Unavailable as e:
            return False, {"scheduler": e.message}
        num_workers = {v.version: v.num_workers for v in versions}
        return sum(num_workers.values()) > 0, {"scheduler": "ok", "workers_per_version": num_workers}

    return check


async def _watch_health(check: Health, servicer: health.aio.HealthServicer) -> None:
    """Keeps the gRPC health status true: NOT_SERVING while a worker (or the scheduler) is silent."""
    while True:
        ok, _ = await check()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GATEWAY_SERVICE):
            await servicer.set(service, status)
        await asyncio.sleep(HEALTH_PROBE_INTERVAL_S)


def _grpc_server(
    config: GatewayConfig, dispatcher: Dispatcher, keys: KeyCheck | None, tls: Tls | None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The gRPC server (Gateway, health, reflection) bound to its port, not yet started; with
    ``keys``, every method but health's needs a valid API key."""
    server = grpc.aio.server(
        interceptors=[] if keys is None else [GrpcKeyInterceptor(keys)],
        options=[
            ("grpc.max_receive_message_length", config.max_request_bytes),
            ("grpc.max_concurrent_streams", config.max_streams_per_connection),
            ("grpc.so_reuseport", 0),  # a port already in use is an error, not a shared port
            *SERVER_OPTIONS,  # clients' keepalive PINGs (rpc.liveness)
        ],
    )
    add_servicer(
        GatewayServicer(dispatcher, config.max_session_requests),
        server,
        gateway_pb2.DESCRIPTOR.services_by_name["Gateway"],
        deserializer=lenient_deserializer,
        pass_undecodable=True,
    )  # a Session fails an undecodable request alone
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (
            GATEWAY_SERVICE,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    try:
        port = add_port(server, f"{config.host}:{config.grpc_port}", tls, mutual=False)  # clients: API keys
    except RuntimeError as e:
        raise Unavailable(f"cannot listen for gRPC on {config.host}:{config.grpc_port}: {e}") from None
    return server, health_servicer, port


async def _http_server(
    config: GatewayConfig, http: HttpApi, keys: KeyCheck | None, tls: Tls | None
) -> tuple[web.AppRunner, int]:
    """The HTTP API started on its port; a client that disconnects cancels its handler."""
    runner = web.AppRunner(
        http.app(config.max_request_bytes, keys),
        handler_cancellation=True,
        access_log=None,
        # From connecting (or the last response) to a request's last header byte, and idle after: a
        # slowloris client that trickles its headers is closed then.
        keepalive_timeout=config.http_read_timeout_s,
    )
    await runner.setup()
    try:
        context = None if tls is None else tls.server_context()
        await web.TCPSite(runner, config.host, config.http_port, ssl_context=context).start()
    except OSError as e:
        await runner.cleanup()
        raise Unavailable(f"cannot listen for HTTP on {config.host}:{config.http_port}: {e}") from None
    return runner, int(runner.addresses[0][1])


async def _routing(
    config: GatewayConfig, workers: WorkerClients, executor: ThreadPoolExecutor, tls: Tls | None
) -> tuple[Tokenizer, ModelInfo, Router, Health]:
    """The tokenizer, the served model, the router and the health check, for a scheduler or static workers."""
    model_dir, tokenizer = await load_tokenizer(config.model, executor)
    if config.scheduler:
        router = SchedulerRouter(config.scheduler, config.scheduler_timeout, tls)
        try:
            model = await _scheduler_model(config, router, model_dir, tokenizer)
        except BaseException:
            await router.close()
            raise
        check = _scheduler_health(router, model.name)
        log.info(
            "model %s version %s max_model_len %d (scheduler %s)",
            model.name,
            model.version,
            model.max_model_len,
            config.scheduler,
        )
        return tokenizer, model, router, check
    model = await _static_model(config, workers, model_dir, tokenizer)
    static = StaticRouter(config.prefill_workers, config.decode_workers, config.local_prefill_threshold)
    addresses = tuple(dict.fromkeys((*config.prefill_workers, *config.decode_workers)))
    log.info(
        "model %s version %s max_model_len %d (static placement)",
        model.name,
        model.version,
        model.max_model_len,
    )
    return tokenizer, model, static, _static_health(workers, addresses)


async def serve_gateway(config: GatewayConfig) -> GatewayServer:
    """Starts the gateway on the running loop once the model is known; returns the running server."""
    executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="gateway-tokenizer")
    tls = config.tls.load()
    workers = WorkerClients(tls, config.worker_keepalive_s)
    router: Router | None = None
    try:
        tokenizer, model, router, check = await _routing(config, workers, executor, tls)
        limits = Limits(
            config.max_prompt_tokens,
            config.max_output_tokens,
            config.max_buffered_tokens,
            config.max_migrations,
        )
        shadows = ShadowTraffic(
            workers, config.max_shadow_requests, config.shadow_timeout, router.report_shadow
        )
        dispatcher = Dispatcher(
            tokenizer,
            model,
            limits,
            router,
            workers,
            executor,
            shadows,
            BoundedLabel(config.metrics_max_tenants),
        )
        keys = None
        if config.require_api_key:
            assert isinstance(router, SchedulerRouter)  # GatewayConfig requires a scheduler for it
            keys = KeyCheck(router.authenticate)
        server, health_servicer, grpc_port = _grpc_server(config, dispatcher, keys, tls)
        await server.start()
        try:
            runner, http_port = await _http_server(
                config, HttpApi(dispatcher, check, config.http_read_timeout_s), keys, tls
            )
        except BaseException:
            await server.stop(0)
            raise
        metrics_endpoint = MetricsEndpoint(metrics.REGISTRY)
        if config.metrics_port is not None:
            try:
                await metrics_endpoint.start(config.host, config.metrics_port)
            except OSError as e:
                await runner.cleanup()
                await server.stop(0)
                raise Unavailable(f"cannot serve metrics on port {config.metrics_port}: {e}") from None
    except BaseException:
        if router is not None:
            await router.close()
        await workers.close()
        executor.shutdown(wait=False)
        raise
    health_task = asyncio.get_running_loop().create_task(_watch_health(check, health_servicer))
    log.info(
        "gateway serving gRPC on %s:%d and HTTP on %s:%d", config.host, grpc_port, config.host, http_port
    )
    return GatewayServer(
        config,
        server,
        runner,
        grpc_port,
        http_port,
        dispatcher,
        workers,
        executor,
        health_task,
        router,
        health_servicer,
        metrics_endpoint,
    )


async def _serve_until_signal(config: GatewayConfig) -> None:
    stop = stop_requested()
    gateway = await serve_gateway(config)
    await stop.wait()
    await gateway.stop()


def run_gateway(args: argparse.Namespace) -> int:
    """`baton gateway`: serves until SIGINT or SIGTERM."""
    config = GatewayConfig.from_args(args)  # a config it rejects: exit 2 with the message
    asyncio.run(_serve_until_signal(config))
    return 0
