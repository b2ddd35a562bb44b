"""`LLMEngine`: one model, one KV cache, one step loop — schedule → run → postprocess.

Single-threaded by design (a worker runs it on its own engine thread). ``step()`` returns a
`RequestOutput` delta for every request that produced text or finished in that step.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from core.errors import InvalidRequest, ModelLoadError
from core.kv_cache import KVCacheManager
from core.request import FinishReason, Request, RequestId, RequestStatus
from core.sampling_params import SamplingParams
from core.step_scheduler import SchedulerConfig, StepScheduler
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.loader import load_model, resolve_model_dir
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, RunnerOutput, kv_block_bytes
from engine.sampler import TokenLogprobs
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """A request's output so far. ``new_text`` / ``new_token_ids`` are what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    new_text: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class _OutputState:
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher | None
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None


class LLMEngine:
    """Builds the model, tokenizer, KV cache, scheduler and runner from an `EngineConfig`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device, dtype = config.torch_device(), config.torch_dtype()
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        block_bytes = kv_block_bytes(self.model_config, config.block_size, dtype)
        num_blocks = config.kv_cache_memory // block_bytes
        capacity = num_blocks * config.block_size
        if num_blocks < 2:
            raise ModelLoadError(
                f"kv_cache_memory {config.kv_cache_memory} B holds {num_blocks} blocks of {block_bytes} B; "
                "raise --kv-cache-memory"
            )
        model_len = self.model_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > capacity:
                raise ModelLoadError(
                    f"max_model_len {config.max_model_len} does not fit in the KV cache ({capacity} tokens "
                    f"= {num_blocks} blocks); raise --kv-cache-memory or lower --max-model-len"
                )
            model_len = config.max_model_len
        self.max_model_len = min(model_len, capacity)
        model = load_model(self.model_dir, self.model_config, dtype, device, self.max_model_len + 1)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = StepScheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.long_prefill_chunk),
            self.kv,
        )
        self.runner = ModelRunner(model, num_blocks, config.block_size)
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.stop_token_ids) | set(self.model_config.eos_token_ids)))
        self._states: dict[RequestId, _OutputState] = {}
        self._aborted: list[RequestOutput] = []
        self._seed_rng = random.Random(config.seed)
        log.info(
            "engine ready: model=%s device=%s dtype=%s kv_blocks=%d (%d tokens, %.0f MiB) max_model_len=%d",
            self.model_dir, device, dtype, num_blocks, capacity, num_blocks * block_bytes / 2**20,
            self.max_model_len,
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
    ) -> Request:
        """Tokenizes and queues a request; raises InvalidRequest if it cannot ever be served."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in token_ids):
                raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        params.validate_for_vocab(self.model_config.vocab_size)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = Request(
            request_id=RequestId(request_id), prompt_token_ids=token_ids, params=params, seed=seed,
            eos_token_ids=self.eos_token_ids, cache_salt=cache_salt, max_model_len=self.max_model_len,
        )
        self.scheduler.add_request(request)
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._states[request.request_id] = _OutputState(
            detok=IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens),
            matcher=matcher,
            logprobs=[] if params.logprobs is not None else None,
        )
        return request

    def abort_request(self, request_id: str) -> bool:
        """Stops a request at this step boundary and frees its blocks; its final output (finish_reason
        "abort") comes with the next ``step()``. Returns False if the id is unknown or finished."""
        request = self.scheduler.abort(RequestId(request_id))
        state = self._states.pop(RequestId(request_id), None)
        if request is None or state is None:
            return False
        self._aborted.append(self._make_output(request, state, "", []))
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        result = self.runner.execute(sched)
        self.scheduler.update(sched, result.sampled)
        for s in sched.scheduled:
            if s.request.request_id in result.sampled:
                outputs.append(self._postprocess(s.request, result))
        return outputs

    def _postprocess(self, request: Request, result: RunnerOutput) -> RequestOutput:
        rid = request.request_id
        state = self._states[rid]
        token = result.sampled[rid]
        if state.logprobs is not None and rid in result.logprobs:
            state.logprobs.append(result.logprobs[rid])
        stopped_by_token = request.finish_reason is FinishReason.STOP and request.stop_reason == token
        delta = "" if stopped_by_token else state.detok.add([token])
        if request.is_finished:
            delta += state.detok.flush()  # a character left incomplete at the end shows as U+FFFD
        if state.matcher is not None:
            delta, hit = state.matcher.feed(delta)
            if hit and not request.is_finished:
                self.scheduler.finish(request, FinishReason.STOP)
                request.stop_reason = state.matcher.stop_string
            elif request.is_finished and not hit:
                delta += state.matcher.flush()
        out = self._make_output(request, state, delta, [token])
        if request.is_finished:
            del self._states[rid]
        return out

    def _make_output(
        self, request: Request, state: _OutputState, delta: str, new_tokens: list[int]
    ) -> RequestOutput:
        state.text += delta
        finished = request.status is RequestStatus.FINISHED
        reason = request.finish_reason.value if finished and request.finish_reason else None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            text=state.text,
            token_ids=list(request.output_token_ids),
            new_text=delta,
            new_token_ids=new_tokens,
            finish_reason=reason,
            stop_reason=request.stop_reason if finished else None,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
        )
