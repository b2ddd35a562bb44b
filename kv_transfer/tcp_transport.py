"""TCP backend: a portable fallback with no native dependency.

The source runs one small server thread (blocked in ``accept``/``recv`` when idle, so it costs no CPU)
that streams the requested block runs straight from the cache tensor's memory; the puller receives
them with ``recv_into`` straight into its own blocks, in a background thread, and then sends the
lease's release on the same connection. Notifications land in a queue the engine loop drains.

The port is the source's own, so the source guards it. It listens on the worker's ``--host`` only. A
frame is a 4-byte length (at most ``MAX_FRAME_BYTES``) and a JSON object of a known ``op`` with typed
fields; anything else drops the connection. Every frame carries the source's credential, a random
token that travels only inside the transfer metadata (which a peer gets over the worker's gRPC port,
mutual TLS when the cluster has certificates) and is compared in constant time. A read names its
lease and may touch only that lease's blocks (`LeaseGrants`). Each refusal is counted (``refused``).
The KV bytes themselves travel in clear: on an untrusted network use NIXL over RDMA, or a encrypted
pod network.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import secrets
import socket
import struct
import threading
from typing import Any

import torch

from core.errors import KVTransferFailed
from kv_transfer.handle import KVLayout, block_runs, check_block_ids
from kv_transfer.transport import (
    NOTIFY_ABORT,
    NOTIFY_RELEASE,
    LeaseGrants,
    PeerHeader,
    ThreadPull,
    pack_metadata,
    unpack_metadata,
)

log = logging.getLogger(__name__)

_IO_TIMEOUT_S = 10.0
MAX_FRAME_BYTES = 1 << 20  # a read of a whole long prompt's runs is a few KiB


class _Refused(Exception):
    """A frame the source will not serve: no or a wrong credential, malformed, or outside its lease."""


def _send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    while len(view):
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("the peer closed the connection mid-transfer")
        view = view[got:]


def _recv_msg(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > MAX_FRAME_BYTES:
        raise _Refused(f"a frame of {n} bytes")
    result = json.loads(_recv_exact(sock, n))
    if not isinstance(result, dict):
        raise _Refused("a frame that is not a JSON object")
    return result


def _runs(value: Any, num_blocks: int) -> list[tuple[int, int]]:
    """A read's ``[[first block, count], ...]``, each run inside the cache."""
    if not isinstance(value, list) or not value:
        raise _Refused("a read without runs")
    runs = []
    for run in value:
        if not (isinstance(run, list) and len(run) == 2 and all(type(x) is int for x in run)):
            raise _Refused("a malformed run")
        s, n = run
        if s < 0 or n < 1 or s + n > num_blocks:
            raise _Refused("a run outside the cache")
        runs.append((s, n))
    return runs


def _byte_view(cache: torch.Tensor) -> memoryview:
    return memoryview(cache.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]


