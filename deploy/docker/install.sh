#!/usr/bin/env bash
# Installs Baton the way its container image does: deploy/docker/Dockerfile runs every install step
# through this script, and CI runs it on a fresh copy of the repository
# (tests/e2e/test_image_install.py), so the image cannot drift from what is tested.
#
#   install.sh [--phase system|python|all] [--variant cpu|cuda] [--prefix DIR] [--source DIR]
#              [--python EXE] [--torch-index-url URL|auto|none]
#
# Phases, in the order `all` (the default) runs them:
#   system  the OS packages Baton needs at run time, through apt-get (root). gcc/g++/ninja stay in the
#           image on purpose: the CPU kernels are compiled on the node's own CPU at first start
#           (-march=native, into BATON_CACHE_DIR) and Triton compiles its launchers on GPU nodes.
#           Packages already installed are not asked for again; when none is missing, nothing runs.
#   python  a venv at PREFIX: torch (the pin in SOURCE/constraints.txt), the generated gRPC code, then
#           Baton from SOURCE, non-editable and without the test/dev extras; then a smoke check.
#
# --torch-index-url: where torch comes from. `none` (the default, also TORCH_INDEX_URL's) asks pip's
# configured indexes (PyPI's torch for Linux is a CUDA build); `auto` means PyTorch's CPU index for
# --variant cpu and the configured indexes for cuda; anything else is an index URL used for torch.
# Idempotent: a second run reuses the venv and leaves an installed torch as it is.
set -euo pipefail

phase=all
variant=cpu
prefix=/opt/baton
source_dir=""
python=python3.11
torch_index_url="${TORCH_INDEX_URL:-none}"
readonly CPU_TORCH_INDEX=https://download.pytorch.org/whl/cpu

log() { printf '[install.sh] %s\n' "$*" >&2; }
die() { printf '[install.sh] error: %s\n' "$*" >&2; exit 1; }
# Prints a command, then runs it: the build log shows every step as it would be typed.
run() { printf '[install.sh] + %s\n' "$*" >&2; "$@"; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit "${1:-2}"; }

while (($#)); do
  case "$1" in
    --phase) phase="${2:?}"; shift 2 ;;
    --variant) variant="${2:?}"; shift 2 ;;
    --prefix) prefix="${2:?}"; shift 2 ;;
    --source) source_dir="${2:?}"; shift 2 ;;
    --python) python="${2:?}"; shift 2 ;;
    --torch-index-url) torch_index_url="${2:?}"; shift 2 ;;
    -h | --help) usage 0 ;;
    *) log "unknown argument: $1"; usage 2 ;;
  esac
done
case "$phase" in
  system | python | all) ;;
  *) die "--phase must be system, python or all (not '$phase')" ;;
esac
case "$variant" in
  cpu | cuda) ;;
  *) die "--variant must be cpu or cuda (not '$variant')" ;;
esac

