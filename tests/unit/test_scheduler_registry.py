"""WorkerRegistry against a real redis-server: TTL eviction, draining, re-registration, published prefix
sets and the overlap placement reads from them."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_runner import run

from core.errors import InvalidRequest
from scheduler.registry import KnownWorker, WorkerLoad, WorkerRecord, WorkerRegistry
from scheduler.snapshot import leading_hits

pytestmark = pytest.mark.unit

TTL = 1.0  # heartbeat timeout in these tests: short, yet with slack for a loaded CI machine


def record(worker_id: str, role: str = "decode", model: str = "llama", version: str = "v1") -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        role=role,
        model=model,
        version=version,  # type: ignore[arg-type]
        address=worker_id,
        num_blocks=100,
        block_size=16,
        max_model_len=4096,
        kv_backend="tcp",
    )


def load(free_blocks: int = 100, draining: bool = False) -> WorkerLoad:
    return WorkerLoad(
        free_blocks=free_blocks,
        running=1,
        waiting=2,
        transfers=0,
        leases=3,
        draining=draining,
        timestamp=123.5,
    )


def ids(views: Any) -> list[str]:
    return [view.worker_id for view in views]


async def overlap(reg: WorkerRegistry, workers: list[str], chain: list[str]) -> dict[str, int]:
    """Each worker's prefix overlap as placement computes it: the published sets of the model's live
    workers in one read (`snapshot_with_prefixes`), then the leading run of the chain each one holds."""
    held = {view.worker_id: hashes for view, _, hashes in await reg.snapshot_with_prefixes("llama")}
    return {w: leading_hits(held.get(w, frozenset()), chain) for w in workers}


def test_register_and_filter_by_model_version_and_role(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r, heartbeat_timeout_s=5)
        await reg.register(record("p:1", "prefill"), load())
        await reg.register(record("d:1", "decode"), load(free_blocks=7))
        await reg.register(record("b:1", "both"), load())
        await reg.register(record("d:2", "decode", version="v2"), load())
        await reg.register(record("q:1", "decode", model="qwen"), load())

        assert ids(await reg.healthy("llama")) == ["b:1", "d:1", "d:2", "p:1"]
        assert ids(await reg.healthy("llama", version="v1")) == ["b:1", "d:1", "p:1"]
        assert ids(await reg.healthy("llama", "v1", roles=["prefill"])) == ["b:1", "p:1"]
        assert ids(await reg.healthy("llama", "v1", roles=["decode"])) == ["b:1", "d:1"]
        assert ids(await reg.healthy("nope")) == []

        view = await reg.get("d:1")
        assert (
            view is not None and view.record == record("d:1", "decode") and view.load == load(free_blocks=7)
        )
        assert await reg.get("unknown") is None

    run(url, body)


def test_each_registration_gets_a_new_epoch_and_a_superseded_one_is_refused(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r, heartbeat_timeout_s=5)
        first = await reg.register(record("d:1"), load())
        other = await reg.register(record("d:2"), load())
        assert 0 < first < other  # one counter for the cluster: never reused, whatever the address
        assert await reg.heartbeat("d:1", load(), epoch=first)
        assert await reg.heartbeat("d:1", load())  # 0: a worker that does not say (not checked)
        view = await reg.get("d:1")
        assert view is not None and view.epoch == first
        second = await reg.register(record("d:1"), load())  # the same address registers again
        assert second > other
        assert not await reg.heartbeat("d:1", load(), ["aa"], epoch=first)  # the old life: refused
        view = await reg.get("d:1")
        assert view is not None and view.epoch == second and view.load == load()  # and changed nothing
        assert await r.smembers("baton:prefix:d:1") == set()
        assert await reg.heartbeat("d:1", load(free_blocks=3), epoch=second)
        rows = await reg.snapshot_with_prefixes("llama")
        assert {v.worker_id: v.epoch for v, _, _ in rows} == {"d:1": second, "d:2": other}

    run(url, body)


def test_missed_heartbeats_evict_and_the_worker_reregisters(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r, heartbeat_timeout_s=TTL)
        await reg.register(record("d:1"), load())
        await reg.register(record("d:2"), load())
        for _ in range(4):  # heartbeats keep d:1 alive past a timeout's worth of time
            await asyncio.sleep(TTL / 3)
            assert await reg.heartbeat("d:1", load(free_blocks=50))
        assert ids(await reg.healthy("llama")) == ["d:1"]  # d:2 missed its heartbeats
        assert await reg.sweep() == ["d:2"]
        assert await reg.sweep() == []

        await asyncio.sleep(TTL + 0.05)
        assert await reg.healthy("llama") == []
        assert not await reg.heartbeat("d:1", load())  # expired: told to re-register
        assert await r.exists("baton:worker:d:1") == 0  # and the heartbeat did not resurrect it
        await reg.register(record("d:1"), load(free_blocks=9))
        assert [v.load.free_blocks for v in await reg.healthy("llama")] == [9]
        assert await reg.sweep() == []  # a re-registered worker is never swept

    run(url, body)


def test_heartbeat_for_an_unknown_worker_returns_false(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r)
        assert not await reg.heartbeat("ghost:1", load(), ["aa"])
        assert await r.exists("baton:worker:ghost:1", "baton:prefix:ghost:1") == 0

    run(url, body)


def test_draining_workers_take_no_new_work_but_are_listed(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r, heartbeat_timeout_s=TTL)
        await reg.register(record("d:1"), load())
        await reg.register(record("d:2"), load())
        await reg.register(record("d:3"), load(draining=True))  # the worker drains itself (SIGTERM)
        assert await reg.set_draining("d:1", True)
        assert not await reg.set_draining("ghost:1", True)

        assert ids(await reg.healthy("llama")) == ["d:2"]
        assert ids(await reg.healthy("llama", include_draining=True)) == ["d:1", "d:2", "d:3"]
        assert [(v.worker_id, v.draining) for v in await reg.all_workers()] == [
            ("d:1", True),
            ("d:2", False),
            ("d:3", True),
        ]
        assert await reg.heartbeat("d:1", load())  # the worker's own load does not undo the scheduler's flag
        assert ids(await reg.healthy("llama")) == ["d:2"]

        assert await reg.set_draining("d:1", False)
        assert ids(await reg.healthy("llama")) == ["d:1", "d:2"]

        await reg.set_draining("d:2", True)
        await reg.register(record("d:2"), load())  # a new incarnation starts undrained
        assert ids(await reg.healthy("llama")) == ["d:1", "d:2"]

        await asyncio.sleep(TTL + 0.05)
        assert not await reg.set_draining("d:1", True)  # expired: no TTL-less hash appears
        assert await r.exists("baton:worker:d:1") == 0

    run(url, body)


def test_deregister_removes_at_once(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r)
        await reg.register(record("d:1"), load(), cached_hashes=["aa"])
        await reg.deregister("d:1")
        assert await reg.all_workers() == []
        assert await r.exists("baton:prefix:d:1") == 0
        assert await reg.sweep() == []

    run(url, body)


def test_prefix_overlap_counts_leading_hashes_only(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r, heartbeat_timeout_s=TTL)
        await reg.register(record("a:1"), load(), cached_hashes=["h0", "h1", "h3"])
        await reg.register(record("b:1"), load())
        assert await reg.heartbeat("b:1", load(), ["h1", "h2", "h3"])  # everything but the first block
        await reg.register(record("c:1"), load())
        chain = ["h0", "h1", "h2", "h3"]
        workers = ["a:1", "b:1", "c:1", "ghost:1"]
        assert await overlap(reg, workers, chain) == {"a:1": 2, "b:1": 0, "c:1": 0, "ghost:1": 0}
        assert await overlap(reg, workers, []) == dict.fromkeys(workers, 0)

        assert await reg.heartbeat("a:1", load())  # no hashes given: the published set is kept
        assert (await overlap(reg, ["a:1"], chain))["a:1"] == 2
        assert await reg.heartbeat("a:1", load(), ["h0", "h1", "h2", "h3", "h4"])  # replaced
        assert (await overlap(reg, ["a:1"], chain))["a:1"] == 4
        assert await reg.heartbeat("a:1", load(), [])  # an emptied cache
        assert (await overlap(reg, ["a:1"], chain))["a:1"] == 0

        many = [f"{i:064x}" for i in range(2500)]  # more than one Lua unpack() slice
        assert await reg.heartbeat("c:1", load(), many)
        assert (await overlap(reg, ["c:1"], many))["c:1"] == 2500
        assert (await overlap(reg, ["c:1"], [*many[:10], "x", *many[10:]]))["c:1"] == 10

        await asyncio.sleep(TTL + 0.05)  # the published set expires with the worker
        assert await r.exists("baton:prefix:c:1") == 0
        await reg.register(record("c:1"), load())
        assert (await overlap(reg, ["c:1"], many))["c:1"] == 0

    run(url, body)


def test_reregistration_clears_the_published_prefix_set(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r)
        await reg.register(record("a:1"), load(), cached_hashes=["h0"])
        await reg.register(record("a:1"), load())  # restarted process: its cache is empty
        assert await overlap(reg, ["a:1"], ["h0"]) == {"a:1": 0}

    run(url, body)


def test_prefix_keeps_registries_apart(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        one, two = WorkerRegistry(r, prefix="one:"), WorkerRegistry(r, prefix="two:")
        await one.register(record("d:1"), load())
        assert ids(await one.healthy("llama")) == ["d:1"]
        assert await two.healthy("llama") == []

    run(url, body)


def test_invalid_records_are_rejected() -> None:
    with pytest.raises(InvalidRequest, match="role"):
        record("d:1", role="router")
    with pytest.raises(InvalidRequest):
        WorkerRecord(
            "d:1",
            "decode",
            "llama",
            "v1",
            "d:1",
            num_blocks=0,
            block_size=16,
            max_model_len=1,
            kv_backend="tcp",
        )


def test_snapshot_reads_live_undrained_workers_and_resends_only_changed_sets(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        reg = WorkerRegistry(r, heartbeat_timeout_s=5.0)
        await reg.register(record("d:1", version="v1"), load())
        await reg.register(record("d:2", version="v2"), load())
        await reg.register(record("o:1", model="other"), load())
        await reg.register(record("x:1"), load(draining=True))
        await reg.heartbeat("d:1", load(), ["a", "b", "z"])
        await reg.heartbeat("d:2", load(), ["a2"])
        rows = await reg.snapshot_with_prefixes("llama")
        got = {view.worker_id: (view.record.version, held) for view, _, held in rows}
        assert got == {"d:1": ("v1", frozenset({"a", "b", "z"})), "d:2": ("v2", frozenset({"a2"}))}
        assert leading_hits(got["d:1"][1], ["a", "b", "c"]) == 2  # leading run only
        # A caller that holds a set of the same generation gets it back without it being sent again.
        # A caller that holds a set of the same generation gets it back without it being sent again, and
        # a record whose load (timestamp) it holds is not sent or parsed again either.
        known = {view.worker_id: KnownWorker(view, gen, held) for view, gen, held in rows}
        newer = WorkerLoad(free_blocks=90, running=2, waiting=0, transfers=0, leases=0, timestamp=124.0)
        assert await reg.heartbeat("d:2", newer, ["a2", "b2"])  # d:2 publishes a new set and load
        again = {
            view.worker_id: (view, held) for view, _, held in await reg.snapshot_with_prefixes("llama", known)
        }
        assert again["d:1"][1] is known["d:1"].held and again["d:1"][0] is known["d:1"].view
        assert again["d:2"][1] == frozenset({"a2", "b2"})
        assert again["d:2"][0].load == newer

    run(url, body)
