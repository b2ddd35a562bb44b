"""`WorkerConfig` and the `baton worker` flags — torch-free, so the launcher and the CLI stay light.

A worker's engine settings are an `EngineConfig` (declared once, in `engine.config`), nested as
``WorkerConfig.engine``; the flags are generated from both by `rpc.flags` (the engine's keep their plain
names: ``--dtype``, ``--kv-cache-memory``).
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field, fields, replace
from typing import Any

from engine.config import EngineConfig
from rpc.flags import add_flags, config_from_args, metrics_port_field
from rpc.tls import TlsConfig

ROLES = ("prefill", "decode", "both")
KV_TRANSPORTS = ("auto", "nixl", "shm", "tcp")
HEAVY_PREFILL_CHUNK = 32  # a prefill worker's default prompt tokens per step for a heavy tenant's prompt
# A worker's engine defaults, where they differ from an engine's alone: a worker is one of several
# processes on a host (`baton up` starts a prefill and a decode worker side by side, each with this
# budget), so its KV cache is 256 MiB rather than the 1 GiB an offline `LLM` takes.
WORKER_ENGINE = EngineConfig(kv_cache_memory=256 << 20)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker process. Field names (the nested engine's too) are the `baton worker` flags.

    ``heavy_prefill_chunk`` is the worker's own field because its default depends on the role (None:
    HEAVY_PREFILL_CHUNK on a prefill worker, where a light tenant's prompt would otherwise wait for a
    whole heavy prompt, else 0); ``__post_init__`` writes the resolved value into ``engine``, whose own
    field is no flag here. `WorkerConfig.flat(dtype=..., threads=1)` takes worker and engine fields as
    one set of keywords.
    """

    role: str = field(
        default="both",
        metadata={"choices": ROLES, "help": "what it serves: prefill, decode, or both (colocated)"},
    )
    served_model_name: str | None = field(
        default=None, metadata={"help": "the model's public name (default: the model directory's name)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address the worker binds"})
    advertise_host: str | None = field(
        default=None,
        metadata={
            "help": "the host other processes reach this worker at (default: --host; in Kubernetes, the "
            "pod IP)"
        },
    )
    port: int = field(default=0, metadata={"help": "gRPC port (0 = any free port)"})
    kv_transport: str = field(
        default="auto",
        metadata={
            "choices": KV_TRANSPORTS,
            "help": "how KV blocks move between workers (default auto: nixl where it imports, else tcp; "
            "shm only on one host)",
        },
    )
    heavy_prefill_chunk: int | None = field(
        default=None,
        metadata={
            "help": "prompt tokens per step of a heavy tenant's prompt, so a light tenant's prompt starts "
            f"soon (default: {HEAVY_PREFILL_CHUNK} on a prefill worker, else 0 = off)"
        },
    )
    lease_ttl_s: float = field(
        default=30.0, metadata={"help": "seconds a prefill's pinned KV blocks wait for their pull"}
    )
    transfer_timeout_s: float = field(
        default=10.0, metadata={"help": "seconds a KV pull may take, unless the request says"}
    )
    max_pending_outputs: int = field(
        default=256, metadata={"help": "unread outputs per request before it is ended as a slow reader"}
    )
    scheduler: str | None = field(
        default=None,
        metadata={
            "help": "scheduler host:port to register with, or the IP host:port of each replica, "
            "comma-separated (default: none)"
        },
    )
    redis_url: str | None = field(
        default=None, metadata={"help": "the cluster's Redis, for the cancellation bus"}
    )
    drain_timeout_s: float = field(
        default=25.0,
        metadata={
            "help": "on SIGTERM, seconds the work in flight may take to finish before a decode worker "
            "hands its streams to another decode worker and a prefill worker gives back its leases"
        },
    )
    metrics_port: int | None = metrics_port_field()
    tls: TlsConfig = TlsConfig()  # mutual TLS on its port and on its calls to the scheduler and peers
    engine: EngineConfig = field(default=WORKER_ENGINE, metadata={"exclude": ("heavy_prefill_chunk",)})

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        heavy = self.heavy_prefill_chunk
        if heavy is None:
            heavy = HEAVY_PREFILL_CHUNK if self.role == "prefill" else 0
        if heavy < 0:
            raise ValueError("heavy_prefill_chunk must not be negative")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must not be negative")
        if self.engine.heavy_prefill_chunk != heavy:
            object.__setattr__(self, "engine", replace(self.engine, heavy_prefill_chunk=heavy))

    @classmethod
    def flat(cls, **settings: Any) -> WorkerConfig:
        """A config from one flat set of keywords, worker and engine fields alike (``dtype=...``, and
        ``threads=`` for the engine's ``num_threads``, as the flag is named), the engine's applied over
        WORKER_ENGINE: what a test or a script writes, as it would write the flags."""
        own = {f.name for f in fields(cls)}
        names = {f.name: f.name for f in fields(EngineConfig)} | {"threads": "num_threads"}
        engine = {names[k]: settings.pop(k) for k in list(settings) if k in names and k not in own}
        if engine:
            settings["engine"] = replace(settings.get("engine", WORKER_ENGINE), **engine)
        return cls(**settings)


def add_worker_parser(sub: Any) -> None:
    p = sub.add_parser("worker", help="run a prefill, decode or colocated worker (gRPC)")
    add_flags(p, WorkerConfig)
    p.set_defaults(func=run_worker, parser=p)


def run_worker(args: argparse.Namespace) -> int:
    config = config_from_args(WorkerConfig, args, args.parser)
    from services.worker.server import serve_until_signal

    asyncio.run(serve_until_signal(config))
    return 0