system_packages() {
  # Run time: a C/C++ toolchain and ninja for torch's extension builder (the CPU kernels), and CA
  # certificates for `baton fetch-model` over https. The CUDA base (Ubuntu) brings no Python of its own;
  # its headers are for Triton's launchers. The CPU base (python:3.11-slim) has Python and its headers.
  local wanted=(ca-certificates gcc g++ libc6-dev ninja-build)
  if [[ "$variant" == cuda ]]; then
    wanted+=(python3.11 python3.11-venv python3.11-dev)
  fi
  command -v dpkg-query >/dev/null || die "the system phase needs a Debian/Ubuntu system (dpkg and apt); \
install ${wanted[*]} yourself and run --phase python"
  local missing=() pkg
  for pkg in "${wanted[@]}"; do
    [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" == "install ok installed" ]] || missing+=("$pkg")
  done
  if ((${#missing[@]} == 0)); then
    log "system packages: all present (${wanted[*]})"
    return
  fi
  ((EUID == 0)) || die "system packages missing (${missing[*]}): run this phase as root"
  log "system packages: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  run apt-get update -qq
  run apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# Copies SOURCE minus local state into a scratch directory: the source may be read-only (the image
# build mounts it) and the build writes the generated gRPC code and setuptools' build/ next to it.
stage_source() {
  local dest="$1"
  run tar -C "$source_dir" -cf - \
    --exclude=./.git --exclude=./.venv --exclude='./.venv-*' --exclude=./.tools --exclude=./.peers \
    --exclude=./build --exclude='*.egg-info' --exclude=__pycache__ --exclude=.mypy_cache \
    --exclude=.ruff_cache --exclude=.pytest_cache --exclude=.hypothesis . |
    tar -C "$dest" -xf -
}

python_packages() {
  [[ -n "$source_dir" ]] || die "--phase python needs --source DIR (the repository)"
  source_dir="$(cd "$source_dir" && pwd)"
  [[ -f "$source_dir/pyproject.toml" ]] || die "$source_dir has no pyproject.toml"
  local torch_pin
  torch_pin="$(grep -E '^torch==' "$source_dir/constraints.txt")" || die "constraints.txt pins no torch"

  if [[ -x "$prefix/bin/python" ]]; then
    log "venv: reusing $prefix"
  else
    command -v "$python" >/dev/null || die "no $python on the PATH (--python EXE)"
    run "$python" -m venv "$prefix"
    # A distribution's bundled pip can be too old for today's wheel metadata (Ubuntu 22.04's is).
    run "$prefix/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  fi
  local py="$prefix/bin/python"
  "$py" -c 'import sys; assert sys.version_info[:2] >= (3, 11), sys.version' || die "$prefix: Python < 3.11"
  local pip=("$py" -m pip install --quiet --disable-pip-version-check --no-input --progress-bar off)

  local torch_index=()
  case "$torch_index_url" in
    none | "") ;;
    auto) [[ "$variant" == cpu ]] && torch_index=(--index-url "$CPU_TORCH_INDEX") ;;
    *) torch_index=(--index-url "$torch_index_url") ;;
  esac
  run "${pip[@]}" -c "$source_dir/constraints.txt" "${torch_index[@]}" "$torch_pin"
  if [[ "$variant" == cpu ]] && "$py" -c 'import sys, torch; sys.exit(torch.version.cuda is None)'; then
    log "warning: --variant cpu got a CUDA torch build ($torch_pin from pip's indexes); \
--torch-index-url auto takes PyTorch's CPU build"
  fi

  local stage
  # No "-" in the name: pip would take it for name-version and keep the wheel it builds in its cache.
  stage="$(mktemp -d "${TMPDIR:-/tmp}/batonsrc.XXXXXX")"
  # shellcheck disable=SC2064  # expand now: the trap must remove this very directory
  trap "rm -rf '$stage'" EXIT
  stage_source "$stage"
  # The wire contract's Python code is generated, not committed: grpcio-tools, grpcio and protobuf as
  # Baton itself depends on them (read from pyproject.toml, so the two cannot differ).
  local codegen_pins
  mapfile -t codegen_pins < <("$py" -c 'import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
wanted = {"grpcio", "grpcio-tools", "protobuf"}
print("\n".join(d for d in deps if re.split(r"[<>=!~ ;\[]", d, maxsplit=1)[0] in wanted))' \
    "$stage/pyproject.toml")
  ((${#codegen_pins[@]} == 3)) ||
    die "pyproject.toml: expected grpcio, grpcio-tools and protobuf pins, found: ${codegen_pins[*]}"
  run "${pip[@]}" -c "$source_dir/constraints.txt" "${codegen_pins[@]}"
  (cd "$stage" && run "$py" proto/build.py)
  # Non-editable: the venv must not depend on the source directory, which the image build unmounts.
  run "${pip[@]}" -c "$source_dir/constraints.txt" "$stage"

  log "smoke check"
  # From / so that the imports resolve to the venv, never to a source tree in the working directory.
  (cd / && run "$prefix/bin/baton" --help >/dev/null)
  (cd / && run "$py" - <<'PY'
import pathlib
import sys

import torch

import baton.v1.gateway_pb2_grpc, engine, kv_transfer, scheduler.server, services.cli  # noqa: F401

# The CPU kernels are compiled at a node's first start from their C++ source, which must ship in the
# package: without it every node would silently serve on the slower torch ops.
for name in ("cpu_ops.cpp", "bf16_dot.cpp"):
    kernel = pathlib.Path(engine.__file__).parent / "csrc" / name
    if not kernel.is_file():
        sys.exit(f"{kernel} is not installed: the package must ship the kernel source (engine's package data)")
print(f"[install.sh] imports and kernel source: ok (torch {torch.__version__})", file=sys.stderr)
PY
  )
  log "installed Baton into $prefix"
}

log "phase=$phase variant=$variant prefix=$prefix source=${source_dir:-none}"
if [[ "$phase" == system || "$phase" == all ]]; then
  system_packages
fi
if [[ "$phase" == python || "$phase" == all ]]; then
  python_packages
fi
