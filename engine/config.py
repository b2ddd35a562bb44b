"""`EngineConfig`: one frozen dataclass for everything an engine process is started with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from core.units import parse_bytes  # noqa: F401  (engine.config.parse_bytes is public)

if TYPE_CHECKING:
    import torch

# Torch-free at import, so the launcher and the CLI take the choices from here without loading torch.
DTYPES = ("auto", "float32", "bfloat16", "float16")
# On CPU a step's time grows with its rows: 4 decodes of the default model take 17 ms alone, 23 ms with
# 16 prompt tokens, 28 with 32, 36 with 64 (2 threads, docs/ENGINE.md). 32 keeps a decoding stream's
# gaps under the mission's 30 ms ITL while a prompt that arrives beside it is still prefilled in a
# few steps; a step without decodes takes the whole budget.
MIXED_PREFILL_TOKENS_CPU = 32
QUANTIZATIONS = ("none", "int8")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build one engine. Field names are the CLI flags (``--kv-cache-memory``) and Helm values.

    The KV cache is sized from ``kv_cache_memory`` (a byte budget) divided by the measured size of one
    block for the loaded model, dtype and block size — never a guessed block count.
    """

    model: str | None = None  # None = the embedded default model
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # auto = bfloat16 on GPU, and on a CPU where it measures faster (else float32)
    quantization: str = "none"  # none | int8 (weight-only, per output channel): its own model version
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512
    heavy_prefill_chunk: int = (
        0  # a heavy tenant's prompt tokens per step; 0 = none is heavy (core.step_scheduler)
    )
    # Prompt tokens a step may carry besides running decodes (their inter-token latency's guard); None =
    # MIXED_PREFILL_TOKENS_CPU on CPU, no cap on GPU (whose steps barely grow with 512 more rows); 0 = no cap.
    mixed_prefill_tokens: int | None = None
    max_model_len: int | None = None  # None = the model's context, capped by what the KV cache holds
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    seed: int = 0  # seeds the per-request seeds of requests that bring none

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.mixed_prefill_tokens is not None and self.mixed_prefill_tokens < 0:
            raise ValueError("mixed_prefill_tokens must not be negative")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}"
            )

    def resolved_mixed_prefill_tokens(self) -> int:
        if self.mixed_prefill_tokens is not None:
            return self.mixed_prefill_tokens
        return MIXED_PREFILL_TOKENS_CPU if self.torch_device().type == "cpu" else 0

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The weights', activations' and KV cache's dtype. ``auto`` probes the CPU (engine.linear)."""
        import torch

        if self.dtype == "auto":
            if self.torch_device().type == "cuda":
                return torch.bfloat16
            from engine.linear import probe_cpu_bf16

            return torch.bfloat16 if probe_cpu_bf16() else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
