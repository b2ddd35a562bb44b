"""Structured outputs on the OpenAI API: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and
their newer ``structured_outputs`` spelling, parsed into the one `StructuredOutput` the engine enforces
(engine.structured). Here: the form, the size and the nesting; the engine compiles it, and a schema it
cannot compile is a 400 from there."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from core.errors import InvalidRequest
from core.sampling_params import StructuredOutput

MAX_JSON_DEPTH = 64  # nesting of a request body or a schema: far over any valid one's, far under a stack's


def parse_structured(fields: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's output constraint: OpenAI's ``response_format``, vLLM's ``guided_*`` fields or its
    ``structured_outputs`` object — at most one of them. The engine compiles it (a bad schema is a 400
    from there); here its form, size and nesting are checked."""
    found: list[tuple[str, StructuredOutput]] = []
    rf = fields.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequest(
                'response_format must be {"type": "text"}, {"type": "json_object"} or '
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
            )
        if rf["type"] == "json_object":
            found.append(("response_format", StructuredOutput("json_object")))
        elif rf["type"] == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise InvalidRequest("response_format.json_schema must be an object with a schema object")
            schema = spec.get("schema", {"type": "object"})
            found.append(("response_format", _json_schema("response_format.json_schema.schema", schema)))
    vllm = {k: fields.get(f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
    so = fields.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("structured_outputs must be an object")
        vllm.update({f"so.{k}": so.get(k) for k in ("json", "regex", "choice", "grammar")})
        if so.get("json_object") is True:
            found.append(("structured_outputs.json_object", StructuredOutput("json_object")))
    for key, value in vllm.items():
        if value is None:
            continue
        name = key.replace("so.", "structured_outputs.") if key.startswith("so.") else f"guided_{key}"
        kind = key.removeprefix("so.")
        if kind == "json":
            found.append((name, _json_schema(name, value)))
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
                raise InvalidRequest(f"{name} must be a non-empty list of non-empty strings")
            found.append((name, StructuredOutput("choice", json.dumps(value, ensure_ascii=False))))
        else:
            if not isinstance(value, str) or not value:
                raise InvalidRequest(f"{name} must be a non-empty string")
            found.append((name, StructuredOutput(kind, value)))
    if len(found) > 1:
        raise InvalidRequest(
            f"{found[0][0]}: only one output constraint per request, got {', '.join(n for n, _ in found)}"
        )
    return found[0][1] if found else None


def _json_schema(name: str, schema: Any) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise InvalidRequest(f"{name} is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{name} must be a JSON schema object")
    check_depth(schema, name)
    return StructuredOutput("json", json.dumps(schema, ensure_ascii=False))


def check_depth(value: Any, name: str) -> None:
    """InvalidRequest for a value nested deeper than ``MAX_JSON_DEPTH`` (walked without recursion)."""
    level: list[Any] = [value]
    for _ in range(MAX_JSON_DEPTH + 1):
        level = [
            v
            for item in level
            if isinstance(item, (dict, list))
            for v in (item.values() if isinstance(item, dict) else item)
        ]
        if not level:
            return
    raise InvalidRequest(f"{name} is nested deeper than {MAX_JSON_DEPTH} levels")
