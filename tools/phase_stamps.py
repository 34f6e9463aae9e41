"""Per-phase times of the tensor-core kernels' workgroups (a kernel-development probe, GPU only).

Builds the kernels with -DCUPA_PHASE_STAMPS (see PHASE_* in cupa/kernels/mma/ops.cuh: thread 0
of each workgroup records clock64 at each phase mark), runs one decode per shape after a cache
flush, and prints the median and 90th percentile of each phase in microseconds, with the grid's
span and the gap between one workgroup's end and the next start on the same multiprocessor.
Each multiprocessor's timeline follows: the share of the grid's span in which it had no, one or
more workgroups streaming (from their first copies to their last chunk), split into before its
first stream, between streams and after its last; and how far apart the workgroups of a
multiprocessor start after the first wave (from each start to the nearest other on the same
multiprocessor: near 0 when its slots end and restart together). --save DIR writes each shape's
stamp rows there (.npy).

    python3 tools/phase_stamps.py --kv-heads 4 --shapes 128x1024,64x4096
"""
import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

# The stamp table is a __device__ array of each compiled module: main() records the modules cupa
# builds (record_modules).
MODULES = []


def record_modules(cupy):
    """Have every cupy.RawModule made from now on appended to MODULES."""
    class RecordedModule(cupy.RawModule):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            MODULES.append(self)

    cupy.RawModule = RecordedModule


BLOCKS, COLUMNS = 16384, 16  # PHASE_BLOCKS, PHASE_COLUMNS in ops.cuh
# (mark, name of the phase that starts there), in kernel order; PHASE_DONE ends the last.
MARKS = [(0, "claim"), (1, "query + ids"), (2, "first chunk"), (3, "chunks"), (4, "end copies"),
         (5, "rows to shared"), (6, "merge + store"), (7, None)]
TIMER_START, TIMER_END, SM = 8, 9, 10
FLUSH_BYTES = 512 << 20


def stamp_tables(cupy):
    tables = []
    for module in MODULES:
        try:
            pointer = module.get_global("cupa_phase_stamps")
        except Exception:  # a module without stamps (the reduce, the portable kernel)
            continue
        tables.append(cupy.ndarray((BLOCKS, COLUMNS), dtype=cupy.uint64, memptr=pointer))
    return tables


def measure(cupy, cupa, batch, seq_len, args):
    from decode_problem import decode_problem
    rng = np.random.default_rng(0)
    q, k, v, tables, lens, options = decode_problem(cupy, rng, batch, seq_len, args)
    out = cupy.empty_like(q)
    cupa.decode(q, k, v, tables, lens, out=out, **options)  # compiles
    plan = cupa.plan_decode(q, k, v, tables, lens, **options)
    flush = cupy.empty(FLUSH_BYTES, dtype=cupy.uint8)
    for table in stamp_tables(cupy):
        table.fill(0)
    flush.fill(1)
    cupa.decode(q, k, v, tables, lens, out=out, **options)
    cupy.cuda.Device().synchronize()
    rows = [h[h[:, 7] != 0] for h in (cupy.asnumpy(t) for t in stamp_tables(cupy))]
    rows = np.concatenate([r for r in rows if len(r)]) if any(len(r) for r in rows) else None
    if rows is None:
        print(f"{batch}x{seq_len}: no stamps (not a tensor-core plan?)")
        return
    clocks = rows[:, :8].astype(np.float64)
    timer = rows[:, [TIMER_START, TIMER_END]].astype(np.float64)
    ghz = np.median((clocks[:, 7] - clocks[:, 0]) / np.maximum(timer[:, 1] - timer[:, 0], 1))
    phases = {name: (clocks[:, b] - clocks[:, a]) / ghz / 1e3
              for (a, name), (b, _) in zip(MARKS, MARKS[1:])}
    phases["total"] = (clocks[:, 7] - clocks[:, 0]) / ghz / 1e3
    gaps, apart = [], []
    for sm in np.unique(rows[:, SM]):
        on_sm = timer[rows[:, SM] == sm]
        for i, start in enumerate(on_sm[:, 0]):
            ends = on_sm[:, 1][on_sm[:, 1] <= start]
            if ends.size:
                gaps.append((start - ends.max()) / 1e3)
                others = np.delete(on_sm[:, 0], i)
                apart.append(np.abs(others - start).min() / 1e3)
    span = (timer[:, 1].max() - timer[:, 0].min()) / 1e3
    print(f"{args.heads}/{args.kv_heads} d{args.head_size} {batch}x{seq_len}: {len(rows)} "
          f"workgroups ({plan.partition_size}-token partitions), span {span:.1f} us, "
          f"{ghz:.2f} GHz")
    for name, us in phases.items():
        print(f"    {name:15s} {np.median(us):7.2f} us  (p90 {np.percentile(us, 90):7.2f})")
    if gaps:
        print(f"    slot gap        {np.median(gaps):7.2f} us  "
              f"(p90 {np.percentile(gaps, 90):7.2f})")
        print(f"    starts apart    {np.median(apart):7.2f} us  "
              f"(p90 {np.percentile(apart, 90):7.2f})")
    # A phase mark's global time: the workgroup's start plus its clock ticks since then.
    streaming = timer[:, :1] + (clocks[:, [2, 4]] - clocks[:, :1]) / ghz
    shares = streaming_shares(rows[:, SM], streaming, timer[:, 0].min(), timer[:, 1].max())
    print("    multiprocessors streaming, share of the span: "
          + ", ".join(f"{name} {share:.1%}" for name, share in shares.items()))
    if args.save:
        np.save(Path(args.save) / f"stamps_{args.kv_heads}_{args.head_size}_{batch}x{seq_len}.npy",
                rows)


def streaming_shares(sms, intervals, begin, end):
    """Mean over multiprocessors of the share of [begin, end] in which none of their workgroups
    streamed (split into before the first stream, between streams, after the last), one did, or
    more than one did. intervals: each workgroup's (first copies, last chunk) times."""
    totals = dict.fromkeys(["none before", "none between", "none after", "one", "more"], 0.0)
    for sm in np.unique(sms):
        on_sm = intervals[sms == sm]
        edges = sorted([(t, 1) for t in on_sm[:, 0]] + [(t, -1) for t in on_sm[:, 1]])
        busy, last = 0, begin
        for t, step in edges:
            if busy == 0:
                key = "none before" if last == begin else "none between"
            else:
                key = "one" if busy == 1 else "more"
            totals[key] += t - last
            busy, last = busy + step, t
        totals["none after"] += end - last
    count = len(np.unique(sms)) * (end - begin)
    return {name: value / count for name, value in totals.items()}


def main():
    extra = os.environ.get("CUPA_EXTRA_OPTIONS", "")
    os.environ["CUPA_EXTRA_OPTIONS"] = (extra + " -DCUPA_PHASE_STAMPS").strip()
    import cupy
    record_modules(cupy)
    import cupa
    from decode_problem import add_problem_arguments, batch_shapes
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(parser)
    parser.add_argument("--shapes", default="128x1024",
                        help="batch x sequence length, comma-separated")
    parser.add_argument("--save", default=None, help="a folder for each shape's stamp rows")
    args = parser.parse_args()
    for batch, seq_len in batch_shapes(args.shapes):
        measure(cupy, cupa, batch, seq_len, args)


if __name__ == "__main__":
    main()
