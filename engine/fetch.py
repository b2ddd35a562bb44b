"""`baton fetch-model URI DEST`: a model's files into a directory, atomically and idempotently.

The Helm chart's init container runs it to fill a cache volume before a worker starts, so it needs the
standard library only (no torch, no Hub client). Sources:

* ``hf://org/repo[@revision]``: the Hugging Face Hub's HTTP API (``HF_ENDPOINT``, ``HF_TOKEN``); the files
  a Baton model directory needs (config, safetensors weights, tokenizer) and no other weight format.
* ``https://…`` / ``http://…``: a ``.tar``, ``.tar.gz``/``.tgz`` or ``.zip`` archive (a presigned
  object-storage URL, say), extracted safely; an archive of one top directory gives that directory.
* ``file://…`` or a plain path: a local directory, copied.

Everything lands in ``DEST.partial-<pid>-<host>`` first and is renamed into place once verified
(config.json and safetensors weights, or a .gguf), with a marker saying where it came from: the same URI
again does nothing, another one is refused unless forced; pods racing on a shared volume each download,
and the first complete copy wins. A URL's query is never recorded or printed: a presigned
URL's signature is a secret, and it changes with every signing of the same object.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import http.client
import json
import os
import shutil
import socket
import stat
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, TextIO, TypeVar

T = TypeVar("T")

MARKER = ".baton-fetch.json"
_CHUNK = 1 << 20
_INDEX = "model.safetensors.index.json"
# Besides the weights, what engine.loader and engine.tokenizer read from a model directory.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_HUB_FILES = frozenset({"config.json", "generation_config.json", _INDEX, *_TOKENIZER_FILES})
_HUB_ANSWERS = {
    401: "no such repository, or a private or gated one and the token is missing or invalid",
    403: "the token has no access (a gated model: accept its terms on the Hub with this account)",
    404: "no such repository, revision or file",
}
_HF_ENDPOINT = "https://huggingface.co"
# Answers worth another try (the server is busy or restarting); any other HTTP error is final.
_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_PROGRESS_EVERY_S = 5.0
_STALE_S = 3600.0  # a DEST.partial-* nothing wrote to for this long belongs to a dead fetch


class FetchError(Exception):
    """A fetch that cannot succeed as asked; the message tells the operator why (printed, no traceback)."""


class HttpStatusError(FetchError):
    """A final HTTP error answer (not worth a retry)."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(f"HTTP {status} from {url}")
        self.status = status


class _Interrupted(Exception):
    """A transfer that broke off (refused, reset, timed out, cut short): worth another try."""


@dataclass(frozen=True, slots=True)
class FetchConfig:
    """How `fetch_model` reaches its sources."""

    hf_endpoint: str = _HF_ENDPOINT
    hf_token: str | None = None
    timeout_s: float = 60.0  # per connect and per read (a stalled server), not per file
    retries: int = 3  # further tries after a broken transfer, each resuming where the last stopped


def config_from_env(env: Mapping[str, str] = os.environ, **fields: Any) -> FetchConfig:
    """The one place fetching reads the environment: ``HF_ENDPOINT`` and ``HF_TOKEN`` (as the Hub's own
    tools do); ``fields`` set the rest."""
    endpoint = env.get("HF_ENDPOINT") or _HF_ENDPOINT
    return FetchConfig(hf_endpoint=endpoint.rstrip("/"), hf_token=env.get("HF_TOKEN") or None, **fields)


@dataclass(frozen=True, slots=True)
class Source:
    """A parsed URI: ``kind`` is hf, archive or dir; ``location`` the repo, URL or absolute path;
    ``identity`` what the marker records and messages print (never a URL's query or credentials)."""

    kind: str
    location: str
    identity: str
    revision: str = ""


