"""NIXL backend: one-sided READ of block runs over UCX (cma zero-copy on one host, TCP/RDMA across).

Gotchas measured here (shared/guide/ENVIRONMENT.md): NIXL's own progress thread spins a whole core,
so it is off and the engine loop drives progress by polling; ``tcp`` must stay in ``UCX_TLS`` or agent
creation fails; ``add_remote_agent`` returns bytes while notification dicts are keyed by str.
"""

from __future__ import annotations

import logging
import os

import torch

from core.errors import KVTransferFailed
from kv_transfer.handle import KVLayout, block_runs, check_block_ids
from kv_transfer.transport import (
    LeaseGrants,
    PeerHeader,
    decode_notification,
    encode_notification,
    pack_metadata,
    unpack_metadata,
)

log = logging.getLogger(__name__)


class _NixlPull:
    def __init__(self, agent: object, handle: object) -> None:
        self._agent, self._handle = agent, handle
        self._done = False

    def poll(self) -> bool:
        if self._done:
            return True
        try:
            state = self._agent.check_xfer_state(self._handle)  # type: ignore[attr-defined]
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the source died mid-read
            self._release()
            raise KVTransferFailed(f"NIXL transfer failed: {type(e).__name__}: {e}") from e
        if state == "DONE":
            self._release()
            self._done = True
            return True
        if state == "ERR":
            self._release()
            raise KVTransferFailed("NIXL transfer failed (the source worker is gone or refused the read)")
        return False

    def cancel(self) -> None:
        self._release()

    def settled(self) -> bool:
        """True once the transfer handle is released: NIXL refuses to release a READ still in
        flight, so until then its blocks may still be written."""
        if self._handle is not None:
            self._release()
        return self._handle is None

    def _release(self) -> None:
        if self._handle is None:
            return
        try:
            self._agent.release_xfer_handle(self._handle)  # type: ignore[attr-defined]
        except Exception as e:  # still in flight (NIXL_ERR_REPOST_ACTIVE-like) or a dead peer's handle
            state = self._safe_state()
            if state in ("PROC",):
                return  # retried by settled() from the engine loop until the READ stops
            log.debug("dropping a NIXL transfer handle in state %s: %s", state, e)
        self._handle = None

    def _safe_state(self) -> str:
        try:
            return str(self._agent.check_xfer_state(self._handle))  # type: ignore[attr-defined]
        except Exception:
            return "ERR"


class NixlTransport:
    """A NIXL agent with the worker's KV cache registered once at start-up."""

    def __init__(self, name: str, layout: KVLayout) -> None:
        os.environ.setdefault("UCX_TLS", "tcp,cma,sm,self")
        from nixl._api import nixl_agent, nixl_agent_config

        self.grants = LeaseGrants()  # not checked here: the source serves no pull itself
        self.refused = 0
        self.name = name
        self.layout = layout
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._cache: torch.Tensor | None = None
        self._peers: dict[str, PeerHeader] = {}

    def register(self, kv_cache: torch.Tensor) -> torch.Tensor:
        if self._cache is not None and kv_cache.data_ptr() == self._cache.data_ptr():
            return self._cache  # already registered (a worker with both roles registers once)
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache must be one contiguous tensor")
        self._cache = kv_cache
        self._agent.register_memory(self._agent.get_reg_descs([kv_cache]))
        return kv_cache

    def metadata(self) -> bytes:
        cache = self._require_cache()
        header = PeerHeader("nixl", self.name, self.layout, cache.data_ptr(), cache.shape[0])
        return pack_metadata(header, self._agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        header, blob = unpack_metadata(metadata)
        if header.backend != "nixl":
            raise KVTransferFailed(f"peer {header.name} speaks {header.backend!r}, not nixl")
        self.layout.check_compatible(header.layout)
        agent_name = self._agent.add_remote_agent(blob)
        name = agent_name.decode() if isinstance(agent_name, bytes) else str(agent_name)
        self._peers[name] = header
        return name

    def start_pull(self, peer: str, src_blocks: list[int], dst_blocks: list[int], lease_id: str) -> _NixlPull:
        header = self._peers.get(peer)
        if header is None:
            raise KVTransferFailed(f"unknown KV peer {peer!r}: add_peer() its metadata first")
        cache = self._require_cache()
        bb = self.layout.block_bytes
        check_block_ids(src_blocks, dst_blocks, header.num_blocks, self._num_local_blocks(), peer)
        local, remote = [], []
        for s, d, n in block_runs(src_blocks, dst_blocks):
            local.append((cache.data_ptr() + d * bb, n * bb, 0))
            remote.append((header.base + s * bb, n * bb, 0))
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, "DRAM" if not cache.is_cuda else "VRAM"),
                self._agent.get_xfer_descs(remote, "DRAM" if not cache.is_cuda else "VRAM"),
                peer,
                encode_notification("release", lease_id),
            )
            state = self._agent.transfer(handle)
        except Exception as e:  # nixl raises its own exception types for a dead or unknown peer
            raise KVTransferFailed(f"NIXL could not start the read from {peer}: {e}") from e
        if state == "ERR":
            raise KVTransferFailed(f"NIXL refused the read from {peer}")
        return _NixlPull(self._agent, handle)

    def notify(self, peer: str, kind: str, lease_id: str) -> None:
        try:
            self._agent.send_notif(peer, encode_notification(kind, lease_id))
        except Exception as e:
            raise KVTransferFailed(f"could not notify {peer}: {e}") from e

    def poll_notifications(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for messages in self._agent.get_new_notifs().values():
            out.extend(decode_notification(m) for m in messages)
        return out

    def close(self) -> None:
        self._peers.clear()

    def _require_cache(self) -> torch.Tensor:
        if self._cache is None:
            raise RuntimeError("register() the KV cache first")
        return self._cache

    def _num_local_blocks(self) -> int:
        return 0 if self._cache is None else int(self._cache.shape[0])
