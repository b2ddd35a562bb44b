"""The gateway process: `GatewayConfig`, `baton gateway`, and `serve_gateway`, which runs the gRPC
`baton.v1.Gateway` service (with health and reflection) and the OpenAI HTTP API on one asyncio loop.

It never imports torch: tokenization and chat templates come from `engine.tokenizer`, the model's
identity and context length from the workers' Info.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from baton.v1 import gateway_pb2, gateway_pb2_grpc
from core.errors import ModelLoadError, Unavailable
from core.units import parse_bytes
from engine.tokenizer import Tokenizer
from services.dispatch import Dispatcher, Limits, ModelInfo
from services.gateway_servicer import GatewayServicer
from services.http_api import HttpApi
from services.placement import StaticPlacer
from services.worker_clients import WorkerClients

log = logging.getLogger(__name__)

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
HEALTH_PROBE_INTERVAL_S = 5.0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway is started with; field names are the `baton gateway` flags."""

    model: str | None = None  # model dir or .gguf for the tokenizer; None = the default model
    served_model_name: str | None = None  # None = the name the workers serve
    host: str = "127.0.0.1"
    grpc_port: int = 50051  # 0 = any free port
    http_port: int = 8000  # 0 = any free port
    prefill_workers: tuple[str, ...] = ()
    decode_workers: tuple[str, ...] = ()
    local_prefill_threshold: int = 32  # prompts shorter than this are prefilled on the decode worker
    max_prompt_tokens: int | None = None  # None = the model's context
    max_output_tokens: int = 4096
    max_request_bytes: int = 4 << 20
    max_streams_per_connection: int = 128
    max_session_requests: int = 64
    max_buffered_tokens: int = 1024  # tokens a client may leave unread before its request fails
    startup_timeout: float = 120.0  # seconds to wait for every worker to answer Info
    tokenizer_threads: int = 2

    def __post_init__(self) -> None:
        if not self.decode_workers:
            raise ValueError("the gateway needs at least one decode worker (--decode-workers host:port,...)")
        for name in ("max_output_tokens", "max_request_bytes", "max_streams_per_connection",
                     "max_session_requests", "max_buffered_tokens", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be at least 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _addresses(text: str) -> tuple[str, ...]:
    items = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in items:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"not a host:port address: {a!r}")
    return items


_INT_FLAGS = {
    "max_output_tokens": "most tokens one request may generate",
    "max_request_bytes": "largest gRPC message or HTTP body accepted, e.g. 4MiB",
    "max_streams_per_connection": "concurrent gRPC streams per client connection",
    "max_session_requests": "requests in flight per gRPC Session",
    "max_buffered_tokens": "tokens a client may leave unread before its request fails (slow reader)",
    "tokenizer_threads": "threads that tokenize and apply chat templates",
}


