"""The fused per-layer ops of a forward step: Baton's C++ CPU kernels where they built, torch otherwise.

`engine/csrc/cpu_ops.cpp` is compiled once per machine (``-O3 -march=native``, so it uses whatever SIMD the
CPU has) into Baton's cache, on first use, and registered as ``torch.ops.baton.*``. If the compiler or the
build fails, or ``BATON_CPU_KERNELS=0``, every op falls back to its torch reference below — the
definitions the kernels are tested against — and a warning says so once. GPU tensors always take the
torch path (the Triton attention kernel lives in `engine.triton_attention`).

Each op does one pass where eager torch needs several: ``add_rms_norm`` is the residual add and the next
norm, ``rope_and_cache`` rotates q and k and writes k and v into their cache slots, ``silu_and_mul`` is
the MLP activation, and ``paged_decode_attention`` attends each decode sequence over its own context
through its block table (work ∝ the sum of the context lengths, no padding to the longest).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_SOURCES = (
    Path(__file__).with_name("csrc") / "cpu_ops.cpp",
    Path(__file__).with_name("csrc") / "bf16_dot.cpp",
)
_HEADERS = (Path(__file__).with_name("csrc") / "side_prefetch.h",)  # in the build's key, not compiled alone
# -fopenmp makes ATen's header-inlined parallel_for parallel; its GOMP symbols resolve to the OpenMP
# runtime torch already loaded (no second runtime is linked), so torch.set_num_threads governs it too.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
_lock = threading.Lock()
_loaded: bool | None = None


def kernels_enabled() -> bool:
    """True once the C++ kernels are loaded; builds them on the first call (tens of seconds, once per
    machine and source version; later processes load the cached library in milliseconds)."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded


def use_kernels(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and kernels_enabled()


def _build_dir() -> Path:
    from engine.digests import cache_root

    # The library is specific to this source, this torch and this CPU's instruction set.
    flags = ""
    with contextlib.suppress(OSError):  # no /proc (not Linux): the source and torch still key it
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
    stamp = (
        b"".join(src.read_bytes() for src in (*_SOURCES, *_HEADERS))
        + " ".join([torch.__version__, *_CFLAGS, flags]).encode()
    )
    key = hashlib.sha256(stamp).hexdigest()[:12]
    return cache_root() / "kernels" / f"cpu_ops-{key}"


def _load() -> bool:
    if os.environ.get("BATON_CPU_KERNELS", "1") == "0":
        log.info("CPU kernels off (BATON_CPU_KERNELS=0): using the torch ops")
        return False
    try:
        from torch.utils.cpp_extension import load

        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        if not (build / "baton_cpu_ops.so").is_file():
            log.info("building Baton's CPU kernels into %s (once per machine)", build)
        # Through torch's loader even when built: it holds a lock in the build directory, so a process
        # never loads a library that another one is still linking.
        load(
            name="baton_cpu_ops",
            sources=[str(src) for src in _SOURCES],
            build_directory=str(build),
            is_python_module=False,
            extra_cflags=_CFLAGS,
            verbose=False,
        )
        return hasattr(torch.ops.baton, "paged_decode_attention")
    except Exception as e:  # no compiler, a failed build: the torch ops still serve, slower
        log.warning("Baton's CPU kernels are unavailable (%s: %s); using the torch ops", type(e).__name__, e)
        return False


# ------------------------------------------------------------------ the ops (kernel, else reference)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, n] → [T, n]
    if use_kernels(x) and x.stride(-1) == 1:
        out = torch.empty(x.shape, dtype=x.dtype)
        torch.ops.baton.rms_norm(out, x, weight, eps)
        return out
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x) in x's dtype, residual + x in fp32); the kernel updates both in place.
    The residual stream stays fp32: it sums every layer's output, where bf16 rounding would add up."""
    if use_kernels(x) and x.is_contiguous() and residual.is_contiguous() and residual.dtype == torch.float32:
        torch.ops.baton.add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = residual + x.float()
    return rms_norm_ref(residual, weight, eps).to(x.dtype), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] → [T, I]
    if use_kernels(gate_up) and gate_up.stride(-1) == 1:
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
        torch.ops.baton.silu_and_mul(out, gate_up)
        return out
    return silu_and_mul_ref(gate_up)


