"""Per-phase times of the tensor-core kernels' workgroups (a kernel-development probe, GPU only).

Builds the kernels with -DCUPA_PHASE_STAMPS (see PHASE_* in cupa/kernels/mma/ops.cuh: thread 0
of each workgroup records clock64 at each phase mark), runs one decode per shape after a cache
flush, and prints the median and 90th percentile of each phase in microseconds, with the grid's
span and the gap between one workgroup's end and the next start on the same multiprocessor.

    python3 tools/phase_stamps.py --kv-heads 4 --shapes 128x1024,64x4096
"""
import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
extra = os.environ.get("CUPA_EXTRA_OPTIONS", "")
os.environ["CUPA_EXTRA_OPTIONS"] = (extra + " -DCUPA_PHASE_STAMPS").strip()

import cupy  # noqa: E402
import numpy as np  # noqa: E402

# The stamp table is a __device__ array of each compiled module: record the modules cupa builds.
MODULES = []
_RawModule = cupy.RawModule


class _RecordedModule(_RawModule):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        MODULES.append(self)


cupy.RawModule = _RecordedModule

import cupa  # noqa: E402
from decode_problem import add_problem_arguments, decode_problem  # noqa: E402

BLOCKS, COLUMNS = 16384, 16  # PHASE_BLOCKS, PHASE_COLUMNS in ops.cuh
# (mark, name of the phase that starts there), in kernel order; PHASE_DONE ends the last.
MARKS = [(0, "claim"), (1, "query + ids"), (2, "first chunk"), (3, "chunks"), (4, "end copies"),
         (5, "rows to shared"), (6, "merge + store"), (7, None)]
TIMER_START, TIMER_END, SM = 8, 9, 10
FLUSH_BYTES = 512 << 20


def stamp_tables():
    tables = []
    for module in MODULES:
        try:
            pointer = module.get_global("cupa_phase_stamps")
        except Exception:  # a module without stamps (the reduce, the portable kernel)
            continue
        tables.append(cupy.ndarray((BLOCKS, COLUMNS), dtype=cupy.uint64, memptr=pointer))
    return tables


def measure(batch, seq_len, args):
    rng = np.random.default_rng(0)
    q, k, v, tables, lens, options = decode_problem(cupy, rng, batch, seq_len, args)
    out = cupy.empty_like(q)
    cupa.decode(q, k, v, tables, lens, out=out, **options)  # compiles
    plan = cupa.plan_decode(q, k, v, tables, lens, **options)
    flush = cupy.empty(FLUSH_BYTES, dtype=cupy.uint8)
    for table in stamp_tables():
        table.fill(0)
    flush.fill(1)
    cupa.decode(q, k, v, tables, lens, out=out, **options)
    cupy.cuda.Device().synchronize()
    rows = [h[h[:, 7] != 0] for h in (cupy.asnumpy(t) for t in stamp_tables())]
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
    gaps = []
    for sm in np.unique(rows[:, SM]):
        on_sm = timer[rows[:, SM] == sm]
        for start in on_sm[:, 0]:
            ends = on_sm[:, 1][on_sm[:, 1] <= start]
            if ends.size:
                gaps.append((start - ends.max()) / 1e3)
    span = (timer[:, 1].max() - timer[:, 0].min()) / 1e3
    print(f"{args.heads}/{args.kv_heads} d{args.head_size} {batch}x{seq_len}: {len(rows)} "
          f"workgroups ({plan.partition_size}-token partitions), span {span:.1f} us, "
          f"{ghz:.2f} GHz")
    for name, us in phases.items():
        print(f"    {name:15s} {np.median(us):7.2f} us  (p90 {np.percentile(us, 90):7.2f})")
    if gaps:
        print(f"    slot gap        {np.median(gaps):7.2f} us  "
              f"(p90 {np.percentile(gaps, 90):7.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_problem_arguments(parser)
    parser.add_argument("--shapes", default="128x1024",
                        help="batch x sequence length, comma-separated")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        batch, seq_len = (int(x) for x in shape.split("x"))
        measure(batch, seq_len, args)


if __name__ == "__main__":
    main()
