"""The gRPC `baton.v1.Gateway` service: Session (multiplexed), Generate (one stream), Cancel, ListModels.

Proto types stop here (converted by `services.gateway.convert`): requests become `GenerationRequest`s
for the `Dispatcher`, and its events (`Delta`, `Finished`, `ServingError`) become messages again. A
request message protobuf cannot decode (a string field that is not UTF-8) is INVALID_ARGUMENT naming
the field, not grpc's UNKNOWN; what a handler raises becomes the call's status (`rpc.servicer`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import grpc

from baton.v1 import gateway_pb2, gateway_pb2_grpc
from core.errors import CapacityExceeded, ServingError
from rpc.errors import as_serving_error, error_to_pb
from rpc.servicer import Undecodable
from services.gateway.admission import GenerationRequest
from services.gateway.auth import api_key_from_metadata
from services.gateway.choices import Choices
from services.gateway.convert import choices_from_pb, completion_to_pb, delta_to_pb, generation_from_pb
from services.gateway.dispatch import Dispatcher
from services.gateway.openai_api import OpenAICall
from services.gateway.request_stream import Delta, Finished, RequestStream

log = logging.getLogger(__name__)

SESSION_OUTBOX = 64  # responses a Session buffers for its client before its requests' streams back up


def several_choices(dispatcher: Dispatcher, request: GenerationRequest, n: int, api_key: str) -> Choices:
    """A request of ``n`` > 1 choices, run as the HTTP API runs them (services.gateway.choices)."""
    call = OpenAICall(request.messages is not None, (request,), n, n)
    return Choices(dispatcher, call, request.request_id, api_key)


def event_fields(event: Delta | Finished) -> dict[str, object]:
    """A response's event: a delta or the completion."""
    if isinstance(event, Delta):
        return {"delta": delta_to_pb(event)}
    return {"completion": completion_to_pb(event)}


def cancel_reason(context: grpc.aio.ServicerContext) -> str:
    remaining = context.time_remaining()
    return "deadline" if remaining is not None and remaining <= 0 else "client"


