"""Where a request runs: the gateway's routing seam, `Router`.

`SchedulerRouter` asks the cluster scheduler (`baton.v1.Scheduler`) once per request (`Place`: tenant,
quotas, version, cache salt, workers) and reports back what the scheduler's ledgers need: the end of
the request (`Finish`), each KV lease handed from a prefill to a decode worker (`ReportLease`) and
cancels (`Cancel`, the cancellation bus). Those reports are fire-and-forget: a slow or absent
scheduler never holds up a client's stream. `StaticRouter` round-robins over configured workers, for a
setup without a scheduler. (The scheduler's own `Placer` picks workers by load and KV overlap; a
`Router` is the gateway's view of that decision.)
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import grpc

from baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from core.errors import (
    CapacityExceeded,
    InvalidRequest,
    ModelNotFound,
    ServingError,
    Unauthenticated,
    Unavailable,
)
from services.status import RETRY_AFTER_KEY

log = logging.getLogger(__name__)

LeaseEvent = Literal["pinned", "released", "aborted"]
_LEASE_EVENTS = {
    "pinned": scheduler_pb2.LEASE_EVENT_PINNED,
    "released": scheduler_pb2.LEASE_EVENT_RELEASED,
    "aborted": scheduler_pb2.LEASE_EVENT_ABORTED,
}
REPORT_TIMEOUT_S = 2.0  # Finish, ReportLease, Cancel: best effort, never on a client's path
# A restarted scheduler (or worker) is reachable again within a second, not after gRPC's default
# reconnect backoff of up to two minutes.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What a router needs to place one request."""

    request_id: str
    prompt_token_ids: Sequence[int]  # on a migration: the prompt and the tokens already sent
    max_tokens: int  # tokens still to generate
    api_key: str = ""  # "" = the scheduler's default tenant
    model: str = ""
    exclude: tuple[str, ...] = ()  # workers that failed this request
    resume: bool = False  # a retry or migration: the quotas were charged at the first placement
    timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """The workers of one request (``prefill`` None: the decode worker prefills it itself), and what
    the scheduler decided with them: the prefix-cache salt the workers must use, the tenant, the model
    version, how long a prefill worker holds the request's KV for the decode worker, and a shadow
    worker of a candidate version to mirror the request to (never answered from)."""

    decode: str
    prefill: str | None = None
    cache_salt: str = ""
    tenant: str = ""
    version: str = ""
    lease_ttl_s: float = 0.0
    shadow_worker: str | None = None
    shadow_version: str = ""


@dataclass(frozen=True, slots=True)
class LeaseReport:
    """A KV handoff's lease as the scheduler's ledger records it."""

    lease_id: str
    request_id: str
    prefill_worker: str
    decode_worker: str
    num_blocks: int
    ttl_s: float


class Router(Protocol):
    """Places requests and hears how they end. The reports return at once; they may fail silently."""

    async def route(self, query: RouteQuery) -> Route: ...

    def finish(self, request_id: str, route: Route, prompt_tokens: int, completion_tokens: int) -> None: ...

    def report_lease(self, event: LeaseEvent, lease: LeaseReport) -> None: ...

    def cancel(self, request_id: str, reason: str) -> asyncio.Task[bool] | None: ...

    async def close(self) -> None: ...


class StaticRouter:
    """Round-robin over configured prefill and decode workers, skipping those a request excludes.

    A prompt shorter than ``local_prefill_threshold`` tokens, or no prefill worker left, skips the
    prefill pool: a short prompt costs less to prefill on the decode worker than to ship as KV.
    """

    def __init__(
        self, prefill_workers: Sequence[str], decode_workers: Sequence[str], local_prefill_threshold: int = 0
    ) -> None:
        if not decode_workers:
            raise Unavailable("no decode workers are configured")
        self.prefill_workers = tuple(prefill_workers)
        self.decode_workers = tuple(decode_workers)
        self.local_prefill_threshold = local_prefill_threshold
        self._next_prefill = itertools.cycle(self.prefill_workers)
        self._next_decode = itertools.cycle(self.decode_workers)

    async def route(self, query: RouteQuery) -> Route:
        return self.place(len(query.prompt_token_ids), query.exclude)

    def place(self, num_prompt_tokens: int, exclude: Sequence[str] = ()) -> Route:
        decode = _next_allowed(self._next_decode, len(self.decode_workers), exclude)
        if decode is None:
            raise Unavailable(f"no decode worker left to try (failed: {', '.join(exclude)})")
        if num_prompt_tokens < self.local_prefill_threshold:
            return Route(decode=decode)
        return Route(decode=decode, prefill=_next_allowed(self._next_prefill, len(self.prefill_workers), exclude))

    def finish(self, request_id: str, route: Route, prompt_tokens: int, completion_tokens: int) -> None:
        pass  # no quotas without a scheduler

    def report_lease(self, event: LeaseEvent, lease: LeaseReport) -> None:
        pass  # the prefill worker's own lease timer is the only ledger

    def cancel(self, request_id: str, reason: str) -> asyncio.Task[bool] | None:
        return None  # the gateway's own call cancellation is the only path

    async def close(self) -> None:
        """Nothing to close: a static router holds no channel of its own."""


def _next_allowed(cycle: itertools.cycle[str], n: int, exclude: Sequence[str]) -> str | None:
    for _ in range(n):
        address = next(cycle)
        if address not in exclude:
            return address
    return None


