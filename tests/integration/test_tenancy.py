"""Several model versions and several tenants behind one gateway: a real redis-server, a real
`baton scheduler`, two `both` workers (tiny model, tcp KV transport, one thread) — one per version of
the model — registered there, and a gateway that places through the scheduler.

* **Shadow traffic**: all weight on v1, v2 the shadow of every request. Clients get exactly v1's
  offline output; every request is mirrored to the v2 worker with the seed the gateway fixed, and (same
  weights) agrees token for token; a cancelled request cancels its shadow.
* **Tenant isolation**: a tenant's second request hits its own prefix cache; another tenant's same
  prompt does not (its salt differs, so neither the blocks nor their timing leak); tenants configured
  to share a cache do hit each other's.
* **Token-rate quota**: over the limit, 429 with Retry-After and an OpenAI body naming the limit
  (RESOURCE_EXHAUSTED with a retry-after trailer over gRPC); after Retry-After seconds it succeeds.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import harness
import pytest
from harness import (
    PLACED,
    WorkerProcess,
    add_tenants,
    baton,
    eventually,
    grpc_generate,
    http_json,
    metric,
    own_database,
    second_build,
)

from baton.v1 import common_pb2, gateway_pb2, scheduler_pb2
from core.sampling_params import SamplingParams
from scheduler.tenants import TenantConfig

pytestmark = pytest.mark.integration

MAX_TOKENS = 12
LONG = 300  # tokens of a request still running when it is cancelled
BLOCK_SIZE = 16  # the workers' KV block size (the engine's default)
PROMPTS = [
    "The quick brown fox jumps over",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def add(a, b):",
]
KEYS = {"alice": "sk-alice", "bob": "sk-bob", "carol": "sk-carol", "dave": "sk-dave", "quinn": "sk-quinn"}
QUOTA = dict(tokens_per_s=4.0, burst_s=6.0)  # a bucket of 24 tokens, refilled at 4 per second


def greedy(max_tokens: int = MAX_TOKENS, **kw: Any) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


# --- the cluster -----------------------------------------------------------------------------------


class Cluster(harness.Cluster):
    """The module's scheduler, a `both` worker per version (v1, v2) and the gateway."""

    @property
    def v1(self) -> WorkerProcess:
        return self.workers[0]

    @property
    def v2(self) -> WorkerProcess:
        return self.workers[1]

    @property
    def model(self) -> str:  # the served model's name
        assert self.gateway is not None
        return self.gateway.model

    versions: tuple[str, str]  # the two digests


TENANTS = [
    TenantConfig("alice"),
    TenantConfig("bob"),
    TenantConfig("carol", share_prefix_cache=True),
    TenantConfig("dave", share_prefix_cache=True),
    TenantConfig("quinn", **QUOTA),  # type: ignore[arg-type]
]


