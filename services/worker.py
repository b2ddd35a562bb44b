"""The worker process: a grpc.aio server around one engine thread, serving `baton.v1.Worker` in the
role prefill, decode or both (plus standard health checking and reflection).

Prefill pins a request's KV blocks under a lease and returns the first token with a `KVHandle`;
Decode pulls those blocks from the prefill worker named in the handle (fetching its transfer metadata
over gRPC once) or prefills locally, then streams tokens. Cancelling a call aborts its request at the
next step and frees its blocks; `Abort` does the same by id. ``GET /metrics`` is served on a port of its
own (`WorkerMetrics`; the engine's state is read on the engine thread only when scraped).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from core.errors import InvalidRequest, KVIncompatible, KVTransferFailed, RequestAborted, ServingError
from core.signals import stop_requested
from decode_worker.handoff import DecodeHandoff
from engine.async_engine import AsyncEngine, OutputStream
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, RequestOutput
from kv_transfer.transport import KVTransport, make_transport
from prefill_worker.handoff import PrefillHandoff, kv_layout
from scheduler.grpc_service import add_servicer
from scheduler.metrics import MetricsEndpoint
from services.convert import (
    FINISH_TO_PB,
    delta_to_pb,
    handle_from_pb,
    handle_to_pb,
    layout_to_pb,
    sampling_from_pb,
)
from services.membership import Membership, RecentCancels, listen_for_cancels
from services.metrics import WorkerMetrics, WorkerStats
from services.status import abort_with
from services.worker_config import WorkerConfig

log = logging.getLogger(__name__)

T = TypeVar("T")
ROLE_TO_PB = {"prefill": worker_pb2.WORKER_ROLE_PREFILL, "decode": worker_pb2.WORKER_ROLE_DECODE,
         "both": worker_pb2.WORKER_ROLE_BOTH}
METADATA_TIMEOUT_S = 5.0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """`baton.v1.Worker` on one engine. Every engine access goes through the engine thread."""

    def __init__(
        self, config: WorkerConfig, aengine: AsyncEngine, transport: KVTransport, address: str,
        prefill: PrefillHandoff | None, decode: DecodeHandoff | None,
    ) -> None:
        self.config = config
        self.aengine = aengine
        self.transport = transport
        self.address = address
        self.prefill = prefill
        self.decode = decode
        self.model_name = config.served_model_name or aengine.engine.model_dir.name
        self._peers: dict[str, asyncio.Future[None]] = {}  # source address → metadata fetched
        self.recent_cancels = RecentCancels()  # filled by the cancellation bus, if this worker listens
        self.metrics = WorkerMetrics(self.model_name, transport.layout.model_digest, config.role, address)

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[LLMEngine], T]) -> T:
        try:
            return await self.aengine.call(fn)
        except ServingError as e:
            await abort_with(context, e)
            raise  # unreachable: abort raises

    # ------------------------------------------------------------------ Prefill
    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> worker_pb2.PrefillResponse:
        handoff = self.prefill
        if handoff is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this worker's role is {self.config.role}")
        assert handoff is not None
        rid, ids, params = await self._parse(context, request.request_id, request.prompt_token_ids, request.sampling)
        t0 = time.monotonic()
        stream = await self._open_stream(context, rid)
        done = ok = False
        try:
            await self._call(context, lambda e: handoff.begin(rid, ids, params, request.cache_salt))
            out, queue_s = await self._final(stream)
            handle = await self._call(context, lambda e: handoff.complete(rid, out))
            done = ok = True
        except ServingError as e:
            done = True
            await abort_with(context, e)
        finally:
            if done:
                self.aengine.close_stream(rid)
            else:  # the caller went away mid-prefill: stop it and free its blocks
                self.aengine.abandon(rid, lambda e: handoff.abort(rid))
            self.metrics.request_ended("prefill", _outcome(context, ok))
        now = time.monotonic()
        self.metrics.queue.observe(queue_s)
        self.metrics.prefill.observe(max(0.0, now - t0 - queue_s))
        resp = worker_pb2.PrefillResponse(
            first=delta_to_pb(out.token_ids[:1], out.text, out.logprobs),
            usage=common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=1, cached_tokens=out.num_cached_tokens),
            prefill_ms=(now - t0) * 1e3,
        )
        if handle is not None:
            resp.handle.CopyFrom(handle_to_pb(handle))
        else:
            resp.finish_reason = FINISH_TO_PB[out.finish_reason or "length"]
            resp.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
        return resp

    async def _open_stream(self, context: grpc.aio.ServicerContext, rid: str) -> OutputStream:
        try:
            return self.aengine.open_stream(rid)
        except ServingError as e:  # the id is in use here: INVALID_ARGUMENT, not an unknown failure
            await abort_with(context, e)
            raise

    async def _final(self, stream: OutputStream) -> tuple[RequestOutput, float]:
        """The request's final output, and how long it waited to be scheduled."""
        queue_s = 0.0
        while True:
            out = await stream.get()
            queue_s = queue_s or out.queue_s
            if out.finished:
                return out, queue_s

    # ------------------------------------------------------------------ Decode
    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        handoff = self.decode
        if handoff is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this worker's role is {self.config.role}")
        assert handoff is not None
        rid, ids, params = await self._parse(context, request.request_id, request.prompt_token_ids, request.sampling)
        t0 = time.monotonic()
        stream = await self._open_stream(context, rid)
        finished = ok = False
        pulled = request.HasField("handle")
        peer = request.handle.source if pulled else ""
        num_bytes = 0
        try:
            if pulled:
                num_bytes = await self._start_pull(context, handoff, rid, ids, request)
            else:
                resume = list(request.resume_token_ids)
                await self._call(context, lambda e: e.add_request(
                    rid, ids, params, cache_salt=request.cache_salt, resume_token_ids=resume))
            t_first: float | None = None
            queue_s = transfer_s = 0.0
            while not finished:
                try:
                    out = await stream.get()
                except ServingError as e:
                    finished = True  # the engine already ended it (slow reader)
                    await abort_with(context, e)
                if out.error is not None:
                    finished = True
                    if isinstance(out.error, KVTransferFailed) and pulled:
                        self._peers.pop(peer, None)  # refetch its metadata next time
                        self.metrics.transfer_failed(peer)
                    await abort_with(context, out.error)
                if out.transfer_s:  # the pull landed
                    transfer_s = out.transfer_s
                    self.metrics.transfer_landed(peer, transfer_s, num_bytes)
                queue_s = queue_s or out.queue_s
                n_new = len(out.new_token_ids)
                msg = worker_pb2.DecodeResponse(delta=delta_to_pb(
                    out.new_token_ids, out.new_text, out.logprobs[-n_new:] if out.logprobs and n_new else None))
                now = time.monotonic()
                if t_first is None and n_new:
                    t_first = now
                    if not pulled:  # prefilled here
                        self.metrics.queue.observe(queue_s)
                        self.metrics.prefill.observe(max(0.0, now - t0 - queue_s))
                if out.finished:
                    finished, ok = True, out.finish_reason != "abort"
                    msg.finish_reason = FINISH_TO_PB[out.finish_reason or "stop"]
                    msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=len(ids), completion_tokens=len(out.token_ids),
                                                        cached_tokens=out.num_cached_tokens))
                    msg.transfer_ms = transfer_s * 1e3
                    msg.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
                    if not pulled and t_first is not None:
                        msg.prefill_ms = (t_first - t0) * 1e3
                    msg.decode_ms = (now - (t_first or now)) * 1e3
                    if ok:
                        self.metrics.decode.observe(now - (t_first or now))
                yield msg
        finally:
            if finished:
                self.aengine.close_stream(rid)
            else:  # cancelled, deadline passed or the client went away
                self.aengine.abandon(rid, lambda e: handoff.abort(rid))
            self.aengine.post(lambda e: handoff.forget(rid))
            self.metrics.request_ended("decode", _outcome(context, ok))

    async def _start_pull(self, context: grpc.aio.ServicerContext, handoff: DecodeHandoff, rid: str,
                          ids: list[int], request: worker_pb2.DecodeRequest) -> int:
        """Starts pulling the handle's blocks; returns the bytes it pulls (the blocks not cached here)."""
        handle = handle_from_pb(request.handle) if request.handle.lease_id else None
        if handle is None or not request.HasField("first_token"):
            await abort_with(context, InvalidRequest("a handoff needs a complete KV handle and the first token"))
        assert handle is not None
        params = sampling_from_pb(request.sampling)
        timeout = request.transfer_timeout_s or self.config.transfer_timeout_s
        try:
            await self._ensure_peer(handle.source)
            num_blocks = await self.aengine.call(lambda e: handoff.start(
                rid, ids, request.first_token, handle, params, timeout_s=timeout, cache_salt=request.cache_salt))
        except ServingError as e:
            if isinstance(e, KVTransferFailed | KVIncompatible):
                self.metrics.transfer_failed(handle.source)
            await abort_with(context, e)
            raise  # unreachable: abort raises
        return num_blocks * self.transport.layout.block_bytes

    async def _ensure_peer(self, source: str) -> None:
        """Fetches a prefill worker's transfer metadata once (concurrent requests share the fetch)."""
        fut = self._peers.get(source)
        if fut is None:
            fut = self._peers[source] = asyncio.ensure_future(self._fetch_peer(source))
        try:
            await asyncio.shield(fut)
        except BaseException:
            if self._peers.get(source) is fut and fut.done():
                del self._peers[source]
            raise

    async def _fetch_peer(self, source: str) -> None:
        decode = self.decode
        assert decode is not None
        try:
            async with grpc.aio.insecure_channel(source) as channel:
                meta = await worker_pb2_grpc.WorkerStub(channel).TransferMetadata(
                    worker_pb2.TransferMetadataRequest(), timeout=METADATA_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise KVTransferFailed(f"cannot fetch KV transfer metadata from {source}: {e.details()}") from e
        await self.aengine.call(lambda e: decode.add_peer(meta.metadata))

    # ------------------------------------------------------------------ Abort, Info, TransferMetadata
    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.AbortResponse:
        rid, asked = request.request_id, time.monotonic()
        return worker_pb2.AbortResponse(found=await self._call(context, lambda e: self.abort_everywhere(e, rid, asked)))

    def abort_everywhere(self, engine: LLMEngine, rid: str, asked: float | None = None) -> bool:
        """Engine thread: stops the request in whatever stage it is here (idempotent). ``asked``: when
        the abort was asked for (monotonic), to time it."""
        found = False
        if self.prefill is not None:
            found = self.prefill.abort(rid) or found
        if self.decode is not None:
            found = self.decode.abort(rid) or found
        found = found or engine.abort_request(rid)
        if found and asked is not None:
            self.metrics.aborted(time.monotonic() - asked)
        return found

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext
                   ) -> worker_pb2.InfoResponse:
        return await self._call(context, self.snapshot)

    def snapshot(self, engine: LLMEngine) -> worker_pb2.InfoResponse:
        """Engine thread: capacity and load (Info, and the heartbeats to the scheduler)."""
        kv = engine.kv
        return worker_pb2.InfoResponse(
            role=ROLE_TO_PB[self.config.role], model=self.model_name, model_digest=self.transport.layout.model_digest,
            max_model_len=engine.max_model_len, num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
            num_pinned_blocks=kv.num_pinned_blocks, num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting), num_transfers=engine.num_transfers,
            num_leases=len(self.prefill.leases) if self.prefill is not None else 0,
            block_size=kv.block_size, kv_backend=type(self.transport).__name__.removesuffix("Transport").lower(),
            address=self.address,
        )

    def stats(self, engine: LLMEngine) -> WorkerStats:
        """Engine thread: what a scrape of /metrics shows of the engine (plain reads, no locks)."""
        kv, sched, p = engine.kv, engine.scheduler, self.prefill
        return WorkerStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_transfers=engine.num_transfers,
            num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks, num_pinned_blocks=kv.num_pinned_blocks,
            num_leases=len(p.leases) if p is not None else 0, prefix_query_tokens=kv.stats.num_query_tokens,
            prefix_hit_tokens=kv.stats.num_hit_tokens, prefix_evictions=kv.stats.num_evictions,
            preemptions=sched.num_preemptions, steps=self.aengine.num_steps,
            scheduled_tokens=engine.num_scheduled_tokens, sampled_tokens=engine.num_sampled_tokens,
            slow_reader_aborts=self.aengine.num_slow_reader_aborts,
            leases_released=p.num_released if p is not None else 0,
            leases_expired=p.num_expired if p is not None else 0,
            leases_aborted=p.num_aborted if p is not None else 0,
        )

    async def refresh_metrics(self) -> None:
        self.metrics.engine.stats = await self.aengine.call(self.stats)

    async def TransferMetadata(self, request: worker_pb2.TransferMetadataRequest,
                               context: grpc.aio.ServicerContext) -> worker_pb2.TransferMetadataResponse:
        meta = await self._call(context, lambda e: self.transport.metadata())
        layout = self.transport.layout
        return worker_pb2.TransferMetadataResponse(
            backend=type(self.transport).__name__.removesuffix("Transport").lower(), name=self.transport.name,
            metadata=meta, compat_hash=layout.compat_hash, layout=layout_to_pb(layout))

    def post_abort(self, rid: str) -> None:
        """An abort from the cancellation bus: queued for the engine thread, timed."""
        asked = time.monotonic()
        self.aengine.post(lambda e: self.abort_everywhere(e, rid, asked))

    # ------------------------------------------------------------------ input
    async def _parse(self, context: grpc.aio.ServicerContext, rid: str, ids: Any, sampling: Any
                     ) -> tuple[str, list[int], Any]:
        try:
            if not rid:
                raise InvalidRequest("request_id is required")
            if not ids:
                raise InvalidRequest("prompt_token_ids must not be empty")
            if rid in self.recent_cancels:  # the cancel overtook the request
                raise RequestAborted(f"request {rid} was cancelled before it arrived")
            return rid, list(ids), sampling_from_pb(sampling)
        except ServingError as e:
            await abort_with(context, e)
            raise


