"""Shadow traffic: a request mirrored to a candidate model version, never answered from.

When the scheduler's `Place` names a ``shadow_worker`` (the model has a shadow version and the request
id falls in its share), the gateway sends that worker the same request in the background: a `Decode`
without a handle (the shadow worker prefills locally), the same prompt token ids and the same sampling
params — the seed the gateway fixed included, so a seeded request samples the same random stream. The
client never waits for it and never sees it. Once both have ended, the shadow's latency and its token
agreement with what the client got are recorded (metrics and one log line per request).

* **Bounded**: at most ``max_in_flight`` shadows run at once; the rest are skipped (and counted), so a
  slow candidate cannot pile up work behind the real traffic.
* **Cancelled with the primary**: a primary that is cancelled or fails cancels its shadow (the
  worker drops it at its next step). It has the primary's request id, so a cancel published on the
  scheduler's bus reaches it too.
* **Cache salt**: the shadow runs with the salt the scheduler derived for the primary's version.
  Salts only partition a worker's own prefix cache, and every block on the shadow worker was computed
  with the shadow version's weights, so reusing the salt cannot mix versions' KV; it keeps tenants
  apart exactly as the primary's does. (A salt of the shadow version's own would need a second Place.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from baton.v1 import worker_pb2
from core.errors import ServingError
from core.sampling_params import SamplingParams
from services import metrics
from services.convert import sampling_to_pb
from services.worker_clients import WorkerClients, worker_error

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShadowRequest:
    """What a shadow runs: the primary's request as the workers see it, and where to mirror it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams  # seeded by the gateway
    cache_salt: str
    worker: str  # the shadow worker's address
    version: str  # the shadow version
    primary_version: str


@dataclass(frozen=True, slots=True)
class PrimaryResult:
    """What the client got: its tokens and latencies (seconds from acceptance)."""

    token_ids: Sequence[int]
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True, slots=True)
class ShadowResult:
    """The shadow's output and latencies (seconds from its start, right after placement)."""

    token_ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    e2e_s: float = 0.0


def token_agreement(primary: Sequence[int], shadow: Sequence[int]) -> float:
    """The share of positions where both outputs hold the same token; a position only one of them
    reached counts as a disagreement. Two empty outputs agree."""
    n = max(len(primary), len(shadow))
    if n == 0:
        return 1.0
    return sum(a == b for a, b in zip(primary, shadow, strict=False)) / n


def first_divergence(primary: Sequence[int], shadow: Sequence[int]) -> int | None:
    """The first position where the outputs differ (a length difference included), or None."""
    for i, (a, b) in enumerate(zip(primary, shadow, strict=False)):
        if a != b:
            return i
    return None if len(primary) == len(shadow) else min(len(primary), len(shadow))


