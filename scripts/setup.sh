#!/usr/bin/env bash
# Create .venv and install everything kvstore needs, Debian packages included. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
APT_PACKAGES=(redis-server redis-tools)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  echo ">> apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
# torch first and pinned: a local CPU build of 2.13.0 is on these machines, while a looser pin
# downloads gigabytes of CUDA wheels. pyproject keeps torch>=2.4 so GPU users keep their build.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
# This checkout installed as `kvstore` before the distribution became kvstore-cache (the name
# `kvstore` on PyPI is another project's): two editable installs of one tree would both claim it.
if .venv/bin/pip show kvstore 2>/dev/null | grep -q "^Editable project location: $PWD\$"; then
  $PIP uninstall -y kvstore
fi
$PIP install -e ".[dev]"
echo ">> setup done: $(.venv/bin/python -c 'import torch, grpc; print("torch", torch.__version__, "grpc", grpc.__version__)')"
