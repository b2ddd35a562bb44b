"""`KVPulls`: the decode worker's pulls in flight. A handed-off request waits here, its blocks allocated,
until its KV lands (it then joins the running batch) or its pull fails or times out (it then ends with
a `KVTransferFailed` error). The engine polls it at the start of every step (`LLMEngine.step_hooks`).

The blocks of a pull that will not be used (aborted, failed, timed out) may still be written to by the
transport: they move to a private lease and return to the pool only once the pull has *settled*, so a
late write can never land in a block another request already owns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

from core.errors import CapacityExceeded, InvalidRequest, KVTransferFailed, ServingError
from core.request import Request, RequestId
from core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from kv_transfer.transport import PendingPull

log = logging.getLogger(__name__)

StartPull = Callable[[list[int], list[int]], PendingPull]  # (source blocks, local blocks) → pull


@dataclass(slots=True)
class _Pull:
    request: Request
    pull: PendingPull
    deadline: float
    num_blocks: int  # blocks pulled (those not already in the local prefix cache)
    started: float = field(default_factory=time.monotonic)


class KVPulls:
    """The pulls in flight into one engine's KV cache. Engine thread only."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._pulls: dict[RequestId, _Pull] = {}
        self._draining: list[tuple[str, PendingPull]] = []  # (private lease, pull)
        engine.step_hooks.append(self)

    @property
    def num_pulls(self) -> int:
        return len(self._pulls)

    @property
    def busy(self) -> bool:
        """Pulls to poll or blocks to drain: the engine keeps stepping."""
        return bool(self._pulls) or bool(self._draining)

    @property
    def num_draining_blocks(self) -> int:
        """Blocks held back until a cancelled pull can no longer write to them."""
        return sum(len(self.engine.kv.pinned_blocks(lease)) for lease, _ in self._draining)

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        source_block_ids: Sequence[int],
        start_pull: StartPull,
        timeout_s: float = 10.0,
        cache_salt: str = "",
    ) -> int:
        """Continues a request prefilled elsewhere: allocates blocks for its prompt, reuses what the
        local prefix cache already holds, and starts pulling only the missing blocks. The request
        joins the batch once the pull lands; a failed or timed-out pull ends it with a
        `KVTransferFailed` error and frees its blocks. Returns the number of blocks pulled."""
        engine, kv = self.engine, self.engine.kv
        if RequestId(request_id) in self._pulls:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        request = engine.continue_request(request_id, prompt_token_ids, first_token, params, cache_salt)
        n_prompt = request.num_prompt_tokens
        n_blocks = -(-n_prompt // kv.block_size)
        try:
            if len(source_block_ids) < n_blocks:
                raise InvalidRequest(
                    f"the handle holds {len(source_block_ids)} blocks, the prompt needs {n_blocks}"
                )
            hit = kv.find_prefix(request)
            hit.block_ids = hit.block_ids[:n_blocks]
            hit.num_tokens = min(hit.num_tokens, n_prompt)
            if not kv.can_allocate(request, n_prompt - hit.num_tokens, hit):
                raise CapacityExceeded("not enough free KV blocks to receive this request", retry_after_s=0.5)
            kv.allocate(request, n_prompt - hit.num_tokens, hit)
            request.num_cached_tokens = hit.num_tokens
            local = cast(list[int], list(kv.block_ids(request.request_id)))  # BlockId is an int
            skip = len(hit.block_ids)
            try:
                pull = start_pull(list(source_block_ids[skip:n_blocks]), local[skip:n_blocks])
            except BaseException:
                kv.free(request)
                raise
        except BaseException:
            engine.forget(request)
            raise
        self._pulls[request.request_id] = _Pull(request, pull, time.monotonic() + timeout_s, n_blocks - skip)
        return n_blocks - skip

    def abort(self, request_id: str) -> bool:
        """Stops a pull in flight; the request's final output (`FinishReason.CANCELLED`) comes with the
        next step. False if no pull of that id is in flight."""
        p = self._pulls.pop(RequestId(request_id), None)
        if p is None:
            return False
        self._drop(p.request, p.pull)
        self.engine.end_unscheduled(p.request)
        return True

    def before_step(self) -> None:
        """Frees settled blocks, admits landed pulls, ends failed and overdue ones."""
        if self._draining:
            self._free_settled()
        now = time.monotonic()
        for rid, p in list(self._pulls.items()):
            error: ServingError | None = None
            try:
                done = p.pull.poll()
            except KVTransferFailed as e:
                done, error = False, e
            if not done and error is None and now > p.deadline:
                error = KVTransferFailed(f"KV transfer of {p.num_blocks} blocks timed out")
            if done:
                del self._pulls[rid]
                self.engine.admit_landed(p.request, now - p.started)
            elif error is not None:
                del self._pulls[rid]
                self._drop(p.request, p.pull)
                log.warning("request %s: %s", rid, error.message)
                self.engine.end_unscheduled(p.request, error)

    def _drop(self, request: Request, pull: PendingPull) -> None:
        """Ends a pull that will not be used. Its blocks move to a private lease (so the request id
        is free for a retry at once) and return to the pool only when no byte can still land."""
        kv = self.engine.kv
        pull.cancel()
        if pull.settled():
            kv.free(request)
            return
        lease = f"drain:{request.request_id}:{id(pull):x}"
        kv.pin(request, lease)
        self._draining.append((lease, pull))

    def _free_settled(self) -> None:
        still = []
        for lease, pull in self._draining:
            if pull.settled():
                self.engine.kv.unpin(lease)
            else:
                still.append((lease, pull))
        self._draining = still
