"""The placement cost function and version choice: pure functions, no Redis, no model."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scheduler.placement import Candidate, NoCapacity, PlacementPolicy, Placer
from scheduler.versions import choose_version, in_shadow

pytestmark = pytest.mark.unit

BS = 16


def worker(
    addr: str,
    *,
    free: int = 100,
    total: int = 100,
    running: int = 0,
    waiting: int = 0,
    transfers: int = 0,
    hit: int = 0,
    role: str = "decode",
    placed: int = 0,
) -> Candidate:
    return Candidate(addr, role, total, free, running, waiting, transfers, hit, placed=placed)


def test_prefix_overlap_wins_over_a_slightly_lighter_worker() -> None:
    placer = Placer()
    cold, warm = worker("a:1", free=90), worker("b:1", free=80, hit=8)  # warm holds 8 of 8 prompt blocks
    p = placer.place([cold, warm], [], num_prompt_tokens=8 * BS + 3, max_tokens=16, block_size=BS)
    assert p.decode.address == "b:1"


def test_equal_costs_go_to_the_worker_placed_on_least() -> None:
    """Every worker just reported an idle load (each heartbeat came after the last placement): the
    burst still goes round them, not always to the first address (seen: 8 of 8 on one worker)."""
    placer = Placer()
    prefills = [worker("p:1", role="prefill", placed=5), worker("p:2", role="prefill", placed=4)]
    for placed_a, placed_b, want in [(0, 0, "a:1"), (1, 0, "b:1"), (3, 4, "a:1")]:
        p = placer.place(
            [worker("a:1", placed=placed_a), worker("b:1", placed=placed_b)],
            prefills,
            num_prompt_tokens=4 * BS,
            max_tokens=16,
            block_size=BS,
        )
        assert p.decode.address == want and p.prefill is not None and p.prefill.address == "p:2"


def test_load_wins_when_the_overlap_is_small() -> None:
    placer = Placer()
    busy = worker("a:1", free=10, waiting=20, hit=1)
    idle = worker("b:1", free=100)
    p = placer.place([busy, idle], [], num_prompt_tokens=20 * BS, max_tokens=16, block_size=BS)
    assert p.decode.address == "b:1"


def test_a_worker_the_request_does_not_fit_is_skipped_and_no_room_is_an_error() -> None:
    placer = Placer()
    small = worker("a:1", free=2)
    p = placer.place(
        [small, worker("b:1", free=50)], [], num_prompt_tokens=10 * BS, max_tokens=8, block_size=BS
    )
    assert p.decode.address == "b:1"
    with pytest.raises(NoCapacity):
        placer.place([small], [], num_prompt_tokens=10 * BS, max_tokens=8, block_size=BS)
    # cached blocks it already holds are not new: the same worker fits once it has the prefix
    p = placer.place(
        [worker("a:1", free=3, hit=9)], [], num_prompt_tokens=10 * BS, max_tokens=8, block_size=BS
    )
    assert p.decode.address == "a:1"


def test_skip_prefill_for_short_prompts_or_prefix_on_the_decode_worker() -> None:
    placer = Placer(PlacementPolicy(local_prefill_threshold=32))
    d, p1 = worker("d:1"), worker("p:1", role="prefill")
    assert placer.place([d], [p1], 20, 8, BS).prefill is None  # short prompt
    assert placer.place([d], [p1], 200, 8, BS).prefill == p1  # long prompt → disaggregated
    warm = worker("d:1", hit=12)  # 192 of 200 tokens already on D: only 8 left to compute
    assert placer.place([warm], [p1], 200, 8, BS).prefill is None
    assert placer.place([d], [], 200, 8, BS).prefill is None  # no prefill pool


def test_exclusions_and_the_least_loaded_prefill_worker() -> None:
    placer = Placer(PlacementPolicy(max_prefill_queue=4))
    ps = [worker("p:1", running=1, role="prefill"), worker("p:2", role="prefill")]
    ds = [worker("d:1"), worker("d:2")]
    p = placer.place(ds, ps, 500, 8, BS, exclude={"d:1", "p:2"})
    assert p.decode.address == "d:2" and p.prefill is not None and p.prefill.address == "p:1"
    assert placer.place(ds, ps, 500, 8, BS).prefill.address == "p:2"  # type: ignore[union-attr]


def test_full_worker_queues_send_the_request_to_the_fair_queue_instead() -> None:
    placer = Placer(PlacementPolicy(max_prefill_queue=2, max_decode_queue=3))
    d, busy_p, open_p = (
        worker("d:1"),
        worker("p:1", running=1, waiting=1, role="prefill"),
        worker("p:2", running=1, role="prefill"),
    )
    assert placer.place([d], [busy_p, open_p], 200, 8, BS).prefill == open_p  # p:1 holds 2 prompts: full
    with pytest.raises(NoCapacity, match="prefill"):
        placer.place([d], [busy_p], 200, 8, BS)  # long prompt, every prefill queue full: wait, not local
    assert placer.place([d], [busy_p], 20, 8, BS).prefill is None  # a short prompt needs no prefill worker
    queued_d = worker("d:2", waiting=2, transfers=1)  # 3 accepted, not started: full
    assert placer.place([queued_d, d], [], 20, 8, BS).decode == d
    with pytest.raises(NoCapacity):
        placer.place([queued_d], [], 20, 8, BS)


def test_a_light_request_takes_one_prefill_slot_more_or_prefills_on_the_decode_worker() -> None:
    d, busy_p = worker("d:1"), worker("p:1", running=1, role="prefill")
    full_p = worker("p:1", running=1, waiting=1, role="prefill")
    slot = Placer()  # the defaults: the light slot on, prefill on D off
    with pytest.raises(NoCapacity, match="prefill"):
        slot.place([d], [busy_p], 200, 8, BS)  # not light: waits for the prefill worker
    assert slot.place([d], [busy_p], 200, 8, BS, light=True).prefill == busy_p  # light: queued behind one
    with pytest.raises(NoCapacity, match="prefill"):
        slot.place([d], [full_p], 200, 8, BS, light=True)  # one slot more, not two
    placer = Placer(PlacementPolicy(light_local_max_tokens=256, light_prefill_slot=False))
    with pytest.raises(NoCapacity, match="prefill"):
        placer.place([d], [busy_p], 200, 8, BS)  # not light: it waits for the prefill worker
    local = placer.place([d], [busy_p], 200, 8, BS, light=True)
    assert local.prefill is None and local.decode == d  # light: prefilled on D with its decodes
    with pytest.raises(NoCapacity, match="prefill"):
        placer.place([d], [busy_p], 300, 8, BS, light=True)  # longer than light_local_max_tokens
    assert placer.place([d], [worker("p:2", role="prefill")], 200, 8, BS, light=True).prefill is not None
    off = Placer(PlacementPolicy(light_local_max_tokens=0, light_prefill_slot=False))
    with pytest.raises(NoCapacity, match="prefill"):
        off.place([d], [busy_p], 200, 8, BS, light=True)


def test_version_choice_follows_weights_and_is_sticky() -> None:
    weights = {"v1": 0.9, "v2": 0.1}
    picks = Counter(choose_version(weights, f"req-{i}", {"v1", "v2"}) for i in range(5000))
    assert 0.07 < picks["v2"] / 5000 < 0.13
    assert all(
        choose_version(weights, f"req-{i}", {"v1", "v2"}) == choose_version(weights, f"req-{i}", {"v1", "v2"})
        for i in range(100)
    )
    assert choose_version({"v1": 0.0, "v2": 1.0}, "x", {"v1", "v2"}) == "v2"  # rollback/rollout = weights
    assert choose_version({"v1": 1.0, "v2": 0.0}, "x", {"v2"}) == "v2"  # the weighted one has no worker
    assert choose_version(weights, "x", set()) is None


@given(st.floats(0.0, 1.0))
def test_shadow_share_is_a_sticky_fraction(share: float) -> None:
    hits = sum(in_shadow(f"r{i}", share) for i in range(2000))
    assert abs(hits / 2000 - share) < 0.06
    assert all(in_shadow(f"r{i}", share) == in_shadow(f"r{i}", share) for i in range(20))


def test_catalog_first_version_takes_traffic_and_later_ones_wait_for_an_operator(
    redis_server: object,
) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from scheduler.versions import ModelCatalog

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)  # type: ignore[attr-defined]
        await client.flushdb()
        catalog = ModelCatalog(client)
        await catalog.announce("m", "v1")
        await catalog.announce("m", "v2")
        await catalog.announce("m", "v1")  # re-announcing keeps the operator's weights
        assert await catalog.weights("m") == {"v1": 1.0, "v2": 0.0}
        assert await catalog.set_weights("m", {"v2": 0.25}) == {"v1": 1.0, "v2": 0.25}
        with pytest.raises(ValueError, match=">= 0"):
            await catalog.set_weights("m", {"v1": -1.0})
        await catalog.set_shadow("m", "v3", 0.1)
        assert await catalog.shadow("m") == ("v3", 0.1)
        await catalog.set_shadow("m", None, 0.0)
        assert await catalog.shadow("m") == (None, 0.0)
        assert await catalog.models() == ["m"]
        await client.aclose()

    asyncio.run(main())


def test_catalog_sums_shadow_comparisons_per_version_pair(redis_server: object) -> None:
    import asyncio

    import redis.asyncio as aioredis

    from scheduler.versions import ModelCatalog

    async def main() -> None:
        client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)  # type: ignore[attr-defined]
        await client.flushdb()
        catalog = ModelCatalog(client)
        assert await catalog.comparisons("m") == []
        one = {
            "requests": 1,
            "identical": 1,
            "greedy_agreement": 1.0,
            "positions": 10,
            "top1_agreed": 10,
            "kl_sum": 0.01,
            "primary_ttft_ms": 20.0,
            "shadow_ttft_ms": 30.0,
            "itl_requests": 1,
            "primary_itl_ms": 10.0,
            "shadow_itl_ms": 8.0,
        }
        two = {
            **one,
            "identical": 0,
            "greedy_agreement": 0.5,
            "top1_agreed": 6,
            "kl_sum": 0.09,
            "shadow_ttft_ms": 50.0,
            "itl_requests": 0,
            "primary_itl_ms": 0.0,
            "shadow_itl_ms": 0.0,
        }
        await catalog.record_shadow("m", "v1", "v2", one)
        await catalog.record_shadow("m", "v1", "v2", two)
        await catalog.record_shadow("m", "v1", "v3", one)
        with pytest.raises(ValueError, match="unknown shadow figures"):
            await catalog.record_shadow("m", "v1", "v2", {"bogus": 1.0})
        pairs = await catalog.comparisons("m")
        assert [(s.primary_version, s.shadow_version) for s in pairs] == [("v1", "v2"), ("v1", "v3")]
        s = pairs[0]
        assert (s.requests, s.identical, s.positions) == (2, 1, 20)
        assert s.greedy_agreement == pytest.approx(0.75) and s.top1_agreement == pytest.approx(0.8)
        assert s.mean_kl == pytest.approx(0.005)
        assert s.latency_ms() == pytest.approx((20.0, 40.0, 10.0, 8.0))  # ITL over the one request with it
        await client.aclose()

    asyncio.run(main())
