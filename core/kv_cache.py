"""`KVCacheManager`: the paged KV block pool with reference counts, prefix caching and LRU eviction.

Every block is in exactly one of three sets at any time:
  * free      — unreferenced and holding nothing reusable;
  * cached    — unreferenced but holding a full, hashed block that a later request may reuse
                (evicted least-recently-freed first when the free set is empty);
  * used      — referenced by one or more requests (shared prefix blocks have ref_count > 1).
``check_integrity()`` proves free + cached + used == total and that the reference counts and the hash
index agree with the block tables.

Prefix caching: full blocks are named by a hash chain ``h_i = H(h_{i-1}, tokens_i)`` whose first link
is ``H(extra_key, tokens_0)``; the extra key carries the tenant salt and model version, so two tenants
share a prefix only if the server gave them the same salt. A hash hit is re-checked against the
stored token ids and parent hash, so a hash collision can never serve another prompt's KV.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import NewType

from core.request import Request, RequestId

BlockId = NewType("BlockId", int)
BlockHash = NewType("BlockHash", bytes)


def _link(parent: BlockHash | None, data: bytes | memoryview, extra_key: str) -> BlockHash:
    h = blake2b(digest_size=16)
    h.update(b"\x00" + extra_key.encode() if parent is None else b"\x01" + parent)
    h.update(data)
    return BlockHash(h.digest())


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str) -> BlockHash:
    """One link of the prefix-hash chain (128-bit BLAKE2b, stable across processes and hosts)."""
    return _link(parent, array("q", token_ids).tobytes(), extra_key)


def hash_chain(
    token_ids: Sequence[int], block_size: int, extra_key: str, parent: BlockHash | None = None
) -> list[BlockHash]:
    """The links of ``token_ids``' full blocks, continuing the chain after ``parent`` (the same links
    as `hash_block` one block at a time; the token ids are packed once, not once per block)."""
    num_full = len(token_ids) // block_size
    data = memoryview(array("q", token_ids[: num_full * block_size]).tobytes())
    step = block_size * 8  # bytes per block: 8 per token id ("q")
    links: list[BlockHash] = []
    for start in range(0, num_full * step, step):
        parent = _link(parent, data[start : start + step], extra_key)
        links.append(parent)
    return links


@dataclass(slots=True)
class PrefixHit:
    """The cached blocks that cover a prefix of a request's tokens (found, not yet referenced)."""

    block_ids: list[BlockId]
    num_tokens: int


@dataclass(slots=True)
class CacheStats:
    """Prefix-cache counters, in tokens (monotonic)."""

    num_query_tokens: int = 0
    num_hit_tokens: int = 0
    num_evictions: int = 0


