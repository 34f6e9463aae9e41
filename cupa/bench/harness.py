"""The bench's measuring tools: the L2-flushing event timer, back-to-back (eager) timing, the
copy ceiling and the random paged problems every table times.
"""

from __future__ import annotations

import numpy as np

from ..problem import DEFAULT_KV_LAYOUT, KV_LAYOUTS, STORAGE_DTYPES

# The read flush reads every word of the flush buffer and writes nothing (the branch never
# fires, but the compiler cannot know that, so the loads stay).
_FLUSH_KERNELS = r"""
extern "C" __global__ void cupa_read_flush(const unsigned int* p, unsigned long long n,
                                           unsigned int* sink) {
    unsigned int acc = 0;
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        acc ^= p[i];
    if (acc == 0x9e3779b9u) sink[0] = acc;
}

// Holds the stream for `cycles` clocks: after the read flush, so that the host has enqueued the
// timed launch before the start event fires (the read is shorter than an eager cupa.decode call's
// host time; the write flush takes long enough by itself).
extern "C" __global__ void cupa_hold(long long cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}
"""
HOLD_CYCLES = 1 << 20  # ~0.5 ms at 2 GHz


class Timer:
    """Median device time of a launch, with L2 flushed before each one by streaming a 512 MB
    buffer through it.

    flush="write" (default, the usual `cache.zero_()` idiom and every table in docs/performance.md)
    fills the buffer, which leaves L2 full of dirty lines written back during the timed launch;
    flush="read" reads it, leaving clean lines. The two differ by a few percent, mostly for the
    peers (docs/perf-log.md, v7).
    The flush also hides the host-side cost of enqueueing the launch: the host records the start
    event and launches while the GPU is still busy with the flush (after the read flush, with a
    0.5 ms hold: the read alone is shorter than an eager call's host time)."""

    def __init__(self, cupy, iters, flush="write"):
        self.cupy = cupy
        self.iters = iters
        self.flush_buffer = cupy.ones(512 << 20, dtype=cupy.uint8)
        self.start = cupy.cuda.Event()
        self.stop = cupy.cuda.Event()
        if flush not in ("read", "write"):
            raise ValueError(f"flush: 'read' or 'write', got {flush!r}")
        self.flush_mode = flush
        if flush == "read":
            self._reader = cupy.RawKernel(_FLUSH_KERNELS, "cupa_read_flush")
            self._hold = cupy.RawKernel(_FLUSH_KERNELS, "cupa_hold")
            self._sink = cupy.zeros(1, dtype=cupy.uint32)

    def flush(self):
        if self.flush_mode == "write":
            self.flush_buffer.fill(1)
            return
        words = self.flush_buffer.view(self.cupy.uint32)
        self._reader((1024,), (256,), (words, np.uint64(words.size), self._sink))
        self._hold((1,), (1,), (np.int64(HOLD_CYCLES),))

    def median_us(self, launch, warmup=3):
        for _ in range(warmup):
            launch()
        times = []
        for _ in range(self.iters):
            self.flush()
            self.start.record()
            launch()
            self.stop.record()
            self.stop.synchronize()
            times.append(self.cupy.cuda.get_elapsed_time(self.start, self.stop) * 1e3)
        return float(np.median(times))


def eager_us(cupy, launch, calls: int = 100, warmup: int = 5) -> float:
    """Device time per call of `calls` calls made back to back, with nothing between them and
    nothing hiding the host: when a call's host work takes longer than its kernels, this is the
    host's time. It is how a user's loop of calls runs (and how do_bench-style harnesses time
    peers without a flush)."""
    for _ in range(warmup):
        launch()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.cuda.get_current_stream().synchronize()
    start.record()
    for _ in range(calls):
        launch()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) * 1e3 / calls


def copy_ceiling_tbs(cupy, timer, nbytes=4 << 30):
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    us = timer.median_us(lambda: dst.__setitem__(Ellipsis, src))
    del src, dst
    return 2 * nbytes / (us * 1e-6) / 1e12


def kv_read_bytes(tokens: int, args) -> int:
    """Bytes of K and V that decoding `tokens` cached tokens reads (every row once): the
    numerator of every TB/s and floor figure of the bench."""
    itemsize = np.dtype(STORAGE_DTYPES[args.dtype]).itemsize
    return 2 * int(tokens) * args.kv_heads * args.head_size * itemsize


def copy_floor_us(nbytes: int, ceiling_tbs: float) -> float:
    """The floor of reading `nbytes` at the copy ceiling's bandwidth (docs/performance.md,
    "Floors"); floor / time is the main table's "% ceiling"."""
    return nbytes / (ceiling_tbs * 1e12) * 1e6


def random_kv(cupy, num_blocks: int, args, kv_layout: str = DEFAULT_KV_LAYOUT):
    """Random key and value caches of `num_blocks` blocks in `args`' sizes and dtype, their
    dimensions in the order `kv_layout` names."""
    np_dtype = STORAGE_DTYPES[args.dtype]
    sizes = dict(num_blocks=num_blocks, num_kv_heads=args.kv_heads, block_size=args.block_size,
                 head_size=args.head_size)
    shape = tuple(sizes[dim] for dim in KV_LAYOUTS[kv_layout])
    return tuple(cupy.random.standard_normal(shape, dtype=cupy.float32).astype(np_dtype)
                 for _ in range(2))


def random_query(cupy, num_tokens: int, args):
    """A random query of `num_tokens` rows (one per sequence) in the bench's heads and dtype."""
    return cupy.random.standard_normal((num_tokens, args.heads, args.head_size),
                                       dtype=cupy.float32).astype(STORAGE_DTYPES[args.dtype])


def make_problem(cupy, rng, batch, seq_len, args, kv_layout: str = DEFAULT_KV_LAYOUT):
    """Random query and paged KV (blocks in shuffled order) of exactly batch x seq_len tokens,
    the caches in `kv_layout`'s order."""
    blocks_per_seq = -(-seq_len // args.block_size)
    num_blocks = batch * blocks_per_seq
    key, value = random_kv(cupy, num_blocks, args, kv_layout)
    tables = rng.permutation(num_blocks).astype(np.int32).reshape(batch, blocks_per_seq)
    query = random_query(cupy, batch, args)
    lens = np.full(batch, seq_len, np.int32)
    return query, key, value, cupy.asarray(tables), cupy.asarray(lens), tables


