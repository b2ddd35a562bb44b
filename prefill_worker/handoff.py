"""`PrefillHandoff`: the prefill side of disaggregation — prefill, pin the blocks under a lease, hand
out a `KVHandle`, and free the blocks when the decode worker has pulled them or the lease expires.

Single-threaded with the engine: the worker's engine thread calls ``service()`` between steps (and
while idle, at a low rate) so releases and expiries are applied where the KV cache is owned.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

from core.errors import ServingError
from core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from kv_transfer.handle import KVHandle, KVLayout
from kv_transfer.transport import KVTransport

log = logging.getLogger(__name__)


class PrefillHandoff:
    """Owns the leases of one prefill worker's engine."""

    def __init__(self, engine: LLMEngine, transport: KVTransport, lease_ttl_s: float = 30.0) -> None:
        self.engine = engine
        self.transport = transport
        self.lease_ttl_s = lease_ttl_s
        self.leases: dict[str, float] = {}  # lease id → expiry (unix time)
        self.num_released = 0
        self.num_expired = 0
        engine.runner.kv_cache = transport.register(engine.runner.kv_cache)

    def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str = ""
    ) -> tuple[int, KVHandle]:
        """Runs the prompt through the engine, samples the first token and leases its blocks.

        Offline driver: it steps the engine until this request is done (the gRPC worker interleaves
        many requests on its engine thread instead)."""
        lease_id = uuid.uuid4().hex
        first = replace(params, max_tokens=1, min_tokens=0)
        self.engine.add_request(request_id, prompt_token_ids, first, cache_salt=cache_salt, kv_lease_id=lease_id)
        token: int | None = None
        while token is None:
            for out in self.engine.step():
                if out.request_id == request_id and out.finished:
                    if out.error is not None or not out.token_ids:
                        self.engine.unpin_lease(lease_id)
                        raise out.error or ServingError(f"prefill of {request_id} ended without a token")
                    token = out.token_ids[0]
        expires_at = time.time() + self.lease_ttl_s
        self.leases[lease_id] = expires_at
        handle = KVHandle(
            source=self.transport.name, lease_id=lease_id, block_ids=tuple(self.engine.pinned_blocks(lease_id)),
            num_tokens=len(prompt_token_ids), block_size=self.engine.kv.block_size,
            compat_hash=self.transport.layout.compat_hash, expires_at=expires_at,
        )
        return token, handle

    def service(self, now: float | None = None) -> int:
        """Applies peers' releases/aborts and expires overdue leases; returns how many blocks it freed."""
        freed = 0
        for kind, lease_id in self.transport.poll_notifications():
            if self.leases.pop(lease_id, None) is not None:
                freed += self.engine.unpin_lease(lease_id)
                self.num_released += 1
                log.info("lease %s %sd by the decode worker", lease_id, kind)
        now = time.time() if now is None else now
        for lease_id, expires_at in list(self.leases.items()):
            if now >= expires_at:
                del self.leases[lease_id]
                freed += self.engine.unpin_lease(lease_id)
                self.num_expired += 1
                log.warning("lease %s expired before its blocks were pulled; freed them", lease_id)
        return freed


def kv_layout(engine: LLMEngine) -> KVLayout:
    """The KV layout (and so the compatibility hash) of an engine's cache."""
    return KVLayout(**engine.kv_layout_fields())  # type: ignore[arg-type]
