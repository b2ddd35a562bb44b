"""Text <-> token ids and chat-template rendering for the engine and the gateway (no torch here).

`Tokenizer.from_dir` reads any Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json,
generation_config.json); `build_gguf_tokenizer` rebuilds a `tokenizers.Tokenizer` from the vocabulary a
GGUF file carries, because transformers' own GGUF tokenizer mis-handles SmolLM2 (see ENVIRONMENT.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.errors import InvalidRequest, ModelLoadError

# llama.cpp's token types (gguf.TokenType); only CONTROL and USER_DEFINED become added tokens.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_BYTE_LEVEL_NO_REGEX = {**_BYTE_LEVEL, "use_regex": False}
# The split regexes of the original Hugging Face tokenizer.json files, keyed by llama.cpp's
# `tokenizer.ggml.pre` name, so that a rebuilt tokenizer splits text exactly like the original.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")


def _regex_then_bytes(regex: str) -> dict[str, Any]:
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, _BYTE_LEVEL_NO_REGEX]}


_PRE_TOKENIZERS: dict[str, dict[str, Any]] = {
    "smollm": {
        "type": "Sequence",
        "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL],
    },
    "gpt2": _BYTE_LEVEL,
    "default": _BYTE_LEVEL,
    "llama-bpe": _regex_then_bytes(_LLAMA3_REGEX),
    "qwen2": _regex_then_bytes(_QWEN2_REGEX),
}


def build_gguf_tokenizer(metadata: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """Build a byte-level BPE `tokenizers.Tokenizer` from a GGUF file's `tokenizer.ggml.*` metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelLoadError(f"unsupported GGUF tokenizer model {model!r} (only byte-level BPE 'gpt2')")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r}; known: {sorted(_PRE_TOKENIZERS)}")
    tokens = _metadata_list(metadata, "tokenizer.ggml.tokens")
    merges = _metadata_list(metadata, "tokenizer.ggml.merges")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError("GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length")
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added_tokens(tokens, token_types),
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        # Same post-processor and decoder as the original SmolLM2 tokenizer.json.
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            # Byte-level pieces never hold a literal space, so one split gives the pair.
            "merges": [merge.split(" ", 1) for merge in merges],
        },
    }
    try:
        return tokenizers.Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # tokenizers raises a bare Exception on a bad spec
        raise ModelLoadError(f"cannot build a tokenizer from the GGUF vocabulary: {e}") from e


def gguf_tokenizer_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenizer_config.json of a GGUF file's tokenizer, in Hugging Face words."""
    tokens = _metadata_list(metadata, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    arch = metadata.get("general.architecture", "")
    return {
        # PreTrainedTokenizerFast loads tokenizer.json as-is; a GPT2Tokenizer class would rebuild it
        # from vocab and merges and lose the digit splitting.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        # llama.cpp's flag says whether it prepends BOS. SmolLM2's GGUF says false, which matches the
        # original HF tokenizer (its chat template opens with <|im_start|> itself); Llama-3 GGUFs say
        # true, as their HF tokenizer prepends <|begin_of_text|>. So the flag is the right source.
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(f"{arch}.context_length", 0)) or None,
        "chat_template": metadata.get("tokenizer.chat_template"),
    }


def _metadata_list(metadata: Mapping[str, Any], key: str) -> list[Any]:
    value = metadata.get(key)
    if not isinstance(value, list) or not value:
        raise ModelLoadError(f"GGUF metadata {key} is missing or empty")
    return value


def _added_tokens(tokens: Sequence[str], token_types: Sequence[int]) -> list[dict[str, Any]]:
    return [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": token_type == _TOKEN_TYPE_CONTROL,
        }
        for i, token_type in enumerate(token_types)
        if token_type in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]


@dataclass(frozen=True, slots=True)
class TokenizerConfig:
    """What a model directory says beyond tokenizer.json: special tokens, BOS policy, chat template."""

    bos_token: str | None = None
    eos_token: str | None = None
    add_bos_token: bool | None = None  # None: trust tokenizer.json's post-processor
    chat_template: str | None = None
    extra_eos_token_ids: tuple[int, ...] = ()  # generation_config.json's eos_token_id(s)

    @classmethod
    def from_hf(
        cls,
        tokenizer_config: Mapping[str, Any],
        generation_config: Mapping[str, Any] | None = None,
        chat_template_file: str | None = None,
    ) -> TokenizerConfig:
        """Parse tokenizer_config.json (+ generation_config.json, chat_template.jinja) contents."""
        eos_ids = (generation_config or {}).get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        add_bos = tokenizer_config.get("add_bos_token")
        return cls(
            bos_token=_token_content(tokenizer_config.get("bos_token")),
            eos_token=_token_content(tokenizer_config.get("eos_token")),
            add_bos_token=add_bos if isinstance(add_bos, bool) else None,
            chat_template=chat_template_file or _pick_chat_template(tokenizer_config.get("chat_template")),
            extra_eos_token_ids=tuple(i for i in eos_ids or () if isinstance(i, int)),
        )


