"""The one harness of the integration and end-to-end tests (tests/integration, tests/e2e): what they start,
how they wait, and the small clients they call with. Each helper lives here once.

* **Waiting**: `eventually` / `eventually_async` poll a condition until it holds (never sleep a fixed
  time and then assert); `SLACK_S` is what a busy 2-core machine may add to a timeout a test waits out.
* **Processes**: `baton` (a `python -m services.cli` command run to its end), `loadgen`, and the services
  as a user starts them — `WorkerProcess` (`start_workers`, `running_workers`), `SchedulerProcess` (on a
  port of their choosing, or `free_port()`), `GatewayThread` (a gateway on its own event loop in this
  process), `Cluster` (workers registered with a scheduler, a gateway placing through it) and `BatonUp`
  (`baton up`).
* **State**: `on_redis` (one call against a Redis), `add_tenants`, `own_database`, `second_build`; `idle`
  (a worker's `Info` with nothing left), `metric` (a sample of this process's gateway registry), `Scrape`
  (a process's /metrics page), `PLACED` (the gateway's log line of a placement).
* **Clients**: `grpc_generate`, `SessionClient`, the raw-bytes gRPC calls, `http_json`, `sse_events` —
  against a `GatewayThread` or a `BatonUp`.

Importable as ``harness`` from every test directory: ``tests/`` is on ``sys.path`` (its conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.client
import itertools
import json
import queue
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from prometheus_client.parser import text_string_to_metric_families

from baton.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from rpc.tls import Tls, sync_channel
from services.gateway.server import GatewayConfig, GatewayServer, serve_gateway

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from scheduler.tenants import TenantConfig

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
FREE_TIMEOUT_S = 10.0
# What a busy 2-core machine (CI keeps one core spinning) may add to a timeout a test waits out: a test
# that checks something happens "within the configured timeout" allows the timeout plus this.
SLACK_S = 5.0
# The gateway's log line of a placement: request id, decode worker, version, shadow worker ("-": none).
PLACED = re.compile(r"request (\S+) placed: prefill=\S+ decode=(\S+) .* version=(\S+) shadow=(\S+)")


# --- waiting ---------------------------------------------------------------------------------------


def offline_tokens(model: Path, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
    """What the engine generates offline for each prompt (greedy, fp32, EOS ignored): the tokens a
    served stream must equal, whatever moved it between workers."""
    from core.sampling_params import SamplingParams
    from engine import LLM

    llm = LLM(str(model), dtype="float32", kv_cache_memory=32 << 20, num_threads=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(list(prompts), params)]


def eventually(check: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.02) -> float:
    """Polls ``check()`` every ``interval_s`` until it holds; returns the seconds that took. Fails naming
    ``what`` once ``timeout_s`` have passed (``check`` is always tried once more after the last sleep)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(interval_s)
    return time.monotonic() - start


