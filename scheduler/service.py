"""The scheduler service: stateless gRPC replicas over Redis (`baton.v1.Scheduler`).

`Place` is the one call a gateway makes per request: authenticate the tenant, choose the model
version (sticky weights), derive the cache salt, charge the tenant's quotas, and pick a prefill and a
decode worker by the documented cost (`scheduler.placement`) — waiting in the tenant-fair queue when no
decode worker has room, up to a timeout. Workers register and heartbeat; the registry evicts those
that stop. A reaper expires overdue leases and tells their prefill worker to free the blocks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import redis.asyncio as aioredis
from google.protobuf.message import Message
from redis.exceptions import RedisError

from baton.v1 import common_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from baton.v1 import scheduler_pb2 as pb
from core.errors import (
    CapacityExceeded,
    InvalidRequest,
    ModelNotFound,
    ServingError,
    Unauthenticated,
    Unavailable,
)
from core.kv_cache import hash_chain
from scheduler import metrics
from scheduler.cancel import CancellationBus
from scheduler.fairness import FairQueue
from scheduler.leases import LeaseLedger
from scheduler.placement import Candidate, NoCapacity, Placement, PlacementPolicy, Placer
from scheduler.quota import QuotaLedger
from scheduler.redis_pipe import RedisPipe
from scheduler.registry import WorkerLoad, WorkerRecord, WorkerRegistry, WorkerView
from scheduler.snapshot import RegistrySnapshot, TTLCache, leading_hits
from scheduler.tenants import TenantConfig, TenantDirectory, cache_salt
from scheduler.versions import ModelCatalog, choose_version, in_shadow

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ClusterSchedulerConfig:
    """One scheduler replica. Field names are the `baton scheduler` flags."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    host: str = "127.0.0.1"
    port: int = 50061
    prefix: str = "baton:"
    heartbeat_timeout_s: float = 3.0
    lease_ttl_s: float = 30.0
    queue_timeout_s: float = 10.0  # longest a request waits for decode capacity
    queue_poll_s: float = 0.02
    reap_interval_s: float = 0.5
    default_tenant: str | None = "default"  # requests without an API key; None = keys required
    accept_any_key: bool = False  # unknown keys also go to the default tenant (a local, single-team cluster)
    local_prefill_threshold: int = 32
    max_prefill_queue: int = 1  # see scheduler.placement: admission limits
    max_decode_queue: int = 8
    local_when_prefill_full: bool = False
    light_local_max_tokens: int = 0  # a light tenant's prompt up to this long may prefill on D (0 = never)
    burst_credit_tokens: float = 512.0  # fair queue: a light tenant's burst allowance, and the debt bound (scheduler.fairness)


STALLED_POLLS = 25  # a waiter that sees room this many polls in a row without its turn hands the turn on
IN_TRANSIT_S = 0.05  # a placement counts against its worker until a load measured this long after it


Row = tuple[WorkerView, frozenset[str]]  # a worker in a registry snapshot, and the block hashes it holds


class RecentPlacements:
    """One worker's placements by this replica, oldest first, with running totals."""

    __slots__ = ("_items", "blocks", "added")

    def __init__(self) -> None:
        self._items: collections.deque[tuple[float, int]] = collections.deque()
        self.blocks = 0
        self.added = 0  # placements ever added: what a candidate built from these totals was built at

    def add(self, at: float, blocks: int) -> None:
        self._items.append((at, blocks))
        self.blocks += blocks
        self.added += 1

    def since(self, cutoff: float) -> tuple[int, int]:
        """Forgets the placements made at or before ``cutoff``; (new blocks, requests) of the rest."""
        items = self._items
        while items and items[0][0] <= cutoff:
            self.blocks -= items.popleft()[1]
        return self.blocks, len(items)

    def last_at(self) -> float:
        """When the newest placement still counted was made (0 if none is)."""
        return self._items[-1][0] if self._items else 0.0


def prompt_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> list[str]:
    """The prompt's prefix-hash chain exactly as the workers' KV caches compute it (hex)."""
    return [h.hex() for h in hash_chain(token_ids, block_size, salt)]


