"""`ModelCatalog`: model names → immutable versions with rollout weights, and optional shadow traffic.

A version is a model digest (weights + config), announced by the workers that serve it. The first
version of a model gets weight 1; later ones arrive at weight 0, so a new build takes no traffic until
an operator gives it some (a canary). Rollback is a weight change: it applies to the next request.
The choice is sticky per request id (a hash, not a random draw), so a retried or migrated request
lands on the same version. Shadow traffic mirrors a share of requests to a candidate version; the
gateway records its latency and token agreement and never answers the client from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping

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
            await self._r.hset(self._weights_key(model), mapping={v: repr(float(w)) for v, w in weights.items()})
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