async def eventually_async(
    check: Callable[[], Awaitable[bool]], timeout_s: float, what: str, interval_s: float = 0.02
) -> float:
    """`eventually` on an event loop: ``await check()``, the loop free between tries."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(interval_s)
    return time.monotonic() - start


# --- commands --------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a service that must come back on the same address (a
    restart); anything that is started once takes ``--port 0`` instead (no race for the port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def baton(*args: str, timeout_s: float = 60.0) -> str:
    """``baton ARGS`` (``python -m services.cli``) as an operator types it, run to its end; its stdout.
    Fails with everything it printed if it exits non-zero. (From a test body on an event loop that
    serves the process's peer: ``await asyncio.to_thread(baton, ...)``.)"""
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def loadgen(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """``loadgen ARGS`` (``python -m loadgen``) as a user runs it, to its end; the test checks the result."""
    return subprocess.run(
        [sys.executable, "-m", "loadgen", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s
    )


# --- Redis -----------------------------------------------------------------------------------------


def on_redis(redis_url: str, body: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    """``body(client)`` on a fresh `redis.asyncio` client (decoded responses), closed afterwards."""
    import redis.asyncio as aioredis

    async def run() -> T:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(run())


def own_database(redis_url: str, db: int) -> str:
    """The URL of database ``db`` on the server of ``redis_url``, emptied: a module's own on the session's
    redis-server."""
    import redis

    url = redis_url.rsplit("/", 1)[0] + f"/{db}"
    client = redis.Redis.from_url(url)
    client.flushdb()
    client.close()
    return url


def add_tenants(
    redis_url: str, tenants: Collection[TenantConfig] = (), keys: dict[str, str] | None = None
) -> None:
    """Adds ``tenants`` and API keys (key → tenant) to a scheduler's Redis, once the scheduler has created
    its default tenant there (it does before it serves)."""
    from scheduler.tenants import TenantDirectory

    async def add(client: aioredis.Redis) -> None:
        directory = TenantDirectory(client)
        deadline = time.monotonic() + 30
        while await directory.get_tenant("default") is None:
            assert time.monotonic() < deadline, "the scheduler did not create its default tenant"
            await asyncio.sleep(0.05)
        for tenant in tenants:
            await directory.add_tenant(tenant)
        for key, name in (keys or {}).items():
            await directory.add_api_key(key, name)

    on_redis(redis_url, add)


def second_build(model: Path, parent: Path) -> Path:
    """The same weights under the same name (``parent / model.name``), but a config with one more
    (ignored) key: a new digest, so a second version of the model."""
    copy = parent / model.name
    shutil.copytree(model, copy)
    config = json.loads((copy / "config.json").read_text())
    config["baton_build"] = 2
    (copy / "config.json").write_text(json.dumps(config))
    return copy


# --- the services as processes ---------------------------------------------------------------------


class ServiceProcess:
    """A `baton` subcommand as a user starts it, on a port of its choosing (``--port 0``: no race for a
    free port); its log goes to a file, which also tells the address it serves on."""

    _count = itertools.count()

    def __init__(self, name: str, log_dir: Path, *args: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}-{next(self._count)}.log"
        self._args = args
        # Started with --tls-dir: the test talks to it over mutual TLS with the same certificate.
        self.tls = Tls.load(args[args.index("--tls-dir") + 1]) if "--tls-dir" in args else None
        self._log = self.log_path.open("w")
        self.proc = self._launch()
        self.address = ""

    def _launch(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "services.cli", *self._args],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def restart(self, deadline: float) -> None:
        """Starts the same command again (after `kill`); it must bind the same address (a fixed port)."""
        assert self.proc.poll() is not None, "restart() needs the process to have exited"
        served, self.address = self.address, ""
        starts = self.log_path.read_text().count("serving on")
        self.proc = self._launch()
        while self.log_path.read_text().count("serving on") == starts:
            assert self.proc.poll() is None, f"{self.name} exited: {self.log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name} did not restart"
            time.sleep(0.05)
        self.address = served

    def wait_address(self, deadline: float) -> None:
        while not self.address:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-3000:]}")
            match = re.search(r"serving on (\S+:\d+)", self.log_path.read_text())
            if match:
                self.address = match.group(1)
            else:
                assert time.monotonic() < deadline, f"{self.name} did not start: {self.log_path.read_text()}"
                time.sleep(0.1)

    def channel(self) -> grpc.Channel:
        """A channel to its gRPC port, as its peers open one (mutual TLS if it was given --tls-dir)."""
        return sync_channel(self.address, self.tls)

    def kill(self) -> None:
        """SIGKILL: no goodbye to the scheduler, connections simply break."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def idle(info: worker_pb2.InfoResponse) -> bool:
    """A worker's `Info` with every block free and no lease, request or transfer left."""
    return (
        info.num_free_blocks == info.num_blocks
        and info.num_leases == 0
        and info.num_running == 0
        and info.num_waiting == 0
        and info.num_transfers == 0
    )


class WorkerProcess(ServiceProcess):
    """`baton worker` on the tiny model (16 MiB of KV cache, one thread)."""

    def __init__(self, role: str, model: Path, log_dir: Path, *flags: str) -> None:
        super().__init__(
            f"worker-{role}",
            log_dir,
            "worker",
            "--role",
            role,
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--kv-cache-memory",
            "16MiB",
            "--threads",
            "1",
            "--dtype",
            "float32",
            *flags,
        )
        self.role = role
        self.stub: worker_pb2_grpc.WorkerStub | None = None

    def wait_ready(self, deadline: float) -> None:
        self.wait_address(deadline)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel())
        self.info()

    def info(self) -> worker_pb2.InfoResponse:
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker {self.role} exited: {self.log_path.read_text()[-3000:]}")
        assert self.stub is not None
        return self.stub.Info(worker_pb2.InfoRequest(), timeout=5)

    def wait_all_free(self, timeout_s: float = FREE_TIMEOUT_S) -> float:
        """Seconds until every block is free and no lease or request remains."""
        start = time.perf_counter()
        while True:
            info = self.info()
            if idle(info):
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout_s:
                raise AssertionError(f"{self.role} worker still holds blocks after {timeout_s} s: {info}")
            time.sleep(0.005)


def start_workers(
    model: Path, log_dir: Path, *roles: str, flags: tuple[str, ...] = ()
) -> list[WorkerProcess]:
    """A `WorkerProcess` per role, started at once; returns when every one serves (or stops them all and
    fails)."""
    workers = [WorkerProcess(role, model, log_dir, *flags) for role in roles]
    try:
        deadline = time.monotonic() + 120
        for worker in workers:
            worker.wait_ready(deadline)
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


@contextlib.contextmanager
def running_workers(
    model: Path, log_dir: Path, *roles: str, flags: tuple[str, ...] = ()
) -> Iterator[list[WorkerProcess]]:
    """`start_workers`, stopped on the way out."""
    workers = start_workers(model, log_dir, *roles, flags=flags)
    try:
        yield workers
    finally:
        for worker in workers:
            worker.stop()


class SchedulerProcess(ServiceProcess):
    """`baton scheduler` over a Redis."""

    def __init__(self, redis_url: str, log_dir: Path, *flags: str) -> None:
        super().__init__("scheduler", log_dir, "scheduler", "--redis-url", redis_url, "--port", "0", *flags)
        self.stub: scheduler_pb2_grpc.SchedulerStub | None = None

    def wait_ready(self, deadline: float) -> None:
        self.wait_address(deadline)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel())

    def num_workers(self) -> int:
        """Healthy workers of every model version, as placement sees them."""
        assert self.stub is not None
        versions = self.stub.ListModelVersions(scheduler_pb2.ListModelVersionsRequest(), timeout=5).versions
        return sum(v.num_workers for v in versions)


