"""`StepScheduler`: a worker's iteration-level scheduler — continuous batching, chunked prefill,
preemption by recompute and abort at step boundaries. Pure Python; drives no model.

One loop: ``schedule() -> SchedulerOutput`` → the model runner executes it → ``update(output, sampled)``.
There is no separate prefill path: each step a request's ``num_computed_tokens`` moves towards its
``num_tokens``; a prompt is simply a request far behind. The rules (see docs/ENGINE.md):

* Token budget: at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences per step.
* Order: running decodes first (one token each, so a long prompt never delays a token stream), then
  running prompts that are part-way through, then waiting requests — both in arrival order.
* Fairness between long and short prompts: a prompt takes at most ``long_prefill_chunk`` tokens per
  step, and the rest of the budget goes to the prompts behind it. Arrival order (FCFS) means a long
  prompt is never overtaken forever; the chunk cap means a short prompt behind it shares each step.
* Preemption: when running requests need more blocks than are free, the victim is the running request
  with the fewest computed tokens (the least work to recompute); ties go to the latest arrival. Its
  blocks are freed (full ones stay in the prefix cache, so recompute is often a cache hit) and it
  returns to the head of the waiting queue. No new request is admitted in a step that preempted.
* Admission keeps one free block per running request in reserve, so the next decode step rarely
  has to preempt.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from core.errors import InvalidRequest
from core.kv_cache import BlockId, KVCacheManager
from core.request import FinishReason, Request, RequestId, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.long_prefill_chunk < 1:
            raise ValueError("scheduler limits must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (every decode needs a token)")


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute ``num_new_tokens`` tokens from ``num_computed_tokens``."""

    request: Request
    num_new_tokens: int
    block_ids: list[BlockId]

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so it yields a new token."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes; the model runner reads tokens and block tables from it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[RequestId] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class StepScheduler:
    """Continuous batching over a `KVCacheManager`; owns the waiting and running queues."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by arrival_seq (FCFS)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[RequestId, Request] = {}
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        capacity = self.kv.num_blocks * self.kv.block_size
        if request.num_prompt_tokens + request.params.max_tokens > min(capacity, request.max_model_len):
            raise InvalidRequest(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.params.max_tokens}) "
                f"exceeds the context of {min(capacity, request.max_model_len)} tokens"
            )
        if request.num_prompt_tokens == 0:
            raise InvalidRequest("the prompt must contain at least one token")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def abort(self, request_id: RequestId) -> Request | None:
        """Drops a request wherever it is and frees its blocks (idempotent; None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (stop, length or abort) and returns its blocks to the pool."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        else:
            return
        if request.kv_lease_id is not None and reason is not FinishReason.ABORT:
            self.kv.pin(request, request.kv_lease_id)  # a peer will pull these blocks; see kv_transfer
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    def add_running(self, request: Request) -> None:
        """Admits a request whose KV is already in its blocks (pulled from a prefill worker): it joins
        the running batch directly, with ``num_computed_tokens`` set by the caller."""
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        plan = self._plan_running_with_preemption(out)
        budget = self.config.max_num_batched_tokens
        for request, n in plan:
            self.kv.allocate(request, n)
            out.scheduled.append(ScheduledRequest(request, n, self.kv.block_ids(request.request_id)))
            budget -= n
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def update(self, out: SchedulerOutput, sampled: dict[RequestId, int]) -> list[Request]:
        """Applies a finished step: advance progress, append sampled tokens, stop finished requests."""
        finished: list[Request] = []
        for s in out.scheduled:
            r = s.request
            if r.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            r.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(r, r.num_computed_tokens)
            token = sampled.get(r.request_id)
            if token is None:
                continue
            r.output_token_ids.append(token)
            reason = r.check_token_stop()
            if reason is not None:
                self.finish(r, reason)
                finished.append(r)
        return finished

    # ------------------------------------------------------------------ internals
    def _plan_running(self) -> list[tuple[Request, int]]:
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        plan = [(r, 1) for r in decodes]
        budget -= len(decodes)
        for r in self.running:
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining > 1 and budget > 0:
                n = min(remaining, self.config.long_prefill_chunk, budget)
                plan.append((r, n))
                budget -= n
        return plan

    def _plan_running_with_preemption(self, out: SchedulerOutput) -> list[tuple[Request, int]]:
        while True:
            plan = self._plan_running()
            needed = sum(self.kv.num_blocks_needed(r, n) for r, n in plan)
            if needed <= self.kv.num_free_blocks:
                return plan
            victim = min(self.running, key=lambda r: (r.num_computed_tokens, -r.arrival_seq))
            self._preempt(victim)
            out.preempted.append(victim.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self._enqueue_waiting(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit = self.kv.find_prefix(request)
            remaining = request.num_tokens - hit.num_tokens
            n = min(remaining, self.config.long_prefill_chunk, budget)
            if not self.kv.can_allocate(request, n, hit, reserve=len(self.running)):
                break  # FCFS: the head waits for blocks; nothing overtakes it
            self.waiting.pop(0)
            self.kv.allocate(request, n, hit)
            request.num_computed_tokens = hit.num_tokens
            request.num_cached_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, n, self.kv.block_ids(request.request_id)))
            budget -= n

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.arrival_seq)

    def check_integrity(self) -> None:
        """The cache invariants, plus: every request is in exactly one queue and holds blocks iff running."""
        self.kv.check_integrity()
        assert len(self.waiting) + len(self.running) == len(self.requests)
        for r in self.running:
            assert r.status is RequestStatus.RUNNING
        for r in self.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert not self.kv.block_ids(r.request_id), f"waiting request {r.request_id} holds blocks"
