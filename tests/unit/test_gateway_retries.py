"""The gateway's failover decisions, without workers: which failures move a request, which worker it
leaves behind, and how often (services.gateway.dispatch)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from core.errors import (
    CapacityExceeded,
    InvalidRequest,
    KVTransferFailed,
    ServingError,
    Unavailable,
    WorkerLost,
)
from core.sampling_params import SamplingParams
from services.gateway import metrics
from services.gateway.admission import Limits, ModelInfo
from services.gateway.dispatch import MAX_KV_RETRIES, MAX_WORKER_RETRIES, Dispatcher
from services.gateway.job import Job as _Job
from services.gateway.router import Route, StaticRouter

pytestmark = pytest.mark.unit


class FakeWorkers:
    """Only what a retry decision asks: whether a worker answers Info."""

    def __init__(self, alive: set[str]) -> None:
        self.alive = alive

    async def info(self, address: str, timeout_s: float) -> object:
        if address not in self.alive:
            raise Unavailable(f"worker {address} is unavailable")
        return object()


def dispatcher(alive: frozenset[str] = frozenset({"p", "d"}), max_migrations: int = 2) -> Dispatcher:
    return Dispatcher(
        cast(Any, None),
        ModelInfo("m", "v1", 512, 384),
        Limits(None, 100, 100, max_migrations),
        StaticRouter(["p"], ["d"]),
        cast(Any, FakeWorkers(set(alive))),
        cast(Any, None),
    )


def job(stage: str, worker: str, sent: int = 0) -> _Job:
    j = _Job("r", [1, 2, 3], SamplingParams(max_tokens=50), None)
    j.route, j.stage, j.worker, j.sent_ids = Route(decode="d", prefill="p"), stage, worker, list(range(sent))
    return j


def count(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def retry(d: Dispatcher, j: _Job, error: ServingError) -> bool:
    return asyncio.run(d._may_retry(j, error))


def lost(address: str) -> WorkerLost:
    return WorkerLost(f"worker {address} is unavailable: Socket closed", address)


def test_a_dead_prefill_worker_is_left_behind_a_bounded_number_of_times() -> None:
    d, j = dispatcher(), job("prefill", "p")
    before = count("baton_gateway_worker_retries_total", stage="prefill")
    for n in range(MAX_WORKER_RETRIES):
        assert retry(d, j, lost("p"))
        assert j.failed == ["p"] * (n + 1)
    assert not retry(d, j, lost("p"))
    assert count("baton_gateway_worker_retries_total", stage="prefill") == before + MAX_WORKER_RETRIES


def test_a_failed_handoff_gets_one_fresh_prefill_without_whichever_failed() -> None:
    j = job("transfer", "d", sent=1)
    assert retry(dispatcher(), j, KVTransferFailed("the lease has already expired")) and j.failed == ["p"]
    assert not retry(dispatcher(), j, KVTransferFailed("again")) and MAX_KV_RETRIES == 1
    # D answered with UNAVAILABLE but is alive: the pull failed on P's side.
    j = job("transfer", "d", sent=1)
    assert retry(dispatcher(alive=frozenset({"p", "d"})), j, lost("d")) and j.failed == ["p"]
    # D does not answer: D is the one to leave.
    j = job("transfer", "d", sent=1)
    assert retry(dispatcher(alive=frozenset({"p"})), j, lost("d")) and j.failed == ["d"]


def test_a_decode_worker_that_dies_mid_stream_is_migrated_from() -> None:
    d, j = dispatcher(max_migrations=2), job("decode", "d", sent=7)
    before = count("baton_gateway_migrations_total")
    assert retry(d, j, lost("d")) and retry(d, j, lost("d2"))
    assert j.migrations == 2 and not retry(d, j, lost("d3"))
    assert count("baton_gateway_migrations_total") == before + 2
    assert not retry(dispatcher(max_migrations=0), job("decode", "d", sent=7), lost("d"))
    # A local decode that failed before any token counts as a retry, not a migration.
    j = job("decode", "d", sent=0)
    assert retry(dispatcher(), j, lost("d")) and j.migrations == 0 and j.retries == 1


@pytest.mark.parametrize(
    "error",
    [
        InvalidRequest("bad"),
        CapacityExceeded("full"),
        Unavailable("prefill worker returned no first token"),
        ServingError("internal error"),
    ],
)
def test_errors_that_are_not_a_lost_worker_end_the_request(error: ServingError) -> None:
    for stage, sent in (("prefill", 0), ("transfer", 1), ("decode", 5)):
        assert not retry(dispatcher(), job(stage, "d", sent), error)