class GatewayThread:
    """A gateway served by `serve_gateway` on its own event loop in a thread of this process."""

    def __init__(self, config: GatewayConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="gateway-loop", daemon=True)
        self.thread.start()
        self.server: GatewayServer = self._call(serve_gateway(config), 120)
        self.tls = config.tls.load()
        self.channel = sync_channel(self.server.grpc_address, self.tls)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.url = self.server.http_url
        self.model = self.server.dispatcher.model.name
        # Whether KV moves from a prefill worker (every prompt is over the local-prefill threshold).
        self.disaggregated = bool(config.prefill_workers) and config.local_prefill_threshold <= 1

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stops the gateway; what is still in flight gets ``grace_s`` seconds (a test's default: none)."""
        self.channel.close()
        self._call(self.server.stop(grace_s), 30 + grace_s)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def __enter__(self) -> GatewayThread:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class Cluster:
    """Worker processes registered with a `baton scheduler` over a Redis, and a gateway (in this process)
    that places every request through the scheduler. Given a ``scheduler``, the cluster uses it (and
    leaves it running); else it starts one with ``scheduler_flags`` (and stops it with the rest). As a
    context manager it stops everything on the way out."""

    def __init__(
        self, redis_url: str, log_dir: Path, *scheduler_flags: str, scheduler: SchedulerProcess | None = None
    ) -> None:
        self.redis_url, self.log_dir = redis_url, log_dir
        self.workers: list[WorkerProcess] = []
        self.gateway: GatewayThread | None = None
        self._owns_scheduler = scheduler is None
        if scheduler is None:
            scheduler = SchedulerProcess(redis_url, log_dir, *scheduler_flags)
            try:
                scheduler.wait_ready(time.monotonic() + 60)
            except BaseException:
                scheduler.stop()
                raise
        self.scheduler = scheduler

    def add_workers(
        self, model: Path, *roles: str, flags: tuple[str, ...] = (), kv_transport: str | None = "tcp"
    ) -> list[WorkerProcess]:
        """Starts a worker per role (all at once), registered with the scheduler and listening on the
        cancellation bus; returns once each serves and the scheduler counts every worker of the cluster.
        One at a time, the first version registered gets the weight."""
        transport = ("--kv-transport", kv_transport) if kv_transport else ()
        joined = (*transport, "--scheduler", self.scheduler.address, "--redis-url", self.redis_url, *flags)
        added = start_workers(model, self.log_dir, *roles, flags=joined)
        self.workers += added
        n = len(self.workers)
        eventually(lambda: self.scheduler.num_workers() == n, 30, f"{n} workers registered")
        return added

    def start_gateway(self, model: Path, **config: Any) -> GatewayThread:
        """A gateway on ``model`` (any free ports) that places through the scheduler."""
        defaults: dict[str, Any] = dict(grpc_port=0, http_port=0, startup_timeout=60)
        self.gateway = GatewayThread(
            GatewayConfig(scheduler=self.scheduler.address, model=str(model), **{**defaults, **config})
        )
        return self.gateway

    def stop(self) -> None:
        """Stops the gateway and the workers (and the scheduler if the cluster started it)."""
        if self.gateway is not None:
            self.gateway.stop()
            self.gateway = None
        for worker in self.workers:
            worker.stop()
        if self._owns_scheduler:
            self.scheduler.stop()

    def __enter__(self: T) -> T:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


# --- baton up --------------------------------------------------------------------------------------


def launch_baton_up(
    log_dir: Path, *flags: str, timeout_s: float = 240.0
) -> tuple[subprocess.Popen[str], str]:
    """`baton up` as a user starts it (any free ports, one thread per worker, logs in ``log_dir``), and
    its banner as printed up to "Press Ctrl-C" (or whatever it printed before exiting or ``timeout_s``)."""
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "up",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--threads",
        "1",
        "--log-dir",
        str(log_dir),
        *flags,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "Press Ctrl-C" in line:
            break
    return proc, "".join(lines)


@dataclass
class BatonUp:
    """A running `baton up`: where its banner says it serves."""

    proc: subprocess.Popen[str]
    http: str  # the gateway's HTTP root (http://host:port)
    grpc: str  # the gateway's gRPC address
    redis: str  # the Redis URL ("" if it runs none)
    metrics: dict[str, str]  # process → its /metrics URL
    banner: str
    _channel: grpc.Channel | None = field(default=None, repr=False)

    @property
    def url(self) -> str:  # as a GatewayThread's, for the clients below
        return self.http

    @functools.cached_property
    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        self._channel = grpc.insecure_channel(self.grpc)
        return gateway_pb2_grpc.GatewayStub(self._channel)

    def children(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def shut_down(self) -> None:
        """Ctrl-C (so the launcher stops its children), then SIGKILL if it has not exited in 30 s."""
        if self._channel is not None:
            self._channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_baton_up(
    log_dir: Path, *flags: str, timeout_s: float = 240.0, metrics_of: Collection[str] = ()
) -> BatonUp:
    """`baton up` ready to serve. Fails (killing it) unless its banner gives the HTTP and gRPC addresses
    and — with ``metrics_of`` — a Redis URL and the /metrics URLs of exactly those processes."""
    proc, text = launch_baton_up(log_dir, *flags, timeout_s=timeout_s)
    http_url = re.search(r"OpenAI HTTP : (https?://\S+)/v1", text)
    grpc_addr = re.search(r"gRPC\s+: (\S+)", text)
    redis_url = re.search(r"redis\s+: (redis://\S+)", text)
    metrics = dict(re.findall(r"(\w+)=(http://\S+/metrics)", text))
    ready = http_url and grpc_addr and (not metrics_of or (redis_url and set(metrics) == set(metrics_of)))
    if not ready:
        proc.kill()
        raise AssertionError(f"baton up did not become ready:\n{text}")
    assert http_url and grpc_addr
    return BatonUp(
        proc, http_url.group(1), grpc_addr.group(1), redis_url.group(1) if redis_url else "", metrics, text
    )


# --- metrics ---------------------------------------------------------------------------------------


def metric(name: str, labels: dict[str, str] | None = None) -> float:
    """A sample of this process's gateway registry (a `GatewayThread`'s); 0 if it has none yet."""
    from services.gateway.metrics import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


class Scrape:
    """One /metrics page, parsed."""

    def __init__(self, url: str) -> None:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("text/plain")
            text = r.read().decode()
        self.families = {f.name: f for f in text_string_to_metric_families(text)}

    def value(self, sample: str, **labels: str) -> float:
        """The sum of ``sample`` over the series whose labels include ``labels``."""
        return sum(
            s.value
            for f in self.families.values()
            for s in f.samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def labels(self, sample: str, label: str) -> set[str]:
        return {s.labels[label] for f in self.families.values() for s in f.samples if s.name == sample}


# --- clients ---------------------------------------------------------------------------------------

Gateway = GatewayThread | BatonUp  # what the clients below call: a `url` (HTTP) and a `stub` (gRPC)


def grpc_generate(
    gw: Gateway, request: gateway_pb2.GenerateRequest, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[list[int], str, Any]:
    """A Generate call to its end: token ids, text and the completion."""
    ids: list[int] = []
    text, completion = "", None
    for msg in gw.stub.Generate(request, timeout=60, metadata=metadata or None):
        if msg.HasField("delta"):
            ids += msg.delta.token_ids
            text += msg.delta.text
        else:
            completion = msg.completion
    return ids, text, completion


def grpc_raw_generate(gw: GatewayThread, data: bytes) -> list[gateway_pb2.GenerateResponse]:
    """Generate with ``data`` sent as the request message's bytes, as they are (e.g. not valid UTF-8)."""
    call = gw.channel.unary_stream(
        "/baton.v1.Gateway/Generate",
        request_serializer=lambda b: b,
        response_deserializer=gateway_pb2.GenerateResponse.FromString,
    )
    return list(call(data, timeout=60))


def grpc_raw_session(gw: GatewayThread, messages: list[bytes]) -> list[gateway_pb2.SessionResponse]:
    """A Session whose request messages are sent as the given bytes; every response until it ends."""
    call = gw.channel.stream_stream(
        "/baton.v1.Gateway/Session",
        request_serializer=lambda b: b,
        response_deserializer=gateway_pb2.SessionResponse.FromString,
    )
    return list(call(iter(messages), timeout=60))


def grpc_raw_cancel(gw: GatewayThread, data: bytes) -> gateway_pb2.CancelResponse:
    call = gw.channel.unary_unary(
        "/baton.v1.Gateway/Cancel",
        request_serializer=lambda b: b,
        response_deserializer=gateway_pb2.CancelResponse.FromString,
    )
    return call(data, timeout=30)


class SessionClient:
    """A gRPC Session driven from this thread: send() requests, next() responses."""

    def __init__(self, gw: Gateway) -> None:
        self._outbox: queue.Queue[gateway_pb2.SessionRequest | None] = queue.Queue()
        self._responses = gw.stub.Session(iter(self._outbox.get, None), timeout=60)

    def generate(
        self, rid: str, prompt: str, sampling: common_pb2.SamplingParams, n: int | None = None
    ) -> None:
        request = gateway_pb2.GenerateRequest(request_id=rid, prompt=prompt, sampling=sampling)
        if n is not None:
            request.n = n
        self._outbox.put(gateway_pb2.SessionRequest(generate=request))

    def cancel(self, rid: str) -> None:
        self._outbox.put(gateway_pb2.SessionRequest(cancel=gateway_pb2.CancelRequest(request_id=rid)))

    def next(self) -> gateway_pb2.SessionResponse:
        return next(self._responses)

    def close(self) -> list[gateway_pb2.SessionResponse]:
        self._outbox.put(None)
        return list(self._responses)


def http_json(
    gw: Gateway,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    method: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """An HTTP call with a JSON (or ``raw``) body: status, headers and the JSON answer (errors too)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        gw.url + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    tls: Tls | None = getattr(gw, "tls", None)
    context = ssl.create_default_context(cadata=tls.ca.decode()) if tls else None
    try:
        with urllib.request.urlopen(req, timeout=60, context=context) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def sse_events(
    gw: Gateway, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[http.client.HTTPConnection, Iterator[Any]]:
    """Opens a streaming request; yields each `data:` payload (parsed JSON, or the string [DONE])."""
    host, port = gw.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.getheader("Content-Type", "").startswith("text/event-stream")

    def events() -> Iterator[Any]:
        for line in response:
            line = line.strip()
            if line.startswith(b"data: "):
                payload = line.removeprefix(b"data: ").decode()
                yield payload if payload == "[DONE]" else json.loads(payload)

    return conn, events()


# --- a gateway as a process ------------------------------------------------------------------------


class GatewayProcess(ServiceProcess):
    """`baton gateway` placing through a scheduler, started the way a user starts it (``-v``: its log
    says where it serves): a process of its own, so a test can SIGKILL it (`kill`) and see what its
    clients and the cluster get, then start it again (`restart`, on the same ports, as a restarted pod
    comes back). ``url`` and ``stub`` serve the clients above (`http_json`, `grpc_generate`) as a
    `GatewayThread`'s do."""

    def __init__(self, scheduler: str, model: Path, log_dir: Path, *flags: str) -> None:
        self.grpc_port, self.http_port = free_port(), free_port()
        super().__init__(
            "gateway",
            log_dir,
            "-v",
            "gateway",
            "--scheduler",
            scheduler,
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(self.grpc_port),
            "--http-port",
            str(self.http_port),
            *flags,
        )
        self.url = f"http://127.0.0.1:{self.http_port}"
        self._starts = 0  # the "serving" lines its log had when it was last ready
        self._channel: grpc.Channel | None = None
        self.stub: gateway_pb2_grpc.GatewayStub | None = None

    def wait_ready(self, deadline: float) -> None:
        """Until this start of it serves: its log says so and /health answers 200 (the scheduler has
        its workers); then a new channel to it."""
        while (starts := self.log_path.read_text().count("gateway serving gRPC on")) <= self._starts:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {self.log_path.read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"gateway did not start: {self.log_path.read_text()[-3000:]}"
            time.sleep(0.1)
        self._starts = starts
        self.address = f"127.0.0.1:{self.grpc_port}"
        eventually(self.healthy, max(1.0, deadline - time.monotonic()), "gateway /health 200")
        if self._channel is not None:
            self._channel.close()
        self._channel = self.channel()
        self.stub = gateway_pb2_grpc.GatewayStub(self._channel)

    def healthy(self) -> bool:
        """Whether its /health answers 200 (it serves, and the scheduler has its workers)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def restart(self, deadline: float) -> None:
        """The same command again (after `kill`), on the same ports; returns once it serves."""
        assert self.proc.poll() is not None, "restart() needs the process to have exited"
        self.proc = self._launch()
        self.wait_ready(deadline)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        super().stop()


# --- Redis with Sentinel ---------------------------------------------------------------------------


class RedisSentinels:
    """A Redis master, one replica of it (``--replicaof``) and three sentinels monitoring it as
    ``baton`` (quorum 2, down after 1 s), each a redis-server process on loopback (the binary
    `scheduler.redis_server.redis_binary` finds; ``--sentinel`` makes it a sentinel). ``url`` is the
    ``redis+sentinel://`` URL of the group (rpc.redis_url); `kill_master` SIGKILLs the master and
    `wait_failover` waits for the sentinels to promote the replica."""

    MASTER = "baton"

    def __init__(self, log_dir: Path) -> None:
        from scheduler.redis_server import redis_binary

        self.dir = log_dir / "redis-sentinels"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.binary = redis_binary()
        self.master_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.url = (
            "redis+sentinel://"
            + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
            + f"/{self.MASTER}/0"
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def _start(self, name: str, *args: str) -> None:
        with open(self.dir / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                [self.binary, *args], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def start(self, timeout_s: float = 30.0) -> RedisSentinels:
        """Starts them all; returns once each sentinel knows the master, the replica and the other two
        sentinels and the replica is in sync (a failover needs all of that)."""
        import redis

        node = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--protected-mode", "no"]
        for name, port in (("master", self.master_port), ("replica", self.replica_port)):
            (self.dir / name).mkdir(exist_ok=True)
            of = ("--replicaof", "127.0.0.1", str(self.master_port)) if name == "replica" else ()
            self._start(name, *node, "--port", str(port), "--dir", str(self.dir / name), *of)
        for i, port in enumerate(self.sentinel_ports):
            conf = self.dir / f"sentinel-{i}.conf"  # a sentinel rewrites its file: one each
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\nprotected-mode no\ndir {self.dir}\n"
                f"sentinel monitor {self.MASTER} 127.0.0.1 {self.master_port} 2\n"
                f"sentinel down-after-milliseconds {self.MASTER} 1000\n"
                f"sentinel failover-timeout {self.MASTER} 5000\n"
                f"sentinel parallel-syncs {self.MASTER} 1\n"
            )
            self._start(f"sentinel-{i}", str(conf), "--sentinel")

        def ready() -> bool:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    log = (self.dir / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"redis {name} exited:\n{log}")
            try:
                for port in self.sentinel_ports:
                    with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as sentinel:
                        state = sentinel.sentinel_master(self.MASTER)
                    if state["num-other-sentinels"] != 2 or state["num-slaves"] != 1:
                        return False
                with redis.Redis(port=self.replica_port, decode_responses=True, socket_timeout=1) as r:
                    return bool(r.info("replication")["master_link_status"] == "up")
            except redis.RedisError:
                return False

        try:
            eventually(ready, timeout_s, "the sentinels see the master, the replica and each other", 0.1)
        except BaseException:
            self.stop()
            raise
        return self

    def master(self) -> tuple[str, int]:
        """The master's address as the sentinels name it now."""
        import redis

        with redis.Redis(port=self.sentinel_ports[0], decode_responses=True, socket_timeout=1) as s:
            host, port = s.sentinel_get_master_addr_by_name(self.MASTER)
        return str(host), int(port)

    def kill_master(self) -> None:
        """SIGKILL the master (it is not started again)."""
        proc = self.procs["master"]
        proc.kill()
        proc.wait(10)

    def wait_failover(self, timeout_s: float) -> float:
        """Seconds until every sentinel names the replica as the master."""
        import redis

        def promoted() -> bool:
            try:
                for port in self.sentinel_ports:
                    with redis.Redis(port=port, decode_responses=True, socket_timeout=1) as s:
                        named = s.sentinel_get_master_addr_by_name(self.MASTER)
                    if not named or int(named[1]) != self.replica_port:
                        return False
                return True
            except redis.RedisError:
                return False

        return eventually(promoted, timeout_s, "the sentinels promoted the replica", 0.05)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def __enter__(self) -> RedisSentinels:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
