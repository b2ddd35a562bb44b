"""Proto ↔ the gateway's own types, at its edges: the Gateway service's requests and responses
(`generation_from_pb`, `delta_to_pb`, `completion_to_pb`), the workers' token deltas (`delta_from_pb`),
and a request protobuf refuses, read once more to name the field at fault (`lenient_deserializer`).
The dispatcher, the shadow path and the HTTP API never see a proto type."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from baton.v1 import common_pb2, gateway_pb2
from core.errors import InvalidRequest
from rpc.convert import FINISH_TO_PB, sampling_from_pb
from rpc.servicer import Undecodable
from services.gateway.admission import GenerationRequest
from services.gateway.openai_api import MAX_N
from services.gateway.request_stream import Delta, Finished, TokenLogprob


def generation_from_pb(
    msg: gateway_pb2.GenerateRequest, timeout_s: float | None, api_key: str = ""
) -> GenerationRequest:
    """A GenerateRequest as the Dispatcher's input; InvalidRequest for bad sampling values."""
    which = msg.WhichOneof("input")
    if which is None:
        raise InvalidRequest("the request needs one of prompt, prompt_token_ids or messages")
    messages = None
    if which == "messages":
        messages = tuple({"role": m.role, "content": m.content} for m in msg.messages.messages)
    return GenerationRequest(
        params=sampling_from_pb(msg.sampling),
        prompt=msg.prompt if which == "prompt" else None,
        prompt_token_ids=tuple(msg.prompt_token_ids.ids) if which == "prompt_token_ids" else None,
        messages=messages,
        request_id=msg.request_id if msg.HasField("request_id") and msg.request_id else None,
        model=msg.model,
        timeout_s=timeout_s,
        api="grpc",
        api_key=api_key,
    )


def choices_from_pb(msg: gateway_pb2.GenerateRequest) -> int:
    """The request's ``n``, checked (the HTTP API's cap)."""
    n = msg.n if msg.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be an integer in [1, {MAX_N}], got {n}")
    return n


def delta_to_pb(delta: Delta) -> common_pb2.TokenDelta:
    msg = common_pb2.TokenDelta(token_ids=delta.token_ids, text=delta.text)
    for field, entries in ((msg.logprobs, delta.logprobs), (msg.prompt_logprobs, delta.prompt_logprobs)):
        for lp in entries or ():
            field.append(common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=lp.top))
    return msg


def delta_from_pb(msg: common_pb2.TokenDelta) -> Delta:
    logprobs = [TokenLogprob(lp.token_id, lp.logprob, dict(lp.top)) for lp in msg.logprobs]
    prompt = [TokenLogprob(lp.token_id, lp.logprob, dict(lp.top)) for lp in msg.prompt_logprobs]
    return Delta(list(msg.token_ids), msg.text, logprobs, prompt or None)


def completion_to_pb(finished: Finished) -> gateway_pb2.Completion:
    u, t = finished.usage, finished.timings
    return gateway_pb2.Completion(
        finish_reason=FINISH_TO_PB[finished.finish_reason],
        usage=common_pb2.Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            cached_tokens=u.cached_tokens,
        ),
        timings=common_pb2.Timings(
            queue_ms=t.queue_ms,
            prefill_ms=t.prefill_ms,
            transfer_ms=t.transfer_ms,
            decode_ms=t.decode_ms,
            ttft_ms=t.ttft_ms,
            e2e_ms=t.e2e_ms,
        ),
        stop_reason=finished.stop_reason,
    )


def _strings_as_bytes(message: descriptor_pb2.DescriptorProto) -> None:
    for f in message.field:
        if f.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
            f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
    for nested in message.nested_type:
        _strings_as_bytes(nested)


def _bytes_twins() -> descriptor_pool.DescriptorPool:
    """The request types with every string field turned into bytes: they parse what the real ones
    refuse, so an error can name the field at fault and the request id."""
    pool = descriptor_pool.DescriptorPool()
    for file in (common_pb2.DESCRIPTOR, gateway_pb2.DESCRIPTOR):
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        for message in proto.message_type:
            _strings_as_bytes(message)
        pool.Add(proto)
    return pool


_TWINS = _bytes_twins()


def _bad_strings(twin: Message, real: Descriptor, path: str = "") -> Iterator[tuple[str, UnicodeDecodeError]]:
    """(field path, error) of each string that is not UTF-8, walking the twin alongside the real type."""
    for field, value in twin.ListFields():
        spec = real.fields_by_name[field.name]
        values = list(value) if field.is_repeated else [value]
        for i, v in enumerate(values):
            name = f"{path}{field.name}" + (f"[{i}]" if field.is_repeated else "")
            if spec.type == FieldDescriptor.TYPE_STRING:
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield name, e
            elif spec.type == FieldDescriptor.TYPE_MESSAGE and not spec.message_type.GetOptions().map_entry:
                yield from _bad_strings(v, spec.message_type, name + ".")


def _undecodable(cls: type[Message], data: bytes, error: DecodeError) -> Undecodable:
    name = cls.DESCRIPTOR.full_name
    try:
        twin = message_factory.GetMessageClass(_TWINS.FindMessageTypeByName(name)).FromString(data)
    except DecodeError:
        return Undecodable(InvalidRequest(f"the request is not a valid {name} message: {error}"))
    bad = list(_bad_strings(twin, cls.DESCRIPTOR))
    if not bad:
        return Undecodable(InvalidRequest(f"the request is not a valid {name} message: {error}"))
    field, e = bad[0]
    message = (
        f"{field} is not valid UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start}); protobuf "
        "strings must be UTF-8 text (send token ids as prompt_token_ids)"
    )
    return Undecodable(InvalidRequest(message), _request_id(twin))


def _request_id(twin: Message) -> str:
    """The request id of a twin GenerateRequest, CancelRequest or SessionRequest, if it is text."""
    holder: Any = twin
    if twin.DESCRIPTOR.name == "SessionRequest":
        action = twin.WhichOneof("action")
        holder = getattr(twin, action) if action else None
    try:
        return str(getattr(holder, "request_id", b"").decode("utf-8"))
    except UnicodeDecodeError:
        return ""


def lenient_deserializer(cls: type[Message]) -> Callable[[bytes], Any]:
    """``cls.FromString``, but a message protobuf refuses becomes an `Undecodable`."""

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return _undecodable(cls, data, e)

    return deserialize
