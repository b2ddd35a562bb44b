"""Generates the Python code of proto/baton/v1 (messages, gRPC stubs, type stubs) next to the sources.

Run by `make` (the `proto` target); the generated files are ignored by git and never edited by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent


def main() -> int:
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "baton" / "v1").glob("*.proto"))
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *sources,
    ]
    rc = protoc.main(args)
    if rc != 0:
        print(f"protoc failed ({rc})", file=sys.stderr)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
