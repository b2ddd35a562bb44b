"""Checkpoint identity (engine.digests): the model version is its config and weight *contents*, and a
weight file's hash is remembered across starts until the file changes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from engine import digests
from engine.digests import file_sha256, model_digest

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of this test's own, and no hashes remembered in this process."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path / "cache"))
    digests._sha256.cache_clear()
    return tmp_path / "cache"


def checkpoint(where: Path, weights: bytes) -> Path:
    where.mkdir(parents=True)
    (where / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (where / "model.safetensors").write_bytes(weights)
    return where


def test_builds_that_differ_only_in_weight_values_are_different_versions(tmp_path: Path) -> None:
    base = checkpoint(tmp_path / "base", bytes(range(256)) * 64)
    tuned = checkpoint(tmp_path / "tuned", bytes(range(255, -1, -1)) * 64)  # same shapes and file size
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    assert (base / "model.safetensors").stat().st_size == (tuned / "model.safetensors").stat().st_size
    assert model_digest(base) != model_digest(tuned)  # a fine-tune never shares a version, salt or KV
    assert model_digest(base) == model_digest(copy)  # the same build anywhere is the same version


def test_a_hash_is_remembered_until_the_file_changes(tmp_path: Path, own_cache: Path) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"a" * 4096)
    first = file_sha256(weights)
    assert first == hashlib.sha256(b"a" * 4096).hexdigest()
    records = list((own_cache / "digests").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["sha256"] == first
    # Another process (no in-memory hash) trusts the record while size and mtime match: it does not
    # read the file. Shown with a record that says something else.
    kept = json.loads(records[0].read_text())
    records[0].write_text(json.dumps({**kept, "sha256": "remembered"}))
    digests._sha256.cache_clear()
    assert file_sha256(weights) == "remembered"
    # Rewritten in place with the same size, and its mtime set back to the old one (as a build tool
    # that fixes timestamps does): read again all the same (the inode's change time moved).
    old_mtime = weights.stat().st_mtime_ns
    time.sleep(0.05)  # file times tick with the kernel's coarse clock (a few ms)
    weights.write_bytes(b"b" * 4096)
    os.utime(weights, ns=(weights.stat().st_atime_ns, old_mtime))
    assert weights.stat().st_mtime_ns == old_mtime
    assert file_sha256(weights) == hashlib.sha256(b"b" * 4096).hexdigest()
    # A cache that cannot be written costs only the re-read.
    digests._sha256.cache_clear()
    shutil.rmtree(own_cache)
    own_cache.write_text("not a directory")
    assert file_sha256(weights) == hashlib.sha256(b"b" * 4096).hexdigest()
