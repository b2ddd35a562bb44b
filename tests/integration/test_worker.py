"""The worker service on real grpc.aio servers over loopback, one engine thread each: the handoff
path, role checks, deadlines, cancellation and Abort — each checked against the blocks `Info` reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from harness import idle

from baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from core.sampling_params import SamplingParams
from services.worker.config import WorkerConfig
from services.worker.server import WorkerServer, serve_worker

pytestmark = pytest.mark.integration

GREEDY = common_pb2.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


async def start(model: Path, role: str, **kw: object) -> tuple[WorkerServer, worker_pb2_grpc.WorkerStub]:
    server = await serve_worker(
        WorkerConfig.flat(
            role=role,
            model=str(model),
            kv_transport="tcp",
            dtype="float32",
            kv_cache_memory=8 << 20,
            threads=1,
            **kw,
        )
    )  # type: ignore[arg-type]
    return server, worker_pb2_grpc.WorkerStub(grpc.aio.insecure_channel(server.address))


async def wait_idle(
    stub: worker_pb2_grpc.WorkerStub, timeout_s: float = 10.0
) -> tuple[worker_pb2.InfoResponse, float]:
    """Polls Info until every block is free and nothing runs; returns it and how long that took."""
    t0 = time.monotonic()
    while True:
        info = await stub.Info(worker_pb2.InfoRequest())
        if idle(info) or time.monotonic() - t0 > timeout_s:
            return info, time.monotonic() - t0
        await asyncio.sleep(0.01)


async def collect(
    stream: AsyncIterator[worker_pb2.DecodeResponse],
) -> tuple[list[int], worker_pb2.DecodeResponse]:
    ids: list[int] = []
    last = None
    async for msg in stream:
        ids.extend(msg.delta.token_ids)
        last = msg
    assert last is not None
    return ids, last


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> list[int]:
    from engine import LLM

    out = LLM(str(tiny_llama), kv_cache_memory=8 << 20, dtype="float32").generate(
        [list(range(3, 70))], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    return out[0].token_ids


def test_handoff_and_local_prefill_equal_offline_and_free_everything(
    tiny_llama: Path, offline: list[int]
) -> None:
    async def main() -> None:
        (p, ps), (d, ds) = await start(tiny_llama, "prefill"), await start(tiny_llama, "decode")
        try:
            ids = list(range(3, 70))
            r = await ps.Prefill(
                worker_pb2.PrefillRequest(request_id="a", prompt_token_ids=ids, sampling=GREEDY)
            )
            assert r.handle.source == p.address and len(r.handle.block_ids) == 5
            assert (await ps.Info(worker_pb2.InfoRequest())).num_leases == 1
            got, last = await collect(
                ds.Decode(
                    worker_pb2.DecodeRequest(
                        request_id="a",
                        prompt_token_ids=ids,
                        sampling=GREEDY,
                        handle=r.handle,
                        first_token=r.first.token_ids[0],
                    )
                )
            )
            assert list(r.first.token_ids) + got == offline
            assert (
                last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 10
            )
            assert last.transfer_ms > 0
            local, _ = await collect(
                ds.Decode(worker_pb2.DecodeRequest(request_id="b", prompt_token_ids=ids, sampling=GREEDY))
            )
            assert local == offline
            stop_at = common_pb2.SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[offline[2]])
            stopped, last = await collect(
                ds.Decode(worker_pb2.DecodeRequest(request_id="s", prompt_token_ids=ids, sampling=stop_at))
            )
            assert stopped == offline[:3] and last.finish_reason == common_pb2.FINISH_REASON_STOP
            assert last.stop_reason == str(offline[2])
            for stub in (ps, ds):
                info, _ = await wait_idle(stub)
                assert info.num_free_blocks == info.num_blocks and info.num_leases == 0
        finally:
            await p.stop()
            await d.stop()

    asyncio.run(main())


def test_roles_input_and_abort_are_clear_and_idempotent(tiny_llama: Path) -> None:
    async def main() -> None:
        p, ps = await start(tiny_llama, "prefill")
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(
                    ps.Decode(
                        worker_pb2.DecodeRequest(request_id="x", prompt_token_ids=[5, 6], sampling=GREEDY)
                    )
                )
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "prefill" in (
                e.value.details() or ""
            )
            bad = [
                (worker_pb2.PrefillRequest(request_id="", prompt_token_ids=[5]), "request_id"),
                (worker_pb2.PrefillRequest(request_id="y"), "prompt_token_ids"),
                (worker_pb2.PrefillRequest(request_id="y", prompt_token_ids=[10**6]), "token ids"),
                (
                    worker_pb2.PrefillRequest(
                        request_id="y",
                        prompt_token_ids=[5],
                        sampling=common_pb2.SamplingParams(temperature=-1.0),
                    ),
                    "temperature",
                ),
            ]
            for req, words in bad:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await ps.Prefill(req)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in (
                    e.value.details() or ""
                )
            # A prefill whose decode never comes: Abort releases its lease at once; a second Abort is a no-op.
            await ps.Prefill(
                worker_pb2.PrefillRequest(
                    request_id="z", prompt_token_ids=list(range(3, 50)), sampling=GREEDY
                )
            )
            assert (await ps.Abort(worker_pb2.AbortRequest(request_id="z"))).found
            assert not (await ps.Abort(worker_pb2.AbortRequest(request_id="z"))).found
            info, _ = await wait_idle(ps)
            assert info.num_free_blocks == info.num_blocks and info.num_leases == 0
        finally:
            await p.stop()

    asyncio.run(main())


def test_cancel_and_deadline_mid_decode_free_blocks_on_both_workers(tiny_llama: Path) -> None:
    long = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        (p, ps), (d, ds) = await start(tiny_llama, "prefill"), await start(tiny_llama, "decode")
        try:
            ids = list(range(3, 90))
            r = await ps.Prefill(
                worker_pb2.PrefillRequest(request_id="c", prompt_token_ids=ids, sampling=long)
            )
            call = ds.Decode(
                worker_pb2.DecodeRequest(
                    request_id="c",
                    prompt_token_ids=ids,
                    sampling=long,
                    handle=r.handle,
                    first_token=r.first.token_ids[0],
                )
            )
            n = 0
            async for msg in call:
                n += len(msg.delta.token_ids)
                if n >= 5:
                    break
            with pytest.raises(grpc.aio.AioRpcError) as dup:  # the same id while it is in flight here
                await collect(
                    ds.Decode(worker_pb2.DecodeRequest(request_id="c", prompt_token_ids=ids, sampling=long))
                )
            assert dup.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in use" in (
                dup.value.details() or ""
            )
            call.cancel()  # the client goes away mid-stream
            for name, stub in (("decode", ds), ("prefill", ps)):
                info, took = await wait_idle(stub)
                print(f"cancel: {name} worker idle {took * 1e3:.0f} ms after the cancel")
                assert (
                    info.num_free_blocks == info.num_blocks and info.num_running == 0 and info.num_leases == 0
                )

            with pytest.raises(grpc.aio.AioRpcError) as e:  # a deadline that passes mid-stream
                await collect(
                    ds.Decode(
                        worker_pb2.DecodeRequest(request_id="dl", prompt_token_ids=ids, sampling=long),
                        timeout=0.05,
                    )
                )  # the tiny model decodes 400 tokens in ~0.3 s now
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            info, took = await wait_idle(ds)
            print(f"deadline: decode worker idle {took * 1e3:.0f} ms after it passed")
            assert info.num_free_blocks == info.num_blocks and info.num_running == 0
        finally:
            await p.stop()
            await d.stop()

    asyncio.run(main())