def rope_and_cache(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    cos: torch.Tensor,  # [P, D/2] fp32 table
    sin: torch.Tensor,
    positions: torch.Tensor,  # [T] long
    k_cache: torch.Tensor,  # [NB, BS, KVH, D] strided view
    v_cache: torch.Tensor,
    slot_blocks: torch.Tensor,  # [T] long
    slot_offsets: torch.Tensor,  # [T] long
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k (RoPE at ``positions``) and stores k and v in their slots; returns rotated (q, k)."""
    if use_kernels(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        torch.ops.baton.rope_and_cache(
            q, k, v, cos, sin, positions, k_cache, v_cache, slot_blocks, slot_offsets
        )
        return q, k
    c = cos[positions].unsqueeze(1).to(q.dtype)  # [T, 1, D/2]
    s = sin[positions].unsqueeze(1).to(q.dtype)
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    write_kv(k_cache, v_cache, k, v, slot_blocks, slot_offsets)
    return q, k


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D], one query token per sequence
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, W] long
    ctx_lens: torch.Tensor,  # [B] long
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [B, H, D]
    if use_kernels(q) and q.stride(-1) == 1:
        out = torch.empty(q.shape, dtype=q.dtype)
        torch.ops.baton.paged_decode_attention(
            out, q, k_cache, v_cache, block_tables, ctx_lens, scale, sliding_window or 0
        )
        return out
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, ctx_lens, scale, sliding_window)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:  # [B, V] fp32 → [B] int64
    """Each row's first maximal index (a NaN counts as the maximum), as ``x.max(dim=-1).indices``."""
    if x.dim() == 2 and x.shape[1] > 0 and x.stride(-1) == 1 and x.dtype == torch.float32 and use_kernels(x):
        out: torch.Tensor = torch.ops.baton.argmax_rows(x)
        return out
    return argmax_rows_ref(x)


# ------------------------------------------------------------------ torch references
def argmax_rows_ref(x: torch.Tensor) -> torch.Tensor:
    # max().indices, not argmax(): the same first maximal index, ~3x faster on CPU over 49k columns.
    return x.max(dim=-1).indices


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Sets to -inf, in place, the logits of ``rows`` whose bit is 0 in ``bitmask`` ``[B, ceil(V/32)]``
    int32 (bit i of word w: token 32·w + i)."""
    if use_kernels(logits) and logits.is_contiguous() and bitmask.is_contiguous():
        torch.ops.baton.apply_token_bitmask(logits, bitmask, torch.tensor(rows, dtype=torch.long))
        return
    apply_token_bitmask_ref(logits, bitmask, rows)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[index].unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    allowed = bits.view(len(rows), -1)[:, : logits.shape[1]].bool()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x [T, heads, D]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def write_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (strided view into the block-major cache)
    v_cache: torch.Tensor,
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    slot_blocks: torch.Tensor,  # [T] long: block id of each new token
    slot_offsets: torch.Tensor,  # [T] long: offset inside that block
) -> None:
    """Stores the new tokens' keys and values in their slots (in place through the views)."""
    k_cache[slot_blocks, slot_offsets] = k
    v_cache[slot_blocks, slot_offsets] = v


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, KVH, D] (strided) × [B, n] block ids → [B, n * bs, KVH, D] contiguous.

    ``index_select`` on the flattened table, not advanced indexing: on CPU it is ~7x faster for this
    gather (a straight block copy instead of the generic index kernel).
    """
    b, n = block_tables.shape
    out = cache.index_select(0, block_tables.reshape(-1))  # [B * n, bs, KVH, D]
    return out.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3])


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Every sequence gathered and padded to the longest, masked by its own length: one batched SDPA."""
    k = gather_blocks(k_cache, block_tables).transpose(1, 2)  # [B, KVH, L, D]
    v = gather_blocks(v_cache, block_tables).transpose(1, 2)
    k_pos = torch.arange(k.shape[2], device=q.device).unsqueeze(0)  # [1, L]
    ctx = ctx_lens.unsqueeze(1)  # [B, 1]
    mask = k_pos < ctx
    if sliding_window is not None:
        mask &= k_pos > ctx - 1 - sliding_window
    bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=bias[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out.squeeze(2)
