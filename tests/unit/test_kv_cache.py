"""KVCacheManager: block accounting, prefix caching with salts, LRU eviction — examples and properties."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from core.kv_cache import KVCacheManager, hash_block
from core.request import Request, RequestId
from core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4


def make_request(rid: str, tokens: list[int], salt: str = "") -> Request:
    return Request(RequestId(rid), list(tokens), SamplingParams(max_tokens=8), seed=0, cache_salt=salt)


def run_prefill(kv: KVCacheManager, r: Request) -> None:
    """Admit a request with its prefix hit and 'compute' the rest of its prompt in one go."""
    hit = kv.find_prefix(r)
    n = r.num_tokens - hit.num_tokens
    assert kv.can_allocate(r, n, hit)
    kv.allocate(r, n, hit)
    r.num_computed_tokens = r.num_tokens
    r.num_cached_tokens = hit.num_tokens
    kv.cache_full_blocks(r, r.num_computed_tokens)


def test_allocation_and_free_balance() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("a", list(range(10)))
    run_prefill(kv, r)
    assert len(kv.block_ids(r.request_id)) == 3
    assert kv.num_free_blocks == 8 - 3  # referenced blocks are used, hashed or not
    kv.check_integrity()
    kv.free(r)
    kv.free(r)  # idempotent
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_blocks_taken_from_the_prefix_cache_come_ascending() -> None:
    """Evicted blocks return tail first; one allocation still gets them in ascending order, so a
    request's blocks merge into few transfer descriptors (kv_transfer.block_runs)."""
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    first = make_request("a", list(range(32)))  # fills all 8 blocks, all cached on free
    run_prefill(kv, first)
    kv.free(first)
    second = make_request("b", list(range(100, 132)))  # evicts all 8
    run_prefill(kv, second)
    table = kv.block_ids(second.request_id)
    assert table == sorted(table) and len(table) == 8
    kv.check_integrity()


def test_prefix_hit_reuses_blocks_and_leaves_last_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(12)))
    run_prefill(kv, a)
    b = make_request("b", list(range(12)))  # identical prompt: 12 tokens = 3 full blocks
    hit = kv.find_prefix(b)
    assert hit.num_tokens == 8, "the block holding the last token is never a hit"
    assert hit.block_ids == kv.block_ids(a.request_id)[:2]
    c = make_request("c", list(range(8)) + [99, 98, 97, 96, 95])
    run_prefill(kv, c)
    assert c.num_cached_tokens == 8
    assert kv.block_ids(c.request_id)[:2] == kv.block_ids(a.request_id)[:2]
    kv.check_integrity()


def test_salts_isolate_tenants() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(kv, make_request("a", list(range(12)), salt="tenant-a"))
    assert kv.find_prefix(make_request("b", list(range(12)), salt="tenant-b")).num_tokens == 0
    assert kv.find_prefix(make_request("c", list(range(12)), salt="tenant-a")).num_tokens == 8
    assert hash_block(None, [1, 2], "x") != hash_block(None, [1, 2], "y")


def test_hash_collision_is_caught_by_token_check() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    run_prefill(kv, a)
    block = kv.block_ids(a.request_id)[0]
    kv._tokens[block] = (9, 9, 9, 9)  # simulate a colliding hash: index says hit, content differs
    assert kv.find_prefix(make_request("b", [1, 2, 3, 4, 5, 6])).num_tokens == 0


def test_lru_evicts_least_recently_freed_and_tail_first() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(9)))  # 2 full blocks + 1 partial
    run_prefill(kv, a)
    kv.free(a)
    b = make_request("b", list(range(100, 109)))
    run_prefill(kv, b)
    kv.free(b)
    # 4 cached blocks (a0 a1 b0 b1), 2 free. Needing 4 blocks evicts 2: a's tail (a1) then a's head (a0).
    c = make_request("c", list(range(200, 216)))
    run_prefill(kv, c)
    assert kv.stats.num_evictions == 2
    assert kv.find_prefix(make_request("b2", list(range(100, 109)))).num_tokens == 8
    assert kv.find_prefix(make_request("a2", list(range(9)))).num_tokens == 0
    kv.check_integrity()


def test_allocate_without_room_is_an_internal_error() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    r = make_request("a", list(range(12)))
    assert not kv.can_allocate(r, 12)
    with pytest.raises(RuntimeError):
        kv.allocate(r, 12)


class CacheMachine(RuleBasedStateMachine):
    """Random admit / grow / compute / free / evict sequences keep every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BS)
        self.live: dict[str, Request] = {}
        self.leases: list[str] = []
        self.n = 0

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=20), salt=st.sampled_from(["", "t1"]))
    def admit(self, tokens: list[int], salt: str) -> None:
        r = make_request(f"r{self.n}", tokens, salt)
        self.n += 1
        hit = self.kv.find_prefix(r)
        # A hit must be exactly the request's own leading tokens.
        for i, b in enumerate(hit.block_ids):
            assert self.kv._tokens[b] == tuple(tokens[i * BS : (i + 1) * BS])
        assert hit.num_tokens < r.num_tokens
        n = r.num_tokens - hit.num_tokens
        if self.kv.can_allocate(r, n, hit):
            needed = self.kv.num_blocks_needed(r, n, hit)
            before = self.kv.num_free_blocks
            self.kv.allocate(r, n, hit)
            assert before - self.kv.num_free_blocks == needed
            r.num_computed_tokens = r.num_tokens
            self.kv.cache_full_blocks(r, r.num_computed_tokens)
            self.live[r.request_id] = r

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live[rid]
        r.output_token_ids.append(data.draw(st.integers(0, 3)))
        if self.kv.can_allocate(r, 1):
            needed = self.kv.num_blocks_needed(r, 1)
            before = self.kv.num_free_blocks
            self.kv.allocate(r, 1)
            assert before - self.kv.num_free_blocks == needed
            r.num_computed_tokens += 1
            self.kv.cache_full_blocks(r, r.num_computed_tokens)
        else:
            r.output_token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(rid))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def pin_for_transfer(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        r = self.live.pop(rid)
        blocks = self.kv.pin(r, f"lease-{rid}")
        assert blocks and not self.kv.block_ids(r.request_id)
        self.kv.free(r)  # the request ends; its blocks stay pinned under the lease
        self.leases.append(f"lease-{rid}")

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        lease = data.draw(st.sampled_from(self.leases))
        self.leases.remove(lease)
        assert self.kv.unpin(lease) > 0
        assert self.kv.unpin(lease) == 0, "unpin is idempotent"

    @rule()
    def reset(self) -> None:
        self.kv.reset_prefix_cache()

    @invariant()
    def integrity(self) -> None:
        self.kv.check_integrity()
        for r in self.live.values():
            table = self.kv.block_ids(r.request_id)
            assert len(table) == -(-r.num_computed_tokens // BS)

    def teardown(self) -> None:
        for r in self.live.values():
            self.kv.free(r)
        for lease in self.leases:
            self.kv.unpin(lease)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == self.kv.num_blocks, "blocks leaked"


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=16), min_size=1, max_size=12))
@settings(max_examples=100, deadline=None)
def test_shared_prefix_blocks_are_refcounted(prompts: list[list[int]]) -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS)
    reqs = []
    for i, p in enumerate(prompts):
        r = make_request(f"r{i}", p)
        run_prefill(kv, r)
        reqs.append(r)
        kv.check_integrity()
    for r in reqs:
        kv.free(r)
        kv.check_integrity()
    assert kv.num_free_blocks == 64