def redact(url: str) -> str:
    """``url`` without its query, fragment and user:password (a presigned URL's signature is a secret)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def parse_source(uri: str) -> Source:
    """``hf://org/repo[@revision]``, ``http(s)://…`` (an archive), ``file://…`` or a plain path."""
    scheme = uri.partition("://")[0].lower() if "://" in uri else ""
    if scheme == "hf":
        repo, _, revision = uri[len("hf://") :].partition("@")
        repo = repo.strip("/")
        names = repo.split("/")
        bad_revision = "@" in uri and not revision
        if not repo or len(names) > 2 or any(n in ("", ".", "..") for n in names) or bad_revision:
            raise FetchError(f"{uri!r} is not hf://org/repo[@revision]")
        revision = revision or "main"
        return Source("hf", repo, f"hf://{repo}@{revision}", revision)
    if scheme in ("http", "https"):
        return Source("archive", uri, redact(uri))
    if scheme == "file":
        parts = urllib.parse.urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise FetchError(f"{uri!r}: a file:// URI names a local path (file:///path)")
        return _dir_source(Path(urllib.parse.unquote(parts.path)))
    if scheme:
        raise FetchError(
            f"unsupported URI scheme {scheme}:// (use hf://org/repo[@revision], an https:// URL of an "
            "archive — for object storage a presigned URL —, file:// or a local path)"
        )
    return _dir_source(Path(uri))


def _dir_source(path: Path) -> Source:
    return Source("dir", str(path.absolute()), path.absolute().as_uri())


def fetch_model(
    uri: str, dest: Path, config: FetchConfig, *, force: bool = False, log: TextIO = sys.stderr
) -> bool:
    """Fetches ``uri`` into the directory ``dest`` (see the module's docstring); progress goes to ``log``.
    False if ``dest`` already held it. Raises `FetchError` (and `OSError` for local trouble, a full disk)."""
    source = parse_source(uri)
    dest = dest.absolute()
    if _holds(dest, source.identity, force):
        print(f"{dest} already holds {source.identity}: nothing to fetch", file=log)
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Pods sharing a volume all run as pid 1 or so: the host name (the pod's) keeps their work apart,
    # and lets a restarted init container find its own leftover.
    work = dest.with_name(f"{dest.name}.partial-{os.getpid()}-{socket.gethostname()}")
    _clear_leftovers(dest, work, log)
    work.mkdir()
    try:
        model = work / "model"
        http = _Http(config, log)
        print(f"fetching {source.identity} into {dest}", file=log)
        if source.kind == "hf":
            extra = _fetch_hub(source, model, http, config)
        elif source.kind == "archive":
            extra = _fetch_archive(source, model, work, http)
        else:
            extra = _fetch_dir(source, model, log)
        files = verify_model_dir(model)
        fetched_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = {"uri": source.identity, "files": files, "fetched_at": fetched_at, **extra}
        (model / MARKER).write_text(json.dumps(record, indent=1) + "\n")
        if not _commit(model, dest, work, source.identity, force):
            print(f"{dest} was completed by another fetch of {source.identity} meanwhile", file=log)
            return False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = sum(files.values())
    print(f"fetched {source.identity}: {len(files)} files, {total / 2**20:.1f} MiB in {dest}", file=log)
    return True


def _clear_leftovers(dest: Path, work: Path, log: TextIO) -> None:
    """Removes this fetch's own leftover and any other that nothing has written to for an hour (a live
    fetch writes at least every ``timeout_s``): a crashed fetch of a large model leaves gigabytes."""
    for partial in dest.parent.glob(f"{dest.name}.partial-*"):
        with contextlib.suppress(OSError):
            last = max((p.lstat().st_mtime for p in partial.rglob("*")), default=partial.lstat().st_mtime)
            if partial == work or time.time() - last > _STALE_S:
                print(f"removing {partial}, left by an interrupted fetch", file=log)
                shutil.rmtree(partial)


def _commit(model: Path, dest: Path, work: Path, identity: str, force: bool) -> bool:
    """Renames the verified model into place: one rename, so DEST is absent, old or complete, never
    partial. False if a concurrent fetch of the same model got there first (this copy is dropped)."""
    try:
        if force and (dest.exists() or dest.is_symlink()):
            dest.rename(work / "replaced")  # removed with the rest of work
        model.rename(dest)  # onto an empty directory too; never onto a non-empty one
        return True
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST) and _holds(dest, identity, force=False):
            return False
        if e.errno in (errno.EXDEV, errno.EBUSY):
            raise FetchError(
                f"cannot rename the fetched model onto {dest} ({e.strerror}): DEST must be a directory "
                "inside the volume (e.g. /models/NAME), not the volume's mount point"
            ) from None
        raise


