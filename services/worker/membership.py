"""A worker's membership in the cluster: registration and heartbeats to the scheduler (load and the
prefix-cache block hashes placement reads), and the cancellation bus (cancels published by any
gateway replica reach the worker that holds the request). Both survive a scheduler or Redis outage:
they log, back off and carry on; requests in flight are never touched by them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import grpc

from baton.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from rpc.tls import Tls, channel

log = logging.getLogger(__name__)

MAX_PUBLISHED_HASHES = 4096  # placement needs leading blocks; a bounded set keeps heartbeats small
LOAD_BEAT_S = 0.02  # between full heartbeats, a changed load is published this often at most


class Membership:
    """Registers with the scheduler, then heartbeats every interval it is told (re-registering when
    the scheduler has evicted it). Between two full heartbeats (load and prefix hashes), a load that
    changed is published at once, at most every ``LOAD_BEAT_S``: admission waits on it (a finished
    request frees a slot that a queued one may take), so it must not be a second old.

    Each registration gets an epoch, which the heartbeats carry. A worker that must register again
    after no heartbeat was taken for longer than a registration lives (the process was stopped or
    starved, or cut off from the scheduler: SIGSTOP, a frozen host, a partition) was taken for dead,
    and its work may have been placed elsewhere meanwhile. It is then *fenced* first: ``on_fenced(epoch)``
    makes it refuse every call placed on that epoch from then on. (A Redis that restarted empty refuses
    a heartbeat too, but without the lapse: the worker simply registers again.)"""

    def __init__(
        self,
        scheduler: str,
        aengine: AsyncEngine,
        info: Callable[[LLMEngine], worker_pb2.InfoResponse],
        role: str,
        tls: Tls | None = None,
        on_fenced: Callable[[int], Awaitable[object]] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.aengine = aengine
        self._info = info
        self.role = role
        self.interval_s = 1.0
        self.draining = False
        self._channel = channel(scheduler, tls)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._task: asyncio.Task[None] | None = None
        self.registered = asyncio.Event()
        self.address = ""  # this worker's, once registered
        self._sent: tuple[object, ...] = ()  # the load last published
        self.epoch = 0  # this registration's (0: none yet)
        self.ttl_s = 3.0  # how long a registration lives without a heartbeat (3 intervals)
        self._acked = 0.0  # monotonic time of the last heartbeat the registry took
        self._on_fenced = on_fenced

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="membership")

    async def drain(self) -> None:
        """Leaves placement: tells the scheduler at once that this worker takes no new work; the
        heartbeats go on (saying so) while its requests in flight finish."""
        self.draining = True
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
            await self._beat(timeout_s=1.0)

    async def stop(self) -> None:
        if not self.draining:
            await self.drain()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()

    async def _run(self) -> None:
        known = False
        backoff = 0.2
        while True:
            try:
                if not known:
                    await self._fence_if_lapsed()
                    await self._register()
                    known = True
                    self.registered.set()
                else:
                    known = await self._beat()
                backoff = 0.2
                if known:
                    known = await self._load_beats(time.monotonic() + self.interval_s)
            except grpc.aio.AioRpcError as e:
                known = False
                log.warning(
                    "scheduler %s unreachable (%s); retrying in %.1fs", self.scheduler, e.code().name, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def _fence_if_lapsed(self) -> None:
        # `_acked` is when the last heartbeat the registry took was *sent*: the registry refreshed the
        # TTL somewhere between sending and the reply, so the send is the safe end of the last known
        # life. (Taken at the reply, a worker frozen with a reply in flight woke, read that old reply
        # as fresh, and re-registered without fencing what it held: its streams had moved on.)
        lapse = time.monotonic() - self._acked
        if not self.epoch or lapse <= self.ttl_s:
            return  # a registry that lost its state (Redis restarted empty): nothing was given away
        epoch, self.epoch = self.epoch, 0
        log.warning(
            "fenced: no heartbeat of registration %d was taken for %.1f s (it lives %.1f s without one); "
            "registering again",
            epoch,
            lapse,
            self.ttl_s,
        )
        if self._on_fenced is not None:
            await self._on_fenced(epoch)

    async def _snapshot(self) -> tuple[worker_pb2.InfoResponse, list[str]]:
        def read(engine: LLMEngine) -> tuple[worker_pb2.InfoResponse, list[str]]:
            hashes = [h.hex() for h in list(engine.kv.cached_hashes())[:MAX_PUBLISHED_HASHES]]
            return self._info(engine), hashes

        return await self.aengine.call(read)

    async def _load_beats(self, until: float) -> bool:
        """Until ``until``: publishes the load whenever it changed since the last heartbeat. Returns
        False if the scheduler no longer knows this worker."""
        while (left := until - time.monotonic()) > 0:
            await asyncio.sleep(min(LOAD_BEAT_S, left))
            load = self._load(await self.aengine.call(self._info))
            if _key(load) == self._sent:
                continue
            sent_at = time.monotonic()
            reply = await self._stub.Heartbeat(
                scheduler_pb2.HeartbeatRequest(
                    address=self.address, load=load, load_only=True, epoch=self.epoch
                ),
                timeout=5.0,
            )
            if not reply.known:
                return False
            self._acked = sent_at
            self._sent = _key(load)
        return True

    def _load(self, info: worker_pb2.InfoResponse) -> scheduler_pb2.WorkerLoad:
        return scheduler_pb2.WorkerLoad(
            free_blocks=info.num_free_blocks,
            running=info.num_running,
            waiting=info.num_waiting,
            transfers=info.num_transfers,
            leases=info.num_leases,
            draining=self.draining,
            queued_tokens=info.num_queued_tokens,
        )

    async def _register(self) -> None:
        info, _ = await self._snapshot()
        record = scheduler_pb2.WorkerRecord(
            address=info.address,
            role=self.role,
            model=info.model,
            version=info.model_digest,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_model_len=info.max_model_len,
            kv_backend=info.kv_backend,
        )
        load = self._load(info)
        sent_at = time.monotonic()
        reply = await self._stub.RegisterWorker(
            scheduler_pb2.RegisterWorkerRequest(worker=record, load=load), timeout=5.0
        )
        self._sent = _key(load)
        self.interval_s = max(0.05, reply.heartbeat_interval_s or 1.0)
        self.ttl_s, self.epoch, self._acked = 3 * self.interval_s, reply.epoch, sent_at
        self.address = info.address
        log.info(
            "registered with scheduler %s as %s (%s), epoch %d",
            self.scheduler,
            info.address,
            self.role,
            self.epoch,
        )

    async def _beat(self, timeout_s: float = 5.0) -> bool:
        info, hashes = await self._snapshot()
        load = self._load(info)
        sent_at = time.monotonic()
        reply = await self._stub.Heartbeat(
            scheduler_pb2.HeartbeatRequest(
                address=info.address, load=load, cached_block_hashes=hashes, epoch=self.epoch
            ),
            timeout=timeout_s,
        )
        self._sent = _key(load)
        if reply.known:
            self._acked = sent_at
        return bool(reply.known)


def _key(load: scheduler_pb2.WorkerLoad) -> tuple[object, ...]:
    return (
        load.free_blocks,
        load.running,
        load.waiting,
        load.transfers,
        load.leases,
        load.draining,
        load.queued_tokens,
    )


class RecentCancels:
    """Request ids the bus cancelled lately. A cancel can overtake its request (the gateway gave up
    while the call was still on its way): a worker checks here when a request arrives."""

    def __init__(self, keep_s: float = 600.0, max_ids: int = 100_000) -> None:
        self.keep_s = keep_s
        self.max_ids = max_ids
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = time.monotonic()
        self._ids.move_to_end(request_id)
        cutoff = time.monotonic() - self.keep_s
        while self._ids and (len(self._ids) > self.max_ids or next(iter(self._ids.values())) < cutoff):
            self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._ids


async def listen_for_cancels(
    redis_url: str, abort: Callable[[str], object], recent: RecentCancels
) -> Callable[[], Awaitable[None]]:
    """Subscribes to the cancellation bus; ``abort(request_id)`` runs for every cancel (idempotent)
    and the id is remembered in ``recent``. Returns an async stop function."""
    from rpc.redis_url import async_client
    from scheduler.cancel import CancellationBus

    client = async_client(redis_url)  # any URL rpc.redis_url reads: ACL user, TLS, Sentinel
    bus = CancellationBus(client)

    def on_cancel(request_id: str, reason: str) -> None:
        log.info("cancel of %s from the bus (%s)", request_id, reason)
        recent.add(request_id)
        abort(request_id)

    bus.listen(on_cancel)
    await bus.wait_subscribed(timeout_s=5.0)

    async def stop() -> None:
        await bus.stop()
        await client.aclose()

    return stop
