"""`EngineConfig`: one frozen dataclass for everything an engine process is started with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.units import parse_bytes

if TYPE_CHECKING:
    import torch

# Torch-free at import, so the launcher and the CLI take the choices from here without loading torch.
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8")
LOAD_FORMATS = ("auto", "dummy")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# On CPU a step's time grows with its rows: 4 decodes of the default model take 17 ms alone, 23 ms with
# 16 prompt tokens, 28 with 32, 36 with 64 (2 threads, docs/ENGINE.md). 32 keeps a decoding stream's
# gaps under the mission's 30 ms ITL while a prompt that arrives beside it is still prefilled in a
# few steps; a step without decodes takes the whole budget.
MIXED_PREFILL_TOKENS_CPU = 32


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How to build one engine. Field names are the keywords of `LLM`, the Helm values and, kebab-cased,
    the `baton worker` flags (``--kv-cache-memory``), which `rpc.flags` generates from these fields: each
    field's ``metadata`` holds its flag's help, choices and parser (plain keys; engine imports no rpc).

    The KV cache is sized from ``kv_cache_memory`` (a byte budget) divided by the measured size of one
    block for the loaded model, dtype and block size — never a guessed block count.
    """

    model: str | None = field(
        default=None, metadata={"help": "HF model directory or .gguf (default: embedded SmolLM2-135M)"}
    )
    device: str = field(default="auto", metadata={"help": "auto = cuda if available, else cpu"})
    dtype: str = field(
        default="auto",
        metadata={
            "choices": DTYPES,
            "help": "weights, activations and KV cache (default auto: bfloat16 on GPU and where this CPU "
            "runs it faster, else float32)",
        },
    )
    quantization: str = field(
        default="none",
        metadata={
            "choices": QUANTIZATIONS,
            "help": "int8: weight-only int8 (per output channel) quantized at load; a model version of its own",
        },
    )
    load_format: str = field(
        default="auto",
        metadata={
            "choices": LOAD_FORMATS,
            "help": "dummy: random weights of the checkpoint's shapes, no weight file read (benchmarks on a "
            "config.json alone, as vLLM's --load-format dummy); a model version of its own",
        },
    )
    block_size: int = field(default=16, metadata={"choices": BLOCK_SIZES, "help": "tokens per KV block"})
    kv_cache_memory: int = field(
        default=1 << 30,
        metadata={"parse": parse_bytes, "help": "KV cache budget in bytes, e.g. 512MiB or 2GiB"},
    )
    max_num_seqs: int = field(default=64, metadata={"help": "requests running at once"})
    max_num_batched_tokens: int = field(
        default=2048, metadata={"help": "tokens per engine step (prefill chunks + decodes)"}
    )
    long_prefill_chunk: int = field(
        default=512,
        metadata={
            "help": "most prompt tokens one request prefills per step (chunked prefill); set it to the "
            "context length to turn chunking off"
        },
    )
    # A heavy tenant's prompt tokens per step (core.step_scheduler). A worker sets it by role: its own
    # heavy_prefill_chunk (services.worker.config) is the flag.
    heavy_prefill_chunk: int = field(
        default=0,
        metadata={
            "help": "prompt tokens per step of a heavy tenant's prompt, so a light tenant's prompt starts "
            "soon (0 = no tenant is heavy)"
        },
    )
    # Prompt tokens a step may carry besides running decodes (their inter-token latency's guard): None =
    # MIXED_PREFILL_TOKENS_CPU on CPU, no cap on GPU (whose steps barely grow with 512 more rows).
    mixed_prefill_tokens: int | None = field(
        default=None,
        metadata={
            "help": "most prompt tokens a step adds to running decodes, guarding their inter-token "
            f"latency (default: {MIXED_PREFILL_TOKENS_CPU} on CPU, no cap on GPU; 0 = no cap)"
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={"help": "longest prompt + output (default: the model's context, capped by the KV cache)"},
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse the KV blocks of a prompt's prefix computed before"}
    )
    num_threads: int | None = field(
        default=None, metadata={"flag": "threads", "help": "torch intra-op threads (default: torch's)"}
    )
    seed: int = field(default=0, metadata={"help": "seeds the per-request seeds of requests that bring none"})

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {self.block_size}"
            )
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

        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}"
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