def _holds(dest: Path, identity: str, force: bool) -> bool:
    """True if ``dest`` already holds the model from ``identity``; raises if it holds something else."""
    if force or not (dest.exists() or dest.is_symlink()):
        return False
    recorded = None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no marker, or not ours
        recorded = json.loads((dest / MARKER).read_text()).get("uri")
    if recorded == identity:
        return True
    if recorded is not None:
        raise FetchError(f"{dest} holds {recorded}, not {identity}: pass --force to replace it")
    if dest.is_dir() and not any(dest.iterdir()):
        return False  # an empty directory (made ahead of time): fill it
    raise FetchError(f"{dest} exists and holds no model fetched by baton: pass --force to replace it")


def verify_model_dir(path: Path) -> dict[str, int]:
    """Checks ``path`` is a loadable model — config.json and safetensors weights (every shard its index
    names), or a .gguf file — and returns its files (relative name → bytes)."""
    files = {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}
    if any(name.endswith(".gguf") and "/" not in name for name in files):
        return files
    try:
        json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise FetchError("no config.json: not a model directory") from None
    except ValueError as e:
        raise FetchError(f"config.json is not JSON ({e})") from None
    if _INDEX in files:
        missing = sorted(set(_index_shards(path / _INDEX)) - set(files))
        if missing:
            raise FetchError(f"{_INDEX} names weight files that are missing: {', '.join(missing)}")
    elif not any(name.endswith(".safetensors") and "/" not in name for name in files):
        raise FetchError("no *.safetensors weights next to config.json (and no .gguf file)")
    return files


def _index_shards(index: Path) -> list[str]:
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise FetchError(f"{index.name} is not a safetensors index ({type(e).__name__}: {e})") from None
    for name in shards:
        _plain_name(name, index.name)
    return shards


def _plain_name(name: str, where: str) -> str:
    """``name`` if it is a plain file name (no directory, no ..): names a server sends become paths here."""
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
        raise FetchError(f"{where} names an unsafe file {name!r}")
    return name


# --- sources ---------------------------------------------------------------------------------------


def _fetch_hub(source: Source, model: Path, http: _Http, config: FetchConfig) -> dict[str, Any]:
    """The files a Baton model directory needs, listed by the Hub's API at the revision, then resolved."""
    repo, revision = source.location, urllib.parse.quote(source.revision, safe="")
    auth = {"Authorization": f"Bearer {config.hf_token}"} if config.hf_token else {}
    api = f"{config.hf_endpoint}/api/models/{repo}/revision/{revision}"

    def resolve(name: str) -> str:
        return f"{config.hf_endpoint}/{repo}/resolve/{revision}/{urllib.parse.quote(name)}"

    try:
        info = http.get_json(api, auth)
        if not isinstance(info, dict):
            raise FetchError(f"{api} did not answer a model's description")
        listed = {
            s["rfilename"] for s in info.get("siblings") or [] if isinstance(s, dict) and "rfilename" in s
        }
        top = {name for name in listed if "/" not in name}  # subfolders hold other formats (original/, onnx/)
        names = sorted(top & _HUB_FILES)
        model.mkdir()
        if _INDEX in top:  # a sharded checkpoint: exactly the shards its index names (not consolidated.*)
            http.download(resolve(_INDEX), model / _INDEX, auth, _INDEX)
            shards = _index_shards(model / _INDEX)
            missing = sorted(set(shards) - top)
            if missing:
                raise FetchError(f"{source.identity}: {_INDEX} names files the repository lacks: {missing}")
            names.remove(_INDEX)
        else:
            shards = sorted(name for name in top if name.endswith(".safetensors"))
        if not shards:
            others = sorted(n for n in listed if n.endswith((".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5")))
            raise FetchError(
                f"{source.identity} has no *.safetensors weights (Baton loads safetensors checkpoints); "
                f"it has {', '.join(others[:5]) or 'no weight files'}"
            )
        for name in names + shards:
            http.download(resolve(name), model / _plain_name(name, "the Hub"), auth, name)
    except HttpStatusError as e:
        raise FetchError(_hub_message(e.status, source, config)) from None
    return {"revision_sha": info.get("sha")}


