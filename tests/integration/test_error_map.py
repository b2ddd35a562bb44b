"""The one error map (rpc.errors), across the wire: every `ServingError` class a server raises reaches
the client as the same class with the same message (and a refusal's retry-after), for each of the
three services — gateway, worker, scheduler — on real grpc.aio servers on loopback, registered the
way the product registers them (`rpc.servicer.add_servicer`), over unary and streaming methods. Then
the product's own clients (the gateway's worker and scheduler clients) and the multiplexed streams'
per-request errors (`RequestError`).

The servicers here are stand-ins that raise on request (the error named in the call's metadata): the
map and the wrapper are the product's; the real servers' handlers are tested elsewhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from baton.v1 import gateway_pb2, scheduler_pb2, worker_pb2
from core.errors import CapacityExceeded, ServingError, Unavailable, WorkerLost
from rpc.errors import error_classes, error_from_pb, error_to_pb, from_rpc_error, wire_name
from rpc.servicer import add_servicer
from services.gateway.router import as_seen, scheduler_error
from services.gateway.worker_clients import worker_error

pytestmark = pytest.mark.integration

SERVICES = {
    "gateway": gateway_pb2.DESCRIPTOR.services_by_name["Gateway"],
    "worker": worker_pb2.DESCRIPTOR.services_by_name["Worker"],
    "scheduler": scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"],
}
RAISE_KEY = "x-raise"  # the wire name of the error the stand-in raises
RETRY_AFTER_S = 2.5


def make_error(name: str) -> ServingError:
    cls = error_classes()[name]
    err = cls(f"{cls.__name__} raised by the server: détails ✓")
    if isinstance(err, CapacityExceeded):
        err.retry_after_s = RETRY_AFTER_S
    return err


def _wanted(context: grpc.aio.ServicerContext) -> ServingError:
    meta = dict(context.invocation_metadata() or ())
    return make_error(str(meta[RAISE_KEY]))


class Raiser:
    """Every method of a service, raising the error the call names (a streaming one after one reply)."""

    def __init__(self, service: ServiceDescriptor) -> None:
        for method in service.methods:
            setattr(self, method.name, self._method(method))

    @staticmethod
    def _method(method: MethodDescriptor) -> Any:
        reply = message_factory.GetMessageClass(method.output_type)

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            raise _wanted(context)

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            yield reply()
            raise _wanted(context)

        return streaming if method.server_streaming else unary


async def _serve(service: ServiceDescriptor) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    add_servicer(Raiser(service), server, service)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _call(
    channel: grpc.aio.Channel, service: ServiceDescriptor, method: MethodDescriptor, name: str
) -> grpc.aio.AioRpcError:
    request_cls = message_factory.GetMessageClass(method.input_type)
    reply_cls = message_factory.GetMessageClass(method.output_type)
    path = f"/{service.full_name}/{method.name}"
    kwargs: dict[str, Any] = dict(
        request_serializer=request_cls.SerializeToString, response_deserializer=reply_cls.FromString
    )
    metadata = ((RAISE_KEY, name),)
    try:
        if method.client_streaming:

            async def requests() -> AsyncIterator[Any]:
                yield request_cls()

            if method.server_streaming:
                call = channel.stream_stream(path, **kwargs)(requests(), metadata=metadata, timeout=10)
                _ = [r async for r in call]
            else:
                await channel.stream_unary(path, **kwargs)(requests(), metadata=metadata, timeout=10)
        elif method.server_streaming:
            call = channel.unary_stream(path, **kwargs)(request_cls(), metadata=metadata, timeout=10)
            _ = [r async for r in call]
        else:
            await channel.unary_unary(path, **kwargs)(request_cls(), metadata=metadata, timeout=10)
    except grpc.aio.AioRpcError as e:
        return e
    raise AssertionError(f"{method.name} did not fail")


def _same(got: ServingError, sent: ServingError) -> None:
    assert type(got) is type(sent), f"sent {type(sent).__name__}, got {type(got).__name__}: {got.message}"
    assert got.message == sent.message
    if isinstance(sent, CapacityExceeded):
        assert isinstance(got, CapacityExceeded) and got.retry_after_s == RETRY_AFTER_S


def test_the_map_knows_every_error_class_by_a_unique_wire_name() -> None:
    classes = error_classes()
    assert len(classes) >= 12 and all(wire_name(c) == n for n, c in classes.items())
    assert {"kv_transfer_failed", "context_length_exceeded", "worker_lost", "serving_error"} <= set(classes)


@pytest.mark.parametrize("component", sorted(SERVICES))
def test_every_serving_error_crosses_the_wire_as_the_same_class_and_message(component: str) -> None:
    service = SERVICES[component]

    async def main() -> None:
        server, address = await _serve(service)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                for method in service.methods:
                    for name in error_classes():
                        sent = make_error(name)
                        e = await _call(channel, service, method, name)
                        assert e.code().name == sent.grpc_code, (method.name, name)
                        _same(from_rpc_error(e, address), sent)
                        if component == "worker":  # the gateway's worker client: the same, but a bare
                            got = worker_error(e, address)  # Unavailable means the worker is gone
                            if type(sent) is Unavailable:
                                assert isinstance(got, WorkerLost) and got.address == address
                            else:
                                _same(got, sent)
                        if component == "scheduler":  # the gateway's scheduler client
                            got = scheduler_error(e, address)
                            if isinstance(sent, Unavailable) or type(sent) is ServingError:
                                assert type(got) is Unavailable and address in got.message
                            else:
                                _same(got, sent)
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_a_request_error_inside_a_multiplexed_stream_keeps_its_class() -> None:
    for name in error_classes():
        sent = make_error(name)
        got = error_from_pb(type(error_to_pb(sent)).FromString(error_to_pb(sent).SerializeToString()))
        _same(got, sent)
        seen = as_seen(got, "s:1")  # as the gateway's Calls stream reads a scheduler's reply
        assert type(seen) is (
            Unavailable if isinstance(sent, Unavailable) or type(sent) is ServingError else type(sent)
        )


def test_a_status_without_a_type_maps_by_its_code_alone() -> None:
    """grpc's own statuses (a peer that cannot be reached, a deadline) carry no type."""

    async def main() -> None:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:  # nothing listens on port 1
            stub = channel.unary_unary(
                "/baton.v1.Worker/Info", request_serializer=lambda m: b"", response_deserializer=lambda b: b
            )
            try:
                await stub(b"", timeout=5)
            except grpc.aio.AioRpcError as e:
                assert type(from_rpc_error(e)) is Unavailable
                assert isinstance(worker_error(e, "127.0.0.1:1"), WorkerLost)
            else:
                raise AssertionError("a call to a closed port succeeded")

    asyncio.run(main())