def _token_content(token: Any) -> str | None:
    # transformers writes special tokens either as plain strings or as AddedToken dicts.
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _pick_chat_template(template: Any) -> str | None:
    # Some models ship several named templates; "default" is the one for plain chat.
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping and non-ASCII kept, unlike jinja2's built-in filter.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the chat template does not parse: {e}") from e


def _validate_messages(messages: Any) -> list[Mapping[str, Any]]:
    if not isinstance(messages, list | tuple):
        raise InvalidRequest("messages must be a list of {role, content} objects")
    if not messages:
        raise InvalidRequest("messages must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object with role and content")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise InvalidRequest(f"messages[{i}].content must be a string")
    return list(messages)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


class Tokenizer:
    """The engine's and gateway's tokenizer: encode, decode and chat templates over `tokenizers`."""

    def __init__(self, backend: tokenizers.Tokenizer, config: TokenizerConfig) -> None:
        self._backend = backend
        self._config = config
        self._bos_token_id = self._resolve(config.bos_token, "bos_token")
        self._eos_token_id = self._resolve(config.eos_token, "eos_token")
        if self._eos_token_id is None and config.extra_eos_token_ids:
            self._eos_token_id = config.extra_eos_token_ids[0]
        self._template = _compile_chat_template(config.chat_template) if config.chat_template else None
        self._bos_fix = self._bos_fix_needed()

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (its vocabulary, for a grammar engine)."""
        return str(self._backend.to_str())

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face model dir's tokenizer.json, tokenizer_config.json, generation_config.json."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{tokenizer_file} not found: the model directory needs a tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"malformed {tokenizer_file}: {e}") from e
        config_file, generation_file = path / "tokenizer_config.json", path / "generation_config.json"
        template_file = path / "chat_template.jinja"  # where transformers >= 4.50 saves the template
        config = TokenizerConfig.from_hf(
            _read_json(config_file) if config_file.is_file() else {},
            _read_json(generation_file) if generation_file.is_file() else None,
            template_file.read_text(encoding="utf-8") if template_file.is_file() else None,
        )
        return cls(backend, config)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file carries (see `engine.gguf_reader.read_gguf_metadata`)."""
        return cls(build_gguf_tokenizer(metadata), TokenizerConfig.from_hf(gguf_tokenizer_config(metadata)))

    def _resolve(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{what} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def _bos_fix_needed(self) -> bool:
        # Sentencepiece-style Llama/Mistral dirs state add_bos_token in the config, while the
        # tokenizer.json post-processor may or may not already prepend it; fix up only a mismatch.
        if self._bos_token_id is None or self._config.add_bos_token is None:
            return False
        probe = self._backend.encode("a", add_special_tokens=True).ids
        post_processor_adds = bool(probe) and probe[0] == self._bos_token_id
        return post_processor_adds != self._config.add_bos_token

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_start|>" always becomes its one id."""
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._bos_fix and self._bos_token_id is not None:
            ids = [self._bos_token_id, *ids] if self._config.add_bos_token else ids[1:]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence at either end decodes to U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template renders tools itself (it reads a ``tools`` variable)."""
        return bool(self._config.chat_template) and "tools" in (self._config.chat_template or "")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render `messages` (and ``tools``, for a template that knows them) with the model's chat
        template; InvalidRequest for malformed messages."""
        checked = _validate_messages(messages)
        if self._template is None:
            raise ModelLoadError("the model has no chat template; use a completion request instead")
        extra = {"tools": list(tools)} if tools else {}
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=self._config.bos_token or "",
                eos_token=self._config.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as e:  # raise_exception() in the template or a sandbox violation
            raise InvalidRequest(f"the chat template rejected the messages: {e}") from e

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """Prompt ids of a chat; the template already spells out BOS and role markers."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False
        )

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: eos plus generation_config.json's eos_token_id list."""
        eos = () if self._eos_token_id is None else (self._eos_token_id,)
        return frozenset((*eos, *self._config.extra_eos_token_ids))

    @property
    def all_special_ids(self) -> frozenset[int]:
        added = self._backend.get_added_tokens_decoder()
        special = {token_id for token_id, token in added.items() if token.special}
        return frozenset(special | {i for i in (self._bos_token_id, self._eos_token_id) if i is not None})

    @property
    def chat_template(self) -> str | None:
        return self._config.chat_template
