"""`Reaper`: a replica's background pass, every ``reap_interval_s``. It expires overdue leases and
tells their prefill worker to free the blocks, sweeps workers whose heartbeats stopped, recreates the
default tenant if Redis lost it, and charges the admissions that did not wait to the fair queue."""

from __future__ import annotations

import asyncio
import logging

import grpc
from redis.exceptions import RedisError

from baton.v1 import worker_pb2, worker_pb2_grpc
from rpc.tls import channel
from scheduler.config import ClusterSchedulerConfig
from scheduler.leases import LeaseLedger
from scheduler.lookups import Lookups
from scheduler.placing import Decider
from scheduler.registry import WorkerRegistry

log = logging.getLogger(__name__)


class Reaper:
    """One replica's reaper; any number of replicas may run one at once."""

    def __init__(
        self,
        config: ClusterSchedulerConfig,
        lookups: Lookups,
        decider: Decider,
        leases: LeaseLedger,
        registry: WorkerRegistry,
    ) -> None:
        self._config = config
        self._lookups = lookups
        self._decider = decider
        self._leases = leases
        self._registry = registry
        self._tls = config.tls.load()

    async def reap_forever(self) -> None:
        """Expires overdue leases (each exactly once across replicas) and tells the prefill worker to
        free them; sweeps workers whose heartbeats stopped; charges the admissions that did not wait (so
        the fair queue's demand is never older than this). Survives Redis outages."""
        while True:
            try:
                await self._lookups.ensure_default_tenant()
                await self._decider.flush_charges()
                self._decider.forget_gone_workers()
                for lease in await self._leases.expire_due():
                    await self.free_on_worker(lease.prefill_worker, lease.request_id)
                await self._registry.sweep()
            except RedisError as e:
                log.warning("reaper: Redis unavailable (%s); retrying", e)
            await asyncio.sleep(self._config.reap_interval_s)

    async def free_on_worker(self, address: str, request_id: str) -> None:
        """Asks a prefill worker to free an expired lease's blocks (`Worker.Abort`)."""
        try:
            async with channel(address, self._tls) as worker:
                await worker_pb2_grpc.WorkerStub(worker).Abort(
                    worker_pb2.AbortRequest(request_id=request_id), timeout=2.0
                )
        except grpc.aio.AioRpcError as e:  # a dead worker's blocks died with it
            log.info("reaper: could not reach %s to free %s: %s", address, request_id, e.details())
