"""The offline API: ``LLM(model=None).generate(prompts, params)`` and ``.chat(messages, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, cast

from core.errors import InvalidRequest
from core.outputs import RequestOutput
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

__all__ = ["LLM", "RequestOutput"]

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """Runs many prompts through one continuously-batched engine and returns them in input order.

    ``model`` is None (the embedded default model), a Hugging Face model directory or a .gguf file;
    other keyword arguments are `EngineConfig` fields (e.g. ``kv_cache_memory``, ``max_num_seqs``).
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        batch = _as_prompt_list(prompts)
        param_list = _broadcast(params, len(batch))
        ids = [self._add(p, sp) for p, sp in zip(batch, param_list, strict=True)]
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them, then generates."""
        if messages and isinstance(messages[0], dict):
            conversations = [cast(Sequence[Message], messages)]
        else:
            conversations = list(cast(Sequence[Sequence[Message]], messages))
        prompts: list[Prompt] = [self.tokenizer.encode_chat(list(c)) for c in conversations]
        return self.generate(prompts, params)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yields the deltas of one request as the engine produces them."""
        rid = self._add(prompt, params or SamplingParams())
        while self.engine.has_unfinished:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        rid = f"offline-{next(self._ids)}"
        self.engine.add_request(rid, prompt, params)
        return rid


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if not items:
        raise InvalidRequest("no prompts given")
    if all(isinstance(t, int) for t in items):
        return [cast(list[int], items)]  # one prompt given as token ids
    return cast(list[Prompt], items)


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
