"""The gateway's admission checks and its lenient gRPC decoding, without servers (services.gateway.admission,
services.gateway.servicer): text that is not Unicode, empty chats, request ids, undecodable messages."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import pytest

from baton.v1 import common_pb2, gateway_pb2
from core.errors import ContextLengthExceeded, InvalidRequest
from core.sampling_params import SamplingParams
from rpc.servicer import Undecodable
from services.gateway.admission import (
    GenerationRequest,
    Limits,
    ModelInfo,
    RequestValidator,
    check_unicode,
    request_id_problem,
)
from services.gateway.convert import lenient_deserializer

pytestmark = pytest.mark.unit


class FakeTokenizer:
    knows_tools = False  # its chat template does not render tools (services.gateway.tools renders them)

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def encode_chat(self, messages: list[dict[str, str]], tools: object = None) -> list[int]:
        assert tools is None
        return [1] + [t for m in messages for t in self.encode(m["content"])]


def validator(max_model_len: int = 64) -> RequestValidator:
    return RequestValidator(
        cast(Any, FakeTokenizer()),
        ModelInfo("m", "v1", max_model_len, 128),
        Limits(None, 32, 100),
        ThreadPoolExecutor(1),
    )


def test_text_that_is_not_unicode_is_refused_by_name() -> None:
    check_unicode("prompt", "héllo ✓")
    with pytest.raises(
        InvalidRequest, match=r"prompt is not valid Unicode: an unpaired surrogate U\+D800 at character 1"
    ):
        check_unicode("prompt", "a\ud800b")
    v = validator()
    with pytest.raises(InvalidRequest, match="prompt is not valid Unicode"):
        v.tokenize(GenerationRequest(SamplingParams(), prompt="x\udfffy"))
    chat = ({"role": "user", "content": "ok"}, {"role": "user", "content": "\ud83d"})
    with pytest.raises(InvalidRequest, match=r"messages\[1\].content is not valid Unicode"):
        v.tokenize(GenerationRequest(SamplingParams(), messages=chat))


def test_chats_need_messages_with_roles() -> None:
    v = validator()
    with pytest.raises(InvalidRequest, match="messages must not be empty"):
        v.tokenize(GenerationRequest(SamplingParams(), messages=()))
    with pytest.raises(InvalidRequest, match=r"messages\[0\].role must be a non-empty string"):
        v.tokenize(GenerationRequest(SamplingParams(), messages=({"role": "", "content": "hi"},)))
    assert v.tokenize(GenerationRequest(SamplingParams(), messages=({"role": "user", "content": "hi"},))) == [
        1,
        4,
        5,
    ]


def test_limits_fill_and_seed() -> None:
    v = validator()
    params = v.check_limits(10, GenerationRequest(SamplingParams(max_tokens=4)))
    assert params.seed is not None and params.max_tokens == 4  # seeded by the gateway
    assert (
        v.check_limits(40, GenerationRequest(SamplingParams(), max_tokens_to_context=True)).max_tokens == 24
    )
    with pytest.raises(ContextLengthExceeded):
        v.check_limits(60, GenerationRequest(SamplingParams(max_tokens=8)))
    assert request_id_problem("abc-1") is None and request_id_problem("a b") is not None


def test_undecodable_grpc_messages_name_the_field_and_keep_the_request_id() -> None:
    generate = gateway_pb2.GenerateRequest(
        request_id="r1", prompt="AAAA", sampling=common_pb2.SamplingParams(stop=["ZZ"])
    )
    decode = lenient_deserializer(gateway_pb2.GenerateRequest)
    assert decode(generate.SerializeToString()) == generate
    bad = decode(generate.SerializeToString().replace(b"AAAA", b"A\xff\xfeA"))
    assert isinstance(bad, Undecodable) and bad.request_id == "r1"
    assert bad.error.message.startswith("prompt is not valid UTF-8 (byte 0xff at offset 1)")
    bad = decode(generate.SerializeToString().replace(b"ZZ", b"Z\xc3"))
    assert isinstance(bad, Undecodable) and "sampling.stop[0] is not valid UTF-8" in bad.error.message
    garbage = decode(b"\xff\xff\xff")
    assert isinstance(garbage, Undecodable) and garbage.request_id == ""
    assert "not a valid baton.v1.GenerateRequest message" in garbage.error.message

    chat = gateway_pb2.SessionRequest(
        generate=gateway_pb2.GenerateRequest(
            request_id="r2",
            messages=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="QQ")]),
        )
    )
    bad = lenient_deserializer(gateway_pb2.SessionRequest)(chat.SerializeToString().replace(b"QQ", b"\x80Q"))
    assert isinstance(bad, Undecodable) and bad.request_id == "r2"
    assert "generate.messages.messages[0].content is not valid UTF-8" in bad.error.message
    cancel = gateway_pb2.CancelRequest(request_id="XX").SerializeToString().replace(b"XX", b"X\xff")
    bad = lenient_deserializer(gateway_pb2.CancelRequest)(cancel)
    assert (
        isinstance(bad, Undecodable)
        and bad.request_id == ""
        and "request_id is not valid" in bad.error.message
    )
