"""`baton up`: the local cluster in one command — a gateway, one prefill and one decode worker (or one
colocated worker) as separate processes, started the way a user starts them, health-checked, and
stopped together on Ctrl-C. Torch-free: the launcher only starts and watches processes. Every process
serves Prometheus metrics (the gateway on its HTTP port, the others on a port of their own); the banner
lists them and the log directory gets a ``prometheus.yml`` that scrapes them all. The children's flags
are generated from the configs the launcher builds for them (`rpc.flags.to_argv`), never hand-written.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineConfig
from rpc.flags import add_flags, config_from_args, field_like, to_argv
from scheduler.config import ClusterSchedulerConfig, SchedulerProcessConfig
from services.gateway.server import GatewayConfig
from services.worker.config import WORKER_ENGINE, WorkerConfig

READY_TIMEOUT_S = 300.0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it if the launcher dies, even by SIGKILL (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: Ctrl-C still stops everything through the launcher


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NotHealthyYet(RuntimeError):
    """Children still starting when a wait ran out (another wait may follow); one that exited is a plain
    RuntimeError."""


@dataclass(slots=True)
class Child:
    """One process of the cluster, its log file and the gRPC address that says it is healthy."""

    name: str
    argv: list[str]
    health_address: str
    log_path: Path
    phase: int = 2  # started after every child of a lower phase is healthy (redis 0, scheduler 1)
    probe: Callable[[str], bool] | None = None  # default: the gRPC health check
    proc: subprocess.Popen[bytes] | None = None

    def healthy(self) -> bool:
        return (self.probe or is_serving)(self.health_address)

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 — closed by the child's lifetime
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass(slots=True)
class Cluster:
    children: list[Child] = field(default_factory=list)

    def start_phase(self, phase: int) -> list[Child]:
        started = [c for c in self.children if c.phase == phase]
        for c in started:
            c.start()
        return started

    @property
    def phases(self) -> list[int]:
        return sorted({c.phase for c in self.children})

    def wait_healthy(self, timeout_s: float, children: list[Child] | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        pending = [c for c in (self.children if children is None else children) if c.proc is not None]
        while pending:
            for c in list(pending):
                assert c.proc is not None
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with code {c.proc.returncode}:\n{c.tail()}")
                if c.healthy():
                    pending.remove(c)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise NotHealthyYet(f"not healthy after {timeout_s:.0f} s: {names}\n{pending[0].tail()}")
            time.sleep(0.2)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc is not None and c.proc.poll() is not None), None)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM everyone (gateway first, so it stops taking requests), then SIGKILL stragglers."""
        for c in reversed(self.children):
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for c in self.children:
            if c.proc is None:
                continue
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait(5)


def is_serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False


