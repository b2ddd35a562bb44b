"""Shadow traffic without workers (services.gateway.shadow): token agreement, next-token distribution agreement
(top-1, KL) on the shared prefix, the bound on shadows in flight, cancellation with the primary, what
each outcome records, and the report per version pair."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import grpc
import pytest

from baton.v1 import common_pb2, worker_pb2
from core.sampling_params import SamplingParams
from services.gateway import metrics
from services.gateway.request_stream import Delta, TokenLogprob
from services.gateway.router import ShadowReport
from services.gateway.shadow import (
    SHADOW_TOP_K,
    PrimaryResult,
    ShadowRequest,
    ShadowTraffic,
    distribution_agreement,
    first_divergence,
    next_token_kl,
    shared_prefix_positions,
    token_agreement,
)
from services.gateway.shadow import as_asked as _as_asked
from services.gateway.worker_clients import WorkerClients

PAIR = {"version": "v1", "shadow_version": "v2"}

pytestmark = pytest.mark.unit


def test_token_agreement_counts_positions_and_lengths() -> None:
    assert token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert token_agreement([1, 2, 3, 4], [1, 9, 3, 9]) == 0.5
    assert token_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # positions only one output reached disagree
    assert token_agreement([], []) == 1.0 and token_agreement([1], []) == 0.0
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def log_dist(probs: Mapping[int, float]) -> dict[int, float]:
    return {t: math.log(p) for t, p in probs.items()}


def test_next_token_kl_is_exact_on_a_full_support_and_bounded_on_a_partial_one() -> None:
    p, q = {1: 0.7, 2: 0.2, 3: 0.1}, {1: 0.6, 2: 0.3, 3: 0.1}
    exact = sum(p[t] * math.log(p[t] / q[t]) for t in p)
    assert next_token_kl(log_dist(p), log_dist(q)) == pytest.approx(exact)
    assert next_token_kl(log_dist(p), log_dist(p)) == pytest.approx(0.0, abs=1e-12)
    # Top-2 lists of a 4-token vocabulary: the rest of each is one bucket.
    p4, q4 = {1: 0.6, 2: 0.3}, {1: 0.5, 2: 0.3}  # rest 0.1 and 0.2
    coarse = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.3) + 0.1 * math.log(0.1 / 0.2)
    assert next_token_kl(log_dist(p4), log_dist(q4)) == pytest.approx(coarse)
    # Q lists other tokens than P's favourite: that token gets Q's smallest listed probability at most.
    far = next_token_kl(log_dist({1: 0.9}), log_dist({7: 0.5, 8: 0.001}))
    assert far == pytest.approx(0.9 * math.log(0.9 / 0.001) + 0.1 * math.log(0.1 / (1 - 0.001)))
    assert far > 5.0
    assert next_token_kl({}, log_dist(q)) == 0.0


def test_distributions_are_compared_on_the_shared_prefix_only() -> None:
    assert shared_prefix_positions([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert shared_prefix_positions([1, 2, 3, 4], [1, 2, 9, 9]) == 3  # the diverging position counts
    assert shared_prefix_positions([1, 2], [1, 2, 3]) == 2
    assert shared_prefix_positions([5], [6]) == 1 and shared_prefix_positions([], [1]) == 0
    a, b = log_dist({1: 0.8, 2: 0.2}), log_dist({2: 0.6, 1: 0.4})
    # Positions 0 and 1 agree on top-1; at 2 the outputs part (different favourites); 3 is past it.
    got = distribution_agreement([1, 1, 1, 1], [1, 1, 2, 9], [a, a, a, a], [a, a, b, b])
    assert (got.positions, got.top1_agreed) == (3, 2)
    assert got.mean_kl == pytest.approx(next_token_kl(a, b) / 3)
    short = distribution_agreement([1, 1, 1], [1, 1, 1], [a], [a, a, a])  # logprobs of one token only
    assert short.positions == 1 and short.top1_agreement == 1.0


def test_the_client_gets_only_the_logprobs_it_asked_for() -> None:
    top = {3: -0.1, 4: -2.0, 5: -3.0}
    delta = Delta([3], "x", [TokenLogprob(3, -0.1, top)])
    assert _as_asked(delta, None).logprobs == [] and _as_asked(delta, None).token_ids == [3]
    assert _as_asked(delta, 0).logprobs == [TokenLogprob(3, -0.1, {})]
    assert _as_asked(delta, 2).logprobs == [TokenLogprob(3, -0.1, {3: -0.1, 4: -2.0})]


class FakeDecode:
    """A worker's Decode stream: one token per message, each after ``delay_s`` (with ``top`` as each
    token's top logprobs, when given)."""

    def __init__(
        self, tokens: list[int], delay_s: float, fail: bool = False, top: dict[int, float] | None = None
    ) -> None:
        self.tokens, self.delay_s, self.fail, self.top = tokens, delay_s, fail, top
        self.cancelled = False
        self.request: worker_pb2.DecodeRequest | None = None

    def __aiter__(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        for t in self.tokens:
            await asyncio.sleep(self.delay_s)
            delta = common_pb2.TokenDelta(token_ids=[t])
            if self.top is not None:
                delta.logprobs.append(
                    common_pb2.TokenLogprob(token_id=t, logprob=self.top.get(t, -9.0), top=self.top)
                )
            yield worker_pb2.DecodeResponse(delta=delta)
        if self.fail:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom"
            )
        yield worker_pb2.DecodeResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeWorkers(WorkerClients):
    """WorkerClients whose stub gives one scripted Decode per call (its typed calls are the real ones)."""

    def __init__(self, *calls: FakeDecode) -> None:
        super().__init__()
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
    return ShadowRequest(
        rid, [1, 2, 3], SamplingParams(max_tokens=4, seed=7), "salt", "w2:1", "v2", "v1", "m"
    )


