"""Where loadgen sends requests: Baton's gRPC `Session` stream, or any OpenAI-compatible HTTP server.

Both are asyncio clients that fill a `RequestRecord` per request: every output chunk's arrival time,
the text, the server's token counts when it gives them, and a classified error. The gRPC target
multiplexes requests over a few `Session` streams (one set per API key, since a key travels in the call's
metadata), opening another when each has ``session_requests`` in flight.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import grpc

from baton.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from loadgen.record import RequestRecord
from loadgen.workload import LoadgenError, RequestSpec

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}
_TIMING_FIELDS = ("queue_ms", "prefill_ms", "transfer_ms", "decode_ms", "ttft_ms", "e2e_ms")


@dataclass(frozen=True, slots=True)
class TargetConfig:
    """How requests are sent; the `loadgen run` target flags by the same names."""

    url: str  # grpc://host:port, or http(s)://host:port[/prefix] of an OpenAI-compatible server
    model: str | None = None  # None: the first model the server lists
    endpoint: str = "completions"  # completions | chat
    temperature: float = 0.0
    ignore_eos: bool = False
    stream_usage: bool = True  # HTTP: ask for usage in the stream (stream_options.include_usage)
    api_key: str = ""  # for the model listing; requests carry their own (RequestSpec.api_key)
    request_timeout: float = 600.0
    connect_timeout: float = 10.0
    session_requests: int = 32  # gRPC: requests in flight per Session stream
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # HTTP: merged into every request body


class Target(Protocol):
    """A server under test."""

    backend: str  # the result's "backend": baton-grpc, openai, openai-chat
    accepts_token_ids: bool  # whether prompts may be sent as token ids

    async def open(self) -> str:
        """Checks the server answers; returns the model id the run uses. LoadgenError if unreachable."""

    async def send(self, spec: RequestSpec, record: RequestRecord) -> None:
        """Sends one request and fills ``record``; never raises for the request's own failure."""

    async def close(self) -> None:
        """Ends the streams and connections (requests still running fail)."""