@pytest.fixture(scope="module")
def cluster(
    redis_server: Any, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    redis_url = own_database(redis_server.url, 3)
    with Cluster(redis_url, tmp_path_factory.mktemp("tenancy")) as c:
        # One after the other: the first version registered gets the weight.
        for model in (tiny_llama, second_build(tiny_llama, tmp_path_factory.mktemp("v2"))):
            c.add_workers(model, "both")
        add_tenants(redis_url, TENANTS, {key: name for name, key in KEYS.items()})
        c.start_gateway(tiny_llama, max_output_tokens=LONG + 50)
        c.versions = (c.v1.info().model_digest, c.v2.info().model_digest)
        assert c.versions[0] != c.versions[1]
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[tuple[list[int], str]]:
    """v1's output offline for the prompts (greedy)."""
    from engine import LLM

    llm = LLM(str(tiny_llama), kv_cache_memory=16 << 20, dtype="float32", num_threads=1)
    return [
        (o.token_ids, o.text)
        for o in llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    ]


def set_rollout(c: Cluster, shadow: bool) -> None:
    """All weight on v1; v2 the shadow of every request (`baton models set`, as an operator types it), or
    no shadow (the SetRollout RPC)."""
    v1, v2 = c.versions
    if shadow:
        baton(
            "models",
            "--scheduler",
            c.scheduler.address,
            "set",
            c.model,
            f"{v1}=1",
            f"{v2}=0",
            "--shadow",
            v2,
            "--shadow-share",
            "1.0",
        )
    else:
        assert c.scheduler.stub is not None
        c.scheduler.stub.SetRollout(
            scheduler_pb2.SetRolloutRequest(model=c.model, weights={v1: 1.0, v2: 0.0}, shadow_version=""),
            timeout=10,
        )
    assert c.scheduler.stub is not None
    listed = c.scheduler.stub.ListModelVersions(
        scheduler_pb2.ListModelVersionsRequest(model=c.model), timeout=10
    )
    assert (dict(listed.shadow).get(c.model) == v2) == shadow


# --- shadow traffic --------------------------------------------------------------------------------

_SHADOWED = re.compile(
    r"request (\S+) shadowed on (\S+): version (\S+) vs (\S+) (\w+) agreement=([\d.]+) "
    r"top1=([\d.]+) kl=([\d.]+) .* ttft=([\d.]+)ms itl=([\d.]+)ms \(primary ttft=([\d.]+)ms"
)


@pytest.fixture
def shadowing(cluster: Cluster) -> Iterator[Cluster]:
    set_rollout(cluster, shadow=True)
    try:
        yield cluster
    finally:
        set_rollout(cluster, shadow=False)


SHADOW_OUTCOMES = ("identical", "diverged", "skipped", "failed", "cancelled")


def shadow_counts() -> dict[str, float]:
    return {o: metric("baton_gateway_shadow_requests_total", {"outcome": o}) for o in SHADOW_OUTCOMES}


def test_shadow_traffic_mirrors_every_request_to_the_candidate(
    shadowing: Cluster, offline: list[tuple[list[int], str]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services")
    c, (v1, v2) = shadowing, shadowing.versions
    before = shadow_counts()
    pair = {"version": v1, "shadow_version": v2}
    agreement = (
        metric("baton_gateway_shadow_agreement_sum", pair),
        metric("baton_gateway_shadow_agreement_count", pair),
    )
    perfect = metric("baton_gateway_shadow_agreement_bucket", {**pair, "le": "0.999"})
    rids = []
    for i, (prompt, expected) in enumerate(zip(PROMPTS, offline, strict=True)):
        rids.append(f"shadow-grpc-{i}")
        got = grpc_generate(
            c.gateway, gateway_pb2.GenerateRequest(request_id=rids[-1], prompt=prompt, sampling=greedy())
        )
        assert got[:2] == expected  # exactly v1's output
    rids.append("shadow-http")
    status, _, body = http_json(
        c.gateway,
        "/v1/completions",
        {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0},
        headers={"X-Request-Id": rids[-1]},
    )
    assert status == 200 and body["choices"][0]["text"] == offline[1][1]
    rids.append("shadow-sampled")  # no seed: the gateway fixes one, and the shadow samples with it
    grpc_generate(
        c.gateway,
        gateway_pb2.GenerateRequest(
            request_id=rids[-1], prompt=PROMPTS[0], sampling=common_pb2.SamplingParams(max_tokens=24)
        ),
    )

    n = len(rids)
    eventually(lambda: shadow_counts()["identical"] == before["identical"] + n, 30, "every shadow compared")
    after = shadow_counts()
    assert {o: after[o] - before[o] for o in SHADOW_OUTCOMES} == {
        "identical": n,
        "diverged": 0,
        "skipped": 0,
        "failed": 0,
        "cancelled": 0,
    }
    assert metric("baton_gateway_shadow_agreement_count", pair) - agreement[1] == n
    assert metric("baton_gateway_shadow_agreement_sum", pair) - agreement[0] == pytest.approx(n)  # 1.0 each
    assert metric("baton_gateway_shadow_agreement_bucket", {**pair, "le": "0.999"}) == perfect
    assert metric("baton_gateway_shadow_in_flight") == 0

    # The client was answered by v1 alone; v2 saw each request only as its shadow.
    messages = [r.getMessage() for r in caplog.records]
    placed = {m.group(1): m.groups()[1:] for m in map(PLACED.match, messages) if m}
    shadowed = {m.group(1): m.groups()[1:] for m in map(_SHADOWED.match, messages) if m}
    assert {r: placed[r] for r in rids} == {r: (c.v1.address, v1, c.v2.address) for r in rids}
    assert {r: shadowed[r][:4] for r in rids} == {r: (c.v2.address, v2, v1, "identical") for r in rids}
    assert all(float(shadowed[r][4]) == 1.0 for r in rids)
    # Same weights: the next-token distributions agree on top-1 everywhere, at a KL of float noise.
    assert all(float(shadowed[r][5]) == 1.0 and float(shadowed[r][6]) < 1e-3 for r in rids)
    ttft, itl, primary_ttft = ([float(shadowed[r][k]) for r in rids] for k in (7, 8, 9))
    print(
        f"\n{n} requests shadowed to v2, agreement 1.0 each (identical outputs), top-1 1.0, KL <= "
        f"{max(float(shadowed[r][6]) for r in rids):.4f}; shadow ttft {min(ttft):.1f}–{max(ttft):.1f} ms, "
        f"itl {min(itl):.1f}–{max(itl):.1f} ms (primary ttft {min(primary_ttft):.1f}–{max(primary_ttft):.1f} ms)"
    )


def test_a_cancelled_request_cancels_its_shadow(shadowing: Cluster) -> None:
    c = shadowing
    before = shadow_counts()
    responses = c.gateway.stub.Generate(
        gateway_pb2.GenerateRequest(
            request_id="shadow-cancelled", prompt=PROMPTS[2], sampling=greedy(LONG, ignore_eos=True)
        ),
        timeout=60,
    )
    assert next(responses).HasField("delta")
    responses.cancel()
    eventually(
        lambda: shadow_counts()["cancelled"] == before["cancelled"] + 1,
        10,
        "the shadow cancelled with its primary",
    )
    t0 = time.perf_counter()
    c.v2.wait_all_free()  # the shadow worker dropped the request and freed its blocks
    c.v1.wait_all_free()
    assert shadow_counts()["identical"] == before["identical"]
    print(
        f"\nshadow cancelled with its primary; the v2 worker free {(time.perf_counter() - t0) * 1e3:.0f} ms "
        "after the gateway counted it"
    )


# --- tenant isolation ------------------------------------------------------------------------------


def _long_prompt(tag: str) -> str:
    words = "continuous batching keeps accelerators busy while sequences come and go".split()
    return f"{tag}: " + " ".join(words[k % len(words)] for k in range(60))


def http_cached(c: Cluster, tenant: str, prompt: str) -> tuple[int, int]:
    status, _, body = http_json(
        c.gateway,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 2, "temperature": 0},
        headers={"Authorization": f"Bearer {KEYS[tenant]}"},
    )
    assert status == 200, body
    return body["usage"]["prompt_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def grpc_cached(c: Cluster, tenant: str, prompt: str) -> int:
    completion = list(
        c.gateway.stub.Generate(
            gateway_pb2.GenerateRequest(prompt=prompt, sampling=greedy(2)),
            timeout=60,
            metadata=(("x-api-key", KEYS[tenant]),),
        )
    )[-1].completion
    return int(completion.usage.cached_tokens)


def test_tenants_never_hit_each_others_prefix_cache(cluster: Cluster) -> None:
    c = cluster
    prompt = _long_prompt("isolation")
    num_tokens, first = http_cached(c, "alice", prompt)
    full_hit = (num_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # the last token is always computed
    assert num_tokens >= 4 * BLOCK_SIZE and first == 0
    assert http_cached(c, "alice", prompt) == (num_tokens, full_hit)  # its own cache: every full block
    assert grpc_cached(c, "alice", prompt) == full_hit
    assert grpc_cached(c, "bob", prompt) == 0  # the same prompt, another tenant: no hit, no timing to read
    assert http_cached(c, "bob", prompt)[1] == full_hit  # bob's own copy now

    shared = _long_prompt("shared")
    assert http_cached(c, "carol", shared)[1] == 0
    assert http_cached(c, "dave", shared)[1] == full_hit  # both configured share_prefix_cache=True
    assert grpc_cached(c, "alice", shared) == 0  # a tenant that does not share never sees the shared cache
    print(
        f"\nprompt of {num_tokens} tokens: alice 0 then {full_hit} cached tokens; bob 0; "
        f"carol → dave (sharing) {full_hit}; alice on the shared prompt 0"
    )


# --- token-rate quota ------------------------------------------------------------------------------


def test_a_token_rate_quota_answers_429_with_retry_after(cluster: Cluster) -> None:
    c = cluster
    body = {"prompt": [5] * 6, "max_tokens": 10, "temperature": 0, "ignore_eos": True}  # 16 tokens charged
    headers = {"x-api-key": KEYS["quinn"]}
    assert http_json(c.gateway, "/v1/completions", body, headers=headers)[0] == 200
    status, response_headers, out = http_json(c.gateway, "/v1/completions", body, headers=headers)
    refused_at = time.monotonic()
    assert status == 429, out
    retry_after = int(response_headers["Retry-After"])
    assert 1 <= retry_after <= 4
    error = out["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "rate_limit_error"
    assert "tenant 'quinn' is over quota" in error["message"] and "token rate over 4/s" in error["message"]
    assert "16 tokens requested" in error["message"]

    with pytest.raises(grpc.RpcError) as info:
        list(
            c.gateway.stub.Generate(
                gateway_pb2.GenerateRequest(
                    prompt_token_ids=gateway_pb2.TokenIds(ids=[5] * 6), sampling=greedy(10, ignore_eos=True)
                ),
                timeout=30,
                metadata=(("x-api-key", KEYS["quinn"]),),
            )
        )
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "token rate" in info.value.details()
    assert float(dict(info.value.trailing_metadata())["retry-after"]) > 0

    time.sleep(max(0.0, retry_after - (time.monotonic() - refused_at)))
    status, _, out = http_json(c.gateway, "/v1/completions", body, headers=headers)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] == 10
    print(
        f"\ntoken-rate quota (4 tokens/s, burst 24): 429 with Retry-After: {retry_after} "
        f"({error['message']!r}); served again after waiting it"
    )
