"""A worker's membership loop decides alone whether its registration may have lapsed, so it is tested
alone: the scheduler's replies are played by a stand-in stub with controlled timing (the loop's RPCs
are exercised for real in tests/integration/test_failover.py and test_partition.py)."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from baton.v1 import scheduler_pb2, worker_pb2
from services.worker.membership import Membership

pytestmark = pytest.mark.unit


class _Engine:
    kv = types.SimpleNamespace(cached_hashes=lambda: [])


class _AsyncEngine:
    async def call(self, fn: Any) -> Any:
        return fn(_Engine())


class _Scheduler:
    """Registers at epoch 1, 2, ...; the first full heartbeat's reply is delayed past the registration's
    life (the worker froze with it in flight: SIGSTOP right after sending); every later one is refused
    (the registry evicted the frozen worker)."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self.epochs = 0
        self.beats = 0

    async def RegisterWorker(self, request: Any, timeout: float) -> Any:  # noqa: N802 (the RPC's name)
        self.epochs += 1
        return scheduler_pb2.RegisterWorkerResponse(epoch=self.epochs, heartbeat_interval_s=0.05)

    async def Heartbeat(self, request: Any, timeout: float) -> Any:  # noqa: N802
        self.beats += 1
        if self.beats == 1:
            await asyncio.sleep(self.stall_s)  # the registry took it at once; the reply reads late
            return scheduler_pb2.HeartbeatResponse(known=True)
        return scheduler_pb2.HeartbeatResponse(known=False)


def test_a_reply_read_after_a_freeze_does_not_hide_the_lapse() -> None:
    stall_s = 0.5
    fenced: list[int] = []

    async def on_fenced(epoch: int) -> None:
        fenced.append(epoch)

    async def scenario() -> Membership:
        m = Membership(
            "127.0.0.1:1",
            _AsyncEngine(),  # type: ignore[arg-type]
            lambda e: worker_pb2.InfoResponse(address="127.0.0.1:2", model="m"),
            "decode",
            on_fenced=on_fenced,
        )
        m._stub = _Scheduler(stall_s)  # type: ignore[assignment]
        m.start()
        for _ in range(400):
            await asyncio.sleep(0.01)
            if m.epoch >= 2:
                break
        await m.stop()
        return m

    m = asyncio.run(scenario())
    assert m.epoch == 2, "the refused worker registered again"
    # Registration 1 lives 0.15 s (3 intervals); its last heartbeat taken was *sent* 0.5 s before the
    # refusal, so the worker fences it before registering again.
    assert fenced == [1]
