"""`ModelRunner`: turns a `SchedulerOutput` into one forward over the paged KV cache and samples.

It owns the model, the KV cache tensor and the sampler; it reads token ids and block tables from the
scheduled requests and returns the sampled token of every request whose step reached its last token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from core.outputs import TokenLogprobs
from core.request import RequestId
from core.step_scheduler import ScheduledRequest, SchedulerOutput
from engine.attention import AttentionMetadata, PrefillSpan
from engine.model import LlamaForCausalLM, layer_views
from engine.model_config import ModelConfig
from engine.sampler import Sampler, SamplingRow, token_logprobs
from engine.structured import apply_masks


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Block-major: one block of one request (all layers, K and V) is one contiguous run of bytes."""
    return (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * elem


@dataclass(slots=True)
class RunnerOutput:
    """The result of one step: a token (and logprobs if asked) per request that sampled."""

    sampled: dict[RequestId, int] = field(default_factory=dict)
    logprobs: dict[RequestId, TokenLogprobs] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # [S, V], rows in `sampled` order; only when asked (tests)


class ModelRunner:
    """Runs steps of a `LlamaForCausalLM` against a block-major KV cache."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.cfg = model.config
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_cache = torch.zeros(
            kv_cache_shape(self.cfg, num_blocks, block_size), dtype=self.dtype, device=self.device
        )
        self.sampler = Sampler()

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor) -> None:
        """A transport may hand back the cache in other memory (shared memory, registered for NIXL)."""
        self._kv_cache = cache
        self.kv_layers = layer_views(cache)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, return_logits: bool = False) -> RunnerOutput:
        input_ids, meta, sample_rows, samplers, prompt_spans = self._prepare(out)
        hidden = self.model(input_ids, meta, self.kv_layers)
        result = RunnerOutput()
        for s, row0 in prompt_spans:
            self._prompt_logprobs(s, row0, hidden)
        if not samplers:
            return result
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        constrained = [
            (i, s.request.constraint) for i, s in enumerate(samplers) if s.request.constraint is not None
        ]
        if constrained:  # structured outputs: what the grammar does not allow next is never sampled
            apply_masks(logits, constrained, self.cfg.vocab_size)
        rows = [
            SamplingRow(
                params=r.params,
                seed=r.seed,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                eos_token_ids=r.eos_token_ids,
            )
            for r in (s.request for s in samplers)
        ]
        sampled = self.sampler(logits, rows)
        for s, token, lp in zip(samplers, sampled.token_ids, sampled.logprobs, strict=True):
            rid = s.request.request_id
            result.sampled[rid] = token
            if s.request.constraint is not None:
                s.request.constraint.accept(token)
            if lp is not None:
                result.logprobs[rid] = lp
        if return_logits:
            result.logits = logits
        return result

    def _prompt_logprobs(self, s: ScheduledRequest, row0: int, hidden: torch.Tensor) -> None:
        """The logprobs of the prompt tokens this chunk predicts (vLLM's ``prompt_logprobs``): the row of
        position p scores prompt token p + 1. Positions already scored (a preempted request computed
        again) are skipped; at most ``PROMPT_LOGPROBS_ROWS`` rows' logits at a time."""
        request = s.request
        if request.prompt_logprobs is None:
            request.prompt_logprobs = [None]  # the first prompt token has nothing before it
        scored = request.prompt_logprobs
        last = min(s.start + s.num_new_tokens, request.num_prompt_tokens - 1)  # positions [.., last)
        for p0 in range(max(s.start, len(scored) - 1), last, PROMPT_LOGPROBS_ROWS):
            p1 = min(last, p0 + PROMPT_LOGPROBS_ROWS)
            rows = hidden[row0 + p0 - s.start : row0 + p1 - s.start]
            targets = request.prompt_token_ids[p0 + 1 : p1 + 1]
            scored.extend(
                token_logprobs(self.model.compute_logits(rows), targets, request.params.prompt_logprobs or 0)
            )

    def _prepare(
        self, out: SchedulerOutput
    ) -> tuple[
        torch.Tensor, AttentionMetadata, list[int], list[ScheduledRequest], list[tuple[ScheduledRequest, int]]
    ]:
        bs = self.block_size
        window = self.cfg.sliding_window
        decodes = [s for s in out.scheduled if s.num_new_tokens == 1]
        chunks = [s for s in out.scheduled if s.num_new_tokens > 1]
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        samplers: list[ScheduledRequest] = []
        ctx_lens: list[int] = []
        tables: list[Sequence[int]] = []
        for s in decodes:
            pos = s.start
            ids.append(s.request.token_at(pos))
            positions.append(pos)
            ctx_lens.append(pos + 1)
            tables.append(s.block_ids[: pos // bs + 1])
            if s.samples:
                sample_rows.append(len(ids) - 1)
                samplers.append(s)
        spans: list[PrefillSpan] = []
        prompt_spans: list[tuple[ScheduledRequest, int]] = []  # chunks whose prompt logprobs are asked for
        row_tables, row_lens = list(tables), list(ctx_lens)  # every row's, if every chunk attends by rows
        for s in chunks:
            start, n = s.start, s.num_new_tokens
            row0 = len(ids)
            if s.request.params.prompt_logprobs is not None and start < s.request.num_prompt_tokens - 1:
                prompt_spans.append((s, row0))
            ids.extend(s.request.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            ctx = start + n
            table = torch.tensor(s.block_ids[: (ctx + bs - 1) // bs], dtype=torch.long)
            span = PrefillSpan(row0, row0 + n, start, table.to(self.device), None)
            if self.device.type == "cpu" and _attends_by_rows(start, n):
                chunk_tables = [s.block_ids[: p // bs + 1] for p in range(start, ctx)]
                chunk_lens = list(range(start + 1, ctx + 1))
                span.row_block_tables = _pad_tables(chunk_tables)
                span.row_ctx_lens = torch.tensor(chunk_lens, dtype=torch.long)
                row_tables += chunk_tables
                row_lens += chunk_lens
            elif start > 0 or (window is not None and n > window):
                q_pos = torch.arange(start, ctx).unsqueeze(1)
                k_pos = torch.arange(ctx).unsqueeze(0)
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                span.mask = mask.to(self.device)
            spans.append(span)
            if s.samples:
                sample_rows.append(row0 + n - 1)
                samplers.append(s)
        pos_t = torch.tensor(positions, dtype=torch.long)
        all_tables = [s.block_ids for s in decodes] + [s.block_ids for s in chunks]
        pairs = _seq_positions(decodes, chunks)
        slot_blocks = torch.tensor([all_tables[i][p // bs] for i, p in pairs], dtype=torch.long)
        meta = AttentionMetadata(
            positions=pos_t.to(self.device),
            slot_blocks=slot_blocks.to(self.device),
            slot_offsets=(pos_t % bs).to(self.device),
            num_decode_tokens=len(decodes),
            decode_block_tables=_pad_tables(tables).to(self.device),
            decode_ctx_lens=torch.tensor(ctx_lens, dtype=torch.long, device=self.device),
            prefills=spans,
        )
        if self.device.type == "cuda":  # the Triton kernel takes the unified form
            meta.block_tables = _pad_tables(all_tables).to(self.device)
            meta.token_seq_ids = torch.tensor([i for i, _ in pairs], dtype=torch.int32, device=self.device)
        elif spans and all(p.row_ctx_lens is not None for p in spans):
            meta.row_block_tables = _pad_tables(row_tables)
            meta.row_ctx_lens = torch.tensor(row_lens, dtype=torch.long)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        return input_ids, meta, sample_rows, samplers, prompt_spans


def _seq_positions(decodes: list[ScheduledRequest], chunks: list[ScheduledRequest]) -> list[tuple[int, int]]:
    """(sequence index, absolute position) of every token, in batch order."""
    pairs = [(i, s.start) for i, s in enumerate(decodes)]
    for j, s in enumerate(chunks):
        pairs.extend((len(decodes) + j, p) for p in range(s.start, s.start + s.num_new_tokens))
    return pairs


# Prompt chunks short enough to attend row by row on CPU, each token a query over its own context as a
# decode is, with the decodes' kernel: no per-chunk SDPA and no gather of the cached context, and a step
# whose chunks all qualify (a prompt arriving beside running decodes, in chunks) runs the one-call
# decode stack. Whether a chunk qualifies depends on the chunk alone, so its numbers do not depend on
# what else is in the step. Row by row reads a query's whole context for each query, as SDPA's
# products do; the bounds keep the per-row kernel on the short contexts it was measured on. Measured
# on the default model (2 threads; 4 decodes and a 64-token prompt in 16-token chunks): 30 ms per mixed
# step on the per-layer path, 23 ms this way.
PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are computed at once (each V floats)
ROW_ATTENTION_MAX_TOKENS = 64  # tokens of the chunk
ROW_ATTENTION_MAX_CONTEXT = 4096  # the sum of its tokens' context lengths


def _attends_by_rows(start: int, n: int) -> bool:
    return n <= ROW_ATTENTION_MAX_TOKENS and n * start + n * (n + 1) // 2 <= ROW_ATTENTION_MAX_CONTEXT


def _pad_tables(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], dtype=torch.long).view(
        len(tables), width
    )
