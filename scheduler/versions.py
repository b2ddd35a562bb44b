"""`ModelCatalog`: model names → immutable versions with rollout weights, and optional shadow traffic.

A version is a model digest (weights + config), announced by the workers that serve it. The first
version of a model gets weight 1; later ones arrive at weight 0, so a new build takes no traffic until
an operator gives it some (a canary). Rollback is a weight change: it applies to the next request.
The choice is sticky per request id (a hash, not a random draw), so a retried or migrated request
lands on the same version. Shadow traffic mirrors a share of requests to a candidate version; the
gateway records its latency and token agreement and never answers the client from it, and reports
each comparison here (`record_shadow`): sums per (primary, shadow) version pair, read back as means by
`comparisons` for `baton models list`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis


def _unit(request_id: str, salt: str) -> float:
    """A stable number in [0, 1) per request id (and purpose)."""
    digest = hashlib.sha256(f"{salt}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose_version(weights: Mapping[str, float], request_id: str, available: Collection[str]) -> str | None:
    """Picks among the available versions in proportion to their weights, sticky per request id.

    When every available version has weight 0 (e.g. the weighted one has no healthy worker left),
    falls back to the available version of highest weight, then the lexically first: serving an
    unweighted version beats refusing the request. None if nothing is available."""
    live = sorted(v for v in available)
    if len(live) <= 1:
        return live[0] if live else None  # one version: whatever the weights, it is the one
    weighted = [(v, max(0.0, weights.get(v, 0.0))) for v in live]
    total = sum(w for _, w in weighted)
    if total <= 0:
        return sorted(live, key=lambda v: (-weights.get(v, 0.0), v))[0]
    point = _unit(request_id, "version") * total
    for version, w in weighted:
        if point < w:
            return version
        point -= w
    return weighted[-1][0]  # rounding at the top edge


def in_shadow(request_id: str, share: float) -> bool:
    return share > 0 and _unit(request_id, "shadow") < share


# The sums kept per version pair (a Redis hash's fields); `ShadowStats` turns them into means.
SHADOW_SUMS = (
    "requests",
    "identical",
    "greedy_agreement",
    "positions",
    "top1_agreed",
    "kl_sum",
    "primary_ttft_ms",
    "shadow_ttft_ms",
    "itl_requests",
    "primary_itl_ms",
    "shadow_itl_ms",
)


@dataclass(frozen=True, slots=True)
class ShadowStats:
    """What the shadowed requests of one version pair showed (means of the recorded sums)."""

    primary_version: str
    shadow_version: str
    sums: Mapping[str, float]

    def _mean(self, key: str, over: str) -> float:
        n = self.sums.get(over, 0.0)
        return self.sums.get(key, 0.0) / n if n else 0.0

    @property
    def requests(self) -> int:
        return int(self.sums.get("requests", 0))

    @property
    def identical(self) -> int:
        return int(self.sums.get("identical", 0))

    @property
    def positions(self) -> int:
        return int(self.sums.get("positions", 0))

    @property
    def greedy_agreement(self) -> float:
        return self._mean("greedy_agreement", "requests")

    @property
    def top1_agreement(self) -> float:
        return self._mean("top1_agreed", "positions")

    @property
    def mean_kl(self) -> float:
        return self._mean("kl_sum", "positions")

    def latency_ms(self) -> tuple[float, float, float, float]:
        """Mean TTFT of primary and shadow, then mean ITL of each (over requests with 2+ tokens)."""
        return (
            self._mean("primary_ttft_ms", "requests"),
            self._mean("shadow_ttft_ms", "requests"),
            self._mean("primary_itl_ms", "itl_requests"),
            self._mean("shadow_itl_ms", "itl_requests"),
        )


class ModelCatalog:
    """Rollout weights and shadow settings per model, in Redis (shared by every scheduler replica).
    The client must use ``decode_responses=True``."""

    def __init__(self, client: aioredis.Redis, prefix: str = "baton:") -> None:
        self._r = client
        self._p = prefix

    def _weights_key(self, model: str) -> str:
        return f"{self._p}model:{model}:weights"

    def _shadow_key(self, model: str) -> str:
        return f"{self._p}model:{model}:shadow"

    def _pairs_key(self, model: str) -> str:
        return f"{self._p}model:{model}:shadow-pairs"

    def _stats_key(self, model: str, primary: str, shadow: str) -> str:
        return f"{self._p}model:{model}:shadow-stats:{primary}:{shadow}"

    async def announce(self, model: str, version: str) -> None:
        """A worker serves ``version``: the model's first version gets weight 1, later ones 0."""
        key = self._weights_key(model)
        await self._r.sadd(f"{self._p}models", model)
        if await self._r.hlen(key) == 0:
            await self._r.hsetnx(key, version, "1")
        else:
            await self._r.hsetnx(key, version, "0")

    async def models(self) -> list[str]:
        return sorted(str(m) for m in await self._r.smembers(f"{self._p}models"))

    async def weights(self, model: str) -> dict[str, float]:
        raw = await self._r.hgetall(self._weights_key(model))
        return {str(v): float(w) for v, w in raw.items()}

    async def read(self, model: str) -> tuple[dict[str, float], tuple[str | None, float]]:
        """Weights and shadow setting of a model in one round trip (a placement reads both)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hgetall(self._weights_key(model))
        pipe.hgetall(self._shadow_key(model))
        raw_weights, raw_shadow = await pipe.execute()
        weights = {str(v): float(w) for v, w in raw_weights.items()}
        version = str(raw_shadow["version"]) if raw_shadow.get("version") else None
        return weights, (version, float(raw_shadow.get("share", 0.0)) if version else 0.0)

    async def set_weights(self, model: str, weights: Mapping[str, float]) -> dict[str, float]:
        for version, w in weights.items():
            if not (w >= 0.0):  # also rejects NaN
                raise ValueError(f"weight of {version} must be >= 0, got {w}")
        if weights:
            await self._r.hset(
                self._weights_key(model), mapping={v: repr(float(w)) for v, w in weights.items()}
            )
        return await self.weights(model)

    async def shadow(self, model: str) -> tuple[str | None, float]:
        raw = await self._r.hgetall(self._shadow_key(model))
        version = str(raw["version"]) if raw.get("version") else None
        return version, float(raw.get("share", 0.0)) if version else 0.0

    async def set_shadow(self, model: str, version: str | None, share: float) -> None:
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"shadow share must be in [0, 1], got {share}")
        if not version:
            await self._r.delete(self._shadow_key(model))
        else:
            await self._r.hset(self._shadow_key(model), mapping={"version": version, "share": repr(share)})

    async def record_shadow(self, model: str, primary: str, shadow: str, values: Mapping[str, float]) -> None:
        """Adds one shadowed request's figures (keys of `SHADOW_SUMS`) to its version pair's sums."""
        unknown = set(values) - set(SHADOW_SUMS)
        if unknown:
            raise ValueError(f"unknown shadow figures: {', '.join(sorted(unknown))}")
        if not primary or not shadow:
            raise ValueError("a shadow report names both versions")
        pipe = self._r.pipeline(transaction=True)
        pipe.sadd(self._pairs_key(model), f"{primary}\t{shadow}")
        key = self._stats_key(model, primary, shadow)
        for field_name, value in values.items():
            if value:
                pipe.hincrbyfloat(key, field_name, float(value))
        await pipe.execute()

    async def comparisons(self, model: str) -> list[ShadowStats]:
        """Every version pair of ``model`` shadowed so far, with its sums."""
        pairs = sorted(str(p).split("\t", 1) for p in await self._r.smembers(self._pairs_key(model)))
        if not pairs:
            return []
        pipe = self._r.pipeline(transaction=False)
        for primary, shadow in pairs:
            pipe.hgetall(self._stats_key(model, primary, shadow))
        raw = await pipe.execute()
        return [
            ShadowStats(primary, shadow, {str(k): float(v) for k, v in sums.items()})
            for (primary, shadow), sums in zip(pairs, raw, strict=True)
        ]
