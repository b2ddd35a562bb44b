"""`StepScheduler`: a worker's iteration-level scheduler — continuous batching, chunked prefill,
preemption by recompute and abort at step boundaries. Pure Python; drives no model.

One loop: ``schedule() -> SchedulerOutput`` → the model runner executes it → ``update(output, sampled)``.
There is no separate prefill path: each step a request's ``num_computed_tokens`` moves towards its
``num_tokens``; a prompt is simply a request far behind. The rules (see docs/ENGINE.md):

* Token budget: at most ``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences per step.
* Order: running decodes first (one token each, so a long prompt never delays a token stream), then
  prompts — running ones part-way through and waiting ones — in *fair order*: the prompt whose tenant
  was served the fewest tokens on this worker goes first, arrival order within a tenant and between
  tenants served alike (one tenant: plain arrival order). The tenant is the request's cache salt,
  which the cluster scheduler derives from it. A tenant that had nothing here is lifted to just below
  the least-served tenant with work here (a virtual token counter, as in the cluster's fair queue), so
  idle time earns no credit. A quiet tenant's prompt therefore overtakes a flood of others' prompts at
  the next step, even one whose chunks have started.
* Fairness between long and short prompts: a prompt takes at most ``long_prefill_chunk`` tokens per
  step, and the rest of the budget goes to the prompts behind it. Arrival order (FCFS) means a long
  prompt is never overtaken forever; the chunk cap means a short prompt behind it shares each step.
* Inter-token latency (``mixed_prefill_tokens`` > 0): a step that runs decodes carries at most that
  many prompt tokens besides them, so a prompt arriving while streams decode lengthens each of their
  steps a little instead of one of them a lot; a step without decodes still takes the whole budget.
* Heavy tenants' prompts (``heavy_prefill_chunk`` > 0; a prefill worker's setting): a tenant whose
  prompt tokens computed here recently (halving every ``RECENT_HALF_LIFE_S``) are more than twice
  another tenant's — one seen here within ``RECENT_WINDOW_S`` — is *heavy*: its prompts take at most
  ``heavy_prefill_chunk`` tokens a step, and a step that computes another (not heavy) tenant's prompt
  gives heavy prompts none. A step is one pass over the weights and cannot be interrupted, so this is
  how a light tenant's prompt that arrives while a flood's prompt is being prefilled starts after one
  short chunk instead of after the whole prompt, and runs alone in its step. It costs the heavy
  tenants a pass per chunk; one tenant alone is never heavy.
* Preemption: when running requests need more blocks than are free, the victim is the running request
  with the fewest computed tokens (the least work to recompute); ties go to the latest arrival. Its
  blocks are freed (full ones stay in the prefix cache, so recompute is often a cache hit) and it
  returns to the head of the waiting queue. No new request is admitted in a step that preempted.
* Admission keeps one free block per running request in reserve, so the next decode step rarely
  has to preempt.
"""

from __future__ import annotations

import bisect
import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from core.errors import InvalidRequest
from core.kv_cache import BlockId, KVCacheManager
from core.outputs import FinishReason
from core.request import Request, RequestId, RequestStatus

