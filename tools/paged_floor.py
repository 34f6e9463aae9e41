"""What paging costs a decode's reads: bare-read floors in the decode's own grid, beside cupa and
torch SDPA (a GPU-only probe for the performance docs' floors).

For each shape, one bench problem (shuffled blocks, cupa.bench.make_problem) and the planner's
partitions. Every floor kernel runs cupa's grid of one workgroup of 128 threads per (partition,
KV head, sequence), copies its K/V into shared memory as cupa's ring does (cp.async, two to
three steps of 32 KB in flight), holds --per-sm workgroups a multiprocessor (by its shared
memory, as cupa's ring sets cupa's: two for the 8-column and 16-row kernels at head 128), and
does nothing else (no products, no merge, no output). They differ in what a workgroup must
learn before its first K/V load:

- dense: nothing. Each (sequence, KV head) is one contiguous run of tokens, as SDPA's dense
  [B, Hkv, L, D] copy of the KV is (the same bytes, reinterpreted).
- paged: the sequence's length, then its partition's block ids, then the blocks: two dependent
  round trips, as cupa's partitions took before v28.
- paged, ids early: the block ids asked for with the length (cupa's one-wave grids since v29).
- in order: the same with every sequence's blocks in order (identity block tables), so that
  the shuffle's cost (DRAM locality) shows apart from the lookups'. cupa runs that way too.
- cupa's copies: the copy pattern of cupa's KvRing (chunk_floor) in the shuffled blocks: 64-token
  chunks in a ring of KvRing's stages, each thread's 16-byte unit of rows a pass apart, rows at
  their own width (as KvRing stages heads 80, 96 and 112), one wait and one
  barrier a chunk; with rows that leave threads without a copy slot, also "all warps", the slots
  spread over every warp (v42's pattern). What cupa adds above this row is its products'.
- cupa's copies + R reads + C cycles (--stand-in R,C, repeatable): the same with a stand-in for
  the products on each chunk, after its copies are issued: R 16-byte shared-memory reads of the
  chunk's stage a thread, then C clock cycles of issuing. It bounds how much work a chunk can
  carry before its copies stop hiding it.

Next to them: the grid-stride read of the same bytes (the read floor of docs/performance.md,
tools/sweep_partitions.py's),
cupa's decode and SDPA on the dense copy, all timed as the bench times (L2 flushed by writing,
median of --iters), in one process.

    python3 tools/paged_floor.py --shapes 1x4096,1x32768,32x2048,128x1024
    python3 tools/paged_floor.py --kv-heads 4 --shapes 1x4096,32x2048,128x1024
    python3 tools/paged_floor.py --head-size 96 --shapes 64x4096,16x16384,128x1024
    python3 tools/paged_floor.py --head-size 96 --shapes 64x4096 --stand-in 12,0 --stand-in 0,2000
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import cupa  # noqa: E402
from cupa.bench.harness import Timer  # noqa: E402
from cupa.bench.peers import sdpa_peer  # noqa: E402
from cupa.gpu.catalogue import kv_ring_stages  # noqa: E402
from decode_problem import add_problem_arguments, batch_shapes, decode_problem  # noqa: E402
from sweep_partitions import stream_read  # noqa: E402

THREADS = 128
MODES = {"dense": 0, "paged": 1, "paged, ids early": 2}
CHUNK_TOKENS = 64  # KvRing's chunk: 4 warps of one 16-token step (a 16-bit cache)
CHUNK_MAX_IDS = 1024  # the block ids chunk_floor holds (its MAX_IDS): partitions of 16384 tokens
RING_BYTES = 3 * 2 * THREADS * 8 * 16  # the kernel's STAGES x (K, V) x THREADS x PER x 16 bytes
SM_SHARED_KB = 228  # a multiprocessor's shared memory (sm_90), 1 KB of it each workgroup's own

# The copies are cupa's: cp.async.cg of 16 bytes into shared memory, which hold no registers in
# flight. A step is THREADS x PER units of K and as many of V (32 KB); a ring of three steps keeps
# two to three in flight (cupa's ring: two chunks of 32 KB). Block ids are read a piece of THREADS
# blocks at a time, the next piece's while the current one streams. A (block, KV head) is
# BLOCK_UNITS 16-byte units.
FLOOR_SOURCE = r"""
#define THREADS 128
#define PER 8
#define STAGES 3
typedef unsigned int u32;

