"""shm backend: same-host transfer through shared memory, for single-node deployments without NIXL.

The source's KV cache lives in a file under /dev/shm (``register`` moves it there); a puller maps
that file read-only and copies the block runs it needs into its own cache from a background thread.
Notifications (release / abort) travel as datagrams on a Unix socket that the source polls without
blocking. Files are named after the owning pid; a new transport removes those of dead processes, so
a SIGKILLed worker does not leak shared memory past the next start.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.errors import KVTransferFailed
from kv_transfer.handle import KVLayout, block_runs, check_block_ids
from kv_transfer.transport import (
    LeaseGrants,
    PeerHeader,
    ThreadPull,
    decode_notification,
    encode_notification,
    pack_metadata,
    unpack_metadata,
)

SHM_DIR = Path("/dev/shm")
_PREFIX = "baton-kv-"
_OWNER = re.compile(rf"^{_PREFIX}.*-(\d+)\.(?:kv|sock)$")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]


def sweep_stale_files(directory: Path = SHM_DIR) -> int:
    """Removes shared-memory files and sockets whose owning process is gone."""
    removed = 0
    for f in directory.glob(f"{_PREFIX}*"):
        m = _OWNER.match(f.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                f.unlink()
                removed += 1
        except PermissionError:
            pass  # alive, someone else's
    return removed


class ShmTransport:
    """Serves this worker's cache as a shared-memory file; pulls peers' blocks from theirs."""

    def __init__(self, name: str, layout: KVLayout, directory: Path = SHM_DIR) -> None:
        self.grants = LeaseGrants()  # not checked here: the source serves no pull itself
        self.refused = 0
        self.name = name
        self.layout = layout
        sweep_stale_files(directory)
        stem = f"{_PREFIX}{_safe(name)}-{os.getpid()}"
        self._file = directory / f"{stem}.kv"
        self._sock_path = directory / f"{stem}.sock"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(self._sock_path))
        # Same host, same user: another user can neither send this worker a release nor read its cache.
        os.chmod(self._sock_path, 0o600)
        self._sock.setblocking(False)
        self._cache: torch.Tensor | None = None
        self._peers: dict[str, tuple[PeerHeader, np.memmap[Any, Any]]] = {}

    def register(self, kv_cache: torch.Tensor) -> torch.Tensor:
        if self._cache is not None and kv_cache.data_ptr() == self._cache.data_ptr():
            return self._cache  # already registered (a worker with both roles registers once)
        if kv_cache.is_cuda:
            raise ValueError("the shm KV transport serves host memory only")
        nbytes = kv_cache.numel() * kv_cache.element_size()
        fd = os.open(self._file, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)  # only this user may map it
        with os.fdopen(fd, "wb") as f:
            f.truncate(nbytes)
        shared = torch.from_file(str(self._file), shared=True, size=kv_cache.numel(), dtype=kv_cache.dtype)
        shared = shared.view(kv_cache.shape)
        shared.copy_(kv_cache)
        self._cache = shared
        return shared

    def metadata(self) -> bytes:
        if self._cache is None:
            raise RuntimeError("register() the KV cache first")
        address = f"{self._file}|{self._sock_path}"
        return pack_metadata(PeerHeader("shm", self.name, self.layout, 0, self._cache.shape[0], address))

    def add_peer(self, metadata: bytes) -> str:
        header, _ = unpack_metadata(metadata)
        if header.backend != "shm":
            raise KVTransferFailed(f"peer {header.name} speaks {header.backend!r}, not shm")
        self.layout.check_compatible(header.layout)
        file, _ = header.address.split("|")
        try:
            mapping: np.memmap[Any, Any] = np.memmap(file, dtype=np.uint8, mode="r")
        except OSError as e:
            raise KVTransferFailed(f"cannot map {header.name}'s shared KV cache {file}: {e}") from e
        self._peers[header.name] = (header, mapping)
        return header.name

    def start_pull(
        self, peer: str, src_blocks: list[int], dst_blocks: list[int], lease_id: str
    ) -> ThreadPull:
        entry = self._peers.get(peer)
        if entry is None:
            raise KVTransferFailed(f"unknown KV peer {peer!r}: add_peer() its metadata first")
        header, src = entry
        check_block_ids(src_blocks, dst_blocks, header.num_blocks, self._num_local_blocks(), peer)
        if self._cache is None:
            raise RuntimeError("register() the KV cache first")
        dst = self._cache.view(torch.uint8).reshape(-1).numpy()
        bb = self.layout.block_bytes
        runs = block_runs(src_blocks, dst_blocks)

        def pull(cancelled: Any) -> None:
            sock_path = header.address.split("|")[1]
            if not os.path.exists(sock_path):
                raise KVTransferFailed(f"the source worker {peer} is gone (no notification socket)")
            for s, d, n in runs:
                if cancelled():
                    raise KVTransferFailed("pull cancelled")
                dst[d * bb : (d + n) * bb] = src[s * bb : (s + n) * bb]
            self._send(sock_path, encode_notification("release", lease_id))

        return ThreadPull(pull, "kv-shm-pull")

    def notify(self, peer: str, kind: str, lease_id: str) -> None:
        entry = self._peers.get(peer)
        if entry is None:
            raise KVTransferFailed(f"unknown KV peer {peer!r}")
        self._send(entry[0].address.split("|")[1], encode_notification(kind, lease_id))

    def _send(self, sock_path: str, msg: bytes) -> None:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(msg, sock_path)
        except OSError as e:
            raise KVTransferFailed(f"could not notify the source at {sock_path}: {e}") from e

    def poll_notifications(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            try:
                out.append(decode_notification(self._sock.recv(4096)))
            except BlockingIOError:
                return out

    def close(self) -> None:
        self._peers.clear()
        self._sock.close()
        for f in (self._file, self._sock_path):
            with contextlib.suppress(OSError):
                f.unlink()

    def _num_local_blocks(self) -> int:
        return 0 if self._cache is None else int(self._cache.shape[0])
