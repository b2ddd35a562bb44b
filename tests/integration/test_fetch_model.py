"""`baton fetch-model` as an init container runs it, against real HTTP servers on 127.0.0.1 that stand in
for the Hugging Face Hub (its two documented endpoints, a token check, a redirect to a CDN) and for object
storage (archives behind a presigned-looking URL). No hub can be reached from these machines, so the
stand-ins are the only Hub these tests see; what they serve follows the Hub's documented HTTP API.

Weights are tiny fake files where only their presence matters; one case fetches a real seeded tiny
Llama and generates with it, proving the fetched directory is a usable model.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_test_token"
MARKER = ".baton-fetch.json"


@dataclass
class Served:
    """One request as the server saw it."""

    path: str
    headers: dict[str, str]


@dataclass
class StandIn:
    """What the HTTP server serves: ``files`` by URL path; ``hub`` repos (repo → file name → bytes) behind
    the Hub's API; ``breaks`` (path → how many more answers to cut off halfway); every request seen."""

    files: dict[str, bytes] = field(default_factory=dict)
    hub: dict[str, dict[str, bytes]] = field(default_factory=dict)
    token: str | None = None
    breaks: dict[str, int] = field(default_factory=dict)
    before: dict[str, Callable[[], None]] = field(default_factory=dict)  # path → run before answering
    requests: list[Served] = field(default_factory=list)
    url: str = ""

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads `requests`
        pass

    def do_GET(self) -> None:
        site = self.server.site
        site.requests.append(Served(self.path, dict(self.headers)))
        path = self.path.split("?", 1)[0]
        if path in site.before:
            site.before.pop(path)()
        if path.startswith("/api/models/") or "/resolve/" in path:
            return self._hub(site, path)
        if path in site.files:
            return self._send_file(site, path, site.files[path])
        self._send(404, b'{"error": "not found"}')

    def _hub(self, site: StandIn, path: str) -> None:
        if site.token is not None and self.headers.get("Authorization") != f"Bearer {site.token}":
            return self._send(401, b'{"error": "Invalid credentials in Authorization header"}')
        if path.startswith("/api/models/"):  # /api/models/{org}/{name}/revision/{rev}
            repo, _, revision = path.removeprefix("/api/models/").partition("/revision/")
            if repo not in site.hub or revision != "main":
                return self._send(404, b'{"error": "Repository not found"}')
            siblings = [{"rfilename": name} for name in site.hub[repo]]
            return self._send(200, json.dumps({"id": repo, "sha": "0" * 40, "siblings": siblings}).encode())
        repo, _, rest = path.lstrip("/").partition("/resolve/")  # /{repo}/resolve/{rev}/{file}
        name = rest.partition("/")[2]
        if repo not in site.hub or name not in site.hub[repo]:
            return self._send(404, b'{"error": "Entry not found"}')
        # As the Hub does for large files: a redirect to a CDN, which must not receive the token.
        cdn = f"/cdn/{repo}/{name}"
        site.files[cdn] = site.hub[repo][name]
        self.send_response(302)
        self.send_header("Location", cdn)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send_file(self, site: StandIn, path: str, body: bytes) -> None:
        start = 0
        asked = self.headers.get("Range", "")
        if asked.startswith("bytes=") and asked.endswith("-"):
            start = int(asked.removeprefix("bytes=").removesuffix("-"))
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if site.breaks.get(path, 0) > 0:  # the connection drops halfway through the file
            site.breaks[path] -= 1
            self.wfile.write(body[start : start + (len(body) - start) // 2])
            self.close_connection = True
            return
        self.wfile.write(body[start:])

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, site: StandIn) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.site = site


@pytest.fixture
def site() -> Iterator[StandIn]:
    stand_in = StandIn()
    server = _Server(stand_in)
    stand_in.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield stand_in
    server.shutdown()
    server.server_close()


def fetch(
    *args: str, site: StandIn | None = None, token: str | None = TOKEN
) -> subprocess.CompletedProcess[str]:
    """``baton fetch-model ARGS`` as an init container runs it; HF_ENDPOINT points at the stand-in."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_ENDPOINT", "HF_TOKEN")}
    if site is not None:
        env["HF_ENDPOINT"] = site.url
    if token is not None:
        env["HF_TOKEN"] = token
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "fetch-model", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def ok(result: subprocess.CompletedProcess[str]) -> Path:
    """The directory a successful fetch printed (its only line on stdout)."""
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return Path(result.stdout.strip())


def failed(result: subprocess.CompletedProcess[str], *words: str) -> str:
    """A fetch that failed cleanly: exit 1, one error line naming ``words``, no traceback, no stdout."""
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    error = [line for line in result.stderr.splitlines() if line.startswith("baton fetch-model: error:")]
    assert len(error) == 1, result.stderr
    for word in words:
        assert word in error[0], error[0]
    return error[0]


def nothing_left(dest: Path) -> None:
    """Neither DEST nor a DEST.partial-* directory exists."""
    assert not dest.exists()
    assert not list(dest.parent.glob(f"{dest.name}.partial-*"))


def fake_model(**extra: bytes) -> dict[str, bytes]:
    """A model directory's files where only presence matters (fake weights)."""
    files = {
        "config.json": json.dumps({"model_type": "llama"}).encode(),
        "tokenizer.json": b"{}",
        "tokenizer_config.json": b"{}",
        "model.safetensors": os.urandom(3000),
    }
    return {**files, **extra}


def directory(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file() and p.name != MARKER
    }


def tar_gz(files: dict[str, bytes], top: str = "", mode: str = "w:gz") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def zip_of(files: dict[str, bytes], top: str = "") -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in files.items():
            zf.writestr(f"{top}{name}", data)
    return out.getvalue()


# --- hf:// -----------------------------------------------------------------------------------------


def test_a_real_tiny_model_fetched_from_the_hub_loads_and_generates(
    site: StandIn, tiny_llama: Path, tmp_path: Path
) -> None:
    model = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
    # What a real repository also holds, which a Baton model directory does not need.
    skipped = {"pytorch_model.bin": b"x", "original/consolidated.safetensors": b"x", "README.md": b"x"}
    site.hub["acme/tiny-llama"] = {**model, **skipped}
    site.token = TOKEN
    dest = tmp_path / "cache" / "models" / "tiny"

    assert ok(fetch("hf://acme/tiny-llama", str(dest), site=site)) == dest
    assert directory(dest) == model
    assert not any(name in "".join(site.paths()) for name in ("pytorch_model.bin", "original/", "README.md"))
    for request in site.requests:  # the token goes to the Hub, never to the CDN it redirects to
        assert ("Authorization" in request.headers) == (not request.path.startswith("/cdn/")), request.path
    marker = json.loads((dest / MARKER).read_text())
    assert marker["uri"] == "hf://acme/tiny-llama@main" and marker["revision_sha"] == "0" * 40

    from core.sampling_params import SamplingParams
    from engine import LLM

    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    fetched = LLM(str(dest), kv_cache_memory=16 << 20, dtype="float32").generate(["The capital of"], params)
    original = LLM(str(tiny_llama), kv_cache_memory=16 << 20, dtype="float32").generate(
        ["The capital of"], params
    )
    assert len(fetched[0].token_ids) == 4
    assert fetched[0].token_ids == original[0].token_ids


def test_a_sharded_checkpoint_brings_exactly_the_shards_its_index_names(
    site: StandIn, tmp_path: Path
) -> None:
    index = {
        "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00002-of-00002.safetensors",
        }
    }
    shards = {name: os.urandom(500) for name in index["weight_map"].values()}
    site.hub["acme/sharded"] = {
        **fake_model(),
        "model.safetensors.index.json": json.dumps(index).encode(),
        **shards,
        "consolidated.safetensors": b"another format's copy of the same weights",
    }
    del site.hub["acme/sharded"]["model.safetensors"]
    dest = ok(fetch("hf://acme/sharded", str(tmp_path / "m"), site=site))
    assert set(directory(dest)) == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors.index.json",
        *shards,
    }
    assert not any("consolidated" in p for p in site.paths())


