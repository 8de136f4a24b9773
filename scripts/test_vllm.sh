#!/usr/bin/env bash
# Set up .venv-vllm if needed (idempotent) and run the vLLM connector tests in it.
# Usage: bash scripts/test_vllm.sh [pytest args...]   (the lead's `make test-vllm` calls this)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
# -p no:cacheprovider: other engineers' runs share the tree; no .pytest_cache races.
exec .venv-vllm/bin/python -m pytest tests/vllm tests/kernels/test_kernels_vllm_own.py -m vllm \
  -p no:cacheprovider "$@"
