"""`DecodeHandoff`: the decode side of disaggregation — check a `KVHandle`, pull only the blocks the
local prefix cache lacks (`decode_worker.pulls`), and continue the request in the continuous batch."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from core.errors import KVIncompatible, KVTransferFailed
from core.sampling_params import SamplingParams
from decode_worker.pulls import KVPulls
from engine.llm_engine import LLMEngine
from kv_transfer.handle import KVHandle
from kv_transfer.transport import NOTIFY_ABORT, NOTIFY_RELEASE, KVTransport, PendingPull

log = logging.getLogger(__name__)


class _NothingToPull:
    """Every block was already in the local prefix cache."""

    def poll(self) -> bool:
        return True

    def cancel(self) -> None:
        """Nothing is in flight."""

    def settled(self) -> bool:
        return True


class DecodeHandoff:
    """Admits handed-off requests into one decode worker's engine."""

    def __init__(self, engine: LLMEngine, transport: KVTransport) -> None:
        self.engine = engine
        self.transport = transport
        self._handles: dict[str, KVHandle] = {}
        self.pulls = KVPulls(engine)
        engine.runner.kv_cache = transport.register(engine.runner.kv_cache)

    def add_peer(self, metadata: bytes) -> str:
        return self.transport.add_peer(metadata)

    def start(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        handle: KVHandle,
        params: SamplingParams,
        timeout_s: float = 10.0,
        cache_salt: str = "",
    ) -> int:
        """Starts the pull; the engine admits the request when it lands. Returns blocks to pull."""
        if handle.compat_hash != self.transport.layout.compat_hash:
            raise KVIncompatible(
                f"KV handle from {handle.source} has compatibility hash {handle.compat_hash}, this worker "
                f"{self.transport.layout.compat_hash} (different model version, dtype or layout)"
            )
        if handle.expired:
            raise KVTransferFailed(f"the lease {handle.lease_id} on {handle.source} has already expired")

        def start_pull(src: list[int], dst: list[int]) -> PendingPull:
            if not src:
                self.transport.notify(handle.source, NOTIFY_RELEASE, handle.lease_id)
                return _NothingToPull()
            return self.transport.start_pull(handle.source, src, dst, handle.lease_id)

        n = self.pulls.add(
            request_id,
            prompt_token_ids,
            first_token,
            params,
            handle.block_ids,
            start_pull,
            timeout_s=timeout_s,
            cache_salt=cache_salt,
        )
        self._handles[request_id] = handle
        return n

    def abort(self, request_id: str) -> bool:
        """Aborts the request here and tells the source to free its lease (best effort)."""
        found = self.pulls.abort(request_id) or self.engine.abort_request(request_id)
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            try:
                self.transport.notify(handle.source, NOTIFY_ABORT, handle.lease_id)
            except KVTransferFailed as e:  # the source is gone: its lease expires on its own
                log.info("abort of %s not delivered to %s: %s", request_id, handle.source, e.message)
        return found

    def forget(self, request_id: str) -> None:
        """Drops the bookkeeping of a request that finished."""
        self._handles.pop(request_id, None)
