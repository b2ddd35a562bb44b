"""The gateway's pure parts: static routing, API keys, scheduler errors, the bounded RequestStream,
config ↔ flags, no torch."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest

from core.errors import CapacityExceeded, InvalidRequest, Unavailable
from rpc.flags import flags as rpc_flags
from services.gateway.request_stream import Delta, Finished, RequestStream, Timings, Usage
from services.gateway.router import Route, RouteQuery, StaticRouter
from services.gateway.server import GatewayConfig, add_gateway_parser

pytestmark = pytest.mark.unit


def test_static_routing_round_robin_and_threshold() -> None:
    router = StaticRouter(["p1", "p2"], ["d1", "d2", "d3"], local_prefill_threshold=8)
    long = [router.place(100) for _ in range(4)]
    assert [r.prefill for r in long] == ["p1", "p2", "p1", "p2"]
    assert [r.decode for r in long] == ["d1", "d2", "d3", "d1"]
    assert router.place(7) == Route(decode="d2")  # short: the decode worker prefills it
    assert router.place(8).prefill is not None
    assert StaticRouter([], ["d"], 0).place(10_000).prefill is None
    with pytest.raises(Unavailable):
        StaticRouter(["p"], [], 0)


def test_static_routing_skips_failed_workers() -> None:
    router = StaticRouter(["p1", "p2"], ["d1", "d2"])
    query = RouteQuery("r", [1] * 40, 8, exclude=("p1", "d1"))
    routes = [asyncio.run(router.route(query)) for _ in range(3)]
    assert {(r.prefill, r.decode) for r in routes} == {("p2", "d2")}
    assert router.place(40, ("p1", "p2")).prefill is None  # no prefill worker left: D prefills
    with pytest.raises(Unavailable, match="no decode worker left to try .failed: d1, d2"):
        router.place(40, ("d1", "d2"))


def test_api_keys_from_http_headers_and_grpc_metadata() -> None:
    from services.gateway.auth import api_key, api_key_from_metadata

    assert api_key({"Authorization": "Bearer sk-1"}) == "sk-1"
    assert api_key({"Authorization": "bearer  sk-2 "}) == "sk-2"
    assert api_key({"x-api-key": "sk-3"}) == "sk-3"
    assert api_key({"Authorization": "Basic abc"}) == "" and api_key({}) == ""
    assert api_key_from_metadata((("authorization", "Bearer sk-4"),)) == "sk-4"
    assert api_key_from_metadata((("x-api-key", "sk-5"), ("user-agent", "grpc"))) == "sk-5"
    assert api_key_from_metadata(None) == ""


def test_scheduler_errors_keep_their_status() -> None:
    import grpc

    from core.errors import ModelNotFound, Unauthenticated
    from services.gateway.router import scheduler_error

    class FakeError(grpc.aio.AioRpcError):  # type: ignore[misc]
        def __init__(
            self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
        ) -> None:
            super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)

    assert isinstance(
        scheduler_error(FakeError(grpc.StatusCode.UNAUTHENTICATED, "invalid API key"), "s"), Unauthenticated
    )
    assert isinstance(scheduler_error(FakeError(grpc.StatusCode.NOT_FOUND, "no model"), "s"), ModelNotFound)
    busy = scheduler_error(
        FakeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", (("retry-after", "2.5"),)), "s"
    )
    assert isinstance(busy, CapacityExceeded) and busy.retry_after_s == 2.5 and busy.http_status == 429
    down = scheduler_error(FakeError(grpc.StatusCode.UNAVAILABLE, "Redis is down"), "s:1")
    assert isinstance(down, Unavailable) and down.http_status == 503
    assert "Redis is down" in down.message and "scheduler s:1" in down.message


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
    args = parser.parse_args(
        [
            "gateway",
            "--decode-workers",
            "127.0.0.1:1,127.0.0.1:2",
            "--prefill-workers",
            "h:3",
            "--max-prompt-tokens",
            "100",
            "--local-prefill-threshold",
            "0",
            "--grpc-port",
            "0",
        ]
    )
    config = GatewayConfig.from_args(args)
    assert config.decode_workers == ("127.0.0.1:1", "127.0.0.1:2") and config.prefill_workers == ("h:3",)
    assert config.max_prompt_tokens == 100 and config.local_prefill_threshold == 0 and config.grpc_port == 0
    flags = {a.dest for a in parser._subparsers._group_actions[0].choices["gateway"]._actions}  # type: ignore[union-attr]
    assert {f.dest for f in rpc_flags(GatewayConfig)} <= flags
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--decode-workers", "nohostport"])
    with pytest.raises(ValueError, match="decode worker"):
        GatewayConfig()
    with pytest.raises(ValueError, match="not both"):
        GatewayConfig(scheduler="h:1", decode_workers=("h:2",))
    scheduled = GatewayConfig.from_args(parser.parse_args(["gateway", "--scheduler", "127.0.0.1:50061"]))
    assert scheduled.scheduler == "127.0.0.1:50061" and scheduled.decode_workers == ()
    with pytest.raises(SystemExit):
        parser.parse_args(["gateway", "--scheduler", "a:1,b:2"])  # replicas: IP addresses only
    replicas = GatewayConfig.from_args(
        parser.parse_args(["gateway", "--scheduler", "127.0.0.1:1, 127.0.0.1:2"])
    )
    assert replicas.scheduler == "127.0.0.1:1,127.0.0.1:2"


def test_gateway_never_imports_torch() -> None:
    code = "import sys, services.gateway.server, services.gateway.http_api; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_http_errors_carry_retry_after_and_the_openai_body() -> None:
    import json

    from services.gateway.http_api import error_response

    response = error_response(CapacityExceeded("the KV cache is full", retry_after_s=2.2), request_id="r1")
    assert response.status == 429
    assert response.headers["Retry-After"] == "3" and response.headers["X-Request-Id"] == "r1"
    assert json.loads(response.body)["error"] == {  # type: ignore[arg-type]
        "message": "the KV cache is full",
        "type": "rate_limit_error",
        "param": None,
        "code": None,
    }
