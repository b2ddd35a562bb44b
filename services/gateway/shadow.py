"""Shadow traffic: a request mirrored to a candidate model version, never answered from.

When the scheduler's `Place` names a ``shadow_worker`` (the model has a shadow version and the request
id falls in its share), the gateway sends that worker the same request in the background: a `Decode`
without a handle (the shadow worker prefills locally), the same prompt token ids and the same sampling
params — the seed the gateway fixed included, so a seeded request samples the same random stream. The
client never waits for it and never sees it. Once both have ended they are compared, per version pair
(metrics labelled by both versions, one log line per request, and a report to the scheduler that
`baton models list` shows):

* **greedy-token agreement**: the share of output positions where both hold the same token;
* **top-1 agreement** and **KL(primary || shadow)** of the next-token distributions on the *shared
  prefix*: every position whose context (prompt and the tokens before it) both saw alike, that is up to
  and including the first position where they diverge. Both run with the top ``SHADOW_TOP_K``
  logprobs on (the primary's are trimmed back to what its client asked for before they reach it); KL
  is estimated from those top-k sets (`next_token_kl`);
* TTFT and ITL of both sides (the shadow prefills locally, so its TTFT includes a prefill the primary
  may have had on a prefill worker).

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
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from core.errors import ServingError
from core.sampling_params import MAX_LOGPROBS, SamplingParams
from services.gateway import metrics
from services.gateway.request_stream import Delta, TokenLogprob
from services.gateway.router import ShadowReport
from services.gateway.worker_clients import Leg, WorkerClients

log = logging.getLogger(__name__)

SHADOW_TOP_K = MAX_LOGPROBS  # alternatives per token both sides return, for top-1 agreement and KL
TopLogprobs = Mapping[int, float]  # token id -> logprob: the most likely next tokens at one position


@dataclass(frozen=True, slots=True)
class ShadowRequest:
    """What a shadow runs: the primary's request as the workers see it, and where to mirror it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams  # seeded by the gateway, with SHADOW_TOP_K logprobs
    cache_salt: str
    worker: str  # the shadow worker's address
    version: str  # the shadow version
    primary_version: str
    model: str = ""


@dataclass(frozen=True, slots=True)
class PrimaryResult:
    """What the client got: its tokens and latencies (seconds from acceptance), and the top logprobs
    the primary's worker returned per token (before they were trimmed for the client)."""

    token_ids: Sequence[int]
    ttft_s: float
    e2e_s: float
    top: Sequence[TopLogprobs] = ()


@dataclass(frozen=True, slots=True)
class ShadowResult:
    """The shadow's output and latencies (seconds from its start, right after placement)."""

    token_ids: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    top: list[TopLogprobs] = field(default_factory=list)


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


def with_top_logprobs(params: SamplingParams) -> SamplingParams:
    """``params`` asking for the SHADOW_TOP_K alternatives per token the comparison needs (or more)."""
    if (params.logprobs or 0) >= SHADOW_TOP_K:
        return params
    return dataclasses.replace(params, logprobs=SHADOW_TOP_K)


def next_token_kl(p: TopLogprobs, q: TopLogprobs) -> float:
    """KL(P || Q) of one position's next-token distributions, estimated from their top-k logprobs.

    The support is P's top-k and one bucket for the rest of the vocabulary. A token of P's top-k
    that Q's top-k lacks gets Q's smallest listed probability (Q gives it at most that), capped by the
    mass Q leaves outside its list, spread over such tokens. This is the KL of the two distributions
    coarsened onto P's top-k, with Q's unknown entries at their upper bound: small for twins, large
    for a candidate that puts little mass where the primary does (zero when both lists are equal)."""
    if not p or not q:
        return 0.0
    p_prob = {t: math.exp(lp) for t, lp in p.items()}
    q_listed = {t: math.exp(lq) for t, lq in q.items()}
    q_left = max(0.0, 1.0 - sum(q_listed.values()))
    missing = [t for t in p_prob if t not in q_listed]
    q_floor = min(min(q_listed.values()), q_left / len(missing)) if missing else 0.0
    kl = 0.0
    q_used = 0.0
    for t, pt in p_prob.items():
        qt = q_listed.get(t, q_floor)
        q_used += qt
        if pt > 0.0:
            kl += pt * (math.log(pt) - math.log(max(qt, 1e-30)))
    p_rest = max(0.0, 1.0 - sum(p_prob.values()))
    q_rest = max(1e-30, 1.0 - q_used)
    if p_rest > 0.0:
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)


