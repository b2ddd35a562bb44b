"""services.gateway.tools: tools and tool_choice checked, the grammar that enforces required and named
calls, the prompt for a template without tools, and the model's output parsed into tool_calls —
whole and as stream deltas."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from core.errors import InvalidRequest
from services.gateway.tools import Tools, ToolStream, parse_output, parse_tools, prompt_messages

pytestmark = pytest.mark.unit

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def tools(choice: Any = None, **kw: Any) -> Tools:
    parsed = parse_tools({"tools": [WEATHER, TIME], "tool_choice": choice, **kw})
    assert parsed is not None
    return parsed


def test_tool_choice_forms() -> None:
    assert tools().choice == "auto" and tools("auto").choice == "auto"
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "auto"}) is None
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    assert (named.choice, named.named) == ("named", "get_weather")
    assert tools("required", parallel_tool_calls=False).parallel is False
    assert tools().functions[1]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"tools": "x"}, "tools must be a list"),
        ({"tools": [WEATHER] * 129}, "at most 128"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0] must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name must be"),
        ({"tools": [WEATHER, WEATHER]}, "is used twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "JSON schema object",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not one of",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be a boolean"),
    ],
)
def test_bad_tools(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_tools(fields)
    assert needle in info.value.message


def test_required_and_named_grammars_accept_exactly_the_calls() -> None:
    required = tools("required").constraint()
    assert required is not None and required.kind == "json"
    schema = json.loads(required.spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    jsonschema.validate(
        [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "x"}}], schema
    )
    for bad in ([], [{"name": "other", "parameters": {}}], [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tools("required", parallel_tool_calls=False).constraint().spec)  # type: ignore[union-attr]
    assert single["maxItems"] == 1
    named = tools({"type": "function", "function": {"name": "get_weather"}}).constraint()
    assert named is not None and json.loads(named.spec) == WEATHER["function"]["parameters"]  # type: ignore[index]
    assert tools("auto").constraint() is None


def test_outputs_become_tool_calls() -> None:
    required = parse_output(tools("required"), '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert required[0] is None and [(c.name, json.loads(c.arguments)) for c in required[1]] == [
        ("get_weather", {"city": "Oslo"})
    ]
    named = parse_output(tools({"type": "function", "function": {"name": "get_time"}}), "{}")
    assert named[1][0].name == "get_time" and named[1][0].arguments == "{}"
    auto = tools()
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    content, calls = parse_output(auto, text)
    assert content == "Let me look." and calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    bare = parse_output(auto, '{"name": "get_time", "parameters": {}}')
    assert bare[0] is None and bare[1][0].name == "get_time"
    assert parse_output(auto, "Just text.") == ("Just text.", [])
    assert parse_output(auto, "<tool_call>{broken</tool_call>")[1] == []  # not a call: all content


def feed_all(stream: ToolStream, pieces: list[str]) -> list[dict[str, Any]]:
    out = [d for p in pieces for d in stream.feed(p)]
    held, _ = stream.finish()
    return out + held


def test_stream_deltas() -> None:
    named = feed_all(
        ToolStream(tools({"type": "function", "function": {"name": "get_weather"}})), ['{"ci', 'ty":"x"}']
    )
    assert named[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in named[1:]) == '{"city":"x"}'
    auto = ToolStream(tools())
    pieces = [
        "Checking ",
        "the weather. <tool",
        '_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
    ]
    deltas = feed_all(auto, pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Checking the weather. "  # the text before the call streamed, the call held whole
    assert deltas[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
    plain = feed_all(ToolStream(tools()), ["Hello", " there"])
    assert "".join(d["content"] for d in plain) == "Hello there"


def test_prompt_for_a_template_without_tools() -> None:
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
    ]
    messages, rendered = prompt_messages(history, tools(), template_knows_tools=False)
    assert rendered is None and messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"].startswith("<tool_call>") and "Oslo" in messages[2]["content"]
    assert messages[3] == {"role": "tool", "content": "12 C"}
    same, given = prompt_messages(history, tools(), template_knows_tools=True)
    assert same == history and given is not None and given[0]["function"]["name"] == "get_weather"
