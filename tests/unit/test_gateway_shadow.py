"""Shadow traffic without workers (services.shadow): token agreement, the bound on shadows in flight,
cancellation with the primary, and what each outcome records."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, cast

import grpc
import pytest

from baton.v1 import common_pb2, worker_pb2
from core.sampling_params import SamplingParams
from services import metrics
from services.shadow import (
    PrimaryResult,
    ShadowRequest,
    ShadowTraffic,
    first_divergence,
    token_agreement,
)

pytestmark = pytest.mark.unit


def test_token_agreement_counts_positions_and_lengths() -> None:
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 9]) == 0.5
    assert token_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # positions only one output reached disagree
    assert token_agreement([], []) == 1.0 and token_agreement([1], []) == 0.0
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


class FakeDecode:
    """A worker's Decode stream: one token per message, each after ``delay_s``."""

    def __init__(self, tokens: list[int], delay_s: float, fail: bool = False) -> None:
        self.tokens, self.delay_s, self.fail = tokens, delay_s, fail
        self.cancelled = False
        self.request: worker_pb2.DecodeRequest | None = None

    def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        for t in self.tokens:
            await asyncio.sleep(self.delay_s)
            yield worker_pb2.DecodeResponse(delta=common_pb2.TokenDelta(token_ids=[t]))
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")
        yield worker_pb2.DecodeResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeWorkers:
    """WorkerClients with one scripted Decode per call."""

    def __init__(self, *calls: FakeDecode) -> None:
        self.calls = list(calls)
        self.started: list[FakeDecode] = []

    def stub(self, address: str) -> Any:
        workers = self

        class Stub:
            def Decode(self, request: worker_pb2.DecodeRequest, timeout: float | None = None) -> FakeDecode:  # noqa: N802
                call = workers.calls.pop(0)
                call.request = request
                workers.started.append(call)
                return call

        return Stub()


def request(rid: str = "r") -> ShadowRequest:
    return ShadowRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4, seed=7), "salt", "w2:1", "v2", "v1")


def count(outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value("baton_gateway_shadow_requests_total", {"outcome": outcome}) or 0.0


def agreement() -> tuple[float, float]:
    get = metrics.REGISTRY.get_sample_value
    return get("baton_gateway_shadow_agreement_sum") or 0.0, get("baton_gateway_shadow_agreement_count") or 0.0


def test_a_shadow_is_compared_with_what_the_client_got() -> None:
    async def main() -> None:
        workers = FakeWorkers(FakeDecode([5, 6, 7, 8], 0.001), FakeDecode([5, 6, 0, 0], 0.001))
        traffic = ShadowTraffic(cast(Any, workers), max_in_flight=4, timeout_s=5)
        same, other = traffic.start(request("a")), traffic.start(request("b"))
        assert same is not None and other is not None and traffic.num_in_flight == 2
        await asyncio.sleep(0)  # the shadows start their calls
        sent = workers.started[0].request
        assert sent is not None and sent.sampling.seed == 7 and sent.cache_salt == "salt"
        assert not sent.HasField("handle") and list(sent.prompt_token_ids) == [1, 2, 3]
        same.primary_finished(PrimaryResult([5, 6, 7, 8], 0.01, 0.02))
        other.primary_finished(PrimaryResult([5, 6, 7, 8], 0.01, 0.02))
        await asyncio.wait([same.task, other.task], timeout=5)
        assert traffic.num_in_flight == 0

    before = count("identical"), count("diverged"), agreement()
    asyncio.run(main())
    after = count("identical"), count("diverged"), agreement()
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1
    assert after[2][0] - before[2][0] == pytest.approx(1.5) and after[2][1] == before[2][1] + 2


def test_shadows_over_the_bound_are_skipped() -> None:
    async def main() -> None:
        workers = FakeWorkers(FakeDecode([1], 0.001))
        traffic = ShadowTraffic(cast(Any, workers), max_in_flight=1, timeout_s=5)
        first = traffic.start(request("a"))
        assert first is not None and traffic.start(request("b")) is None
        first.primary_finished(PrimaryResult([1], 0.0, 0.0))
        await first.task
        assert traffic.num_in_flight == 0
        assert ShadowTraffic(cast(Any, workers), max_in_flight=0).start(request("c")) is None

    before = count("skipped")
    asyncio.run(main())
    assert count("skipped") == before + 2


@pytest.mark.parametrize("outcome", ["cancelled", "primary_failed"])
def test_a_shadow_ends_with_its_primary(outcome: str) -> None:
    async def main() -> FakeDecode:
        workers = FakeWorkers(FakeDecode(list(range(1000)), 0.01))
        run = ShadowTraffic(cast(Any, workers), max_in_flight=1, timeout_s=5).start(request())
        assert run is not None
        await asyncio.sleep(0.03)
        run.cancel(outcome)
        await asyncio.wait([run.task], timeout=5)
        return workers.started[0]

    before = count(outcome)
    call = asyncio.run(main())
    assert call.cancelled  # the worker call was cancelled: the worker drops the request
    assert count(outcome) == before + 1


def test_a_failed_or_slow_shadow_is_counted_and_never_raises() -> None:
    async def main() -> None:
        workers = FakeWorkers(FakeDecode([1, 2], 0.001, fail=True), FakeDecode(list(range(100)), 0.05))
        traffic = ShadowTraffic(cast(Any, workers), max_in_flight=2, timeout_s=0.2)
        failed, slow = traffic.start(request("a")), traffic.start(request("b"))
        assert failed is not None and slow is not None
        await asyncio.wait([failed.task, slow.task], timeout=5)
        assert failed.task.exception() is None and slow.task.exception() is None
        assert workers.started[1].cancelled

    before = count("failed"), count("timeout")
    asyncio.run(main())
    assert (count("failed"), count("timeout")) == (before[0] + 1, before[1] + 1)


def test_close_stops_every_shadow() -> None:
    async def main() -> None:
        workers = FakeWorkers(FakeDecode(list(range(1000)), 0.01))
        traffic = ShadowTraffic(cast(Any, workers), max_in_flight=1, timeout_s=5)
        run = traffic.start(request())
        assert run is not None
        await traffic.close()
        assert run.task.done() and traffic.num_in_flight == 0

    before = count("shutdown")
    asyncio.run(main())
    assert count("shutdown") == before + 1
