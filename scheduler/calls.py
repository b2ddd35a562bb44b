"""The gateway's per-request calls — `Place`, `Finish`, `ReportLease`, `Cancel` — on one `Calls`
stream (`serve_calls`), and how such a call's error is answered: a unary call raises it (Redis errors
as `Unavailable`, `unless_store_down`) and `rpc.servicer.add_servicer` ends the call with its status;
on the stream it is that call's `RequestError` (`rpc.errors.error_to_pb`), and the stream goes on.

**Orphans.** A gateway that dies (SIGKILL, a lost node) never sends the `Finish` of the requests it
had placed, so their quota charge — a tenant concurrency slot, KV blocks in the ledger — would stay
for the whole request TTL (an hour). Each stream therefore keeps the ids it placed and has not
finished; once it ends with some left, and ``orphan_grace_s`` (`ORPHAN_GRACE_S`) later no other live
stream of this replica holds them (a gateway back after a network blip re-places or resumes its
requests on its new stream), their expiry in the ledger is brought forward to ``orphan_retention_s``
(`ORPHAN_RETENTION_S`) from then (`QuotaLedger.orphan`) — not refunded at once: until then a client
that re-sends such an id to another gateway is still refused ALREADY_EXISTS rather than served
twice, and after it the tenant has its slot back. A gateway that is still alive and finishes one of
them later finishes it as ever (`Finish` is idempotent)."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from google.protobuf.message import Message
from redis.exceptions import RedisError

from baton.v1 import scheduler_pb2 as pb
from core.errors import InvalidRequest, RequestAborted, ServingError, Unavailable
from rpc.errors import error_to_pb

log = logging.getLogger(__name__)

T = TypeVar("T")

Handler = Callable[[Any], Awaitable[Message]]  # a call's request → its reply (the unary call's own code)

# How long after a stream ends its unfinished requests are left as they are: a gateway that lost the
# stream but lives (a network blip, a replica restart) re-places or resumes them on a new one by then.
ORPHAN_GRACE_S = 30.0
# How long an orphaned request still holds its quota charge (from the end of the grace): its id stays
# in flight, so the same id re-sent by a client (the gateway died mid-stream) is refused, not served
# twice; after it the tenant's concurrency slot and KV blocks come back (not after the request TTL).
ORPHAN_RETENTION_S = 120.0


class Orphans(Protocol):
    """Where orphaned requests go (`scheduler.quota.QuotaLedger.orphan`)."""

    async def orphan(self, tenant: str, request_ids: Sequence[str], retention_s: float) -> int: ...


class Placed:
    """The requests one `Calls` stream placed and has not finished: request id → tenant. Every live
    stream of this process counts in `held`, so a request one stream left but another holds (re-placed
    or resumed there) is not orphaned."""

    held: collections.Counter[tuple[str, str]] = collections.Counter()  # (tenant, id) → live streams

    def __init__(self) -> None:
        self._ids: dict[str, str] = {}
        self._closed = False

    def add(self, request_id: str, tenant: str) -> None:
        if self._closed or self._ids.get(request_id) == tenant:
            return  # the stream has ended; or placed again on this stream (a migration): held once
        self.remove(request_id)
        self._ids[request_id] = tenant
        self.held[(tenant, request_id)] += 1

    def remove(self, request_id: str) -> None:
        tenant = self._ids.pop(request_id, None)
        if tenant is not None:
            self._release(tenant, request_id)

    def close(self) -> dict[str, list[str]]:
        """Ends this stream's hold: what it left unfinished, by tenant."""
        self._closed = True
        left: dict[str, list[str]] = {}
        for request_id, tenant in self._ids.items():
            self._release(tenant, request_id)
            left.setdefault(tenant, []).append(request_id)
        self._ids.clear()
        return left

    @classmethod
    def _release(cls, tenant: str, request_id: str) -> None:
        key = (tenant, request_id)
        cls.held[key] -= 1
        if cls.held[key] <= 0:
            del cls.held[key]


_orphaning: set[asyncio.Task[None]] = set()  # the grace periods under way (a task needs a reference)


async def _orphan_later(
    orphans: Orphans, left: dict[str, list[str]], grace_s: float, retention_s: float
) -> None:
    """After ``grace_s``, the requests in ``left`` that no live stream holds again are orphans."""
    await asyncio.sleep(grace_s)
    for tenant, request_ids in left.items():
        ids = [r for r in request_ids if (tenant, r) not in Placed.held]
        if not ids:
            continue
        try:
            changed = await orphans.orphan(tenant, ids, retention_s)
        except Exception as e:  # Redis down: the charges expire with the request TTL, as before
            log.warning("could not release %d orphaned requests of tenant %s: %s", len(ids), tenant, e)
            continue
        log.warning(
            "%d requests of tenant %s were placed by a gateway that is gone (%s): their quota charge "
            "is released in %g s",
            changed,
            tenant,
            ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else ""),
            retention_s,
        )


