"""Identities of files and checkpoints: `file_sha256` (a file's content hash, read once per change of
the file), `model_digest` (a checkpoint's version id), and Baton's cache directory.

Weights are hundreds of megabytes to tens of gigabytes: hashing them at every start would cost seconds
(0.35 s for the default model's 538 MB here). The hash is remembered in ``<cache>/digests/`` under the
file's absolute path, with the file's size, mtime, inode and inode change time when it was read: any
rewrite changes the change time (which no tool sets back), so a changed file is always read again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
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
    return _sha256(str(path), _identity(path))


def _identity(path: Path) -> tuple[int, ...]:
    """What changes whenever the file's contents may have: size, mtime, and the inode's change time and
    number (a copy that kept the old mtime, or an mtime set back by a build tool, still shows)."""
    st = path.stat()
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


@functools.cache
def _sha256(path: str, identity: tuple[int, ...]) -> str:
    try:
        record: Path | None = (
            cache_root() / "digests" / f"{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"
        )
    except RuntimeError:  # no home directory (an arbitrary container user) and no cache set: remember nothing
        record = None
    if record is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            kept = json.loads(record.read_text())
            if kept["path"] == path and tuple(kept["identity"]) == identity:
                return str(kept["sha256"])
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if record is not None and _identity(Path(path)) == identity:  # not changed while read: worth keeping
        with contextlib.suppress(OSError):  # a read-only cache only costs the next start a re-read
            record.parent.mkdir(parents=True, exist_ok=True)
            partial = record.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            partial.write_text(json.dumps({"path": path, "identity": identity, "sha256": digest}))
            partial.replace(record)
    return digest


def model_digest(model_dir: Path) -> str:
    """A checkpoint's identity, its model version in the cluster: its config and the contents of its
    weight files. Two builds whose weights differ anywhere — a fine-tune of the same shapes and file
    sizes too — never share a version, a prefix-cache salt or a KV handoff. Each weight file is read
    once per change of it, the files of a sharded checkpoint in parallel (hashlib releases the GIL):
    the first start of a 16 GB checkpoint reads for a few seconds on a node's cores."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    files = sorted(model_dir.glob("*.safetensors"))
    with ThreadPoolExecutor(max_workers=max(1, min(len(files), os.cpu_count() or 1))) as pool:
        for f, digest in zip(files, pool.map(file_sha256, files), strict=True):
            h.update(f"{f.name}:{digest}".encode())
    return h.hexdigest()[:16]