def test_hub_errors_are_one_clear_line(site: StandIn, tmp_path: Path) -> None:
    site.hub["acme/model"] = fake_model()
    site.hub["acme/pickles"] = {"config.json": b"{}", "pytorch_model.bin": b"x"}
    site.token = TOKEN
    dest = tmp_path / "m"

    failed(fetch("hf://acme/model", str(dest), site=site, token="hf_wrong"), "401", "HF_TOKEN is set")
    nothing_left(dest)
    failed(fetch("hf://acme/model", str(dest), site=site, token=None), "401", "HF_TOKEN is not set")
    failed(fetch("hf://acme/missing", str(dest), site=site), "404", "hf://acme/missing@main")
    failed(fetch("hf://acme/model@v2", str(dest), site=site), "404")
    failed(fetch("hf://acme/pickles", str(dest), site=site), "no *.safetensors", "pytorch_model.bin")
    failed(fetch("s3://bucket/model", str(dest)), "unsupported URI scheme s3://", "presigned")
    failed(fetch("hf://acme/a/b", str(dest), site=site), "is not hf://org/repo[@revision]")
    failed(fetch("hf://acme/model@", str(dest), site=site), "is not hf://org/repo[@revision]")
    nothing_left(dest)


# --- archives --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "pack"),
    [
        ("model.tar.gz", lambda f: tar_gz(f, top="my-model/")),
        ("model.tgz", lambda f: tar_gz(f)),
        ("model.tar", lambda f: tar_gz(f, top="./my-model/", mode="w")),
        ("model.zip", lambda f: zip_of(f, top="my-model/")),
        ("model.zip?v=flat", lambda f: zip_of(f)),
    ],
)
def test_an_archive_behind_a_presigned_url_is_extracted(
    site: StandIn, tmp_path: Path, name: str, pack: Any
) -> None:
    files = fake_model(**{"extra/notes.txt": b"kept"})
    path = "/bucket/" + name.split("?")[0]
    site.files[path] = pack(files)
    secret = "X-Amz-Signature=0123secret"
    result = fetch(f"{site.url}{path}?{secret}", str(tmp_path / "m"))
    dest = ok(result)
    assert directory(dest) == files  # one top directory: its contents, not the directory
    assert "secret" not in result.stderr + (dest / MARKER).read_text()  # the signature is never recorded
    assert json.loads((dest / MARKER).read_text())["uri"] == f"{site.url}{path}"
    assert not list(tmp_path.glob("m.partial-*"))


