"""The import rules of docs/ARCHITECTURE.md ("Layers and imports"), read from the source: `core`
imports only the standard library, proto types never reach `core` or `engine`, the gateway and the
workers never import each other or the scheduler, and no lower layer imports a higher one."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
OURS = {
    "core",
    "engine",
    "kv_transfer",
    "rpc",
    "scheduler",
    "prefill_worker",
    "decode_worker",
    "services",
    "autoscaler",
    "baton",
    "loadgen",
    "benchmarks",
}
ROLE = {
    "core",
    "engine",
    "kv_transfer",
    "rpc",
    "baton",
    # the worker shell's lower half, which the role handlers are built on (not its server)
    "services.worker.shell",
    "services.worker.metrics",
    "services.worker.config",
    "services.worker.membership",
    "scheduler.cancel",
}  # the cancellation bus: the scheduler publishes, every worker listens
# the packages that ship (those whose rules the house-rule tests check)
PRODUCT = (
    "core",
    "engine",
    "kv_transfer",
    "rpc",
    "scheduler",
    "services",
    "prefill_worker",
    "decode_worker",
    "autoscaler",
    "loadgen",
)
# package (a folder) → the packages or modules of ours it may import (itself always)
ALLOWED = {
    "core": set(),
    "engine": {"core"},
    "kv_transfer": {"core"},
    "rpc": {"core", "baton", "kv_transfer"},
    "scheduler": {"core", "baton", "rpc"},
    "prefill_worker": ROLE,
    "decode_worker": ROLE,
    "services.worker": ROLE | {"prefill_worker", "decode_worker"},
    # the gateway tokenizes (engine's torch-free tokenizer and GGUF reader) and serves; it never runs a model
    "services.gateway": {"core", "engine.tokenizer", "engine.gguf_convert", "kv_transfer", "rpc", "baton"},
    "loadgen": {"core", "baton", "engine.tokenizer", "engine.gguf_convert"},  # a client: no server code
    # a control loop over metrics and a cluster API: it never imports a server, the engine or the proto
    "autoscaler": {"core", "rpc.flags", "rpc.metrics"},
}


def imports(package: str) -> dict[str, set[str]]:
    """Module imported → the files of ``package`` that import it (absolute imports, also inside functions)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import mod` imports pkg.mod when mod is a module of ours
                names = [
                    f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                    for a in node.names
                ]
            else:
                names = []
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _within(name: str, allowed: str) -> bool:
    return name == allowed or name.startswith(allowed + ".")


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(package: str) -> None:
    found = imports(package)
    wrong = {
        name: files
        for name, files in found.items()
        if name.split(".")[0] in OURS
        and not _within(name, package)
        and not any(_within(name, a) for a in ALLOWED[package])
    }
    assert not wrong, f"{package} may import {sorted(ALLOWED[package]) or 'none of ours'}; found {wrong}"


def test_every_product_package_has_its_rule() -> None:
    folders = {
        p.parent.relative_to(ROOT).as_posix().replace("/", ".")
        for p in ROOT.glob("*/**/__init__.py")
        if p.relative_to(ROOT).parts[0] in OURS - {"baton"}
    }
    ruled = {f for f in folders if any(_within(f, a) for a in ALLOWED)}
    assert folders - ruled <= {"services", "benchmarks", "proto"}, sorted(folders - ruled)


def test_core_imports_only_the_standard_library() -> None:
    outside = {
        name: files
        for name, files in imports("core").items()
        if name.split(".")[0] != "core" and name.split(".")[0] not in sys.stdlib_module_names
    }
    assert not outside, f"core must stay pure Python on the standard library; found {outside}"