__device__ __forceinline__ void copy_cg(uint4* dst, const uint4* src, bool valid) {
    u32 shared;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(shared) : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(shared), "l"(src), "r"(valid ? 16 : 0));
}

// BLOCK_UNITS: the 16-byte units of one (block, KV head), a compile-time constant so that a
// unit's block is a multiply, not a division, at every head size (192 units at head 96).
// Copies units [0, n) of a region, unit j from k + address(j) and v + address(j).
template <typename Address>
__device__ __forceinline__ void stream(uint4* ring, const uint4* k, const uint4* v, int n,
                                       Address address) {
    const int steps = (n + THREADS * PER - 1) / (THREADS * PER);
    for (int s = 0; s < steps; ++s) {
        uint4* stage = ring + (s % STAGES) * 2 * THREADS * PER;
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int j = (s * PER + u) * THREADS + threadIdx.x;
            const bool valid = j < n;
            const long long off = valid ? address(j) : 0;
            copy_cg(stage + u * THREADS + threadIdx.x, k + off, valid);
            copy_cg(stage + (PER + u) * THREADS + threadIdx.x, v + off, valid);
        }
        asm volatile("cp.async.commit_group;");
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));  // step s - 2 has landed
    }
    asm volatile("cp.async.wait_group 0;");
}

