"""`baton up`: the local cluster in one command — a gateway, prefill and decode workers (one each by
default, or colocated workers) as separate processes, started the way a user starts them,
health-checked, restarted when one dies (`services.supervisor`), and stopped together only on Ctrl-C. Torch-free: the launcher only starts and watches processes. Every process
serves Prometheus metrics (the gateway on its HTTP port, the others on a port of their own); the banner
lists them and the log directory gets a ``prometheus.yml`` that scrapes them all. The children's flags
are generated from the configs the launcher builds for them (`rpc.flags.to_argv`), never hand-written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autoscaler.config import PolicyConfig
from engine.config import EngineConfig
from rpc.flags import add_flags, config_from_args, field_like, to_argv
from scheduler.config import ClusterSchedulerConfig, SchedulerProcessConfig
from services.gateway.server import GatewayConfig
from services.local_security import LocalSecurity
from services.supervisor import Child, NotHealthyYet, Supervisor, free_port, is_serving
from services.worker.config import WORKER_ENGINE, WorkerConfig

__all__ = ["UpConfig", "build_cluster", "free_port", "is_serving", "run_up"]

READY_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class UpConfig:
    """`baton up`'s flags (`rpc.flags`). Those it hands to its children take the children's defaults and
    choices from their configs; the children's command lines are `to_argv` of those configs."""

    model: str | None = field_like(EngineConfig, "model")
    host: str = field_like(GatewayConfig, "host", help="address every process binds")
    grpc_port: int = field_like(GatewayConfig, "grpc_port", help="gateway gRPC port (0 = any free port)")
    http_port: int = field_like(GatewayConfig, "http_port", help="gateway HTTP port (0 = any free port)")
    colocated: bool = field(default=False, metadata={"help": "workers with role both instead of P + D"})
    prefill_workers: int = field(default=1, metadata={"help": "prefill workers (none when colocated)"})
    decode_workers: int = field(
        default=1, metadata={"help": "decode workers (colocated: workers with role both)"}
    )
    static: bool = field(
        default=False,
        metadata={"help": "no Redis and no scheduler: the gateway places on the workers it is given"},
    )
    kv_transport: str = field_like(WorkerConfig, "kv_transport")
    kv_cache_memory: int = field_like(
        WorkerConfig, "engine.kv_cache_memory", help="each worker's KV cache budget, e.g. 512MiB"
    )
    max_prefill_queue: int = field_like(ClusterSchedulerConfig, "max_prefill_queue")
    max_decode_queue: int = field_like(ClusterSchedulerConfig, "max_decode_queue")
    max_num_seqs: int = field_like(
        WorkerConfig, "engine.max_num_seqs", help="each worker's running batch, in requests at most"
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
    drain_timeout_s: float = field(
        default=5.0,
        metadata={
            "help": "seconds a stopping worker or the gateway lets its streams finish before handing them "
            "on (a worker) or ending them with an error (the gateway)"
        },
    )
    autoscale: bool = field(
        default=False,
        metadata={
            "help": "size the prefill and decode pools from the cluster's metrics (baton autoscale's policy, "
            "over worker processes on this machine)"
        },
    )
    autoscale_interval_s: float = field(
        default=2.0, metadata={"help": "--autoscale: seconds between decisions"}
    )
    autoscale_window_s: float = field(
        default=10.0,
        metadata={"help": "--autoscale: the p95s and rates a decision reads are over this many seconds"},
    )
    policy: PolicyConfig = PolicyConfig(
        max_prefill=2, max_decode=4, scale_up_window_s=4.0, scale_down_window_s=30.0
    )
    log_dir: str | None = field(
        default=None, metadata={"help": "where each process writes its log (default: a temp dir)"}
    )
    tls: bool = field(
        default=False,
        metadata={
            "help": "a development CA in the log dir: HTTPS and TLS gRPC on the gateway, mutual TLS "
            "between every process"
        },
    )
    require_api_key: bool = field(
        default=False, metadata={"help": "every route but health needs an API key; one is made and printed"}
    )

    def __post_init__(self) -> None:
        if self.decode_workers < 1:
            raise ValueError("--decode-workers must be at least 1")
        if self.prefill_workers < 0:
            raise ValueError("--prefill-workers must not be negative")
        if self.autoscale and self.static:
            raise ValueError(
                "--autoscale needs the scheduler (it reads the pools' load there): drop --static"
            )
        if self.autoscale_interval_s <= 0 or self.autoscale_window_s <= 0 or self.drain_timeout_s < 0:
            raise ValueError(
                "the autoscale interval and window must be positive, the drain timeout not negative"
            )


@dataclass(frozen=True, slots=True)
class WorkerFactory:
    """How `baton up` starts one worker of a pool: at start-up, or later when the local scaler adds one."""

    baton: tuple[str, ...]  # the `baton` command line, up to the subcommand
    config: WorkerConfig  # every worker's settings but its role and ports
    log_dir: Path
    colocated: bool = False
    probe: Callable[[str], bool] | None = None  # its health check (default: plaintext gRPC health)

    def role(self, pool: str) -> str:
        return "both" if self.colocated else pool

    def name(self, pool: str) -> str:
        return "worker" if self.colocated else f"{pool} worker"

    def child(self, pool: str, index: int) -> tuple[Child, str]:
        """The ``index``-th worker of ``pool`` (1, 2, …) on fresh ports; and its metrics address."""
        host = self.config.host
        port, metrics_port = free_port(host), free_port(host)
        role = self.role(pool)
        config = replace(self.config, role=role, port=port, metrics_port=metrics_port)
        suffix = "" if index == 1 else f" {index}"
        log_name = ("worker" if self.colocated else pool) + ("" if index == 1 else f"-{index}")
        child = Child(
            self.name(pool) + suffix,
            [*self.baton, "worker", *to_argv(config)],
            f"{host}:{port}",
            self.log_dir / f"{log_name}.log",
            pool=pool,
            probe=self.probe,
        )
        return child, f"{host}:{metrics_port}"


def build_cluster(
    up: UpConfig, log_dir: Path, verbose: bool = False, security: LocalSecurity | None = None
) -> tuple[Supervisor, dict[str, str], WorkerFactory]:
    """The processes of the local cluster; returns them, the endpoints to print, and how to start more
    workers. Each child's command line is `to_argv` of the config built for it here, so it is checked
    before anything starts."""
    baton = [sys.executable, "-m", "services.cli", *(["-v"] if verbose else [])]
    host = up.host
    engine = replace(
        WORKER_ENGINE,
        model=up.model,
        kv_cache_memory=up.kv_cache_memory,
        max_num_seqs=up.max_num_seqs,
        dtype=up.dtype,
        quantization=up.quantization,
        num_threads=up.threads or None,
    )
    if security is None:
        security = LocalSecurity.prepare(log_dir, host, up.tls, up.require_api_key)
    worker = WorkerConfig(
        host=host,
        kv_transport=up.kv_transport,
        engine=engine,
        drain_timeout_s=up.drain_timeout_s,
        tls=security.config,
    )
    cluster = Supervisor(state_path=log_dir / "processes.json")
    scheduler = redis_url = ""
    metrics: dict[str, str] = {}  # process → host:port of its /metrics
    if not up.static:
        from scheduler.redis_server import redis_binary

        redis_port, scheduler_port = free_port(host), free_port(host)
        redis_url = security.redis_url(host, redis_port)
        scheduler = f"{host}:{scheduler_port}"
        conf = [str(security.redis_conf)] if security.redis_conf else []  # its password, not on argv
        redis_argv = [*conf, "--bind", host, "--port", str(redis_port), "--save", "", "--appendonly", "no"]
        cluster.children.append(
            Child(
                "redis",
                [redis_binary(), *redis_argv],
                f"{host}:{redis_port}",
                log_dir / "redis.log",
                phase=0,
                probe=security.redis_probe,
            )
        )
        metrics_port = free_port(host)
        metrics["scheduler"] = f"{host}:{metrics_port}"
        replica = ClusterSchedulerConfig(
            redis_url=redis_url,
            host=host,
            port=scheduler_port,
            accept_any_key=not up.require_api_key,
            api_keys_file=security.keys_file,
            tls=security.config,
            max_prefill_queue=up.max_prefill_queue,
            max_decode_queue=up.max_decode_queue,
        )
        argv = to_argv(SchedulerProcessConfig(replica, metrics_port=metrics_port))
        cluster.children.append(
            Child(
                "scheduler",
                [*baton, "scheduler", *argv],
                scheduler,
                log_dir / "scheduler.log",
                phase=1,
                probe=security.probe,
            )
        )
        worker = replace(worker, scheduler=scheduler, redis_url=redis_url)
    factory = WorkerFactory(tuple(baton), worker, log_dir, up.colocated, security.probe)
    pools = (
        [("decode", up.decode_workers)]
        if up.colocated
        else [("prefill", up.prefill_workers), ("decode", up.decode_workers)]
    )
    addresses: dict[str, str] = {}  # "prefill", "decode", "decode_2", … (role "both": "both", "both_2")
    for pool, count in pools:
        for i in range(1, count + 1):
            role = factory.role(pool)
            key = role if i == 1 else f"{role}_{i}"
            child, metrics[key] = factory.child(pool, i)
            addresses[key] = child.health_address
            cluster.children.append(child)
    grpc_port = up.grpc_port or free_port(host)
    http_port = up.http_port or free_port(host)
    by_role = {
        r: tuple(a for k, a in addresses.items() if k.split("_")[0] == r)
        for r in ("prefill", "decode", "both")
    }
    decode = () if scheduler else (by_role["decode"] or by_role["both"])
    prefill = () if scheduler else by_role["prefill"]
    gateway = GatewayConfig(
        model=up.model,
        host=host,
        grpc_port=grpc_port,
        http_port=http_port,
        scheduler=scheduler or None,
        decode_workers=decode,
        prefill_workers=prefill,
        drain_timeout_s=up.drain_timeout_s,
        tls=security.config,
        require_api_key=up.require_api_key,
        # Prometheus scrapes in plaintext and without a key on a port of its own when the API has either.
        metrics_port=free_port(host) if up.tls or up.require_api_key else None,
    )
    cluster.children.append(
        Child(
            "gateway",
            [*baton, "gateway", *to_argv(gateway)],
            f"{host}:{grpc_port}",
            log_dir / "gateway.log",
            phase=3,
            probe=security.probe,
        )
    )
    metrics["gateway"] = f"{host}:{gateway.metrics_port or http_port}"
    scheme = "https" if up.tls else "http"
    endpoints = {"grpc": f"{host}:{grpc_port}", "http": f"{scheme}://{host}:{http_port}", **addresses}
    if scheduler:
        endpoints["scheduler"] = scheduler
        endpoints["redis"] = redis_url
    endpoints.update({f"metrics:{name}": address for name, address in metrics.items()})
    return cluster, endpoints, factory


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


def banner(endpoints: dict[str, str], model_name: str, log_dir: Path, security: LocalSecurity) -> str:
    http = endpoints["http"]
    workers = ", ".join(
        f"{k} {v}" for k, v in endpoints.items() if k.split("_")[0] in ("prefill", "decode", "both")
    )
    metrics = " ".join(
        f"{k.removeprefix('metrics:')}=http://{v}/metrics"
        for k, v in endpoints.items()
        if k.startswith("metrics:")
    )
    autoscaling = (
        "\nThe autoscaler sizes the prefill and decode pools (its decisions are printed below)."
        if "metrics:autoscaler" in endpoints
        else ""
    )
    redis = endpoints.get("redis", "none")
    if security.redis_password:
        redis = redis.replace(security.redis_password, "***") + f"   (password in {security.redis_conf})"
    secured = ""
    if security.ca_file:
        secured += f"\n  TLS         : CA {security.ca_file} (development CA; mutual TLS inside the cluster)"
    if security.api_key:
        secured += f"\n  API key     : {security.api_key}   (tenant default; also in {log_dir / 'api-key'})"
    return f"""
Baton is up — model {model_name}
  OpenAI HTTP : {http}/v1   (health {http}/health)
  gRPC        : {endpoints["grpc"]}   (baton.v1.Gateway; reflection on){secured}
  workers     : {workers}
  scheduler   : {endpoints.get("scheduler", "none (static placement)")}
  redis       : {redis}
  metrics     : {metrics}
                (Prometheus: prometheus --config.file={log_dir / "prometheus.yml"}; Grafana: deploy/grafana/)
  logs        : {log_dir}

Try it:
  curl -s{security.curl_flags()} {http}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model_name}", "messages": [{{"role": "user", "content": "Which city is the capital of France?"}}], "max_tokens": 32, "temperature": 0}}'

A process that dies is started again, the rest serving on.{autoscaling}
Press Ctrl-C to stop everything.
""".rstrip()


def wait_serving(
    http: str, deadline: float, stop: Callable[[], bool], context: ssl.SSLContext | None = None
) -> bool:
    """Polls ``http``/health until it answers 200 (True), the deadline passes or ``stop()`` (False)."""
    import urllib.error
    import urllib.request

    while not stop() and time.monotonic() < deadline:
        with contextlib.suppress(urllib.error.URLError, OSError):  # 503 or not listening yet: ask again
            with urllib.request.urlopen(f"{http}/health", timeout=2, context=context) as resp:
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
    security = LocalSecurity.prepare(log_dir, up.host, up.tls, up.require_api_key)
    cluster, endpoints, factory = build_cluster(up, log_dir, args.verbose, security)
    if up.autoscale:
        endpoints["metrics:autoscaler"] = f"{up.host}:{free_port(up.host)}"
    (log_dir / "prometheus.yml").write_text(prometheus_config(endpoints))
    stopping = False
    autoscaling = threading.Event()  # set: the autoscaler's thread stops

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
        if not wait_serving(endpoints["http"], deadline, lambda: stopping, security.client_context()):
            if stopping:
                return 130
            print(
                f"baton up: the gateway's {endpoints['http']}/health did not report ready in time",
                file=sys.stderr,
            )
            return 1
        if up.autoscale:
            start_autoscaler(up, cluster, factory, endpoints, log_dir, autoscaling)
        print(banner(endpoints, Path(model_dir).name, log_dir, security), flush=True)
        while not stopping:  # as Kubernetes would: a child that dies is started again, the rest serve on
            for event in cluster.supervise():
                print(f"baton up: {event}", file=sys.stderr, flush=True)
            time.sleep(0.2)
        print("stopping …", flush=True)
        return 0
    finally:
        autoscaling.set()
        cluster.stop(grace_s=up.drain_timeout_s + 5.0)


def start_autoscaler(
    up: UpConfig,
    cluster: Supervisor,
    factory: WorkerFactory,
    endpoints: dict[str, str],
    log_dir: Path,
    stop: threading.Event,
) -> None:
    """`--autoscale`: the autoscaler's loop on a thread of the launcher, over the local scaler (worker
    processes started and retired here), reading the gateway's and the scheduler's /metrics; its own
    /metrics on the port the banner names. Each decision that changes a pool is printed."""
    from prometheus_client import start_http_server

    from autoscaler.controller import Autoscaler
    from autoscaler.policy import ReactivePolicy
    from autoscaler.signals import MetricsSource
    from services.local_scaler import LocalScaler

    source = MetricsSource(
        [f"http://{endpoints['metrics:gateway']}/metrics"],
        f"http://{endpoints['metrics:scheduler']}/metrics",
        up.autoscale_window_s,
    )

    decisions = log_dir / "autoscaler.log"

    def say(decision: Any) -> None:
        line = f"autoscaler: {decision.describe()}"
        print(f"baton up: {line}", file=sys.stderr, flush=True)
        with decisions.open("a") as f:  # for the operator (and the tests), as the other processes' logs
            f.write(f"{time.strftime('%H:%M:%S')} {line}\n")

    autoscaler = Autoscaler(source, ReactivePolicy(up.policy), LocalScaler(cluster, factory), on_decision=say)
    host, port = endpoints["metrics:autoscaler"].rsplit(":", 1)
    start_http_server(int(port), host, autoscaler.metrics.registry)
    threading.Thread(
        target=autoscaler.run, args=(up.autoscale_interval_s, stop), name="autoscaler", daemon=True
    ).start()


def add_up_parser(sub: Any) -> None:
    p = sub.add_parser("up", help="start a local cluster: gateway + prefill + decode workers, supervised")
    add_flags(p, UpConfig)
    p.set_defaults(func=run_up, parser=p)
