"""A short run of every kernel family, for compute-sanitizer (memcheck, racecheck, initcheck,
synccheck): the portable kernel per dtype and head size, both tensor-core kernels, fp8 caches,
the cluster merge, the chained reduce and the cache write. Device tables hold block ids outside
the cache and lengths past the table's capacity, which the kernels must treat as empty.

    compute-sanitizer --tool racecheck --racecheck-report hazard python3 tools/sanitizer_probe.py

tests/gpu/test_gpu_sanitizer.py runs it under each tool. Prints one line per call and "probe done".
Under CUPA_EMULATE=<gfx target> (the emulated AMD build, docs/amd_emulation.md) "auto" is the
matrix-core kernel and every merge is the reduce launch: no cluster merge, no chained reduce.
"""
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupy  # noqa: E402

import cupa  # noqa: E402
from cupa.gpu import dispatch  # noqa: E402

HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)


def problem(rng, dtype, head_size, group, *, kv_heads=2, lens=(1, 130, 700), block_size=16):
    """Device arrays of a small decode, its tables poisoned past each sequence's blocks (ids
    outside the cache) and one length past the table's capacity."""
    blocks = 4 + sum(-(-n // block_size) for n in lens)
    shape = (blocks, kv_heads, block_size, head_size)
    key = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
    value = cupy.asarray(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
    width = max(-(-n // block_size) for n in lens) + 1
    tables = rng.integers(blocks, 2**30, size=(len(lens), width)).astype(np.int32)
    tables[:, 1::2] *= -1
    for s, n in enumerate(lens):
        used = -(-n // block_size)
        tables[s, :used] = rng.integers(0, blocks, used)
    seq_lens = np.array(lens, np.int32)
    seq_lens[-1] = width * block_size + 5  # past the capacity: clamped by the kernels
    query = cupy.asarray(rng.standard_normal((len(lens), kv_heads * group, head_size),
                                             dtype=np.float32)).astype(dtype)
    return query, key, value, cupy.asarray(tables), cupy.asarray(seq_lens)


def run(label, *args, **options):
    out = cupa.decode(*args, **options)
    cupy.cuda.Device().synchronize()
    print(f"{label}: ok", flush=True)
    return out


def run_fp8(label, query, key, value, tables, lens):
    codes = (cupa.quantize_fp8(x, "fp8_e4m3", 0.05) for x in (key, value))
    run(label, query, *codes, tables, lens, kv_format="fp8_e4m3", k_scale=0.05, v_scale=0.05,
        partition_size=256)


def main():
    rng = np.random.default_rng(0)
    os.environ["CUPA_KERNEL"] = "portable"
    dispatch.reload_switches()
    for dtype in ("float16", "bfloat16", "float32"):
        for head_size in HEAD_SIZES:
            for group in (1, 4, 8):
                run(f"portable {dtype} d{head_size} group {group}",
                    *problem(rng, dtype, head_size, group), partition_size=256)
    for head_size in (80, 128):
        run_fp8(f"portable fp8 d{head_size}", *problem(rng, "float16", head_size, 4))
    os.environ["CUPA_KERNEL"] = "auto"
    emulated = bool(os.environ.get("CUPA_EMULATE"))
    cores = "matrix cores" if emulated else "tensor cores"
    for merge in ("reduce",) if emulated else ("reduce", "cluster"):
        os.environ["CUPA_MERGE"] = merge
        dispatch.reload_switches()
        for dtype in ("float16", "bfloat16"):
            # 80, 96 and 112 at their own width, 192 at 256 (catalogue.staged_head_size).
            for head_size in (64, 80, 96, 112, 128, 192, 256):
                run(f"{cores} {dtype} d{head_size} group 8 ({merge})",
                    *problem(rng, dtype, head_size, 8), partition_size=256)
            run(f"{cores} 16-row {dtype} group 32 ({merge})",
                *problem(rng, dtype, 128, 32), partition_size=256)
            if emulated and dtype == "float16":
                # Two row tiles where wavefront pairs share a tile: RDNA3 at 96 (and 128
                # above), RDNA4 at 192 (catalogue.ONE_TILE_HEAD_SIZES, decode_matrix.cu SPLIT).
                for head_size in (96, 192):
                    run(f"{cores} 16-row {dtype} d{head_size} group 32 ({merge})",
                        *problem(rng, dtype, head_size, 32), partition_size=256)
            # fp8 rows at 80, 96 and 112 at their own width; 80 and 112 end mid column block.
            for head_size in (80, 96, 112, 128):
                run_fp8(f"{cores} fp8 {dtype} d{head_size} ({merge})",
                        *problem(rng, dtype, head_size, 8))
            run_fp8(f"{cores} 16-row fp8 {dtype} d112 group 32 ({merge})",
                    *problem(rng, dtype, 112, 32))
    for chained in () if emulated else ("1", "0"):
        os.environ.update(CUPA_MERGE="reduce", CUPA_CHAINED_REDUCE=chained)
        dispatch.reload_switches()
        run(f"reduce, chained={chained}", *problem(rng, "float16", 128, 8), partition_size=128)
    for kv_format in (None, "fp8_e4m3"):
        cache = cupa.PagedKVCache(1, 64, 16, 2, 128, "float16", backend="gpu",
                                  kv_format=kv_format)
        slots = cache.extend(["a", "b"], [40, 3])
        rows = cupy.asarray(rng.standard_normal((43, 2, 128), dtype=np.float32)).astype("float16")
        cache.write(0, slots, rows, rows)
        cupy.cuda.Device().synchronize()
        print(f"cache write ({kv_format}): ok", flush=True)
    print("probe done", flush=True)


if __name__ == "__main__":
    main()
