"""The import rules of docs/ARCHITECTURE.md ("Layers and imports"), read from the source: `core`
imports only the standard library, proto types never reach `core` or `engine`, and no lower layer
imports a higher one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
OURS = {"core", "engine", "kv_transfer", "scheduler", "prefill_worker", "decode_worker", "services", "baton",
        "loadgen", "benchmarks"}
# package → the packages of ours it may import (itself always)
ALLOWED = {
    "core": set(),
    "engine": {"core"},
    "kv_transfer": {"core"},
    "scheduler": {"core", "baton"},
    "prefill_worker": {"core", "engine", "kv_transfer"},
    "decode_worker": {"core", "engine", "kv_transfer"},
}


def imports(package: str) -> dict[str, set[str]]:
    """Top-level module → the files of ``package`` that import it (absolute imports, also inside functions)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                     else [])
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(package: str) -> None:
    found = imports(package)
    wrong = {name: files for name, files in found.items()
             if name in OURS and name != package and name not in ALLOWED[package]}
    assert not wrong, f"{package} may import {sorted(ALLOWED[package]) or 'none of ours'}; found {wrong}"


def test_core_imports_only_the_standard_library() -> None:
    outside = {name: files for name, files in imports("core").items()
               if name != "core" and name not in sys.stdlib_module_names}
    assert not outside, f"core must stay pure Python on the standard library; found {outside}"
