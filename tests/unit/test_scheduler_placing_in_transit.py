"""How long a placement counts against its workers (scheduler.placing.RecentPlacements), against a real
redis-server. A worker publishes its load only when it changes, so a request that came and went within
``IN_TRANSIT_S`` of its placement (a short prompt on a prefill worker: there, prefilled, its KV pulled)
leaves a last load measured less than ``IN_TRANSIT_S`` after the placement, and no later one. That load
stays the worker's; the placement must stop counting, not wait for the next full heartbeat (a third of
the heartbeat timeout later) while a waiting Place times out with every worker idle."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from baton.v1 import scheduler_pb2 as pb
from core.errors import CapacityExceeded
from scheduler.placement import Placement
from scheduler.placing import IN_TRANSIT_S, LOAD_QUIET_S
from scheduler.registry import WorkerLoad
from scheduler.service import ClusterSchedulerConfig, SchedulerServicer

pytestmark = pytest.mark.unit

VERSION = "v1"
BLOCK = 16
IDLE = WorkerLoad(free_blocks=1000, running=0, waiting=0, transfers=0, leases=0)
SETTLED_S = IN_TRANSIT_S + LOAD_QUIET_S + 0.05  # past which such a placement no longer counts


class NoContext:
    async def abort(self, code: Any, message: str) -> None:
        raise AssertionError(f"aborted: {code} {message}")


def run(url: str, body: Any, **config: Any) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(url, decode_responses=True)
        # No sweep here and a long heartbeat timeout: only the loads the test sends reach the scheduler.
        cfg = ClusterSchedulerConfig(redis_url=url, heartbeat_timeout_s=60.0, **config)
        servicer = SchedulerServicer(cfg, client)
        await servicer.ensure_default_tenant()
        try:
            await body(servicer)
        finally:
            await client.aclose()

    asyncio.run(main())


async def register(s: SchedulerServicer, address: str, role: str) -> None:
    record = pb.WorkerRecord(
        address=address,
        role=role,
        model="m",
        version=VERSION,
        num_blocks=1000,
        block_size=BLOCK,
        max_model_len=4096,
        kv_backend="tcp",
    )
    load = pb.WorkerLoad(free_blocks=1000)
    await s.RegisterWorker(pb.RegisterWorkerRequest(worker=record, load=load), NoContext())


async def heartbeat_at(s: SchedulerServicer, address: str, load: WorkerLoad, at: float) -> None:
    """A load-only heartbeat as `SchedulerServicer.Heartbeat` takes it, its load measured at ``at``."""
    measured = WorkerLoad(
        load.free_blocks, load.running, load.waiting, load.transfers, load.leases, timestamp=at
    )
    assert await s.registry.heartbeat(address, measured)
    if s.snapshot.update_load(address, measured):
        s.decider.load_changed()


async def candidate(s: SchedulerServicer, address: str) -> Any:
    decode, prefill = await s.decider.pools("m", VERSION, [])
    return {c.address: c for c in (*decode, *prefill)}[address]


def test_a_placement_stops_counting_once_a_load_measured_after_it_stays_the_newest(url: str) -> None:
    async def body(s: SchedulerServicer) -> None:
        await register(s, "d:1", "decode")
        s.snapshot.invalidate()
        s.decider.note_placement(Placement(None, await candidate(s, "d:1"), 0.0), 5)
        placed_at = s.decider._recent["d:1"].last_at()
        assert ((c := await candidate(s, "d:1")).free_blocks, c.waiting) == (995, 1)

        # The worker's load changes once, 10 ms after the placement (the request may still be on its way)...
        await heartbeat_at(s, "d:1", IDLE, placed_at + 0.01)
        assert (await candidate(s, "d:1")).waiting == 1
        # ...and never again: that load is still the worker's IN_TRANSIT_S after the placement, which it
        # therefore shows (here: the request came and went). Before the fix it counted until the next
        # full heartbeat.
        await asyncio.sleep(max(0.0, placed_at + SETTLED_S - time.time()))
        assert ((c := await candidate(s, "d:1")).free_blocks, c.waiting) == (1000, 0)

    run(url, body)


def test_a_placement_counts_while_no_load_measured_after_it_has_come(url: str) -> None:
    """Silence alone proves nothing (the request may still be on its way, or the worker's engine busy
    with a long step): a placement with no later load keeps counting."""

    async def body(s: SchedulerServicer) -> None:
        await register(s, "d:1", "decode")
        s.snapshot.invalidate()
        s.decider.note_placement(Placement(None, await candidate(s, "d:1"), 0.0), 5)
        placed_at = s.decider._recent["d:1"].last_at()
        await asyncio.sleep(SETTLED_S)
        assert ((c := await candidate(s, "d:1")).free_blocks, c.waiting) == (995, 1)
        # A load measured IN_TRANSIT_S after it ends it at once.
        await heartbeat_at(s, "d:1", IDLE, placed_at + IN_TRANSIT_S)
        assert ((c := await candidate(s, "d:1")).free_blocks, c.waiting) == (1000, 0)

    run(url, body)


def test_a_waiting_place_gets_the_prefill_slot_a_quick_request_left(url: str) -> None:
    """The symptom: one prefill slot (max_prefill_queue 1); the first request takes it and is done
    within IN_TRANSIT_S, the prefill worker's last load saying so; the second, waiting in the fair queue,
    must be placed, not time out with every worker idle."""
    prompt = list(range(100, 155))  # 55 tokens: past the local-prefill threshold, so it needs the P worker

    async def body(s: SchedulerServicer) -> None:
        await register(s, "p:1", "prefill")
        await register(s, "d:1", "decode")
        s.snapshot.invalidate()
        first = await s.decider.place(pb.PlaceRequest(request_id="r1", prompt_token_ids=prompt, max_tokens=8))
        assert (first.prefill_worker, first.decode_worker) == ("p:1", "d:1")
        placed_at = s.decider._recent["p:1"].last_at()
        # On P: arrived, prefilled, its KV pulled, within IN_TRANSIT_S; on D: decoding.
        await heartbeat_at(s, "p:1", WorkerLoad(996, 0, 0, 0, 1), placed_at + 0.01)
        await heartbeat_at(s, "p:1", IDLE, placed_at + 0.03)
        await heartbeat_at(s, "d:1", WorkerLoad(995, 1, 0, 0, 0), placed_at + 0.03)

        t0 = time.monotonic()
        try:
            second = await s.decider.place(
                pb.PlaceRequest(request_id="r2", prompt_token_ids=prompt, max_tokens=8)
            )
        except CapacityExceeded as e:
            pytest.fail(f"the second request was not placed although every worker is idle: {e}")
        assert (second.prefill_worker, second.decode_worker) == ("p:1", "d:1")
        assert time.monotonic() - t0 < 1.0
        assert s.decider.waiting_here == 0 and await s.queue.depth() == 0

    run(url, body, queue_timeout_s=2.0)
