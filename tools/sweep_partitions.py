"""Time cupa decode over a range of forced partition sizes, next to the planner's own choice.

Used to tune the planner (cupa/plan.py, the variants' min_partition / workgroups_per_sm): one run
on the GPU prints, per shape, the time at each partition size and the ratio of the best to the
planner's pick. Timings as in `python -m cupa bench` (L2 flushed by writing, median of --iters).

    python3 tools/sweep_partitions.py [--kv-format fp8_e4m3] [--query-len 4] [--shapes 1x4096,...]

The dispatch switches pick kernels: CUPA_KERNEL=portable, CUPA_ROW_CHUNKS=always|never (more than
8 query rows as 8-row chunks of the 8-column kernel, or on the 16-row kernel),
CUPA_DENSE=always|never (the 8-column kernel's dense form at head 64 and for fp8 at head 128,
or its default form; cupa.gpu.dispatch).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupa  # noqa: E402
from cupa.bench.main import DEFAULT_SHAPES
from cupa.bench.harness import Timer  # noqa: E402
from decode_problem import (FP8_SCALE, add_problem_arguments, batch_shapes,  # noqa: E402
                            decode_problem)


_READ = r"""
extern "C" __global__ void sweep_read(const uint4* a, const uint4* b, unsigned long long n,
                                      unsigned int* sink) {
    unsigned int acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const uint4 x = a[i], y = b[i];
        acc ^= x.x ^ x.y ^ x.z ^ x.w ^ y.x ^ y.y ^ y.z ^ y.w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
}
"""
_kernel = {}


def stream_read(cupy, key, value):
    """Streams both caches once (the byte floor of a decode over every block): eight workgroups
    of 256 threads a multiprocessor, grid-stride."""
    if not _kernel:
        _kernel["read"] = cupy.RawKernel(_READ, "sweep_read")
        _kernel["sink"] = cupy.zeros(1, dtype=cupy.uint32)
        _kernel["grid"] = 8 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    n = key.nbytes // 16
    _kernel["read"]((_kernel["grid"],), (256,), (key, value, np.uint64(n), _kernel["sink"]))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES))
    add_problem_arguments(p)
    p.add_argument("--sizes", default="64,128,256,512,1024,2048,4096",
                   help="partition sizes to force (those >= the sequence are skipped)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--check", action="store_true",
                   help="also print ||out - ref|| / ||ref|| against cupa.reference (sequence 0 of "
                        "each shape, at the planner's choice)")
    p.add_argument("--floors", action="store_true",
                   help="also time a plain streaming read of the same bytes and cupa with the "
                        "blocks in order (identity block tables), at the planner's choice")
    args = p.parse_args()
    import cupy
    rng = np.random.default_rng(0)
    timer = Timer(cupy, args.iters)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    for batch, seq_len in batch_shapes(args.shapes):
        sweep_shape(cupy, timer, rng, batch, seq_len, sizes, args)


def sweep_shape(cupy, timer, rng, batch, seq_len, sizes, args):
    """Prints one shape's line (and its floors line with --floors)."""
    query, key, value, tables, lens, options = decode_problem(cupy, rng, batch, seq_len, args)
    out = cupy.empty_like(query)

    def time(partition_size, block_tables=tables):
        return timer.median_us(lambda: cupa.decode(query, key, value, block_tables, lens, out=out,
                                                   partition_size=partition_size, **options))
    chosen = cupa.plan_decode(query, key, value, tables, lens, **options).partition_size
    planner = time(None)
    if args.check:
        check(cupy, query, key, value, tables, lens, out, options, args)
    results = {s: time(s) for s in sizes if s < seq_len}
    if sizes:
        results[seq_len] = time(seq_len)
    else:  # --sizes '': the planner's choice only
        results[chosen] = planner
    if args.floors:
        kv_bytes = 2 * key.nbytes
        floor = timer.median_us(lambda: stream_read(cupy, key, value))
        in_order = time(None, cupy.arange(tables.size, dtype=cupy.int32).reshape(tables.shape))
        print(f"{batch}x{seq_len} floors: read {kv_bytes / 1e6:.1f} MB {floor:.1f} us "
              f"({kv_bytes / floor / 1e6:.2f} TB/s); cupa blocks in order {in_order:.1f} us "
              f"vs shuffled {planner:.1f} us", flush=True)
    best = min(results, key=results.get)
    row = "  ".join(f"{s}:{us:.1f}" for s, us in results.items())
    label = f"{args.kv_format or args.dtype}, {args.query_len} new token(s)"
    print(f"{batch}x{seq_len} [{label}] planner P={chosen}: {planner:.1f} us | {row} | "
          f"best P={best} {results[best]:.1f} us = {results[best] / planner:.3f}x planner",
          flush=True)


def check(cupy, query, key, value, tables, lens, out, options, args):
    """Prints the relative error of `out` (the last timed launch) for sequence 0 against the
    float64 reference, on that sequence's blocks copied to the host."""
    from cupa.reference import paged_decode_reference
    q_len = args.query_len
    n = int(cupy.asnumpy(cupy.asarray(lens))[0])
    blocks = cupy.asnumpy(tables[0])[: -(-n // key.shape[2])]
    k, v = (cupy.asnumpy(x[cupy.asarray(blocks)]) for x in (key, value))
    if args.kv_format:
        k, v = (cupa.dequantize_fp8(x, args.kv_format, FP8_SCALE) for x in (k, v))
    ref, _ = paged_decode_reference(cupy.asnumpy(query[:q_len]), k, v,
                                    np.arange(len(blocks))[None], [n],
                                    query_start_loc=np.array([0, q_len]))
    got = cupy.asnumpy(out[:q_len]).astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"  check: ||out - ref|| / ||ref|| = {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