def make_target(config: TargetConfig) -> Target:
    """The target for the URL's scheme; LoadgenError for a URL loadgen cannot use."""
    parts = urlsplit(config.url)
    if parts.scheme not in ("grpc", "http", "https") or not parts.hostname:
        raise LoadgenError(f"--target {config.url!r}: expected grpc://HOST:PORT or http(s)://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        raise LoadgenError(f"--target {config.url!r}: the port is not a number in 0..65535") from None
    if config.endpoint not in ("completions", "chat"):
        raise LoadgenError(f"--endpoint {config.endpoint!r}: expected completions or chat")
    if parts.scheme == "grpc":
        if port is None:
            raise LoadgenError(f"--target {config.url!r}: a gRPC target needs a port (grpc://HOST:PORT)")
        return GrpcTarget(config, f"{parts.hostname}:{port}")
    return HttpTarget(config)


def _describe(e: BaseException) -> str:
    """A short, one-line cause of a client-side failure."""
    if isinstance(e, aiohttp.ClientConnectorError):
        if isinstance(e.os_error, ConnectionRefusedError):
            return "connection refused"
        return e.os_error.strerror or str(e.os_error) or str(e)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# --- OpenAI-compatible HTTP ------------------------------------------------------------------------


class HttpTarget:
    """POST /v1/completions or /v1/chat/completions with ``stream: true``, read as server-sent events."""

    accepts_token_ids = False  # peers differ; text is what every OpenAI-compatible server takes

    def __init__(self, config: TargetConfig) -> None:
        self.config = config
        self.backend = "openai-chat" if config.endpoint == "chat" else "openai"
        self._base = config.url.rstrip("/").removesuffix("/v1")
        self._path = "/v1/chat/completions" if config.endpoint == "chat" else "/v1/completions"
        self._session: aiohttp.ClientSession | None = None
        self.model = config.model or ""

    async def open(self) -> str:
        # A connection per request (as vLLM's benchmark client opened a session per request): a pooled
        # keep-alive connection that the server closes as its stream ends fails the next request's write
        # ("Can not write request body": 5 of 12 back-to-back requests to llama.cpp's server), which
        # would count a client race as the server's failure. On loopback a connect costs ~0.1 ms.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout)
        try:
            async with self._session.get(f"{self._base}/v1/models", headers=headers, timeout=timeout) as r:
                listed = await r.json(content_type=None) if r.status == 200 else None
        except (aiohttp.ClientError, TimeoutError) as e:
            raise LoadgenError(f"cannot reach {self.config.url}: {_describe(e)}") from None
        except ValueError:  # a 200 that is not JSON: not an OpenAI-compatible server at this address
            listed = None
        if not self.model:
            models = listed.get("data") if isinstance(listed, dict) else None
            first = models[0] if isinstance(models, list) and models else None
            if not (isinstance(first, dict) and first.get("id")):
                raise LoadgenError(f"{self.config.url}/v1/models lists no model; give --model")
            self.model = str(first["id"])
        return self.model

    def _body(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.output_len,
            "temperature": self.config.temperature,
            "stream": True,
        }
        if self.config.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        else:
            body["prompt"] = spec.prompt
        if self.config.stream_usage:
            body["stream_options"] = {"include_usage": True}
        if self.config.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and llama.cpp's extra field; only when asked for
        body.update(self.config.extra_body)  # a server's own fields (e.g. llama.cpp's min_tokens)
        return body

    async def send(self, spec: RequestSpec, record: RequestRecord) -> None:
        assert self._session is not None, "open() first"
        headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
        url, body = self._base + self._path, self._body(spec)
        record.start = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.request_timeout):
                async with self._session.post(url, json=body, headers=headers) as r:
                    if r.status != 200:
                        message = _http_error(r.status, await r.text())
                        record.fail(f"http:{r.status}", message, time.perf_counter())
                        return
                    await self._read_events(r, record)
        except TimeoutError:
            record.fail(
                "timeout",
                f"no complete response within {self.config.request_timeout:g} s",
                time.perf_counter(),
            )
        except aiohttp.ClientError as e:
            record.fail("connection", _describe(e), time.perf_counter())

    async def _read_events(self, response: aiohttp.ClientResponse, record: RequestRecord) -> None:
        chat = self.config.endpoint == "chat"
        async for raw in response.content:
            now = time.perf_counter()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments (": ping"), event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                record.end = now
                break
            try:
                data = json.loads(payload)
            except ValueError:
                record.fail("stream", f"an event is not JSON: {payload[:80]!r}", now)
                return
            if not isinstance(data, dict):
                record.fail("stream", f"an event is not a JSON object: {payload[:80]!r}", now)
                return
            if "error" in data:
                error = data["error"]
                message = error.get("message", error) if isinstance(error, dict) else error
                record.fail("stream", str(message), now)
                return
            _take_chunk(data, chat, record, now)
        record.end = record.end or time.perf_counter()
        if not record.chunk_times:
            record.fail("empty", "the stream ended without any output", record.end)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _take_chunk(data: dict[str, Any], chat: bool, record: RequestRecord, now: float) -> None:
    """Records one SSE chunk: its text (a chunk with text is one output chunk) and any usage."""
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        delta = choice.get("delta")
        text = (delta.get("content") if isinstance(delta, dict) else None) if chat else choice.get("text")
        if isinstance(text, str) and text:  # role openers, finish chunks and held-back bytes carry none
            record.chunk_times.append(now)
            record.chunk_tokens.append(1)
            record.generated_text += text
    usage = data.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens = usage["completion_tokens"]
        if isinstance(usage.get("prompt_tokens"), int):
            record.server_prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]


