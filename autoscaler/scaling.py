"""What the autoscaler acts through: a `Scaler` per cluster kind — `autoscaler.kube.KubernetesScaler`
(the Deployments' scale subresource) or `services.local_scaler.LocalScaler` (`baton worker` processes
on this machine) — and the `PoolState` each reports. A pool is a set of interchangeable workers of one
role: ``prefill`` or ``decode``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

POOLS = ("prefill", "decode")


class ScalerError(RuntimeError):
    """A scaler could not read or change a pool (a missing Deployment, a refused patch); the message
    says which pool and why. The controller logs it and tries again at its next interval."""


@dataclass(frozen=True, slots=True)
class PoolState:
    """One pool as its scaler sees it now."""

    desired: int  # the replicas asked for (a Deployment's spec.replicas)
    ready: int  # replicas serving (a pod Ready; a process healthy and registered)
    pending: int  # replicas asked for that are not ready yet (starting, pulling, unschedulable)

    def __post_init__(self) -> None:
        if min(self.desired, self.ready, self.pending) < 0:
            raise ValueError(f"replica counts must not be negative: {self}")


class Scaler(Protocol):
    """Reads and sets a pool's replicas. Implementations are thread-safe: the controller calls them
    from its own thread."""

    def state(self, pool: str) -> PoolState:
        """The pool's replicas now; raises `ScalerError` if it cannot be read."""
        ...

    def scale(self, pool: str, replicas: int) -> None:
        """Asks for ``replicas`` in the pool (idempotent); raises `ScalerError` if refused. Removing a
        replica drains it: its streams finish or migrate before it exits."""
        ...

    def close(self) -> None:
        """Stops watches and closes connections."""
        ...
