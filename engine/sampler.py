"""Batched, seeded sampling: a decode step's logits ``[B, V]`` → one token (and optional logprobs) per row.

Order of operations for a row (vLLM / OpenAI meanings)::

    raw logits ──► logprobs (log_softmax of the RAW logits, only for rows that ask)
        │
        ├─ min_tokens: stop ids (and EOS unless ignore_eos) → -inf while len(output) < min_tokens
        ├─ penalties: repetition (prompt + output), presence / frequency (output only)
        ├─ temperature == 0 → argmax                                 (greedy rows)
        └─ / temperature → top-k → top-p → softmax → min-p → race    (random rows)

Logprobs describe what the model said, not what the sampler did: they come from the raw logits, before
penalties, temperature and filters (vLLM v1's default ``raw_logprobs``), so they are comparable across
requests with different sampling parameters.

**Reproducibility.** A random row's token depends only on its own filtered distribution and on
``(seed, position)`` with ``position = len(output_token_ids)`` — never on the other rows of the batch, on
their order, or on how many steps this sampler has run. A request that is preempted and recomputed, or
migrated to another worker (prefill → decode), therefore continues with exactly the same tokens. That is
why the draw is the *exponential race* ``argmax(probs / E)``, ``E = -log U ~ Exp(1)`` i.i.d. per token
(token i wins with probability ``probs[i]``), with ``U`` drawn over the whole vocabulary from a generator
re-seeded per row from ``draw_seed(seed, position)`` (splitmix64), instead of
``torch.multinomial`` on a shared generator, whose stream advances with every row and every step.
Every filter touches only the rows that asked for it and every op is row-wise, so a row's result is
bit-identical whether it is alone or in a batch. The noise stream is device-specific: the same request
sampled on CPU and on GPU gives different (equally valid) continuations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from core.outputs import TokenLogprobs
from core.sampling_params import SamplingParams
from engine.cpu_ops import argmax_rows

_MASK64 = (1 << 64) - 1
# top-p looks for the nucleus among this many most likely tokens before sorting the whole vocabulary.
_TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class SamplingRow:
    """One request's sampling state for this step; this step samples output index ``len(output_token_ids)``.

    ``seed`` is the resolved seed: ``params.seed``, or one the engine chose at admission (and keeps for
    the request's life, so recomputation after preemption reproduces the same tokens).
    ``eos_token_ids`` are the model's EOS ids, masked during ``min_tokens`` unless ``params.ignore_eos``.
    """

    params: SamplingParams
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class SamplerOutput:
    """One token per row, and its logprobs where the row asked for them (None where ``logprobs`` is None)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Picks the next token of every row of a batch; see the module docstring for the order and semantics.

    Keeps one ``torch.Generator`` per device and re-seeds it for every random row, so it holds no state
    that affects results. Not thread-safe: one per engine thread.
    """

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``logits`` is ``[B, V]`` fp32 with ``B == len(rows)``; it is never modified."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
        if not rows:
            return SamplerOutput(token_ids=[], logprobs=[])
        logits = logits.float()
        processed = apply_penalties(apply_min_tokens(logits, rows), rows)

        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        if greedy:
            token_ids[_long(greedy, logits.device)] = argmax_rows(_select(processed, greedy))
        if random:
            sampled = self._sample(_select(processed, random), [rows[i] for i in random])
            token_ids[_long(random, logits.device)] = sampled
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=_logprobs(logits, rows, token_ids))

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:  # [n, V] → [n]
        probs = filtered_probs(logits, [row.params for row in rows])
        # E = -log(U) ~ Exp(1), U drawn in fp64 (53 bits): fp32's 24 bits would cap E below at 6e-8 and
        # so starve tokens with probability under ~1e-7. Also ~3x faster than exponential_ on CPU.
        uniform = torch.empty(probs.shape, dtype=torch.float64, device=probs.device)  # [n, V]
        generator = self._generator(logits.device)
        for i, row in enumerate(rows):
            generator.manual_seed(draw_seed(row.seed, len(row.output_token_ids)))
            uniform[i].uniform_(generator=generator)
        noise = uniform.log_().neg_().to(probs.dtype)
        # U == 1 (possible on some backends) gives E == 0 and p / 0 == NaN for filtered tokens, which
        # argmax would pick; U == 0 gives E == inf, which is harmless (that token just loses).
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]


def draw_seed(seed: int, position: int) -> int:
    """The 64-bit generator seed for output ``position`` of a request seeded with ``seed``.

    Two rounds of splitmix64 spread every bit of both inputs over the whole word; this matters because
    the CPU generator (mt19937) keeps only the low 32 bits of its seed.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def apply_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Masks to -inf, while ``len(output) < min_tokens``, the row's stop token ids and — unless
    ``ignore_eos`` (EOS then does not end the request, so there is nothing to hold back) — its EOS ids.

    Returns ``logits`` itself when no row is blocked, else a masked copy.
    """
    row_ids: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        if len(row.output_token_ids) >= row.params.min_tokens:
            continue
        blocked = set(row.params.stop_token_ids)
        if not row.params.ignore_eos:
            blocked.update(row.eos_token_ids)
        row_ids += [i] * len(blocked)
        token_ids += sorted(blocked)
    if not row_ids:
        return logits
    masked = logits.clone()
    index = (_long(row_ids, logits.device), _long(token_ids, logits.device))
    masked.index_put_(index, torch.tensor(float("-inf"), device=logits.device))
    return masked


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (HF / vLLM: a positive logit is divided by the
    penalty, a negative one multiplied), then OpenAI presence / frequency penalties over output tokens
    only (``logit -= presence * (count > 0) + frequency * count``).

    Only rows whose params use penalties are touched; returns ``logits`` itself when none do.
    """
    use = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if not use:
        return logits
    sub = [rows[i].params for i in use]
    device, vocab_size = logits.device, logits.shape[1]
    x = _select(logits, use)  # [n, V]; every update below is out of place
    if any(p.repetition_penalty != 1.0 for p in sub):
        repetition = torch.tensor([p.repetition_penalty for p in sub], device=device).unsqueeze(1)
        seqs = [chain(rows[i].prompt_token_ids, rows[i].output_token_ids) for i in use]
        seen = _token_counts([list(s) for s in seqs], vocab_size, device) > 0
        x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in sub):
        counts = _token_counts([rows[i].output_token_ids for i in use], vocab_size, device)
        presence = torch.tensor([p.presence_penalty for p in sub], device=device).unsqueeze(1)
        frequency = torch.tensor([p.frequency_penalty for p in sub], device=device).unsqueeze(1)
        x = x - (frequency * counts + presence * (counts > 0))
    if len(use) == len(rows):
        return x
    return logits.index_copy(0, _long(use, device), x)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a random row samples from: ``softmax(logits / T)`` restricted by top-k, then
    top-p (on the top-k renormalized distribution), then min-p, renormalized. ``[n, V]`` → ``[n, V]``.

    top-k keeps every token tied with the k-th largest logit; top-p keeps the smallest set of most likely
    tokens whose mass reaches ``top_p`` (always at least the top token, and any token tied with the last
    one kept, like top-k); min-p drops tokens below
    ``min_p * max prob`` — a ratio to the top token, so unchanged by the earlier filters. Each filter runs
    only on the rows that use it, so the other rows stay bit-identical to being sampled alone.
    """
    device, vocab_size = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    x = logits / temperature
    top_k = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size]
    if top_k:
        x = _on_rows(x, top_k, lambda sub: _top_k(sub, [params[i].top_k for i in top_k]))
    top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p:
        x = _on_rows(x, top_p, lambda sub: _top_p(sub, [params[i].top_p for i in top_p]))
    probs = x.softmax(dim=-1)
    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        probs = _on_rows(probs, min_p, lambda sub: _min_p(sub, [params[i].min_p for i in min_p]))
    return probs


def _top_k(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:  # [n, V], 0 < k < V
    k = _long(top_k, x.device).unsqueeze(1)  # [n, 1]
    # The k-th largest value is the same whatever k_max is, so other rows' k cannot change this row.
    kth = x.topk(max(top_k), dim=-1).values.gather(1, k - 1)  # [n, 1]
    return x.masked_fill(x < kth, float("-inf"))


def _top_p(x: torch.Tensor, top_p: list[float]) -> torch.Tensor:  # [n, V], 0 < p < 1
    p = torch.tensor(top_p, device=x.device).unsqueeze(1)  # [n, 1]
    probs = x.softmax(dim=-1)
    # A full sort of the vocabulary is the expensive part (~30 ms for 16 x 49k on CPU); the nucleus
    # nearly always lies within the top few hundred tokens, so look there first and sort in full only
    # the rows whose nucleus is wider. Both give the same values in the same order, so the same result.
    candidates = probs.topk(min(_TOP_P_CANDIDATES, probs.shape[1]), dim=-1).values  # [n, c] best first
    threshold, complete = _nucleus_threshold(candidates, p)
    if not bool(complete.all()):
        wide = complete.logical_not().nonzero().squeeze(1)
        sorted_probs = probs.index_select(0, wide).sort(dim=-1, descending=True).values
        threshold[wide] = _nucleus_threshold(sorted_probs, p.index_select(0, wide))[0]
    return x.masked_fill(probs < threshold, float("-inf"))


def _nucleus_threshold(sorted_probs: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For probs sorted best first ``[n, c]``: the smallest kept prob ``[n, 1]`` (a token is kept while the
    mass strictly before it is below ``p``, so the top token always is), and whether the cut fell inside
    these ``c`` values ``[n]``. Ties with the last kept token are kept too, so the order of ties is moot."""
    mass_before = F.pad(sorted_probs.cumsum(dim=-1)[:, :-1], (1, 0))  # exclusive prefix sum, nondecreasing
    # >= 1: a top_p below float32's smallest value (5e-324 is a valid request) rounds to 0 here.
    num_kept = (mass_before < p).sum(dim=-1, keepdim=True).clamp_min(1)  # [n, 1]
    threshold = sorted_probs.gather(1, num_kept - 1)
    return threshold, num_kept.squeeze(1) < sorted_probs.shape[1]


