"""Launching decode on a GPU: plan -> compiled variant -> partition kernel -> reduce kernel.

All arrays here are cupy arrays already validated by `cupa.api`. Nothing in this path reads
device memory back to the host, so a call only enqueues work on the stream.
"""

from __future__ import annotations

import numpy as np

from .arrays import cupy_module
from .compiler import kernels as compiled_kernels
from .device import device_info
from .plan import make_plan
from . import variants

_NULL = np.uint64(0)  # a null pointer argument


def _ptr(array):
    return _NULL if array is None else array


def decode_gpu(query, key_cache, value_cache, block_tables, seq_lens, shape, *, alibi_slopes,
               sinks, out, return_lse, partition_size, max_seq_len):
    cupy = cupy_module()
    info = device_info()
    plan = make_plan(shape, info.multiprocessors, arch=info.target.arch,
                     partition_size=partition_size,
                     max_seq_len=max_seq_len)
    if out is None:
        out = cupy.empty(query.shape, dtype=query.dtype)
    lse = cupy.empty((shape.num_seqs, shape.num_heads), dtype=cupy.float32) if return_lse else None
    if shape.num_seqs == 0:
        return out, lse

    kernels = compiled_kernels(plan.variant, info.index)
    if plan.single_partition:
        part_acc = part_max = part_sum = None
    else:
        partials = (shape.num_seqs, shape.num_heads, plan.max_partitions)
        part_acc = cupy.empty(partials + (shape.head_size,), dtype=cupy.float32)
        part_max = cupy.empty(partials, dtype=cupy.float32)
        part_sum = cupy.empty(partials, dtype=cupy.float32)

    i32 = np.int32
    grid = (shape.num_kv_heads * plan.head_chunks, plan.max_partitions, shape.num_seqs)
    kernels[plan.variant.partition_name](grid, (variants.THREADS,), (
        out, _ptr(lse), _ptr(part_acc), _ptr(part_max), _ptr(part_sum), query, key_cache,
        value_cache, block_tables, seq_lens, _ptr(alibi_slopes), _ptr(sinks),
        np.float32(shape.scale), np.float32(shape.logits_soft_cap), i32(shape.sliding_window),
        i32(shape.num_heads), i32(shape.num_kv_heads), i32(shape.block_size),
        i32(shape.max_blocks_per_seq), i32(shape.num_blocks), i32(plan.partition_size),
        i32(plan.max_partitions), i32(plan.head_chunks)))
    if not plan.single_partition:
        kernels[plan.variant.reduce_name]((shape.num_seqs * shape.num_heads,), (variants.THREADS,), (
            out, _ptr(lse), part_acc, part_max, part_sum, seq_lens, _ptr(sinks),
            i32(shape.sliding_window), i32(shape.num_heads),
            i32(shape.head_size), i32(plan.partition_size), i32(plan.max_partitions),
            i32(shape.capacity)))
    return out, lse
