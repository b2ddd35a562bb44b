"""Our engine against Hugging Face transformers on seeded random tiny checkpoints (fp32, CPU).

Logits of every sampled position — prompt ends and 16+ decode steps, in one mixed batch — must match
a full-sequence HF forward within 1e-4; greedy tokens must be identical. Chunked prefill (chunks of 1,
7 and 64) and prefix-cache hits must give the same logits as a one-shot prefill.
"""

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
DECODE_STEPS = 17


def prompts(seed: int, lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def run_engine(
    path: Path, token_prompts: list[list[int]], max_tokens: int = DECODE_STEPS, **cfg: object
) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]], LLMEngine]:
    """Drives the engine's own loop, keeping the logits row of every sampled token."""
    cfg.setdefault("dtype", "float32")  # fp32 is the reference; auto would pick bf16 on a CPU fast at it
    engine = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=8 << 20, **cfg))  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(token_prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(token_prompts))}
    logits: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(token_prompts))}
    while engine.scheduler.has_unfinished:
        sched = engine.scheduler.schedule()
        result = engine.runner.execute(sched, return_logits=True)
        engine.scheduler.update(sched, result.sampled)
        engine.scheduler.check_integrity()
        assert result.logits is not None or not result.sampled
        for row, (rid, tok) in enumerate(result.sampled.items()):
            tokens[rid].append(tok)
            assert result.logits is not None
            logits[rid].append(result.logits[row])
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "blocks leaked"
    return tokens, logits, engine


def hf_reference(path: Path, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """HF logits at every position that predicts a generated token: [len(generated), V]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    ids = torch.tensor([prompt + generated[:-1]])
    with torch.no_grad():
        out = model(ids).logits[0]
    return out[len(prompt) - 1 :]


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2", "tiny_mistral"])
def test_logits_and_greedy_tokens_match_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(arch)
    # Mistral's window is 24 tokens: prompts of 30+ exercise it in prefill and decode.
    batch = prompts(1, [5, 19, 33, 1, 40], 380)
    tokens, logits, _ = run_engine(path, batch)
    for i, p in enumerate(batch):
        rid = f"r{i}"
        assert len(tokens[rid]) == DECODE_STEPS
        ref = hf_reference(path, p, tokens[rid])
        ours = torch.stack(logits[rid])
        diff = (ours - ref).abs().max().item()
        assert diff < ATOL, f"{arch} prompt {i}: max |logit diff| {diff:.2e}"
        assert ref.argmax(-1).tolist() == tokens[rid], "greedy tokens differ from transformers"


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_one_shot(tiny_llama: Path, chunk: int) -> None:
    batch = prompts(2, [70, 9, 130], 380)
    one_tokens, one_logits, _ = run_engine(
        tiny_llama, batch, max_tokens=4, max_num_batched_tokens=512, long_prefill_chunk=512
    )
    tokens, logits, engine = run_engine(
        tiny_llama,
        batch,
        max_tokens=4,
        max_num_seqs=4,
        max_num_batched_tokens=max(chunk, 8),
        long_prefill_chunk=chunk,
    )
    assert tokens == one_tokens
    for rid in one_logits:
        diff = (torch.stack(logits[rid]) - torch.stack(one_logits[rid])).abs().max().item()
        assert diff < ATOL, f"chunk {chunk}, {rid}: {diff:.2e}"


def test_prefix_cache_hits_match_one_shot(tiny_llama: Path) -> None:
    shared = prompts(3, [48], 380)[0]
    first = shared + [5, 6, 7]
    second = shared + [9, 10, 11, 12, 13]
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=8 << 20, dtype="float32"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    engine.add_request("a", first, params)
    while engine.has_unfinished:
        engine.step()
    engine.add_request("b", second, params)
    outs = []
    while engine.has_unfinished:
        outs += engine.step()
    final = outs[-1]
    assert final.num_cached_tokens == 48, "the shared 3 blocks of 16 must come from the cache"
    assert engine.kv.stats.num_hit_tokens == 48
    ref = hf_reference(tiny_llama, second, final.token_ids)
    ref_logprobs = torch.log_softmax(ref, dim=-1)
    assert final.logprobs is not None
    for step, lp in enumerate(final.logprobs):
        assert lp.token_id == final.token_ids[step]
        assert abs(lp.logprob - ref_logprobs[step, lp.token_id].item()) < ATOL
        for tok, value in lp.top:
            assert abs(value - ref_logprobs[step, tok].item()) < ATOL
    engine.scheduler.check_integrity()
