"""The Baton engine: a paged-KV Llama-family model runner with continuous batching (torch).

`from engine import LLM, SamplingParams`. Heavy modules load lazily so that the torch-free parts
(`engine.tokenizer`, `engine.detokenizer`) stay importable by processes without torch.
"""

from __future__ import annotations

from typing import Any

from core.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
