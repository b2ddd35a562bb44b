"""Paged attention over the KV cache: a unified torch reference, the fast CPU paths, and the GPU dispatch.

The KV cache of a worker is one tensor ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``
(block-major) so that one block of one request — all layers, K and V — is a single contiguous run of
bytes: the unit kv_transfer moves. A layer's K (or V) cache is the strided view
``kv_cache[:, layer, 0]`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``.

A flattened batch holds ``T`` query tokens from ``S`` sequences. Token ``t`` belongs to sequence
``token_seq_ids[t]``, sits at absolute position ``token_positions[t]`` and attends to that sequence's keys
at positions ``0 .. token_positions[t]`` (causal), found through ``block_tables[seq]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cpu_ops import gather_blocks, paged_decode_attention


@dataclass(slots=True)
class PrefillSpan:
    """A sequence that contributes several query tokens (a prompt chunk) to the flattened batch."""

    token_start: int  # first row in the flattened batch
    token_end: int  # one past the last row
    start_pos: int  # absolute position of the first query token
    block_table: torch.Tensor  # [n_blocks] long, covering positions 0 .. start_pos + n - 1
    mask: torch.Tensor | None  # [n, ctx] bool (True = attend), None when a plain causal mask will do
    # A short chunk on CPU attends row by row, each token a query of its own, as decodes do (the same
    # kernel whatever else is in the step, so its numbers do not depend on the batch): [n, W], [n].
    row_block_tables: torch.Tensor | None = None
    row_ctx_lens: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens sit in the paged cache. Decode tokens (one per sequence) come first."""

    positions: torch.Tensor  # [T] long
    slot_blocks: torch.Tensor  # [T] long
    slot_offsets: torch.Tensor  # [T] long
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] long (padded with block 0)
    decode_ctx_lens: torch.Tensor  # [Bd] long: each decode sequence's context, its new token included
    prefills: list[PrefillSpan]
    # The unified form used by the GPU kernel (every token: its sequence and that sequence's table).
    block_tables: torch.Tensor | None = None  # [S, max_blocks]
    token_seq_ids: torch.Tensor | None = None  # [T]
    # Every row as a query of its own (its sequence's table, context = its position + 1), set on CPU when
    # every prompt chunk of the step attends row by row: then the whole step runs the one-call decode
    # stack (varlen attention per row) instead of the per-layer path.
    row_block_tables: torch.Tensor | None = None  # [T, max_blocks] long
    row_ctx_lens: torch.Tensor | None = None  # [T] long

    def rows_attention(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(block table, context length) of every one of the ``num_tokens`` rows, if the step can attend
        row by row: a decode-only step, or one whose prompt chunks were laid out so."""
        if self.num_decode_tokens == num_tokens and not self.prefills:
            return self.decode_block_tables, self.decode_ctx_lens
        if self.row_block_tables is not None and self.row_ctx_lens is not None:
            return self.row_block_tables, self.row_ctx_lens
        return None


def paged_attention_reference(
    q: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int, padded with any valid block id
    token_seq_ids: torch.Tensor,  # [T] int
    token_positions: torch.Tensor,  # [T] int
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Straightforward per-token paged attention: the definition every faster path is tested against."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for t in range(num_tokens):
        seq = int(token_seq_ids[t])
        pos = int(token_positions[t])
        lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        n_ctx = pos + 1
        n_blocks = (n_ctx + block_size - 1) // block_size
        blocks = block_tables[seq, :n_blocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[lo:n_ctx]  # [L, KVH, D]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[lo:n_ctx]
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t].float(), k.float()) * scale
        probs = torch.softmax(scores, dim=-1)
        out[t] = torch.einsum("hl,lhd->hd", probs, v.float()).to(q.dtype)
    return out


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads; q [B,H,Lq,D], k/v [B,KVH,Lk,D]."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k_new: torch.Tensor,  # [T, KVH, D] this step's keys (already written to the cache)
    v_new: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Attention for a mixed batch: the Triton kernel on GPU; on CPU the varlen paged decode kernel for
    all decode tokens (each over its own context) and for short prompt chunks (row by row), plus one SDPA
    per other prompt chunk (a fresh prompt uses its own K/V, no cache gather)."""
    if q.is_cuda and meta.block_tables is not None and meta.token_seq_ids is not None:
        from engine.triton_attention import paged_attention_triton

        return paged_attention_triton(
            q, k_cache, v_cache, meta.block_tables, meta.token_seq_ids, meta.positions, scale, sliding_window
        )
    outs: list[torch.Tensor] = []
    nd = meta.num_decode_tokens
    if nd:
        outs.append(
            paged_decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_ctx_lens,
                scale,
                sliding_window,
            )
        )  # [Bd, H, D]
    for p in meta.prefills:
        if p.row_block_tables is not None and p.row_ctx_lens is not None:
            outs.append(
                paged_decode_attention(
                    q[p.token_start : p.token_end],
                    k_cache,
                    v_cache,
                    p.row_block_tables,
                    p.row_ctx_lens,
                    scale,
                    sliding_window,
                )
            )
            continue
        qp = q[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if p.mask is None:
            k = k_new[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)  # [1, KVH, n, D]
            v = v_new[p.token_start : p.token_end].transpose(0, 1).unsqueeze(0)
            o = sdpa(qp, k, v, None, scale, causal=True)
        else:
            ctx = p.mask.shape[1]
            table = p.block_table.unsqueeze(0)
            k = gather_blocks(k_cache, table)[:, :ctx].transpose(1, 2)  # [1, KVH, ctx, D]
            v = gather_blocks(v_cache, table)[:, :ctx].transpose(1, 2)
            o = sdpa(qp, k, v, p.mask, scale)
        outs.append(o.squeeze(0).transpose(0, 1))  # [n, H, D]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
