"""How close a model version's next-token distributions are to another's, on the same tokens.

`teacher_forced_logits` runs one sequence through an engine's model in one prefill and returns the logits
of every position (the sequence is fed as is, whatever the model would have picked: teacher forcing);
it uses a scratch KV cache of its own, so a serving engine's blocks are never touched. `compare` turns
two versions' logits over the same tokens into the figures a rollout is judged by: argmax agreement,
the mean KL divergence of the candidate from the reference, and each one's NLL of the actual tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.model import LlamaForCausalLM, layer_views
from engine.model_runner import kv_cache_shape


@dataclass(frozen=True, slots=True)
class Agreement:
    """Reference vs candidate over ``num_positions`` next-token predictions."""

    num_positions: int
    argmax_agreement: float  # share of positions whose most likely next token is the same
    mean_kl: float  # mean KL(reference || candidate), nats
    ref_nll: float  # mean negative log-likelihood of the actual next tokens, nats
    cand_nll: float

    @property
    def nll_ratio(self) -> float:
        return self.cand_nll / self.ref_nll if self.ref_nll else float("inf")


@torch.inference_mode()
def teacher_forced_logits(
    model: LlamaForCausalLM, token_ids: Sequence[int], block_size: int = 16, rows_per_step: int | None = None
) -> torch.Tensor:
    """fp32 logits ``[n, V]`` of positions 0..n-1 of ``token_ids`` (row i predicts token i + 1).

    One prefill by default. With ``rows_per_step`` the tokens go in steps of that many rows, each row a
    query of its own over the cache written so far — the shape of a decode step, so a decode step's
    kernels (the one-call decode stack, the int8 kernel at up to 16 rows) make the figures."""
    n = len(token_ids)
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    num_blocks = -(-n // block_size)
    kv = torch.zeros(kv_cache_shape(model.config, num_blocks, block_size), dtype=dtype, device=device)
    views = layer_views(kv)
    table = torch.arange(num_blocks, device=device)
    tokens = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    step = n if rows_per_step is None else rows_per_step
    logits = []
    for start in range(0, n, step):
        end = min(n, start + step)
        positions = torch.arange(start, end, device=device)
        rows = rows_per_step is not None
        row_tables = table.unsqueeze(0).expand(end - start, -1).contiguous() if rows else None
        row_lens = positions + 1 if rows else None
        meta = AttentionMetadata(
            positions=positions,
            slot_blocks=positions // block_size,
            slot_offsets=positions % block_size,
            num_decode_tokens=0,
            decode_block_tables=torch.empty(0, 0, dtype=torch.long, device=device),
            decode_ctx_lens=torch.empty(0, dtype=torch.long, device=device),
            prefills=[PrefillSpan(0, end - start, start, table, None, row_tables, row_lens)],
            block_tables=table.unsqueeze(0),
            token_seq_ids=torch.zeros(end - start, dtype=torch.int32, device=device),
            row_block_tables=row_tables,
            row_ctx_lens=row_lens,
        )
        logits.append(model.compute_logits(model(tokens[start:end], meta, views)))
    return torch.cat(logits)


def compare(
    ref_logits: Sequence[torch.Tensor],
    cand_logits: Sequence[torch.Tensor],
    sequences: Sequence[Sequence[int]],
    num_last: int | None = None,
) -> Agreement:
    """Figures over the predictions of each sequence's last ``num_last`` tokens (default: of every token
    after the first)."""
    agree = kl = ref_nll = cand_nll = 0.0
    count = 0
    for ref, cand, seq in zip(ref_logits, cand_logits, sequences, strict=True):
        start = 0 if num_last is None else len(seq) - 1 - num_last
        ref, cand = ref[start:-1].float(), cand[start:-1].float()
        targets = torch.tensor(list(seq[start + 1 :]), device=ref.device)
        ref_lp, cand_lp = ref.log_softmax(-1), cand.log_softmax(-1)
        agree += float((ref.argmax(-1) == cand.argmax(-1)).sum())
        kl += float((ref_lp.exp() * (ref_lp - cand_lp)).sum())
        ref_nll -= float(ref_lp.gather(1, targets.unsqueeze(1)).sum())
        cand_nll -= float(cand_lp.gather(1, targets.unsqueeze(1)).sum())
        count += len(targets)
    if count == 0:
        raise ValueError("no positions to compare")
    return Agreement(count, agree / count, kl / count, ref_nll / count, cand_nll / count)


# Short openings for `sample_texts` when the user brings no prompts of their own.
DEFAULT_OPENINGS = (
    "The history of",
    "A recipe for",
    "My favourite",
    "In the year",
    "The best way to",
    "Scientists say",
    "Once upon a time",
    "Dear diary,",
)
DEFAULT_SUBJECTS = ("cats", "rain", "cities", "music", "trains", "tea", "stars", "maps")


def default_prompts(count: int) -> list[str]:
    """``count`` short prompts, every opening with every subject (64 distinct ones)."""
    n_open, n_subj = len(DEFAULT_OPENINGS), len(DEFAULT_SUBJECTS)
    return [
        f"{DEFAULT_OPENINGS[i % n_open]} {DEFAULT_SUBJECTS[(i // n_open + i) % n_subj]}" for i in range(count)
    ]


def sample_texts(llm: Any, prompts: Sequence[str], num_tokens: int, seed: int = 0) -> list[list[int]]:
    """Each prompt followed by ``num_tokens`` tokens sampled from ``llm`` (an `engine.LLM`, the reference)
    at temperature 1, seeded per prompt: natural text that no version's own argmax chose."""
    from core.sampling_params import SamplingParams

    ids = [llm.tokenizer.encode(p) for p in prompts]
    params = [
        SamplingParams(max_tokens=num_tokens, temperature=1.0, seed=seed + i, ignore_eos=True)
        for i in range(len(ids))
    ]
    outs = llm.generate(ids, params)
    return [p + o.token_ids for p, o in zip(ids, outs, strict=True)]


def evaluate(
    reference: Any,
    candidate: Any,
    sequences: Sequence[Sequence[int]],
    num_last: int | None,
    rows_per_step: int | None = None,
) -> Agreement:
    """`compare` of two `engine.LLM`s' teacher-forced logits over ``sequences`` (the candidate's in steps
    of ``rows_per_step`` rows when given: see `teacher_forced_logits`)."""
    ref = [teacher_forced_logits(reference.engine.runner.model, s) for s in sequences]
    cand = [
        teacher_forced_logits(candidate.engine.runner.model, s, rows_per_step=rows_per_step)
        for s in sequences
    ]
    return compare(ref, cand, sequences, num_last)
