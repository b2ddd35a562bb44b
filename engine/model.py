"""The Llama-family transformer (Llama 2/3, Mistral, Qwen2) over a flattened mixed batch with paged KV.

One forward takes ``T`` tokens from many sequences at once — prefill chunks and decode tokens side by
side — with their absolute positions, writes their K/V into the paged cache and attends through block
tables (`engine.attention`). Shapes in comments: T tokens, H query heads, KVH KV heads, D head dim.
q/k/v and gate/up projections are fused into one matmul each: fewer, larger GEMMs are what eager CPU
inference is bound by.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_ops
from engine.attention import AttentionMetadata, paged_attention
from engine.model_config import ModelConfig, RopeScaling

LOGITS_SLICE_ROWS = 2048  # vocabulary rows per lm_head GEMM on CPU


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm."""
        return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """Per-pair rotation frequencies, with linear or Llama-3 (wavelength-banded) scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the Hugging Face convention) from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        if self.cos.device.type != "meta":
            self.init_tables(self.cos.device)

    def init_tables(self, device: torch.device) -> None:
        """(Re)computes the cos/sin tables in float64 → fp32, e.g. after building on the meta device."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float64), inv_freq)  # [P, D/2]
        self.cos = freqs.cos().float().to(device)
        self.sin = freqs.sin().float().to(device)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        kv_layer: tuple[torch.Tensor, torch.Tensor],
        rope: RotaryEmbedding,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # [T, H, D] strided views of the qkv output
        k = k.view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_layer  # [num_blocks, block_size, KVH, D] views
        q, k = cpu_ops.rope_and_cache(
            q, k, v, rope.cos, rope.sin, meta.positions, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets
        )
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, self.sliding_window)  # [T, H, D]
        projected: torch.Tensor = self.o_proj(out.reshape(t, self.q_size))
        return projected


class MLP(nn.Module):
    gate_up_proj: nn.Module  # nn.Linear, or its fast form after loading (engine.linear)
    down_proj: nn.Module

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(cpu_ops.silu_and_mul(self.gate_up_proj(x)))
        return out


class DecoderLayer(nn.Module):
    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: MLP

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_layer: tuple[torch.Tensor, torch.Tensor],
        rope: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output (the embeddings for layer 0), residual: the stream before
        it (None for layer 0). Returns this layer's MLP output and the stream before it."""
        if residual is None:
            x, residual = self.input_layernorm(x), x.float()
        else:
            x, residual = self.input_layernorm.add(x, residual)
        x = self.self_attn(x, meta, kv_layer, rope)
        x, residual = self.post_attention_layernorm.add(x, residual)
        return self.mlp(x), residual


def _build_decode_plan(model: LlamaForCausalLM) -> tuple[int, list[torch.Tensor]] | None:
    from engine.linear import Bf16DotLinear, Int8Linear, PackedLinear

    none = torch.empty(0)

    def parts(m: nn.Module) -> tuple[int, list[torch.Tensor]] | None:
        if isinstance(m, Bf16DotLinear):
            return 3, [m.packed, none if m.bias is None else m.bias, none]
        if isinstance(m, PackedLinear):
            return 1, [m.packed, none if m.bias is None else m.bias, none]
        if isinstance(m, Int8Linear):
            return 2, [m.qweight, none if m.bias is None else m.bias, m.scales]
        if isinstance(m, nn.Linear):
            return 0, [m.weight.detach(), none if m.bias is None else m.bias.detach(), none]
        return None

    kinds: set[int] = set()
    weights: list[torch.Tensor] = []
    for layer in model.decoder_layers():
        weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
        for proj in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            got = parts(proj)
            if got is None:
                return None
            kinds.add(got[0])
            weights += got[1]
    if len(kinds) != 1:
        return None
    return kinds.pop(), weights  # an empty tensor stands for "no bias" (a Tensor[] cannot hold None)


def layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[num_blocks, L, 2, block_size, KVH, D] → per layer (K, V) views [num_blocks, block_size, KVH, D],
    made once per cache rather than sliced again in every step."""
    return [(kv_cache[:, i, 0], kv_cache[:, i, 1]) for i in range(kv_cache.shape[1])]


class LlamaForCausalLM(nn.Module):
    """Token ids + positions of a flattened batch → hidden states; `compute_logits` on selected rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_buffers(self, device: torch.device) -> None:
        """Fills the non-checkpoint buffers (RoPE tables); needed after building on the meta device."""
        self.rope.init_tables(device)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V) views, see `layer_views`
    ) -> torch.Tensor:  # [T, hidden]
        x: torch.Tensor = self.embed_tokens(input_ids)
        rows = meta.rows_attention(x.shape[0])
        if rows is not None and cpu_ops.use_kernels(x):
            plan = self._decode_plan()
            if plan is not None:  # every row attends on its own: the whole stack in one C++ call
                cfg = self.config
                k_caches, v_caches = [kv[0] for kv in kv_layers], [kv[1] for kv in kv_layers]
                hidden: torch.Tensor = torch.ops.baton.decode_layers(
                    x,
                    plan[1],
                    plan[0],
                    meta.positions,
                    meta.slot_blocks,
                    meta.slot_offsets,
                    rows[0],
                    rows[1],
                    self.rope.cos,
                    self.rope.sin,
                    k_caches,
                    v_caches,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.head_dim,
                    cfg.rms_norm_eps,
                    cfg.head_dim**-0.5,
                    cfg.sliding_window or 0,
                )
                return hidden
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.decoder_layers()):
            x, residual = cast(
                tuple[torch.Tensor, torch.Tensor], layer(x, residual, meta, kv_layers[i], self.rope)
            )
        return x if residual is None else (residual + x.float()).to(x.dtype)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def _decode_plan(self) -> tuple[int, list[torch.Tensor]] | None:
        """(kind, 14 tensors per layer) for `baton::decode_layers`, built once; None when the layers'
        projections are not all of one kind it knows (then the Python forward serves)."""
        if not hasattr(self, "_plan"):
            self._plan = _build_decode_plan(self)
        return self._plan

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] → [S, V] fp32
        h = self.norm(hidden)
        if h.is_cuda or not isinstance(self.lm_head, nn.Linear):  # a packed or int8 head: one call
            logits: torch.Tensor = self.lm_head(h)
            return logits.float()
        # On CPU one [S, hidden] x [hidden, V] GEMM over the whole vocabulary runs ~15% slower than the
        # same product in vocabulary slices that stay cache-resident (measured: benchmarks, docs/ENGINE.md).
        slices = torch.split(self.lm_head.weight, LOGITS_SLICE_ROWS)
        return torch.cat([F.linear(h, w) for w in slices], dim=1).float()
