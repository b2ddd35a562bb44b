"""Paged attention as one Triton kernel for the GPU path: decode and chunked-prefill tokens alike.

Same signature and semantics as ``engine.attention.paged_attention_reference``: each query token attends
causally to its own sequence's keys ``0 .. pos`` (or the last ``sliding_window`` of them), found block by
block through that sequence's block table in the block-major KV cache.

Design: one program per (query token, KV head). The program loads the ``H // KVH`` query heads of its
group as one ``[GROUP_PAD, D]`` tile (rows padded to 16 for ``tl.dot``), so every K/V block is read once
per group, not once per query head. It walks the sequence's blocks in order, one ``[BLOCK_SIZE, D]`` K and
V tile at a time, and keeps an fp32 online softmax (running max, running sum, rescaled accumulator); only
blocks that hold at least one visible key are visited, so a sliding window also saves the bandwidth.

On a CPU this runs only under ``TRITON_INTERPRET=1`` (correct, slow); serving on CPU uses the torch paths.
Importing the module launches nothing and needs no CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_MIN_DOT_DIM = 16  # tl.dot wants every tile dimension >= 16


@triton.jit  # type: ignore[untyped-decorator]
def _paged_attention_kernel(  # type: ignore[no-untyped-def]  # Triton's own argument types (pointers, constexprs)
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    seq_ids_ptr,
    positions_ptr,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,  # K cache view [num_blocks, block_size, KVH, D]
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bts,
    stride_btb,  # block tables [S, max_blocks]
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is the native instruction)
    sliding_window,  # 0 = none
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)

    seq = tl.load(seq_ids_ptr + token).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int32)
    lo = tl.where(sliding_window > 0, tl.maximum(pos - sliding_window + 1, 0), 0)

    rows = tl.arange(0, GROUP_PAD)  # query heads of this group, padded
    row_ok = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    slots = tl.arange(0, BLOCK_SIZE)

    # [GROUP_PAD, D]; padded rows are zeros and never stored. int64 offsets: big caches exceed 2**31 elements.
    heads = (kv_head * GROUP + rows).to(tl.int64)
    q_offs = token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

    kv_head64 = kv_head.to(tl.int64)
    bt_row = block_tables_ptr + seq * stride_bts
    # Every visited block holds >= 1 visible key (the first holds `lo`, the last `pos`), so m_new is finite.
    for j in range(lo // BLOCK_SIZE, pos // BLOCK_SIZE + 1):
        block = tl.load(bt_row + j * stride_btb).to(tl.int64)
        k_offs = (
            block * stride_kb + slots[:, None] * stride_ks + kv_head64 * stride_kh + dims[None, :] * stride_kd
        )
        v_offs = (
            block * stride_vb + slots[:, None] * stride_vs + kv_head64 * stride_vh + dims[None, :] * stride_vd
        )
        # A real GPU would prefetch the next block here (num_stages pipelining) since decode is HBM-bound.
        k = tl.load(k_ptr + k_offs)  # [BLOCK_SIZE, D]; the whole block is in bounds, only keys get masked
        v = tl.load(v_ptr + v_offs)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, BLOCK_SIZE] fp32
        key_pos = j * BLOCK_SIZE + slots
        visible = (key_pos <= pos) & (key_pos >= lo)
        s = tl.where(visible[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)  # exp2(-inf) = 0 on the first block
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_offs = token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_shapes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    token_seq_ids: torch.Tensor,
    token_positions: torch.Tensor,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(
            f"expected q [T, H, D] and k_cache [num_blocks, block_size, KVH, D], "
            f"got {tuple(q.shape)} and {tuple(k_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if not _is_power_of_two(head_dim) or head_dim < _MIN_DOT_DIM:
        raise ValueError(f"head_dim must be a power of two >= {_MIN_DOT_DIM}, got {head_dim}")
    if not _is_power_of_two(block_size) or block_size < _MIN_DOT_DIM:
        raise ValueError(f"block_size must be a power of two >= {_MIN_DOT_DIM}, got {block_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got {tuple(block_tables.shape)}")
    if token_seq_ids.shape != (num_tokens,) or token_positions.shape != (num_tokens,):
        raise ValueError(
            f"token_seq_ids {tuple(token_seq_ids.shape)} and token_positions "
            f"{tuple(token_positions.shape)} must both be [{num_tokens}]"
        )


def paged_attention_triton(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (strided view into the block-major cache)
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32/int64, padded with any valid block id
    token_seq_ids: torch.Tensor,  # [T] int
    token_positions: torch.Tensor,  # [T] int
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D], q's dtype
    """Paged attention for a flattened batch of decode and prefill tokens; matches the torch reference."""
    _check_shapes(q, k_cache, v_cache, block_tables, token_seq_ids, token_positions)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    token_seq_ids = token_seq_ids.contiguous()
    token_positions = token_positions.contiguous()

    _paged_attention_kernel[(num_tokens, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        token_seq_ids,
        token_positions,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        scale * _LOG2E,
        sliding_window or 0,
        GROUP=group,
        # Padding the group to 16 rows wastes MMA work on decode, but decode is bandwidth-bound: the
        # K/V bytes read, not the FLOPs, set its speed.
        GROUP_PAD=max(_MIN_DOT_DIM, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        # fp32 inputs would otherwise run the dots in TF32 on a GPU (~1e-3 error); half types keep the default.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    return out