def _min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:  # [n, V] probs, 0 < min_p <= 1
    threshold = torch.tensor(min_p, device=probs.device).unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    kept = probs.masked_fill(probs < threshold, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled tokens and the top-n alternatives, from the raw ``logits`` ``[B, V]``."""
    out: list[TokenLogprobs | None] = [None] * len(rows)
    use = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not use:
        return out
    logprobs = _select(logits, use).log_softmax(dim=-1)  # [n, V]
    chosen = _select(token_ids, use).unsqueeze(1)  # [n, 1]
    chosen_logprobs = logprobs.gather(1, chosen)  # [n, 1]
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1  # [n]
    num_top = [rows[i].params.logprobs or 0 for i in use]
    top_values, top_ids = logprobs.topk(max(num_top), dim=-1)  # [n, max_n], best first
    # One device → host copy per tensor, not one per element.
    chosen_list, chosen_logprobs_list = chosen.squeeze(1).tolist(), chosen_logprobs.squeeze(1).tolist()
    ranks_list, top_values_list, top_ids_list = ranks.tolist(), top_values.tolist(), top_ids.tolist()
    for j, (i, n) in enumerate(zip(use, num_top, strict=True)):
        out[i] = TokenLogprobs(
            token_id=chosen_list[j],
            logprob=chosen_logprobs_list[j],
            rank=ranks_list[j],
            top=list(zip(top_ids_list[j][:n], top_values_list[j][:n], strict=True)),
        )
    return out


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """Each row's logprob of ``token_ids[row]``, its rank and the ``num_top`` best alternatives, from raw
    ``logits`` ``[n, V]`` (a prompt's logprobs: each position scores the prompt's next token)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, chosen)
    ranks = ((logprobs > chosen_logprobs).sum(dim=-1) + 1).tolist()
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (logprobs[:, :0], chosen[:, :0])
    values, ids, tops = chosen_logprobs.squeeze(1).tolist(), top_ids.tolist(), top_values.tolist()
    return [
        TokenLogprobs(token_id=t, logprob=v, rank=r, top=list(zip(i, tv, strict=True)))
        for t, v, r, i, tv in zip(token_ids, values, ranks, ids, tops, strict=True)
    ]


def _token_counts(seqs: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each sequence: ``[len(seqs), vocab_size]`` fp32."""
    counts = torch.zeros(len(seqs), vocab_size, device=device)
    lengths = _long([len(s) for s in seqs], device)
    row_ids = torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)
    token_ids = _long(list(chain.from_iterable(seqs)), device)
    # Adding ones is exact in fp32, so the accumulation order (atomics on GPU) cannot change the counts.
    counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)
    return counts


def _select(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Rows ``rows`` of ``x``; ``x`` itself when that is all of them."""
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, _long(rows, x.device))


def _on_rows(x: torch.Tensor, rows: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Replaces rows ``rows`` of ``x`` with ``fn(those rows)``, leaving the others untouched bit for bit.
    Writes into ``x`` (which must be the caller's own tensor) unless ``rows`` is every row."""
    if len(rows) == x.shape[0]:
        return fn(x)
    return x.index_copy_(0, _long(rows, x.device), fn(_select(x, rows)))


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
