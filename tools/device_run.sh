#!/usr/bin/env bash
# One device session: GPU tests, then benchmarks. Usage: tools/device_run.sh [tests|bench|all]
# Writes logs under $OUT (device tool) or ./out. Install carried FlashInfer wheels if present.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
what="${1:-all}"
shift || true
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider -k "gpu or hf_parity" "$@" tests \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 150 python3 -m cupa bench --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
    | grep -v "^\s*\[" | tee "$OUT/bench.log"
fi