def add_gateway_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Registers `baton gateway`."""
    d = GatewayConfig.__dataclass_fields__
    p = sub.add_parser("gateway", help="serve the gRPC and OpenAI HTTP APIs in front of the workers")
    p.add_argument("--model", default=None, help="model dir or .gguf for the tokenizer (default: the default model)")
    p.add_argument("--served-model-name", default=None, help="the model's public name (default: the workers')")
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--grpc-port", type=int, default=d["grpc_port"].default)
    p.add_argument("--http-port", type=int, default=d["http_port"].default)
    p.add_argument("--prefill-workers", type=_addresses, default=(), help="host:port,... of prefill workers")
    p.add_argument("--decode-workers", type=_addresses, required=True, help="host:port,... of decode workers")
    p.add_argument("--local-prefill-threshold", type=int, default=d["local_prefill_threshold"].default,
                   help="prompts shorter than this many tokens are prefilled on the decode worker")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's context")
    for name, what in _INT_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=parse_bytes if name == "max_request_bytes" else int,
                       default=d[name].default, help=f"{what} (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=d["startup_timeout"].default,
                   help="seconds to wait for the workers at start-up")
    p.set_defaults(func=run_gateway)


def resolve_tokenizer_dir(model: str | None) -> Path:
    """The model directory whose tokenizer the gateway uses, resolved without torch (as
    `engine.loader.resolve_model_dir` does, which imports torch)."""
    from engine import gguf_convert

    if model is None:
        return gguf_convert.prepare_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return gguf_convert.prepare_gguf_model(path)
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is not a model directory or a .gguf file")
    return path


def _vocab_size(model_dir: Path, tokenizer: Tokenizer) -> int:
    config = model_dir / "config.json"
    try:
        return int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return tokenizer.vocab_size


class GatewayServer:
    """A running gateway: its bound ports, and `stop()`."""

    def __init__(
        self, config: GatewayConfig, grpc_server: grpc.aio.Server, runner: web.AppRunner, grpc_port: int,
        http_port: int, dispatcher: Dispatcher, workers: WorkerClients, executor: ThreadPoolExecutor,
        health_task: asyncio.Task[None],
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

    @property
    def grpc_address(self) -> str:
        return f"{self.config.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    async def stop(self, grace_s: float = 2.0) -> None:
        self._health_task.cancel()
        await self.dispatcher.shutdown()
        await self._grpc_server.stop(grace_s)
        await self._runner.cleanup()
        await self._workers.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("gateway stopped")


async def _load_model(
    config: GatewayConfig, workers: WorkerClients, executor: ThreadPoolExecutor
) -> tuple[Tokenizer, ModelInfo]:
    """The tokenizer (off the loop) and the model version the workers serve (all must agree)."""
    loop = asyncio.get_running_loop()
    model_dir = await loop.run_in_executor(executor, resolve_tokenizer_dir, config.model)
    tokenizer = await loop.run_in_executor(executor, Tokenizer.from_dir, model_dir)
    infos = await workers.wait_ready((*config.prefill_workers, *config.decode_workers), config.startup_timeout)
    digests = {info.model_digest for info in infos.values()}
    if len(digests) != 1:
        detail = ", ".join(f"{a}: {i.model_digest}" for a, i in infos.items())
        raise Unavailable(f"the workers serve different model versions ({detail})")
    decode = [infos[a] for a in config.decode_workers]
    model = ModelInfo(
        name=config.served_model_name or decode[0].model or model_dir.name,
        version=decode[0].model_digest,
        max_model_len=min(i.max_model_len for i in decode),
        vocab_size=_vocab_size(model_dir, tokenizer),
    )
    log.info("model %s version %s max_model_len %d", model.name, model.version, model.max_model_len)
    return tokenizer, model


async def _watch_workers(
    workers: WorkerClients, addresses: tuple[str, ...], servicer: health.aio.HealthServicer
) -> None:
    """Keeps the gRPC health status true: NOT_SERVING while any worker is silent."""
    while True:
        problems = await workers.probe(addresses)
        ok = all(p is None for p in problems.values())
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", GATEWAY_SERVICE):
            await servicer.set(service, status)
        await asyncio.sleep(HEALTH_PROBE_INTERVAL_S)


def _grpc_server(config: GatewayConfig, dispatcher: Dispatcher) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """The gRPC server (Gateway, health, reflection) bound to its port, not yet started."""
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", config.max_request_bytes),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
        ("grpc.so_reuseport", 0),  # a port already in use is an error, not a shared port
    ])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(dispatcher, config.max_session_requests), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GATEWAY_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    try:
        port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    except RuntimeError as e:
        raise Unavailable(f"cannot listen for gRPC on {config.host}:{config.grpc_port}: {e}") from None
    return server, health_servicer, port


async def _http_server(config: GatewayConfig, http: HttpApi) -> tuple[web.AppRunner, int]:
    """The HTTP API started on its port; a client that disconnects cancels its handler."""
    runner = web.AppRunner(http.app(config.max_request_bytes), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.http_port).start()
    except OSError as e:
        await runner.cleanup()
        raise Unavailable(f"cannot listen for HTTP on {config.host}:{config.http_port}: {e}") from None
    return runner, int(runner.addresses[0][1])


async def serve_gateway(config: GatewayConfig) -> GatewayServer:
    """Starts the gateway on the running loop once every worker answers; returns the running server."""
    executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="gateway-tokenizer")
    workers = WorkerClients()
    try:
        tokenizer, model = await _load_model(config, workers, executor)
        limits = Limits(config.max_prompt_tokens, config.max_output_tokens, config.max_buffered_tokens)
        placer = StaticPlacer(config.prefill_workers, config.decode_workers, config.local_prefill_threshold)
        dispatcher = Dispatcher(tokenizer, model, limits, placer, workers, executor)
        server, health_servicer, grpc_port = _grpc_server(config, dispatcher)
        await server.start()
        addresses = tuple(dict.fromkeys((*config.prefill_workers, *config.decode_workers)))
        try:
            runner, http_port = await _http_server(config, HttpApi(dispatcher, workers, addresses))
        except BaseException:
            await server.stop(0)
            raise
    except BaseException:
        await workers.close()
        executor.shutdown(wait=False)
        raise
    health_task = asyncio.get_running_loop().create_task(_watch_workers(workers, addresses, health_servicer))
    log.info("gateway serving gRPC on %s:%d and HTTP on %s:%d", config.host, grpc_port, config.host, http_port)
    return GatewayServer(config, server, runner, grpc_port, http_port, dispatcher, workers, executor, health_task)


async def _serve_until_signal(config: GatewayConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    gateway = await serve_gateway(config)
    await stop.wait()
    await gateway.stop()


def run_gateway(args: argparse.Namespace) -> int:
    """`baton gateway`: serves until SIGINT or SIGTERM."""
    try:
        config = GatewayConfig.from_args(args)
    except ValueError as e:
        raise SystemExit(f"baton gateway: {e}") from None
    asyncio.run(_serve_until_signal(config))
    return 0
