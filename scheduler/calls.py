"""The gateway's per-request calls — `Place`, `Finish`, `ReportLease`, `Cancel` — on one `Calls`
stream (`serve_calls`), and how such a call's error is answered: a unary call raises it (Redis errors
as `Unavailable`, `unless_store_down`) and `rpc.servicer.add_servicer` ends the call with its status;
on the stream it is that call's `RequestError` (`rpc.errors.error_to_pb`), and the stream goes on."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from google.protobuf.message import Message
from redis.exceptions import RedisError

from baton.v1 import scheduler_pb2 as pb
from core.errors import InvalidRequest, RequestAborted, ServingError, Unavailable
from rpc.errors import error_to_pb

log = logging.getLogger(__name__)

T = TypeVar("T")

Handler = Callable[[Any], Awaitable[Message]]  # a call's request → its reply (the unary call's own code)


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
    batches: AsyncIterator[pb.SchedulerCalls], handlers: Mapping[str, Handler]
) -> AsyncGenerator[pb.SchedulerReplies, None]:
    """A gateway's per-request calls on one stream: each runs as its own task (a Place may wait in
    the fair queue) and is answered when done, in any order; the replies ready when one is sent go
    out together. The stream ends once the client has half-closed it and every call is answered; if
    it breaks, every unanswered call is cancelled (a waiting Place leaves the queue). ``handlers``:
    what each kind of call runs."""
    replies: asyncio.Queue[pb.SchedulerReply | None] = asyncio.Queue()
    running: dict[int, asyncio.Task[None]] = {}

    async def answer(call_id: int, kind: str, request: Message) -> None:
        try:
            reply = pb.SchedulerReply(call_id=call_id, **{kind: await handlers[kind](request)})
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
