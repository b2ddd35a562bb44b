"""Rolling out a quantized twin, as docs/ROLLOUT.md tells an operator to: a real redis-server, a real
`baton scheduler`, three real `both` workers (tiny model, tcp KV transport, one thread) and a gateway
that places through the scheduler.

* v1: the current version (fp32);
* v2: its int8 twin (`--quantization int8` on the same checkpoint: a version of its own);
* v3: a broken candidate: int8 of a copy whose projection weights were zeroed, so every int8 scale is
  at its floor (what a quantization job that wrote zero scales would serve).

Traffic is shadowed to a candidate with `baton models set --shadow`; the comparison per version pair
(greedy-token agreement, top-1 agreement and KL of the next-token distributions on the shared prefix,
TTFT and ITL) is read back with `baton models list`, as an operator reads it. The twin passes, the broken
candidate is flagged; the twin is then promoted and rolled back with one command each.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import harness
import pytest
from harness import PLACED, baton, eventually, grpc_generate, http_json, own_database

from baton.v1 import common_pb2, gateway_pb2
from scheduler.admin import DEFAULT_MAX_KL, DEFAULT_MIN_TOP1

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
PROMPTS = [
    "The quick brown fox jumps over",
    "Paris is the capital of France; Berlin is",
    "def add(a, b):",
    "Continuous batching keeps accelerators",
    "The lazy dog",
    "Berlin is the capital of Germany.",
    "return a + b",
    "while sequences come and go",
]


class Cluster(harness.Cluster):
    """The module's scheduler, a `both` worker per version — v1, v2 (the int8 twin), v3 (broken) — and
    the gateway."""

    @property
    def model(self) -> str:  # the served model's name
        assert self.gateway is not None
        return self.gateway.model

    versions: dict[str, str]  # v1/v2/v3 -> the digest each worker serves


def broken_copy(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint with every decoder projection zeroed (so int8 quantizes it to zero scales)."""
    import torch
    from safetensors.torch import load_file, save_file

    copy = tmp_path_factory.mktemp("broken") / model.name
    shutil.copytree(model, copy)
    weights = load_file(str(copy / "model.safetensors"))
    zeroed = {
        k: torch.zeros_like(v) if ".layers." in k and k.endswith("proj.weight") else v
        for k, v in weights.items()
    }
    save_file(zeroed, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def baton_models(c: Cluster, *args: str) -> str:
    return baton("models", "--scheduler", c.scheduler.address, *args)


def listed(c: Cluster) -> dict[str, Any]:
    return json.loads(baton_models(c, "list", c.model, "--json"))


def comparison(c: Cluster, candidate: str) -> dict[str, Any] | None:
    pairs = {(p["primary_version"], p["shadow_version"]): p for p in listed(c)["comparisons"]}
    return pairs.get((c.versions["v1"], c.versions[candidate]))


@pytest.fixture(scope="module")
def cluster(
    redis_server: Any, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    redis_url = own_database(redis_server.url, 5)
    with Cluster(redis_url, tmp_path_factory.mktemp("rollout")) as c:
        builds = {
            "v1": (tiny_llama, ()),
            "v2": (tiny_llama, ("--quantization", "int8")),
            "v3": (broken_copy(tiny_llama, tmp_path_factory), ("--quantization", "int8")),
        }
        workers = {}
        for name, (model, flags) in builds.items():
            # One after the other: the first version registered gets the weight.
            (workers[name],) = c.add_workers(model, "both", flags=flags)
        c.start_gateway(tiny_llama)
        c.versions = {name: w.info().model_digest for name, w in workers.items()}
        assert len(set(c.versions.values())) == 3  # the twin is a version of its own
        yield c


def send_traffic(c: Cluster, tag: str) -> list[str]:
    """The prompts over gRPC, and two over HTTP: one without logprobs, one asking for 2 alternatives."""
    rids = []
    for i, prompt in enumerate(PROMPTS):
        rids.append(f"{tag}-{i}")
        grpc_generate(
            c.gateway,
            gateway_pb2.GenerateRequest(
                request_id=rids[-1],
                prompt=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
            ),
        )
    rids.append(f"{tag}-plain")
    status, _, body = http_json(
        c.gateway,
        "/v1/completions",
        {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0},
        headers={"X-Request-Id": rids[-1]},
    )
    assert status == 200 and body["choices"][0]["logprobs"] is None  # the comparison's logprobs stay inside
    rids.append(f"{tag}-top2")
    status, _, body = http_json(
        c.gateway,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": PROMPTS[1]}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        },
        headers={"X-Request-Id": rids[-1]},
    )
    assert status == 200
    content = body["choices"][0]["logprobs"]["content"]
    assert content and all(len(t["top_logprobs"]) == 2 for t in content)  # what it asked for, not 20
    return rids


def shadow_to(c: Cluster, candidate: str) -> dict[str, Any]:
    """All weight on v1, every request mirrored to the candidate; its comparison once all arrived."""
    baton_models(
        c,
        "set",
        c.model,
        f"{c.versions['v1']}=1",
        f"{c.versions['v2']}=0",
        f"{c.versions['v3']}=0",
        "--shadow",
        c.versions[candidate],
        "--shadow-share",
        "1.0",
    )
    rids = send_traffic(c, f"shadow-{candidate}")

    def arrived() -> bool:
        got = comparison(c, candidate)
        return got is not None and got["requests"] >= len(rids)

    # Each try runs `baton models list` (a process): every half second, to leave the cluster the CPU.
    eventually(arrived, 60, f"every shadow of {candidate} compared and reported", interval_s=0.5)
    got = comparison(c, candidate)
    assert got is not None and got["requests"] == len(rids)
    return got


def test_the_int8_twin_agrees_with_its_version(cluster: Cluster) -> None:
    got = shadow_to(cluster, "v2")
    assert got["positions"] >= len(PROMPTS) * 8  # most of each output's prefix is shared
    assert got["top1_agreement"] >= DEFAULT_MIN_TOP1 and got["mean_kl"] <= DEFAULT_MAX_KL, got
    assert got["flagged"] == ""
    assert got["shadow_ttft_ms"] > 0 and got["primary_ttft_ms"] > 0 and got["shadow_itl_ms"] > 0
    print(
        f"\nint8 twin shadowed on {got['requests']} requests: greedy agreement {got['greedy_agreement']:.3f}, "
        f"top-1 {got['top1_agreement']:.3f} over {got['positions']} positions, mean KL {got['mean_kl']:.5f}; "
        f"TTFT {got['shadow_ttft_ms']:.1f} vs {got['primary_ttft_ms']:.1f} ms, "
        f"ITL {got['shadow_itl_ms']:.1f} vs {got['primary_itl_ms']:.1f} ms"
    )


def test_a_broken_candidate_is_flagged(cluster: Cluster) -> None:
    got = shadow_to(cluster, "v3")
    assert got["top1_agreement"] < DEFAULT_MIN_TOP1 and got["mean_kl"] > DEFAULT_MAX_KL, got
    assert "top-1 agreement" in got["flagged"] and "mean KL" in got["flagged"]
    text = baton_models(cluster, "list", cluster.model)
    row = next(line for line in text.splitlines() if line.startswith(cluster.versions["v3"]))
    assert "FLAGGED" in row
    twin = next(line for line in text.splitlines() if line.startswith(cluster.versions["v2"] + " "))
    assert twin.rstrip().endswith("ok")
    print(
        f"\nbroken candidate: top-1 {got['top1_agreement']:.3f}, mean KL {got['mean_kl']:.3f} -> {got['flagged']}"
    )


def test_promote_and_roll_back_with_one_command_each(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    c, v = cluster, cluster.versions
    caplog.set_level(logging.INFO, logger="services")

    def served_by(rid: str) -> tuple[str, str]:
        grpc_generate(
            c.gateway,
            gateway_pb2.GenerateRequest(
                request_id=rid,
                prompt=PROMPTS[0],
                sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
            ),
        )
        placed = [
            m for m in map(PLACED.match, (r.getMessage() for r in caplog.records)) if m and m.group(1) == rid
        ]
        return placed[-1].group(3), placed[-1].group(4)

    baton_models(c, "set", c.model, f"{v['v1']}=0", f"{v['v2']}=1", "--shadow", "")  # promote
    assert listed(c)["shadow"] == {}
    assert all(served_by(f"promoted-{i}") == (v["v2"], "-") for i in range(4))
    baton_models(c, "set", c.model, f"{v['v1']}=1", f"{v['v2']}=0")  # roll back
    assert all(served_by(f"rolled-back-{i}") == (v["v1"], "-") for i in range(4))