def scheduler_error(e: grpc.aio.AioRpcError, address: str) -> ServingError:
    """A failed scheduler call as the error the client sees: the scheduler's own status (401, 404,
    429 with its retry-after, 400) or, for anything else, UNAVAILABLE saying the scheduler failed."""
    code, details = e.code(), e.details() or e.code().name
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Unauthenticated(details)
    if code == grpc.StatusCode.NOT_FOUND:
        return ModelNotFound(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        retry_after = 1.0
        for key, value in e.trailing_metadata() or ():
            if key == RETRY_AFTER_KEY:
                try:
                    retry_after = float(value)
                except ValueError:
                    log.warning("scheduler %s sent a malformed retry-after %r", address, value)
        return CapacityExceeded(details, retry_after_s=retry_after)
    if code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"cannot place the request now: {details} (scheduler {address})")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"the scheduler {address} did not answer in time")
    return Unavailable(f"the scheduler {address} failed: {code.name}: {details}")


class SchedulerRouter:
    """The gateway's client of the cluster scheduler: one channel, shared by every request."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address = address
        self.timeout_s = timeout_s  # longest Place may take (it may wait in the scheduler's fair queue)
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._background: set[asyncio.Task[bool]] = set()

    async def route(self, query: RouteQuery) -> Route:
        request = scheduler_pb2.PlaceRequest(
            request_id=query.request_id, api_key=query.api_key, model=query.model,
            prompt_token_ids=query.prompt_token_ids, max_tokens=query.max_tokens,
            exclude_workers=query.exclude, resume=query.resume,
        )
        timeout = self.timeout_s if query.timeout_s is None else min(self.timeout_s, query.timeout_s)
        call = self._stub.Place(request, timeout=timeout)
        try:
            resp: scheduler_pb2.PlaceResponse = await call
        except grpc.aio.AioRpcError as e:
            raise scheduler_error(e, self.address) from None
        except asyncio.CancelledError:
            call.cancel()  # the scheduler gives the quota back when Place is cancelled; if it had
            if call.done() and not call.cancelled() and not query.resume:  # already answered, we do
                self._report(self._finish_cancelled(call, query.request_id))
            raise
        return Route(
            decode=resp.decode_worker, prefill=resp.prefill_worker if resp.HasField("prefill_worker") else None,
            cache_salt=resp.cache_salt, tenant=resp.tenant, version=resp.version, lease_ttl_s=resp.lease_ttl_s,
            shadow_worker=resp.shadow_worker if resp.HasField("shadow_worker") else None,
            shadow_version=resp.shadow_version,
        )

    async def _finish_cancelled(self, call: grpc.aio.UnaryUnaryCall, request_id: str) -> bool:
        try:
            resp = await call
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            return False
        return await self._finish(request_id, resp.tenant, 0, 0)

    def finish(self, request_id: str, route: Route, prompt_tokens: int, completion_tokens: int) -> None:
        self._report(self._finish(request_id, route.tenant, prompt_tokens, completion_tokens))

    async def _finish(self, request_id: str, tenant: str, prompt_tokens: int, completion_tokens: int) -> bool:
        request = scheduler_pb2.FinishRequest(request_id=request_id, tenant=tenant, prompt_tokens=prompt_tokens,
                                              completion_tokens=completion_tokens)
        return await self._call("Finish", request_id, self._stub.Finish(request, timeout=REPORT_TIMEOUT_S))

    def report_lease(self, event: LeaseEvent, lease: LeaseReport) -> None:
        request = scheduler_pb2.ReportLeaseRequest(
            event=_LEASE_EVENTS[event], lease_id=lease.lease_id, request_id=lease.request_id,
            prefill_worker=lease.prefill_worker, decode_worker=lease.decode_worker, num_blocks=lease.num_blocks,
            ttl_s=lease.ttl_s,
        )
        self._report(self._call(f"ReportLease({event})", lease.request_id,
                                self._stub.ReportLease(request, timeout=REPORT_TIMEOUT_S)))

    def cancel(self, request_id: str, reason: str) -> asyncio.Task[bool] | None:
        """Publishes the cancel on the cluster's cancellation bus: the worker drops the request even
        when this gateway's own cancellation of its call is lost."""
        request = scheduler_pb2.SchedulerCancelRequest(request_id=request_id, reason=reason)
        return self._report(self._call("Cancel", request_id, self._stub.Cancel(request, timeout=REPORT_TIMEOUT_S)))

    async def _call(self, name: str, request_id: str, call: grpc.aio.UnaryUnaryCall) -> bool:
        try:
            await call
        except grpc.aio.AioRpcError as e:
            log.info("request %s: scheduler %s failed: %s %s", request_id, name, e.code().name, e.details())
            return False
        return True

    def _report(self, coro: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def list_versions(self, model: str = "", timeout_s: float = 5.0) -> list[scheduler_pb2.ModelVersion]:
        """The model versions the scheduler knows, with their healthy worker counts."""
        try:
            resp = await self._stub.ListModelVersions(
                scheduler_pb2.ListModelVersionsRequest(model=model), timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise scheduler_error(e, self.address) from None
        return list(resp.versions)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=REPORT_TIMEOUT_S)
        await self._channel.close()
