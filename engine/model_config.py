"""`ModelConfig`: the architecture of a Llama-family checkpoint, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import ModelLoadError

# Architectures whose forward is the Llama block (RMSNorm, RoPE, GQA attention, SwiGLU MLP).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling; ``rope_type`` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the model code needs to know about a checkpoint."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        file = path / "config.json"
        if not file.is_file():
            raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
        try:
            raw = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{file} is not valid JSON: {e}") from e
        return cls.from_dict(raw, source=str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelLoadError(f"{source}: missing required field {key!r}")
            return raw[key]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {heads} is not a multiple of KV heads {kv_heads}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: unsupported hidden_act {raw.get('hidden_act')!r} (only silu)")
        theta, scaling = _rope(raw, source)
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", family == "mistral") else None
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        if sliding is not None and int(sliding) >= max_pos:
            sliding = None  # a window as long as the context is no window
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Mistral only when attention_bias is set.
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding is not None else None,
            eos_token_ids=eos_ids,
        )


def _rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    # transformers 5 writes `rope_parameters` (theta included); checkpoints from 4.x use
    # `rope_theta` + `rope_scaling`. Accept both.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported RoPE scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )
    return theta, scaling