def _hub_message(status: int, source: Source, config: FetchConfig) -> str:
    why = _HUB_ANSWERS.get(status, "an error")
    token = "HF_TOKEN is set" if config.hf_token else "HF_TOKEN is not set"
    return f"the Hub answered HTTP {status} for {source.identity} at {config.hf_endpoint}: {why} ({token})"


def _fetch_archive(source: Source, model: Path, work: Path, http: _Http) -> dict[str, Any]:
    """Downloads the archive next to the model (resumable), extracts it safely, and keeps its content."""
    archive, extracted = work / "archive", work / "extracted"
    name = PurePosixPath(urllib.parse.urlsplit(source.location).path).name or "archive"
    http.download(source.location, archive, {}, name)
    extracted.mkdir()
    try:
        with archive.open("rb") as f:
            zipped = f.read(2) == b"PK" and zipfile.is_zipfile(f)
        if not zipped and not tarfile.is_tarfile(archive):
            raise FetchError(f"{source.identity} is not a .tar, .tar.gz/.tgz or .zip archive")
        _extract(archive, extracted, zipped)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise FetchError(f"{source.identity}: a corrupt archive ({type(e).__name__}: {e})") from None
    archive.unlink()  # the space back before the model is renamed into place
    entries = [p for p in extracted.iterdir() if p.name != "__MACOSX"]
    root = entries[0] if len(entries) == 1 and entries[0].is_dir() else extracted
    root.rename(model)
    return {}


def _extract(archive: Path, root: Path, zipped: bool) -> None:
    # Member by member, regular files and directories only: nothing in it can point outside root.
    if zipped:
        with zipfile.ZipFile(archive) as zf:
            for info in zf.infolist():
                link = stat.S_ISLNK(info.external_attr >> 16)
                kind = "link" if link else "dir" if info.is_dir() else "file"
                _extract_member(root, info.filename, kind, functools.partial(zf.open, info))
    else:
        with tarfile.open(archive) as tar:  # plain, gzip, bzip2 or xz
            for member in tar:
                kind = "dir" if member.isdir() else "file" if member.isfile() else "link"
                _extract_member(root, member.name, kind, functools.partial(tar.extractfile, member))


def _extract_member(root: Path, name: str, kind: str, open_data: Callable[[], IO[bytes] | None]) -> None:
    """One member under ``root``; absolute names and .. (path traversal), links and devices are refused."""
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or (path.parts and ":" in path.parts[0]):
        raise FetchError(f"unsafe archive member {name!r} (an absolute path or ..): refusing to extract")
    if kind == "link":
        raise FetchError(f"archive member {name!r} is a link or a special file: archive the files themselves")
    target = root.joinpath(*path.parts)
    if kind == "dir":
        target.mkdir(parents=True, exist_ok=True)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    data = open_data()
    assert data is not None  # a regular file always has data
    with data, target.open("wb") as out:
        shutil.copyfileobj(data, out, _CHUNK)


def _fetch_dir(source: Source, model: Path, log: TextIO) -> dict[str, Any]:
    src = Path(source.location)
    if not src.is_dir():
        raise FetchError(f"{src} is not a directory")

    def copy(a: str, b: str) -> object:  # symlinks (a Hub cache's snapshot) are followed: files land here
        print(f"  {Path(a).relative_to(src)}", file=log)
        return shutil.copy2(a, b)

    shutil.copytree(src, model, ignore=shutil.ignore_patterns(MARKER), copy_function=copy)
    return {}


# --- HTTP ------------------------------------------------------------------------------------------


