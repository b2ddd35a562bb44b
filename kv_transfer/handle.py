"""`KVHandle` (what a prefill worker hands to a decode worker) and `KVLayout` with its compatibility hash."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass

from core.errors import KVIncompatible, KVTransferFailed

BATON_KV_VERSION = "1"  # bump when the block layout or the transfer protocol changes


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Everything that must match for one worker's KV blocks to be meaningful in another's cache."""

    model_digest: str  # the model version's weights + config digest
    dtype: str  # "float32", "bfloat16", …
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = "block_major"  # [blocks, layers, 2, block_size, kv_heads, head_dim]
    baton_version: str = BATON_KV_VERSION

    @property
    def block_bytes(self) -> int:
        elem = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def compat_hash(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def check_compatible(self, other: KVLayout) -> None:
        """Raises KVIncompatible naming every field that differs."""
        if self.compat_hash == other.compat_hash:
            return
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k}: {mine[k]!r} here vs {theirs[k]!r} at the peer" for k in mine if mine[k] != theirs[k]]
        raise KVIncompatible("KV caches are incompatible (" + "; ".join(diffs) + ")")


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A lease on a prefill worker's blocks holding one request's prompt KV.

    The decode worker pulls the blocks it lacks, then notifies the source, which unpins them; if it
    never does, the lease expires at ``expires_at`` and the source frees them anyway.
    """

    source: str  # the prefill worker's transport name (its address / agent name)
    lease_id: str
    block_ids: tuple[int, ...]  # source block ids, in sequence order
    num_tokens: int  # prompt tokens whose KV the blocks hold
    block_size: int
    compat_hash: str
    expires_at: float  # unix time

    @property
    def expired(self) -> bool:
        return time.time() >= self.expires_at


def block_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Merges a block mapping into runs ``(src_start, dst_start, count)`` that are contiguous on both
    sides, so a transfer needs one descriptor per run instead of one per block."""
    if len(src) != len(dst):
        raise ValueError("source and destination block lists differ in length")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def check_block_ids(src: list[int], dst: list[int], num_src: int, num_dst: int, peer: str) -> None:
    """Every block id must exist on its side; a bad id is a clear error, never a stray copy."""
    if len(src) != len(dst):
        raise KVTransferFailed(
            f"pull from {peer}: {len(src)} source blocks but {len(dst)} destination blocks"
        )
    if src and (min(src) < 0 or max(src) >= num_src):
        raise KVTransferFailed(f"pull from {peer}: source block id out of range [0, {num_src})")
    if dst and (min(dst) < 0 or max(dst) >= num_dst):
        raise KVTransferFailed(f"pull from {peer}: destination block id out of range [0, {num_dst})")
