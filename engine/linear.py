"""The projections of a loaded model in the form this machine multiplies fastest, and int8 weights.

After loading, `prepare_linears` replaces each `nn.Linear` of the decoder layers (and the logits head):

- **bf16 on CPU** → `PackedLinear`: the weight reordered once into oneDNN's blocked layout
  (``mkldnn._reorder_linear_weight``), so each call skips the per-call reorder that ``F.linear`` pays
  (measured here: 1.4-2x faster at 1-32 rows; AMX or AVX512-BF16 do the products).
- **int8** (``quantization="int8"``) → `Int8Linear` for the decoder layers: symmetric per-output-channel
  int8 weights with one scale per row (a quarter of fp32's bytes). A decode step's few rows (up to 16)
  go through Baton's own kernel (``baton::int8_linear``, engine/csrc/cpu_ops.cpp: each weight read once
  and widened in registers; with bf16 rows on AVX512-VNNI the weights are packed at load and the rows
  quantized per row to int16 for ``vpdpwssd`` products, 2.6-3.4x faster); without the C++ kernels, up to 8 rows take ``aten._weight_int8pack_mm``
  (with bf16 activations: fp32 ones run it 20-40x slower). More rows (a prefill) are dequantized and
  multiplied as bf16 where the CPU has AMX; without AMX the packed kernel takes them all
  (`int8_kernel_max_rows`: 1.3-4.6x faster at 16-512 rows on a Xeon without AMX). The logits head stays bf16.
- **bf16 on a CPU with AVX512-BF16** → `Bf16DotLinear` instead: the weight packed for ``vdpbf16ps``
  (``baton::bf16_linear``, engine/csrc/bf16_dot.cpp), 1.4-2x faster than oneDNN at a decode step's
  1-8 rows and as fast from 16 up (Zen 4). On a CPU with AMX the same packed weights go through AMX
  tiles (the layout is already AMX's B tile): measured on a Xeon with AMX, 2 threads, 16 rows x
  1536x576 14 us vs 126 us on dot products and 73 us in oneDNN; a batch-16 decode step 79 → 18 ms. The logits head takes it too (int8 included), with fp32 logits:
  oneDNN's bf16 linear returns bf16 logits, whose rounding swapped near-tied tokens — teacher-forced
  against fp32 on the default model, argmax agreement 97.1% → 98.7% (bf16) and 94.9% → 95.7% (int8)
  with fp32 logits from the same weights. Elsewhere the head is a `PackedLinear`.
- fp32, GPU, or a CPU without oneDNN bf16 → unchanged ``nn.Linear`` (the reference).

`probe_cpu_bf16` decides whether bf16 is fast on this CPU (``dtype="auto"``): oneDNN must support it
and a packed bf16 product must beat the fp32 one. On an AVX2-only machine bf16 ran ~50x slower.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_ops

log = logging.getLogger(__name__)

# int8 rows per call above which _weight_int8pack_mm loses to dequantize-then-multiply (it redoes the
# dequantization for every 4 rows; measured here at 3072x576: 4 rows 84 us, 16 rows 401 us vs 298 us).
_INT8PACK_MAX_ROWS = 8
# Rows Baton's int8 kernel takes. One decode step's layer weights streamed from memory (the default
# model, 2 threads): 1 row 9.9 ms vs 10.5 (int8pack), 8 rows 17.3 vs 24.6, 12 rows 24.3 vs 31.8
# (dequantize + multiply), 16 rows 30.3 vs 33.0; above 16 a prefill's rows are compute-bound and the
# bf16 GEMM wins.
_KERNEL_MAX_ROWS = 16


def _packing_available() -> bool:
    return (
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@functools.cache
def probe_cpu_bf16() -> bool:
    """True when bf16 weights and activations are the faster choice on this CPU (checked once: ~50 ms)."""
    if not _packing_available():
        return False
    if cpu_ops.kernels_enabled() and torch.ops.baton.bf16_dot_available():
        # Baton's own bf16 kernels run here (AVX512-BF16): bf16 is the faster choice at every batch
        # measured (a decode step at batch 1 14 vs 27 ms fp32 on a Xeon without AMX, 2026-12-07). No timing
        # then: on a busy machine a timed probe flipped, and a prefill and a decode worker started side by
        # side chose different dtypes, whose KV caches cannot be exchanged (a fresh-clone CI run, 2026-12-07).
        return True
    try:
        w = torch.randn(1536, 576) * 0.02
        x = torch.randn(16, 576)
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16)
        xb = x.bfloat16()

        def best(fn: object) -> float:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(4):
                    fn()  # type: ignore[operator]
                times.append(time.perf_counter() - t0)
            return min(times)

        fp32 = best(lambda: F.linear(x, w))
        bf16 = best(lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none", [], ""))
    except Exception as e:  # an op missing in this build: fp32 it is
        log.info("bf16 probe failed (%s): float32", e)
        return False
    log.info(
        "bf16 probe: packed bf16 %.0f us vs fp32 %.0f us per 16x576x1536 product", bf16 * 250e3, fp32 * 250e3
    )
    return bf16 < fp32


class PackedLinear(nn.Module):
    """A bf16 linear layer whose weight is stored in oneDNN's blocked layout (CPU only)."""

    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().bfloat16(), 16)
        )
        self.register_buffer("bias", None if bias is None else bias.detach().bfloat16())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return out


