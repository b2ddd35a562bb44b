"""The processes of a local cluster, supervised as Kubernetes would: each `Child` is started, checked
for health, and — when it exits while the cluster runs — started again with the same command line (so
the same ports) after a backoff that doubles with each quick death (0.5 s up to 10 s; a child that ran
for a minute starts again at 0.5 s). The rest keep serving meanwhile: a decode worker's streams migrate
to another decode worker, a scheduler's work waits for its return. Only `Supervisor.stop` (Ctrl-C) ends
them — or `retire`, the local scaler's scale-down: the child is sent SIGTERM (it drains) and, once it
has exited, forgotten instead of restarted. `add` starts a new child while the rest run (a scale-up);
both may be called from another thread. Torch-free, like `baton up`."""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc.tls import Tls, sync_channel

BACKOFF_S = 0.5  # before the first restart of a child that died
MAX_BACKOFF_S = 10.0
STABLE_S = 60.0  # a child that ran this long before it died starts again at BACKOFF_S


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


def health_status(address: str, service: str = "", timeout_s: float = 1.0, tls: Tls | None = None) -> str:
    """The gRPC health status a process at ``address`` answers (SERVING, NOT_SERVING, …), or UNREACHABLE
    with the reason when it does not answer; over mutual TLS with ``tls``."""
    try:
        with sync_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError as e:
        return f"UNREACHABLE ({e.code().name})"


def is_serving(address: str, tls: Tls | None = None) -> bool:
    return health_status(address, tls=tls) == "SERVING"


def redis_ping(address: str, password: str | None = None) -> bool:
    import redis

    host, port = address.rsplit(":", 1)
    try:
        client = redis.Redis(host=host, port=int(port), password=password, socket_connect_timeout=0.5)
        return bool(client.ping())
    except redis.RedisError:
        return False


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
    started_at: float = 0.0
    restarts: int = 0
    quick_deaths: int = 0  # deaths in a row, each before STABLE_S: the next backoff doubles
    restart_at: float | None = None  # it died: when to start it again
    pool: str = ""  # the worker pool it belongs to ("prefill", "decode"), for the local scaler
    retiring_since: float | None = None  # retired: sent SIGTERM at this time, never restarted

    def healthy(self) -> bool:
        return (self.probe or is_serving)(self.health_address)

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 — closed by the child's lifetime; a restart appends
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        self.started_at = time.monotonic()

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass(slots=True)
class Supervisor:
    children: list[Child] = field(default_factory=list)
    state_path: Path | None = None  # where the children's names, pids and addresses are written
    lock: threading.RLock = field(default_factory=threading.RLock)  # `add` and `retire` come from elsewhere

    def add(self, child: Child) -> None:
        """Starts a new child while the rest run (it is supervised from now on)."""
        with self.lock:
            self.children.append(child)
            child.start()
            self.write_state()

    def retire(self, child: Child) -> None:
        """Sends the child SIGTERM (a worker drains: its streams finish or move on) and lets it go: it is
        not started again, and is dropped once it has exited."""
        with self.lock:
            if child.retiring_since is not None:
                return
            child.retiring_since = time.monotonic()
            child.restart_at = None
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
            self.write_state()

    def start_phase(self, phase: int) -> list[Child]:
        started = [c for c in self.children if c.phase == phase]
        for c in started:
            c.start()
        self.write_state()
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

    def supervise(self, now: float | None = None) -> list[str]:
        """One pass: notes children that died (scheduling their restart) and restarts those whose
        backoff is over. Returns what happened, a line each, for the operator."""
        now = time.monotonic() if now is None else now
        events = []
        with self.lock:
            for c in list(self.children):
                if c.retiring_since is not None:
                    if c.proc is None or c.proc.poll() is not None:
                        self.children.remove(c)
                        self.write_state()
                        code = c.proc.returncode if c.proc is not None else None
                        events.append(
                            f"{c.name} retired: exited ({code}) {now - c.retiring_since:.1f} s after SIGTERM"
                        )
                    continue
                events.extend(self._supervise_one(c, now))
        return events

    def _supervise_one(self, c: Child, now: float) -> list[str]:
        if c.proc is None:
            return []
        if c.restart_at is None and c.proc.poll() is not None:
            c.quick_deaths = c.quick_deaths + 1 if now - c.started_at < STABLE_S else 1
            backoff = min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (c.quick_deaths - 1))
            c.restart_at = now + backoff
            return [f"{c.name} exited ({c.proc.returncode}); starting it again in {backoff:g} s\n{c.tail(5)}"]
        if c.restart_at is not None and now >= c.restart_at:
            c.restart_at = None
            c.restarts += 1
            c.start()
            self.write_state()
            return [f"{c.name} started again (restart {c.restarts}, pid {c.proc.pid})"]
        return []

    def write_state(self) -> None:
        """The children's names, pids and addresses, as JSON (for operators and tests: which pid is which)."""
        if self.state_path is None:
            return
        state = [
            {
                "name": c.name,
                "pid": c.proc.pid if c.proc else None,
                "address": c.health_address,
                "restarts": c.restarts,
                "pool": c.pool,
                "retiring": c.retiring_since is not None,
            }
            for c in self.children
        ]
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_path)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM everyone (gateway first, so it stops taking requests), then SIGKILL stragglers."""
        with self.lock:
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
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