@pytest.mark.parametrize(
    ("member", "pack"),
    [
        ("../evil.txt", lambda files: tar_gz(files)),
        ("/tmp/evil.txt", lambda files: tar_gz(files)),
        ("my-model/../../evil.txt", lambda files: zip_of(files)),
    ],
)
def test_an_archive_member_outside_the_directory_is_refused(
    site: StandIn, tmp_path: Path, member: str, pack: Any
) -> None:
    site.files["/m.tar.gz"] = pack({**fake_model(), member: b"pwned"})
    dest = tmp_path / "deep" / "m"
    failed(fetch(f"{site.url}/m.tar.gz", str(dest)), "unsafe archive member", repr(member))
    nothing_left(dest)
    assert not list(tmp_path.rglob("evil.txt")) and not Path("/tmp/evil.txt").exists()


def test_links_and_non_archives_are_refused(site: StandIn, tmp_path: Path) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        link = tarfile.TarInfo("config.json")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    site.files["/link.tar.gz"] = out.getvalue()
    site.files["/page.html"] = b"<html>not an archive</html>"
    site.files["/empty.tar.gz"] = tar_gz({"README.md": b"no model here"})
    dest = tmp_path / "m"
    failed(fetch(f"{site.url}/link.tar.gz", str(dest)), "is a link")
    failed(fetch(f"{site.url}/page.html", str(dest)), "not a .tar, .tar.gz/.tgz or .zip archive")
    failed(fetch(f"{site.url}/empty.tar.gz", str(dest)), "no config.json")
    failed(fetch(f"{site.url}/absent.tar.gz", str(dest)), "HTTP 404")
    nothing_left(dest)


# --- idempotence, --force, interruptions -----------------------------------------------------------


def test_a_second_run_downloads_nothing(site: StandIn, tmp_path: Path) -> None:
    site.hub["acme/model"] = fake_model()
    dest = tmp_path / "m"
    ok(fetch("hf://acme/model", str(dest), site=site))
    seen = len(site.requests)
    assert seen == 1 + 2 * 4  # the listing, then each file: the resolve and its redirect
    again = fetch("hf://acme/model", str(dest), site=site)
    assert ok(again) == dest
    assert "already holds hf://acme/model@main" in again.stderr
    assert len(site.requests) == seen


