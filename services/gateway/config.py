"""The gateway's configuration, `GatewayConfig`: its fields are the `baton gateway` flags (`rpc.flags`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from core.units import parse_bytes
from rpc.flags import config_from_args, port_or_off
from rpc.liveness import KEEPALIVE_S
from rpc.metrics import DEFAULT_MAX_TENANTS
from rpc.tls import TlsConfig, target


def _addresses(text: str) -> tuple[str, ...]:
    items = tuple(a.strip() for a in text.split(",") if a.strip())
    for a in items:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise argparse.ArgumentTypeError(f"not a host:port address: {a!r}")
    return items


def _address(text: str) -> str:
    items = _addresses(text)
    if len(items) != 1:
        raise argparse.ArgumentTypeError(f"expected one host:port address, got {text!r}")
    return items[0]


def _scheduler(text: str) -> str:
    items = _addresses(text)
    if len(items) > 1:
        try:
            target(",".join(items))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return ",".join(items)


def _help(text: str, **meta: Any) -> dict[str, Any]:
    return {"help": text, **meta}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway is started with; field names are the `baton gateway` flags (`rpc.flags`)."""

    model: str | None = field(
        default=None, metadata=_help("model dir or .gguf for the tokenizer (default: the default model)")
    )
    served_model_name: str | None = field(
        default=None, metadata=_help("the model's public name (default: the workers')")
    )
    host: str = "127.0.0.1"
    grpc_port: int = field(default=50051, metadata=_help("gRPC port (0 = any free port)"))
    http_port: int = field(
        default=8000, metadata=_help("HTTP port: OpenAI API, /health, /metrics (0 = any free port)")
    )
    scheduler: str | None = field(
        default=None,
        metadata=_help(
            "host:port of the cluster scheduler, which places every request, or the IP host:port of each "
            "of its replicas, comma-separated (default: none, static placement)",
            parse=_scheduler,
        ),
    )
    require_api_key: bool = field(
        default=False,
        metadata=_help(
            "every route and method but health needs an API key the scheduler knows (401 / UNAUTHENTICATED)"
        ),
    )
    metrics_port: int | None = field(
        default=None,
        metadata=_help(
            "also serve GET /metrics on this port, without a key (default: only on the HTTP port)",
            parse=port_or_off,
            none="-1",
        ),
    )
    tls: TlsConfig = TlsConfig()
    scheduler_timeout: float = field(
        default=30.0, metadata=_help("seconds a placement may take, queueing included")
    )
    worker_keepalive_s: float = field(
        default=KEEPALIVE_S,
        metadata=_help(
            "seconds between keepalive PINGs to a worker with calls in flight; one unanswered for twice "
            "that marks the worker lost (hung, partitioned) and its streams migrate (rpc.liveness)"
        ),
    )
    prefill_workers: tuple[str, ...] = field(
        default=(), metadata=_help("without a scheduler: host:port,... of prefill workers", parse=_addresses)
    )
    decode_workers: tuple[str, ...] = field(
        default=(), metadata=_help("without a scheduler: host:port,... of decode workers", parse=_addresses)
    )
    local_prefill_threshold: int = field(
        default=32,
        metadata=_help(
            "without a scheduler: prompts shorter than this many tokens are prefilled on the decode worker"
        ),
    )
    max_migrations: int = field(
        default=2,
        metadata=_help("times a request's decode may move to another worker after its worker failed"),
    )
    max_prompt_tokens: int | None = field(
        default=None, metadata=_help("most prompt tokens a request may bring (default: the model's context)")
    )
    max_output_tokens: int = field(default=4096, metadata=_help("most tokens one request may generate"))
    max_request_bytes: int = field(
        default=4 << 20,
        metadata=_help("largest gRPC message or HTTP body accepted, e.g. 4MiB", parse=parse_bytes),
    )
    http_read_timeout_s: float = field(
        default=30.0,
        metadata=_help(
            "seconds an HTTP client has to send a request's headers (from connecting, or from its last "
            "response: an idle connection is closed then) and as many for its body (408)"
        ),
    )
    max_streams_per_connection: int = field(
        default=128, metadata=_help("concurrent gRPC streams per client connection")
    )
    max_session_requests: int = field(default=64, metadata=_help("requests in flight per gRPC Session"))
    max_buffered_tokens: int = field(
        default=1024,
        metadata=_help("tokens a client may leave unread before its request fails (slow reader)"),
    )
    startup_timeout: float = field(
        default=120.0,
        metadata=_help(
            "seconds to wait for the workers (or a worker registered with the scheduler) at start-up"
        ),
    )
    tokenizer_threads: int = field(
        default=2, metadata=_help("threads that tokenize and apply chat templates")
    )
    max_shadow_requests: int = field(
        default=16,
        metadata=_help("shadow requests (mirrored to a candidate version) in flight; more are skipped"),
    )
    shadow_timeout: float = field(default=120.0, metadata=_help("seconds a shadow request may run"))
    metrics_max_tenants: int = field(
        default=DEFAULT_MAX_TENANTS,
        metadata=_help("tenants with a metrics label of their own; later ones are counted as 'other'"),
    )
    drain_timeout_s: float = field(
        default=25.0,
        metadata=_help(
            "on SIGTERM, seconds the streams in flight may take to finish (new requests get UNAVAILABLE); "
            "those still running then end with UNAVAILABLE"
        ),
    )

    def __post_init__(self) -> None:
        if self.scheduler and (self.decode_workers or self.prefill_workers):
            raise ValueError("give either --scheduler or --decode-workers/--prefill-workers, not both")
        if not self.scheduler and not self.decode_workers:
            raise ValueError(
                "the gateway needs a scheduler (--scheduler host:port) or at least one decode "
                "worker (--decode-workers host:port,...)"
            )
        if self.require_api_key and not self.scheduler:
            raise ValueError("--require-api-key needs --scheduler: API keys and tenants live there")
        if self.max_migrations < 0 or self.scheduler_timeout <= 0 or self.shadow_timeout <= 0:
            raise ValueError(
                "max_migrations must be at least 0, scheduler_timeout and shadow_timeout positive"
            )
        if self.http_read_timeout_s <= 0 or self.worker_keepalive_s <= 0:
            raise ValueError("http_read_timeout_s and worker_keepalive_s must be positive")
        if self.max_shadow_requests < 0 or self.metrics_max_tenants < 0 or self.drain_timeout_s < 0:
            raise ValueError(
                "max_shadow_requests, metrics_max_tenants and drain_timeout_s must be at least 0"
            )
        for name in (
            "max_output_tokens",
            "max_request_bytes",
            "max_streams_per_connection",
            "max_session_requests",
            "max_buffered_tokens",
            "tokenizer_threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError("max_prompt_tokens must be at least 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return config_from_args(cls, args, getattr(args, "parser", None))