def shared_prefix_positions(primary: Sequence[int], shadow: Sequence[int]) -> int:
    """How many positions both saw with the same context: the leading equal tokens, and the first
    position after them where both produced a token (the one where they diverge)."""
    n = min(len(primary), len(shadow))
    same = first_divergence(primary, shadow)
    return n if same is None else min(same + 1, n)


@dataclass(frozen=True, slots=True)
class DistributionAgreement:
    """Next-token distributions compared on the shared prefix."""

    positions: int
    top1_agreed: int
    kl_sum: float

    @property
    def top1_agreement(self) -> float:
        return self.top1_agreed / self.positions if self.positions else 1.0

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.positions if self.positions else 0.0


def distribution_agreement(
    primary: Sequence[int],
    shadow: Sequence[int],
    primary_top: Sequence[TopLogprobs],
    shadow_top: Sequence[TopLogprobs],
) -> DistributionAgreement:
    """Top-1 agreement and KL(primary || shadow) over the positions of the shared prefix where both
    returned their top logprobs."""
    n = min(shared_prefix_positions(primary, shadow), len(primary_top), len(shadow_top))
    agreed, kl = 0, 0.0
    for p, q in zip(primary_top[:n], shadow_top[:n], strict=True):
        if p and q and max(p, key=p.__getitem__) == max(q, key=q.__getitem__):
            agreed += 1
        kl += next_token_kl(p, q)
    return DistributionAgreement(n, agreed, kl)


def _itl_s(ttft_s: float, e2e_s: float, num_tokens: int) -> float:
    return (e2e_s - ttft_s) / (num_tokens - 1) if num_tokens > 1 else 0.0


class ShadowRun:
    """One mirrored request: its background task, told how the primary ended."""

    def __init__(
        self,
        request: ShadowRequest,
        workers: WorkerClients,
        timeout_s: float,
        report: Callable[[ShadowReport], None] | None = None,
    ) -> None:
        self.request = request
        self._workers = workers
        self._timeout_s = timeout_s
        self._report = report
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
            pair = (self.request.primary_version, self.request.version)
            metrics.SHADOW_TTFT.labels(*pair).observe(shadow.ttft_s)
            metrics.SHADOW_E2E.labels(*pair).observe(shadow.e2e_s)
            primary = await self._primary
            self._outcome = self._record(primary, shadow)
        except (ServingError, TimeoutError) as e:
            log.info(
                "request %s: shadow on %s (version %s) %s: %s",
                self.request.request_id,
                self.request.worker,
                self.request.version,
                self._outcome,
                getattr(e, "message", None) or "no answer in time",
            )
        except Exception:  # a bug in the shadow path must never reach the client's request
            log.exception("request %s: shadow failed", self.request.request_id)

    async def _decode(self) -> ShadowResult:
        r = self.request
        start = time.perf_counter()
        leg = Leg(
            r.request_id, list(r.prompt_token_ids), with_top_logprobs(r.params), r.cache_salt, self._timeout_s
        )
        token_ids: list[int] = []
        top: list[TopLogprobs] = []
        ttft_s = 0.0
        async with contextlib.aclosing(self._workers.decode(r.worker, leg)) as events:
            async for event in events:  # closed early, the worker drops the request
                if not isinstance(event, Delta):
                    continue
                if event.token_ids and not token_ids:
                    ttft_s = time.perf_counter() - start
                token_ids.extend(event.token_ids)
                top.extend(lp.top for lp in event.logprobs)
        return ShadowResult(token_ids, ttft_s, time.perf_counter() - start, top)

    def _record(self, primary: PrimaryResult, shadow: ShadowResult) -> str:
        r = self.request
        pair = (r.primary_version, r.version)
        agreement = token_agreement(primary.token_ids, shadow.token_ids)
        dist = distribution_agreement(primary.token_ids, shadow.token_ids, primary.top, shadow.top)
        identical = list(primary.token_ids) == shadow.token_ids
        metrics.SHADOW_AGREEMENT.labels(*pair).observe(agreement)
        if dist.positions:
            metrics.SHADOW_POSITIONS.labels(*pair).inc(dist.positions)
            metrics.SHADOW_TOP1_AGREED.labels(*pair).inc(dist.top1_agreed)
            metrics.SHADOW_KL.labels(*pair).observe(dist.mean_kl)
        p_itl = _itl_s(primary.ttft_s, primary.e2e_s, len(primary.token_ids))
        s_itl = _itl_s(shadow.ttft_s, shadow.e2e_s, len(shadow.token_ids))
        if s_itl:
            metrics.SHADOW_ITL.labels(*pair).observe(s_itl)
        log.info(
            "request %s shadowed on %s: version %s vs %s %s agreement=%.3f top1=%.3f kl=%.4f positions=%d "
            "tokens=%d/%d first_divergence=%s ttft=%.1fms itl=%.1fms (primary ttft=%.1fms itl=%.1fms)",
            r.request_id,
            r.worker,
            r.version,
            r.primary_version,
            "identical" if identical else "diverged",
            agreement,
            dist.top1_agreement,
            dist.mean_kl,
            dist.positions,
            len(shadow.token_ids),
            len(primary.token_ids),
            first_divergence(primary.token_ids, shadow.token_ids),
            shadow.ttft_s * 1e3,
            s_itl * 1e3,
            primary.ttft_s * 1e3,
            p_itl * 1e3,
        )
        if self._report is not None:
            self._report(
                ShadowReport(
                    r.model,
                    r.primary_version,
                    r.version,
                    identical,
                    agreement,
                    dist.positions,
                    dist.top1_agreed,
                    dist.kl_sum,
                    primary.ttft_s * 1e3,
                    shadow.ttft_s * 1e3,
                    p_itl * 1e3,
                    s_itl * 1e3,
                )
            )
        return "identical" if identical else "diverged"


