"""`shutdown_step`: a shutdown step whose completion never comes is given up on an asyncio timer, with
a warning that names it; one that finishes in time is awaited to its end. (The gRPC poller's lost
completion it guards against cannot be caused on purpose: a future nobody resolves stands in for it.)"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from rpc.liveness import shutdown_step

pytestmark = pytest.mark.unit


def test_a_step_that_never_finishes_is_given_up_and_named(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[float, bool]:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        t0 = time.monotonic()
        await shutdown_step("the stuck part", never, 0.2)
        return time.monotonic() - t0, never.cancelled()

    with caplog.at_level(logging.WARNING, logger="rpc.liveness"):
        took, cancelled = asyncio.run(main())
    assert 0.2 <= took < 10.0
    assert cancelled  # nothing is left waiting behind the shutdown
    assert any("the stuck part did not finish in 0.2 s" in r.getMessage() for r in caplog.records)


def test_a_step_that_finishes_runs_to_its_end(caplog: pytest.LogCaptureFixture) -> None:
    done: list[str] = []

    async def step() -> None:
        await asyncio.sleep(0.01)
        done.append("closed")

    with caplog.at_level(logging.WARNING, logger="rpc.liveness"):
        asyncio.run(shutdown_step("a quick part", step(), 5.0))
    assert done == ["closed"]
    assert not caplog.records