class GatewaySession:
    """One Session call: starts and cancels requests by id, fans their events into one outbox.

    At most ``max_requests`` requests run at once in a session; more get RESOURCE_EXHAUSTED. The
    outbox is bounded: a client that stops reading backs up its own requests' streams, which then
    fail alone (see `RequestStream`).
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        max_requests: int,
        time_remaining: Callable[[], float | None],
        api_key: str = "",
    ) -> None:
        self._dispatcher = dispatcher
        self._max_requests = max_requests
        self._api_key = api_key  # the call's: every request of the session is the same tenant's
        self._time_remaining = time_remaining  # the call's deadline applies to each of its requests
        self._outbox: asyncio.Queue[gateway_pb2.SessionResponse | None] = asyncio.Queue(SESSION_OUTBOX)
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[str, Choices] = {}  # requests of n > 1 choices, by request id
        self._pumps: set[asyncio.Task[None]] = set()
        self._reading = True
        self._closed = False

    async def read(self, requests: AsyncIterator[gateway_pb2.SessionRequest | Undecodable]) -> None:
        try:
            async for msg in requests:
                if isinstance(msg, Undecodable):  # that request alone fails; the session goes on
                    await self._send_error(msg.request_id, msg.error)
                    continue
                action = msg.WhichOneof("action")
                if action == "generate":
                    await self._start(msg.generate)
                elif action == "cancel":
                    self._dispatcher.cancel(msg.cancel.request_id, "session")
        finally:
            self._reading = False
            await self._end_if_idle()

    async def responses(self) -> AsyncIterator[gateway_pb2.SessionResponse]:
        while (msg := await self._outbox.get()) is not None:
            yield msg

    def close(self, reason: str) -> None:
        """The call ended: cancel what still runs."""
        self._closed = True
        for stream in list(self._streams.values()):
            stream.cancel(reason)
        for call in list(self._calls.values()):
            call.cancel(reason)
        for pump in self._pumps:
            pump.cancel()

    async def _start(self, msg: gateway_pb2.GenerateRequest) -> None:
        rid = msg.request_id if msg.HasField("request_id") and msg.request_id else uuid.uuid4().hex
        if len(self._streams) + len(self._calls) >= self._max_requests:
            await self._send_error(
                rid,
                CapacityExceeded(
                    f"this session already runs {len(self._streams)} requests, the limit is {self._max_requests}",
                    retry_after_s=1.0,
                ),
            )
            return
        try:
            request = replace(generation_from_pb(msg, self._time_remaining(), self._api_key), request_id=rid)
            n = choices_from_pb(msg)
            if n > 1:
                call = several_choices(self._dispatcher, request, n, self._api_key)
                self._calls[rid] = call
                try:
                    await call.start()
                except BaseException:
                    self._calls.pop(rid, None)
                    await call.close("failed")
                    raise
                run = self._pump_choices(rid, call)
            else:
                stream = self._dispatcher.submit(request)
                self._streams[rid] = stream
                run = self._pump(stream)
        except ServingError as e:
            await self._send_error(rid, e)
            return
        pump = asyncio.get_running_loop().create_task(run)
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)

    async def _pump(self, stream: RequestStream) -> None:
        async def events() -> AsyncIterator[tuple[int, Delta | Finished]]:
            async for event in stream:
                yield 0, event

        async def done() -> None:
            self._streams.pop(stream.request_id, None)

        await self._forward(stream.request_id, events(), done)

    async def _pump_choices(self, rid: str, call: Choices) -> None:
        async def events() -> AsyncIterator[tuple[int, Delta | Finished]]:
            async for choice, event in call.events():
                yield choice.index, event

        async def done() -> None:
            self._calls.pop(rid, None)
            await call.close("failed")  # a no-op for the choices that ended

        await self._forward(rid, events(), done)

    async def _forward(
        self,
        rid: str,
        events: AsyncIterator[tuple[int, Delta | Finished]],
        done: Callable[[], Awaitable[None]],
    ) -> None:
        """One request's events into the outbox, each with its choice's index; its error as its own."""
        try:
            async for index, event in events:
                await self._outbox.put(
                    gateway_pb2.SessionResponse(request_id=rid, index=index, **event_fields(event))
                )
        except ServingError as e:
            await self._send_error(rid, e)
        except Exception as e:  # a bug must not take the other requests of the session down
            await self._send_error(rid, as_serving_error(e))
        finally:
            await done()
            if not self._closed:
                await self._end_if_idle()

    async def _send_error(self, rid: str, error: ServingError) -> None:
        await self._outbox.put(gateway_pb2.SessionResponse(request_id=rid, error=error_to_pb(error)))

    async def _end_if_idle(self) -> None:
        if not self._reading and not self._streams and not self._calls and not self._closed:
            self._closed = True
            await self._outbox.put(None)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """baton.v1.Gateway over the `Dispatcher`."""

    def __init__(self, dispatcher: Dispatcher, max_session_requests: int) -> None:
        self._dispatcher = dispatcher
        self._max_session_requests = max_session_requests

    async def Session(  # noqa: N802 (gRPC method names)
        self,
        request_iterator: AsyncIterator[gateway_pb2.SessionRequest | Undecodable],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[gateway_pb2.SessionResponse]:
        session = GatewaySession(
            self._dispatcher,
            self._max_session_requests,
            context.time_remaining,
            api_key_from_metadata(context.invocation_metadata()),
        )
        reader = asyncio.get_running_loop().create_task(session.read(request_iterator))
        try:
            async for msg in session.responses():
                yield msg
        finally:
            reader.cancel()
            session.close(cancel_reason(context))

    async def Generate(  # noqa: N802
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        key = api_key_from_metadata(context.invocation_metadata())  # (an Undecodable never gets here)
        generation = generation_from_pb(request, context.time_remaining(), key)
        n = choices_from_pb(request)
        if n > 1:
            call = several_choices(self._dispatcher, generation, n, key)
            try:
                await call.start()
                async for choice, event in call.events():
                    yield gateway_pb2.GenerateResponse(
                        request_id=call.id, index=choice.index, **event_fields(event)
                    )
            finally:
                await call.close(cancel_reason(context))
            return
        stream = self._dispatcher.submit(generation)
        rid = stream.request_id
        try:
            async for event in stream:
                if isinstance(event, Delta):
                    yield gateway_pb2.GenerateResponse(request_id=rid, delta=delta_to_pb(event))
                else:
                    yield gateway_pb2.GenerateResponse(request_id=rid, completion=completion_to_pb(event))
        finally:
            stream.cancel(cancel_reason(context))  # a no-op when it has ended

    async def Cancel(  # noqa: N802
        self, request: gateway_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.CancelResponse:
        return gateway_pb2.CancelResponse(found=self._dispatcher.cancel(request.request_id, "cancel_rpc"))

    async def ListModels(  # noqa: N802
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        model = self._dispatcher.model
        return gateway_pb2.ListModelsResponse(
            models=[
                gateway_pb2.Model(name=model.name, version=model.version, max_model_len=model.max_model_len)
            ]
        )
