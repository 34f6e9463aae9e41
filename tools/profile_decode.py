"""Run one decode configuration a few times, for a profiler (ncu / nsys) to capture.

    ncu --kernel-name regex:cupa_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        python3 tools/profile_decode.py --batch 16 --seq-len 16384 --kv-format fp8_e4m3
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupa  # noqa: E402
from decode_problem import add_problem_arguments, decode_problem  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=16384)
    add_problem_arguments(p)
    p.add_argument("--partition-size", type=int, default=None,
                   help="force the partition size (default: the planner's)")
    p.add_argument("--runs", type=int, default=4)
    args = p.parse_args()
    import cupy
    rng = np.random.default_rng(0)
    query, key, value, tables, lens, options = decode_problem(cupy, rng, args.batch,
                                                              args.seq_len, args)
    options["partition_size"] = args.partition_size
    for _ in range(args.runs):
        cupa.decode(query, key, value, tables, lens, **options)
    cupy.cuda.get_current_stream().synchronize()
    print("ok", cupa.plan_decode(query, key, value, tables, lens, **options).kernel)


if __name__ == "__main__":
    main()
