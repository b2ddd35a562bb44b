"""loadgen against a server that is not Baton: a minimal OpenAI-compatible streaming server (aiohttp, on
127.0.0.1, in a thread of this process) with known delays — a first chunk after TTFT_S, then one token
every ITL_S. The measured TTFT / ITL / TPOT must agree with those delays; the JSON, the table and the
PNGs must be written; tenants' keys must reach the server; errors are counted by kind; and the server,
strict like `transformers serve`, rejects any field loadgen was not asked to send."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadgen.cli import main

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TTFT_S = 0.060
ITL_S = 0.015
KNOWN_FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "stream", "stream_options"}
DENIED_KEY = "sk-denied"


class MockOpenAIServer:
    """/v1/models, and /v1/completions + /v1/chat/completions streamed as SSE with fixed delays."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.keys: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mock-openai", daemon=True)
        self.thread.start()
        self.runner: web.AppRunner | None = None
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "mock-model", "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        self.bodies.append(body)
        self.keys.append(key)
        if key == DENIED_KEY:
            return web.json_response({"error": {"message": "invalid API key", "type": "auth"}}, status=401)
        if set(body) - KNOWN_FIELDS:
            unknown = sorted(set(body) - KNOWN_FIELDS)
            return web.json_response({"error": {"message": f"unknown fields {unknown}"}}, status=400)
        chat = "messages" in body
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> None:
            chunk = {
                "object": "chat.completion.chunk" if chat else "text_completion",
                "choices": [choice] if choice else [],
                "usage": usage,
            }
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())

        if chat:  # a role opener at once carries no token: it must not count as the first one
            await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        await asyncio.sleep(TTFT_S)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await asyncio.sleep(ITL_S)
            text = f" t{i}"
            await send({"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text})
        await send(
            {"index": 0, "delta": {}, "finish_reason": "length"}
            if chat
            else {"index": 0, "text": "", "finish_reason": "length"}
        )
        if body.get("stream_options", {}).get("include_usage"):
            await send(None, {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def close(self) -> None:
        assert self.runner is not None
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def server() -> Iterator[MockOpenAIServer]:
    srv = MockOpenAIServer()
    try:
        yield srv
    finally:
        srv.close()


def test_measures_the_servers_known_delays_and_writes_json_table_and_plots(
    server: MockOpenAIServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result_file, plots = tmp_path / "peer.json", tmp_path / "plots"
    code = main(
        [
            "run",
            "--target",
            server.url,
            "--num-requests",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--arrival",
            "constant",
            "--rate",
            "40",
            "--warmup",
            "2",
            "--slo",
            "ttft:500,itl:200",
            "--percentiles",
            "50,99",
            "--result-file",
            str(result_file),
            "--plot-dir",
            str(plots),
            "--label",
            "mock",
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table

    result = json.loads(result_file.read_text())
    assert result["backend"] == "openai" and result["model_id"] == "mock-model" and result["label"] == "mock"
    assert (result["num_prompts"], result["completed"], result["failed"]) == (8, 8, 0)
    assert result["loadgen"]["num_warmup"] == 2 and len(server.bodies) >= 10
    assert result["output_lens"] == [8] * 8 and result["total_output_tokens"] == 64
    assert result["input_lens"] == [7] * 8, "the server's usage.prompt_tokens when it reports it"
    # The known delays, measured from outside (loose bounds: a busy 2-core machine adds jitter, never less).
    assert TTFT_S * 1000 * 0.95 <= result["mean_ttft_ms"] <= TTFT_S * 1000 + 60
    assert ITL_S * 1000 * 0.8 <= result["median_itl_ms"] <= ITL_S * 1000 + 15
    assert ITL_S * 1000 * 0.8 <= result["mean_tpot_ms"] <= ITL_S * 1000 + 15
    assert all(len(itl) == 7 for itl in result["itls"]), "8 tokens in 8 chunks: 7 gaps each"
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["p99_ttft_ms"] >= result["p50_ttft_ms"] and "p90_ttft_ms" not in result
    assert result["generated_texts"][0] == "".join(f" t{i}" for i in range(8))
    assert result["request_rate"] == 40 and result["burstiness"] is None
    for body in server.bodies:
        assert set(body) <= KNOWN_FIELDS and body["stream"] is True and body["model"] == "mock-model"
    for name in ("latency_cdf.png", "throughput.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_with_tenants_sends_each_tenants_key_and_counts_errors_by_kind(
    server: MockOpenAIServer, tmp_path: Path
) -> None:
    server.keys.clear()
    result_file = tmp_path / "chat.json"
    code = main(
        [
            "run",
            "--target",
            server.url + "/v1",
            "--endpoint",
            "chat",
            "--num-requests",
            "12",
            "--output-len",
            "3",
            "--arrival",
            "closed",
            "--concurrency",
            "4",
            "--tenant",
            "a:0.5:sk-a",
            "--tenant",
            f"b:0.5:{DENIED_KEY}",
            "--ignore-eos",
            "--seed",
            "3",
            "--result-file",
            str(result_file),
            "--no-progress",
        ]
    )
    assert code == 0
    result = json.loads(result_file.read_text())
    assert result["backend"] == "openai-chat" and result["max_concurrency"] == 4
    assert result["request_rate"] == "inf"
    denied = result["tenants"].count("b")
    assert 0 < denied < 12 and set(server.keys) == {"sk-a", DENIED_KEY}
    # the strict server refused ignore_eos (asked for with --ignore-eos) with 400; the denied key got 401
    assert result["errors_by_kind"] == {"http:400": 12 - denied, "http:401": denied}
    assert result["completed"] == 0 and all(e.startswith("HTTP 40") for e in result["errors"])
    assert set(result["per_tenant"]) == {"a", "b"} and result["per_tenant"]["b"]["failed"] == denied


def test_chat_ttft_ignores_the_role_opener(server: MockOpenAIServer, tmp_path: Path) -> None:
    result_file = tmp_path / "chat.json"
    assert (
        main(
            [
                "run",
                "--target",
                server.url,
                "--endpoint",
                "chat",
                "--num-requests",
                "3",
                "--output-len",
                "2",
                "--result-file",
                str(result_file),
                "--no-progress",
            ]
        )
        == 0
    )
    result = json.loads(result_file.read_text())
    assert result["completed"] == 3 and result["mean_ttft_ms"] >= TTFT_S * 1000 * 0.95


def test_unreachable_target_exits_2_with_one_line_and_no_traceback(server: MockOpenAIServer) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for target in (f"http://127.0.0.1:{port}", f"grpc://127.0.0.1:{port}"):
        start = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "loadgen",
                "run",
                "--target",
                target,
                "--num-requests",
                "2",
                "--connect-timeout",
                "5",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"loadgen: error: cannot reach {target}"), proc.stderr
        assert "Traceback" not in proc.stderr and time.monotonic() - start < 30


def test_closed_loop_for_a_duration_with_warmup_seconds(server: MockOpenAIServer, tmp_path: Path) -> None:
    result_file = tmp_path / "closed.json"
    assert (
        main(
            [
                "run",
                "--target",
                server.url,
                "--arrival",
                "closed",
                "--concurrency",
                "3",
                "--duration",
                "0.4",
                "--warmup",
                "0.1s",
                "--output-len",
                "2",
                "--result-file",
                str(result_file),
                "--no-progress",
            ]
        )
        == 0
    )
    result = json.loads(result_file.read_text())
    # each request takes ~TTFT_S + ITL_S = 75 ms, three at a time: ~16 in 0.4 s, then the last ones finish
    assert result["loadgen"]["num_warmup"] >= 3 and 6 <= result["completed"] <= 24 and result["failed"] == 0
    assert 0.4 <= result["duration"] <= 0.8 and result["max_concurrent_requests"] == 3
    assert result["max_concurrency"] == 3 and result["loadgen"]["duration"] == 0.4


def test_a_request_over_its_timeout_fails_as_timeout(server: MockOpenAIServer, tmp_path: Path) -> None:
    result_file = tmp_path / "timeout.json"
    assert (
        main(
            [
                "run",
                "--target",
                server.url,
                "--num-requests",
                "2",
                "--output-len",
                "2",
                "--request-timeout",
                "0.02",
                "--result-file",
                str(result_file),
                "--no-progress",
            ]
        )
        == 0
    )
    result = json.loads(result_file.read_text())
    assert result["errors_by_kind"] == {"timeout": 2} and result["completed"] == 0
    assert result["errors"] == ["no complete response within 0.02 s"] * 2


def test_extra_body_fields_reach_the_server(server: MockOpenAIServer, tmp_path: Path) -> None:
    """--extra-body merges a server's own fields into every request (how the peer benchmark forces
    llama.cpp's output length with min_tokens); here a field the strict mock server knows."""
    server.bodies.clear()
    code = main(
        [
            "run",
            "--target",
            server.url,
            "--num-requests",
            "3",
            "--output-len",
            "2",
            "--arrival",
            "closed",
            "--concurrency",
            "1",
            "--extra-body",
            '{"temperature": 0.25}',
            "--no-progress",
            "--result-file",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 0 and len(server.bodies) == 3
    assert all(body["temperature"] == 0.25 for body in server.bodies)
