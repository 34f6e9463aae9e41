"""Run one decode configuration a few times, for a profiler (ncu / nsys) to capture.

    ncu --kernel-name regex:cupa_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        python3 tools/profile_decode.py --batch 16 --seq-len 16384 --kv-format fp8_e4m3
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupa  # noqa: E402
from cupa.bench import make_problem  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--dtype", default="float16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--query-len", type=int, default=1, help="new tokens per sequence")
    p.add_argument("--kv-format", default=None, help="fp8_e4m3 or fp8_e4m3fnuz")
    p.add_argument("--partition-size", type=int, default=None,
                   help="force the partition size (default: the planner's)")
    p.add_argument("--runs", type=int, default=4)
    args = p.parse_args()
    import cupy
    rng = np.random.default_rng(0)
    query, key, value, tables, lens, _ = make_problem(cupy, rng, args.batch, args.seq_len, args)
    options = {}
    if args.query_len > 1:
        query = cupy.random.standard_normal((args.batch * args.query_len,) + query.shape[1:],
                                            dtype=cupy.float32).astype(query.dtype)
        options["query_start_loc"] = np.arange(0, args.batch * args.query_len + 1,
                                               args.query_len, dtype=np.int32)
    if args.kv_format:
        scale = 0.02
        key = cupa.quantize_fp8(key, args.kv_format, scale)
        value = cupa.quantize_fp8(value, args.kv_format, scale)
        options.update(kv_format=args.kv_format, k_scale=scale, v_scale=scale)
    options["partition_size"] = args.partition_size
    for _ in range(args.runs):
        cupa.decode(query, key, value, tables, lens, max_seq_len=args.seq_len, **options)
    cupy.cuda.get_current_stream().synchronize()
    print("ok", cupa.plan_decode(query, key, value, tables, lens, max_seq_len=args.seq_len,
                                 **options).kernel)


if __name__ == "__main__":
    main()
