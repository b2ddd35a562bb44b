"""`Dispatcher`: the gateway's request path, one for gRPC Session, gRPC Generate and HTTP alike.

accept (request id) → validate → tokenize / chat template (thread pool, never on the event loop) →
place → Prefill on P → first token to the client at once → Decode on D, streaming; or Decode on D
alone for short prompts. Each request runs in its own driver task; cancelling it (client cancel,
Cancel RPC, Session cancel, disconnect, deadline, slow reader) cancels the worker calls at once,
so the workers drop the request at their next step and free its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from baton.v1 import common_pb2, worker_pb2
from core.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelLoadError,
    ModelNotFound,
    ServingError,
    Unavailable,
)
from core.sampling_params import MAX_SEED, SamplingParams
from engine.tokenizer import Tokenizer
from services import metrics
from services.convert import FINISH_FROM_PB, sampling_to_pb
from services.placement import Placement, Placer
from services.request_stream import Delta, Finished, RequestStream, Timings, TokenLogprob, Usage
from services.status import as_serving_error
from services.worker_clients import WorkerClients, worker_error

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # printable ASCII, no spaces: it travels in logs and headers


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """The served model version, as read from the workers at start-up."""

    name: str
    version: str  # the workers' model digest
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-request limits that protect the gateway's and the workers' memory and queues."""

    max_prompt_tokens: int | None  # None: the model's context
    max_output_tokens: int
    max_buffered_tokens: int  # tokens a slow client may leave unread before its request fails


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One client request as a frontend parsed it; exactly one of prompt, prompt_token_ids, messages."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    request_id: str | None = None  # the client's idempotency key; None = a new UUID
    model: str = ""  # empty = the served model
    max_tokens_to_context: bool = False  # max_tokens was not given: fill the context (chat)
    timeout_s: float | None = None  # the client's deadline, from now
    api: str = "grpc"  # for metrics: grpc | http


