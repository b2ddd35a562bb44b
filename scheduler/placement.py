"""`Placer`: picks a prefill and a decode worker for one request — a pure function of the workers'
published load and prefix-cache contents, so it is unit-tested without Redis or a model.

The cost of a decode worker (lower is better; every term is a fraction, so they add up sensibly):

    cost(D) = kv_usage_after(D) + queue_weight · queued(D) − overlap_weight · hit_fraction(D)

* ``kv_usage_after`` — the share of D's KV blocks in use once this request's new blocks are taken
  (blocks its prefix cache already holds are not new). A worker the request does not fit is skipped.
* ``queued`` — waiting requests plus pulls in flight, per running slot: work D has accepted but not
  started; waiting requests add latency to every token D produces, so they count more than running ones.
* ``hit_fraction`` — the share of the prompt's blocks D already holds (leading blocks of the hash
  chain): prefill work that need not run and KV that need not move.

A prefill worker is chosen by the same idea: fewest queued prompts, most leading blocks cached.
The prefill pool is skipped (the decode worker prefills locally, chunked among its decodes) when
what is left to compute on D is short — under ``local_prefill_threshold`` tokens — or when no
prefill worker is healthy; and, when every prefill worker is busy, for a *light* tenant's prompt of at
most ``light_local_max_tokens`` tokens (see below).

Admission limits: a worker's own queue is first come, first served, so work queued there escapes the
scheduler's tenant-fair queue. A decode worker with ``max_decode_queue`` requests waiting or pulling,
or a prefill worker with ``max_prefill_queue`` prompts accepted and not yet prefilled, takes no more:
the request waits in the fair queue instead (`NoCapacity`), where the tenant that was served least
goes first. Small prefill queues keep a quiet tenant's prompt from waiting behind a flood of others.

Latency isolation: a step on a prefill worker cannot be interrupted — it is one pass over the weights —
so even first in the fair order a quiet tenant's prompt would wait for the rest of a heavy tenant's
prefill. A prefill worker therefore computes a heavy tenant's prompt in short chunks
(``--heavy-prefill-chunk``, core.step_scheduler), and a request the scheduler calls *light* (its
tenant asked for less than half as much recently as another waiting tenant: `FairQueue.is_light`) may
take one prompt slot more there (``light_prefill_slot``): it is sent while the heavy prompt is still
being computed and runs alone in the worker's next step.

Optionally (``light_local_max_tokens``) a light request prefills on its decode worker instead when
every prefill worker is busy; the decode worker takes the short prompt into its next step along with
its decodes, and the heavy tenants pay with one longer decode step each time. Off by default: on the Tenancy benchmark it raised every stream's ITL p95 by half
for no clear gain in the quiet tenant's TTFT p95 (docs/SCHEDULER.md).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Candidate(NamedTuple):
    """One healthy worker as the placer sees it (a tuple: built for every worker at every decision)."""

    address: str
    role: str  # prefill | decode | both
    num_blocks: int
    free_blocks: int  # free plus evictable cached blocks
    running: int
    waiting: int
    transfers: int
    hit_blocks: int  # leading blocks of this request's hash chain it holds
    load_timestamp: float = 0.0  # when the worker measured this load (its heartbeat)
    placed: int = 0  # requests this replica ever placed on it: equal costs go to the least placed
    epoch: int = 0  # its registration's: the calls the gateway makes there carry it


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """The knobs of the cost function (documented in the module docstring and docs/SCHEDULER.md)."""

    queue_weight: float = 0.5
    overlap_weight: float = 1.0
    local_prefill_threshold: int = 32  # tokens left to compute below which P is skipped
    max_running_hint: int = 64  # a worker's batch size, to scale its queue
    # Prompts a prefill worker holds (prefilling or queued) before it is full. Prefill is compute-bound,
    # so one at a time costs little throughput, and every later prompt waits in the fair order.
    max_prefill_queue: int = 1
    max_decode_queue: int = 8  # requests a decode worker holds waiting or pulling before it is full
    local_when_prefill_full: bool = False  # every prefill queue full: prefill on D instead of waiting
    light_local_max_tokens: int = 0  # ...and so for a light tenant's prompt up to this long (0 = never)
    light_prefill_slot: bool = True  # a light request may take one prompt slot more on a prefill worker


@dataclass(frozen=True, slots=True)
class Placement:
    prefill: Candidate | None  # None: the decode worker prefills locally
    decode: Candidate
    decode_cost: float


class NoCapacity(Exception):
    """No worker can take the request now (every decode worker, or every prefill worker, is full or
    excluded); ``pool`` says which (what an autoscaler would add)."""

    def __init__(self, message: str, pool: str) -> None:
        super().__init__(message)
        self.pool = pool


class Placer:
    """Chooses workers by the documented cost; stateless and deterministic (ties → the worker this
    replica placed on least, then address order)."""

    def __init__(self, policy: PlacementPolicy | None = None) -> None:
        self.policy = policy or PlacementPolicy()

    def decode_cost(self, c: Candidate, num_prompt_blocks: int, num_blocks_needed: int) -> float | None:
        """None when the request's new blocks do not fit in the worker's free blocks."""
        return self._decode_cost_of(num_prompt_blocks, num_blocks_needed)(c)

    def _decode_cost_of(
        self, num_prompt_blocks: int, num_blocks_needed: int
    ) -> Callable[[Candidate], float | None]:
        """`decode_cost` for one request, with its per-request terms looked up once (it runs for every
        decode worker at every decision)."""
        p = self.policy
        max_queue, queue_weight, hint, overlap_weight = (
            p.max_decode_queue,
            p.queue_weight,
            max(1, p.max_running_hint),
            p.overlap_weight,
        )

        def cost(c: Candidate) -> float | None:
            new_blocks = max(0, num_blocks_needed - c.hit_blocks)
            queued = c.waiting + c.transfers
            if c.num_blocks <= 0 or new_blocks > c.free_blocks or queued >= max_queue:
                return None
            usage_after = 1.0 - (c.free_blocks - new_blocks) / c.num_blocks
            hit_fraction = c.hit_blocks / num_prompt_blocks if num_prompt_blocks else 0.0
            return usage_after + queue_weight * (queued / hint) - overlap_weight * hit_fraction

        return cost

    def prefill_cost(self, c: Candidate, num_prompt_blocks: int) -> float:
        queued = (c.running + c.waiting) / max(1, self.policy.max_running_hint)
        hit_fraction = c.hit_blocks / num_prompt_blocks if num_prompt_blocks else 0.0
        return queued - self.policy.overlap_weight * hit_fraction

    def place(
        self,
        decode_pool: Sequence[Candidate],
        prefill_pool: Sequence[Candidate],
        num_prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        exclude: Collection[str] = (),
        light: bool = False,
    ) -> Placement:
        """``light``: the request's tenant is light (module docstring): it may take one prompt slot more on
        a prefill worker and, if ``light_local_max_tokens`` allows, prefill on the decode worker when every
        prefill worker is busy."""
        num_prompt_blocks = num_prompt_tokens // block_size  # full blocks: the ones a cache can hold
        num_blocks_needed = -(-(num_prompt_tokens + min(max_tokens, block_size)) // block_size)
        cost_of = self._decode_cost_of(num_prompt_blocks, num_blocks_needed)
        decode: Candidate | None = None
        best = 0.0
        for c in decode_pool:
            cost = cost_of(c)
            if (
                cost is not None
                and (decode is None or cost < best or (cost == best and _fewer_placed(c, decode)))
                and c.address not in exclude
            ):
                decode, best = c, cost
        if decode is None:
            raise NoCapacity("no decode worker has room for this request now", "decode")
        left_on_decode = num_prompt_tokens - decode.hit_blocks * block_size
        prefills = [c for c in prefill_pool if c.address not in exclude and c.address != decode.address]
        if left_on_decode < self.policy.local_prefill_threshold or not prefills:
            return Placement(None, decode, best)
        slots = self.policy.max_prefill_queue + (1 if light and self.policy.light_prefill_slot else 0)
        open_ = [c for c in prefills if c.running + c.waiting < slots]
        if not open_:
            if self.policy.local_when_prefill_full or (
                light and left_on_decode <= self.policy.light_local_max_tokens
            ):
                return Placement(None, decode, best)  # conditional disaggregation: prefill on D
            raise NoCapacity("every prefill worker's queue is full", "prefill")
        prefill = min(open_, key=lambda c: (self.prefill_cost(c, num_prompt_blocks), c.placed, c.address))
        return Placement(prefill, decode, best)


def _fewer_placed(c: Candidate, other: Candidate) -> bool:
    """Between two workers of equal cost, the one this replica placed on less often (then by address):
    when every worker has just reported an idle load, a burst still goes round them, not to one."""
    return (c.placed, c.address) < (other.placed, other.address)
