"""The OpenAPI 3.1 description of the gateway's HTTP API, served at ``GET /openapi.json``.

It is built from the same limits the parser enforces (`services.gateway.openai_api`,
`core.sampling_params`) and the running gateway's own (``--max-output-tokens``), so a client generated
from it — or a fuzzer such as schemathesis — sees the ranges the server really accepts. Fields that the
server takes but that carry nested structure of their own (``response_format``, ``tools``, …) are
described as their JSON type; their content is checked by the server with a 400 naming what is wrong.
Every error is the OpenAI error body, ``ErrorResponse``.
"""

from __future__ import annotations

from typing import Any

from core.sampling_params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
)
from services.gateway.openai_api import MAX_N, MAX_PROMPTS

_REF = "#/components/schemas/"
_ANY: dict[str, Any] = {}  # any JSON value: fields the server accepts with no effect on what it generates


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI clients send ``null`` for a field they leave unset; the server reads it as not given."""
    return {"anyOf": [schema, {"type": "null"}]}


def _int(minimum: int | None = None, maximum: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    return _nullable(schema)


def _number(minimum: float, maximum: float, exclusive_minimum: bool = False) -> dict[str, Any]:
    low = {"exclusiveMinimum": minimum} if exclusive_minimum else {"minimum": minimum}
    return _nullable({"type": "number", **low, "maximum": maximum})


def _common(max_output_tokens: int) -> dict[str, Any]:
    stop = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}
    return {
        "model": _nullable({"type": "string"}),
        "max_tokens": _int(1, max_output_tokens),
        "n": _int(1, MAX_N),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object"}),
        "temperature": _number(0.0, MAX_TEMPERATURE),
        "top_p": _number(0.0, 1.0, exclusive_minimum=True),
        "top_k": _int(-1),
        "min_p": _number(0.0, 1.0),
        "min_tokens": _int(0, max_output_tokens),
        "repetition_penalty": _number(0.0, MAX_REPETITION_PENALTY, exclusive_minimum=True),
        "presence_penalty": _number(-2.0, 2.0),
        "frequency_penalty": _number(-2.0, 2.0),
        "seed": _int(0, MAX_SEED),
        "stop": _nullable({"anyOf": [stop, {"type": "array", "items": stop, "maxItems": MAX_STOP_STRINGS}]}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "skip_special_tokens": _nullable({"type": "boolean"}),
        "prompt_logprobs": _int(0, MAX_LOGPROBS),
        "response_format": _nullable({"type": "object"}),
        "user": _ANY,
        "metadata": _ANY,
        "service_tier": _ANY,
    }


def _prompt() -> dict[str, Any]:
    text = {"type": "string", "minLength": 1}
    tokens = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    batch = {"type": "array", "items": {"anyOf": [text, tokens]}, "minItems": 1, "maxItems": MAX_PROMPTS}
    return {"anyOf": [text, tokens, batch]}


def _message() -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            # system, developer, user, assistant, tool; any other is the chat template's to take or refuse
            "role": {"type": "string", "minLength": 1},
            "content": {"type": "string"},
            "name": {"type": "string"},
        },
    }


def _responses(success: str) -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": f"{_REF}ErrorResponse"}}}
    responses: dict[str, Any] = {
        "200": {
            "description": "the answer (JSON), or with stream: true server-sent events",
            "content": {
                "application/json": {"schema": {"$ref": f"{_REF}{success}"}},
                # each event: its data is a chunk as JSON, the last one "[DONE]"
                "text/event-stream": {
                    "schema": {
                        "type": "object",
                        "required": ["data"],
                        "properties": {"data": {"type": "string"}},
                    }
                },
            },
        }
    }
    for status, why in (
        ("400", "a field is wrong (the message names it)"),
        ("401", "no valid API key (--require-api-key)"),
        ("404", "no such model"),
        ("408", "the body did not arrive in time"),
        ("413", "the body is over --max-request-bytes"),
        ("429", "over a quota or capacity (Retry-After)"),
        ("503", "no worker can take it now"),
    ):
        responses[status] = {"description": why, "content": error}
    return responses


def openapi_document(model: str, max_output_tokens: int, require_api_key: bool = False) -> dict[str, Any]:
    """The description of this gateway's HTTP API, for a gateway serving ``model`` (``require_api_key``:
    every operation but health needs a bearer key)."""
    common = _common(max_output_tokens)
    completion_request = {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            **common,
            "prompt": _prompt(),
            "best_of": _int(1, MAX_N),
            "logprobs": _int(0, MAX_LOGPROBS),
            "echo": _nullable({"type": "boolean"}),
        },
    }
    chat_request = {
        "type": "object",
        "required": ["messages"],
        "properties": {
            **common,
            "messages": {"type": "array", "items": {"$ref": f"{_REF}ChatMessage"}, "minItems": 1},
            "max_completion_tokens": _int(1, max_output_tokens),
            "logprobs": _nullable({"type": "boolean"}),
            "top_logprobs": _int(0, MAX_LOGPROBS),
            "tools": _nullable({"type": "array"}),
            "tool_choice": _nullable({"anyOf": [{"type": "string"}, {"type": "object"}]}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
        },
    }
    answer = {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object"},
        },
    }
    error = {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "integer", "null"]},
                },
            }
        },
    }
    models = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id", "object"],
                    "properties": {"id": {"type": "string"}},
                },
            },
        },
    }
    json_error = {"application/json": {"schema": {"$ref": f"{_REF}ErrorResponse"}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Baton OpenAI-compatible API",
            "version": "1",
            "description": f"Serves {model}. Every error is an OpenAI error body.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "CompletionRequest": completion_request,
                "ChatCompletionRequest": chat_request,
                "ChatMessage": _message(),
                "Completion": answer,
                "ChatCompletion": answer,
                "ModelList": models,
                "ErrorResponse": error,
            },
        },
        "security": [{"bearer": []}] if require_api_key else [],
        "paths": {
            "/v1/completions": {
                "post": {
                    "operationId": "createCompletion",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": f"{_REF}CompletionRequest"}}},
                    },
                    "responses": _responses("Completion"),
                }
            },
            "/v1/chat/completions": {
                "post": {
                    "operationId": "createChatCompletion",
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": f"{_REF}ChatCompletionRequest"}}},
                    },
                    "responses": _responses("ChatCompletion"),
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "responses": {
                        "200": {
                            "description": "the served model",
                            "content": {"application/json": {"schema": {"$ref": f"{_REF}ModelList"}}},
                        },
                        "401": {"description": "no valid API key", "content": json_error},
                    },
                }
            },
            "/health": {
                "get": {
                    "operationId": "health",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "serving",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                        "503": {
                            "description": "not serving",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        },
                    },
                }
            },
        },
    }