class KVCacheManager:
    """Owns the block pool and every request's block table; all methods are O(blocks touched)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.stats = CacheStats()
        self._ref_count = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._parent: list[BlockHash | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: deque[BlockId] = deque(BlockId(i) for i in range(num_blocks))
        self._cached: OrderedDict[BlockId, None] = OrderedDict()  # LRU order: oldest first
        self._hash_to_block: dict[BlockHash, BlockId] = {}
        self._req_blocks: dict[RequestId, list[BlockId]] = {}
        self._req_num_hashed: dict[RequestId, int] = {}  # leading blocks already registered/verified
        self._req_hashes: dict[RequestId, list[BlockHash]] = {}
        self._pinned: dict[str, list[BlockId]] = {}  # lease id → blocks kept for a KV transfer

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take now: free plus evictable cached blocks."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, request_id: RequestId) -> list[BlockId]:
        return self._req_blocks.get(request_id, [])

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Hash chain of the request's full blocks (extended lazily as tokens are added)."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        bs = self.block_size
        if len(hashes) < num_full:
            parent = hashes[-1] if hashes else None
            hashes += hash_chain(
                request.token_slice(len(hashes) * bs, num_full * bs), bs, request.cache_salt, parent
            )
        return hashes

    def cached_hashes(self) -> set[BlockHash]:
        """Every block hash this cache can serve now (what a worker publishes for KV-aware placement)."""
        return set(self._hash_to_block)

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of cached blocks that matches the request's leading tokens.

        At most ``num_tokens - 1`` tokens can hit: the last token must be computed to get its logits,
        and the block that holds it must be private because the step writes into it.
        """
        if (
            not self.enable_prefix_caching
            or request.num_computed_tokens > 0
            or request.params.prompt_logprobs is not None  # every prompt token's logits are needed
        ):
            return PrefixHit([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[BlockId] = []
        parent: BlockHash | None = None
        for i, h in enumerate(self.block_hashes(request)[:max_blocks]):
            block = self._hash_to_block.get(h)
            if block is None or self._parent[block] != parent:
                break
            tokens = request.token_slice(i * self.block_size, (i + 1) * self.block_size)
            if self._tokens[block] != tuple(tokens):  # collision guard
                break
            hits.append(block)
            parent = h
        return PrefixHit(hits, len(hits) * self.block_size)

    def num_blocks_needed(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> int:
        """Blocks an allocation for ``num_new_tokens`` more tokens would take from the free pool."""
        num_hit = len(hit.block_ids) if hit else 0
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        total = -(-(num_computed + num_new_tokens) // self.block_size)
        new = max(0, total - len(self.block_ids(request.request_id)) - num_hit)
        # A hit on an unreferenced cached block takes it out of the evictable set.
        revived = sum(1 for b in hit.block_ids if self._ref_count[b] == 0) if hit else 0
        return new + revived

    def can_allocate(
        self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None, reserve: int = 0
    ) -> bool:
        return self.num_blocks_needed(request, num_new_tokens, hit) + reserve <= self.num_free_blocks

    # ------------------------------------------------------------------ mutations
    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> list[BlockId]:
        """Grows the request's block table to hold ``num_new_tokens`` more tokens; returns new blocks.

        With a prefix ``hit`` (only at admission) the hit blocks are referenced first. The caller
        checks ``can_allocate`` first; running out here is an internal error.
        """
        rid = request.request_id
        table = self._req_blocks.setdefault(rid, [])
        num_computed = request.num_computed_tokens
        if hit is not None:  # admission: count the prefix-cache query once
            self.stats.num_query_tokens += request.num_tokens
            self.stats.num_hit_tokens += hit.num_tokens
        if hit and hit.block_ids:
            assert not table, "a prefix hit is only applied to a request without blocks"
            for b in hit.block_ids:
                if self._ref_count[b] == 0:
                    del self._cached[b]
                self._ref_count[b] += 1
            table.extend(hit.block_ids)
            self._req_num_hashed[rid] = len(hit.block_ids)
            num_computed += hit.num_tokens
        total = -(-(num_computed + num_new_tokens) // self.block_size)
        # Ascending order: blocks evicted from the prefix cache come out tail first, and a request
        # whose blocks are adjacent and ascending moves as one descriptor (kv_transfer.block_runs).
        new_blocks = sorted(self._take_block() for _ in range(max(0, total - len(table))))
        for b in new_blocks:
            self._ref_count[b] = 1
        table.extend(new_blocks)
        return new_blocks

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Registers the request's blocks that became full (and computed) in the prefix index."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        done = self._req_num_hashed.get(rid, 0)
        num_full = num_computed_tokens // self.block_size
        if num_full <= done:
            return
        hashes = self.block_hashes(request)
        table = self._req_blocks[rid]
        bs = self.block_size
        for i in range(done, num_full):
            h = hashes[i]
            if h in self._hash_to_block:
                continue  # another block already holds this content; this one stays private
            b = table[i]
            self._hash[b] = h
            self._parent[b] = hashes[i - 1] if i > 0 else None
            self._tokens[b] = tuple(request.token_slice(i * bs, (i + 1) * bs))
            self._hash_to_block[h] = b
        self._req_num_hashed[rid] = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks (idempotent). Tail blocks are queued for eviction before the
        head, because a shared prefix is more likely to be reused than a request's private tail."""
        rid = request.request_id
        table = self._req_blocks.pop(rid, [])
        self._req_num_hashed.pop(rid, None)
        self._req_hashes.pop(rid, None)
        self._release(table)

    def _release(self, table: list[BlockId]) -> None:
        for b in reversed(table):
            self._ref_count[b] -= 1
            assert self._ref_count[b] >= 0, f"block {b} freed more often than referenced"
            if self._ref_count[b] == 0:
                if self._hash[b] is not None:
                    self._cached[b] = None
                else:
                    self._free.append(b)

    def pin(self, request: Request, lease_id: str) -> list[BlockId]:
        """Moves a request's blocks to a lease: they stay referenced (and readable by a peer) after
        the request itself is gone, until ``unpin``. Used by a prefill worker for the KV handoff."""
        if lease_id in self._pinned:
            raise ValueError(f"lease {lease_id!r} already pins blocks")
        rid = request.request_id
        blocks = self._req_blocks.pop(rid, [])
        self._req_num_hashed.pop(rid, None)
        self._req_hashes.pop(rid, None)
        self._pinned[lease_id] = blocks
        return list(blocks)

    def unpin(self, lease_id: str) -> int:
        """Releases a lease's blocks (idempotent); returns how many blocks it held."""
        blocks = self._pinned.pop(lease_id, [])
        self._release(blocks)
        return len(blocks)

    def pinned_blocks(self, lease_id: str) -> list[BlockId]:
        return list(self._pinned.get(lease_id, []))

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(b) for b in self._pinned.values())

    def reset_prefix_cache(self) -> None:
        """Drops every evictable cached block (e.g. after a model version change)."""
        while self._cached:
            b, _ = self._cached.popitem(last=False)
            self._drop_hash(b)
            self._free.append(b)

    def _take_block(self) -> BlockId:
        if self._free:
            return self._free.popleft()
        if not self._cached:
            raise RuntimeError("KV cache exhausted: allocate() called without can_allocate()")
        b, _ = self._cached.popitem(last=False)
        self._drop_hash(b)
        self.stats.num_evictions += 1
        return b

    def _drop_hash(self, b: BlockId) -> None:
        h = self._hash[b]
        if h is not None and self._hash_to_block.get(h) == b:
            del self._hash_to_block[h]
        self._hash[b] = None
        self._parent[b] = None
        self._tokens[b] = None

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Raises AssertionError unless free + cached + used == total and all indexes agree."""
        refs = [0] * self.num_blocks
        for table in [*self._req_blocks.values(), *self._pinned.values()]:
            for b in table:
                refs[b] += 1
        assert refs == self._ref_count, "reference counts disagree with the block tables and leases"
        free, cached = set(self._free), set(self._cached)
        used = {b for b in range(self.num_blocks) if refs[b] > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not (free & cached) and not (free & used) and not (cached & used), "a block is in two sets"
        assert len(free) + len(cached) + len(used) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + used {len(used)} != total {self.num_blocks}"
        )
        assert all(self._hash[b] is None for b in free), "a free block still carries a hash"
        assert all(self._hash[b] is not None for b in cached), "a cached block has no hash"
        for h, b in self._hash_to_block.items():
            assert self._hash[b] == h, f"hash index points at block {b} holding other content"