class TcpTransport:
    """Serves this worker's blocks on ``host:port`` and pulls peers' blocks over plain sockets."""

    def __init__(
        self, name: str, layout: KVLayout, host: str = "127.0.0.1", advertise_host: str | None = None
    ) -> None:
        self.name = name
        self.layout = layout
        self._cache: torch.Tensor | None = None
        self._peers: dict[str, PeerHeader] = {}
        self._notes: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        self._server = socket.create_server((host, 0))
        bound_host, bound_port = self._server.getsockname()[:2]
        self.address = f"{advertise_host or bound_host}:{bound_port}"  # what peers connect to
        self._closed = False
        self._credential = secrets.token_hex(32)
        self.grants = LeaseGrants()
        self.refused = 0
        threading.Thread(target=self._serve, daemon=True, name="kv-tcp-server").start()

    def register(self, kv_cache: torch.Tensor) -> torch.Tensor:
        if self._cache is not None and kv_cache.data_ptr() == self._cache.data_ptr():
            return self._cache  # already registered (a worker with both roles registers once)
        if not kv_cache.is_contiguous() or kv_cache.is_cuda:
            raise ValueError("the tcp KV transport needs one contiguous host tensor")
        self._cache = kv_cache
        return kv_cache

    def metadata(self) -> bytes:
        cache = self._require_cache()
        return pack_metadata(
            PeerHeader("tcp", self.name, self.layout, 0, cache.shape[0], self.address, self._credential)
        )

    def add_peer(self, metadata: bytes) -> str:
        header, _ = unpack_metadata(metadata)
        if header.backend != "tcp":
            raise KVTransferFailed(f"peer {header.name} speaks {header.backend!r}, not tcp")
        self.layout.check_compatible(header.layout)
        self._peers[header.name] = header
        return header.name

    def start_pull(
        self, peer: str, src_blocks: list[int], dst_blocks: list[int], lease_id: str
    ) -> ThreadPull:
        header = self._peers.get(peer)
        if header is None:
            raise KVTransferFailed(f"unknown KV peer {peer!r}: add_peer() its metadata first")
        check_block_ids(src_blocks, dst_blocks, header.num_blocks, self._num_local_blocks(), peer)
        dst = _byte_view(self._require_cache())
        bb = self.layout.block_bytes
        runs = block_runs(src_blocks, dst_blocks)

        live: list[socket.socket] = []

        def pull(cancelled: Any) -> None:
            host, port = header.address.rsplit(":", 1)
            try:
                sock = socket.create_connection((host, int(port)), timeout=_IO_TIMEOUT_S)
            except OSError as e:
                raise KVTransferFailed(f"cannot reach the KV source {peer} at {header.address}: {e}") from e
            live.append(sock)
            with sock:
                if cancelled():
                    raise KVTransferFailed("pull cancelled")
                try:
                    read = {"op": "read", "lease": lease_id, "runs": [[s, n] for s, _, n in runs]}
                    _send_msg(sock, {**read, "credential": header.credential})
                    for _, d, n in runs:
                        if cancelled():
                            raise KVTransferFailed("pull cancelled")
                        _recv_into(sock, dst[d * bb : (d + n) * bb])
                    release = {"op": "notify", "kind": NOTIFY_RELEASE, "lease": lease_id}
                    _send_msg(sock, {**release, "credential": header.credential})
                    _recv_msg(sock)  # ack: the source has queued the release
                except (OSError, ConnectionError, _Refused, ValueError) as e:
                    why = "cancelled" if cancelled() else f"the KV source {peer} failed mid-transfer: {e}"
                    raise KVTransferFailed(f"pull {why}") from e

        def interrupt() -> None:
            for sock in live:  # wakes a recv blocked on a hung or dead source
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        return ThreadPull(pull, "kv-tcp-pull", interrupt)

    def notify(self, peer: str, kind: str, lease_id: str) -> None:
        header = self._peers.get(peer)
        if header is None:
            raise KVTransferFailed(f"unknown KV peer {peer!r}")
        host, port = header.address.rsplit(":", 1)
        try:
            with socket.create_connection((host, int(port)), timeout=_IO_TIMEOUT_S) as sock:
                _send_msg(
                    sock, {"op": "notify", "kind": kind, "lease": lease_id, "credential": header.credential}
                )
                _recv_msg(sock)
        except (OSError, _Refused, ValueError) as e:
            raise KVTransferFailed(f"could not notify {peer}: {e}") from e

    def poll_notifications(self) -> list[tuple[str, str]]:
        out = []
        while True:
            try:
                out.append(self._notes.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        self._closed = True
        self._server.close()

    # ------------------------------------------------------------------ the source side
    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True, name="kv-tcp-conn").start()

    def _handle(self, conn: socket.socket) -> None:
        conn.settimeout(_IO_TIMEOUT_S)
        with conn:
            try:
                while True:
                    msg = _recv_msg(conn)
                    credential = msg.get("credential")
                    if not isinstance(credential, str) or not hmac.compare_digest(
                        credential.encode(), self._credential.encode()
                    ):
                        raise _Refused("no or a wrong credential")
                    lease = msg.get("lease")
                    if not isinstance(lease, str):
                        raise _Refused("a frame without a lease")
                    if msg.get("op") == "read":
                        cache = self._require_cache()
                        runs = _runs(msg.get("runs"), cache.shape[0])
                        if not self.grants.allows(lease, (b for s, n in runs for b in range(s, s + n))):
                            raise _Refused("a read outside its lease")
                        src, bb = _byte_view(cache), self.layout.block_bytes
                        for s, n in runs:
                            conn.sendall(src[s * bb : (s + n) * bb])
                    elif msg.get("op") == "notify" and msg.get("kind") in (NOTIFY_RELEASE, NOTIFY_ABORT):
                        self._notes.put((str(msg["kind"]), lease))
                        _send_msg(conn, {"ok": True})
                        return
                    else:
                        raise _Refused("an unknown op")
            except _Refused as e:  # dropped: the puller fails fast; counted for the operator
                self.refused += 1
                log.warning("KV transfer: refused a connection: %s", e)
            except (OSError, ValueError, struct.error):
                return  # the puller went away; its lease expires on its own

    def _require_cache(self) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("register() the KV cache first")
        return self._cache

    def _num_local_blocks(self) -> int:
        return 0 if self._cache is None else int(self._cache.shape[0])
