"""`add_servicer`: registers a gRPC servicer the way every Baton server does. Its handlers just raise:

- a `ServingError` a handler raises (also from inside a response stream) ends the call with that
  error's status and type (`rpc.errors.abort_with`); any other exception ends it INTERNAL with a
  generic message, the traceback in the log;
- a request protobuf cannot decode is answered INVALID_ARGUMENT with protobuf's reason, instead of
  grpc's UNKNOWN "Unexpected DecodeError".

The generated ``add_*Servicer_to_server`` functions pass each request's bytes to ``FromString``, and
grpc turns the DecodeError of a malformed message (a string field that is not UTF-8, a corrupt wire
format) into UNKNOWN: a bad request reported as a server fault. Here the deserializer hands the
handler a marker instead, and the handler aborts with INVALID_ARGUMENT before the servicer's method
runs; for a request stream, at the message that failed. The gateway, whose clients are outside the
cluster, also names the offending field (services.gateway.servicer).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from core.errors import InvalidRequest
from rpc.errors import abort_with


@dataclass(frozen=True, slots=True)
class Undecodable:
    """In place of a request message protobuf refused: the error to answer with, and the request id
    when it could still be read (a Session answers that request alone)."""

    error: InvalidRequest
    request_id: str = ""


Deserializer = Callable[[type[Message]], Callable[[bytes], Any]]


def strict_deserializer(cls: type[Message]) -> Callable[[bytes], Any]:
    """``cls.FromString``, but a message protobuf refuses becomes an `Undecodable` with its reason."""

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except (DecodeError, UnicodeDecodeError) as e:  # the latter from the pure-Python backend
            return Undecodable(InvalidRequest(f"malformed request: {e}"))  # protobuf names the message type

    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, request: Undecodable) -> None:
    await abort_with(context, request.error)


async def _ended_by(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """A handler's exception as the call's status (raises). An abort already under way passes."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    await abort_with(context, exc)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        yield request


def _handler(
    method: MethodDescriptor,
    behaviour: Callable[..., Any],
    deserializer: Deserializer,
    pass_undecodable: bool,
) -> grpc.RpcMethodHandler:
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    decode, encode = deserializer(request_cls), response_cls.SerializeToString

    def checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        return requests if pass_undecodable else _checked(requests, context)

    if not method.client_streaming and not method.server_streaming:

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            try:
                return await behaviour(request, context)
            except Exception as e:
                await _ended_by(context, e)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, request_deserializer=decode, response_serializer=encode
        )
    if not method.client_streaming:

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(context, request)
            try:
                async with contextlib.aclosing(
                    behaviour(request, context)
                ) as responses:  # its finally runs now
                    async for response in responses:
                        yield response
            except Exception as e:
                await _ended_by(context, e)

        return grpc.unary_stream_rpc_method_handler(
            unary_stream, request_deserializer=decode, response_serializer=encode
        )
    if not method.server_streaming:

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behaviour(checked(requests, context), context)
            except Exception as e:
                await _ended_by(context, e)

        return grpc.stream_unary_rpc_method_handler(
            stream_unary, request_deserializer=decode, response_serializer=encode
        )

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        try:
            async with contextlib.aclosing(behaviour(checked(requests, context), context)) as responses:
                async for response in responses:
                    yield response
        except Exception as e:
            await _ended_by(context, e)

    return grpc.stream_stream_rpc_method_handler(
        stream_stream, request_deserializer=decode, response_serializer=encode
    )


def add_servicer(
    servicer: object,
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    deserializer: Deserializer = strict_deserializer,
    pass_undecodable: bool = False,
) -> None:
    """Registers every method of ``service`` on ``servicer`` (its method of the same name), as the
    generated ``add_*Servicer_to_server`` does, with errors and malformed requests answered as above.
    ``deserializer``: how a request's bytes become a message or an `Undecodable` (the gateway names
    the field at fault); ``pass_undecodable``: a request *stream* hands its `Undecodable` messages to
    the servicer (which may fail that request alone) instead of ending the call."""
    handlers = {
        method.name: _handler(method, getattr(servicer, method.name), deserializer, pass_undecodable)
        for method in service.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
