"""`EngineConfig`: one frozen dataclass for everything an engine process is started with."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.units import parse_bytes  # noqa: F401  (engine.config.parse_bytes is public)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build one engine. Field names are the CLI flags (``--kv-cache-memory``) and Helm values.

    The KV cache is sized from ``kv_cache_memory`` (a byte budget) divided by the measured size of one
    block for the loaded model, dtype and block size — never a guessed block count.
    """

    model: str | None = None  # None = the embedded default model
    device: str = "auto"  # auto = cuda if available, else cpu
    dtype: str = "auto"  # auto = float32 on CPU (no fast bf16 there), bfloat16 on GPU
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512
    heavy_prefill_chunk: int = 0  # a heavy tenant's prompt tokens per step; 0 = none is heavy (core.step_scheduler)
    max_model_len: int | None = None  # None = the model's context, capped by what the KV cache holds
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    seed: int = 0  # seeds the per-request seeds of requests that bring none

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {self.dtype!r}")
        return dtypes[self.dtype]
