"""Where a request runs: the gateway's routing seam, `Router`.

`SchedulerRouter` asks the cluster scheduler (`baton.v1.Scheduler`) once per request (`Place`: tenant,
quotas, version, cache salt, workers) and reports back what the scheduler's ledgers need: the end of
the request (`Finish`), each KV lease handed from a prefill to a decode worker (`ReportLease`),
cancels (`Cancel`, the cancellation bus) and each shadowed request's comparison (`ReportShadow`). Those reports are fire-and-forget: a slow or absent
scheduler never holds up a client's stream. `StaticRouter` round-robins over configured workers, for a
setup without a scheduler. (The scheduler's own `Placer` picks workers by load and KV overlap; a
`Router` is the gateway's view of that decision.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import grpc

from baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from core.errors import SchedulerLost, ServingError, Unavailable
from core.expiry import Expired, expire_later
from rpc.errors import error_from_pb, from_rpc_error
from rpc.tls import Tls, channel

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
    siblings: tuple[str, ...] = ()  # the call's other choices, charged with this request


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
    prefill_epoch: int = 0  # the workers' registration epochs the calls are meant for (0: unchecked)
    decode_epoch: int = 0


@dataclass(frozen=True, slots=True)
class LeaseReport:
    """A KV handoff's lease as the scheduler's ledger records it."""

    lease_id: str
    request_id: str
    prefill_worker: str
    decode_worker: str
    num_blocks: int
    ttl_s: float


@dataclass(frozen=True, slots=True)
class ShadowReport:
    """One shadowed request compared with what its client got (services.gateway.shadow), for the version
    pair's sums in the scheduler (`baton models list`)."""

    model: str
    primary_version: str
    shadow_version: str
    identical: bool
    greedy_agreement: float  # share of output positions holding the same token
    positions: int  # next-token distributions compared, on the shared prefix
    top1_agreed: int  # of them, where both put the same token first
    kl_sum: float  # KL(primary || shadow) summed over those positions
    primary_ttft_ms: float
    shadow_ttft_ms: float
    primary_itl_ms: float  # 0 with fewer than 2 tokens
    shadow_itl_ms: float


class Router(Protocol):
    """Places requests and hears how they end. The reports return at once; they may fail silently."""

    async def route(self, query: RouteQuery) -> Route: ...

    def finish(self, request_id: str, route: Route, prompt_tokens: int, completion_tokens: int) -> None: ...

    def report_lease(self, event: LeaseEvent, lease: LeaseReport) -> None: ...

    def report_shadow(self, report: ShadowReport) -> None: ...

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
        return Route(
            decode=decode, prefill=_next_allowed(self._next_prefill, len(self.prefill_workers), exclude)
        )

    def finish(self, request_id: str, route: Route, prompt_tokens: int, completion_tokens: int) -> None:
        pass  # no quotas without a scheduler

    def report_lease(self, event: LeaseEvent, lease: LeaseReport) -> None:
        pass  # the prefill worker's own lease timer is the only ledger

    def report_shadow(self, report: ShadowReport) -> None:
        pass  # a static router names no shadow workers: nothing is ever compared

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
    """A failed unary scheduler call as the error the client sees (see `as_seen`)."""
    return as_seen(from_rpc_error(e, address), address)


def as_seen(error: ServingError, address: str) -> ServingError:
    """A scheduler's error as the client sees it: the scheduler's own refusal as it is (401, 404, 429
    with its retry-after, 400); a scheduler that cannot be reached, is unavailable or failed, as
    UNAVAILABLE naming it."""
    if isinstance(error, Unavailable):
        return Unavailable(f"cannot place the request now: {error.message} (scheduler {address})")
    if type(error) is ServingError:
        return Unavailable(f"the scheduler {address} failed: {error.message}")
    return error


Undo = Callable[[Any], object]


