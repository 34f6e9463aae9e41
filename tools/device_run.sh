#!/usr/bin/env bash
# One device session: GPU tests, then benchmarks. Usage: tools/device_run.sh [tests|bench|all]
# Writes logs under $OUT (device tool) or ./out. Installs carried FlashInfer wheels if present.
# The GPU tests run as eight parallel pytest shards (their time is mostly the float64 numpy
# reference on the host's cores); the bench runs alone afterwards, so its timings see an idle GPU.
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
  shards=8
  for i in $(seq 0 $((shards - 1))); do
    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout 480 python3 -m pytest -q -p no:cacheprovider \
      -k "gpu or hf_parity" --shard "$i/$shards" "$@" tests > "$OUT/gpu_tests_$i.log" 2>&1 &
  done
  wait
  for i in $(seq 0 $((shards - 1))); do
    echo "== shard $i/$shards: $(grep -E "passed|failed|error" "$OUT/gpu_tests_$i.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$i.log" | head -10
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 300 python3 -m cupa bench --features --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
    | grep -v "^\s*\[\|INFO" | tee "$OUT/bench.log"
fi
