#!/usr/bin/env bash
# Installs guidellm, the vLLM project's load-testing tool, into a venv of its own, from PyPI as its users
# install it, for tests/e2e/test_guidellm.py.
#
# Why a venv of its own: guidellm pins its own click, datasets and httpx, which Baton's venv need not
# share. torch is held to the CPU wheel on disk by the repository's constraints.txt: unpinned, guidellm's
# `torch` dependency pulls a CUDA build of several GB.
#
# Usage: deploy/peers/install-guidellm.sh [DIR]   (default: .venv-guidellm at the repository root;
# idempotent: a second run with guidellm 0.8.1 in place does nothing)
set -euo pipefail

GUIDELLM_VERSION="0.8.1"
PYTHON="${PYTHON:-python3}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dir="${1:-$root/.venv-guidellm}"

installed() {
    [[ -x "$dir/bin/guidellm" ]] && [[ "$("$dir/bin/python" -c \
        'import importlib.metadata as m; print(m.version("guidellm"))' 2>/dev/null)" == "$GUIDELLM_VERSION" ]]
}

if installed; then
    exit 0
fi

if [[ ! -x "$dir/bin/python" ]]; then
    "$PYTHON" -m venv "$dir"
    # What `python -m venv` writes itself from Python 3.13 on: git never sees the venv.
    echo '*' >"$dir/.gitignore"
fi
"$dir/bin/python" -m pip --disable-pip-version-check -q install -c "$root/constraints.txt" \
    "guidellm==$GUIDELLM_VERSION"

installed || { echo "error: $dir/bin/guidellm is not guidellm $GUIDELLM_VERSION after the install" >&2; exit 1; }
