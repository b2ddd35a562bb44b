"""`PrefillHandoff`: the prefill side of disaggregation — prefill, pin the blocks under a lease, hand
out a `KVHandle`, and free the blocks when the decode worker has pulled them or the lease expires.

Single-threaded with the engine: every method runs on the worker's engine thread, which also calls
``service()`` between steps (and while idle) so releases and expiries are applied where the KV cache
is owned. ``begin`` / ``complete`` let a server interleave many prefills; ``prefill`` is the offline
driver that steps the engine itself.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace

from core.errors import ServingError
from core.outputs import FinishReason, RequestOutput
from core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from kv_transfer.handle import KVHandle, KVLayout
from kv_transfer.transport import KVTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Prefilling:
    lease_id: str
    params: SamplingParams
    num_prompt_tokens: int


class PrefillHandoff:
    """Owns the leases of one prefill worker's engine."""

    def __init__(self, engine: LLMEngine, transport: KVTransport, lease_ttl_s: float = 30.0) -> None:
        self.engine = engine
        self.transport = transport
        self.lease_ttl_s = lease_ttl_s
        self.leases: dict[str, float] = {}  # lease id → expiry (unix time)
        self._prefilling: dict[str, _Prefilling] = {}  # request id → its prefill in flight
        self._lease_of: dict[str, str] = {}  # request id → lease id, while the lease is held
        self.num_released = 0
        self.num_expired = 0
        self.num_aborted = 0
        engine.runner.kv_cache = transport.register(engine.runner.kv_cache)

    def begin(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str = ""
    ) -> None:
        """Queues the prompt: the engine samples one token, then pins the blocks under a new lease."""
        lease_id = uuid.uuid4().hex
        # One token here; min_tokens still applies to it (EOS is blocked if min_tokens >= 1).
        first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        more = params.max_tokens > 1 and len(prompt_token_ids) + 1 < self.engine.max_model_len
        self.engine.add_request(
            request_id,
            prompt_token_ids,
            first,
            cache_salt=cache_salt,
            kv_lease_id=lease_id,
            continues_elsewhere=more,
        )
        self._prefilling[request_id] = _Prefilling(lease_id, params, len(prompt_token_ids))

    def complete(self, request_id: str, out: RequestOutput) -> KVHandle | None:
        """Turns the prefill's final output into a handle; None when the first token already ended
        the request (EOS, a stop string, max_tokens 1), in which case the blocks are freed at once."""
        p = self._prefilling.pop(request_id)
        if out.error is not None or not out.token_ids or out.finish_reason is FinishReason.CANCELLED:
            self.engine.unpin_lease(p.lease_id)
            raise out.error or ServingError(f"prefill of {request_id} ended without a token")
        if self.ends_at_first_token(out, p.params, p.num_prompt_tokens):
            self.engine.unpin_lease(p.lease_id)
            return None
        expires_at = time.time() + self.lease_ttl_s
        self.leases[p.lease_id] = expires_at
        self._lease_of[request_id] = p.lease_id
        block_ids = tuple(self.engine.pinned_blocks(p.lease_id))
        self.transport.grants.grant(p.lease_id, block_ids)  # a pull of this lease may read these only
        return KVHandle(
            source=self.transport.name,
            lease_id=p.lease_id,
            block_ids=block_ids,
            num_tokens=p.num_prompt_tokens,
            block_size=self.engine.kv.block_size,
            compat_hash=self.transport.layout.compat_hash,
            expires_at=expires_at,
        )

    def ends_at_first_token(self, out: RequestOutput, params: SamplingParams, num_prompt_tokens: int) -> bool:
        if out.finish_reason is FinishReason.STOP:
            return True
        return params.max_tokens == 1 or num_prompt_tokens + 1 >= self.engine.max_model_len

    def prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, cache_salt: str = ""
    ) -> tuple[int, KVHandle]:
        """Offline driver: prefills one request by stepping the engine until its first token."""
        self.begin(request_id, prompt_token_ids, params, cache_salt)
        while True:
            for out in self.engine.step():
                if out.request_id == request_id and out.finished:
                    handle = self.complete(request_id, out)
                    if handle is None:
                        raise ServingError(
                            f"request {request_id} finished at its first token; nothing to hand off"
                        )
                    return out.token_ids[0], handle

    def abort(self, request_id: str) -> bool:
        """Stops a prefill in flight, or releases the lease of a finished one. Idempotent."""
        p = self._prefilling.pop(request_id, None)
        if p is not None:
            self.engine.abort_request(request_id)
            self.engine.unpin_lease(p.lease_id)
            self.num_aborted += 1
            return True
        lease_id = self._lease_of.pop(request_id, None)
        if lease_id is not None and self.leases.pop(lease_id, None) is not None:
            self._unpin(lease_id)
            self.num_aborted += 1
            return True
        return False

    def give_up_leases(self) -> int:
        """Frees every lease still held: a draining worker's, at the end of its drain, when no new work
        comes here (so the blocks are not written again before the process exits). A pull still running
        then fails at its decode worker, whose gateway prefills the request again elsewhere."""
        lease_ids = list(self.leases)
        for lease_id in lease_ids:
            del self.leases[lease_id]
            self._unpin(lease_id)
            self.num_aborted += 1
            log.warning("lease %s given up: this worker is shutting down", lease_id)
        self._lease_of.clear()
        return len(lease_ids)

    def _unpin(self, lease_id: str) -> int:
        """Ends a held lease: no pull may read its blocks any more, and they are freed (their count)."""
        self.transport.grants.revoke(lease_id)
        return int(self.engine.unpin_lease(lease_id))

    def service(self, now: float | None = None) -> int:
        """Applies peers' releases/aborts and expires overdue leases; returns how many blocks it freed."""
        freed = 0
        for kind, lease_id in self.transport.poll_notifications():
            if self.leases.pop(lease_id, None) is not None:
                freed += self._unpin(lease_id)
                self.num_released += 1
                log.info("lease %s %sd by the decode worker", lease_id, kind)
        now = time.time() if now is None else now
        for lease_id, expires_at in list(self.leases.items()):
            if now >= expires_at:
                del self.leases[lease_id]
                freed += self._unpin(lease_id)
                self.num_expired += 1
                log.warning("lease %s expired before its blocks were pulled; freed them", lease_id)
        if len(self._lease_of) > len(self.leases):
            live = set(self.leases)
            self._lease_of = {r: lease for r, lease in self._lease_of.items() if lease in live}
        return freed


def kv_layout(engine: LLMEngine) -> KVLayout:
    """The KV layout (and so the compatibility hash) of an engine's cache."""
    return KVLayout(**engine.kv_layout_fields())  # type: ignore[arg-type]
