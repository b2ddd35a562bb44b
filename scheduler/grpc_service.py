"""`add_servicer`: registers a gRPC servicer so that a request protobuf cannot decode is answered
INVALID_ARGUMENT with protobuf's reason, instead of grpc's UNKNOWN "Unexpected DecodeError".

The generated ``add_*Servicer_to_server`` functions pass each request's bytes to ``FromString``, and
grpc turns the DecodeError of a malformed message (a string field that is not UTF-8, a corrupt wire
format) into UNKNOWN: a bad request reported as a server fault. Here the deserializer hands the
handler a marker instead, and the handler aborts with INVALID_ARGUMENT before the servicer's method
runs; for a request stream, at the message that failed. Used by the scheduler and the workers (it lives
here, the lowest layer that serves gRPC: `core` imports only the standard library); the
gateway, whose clients are outside the cluster, names the offending field too (services.gateway_servicer).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message


class _Undecodable:
    """In place of a request message protobuf refused."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _deserializer(cls: type[Message]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Message | _Undecodable:
        try:
            return cls.FromString(data)
        except (DecodeError, UnicodeDecodeError) as e:  # the latter from the pure-Python backend
            return _Undecodable(f"malformed request: {e}")  # protobuf names the message type

    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, request: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await _refuse(context, request)
        yield request


def _handler(method: MethodDescriptor, behaviour: Callable[..., Any]) -> grpc.RpcMethodHandler:
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    decode, encode = _deserializer(request_cls), response_cls.SerializeToString

    if not method.client_streaming and not method.server_streaming:
        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, request_deserializer=decode,
                                                   response_serializer=encode)
    if not method.client_streaming:
        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await _refuse(context, request)
            async with contextlib.aclosing(behaviour(request, context)) as responses:  # its finally runs now
                async for response in responses:
                    yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, request_deserializer=decode,
                                                    response_serializer=encode)
    if not method.server_streaming:
        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, request_deserializer=decode,
                                                    response_serializer=encode)

    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async with contextlib.aclosing(behaviour(_checked(requests, context), context)) as responses:
            async for response in responses:
                yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, request_deserializer=decode,
                                                 response_serializer=encode)


def add_servicer(servicer: object, server: grpc.aio.Server, service: ServiceDescriptor) -> None:
    """Registers every method of ``service`` on ``servicer`` (its method of the same name), as the
    generated ``add_*Servicer_to_server`` does, with malformed requests answered INVALID_ARGUMENT."""
    handlers = {method.name: _handler(method, getattr(servicer, method.name)) for method in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
