"""How close a decode launch is to its compute bound: the same launch timed on the bench's
shuffled paged KV and with every block id folded into a small set of blocks that stays in L2
(same grid, same instructions, almost no DRAM traffic). When the aliased time approaches the
normal one, the kernel's compute per chunk, not DRAM, co-limits it.

    python3 tools/compute_bound.py [--kv-format fp8_e4m3] [--shapes 64x4096,...] [--alias 256]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

import cupa  # noqa: E402
from cupa.bench.harness import Timer  # noqa: E402
from decode_problem import add_problem_arguments, batch_shapes, decode_problem  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="64x4096,16x16384,256x2048")
    p.add_argument("--alias", type=int, default=256, help="blocks the aliased tables use")
    p.add_argument("--iters", type=int, default=30)
    add_problem_arguments(p)
    args = p.parse_args()
    import cupy
    rng = np.random.default_rng(0)
    timer = Timer(cupy, args.iters)
    for batch, seq_len in batch_shapes(args.shapes):
        query, key, value, tables, lens, options = decode_problem(cupy, rng, batch, seq_len, args)
        out = cupy.empty_like(query)

        def time(block_tables):
            return timer.median_us(lambda: cupa.decode(query, key, value, block_tables, lens,
                                                       out=out, **options))
        normal = time(tables)
        aliased = time(tables % min(args.alias, key.shape[0]))
        print(f"{text} [{args.kv_format or args.dtype}, block {args.block_size}] "
              f"normal {normal:.1f} us, L2-aliased {aliased:.1f} us "
              f"({aliased / normal:.2f} of normal)", flush=True)


if __name__ == "__main__":
    main()
