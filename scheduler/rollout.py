"""`RolloutAdmin`: the model-version RPCs — `ListModelVersions` and `SetRollout` (an operator's,
through `baton models`) and `ReportShadow` (the gateway's comparison of a shadowed request)."""

from __future__ import annotations

import logging

from baton.v1 import scheduler_pb2 as pb
from core.errors import InvalidRequest, ModelNotFound
from scheduler.lookups import Lookups
from scheduler.registry import WorkerRegistry
from scheduler.versions import ModelCatalog

log = logging.getLogger(__name__)


class RolloutAdmin:
    """Versions, rollout weights and shadow traffic, read and set in the catalog."""

    def __init__(self, catalog: ModelCatalog, registry: WorkerRegistry, lookups: Lookups) -> None:
        self._catalog = catalog
        self._registry = registry
        self._lookups = lookups

    async def list_versions(self, request: pb.ListModelVersionsRequest) -> pb.ListModelVersionsResponse:
        resp = pb.ListModelVersionsResponse()
        for model in [request.model] if request.model else await self._catalog.models():
            resp.versions.extend(await self.versions(model))
            shadow, share = await self._catalog.shadow(model)
            if shadow:
                resp.shadow[model], resp.shadow_share[model] = shadow, share
            for stats in await self._catalog.comparisons(model):
                p_ttft, s_ttft, p_itl, s_itl = stats.latency_ms()
                resp.comparisons.append(
                    pb.ShadowComparison(
                        model=model,
                        primary_version=stats.primary_version,
                        shadow_version=stats.shadow_version,
                        requests=stats.requests,
                        identical=stats.identical,
                        greedy_agreement=stats.greedy_agreement,
                        positions=stats.positions,
                        top1_agreement=stats.top1_agreement,
                        mean_kl=stats.mean_kl,
                        primary_ttft_ms=p_ttft,
                        shadow_ttft_ms=s_ttft,
                        primary_itl_ms=p_itl,
                        shadow_itl_ms=s_itl,
                    )
                )
        return resp

    async def report_shadow(self, request: pb.ReportShadowRequest) -> pb.ReportShadowResponse:
        if (
            request.positions < request.top1_agreed
            or not 0.0 <= request.greedy_agreement <= 1.0
            or not request.kl_sum >= 0.0
        ):  # the last also refuses NaN
            raise InvalidRequest("a shadow report's figures are out of range")
        if request.model not in await self._catalog.models():
            raise ModelNotFound(f"model {request.model!r} is not known")
        has_itl = request.primary_itl_ms > 0 and request.shadow_itl_ms > 0
        try:
            await self._catalog.record_shadow(
                request.model,
                request.primary_version,
                request.shadow_version,
                {
                    "requests": 1,
                    "identical": float(request.identical),
                    "greedy_agreement": request.greedy_agreement,
                    "positions": request.positions,
                    "top1_agreed": request.top1_agreed,
                    "kl_sum": request.kl_sum,
                    "primary_ttft_ms": request.primary_ttft_ms,
                    "shadow_ttft_ms": request.shadow_ttft_ms,
                    "itl_requests": float(has_itl),
                    "primary_itl_ms": request.primary_itl_ms if has_itl else 0.0,
                    "shadow_itl_ms": request.shadow_itl_ms if has_itl else 0.0,
                },
            )
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return pb.ReportShadowResponse()

    async def set_rollout(self, request: pb.SetRolloutRequest) -> pb.SetRolloutResponse:
        """New weights (and optionally a shadow), in effect at once on this replica, within 50 ms on the others."""
        try:
            if request.model not in await self._catalog.models():
                raise ModelNotFound(f"model {request.model!r} is not known")
            known = set(await self._catalog.weights(request.model))
            unknown = sorted(set(request.weights) - known)
            if unknown:
                raise InvalidRequest(f"unknown version(s) of {request.model}: {', '.join(unknown)}")
            await self._catalog.set_weights(request.model, dict(request.weights))
            self._lookups.rollout_changed()
            if request.HasField("shadow_version"):
                await self._catalog.set_shadow(
                    request.model,
                    request.shadow_version or None,
                    request.shadow_share if request.HasField("shadow_share") else 0.0,
                )
                self._lookups.rollout_changed()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        log.info("rollout of %s set: %s", request.model, dict(request.weights))
        return pb.SetRolloutResponse(versions=await self.versions(request.model))

    async def versions(self, model: str) -> list[pb.ModelVersion]:
        """A model's versions with their weights, healthy workers (draining ones too) and context length."""
        weights = await self._catalog.weights(model)
        views = await self._registry.healthy(model, include_draining=True)
        out = []
        for version in sorted(weights):
            serving = [v for v in views if v.record.version == version]
            out.append(
                pb.ModelVersion(
                    model=model,
                    version=version,
                    weight=weights[version],
                    num_workers=len(serving),
                    max_model_len=min((v.record.max_model_len for v in serving), default=0),
                )
            )
        return out
