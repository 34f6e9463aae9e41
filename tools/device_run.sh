#!/usr/bin/env bash
# One device session: GPU tests, then benchmarks. Usage: tools/device_run.sh [tests|bench|all]
# Writes logs under $OUT (device tool) or ./out. Installs carried FlashInfer wheels if present.
# The GPU tests run as four parallel pytest processes (their time is mostly the float64 numpy
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
  groups=("tests/test_gpu_decode.py"
          "tests/test_gpu_multi_token.py tests/test_gpu_cache.py"
          "tests/test_gpu_fp8_decode.py"
          "tests/test_gpu_fp8.py tests/test_gpu_examples.py tests/test_hf_parity.py tests/test_cli.py tests/test_decode_numpy.py tests/test_fp8.py")
  for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086
    timeout 480 python3 -m pytest -q -p no:cacheprovider -k "gpu or hf_parity" "$@" \
      ${groups[$i]} > "$OUT/gpu_tests_$i.log" 2>&1 &
  done
  wait
  for i in "${!groups[@]}"; do
    echo "== ${groups[$i]}"; grep -E "passed|failed|error" "$OUT/gpu_tests_$i.log" | tail -3
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$i.log" | head -10
  done
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout 300 python3 -m cupa bench --features --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
    | grep -v "^\s*\[\|INFO" | tee "$OUT/bench.log"
fi
