"""The OpenAI-compatible HTTP API on aiohttp, in the gateway process and on its asyncio loop.

POST /v1/completions, POST /v1/chat/completions (``stream: true`` as server-sent events), GET
/v1/models, GET /health, GET /metrics, GET /openapi.json (this API's description). Every error is an
OpenAI error body with its HTTP status (429 with Retry-After). A client that closes its connection cancels its request downstream: the handler
is cancelled (``handler_cancellation``) or its next write fails, and either way the stream is cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from core.errors import CapacityExceeded, InvalidRequest, ServingError, Unauthenticated
from rpc.errors import as_serving_error
from services.gateway import metrics
from services.gateway.auth import KeyCheck, api_key, http_middleware
from services.gateway.choices import Choice, Choices
from services.gateway.dispatch import Dispatcher
from services.gateway.openai_api import OpenAICall, parse_chat, parse_completion
from services.gateway.openai_responses import (
    chunk_json,
    error_json,
    response_json,
    tool_finish_reason,
    usage_chunk_json,
)
from services.gateway.openapi import openapi_document
from services.gateway.request_stream import Delta, Finished, Usage
from services.gateway.structured import MAX_JSON_DEPTH, check_depth
from services.gateway.tools import ToolStream

log = logging.getLogger(__name__)

REQUEST_ID_HEADERS = ("X-Request-Id", "Idempotency-Key")
IGNORED_FIELDS_HEADER = "X-Baton-Ignored-Fields"  # the body's fields this server does not know
MAX_ECHOED_CHARS = 1024  # of those names, in the header and the log
REQUEST_ID = web.RequestKey("request_id", str)  # set once the request is accepted, for error responses
_HTTP_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
HealthCheck = Callable[[], Awaitable[tuple[bool, dict[str, Any]]]]  # (serving, details for the body)


def error_response(
    error: ServingError, status: int | None = None, request_id: str | None = None
) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(error, CapacityExceeded):
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return web.json_response(error_json(error), status=status or error.http_status, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as an OpenAI error body; unknown exceptions as a generic 500 (logged)."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = InvalidRequest(e.text or e.reason)
        error.error_type = _HTTP_ERROR_TYPES.get(
            e.status, "invalid_request_error" if e.status < 500 else "internal_error"
        )
        return error_response(error, status=e.status)
    except ServingError as e:
        return error_response(e, request_id=request.get(REQUEST_ID))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        return error_response(as_serving_error(e), request_id=request.get(REQUEST_ID))


class HttpApi:
    """The routes, over the same `Dispatcher` the gRPC API uses."""

    def __init__(
        self, dispatcher: Dispatcher, health_check: HealthCheck, read_timeout_s: float = 30.0
    ) -> None:
        self.dispatcher = dispatcher
        self.read_timeout_s = read_timeout_s  # for a request's body (a slow sender gets 408)
        self.keyed = False  # every route but health needs an API key (set by `app`)
        self.health_check = health_check
        self.created = int(time.time())

    def app(self, max_request_bytes: int, keys: KeyCheck | None = None) -> web.Application:
        """The routes; with ``keys``, every one but ``GET /health`` needs a valid API key."""
        self.keyed = keys is not None
        guard = [] if keys is None else [http_middleware(keys)]
        app = web.Application(client_max_size=max_request_bytes, middlewares=[_errors, *guard])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        """This API's OpenAPI description (`services.gateway.openapi`)."""
        limits = self.dispatcher.limits
        document = openapi_document(self.dispatcher.model.name, limits.max_output_tokens, self.keyed)
        return web.json_response(document)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def models(self, request: web.Request) -> web.Response:
        model = self.dispatcher.model
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": model.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "baton",
                        "root": model.version,
                        "parent": None,
                        "max_model_len": model.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{model.version[:24]}",
                                "object": "model_permission",
                                "created": self.created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        """200 when every worker answers Info (with a scheduler: it answers and has workers), else 503;
        the body says what does not."""
        ok, details = await self.health_check()
        if self.dispatcher.draining:
            ok, details = False, {**details, "draining": True}
        body = {
            "status": "ok" if ok else "unavailable",
            "model": self.dispatcher.model.name,
            "requests_in_flight": self.dispatcher.num_in_flight,
            **details,
        }
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _generate(
        self, request: web.Request, parse: Callable[[Any, str | None], OpenAICall]
    ) -> web.StreamResponse:
        body = await _read_json(request, self.read_timeout_s)
        rid = next((request.headers[h] for h in REQUEST_ID_HEADERS if request.headers.get(h)), None)
        call = parse(body, rid)
        headers = {}
        if call.ignored:
            # A client's field names, escaped to printable ASCII and capped: neither the log nor the
            # header can be given a line break or a megabyte.
            names = ", ".join(ascii(name)[1:-1] for name in call.ignored)[:MAX_ECHOED_CHARS]
            log.warning("%s: ignored the field(s) it does not know: %s", request.path, names)
            headers[IGNORED_FIELDS_HEADER] = names
        choices = Choices(self.dispatcher, call, rid, api_key(request.headers))
        try:
            await choices.start()
            request[REQUEST_ID] = choices.id
            headers["X-Request-Id"] = choices.id
            if call.stream:
                return await self._stream(request, call, choices, headers)
            return await self._collect(call, choices, headers)
        finally:
            await choices.close("disconnect")  # a no-op for the choices that ended

    async def _collect(self, call: OpenAICall, choices: Choices, headers: dict[str, str]) -> web.Response:
        outputs = await choices.collect()
        body = response_json(
            call,
            choices.id,
            self.dispatcher.model.name,
            int(time.time()),
            outputs,
            choices.usage(),
            self._token_text,
        )
        return web.json_response(body, headers=headers)

    async def _stream(
        self, request: web.Request, call: OpenAICall, choices: Choices, headers: dict[str, str]
    ) -> web.StreamResponse:
        """Server-sent events. Errors before the first token are a plain error response; after it, an
        error event followed by [DONE]."""
        events = aiter(choices.events())
        first = await anext(events)  # a ServingError here becomes an HTTP error status
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await response.prepare(request)
        rid, model, created = choices.id, self.dispatcher.model.name, int(time.time())

        async def send(data: Any) -> None:
            await response.write(f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

        def usage() -> Usage | None:
            return choices.usage() if call.continuous_usage else None

        def chunk(index: int, delta: Delta | None = None, end: Finished | None = None, **kw: Any) -> Any:
            return chunk_json(call, rid, model, created, index, delta, end, self._token_text, **kw)

        # Under tools, each chat choice's text goes through its ToolStream (services.gateway.tools).
        tool_streams = {c.index: ToolStream(call.tools) for c in choices.choices} if call.tools else {}
        try:
            for c in choices.choices:  # the role opener, for every choice
                if call.chat:
                    await send(chunk(c.index, role=True))
            started: set[int] = set()  # choices whose first delta went out (with the prompt's echo)
            left = len(choices.choices)
            event: tuple[Choice, Delta | Finished] | None = first
            while event is not None:
                choice, out = event
                tools = tool_streams.get(choice.index)
                if isinstance(out, Delta) and tools is not None:
                    for i, message in enumerate(tools.feed(out.text)):  # logprobs go with the first
                        await send(
                            chunk(choice.index, out if i == 0 else None, message=message, usage=usage())
                        )
                elif isinstance(out, Delta) and choice.index not in started:
                    started.add(choice.index)
                    prompt = (choice.request.prompt_token_ids or (), out.prompt_logprobs or [])
                    text = choices.echo(choice) + out.text if call.echo else None
                    await send(chunk(choice.index, out, usage=usage(), text=text, prompt=prompt))
                elif isinstance(out, Delta):
                    if out.text or out.logprobs:  # tokens whose text is held back add nothing yet
                        await send(chunk(choice.index, out, usage=usage()))
                else:
                    reason = None
                    if tools is not None:
                        held, called = tools.finish()
                        for message in held:
                            await send(chunk(choice.index, message=message, usage=usage()))
                        reason = (
                            tool_finish_reason(call, "stop")
                            if called and out.finish_reason == "stop"
                            else None
                        )
                    left -= 1
                    last = usage() or (None if left or call.include_usage else choices.usage())
                    await send(chunk(choice.index, None, out, usage=last, reason=reason))
                    if not left and call.include_usage:
                        await send(usage_chunk_json(call, rid, model, created, choices.usage()))
                event = await anext(events, None)
        except ServingError as e:
            await send(error_json(e))
        except ConnectionResetError:
            log.info("request %s: the client closed the connection", rid)
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _token_text(self, token_id: int) -> str:
        return self.dispatcher.tokenizer.decode([token_id], skip_special_tokens=False)


async def _read_json(request: web.Request, timeout_s: float) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()  # raises 413 over client_max_size
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout_s:g} s") from None
    try:
        text = raw.decode("utf-8-sig")  # JSON between systems is UTF-8 (RFC 8259); a BOM is tolerated
    except UnicodeDecodeError as e:
        raise InvalidRequest(
            f"the request body is not valid UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} ({e.reason})"
        ) from None
    try:
        body = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # nested past the parser's stack
        raise InvalidRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    check_depth(body, "the request body")
    return body
