"""Prompt logprobs (vLLM's ``prompt_logprobs``; OpenAI's ``echo`` with ``logprobs``): every prompt token's
log-probability given the tokens before it, against Hugging Face transformers on the tiny model (fp32),
the same whether the prompt is computed in one step or in chunks, computed whole even where the prefix
cache holds the prompt, and sent once, with the first sampled token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.model

ATOL = 1e-4
PROMPT = [int(t) for t in torch.randint(3, 380, (75,), generator=torch.Generator().manual_seed(5))]


def run(path: Path, prompt: list[int], **config: int) -> tuple[list[int], list]:  # type: ignore[type-arg]
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=4 << 20, dtype="float32", **config))
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3))
    outs = [o for _ in range(50) for o in engine.step()]
    with_prompt = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0].new_token_ids  # once, with the first token
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return outs[-1].token_ids, with_prompt[0].prompt_logprobs  # type: ignore[return-value]


def test_prompt_logprobs_match_transformers(tiny_llama: Path) -> None:
    _, got = run(tiny_llama, PROMPT)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_llama, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT])).logits[0].log_softmax(-1)  # [L, V]
    assert got[0] is None and len(got) == len(PROMPT)
    for p, lp in enumerate(got[1:]):
        assert lp.token_id == PROMPT[p + 1]
        assert abs(lp.logprob - ref[p, PROMPT[p + 1]].item()) < ATOL, p
        assert lp.rank == int((ref[p] > ref[p, PROMPT[p + 1]]).sum()) + 1
        best = ref[p].topk(3)
        assert [t for t, _ in lp.top] == best.indices.tolist()


def test_chunked_and_cached_prompts_give_the_same_logprobs(tiny_llama: Path) -> None:
    tokens, whole = run(tiny_llama, PROMPT)
    chunked_tokens, chunked = run(
        tiny_llama, PROMPT, long_prefill_chunk=16, max_num_batched_tokens=16, max_num_seqs=4
    )
    assert chunked_tokens == tokens
    assert [lp.token_id for lp in chunked[1:]] == [lp.token_id for lp in whole[1:]]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(chunked[1:], whole[1:], strict=True)) < ATOL

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=4 << 20, dtype="float32"))
    engine.add_request("warm", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    list(engine.step())
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    out = [o for _ in range(5) for o in engine.step() if o.request_id == "r"][0]
    assert out.num_cached_tokens == 0  # the cached prompt is computed again, for its logits
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(PROMPT)
    assert all(lp.top == [] for lp in out.prompt_logprobs[1:])  # 0 alternatives asked for
