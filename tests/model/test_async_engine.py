"""`AsyncEngine.launch`: the engine is built on the engine thread, and so every torch op of a worker runs
on one thread (one OpenMP team; see the docstring of `launch`)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from core.sampling_params import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def test_launch_builds_the_engine_on_the_engine_thread_and_serves(tiny_llama: Path) -> None:
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLMEngine(
            EngineConfig(model=str(tiny_llama), dtype="float32", kv_cache_memory=1 << 20, num_threads=1)
        )

    async def main() -> tuple[list[int], str]:
        aengine = await AsyncEngine.launch(build)
        try:
            stream = aengine.open_stream("r1")
            params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
            await aengine.call(lambda e: e.add_request("r1", [5, 6, 7, 8], params))
            out = await stream.get()
            while not out.finished:
                out = await stream.get()
            where = await aengine.call(lambda e: threading.current_thread().name)
            return list(out.token_ids), where
        finally:
            aengine.stop()

    tokens, where = asyncio.run(main())
    assert built_on == ["engine"]
    assert where == "engine"
    assert len(tokens) == 5


def test_a_failing_factory_fails_launch_with_its_error() -> None:
    def build() -> LLMEngine:
        raise FileNotFoundError("no such model")

    async def main() -> AsyncEngine:
        return await AsyncEngine.launch(build)

    with pytest.raises(FileNotFoundError, match="no such model"):
        asyncio.run(main())