class _Http:
    """urllib with bounded timeouts, retries that resume a broken download (Range), progress lines."""

    def __init__(self, config: FetchConfig, log: TextIO) -> None:
        self.config, self.log = config, log

    def get_json(self, url: str, headers: Mapping[str, str]) -> Any:
        def once() -> Any:
            with self._open(url, headers) as response:
                body = _read(response, None)
            try:
                return json.loads(body)
            except ValueError:
                raise FetchError(f"{redact(url)} did not answer JSON") from None

        return self._retrying(redact(url), once)

    def download(self, url: str, path: Path, headers: Mapping[str, str], label: str) -> int:
        """Streams ``url`` into ``path`` in chunks; returns its size. A retry asks for the rest only."""
        path.unlink(missing_ok=True)
        return self._retrying(label, lambda: self._download_once(url, path, headers, label))

    def _download_once(self, url: str, path: Path, headers: Mapping[str, str], label: str) -> int:
        have = path.stat().st_size if path.exists() else 0
        asked = {**headers, **({"Range": f"bytes={have}-"} if have else {})}
        try:
            response = self._open(url, asked)
        except HttpStatusError as e:
            if e.status != 416 or not have:
                raise
            path.unlink()  # "range not satisfiable": what we hold is not a prefix of the file
            raise _Interrupted("the server refused to resume; starting over") from None
        with response:
            length = response.headers.get("Content-Length")
            content_range = response.headers.get("Content-Range", "")  # bytes START-END/TOTAL
            resumed = have > 0 and response.status == 206 and content_range.startswith(f"bytes {have}-")
            if response.status == 206 and not resumed:
                path.unlink(missing_ok=True)
                raise _Interrupted("the server answered another range; starting over")
            if not resumed:
                have = 0  # the server sent the whole file
            total = have + int(length) if length is not None and length.isdigit() else None
            started, next_report = time.monotonic(), time.monotonic() + _PROGRESS_EVERY_S
            with path.open("ab" if resumed else "wb") as out:
                while chunk := _read(response, _CHUNK):
                    out.write(chunk)
                    have += len(chunk)
                    if time.monotonic() >= next_report:
                        next_report = time.monotonic() + _PROGRESS_EVERY_S
                        print(f"  {label}: {_size(have, total)}", file=self.log, flush=True)
                out.flush()
                os.fsync(out.fileno())  # the marker, written last, must never outlive the data
        if total is not None and have < total:
            raise _Interrupted(f"the connection closed after {have} of {total} bytes")
        seconds = time.monotonic() - started
        print(f"  {label}: {_size(have, None)} in {seconds:.1f} s", file=self.log, flush=True)
        return have

    def _open(self, url: str, headers: Mapping[str, str]) -> http.client.HTTPResponse:
        request = urllib.request.Request(url, headers={"User-Agent": "baton-fetch-model"})
        for key, value in headers.items():
            if key == "Authorization":  # never forwarded on a redirect (the Hub's CDN needs no token)
                request.add_unredirected_header(key, value)
            else:
                request.add_header(key, value)
        try:
            response: http.client.HTTPResponse = urllib.request.urlopen(
                request, timeout=self.config.timeout_s
            )
            return response
        except urllib.error.HTTPError as e:
            e.close()
            if e.code in _RETRY_STATUSES:
                raise _Interrupted(f"HTTP {e.code}") from e
            raise HttpStatusError(e.code, redact(url)) from None
        except (OSError, http.client.HTTPException) as e:  # refused, unknown host, timed out, reset
            raise _Interrupted(str(getattr(e, "reason", e)) or type(e).__name__) from e

    def _retrying(self, what: str, attempt: Callable[[], T]) -> T:
        for n in range(self.config.retries + 1):
            try:
                return attempt()
            except _Interrupted as e:
                if n == self.config.retries:
                    raise FetchError(f"{what}: {e} (gave up after {n + 1} tries)") from None
                pause = min(0.5 * 2**n, 8.0)
                print(f"  {what}: {e}; trying again in {pause:.1f} s", file=self.log, flush=True)
                time.sleep(pause)
        raise AssertionError("unreachable")


def _read(response: http.client.HTTPResponse, size: int | None) -> bytes:
    """A read from the network; a broken connection is an interruption (a retry), not a local error."""
    try:
        return response.read(size) if size is not None else response.read()
    except (OSError, http.client.HTTPException) as e:
        raise _Interrupted(f"{type(e).__name__}: {e}") from e


def _size(done: int, total: int | None) -> str:
    mib = done / 2**20
    return f"{mib:.1f} MiB" if not total else f"{mib:.1f} of {total / 2**20:.1f} MiB ({100 * done // total}%)"
