"""The gateway's pure parts: static placement, the bounded RequestStream, config ↔ flags, no torch."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import subprocess
import sys

import pytest

from core.errors import CapacityExceeded, InvalidRequest, Unavailable
from services.gateway import GatewayConfig, add_gateway_parser
from services.placement import Placement, StaticPlacer
from services.request_stream import Delta, Finished, RequestStream, Timings, Usage

pytestmark = pytest.mark.unit


def test_static_placement_round_robin_and_threshold() -> None:
    placer = StaticPlacer(["p1", "p2"], ["d1", "d2", "d3"], local_prefill_threshold=8)
    long = [placer.place(100) for _ in range(4)]
    assert [p.prefill for p in long] == ["p1", "p2", "p1", "p2"]
    assert [p.decode for p in long] == ["d1", "d2", "d3", "d1"]
    assert placer.place(7) == Placement(decode="d2")  # short: the decode worker prefills it
    assert placer.place(8).disaggregated
    assert not StaticPlacer([], ["d"], 0).place(10_000).disaggregated
    with pytest.raises(Unavailable):
        StaticPlacer(["p"], [], 0)


FINISHED = Finished("stop", Usage(1, 2), Timings())


def _drive(stream: RequestStream, coro_fn) -> asyncio.Task[None]:  # type: ignore[no-untyped-def]
    task = asyncio.get_running_loop().create_task(coro_fn())
    stream.attach(task)
    return task


def test_stream_merges_deltas_while_the_client_lags() -> None:
    async def main() -> list[object]:
        stream = RequestStream("r", max_buffered_tokens=10)

        async def driver() -> None:
            for i in range(3):
                assert stream.push(Delta([i], str(i)))
            stream.finish(FINISHED)

        await _drive(stream, driver)
        return [e async for e in stream]

    events = asyncio.run(main())
    assert events == [Delta([0, 1, 2], "012"), FINISHED]


def test_stream_fails_a_client_that_does_not_read() -> None:
    async def main() -> tuple[list[object], BaseException | None, str | None]:
        stream = RequestStream("slow", max_buffered_tokens=4)

        async def driver() -> None:
            for i in range(100):
                if not stream.push(Delta([i], "x")):
                    await asyncio.sleep(10)  # cancelled by the stream right here
            stream.finish(FINISHED)

        task = _drive(stream, driver)
        await asyncio.sleep(0.01)
        assert task.cancelled()
        events: list[object] = []
        try:
            async for e in stream:
                events.append(e)
        except CapacityExceeded as e:
            return events, e, stream.cancel_reason
        return events, None, stream.cancel_reason

    events, error, reason = asyncio.run(main())
    assert isinstance(error, CapacityExceeded) and "did not read its stream" in error.message
    assert reason == "slow_reader"
    assert len(events) == 1 and len(events[0].token_ids) == 5  # type: ignore[attr-defined]


def test_stream_cancel_is_idempotent_and_reports_found() -> None:
    async def main() -> tuple[bool, bool, bool]:
        stream = RequestStream("c", max_buffered_tokens=4)
        task = _drive(stream, lambda: asyncio.sleep(10))
        first = stream.cancel("client")
        second = stream.cancel("session")
        await asyncio.gather(task, return_exceptions=True)
        return first, second, stream.cancel("again") or stream.cancel_reason != "client"

    assert asyncio.run(main()) == (True, True, False)


def test_stream_error_after_deltas() -> None:
    async def main() -> list[object]:
        stream = RequestStream("e", max_buffered_tokens=4)
        stream.push(Delta([1], "a"))
        stream.fail(InvalidRequest("boom"))
        got: list[object] = []
        with pytest.raises(InvalidRequest):
            async for e in stream:
                got.append(e)
        return got

    assert asyncio.run(main()) == [Delta([1], "a")]


def test_flags_are_the_config_fields() -> None:
    parser = argparse.ArgumentParser()
    add_gateway_parser(parser.add_subparsers())
    args = parser.parse_args([
        "gateway", "--decode-workers", "127.0.0.1:1,127.0.0.1:2", "--prefill-workers", "h:3",
        "--max-prompt-tokens", "100", "--local-prefill-threshold", "0", "--grpc-port", "0",
    ])
    config = GatewayConfig.from_args(args)
    assert config.decode_workers == ("127.0.0.1:1", "127.0.0.1:2") and config.prefill_workers == ("h:3",)
    assert config.max_prompt_tokens == 100 and config.local_prefill_threshold == 0 and config.grpc_port == 0
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["gateway"]._actions}  # type: ignore[union-attr]
    assert {f.name for f in dataclasses.fields(GatewayConfig)} <= flags
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--decode-workers", "nohostport"])
    with pytest.raises(ValueError, match="decode worker"):
        GatewayConfig()


def test_gateway_never_imports_torch() -> None:
    code = "import sys, services.gateway, services.http_api; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_http_errors_carry_retry_after_and_the_openai_body() -> None:
    import json

    from services.http_api import error_response

    response = error_response(CapacityExceeded("the KV cache is full", retry_after_s=2.2), request_id="r1")
    assert response.status == 429
    assert response.headers["Retry-After"] == "3" and response.headers["X-Request-Id"] == "r1"
    assert json.loads(response.body)["error"] == {  # type: ignore[arg-type]
        "message": "the KV cache is full", "type": "rate_limit_error", "param": None, "code": None,
    }
