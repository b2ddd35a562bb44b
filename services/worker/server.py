"""The worker process: a grpc.aio server around one engine thread, serving `baton.v1.Worker` in the
role prefill, decode or both (plus standard health checking and reflection).

Prefill (`prefill_worker.rpc`) pins a request's KV blocks under a lease and returns the first token with
a `KVHandle`; Decode (`decode_worker.rpc`) pulls those blocks from the prefill worker named in the
handle or prefills locally, then streams tokens; the handlers share a `WorkerShell`. Cancelling a call aborts its request at the
next step and frees its blocks; `Abort` does the same by id. ``GET /metrics`` is served on a port of its
own (`WorkerMetrics`; the engine's state is read on the engine thread only when scraped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from baton.v1 import worker_pb2, worker_pb2_grpc
from core.errors import RoleMismatch, WorkerDraining
from decode_worker.handoff import DecodeHandoff
from decode_worker.rpc import DecodeRPC
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from kv_transfer.transport import KVTransport, make_transport
from prefill_worker.handoff import PrefillHandoff, kv_layout
from prefill_worker.rpc import PrefillRPC
from rpc.convert import layout_to_pb
from rpc.liveness import SERVER_OPTIONS, shutdown_step
from rpc.metrics import MetricsEndpoint
from rpc.servicer import add_servicer
from rpc.signals import stop_requested
from rpc.tls import add_port
from services.worker.config import WorkerConfig
from services.worker.membership import Membership, listen_for_cancels
from services.worker.metrics import WorkerMetrics, WorkerStats
from services.worker.shell import WorkerShell

log = logging.getLogger(__name__)


ROLE_TO_PB = {
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
    "both": worker_pb2.WORKER_ROLE_BOTH,
}


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """`baton.v1.Worker` on one engine: `Prefill` by the prefill role (`prefill_worker.rpc`), `Decode` by
    the decode role (`decode_worker.rpc`), and what every worker answers: Abort, Info, TransferMetadata."""

    def __init__(
        self, shell: WorkerShell, prefill: PrefillHandoff | None, decode: DecodeHandoff | None
    ) -> None:
        self.shell = shell
        self.prefill = prefill
        self.decode = decode
        self.prefill_rpc = PrefillRPC(shell, prefill) if prefill is not None else None
        self.decode_rpc = DecodeRPC(shell, decode) if decode is not None else None

    @property
    def metrics(self) -> WorkerMetrics:
        return self.shell.metrics

    def _wrong_role(self) -> RoleMismatch:
        return RoleMismatch(f"this worker's role is {self.shell.config.role}")

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        if self.prefill_rpc is None:
            raise self._wrong_role()
        return await self.prefill_rpc.prefill(request, context)

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        if self.decode_rpc is None:
            raise self._wrong_role()
        async with contextlib.aclosing(self.decode_rpc.decode(request, context)) as responses:
            async for response in responses:  # its finally runs when the call ends, not at collection
                yield response

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        rid, asked = request.request_id, time.monotonic()
        return worker_pb2.AbortResponse(
            found=await self.shell.call(lambda e: self.abort_everywhere(e, rid, asked))
        )

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

    async def Info(
        self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.InfoResponse:
        return await self.shell.call(self.snapshot)

    def snapshot(self, engine: LLMEngine) -> worker_pb2.InfoResponse:
        """Engine thread: capacity and load (Info, and the heartbeats to the scheduler)."""
        kv, shell = engine.kv, self.shell
        return worker_pb2.InfoResponse(
            role=ROLE_TO_PB[shell.config.role],
            model=shell.model_name,
            model_digest=shell.transport.layout.model_digest,
            max_model_len=engine.max_model_len,
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_pinned_blocks=kv.num_pinned_blocks,
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_transfers=self._num_pulls(),
            num_leases=len(self.prefill.leases) if self.prefill is not None else 0,
            block_size=kv.block_size,
            kv_backend=_backend(shell.transport),
            address=shell.address,
            num_queued_tokens=engine.scheduler.num_queued_prompt_tokens,
        )

    def stats(self, engine: LLMEngine) -> WorkerStats:
        """Engine thread: what a scrape of /metrics shows of the engine (plain reads, no locks)."""
        kv, sched, p, aengine = engine.kv, engine.scheduler, self.prefill, self.shell.aengine
        return WorkerStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_transfers=self._num_pulls(),
            num_blocks=kv.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_pinned_blocks=kv.num_pinned_blocks,
            num_leases=len(p.leases) if p is not None else 0,
            prefix_query_tokens=kv.stats.num_query_tokens,
            prefix_hit_tokens=kv.stats.num_hit_tokens,
            prefix_evictions=kv.stats.num_evictions,
            preemptions=sched.num_preemptions,
            steps=aengine.num_steps,
            scheduled_tokens=engine.num_scheduled_tokens,
            sampled_tokens=engine.num_sampled_tokens,
            slow_reader_aborts=aengine.num_slow_reader_aborts,
            leases_released=p.num_released if p is not None else 0,
            leases_expired=p.num_expired if p is not None else 0,
            leases_aborted=p.num_aborted if p is not None else 0,
            kv_transfer_refused=self.shell.transport.refused,
        )

    def _num_pulls(self) -> int:
        return self.decode.pulls.num_pulls if self.decode is not None else 0

    async def refresh_metrics(self) -> None:
        self.metrics.engine.stats = await self.shell.aengine.call(self.stats)

    async def TransferMetadata(
        self, request: worker_pb2.TransferMetadataRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.TransferMetadataResponse:
        transport = self.shell.transport
        meta = await self.shell.call(lambda e: transport.metadata())
        return worker_pb2.TransferMetadataResponse(
            backend=_backend(transport),
            name=transport.name,
            metadata=meta,
            compat_hash=transport.layout.compat_hash,
            layout=layout_to_pb(transport.layout),
        )

    def busy(self, engine: LLMEngine) -> bool:
        """Engine thread: anything in flight here — requests running or waiting, pulls, leases held."""
        leases = self.prefill is not None and bool(self.prefill.leases)
        return engine.has_unfinished or self._num_pulls() > 0 or leases

    def hand_back(self, engine: LLMEngine) -> tuple[int, int]:
        """Engine thread, at the end of a drain: every request still here ends with `WorkerDraining`
        (its gateway continues it on another worker, from the tokens its client has) and the leases no
        decode worker pulled are given up. Returns (requests, leases)."""
        err = WorkerDraining(
            f"worker {self.shell.address} is shutting down; the request continues on another worker"
        )
        requests = self.shell.aengine.end_streams(err, lambda rid: self.abort_everywhere(engine, rid))
        leases = self.prefill.give_up_leases() if self.prefill is not None else 0
        return requests, leases

    async def fence(self, epoch: int) -> None:
        """This worker was fenced out of registration ``epoch`` (`Membership`): from now on a call placed
        on that registration is refused (`WorkerFenced`), before the worker registers again. What a
        gateway gave up while the worker was away ended with its call (a broken connection cancels the
        call; the request is aborted and its blocks freed) and its leases expire in the scheduler's
        ledger (the reaper frees them here); a call whose gateway still waits on it goes on — a worker
        that was only starved for a while keeps serving its live streams."""
        self.shell.fenced_epoch = max(self.shell.fenced_epoch, epoch)
        self.metrics.fenced.inc()
        running = await self.shell.call(lambda e: len(e.scheduler.running) + len(e.scheduler.waiting))
        log.warning(
            "fenced out of epoch %d: calls placed on it are refused; %d requests whose callers are still "
            "connected go on",
            epoch,
            running,
        )

    def post_abort(self, rid: str) -> None:
        """An abort from the cancellation bus: queued for the engine thread, timed."""
        asked = time.monotonic()
        self.shell.aengine.post(lambda e: self.abort_everywhere(e, rid, asked))


def _backend(transport: KVTransport) -> str:
    return type(transport).__name__.removesuffix("Transport").lower()


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

    servicer: WorkerServicer | None = None

    @property
    def metrics_url(self) -> str:
        return self.metrics_endpoint.url if self.metrics_endpoint is not None else ""

    async def drain(self, timeout_s: float) -> str:
        """What SIGTERM starts: the health check says NOT_SERVING and the worker leaves placement at
        once, and takes no new request; the work in flight has ``timeout_s`` seconds to finish. What is
        still here then is handed back (`WorkerServicer.hand_back`): a decode stream continues
        token-exactly on another decode worker, a lease nobody pulled is given up. `stop` follows.
        Returns what it did, in a line."""
        assert self.servicer is not None
        servicer, started = self.servicer, time.monotonic()
        servicer.shell.draining = True
        for name in ("", "baton.v1.Worker"):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self.membership is not None:
            await self.membership.drain()
        deadline = started + timeout_s
        while await self.aengine.call(servicer.busy) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        requests, leases = await self.aengine.call(servicer.hand_back)
        settle_by = time.monotonic() + 2.0  # the aborts are applied at the next step; cancelled pulls settle
        while await self.aengine.call(servicer.busy) and time.monotonic() < settle_by:
            await asyncio.sleep(0.02)
        used, total = await self.aengine.call(
            lambda e: (e.kv.num_blocks - e.kv.num_free_blocks, e.kv.num_blocks)
        )
        if requests:  # let their last messages and the error reach the gateways before the server stops
            await asyncio.sleep(0.2)
        return (
            f"drained in {time.monotonic() - started:.1f} s: {requests} requests handed back, {leases} leases "
            f"given up, {used} of {total} KV blocks in use"
        )

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.membership is not None:  # placement stops sending work here first
            await shutdown_step("leaving the scheduler", self.membership.stop(), 5.0)
        if self.stop_bus is not None:
            await shutdown_step("the cancellation bus", self.stop_bus(), 5.0)
        if self.metrics_endpoint is not None:
            await shutdown_step("the metrics endpoint", self.metrics_endpoint.stop(), 5.0)
        await shutdown_step("the health service", self.health.enter_graceful_shutdown(), 5.0)
        await shutdown_step("the gRPC server", self.server.stop(grace_s), grace_s + 5.0)
        self.aengine.stop()
        self.transport.close()


async def serve_worker(config: WorkerConfig) -> WorkerServer:
    """Loads the engine, binds the port, registers the KV cache, and starts serving (health SERVING)."""
    # Every torch op, the engine's construction and the KV cache's registration included, runs on the
    # engine thread (see AsyncEngine.launch).
    aengine = await AsyncEngine.launch(lambda: LLMEngine(config.engine), config.max_pending_outputs)
    try:
        tls = config.tls.load()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *SERVER_OPTIONS])
        port = add_port(server, f"{config.host}:{config.port}", tls)  # mutual TLS if configured
        if port == 0:
            raise OSError(f"cannot bind {config.host}:{config.port}")
        address = f"{config.advertise_host or config.host}:{port}"
        transport = make_transport(
            config.kv_transport, address, kv_layout(aengine.engine), config.host, config.advertise_host
        )
        prefill, decode = await aengine.call(
            lambda engine: (
                PrefillHandoff(engine, transport, config.lease_ttl_s)
                if config.role in ("prefill", "both")
                else None,
                DecodeHandoff(engine, transport) if config.role in ("decode", "both") else None,
            )
        )
    except BaseException:
        aengine.stop()
        raise
    engine = aengine.engine
    if prefill is not None:
        aengine.service_hooks.append(prefill.service)
    servicer = WorkerServicer(WorkerShell(config, aengine, transport, address, tls), prefill, decode)
    aengine.on_abort = servicer.metrics.aborted
    add_servicer(
        servicer, server, worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    )  # malformed → INVALID_ARGUMENT
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [
            worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name,
            "grpc.health.v1.Health",
            reflection.SERVICE_NAME,
        ],
        server,
    )
    await server.start()
    for name in ("", "baton.v1.Worker"):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    worker = WorkerServer(server, aengine, transport, health, address, servicer=servicer)
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
            config.redis_url, lambda rid: servicer.post_abort(rid), servicer.shell.recent_cancels
        )
    if config.scheduler:
        worker.membership = Membership(
            config.scheduler, aengine, servicer.snapshot, config.role, tls, on_fenced=servicer.fence
        )
        worker.membership.start()
    log.info(
        "worker ready: role=%s address=%s model=%s kv=%s metrics=%s",
        config.role,
        address,
        engine.model_dir,
        type(transport).__name__,
        worker.metrics_url or "off",
    )
    return worker


async def serve_until_signal(config: WorkerConfig) -> None:
    """`baton worker`: serves until SIGINT or SIGTERM, then stops cleanly."""
    stop = stop_requested()
    worker = await serve_worker(config)
    print(f"baton worker ({config.role}) serving on {worker.address}", flush=True)
    if worker.metrics_url:
        print(f"baton worker ({config.role}) metrics on {worker.metrics_url}", flush=True)
    await stop.wait()
    log.info("worker %s draining (up to %g s)", worker.address, config.drain_timeout_s)
    print(f"baton worker ({config.role}) {await worker.drain(config.drain_timeout_s)}", flush=True)
    await worker.stop()
