#!/usr/bin/env bash
# Issue 19's runs on a lent GPU machine, in one call (docs/GPU.md): the GPU tests, the copy
# kernels' bandwidth, TTFT of an 8B-architecture model, then the rest of the suite there.
# Every log and the results this run writes land in $OUT (or ./gpu-out).
# Lessons of 2026-11-29: the suite beside the GPU tests (on the CPU cores they left) doubled
# their time, and `timeout` cut both off before pytest's summary; so steps run one after
# another, and each failure's traceback is logged as it happens (KVTEST_REPORT_AT_ONCE).
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
. scripts/gpu_env.sh || exit 1
export KVTEST_REPORT_AT_ONCE=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/env.txt"
python3 -c "import torch, cupy, transformers; print(torch.__version__, cupy.__version__, transformers.__version__)" >> "$OUT/env.txt"
STEPS=${STEPS:-tests copy ttft}  # and `suite`: the whole default suite there
want() { [[ " $STEPS " == *" $1 "* ]]; }
section() { echo "=== $1"; shift; timeout "$@"; echo "=== rc $?"; }
# The integration tests first: the kernels' own tests (~170) take minutes.
want tests && section "pytest -m gpu" "${TESTS_S:-240}" python3 -m pytest -m gpu -p no:cacheprovider -v -s -rfEs \
    ${GPU_TESTS:-tests/integration/test_hf_cuda.py tests/integration/test_gpu_chain.py tests/kernels} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed|GB/s" | tail -40
want copy && section "gpu_copy" "${COPY_S:-150}" python3 -m benchmarks.gpu_copy ${COPY_ARGS:-} 2>&1 | tee "$OUT/gpu_copy.log" | tail -25
want ttft && section "gpu_ttft" "${TTFT_S:-300}" python3 -m benchmarks.gpu_ttft ${TTFT_ARGS:-} 2>&1 | tee "$OUT/gpu_ttft.log" | grep -v "it/s" | tail -12
find benchmarks/results -name 'gpu_*.json' -newer "$OUT/env.txt" -exec cp {} "$OUT/" \;
want suite && section "suite on the GPU machine" "${SUITE_S:-300}" python3 -m pytest -p no:cacheprovider -v -n "${SUITE_N:-12}" -rfE \
    ${SUITE_PATHS:-tests/unit tests/integration tests/fault} > "$OUT/suite.log" 2>&1
want suite && grep -E "FAILED|ERROR|passed|failed" "$OUT/suite.log" | tail -25
exit 0
