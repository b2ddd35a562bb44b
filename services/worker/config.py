"""`WorkerConfig` and the `baton worker` flags — torch-free, so the launcher and the CLI stay light."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass
from typing import Any

from core.units import parse_bytes
from engine.config import DTYPES, QUANTIZATIONS

ROLES = ("prefill", "decode", "both")
HEAVY_PREFILL_CHUNK = 32  # a prefill worker's default prompt tokens per step for a heavy tenant's prompt


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process. Field names are the `baton worker` flags."""

    role: str = "both"
    model: str | None = None  # None = the embedded default model
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    kv_transport: str = "auto"  # auto, nixl, shm, tcp
    kv_cache_memory: int = 256 << 20
    dtype: str = "auto"  # auto = bfloat16 where this CPU multiplies it faster than float32 (engine.linear)
    quantization: str = "none"  # int8: weight-only int8, served as its own model version
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens per engine step (prefill chunks + decodes)
    long_prefill_chunk: int = 512  # the most prompt tokens one request may prefill per step
    # A heavy tenant's prompt tokens per step (core.step_scheduler); None = HEAVY_PREFILL_CHUNK on a
    # prefill worker, where a light tenant's prompt would otherwise wait for a whole heavy prompt, else 0.
    heavy_prefill_chunk: int | None = None
    mixed_prefill_tokens: int | None = (
        None  # prompt tokens beside running decodes per step; None = engine default
    )
    threads: int | None = None
    lease_ttl_s: float = 30.0
    transfer_timeout_s: float = 10.0
    max_pending_outputs: int = 256  # unread outputs per request before it is ended as a slow reader
    scheduler: str | None = None  # host:port of a scheduler: register and heartbeat there
    redis_url: str | None = None  # the cluster's Redis: listen on the cancellation bus
    metrics_port: int | None = 0  # GET /metrics; 0 = any free port, None = no metrics endpoint

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.heavy_prefill_chunk is None:
            object.__setattr__(
                self, "heavy_prefill_chunk", HEAVY_PREFILL_CHUNK if self.role == "prefill" else 0
            )


def add_worker_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a prefill, decode or colocated worker (gRPC)")
    p.add_argument("--role", choices=ROLES, default="both")
    p.add_argument(
        "--model", default=None, help="HF model directory or .gguf (default: embedded SmolLM2-135M)"
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--kv-transport", choices=["auto", "nixl", "shm", "tcp"], default="auto")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default="256MiB")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="weights, activations and KV cache (default auto: bfloat16 where this CPU runs it faster)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="int8: weight-only int8 quantized at load; a model version of its own",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    p.add_argument(
        "--long-prefill-chunk",
        type=int,
        default=512,
        help="most prompt tokens one request prefills per step (chunked prefill); "
        "set it to the context length to turn chunking off",
    )
    p.add_argument(
        "--mixed-prefill-tokens",
        type=int,
        default=None,
        help="most prompt tokens a step adds to running decodes, guarding their inter-token latency "
        "(default: 32 on CPU, no cap on GPU; 0 = no cap)",
    )
    p.add_argument(
        "--heavy-prefill-chunk",
        type=int,
        default=None,
        help="prompt tokens per step of a heavy tenant's prompt, so a light tenant's prompt starts "
        f"soon (default: {HEAVY_PREFILL_CHUNK} on a prefill worker, else 0 = off)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--lease-ttl-s", type=float, default=30.0)
    p.add_argument("--transfer-timeout-s", type=float, default=10.0)
    p.add_argument("--max-pending-outputs", type=int, default=256)
    p.add_argument("--scheduler", default=None, help="scheduler host:port to register with (default: none)")
    p.add_argument("--redis-url", default=None, help="the cluster's Redis, for the cancellation bus")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="port of GET /metrics (default 0: any free port, printed at start; -1: no metrics)",
    )
    p.set_defaults(func=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    names = WorkerConfig.__dataclass_fields__
    if args.metrics_port < 0:
        args.metrics_port = None
    config = WorkerConfig(**{k: v for k, v in vars(args).items() if k in names})
    from services.worker.server import serve_until_signal

    asyncio.run(serve_until_signal(config))
    return 0
