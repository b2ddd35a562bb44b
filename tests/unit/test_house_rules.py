"""House rules read from the source: no product module over 500 lines, and proto types only at the
RPC edges (the conversion modules, the servicers and the clients), never in the logic between them."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_layers import PRODUCT, imports

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 500
# Where proto types may appear: the modules that convert, serve or call over gRPC.
EDGES = {
    "rpc/convert.py",
    "rpc/errors.py",
    "services/gateway/convert.py",
    "services/gateway/servicer.py",
    "services/gateway/server.py",
    "services/gateway/router.py",
    "services/gateway/worker_clients.py",
    "services/worker/server.py",
    "services/worker/membership.py",
    "prefill_worker/rpc.py",
    "decode_worker/rpc.py",
    "scheduler/service.py",
    "scheduler/server.py",
    "scheduler/calls.py",
    "scheduler/placing.py",
    "scheduler/rollout.py",
    "scheduler/reaper.py",
    "scheduler/admin.py",
    "loadgen/targets.py",
}


def test_no_product_module_is_over_500_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for package in PRODUCT
        for p in (ROOT / package).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these along their seams (at most {MAX_LINES} lines): {long}"


def test_proto_types_appear_only_at_the_rpc_edges() -> None:
    found: set[str] = set()
    for package in PRODUCT:
        for name, files in imports(package).items():
            if name.split(".")[0] == "baton":
                found |= files
    assert found - EDGES == set(), f"proto types outside the RPC edges: {sorted(found - EDGES)}"
    assert EDGES - found == set(), f"no longer edges (drop them from EDGES): {sorted(EDGES - found)}"
