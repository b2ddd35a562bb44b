"""Tenants: their quota configuration, the API keys that map to them, and their prefix-cache salts.

Everything lives in Redis so that every stateless gateway and scheduler replica resolves a key the
same way. API keys are stored only as SHA-256 digests: a dump of Redis reveals no usable key. A plain
(unsalted, unstretched) digest is enough because keys are long random tokens, not passwords, and a
lookup must find the tenant from the key alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from core.errors import Unauthenticated

# Tenant names appear inside Redis keys and salt derivations, so they are kept to a plain alphabet.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


_KINDS: dict[str, tuple[type, ...]] = {"str": (str,), "float": (int, float), "int": (int,), "bool": (bool,)}


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant's limits and fair share. The defaults suit a modest interactive tenant.

    Each rate is a token bucket whose capacity is ``rate × burst_s``: an idle tenant may spend that
    much at once, then ``rate`` per second.
    """

    name: str
    requests_per_s: float = 10.0
    tokens_per_s: float = 20_000.0
    burst_s: float = 10.0
    max_concurrent: int = 64
    max_kv_blocks: int = 100_000
    max_queue_depth: int = 256
    weight: float = 1.0  # share of contended capacity, relative to other tenants' weights
    share_prefix_cache: bool = False  # True: the tenant's prompts may hit other sharing tenants' cache

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # JSON from Redis or an operator: true is not a number here
            value, kinds = getattr(self, f.name), _KINDS[str(f.type)]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise ValueError(f"tenant field {f.name} must be {f.type}, got {value!r}")
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tenant name {self.name!r} must match {_NAME.pattern}")
        for field in ("requests_per_s", "tokens_per_s", "burst_s", "weight"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"tenant {self.name!r}: {field} must be a positive number, got {value}")
        if self.request_burst < 1:
            raise ValueError(f"tenant {self.name!r}: requests_per_s × burst_s must allow one request")
        if self.max_concurrent < 1 or self.max_kv_blocks < 1:
            raise ValueError(f"tenant {self.name!r}: max_concurrent and max_kv_blocks must be at least 1")
        if self.max_queue_depth < 0:
            raise ValueError(f"tenant {self.name!r}: max_queue_depth must be 0 (never wait) or more")

    @property
    def request_burst(self) -> float:
        """Capacity of the request bucket (requests)."""
        return self.requests_per_s * self.burst_s

    @property
    def token_burst(self) -> float:
        """Capacity of the token bucket (tokens): the largest request the tenant can ever send."""
        return self.tokens_per_s * self.burst_s

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TenantConfig:
        data: dict[str, Any] = json.loads(text)
        # Ignore fields a newer replica may have written, so a rolling upgrade can still read them.
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def api_key_digest(api_key: str) -> str:
    """What is stored in place of an API key."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def cache_salt(tenant: TenantConfig, model_version: str) -> str:
    """The prefix-cache salt of a tenant's requests on one model version; never taken from a client.

    Different salts give different block hashes, so one tenant's prompts can never hit (or time) another
    tenant's cached blocks. Tenants configured to share get one salt per version. The version is part
    of the salt so that a cache entry never outlives the weights it was computed with.
    """
    # The NUL separators and distinct domain tags keep ("a", "b.c") and ("a.b", "c") apart, and keep
    # the shared salt apart from every tenant's own.
    if tenant.share_prefix_cache:
        material = f"baton/shared-prefix-salt\0{model_version}"
    else:
        material = f"baton/tenant-prefix-salt\0{tenant.name}\0{model_version}"
    return hashlib.sha256(material.encode()).hexdigest()[:32]


_DIGEST = re.compile(r"[0-9a-f]{64}")


def read_key_digests(path: str) -> dict[str, str]:
    """A keys file: one ``TENANT SHA256-HEX`` line per API key (``#`` comments and blank lines allowed);
    returns digest → tenant. A malformed line is an error naming its number (never its content)."""
    digests: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            text = line.split("#", 1)[0].strip()
            if not text:
                continue
            parts = text.split()
            if len(parts) != 2 or not _NAME.fullmatch(parts[0]) or not _DIGEST.fullmatch(parts[1].lower()):
                raise ValueError(f"{path}:{number}: expected 'TENANT SHA256-HEX-OF-KEY'")
            digests[parts[1].lower()] = parts[0]
    return digests


# Resolve in one round trip: key digest → tenant name → tenant config.
_RESOLVE = """
local name = redis.call('HGET', KEYS[1], ARGV[1])
if not name then return false end
return redis.call('HGET', KEYS[2], name)
"""

# Removing a tenant revokes its keys in the same step, so no key is left pointing at nothing.
_REMOVE_TENANT = """
local removed = redis.call('HDEL', KEYS[2], ARGV[1])
local keys = redis.call('HGETALL', KEYS[1])
for i = 1, #keys, 2 do
  if keys[i + 1] == ARGV[1] then redis.call('HDEL', KEYS[1], keys[i]) end
end
return removed
"""


class TenantDirectory:
    """Tenant configs and API keys in Redis: ``{prefix}tenants`` (name → config JSON) and
    ``{prefix}api_keys`` (SHA-256 of a key → tenant name).

    ``default_tenant``, when set, is the tenant of requests that carry no API key at all (a local or
    trusted deployment); a key that is present but unknown is always refused.
    """

    def __init__(
        self, client: aioredis.Redis, prefix: str = "baton:", default_tenant: str | None = None
    ) -> None:
        self._client = client
        self._tenants_key = f"{prefix}tenants"
        self._keys_key = f"{prefix}api_keys"
        self.default_tenant = default_tenant
        self._resolve = client.register_script(_RESOLVE)
        self._remove_tenant = client.register_script(_REMOVE_TENANT)

    async def add_tenant(self, tenant: TenantConfig) -> None:
        """Create or replace a tenant's config; in-flight requests keep what they were charged."""
        await self._client.hset(self._tenants_key, tenant.name, tenant.to_json())

    async def remove_tenant(self, name: str) -> bool:
        """Delete a tenant and revoke all its API keys; False if there was no such tenant."""
        return bool(await self._remove_tenant(keys=[self._keys_key, self._tenants_key], args=[name]))

    async def get_tenant(self, name: str) -> TenantConfig | None:
        text = await self._client.hget(self._tenants_key, name)
        return None if text is None else TenantConfig.from_json(str(text))

    async def list_tenants(self) -> list[TenantConfig]:
        configs = await self._client.hgetall(self._tenants_key)
        return sorted((TenantConfig.from_json(str(text)) for text in configs.values()), key=lambda t: t.name)

    async def add_api_key(self, api_key: str, tenant: str) -> None:
        """Map a key to an existing tenant (a key already in use moves to this tenant)."""
        if not api_key:
            raise ValueError("an API key must not be empty")
        if await self.get_tenant(tenant) is None:
            raise ValueError(f"no tenant named {tenant!r}; add the tenant before its keys")
        await self._client.hset(self._keys_key, api_key_digest(api_key), tenant)

    async def ensure_key_digests(self, digests: dict[str, str]) -> int:
        """Maps each SHA-256 key digest to its tenant where Redis lacks the mapping (configured keys,
        `read_key_digests`); returns how many were added."""
        if not digests:
            return 0
        have = await self._client.hmget(self._keys_key, list(digests))
        missing = {d: t for (d, t), held in zip(digests.items(), have, strict=True) if held is None}
        for digest, tenant in missing.items():  # rare: a fresh or emptied Redis
            await self._client.hset(self._keys_key, digest, tenant)
        return len(missing)

    async def revoke_api_key(self, api_key: str) -> bool:
        """False if the key was not known."""
        return bool(await self._client.hdel(self._keys_key, api_key_digest(api_key)))

    async def resolve(self, api_key: str | None) -> TenantConfig:
        """The tenant of a request's API key; raises `Unauthenticated` when there is none."""
        if not api_key:
            if self.default_tenant is None:
                raise Unauthenticated("no API key given: send one as 'Authorization: Bearer <key>'")
            tenant = await self.get_tenant(self.default_tenant)
            if tenant is None:
                # A misconfiguration, but refusing is safer than serving without limits.
                raise Unauthenticated(
                    f"no API key given, and the default tenant {self.default_tenant!r} does not exist"
                )
            return tenant
        text = await self._resolve(keys=[self._keys_key, self._tenants_key], args=[api_key_digest(api_key)])
        if text is None:
            # Same message for unknown, revoked and orphaned keys: a caller learns nothing by probing.
            raise Unauthenticated("invalid API key")
        return TenantConfig.from_json(str(text))
