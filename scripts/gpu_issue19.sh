#!/usr/bin/env bash
# Issue 19's runs on a lent GPU machine, in one call (docs/GPU.md): the GPU tests, the copy
# kernels' bandwidth, TTFT of an 8B-architecture model, then the rest of the suite there.
# Every log and result lands in $OUT (or ./gpu-out).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
. scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt"
python3 -c "import torch, cupy, transformers; print(torch.__version__, cupy.__version__, transformers.__version__)" >> "$OUT/env.txt"
STEPS=${STEPS:-tests copy ttft}  # and `suite`: the whole default suite there
want() { [[ " $STEPS " == *" $1 "* ]]; }
section() { echo "=== $1"; shift; timeout "$@"; echo "=== rc $?"; }
want tests && section "pytest -m gpu" 200 python3 -m pytest -m gpu -p no:cacheprovider -q -s -rs \
    tests/kernels tests/integration/test_gpu_chain.py tests/integration/test_hf_cuda.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|FAIL|ratio|GB/s|^[a-z].*[0-9]$" | tail -30
want copy && section "gpu_copy" 150 python3 -m benchmarks.gpu_copy ${COPY_ARGS:-} 2>&1 | tee "$OUT/gpu_copy.log" | tail -25
want ttft && section "gpu_ttft" 300 python3 -m benchmarks.gpu_ttft ${TTFT_ARGS:-} 2>&1 | tee "$OUT/gpu_ttft.log" | grep -v "it/s" | tail -12
cp benchmarks/results/gpu_*.json "$OUT/" 2>/dev/null
want suite && section "suite on the GPU machine" 240 python3 -m pytest -p no:cacheprovider -q -n 12 -rf \
    ${SUITE_PATHS:-tests/unit tests/integration tests/fault} 2>&1 | tee "$OUT/suite.log" | tail -15
exit 0