class Bf16DotLinear(nn.Module):
    """A bf16 linear layer whose weight is packed for AVX512-BF16 dot products (baton::bf16_linear,
    engine/csrc/bf16_dot.cpp): bf16 rows in, fp32 accumulation, bf16 out — or fp32 out (the logits head).
    Measured on the default model's shapes (Zen 4, 2 threads): as fast as oneDNN's packed linear from 16
    to 256 rows and 1.4-2x faster at 1-8 rows, a decode step's."""

    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.fp32_out = fp32_out
        self.register_buffer("packed", torch.ops.baton.bf16_pack(weight.detach().bfloat16()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @staticmethod
    def available(weight: torch.Tensor) -> bool:
        """This CPU and build multiply bf16 pairs, and the weight fits whole blocks (N % 16, K % 2)."""
        return (
            weight.device.type == "cpu"
            and weight.shape[0] % 16 == 0
            and weight.shape[1] % 2 == 0
            and cpu_ops.kernels_enabled()
            and bool(torch.ops.baton.bf16_dot_available())
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.baton.bf16_linear(
            x.to(torch.bfloat16), self.packed, self.out_features, self.bias, self.fp32_out
        )
        return out


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight ≈ q * scale[:, None]``, ``|q| <= 127``; fp32 scales."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
    q = torch.round(w / scale.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


@functools.cache
def int8_kernel_max_rows() -> int:
    """Rows up to which packed int8 weights go through Baton's kernel, on this machine: every row count
    where the CPU has no AMX (the kernel beat dequantize + bf16 GEMM at 16-512 rows there), a decode
    step's 16 where it has (its bf16 tiles keep a prefill). Decided by the CPU's features, not timed: every
    process on a machine must choose alike (a timed choice flipped on a busy machine). Also set for the
    one-call decode stack (``baton::int8_set_kernel_max_rows``)."""
    if not (cpu_ops.kernels_enabled() and torch.ops.baton.int8_packed_available()):
        return _KERNEL_MAX_ROWS
    rows = _KERNEL_MAX_ROWS if torch.ops.baton.bf16_amx_available() else 1 << 30
    torch.ops.baton.int8_set_kernel_max_rows(rows)
    return rows


class Int8Linear(nn.Module):
    """Weight-only int8 linear: int8 weights [N, K] and per-row scales, activations in their own dtype.

    With bf16 activations on a CPU whose kernels have the packed int8 form (AVX512-VNNI), ``qweight``
    holds the weights packed for it (``baton::int8_pack``: [N/16, K/2, 16, 2], the same bytes);
    `weight_nk` gives them back as [N, K]."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        q, scale = quantize_int8(weight)
        self.packed = act_dtype == torch.bfloat16 and self.packing_available(weight)
        self.register_buffer("qweight", torch.ops.baton.int8_pack(q) if self.packed else q)
        self.register_buffer("scales", scale.to(act_dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype))

    @staticmethod
    def packing_available(weight: torch.Tensor) -> bool:
        return (
            weight.device.type == "cpu"
            and cpu_ops.kernels_enabled()
            and bool(torch.ops.baton.int8_packed_available())
        )

    def weight_nk(self) -> torch.Tensor:  # [N, K] int8
        if not self.packed:
            return self.qweight
        out: torch.Tensor = torch.ops.baton.int8_unpack(self.qweight, self.out_features, self.in_features)
        return out

    def dequantized(self) -> torch.Tensor:  # [N, K] fp32: what the kernels multiply by (tests, the reference)
        return self.weight_nk().float() * self.scales.float().unsqueeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty(0, self.out_features)
        out: torch.Tensor
        if (
            x.shape[0] <= (int8_kernel_max_rows() if self.packed else _KERNEL_MAX_ROWS)
            and cpu_ops.use_kernels(x)
            and (not self.packed or x.dtype == torch.bfloat16)
        ):
            out = torch.ops.baton.int8_linear(x, self.qweight, self.scales)
        elif x.device.type == "cpu" and x.shape[0] <= _INT8PACK_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(x, self.weight_nk(), self.scales)
        else:
            out = F.linear(x, self.weight_nk().to(x.dtype)) * self.scales
        return out if self.bias is None else out + self.bias


def prepare_linears(model: nn.Module, quantization: str, dtype: torch.dtype, device: torch.device) -> None:
    """Swaps the model's `nn.Linear` modules (decoder layers and ``lm_head``) for their fast form, in
    place. The input embedding keeps its own (plain) weight when the head is tied to it."""
    pack = device.type == "cpu" and dtype == torch.bfloat16 and _packing_available()
    if quantization == "none" and not pack:
        return
    linears = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, nn.Linear)
    ]
    # Every projection takes the dot-product kernel or none does (the one-call decode stack takes one kind).
    dot = pack and all(
        Bf16DotLinear.available(child.weight) for _, name, child in linears if name != "lm_head"
    )
    for parent, name, child in linears:
        # The logits head stays in the activation dtype, as llama.cpp keeps its output tensor at higher
        # precision: its rounding lands on the logits directly (measured on the default model: the
        # int8 head alone cost more argmax agreement with fp32 than all 30 layers' int8 weights). Where
        # the CPU has AVX512-BF16 its logits come out in fp32 (see the module docstring).
        if quantization == "int8" and name != "lm_head":
            new: nn.Module = Int8Linear(child.weight, child.bias, dtype)
            if new.packed:
                int8_kernel_max_rows()  # set once, before the first step (the decode stack reads it too)
        elif not pack:
            continue
        elif name == "lm_head" and child.bias is None and Bf16DotLinear.available(child.weight[:16]):
            new = Bf16DotLinear(child.weight, None, fp32_out=True)
        elif dot and name != "lm_head":
            new = Bf16DotLinear(child.weight, child.bias)
        else:
            new = PackedLinear(child.weight, child.bias)
        setattr(parent, name, new.to(device))
