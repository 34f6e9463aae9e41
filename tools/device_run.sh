#!/usr/bin/env bash
# One device session: GPU tests, then benchmarks.
# Usage: tools/device_run.sh [tests|emulated|emulated-sanitizer|bench|generate|all|breadth]
#        [pytest args]
#   generate: the example engine at 8 and 32 prompts, 512 -> 256, graphs and eager, one json
#   emulated: the decode suites under the emulated AMD builds and the emulation's own tests:
#             the portable kernel at gfx942 (wave64) and gfx1100 (wave32), the matrix-core
#             kernel at gfx90a, gfx942 (MFMA), gfx1100 and gfx1201 (WMMA); CUPA_EMULATED_TARGETS
#             picks entries ("gfx942", "gfx942:portable").
#   emulated-sanitizer: compute-sanitizer's memcheck, racecheck and synccheck over
#             tools/sanitizer_probe.py under the emulated builds of gfx942, gfx1100 and gfx1201,
#             all at once (tests/gpu/test_gpu_sanitizer.py's emulated runs)
# Writes logs under $OUT (device tool) or ./out. Installs carried FlashInfer wheels if present:
# .whl/*.whl, or .whlx/*.tar.xz, the same wheels unpacked and xz-compressed (19 MB against 62 MiB,
# for when the wheels no longer fit the device's 64 MiB carry beside the tree), made with
#   mkdir -p /tmp/fi .whlx && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/fi; done
#   tar cJf .whlx/site.tar.xz -C /tmp/fi .   (and /.whlx/ in .git/info/exclude, as /.whl/)
# The GPU tests run as eight parallel pytest shards (their time is mostly the float64 numpy
# reference on the host's cores; CUPA_TESTS_TIMEOUT, default 480 s, limits each shard); the
# bench runs alone afterwards, so its timings see an idle GPU.
set -u
OUT="${OUT:-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
elif ls .whlx/*.tar.xz >/dev/null 2>&1; then
  mkdir -p /tmp/site && for t in .whlx/*.tar.xz; do tar xJf "$t" -C /tmp/site; done \
    && export PYTHONPATH=/tmp/site
fi
# The summed pytest summary lines of shard logs: "== total: N passed, N failed, N errors", and
# how many logs have no summary (a shard that timed out or crashed).
total_of() {
  for log in "$@"; do
    line=$(grep -E "[0-9]+ (passed|failed|errors?)" "$log" | tail -1); echo "${line:-no summary}"
  done | awk '/^no summary$/ { m++; next }
    { for (i = 2; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1);
      if ($i ~ /^failed/) f += $(i-1); if ($i ~ /^error/) e += $(i-1) } }
    END { printf "== total: %d passed, %d failed, %d errors, %d logs without a summary\n", p, f, e, m }'
}
what="${1:-all}"
shift || true
if [ "$what" = tests ] || [ "$what" = all ]; then
  shards=8
  for i in $(seq 0 $((shards - 1))); do
    CUPA_REQUIRE_GPU=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout ${CUPA_TESTS_TIMEOUT:-480} \
      python3 -m pytest -q -p no:cacheprovider --shard "$i/$shards" "$@" tests/gpu \
      tests/unit/test_hf_parity.py > "$OUT/gpu_tests_$i.log" 2>&1 &
  done
  wait
  for i in $(seq 0 $((shards - 1))); do
    echo "== shard $i/$shards: $(grep -E "passed|failed|error" "$OUT/gpu_tests_$i.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests_$i.log" | head -10
  done
  total_of "$OUT"/gpu_tests_*.log
fi
if [ "$what" = emulated ]; then
  # Each entry: an AMD target, emulated; ":portable" forces the portable kernel there (the
  # default picks the matrix-core kernel wherever it applies). Default: the six pairs of #21.
  # Each pair tests its own kernel only (CUPA_TEST_KERNEL_MODES=auto), CUPA_SKIP_OWN=1 skips
  # the emulation's own tests.
  if [ "${CUPA_SKIP_OWN:-0}" != 1 ]; then
    python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_amd_emulation.py "$@" \
      > "$OUT/emulation_tests.log" 2>&1
    echo "== emulation's own tests: $(grep -E "passed|failed|error" "$OUT/emulation_tests.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/emulation_tests.log" | head -10
  fi
  for entry in ${CUPA_EMULATED_TARGETS:-gfx942:portable gfx1100:portable gfx90a gfx942 gfx1100 gfx1201}; do
    target=${entry%%:*}; kernel=auto; [ "$entry" != "$target" ] && kernel=${entry#*:}
    name=${target}_$kernel
    shards=8
    for i in $(seq 0 $((shards - 1))); do
      CUPA_EMULATE=$target CUPA_KERNEL=$kernel CUPA_FUZZ_PER_CHUNK=${CUPA_FUZZ_PER_CHUNK:-16} \
        CUPA_TEST_KERNEL_MODES=auto \
        CUPA_REQUIRE_GPU=1 OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 timeout ${CUPA_EMULATED_TIMEOUT:-400} \
        python3 -m pytest -q -p no:cacheprovider --shard "$i/$shards" "$@" \
        tests/gpu/test_gpu_decode.py tests/gpu/test_gpu_fp8_decode.py tests/gpu/test_gpu_multi_token.py \
        tests/gpu/test_gpu_cache.py tests/gpu/test_gpu_host_path.py tests/gpu/test_gpu_fuzz.py \
        tests/gpu/test_gpu_selftest.py tests/gpu/test_gpu_kv_layout.py \
        > "$OUT/emulated_${name}_$i.log" 2>&1 &
    done
    wait
    for i in $(seq 0 $((shards - 1))); do
      echo "== $name shard $i/$shards: $(grep -E "passed|failed|error" "$OUT/emulated_${name}_$i.log" | tail -1)"
      grep -E "^(FAILED|ERROR)" "$OUT/emulated_${name}_$i.log" | head -5
    done
    echo "== $name $(total_of "$OUT"/emulated_${name}_*.log | cut -c4-)"
    cat "$OUT"/emulated_${name}_*.log > "$OUT/emulated_${name}.log" && rm "$OUT"/emulated_${name}_*.log
  done
fi
if [ "$what" = emulated-sanitizer ]; then
  for target in gfx942 gfx1100 gfx1201; do
    CUPA_EMULATE=$target CUPA_KERNEL=auto CUPA_REQUIRE_GPU=1 timeout ${CUPA_EMULATED_TIMEOUT:-400} \
      python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_sanitizer.py "$@" \
      > "$OUT/emulated_sanitizer_$target.log" 2>&1 &
  done
  wait
  for target in gfx942 gfx1100 gfx1201; do
    echo "== sanitizer at $target: $(grep -E "passed|failed|error" "$OUT/emulated_sanitizer_$target.log" | tail -1)"
    grep -E "^(FAILED|ERROR)" "$OUT/emulated_sanitizer_$target.log" | head -5
  done
fi
if [ "$what" = generate ]; then
  for graphs in --graphs --no-graphs; do
    timeout 100 python3 examples/bench_generate.py --prompts 8,32 --input-len 512 \
      --output-lens 256 --attention paged $graphs --json "$OUT/generate$graphs.json" 2>&1 | tail -8
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = [json.loads((out / f"generate{g}.json").read_text()) for g in ("--graphs", "--no-graphs")]
merged = dict(runs[0], graphs=[True, False], results=runs[0]["results"] + runs[1]["results"],
              roofline=runs[0]["roofline"] + runs[1]["roofline"])
(out / "generate.json").write_text(json.dumps(merged, indent=2))
PY
fi
if [ "$what" = breadth ]; then
  # The issue's "also within 10% of the best peer" configurations, one bench run each, and the
  # cache layouts and block sizes of v52 (timed without peers in session 47);
  # CUPA_BREADTH="group16 nhd" runs only those.
  while read -r name flags; do
    case " ${CUPA_BREADTH:-$name} " in *" $name "*) ;; *) continue ;; esac
    echo "== $name: $flags"
    timeout 170 python3 -m cupa bench $flags --json "$OUT/breadth_$name.json" </dev/null 2>&1 \
      | grep -v "^\s*\[\|INFO" | tail -12
  done <<'CONFIGS'
mha --heads 32 --kv-heads 32
group4 --heads 32 --kv-heads 8
group16 --heads 64 --kv-heads 4
bf16 --dtype bfloat16
head64 --head-size 64
block32 --block-size 32
head256 --head-size 256
head256_group16 --head-size 256 --heads 64 --kv-heads 4
head96 --head-size 96
head80_mha --head-size 80 --heads 32 --kv-heads 32
head192 --head-size 192
head112 --head-size 112
nhd --kv-layout NHD
block1 --block-size 1
block4 --block-size 4
CONFIGS
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  timeout "${CUPA_BENCH_TIMEOUT:-300}" python3 -m cupa bench --features --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 \
    | grep -v "^\s*\[\|INFO" | tee "$OUT/bench.log"
fi
