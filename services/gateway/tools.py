"""Tool calls on /v1/chat/completions: ``tools`` and ``tool_choice`` (``none``, ``auto``, ``required``, a
named function) parsed and checked; the tools put in the prompt; the model's output turned into
``tool_calls`` — whole, or as stream deltas.

* **The prompt.** A chat template that knows tools (it reads a ``tools`` variable: Qwen2.5, Llama 3.1,
  Mistral's) renders them itself, with the conversation's earlier calls and results. For one that does
  not (SmolLM2, ChatML without tools) Baton writes the tools into a system message of its own and the
  earlier calls into the assistant turns, in the ``<tool_call>`` JSON form it then parses.
* **required / named** are enforced through the grammar engine (engine.structured): the output is held
  to a JSON array of ``{"name", "parameters"}`` objects, one per call, whose ``parameters`` follow that
  tool's schema (``required``; one item at most with ``parallel_tool_calls: false``), or to the named
  tool's parameters alone. Such an output always parses.
* **auto** leaves the model free; its output is searched for ``<tool_call>{"name", "arguments"}``
  blocks, or is one bare ``{"name", "parameters"|"arguments"}`` object (Llama 3's form). Text outside
  the calls is the message's content; nothing that parses leaves the whole output as content.
* **Streaming**: a named call's arguments stream as they are generated; ``required`` and ``auto`` hold
  back what may be a call and send each call whole once it is complete (text that cannot be a call
  streams as content at once).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.errors import InvalidRequest
from core.sampling_params import StructuredOutput
from services.gateway.structured import check_depth

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
CALL_OPEN = "<tool_call>"


@dataclass(frozen=True, slots=True)
class Tools:
    """A chat request's tools and how it may use them."""

    functions: tuple[dict[str, Any], ...]  # each {"name", "description", "parameters"}
    choice: str  # auto | required | named
    named: str | None = None
    parallel: bool = True

    def constraint(self) -> StructuredOutput | None:
        """The grammar that enforces ``required`` or a named tool (None for ``auto``)."""
        if self.choice == "named":
            fn = next(f for f in self.functions if f["name"] == self.named)
            return StructuredOutput("json", json.dumps(fn["parameters"], ensure_ascii=False))
        if self.choice != "required":
            return None
        call_schemas = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "parameters": f["parameters"]},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for f in self.functions
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call_schemas}}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", json.dumps(schema, ensure_ascii=False))

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates take them (OpenAI's form)."""
        return [{"type": "function", "function": f} for f in self.functions]


def parse_tools(fields: Mapping[str, Any]) -> Tools | None:
    """The request's tools (None: no tools, or ``tool_choice: "none"``); InvalidRequest naming what is
    wrong."""
    tools, choice = fields.get("tools"), fields.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} function tools")
    functions: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}')
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . or -")
        if any(f["name"] == name for f in functions):
            raise InvalidRequest(f"tools[{i}].function.name {name!r} is used twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        check_depth(params, f"tools[{i}].function.parameters")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise InvalidRequest(f"tools[{i}].function.description must be a string")
        functions.append({"name": name, "description": description, "parameters": params})
    parallel = fields.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequest(f"parallel_tool_calls must be a boolean, got {parallel!r}")
    if choice is None or choice == "auto":
        return Tools(tuple(functions), "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(tuple(functions), "required", parallel=parallel)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(named, str):
        raise InvalidRequest(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if not any(f["name"] == named for f in functions):
        raise InvalidRequest(f"tool_choice names {named!r}, which is not one of the tools")
    return Tools(tuple(functions), "named", named, parallel)


# --- the prompt ------------------------------------------------------------------------------------


def parse_tool_message_fields(i: int, m: Mapping[str, Any], message: dict[str, Any]) -> None:
    """A message's ``tool_calls`` (assistant) and ``tool_call_id`` (tool), checked, into ``message``;
    arguments as objects, as chat templates take them."""
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise InvalidRequest(f"messages[{i}].tool_calls must be a list")
        parsed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequest(f"messages[{i}].tool_calls[{j}] must have a function with a name")
            arguments = fn.get("arguments", "{}")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments or "{}")
                except ValueError:
                    raise InvalidRequest(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON"
                    ) from None
            parsed.append(
                {
                    "id": str(call.get("id", "")),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments},
                }
            )
        message["tool_calls"] = parsed
    if m.get("tool_call_id") is not None:
        if not isinstance(m["tool_call_id"], str):
            raise InvalidRequest(f"messages[{i}].tool_call_id must be a string")
        message["tool_call_id"] = m["tool_call_id"]


def prompt_messages(
    messages: Sequence[Mapping[str, Any]], tools: Tools | None, template_knows_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to render. A template that knows tools gets both as they are; for one
    that does not, the tools become a system message and earlier calls become assistant text, in the
    form the output is parsed in."""
    if template_knows_tools:
        return [dict(m) for m in messages], tools.template_tools() if tools is not None else None
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "\n".join(
                f"{CALL_OPEN}\n"
                + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                + "\n</tool_call>"
                for c in calls
            )
            m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m.get("content") is None:
            m["content"] = ""
        m.pop("tool_call_id", None)
        out.append(m)
    if tools is not None:
        listing = "\n".join(json.dumps({"type": "function", "function": f}) for f in tools.functions)
        text = (
            "You can call functions to answer. Their signatures, one JSON object per line:\n"
            f"<tools>\n{listing}\n</tools>\n"
            "To call one, answer with a JSON object holding its name and its arguments, between tags:\n"
            f'{CALL_OPEN}\n{{"name": "the function", "arguments": {{...}}}}\n</tool_call>'
        )
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


# --- the output ------------------------------------------------------------------------------------


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def json(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def parse_output(tools: Tools, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output."""
    if tools.choice == "named":
        assert tools.named is not None
        return None, [ToolCall(tools.named, text)]
    if tools.choice == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut at max_tokens: not a whole array
        return None, [
            ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items
        ]
    calls: list[ToolCall] = []
    for block in _CALL_BLOCK.findall(text):
        call = _call_object(block)
        if call is None:
            return text, []
        calls.append(call)
    if calls:
        content = _CALL_BLOCK.sub("", text).strip()
        return content or None, calls
    bare = _call_object(text.strip()) if text.strip().startswith("{") else None
    return (None, [bare]) if bare is not None else (text, [])


def _call_object(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolStream:
    """One choice's stream under tools: text in, chat deltas out."""

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self._text = ""
        self._sent = 0  # characters of _text sent as content (auto) or arguments (named)
        self._named_call: ToolCall | None = None
        self._holding = False  # auto: what may be a call is held back until the end

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas to send now for ``text``, the output's next piece."""
        self._text += text
        if self.tools.choice == "named":
            deltas = []
            if self._named_call is None:
                assert self.tools.named is not None
                self._named_call = ToolCall(self.tools.named, "")
                first = self._named_call.json(0)
                deltas.append({"tool_calls": [first]})
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        if self.tools.choice == "required" or self._holding:
            return []
        unsent = self._text[self._sent :]
        if self._sent == 0 and unsent.lstrip().startswith("{"):  # a bare JSON call, or JSON content
            self._holding = True
            return []
        start = unsent.find(CALL_OPEN)
        if start >= 0:  # a call begins: the text before it is content, the rest waits for the end
            self._holding = True
            send = unsent[:start]
        else:  # hold a tail that may be the start of "<tool_call>"
            keep = next((k for k in range(len(CALL_OPEN) - 1, 0, -1) if unsent.endswith(CALL_OPEN[:k])), 0)
            send = unsent[: len(unsent) - keep]
        self._sent += len(send)
        return [{"content": send}] if send else []

    def finish(self) -> tuple[list[dict[str, Any]], bool]:
        """The deltas of what was held back, and whether the output was a tool call."""
        if self.tools.choice == "named":
            return ([] if self._named_call else self.feed("")), True
        held = self._text[self._sent :]
        content, calls = parse_output(self.tools, held)
        deltas: list[dict[str, Any]] = []
        if content:
            deltas.append({"content": content})
        if calls:
            deltas.append({"tool_calls": [c.json(i) for i, c in enumerate(calls)]})
        return deltas, bool(calls)
