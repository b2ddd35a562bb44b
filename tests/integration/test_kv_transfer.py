"""Prefill in one process, KV transfer, decode in another — with each transport — against one process
doing both. Real processes, real NIXL (UCX over loopback/cma) and real sockets; nothing is mocked."""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from core.sampling_params import SamplingParams
from decode_worker.handoff import DecodeHandoff
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from kv_transfer.handle import KVHandle
from kv_transfer.transport import make_transport
from prefill_worker.handoff import kv_layout

pytestmark = pytest.mark.integration

BACKENDS = ["nixl", "tcp"]
KV_MEMORY = 8 << 20


def prefill_worker_main(model: str | None, backend: str, lease_ttl_s: float, conn: Any) -> None:
    """The prefill process: serves prefill commands from the pipe and services its leases."""
    from prefill_worker.handoff import PrefillHandoff

    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=KV_MEMORY if model else 64 << 20))
    handoff = PrefillHandoff(engine, make_transport(backend, f"prefill-{backend}", kv_layout(engine)), lease_ttl_s)
    conn.send(handoff.transport.metadata())
    while True:
        if conn.poll(0.005):
            cmd, args = conn.recv()
            if cmd == "prefill":
                token, handle = handoff.prefill(*args)
                conn.send((token, asdict(handle)))
            elif cmd == "stats":
                handoff.service()
                kv = engine.kv
                conn.send({"free": kv.num_free_blocks, "total": kv.num_blocks, "pinned": kv.num_pinned_blocks,
                           "leases": len(handoff.leases), "released": handoff.num_released,
                           "expired": handoff.num_expired})
            elif cmd == "stop":
                conn.send("bye")
                return
        handoff.service()


class PrefillProcess:
    def __init__(self, model: str | None, backend: str, lease_ttl_s: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_worker_main, args=(model, backend, lease_ttl_s, child), daemon=True)
        self.proc.start()
        assert self.conn.poll(120), "the prefill process did not start"
        self.metadata: bytes = self.conn.recv()

    def call(self, cmd: str, *args: Any) -> Any:
        self.conn.send((cmd, args))
        assert self.conn.poll(120), f"no answer to {cmd}"
        return self.conn.recv()

    def prefill(self, rid: str, ids: list[int], params: SamplingParams) -> tuple[int, KVHandle]:
        token, raw = self.call("prefill", rid, ids, params)
        raw["block_ids"] = tuple(raw["block_ids"])
        return token, KVHandle(**raw)

    def wait_all_free(self, timeout_s: float = 10.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.call("stats")
            if stats["pinned"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (AssertionError, OSError, EOFError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def decode_engine(model: str | None, backend: str) -> tuple[LLMEngine, DecodeHandoff]:
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=KV_MEMORY if model else 64 << 20))
    return engine, DecodeHandoff(engine, make_transport(backend, f"decode-{backend}-{time.monotonic_ns()}",
                                                        kv_layout(engine)))


def run_until_done(engine: LLMEngine, ids: list[str], timeout_s: float = 60.0) -> dict[str, Any]:
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(ids):
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.scheduler.has_unfinished:
            time.sleep(0.001)  # only transfers in flight: don't spin
    return done


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 380, (int(torch.randint(5, 70, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_disaggregated_greedy_equals_one_process(tiny_llama: Path, backend: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    batch = prompts(5, seed=11)
    reference = LLMEngine(EngineConfig(model=str(tiny_llama), kv_cache_memory=KV_MEMORY))
    for i, p in enumerate(batch):
        reference.add_request(f"r{i}", p, params)
    expected = run_until_done(reference, [f"r{i}" for i in range(len(batch))])

    prefill = PrefillProcess(str(tiny_llama), backend)
    try:
        engine, handoff = decode_engine(str(tiny_llama), backend)
        handoff.add_peer(prefill.metadata)
        for i, p in enumerate(batch):
            token, handle = prefill.prefill(f"r{i}", p, params)
            assert handle.num_tokens == len(p)
            handoff.start(f"r{i}", p, token, handle, params)
        got = run_until_done(engine, [f"r{i}" for i in range(len(batch))])
        for rid, out in expected.items():
            assert got[rid].token_ids == out.token_ids, f"{backend}: {rid} differs from one-process decoding"
        stats = prefill.wait_all_free()
        assert stats["pinned"] == 0 and stats["free"] == stats["total"], f"prefill side leaked: {stats}"
        assert stats["released"] == len(batch) and stats["expired"] == 0
        engine.scheduler.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
    finally:
        prefill.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_partial_prefix_hit_pulls_only_missing_blocks(tiny_llama: Path, backend: str) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    base = list(range(100, 164))  # 64 tokens
    first, second = base + [7, 8], base[:48] + [9] * 30  # 5 blocks each; they share 3 full blocks of 16
    prefill = PrefillProcess(str(tiny_llama), backend)
    try:
        engine, handoff = decode_engine(str(tiny_llama), backend)
        handoff.add_peer(prefill.metadata)
        token, handle = prefill.prefill("a", first, params)
        assert handoff.start("a", first, token, handle, params) == 5, "a cold cache pulls every block"
        run_until_done(engine, ["a"])
        token, handle = prefill.prefill("b", second, params)
        pulled = handoff.start("b", second, token, handle, params)
        assert pulled == len(handle.block_ids) - 3, "the 3 shared blocks come from the local prefix cache"
        out = run_until_done(engine, ["b"])["b"]
        assert out.num_cached_tokens == 48
        assert engine.kv.stats.num_hit_tokens >= 48
        assert prefill.wait_all_free()["pinned"] == 0
    finally:
        prefill.stop()


@pytest.mark.slow
def test_default_model_one_prompt_over_nixl() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    reference = LLMEngine(EngineConfig(model=None, kv_cache_memory=64 << 20))
    ids = reference.tokenizer.encode("The capital of France is")
    reference.add_request("ref", ids, params)
    expected = run_until_done(reference, ["ref"])["ref"]
    prefill = PrefillProcess(None, "nixl")
    try:
        engine, handoff = decode_engine(None, "nixl")
        handoff.add_peer(prefill.metadata)
        token, handle = prefill.prefill("p", ids, params)
        handoff.start("p", ids, token, handle, params)
        out = run_until_done(engine, ["p"])["p"]
        assert out.token_ids == expected.token_ids
        assert "Paris" in out.text
        assert prefill.wait_all_free()["pinned"] == 0
    finally:
        prefill.stop()
