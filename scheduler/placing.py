"""`Decider`: this replica's `Place` decisions and the state they keep.

A decision authenticates the tenant, chooses the model version (sticky weights), derives the cache
salt, charges the tenant's quotas, and picks a prefill and a decode worker by the documented cost
(the pure policy, `scheduler.placement.Placer`) — waiting in the tenant-fair queue when no decode
worker has room, up to a timeout. Between decisions it keeps, per worker, what this replica placed on
it since the worker's last load, and each worker's candidate built from both.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from baton.v1 import scheduler_pb2 as pb
from core.errors import CapacityExceeded, DuplicateRequest, InvalidRequest, Unavailable
from core.kv_cache import hash_chain
from scheduler import metrics
from scheduler.config import ClusterSchedulerConfig
from scheduler.fairness import FairQueue
from scheduler.lookups import Lookups
from scheduler.placement import Candidate, NoCapacity, Placement, Placer
from scheduler.quota import QuotaLedger
from scheduler.registry import WorkerRegistry, WorkerView
from scheduler.snapshot import RegistrySnapshot, leading_hits
from scheduler.tenants import TenantConfig, cache_salt
from scheduler.versions import choose_version, in_shadow

log = logging.getLogger(__name__)

STALLED_POLLS = 25  # a waiter that sees room this many polls in a row without its turn hands the turn on
IN_TRANSIT_S = 0.05  # a placement counts against its worker until a load measured this long after it
# ...or until a load measured after it has been the worker's newest for this long beyond that: a worker
# publishes a changed load at once (every LOAD_BEAT_S = 20 ms at most, services.worker.membership) and
# not an unchanged one, and a replica reads the registry's copy within RegistrySnapshot.max_age_s (50 ms),
# so a load nobody replaced is still the worker's load IN_TRANSIT_S after the placement.
LOAD_QUIET_S = 0.1


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

    def pending(self, load_at: float, now: float) -> tuple[int, int, float]:
        """(new blocks, requests) of the placements that the worker's newest load, measured at
        ``load_at``, may not show yet as of ``now``, and until when that stays so (inf: until another
        load or placement). Forgets the others: those made ``IN_TRANSIT_S`` or more before that load,
        and those made before it ``IN_TRANSIT_S + LOAD_QUIET_S`` or more ago. A worker publishes only a
        load that changed, so a load measured after a placement that is still its newest is its load
        ``IN_TRANSIT_S`` after the placement as well (without this, a request that came and went within
        ``IN_TRANSIT_S`` of its placement — a short prompt on a prefill worker — would count until the
        worker's next full heartbeat, a third of the heartbeat timeout later, and keep every waiter out)."""
        items = self._items
        cutoff = max(load_at - IN_TRANSIT_S, min(now - IN_TRANSIT_S - LOAD_QUIET_S, _before(load_at)))
        while items and items[0][0] <= cutoff:
            self.blocks -= items.popleft()[1]
        until = items[0][0] + IN_TRANSIT_S + LOAD_QUIET_S if items and items[0][0] < load_at else math.inf
        return self.blocks, len(items), until

    def last_at(self) -> float:
        """When the newest placement still counted was made (0 if none is)."""
        return self._items[-1][0] if self._items else 0.0


def _before(t: float) -> float:
    """The largest float below ``t``: ``x <= _before(t)`` is ``x < t``."""
    return math.nextafter(t, -math.inf)


def prompt_hashes(token_ids: Sequence[int], block_size: int, salt: str) -> list[str]:
    """The prompt's prefix-hash chain exactly as the workers' KV caches compute it (hex)."""
    return [h.hex() for h in hash_chain(token_ids, block_size, salt)]


class Decider:
    """Decides one replica's `Place` calls. Its collaborators are the replica's own (shared with the
    servicer): the pure ``placer``, the registry ``snapshot``, the ``quota`` ledger, the fair ``queue``."""

    def __init__(
        self,
        config: ClusterSchedulerConfig,
        placer: Placer,
        lookups: Lookups,
        snapshot: RegistrySnapshot,
        registry: WorkerRegistry,
        quota: QuotaLedger,
        queue: FairQueue,
        client: aioredis.Redis,
    ) -> None:
        self._config = config
        self._placer = placer
        self._lookups = lookups
        self._snapshot = snapshot
        self._registry = registry
        self._quota = quota
        self._queue = queue
        self._client = client
        self._recent: dict[str, RecentPlacements] = {}  # worker → this replica's placements on it
        # worker → (the view and the count of placements it was built from, until when it holds (time.time),
        # its candidate without hits)
        self._candidates: dict[str, tuple[WorkerView, int, float, Candidate]] = {}
        self._split: dict[
            str, tuple[list[Row], dict[str, tuple[list[Row], list[Row]]]]
        ] = {}  # see _by_version
        self._waiting_here = 0  # requests of this replica in the fair queue
        # Of those, how many found no room in each pool at their last look (what an autoscaler would add).
        self.waiting_for: dict[str, int] = {"prefill": 0, "decode": 0}
        self._claim = asyncio.Lock()  # one waiter at a time turns seen room into a placement
        self._load_changed = asyncio.Event()  # set (and replaced) when a heartbeat here changes a load
        self._uncharged: dict[
            str, tuple[TenantConfig, float]
        ] = {}  # tenant → tokens admitted, not yet charged

    @property
    def waiting_here(self) -> int:
        """Place calls of this replica waiting in the fair queue now."""
        return self._waiting_here

    def load_changed(self) -> None:
        """A heartbeat here changed a worker's load: wake this replica's waiters (a slot may have freed)."""
        self._load_changed.set()
        self._load_changed = asyncio.Event()

    async def place(self, request: pb.PlaceRequest) -> pb.PlaceResponse:
        """One `Place`, its decision time recorded in the reply and the metrics."""
        t0 = time.perf_counter()
        try:
            resp = await self._place(request)
        except BaseException as e:
            metrics.record_place(time.perf_counter() - t0, request.model, error=e)
            raise
        resp.decision_ms = (time.perf_counter() - t0) * 1e3
        metrics.record_place(
            resp.decision_ms / 1e3,
            request.model,
            resp.tenant,
            resp.version,
            placed_with_prefill=resp.HasField("prefill_worker"),
        )
        return resp

    async def _place(self, request: pb.PlaceRequest) -> pb.PlaceResponse:
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        tenant = await self._lookups.tenant(request.api_key)
        ids = request.prompt_token_ids  # the repeated field itself: hashed as it is, not copied
        if not ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        model, weights, shadow = await self._lookups.catalog_view(request.model)
        pools = self._by_version(model, await self._snapshot.workers(model))
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
        charged = (request.request_id, *request.siblings)  # a call's other choices are charged with it
        if not request.resume:
            try:
                admission = await self._quota.admit(
                    tenant, request.request_id, len(ids), request.max_tokens, blocks_needed, request.siblings
                )
            except (asyncio.CancelledError, RedisError):
                # Given up mid-call, or the reply lost (a timeout, a dropped connection): the charge may
                # have landed all the same. Finish is idempotent; if Redis is down it fails too, and the
                # charge (if any) expires with the request TTL.
                with contextlib.suppress(RedisError):
                    await asyncio.shield(self._give_back(tenant, charged, len(ids)))
                raise
            if admission.already_admitted and not request.resent:
                # The id is in flight already (its charge is that request's: nothing to give back). A
                # client re-sending it after its gateway died must not have it generated twice.
                raise DuplicateRequest(
                    f"request id {request.request_id!r} is already in flight in this cluster (a gateway "
                    "that was lost may have streamed part of it); send it again with a new id"
                )
        try:
            placement = await self._place_or_wait(
                model, version, tenant, request, chain, len(ids), block_size, blocks_needed
            )
        except BaseException:
            if not request.resume:  # nothing was served: give the quota back
                await self._give_back(tenant, charged, len(ids))
            raise
        if request.resume:  # a call's other choice: its reserved charge is its own now
            await self._quota.claim(tenant, request.request_id)
        resp = pb.PlaceResponse(
            tenant=tenant.name,
            version=version,
            cache_salt=salt,
            decode_worker=placement.decode.address,
            decode_epoch=placement.decode.epoch,
            prefix_hit_blocks=placement.decode.hit_blocks,
            lease_ttl_s=self._config.lease_ttl_s,
        )
        if placement.prefill is not None:
            resp.prefill_worker = placement.prefill.address
            resp.prefill_epoch = placement.prefill.epoch
        await self._add_shadow(resp, model, request.request_id, shadow)
        return resp

    async def _give_back(self, tenant: TenantConfig, request_ids: Sequence[str], prompt_tokens: int) -> None:
        for request_id in request_ids:
            await self._quota.finish(tenant, request_id, prompt_tokens, 0)

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

    async def pools(
        self, model: str, version: str, chain: list[str]
    ) -> tuple[list[Candidate], list[Candidate]]:
        """The (decode, prefill) candidates of a model version for a request with this hash chain."""
        decode, prefill = self._by_version(model, await self._snapshot.workers(model)).get(version, ([], []))
        return self._pool(decode, chain), self._pool(prefill, chain)

    def _pool(self, rows: list[Row], chain: list[str]) -> list[Candidate]:
        """One pool's candidates for a request with this hash chain. Only a worker that holds the
        chain's first block can hold any of its leading blocks, so only those are searched further."""
        first = chain[0] if chain else ""
        pool = []
        now = time.time()
        for view, held in rows:
            c = self._candidate(view, now)
            if first in held:
                c = c._replace(hit_blocks=leading_hits(held, chain))
            pool.append(c)
        return pool

    def _candidate(self, view: WorkerView, now: float) -> Candidate:
        """A worker's load as of its last heartbeat, plus what this replica placed on it since: without
        that, every request of a burst would see the same idle worker and pile onto it. A placement
        counts until a load measured ``IN_TRANSIT_S`` after it (the request reaches the worker through
        the gateway, so a load measured just after the placement may not show it yet), or until a load
        measured after it has stood unreplaced that long and ``LOAD_QUIET_S`` more (`RecentPlacements.pending`).
        Kept until the worker's load or this replica's placements on it change, or such a placement
        stops counting: a decision rebuilds only those."""
        r, load = view.record, view.load
        recent = self._recent.get(r.address)
        added = recent.added if recent is not None else 0
        kept = self._candidates.get(r.address)
        if kept is not None and kept[0] is view and kept[1] == added and now < kept[2]:
            return kept[3]
        blocks, requests, until = (
            recent.pending(load.timestamp, now) if recent is not None else (0, 0, math.inf)
        )
        c = Candidate(
            r.address,
            r.role,
            r.num_blocks,
            max(0, load.free_blocks - blocks),
            load.running,
            load.waiting + requests,
            load.transfers,
            0,
            load.timestamp,
            added,
            view.epoch,
        )
        self._candidates[r.address] = (view, added, until, c)
        return c

    def forget_gone_workers(self) -> None:
        """Drops what this replica keeps per worker for workers no snapshot holds (placements only once
        they are older than the heartbeat timeout: a copy may be away for a moment after a registration)."""
        live = {view.record.address for rows in self._snapshot.cached().values() for view, _ in rows}
        old = time.time() - self._config.heartbeat_timeout_s
        for address in [a for a, recent in self._recent.items() if a not in live and recent.last_at() <= old]:
            del self._recent[address]
        for address in [a for a in self._candidates if a not in live]:
            del self._candidates[address]

    def note_placement(self, placement: Placement, blocks: int) -> None:
        """Counts a placement against its workers (``blocks`` new blocks on the decode worker)."""
        now = time.time()  # the clock of WorkerLoad.timestamp: this replica's, when the load arrived
        for c, n_blocks in (
            (placement.decode, max(0, blocks - placement.decode.hit_blocks)),
            (placement.prefill, 0),
        ):
            if c is not None:
                recent = self._recent.get(c.address)
                if recent is None:
                    recent = self._recent[c.address] = RecentPlacements()
                recent.add(now, n_blocks)

    async def _place_or_wait(
        self,
        model: str,
        version: str,
        tenant: TenantConfig,
        request: pb.PlaceRequest,
        chain: list[str],
        num_prompt_tokens: int,
        block_size: int,
        blocks_needed: int,
    ) -> Placement:
        """Places the request now if there is room and nobody waits; otherwise it waits in the
        tenant-fair queue, re-reading the workers' load, and goes when there is room *and* it is the
        next request in fair order. The placement is noted against its workers before the next waiter
        of this replica looks (one lock), so one free slot is never given twice here."""
        exclude = set(request.exclude_workers)
        config = self._config

        def place(pools: tuple[list[Candidate], list[Candidate]], light: bool = False) -> Placement:
            return self._placer.place(
                *pools, num_prompt_tokens, request.max_tokens, block_size, exclude, light
            )

        why, blocked = "others are waiting", ""
        if not self._waiting_here:  # with others waiting, a newcomer queues too: the fair order decides
            try:
                placement = place(await self.pools(model, version, chain))
            except NoCapacity as e:  # no room now: wait below
                why, blocked = str(e), e.pool
            else:
                self.note_placement(placement, blocks_needed)
                # Fair order counts every admission, not only the queued ones: charged to the tenant's
                # counter with the next flush (before anyone here enqueues or claims).
                _, tokens = self._uncharged.get(tenant.name, (tenant, 0.0))
                self._uncharged[tenant.name] = (tenant, tokens + num_prompt_tokens + request.max_tokens)
                return placement
        rid = request.request_id
        t0 = time.monotonic()
        waited = "abandoned"  # how the wait ends, for metrics: placed | timeout | abandoned
        await self.flush_charges()
        await self._queue.enqueue(tenant, rid, num_prompt_tokens + request.max_tokens, config.queue_timeout_s)
        deadline = time.monotonic() + config.queue_timeout_s
        ready_key = f"{config.prefix}fq:ready:{rid}"
        stalled = 0  # polls in a row that saw room while another request was next
        self._waiting_here += 1

        def blocked_on(pool: str) -> None:
            nonlocal blocked
            if pool != blocked:
                if blocked:
                    self.waiting_for[blocked] -= 1
                if pool:
                    self.waiting_for[pool] += 1
                blocked = pool

        if blocked:
            self.waiting_for[blocked] += 1
        try:
            # A light tenant's prompt need not wait for a heavier one's prefill (scheduler.placement).
            policy = self._placer.policy
            light = (
                policy.light_prefill_slot or policy.light_local_max_tokens > 0
            ) and await self._queue.is_light(tenant.name)
            look_now = light  # it may find its room at once (a prefill slot more, or the decode worker)
            while time.monotonic() < deadline:
                if not look_now:
                    with contextlib.suppress(asyncio.TimeoutError):  # a load change here, or the poll
                        await asyncio.wait_for(self._load_changed.wait(), config.queue_poll_s)
                look_now = False
                async with self._claim:  # the load read inside: it must include the last waiter's claim
                    try:
                        placement = place(await self.pools(model, version, chain), light)
                    except NoCapacity as e:
                        blocked_on(e.pool)
                        continue
                    blocked_on("")  # room: only its turn in the fair order is awaited
                    await self.flush_charges()
                    if await self._queue.pop_if_next(rid) or await self._client.delete(ready_key):
                        self.note_placement(placement, blocks_needed)
                        log.debug(
                            "request %s (tenant %s) waited %.0f ms (%s)",
                            rid,
                            tenant.name,
                            (time.monotonic() - t0) * 1e3,
                            why,
                        )
                        waited = "placed"
                        return placement
                    stalled += 1
                    if stalled >= STALLED_POLLS:
                        # The next request's waiter has not claimed the room for a while (its replica may
                        # be gone, or it waits for another model): take it out and hand it its turn.
                        stalled = 0
                        head = await self._queue.pop_next()
                        if head is not None:
                            await self._client.set(
                                f"{config.prefix}fq:ready:{head.request_id}",
                                "1",
                                ex=max(1, math.ceil(config.queue_timeout_s)),
                            )
            waited = "timeout"
            raise CapacityExceeded(
                f"no worker capacity for {config.queue_timeout_s:g} s (queue wait timed out)",
                retry_after_s=1.0,
            )
        finally:
            metrics.record_queue_wait(time.monotonic() - t0, tenant.name, waited)
            blocked_on("")
            self._waiting_here -= 1
            await self._queue.remove(rid)
            await self._client.delete(ready_key)

    async def flush_charges(self) -> None:
        """Charges the admissions placed without waiting to their tenants' fair-queue counters."""
        pending, self._uncharged = self._uncharged, {}
        for tenant, tokens in pending.values():
            await self._queue.charge(tenant, tokens)

    async def _add_shadow(
        self, resp: pb.PlaceResponse, model: str, request_id: str, shadow: tuple[str | None, float]
    ) -> None:
        shadow_version, share = shadow
        if not shadow_version or shadow_version == resp.version or not in_shadow(request_id, share):
            return
        views = await self._registry.healthy(model, shadow_version, roles=("decode",))
        if views:
            best = max(views, key=lambda v: (v.load.free_blocks, v.worker_id))
            resp.shadow_version, resp.shadow_worker = shadow_version, best.record.address
