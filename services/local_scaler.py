"""`LocalScaler`: the autoscaler's `Scaler` over `baton up`'s own processes — a pool is the worker
children of one role; a scale-up starts more `baton worker` processes (fresh ports, registered with the
scheduler like the rest), a scale-down retires the newest (SIGTERM: it drains, its streams finish or
continue token-exactly on another decode worker, and it is not started again). So `baton up
--autoscale` runs the whole loop — metrics, policy, processes — for real on one machine."""

from __future__ import annotations

import logging

from autoscaler.scaling import POOLS, PoolState, ScalerError
from services.launcher import WorkerFactory
from services.supervisor import Child, Supervisor

log = logging.getLogger(__name__)


class LocalScaler:
    """Starts and retires worker processes of ``supervisor`` (thread-safe through its lock)."""

    def __init__(self, supervisor: Supervisor, factory: WorkerFactory) -> None:
        self.supervisor = supervisor
        self.factory = factory
        self._next = {pool: 1 + len(self._members(pool)) for pool in POOLS}

    def _members(self, pool: str) -> list[Child]:
        """The pool's children not being retired, oldest first."""
        with self.supervisor.lock:
            return [c for c in self.supervisor.children if c.pool == pool and c.retiring_since is None]

    def _check(self, pool: str) -> None:
        if pool not in POOLS or (self.factory.colocated and pool == "prefill"):
            raise ScalerError(f"this cluster has no {pool} pool to scale")

    def state(self, pool: str) -> PoolState:
        self._check(pool)
        members = self._members(pool)
        ready = sum(1 for c in members if c.restart_at is None and c.healthy())
        return PoolState(desired=len(members), ready=ready, pending=len(members) - ready)

    def scale(self, pool: str, replicas: int) -> None:
        self._check(pool)
        if replicas < 0:
            raise ScalerError(f"cannot scale {pool} to {replicas} replicas")
        with self.supervisor.lock:
            members = self._members(pool)
            for _ in range(replicas - len(members)):
                child, _metrics = self.factory.child(pool, self._next[pool])
                self._next[pool] += 1
                self.supervisor.add(child)
                log.info(
                    "%s pool: started %s (pid %s)", pool, child.name, child.proc.pid if child.proc else "-"
                )
            for child in reversed(members[replicas:]):  # the newest go first
                self.supervisor.retire(child)
                log.info("%s pool: retiring %s (it drains, then exits)", pool, child.name)

    def close(self) -> None:
        """Nothing of its own to close: the processes are the supervisor's."""