class ShadowTraffic:
    """Starts shadows, at most ``max_in_flight`` at once, each for at most ``timeout_s``."""

    def __init__(
        self,
        workers: WorkerClients,
        max_in_flight: int = 16,
        timeout_s: float = 120.0,
        report: Callable[[ShadowReport], None] | None = None,
    ) -> None:
        self._workers = workers
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self._report = report  # where each comparison goes besides metrics and the log (the scheduler)
        self._runs: set[ShadowRun] = set()

    @property
    def num_in_flight(self) -> int:
        return len(self._runs)

    def start(self, request: ShadowRequest) -> ShadowRun | None:
        """Mirrors ``request`` in the background; None (counted as skipped) when too many already run."""
        if len(self._runs) >= self.max_in_flight:
            metrics.SHADOW_REQUESTS.labels("skipped").inc()
            log.info(
                "request %s: shadow on %s skipped (%d shadows in flight)",
                request.request_id,
                request.worker,
                len(self._runs),
            )
            return None
        run = ShadowRun(request, self._workers, self.timeout_s, self._report)
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
            log.info(
                "request %s: shadow on %s (version %s) %s",
                run.request.request_id,
                run.request.worker,
                run.request.version,
                run.outcome,
            )

    async def close(self) -> None:
        """Cancels every shadow still running (the gateway is stopping)."""
        runs = list(self._runs)
        for run in runs:
            run.cancel("shutdown")
        if runs:
            await asyncio.wait([r.task for r in runs], timeout=5.0)


def as_asked(delta: Delta, num_logprobs: int | None) -> Delta:
    """A shadowed primary's ``delta`` with the logprobs its client asked for: none, or each token's
    ``num_logprobs`` best (the primary asked its workers for SHADOW_TOP_K)."""
    if num_logprobs is None:
        return Delta(delta.token_ids, delta.text, prompt_logprobs=delta.prompt_logprobs)
    trimmed = [
        TokenLogprob(
            lp.token_id, lp.logprob, dict(sorted(lp.top.items(), key=lambda kv: -kv[1])[:num_logprobs])
        )
        for lp in delta.logprobs
    ]
    return Delta(delta.token_ids, delta.text, trimmed, delta.prompt_logprobs)
