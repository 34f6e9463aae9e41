"""Host (Python) cost per call of cupa's entry points, beside the floor it is measured against.

The floor L is one bare cupy `RawKernel` launch of an empty kernel with as many arguments as the
decode kernel (CUPA_PARTITION_PARAMS: 14 pointers, 20 scalars), timed the same way in the same
process: host timings move 1.7x between machines, ratios to L much less. Every figure is host
wall time per call of calls enqueued back to back on device arrays, with the GPU kept from being
the bottleneck (the problems are small, and the host clock stops before the final
synchronisation).
"""

from __future__ import annotations

import time

import numpy as np

from ..api import decode, plan_decode
from ..cache import PagedKVCache

_EMPTY_KERNEL = r"""
extern "C" __global__ void cupa_empty_34(
    void* a0, void* a1, void* a2, void* a3, void* a4, void* a5, void* a6, void* a7, void* a8,
    void* a9, void* a10, void* a11, void* a12, void* a13, float s0, float s1, int s2, int s3,
    int s4, int s5, int s6, int s7, int s8, int s9, int s10, int s11, int s12, int s13, int s14,
    int s15, int s16, long long s17, long long s18, int s19) {}
"""
CALLS = 300
EXTEND_SEQS = 32


def host_us(cupy, call, calls: int = CALLS, warmup: int = 20) -> float:
    """Host microseconds per call of `calls` back-to-back calls (the GPU drains afterwards)."""
    for _ in range(warmup):
        call()
    cupy.cuda.get_current_stream().synchronize()
    best = float("inf")
    for _ in range(3):  # the best of three rounds: host timings carry scheduler noise
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        cupy.cuda.get_current_stream().synchronize()
    return best


def host_costs(cupy) -> dict:
    """{"launch_floor", "decode", "plan_run", "cache_write", "extend_tables"}: host us per call."""
    kernel = cupy.RawKernel(_EMPTY_KERNEL, "cupa_empty_34")
    pointer = cupy.empty(1, dtype=cupy.float32)
    args = ((pointer,) * 14 + (np.float32(1), np.float32(0)) + (np.int32(1),) * 15
            + (np.int64(1), np.int64(1), np.int32(1)))
    floor = host_us(cupy, lambda: kernel((1,), (32,), args))

    rng = np.random.default_rng(0)
    batch, heads, kv_heads, head_size, block_size, seq_len = 8, 64, 8, 128, 16, 256
    blocks = batch * seq_len // block_size
    cache_shape = (blocks, kv_heads, block_size, head_size)
    key = cupy.asarray(rng.standard_normal(cache_shape, dtype=np.float32), dtype=cupy.float16)
    value = cupy.asarray(rng.standard_normal(cache_shape, dtype=np.float32), dtype=cupy.float16)
    query = cupy.asarray(rng.standard_normal((batch, heads, head_size), dtype=np.float32),
                         dtype=cupy.float16)
    tables = cupy.asarray(rng.permutation(blocks).astype(np.int32).reshape(batch, -1))
    lens = cupy.full(batch, seq_len, dtype=cupy.int32)
    out = cupy.empty_like(query)
    plan = plan_decode(query, key, value, tables, lens)
    costs = {
        "launch_floor": floor,
        "decode": host_us(cupy, lambda: decode(query, key, value, tables, lens, out=out)),
        "plan_run": host_us(cupy, lambda: plan.run(query, key, value, tables, lens, out=out)),
    }

    cache = PagedKVCache(num_layers=2, num_blocks=4 * EXTEND_SEQS * 64, block_size=block_size,
                         num_kv_heads=kv_heads, head_size=head_size, dtype="float16",
                         backend="gpu")
    ids = list(range(EXTEND_SEQS))
    slots = cache.extend(ids, 512)  # prompts of 512 tokens
    rows = cupy.asarray(rng.standard_normal((EXTEND_SEQS, kv_heads, head_size),
                                            dtype=np.float32), dtype=cupy.float16)
    step_slots = cupy.asarray(slots.reshape(EXTEND_SEQS, 512)[:, -1].astype(np.int64))
    costs["cache_write"] = host_us(cupy, lambda: cache.write(0, step_slots, rows, rows))

    def extend_and_tables():  # one decode step's bookkeeping of 32 sequences
        cache.extend(ids, 1)
        cache.tables(ids)
    costs["extend_tables"] = host_us(cupy, extend_and_tables, calls=200, warmup=5)
    return costs