def test_another_uri_is_refused_unless_forced(site: StandIn, tmp_path: Path) -> None:
    site.hub["acme/a"] = fake_model(**{"special_tokens_map.json": b"{}"})
    site.hub["acme/b"] = fake_model(**{"generation_config.json": b"{}"})
    dest = tmp_path / "m"
    ok(fetch("hf://acme/a", str(dest), site=site))
    failed(fetch("hf://acme/b", str(dest), site=site), "holds hf://acme/a@main", "--force")
    assert directory(dest) == site.hub["acme/a"]
    ok(fetch("hf://acme/b", str(dest), "--force", site=site))
    assert directory(dest) == site.hub["acme/b"]  # nothing of a's left
    assert not list(tmp_path.glob("m.partial-*"))

    stranger = tmp_path / "not-ours"
    (stranger / "data").mkdir(parents=True)
    failed(fetch("hf://acme/a", str(stranger), site=site), "holds no model fetched by baton", "--force")
    assert (stranger / "data").is_dir()
    (tmp_path / "empty").mkdir()  # made ahead of time (e.g. by a volume's owner): filled
    ok(fetch("hf://acme/a", str(tmp_path / "empty"), site=site))


def test_pods_racing_on_a_shared_volume_keep_the_first_complete_copy(site: StandIn, tmp_path: Path) -> None:
    site.hub["acme/model"] = fake_model()
    dest, other = tmp_path / "shared" / "m", tmp_path / "other-pod"
    ok(fetch("hf://acme/model", str(other), site=site))
    # While this fetch is still downloading, another pod's fetch of the same model completes.
    site.before["/cdn/acme/model/tokenizer_config.json"] = lambda: shutil.copytree(other, dest)
    result = fetch("hf://acme/model", str(dest), site=site)
    assert ok(result) == dest
    assert "completed by another fetch" in result.stderr
    assert directory(dest) == site.hub["acme/model"]
    assert not list(dest.parent.glob("m.partial-*"))


def test_leftovers_of_dead_fetches_are_removed(site: StandIn, tmp_path: Path) -> None:
    site.hub["acme/model"] = fake_model()
    dead, live = tmp_path / "m.partial-7-pod-a", tmp_path / "m.partial-7-pod-b"
    for partial in (dead, live):
        (partial / "model").mkdir(parents=True)
        (partial / "model" / "model.safetensors").write_bytes(b"half")
    two_hours_ago = time.time() - 7200
    for path in (dead / "model" / "model.safetensors", dead / "model", dead):
        os.utime(path, (two_hours_ago, two_hours_ago))
    result = fetch("hf://acme/model", str(tmp_path / "m"), site=site)
    ok(result)
    assert not dead.exists() and f"removing {dead}" in result.stderr
    assert live.exists()  # another pod's fetch, still writing: left alone


def test_an_interrupted_download_leaves_no_dest_and_a_clean_retry_works(
    site: StandIn, tmp_path: Path
) -> None:
    site.hub["acme/model"] = fake_model(**{"model.safetensors": os.urandom(200_000)})
    site.breaks["/cdn/acme/model/model.safetensors"] = 2  # the first try and its one retry both break
    dest = tmp_path / "m"
    failed(
        fetch("hf://acme/model", str(dest), "--retries", "1", site=site), "model.safetensors", "closed after"
    )
    nothing_left(dest)
    assert ok(fetch("hf://acme/model", str(dest), site=site)) == dest
    assert directory(dest) == site.hub["acme/model"]


def test_a_broken_transfer_resumes_where_it_stopped(site: StandIn, tmp_path: Path) -> None:
    weights = os.urandom(300_000)
    site.files["/m.tar"] = tar_gz(fake_model(**{"model.safetensors": weights}), mode="w")
    site.breaks["/m.tar"] = 1
    result = fetch(f"{site.url}/m.tar", str(tmp_path / "m"))
    dest = ok(result)
    assert (dest / "model.safetensors").read_bytes() == weights
    assert "trying again" in result.stderr
    ranges = [r.headers.get("Range") for r in site.requests]
    assert ranges == [None, f"bytes={len(site.files['/m.tar']) // 2}-"]  # the retry asked for the rest only


# --- local directories -----------------------------------------------------------------------------


def test_a_local_directory_is_copied(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name, data in fake_model().items():
        (src / name).write_bytes(data)
    assert directory(ok(fetch(str(src), str(tmp_path / "a")))) == directory(src)
    assert directory(ok(fetch(src.as_uri(), str(tmp_path / "b")))) == directory(src)
    assert json.loads((tmp_path / "b" / MARKER).read_text())["uri"] == src.as_uri()
    # the same directory, named as a path or a file:// URI, is the same source
    assert "already holds" in fetch(src.as_uri(), str(tmp_path / "a")).stderr
    (src / "config.json").unlink()
    failed(fetch(str(src), str(tmp_path / "c")), "no config.json")
    failed(fetch(str(tmp_path / "nowhere"), str(tmp_path / "c")), "is not a directory")
    nothing_left(tmp_path / "c")
