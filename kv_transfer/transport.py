"""The `KVTransport` seam: how a decode worker pulls KV blocks from a prefill worker's cache.

Every backend moves whole blocks of the block-major cache (one block = all layers, K and V, one
contiguous run of ``KVLayout.block_bytes``), merged into runs of adjacent blocks. The pulling side
starts a pull and polls it from its engine loop (no thread spins); the source side learns that a
lease is done from ``poll_notifications`` and unpins its blocks.

Backends: ``nixl`` (one-sided RDMA READ via NIXL/UCX; host memory on CPU, VRAM on GPU), ``shm``
(same host: the source's cache lives in shared memory, the puller copies from a mapping), ``tcp``
(portable, no native dependency). ``make_transport("auto", …)`` picks NIXL when it imports.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from core.errors import KVTransferFailed
from kv_transfer.handle import KVLayout

log = logging.getLogger(__name__)

NOTIFY_RELEASE = "release"  # the pull finished: the source may free the lease's blocks
NOTIFY_ABORT = "abort"  # the pulling side gave up (abort, timeout): free them too


def encode_notification(kind: str, lease_id: str) -> bytes:
    return f"{kind}:{lease_id}".encode()


def decode_notification(msg: bytes) -> tuple[str, str]:
    kind, _, lease = msg.decode(errors="replace").partition(":")
    return kind, lease


class PendingPull(Protocol):
    """A pull in flight. ``poll()`` is True once every byte has landed; it raises KVTransferFailed on
    error. ``cancel()`` asks it to stop; ``settled()`` is True once no byte can land any more — only
    then may the destination blocks be given to another request."""

    def poll(self) -> bool: ...

    def cancel(self) -> None: ...

    def settled(self) -> bool: ...


class ThreadPull:
    """A pull done by a background thread (tcp, shm): the copy runs off the engine thread and
    ``poll()`` only looks at an event. ``work(cancelled)`` should check ``cancelled()`` between runs;
    ``interrupt`` (if given) unblocks it from another thread, e.g. by shutting its socket down."""

    def __init__(
        self,
        work: Callable[[Callable[[], bool]], None],
        name: str,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._cancelled = False
        self._interrupt = interrupt
        threading.Thread(target=self._run, args=(work,), daemon=True, name=name).start()

    def _run(self, work: Callable[[Callable[[], bool]], None]) -> None:
        try:
            work(lambda: self._cancelled)
        except BaseException as e:  # surfaced by poll() on the engine thread
            self._error = e
        finally:
            self._done.set()

    def poll(self) -> bool:
        if not self._done.is_set():
            return False
        if self._error is not None:
            if isinstance(self._error, KVTransferFailed):
                raise self._error
            raise KVTransferFailed(f"KV pull failed: {self._error}") from self._error
        return True

    def cancel(self) -> None:
        self._cancelled = True
        if self._interrupt is not None and not self._done.is_set():
            self._interrupt()

    def settled(self) -> bool:
        return self._done.is_set()


class LeaseGrants:
    """The blocks each live lease of a source may hand out, for a backend that serves pulls itself
    (tcp): a pull names its lease and may read only that lease's blocks, so a peer that learned a
    source's credential still cannot read another request's KV. Written from the engine thread (the
    prefill handoff grants at pin time and revokes at release, abort or expiry), read from the
    serving threads."""

    def __init__(self) -> None:
        self._blocks: dict[str, frozenset[int]] = {}
        self._lock = threading.Lock()

    def grant(self, lease_id: str, block_ids: Sequence[int]) -> None:
        with self._lock:
            self._blocks[lease_id] = frozenset(block_ids)

    def revoke(self, lease_id: str) -> None:
        with self._lock:
            self._blocks.pop(lease_id, None)

    def allows(self, lease_id: str, block_ids: Iterable[int]) -> bool:
        """Every one of ``block_ids`` belongs to the live lease ``lease_id``."""
        with self._lock:
            owned = self._blocks.get(lease_id)
        return owned is not None and all(b in owned for b in block_ids)

    def __len__(self) -> int:
        return len(self._blocks)


class KVTransport(Protocol):
    """One worker's end of KV transfer; ``metadata()`` is what its peers need to pull from it.
    ``grants`` holds the blocks of its live leases (the backends that serve pulls themselves check
    them); ``refused`` counts connections refused for a missing or wrong credential or a malformed
    or out-of-lease frame."""

    name: str
    layout: KVLayout
    grants: LeaseGrants
    refused: int

    def register(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """Registers the cache once at start-up; returns the tensor the cache must live in from now
        on (the same one, or — for shm — a copy in shared memory). Registering the returned tensor
        again is a no-op."""
        ...

    def metadata(self) -> bytes: ...

    def add_peer(self, metadata: bytes) -> str: ...

    def start_pull(
        self, peer: str, src_blocks: list[int], dst_blocks: list[int], lease_id: str
    ) -> PendingPull: ...

    def notify(self, peer: str, kind: str, lease_id: str) -> None: ...

    def poll_notifications(self) -> list[tuple[str, str]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PeerHeader:
    """The part of every backend's metadata that is not backend-specific."""

    backend: str
    name: str
    layout: KVLayout
    base: int  # address of block 0 (nixl) or 0
    num_blocks: int
    address: str = ""  # host:port (tcp), or the shared-memory file and notification socket (shm)
    credential: str = ""  # what a puller must show the source (tcp); travels only in this metadata


def pack_metadata(header: PeerHeader, blob: bytes = b"") -> bytes:
    head = json.dumps({**asdict(header), "layout": asdict(header.layout)}).encode()
    return struct.pack("<I", len(head)) + head + blob


def unpack_metadata(data: bytes) -> tuple[PeerHeader, bytes]:
    (n,) = struct.unpack_from("<I", data, 0)
    raw = json.loads(data[4 : 4 + n])
    raw["layout"] = KVLayout(**raw["layout"])
    return PeerHeader(**raw), data[4 + n :]


def make_transport(
    kind: str, name: str, layout: KVLayout, host: str = "127.0.0.1", advertise_host: str | None = None
) -> KVTransport:
    """``auto`` = nixl when it imports, else tcp; ``shm`` only between processes on one host. ``host``
    and ``advertise_host``: where the tcp backend listens and the address its peers are told (NIXL's
    UCX finds its own interfaces)."""
    if kind == "auto":
        try:
            import nixl._api  # noqa: F401
        except Exception as e:  # ImportError, or a broken native library
            log.info("nixl unavailable (%s); using the tcp KV transport", e)
            kind = "tcp"
        else:
            kind = "nixl"
    if kind == "nixl":
        from kv_transfer.nixl_transport import NixlTransport

        return NixlTransport(name, layout)
    if kind == "tcp":
        from kv_transfer.tcp_transport import TcpTransport

        return TcpTransport(name, layout, host, advertise_host)
    if kind == "shm":
        from kv_transfer.shm_transport import ShmTransport

        return ShmTransport(name, layout)
    raise ValueError(f"unknown KV transport {kind!r} (auto, nixl, shm, tcp)")
