"""`Lookups`: the configuration a replica reads per request — an API key's tenant, a tenant by name,
the models served, a model's rollout weights and shadow — each cached for a short time, so a decision
rarely reads it from Redis."""

from __future__ import annotations

import logging
import time

from core.errors import InvalidRequest, ModelNotFound, Unauthenticated, Unavailable
from scheduler.config import ClusterSchedulerConfig
from scheduler.snapshot import TTLCache
from scheduler.tenants import TenantConfig, TenantDirectory, read_key_digests
from scheduler.versions import ModelCatalog

log = logging.getLogger(__name__)


class Lookups:
    """Tenants and the model catalog as one replica sees them. Tenants and keys change rarely: a
    revoked key stops working within 1 s on every replica. Rollout weights change at once on the
    replica that set them (`rollout_changed`) and within 50 ms on the others. The list of models is
    re-read at most once a second, and at once after a registration here (`models_changed`)."""

    def __init__(
        self, config: ClusterSchedulerConfig, tenants: TenantDirectory, catalog: ModelCatalog
    ) -> None:
        self._config = config
        self._tenants = tenants
        self._key_digests = read_key_digests(config.api_keys_file) if config.api_keys_file else {}
        self._catalog = catalog
        self._tenant_cache: TTLCache[str, TenantConfig] = TTLCache(1.0)  # API key → its tenant
        self._tenant_names: TTLCache[str, TenantConfig] = TTLCache(1.0)  # name → config, for Finish
        self._models: tuple[float, list[str]] = (0.0, [])  # (read at, names)
        # model → (version weights, (shadow version, shadow share))
        self._catalog_cache: TTLCache[str, tuple[dict[str, float], tuple[str | None, float]]] = TTLCache(0.05)

    async def tenant(self, api_key: str) -> TenantConfig:
        """The tenant of an API key; no key (or, with ``accept_any_key``, an unknown one) → the default
        tenant. An unknown key otherwise raises `Unauthenticated`."""
        cached = self._tenant_cache.get(api_key)
        if cached is not None:
            return cached
        try:
            return self._tenant_cache.put(api_key, await self._tenants.resolve(api_key or None))
        except Unauthenticated:
            if api_key and not self._config.accept_any_key:
                raise
        await self.ensure_default_tenant()  # Redis may have lost it (a restart without persistence)
        return self._tenant_cache.put(api_key, await self._tenants.resolve(None))

    async def tenant_named(self, name: str) -> TenantConfig | None:
        """A tenant by name, remembered for up to 1 s as a key's tenant is: a Finish needs no read of it."""
        cached = self._tenant_names.get(name)
        if cached is not None:
            return cached
        tenant = await self._tenants.get_tenant(name)
        return self._tenant_names.put(name, tenant) if tenant is not None else None

    async def ensure_default_tenant(self) -> None:
        """The default tenant and the keys file are configuration, not state: recreate them if Redis
        lost them (a restart without persistence), so requests work again without an operator."""
        if await self._tenants.ensure_key_digests(self._key_digests):
            log.info("API keys of %s (re)added", self._config.api_keys_file)
        name = self._config.default_tenant
        if name and await self._tenants.get_tenant(name) is None:
            # Anonymous traffic of a single-team cluster: limited by capacity, not by a quota.
            await self._tenants.add_tenant(
                TenantConfig(
                    name,
                    requests_per_s=1e6,
                    tokens_per_s=1e9,
                    burst_s=1.0,
                    max_concurrent=100_000,
                    max_kv_blocks=10**9,
                    max_queue_depth=10_000,
                )
            )
            log.info("default tenant %r (re)created", name)

    async def catalog_view(self, name: str) -> tuple[str, dict[str, float], tuple[str | None, float]]:
        """The model name (or the only one served), its version weights and shadow, in one read."""
        model = await self.model_name(name)
        view = self._catalog_cache.get(model)
        if view is None:
            view = self._catalog_cache.put(model, await self._catalog.read(model))
        return model, view[0], view[1]

    async def model_name(self, name: str) -> str:
        """The model a request names, or the only one served when it names none."""
        read_at, models = self._models
        if time.monotonic() - read_at > 1.0:
            models = await self._catalog.models()
            self._models = (time.monotonic(), models)
        if not name:
            if len(models) == 1:
                return models[0]
            if not models:
                raise Unavailable("no worker has registered a model yet")
            raise InvalidRequest(f"name a model: this cluster serves {', '.join(models)}")
        if not models:
            raise Unavailable("no worker has registered a model yet")
        if name not in models:
            raise ModelNotFound(f"model {name!r} is not served here (served: {', '.join(models) or 'none'})")
        return name

    def models_changed(self) -> None:
        """A worker registered here: read the list of models again at the next request."""
        self._models = (0.0, [])

    def rollout_changed(self) -> None:
        """Rollout weights or a shadow were set here: read them again at the next request."""
        self._catalog_cache.invalidate()