extern "C" __global__ void __launch_bounds__(THREADS)
paged_floor(const uint4* __restrict__ key, const uint4* __restrict__ value,
            const int* __restrict__ tables, const int* __restrict__ lens, int max_blocks,
            int block_shift, int row_units, int kv_heads, int capacity,
            int partition, int mode) {
    __shared__ int ids[THREADS];
    extern __shared__ uint4 ring[];
    const int part = blockIdx.x, head = blockIdx.y, seq = blockIdx.z, t = threadIdx.x;
    const int start = part * partition;
    const int first = start >> block_shift;
    const int* row = tables + (long long)seq * max_blocks;
    int next = 0;  // the block id this thread stages for the next piece
    if (mode == 2 && first + t < max_blocks) next = row[first + t];
    const int len = mode == 0 ? capacity : lens[seq];
    const int end = min(len, start + partition);
    if (start < end && mode == 0) {
        const long long base = ((long long)(seq * kv_heads + head) * capacity + start) * row_units;
        stream(ring, key + base, value + base, (end - start) * row_units,
               [](int j) { return (long long)j; });
    } else if (start < end) {
        const int last = (end - 1) >> block_shift;  // the partition's last block, inclusive
        if (mode == 1 && first + t <= last) next = row[first + t];
        for (int b0 = first; b0 <= last; b0 += THREADS) {
            __syncthreads();
            ids[t] = next;
            __syncthreads();
            next = b0 + THREADS + t <= last ? row[b0 + THREADS + t] : 0;
            const int blocks = min(THREADS, last + 1 - b0);
            stream(ring, key, value, blocks * BLOCK_UNITS, [&](int j) {
                return ((long long)ids[j / BLOCK_UNITS] * kv_heads + head) * BLOCK_UNITS +
                       j % BLOCK_UNITS;
            });
        }
    }
}
// cupa's copy pattern without its products (CHUNK, MAX_IDS, ROW_UNITS, ROWS_PER_PASS, STAGES and
// SPREAD from the host: chunk_kernel): chunks of CHUNK tokens staged in a ring of STAGES
// chunks (K then V), copy slot i taking 16-byte unit i % ROW_UNITS of rows i / ROW_UNITS +
// p * ROWS_PER_PASS, ROWS_PER_PASS * ROW_UNITS slots in threads 0.. (SPREAD 0: cupa's KvRing) or
// in the first COPY_LANES lanes of every warp (SPREAD 1: v42's), one wait and one barrier a
// chunk, the partition's block ids read into shared memory first (cupa's come earlier, by
// cp.async: this floor's prologue is one round trip longer).
#ifdef ROW_UNITS
#ifndef SMEM_READS
#define SMEM_READS 0
#endif
#ifndef WORK_CYCLES
#define WORK_CYCLES 0
#endif
#define COPY_SLOTS (ROWS_PER_PASS * ROW_UNITS)
#define COPY_LANES (COPY_SLOTS / (THREADS / 32))
extern "C" __global__ void __launch_bounds__(THREADS)
chunk_floor(const uint4* __restrict__ key, const uint4* __restrict__ value,
            const int* __restrict__ tables, const int* __restrict__ lens, int max_blocks,
            int block_shift, int kv_heads, int partition) {
    __shared__ int ids[MAX_IDS];
    extern __shared__ uint4 ring[];
    const int part = blockIdx.x, head = blockIdx.y, seq = blockIdx.z, t = threadIdx.x;
    const int start = part * partition;
    const int end = min(lens[seq], start + partition);
    if (start >= end) return;
    const int first = start >> block_shift;
    const int blocks = ((end - 1) >> block_shift) - first + 1;
    const int* row = tables + (long long)seq * max_blocks;
    for (int i = t; i < blocks && i < MAX_IDS; i += THREADS) ids[i] = row[first + i];
    __syncthreads();
    const int slot = SPREAD ? (t >> 5) * COPY_LANES + (t & 31) : t;
    const bool copies = SPREAD ? (t & 31) < COPY_LANES : t < COPY_SLOTS;
    const int r0 = slot / ROW_UNITS, u = slot % ROW_UNITS;
    const int chunks = (end - start + CHUNK - 1) / CHUNK;
    const int mask = (1 << block_shift) - 1;
    auto issue = [&](int c) {
        uint4* stage = ring + (c % STAGES) * 2 * CHUNK * ROW_UNITS;
#pragma unroll
        for (int p = 0; p < CHUNK / ROWS_PER_PASS; ++p) {
            const int r = r0 + p * ROWS_PER_PASS, token = start + c * CHUNK + r;
            const bool valid = copies && token < end;
            const int block = valid ? ids[(token >> block_shift) - first] : 0;
            const long long off =
                ((long long)block * kv_heads + head) * BLOCK_UNITS + (token & mask) * ROW_UNITS + u;
            copy_cg(stage + r * ROW_UNITS + u, key + (valid ? off : 0), valid);
            copy_cg(stage + (CHUNK + r) * ROW_UNITS + u, value + (valid ? off : 0), valid);
        }
    };
    for (int c = 0; c < STAGES - 1; ++c) {
        if (c < chunks) issue(c);
        asm volatile("cp.async.commit_group;");
    }
    unsigned sink = 0;
    for (int c = 0; c < chunks; ++c) {
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2));
        __syncthreads();
        if (c + STAGES - 1 < chunks) issue(c + STAGES - 1);
        asm volatile("cp.async.commit_group;");
        // A stand-in for cupa's products on chunk c (--stand-in): SMEM_READS 16-byte reads of
        // its stage a thread (cupa's ldmatrix of a warp's 16 rows of K and V: 12 at head 96,
        // 16 at head 128), then WORK_CYCLES clock cycles of issuing.
        const uint4* stage = ring + (c % STAGES) * 2 * CHUNK * ROW_UNITS;