class ShadowRun:
    """One mirrored request: its background task, told how the primary ended."""

    def __init__(self, request: ShadowRequest, workers: WorkerClients, timeout_s: float) -> None:
        self.request = request
        self._workers = workers
        self._timeout_s = timeout_s
        self._primary: asyncio.Future[PrimaryResult] = asyncio.get_running_loop().create_future()
        self._outcome = "failed"
        self._cancel_outcome = "cancelled"
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"shadow-{request.request_id}")

    def primary_finished(self, result: PrimaryResult) -> None:
        """The client got its whole output: compare once the shadow has its own."""
        if not self._primary.done():
            self._primary.set_result(result)

    def cancel(self, outcome: str = "cancelled") -> None:
        """The primary was cancelled (or failed: ``primary_failed``); stop the shadow too."""
        if not self.task.done():
            self._cancel_outcome = outcome
            self.task.cancel()

    @property
    def outcome(self) -> str:
        """How it ended (read once its task is done): see `metrics.SHADOW_REQUESTS`."""
        return self._cancel_outcome if self.task.cancelled() else self._outcome

    async def _run(self) -> None:
        try:
            try:
                async with asyncio.timeout(self._timeout_s):
                    shadow = await self._decode()
            except TimeoutError:
                self._outcome = "timeout"
                raise
            metrics.SHADOW_TTFT.observe(shadow.ttft_s)
            metrics.SHADOW_E2E.observe(shadow.e2e_s)
            primary = await self._primary
            self._outcome = self._record(primary, shadow)
        except (ServingError, TimeoutError) as e:
            log.info("request %s: shadow on %s (version %s) %s: %s", self.request.request_id, self.request.worker,
                     self.request.version, self._outcome, getattr(e, "message", None) or "no answer in time")
        except Exception:  # a bug in the shadow path must never reach the client's request
            log.exception("request %s: shadow failed", self.request.request_id)

    async def _decode(self) -> ShadowResult:
        r = self.request
        start = time.perf_counter()
        message = worker_pb2.DecodeRequest(request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                                           sampling=sampling_to_pb(r.params), cache_salt=r.cache_salt)
        token_ids: list[int] = []
        ttft_s = 0.0
        call = self._workers.stub(r.worker).Decode(message, timeout=self._timeout_s)
        try:
            async for msg in call:
                if msg.delta.token_ids and not token_ids:
                    ttft_s = time.perf_counter() - start
                token_ids.extend(msg.delta.token_ids)
        except grpc.aio.AioRpcError as e:
            raise worker_error(e, r.worker) from None
        finally:
            call.cancel()  # a no-op once it has finished; otherwise the worker drops the request
        return ShadowResult(token_ids, ttft_s, time.perf_counter() - start)

    def _record(self, primary: PrimaryResult, shadow: ShadowResult) -> str:
        agreement = token_agreement(primary.token_ids, shadow.token_ids)
        identical = list(primary.token_ids) == shadow.token_ids
        metrics.SHADOW_AGREEMENT.observe(agreement)
        r = self.request
        log.info(
            "request %s shadowed on %s: version %s vs %s %s agreement=%.3f tokens=%d/%d first_divergence=%s "
            "ttft=%.1fms e2e=%.1fms (primary ttft=%.1fms e2e=%.1fms)",
            r.request_id, r.worker, r.version, r.primary_version, "identical" if identical else "diverged",
            agreement, len(shadow.token_ids), len(primary.token_ids),
            first_divergence(primary.token_ids, shadow.token_ids), shadow.ttft_s * 1e3, shadow.e2e_s * 1e3,
            primary.ttft_s * 1e3, primary.e2e_s * 1e3,
        )
        return "identical" if identical else "diverged"


class ShadowTraffic:
    """Starts shadows, at most ``max_in_flight`` at once, each for at most ``timeout_s``."""

    def __init__(self, workers: WorkerClients, max_in_flight: int = 16, timeout_s: float = 120.0) -> None:
        self._workers = workers
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self._runs: set[ShadowRun] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._runs)

    def start(self, request: ShadowRequest) -> ShadowRun | None:
        """Mirrors ``request`` in the background; None (counted as skipped) when too many already run."""
        if len(self._runs) >= self.max_in_flight:
            metrics.SHADOW_REQUESTS.labels("skipped").inc()
            log.info("request %s: shadow on %s skipped (%d shadows in flight)", request.request_id, request.worker,
                     len(self._runs))
            return None
        run = ShadowRun(request, self._workers, self.timeout_s)
        self._runs.add(run)
        metrics.SHADOW_IN_FLIGHT.inc()
        run.task.add_done_callback(lambda _: self._done(run))
        return run

    def _done(self, run: ShadowRun) -> None:
        # Counted here, not in the task: a task cancelled before its first step never runs its body.
        self._runs.discard(run)
        metrics.SHADOW_IN_FLIGHT.dec()
        metrics.SHADOW_REQUESTS.labels(run.outcome).inc()
        if run.task.cancelled():  # the other outcomes logged their own line
            log.info("request %s: shadow on %s (version %s) %s", run.request.request_id, run.request.worker,
                     run.request.version, run.outcome)

    async def close(self) -> None:
        """Cancels every shadow still running (the gateway is stopping)."""
        runs = list(self._runs)
        for run in runs:
            run.cancel("shutdown")
        if runs:
            await asyncio.wait([r.task for r in runs], timeout=5.0)