def count(outcome: str) -> float:
    return (
        metrics.REGISTRY.get_sample_value("baton_gateway_shadow_requests_total", {"outcome": outcome}) or 0.0
    )


def agreement() -> tuple[float, float]:
    get = metrics.REGISTRY.get_sample_value
    return (
        get("baton_gateway_shadow_agreement_sum", PAIR) or 0.0,
        get("baton_gateway_shadow_agreement_count", PAIR) or 0.0,
    )


def test_a_shadow_is_compared_with_what_the_client_got() -> None:
    async def main() -> None:
        workers = FakeWorkers(FakeDecode([5, 6, 7, 8], 0.001), FakeDecode([5, 6, 0, 0], 0.001))
        traffic = ShadowTraffic(cast(Any, workers), max_in_flight=4, timeout_s=5)
        same, other = traffic.start(request("a")), traffic.start(request("b"))
        assert same is not None and other is not None and traffic.num_in_flight == 2
        await asyncio.sleep(0)  # the shadows start their calls
        sent = workers.started[0].request
        assert sent is not None and sent.sampling.seed == 7 and sent.cache_salt == "salt"
        assert sent.sampling.logprobs == SHADOW_TOP_K  # what the distribution comparison needs
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


def test_each_comparison_is_reported_per_version_pair() -> None:
    get = metrics.REGISTRY.get_sample_value
    top = log_dist({5: 0.5, 6: 0.3, 7: 0.1})
    other = log_dist({6: 0.6, 5: 0.2, 7: 0.1})
    reports: list[ShadowReport] = []

    async def main() -> None:
        workers = FakeWorkers(FakeDecode([5, 6, 0], 0.001, top=other))
        run = ShadowTraffic(cast(Any, workers), max_in_flight=1, timeout_s=5, report=reports.append).start(
            request()
        )
        assert run is not None
        run.primary_finished(PrimaryResult([5, 6, 7], 0.010, 0.030, [top, top, top]))
        await asyncio.wait([run.task], timeout=5)

    before = {
        n: get(n, PAIR) or 0.0
        for n in (
            "baton_gateway_shadow_positions_total",
            "baton_gateway_shadow_top1_agreed_total",
            "baton_gateway_shadow_kl_nats_count",
        )
    }
    asyncio.run(main())
    [r] = reports
    assert (r.model, r.primary_version, r.shadow_version, r.identical) == ("m", "v1", "v2", False)
    assert r.greedy_agreement == pytest.approx(2 / 3)
    assert (r.positions, r.top1_agreed) == (3, 0)  # every position shared its context; no favourite agreed
    assert r.kl_sum == pytest.approx(3 * next_token_kl(top, other))
    assert r.primary_ttft_ms == pytest.approx(10.0) and r.primary_itl_ms == pytest.approx(10.0)
    assert r.shadow_ttft_ms > 0 and r.shadow_itl_ms > 0
    assert (
        get("baton_gateway_shadow_positions_total", PAIR)
        == before["baton_gateway_shadow_positions_total"] + 3
    )
    assert (
        get("baton_gateway_shadow_top1_agreed_total", PAIR)
        == before["baton_gateway_shadow_top1_agreed_total"]
    )
    assert get("baton_gateway_shadow_kl_nats_count", PAIR) == before["baton_gateway_shadow_kl_nats_count"] + 1
