"""There is one error map (rpc/errors.py): no other product module maps a ServingError to a gRPC
status or back, sets the error metadata, aborts a call by hand, or recognises an error by its text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_layers import PRODUCT

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
THE_MAP = {"rpc/errors.py"}
FORBIDDEN = {
    "a gRPC status code named": re.compile(r"\bStatusCode\s*(\.|\[)"),
    "a call aborted by hand": re.compile(r"\bcontext\.abort\("),
    "trailing metadata set by hand": re.compile(r"\bset_trailing_metadata\("),
    "a RequestError built by hand": re.compile(r"\bRequestError\("),
    "an error recognised by its text": re.compile(
        r"""["'][^"']*["']\s+(not\s+)?in\s+[\w.]*(details\(\)|message|str\(e\w*\))"""
    ),
}


def product_files() -> list[Path]:
    return sorted(p for package in PRODUCT for p in (ROOT / package).rglob("*.py"))


def test_no_module_but_the_map_turns_errors_into_statuses_or_back() -> None:
    found = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in THE_MAP:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in FORBIDDEN.items():
                if pattern.search(line):
                    found.append(f"{rel}:{n}: {what}: {line.strip()}")
    assert not found, "error mapping outside rpc/errors.py:\n" + "\n".join(found)


def test_the_patterns_catch_what_they_are_meant_to() -> None:
    samples = {
        "a gRPC status code named": 'if code == grpc.StatusCode.UNAVAILABLE and "KV" in details:',
        "a call aborted by hand": "await context.abort(grpc.StatusCode.INTERNAL, 'x')",
        "trailing metadata set by hand": "context.set_trailing_metadata(((RETRY_AFTER_KEY, '1'),))",
        "a RequestError built by hand": "common_pb2.RequestError(code=14, message=m)",
        "an error recognised by its text": 'if "KV" in e.details():',
    }
    for what, line in samples.items():
        assert FORBIDDEN[what].search(line), what
    assert FORBIDDEN["an error recognised by its text"].search('elif "timed out" in err.message:')