#pragma unroll 1
        for (int k = 0; k < SMEM_READS; ++k) {
            const uint4 x = stage[(k * THREADS + t) % (2 * CHUNK * ROW_UNITS)];
            sink ^= x.x ^ x.w;
        }
        if (WORK_CYCLES > 0) {
            const long long t0 = clock64();
            while (clock64() - t0 < WORK_CYCLES) sink = sink * 1664525u + 1013904223u;
        }
    }
    asm volatile("cp.async.wait_group 0;");
    if (sink == 0x9e3779b9u) ring[t] = make_uint4(sink, 0, 0, 0);  // keeps the reads
}
#endif
"""


def stand_in(text: str) -> tuple[int, int]:
    """'READS,CYCLES' of --stand-in -> (reads, cycles), both whole and not negative."""
    try:
        reads, cycles = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--stand-in: READS,CYCLES (two whole numbers), got {text!r}") from None
    if reads < 0 or cycles < 0:
        raise ValueError(f"--stand-in: READS and CYCLES are not negative, got {text!r}")
    return reads, cycles


def log2_exact(value: int, what: str) -> int:
    """log2 of a power of two."""
    shift = int(value).bit_length() - 1
    if value <= 0 or 1 << shift != value:
        raise ValueError(f"{what}: a power of two, got {value}")
    return shift


def shared_bytes(per_sm: int) -> int:
    """The dynamic shared memory of a floor workgroup that lets per_sm of them share a
    multiprocessor and not one more (it holds the ring)."""
    nbytes = (SM_SHARED_KB - 8) // per_sm << 10
    if nbytes < RING_BYTES:
        raise ValueError(f"per_sm: at most {(SM_SHARED_KB - 8) * 1024 // RING_BYTES}, got {per_sm}")
    return nbytes


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1x4096,1x32768,8x4096,32x2048,128x1024,16x16384")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--per-sm", type=int, default=2, choices=(1, 2),
                   help="workgroups of the floor kernels a multiprocessor holds")
    p.add_argument("--stand-in", action="append", default=[], metavar="READS,CYCLES",
                   type=stand_in,
                   help="also time cupa's copies with a stand-in for the products on each "
                        "chunk: READS 16-byte shared-memory reads a thread, then CYCLES of "
                        "issuing (repeatable)")
    add_problem_arguments(p)
    args = p.parse_args()
    import cupy
    args.shared_bytes = shared_bytes(args.per_sm)
    timer = Timer(cupy, args.iters)
    rng = np.random.default_rng(0)
    print("us, L2 flushed by writing, median of", args.iters, flush=True)
    for batch, seq_len in batch_shapes(args.shapes):
        floors_of_shape(cupy, timer, rng, batch, seq_len, args)


def floor_kernel(cupy, block_units: int, nbytes: int):
    """The floor kernel for (block, KV head) regions of block_units 16-byte units."""
    options = ("-std=c++17", f"-DBLOCK_UNITS={block_units}")
    module = cupy.RawModule(code=FLOOR_SOURCE, options=options)
    kernel = module.get_function("paged_floor")
    kernel.max_dynamic_shared_size_bytes = nbytes
    return kernel


def chunk_layout(row_units: int) -> tuple[int, int]:
    """(rows a copy pass, ring stages) of cupa's KvRing for a row of row_units 16-byte units
    staged at its own width: 8 rows a pass where a row is not a divisor of the 128 threads
    (KvRing's own width), and catalogue.kv_ring_stages for a 64-token chunk of K."""
    rows = 8 if row_units > 8 and row_units % 8 else THREADS // row_units
    if rows * row_units > THREADS or CHUNK_TOKENS % rows:
        raise ValueError(f"no KvRing layout for rows of {row_units} units (cupa stages them "
                         "wider)")
    return rows, kv_ring_stages(CHUNK_TOKENS * row_units * 16)


def chunk_kernel(cupy, row_units: int, block_units: int, spread: bool, reads: int = 0,
                 cycles: int = 0):
    """The floor kernel with cupa's copy pattern (chunk_floor) and its dynamic shared bytes;
    reads and cycles: the stand-in for the products on each chunk (see chunk_floor)."""
    rows, stages = chunk_layout(row_units)
    options = ("-std=c++17", f"-DBLOCK_UNITS={block_units}", f"-DCHUNK={CHUNK_TOKENS}",
               f"-DMAX_IDS={CHUNK_MAX_IDS}", f"-DROW_UNITS={row_units}",
               f"-DROWS_PER_PASS={rows}", f"-DSTAGES={stages}", f"-DSPREAD={int(spread)}",
               f"-DSMEM_READS={reads}", f"-DWORK_CYCLES={cycles}")
    kernel = cupy.RawModule(code=FLOOR_SOURCE, options=options).get_function("chunk_floor")
    nbytes = stages * 2 * CHUNK_TOKENS * row_units * 16
    kernel.max_dynamic_shared_size_bytes = nbytes
    return kernel, nbytes


def floors_of_shape(cupy, timer, rng, batch, seq_len, args):
    """Prints one shape's line."""
    query, key, value, tables, lens, options = decode_problem(cupy, rng, batch, seq_len, args)
    out = cupy.empty_like(query)
    plan = cupa.plan_decode(query, key, value, tables, lens, **options)
    block_size = key.shape[2]
    row_units = key.shape[3] * key.itemsize // 16
    grid = (plan.max_partitions, key.shape[1], batch)
    kernel = floor_kernel(cupy, row_units * block_size, args.shared_bytes)
    max_blocks = np.int32(tables.shape[1])
    block_shift = np.int32(log2_exact(block_size, "block size"))
    kv_heads, partition = np.int32(key.shape[1]), np.int32(plan.partition_size)
    scalars = (max_blocks, block_shift, np.int32(row_units), kv_heads,
               np.int32(tables.shape[1] * block_size), partition)
    in_order = cupy.arange(tables.size, dtype=cupy.int32).reshape(tables.shape)
    times = {}
    runs = [(name, mode, tables) for name, mode in MODES.items()]
    runs.append(("in order", MODES["paged, ids early"], in_order))
    for name, mode, block_tables in runs:
        times[name] = timer.median_us(lambda: kernel(
            grid, (THREADS,), (key, value, block_tables, lens) + scalars + (np.int32(mode),),
            shared_mem=args.shared_bytes))
    try:
        rows_a_pass = chunk_layout(row_units)[0]
    except ValueError:  # head 192's rows: cupa stages them at 256
        rows_a_pass = 0
    chunked = []  # (name, spread, reads, cycles) of the chunk_floor rows
    if rows_a_pass and plan.partition_size // block_size <= CHUNK_MAX_IDS:
        chunked.append(("cupa's copies", False, 0, 0))
        if rows_a_pass * row_units < THREADS:  # copy slots that can be spread
            chunked.append(("cupa's copies, all warps", True, 0, 0))
        chunked += [(f"cupa's copies + {reads} reads + {cycles} cycles", False, reads, cycles)
                    for reads, cycles in args.stand_in]
    for name, spread, reads, cycles in chunked:
        chunk, nbytes = chunk_kernel(cupy, row_units, row_units * block_size, spread, reads,
                                     cycles)
        times[name] = timer.median_us(lambda: chunk(
            grid, (THREADS,), (key, value, tables, lens, max_blocks, block_shift, kv_heads,
                               partition), shared_mem=nbytes))
    times["grid-stride read"] = timer.median_us(lambda: stream_read(cupy, key, value))
    for name, block_tables in (("cupa", tables), ("cupa in order", in_order)):
        times[name] = timer.median_us(
            lambda: cupa.decode(query, key, value, block_tables, lens, out=out, **options))
    sdpa = sdpa_peer(cupy, query, key, value, cupy.asnumpy(tables), seq_len, args) \
        if not args.kv_format and args.query_len == 1 else None
    if sdpa is not None:
        times["sdpa"] = timer.median_us(sdpa)
    megabytes = 2 * key.nbytes / 1e6
    row = "  ".join(f"{name} {us:.1f}" for name, us in times.items())
    print(f"{batch}x{seq_len} ({megabytes:.0f} MB; {grid[0]} partitions of {plan.partition_size},"
          f" {np.prod(grid)} workgroups; cupa {plan.kernel}, merge {plan.merge}): {row}",
          flush=True)


if __name__ == "__main__":
    main()