FAIR_TIE = 1e-3  # tokens: a lifted tenant starts this far below the least-served one (ties go to it)
MAX_TRACKED_TENANTS = 10_000
RECENT_HALF_LIFE_S = 5.0  # heavy tenants: prompt tokens computed here count half after this long
RECENT_WINDOW_S = 10.0  # ...against tenants whose prompts were computed here this recently
HEAVY_SHARE = 0.5  # heavy: another recent tenant's recent prompt tokens are below this share of its own


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one step."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512
    heavy_prefill_chunk: int = 0  # a heavy tenant's prompt tokens per step (0: no tenant is heavy)
    mixed_prefill_tokens: int = 0  # prompt tokens a step may add to running decodes (0: the budget's rest)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.long_prefill_chunk < 1:
            raise ValueError("scheduler limits must be positive")
        if self.heavy_prefill_chunk < 0 or self.mixed_prefill_tokens < 0:
            raise ValueError("heavy_prefill_chunk and mixed_prefill_tokens must not be negative")
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

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = kv
        self._clock = clock
        self._recent: dict[str, tuple[float, float]] = {}  # tenant → (prompt tokens, decayed to this time)
        self._heavy: frozenset[str] = frozenset()  # this step's heavy tenants
        self.waiting: list[Request] = []  # sorted by arrival_seq (FCFS)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[RequestId, Request] = {}
        self.num_preemptions = 0
        self._served: dict[str, float] = {}  # tenant (cache salt) → tokens computed here, lifted
        self._active: dict[str, int] = {}  # tenant → its unfinished requests here

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
        self._join(request)
        self.requests[request.request_id] = request
        self._enqueue_waiting(request)

    def _join(self, request: Request) -> None:
        """Counts the request for its tenant; a tenant with nothing here is lifted (see the docstring)."""
        key = request.cache_salt
        if not self._active.get(key):
            floor = min((self._served.get(k, 0.0) for k, n in self._active.items() if n), default=None)
            mine = self._served.get(key, 0.0)
            self._served[key] = mine if floor is None else max(mine, floor - FAIR_TIE)
            if len(self._served) > MAX_TRACKED_TENANTS:  # forget idle tenants; they are lifted anyway
                self._served = {k: v for k, v in self._served.items() if self._active.get(k)}
        self._active[key] = self._active.get(key, 0) + 1

    def _fair_key(self, request: Request) -> tuple[float, int]:
        return self._served.get(request.cache_salt, 0.0), request.arrival_seq

    def abort(self, request_id: RequestId) -> Request | None:
        """Drops a request wherever it is and frees its blocks (idempotent; None if unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.CANCELLED)
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Ends a request (stop, length or abort) and returns its blocks to the pool."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        else:
            return
        if request.kv_lease_id is not None and reason is not FinishReason.CANCELLED:
            self.kv.pin(request, request.kv_lease_id)  # a peer will pull these blocks; see kv_transfer
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]
        left = self._active.get(request.cache_salt, 0) - 1
        if left > 0:
            self._active[request.cache_salt] = left
        else:
            self._active.pop(request.cache_salt, None)

    def add_running(self, request: Request) -> None:
        """Admits a request whose KV is already in its blocks (pulled from a prefill worker): it joins
        the running batch directly, with ``num_computed_tokens`` set by the caller."""
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.RUNNING
        self._join(request)
        self.requests[request.request_id] = request
        self.running.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens still to compute — queued prompts and the rest of part-way ones (a decode's one
        next token is not counted): the prefill backlog, read by placement and autoscaling."""
        gaps = (r.num_tokens - r.num_computed_tokens for r in (*self.waiting, *self.running))
        return sum(g for g in gaps if g > 1)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._heavy = self._heavy_tenants()
        plan = self._plan_running_with_preemption(out)
        budget = self.config.max_num_batched_tokens
        chunks: list[tuple[Request, int]] = []
        for request, n in plan:
            if n > 1 or request.num_tokens - request.num_computed_tokens > 1:
                chunks.append((request, n))  # a prompt part-way through: in fair order below
                continue
            self._run(out, request, n)
            budget -= n
        if out.scheduled and self.config.mixed_prefill_tokens:  # decodes run: keep their step short
            budget = min(budget, self.config.mixed_prefill_tokens)
        # Prompts in fair order. The plan's chunks fit the free blocks, and a waiting request is admitted
        # only into blocks those chunks do not need, so a started prompt always progresses. A chunk
        # that a fairer waiting request overtakes gets less of the budget, or none this step.
        pending = sum(self.kv.num_blocks_needed(r, n) for r, n in chunks)
        admitting = not out.preempted
        started = [(self._fair_key(r), 0, r, n) for r, n in chunks]  # fair order already (_plan_running)
        waiting = (
            (self._fair_key(r), 1, r, 0) for r in (tuple(self.waiting) if admitting else ())
        )  # _admit removes
        # One tenant (the common case): the waiting queue is in arrival order, which is the fair order, so
        # merge lazily instead of sorting every waiting request every step.
        queue: Iterable[tuple[tuple[float, int], int, Request, int]] = (
            heapq.merge(started, waiting, key=lambda x: (x[0], x[1]))
            if len(self._active) <= 1
            else sorted([*started, *waiting], key=lambda x: (x[0], x[1]))
        )
        if self._heavy:  # heavy tenants' prompts after the others, and only in a step without them
            queue = sorted(queue, key=lambda x: x[2].cache_salt in self._heavy)
        light_prompt = False
        for _, is_waiting, request, n in queue:
            if budget <= 0:
                break
            heavy = request.cache_salt in self._heavy
            if heavy and light_prompt:
                if is_waiting:
                    admitting = False  # waiting heavy prompts keep their order for the next step
                else:
                    pending -= self.kv.num_blocks_needed(request, n)
                continue
            if not is_waiting:
                pending -= self.kv.num_blocks_needed(request, n)
                n = min(n, budget)
                self._run(out, request, n)
                budget -= n
                light_prompt = light_prompt or not heavy
            elif admitting and self._admit(out, request, budget, reserve=len(self.running) + pending):
                budget -= out.scheduled[-1].num_new_tokens
                light_prompt = light_prompt or not heavy
            else:
                admitting = False  # the fair head waits for blocks or a slot; no waiting request overtakes it
        return out

    def _run(self, out: SchedulerOutput, request: Request, n: int) -> None:
        self.kv.allocate(request, n)
        out.scheduled.append(ScheduledRequest(request, n, self.kv.block_ids(request.request_id)))

    def update(self, out: SchedulerOutput, sampled: dict[RequestId, int]) -> list[Request]:
        """Applies a finished step: advance progress, append sampled tokens, stop finished requests."""
        finished: list[Request] = []
        for s in out.scheduled:
            r = s.request
            if r.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            self._served[r.cache_salt] = self._served.get(r.cache_salt, 0.0) + s.num_new_tokens
            if self.config.heavy_prefill_chunk and r.num_tokens - r.num_computed_tokens > 1:
                self._note_prompt_tokens(r.cache_salt, s.num_new_tokens)
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
        for r in sorted(self.running, key=self._fair_key):
            remaining = r.num_tokens - r.num_computed_tokens
            if remaining > 1 and budget > 0:
                n = min(remaining, self._chunk(r), budget)
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

    def _admit(self, out: SchedulerOutput, request: Request, budget: int, reserve: int) -> bool:
        """Starts a waiting request with up to ``budget`` tokens, leaving ``reserve`` blocks free;
        False if blocks or sequence slots are short."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        hit = self.kv.find_prefix(request)
        remaining = request.num_tokens - hit.num_tokens
        n = min(remaining, self._chunk(request), budget)
        if not self.kv.can_allocate(request, n, hit, reserve=reserve):
            return False
        self.waiting.remove(request)
        self.kv.allocate(request, n, hit)
        request.num_computed_tokens = hit.num_tokens
        request.num_cached_tokens = hit.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.scheduled.append(ScheduledRequest(request, n, self.kv.block_ids(request.request_id)))
        return True

    def _chunk(self, request: Request) -> int:
        """The most prompt tokens ``request`` may compute in one step."""
        if request.cache_salt in self._heavy:
            return min(self.config.long_prefill_chunk, self.config.heavy_prefill_chunk)
        return self.config.long_prefill_chunk

    def _note_prompt_tokens(self, tenant: str, n: int) -> None:
        now = self._clock()
        tokens, at = self._recent.get(tenant, (0.0, now))
        self._recent[tenant] = (tokens * 2 ** (-(now - at) / RECENT_HALF_LIFE_S) + n, now)
        if len(self._recent) > MAX_TRACKED_TENANTS:
            self._recent = {k: v for k, v in self._recent.items() if now - v[1] <= RECENT_WINDOW_S}

    def _heavy_tenants(self) -> frozenset[str]:
        """Tenants whose recent prompt tokens here are more than 1 / HEAVY_SHARE times another recent
        tenant's (none unless ``heavy_prefill_chunk`` is set)."""
        if not self.config.heavy_prefill_chunk or len(self._recent) < 2:
            return frozenset()
        now = self._clock()
        recent = {
            t: tokens * 2 ** (-(now - at) / RECENT_HALF_LIFE_S)
            for t, (tokens, at) in self._recent.items()
            if now - at <= RECENT_WINDOW_S
        }
        if len(recent) < 2:
            return frozenset()
        least = min(recent.values())
        return frozenset(t for t, tokens in recent.items() if least < HEAVY_SHARE * tokens)

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
