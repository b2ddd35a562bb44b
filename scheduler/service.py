"""The scheduler service: stateless gRPC replicas over Redis (`baton.v1.Scheduler`).

`SchedulerServicer` is the gRPC surface of one replica; the work is done by its parts:

- `scheduler.placing.Decider`: `Place`, the one call a gateway makes per request;
- `scheduler.calls.serve_calls`: the gateway's `Calls` stream, which carries `Place`, `Finish`,
  `ReportLease` and `Cancel`;
- `scheduler.lookups.Lookups`: tenants and the model catalog, cached per replica;
- `scheduler.rollout.RolloutAdmin`: `ListModelVersions`, `SetRollout` and `ReportShadow`;
- `scheduler.reaper.Reaper`: expires overdue leases and tells their prefill worker to free the blocks.

Workers register and heartbeat here; the registry evicts those that stop. A handler raises its
`ServingError`: `rpc.servicer.add_servicer` (`scheduler.server`) ends the call with its status.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import redis.asyncio as aioredis

from baton.v1 import scheduler_pb2 as pb
from baton.v1 import scheduler_pb2_grpc
from core.errors import InvalidRequest
from scheduler.calls import Handler, serve_calls, unless_store_down
from scheduler.cancel import CancellationBus
from scheduler.config import ClusterSchedulerConfig
from scheduler.fairness import FairQueue
from scheduler.leases import LeaseLedger
from scheduler.lookups import Lookups
from scheduler.placement import PlacementPolicy, Placer
from scheduler.placing import Decider, prompt_hashes
from scheduler.quota import QuotaLedger
from scheduler.reaper import Reaper
from scheduler.redis_pipe import RedisPipe
from scheduler.registry import WorkerLoad, WorkerRecord, WorkerRegistry
from scheduler.rollout import RolloutAdmin
from scheduler.snapshot import RegistrySnapshot
from scheduler.tenants import TenantDirectory
from scheduler.versions import ModelCatalog

# Imported from here by other packages: the replica's configuration, and the prompt's hash chain.
__all__ = ["ClusterSchedulerConfig", "SchedulerServicer", "prompt_hashes"]

T = TypeVar("T")


def _redis_errors_unavailable(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]:
    """A unary RPC (registration, heartbeats, the operator's calls) whose Redis errors end it UNAVAILABLE,
    as for the per-request calls: never grpc's UNKNOWN or INTERNAL during an outage."""

    @functools.wraps(method)
    async def rpc(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        return await unless_store_down(method(self, request, context))

    return rpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):  # type: ignore[misc]  # generated, untyped
    """One replica; every piece of shared state lives in Redis."""

    def __init__(
        self, config: ClusterSchedulerConfig, client: aioredis.Redis, pipe: RedisPipe | None = None
    ) -> None:
        self.config = config
        p = config.prefix
        self.registry = WorkerRegistry(client, p, config.heartbeat_timeout_s)
        self.catalog = ModelCatalog(client, p)
        self.tenants = TenantDirectory(client, p, default_tenant=config.default_tenant)
        self.quota = QuotaLedger(
            client, p, pipe=pipe
        )  # per-request scripts (quota, leases) on the pipe if given
        self.queue = FairQueue(client, p, burst_credit_tokens=config.burst_credit_tokens)
        self.leases = LeaseLedger(client, p, pipe=pipe)
        self.bus = CancellationBus(client, p)
        self.placer = Placer(
            PlacementPolicy(
                local_prefill_threshold=config.local_prefill_threshold,
                max_prefill_queue=config.max_prefill_queue,
                max_decode_queue=config.max_decode_queue,
                local_when_prefill_full=config.local_when_prefill_full,
                light_local_max_tokens=config.light_local_max_tokens,
            )
        )
        self.snapshot = RegistrySnapshot(self.registry)
        self.lookups = Lookups(config, self.tenants, self.catalog)
        self.decider = Decider(
            config, self.placer, self.lookups, self.snapshot, self.registry, self.quota, self.queue, client
        )
        self.rollout = RolloutAdmin(self.catalog, self.registry, self.lookups)
        self.reaper = Reaper(config, self.lookups, self.decider, self.leases, self.registry)
        # What each call on the `Calls` stream runs: the unary calls' own code.
        self._stream_handlers: dict[str, Handler] = {
            "place": self.decider.place,
            "finish": self._finish,
            "report_lease": self._report_lease,
            "cancel": self._cancel,
        }

    @property
    def waiting_here(self) -> int:
        """Place calls of this replica waiting in the fair queue now."""
        return self.decider.waiting_here

    @property
    def waiting_for(self) -> dict[str, int]:
        """Of those, how many found no room in each pool (prefill, decode) at their last look."""
        return dict(self.decider.waiting_for)

    # ------------------------------------------------------------------ the per-request calls
    async def Place(self, request: pb.PlaceRequest, context: grpc.aio.ServicerContext) -> pb.PlaceResponse:
        return await unless_store_down(self.decider.place(request))

    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext) -> pb.FinishResponse:
        return await unless_store_down(self._finish(request))

    async def _finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        tenant = await self.lookups.tenant_named(request.tenant)
        if tenant is not None:
            await self.quota.finish(
                tenant, request.request_id, request.prompt_tokens, request.completion_tokens
            )
        return pb.FinishResponse()

    async def Cancel(
        self, request: pb.SchedulerCancelRequest, context: grpc.aio.ServicerContext
    ) -> pb.SchedulerCancelResponse:
        return await unless_store_down(self._cancel(request))

    async def _cancel(self, request: pb.SchedulerCancelRequest) -> pb.SchedulerCancelResponse:
        return pb.SchedulerCancelResponse(
            first=await self.bus.cancel(request.request_id, request.reason or "client")
        )

    async def ReportLease(
        self, request: pb.ReportLeaseRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportLeaseResponse:
        return await unless_store_down(self._report_lease(request))

    async def _report_lease(self, request: pb.ReportLeaseRequest) -> pb.ReportLeaseResponse:
        if request.event == pb.LEASE_EVENT_PINNED:
            ttl = request.ttl_s or self.config.lease_ttl_s
            lease = await self.leases.create(
                request.lease_id,
                request.request_id,
                request.prefill_worker,
                request.decode_worker,
                request.num_blocks,
                ttl,
            )
            return pb.ReportLeaseResponse(applied=lease is not None)
        if request.event == pb.LEASE_EVENT_RELEASED:
            return pb.ReportLeaseResponse(applied=await self.leases.release(request.lease_id))
        if request.event == pb.LEASE_EVENT_ABORTED:
            return pb.ReportLeaseResponse(applied=await self.leases.abort(request.lease_id))
        raise InvalidRequest("a lease report needs an event")

    def Calls(
        self, batches: AsyncIterator[pb.SchedulerCalls], context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.SchedulerReplies, None]:
        """The same calls on one stream (`scheduler.calls.serve_calls`)."""
        return serve_calls(batches, self._stream_handlers, orphans=self.quota)

    # ------------------------------------------------------------------ workers
    @_redis_errors_unavailable
    async def RegisterWorker(
        self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterWorkerResponse:
        w = request.worker
        record = WorkerRecord(
            w.address,
            w.role,
            w.model,
            w.version,
            w.address,  # ServingError: its status
            w.num_blocks,
            w.block_size,
            w.max_model_len,
            w.kv_backend,
        )
        epoch = await self.registry.register(record, _load(request.load))
        await self.catalog.announce(w.model, w.version)
        self.snapshot.invalidate(w.model)  # placeable at once, here; other replicas within max_age_s
        self.lookups.models_changed()
        return pb.RegisterWorkerResponse(
            heartbeat_interval_s=self.config.heartbeat_timeout_s / 3, epoch=epoch
        )

    @_redis_errors_unavailable
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        hashes = None if request.load_only else list(request.cached_block_hashes)
        load = _load(request.load)
        known = await self.registry.heartbeat(request.address, load, hashes, request.epoch)
        if known and self.snapshot.update_load(request.address, load):
            self.decider.load_changed()
        return pb.HeartbeatResponse(known=known)

    # ------------------------------------------------------------------ model versions
    @_redis_errors_unavailable
    async def ListModelVersions(
        self, request: pb.ListModelVersionsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelVersionsResponse:
        return await self.rollout.list_versions(request)

    @_redis_errors_unavailable
    async def ReportShadow(
        self, request: pb.ReportShadowRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportShadowResponse:
        return await self.rollout.report_shadow(request)

    @_redis_errors_unavailable
    async def SetRollout(
        self, request: pb.SetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetRolloutResponse:
        return await self.rollout.set_rollout(request)

    # ------------------------------------------------------------------ tenants
    @_redis_errors_unavailable
    async def Authenticate(
        self, request: pb.AuthenticateRequest, context: grpc.aio.ServicerContext
    ) -> pb.AuthenticateResponse:
        """The tenant of a key as Place resolves it (cached 1 s, so a gateway's checks rarely read Redis)."""
        return pb.AuthenticateResponse(tenant=(await self.lookups.tenant(request.api_key)).name)

    async def ensure_default_tenant(self) -> None:
        """Recreates the default tenant if Redis lost it (`scheduler.lookups.Lookups.ensure_default_tenant`)."""
        await self.lookups.ensure_default_tenant()


def _load(msg: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(
        msg.free_blocks, msg.running, msg.waiting, msg.transfers, msg.leases, msg.draining, msg.queued_tokens
    )
