"""Host (Python) cost of one `cupa.decode` / `DecodePlan.run` call on the GPU.

Calls are enqueued back to back without synchronising, so when the host is slower than the GPU
the time per call is the host's. `--profile` adds a cProfile of `cupa.decode` (top entries by
cumulative time).

    python3 tools/host_overhead.py [--batch 8 --seq-len 4096] [--profile]
"""
import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupa  # noqa: E402
from decode_problem import add_problem_arguments, decode_problem  # noqa: E402


def per_call_us(cupy, call, calls):
    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=4096)
    add_problem_arguments(p)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    import cupy
    rng = np.random.default_rng(0)
    query, key, value, tables, lens, options = decode_problem(cupy, rng, args.batch,
                                                              args.seq_len, args)
    out = cupy.empty_like(query)
    plan = cupa.plan_decode(query, key, value, tables, lens, **options)
    run_options = {k: options[k] for k in ("query_start_loc",) if k in options}
    calls = {"cupa.decode": lambda: cupa.decode(query, key, value, tables, lens, out=out,
                                                **options),
             "DecodePlan.run": lambda: plan.run(query, key, value, tables, lens, out=out,
                                                **run_options)}
    for call in calls.values():  # compile and warm up
        call()
    for name, call in calls.items():
        print(f"{name}: {per_call_us(cupy, call, args.calls):.1f} us per call", flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            calls["cupa.decode"]()
        profile.disable()
        cupy.cuda.Device().synchronize()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(20)


if __name__ == "__main__":
    main()