def _http_error(status: int, body: str) -> str:
    """The message of an OpenAI error body ({"error": {"message": ...}}), else the body's start."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    return f"HTTP {status}: {message or body[:200] or 'no body'}"


# --- Baton gRPC Session --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Ended:
    """The Session stream ended while a request still waited on it."""

    kind: str
    message: str


class _Session:
    """One `Gateway.Session` call: writes requests under a lock, routes responses by request id."""

    def __init__(self, stub: gateway_pb2_grpc.GatewayStub, api_key: str) -> None:
        metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._call = stub.Session(metadata=metadata)
        self.pending: dict[str, asyncio.Queue[tuple[float, Any]]] = {}
        self.ended: _Ended | None = None
        self._write_lock = asyncio.Lock()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        ended = _Ended("grpc:OK", "the Session stream ended before the request did")
        try:
            async for msg in self._call:
                queue = self.pending.get(msg.request_id)
                if queue is not None:
                    queue.put_nowait((time.perf_counter(), msg))
        except grpc.aio.AioRpcError as e:
            ended = _Ended(f"grpc:{e.code().name}", e.details() or e.code().name)
        finally:
            self.ended = ended
            for queue in self.pending.values():
                queue.put_nowait((time.perf_counter(), ended))

    async def write(self, request: gateway_pb2.SessionRequest) -> None:
        async with self._write_lock:
            await self._call.write(request)

    async def close(self, timeout: float) -> None:
        if self.ended is None:
            try:
                await self._call.done_writing()
                await asyncio.wait_for(asyncio.shield(self._reader), timeout)
            except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError):
                self._call.cancel()
        self._reader.cancel()


class GrpcTarget:
    """Baton's `baton.v1.Gateway/Session`: requests multiplexed by id over a few bidirectional streams."""

    backend = "baton-grpc"

    def __init__(self, config: TargetConfig, address: str) -> None:
        self.config = config
        self.accepts_token_ids = config.endpoint == "completions"  # chat messages are text
        self.address = address
        self.model = config.model or ""
        self._run_id = uuid.uuid4().hex[:8]  # request ids unique across runs against one gateway
        self._channel: grpc.aio.Channel | None = None
        self._stub: gateway_pb2_grpc.GatewayStub | None = None
        self._sessions: dict[str, list[_Session]] = {}

    async def open(self) -> str:
        self._channel = grpc.aio.insecure_channel(self.address)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        metadata = (("authorization", f"Bearer {self.config.api_key}"),) if self.config.api_key else ()
        try:
            listed = await self._stub.ListModels(
                gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=self.config.connect_timeout
            )
        except grpc.aio.AioRpcError as e:
            raise LoadgenError(
                f"cannot reach {self.config.url}: {e.code().name}: "
                f"{' '.join((e.details() or '').split())[:200]}"
            ) from None
        if not self.model and listed.models:
            self.model = listed.models[0].name  # "" (the gateway's default model) is also fine to send
        return self.model

    def _session_for(self, api_key: str) -> _Session:
        assert self._stub is not None, "open() first"
        sessions = [s for s in self._sessions.get(api_key, []) if s.ended is None]
        for session in sessions:
            if len(session.pending) < self.config.session_requests:
                return session
        session = _Session(self._stub, api_key)
        self._sessions[api_key] = [*sessions, session]
        return session

    def _request(self, spec: RequestSpec, rid: str) -> gateway_pb2.SessionRequest:
        sampling = common_pb2.SamplingParams(max_tokens=spec.output_len, temperature=self.config.temperature)
        if self.config.ignore_eos:
            sampling.ignore_eos = True
        generate = gateway_pb2.GenerateRequest(request_id=rid, model=self.model, sampling=sampling)
        if self.config.endpoint == "chat":
            generate.messages.messages.add(role="user", content=spec.prompt)
        elif spec.prompt_token_ids is not None:
            generate.prompt_token_ids.ids.extend(spec.prompt_token_ids)
        else:
            generate.prompt = spec.prompt
        return gateway_pb2.SessionRequest(generate=generate)

    async def send(self, spec: RequestSpec, record: RequestRecord) -> None:
        session = self._session_for(spec.api_key)
        rid = f"loadgen-{self._run_id}-{spec.index}"
        queue: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()
        session.pending[rid] = queue
        request = self._request(spec, rid)
        record.start = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.request_timeout):
                await session.write(request)
                while not await self._take(queue, record):
                    continue
        except TimeoutError:
            record.fail(
                "timeout",
                f"no complete response within {self.config.request_timeout:g} s",
                time.perf_counter(),
            )
            await self._cancel(session, rid)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            kind = f"grpc:{e.code().name}" if isinstance(e, grpc.aio.AioRpcError) else "connection"
            record.fail(kind, _describe(e), time.perf_counter())
        finally:
            session.pending.pop(rid, None)

    @staticmethod
    async def _take(queue: asyncio.Queue[tuple[float, Any]], record: RequestRecord) -> bool:
        """Applies the request's next message to its record; True once the request has ended."""
        now, msg = await queue.get()
        if isinstance(msg, _Ended):
            record.fail(msg.kind, msg.message, now)
            return True
        event = msg.WhichOneof("event")
        if event == "delta":
            if msg.delta.token_ids:
                record.chunk_times.append(now)
                record.chunk_tokens.append(len(msg.delta.token_ids))
            record.generated_text += msg.delta.text
            return False
        if event == "error":
            code = _CODE_NAMES.get(msg.error.code, str(msg.error.code))
            record.fail(f"grpc:{code}", msg.error.message, now)
            return True
        completion = msg.completion
        record.end = now
        record.output_tokens = completion.usage.completion_tokens
        record.server_prompt_tokens = completion.usage.prompt_tokens
        record.cached_tokens = completion.usage.cached_tokens
        record.server_timings = {name: getattr(completion.timings, name) for name in _TIMING_FIELDS}
        reason = completion.finish_reason
        if reason in (common_pb2.FINISH_REASON_CANCELLED, common_pb2.FINISH_REASON_ERROR):
            kind = "cancelled" if reason == common_pb2.FINISH_REASON_CANCELLED else "error"
            record.fail(kind, f"finished as {common_pb2.FinishReason.Name(reason)}", now)
        elif not record.chunk_times:
            record.fail("empty", "the request finished without any output", now)
        return True

    @staticmethod
    async def _cancel(session: _Session, rid: str) -> None:
        if session.ended is None:
            try:
                cancel = gateway_pb2.CancelRequest(request_id=rid)
                await session.write(gateway_pb2.SessionRequest(cancel=cancel))
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                return  # the stream is gone, and the request with it

    async def close(self) -> None:
        for session in (s for group in self._sessions.values() for s in group):
            await session.close(self.config.connect_timeout)
        if self._channel is not None:
            await self._channel.close()
