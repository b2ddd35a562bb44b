"""Identities of files and checkpoints: `file_sha256` (a file's content hash, read once per change of
the file), `model_digest` (a checkpoint's version id), and Baton's cache directory.

Weights are hundreds of megabytes to tens of gigabytes: hashing them at every start would cost seconds
(0.35 s for the default model's 538 MB here). The hash is remembered in ``<cache>/digests/`` under the
file's absolute path, with the size and modification time it was computed for; a file rewritten in
place gets a new mtime and is read again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path


def cache_root(env: Mapping[str, str] = os.environ) -> Path:
    """Baton's cache: $BATON_CACHE_DIR, else $XDG_CACHE_HOME/baton, else ~/.cache/baton."""
    if env.get("BATON_CACHE_DIR"):
        return Path(env["BATON_CACHE_DIR"])
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]) / "baton"
    return Path.home() / ".cache" / "baton"


def file_sha256(path: Path) -> str:
    """The SHA-256 (hex) of the file's contents."""
    path = path.resolve()
    stat = path.stat()
    return _sha256(str(path), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    record = cache_root() / "digests" / f"{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        kept = json.loads(record.read_text())
        if kept["path"] == path and kept["size"] == size and kept["mtime_ns"] == mtime_ns:
            return str(kept["sha256"])
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache only costs the next start a re-read
        record.parent.mkdir(parents=True, exist_ok=True)
        partial = record.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"path": path, "size": size, "mtime_ns": mtime_ns, "sha256": digest}))
        partial.replace(record)
    return digest


def model_digest(model_dir: Path) -> str:
    """A checkpoint's identity, its model version in the cluster: its config and the contents of its
    weight files. Two builds whose weights differ anywhere — a fine-tune of the same shapes and file
    sizes too — never share a version, a prefix-cache salt or a KV handoff. Each weight file is read
    once per change of it (engine.file_digest)."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{file_sha256(f)}".encode())
    return h.hexdigest()[:16]
