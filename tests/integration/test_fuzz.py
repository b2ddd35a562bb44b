"""Fuzzing the gateway's two public surfaces, against a real gateway in front of a real prefill and
decode worker (tiny model, tcp KV transport; each prompt of 2+ tokens is prefilled, handed over and
decoded):

* **HTTP**: schemathesis — run as its users run it, its CLI against our ``/openapi.json`` — generates
  positive and negative requests for every operation; no answer is a 5xx, every answer conforms to the
  description (status, content type, body: the OpenAI error body for every 4xx), and a request that
  breaks the schema is refused.
* **gRPC**: hypothesis builds `GenerateRequest` messages from the proto descriptors (every field of
  every type, nested messages, oneofs, out-of-range numbers, odd strings) and mangles their bytes
  (truncated, bit-flipped, appended garbage); every call ends OK or with a client error status, never
  UNKNOWN or INTERNAL.

After each, both workers hold no block, lease or request, and the gateway answers health.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from harness import GatewayThread, WorkerProcess, running_workers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.v1 import gateway_pb2
from services.gateway.server import GatewayConfig

pytestmark = pytest.mark.integration

MAX_OUTPUT_TOKENS = 8  # the fuzzed gateway's limit: a valid request generates a few tokens at most
CLIENT_ERRORS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.OUT_OF_RANGE,
}


@pytest.fixture(scope="module")
def fuzzed(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayThread, list[WorkerProcess]]]:
    with running_workers(
        tiny_llama, tmp_path_factory.mktemp("fuzz"), "prefill", "decode", flags=("--kv-transport", "tcp")
    ) as workers:
        config = GatewayConfig(
            model=str(tiny_llama),
            grpc_port=0,
            http_port=0,
            prefill_workers=(workers[0].address,),
            decode_workers=(workers[1].address,),
            local_prefill_threshold=2,
            max_output_tokens=MAX_OUTPUT_TOKENS,
            max_request_bytes=256 << 10,
            startup_timeout=60,
        )
        with GatewayThread(config) as gw:
            yield gw, workers


def _settled(gw: GatewayThread, workers: list[WorkerProcess]) -> None:
    from harness import http_json

    for worker in workers:
        worker.wait_all_free(30)
    assert http_json(gw, "/health")[0] == 200


def test_schemathesis_finds_no_server_error_and_no_answer_off_the_description(
    fuzzed: tuple[GatewayThread, list[WorkerProcess]], tmp_path: Path
) -> None:
    gw, workers = fuzzed
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{gw.url}/openapi.json",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance,negative_data_rejection",
        "--mode",
        "all",
        "--max-examples",
        "40",
        "--seed",
        "20261202",
        "--generation-allow-x00",
        "false",
        "--request-timeout",
        "60",
        "--workers",
        "1",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    generated = re.search(r"(\d+) generated", run.stdout)
    print(f"schemathesis: {generated.group(1) if generated else '?'} cases generated, no failure")
    assert "createCompletion" in run.stdout or "/v1/completions" in run.stdout, run.stdout[-3000:]
    _settled(gw, workers)


# --- gRPC: messages from the descriptors -----------------------------------------------------------

_INTS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INTS:
        low, high = _INTS[kind]
        # Mostly small values (the ones with meaning), sometimes the extremes.
        return st.one_of(st.integers(-3, 40).filter(lambda v: low <= v <= high), st.integers(low, high))
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return st.floats(
            allow_nan=True, allow_infinity=True, width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64
        )
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return st.text(max_size=40)
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if kind == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values] + [99])
    raise AssertionError(f"no strategy for field type {kind}")


def message_dicts(
    descriptor: Descriptor, depth: int = 0, max_fields: int | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    """Field name → value for a message of ``descriptor``: any subset of its fields (at most
    ``max_fields``; one member of each oneof), nested messages up to three levels."""
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3 or field.message_type.GetOptions().map_entry:
                continue
            value: st.SearchStrategy[Any] = message_dicts(field.message_type, depth + 1, max_fields)
        else:
            value = _scalar(field)
        if field.is_repeated:
            value = st.lists(value, max_size=6)
        fields[field.name] = value
    oneofs = {f.name: o.name for o in descriptor.oneofs for f in o.fields}

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        most = len(fields) if max_fields is None else min(max_fields, len(fields))
        chosen = draw(st.sets(st.sampled_from(sorted(fields)), max_size=most)) if fields else set()
        seen: set[str] = set()
        out = {}
        for name in sorted(chosen):
            group = oneofs.get(name)
            if group is not None and group in seen:
                continue
            if group is not None:
                seen.add(group)
            out[name] = draw(fields[name])
        return out

    return build()


def _message(cls: Any, values: dict[str, Any]) -> Any:
    msg = cls()
    for name, value in values.items():
        field = cls.DESCRIPTOR.fields_by_name[name]
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = message_factory.GetMessageClass(field.message_type)
            if field.is_repeated:
                getattr(msg, name).extend(_message(sub, v) for v in value)
            else:
                getattr(msg, name).CopyFrom(_message(sub, value))
        elif field.is_repeated:
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


VALID = {"prompt": "The quick brown fox", "sampling": {"max_tokens": 4, "temperature": 0.0}}


def _merged(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in changes.items():
        out[name] = (
            _merged(out[name], value)
            if isinstance(value, dict) and isinstance(out.get(name), dict)
            else value
        )
    return out


@st.composite
def wire_requests(draw: st.DrawFn) -> bytes:
    """A GenerateRequest from the descriptors — entirely random, or a valid one with a few fields
    changed, so that the deep path (placement, prefill, handoff, decode) is fuzzed too — serialized,
    and sometimes mangled."""
    descriptor = gateway_pb2.GenerateRequest.DESCRIPTOR
    if draw(st.booleans()):
        values = draw(message_dicts(descriptor))
    else:
        values = _merged(VALID, draw(message_dicts(descriptor, max_fields=2)))
        if "prompt_token_ids" in values or "messages" in values:
            values.pop("prompt", None)  # one member of the input oneof
    data = _message(gateway_pb2.GenerateRequest, values).SerializeToString()
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip", "append"]))
    if damage == "truncate" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :]
    elif damage == "append":
        data += draw(st.binary(min_size=1, max_size=20))
    return data


def test_random_grpc_messages_from_the_descriptors_get_a_client_status_never_a_server_fault(
    fuzzed: tuple[GatewayThread, list[WorkerProcess]],
) -> None:
    gw, workers = fuzzed
    call = gw.channel.unary_stream(
        "/baton.v1.Gateway/Generate",
        request_serializer=lambda b: b,
        response_deserializer=gateway_pb2.GenerateResponse.FromString,
    )
    seen: dict[grpc.StatusCode, int] = {}

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(wire_requests())
    def one(data: bytes) -> None:
        try:
            list(call(data, timeout=60))  # read the stream to its end
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
            assert code in CLIENT_ERRORS, (code, e.details(), data)
        seen[code] = seen.get(code, 0) + 1

    one()
    print(
        "grpc fuzz: " + ", ".join(f"{code.name} {n}" for code, n in sorted(seen.items(), key=lambda x: -x[1]))
    )
    assert seen.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 0 and seen.get(grpc.StatusCode.OK, 0) > 0, seen
    _settled(gw, workers)