def redis_ping(address: str) -> bool:
    import redis

    host, port = address.rsplit(":", 1)
    try:
        return bool(redis.Redis(host=host, port=int(port), socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


@dataclass(frozen=True, slots=True)
class UpConfig:
    """`baton up`'s flags (`rpc.flags`). Those it hands to its children take the children's defaults and
    choices from their configs; the children's command lines are `to_argv` of those configs."""

    model: str | None = field_like(EngineConfig, "model")
    host: str = field_like(GatewayConfig, "host", help="address every process binds")
    grpc_port: int = field_like(GatewayConfig, "grpc_port", help="gateway gRPC port (0 = any free port)")
    http_port: int = field_like(GatewayConfig, "http_port", help="gateway HTTP port (0 = any free port)")
    colocated: bool = field(default=False, metadata={"help": "one worker with role both instead of P + D"})
    static: bool = field(
        default=False,
        metadata={"help": "no Redis and no scheduler: the gateway places on the workers it is given"},
    )
    kv_transport: str = field_like(WorkerConfig, "kv_transport")
    kv_cache_memory: int = field_like(
        WorkerConfig, "engine.kv_cache_memory", help="each worker's KV cache budget, e.g. 512MiB"
    )
    dtype: str = field_like(
        WorkerConfig,
        "engine.dtype",
        help="every worker's weights, activations and KV cache (default auto: bfloat16 where faster)",
    )
    quantization: str = field_like(
        WorkerConfig,
        "engine.quantization",
        help="int8: every worker serves the weight-only int8 twin of the model",
    )
    threads: int = field(
        default_factory=lambda: max(1, (os.cpu_count() or 2) // 2),
        metadata={"help": "torch threads per worker (default: half the cores each; 0 = torch's)"},
    )
    ready_timeout: float = field(
        default=READY_TIMEOUT_S, metadata={"help": "seconds for the cluster to start serving"}
    )
    log_dir: str | None = field(
        default=None, metadata={"help": "where each process writes its log (default: a temp dir)"}
    )


def build_cluster(up: UpConfig, log_dir: Path, verbose: bool = False) -> tuple[Cluster, dict[str, str]]:
    """The processes of the local cluster; returns them and the endpoints to print. Each child's command
    line is `to_argv` of the config built for it here, so it is checked before anything starts."""
    baton = [sys.executable, "-m", "services.cli", *(["-v"] if verbose else [])]
    host = up.host
    engine = replace(
        WORKER_ENGINE,
        model=up.model,
        kv_cache_memory=up.kv_cache_memory,
        dtype=up.dtype,
        quantization=up.quantization,
        num_threads=up.threads or None,
    )
    worker = WorkerConfig(host=host, kv_transport=up.kv_transport, engine=engine)
    cluster = Cluster()
    scheduler = redis_url = ""
    metrics: dict[str, str] = {}  # process → host:port of its /metrics
    if not up.static:
        from scheduler.redis_server import redis_binary

        redis_port, scheduler_port = free_port(host), free_port(host)
        redis_url = f"redis://{host}:{redis_port}/0"
        scheduler = f"{host}:{scheduler_port}"
        redis_argv = ["--bind", host, "--port", str(redis_port), "--save", "", "--appendonly", "no"]
        cluster.children.append(
            Child(
                "redis",
                [redis_binary(), *redis_argv],
                f"{host}:{redis_port}",
                log_dir / "redis.log",
                phase=0,
                probe=redis_ping,
            )
        )
        metrics_port = free_port(host)
        metrics["scheduler"] = f"{host}:{metrics_port}"
        replica = ClusterSchedulerConfig(
            redis_url=redis_url, host=host, port=scheduler_port, accept_any_key=True
        )
        argv = to_argv(SchedulerProcessConfig(replica, metrics_port=metrics_port))
        cluster.children.append(
            Child("scheduler", [*baton, "scheduler", *argv], scheduler, log_dir / "scheduler.log", phase=1)
        )
        worker = replace(worker, scheduler=scheduler, redis_url=redis_url)
    roles = [("worker", "both")] if up.colocated else [("prefill", "prefill"), ("decode", "decode")]
    addresses: dict[str, str] = {}
    for name, role in roles:
        port, metrics_port = free_port(host), free_port(host)
        addresses[role] = f"{host}:{port}"
        metrics[role] = f"{host}:{metrics_port}"
        argv = to_argv(replace(worker, role=role, port=port, metrics_port=metrics_port))
        cluster.children.append(
            Child(f"{name} worker", [*baton, "worker", *argv], addresses[role], log_dir / f"{name}.log")
        )
    grpc_port = up.grpc_port or free_port(host)
    http_port = up.http_port or free_port(host)
    decode = () if scheduler else (addresses.get("decode") or addresses["both"],)
    prefill = (addresses["prefill"],) if "prefill" in addresses and not scheduler else ()
    gateway = GatewayConfig(
        model=up.model,
        host=host,
        grpc_port=grpc_port,
        http_port=http_port,
        scheduler=scheduler or None,
        decode_workers=decode,
        prefill_workers=prefill,
    )
    cluster.children.append(
        Child(
            "gateway",
            [*baton, "gateway", *to_argv(gateway)],
            f"{host}:{grpc_port}",
            log_dir / "gateway.log",
            phase=3,
        )
    )
    metrics["gateway"] = f"{host}:{http_port}"
    endpoints = {"grpc": f"{host}:{grpc_port}", "http": f"http://{host}:{http_port}", **addresses}
    if scheduler:
        endpoints["scheduler"] = scheduler
        endpoints["redis"] = redis_url
    endpoints.update({f"metrics:{name}": address for name, address in metrics.items()})
    return cluster, endpoints


def prometheus_config(endpoints: dict[str, str]) -> str:
    """A Prometheus scrape configuration for every process of the cluster (one job per process)."""
    jobs = "".join(
        f"  - job_name: baton-{key.removeprefix('metrics:')}\n    static_configs:\n"
        f"      - targets: ['{address}']\n"
        for key, address in endpoints.items()
        if key.startswith("metrics:")
    )
    return f"global:\n  scrape_interval: 5s\nscrape_configs:\n{jobs}"


def prepare_model(model: str | None) -> str:
    """Resolves the model once before the workers start (the default model is converted on first use,
    and two workers must not convert it at the same time). Runs in a child: the launcher stays light."""
    cmd = [
        sys.executable,
        "-c",
        "import sys; from engine.loader import resolve_model_dir; print(resolve_model_dir(sys.argv[1] or None))",
        model or "",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"cannot prepare the model: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip().splitlines()[-1]


def banner(endpoints: dict[str, str], model_name: str, log_dir: Path) -> str:
    http = endpoints["http"]
    workers = ", ".join(f"{k} {v}" for k, v in endpoints.items() if k in ("prefill", "decode", "both"))
    metrics = " ".join(
        f"{k.removeprefix('metrics:')}=http://{v}/metrics"
        for k, v in endpoints.items()
        if k.startswith("metrics:")
    )
    return f"""
Baton is up — model {model_name}
  OpenAI HTTP : {http}/v1   (health {http}/health, metrics {http}/metrics)
  gRPC        : {endpoints["grpc"]}   (baton.v1.Gateway; reflection on)
  workers     : {workers}
  scheduler   : {endpoints.get("scheduler", "none (static placement)")}
  redis       : {endpoints.get("redis", "none")}
  metrics     : {metrics}
                (Prometheus: prometheus --config.file={log_dir / "prometheus.yml"}; Grafana: deploy/grafana/)
  logs        : {log_dir}

Try it:
  curl -s {http}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Which city is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'

Press Ctrl-C to stop everything.
""".rstrip()


def wait_serving(http: str, deadline: float, stop: Callable[[], bool]) -> bool:
    """Polls ``http``/health until it answers 200 (True), the deadline passes or ``stop()`` (False)."""
    import urllib.error
    import urllib.request

    while not stop() and time.monotonic() < deadline:
        with contextlib.suppress(urllib.error.URLError, OSError):  # 503 or not listening yet: ask again
            with urllib.request.urlopen(f"{http}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        time.sleep(0.1)
    return False


def run_up(args: argparse.Namespace) -> int:
    up = config_from_args(UpConfig, args, args.parser)
    model_dir = prepare_model(up.model)
    up = replace(up, model=model_dir)
    log_dir = Path(up.log_dir or tempfile.mkdtemp(prefix="baton-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cluster, endpoints = build_cluster(up, log_dir, args.verbose)
    (log_dir / "prometheus.yml").write_text(prometheus_config(endpoints))
    stopping = False

    def on_signal(signum: int, frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"starting {len(cluster.children)} processes (logs in {log_dir}) …", flush=True)
    try:
        deadline = time.monotonic() + up.ready_timeout
        for phase in cluster.phases:  # Redis, then the scheduler, then the workers, then the gateway
            started = cluster.start_phase(phase)
            while not stopping:  # poll in short slices so Ctrl-C during start-up is honoured at once
                try:
                    cluster.wait_healthy(min(1.0, max(0.0, deadline - time.monotonic())), started)
                    break
                except RuntimeError as e:
                    if not isinstance(e, NotHealthyYet) or time.monotonic() > deadline:
                        print(f"baton up: {e}", file=sys.stderr)
                        return 1
            if stopping:
                return 130
        # Healthy processes are not yet a cluster that places: the workers' registrations must reach
        # the scheduler first. The gateway's /health says so (200 once a scheduler has its workers).
        if not wait_serving(endpoints["http"], deadline, lambda: stopping):
            if stopping:
                return 130
            print(
                f"baton up: the gateway's {endpoints['http']}/health did not report ready in time",
                file=sys.stderr,
            )
            return 1
        print(banner(endpoints, Path(model_dir).name, log_dir), flush=True)
        while not stopping:
            dead = cluster.first_exited()
            if dead is not None:
                print(
                    f"baton up: {dead.name} exited ({dead.proc.returncode if dead.proc else '?'}):\n{dead.tail()}",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.2)
        print("stopping …", flush=True)
        return 0
    finally:
        cluster.stop()


def add_up_parser(sub: Any) -> None:
    p = sub.add_parser("up", help="start a local cluster: gateway + prefill + decode workers")
    add_flags(p, UpConfig)
    p.set_defaults(func=run_up, parser=p)
