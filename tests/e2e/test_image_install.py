"""The container image's recipe without Docker (none runs on these machines): deploy/docker/install.sh run
exactly as the Dockerfile's RUN lines run it, on a fresh copy of the repository, then a real `baton
scheduler` from the installed venv answering `baton health`; and the Dockerfile and .dockerignore read
for the rules the image keeps (every install step in install.sh, a non-root user, a gRPC health check,
no weights or caches in the image or its build context)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from harness import own_database

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
# The build arguments of `docker build --build-arg VARIANT=cpu --build-arg TORCH_INDEX_URL=none`: torch
# from pip's configured indexes (here the CPU wheel on disk; PyTorch's index is out of reach).
BUILD_ARGS = {"VARIANT": "cpu", "TORCH_INDEX_URL": "none"}
IMAGE_PREFIX = "/opt/baton"


def instructions() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (KEYWORD, arguments), continuation lines joined."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    found = []
    for line in text.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def arg_defaults() -> dict[str, str]:
    """Every ARG's default (later stages' bare ARGs inherit the global one)."""
    defaults: dict[str, str] = {}
    for keyword, rest in instructions():
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            defaults[name] = value
    return defaults


def install_runs() -> list[tuple[list[str], dict[str, str]]]:
    """The RUN lines that call install.sh: (the command's words, bind mounts target → source)."""
    runs = []
    for keyword, rest in instructions():
        if keyword != "RUN" or "install.sh" not in rest:
            continue
        words = shlex.split(rest)
        mounts = {}
        for word in [w for w in words if w.startswith("--mount=")]:
            options = dict(o.split("=", 1) for o in word.removeprefix("--mount=").split(","))
            if options.get("type") == "bind":
                mounts[options["target"]] = options.get("source", ".")
        runs.append(([w for w in words if not w.startswith("--mount=")], mounts))
    return runs


def image_command(words: list[str], mounts: dict[str, str], source: Path, prefix: Path) -> list[str]:
    """A RUN line's command with the build args filled in and the image's paths mapped to this machine's:
    each bind mount's target to its source in ``source`` (the build context), the venv to ``prefix``."""
    mapped = {target: str(source / path) for target, path in mounts.items()} | {IMAGE_PREFIX: str(prefix)}
    out = []
    for word in words:
        word = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: BUILD_ARGS[m.group(1) or m.group(2)], word)
        for target, path in sorted(mapped.items(), key=lambda kv: -len(kv[0])):
            if word == target or word.startswith(target + "/"):
                word = path + word[len(target) :]
                break
        out.append(word)
    return out