@dataclass(slots=True)
class _Job:
    """Driver-side state of one request: its prompt, its params and the timings gathered so far."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline: float | None  # monotonic
    dispatched_at: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    decode_ms: float = 0.0
    cached_tokens: int = 0
    decoded_any: bool = False  # a Decode call streamed at least one token
    # Aborts sent to workers after a cancel or failure; the request id stays reserved until they land,
    # so a client that reuses it at once cannot have its new request aborted by the old one's cleanup.
    aborts: list[asyncio.Task[bool]] = field(default_factory=list)

    def abort_on(self, workers: WorkerClients, address: str) -> None:
        self.aborts.append(workers.abort_soon(address, self.request_id))

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


def delta_from_pb(msg: common_pb2.TokenDelta) -> Delta:
    logprobs = [TokenLogprob(lp.token_id, lp.logprob, dict(lp.top)) for lp in msg.logprobs]
    return Delta(list(msg.token_ids), msg.text, logprobs)


class Dispatcher:
    """Runs requests through the workers; the registry of in-flight requests for cancellation by id."""

    def __init__(
        self, tokenizer: Tokenizer, model: ModelInfo, limits: Limits, placer: Placer,
        workers: WorkerClients, executor: Executor,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits
        self.placer = placer
        self.workers = workers
        self._executor = executor
        self._in_flight: dict[str, RequestStream] = {}

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Accepts a request and starts its driver; raises InvalidRequest for a bad or duplicate id."""
        rid = request.request_id or uuid.uuid4().hex
        problem = None
        if not _REQUEST_ID.fullmatch(rid):
            problem = "request_id must be 1 to 128 printable ASCII characters without spaces"
        elif rid in self._in_flight:
            problem = f"request id {rid!r} is already in flight"
        if problem is not None:
            metrics.REQUESTS.labels(request.api, "INVALID_ARGUMENT").inc()
            raise InvalidRequest(problem)
        stream = RequestStream(rid, self.limits.max_buffered_tokens)
        self._in_flight[rid] = stream
        metrics.IN_FLIGHT.inc()
        stream.attach(asyncio.get_running_loop().create_task(self._run(stream, request), name=f"request-{rid}"))
        log.info("request %s accepted (%s)", rid, request.api)
        return stream

    def cancel(self, request_id: str, reason: str) -> bool:
        """Cancels a request in flight, wherever it runs; False if the id is unknown or already ended."""
        stream = self._in_flight.get(request_id)
        return stream.cancel(reason) if stream is not None else False

    async def shutdown(self) -> None:
        streams = list(self._in_flight.values())
        for stream in streams:
            stream.cancel("shutdown")
        await asyncio.sleep(0)

    # --- one request ---------------------------------------------------------------------------

    async def _run(self, stream: RequestStream, request: GenerationRequest) -> None:
        outcome = "ok"
        job: _Job | None = None
        deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
        try:
            async with asyncio.timeout(request.timeout_s):
                job = await self._prepare(stream.request_id, request, deadline)
                await self._execute(stream, job)
        except (asyncio.CancelledError, TimeoutError) as e:
            reason = "deadline" if isinstance(e, TimeoutError) else stream.cancel_reason or "shutdown"
            outcome = self._cancelled(stream, job, reason)
        except Exception as e:  # every failure ends this request alone, as a ServingError
            err = as_serving_error(e)
            stream.fail(err)
            outcome = err.grpc_code
            log.info("request %s failed: %s %s", stream.request_id, err.grpc_code, err.message)
        finally:
            if job is not None and job.aborts:
                try:
                    await asyncio.wait(job.aborts)  # each has its own timeout
                except asyncio.CancelledError:
                    log.info("request %s: left its worker aborts to the background", stream.request_id)
            del self._in_flight[stream.request_id]
            metrics.IN_FLIGHT.dec()
            metrics.REQUESTS.labels(request.api, outcome).inc()

    def _cancelled(self, stream: RequestStream, job: _Job | None, reason: str) -> str:
        metrics.CANCELLATIONS.labels(reason).inc()
        log.info("request %s cancelled (%s) after %d tokens", stream.request_id, reason, stream.num_tokens)
        if stream.ended:  # the slow-reader error was already set
            return "RESOURCE_EXHAUSTED"
        stream.finish(self._finished(stream, job, "cancelled", stream.num_tokens))
        return "cancelled"

    async def _prepare(self, rid: str, request: GenerationRequest, deadline: float | None) -> _Job:
        """Validates the request against the model and the limits; tokenizes off the event loop."""
        if request.model and request.model != self.model.name:
            raise ModelNotFound(f"model {request.model!r} is not served here; the model is {self.model.name!r}")
        loop = asyncio.get_running_loop()
        prompt_ids = await loop.run_in_executor(self._executor, self._tokenize, request)
        params = self._check_limits(len(prompt_ids), request)
        return _Job(rid, prompt_ids, params, deadline)

    def _tokenize(self, request: GenerationRequest) -> list[int]:
        if request.messages is not None:
            try:
                ids = self.tokenizer.encode_chat(list(request.messages))
            except ModelLoadError as e:
                raise InvalidRequest(e.message) from None
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt) if request.prompt else []
        elif request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.model.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"prompt token ids must be in [0, {self.model.vocab_size}); got {bad[0]}"
                )
        else:
            raise InvalidRequest("the request needs a prompt, prompt token ids or messages")
        if not ids:
            raise InvalidRequest("the prompt must not be empty")
        return ids

    def _check_limits(self, num_prompt: int, request: GenerationRequest) -> SamplingParams:
        params, limits, context = request.params, self.limits, self.model.max_model_len
        max_prompt = min(limits.max_prompt_tokens or context, context)
        if num_prompt > max_prompt:
            raise ContextLengthExceeded(
                f"the prompt has {num_prompt} tokens, over the limit of {max_prompt} prompt tokens"
            )
        if request.max_tokens_to_context:
            room = max(1, min(limits.max_output_tokens, context - num_prompt))
            params = replace(params, max_tokens=max(room, params.min_tokens))
        if params.max_tokens > limits.max_output_tokens:
            raise InvalidRequest(
                f"max_tokens is {params.max_tokens}, over the limit of {limits.max_output_tokens} output tokens"
            )
        if num_prompt + params.max_tokens > context:
            raise ContextLengthExceeded(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({params.max_tokens}) is "
                f"{num_prompt + params.max_tokens} tokens, over the model's context of {context} tokens"
            )
        params.validate_for_vocab(self.model.vocab_size)
        if params.seed is None:
            # Seeded here, not on the worker: a decode retried after a failed KV transfer then
            # continues exactly the stream the client already started to read.
            params = replace(params, seed=secrets.randbelow(MAX_SEED))
        return params

    async def _execute(self, stream: RequestStream, job: _Job) -> None:
        placement = self.placer.place(len(job.prompt_ids))
        job.dispatched_at = time.perf_counter()
        log.info(
            "request %s placed: prefill=%s decode=%s prompt_tokens=%d",
            job.request_id, placement.prefill or "local", placement.decode, len(job.prompt_ids),
        )
        if placement.prefill is None:
            await self._decode(stream, job, placement.decode)
        else:
            await self._disaggregated(stream, job, placement)

    async def _disaggregated(self, stream: RequestStream, job: _Job, placement: Placement) -> None:
        """Prefill on P, stream the first token, Decode on D; one retry with a fresh prefill if D fails
        with UNAVAILABLE before it streamed anything (the first token stays the one already sent)."""
        prefill_at, decode_at = placement.prefill, placement.decode
        assert prefill_at is not None
        first_token: int | None = None
        for attempt in range(2):
            prefill = await self._prefill(job, prefill_at)
            job.prefill_ms += prefill.prefill_ms
            job.cached_tokens = prefill.usage.cached_tokens
            if first_token is None:
                if not prefill.first.token_ids:
                    raise Unavailable(f"prefill worker {prefill_at} returned no first token")
                first_token = prefill.first.token_ids[0]
                self._push(stream, prefill.first)
            if prefill.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED or not prefill.HasField("handle"):
                if prefill.HasField("handle"):
                    job.abort_on(self.workers, prefill_at)
                reason = FINISH_FROM_PB.get(prefill.finish_reason, "stop")
                stream.finish(self._finished(stream, job, reason, max(1, prefill.usage.completion_tokens),
                                             prefill.stop_reason))
                return
            try:
                await self._decode(stream, job, decode_at, prefill.handle, first_token)
                return
            except ServingError as e:
                # The KV pull failed (KVTransferFailed) or D was unreachable: release the lease, and
                # give a fresh prefill one more try if the client has seen nothing after the first token.
                await self.workers.abort(prefill_at, job.request_id)  # the request id is reused below
                if attempt == 1 or job.decoded_any or e.grpc_code != "UNAVAILABLE":
                    raise
                retry = self.placer.place(len(job.prompt_ids))
                if retry.prefill is None:
                    raise
                metrics.KV_TRANSFER_RETRIES.inc()
                log.warning("request %s: decode after handoff failed (%s); retrying with a new prefill",
                            job.request_id, e.message)
                prefill_at, decode_at = retry.prefill, retry.decode
            except BaseException:
                job.abort_on(self.workers, prefill_at)  # D may never have taken the lease
                raise

    async def _prefill(self, job: _Job, address: str) -> worker_pb2.PrefillResponse:
        request = worker_pb2.PrefillRequest(
            request_id=job.request_id, prompt_token_ids=job.prompt_ids, sampling=sampling_to_pb(job.params),
        )
        call = self.workers.stub(address).Prefill(request, timeout=job.remaining_s())
        try:
            response: worker_pb2.PrefillResponse = await call
        except grpc.aio.AioRpcError as e:
            raise worker_error(e, address) from None
        except asyncio.CancelledError:
            # The prefill may have finished (and leased its blocks) as we cancelled: release them.
            job.abort_on(self.workers, address)
            raise
        finally:
            call.cancel()  # a no-op once it has finished; aborts the prefill if we were cancelled
        return response

    async def _decode(
        self, stream: RequestStream, job: _Job, address: str,
        handle: common_pb2.KVHandle | None = None, first_token: int | None = None,
    ) -> None:
        """Streams D's tokens to the client; with a handle D pulls the KV and starts after first_token."""
        request = worker_pb2.DecodeRequest(
            request_id=job.request_id, prompt_token_ids=job.prompt_ids, sampling=sampling_to_pb(job.params),
        )
        if handle is not None:
            request.handle.CopyFrom(handle)
        if first_token is not None:
            request.first_token = first_token
        last: worker_pb2.DecodeResponse | None = None
        call = self.workers.stub(address).Decode(request, timeout=job.remaining_s())
        try:
            async for msg in call:
                if msg.delta.token_ids or msg.delta.text:
                    job.decoded_any = True
                    self._push(stream, msg.delta)
                if msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    last = msg
        except grpc.aio.AioRpcError as e:
            raise worker_error(e, address) from None
        finally:
            call.cancel()  # a no-op once it has finished; otherwise the worker aborts and frees blocks
        if last is None:
            raise Unavailable(f"decode worker {address} ended the stream without a finish reason")
        job.transfer_ms, job.decode_ms = last.transfer_ms, last.decode_ms
        job.prefill_ms += last.prefill_ms
        if handle is None and first_token is None:
            job.cached_tokens = last.usage.cached_tokens
        reason = FINISH_FROM_PB.get(last.finish_reason, "stop")
        stream.finish(self._finished(stream, job, reason, last.usage.completion_tokens or stream.num_tokens,
                                     last.stop_reason))

    def _push(self, stream: RequestStream, msg: common_pb2.TokenDelta) -> None:
        first = stream.first_token_at is None
        stream.push(delta_from_pb(msg))
        if first and stream.first_token_at is not None:
            metrics.TTFT.observe(stream.first_token_at - stream.accepted_at)

    def _finished(self, stream: RequestStream, job: _Job | None, reason: str, completion_tokens: int,
                  stop_reason: str = "") -> Finished:
        now = time.perf_counter()
        e2e_s = now - stream.accepted_at
        metrics.E2E.observe(e2e_s)
        ttft = (stream.first_token_at - stream.accepted_at) * 1e3 if stream.first_token_at else 0.0
        if job is None:
            return Finished(reason, Usage(0, completion_tokens), Timings(ttft_ms=ttft, e2e_ms=e2e_s * 1e3))
        queue_ms = (job.dispatched_at - stream.accepted_at) * 1e3 if job.dispatched_at else e2e_s * 1e3
        timings = Timings(queue_ms, job.prefill_ms, job.transfer_ms, job.decode_ms, ttft, e2e_s * 1e3)
        log.info(
            "request %s finished: %s prompt=%d completion=%d ttft=%.1fms e2e=%.1fms", job.request_id, reason,
            len(job.prompt_ids), completion_tokens, ttft, e2e_s * 1e3,
        )
        return Finished(reason, Usage(len(job.prompt_ids), completion_tokens, job.cached_tokens), timings, stop_reason)
