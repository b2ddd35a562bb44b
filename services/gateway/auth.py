"""Who may call the gateway: ``--require-api-key``, checked before any work, on HTTP and gRPC alike.

Deny by default: every HTTP route but ``GET /health`` and every gRPC method but the health service's
needs a valid key, so a route added later is guarded without anyone remembering to guard it, and a
path trick (``//v1/models``, ``/V1/models``, ``/v1/../v1/models``) is at worst a 401, never a way
round the check: the one open path is compared exactly, after aiohttp has normalized it.

A key is valid when the scheduler resolves it to a tenant (its ``Authenticate`` answers as ``Place``
would). Keys are never compared as strings anywhere: the scheduler keeps only their SHA-256 digests
(`scheduler.tenants`) and looks the digest up, and this gateway remembers the digests of keys it has
seen accepted for ``ttl_s``. A lookup's timing can at most tell how much of a digest matched, which
brings an attacker no closer to a key (that would take a SHA-256 preimage). A revoked key stops
working within ``ttl_s`` here, and at once for generation (``Place`` resolves it again).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import grpc
from aiohttp import web

from core.errors import ServingError, Unauthenticated
from rpc.errors import abort_with
from services.gateway import metrics

OPEN_HTTP_PATHS = frozenset({"/health"})  # GET or HEAD, exactly these paths
OPEN_GRPC_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
NO_KEY = "this server requires an API key: send it as 'Authorization: Bearer <key>'"

Authenticate = Callable[[str], Awaitable[str]]  # API key → tenant name; raises Unauthenticated


def _key(authorization: str, x_api_key: str) -> str:
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return x_api_key.strip()


def api_key(headers: Mapping[str, str]) -> str:
    """The client's API key from HTTP headers: ``Authorization: Bearer KEY`` or ``x-api-key: KEY``
    ("" = none)."""
    return _key(headers.get("Authorization", ""), headers.get("x-api-key", ""))


def api_key_from_metadata(metadata: Sequence[tuple[str, str | bytes]] | None) -> str:
    """The same from gRPC metadata (whose keys are lower case)."""
    values = {key.lower(): value for key, value in metadata or () if isinstance(value, str)}
    return _key(values.get("authorization", ""), values.get("x-api-key", ""))


class KeyCheck:
    """Checks an API key with the scheduler, remembering the digests of accepted keys for ``ttl_s``
    (at most ``max_keys`` of them) so that a busy client costs the scheduler one call a second."""

    def __init__(self, authenticate: Authenticate, ttl_s: float = 1.0, max_keys: int = 10_000) -> None:
        self._authenticate = authenticate
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._accepted: dict[bytes, float] = {}  # digest → when the scheduler last accepted it

    async def check(self, api_key: str, surface: str) -> None:
        """Returns if ``api_key`` is valid; raises `Unauthenticated` (counted per surface) if not."""
        if not api_key:
            metrics.AUTH_REFUSED.labels(surface, "missing").inc()
            raise Unauthenticated(NO_KEY)
        digest = hashlib.sha256(api_key.encode()).digest()
        seen = self._accepted.get(digest)
        if seen is not None and time.monotonic() - seen <= self.ttl_s:
            return
        try:
            await self._authenticate(api_key)
        except Unauthenticated:
            self._accepted.pop(digest, None)
            metrics.AUTH_REFUSED.labels(surface, "invalid").inc()
            raise
        if len(self._accepted) >= self.max_keys:
            self._accepted.clear()  # rare; a cleared key costs one more scheduler call
        self._accepted[digest] = time.monotonic()


def http_middleware(keys: KeyCheck) -> Any:
    """The aiohttp middleware that refuses a request without a valid key before routing: an unknown
    path is a 401 too, so the routes cannot be probed."""

    @web.middleware
    async def require_api_key(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if not (request.method in ("GET", "HEAD") and request.path in OPEN_HTTP_PATHS):
            await keys.check(api_key(request.headers), "http")
        return await handler(request)

    return require_api_key


class GrpcKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """The same check for every gRPC method but health: a call without a valid key ends
    UNAUTHENTICATED before its handler (or the request's decoding) runs."""

    def __init__(self, keys: KeyCheck) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method in OPEN_GRPC_METHODS:
            return await continuation(details)
        try:
            await self._keys.check(api_key_from_metadata(details.invocation_metadata), "grpc")
        except ServingError as e:
            return _refusal(await continuation(details), e)
        return await continuation(details)


def _refusal(handler: grpc.RpcMethodHandler | None, error: ServingError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` (unary or streaming) that only ends the call with
    ``error``; the request is never decoded."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort_with(context, error)

    if handler is None or not (handler.request_streaming or handler.response_streaming):
        return grpc.unary_unary_rpc_method_handler(refuse)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    return grpc.unary_stream_rpc_method_handler(refuse)
