"""Loading weights: a Hugging Face directory of (sharded) safetensors into our fused-projection model.

`resolve_model_dir` turns the user's ``--model`` into a directory: None means the embedded default
model (dequantized once from its GGUF into the cache), a ``.gguf`` file is converted the same way.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from core.errors import ModelLoadError
from engine.linear import prepare_linears
from engine.model import LlamaForCausalLM
from engine.model_config import ModelConfig

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF name suffix inside a layer → (our parameter, which slice of a fused matrix)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def resolve_model_dir(model: str | Path | None) -> Path:
    """The directory to load for ``--model``: None = the default model, a .gguf file, or an HF dir."""
    if model is None:
        from engine import gguf_convert  # the gguf package is needed only to convert a GGUF

        return gguf_convert.prepare_default_model()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        from engine import gguf_convert

        return gguf_convert.prepare_gguf_model(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {str(path)!r} is neither a model directory nor a .gguf file")
    return path


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{index} is malformed: {e}") from e
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{path}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    return files


def load_model(
    path: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str = "none",
    load_format: str = "auto",
) -> LlamaForCausalLM:
    """Builds the model without initialising it, fills every parameter from the checkpoint, then puts
    the projections in their fast form (packed bf16, or int8 with ``quantization="int8"``).
    ``load_format="dummy"`` fills them with seeded random values instead and reads no weight file."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions=max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.init_buffers(device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    params = dict(model.named_parameters())
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    splits = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    if load_format == "dummy":
        _fill_random(params)
        prepare_linears(model, quantization, dtype, device)
        return model.eval()
    loaded: set[str] = set()
    for file in safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    target = _target(name, cfg)
                    if target is None:
                        continue
                    pname, part = target
                    if pname not in params:
                        raise ModelLoadError(
                            f"{file.name}: tensor {name!r} does not fit the {cfg.architecture} layout"
                        )
                    tensor = f.get_tensor(name)
                    dest = params[pname].data
                    if part is not None:
                        sizes = splits[pname.split(".")[-2]]  # ...qkv_proj.weight → qkv_proj
                        start = sum(sizes[:part])
                        dest = dest.narrow(0, start, sizes[part])
                    if tuple(dest.shape) != tuple(tensor.shape):
                        raise ModelLoadError(
                            f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                        )
                    dest.copy_(tensor.to(dtype))
                    loaded.add(f"{pname}#{part}")
        except ModelLoadError:
            raise
        except Exception as e:  # a truncated or foreign file: name it
            raise ModelLoadError(f"cannot read {file}: {e}") from e
    missing = [p for p in _expected(params, cfg) if p not in loaded]
    if missing:
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    prepare_linears(model, quantization, dtype, device)
    return model.eval()


def _fill_random(params: dict[str, torch.nn.Parameter]) -> None:
    """Norm weights 1, everything else N(0, 0.02) from a fixed seed: the shapes and bytes of the real
    checkpoint, activations of a sane size, the same values on every run of one device."""
    gen = torch.Generator(device=next(iter(params.values())).device).manual_seed(0)
    for name, p in params.items():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 0.02, generator=gen)


def _target(name: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    if _IGNORED.search(name):
        return None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # tied: the embedding is the head
    m = _LAYER.match(name)
    if m is None:
        return name.removeprefix("model."), None
    layer, rest = m.groups()
    module, _, leaf = rest.rpartition(".")
    if module in _FUSED:
        fused, part = _FUSED[module]
        return f"layers.{layer}.{fused}.{leaf}", part
    return f"layers.{layer}.{rest}", None


def _expected(params: dict[str, torch.nn.Parameter], cfg: ModelConfig) -> list[str]:
    out = []
    for pname in params:
        if pname == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".qkv_proj." in pname:
            out += [f"{pname}#{i}" for i in range(3)]
        elif ".gate_up_proj." in pname:
            out += [f"{pname}#{i}" for i in range(2)]
        else:
            out.append(f"{pname}#None")
    return out