def fresh_copy(dest: Path) -> None:
    """The repository's tracked and untracked-but-not-ignored files, as a fresh clone (plus work in
    progress) holds them: no venv, no generated code, no caches."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not there
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Dockerfile's install steps, in order, run on a fresh copy; the venv's prefix."""
    tmp = tmp_path_factory.mktemp("image")
    source, prefix = tmp / "src", tmp / "opt-baton"
    fresh_copy(source)
    runs = install_runs()
    assert [r[0][r[0].index("--phase") + 1] for r in runs] == ["system", "python"]
    for words, mounts in runs:
        command = image_command(words, mounts, source, prefix)
        started = time.monotonic()
        done = subprocess.run(command, cwd="/", capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{shlex.join(command)}\n{done.stdout}{done.stderr[-6000:]}"
        print(f"{shlex.join(command)}: {time.monotonic() - started:.0f} s")
    shutil.rmtree(source)  # what the image build unmounts: the venv must not need it
    return prefix


def venv_env() -> dict[str, str]:
    """This environment without what points Python at the test run's own venv or source tree."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def run_installed(prefix: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """A command of the installed venv, away from any source tree (imports come from the venv alone)."""
    return subprocess.run(
        [str(prefix / "bin" / args[0]), *args[1:]],
        cwd="/",
        env=venv_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_installed_baton_runs_from_its_own_venv(installed: Path) -> None:
    helped = run_installed(installed, "baton", "--help")
    assert helped.returncode == 0, helped.stderr
    for command in ("scheduler", "worker", "gateway", "health", "fetch-model"):
        assert command in helped.stdout
    probe = run_installed(
        installed,
        "python",
        "-c",
        "import importlib.util as u, engine, baton.v1.gateway_pb2 as g, torch; "
        "print(engine.__file__); print(g.__file__); print(torch.__version__); "
        # (transformers is not among them: xgrammar, the structured-output engine, imports it at run time)
        "print([m for m in ('pytest', 'hypothesis', 'ruff', 'mypy', 'openai') if u.find_spec(m)])",
    )
    assert probe.returncode == 0, probe.stderr
    engine_file, generated, torch_version, dev_tools = probe.stdout.splitlines()
    assert engine_file.startswith(str(installed)) and generated.startswith(str(installed))  # non-editable
    assert torch_version.startswith("2.13.0")
    assert dev_tools == "[]"  # no test or dev extras in the image
    for name in ("cpu_ops.cpp", "bf16_dot.cpp"):
        kernel = Path(engine_file).parent / "csrc" / name
        assert kernel.is_file(), "the CPU kernels are compiled on the node from this source"


def test_a_scheduler_from_the_installed_venv_answers_the_health_check(
    installed: Path, redis_server: Any, tmp_path: Path
) -> None:
    log = tmp_path / "scheduler.log"
    env = {**venv_env(), "BATON_CACHE_DIR": str(tmp_path / "cache")}
    with log.open("w") as out:
        scheduler = subprocess.Popen(
            [
                str(installed / "bin" / "baton"),
                "scheduler",
                "--redis-url",
                own_database(redis_server.url, 9),
                "--port",
                "0",
            ],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        address = wait_for_address(scheduler, log)
        healthy = run_installed(installed, "baton", "health", address)
        assert (healthy.returncode, healthy.stdout.strip()) == (0, "SERVING"), healthy.stderr
    finally:
        scheduler.send_signal(signal.SIGTERM)
        try:
            scheduler.wait(30)
        except subprocess.TimeoutExpired:
            scheduler.kill()
            raise
    gone = run_installed(installed, "baton", "health", address)
    assert gone.returncode == 1, gone.stdout + gone.stderr
    assert "Traceback" not in gone.stderr


def wait_for_address(proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not (found := re.search(r"serving on (\S+:\d+)", log.read_text())):
        assert proc.poll() is None, f"the scheduler exited: {log.read_text()}"
        assert time.monotonic() < deadline, f"the scheduler did not start: {log.read_text()}"
        time.sleep(0.1)
    return found.group(1)


def test_the_system_phase_asks_apt_for_what_is_missing_only(tmp_path: Path) -> None:
    # dpkg and apt-get stand-ins: this machine has every package, and a test must not install any.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dpkg-query").write_text(
        '#!/bin/sh\nfor a; do :; done\ncase "$a" in python3.11-dev|ninja-build) exit 1;; esac\n'
        'printf "install ok installed"\n'
    )
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/apt.log\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    script = ROOT / "deploy" / "docker" / "install.sh"
    done = subprocess.run(
        ["bash", str(script), "--phase", "system", "--variant", "cuda"],
        env=env,
        capture_output=True,
        text=True,
    )
    if os.geteuid() != 0:
        assert done.returncode == 1 and "run this phase as root" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "apt.log").read_text().splitlines() == [
        "update -qq",
        "install -y -qq --no-install-recommends ninja-build python3.11-dev",
    ]


# --- the Dockerfile and .dockerignore, read ----------------------------------------------------------

USER_SETUP = re.compile(r"^(groupadd|useradd|install -d|mkdir|chown|chmod)\b")
INSTALLERS = re.compile(r"\b(pip3?|python3? -m pip|uv|npm|apt-get|apt|dpkg|conda|curl|wget)\b")


def test_every_install_step_runs_through_install_sh() -> None:
    for keyword, rest in instructions():
        if keyword != "RUN":
            continue
        command = " ".join(w for w in shlex.split(rest) if not w.startswith("--mount="))
        if "install.sh" in command:
            assert re.fullmatch(r"bash \S*install\.sh( --[\w-]+ \S+)+", command), command
        else:
            steps = [s.strip() for s in command.split("&&")]
            assert all(USER_SETUP.match(s) for s in steps), f"an install step outside install.sh: {command}"
        assert not INSTALLERS.search(command.replace("install.sh", "")), command
    # The two phases, for the variant being built, and the venv from the mounted source.
    runs = [" ".join(words) for words, _ in install_runs()]
    assert runs[0].endswith("--phase system --variant ${VARIANT}"), runs[0]
    assert "--phase python --variant ${VARIANT} --prefix /opt/baton --source /src" in runs[1], runs[1]


def test_the_image_runs_as_a_fixed_non_root_user_with_a_grpc_health_check() -> None:
    found = instructions()
    defaults = arg_defaults()
    user = [rest for keyword, rest in found if keyword == "USER"][-1]
    uid, _, gid = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], user).partition(":")
    assert uid.isdigit() and int(uid) >= 1000 and gid.isdigit(), user  # numeric: runAsNonRoot can check it
    health = [rest for keyword, rest in found if keyword == "HEALTHCHECK"]
    assert len(health) == 1 and re.search(r"CMD baton health .*\$\{BATON_HEALTH_ADDRESS\}", health[0])
    assert ("ENTRYPOINT", '["baton"]') in found
    env = " ".join(rest for keyword, rest in found if keyword == "ENV")
    assert "BATON_CACHE_DIR=/cache" in env and ("VOLUME", '["/cache"]') in found
    assert defaults["CPU_BASE_IMAGE"].startswith("python:3.11-") and "cuda" in defaults["CUDA_BASE_IMAGE"]


def test_no_weights_caches_or_kernels_go_into_the_image() -> None:
    for keyword, rest in instructions():
        if keyword in ("COPY", "ADD"):
            assert not re.search(r"safetensors|gguf|\.bin\b|cache|models?/|\.venv", rest), rest
        if keyword == "RUN":  # weights are fetched onto a volume and kernels built on the node, at run time
            assert not re.search(r"fetch-model|prepare-model|gguf_convert|cpu_ops|kernels_enabled", rest), (
                rest
            )


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for a context path: the last pattern that matches it or a directory above it wins
    (``!`` re-includes); ``*`` stays within a path element, ``**`` spans any number of them."""
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        body = pattern.removeprefix("!").strip("/")
        regex = re.escape(body).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        regex = regex.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            ignored = not negated
    return ignored


def test_the_build_context_keeps_out_local_state_and_keeps_what_install_sh_needs() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for out in (
        ".git/HEAD",
        ".venv/bin/python",
        ".tools/bin/helm",
        ".peers/llama-server",
        ".pytest_cache/x",
        ".mypy_cache/x",
        "engine/__pycache__/llm.cpython-311.pyc",
        "baton.egg-info/PKG-INFO",
        "models/llama/model.safetensors",
        "x.gguf",
        "proto/baton/v1/gateway_pb2.py",
        "tests/conftest.py",
    ):
        assert dockerignored(out, patterns), out
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    needed = [
        n
        for n in listed
        if n.split("/")[0]
        in (
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
            "proto",
        )
    ]
    needed += [
        "pyproject.toml",
        "constraints.txt",
        "README.md",
        "deploy/docker/install.sh",
        "engine/csrc/cpu_ops.cpp",
        "engine/csrc/bf16_dot.cpp",
    ]
    assert [n for n in needed if dockerignored(n, patterns)] == []