@dataclass(slots=True)
class WorkerServer:
    """A running worker: its gRPC server, engine thread and transport."""

    server: grpc.aio.Server
    aengine: AsyncEngine
    transport: KVTransport
    health: HealthServicer
    address: str
    membership: Membership | None = None
    stop_bus: Callable[[], Awaitable[object]] | None = None
    metrics_endpoint: MetricsEndpoint | None = None

    @property
    def metrics_url(self) -> str:
        return self.metrics_endpoint.url if self.metrics_endpoint is not None else ""

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.membership is not None:
            await self.membership.stop()  # placement stops sending work here first
        if self.stop_bus is not None:
            await self.stop_bus()
        if self.metrics_endpoint is not None:
            await self.metrics_endpoint.stop()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        self.aengine.stop()
        self.transport.close()


async def serve_worker(config: WorkerConfig) -> WorkerServer:
    """Loads the engine, binds the port, registers the KV cache, and starts serving (health SERVING)."""
    engine_config = EngineConfig(model=config.model, kv_cache_memory=config.kv_cache_memory,
                                 dtype=config.dtype, quantization=config.quantization,
                                 block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                                 max_num_batched_tokens=config.max_num_batched_tokens,
                                 long_prefill_chunk=config.long_prefill_chunk,
                                 heavy_prefill_chunk=config.heavy_prefill_chunk or 0,
                                 mixed_prefill_tokens=config.mixed_prefill_tokens, num_threads=config.threads)
    # Every torch op, the engine's construction and the KV cache's registration included, runs on the
    # engine thread (see AsyncEngine.launch).
    aengine = await AsyncEngine.launch(lambda: LLMEngine(engine_config), config.max_pending_outputs)
    try:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        port = server.add_insecure_port(f"{config.host}:{config.port}")
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        address = f"{config.host}:{port}"
        transport = make_transport(config.kv_transport, address, kv_layout(aengine.engine))
        prefill, decode = await aengine.call(lambda engine: (
            PrefillHandoff(engine, transport, config.lease_ttl_s) if config.role in ("prefill", "both") else None,
            DecodeHandoff(engine, transport) if config.role in ("decode", "both") else None))
    except BaseException:
        aengine.stop()
        raise
    engine = aengine.engine
    if prefill is not None:
        aengine.service_hooks.append(prefill.service)
    servicer = WorkerServicer(config, aengine, transport, address, prefill, decode)
    aengine.on_abort = servicer.metrics.aborted
    add_servicer(servicer, server, worker_pb2.DESCRIPTOR.services_by_name["Worker"])  # malformed → INVALID_ARGUMENT
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name, "grpc.health.v1.Health",
         reflection.SERVICE_NAME], server)
    await server.start()
    for name in ("", "baton.v1.Worker"):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    worker = WorkerServer(server, aengine, transport, health, address)
    if config.metrics_port is not None:
        endpoint = MetricsEndpoint(servicer.metrics.registry, servicer.refresh_metrics)
        try:
            await endpoint.start(config.host, config.metrics_port)
        except OSError:
            await worker.stop(0)
            raise
        worker.metrics_endpoint = endpoint
    if config.redis_url:
        worker.stop_bus = await listen_for_cancels(
            config.redis_url, lambda rid: servicer.post_abort(rid), servicer.recent_cancels)
    if config.scheduler:
        worker.membership = Membership(config.scheduler, aengine, servicer.snapshot, config.role)
        worker.membership.start()
    log.info("worker ready: role=%s address=%s model=%s kv=%s metrics=%s", config.role, address, engine.model_dir,
             type(transport).__name__, worker.metrics_url or "off")
    return worker


async def serve_until_signal(config: WorkerConfig) -> None:
    """`baton worker`: serves until SIGINT or SIGTERM, then stops cleanly."""
    stop = stop_requested()
    worker = await serve_worker(config)
    print(f"baton worker ({config.role}) serving on {worker.address}", flush=True)
    if worker.metrics_url:
        print(f"baton worker ({config.role}) metrics on {worker.metrics_url}", flush=True)
    await stop.wait()
    log.info("worker %s stopping", worker.address)
    await worker.stop()


def _outcome(context: grpc.aio.ServicerContext, ok: bool) -> str:
    """A call's ``outcome`` label: ok, cancelled (the caller went away), or the status it ended with."""
    if ok:
        return "ok"
    code = context.code()
    if code is None:
        return "cancelled"
    return code.name if isinstance(code, grpc.StatusCode) else str(code)