class CallStream:
    """The gateway's one `Scheduler.Calls` stream: many requests' calls multiplexed by call id, each
    answered whenever the scheduler is done with it. Opened on first use and again after it breaks;
    a break fails the calls it carried (UNAVAILABLE), as a broken channel fails unary calls."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, address: str) -> None:
        self._stub = stub
        self.address = address
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[scheduler_pb2.SchedulerCall | None] | None = None
        # call id → (its waiter, what undoes it): until its reply arrives, also after it was given up
        self._pending: dict[int, tuple[asyncio.Future[scheduler_pb2.SchedulerReply], Undo | None]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def call(
        self, timeout_s: float, undo: Undo | None = None, withdraw: bool = True, **call: Any
    ) -> Any:
        """Sends one call (``place=...``, ``finish=...``, ...) and returns its reply message; a failure
        is raised as the error the client sees. Cancelled or timed out, the call is abandoned on the
        scheduler (a waiting Place leaves the queue, its quota returned); if it succeeds there all the
        same (its reply crossed the abandon), ``undo`` gets the reply, to give back what it took.
        ``withdraw`` False: a call given up is only no longer waited for; the scheduler still runs it
        (a report: Finish, ReportLease and Cancel are idempotent and must land however late)."""
        outbox = self._open()
        call_id = next(self._ids)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[scheduler_pb2.SchedulerReply] = loop.create_future()
        self._pending[call_id] = (reply, undo)
        outbox.put_nowait(scheduler_pb2.SchedulerCall(call_id=call_id, **call))
        timer = expire_later(reply, timeout_s)
        try:
            answer = await reply
        except (asyncio.CancelledError, Expired) as e:
            if (
                withdraw and call_id in self._pending
            ):  # no reply yet: the scheduler undoes it (or its reply is undone)
                outbox.put_nowait(scheduler_pb2.SchedulerCall(call_id=call_id, abandon=True))
            if isinstance(e, Expired):
                raise Unavailable(f"the scheduler {self.address} did not answer in time") from None
            raise
        finally:
            timer.cancel()
        kind = answer.WhichOneof("reply")
        if kind == "error":
            raise as_seen(error_from_pb(answer.error), self.address)
        return getattr(answer, kind)

    def _open(self) -> asyncio.Queue[scheduler_pb2.SchedulerCall | None]:
        if self._outbox is not None:
            return self._outbox
        outbox: asyncio.Queue[scheduler_pb2.SchedulerCall | None] = asyncio.Queue()

        async def calls() -> AsyncIterator[scheduler_pb2.SchedulerCalls]:
            # Whatever calls are ready when a message goes out travel together.
            while (first := await outbox.get()) is not None:
                batch = scheduler_pb2.SchedulerCalls(calls=[first])
                while not outbox.empty():
                    more = outbox.get_nowait()
                    if more is None:
                        yield batch
                        return
                    batch.calls.append(more)
                yield batch

        try:
            stream = self._stub.Calls(calls())
        except grpc.aio.UsageError:  # the channel is closed: this gateway is going away
            raise SchedulerLost(f"the channel to the scheduler {self.address} is closed") from None
        self._outbox = outbox
        self._reader = asyncio.get_running_loop().create_task(self._read(stream, outbox))
        return outbox

    async def _read(
        self, stream: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[scheduler_pb2.SchedulerCall | None]
    ) -> None:
        error: ServingError = SchedulerLost(f"the scheduler {self.address} closed the call stream")
        try:
            async for batch in stream:
                for reply in batch.replies:
                    waiter, undo = self._pending.pop(reply.call_id, (None, None))
                    if waiter is None:
                        continue
                    if not waiter.done():
                        waiter.set_result(reply)
                    elif undo is not None and (kind := reply.WhichOneof("reply")) not in (None, "error"):
                        undo(getattr(reply, kind))  # given up, but it had succeeded: give it back
        except grpc.aio.AioRpcError as e:
            error = SchedulerLost(scheduler_error(e, self.address).message)
        finally:
            if self._outbox is outbox:  # the next call opens a new stream
                self._outbox = None
            outbox.put_nowait(None)
            stream.cancel()
            pending, self._pending = self._pending, {}
            for waiter, _ in pending.values():
                if not waiter.done():
                    waiter.set_exception(error)

    async def close(self) -> None:
        if self._outbox is not None:
            self._outbox.put_nowait(None)  # half-close: the scheduler answers what it has, then ends
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._reader, REPORT_TIMEOUT_S)


class SchedulerRouter:
    """The gateway's client of the cluster scheduler: one channel, shared by every request, and one
    `Calls` stream on it for the per-request calls (Place, Finish, ReportLease, Cancel)."""

    def __init__(self, address: str, timeout_s: float = 30.0, tls: Tls | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s  # longest Place may take (it may wait in the scheduler's fair queue)
        self._channel = channel(address, tls, CHANNEL_OPTIONS)
        self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._calls = CallStream(self._stub, address)
        self._background: set[asyncio.Task[bool]] = set()

    async def route(self, query: RouteQuery) -> Route:
        request = scheduler_pb2.PlaceRequest(
            request_id=query.request_id,
            api_key=query.api_key,
            model=query.model,
            prompt_token_ids=query.prompt_token_ids,
            max_tokens=query.max_tokens,
            exclude_workers=query.exclude,
            resume=query.resume,
            siblings=query.siblings,
        )
        timeout = self.timeout_s if query.timeout_s is None else min(self.timeout_s, query.timeout_s)

        def undo(placed: scheduler_pb2.PlaceResponse) -> None:
            # Given up just after the scheduler placed it: nothing was served, give the quota back
            # (a migration's quota was charged at its first placement and ends with the request).
            if not query.resume:
                for request_id in (query.request_id, *query.siblings):
                    self._report(self._finish(request_id, placed.tenant, 0, 0))

        try:
            resp: scheduler_pb2.PlaceResponse = await self._calls.call(timeout, undo=undo, place=request)
        except SchedulerLost as e:
            # The replica went away before answering: once more, on the stream the channel opens to
            # another replica (a Place is idempotent per request id: charged once).
            log.warning("request %s: %s; placing it again", query.request_id, e.message)
            request.resent = True  # the admission the lost replica may have made is this request's
            resp = await self._calls.call(timeout, undo=undo, place=request)
        return Route(
            decode=resp.decode_worker,
            prefill=resp.prefill_worker if resp.HasField("prefill_worker") else None,
            cache_salt=resp.cache_salt,
            tenant=resp.tenant,
            version=resp.version,
            lease_ttl_s=resp.lease_ttl_s,
            shadow_worker=resp.shadow_worker if resp.HasField("shadow_worker") else None,
            shadow_version=resp.shadow_version,
            prefill_epoch=resp.prefill_epoch,
            decode_epoch=resp.decode_epoch,
        )

    def finish(self, request_id: str, route: Route, prompt_tokens: int, completion_tokens: int) -> None:
        self._report(self._finish(request_id, route.tenant, prompt_tokens, completion_tokens))

    async def _finish(self, request_id: str, tenant: str, prompt_tokens: int, completion_tokens: int) -> bool:
        request = scheduler_pb2.FinishRequest(
            request_id=request_id,
            tenant=tenant,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
        return await self._call("Finish", request_id, finish=request)

    def report_lease(self, event: LeaseEvent, lease: LeaseReport) -> None:
        request = scheduler_pb2.ReportLeaseRequest(
            event=_LEASE_EVENTS[event],
            lease_id=lease.lease_id,
            request_id=lease.request_id,
            prefill_worker=lease.prefill_worker,
            decode_worker=lease.decode_worker,
            num_blocks=lease.num_blocks,
            ttl_s=lease.ttl_s,
        )
        # The scheduler runs a stream's calls as concurrent tasks, so this lease's end may reach Redis
        # before its pin; the ledger records such a lease as ended when the pin lands (scheduler.leases).
        self._report(self._call(f"ReportLease({event})", lease.request_id, report_lease=request))

    def report_shadow(self, report: ShadowReport) -> None:
        self._report(self._report_shadow(report))

    async def _report_shadow(self, r: ShadowReport) -> bool:
        request = scheduler_pb2.ReportShadowRequest(
            model=r.model,
            primary_version=r.primary_version,
            shadow_version=r.shadow_version,
            identical=r.identical,
            greedy_agreement=r.greedy_agreement,
            positions=r.positions,
            top1_agreed=r.top1_agreed,
            kl_sum=r.kl_sum,
            primary_ttft_ms=r.primary_ttft_ms,
            shadow_ttft_ms=r.shadow_ttft_ms,
            primary_itl_ms=r.primary_itl_ms,
            shadow_itl_ms=r.shadow_itl_ms,
        )
        try:  # a unary call: a share of requests, once each, after both outputs ended
            await self._stub.ReportShadow(request, timeout=REPORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            log.info(
                "shadow report of %s vs %s failed: %s %s",
                r.shadow_version,
                r.primary_version,
                e.code().name,
                e.details(),
            )
            return False
        return True

    def cancel(self, request_id: str, reason: str) -> asyncio.Task[bool] | None:
        """Publishes the cancel on the cluster's cancellation bus: the worker drops the request even
        when this gateway's own cancellation of its call is lost."""
        request = scheduler_pb2.SchedulerCancelRequest(request_id=request_id, reason=reason)
        return self._report(self._call("Cancel", request_id, cancel=request))

    async def _call(self, name: str, request_id: str, **call: Any) -> bool:
        try:
            await self._calls.call(REPORT_TIMEOUT_S, withdraw=False, **call)
        except ServingError as e:
            log.info("request %s: scheduler %s failed: %s %s", request_id, name, e.grpc_code, e.message)
            return False
        return True

    def _report(self, coro: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def _unary(self, method: Any, request: Any, timeout_s: float) -> Any:
        """One unary scheduler call; its failure as the error the client sees."""
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise scheduler_error(e, self.address) from None

    async def authenticate(self, api_key: str) -> str:
        """The tenant of ``api_key`` (`Unauthenticated` if it has none), as a Place would resolve it."""
        request = scheduler_pb2.AuthenticateRequest(api_key=api_key)
        return str((await self._unary(self._stub.Authenticate, request, REPORT_TIMEOUT_S)).tenant)

    async def list_versions(
        self, model: str = "", timeout_s: float = 5.0
    ) -> list[scheduler_pb2.ModelVersion]:
        """The model versions the scheduler knows, with their healthy worker counts."""
        request = scheduler_pb2.ListModelVersionsRequest(model=model)
        return list((await self._unary(self._stub.ListModelVersions, request, timeout_s)).versions)

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=REPORT_TIMEOUT_S)
        await self._calls.close()
        await self._channel.close()
