"""The Triton paged-attention kernel matches the torch reference, run in Triton's CPU interpreter."""

from __future__ import annotations

import os

# Triton decides interpreted-vs-compiled when @triton.jit runs, i.e. when engine.triton_attention is
# imported; there is no GPU here, so the variable must be set before that import (and before triton's).
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from engine.attention import paged_attention_reference  # noqa: E402
from engine.triton_attention import paged_attention_triton  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.triton]

HEAD_DIM = 16  # the smallest tl.dot allows: the interpreter is slow
NUM_LAYERS = 2
LAYER = 1


def make_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of LAYER as the strided views the engine passes: kv_cache[:, layer, 0] and [:, layer, 1]."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(dtype)
    k_cache, v_cache = kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1]
    assert not k_cache.is_contiguous()
    return k_cache, v_cache


def make_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, dtype: torch.dtype, seed: int = 0
) -> torch.Tensor:
    """Non-contiguous, shuffled blocks per sequence; padding holds random valid block ids."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(n + block_size - 1) // block_size for n in seq_lens]
    max_blocks = max(blocks_needed)
    assert sum(blocks_needed) <= num_blocks
    free = torch.randperm(num_blocks, generator=gen)
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen)
    used = 0
    for seq, n in enumerate(blocks_needed):
        tables[seq, :n] = free[used : used + n]
        used += n
    return tables.to(dtype)


def run_both(q, k_cache, v_cache, block_tables, seq_ids, positions, sliding_window=None):
    scale = q.shape[-1] ** -0.5
    args = (q, k_cache, v_cache, block_tables, seq_ids, positions, scale, sliding_window)
    return paged_attention_triton(*args), paged_attention_reference(*args)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 3), (2, 2)])
def test_decode_ragged_lengths(block_size: int, num_heads: int, num_kv_heads: int) -> None:
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size - 3]
    num_blocks = 12
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, num_kv_heads)
    tables = make_block_tables(seq_lens, block_size, num_blocks, torch.int32)
    q = torch.randn(len(seq_lens), num_heads, HEAD_DIM)
    seq_ids = torch.arange(len(seq_lens))
    positions = torch.tensor(seq_lens) - 1  # one decode token per sequence, the newest position

    out, ref = run_both(q, k_cache, v_cache, tables, seq_ids, positions)

    assert out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def mixed_batch(block_size: int, num_heads: int, num_kv_heads: int, table_dtype: torch.dtype):
    """Sequence 1 prefills a causal chunk across a block boundary; sequences 0 and 2 decode one token each."""
    seq_lens = [2 * block_size + 3, 2 * block_size + 5, block_size + 1]
    chunk = range(block_size - 4, 2 * block_size + 5)  # positions already computed: 0 .. block_size - 5
    num_blocks = 10
    k_cache, v_cache = make_kv_cache(num_blocks, block_size, num_kv_heads, seed=1)
    tables = make_block_tables(seq_lens, block_size, num_blocks, table_dtype, seed=1)
    seq_ids = torch.tensor([0] + [1] * len(chunk) + [2])
    positions = torch.tensor([seq_lens[0] - 1, *chunk, seq_lens[2] - 1])
    # q as a non-contiguous slice of a fused qkv projection, the way the model hands it over.
    qkv = torch.randn(len(seq_ids), num_heads + 2 * num_kv_heads, HEAD_DIM)
    q = qkv[:, :num_heads]
    return q, k_cache, v_cache, tables, seq_ids, positions


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
def test_mixed_prefill_chunk_and_decode(table_dtype: torch.dtype) -> None:
    batch = mixed_batch(16, 4, 2, table_dtype)

    out, ref = run_both(*batch)

    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block_size,sliding_window", [(16, 1), (16, 20), (32, 5)])
def test_sliding_window(block_size: int, sliding_window: int) -> None:
    batch = mixed_batch(block_size, 6, 3, torch.int64)

    out, ref = run_both(*batch, sliding_window=sliding_window)

    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_group_of_eight_head_dim_64() -> None:
    block_size, num_heads, num_kv_heads, head_dim = 16, 8, 1, 64
    seq_lens = [block_size + 1, 2 * block_size + 7]
    k_cache, v_cache = make_kv_cache(6, block_size, num_kv_heads, head_dim=head_dim, seed=2)
    tables = make_block_tables(seq_lens, block_size, 6, torch.int64, seed=2)
    q = torch.randn(2, num_heads, head_dim)
    seq_ids, positions = torch.tensor([1, 0]), torch.tensor([seq_lens[1] - 1, seq_lens[0] - 1])

    out, ref = run_both(q, k_cache, v_cache, tables, seq_ids, positions)

    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_half_precision_output_dtype() -> None:
    block_size, num_heads, num_kv_heads = 16, 4, 2
    seq_lens = [block_size + 2, 3]
    k_cache, v_cache = make_kv_cache(4, block_size, num_kv_heads, dtype=torch.float16)
    tables = make_block_tables(seq_lens, block_size, 4, torch.int32)
    q = torch.randn(2, num_heads, HEAD_DIM).to(torch.float16)
    seq_ids, positions = torch.tensor([0, 1]), torch.tensor([n - 1 for n in seq_lens])

    out, ref = run_both(q, k_cache, v_cache, tables, seq_ids, positions)

    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_empty_batch() -> None:
    k_cache, v_cache = make_kv_cache(2, 16, 2)
    q = torch.empty(0, 4, HEAD_DIM)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    empty = torch.empty(0, dtype=torch.long)

    out = paged_attention_triton(q, k_cache, v_cache, tables, empty, empty, 0.25)

    assert out.shape == (0, 4, HEAD_DIM)


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,match", [(4, 2, 24, "head_dim"), (5, 2, HEAD_DIM, "divisible")]
)
def test_unsupported_shapes_raise(num_heads: int, num_kv_heads: int, head_dim: int, match: str) -> None:
    k_cache, v_cache = make_kv_cache(2, 16, num_kv_heads, head_dim=head_dim)
    q = torch.randn(1, num_heads, head_dim)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    ids = torch.zeros(1, dtype=torch.long)

    with pytest.raises(ValueError, match=match):
        paged_attention_triton(q, k_cache, v_cache, tables, ids, ids, 0.25)
