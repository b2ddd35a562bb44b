"""TenantDirectory against a real redis-server: keys hashed at rest, resolution, salts."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis_runner import run

from core.errors import Unauthenticated
from scheduler.tenants import TenantConfig, TenantDirectory, api_key_digest, cache_salt

pytestmark = pytest.mark.unit

SECRET = "sk-baton-9f8e7d6c5b4a39281706f5e4d3c2b1a0"


def test_api_keys_are_hashed_at_rest(url: str, redis_client: Any) -> None:
    async def body(r: aioredis.Redis) -> None:
        d = TenantDirectory(r)
        await d.add_tenant(TenantConfig("acme"))
        await d.add_api_key(SECRET, "acme")

    run(url, body)
    everything: list[str] = []
    for key in redis_client.scan_iter("*"):
        everything.append(key)
        kind = redis_client.type(key)
        if kind == "hash":
            for field, value in redis_client.hgetall(key).items():
                everything += [field, value]
        elif kind == "string":
            everything.append(redis_client.get(key))
    assert everything, "nothing was stored"
    assert not any(SECRET in item for item in everything)
    assert api_key_digest(SECRET) in everything


def test_resolve_known_unknown_and_revoked_keys(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        d = TenantDirectory(r)
        acme = TenantConfig("acme", tokens_per_s=500.0, weight=2.0)
        await d.add_tenant(acme)
        await d.add_api_key(SECRET, "acme")
        assert await d.resolve(SECRET) == acme
        for bad in ("sk-wrong", None, ""):
            with pytest.raises(Unauthenticated) as e:
                await d.resolve(bad)
            assert e.value.grpc_code == "UNAUTHENTICATED" and e.value.http_status == 401
        with pytest.raises(Unauthenticated, match="invalid API key"):
            await d.resolve("sk-wrong")
        with pytest.raises(Unauthenticated, match="no API key"):
            await d.resolve(None)
        assert await d.revoke_api_key(SECRET)
        assert not await d.revoke_api_key(SECRET)
        with pytest.raises(Unauthenticated, match="invalid API key"):
            await d.resolve(SECRET)
        with pytest.raises(ValueError, match="no tenant named"):
            await d.add_api_key("sk-other", "nobody")

    run(url, body)


def test_default_tenant_only_for_requests_without_a_key(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        d = TenantDirectory(r, default_tenant="anonymous")
        with pytest.raises(Unauthenticated, match="default tenant 'anonymous' does not exist"):
            await d.resolve(None)
        anonymous = TenantConfig("anonymous", requests_per_s=1.0)
        await d.add_tenant(anonymous)
        assert await d.resolve(None) == anonymous
        assert await d.resolve("") == anonymous
        with pytest.raises(Unauthenticated):  # a wrong key is never quietly anonymous
            await d.resolve("sk-wrong")

    run(url, body)


def test_tenants_list_replace_and_remove(url: str) -> None:
    async def body(r: aioredis.Redis) -> None:
        d = TenantDirectory(r, prefix="t1:")
        await d.add_tenant(TenantConfig("zeta"))
        await d.add_tenant(TenantConfig("alpha"))
        await d.add_tenant(TenantConfig("alpha", max_concurrent=3))
        assert [(t.name, t.max_concurrent) for t in await d.list_tenants()] == [("alpha", 3), ("zeta", 64)]
        await d.add_api_key("k1", "alpha")
        await d.add_api_key("k2", "zeta")
        assert await d.remove_tenant("alpha")
        assert not await d.remove_tenant("alpha")
        with pytest.raises(Unauthenticated):
            await d.resolve("k1")  # its keys went with it
        assert (await d.resolve("k2")).name == "zeta"
        assert await TenantDirectory(r, prefix="t2:").list_tenants() == []  # prefixes are separate

    run(url, body)


def test_tenant_config_validation_and_json() -> None:
    for bad in ("", "has space", "a:b", "{x}", "x" * 65):
        with pytest.raises(ValueError, match="must match"):
            TenantConfig(bad)
    with pytest.raises(ValueError, match="tokens_per_s"):
        TenantConfig("a", tokens_per_s=0)
    with pytest.raises(ValueError, match="weight"):
        TenantConfig("a", weight=float("nan"))
    with pytest.raises(ValueError, match="must allow one request"):
        TenantConfig("a", requests_per_s=0.5, burst_s=1.0)
    # Stored as JSON: a value of the wrong type is refused, a boolean included (true is no count).
    for field, value in (
        ("max_concurrent", True),
        ("tokens_per_s", "5"),
        ("share_prefix_cache", 1),
        ("max_kv_blocks", 2.5),
    ):
        with pytest.raises(ValueError, match=f"{field} must be"):
            TenantConfig.from_json(json.dumps({"name": "a", field: value}))
    t = TenantConfig("a", requests_per_s=2.0, tokens_per_s=100.0, burst_s=3.0, share_prefix_cache=True)
    assert (t.request_burst, t.token_burst) == (6.0, 300.0)
    assert TenantConfig.from_json(t.to_json()) == t
    newer = t.to_json()[:-1] + ', "added_later": 1}'
    assert TenantConfig.from_json(newer) == t


def test_cache_salt_is_per_tenant_and_version_unless_shared() -> None:
    a, b = TenantConfig("a"), TenantConfig("b")
    shared_x = TenantConfig("x", share_prefix_cache=True)
    shared_y = TenantConfig("y", share_prefix_cache=True)
    assert cache_salt(a, "v1") == cache_salt(TenantConfig("a", weight=3.0), "v1")  # only name and version
    assert cache_salt(a, "v1") != cache_salt(b, "v1")
    assert cache_salt(a, "v1") != cache_salt(a, "v2")
    assert cache_salt(shared_x, "v1") == cache_salt(shared_y, "v1")
    assert cache_salt(shared_x, "v1") != cache_salt(shared_x, "v2")
    assert cache_salt(shared_x, "v1") not in {cache_salt(a, "v1"), cache_salt(b, "v1")}
    # The separator keeps name/version boundaries apart.
    assert cache_salt(TenantConfig("a.b"), "c") != cache_salt(TenantConfig("a"), "b.c")
    assert len(cache_salt(a, "v1")) == 32 and int(cache_salt(a, "v1"), 16) >= 0
