"""`Dispatcher`: the gateway's request path, one for gRPC Session, gRPC Generate and HTTP alike.

accept (request id) → validate and tokenize (`services.gateway.admission`, off the event loop) → route
(the scheduler's Place, or static) → Prefill on P → first token to the client at once → Decode on D,
streaming; or Decode on D alone. A route naming a shadow worker mirrors the request there
(`services.gateway.shadow`). A failed worker is left behind and the request routed again from the tokens
the client has: a prefill retried elsewhere, a failed KV transfer prefilled afresh once, a decode that
dies mid-stream migrated (the new worker recomputes the tokens sent) — each a bounded number of times.
Each request runs in its own driver task; cancelling it (client cancel, Cancel RPC, Session cancel,
disconnect, deadline, slow reader) cancels the worker calls at once, so the workers drop it at their
next step and free its blocks, and publishes the cancel on the scheduler's cancellation bus.

Metrics (`services.gateway.metrics`): a request is counted when it ends, a completed one's TTFT, time
and segments (its `Timings`) observed then; inter-token gaps as its tokens reach the client's stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor

from core.errors import (
    DuplicateRequest,
    InvalidRequest,
    KVTransferFailed,
    ServingError,
    Unavailable,
    WorkerDraining,
    WorkerLost,
)
from core.outputs import FinishReason
from core.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from kv_transfer.handle import KVHandle
from rpc.errors import as_serving_error
from rpc.metrics import NONE, BoundedLabel
from services.gateway import metrics
from services.gateway.admission import (
    GenerationRequest,
    Limits,
    ModelInfo,
    RequestValidator,
    request_id_problem,
)
from services.gateway.job import Job
from services.gateway.request_stream import Delta, Finished, RequestStream, Timings, Usage
from services.gateway.router import LeaseEvent, LeaseReport, Route, RouteQuery, Router
from services.gateway.shadow import (
    PrimaryResult,
    ShadowRequest,
    ShadowRun,
    ShadowTraffic,
    as_asked,
    with_top_logprobs,
)
from services.gateway.worker_clients import Leg, WorkerClients

log = logging.getLogger(__name__)

MAX_WORKER_RETRIES = 2  # re-routes of a request whose worker failed before it streamed anything
MAX_KV_RETRIES = 1  # fresh prefills after a failed KV handoff


class Dispatcher:
    """Runs requests through the workers; the registry of in-flight requests for cancellation by id."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        model: ModelInfo,
        limits: Limits,
        router: Router,
        workers: WorkerClients,
        executor: Executor,
        shadows: ShadowTraffic | None = None,
        tenant_label: BoundedLabel | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits
        self.router = router
        self.workers = workers
        self.validator = RequestValidator(tokenizer, model, limits, executor)
        self.shadows = shadows or ShadowTraffic(workers)
        self.tenant_label = tenant_label or BoundedLabel()  # keeps the tenant label's values bounded
        self._client_wait = metrics.CLIENT_WAIT.labels(model.name)
        self._in_flight: dict[str, RequestStream] = {}
        self.calls: dict[str, Callable[[str], None]] = {}  # a call of several choices: its cancel, by id
        self._jobs: dict[str, Job] = {}
        self._idle = asyncio.Event()  # set while nothing is in flight
        self._idle.set()
        self.draining = False

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def submit(self, request: GenerationRequest) -> RequestStream:
        """Accepts a request and starts its driver; raises InvalidRequest for a bad or duplicate id."""
        metrics.ARRIVALS.labels(self.model.name, request.api).inc()  # demand, whatever becomes of it
        if self.draining:
            metrics.REQUESTS.labels(self.model.name, NONE, NONE, request.api, "error", "UNAVAILABLE").inc()
            raise Unavailable(
                "this gateway is shutting down and takes no new requests: send it to another one"
            )
        rid = request.request_id or uuid.uuid4().hex
        problem = request_id_problem(rid)
        error: ServingError | None = None if problem is None else InvalidRequest(problem)
        if error is None and rid in self._in_flight:
            error = DuplicateRequest(f"request id {rid!r} is already in flight; send it with a new id")
        if error is not None:
            metrics.REQUESTS.labels(self.model.name, NONE, NONE, request.api, "error", error.grpc_code).inc()
            raise error
        stream = RequestStream(rid, self.limits.max_buffered_tokens, self._client_wait.observe)
        self._in_flight[rid] = stream
        self._idle.clear()
        metrics.IN_FLIGHT.inc()
        stream.attach(
            asyncio.get_running_loop().create_task(self._run(stream, request), name=f"request-{rid}")
        )
        log.info("request %s accepted (%s)", rid, request.api)
        return stream

    async def prepare(self, request: GenerationRequest) -> tuple[list[int], SamplingParams]:
        """Validates and tokenizes ahead of `submit` (every prompt of a call, before any runs); a failure
        here is counted as a request that ended so."""
        try:
            return await self.validator.prepare(request)
        except ServingError as e:
            metrics.ARRIVALS.labels(self.model.name, request.api).inc()
            metrics.REQUESTS.labels(self.model.name, NONE, NONE, request.api, "error", e.grpc_code).inc()
            raise

    def cancel(self, request_id: str, reason: str) -> bool:
        """Cancels a request in flight, wherever it runs; False if the id is unknown or already ended."""
        if request_id in self.calls:  # the choices of one call (services.gateway.choices)
            self.calls[request_id](reason)
            return True
        stream = self._in_flight.get(request_id)
        return stream.cancel(reason) if stream is not None else False

    def route_of(self, request_id: str) -> Route | None:
        """Where a request in flight runs now (None: unknown, ended, or not routed yet)."""
        job = self._jobs.get(request_id)
        return None if job is None else job.route

    def drain(self) -> None:
        """Takes no new request (`submit` raises Unavailable); those in flight go on."""
        self.draining = True

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Drains: the requests in flight have ``grace_s`` seconds to finish; those still running then
        end with `Unavailable` — an error the client can tell from a normal end (gRPC UNAVAILABLE, an
        HTTP 503 or, mid-stream, an SSE error event), never a finish that looks complete. Their workers
        are told to drop them, as for a cancel."""
        self.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)
        drivers = [s.driver for s in self._in_flight.values() if s.driver is not None]
        if drivers:
            log.warning(
                "shutting down with %d requests in flight: ending them with UNAVAILABLE", len(drivers)
            )
        for stream in list(self._in_flight.values()):
            stream.cancel("shutdown")
        if drivers:
            await asyncio.wait(drivers, timeout=5.0)
        await self.shadows.close()

    # --- one request ---------------------------------------------------------------------------

    async def _run(self, stream: RequestStream, request: GenerationRequest) -> None:
        outcome = "ok"  # ok | cancelled | the error's gRPC code
        reason = ""  # why it was cancelled
        job: Job | None = None
        deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
        try:
            async with asyncio.timeout(request.timeout_s):
                prompt_ids, params = await self.validator.prepare(request)
                job = Job(stream.request_id, prompt_ids, params, deadline, request.api_key)
                job.siblings, job.precharged = request.siblings, request.precharged  # (choices)
                job.client_logprobs = params.logprobs
                self._jobs[job.request_id] = job
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
            if job is not None and job.route is not None:  # the scheduler charged its quotas
                self.router.finish(job.request_id, job.route, len(job.prompt_ids), len(job.sent_ids))
            if job is not None and job.shadow is not None:
                self._end_shadow(stream, job, job.shadow, outcome)
            self._jobs.pop(stream.request_id, None)
            if job is not None and job.aborts:
                try:
                    await asyncio.wait(job.aborts)  # each has its own timeout
                except asyncio.CancelledError:
                    log.info("request %s: left its worker aborts to the background", stream.request_id)
            del self._in_flight[stream.request_id]
            if not self._in_flight:
                self._idle.set()
            metrics.IN_FLIGHT.dec()
            placed = job is not None and job.route is not None
            labels = job.labels if job is not None and placed else (self.model.name, NONE, NONE)
            metrics.count_ended(
                labels, request.api, outcome, reason, stream.finished, job if placed else None
            )

    def _cancelled(self, stream: RequestStream, job: Job | None, reason: str) -> str:
        metrics.CANCELLATIONS.labels(reason).inc()
        log.info("request %s cancelled (%s) after %d tokens", stream.request_id, reason, stream.num_tokens)
        if job is not None and job.route is not None:
            published = self.router.cancel(job.request_id, reason)  # reaches the worker even if our call's
            if published is not None:  # cancellation does not
                job.aborts.append(published)
        if stream.ended:  # the slow-reader error was already set
            return "RESOURCE_EXHAUSTED"
        if reason == "shutdown":  # the system gave up, not the client: an error, not a finish
            err = Unavailable(
                f"request {stream.request_id} was cut after {stream.num_tokens} tokens: the gateway shut down "
                "before it finished; send it again"
            )
            stream.fail(err)
            return err.grpc_code
        stream.finish(self._finished(stream, job, FinishReason.CANCELLED, stream.num_tokens))
        return "cancelled"

    @staticmethod
    def _end_shadow(stream: RequestStream, job: Job, shadow: ShadowRun, outcome: str) -> None:
        """Tells the request's shadow how the primary ended: compare with what the client got, or stop."""
        if outcome == "ok":
            ttft_s = (stream.first_token_at or stream.accepted_at) - stream.accepted_at
            shadow.primary_finished(
                PrimaryResult(job.sent_ids, ttft_s, time.perf_counter() - stream.accepted_at, job.shadow_top)
            )
        else:
            shadow.cancel("cancelled" if outcome == "cancelled" else "primary_failed")

    async def _execute(self, stream: RequestStream, job: Job) -> None:
        """Routes the request and runs it; a worker that fails is excluded and the request routed again,
        going on from what the client already has."""
        route = await self._route(job)
        job.dispatched_at = time.perf_counter()
        if route.shadow_worker:
            compared = with_top_logprobs(job.params)
            job.shadow = self.shadows.start(
                ShadowRequest(
                    job.request_id,
                    job.prompt_ids,
                    compared,
                    route.cache_salt,
                    route.shadow_worker,
                    route.shadow_version,
                    route.version,
                    self.model.name,
                )
            )
            if job.shadow is not None:
                job.params = compared  # the primary returns the same top logprobs as its shadow
        while True:
            try:
                await self._attempt(stream, job, route)
                return
            except ServingError as e:
                if not await self._may_retry(job, e):
                    raise
                log.warning(
                    "request %s: %s failed on %s after %d tokens (%s); routing again without it",
                    job.request_id,
                    job.stage,
                    job.failed[-1],
                    len(job.sent_ids),
                    e.message,
                )
            if len(job.sent_ids) >= job.params.max_tokens:  # the last token arrived, its finish did not
                stream.finish(self._finished(stream, job, FinishReason.LENGTH, len(job.sent_ids)))
                return
            route = await self._route(job)

    async def _route(self, job: Job) -> Route:
        query = RouteQuery(
            job.request_id,
            [*job.prompt_ids, *job.sent_ids],
            job.params.max_tokens - len(job.sent_ids),
            api_key=job.api_key,
            model=self.model.name,
            exclude=tuple(job.failed),
            resume=job.route is not None or job.precharged,
            timeout_s=job.remaining_s(),
            siblings=job.siblings if job.route is None else (),
        )
        route = job.route = await self.router.route(query)
        if job.itl is None:  # the first placement names the version and tenant
            job.labels = (
                self.model.name,
                route.version or self.model.version,
                self.tenant_label(route.tenant),
            )
            job.itl = metrics.ITL.labels(*job.labels[:2])
        log.info(
            "request %s placed: prefill=%s decode=%s prompt_tokens=%d resume_tokens=%d version=%s shadow=%s",
            job.request_id,
            route.prefill or "local",
            route.decode,
            len(job.prompt_ids),
            len(job.sent_ids),
            route.version or "-",
            route.shadow_worker or "-",
        )
        return route

    async def _may_retry(self, job: Job, error: ServingError) -> bool:
        """Whether a failed attempt may go on elsewhere; if so, which worker to leave behind."""
        if not isinstance(error, WorkerLost | KVTransferFailed) or job.route is None:
            return False
        failed = job.worker
        if job.stage == "transfer":  # D never streamed: one fresh prefill, without whichever failed
            if job.kv_retries >= MAX_KV_RETRIES:
                return False
            job.kv_retries += 1
            metrics.KV_TRANSFER_RETRIES.inc()
            if (
                job.route.prefill is not None
                and not isinstance(error, WorkerDraining)  # D gave it back, however well it answers
                and (isinstance(error, KVTransferFailed) or await self._answers(failed))
            ):
                failed = job.route.prefill  # D is alive: the pull failed on P's side (e.g. its lease expired)
        elif job.stage == "decode" and job.sent_ids:  # a migration: D died mid-stream
            if job.migrations >= self.limits.max_migrations:
                return False
            job.migrations += 1
            metrics.MIGRATIONS.inc()
        else:  # nothing streamed from this worker yet
            if job.retries >= MAX_WORKER_RETRIES:
                return False
            job.retries += 1
            metrics.WORKER_RETRIES.labels(job.stage).inc()
        job.failed.append(failed)
        return True

    async def _answers(self, address: str) -> bool:
        try:
            await self.workers.info(address, timeout_s=1.0)
        except ServingError:
            return False
        return True

    async def _attempt(self, stream: RequestStream, job: Job, route: Route) -> None:
        if route.prefill is not None and len(job.sent_ids) <= 1:
            handle = await self._prefill(stream, job, route.prefill)
            if handle is not None:
                await self._handoff(stream, job, route.prefill, route.decode, handle)
            return
        # A decode worker alone: it prefills the prompt, and on a migration recomputes what was sent.
        job.stage, job.worker = "decode", route.decode
        await self._decode(stream, job, route.decode)

    async def _prefill(self, stream: RequestStream, job: Job, address: str) -> KVHandle | None:
        """Prefill on P; the first token goes to the client at once (unless it has it from an earlier
        attempt). Returns the KV handle, or None when that token already ended the request."""
        assert job.route is not None
        job.stage, job.worker = "prefill", address
        try:
            r = await self.workers.prefill(address, self._leg(job, prefill=True))
        except asyncio.CancelledError:
            # The prefill may have finished (and leased its blocks) as we cancelled: release them.
            job.abort_on(self.workers, address)
            raise
        job.prefill_ms += r.prefill_ms
        job.cached_tokens = r.cached_tokens
        if not job.sent_ids:
            self._push(stream, job, r.first)
        if r.finish_reason is not None or r.handle is None:
            if r.handle is not None:
                job.abort_on(self.workers, address)
            reason = r.finish_reason or FinishReason.STOP
            stream.finish(self._finished(stream, job, reason, max(1, r.completion_tokens), r.stop_reason))
            return None
        ttl_s = job.route.lease_ttl_s or max(0.0, r.handle.expires_at - time.time())
        job.lease = LeaseReport(
            r.handle.lease_id, job.request_id, address, job.route.decode, len(r.handle.block_ids), ttl_s
        )
        self.router.report_lease("pinned", job.lease)
        return r.handle

    @staticmethod
    def _leg(job: Job, prefill: bool = False) -> Leg:
        r = job.route
        assert r is not None
        epoch = r.prefill_epoch if prefill else r.decode_epoch  # that worker's registration (fencing)
        return Leg(job.request_id, job.prompt_ids, job.params, r.cache_salt, job.remaining_s(), epoch)

    async def _handoff(
        self, stream: RequestStream, job: Job, prefill_at: str, decode_at: str, handle: KVHandle
    ) -> None:
        """Decode on D from P's KV, continuing after the first token the client already has."""
        job.stage, job.worker = "transfer", decode_at
        try:
            await self._decode(stream, job, decode_at, handle)
        except ServingError:
            if job.lease is not None:  # D never took it; freed before a retry reuses the request id on P
                await self.workers.abort(prefill_at, job.request_id)
                self._end_lease(job, "aborted")
            raise
        except BaseException:
            if job.lease is not None:
                job.abort_on(self.workers, prefill_at)
                self._end_lease(job, "aborted")
            raise

    def _end_lease(self, job: Job, event: LeaseEvent) -> None:
        if job.lease is not None:
            self.router.report_lease(event, job.lease)
            job.lease = None

    async def _decode(
        self, stream: RequestStream, job: Job, address: str, handle: KVHandle | None = None
    ) -> None:
        """Streams D's tokens to the client. With a handle D pulls the KV and starts after the first
        token; without one it prefills, and first recomputes every token the client already has."""
        resumed = bool(job.sent_ids) and handle is None
        legs = self.workers.decode(
            address,
            self._leg(job),
            handle,
            job.sent_ids[0] if handle is not None else None,
            job.sent_ids if resumed else (),
        )
        async with contextlib.aclosing(legs) as events:
            async for event in events:
                if isinstance(event, Delta):
                    self._end_lease(job, "released")  # D streams only once it has pulled the KV
                    job.stage = "decode"
                    if event.token_ids or event.text:
                        self._push(stream, job, event)
                    continue
                job.transfer_ms += event.transfer_ms
                job.decode_ms += event.decode_ms
                job.prefill_ms += event.prefill_ms
                if handle is None and not resumed:
                    job.cached_tokens = event.cached_tokens
                completion_tokens = event.completion_tokens or stream.num_tokens
                stream.finish(
                    self._finished(stream, job, event.finish_reason, completion_tokens, event.stop_reason)
                )

    def _push(self, stream: RequestStream, job: Job, delta: Delta) -> None:
        job.sent_ids.extend(delta.token_ids)
        if job.shadow is not None:  # the comparison's logprobs: kept here, trimmed for the client
            job.shadow_top.extend(lp.top for lp in delta.logprobs)
            delta = as_asked(delta, job.client_logprobs)
        if delta.prompt_logprobs is not None:  # sent once: a retry or a migration computes them again
            if job.prompt_logprobs_sent:
                delta = Delta(delta.token_ids, delta.text, delta.logprobs)
            job.prompt_logprobs_sent = True
        stream.push(delta)
        if delta.token_ids:
            now = time.perf_counter()
            if job.last_token_at and job.itl is not None:
                job.itl.observe(now - job.last_token_at)
            job.last_token_at = now

    def _finished(
        self,
        stream: RequestStream,
        job: Job | None,
        reason: FinishReason,
        completion_tokens: int,
        stop_reason: str = "",
    ) -> Finished:
        now = time.perf_counter()
        e2e_s = now - stream.accepted_at
        ttft = (stream.first_token_at - stream.accepted_at) * 1e3 if stream.first_token_at else 0.0
        if job is None:
            return Finished(reason, Usage(0, completion_tokens), Timings(ttft_ms=ttft, e2e_ms=e2e_s * 1e3))
        queue_ms = (job.dispatched_at - stream.accepted_at) * 1e3 if job.dispatched_at else e2e_s * 1e3
        timings = Timings(queue_ms, job.prefill_ms, job.transfer_ms, job.decode_ms, ttft, e2e_s * 1e3)
        log.info(
            "request %s finished: %s prompt=%d completion=%d ttft=%.1fms e2e=%.1fms migrations=%d",
            job.request_id,
            reason,
            len(job.prompt_ids),
            completion_tokens,
            ttft,
            e2e_s * 1e3,
            job.migrations,
        )
        return Finished(
            reason, Usage(len(job.prompt_ids), completion_tokens, job.cached_tokens), timings, stop_reason
        )
