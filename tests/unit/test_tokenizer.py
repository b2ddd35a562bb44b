"""engine.tokenizer: the SmolLM2 tokenizer rebuilt from the GGUF, HF directories and chat templates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from core.errors import InvalidRequest, ModelLoadError
from engine.gguf_convert import default_gguf_path
from engine.gguf_reader import read_gguf_metadata
from engine.tokenizer import Tokenizer, TokenizerConfig, build_gguf_tokenizer, gguf_tokenizer_config

pytestmark = pytest.mark.unit

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Ids verified by decoding them back and against transformers' own GGUF tokenizer (which imports
# torch, so that cross-check lives in tests/model/test_gguf_convert.py).
KNOWN_IDS = {
    "Hello world, how are you?": [19556, 905, 28, 638, 359, 346, 47],
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "<|im_start|>user\nHi<|im_end|>\n": [1, 4093, 198, 26843, 2, 198],
}


@pytest.fixture(scope="module")
def gguf_metadata() -> dict:
    try:
        return read_gguf_metadata(default_gguf_path())
    except ModelLoadError as e:
        pytest.fail(f"default model not installed (run make setup): {e}")


@pytest.fixture(scope="module")
def smollm(gguf_metadata: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_metadata)


def test_special_tokens_are_single_ids(smollm: Tokenizer) -> None:
    assert smollm.encode("<|im_start|>") == [1]
    assert smollm.encode("<|im_end|>") == [2]
    assert smollm.encode("a<|im_end|>b", add_special_tokens=False)[1:2] == [2]
    assert smollm.eos_token_id == 2 and smollm.bos_token_id == 1
    assert smollm.stop_token_ids == frozenset({2})
    assert smollm.all_special_ids == frozenset(range(17))
    assert smollm.vocab_size == 49152
    assert smollm.id_to_token(2) == "<|im_end|>" and smollm.token_to_id("<|im_start|>") == 1


def test_digits_split_individually(smollm: Tokenizer) -> None:
    ids = smollm.encode("12345")
    assert len(ids) == 5
    assert [smollm.decode([i]) for i in ids] == list("12345")


@pytest.mark.parametrize("text", list(KNOWN_IDS))
def test_known_ids_round_trip(smollm: Tokenizer, text: str) -> None:
    ids = smollm.encode(text)
    assert ids == KNOWN_IDS[text]  # no BOS: the original SmolLM2 tokenizer adds none
    assert smollm.decode(ids, skip_special_tokens=False) == text


def test_round_trip_unicode_and_whitespace(smollm: Tokenizer) -> None:
    text = "Hello world\n\n  tabs\tand émojis 😀 世界 e\u0301 ½"
    assert smollm.decode(smollm.encode(text)) == text


def test_decode_skips_special_tokens(smollm: Tokenizer) -> None:
    ids = smollm.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert smollm.decode(ids) == "assistant\nHi"
    assert smollm.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nHi<|im_end|>"


def test_chat_template_adds_default_system_prompt(smollm: Tokenizer) -> None:
    prompt = smollm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_keeps_given_system_prompt(smollm: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = smollm.apply_chat_template(messages, add_generation_prompt=False)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_encode_chat_uses_special_ids_without_bos(smollm: Tokenizer) -> None:
    ids = smollm.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert ids[-4:] == [1, 520, 9531, 198]  # "<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "messages",
    [
        "hello",
        [],
        None,
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "user", "content": 3}],
        [{"role": "", "content": "hi"}],
        ["hi"],
    ],
)
def test_invalid_messages_raise_invalid_request(smollm: Tokenizer, messages: object) -> None:
    with pytest.raises(InvalidRequest):
        smollm.apply_chat_template(messages)  # type: ignore[arg-type]


def test_gguf_tokenizer_config(gguf_metadata: dict) -> None:
    config = gguf_tokenizer_config(gguf_metadata)
    assert config["bos_token"] == "<|im_start|>" and config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False
    assert config["chat_template"].startswith("{% for message in messages %}")


def test_unsupported_gguf_tokenizer_model(gguf_metadata: dict) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer model"):
        build_gguf_tokenizer({**gguf_metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(ModelLoadError, match="pre-tokenizer"):
        build_gguf_tokenizer({**gguf_metadata, "tokenizer.ggml.pre": "nonesuch"})


def test_module_does_not_import_torch() -> None:
    code = "import sys, engine.tokenizer, engine.detokenizer; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


# --- Hugging Face directories -------------------------------------------------------------------

TINY_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _tiny_backend(post_processor_adds_bos: bool) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<eot>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    if post_processor_adds_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def _write_hf_dir(
    path: Path,
    *,
    post_processor_adds_bos: bool = False,
    config: dict | None = None,
    generation: dict | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _tiny_backend(post_processor_adds_bos).save(str(path / "tokenizer.json"))
    # transformers writes special tokens as AddedToken dicts or plain strings; use both.
    base = {
        "bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "special": True},
        "eos_token": "</s>",
        "chat_template": TINY_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def test_from_dir_tiny_hf_tokenizer(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write_hf_dir(tmp_path, generation={"eos_token_id": [1, 2]}))
    assert tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.stop_token_ids == frozenset({1, 2})
    assert tok.decode(tok.encode("hello world")) == "hello world"
    assert tok.encode("hello")[0] != 0  # no add_bos_token and no post-processor: no BOS
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<s>[user]hi</s>\n[assistant]"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == 0


def test_template_raise_exception_is_invalid_request(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write_hf_dir(tmp_path))
    with pytest.raises(InvalidRequest, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("post_processor_adds_bos", "add_bos_token", "expect_bos"),
    [(False, True, True), (True, False, False), (True, None, True), (False, None, False), (True, True, True)],
)
def test_add_bos_token_honoured(
    tmp_path: Path, post_processor_adds_bos: bool, add_bos_token: bool | None, expect_bos: bool
) -> None:
    config = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
    tok = Tokenizer.from_dir(
        _write_hf_dir(tmp_path, post_processor_adds_bos=post_processor_adds_bos, config=config)
    )
    ids = tok.encode("hello world")
    assert (ids[0] == 0) == expect_bos and ids.count(0) == int(expect_bos)
    assert 0 not in tok.encode("hello world", add_special_tokens=False)


def test_chat_template_jinja_file_and_named_templates(tmp_path: Path) -> None:
    path = _write_hf_dir(tmp_path, config={"chat_template": [{"name": "default", "template": "named"}]})
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}]) == "named"
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] | tojson }}")
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'


def test_no_chat_template_is_model_load_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write_hf_dir(tmp_path, config={"chat_template": None}))
    assert tok.chat_template is None
    with pytest.raises(ModelLoadError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    path = _write_hf_dir(tmp_path / "m")
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_dir(path)
    (path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(path)


def test_unknown_special_token_and_bad_template(tmp_path: Path) -> None:
    backend = _tiny_backend(False)
    with pytest.raises(ModelLoadError, match="eos_token"):
        Tokenizer(backend, TokenizerConfig(eos_token="<missing>"))
    with pytest.raises(ModelLoadError, match="does not parse"):
        Tokenizer(backend, TokenizerConfig(chat_template="{% for %}"))


def test_sandbox_blocks_attribute_access(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer(_tiny_backend(False), TokenizerConfig(chat_template=template))
    with pytest.raises(InvalidRequest):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
