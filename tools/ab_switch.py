"""Time two settings of cupa's dispatch switches against each other, interleaved, on each shape.

A planner or kernel-form experiment is an A/B within one process: both forms are planned on the
same arrays, then timed in alternating order (A, B, then B, A, ...), so that a drift of the
machine during the run lands on both. Timings as in `python -m cupa bench` (L2 flushed before
each launch, by writing unless --flush read; median of --iters launches), or with --eager as
the bench's eager column times a user's loop (--calls calls back to back, nothing between
them: the host's enqueue and the chaining of one call to the next count); each round's figure
is printed, and the medians' ratio.
The two forms' outputs are compared too (relative difference), which shows whether the forms
computed the same chunks in the same order (0) or not.

    python3 tools/ab_switch.py CUPA_DENSE=always CUPA_DENSE=never --shapes 64x4096,16x16384
    python3 tools/ab_switch.py CUPA_MERGE=cluster CUPA_MERGE=reduce --kv-format fp8_e4m3
    python3 tools/ab_switch.py CUPA_CHAINED_REDUCE=1 CUPA_CHAINED_REDUCE=0 --shapes longtail64
    python3 tools/ab_switch.py CUPA_STAGED_HEADS=never CUPA_STAGED_HEADS=auto --head-size 96
    python3 tools/ab_switch.py --eager CUPA_CHAINED_PHASE1=always CUPA_CHAINED_PHASE1=0

A shape is BxL or the name of one of the bench's ragged batches (cupa.bench.ragged), which gets
both length hints as in the bench.

A side is one or more comma-separated NAME=VALUE assignments of the switches read by
cupa.gpu.dispatch (its module docstring lists them); NAME= unsets one.
CUPA_PARTITION_SIZE=N is the tool's own: that side's plan takes N-token partitions. Compile
options compare the same way: a plan compiles its kernels when it is made, with
CUPA_EXTRA_OPTIONS as they are then, and cupa keeps one module per (device, variant, options),
so the two sides run two builds of a kernel:

    python3 tools/ab_switch.py CUPA_EXTRA_OPTIONS=-DCUPA_MMA_MIN_BLOCKS=3 CUPA_EXTRA_OPTIONS=

The planner reads a variant's residency once per process, from the first side's build: an
option that changes residency (registers, or shared memory through an experiment's host
change) leaves both sides planned alike.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupa  # noqa: E402
from cupa.bench.main import DEFAULT_SHAPES  # noqa: E402
from decode_problem import (RAGGED_BATCHES, add_problem_arguments, decode_problem,  # noqa: E402
                            ragged_problem)


def parse_side(text: str) -> dict:
    """'CUPA_A=x,CUPA_B=' -> {'CUPA_A': 'x', 'CUPA_B': None} (None: unset)."""
    side = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        if not sep or not name.startswith("CUPA_"):
            raise ValueError(f"a side is NAME=VALUE[,NAME=VALUE...] of CUPA_* switches, "
                             f"got {item!r}")
        side[name] = value or None
    return side


def round_orders(rounds: int) -> list:
    """Which side goes first in each round: A, B, then B, A, alternating."""
    return [(0, 1) if r % 2 == 0 else (1, 0) for r in range(rounds)]


EAGER_WARMUP = 10  # calls before an eager round's timed ones: the chain and the pool settle


def make_measure(cupy, args):
    """The timing of one round: launch -> microseconds a call (see the module docstring)."""
    from cupa.bench.harness import Timer, eager_us
    if args.eager:
        return lambda launch: eager_us(cupy, launch, calls=args.calls, warmup=EAGER_WARMUP)
    return Timer(cupy, args.iters, args.flush).median_us


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="side A: NAME=VALUE[,NAME=VALUE...]")
    p.add_argument("b", help="side B, the same way")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    add_problem_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--flush", choices=("read", "write"), default="write",
                   help="how L2 is flushed before each timed launch (as the bench's --flush)")
    p.add_argument("--eager", action="store_true",
                   help="time --calls calls back to back instead (the bench's eager column)")
    p.add_argument("--calls", type=int, default=100, help="calls of an --eager round")
    args = p.parse_args()
    sides = (parse_side(args.a), parse_side(args.b))

    import cupy
    from cupa.gpu import dispatch
    measure = make_measure(cupy, args)
    rng = np.random.default_rng(0)
    for shape in args.shapes.split(","):
        if shape in RAGGED_BATCHES:
            problem = ragged_problem(cupy, shape, args)
        else:
            batch, seq_len = (int(x) for x in shape.split("x"))
            problem = decode_problem(cupy, rng, batch, seq_len, args)
        query, key, value, tables, lens, options = problem
        plans = []
        for side in sides:
            side = dict(side)
            forced = side.pop("CUPA_PARTITION_SIZE", None)  # a tool-side switch: the plan's size
            dispatch.set_switches(side)
            sized = dict(options, partition_size=int(forced)) if forced else options
            plans.append(cupa.plan_decode(query, key, value, tables, lens, **sized))
        per_call = {k: options[k] for k in ("query_start_loc",) if k in options}
        outs = [cupy.asnumpy(plan.run(query, key, value, tables, lens, **per_call))
                .astype(np.float64) for plan in plans]
        diff = np.linalg.norm(outs[0] - outs[1]) / np.linalg.norm(outs[1])
        times = ([], [])
        for order in round_orders(args.rounds):
            for s in order:
                plan = plans[s]
                times[s].append(measure(
                    lambda: plan.run(query, key, value, tables, lens, **per_call)))
        a, b = (float(np.median(t)) for t in times)
        rounds = " | ".join(" ".join(f"{x:.1f}" for x in t) for t in times)
        print(f"{shape:>10}: A {a:8.1f} us, B {b:8.1f} us, A/B {a / b:.4f} (rounds {rounds}); "
              f"kernels {plans[0].kernel} / {plans[1].kernel}, outputs differ by {diff:.2e}",
              flush=True)
        del query, key, value, tables, plans, outs
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
