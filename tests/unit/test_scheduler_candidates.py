"""The scheduler's per-decision view of its workers (scheduler.placing.Decider.pools) against a real
redis-server: prefix hits from the hash chain, this replica's placements counted until a later load,
the kept candidates rebuilt exactly when their inputs change, and forgotten when a worker is gone; and
the tenants a Finish reads."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from baton.v1 import scheduler_pb2 as pb
from scheduler.placement import Placement
from scheduler.placing import IN_TRANSIT_S, prompt_hashes
from scheduler.service import ClusterSchedulerConfig, SchedulerServicer
from scheduler.tenants import TenantConfig, cache_salt

pytestmark = pytest.mark.unit

VERSION = "v1"
BLOCK = 16


class NoContext:
    async def abort(self, code: Any, message: str) -> None:
        raise AssertionError(f"aborted: {code} {message}")


def run(url: str, body: Any) -> None:
    async def main() -> None:
        client = aioredis.Redis.from_url(url, decode_responses=True)
        servicer = SchedulerServicer(ClusterSchedulerConfig(redis_url=url, heartbeat_timeout_s=0.4), client)
        await servicer.ensure_default_tenant()
        try:
            await body(servicer)
        finally:
            await client.aclose()

    asyncio.run(main())


async def register(s: SchedulerServicer, address: str, free: int, held: list[str]) -> None:
    record = pb.WorkerRecord(
        address=address,
        role="decode",
        model="m",
        version=VERSION,
        num_blocks=1000,
        block_size=BLOCK,
        max_model_len=4096,
        kv_backend="nixl",
    )
    load = pb.WorkerLoad(free_blocks=free, running=1, waiting=0)
    await s.RegisterWorker(pb.RegisterWorkerRequest(worker=record, load=load), NoContext())
    await s.Heartbeat(pb.HeartbeatRequest(address=address, load=load, cached_block_hashes=held), NoContext())


def test_hits_count_leading_blocks_and_placements_count_until_a_later_load(url: str) -> None:
    prompt = list(range(100, 100 + 4 * BLOCK))
    chain = prompt_hashes(prompt, BLOCK, cache_salt(TenantConfig("default"), VERSION))

    async def body(s: SchedulerServicer) -> None:
        await register(s, "a:1", 900, chain[:2])  # the first two blocks
        await register(s, "b:1", 800, chain[1:])  # every block but the first: no leading hit
        await register(s, "c:1", 700, [])
        s.snapshot.invalidate()
        decode, _ = await s.decider.pools("m", VERSION, chain)
        by = {c.address: c for c in decode}
        assert (by["a:1"].hit_blocks, by["b:1"].hit_blocks, by["c:1"].hit_blocks) == (2, 0, 0)
        assert [by[a].free_blocks for a in ("a:1", "b:1", "c:1")] == [900, 800, 700]

        # Nothing changed: the same candidates (kept, not rebuilt); another chain: no hits anywhere.
        again, _ = await s.decider.pools("m", VERSION, chain)
        assert {c.address: c for c in again}["c:1"] is by["c:1"]
        other, _ = await s.decider.pools("m", VERSION, ["f" * 32])
        assert all(c.hit_blocks == 0 for c in other)

        # A placement on c counts against it at once (5 new blocks, one more request waiting)...
        s.decider.note_placement(Placement(None, by["c:1"], 0.0), 5)
        placed = {c.address: c for c in (await s.decider.pools("m", VERSION, chain))[0]}
        assert (placed["c:1"].free_blocks, placed["c:1"].waiting) == (695, 1)
        assert placed["b:1"] is by["b:1"]  # the others are kept as they were
        # ...until a load c measured IN_TRANSIT_S after it arrives: that load includes the request.
        await asyncio.sleep(IN_TRANSIT_S * 1.5)
        await s.Heartbeat(
            pb.HeartbeatRequest(
                address="c:1", load_only=True, load=pb.WorkerLoad(free_blocks=690, running=2, waiting=0)
            ),
            NoContext(),
        )
        later = {c.address: c for c in (await s.decider.pools("m", VERSION, chain))[0]}
        assert (later["c:1"].free_blocks, later["c:1"].running, later["c:1"].waiting) == (690, 2, 0)

    run(url, body)


def test_what_is_kept_per_worker_is_forgotten_once_the_worker_is_gone(url: str) -> None:
    async def body(s: SchedulerServicer) -> None:
        await register(s, "a:1", 900, [])
        await register(s, "b:1", 900, [])
        s.snapshot.invalidate()
        decode, _ = await s.decider.pools("m", VERSION, [])
        for c in decode:
            s.decider.note_placement(Placement(None, c, 0.0), 1)
        await s.decider.pools("m", VERSION, [])
        assert set(s.decider._recent) == set(s.decider._candidates) == {"a:1", "b:1"}

        # b stops heartbeating; a keeps on. Past the heartbeat timeout b leaves the registry.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            await s.Heartbeat(
                pb.HeartbeatRequest(address="a:1", load_only=True, load=pb.WorkerLoad(free_blocks=900)),
                NoContext(),
            )
            await asyncio.sleep(0.05)
        await s.registry.sweep()
        s.snapshot.invalidate()
        assert [c.address for c in (await s.decider.pools("m", VERSION, []))[0]] == ["a:1"]
        s.decider.forget_gone_workers()
        assert set(s.decider._recent) == set(s.decider._candidates) == {"a:1"}

    run(url, body)


def test_finishes_read_their_tenant_at_most_once_a_second(url: str) -> None:
    """A Finish needs its tenant's limits to refund; like a key's tenant, they are remembered for 1 s."""

    async def body(s: SchedulerServicer) -> None:
        tenant = TenantConfig("solo", max_concurrent=8)
        await s.tenants.add_tenant(tenant)
        reads = 0
        real_get = s.tenants.get_tenant

        async def counted(name: str) -> TenantConfig | None:
            nonlocal reads
            reads += 1
            return await real_get(name)

        s.tenants.get_tenant = counted  # type: ignore[method-assign]
        for i in range(3):
            await s.quota.admit(tenant, f"r{i}", 10, 4, 1)
        for i in range(3):
            await s._finish(
                pb.FinishRequest(request_id=f"r{i}", tenant="solo", prompt_tokens=10, completion_tokens=4)
            )
        assert reads == 1 and (await s.quota.usage(tenant)).concurrent == 0
        await s._finish(pb.FinishRequest(request_id="x", tenant="nobody"))  # an unknown tenant: nothing to do
        assert reads == 2

    run(url, body)
