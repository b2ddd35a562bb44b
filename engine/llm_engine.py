"""`LLMEngine`: one model, one KV cache, one step loop — schedule → run → postprocess.

Single-threaded by design (a worker runs it on its own engine thread). ``step()`` returns a
`RequestOutput` delta for every request that produced text or finished in that step.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import random
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from core.errors import InvalidRequest, ModelLoadError, ServingError
from core.kv_cache import KVCacheManager
from core.outputs import FinishReason, RequestOutput
from core.request import Request, RequestId, RequestStatus
from core.sampling_params import SamplingParams
from core.step_scheduler import ScheduledRequest, SchedulerConfig, StepScheduler
from engine.config import EngineConfig
from engine.digests import model_digest
from engine.loader import load_model, resolve_model_dir
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner, RunnerOutput, kv_block_bytes
from engine.output_processor import OutputProcessor
from engine.structured import Grammars
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class StepHook(Protocol):
    """Work the engine runs at the start of every step (the decode worker's KV pulls): it may admit
    requests (`admit_landed`) or end them (`end_unscheduled`); while ``busy`` the engine keeps stepping."""

    @property
    def busy(self) -> bool: ...

    def before_step(self) -> None: ...


def _return_freed_memory() -> None:
    """Hands memory freed while loading back to the OS (glibc keeps it otherwise): resident memory is
    then what the engine holds, which is what a worker's memory request must cover."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
        model = load_model(
            self.model_dir,
            self.model_config,
            dtype,
            device,
            self.max_model_len + 1,
            config.quantization,
            config.load_format,
        )
        _return_freed_memory()  # the checkpoint's fp32 copies and the weights before packing or quantizing
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = StepScheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.long_prefill_chunk,
                config.heavy_prefill_chunk,
                config.resolved_mixed_prefill_tokens(),
            ),
            self.kv,
        )
        self.runner = ModelRunner(model, num_blocks, config.block_size)
        self.eos_token_ids = tuple(
            sorted(set(self.tokenizer.stop_token_ids) | set(self.model_config.eos_token_ids))
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammars = Grammars(self.tokenizer.to_json(), self.model_config.vocab_size, self.eos_token_ids)
        self._aborted: list[RequestOutput] = []  # ended between steps: emitted with the next step
        self.step_hooks: list[StepHook] = []
        self._transfer_seconds: dict[RequestId, float] = {}  # landed pulls: start → landed
        # Metrics, read by the worker when scraped (plain counters: nothing per step but additions).
        self._queued_at: dict[RequestId, float] = {}  # requests not yet scheduled once → added at
        self._queue_seconds: dict[RequestId, float] = {}  # scheduled, first output not yet made
        self.num_scheduled_tokens = 0  # tokens run through the model (prompt chunks and decodes)
        self.num_sampled_tokens = 0
        self._seed_rng = random.Random(config.seed)
        self._model_version: str | None = None
        log.info(
            "engine ready: model=%s device=%s dtype=%s quantization=%s kv_blocks=%d (%d tokens, %.0f MiB) max_model_len=%d",
            self.model_dir,
            device,
            dtype,
            config.quantization,
            num_blocks,
            capacity,
            num_blocks * block_bytes / 2**20,
            self.max_model_len,
        )

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
        kv_lease_id: str | None = None,
        resume_token_ids: Sequence[int] = (),
        continues_elsewhere: bool = False,
    ) -> Request:
        """Tokenizes and queues a request; raises InvalidRequest if it cannot ever be served.

        With ``kv_lease_id`` (a prefill for a handoff) the request's blocks are pinned under that lease
        when it finishes, for a decode worker to pull; ``unpin_lease`` frees them.

        ``resume_token_ids`` continues a request another worker started (a migration): they are
        output tokens the client already has — recomputed like a preempted request's, counted against
        ``max_tokens``, never emitted again; sampling continues at the same positions, so a seeded
        request continues exactly as it would have.

        ``continues_elsewhere``: the request's ``max_tokens`` is a handoff point, not its end (a
        prefill whose decode runs on another worker): text held back at that point (part of a
        character, the start of a stop string) stays held back — the decode side emits it.
        """
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else self._check_ids(prompt)
        resumed = self._check_ids(resume_token_ids)
        if len(resumed) >= params.max_tokens:
            raise InvalidRequest(f"nothing to resume: {len(resumed)} tokens already meet max_tokens")
        request = self._new_request(request_id, token_ids, params, cache_salt)
        request.kv_lease_id = kv_lease_id
        request.output_token_ids.extend(resumed)
        self._constrain(request)
        self.outputs.track(request, continues_elsewhere)
        if resumed:
            self.outputs.replay(request, resumed)
        self.scheduler.add_request(request)
        self._queued_at[request.request_id] = time.monotonic()
        return request

    def continue_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        cache_salt: str = "",
    ) -> Request:
        """A request prefilled elsewhere, checked and tracked but not yet scheduled (its KV is to be
        pulled: see decode_worker.pulls); ``first_token`` is the one the prefill worker already sent.
        Then `admit_landed` schedules it, or `end_unscheduled` / `forget` ends it."""
        request = self._new_request(
            request_id, self._check_ids([*prompt_token_ids, first_token]), params, cache_salt
        )
        request.prompt_token_ids.pop()
        if request.request_id in self.scheduler.requests or request.request_id in self.outputs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        request.output_token_ids.append(first_token)
        if request.num_prompt_tokens + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt + max_tokens exceeds the context of {self.max_model_len} tokens")
        self._constrain(request)
        self.outputs.track(request)
        self.outputs.replay(request, [first_token])
        return request

    def admit_landed(self, request: Request, transfer_s: float) -> None:
        """A continued request whose prompt KV is now in its blocks joins the running batch."""
        self._transfer_seconds[request.request_id] = transfer_s
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request, request.num_computed_tokens)
        self.scheduler.add_running(request)

    def end_unscheduled(self, request: Request, error: ServingError | None = None) -> None:
        """Ends a continued request that never joined the batch (its blocks are the caller's to free);
        its final output (`FinishReason.CANCELLED`, with ``error``) comes with the next step."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = FinishReason.CANCELLED
        out = self._timed(self.outputs.ended(request))
        out.error = error
        self._aborted.append(out)

    def forget(self, request: Request) -> None:
        """Drops a continued request that could not start (nothing is emitted)."""
        self.outputs.forget(request.request_id)

    def kv_layout_fields(self) -> dict[str, object]:
        """What a peer's KV cache must match (see kv_transfer.KVLayout): model, dtype and geometry."""
        cfg = self.model_config
        return {
            "model_digest": self.model_version,
            "dtype": str(self.runner.kv_cache.dtype).removeprefix("torch."),
            "block_size": self.kv.block_size,
            "num_layers": cfg.num_layers,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
        }

    @property
    def model_version(self) -> str:
        """The served model's identity in the cluster: the checkpoint's digest, and for a quantized twin
        a digest of that and the quantization (so its KV never mixes with the original's)."""
        if self._model_version is None:
            if self.config.load_format == "dummy":  # random weights: never the checkpoint's version
                config_json = (self.model_dir / "config.json").read_bytes()
                digest = hashlib.sha256(b"dummy-v1:" + config_json).hexdigest()[:16]
            else:
                digest = model_digest(self.model_dir)
            if self.config.quantization != "none":
                digest = hashlib.sha256(f"{digest}+{self.config.quantization}-woq-v1".encode()).hexdigest()[
                    :16
                ]
            self._model_version = digest
        return self._model_version

    def pinned_blocks(self, lease_id: str) -> list[int]:
        return list(self.kv.pinned_blocks(lease_id))

    def unpin_lease(self, lease_id: str) -> int:
        """Frees the blocks a finished handoff prefill pinned (idempotent); returns how many."""
        return self.kv.unpin(lease_id)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
        return list(ids)

    def _new_request(
        self, request_id: str, token_ids: list[int], params: SamplingParams, salt: str
    ) -> Request:
        params.validate_for_vocab(self.model_config.vocab_size)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        return Request(
            request_id=RequestId(request_id),
            prompt_token_ids=token_ids,
            params=params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            cache_salt=salt,
            max_model_len=self.max_model_len,
        )

    def _constrain(self, request: Request) -> None:
        """The request's structured-output matcher, over the output it already has (a handoff's first
        token, a migration's resumed tokens). Compiled grammars are cached: a worker compiles off this
        thread first (engine.structured)."""
        if request.params.structured is not None:
            request.constraint = self.grammars.constraint(request.params.structured, request.output_token_ids)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request at this step boundary and frees its blocks; its final output (finish_reason
        CANCELLED) comes with the next ``step()``. Returns False if the id is unknown or finished (a
        request whose KV is still being pulled is its `StepHook`'s to abort)."""
        request = self.scheduler.abort(RequestId(request_id))
        self._queued_at.pop(RequestId(request_id), None)
        if request is None or request.request_id not in self.outputs:
            return False
        self._aborted.append(self._timed(self.outputs.ended(request)))
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted) or any(h.busy for h in self.step_hooks)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        for hook in self.step_hooks:
            hook.before_step()
        outputs, self._aborted = self._aborted, []
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        if self._queued_at:
            self._note_first_scheduled(sched.scheduled)
        result = self.runner.execute(sched)
        self.scheduler.update(sched, result.sampled)
        self.num_scheduled_tokens += sched.num_tokens
        self.num_sampled_tokens += len(result.sampled)
        for s in sched.scheduled:
            if s.request.request_id in result.sampled:
                outputs.append(self._postprocess(s.request, result))
        return outputs

    def _note_first_scheduled(self, scheduled: list[ScheduledRequest]) -> None:
        now = time.monotonic()
        for s in scheduled:
            added = self._queued_at.pop(s.request.request_id, None)
            if added is not None:
                self._queue_seconds[s.request.request_id] = now - added

    def _postprocess(self, request: Request, result: RunnerOutput) -> RequestOutput:
        rid = request.request_id
        out = self.outputs.sampled(
            request, result.sampled[rid], result.logprobs.get(rid), self.scheduler.finish
        )
        return self._timed(out)

    def _timed(self, out: RequestOutput) -> RequestOutput:
        """The metrics a request's first output after an event carries (queue wait, KV pull)."""
        if self._queue_seconds:
            out.queue_s = self._queue_seconds.pop(RequestId(out.request_id), 0.0)
        if self._transfer_seconds:
            out.transfer_s = self._transfer_seconds.pop(RequestId(out.request_id), 0.0)
        return out
