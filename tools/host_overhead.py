"""Host (Python) cost per call of cupa's entry points against the bare-launch floor L
(cupa.bench.host, the figures `python -m cupa bench` records as host_us), and optionally a
cProfile of `cupa.decode` on a bench problem.

    python3 tools/host_overhead.py [--profile --batch 8 --seq-len 4096]
"""
import argparse
import cProfile
import pstats
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupa  # noqa: E402
from cupa.bench.host import host_costs  # noqa: E402
from decode_problem import add_problem_arguments, decode_problem  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    add_problem_arguments(p)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    import cupy
    costs = host_costs(cupy)
    floor = costs["launch_floor"]
    for name, us in costs.items():
        print(f"{name:>14}: {us:6.1f} us per call  ({us / floor:.2f} L)", flush=True)
    if args.profile:
        rng = np.random.default_rng(0)
        query, key, value, tables, lens, options = decode_problem(cupy, rng, args.batch,
                                                                  args.seq_len, args)
        out = cupy.empty_like(query)
        cupa.decode(query, key, value, tables, lens, out=out, **options)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            cupa.decode(query, key, value, tables, lens, out=out, **options)
        profile.disable()
        cupy.cuda.Device().synchronize()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
