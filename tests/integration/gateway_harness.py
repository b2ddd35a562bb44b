"""Test harness for the gateway's integration tests: real worker and scheduler processes, a gateway on
its own event loop in a thread of the test process, and small synchronous clients (gRPC Generate and
Session, HTTP JSON, server-sent events)."""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc

from baton.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.gateway.server import GatewayConfig, GatewayServer, serve_gateway

ROOT = Path(__file__).resolve().parents[2]
FREE_TIMEOUT_S = 10.0


class ServiceProcess:
    """A `baton` subcommand as a user starts it, on a port of its choosing (``--port 0``: no race for a
    free port); its log goes to a file, which also tells the address it serves on."""

    _count = itertools.count()

    def __init__(self, name: str, log_dir: Path, *args: str) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}-{next(self._count)}.log"
        self._args = args
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
        self.stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(self.address))
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
            if (
                info.num_free_blocks == info.num_blocks
                and info.num_leases == 0
                and info.num_running == 0
                and info.num_waiting == 0
                and info.num_transfers == 0
            ):
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout_s:
                raise AssertionError(f"{self.role} worker still holds blocks after {timeout_s} s: {info}")
            time.sleep(0.005)


class SchedulerProcess(ServiceProcess):
    """`baton scheduler` over a Redis."""

    def __init__(self, redis_url: str, log_dir: Path, *flags: str) -> None:
        super().__init__("scheduler", log_dir, "scheduler", "--redis-url", redis_url, "--port", "0", *flags)
        self.stub: scheduler_pb2_grpc.SchedulerStub | None = None

    def wait_ready(self, deadline: float) -> None:
        self.wait_address(deadline)
        self.stub = scheduler_pb2_grpc.SchedulerStub(grpc.insecure_channel(self.address))

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
        self.channel = grpc.insecure_channel(self.server.grpc_address)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)
        self.url = self.server.http_url
        self.model = self.server.dispatcher.model.name
        # Whether KV moves from a prefill worker (every prompt is over the local-prefill threshold).
        self.disaggregated = bool(config.prefill_workers) and config.local_prefill_threshold <= 1

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.channel.close()
        self._call(self.server.stop(), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def grpc_generate(gw: GatewayThread, request: gateway_pb2.GenerateRequest) -> tuple[list[int], str, Any]:
    ids: list[int] = []
    text, completion = "", None
    for msg in gw.stub.Generate(request, timeout=60):
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

    def __init__(self, gw: GatewayThread) -> None:
        self._outbox: queue.Queue[gateway_pb2.SessionRequest | None] = queue.Queue()
        self._responses = gw.stub.Session(iter(self._outbox.get, None), timeout=60)

    def generate(self, rid: str, prompt: str, sampling: common_pb2.SamplingParams) -> None:
        self._outbox.put(
            gateway_pb2.SessionRequest(
                generate=gateway_pb2.GenerateRequest(request_id=rid, prompt=prompt, sampling=sampling)
            )
        )

    def cancel(self, rid: str) -> None:
        self._outbox.put(gateway_pb2.SessionRequest(cancel=gateway_pb2.CancelRequest(request_id=rid)))

    def next(self) -> gateway_pb2.SessionResponse:
        return next(self._responses)

    def close(self) -> list[gateway_pb2.SessionResponse]:
        self._outbox.put(None)
        return list(self._responses)


def http_json(
    gw: GatewayThread,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    method: str | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        gw.url + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def sse_events(gw: GatewayThread, path: str, body: Any) -> tuple[http.client.HTTPConnection, Iterator[Any]]:
    """Opens a streaming request; yields each `data:` payload (parsed JSON, or the string [DONE])."""
    host, port = gw.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
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