def _redis_errors_unavailable(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[T]]:
    """A unary RPC (registration, heartbeats, the operator's calls) whose Redis errors end it UNAVAILABLE,
    as `_unless_failed` does for the per-request calls: never grpc's UNKNOWN during an outage."""
    @functools.wraps(method)
    async def rpc(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        return await _unless_failed(context, method(self, request, context))

    return rpc


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):  # type: ignore[misc]  # generated, untyped
    """One replica; every piece of shared state lives in Redis."""

    def __init__(self, config: ClusterSchedulerConfig, client: aioredis.Redis, pipe: RedisPipe | None = None) -> None:
        self.config = config
        p = config.prefix
        self.registry = WorkerRegistry(client, p, config.heartbeat_timeout_s)
        self.catalog = ModelCatalog(client, p)
        self.tenants = TenantDirectory(client, p, default_tenant=config.default_tenant)
        self.quota = QuotaLedger(client, p, pipe=pipe)  # per-request scripts (quota, leases) on the pipe if given
        self.queue = FairQueue(client, p, burst_credit_tokens=config.burst_credit_tokens)
        self.leases = LeaseLedger(client, p, pipe=pipe)
        self.bus = CancellationBus(client, p)
        self.placer = Placer(PlacementPolicy(local_prefill_threshold=config.local_prefill_threshold,
                                             max_prefill_queue=config.max_prefill_queue,
                                             max_decode_queue=config.max_decode_queue,
                                             local_when_prefill_full=config.local_when_prefill_full,
                                             light_local_max_tokens=config.light_local_max_tokens))
        self._client = client
        self.snapshot = RegistrySnapshot(self.registry)
        self._models: tuple[float, list[str]] = (0.0, [])
        self._recent: dict[str, RecentPlacements] = {}  # worker → this replica's placements on it
        # worker → (the view and the count of placements it was built from, its candidate without hits)
        self._candidates: dict[str, tuple[WorkerView, int, Candidate]] = {}
        self._split: dict[str, tuple[list[Row], dict[str, tuple[list[Row], list[Row]]]]] = {}  # see _by_version
        self._waiting_here = 0  # requests of this replica in the fair queue
        self._claim = asyncio.Lock()  # one waiter at a time turns seen room into a placement
        self._load_changed = asyncio.Event()  # set (and replaced) when a heartbeat here changes a load
        self._uncharged: dict[str, tuple[TenantConfig, float]] = {}  # tenant → tokens admitted, not yet charged
        # Tenants and keys change rarely: a revoked key stops working within 1 s on every replica.
        self._tenant_cache: TTLCache[str, TenantConfig] = TTLCache(1.0)
        self._tenant_names: TTLCache[str, TenantConfig] = TTLCache(1.0)  # name → config, for Finish
        # Rollout weights: at once on this replica (SetRollout invalidates), within 50 ms on the others.
        # What each call on the `Calls` stream runs: the unary calls' own code.
        self._stream_handlers: dict[str, Callable[[Any], Awaitable[Message]]] = {
            "place": self._timed_place, "finish": self._finish, "report_lease": self._report_lease,
            "cancel": self._cancel,
        }
        self._catalog_cache: TTLCache[str, tuple[dict[str, float], tuple[str | None, float]]] = TTLCache(0.05)  # worker → (load timestamp, blocks, requests) placed since  # (read at, names): changes only on registration

    @property
    def waiting_here(self) -> int:
        """Place calls of this replica waiting in the fair queue now."""
        return self._waiting_here

    # ------------------------------------------------------------------ Place
    async def Place(self, request: pb.PlaceRequest, context: grpc.aio.ServicerContext) -> pb.PlaceResponse:
        return await _unless_failed(context, self._timed_place(request))

    async def _timed_place(self, request: pb.PlaceRequest) -> pb.PlaceResponse:
        t0 = time.perf_counter()
        try:
            resp = await self._place(request)
        except BaseException as e:
            metrics.record_place(time.perf_counter() - t0, request.model, error=e)
            raise
        resp.decision_ms = (time.perf_counter() - t0) * 1e3
        metrics.record_place(resp.decision_ms / 1e3, request.model, resp.tenant, resp.version,
                             placed_with_prefill=resp.HasField("prefill_worker"))
        return resp

    async def _place(self, request: pb.PlaceRequest) -> pb.PlaceResponse:
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        tenant = await self._tenant(request.api_key)
        ids = request.prompt_token_ids  # the repeated field itself: hashed as it is, not copied
        if not ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        model, weights, shadow = await self._catalog_view(request.model)
        pools = self._by_version(model, await self.snapshot.workers(model))
        version = choose_version(weights, request.request_id, {v for v, (d, _) in pools.items() if d})
        if version is None:
            raise Unavailable(f"no healthy decode worker serves model {model!r}")
        decode_rows = pools[version][0]
        block_size = decode_rows[0][0].record.block_size
        salt = cache_salt(tenant, version)
        chain = prompt_hashes(ids, block_size, salt)  # exactly the chain the workers' caches compute
        blocks_needed = -(-(len(ids) + min(request.max_tokens, block_size)) // block_size)
        if not any(v.worker_id not in request.exclude_workers for v, _ in decode_rows):
            raise Unavailable(f"no other healthy decode worker serves model {model!r}")
        if not request.resume:
            try:
                await self.quota.admit(tenant, request.request_id, len(ids), request.max_tokens, blocks_needed)
            except (asyncio.CancelledError, RedisError):
                # Given up mid-call, or the reply lost (a timeout, a dropped connection): the charge may
                # have landed all the same. Finish is idempotent; if Redis is down it fails too, and the
                # charge (if any) expires with the request TTL.
                with contextlib.suppress(RedisError):
                    await asyncio.shield(self.quota.finish(tenant, request.request_id, len(ids), 0))
                raise
        try:
            placement = await self._place_or_wait(model, version, tenant, request, chain, len(ids), block_size,
                                                  blocks_needed)
        except BaseException:
            if not request.resume:  # nothing was served: give the quota back
                await self.quota.finish(tenant, request.request_id, len(ids), 0)
            raise
        resp = pb.PlaceResponse(tenant=tenant.name, version=version, cache_salt=salt,
                                decode_worker=placement.decode.address,
                                prefix_hit_blocks=placement.decode.hit_blocks, lease_ttl_s=self.config.lease_ttl_s)
        if placement.prefill is not None:
            resp.prefill_worker = placement.prefill.address
        await self._add_shadow(resp, model, request.request_id, shadow)
        return resp

    async def _tenant(self, api_key: str) -> TenantConfig:
        cached = self._tenant_cache.get(api_key)
        if cached is not None:
            return cached
        try:
            return self._tenant_cache.put(api_key, await self.tenants.resolve(api_key or None))
        except Unauthenticated:
            if api_key and not self.config.accept_any_key:
                raise
        await self.ensure_default_tenant()  # Redis may have lost it (a restart without persistence)
        return self._tenant_cache.put(api_key, await self.tenants.resolve(None))

    async def _tenant_named(self, name: str) -> TenantConfig | None:
        """A tenant by name, remembered for up to 1 s as a key's tenant is: a Finish needs no read of it."""
        cached = self._tenant_names.get(name)
        if cached is not None:
            return cached
        tenant = await self.tenants.get_tenant(name)
        return self._tenant_names.put(name, tenant) if tenant is not None else None

    async def _catalog_view(self, name: str) -> tuple[str, dict[str, float], tuple[str | None, float]]:
        """The model name (or the only one served), its version weights and shadow, in one read."""
        model = await self._model_name(name)
        view = self._catalog_cache.get(model)
        if view is None:
            view = self._catalog_cache.put(model, await self.catalog.read(model))
        return model, view[0], view[1]

    async def _model_name(self, name: str) -> str:
        read_at, models = self._models
        if time.monotonic() - read_at > 1.0:
            models = await self.catalog.models()
            self._models = (time.monotonic(), models)
        if not name:
            if len(models) == 1:
                return models[0]
            if not models:
                raise Unavailable("no worker has registered a model yet")
            raise InvalidRequest(f"name a model: this cluster serves {', '.join(models)}")
        if not models:
            raise Unavailable("no worker has registered a model yet")
        if name not in models:
            raise ModelNotFound(f"model {name!r} is not served here (served: {', '.join(models) or 'none'})")
        return name

    def _by_version(self, model: str, snapshot: list[Row]) -> dict[str, tuple[list[Row], list[Row]]]:
        """The snapshot's workers by version, as (decode rows, prefill rows): split once per registry
        refresh, not once per decision."""
        cached = self._split.get(model)
        if cached is not None and cached[0] is snapshot:
            return cached[1]
        pools: dict[str, tuple[list[Row], list[Row]]] = {}
        for row in snapshot:
            record = row[0].record
            decode, prefill = pools.setdefault(record.version, ([], []))
            if record.serves("decode"):
                decode.append(row)
            if record.serves("prefill"):
                prefill.append(row)
        self._split[model] = (snapshot, pools)
        return pools

    async def _pools(self, model: str, version: str, chain: list[str]) -> tuple[list[Candidate], list[Candidate]]:
        decode, prefill = self._by_version(model, await self.snapshot.workers(model)).get(version, ([], []))
        return self._pool(decode, chain), self._pool(prefill, chain)

    def _pool(self, rows: list[Row], chain: list[str]) -> list[Candidate]:
        """One pool's candidates for a request with this hash chain. Only a worker that holds the
        chain's first block can hold any of its leading blocks, so only those are searched further."""
        first = chain[0] if chain else ""
        pool = []
        for view, held in rows:
            c = self._candidate(view)
            if first in held:
                c = c._replace(hit_blocks=leading_hits(held, chain))
            pool.append(c)
        return pool

    def _candidate(self, view: WorkerView) -> Candidate:
        """A worker's load as of its last heartbeat, plus what this replica placed on it since: without
        that, every request of a burst would see the same idle worker and pile onto it. A placement
        counts until a load measured ``IN_TRANSIT_S`` after it (the request reaches the worker through
        the gateway, so a load measured just after the placement may not show it yet). Kept until the
        worker's load or this replica's placements on it change: a decision rebuilds only those."""
        r, load = view.record, view.load
        recent = self._recent.get(r.address)
        added = recent.added if recent is not None else 0
        kept = self._candidates.get(r.address)
        if kept is not None and kept[0] is view and kept[1] == added:
            return kept[2]
        blocks, requests = recent.since(load.timestamp - IN_TRANSIT_S) if recent is not None else (0, 0)
        c = Candidate(r.address, r.role, r.num_blocks, max(0, load.free_blocks - blocks), load.running,
                      load.waiting + requests, load.transfers, 0, load.timestamp)
        self._candidates[r.address] = (view, added, c)
        return c

    def _forget_gone_workers(self) -> None:
        """Drops what this replica keeps per worker for workers no snapshot holds (placements only once
        they are older than the heartbeat timeout: a copy may be away for a moment after a registration)."""
        live = {view.record.address for rows in self.snapshot.cached().values() for view, _ in rows}
        old = time.time() - self.config.heartbeat_timeout_s
        for address in [a for a, recent in self._recent.items() if a not in live and recent.last_at() <= old]:
            del self._recent[address]
        for address in [a for a in self._candidates if a not in live]:
            del self._candidates[address]

    def _note_placement(self, placement: Placement, blocks: int) -> None:
        now = time.time()  # the clock of WorkerLoad.timestamp: this replica's, when the load arrived
        for c, n_blocks in ((placement.decode, max(0, blocks - placement.decode.hit_blocks)), (placement.prefill, 0)):
            if c is not None:
                recent = self._recent.get(c.address)
                if recent is None:
                    recent = self._recent[c.address] = RecentPlacements()
                recent.add(now, n_blocks)

    async def _place_or_wait(
        self, model: str, version: str, tenant: TenantConfig, request: pb.PlaceRequest, chain: list[str],
        num_prompt_tokens: int, block_size: int, blocks_needed: int,
    ) -> Placement:
        """Places the request now if there is room and nobody waits; otherwise it waits in the
        tenant-fair queue, re-reading the workers' load, and goes when there is room *and* it is the
        next request in fair order. The placement is noted against its workers before the next waiter
        of this replica looks (one lock), so one free slot is never given twice here."""
        exclude = set(request.exclude_workers)

        def place(pools: tuple[list[Candidate], list[Candidate]], light: bool = False) -> Placement:
            return self.placer.place(*pools, num_prompt_tokens, request.max_tokens, block_size, exclude, light)

        why = "others are waiting"
        if not self._waiting_here:  # with others waiting, a newcomer queues too: the fair order decides
            try:
                placement = place(await self._pools(model, version, chain))
            except NoCapacity as e:  # no room now: wait below
                why = str(e)
            else:
                self._note_placement(placement, blocks_needed)
                # Fair order counts every admission, not only the queued ones: charged to the tenant's
                # counter with the next flush (before anyone here enqueues or claims).
                _, tokens = self._uncharged.get(tenant.name, (tenant, 0.0))
                self._uncharged[tenant.name] = (tenant, tokens + num_prompt_tokens + request.max_tokens)
                return placement
        rid = request.request_id
        t0 = time.monotonic()
        waited = "abandoned"  # how the wait ends, for metrics: placed | timeout | abandoned
        await self._flush_charges()
        await self.queue.enqueue(tenant, rid, num_prompt_tokens + request.max_tokens, self.config.queue_timeout_s)
        deadline = time.monotonic() + self.config.queue_timeout_s
        ready_key = f"{self.config.prefix}fq:ready:{rid}"
        stalled = 0  # polls in a row that saw room while another request was next
        self._waiting_here += 1
        try:
            # A light tenant's prompt need not wait for a heavier one's prefill (scheduler.placement).
            policy = self.placer.policy
            light = ((policy.light_prefill_slot or policy.light_local_max_tokens > 0)
                     and await self.queue.is_light(tenant.name))
            look_now = light  # it may find its room at once (a prefill slot more, or the decode worker)
            while time.monotonic() < deadline:
                if not look_now:
                    with contextlib.suppress(asyncio.TimeoutError):  # a load change here, or the poll
                        await asyncio.wait_for(self._load_changed.wait(), self.config.queue_poll_s)
                look_now = False
                async with self._claim:  # the load read inside: it must include the last waiter's claim
                    try:
                        placement = place(await self._pools(model, version, chain), light)
                    except NoCapacity:
                        continue
                    await self._flush_charges()
                    if await self.queue.pop_if_next(rid) or await self._client.delete(ready_key):
                        self._note_placement(placement, blocks_needed)
                        log.debug("request %s (tenant %s) waited %.0f ms (%s)", rid, tenant.name,
                                  (time.monotonic() - t0) * 1e3, why)
                        waited = "placed"
                        return placement
                    stalled += 1
                    if stalled >= STALLED_POLLS:
                        # The next request's waiter has not claimed the room for a while (its replica may
                        # be gone, or it waits for another model): take it out and hand it its turn.
                        stalled = 0
                        head = await self.queue.pop_next()
                        if head is not None:
                            await self._client.set(f"{self.config.prefix}fq:ready:{head.request_id}", "1",
                                                   ex=max(1, math.ceil(self.config.queue_timeout_s)))
            waited = "timeout"
            raise CapacityExceeded(
                f"no worker capacity for {self.config.queue_timeout_s:g} s (queue wait timed out)", retry_after_s=1.0)
        finally:
            metrics.record_queue_wait(time.monotonic() - t0, tenant.name, waited)
            self._waiting_here -= 1
            await self.queue.remove(rid)
            await self._client.delete(ready_key)

    async def _flush_charges(self) -> None:
        """Charges the admissions placed without waiting to their tenants' fair-queue counters."""
        pending, self._uncharged = self._uncharged, {}
        for tenant, tokens in pending.values():
            await self.queue.charge(tenant, tokens)

    async def _add_shadow(self, resp: pb.PlaceResponse, model: str, request_id: str,
                          shadow: tuple[str | None, float]) -> None:
        shadow_version, share = shadow
        if not shadow_version or shadow_version == resp.version or not in_shadow(request_id, share):
            return
        views = await self.registry.healthy(model, shadow_version, roles=("decode",))
        if views:
            best = max(views, key=lambda v: (v.load.free_blocks, v.worker_id))
            resp.shadow_version, resp.shadow_worker = shadow_version, best.record.address

    # ------------------------------------------------------------------ request end, cancel, leases
    async def Finish(self, request: pb.FinishRequest, context: grpc.aio.ServicerContext) -> pb.FinishResponse:
        return await _unless_failed(context, self._finish(request))

    async def _finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        tenant = await self._tenant_named(request.tenant)
        if tenant is not None:
            await self.quota.finish(tenant, request.request_id, request.prompt_tokens, request.completion_tokens)
        return pb.FinishResponse()

    async def Cancel(self, request: pb.SchedulerCancelRequest, context: grpc.aio.ServicerContext
                     ) -> pb.SchedulerCancelResponse:
        return await _unless_failed(context, self._cancel(request))

    async def _cancel(self, request: pb.SchedulerCancelRequest) -> pb.SchedulerCancelResponse:
        return pb.SchedulerCancelResponse(first=await self.bus.cancel(request.request_id, request.reason or "client"))

    async def ReportLease(self, request: pb.ReportLeaseRequest, context: grpc.aio.ServicerContext
                          ) -> pb.ReportLeaseResponse:
        return await _unless_failed(context, self._report_lease(request))

    async def _report_lease(self, request: pb.ReportLeaseRequest) -> pb.ReportLeaseResponse:
        if request.event == pb.LEASE_EVENT_PINNED:
            ttl = request.ttl_s or self.config.lease_ttl_s
            lease = await self.leases.create(request.lease_id, request.request_id, request.prefill_worker,
                                             request.decode_worker, request.num_blocks, ttl)
            return pb.ReportLeaseResponse(applied=lease is not None)
        if request.event == pb.LEASE_EVENT_RELEASED:
            return pb.ReportLeaseResponse(applied=await self.leases.release(request.lease_id))
        if request.event == pb.LEASE_EVENT_ABORTED:
            return pb.ReportLeaseResponse(applied=await self.leases.abort(request.lease_id))
        raise InvalidRequest("a lease report needs an event")

    # ------------------------------------------------------------------ the gateway's call stream
    async def Calls(self, batches: AsyncIterator[pb.SchedulerCalls], context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[pb.SchedulerReplies]:
        """A gateway's per-request calls on one stream: each runs as its own task (a Place may wait in
        the fair queue) and is answered when done, in any order; the replies ready when one is sent go
        out together. The stream ends once the client has half-closed it and every call is answered; if
        it breaks, every unanswered call is cancelled (a waiting Place leaves the queue)."""
        replies: asyncio.Queue[pb.SchedulerReply | None] = asyncio.Queue()
        running: dict[int, asyncio.Task[None]] = {}

        async def answer(call_id: int, kind: str, request: Message) -> None:
            try:
                reply = pb.SchedulerReply(call_id=call_id, **{kind: await self._stream_handlers[kind](request)})
            except ServingError as e:
                reply = pb.SchedulerReply(call_id=call_id, error=_request_error(e))
            except RedisError as e:
                reply = pb.SchedulerReply(call_id=call_id, error=_request_error(_store_down(e)))
            except Exception:  # a bug must not end the other calls of this gateway
                log.exception("scheduler call %s (%s) failed", call_id, kind)
                reply = pb.SchedulerReply(call_id=call_id, error=common_pb2.RequestError(
                    code=grpc.StatusCode.INTERNAL.value[0], message=f"the scheduler failed on {kind}"))
            finally:
                running.pop(call_id, None)
            replies.put_nowait(reply)

        def start(call: pb.SchedulerCall) -> None:
            kind = call.WhichOneof("call")
            if kind == "abandon":
                task = running.get(call.call_id)
                if task is not None:
                    task.cancel()
            elif kind is None or call.call_id in running:
                why = "names no call" if kind is None else "reuses the id of a call still running"
                replies.put_nowait(pb.SchedulerReply(call_id=call.call_id, error=common_pb2.RequestError(
                    code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=f"call {call.call_id} {why}")))
            else:
                task = running[call.call_id] = asyncio.create_task(answer(call.call_id, kind, getattr(call, kind)))
                task.add_done_callback(functools.partial(abandoned, call.call_id))

        def abandoned(call_id: int, task: asyncio.Task[None]) -> None:
            """One reply per call, also for one cancelled (undone on the way out) before or while it ran."""
            if task.cancelled():
                running.pop(call_id, None)
                replies.put_nowait(pb.SchedulerReply(call_id=call_id, error=common_pb2.RequestError(
                    code=grpc.StatusCode.CANCELLED.value[0], message=f"call {call_id} abandoned")))

        async def read() -> None:
            try:
                async for batch in batches:
                    for call in batch.calls:
                        start(call)
                if running:  # half-closed: answer what is running, then end the stream
                    await asyncio.wait(list(running.values()))
            finally:
                replies.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (first := await replies.get()) is not None:
                out = pb.SchedulerReplies(replies=[first])
                ended = False
                while not replies.empty():
                    more = replies.get_nowait()
                    if more is None:
                        ended = True
                        break
                    out.replies.append(more)
                yield out
                if ended:
                    break
            await reader  # re-raises a failed read (a malformed message) as the stream's error
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()  # the gateway is gone: a waiting Place leaves the queue, its quota returned

    # ------------------------------------------------------------------ workers
    @_redis_errors_unavailable
    async def RegisterWorker(self, request: pb.RegisterWorkerRequest, context: grpc.aio.ServicerContext
                             ) -> pb.RegisterWorkerResponse:
        w = request.worker
        record = WorkerRecord(w.address, w.role, w.model, w.version, w.address,  # ServingError: its status
                              w.num_blocks, w.block_size, w.max_model_len, w.kv_backend)
        await self.registry.register(record, _load(request.load))
        await self.catalog.announce(w.model, w.version)
        self.snapshot.invalidate(w.model)  # placeable at once, here; other replicas within max_age_s
        self._models = (0.0, [])
        return pb.RegisterWorkerResponse(heartbeat_interval_s=self.config.heartbeat_timeout_s / 3)

    @_redis_errors_unavailable
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatResponse:
        hashes = None if request.load_only else list(request.cached_block_hashes)
        load = _load(request.load)
        known = await self.registry.heartbeat(request.address, load, hashes)
        if known and self.snapshot.update_load(request.address, load):
            self._load_changed.set()  # wake this replica's waiters: a slot may have freed
            self._load_changed = asyncio.Event()
        return pb.HeartbeatResponse(known=known)

    # ------------------------------------------------------------------ model versions
    @_redis_errors_unavailable
    async def ListModelVersions(self, request: pb.ListModelVersionsRequest, context: grpc.aio.ServicerContext
                                ) -> pb.ListModelVersionsResponse:
        resp = pb.ListModelVersionsResponse()
        for model in [request.model] if request.model else await self.catalog.models():
            resp.versions.extend(await self._versions(model))
            shadow, share = await self.catalog.shadow(model)
            if shadow:
                resp.shadow[model], resp.shadow_share[model] = shadow, share
            for stats in await self.catalog.comparisons(model):
                p_ttft, s_ttft, p_itl, s_itl = stats.latency_ms()
                resp.comparisons.append(pb.ShadowComparison(
                    model=model, primary_version=stats.primary_version, shadow_version=stats.shadow_version,
                    requests=stats.requests, identical=stats.identical, greedy_agreement=stats.greedy_agreement,
                    positions=stats.positions, top1_agreement=stats.top1_agreement, mean_kl=stats.mean_kl,
                    primary_ttft_ms=p_ttft, shadow_ttft_ms=s_ttft, primary_itl_ms=p_itl, shadow_itl_ms=s_itl))
        return resp

    @_redis_errors_unavailable
    async def ReportShadow(self, request: pb.ReportShadowRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ReportShadowResponse:
        if request.positions < request.top1_agreed or not 0.0 <= request.greedy_agreement <= 1.0 \
                or not request.kl_sum >= 0.0:  # the last also refuses NaN
            raise InvalidRequest("a shadow report's figures are out of range")
        if request.model not in await self.catalog.models():
            raise ModelNotFound(f"model {request.model!r} is not known")
        has_itl = request.primary_itl_ms > 0 and request.shadow_itl_ms > 0
        try:
            await self.catalog.record_shadow(request.model, request.primary_version, request.shadow_version, {
                "requests": 1, "identical": float(request.identical), "greedy_agreement": request.greedy_agreement,
                "positions": request.positions, "top1_agreed": request.top1_agreed, "kl_sum": request.kl_sum,
                "primary_ttft_ms": request.primary_ttft_ms, "shadow_ttft_ms": request.shadow_ttft_ms,
                "itl_requests": float(has_itl), "primary_itl_ms": request.primary_itl_ms if has_itl else 0.0,
                "shadow_itl_ms": request.shadow_itl_ms if has_itl else 0.0,
            })
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return pb.ReportShadowResponse()

    @_redis_errors_unavailable
    async def SetRollout(self, request: pb.SetRolloutRequest, context: grpc.aio.ServicerContext
                         ) -> pb.SetRolloutResponse:
        try:
            if request.model not in await self.catalog.models():
                raise ModelNotFound(f"model {request.model!r} is not known")
            known = set(await self.catalog.weights(request.model))
            unknown = sorted(set(request.weights) - known)
            if unknown:
                raise InvalidRequest(f"unknown version(s) of {request.model}: {', '.join(unknown)}")
            await self.catalog.set_weights(request.model, dict(request.weights))
            self._catalog_cache.invalidate()
            if request.HasField("shadow_version"):
                await self.catalog.set_shadow(request.model, request.shadow_version or None,
                                              request.shadow_share if request.HasField("shadow_share") else 0.0)
                self._catalog_cache.invalidate()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        log.info("rollout of %s set: %s", request.model, dict(request.weights))
        return pb.SetRolloutResponse(versions=await self._versions(request.model))

    async def _versions(self, model: str) -> list[pb.ModelVersion]:
        weights = await self.catalog.weights(model)
        views = await self.registry.healthy(model, include_draining=True)
        out = []
        for version in sorted(weights):
            serving = [v for v in views if v.record.version == version]
            out.append(pb.ModelVersion(model=model, version=version, weight=weights[version],
                                       num_workers=len(serving),
                                       max_model_len=min((v.record.max_model_len for v in serving), default=0)))
        return out

    # ------------------------------------------------------------------ background
    async def reap_forever(self) -> None:
        """Expires overdue leases (each exactly once across replicas) and tells the prefill worker to
        free them; sweeps workers whose heartbeats stopped; charges the admissions that did not wait (so
        the fair queue's demand is never older than this). Survives Redis outages."""
        while True:
            try:
                await self.ensure_default_tenant()
                await self._flush_charges()
                self._forget_gone_workers()
                for lease in await self.leases.expire_due():
                    await self._free_on_worker(lease.prefill_worker, lease.request_id)
                await self.registry.sweep()
            except RedisError as e:
                log.warning("reaper: Redis unavailable (%s); retrying", e)
            await asyncio.sleep(self.config.reap_interval_s)

    async def ensure_default_tenant(self) -> None:
        """The default tenant is configuration, not state: recreate it if Redis lost it (a restart
        without persistence), so anonymous requests work again without an operator."""
        name = self.config.default_tenant
        if name and await self.tenants.get_tenant(name) is None:
            # Anonymous traffic of a single-team cluster: limited by capacity, not by a quota.
            await self.tenants.add_tenant(TenantConfig(
                name, requests_per_s=1e6, tokens_per_s=1e9, burst_s=1.0, max_concurrent=100_000,
                max_kv_blocks=10**9, max_queue_depth=10_000))
            log.info("default tenant %r (re)created", name)

    async def _free_on_worker(self, address: str, request_id: str) -> None:
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                await worker_pb2_grpc.WorkerStub(channel).Abort(worker_pb2.AbortRequest(request_id=request_id),
                                                                timeout=2.0)
        except grpc.aio.AioRpcError as e:  # a dead worker's blocks died with it
            log.info("reaper: could not reach %s to free %s: %s", address, request_id, e.details())


async def _unless_failed(context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
    """A unary call's result, or its error as the call's status: Redis errors are UNAVAILABLE for the
    caller (who may retry), not an unknown failure."""
    try:
        return await call
    except ServingError as e:
        await _abort(context, e)
        raise
    except RedisError as e:
        await _abort(context, _store_down(e))
        raise


def _store_down(e: RedisError) -> Unavailable:
    return Unavailable(f"the scheduler's state store is unavailable: {e}")


def _request_error(error: ServingError) -> common_pb2.RequestError:
    """An error as one call's reply on the `Calls` stream: the status code a unary call would end with."""
    reply = common_pb2.RequestError(code=grpc.StatusCode[error.grpc_code].value[0], message=error.message)
    if isinstance(error, CapacityExceeded):
        reply.retry_after_s = error.retry_after_s
    return reply


def _load(msg: pb.WorkerLoad) -> WorkerLoad:
    return WorkerLoad(msg.free_blocks, msg.running, msg.waiting, msg.transfers, msg.leases, msg.draining)


async def _abort(context: grpc.aio.ServicerContext, error: ServingError) -> None:
    """Ends the call with the error's status (the same mapping as services.status, which the scheduler
    may not import): RESOURCE_EXHAUSTED carries its retry-after as trailing metadata."""
    if isinstance(error, CapacityExceeded):
        context.set_trailing_metadata((("retry-after", f"{error.retry_after_s:g}"),))
    await context.abort(grpc.StatusCode[error.grpc_code], error.message)