def store_down(e: RedisError) -> Unavailable:
    return Unavailable(f"the scheduler's state store is unavailable: {e}")


async def unless_store_down(call: Awaitable[T]) -> T:
    """A call's result; a Redis error is raised as `Unavailable` (the caller may retry), never as an
    unknown failure."""
    try:
        return await call
    except RedisError as e:
        raise store_down(e) from e


async def serve_calls(
    batches: AsyncIterator[pb.SchedulerCalls],
    handlers: Mapping[str, Handler],
    orphans: Orphans | None = None,
    orphan_grace_s: float = ORPHAN_GRACE_S,
    orphan_retention_s: float = ORPHAN_RETENTION_S,
) -> AsyncGenerator[pb.SchedulerReplies, None]:
    """A gateway's per-request calls on one stream: each runs as its own task (a Place may wait in
    the fair queue) and is answered when done, in any order; the replies ready when one is sent go
    out together. The stream ends once the client has half-closed it and every call is answered; if
    it breaks, every unanswered call is cancelled (a waiting Place leaves the queue). ``handlers``:
    what each kind of call runs. ``orphans``: where the requests this stream placed and did not
    finish go once it has ended (see the module's doc); None: nowhere (they expire with the TTL)."""
    replies: asyncio.Queue[pb.SchedulerReply | None] = asyncio.Queue()
    running: dict[int, asyncio.Task[None]] = {}
    placed = Placed()

    async def answer(call_id: int, kind: str, request: Message) -> None:
        try:
            result = await handlers[kind](request)
            if isinstance(result, pb.PlaceResponse):
                placed.add(request.request_id, result.tenant)
            elif isinstance(request, pb.FinishRequest):
                placed.remove(request.request_id)
            reply = pb.SchedulerReply(call_id=call_id, **{kind: result})
        except ServingError as e:
            reply = pb.SchedulerReply(call_id=call_id, error=error_to_pb(e))
        except RedisError as e:
            reply = pb.SchedulerReply(call_id=call_id, error=error_to_pb(store_down(e)))
        except Exception:  # a bug must not end the other calls of this gateway
            log.exception("scheduler call %s (%s) failed", call_id, kind)
            reply = pb.SchedulerReply(
                call_id=call_id, error=error_to_pb(ServingError(f"the scheduler failed on {kind}"))
            )
        finally:
            running.pop(call_id, None)
        replies.put_nowait(reply)

    def start(call: pb.SchedulerCall) -> None:
        kind = call.WhichOneof("call")
        if kind == "abandon":
            task = running.get(call.call_id)
            if task is not None:
                task.cancel()
        elif kind is None or call.call_id in running:
            why = "names no call" if kind is None else "reuses the id of a call still running"
            replies.put_nowait(
                pb.SchedulerReply(
                    call_id=call.call_id, error=error_to_pb(InvalidRequest(f"call {call.call_id} {why}"))
                )
            )
        else:
            task = running[call.call_id] = asyncio.create_task(
                answer(call.call_id, kind, getattr(call, kind))
            )
            task.add_done_callback(functools.partial(abandoned, call.call_id))

    def abandoned(call_id: int, task: asyncio.Task[None]) -> None:
        """One reply per call, also for one cancelled (undone on the way out) before or while it ran."""
        if task.cancelled():
            running.pop(call_id, None)
            replies.put_nowait(
                pb.SchedulerReply(
                    call_id=call_id, error=error_to_pb(RequestAborted(f"call {call_id} abandoned"))
                )
            )

    async def read() -> None:
        try:
            async for batch in batches:
                for call in batch.calls:
                    start(call)
            if running:  # half-closed: answer what is running, then end the stream
                await asyncio.wait(list(running.values()))
        finally:
            replies.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (first := await replies.get()) is not None:
            out = pb.SchedulerReplies(replies=[first])
            ended = False
            while not replies.empty():
                more = replies.get_nowait()
                if more is None:
                    ended = True
                    break
                out.replies.append(more)
            yield out
            if ended:
                break
        await reader  # re-raises a failed read (a malformed message) as the stream's error
    finally:
        reader.cancel()
        for task in list(running.values()):
            task.cancel()  # the gateway is gone: a waiting Place leaves the queue, its quota returned
        left = placed.close()
        if left and orphans is not None:
            task = asyncio.get_running_loop().create_task(
                _orphan_later(orphans, left, orphan_grace_s, orphan_retention_s)
            )
            _orphaning.add(task)
            task.add_done_callback(_orphaning.discard)
