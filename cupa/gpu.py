"""Launching decode on a GPU: plan -> compiled variant -> partition kernel -> reduce kernel.

All arrays here are cupy arrays already validated by `cupa.api`. Nothing in this path reads
device memory back to the host, so a call only enqueues work on the stream. The workspace is a
separate object so that a `cupa.DecodePlan` can own one for its whole life (graph capture needs
every pointer to stay put).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .arrays import cupy_module
from . import chained_launch
from .compiler import kernels as compiled_kernels
from .device import device_info
from .plan import LaunchPlan
from .validation import DecodeShape
from . import variants

_NULL = np.uint64(0)  # a null pointer argument


def _ptr(array):
    return _NULL if array is None else array


@dataclass
class Workspace:
    """Phase-1 partials per query row and partition (absent with a single partition)."""

    part_acc: object = None  # float32 [num_tokens, num_heads, max_partitions, head_size]
    part_max: object = None  # float32 [num_tokens, num_heads, max_partitions] (log2 domain)
    part_sum: object = None  # float32 [num_tokens, num_heads, max_partitions]


def allocate_workspace(plan: LaunchPlan, shape: DecodeShape) -> Workspace:
    if not plan.reduce_launch:  # one partition, or clusters merging in shared memory
        return Workspace()
    cupy = cupy_module()
    partials = (shape.num_tokens, shape.num_heads, plan.max_partitions)
    return Workspace(part_acc=cupy.empty(partials + (shape.head_size,), dtype=cupy.float32),
                     part_max=cupy.empty(partials, dtype=cupy.float32),
                     part_sum=cupy.empty(partials, dtype=cupy.float32))


def kernel_kv_scales(plan: LaunchPlan, fmt, k_scale: np.ndarray, v_scale: np.ndarray,
                     device_index: int):
    """The kernels' fp8 factors on the device, float32 [2 * num_kv_heads] (K heads, then V
    heads), or None for a plain cache. A software-widening kernel sees a code's value times
    2^(bias - 15), so that power of two is folded in here (variants.fp8_value_power)."""
    if fmt is None:
        return None
    power = np.float32(variants.fp8_value_power(plan.variant, fmt.exponent_bias))
    factors = np.concatenate([k_scale * power, v_scale * power]).astype(np.float32)
    return _device_factors(factors.tobytes(), device_index)


@functools.lru_cache(maxsize=64)
def _device_factors(raw: bytes, device_index: int):
    """One device copy per set of factors: a decode loop over the layers of a model reuses it
    instead of uploading the same few floats on every call. Read-only for the kernels."""
    cupy = cupy_module()
    with cupy.cuda.Device(device_index):
        return cupy.asarray(np.frombuffer(raw, dtype=np.float32))


def _current_stream_ptr() -> int:
    """The stream cupy launches on now: where the driver-API launches go too."""
    return cupy_module().cuda.get_current_stream().ptr


def launch(plan: LaunchPlan, shape: DecodeShape, workspace: Workspace, device_index: int, *,
           out, lse, query, key_cache, value_cache, kv_scales, block_tables, seq_lens,
           query_start_loc, alibi_slopes, sinks):
    """Enqueue phase 1, and the reduce where the partitions neither are one nor merge within
    clusters."""
    if shape.num_seqs == 0:
        return
    kernels = compiled_kernels(plan.variant, device_index)
    i32 = np.int32
    grid = (shape.num_kv_heads * plan.head_chunks, plan.max_partitions, shape.num_seqs)
    partition = kernels[plan.variant.partition_name]
    args = (
        out, _ptr(lse), _ptr(workspace.part_acc), _ptr(workspace.part_max),
        _ptr(workspace.part_sum), query, key_cache, value_cache, _ptr(kv_scales), block_tables,
        seq_lens, _ptr(query_start_loc), _ptr(alibi_slopes), _ptr(sinks),
        np.float32(shape.scale), np.float32(shape.logits_soft_cap), i32(shape.sliding_window),
        i32(shape.num_tokens), i32(shape.num_heads), i32(shape.num_kv_heads),
        i32(shape.block_size), i32(shape.max_blocks_per_seq), i32(shape.num_blocks),
        i32(plan.partition_size), i32(plan.max_partitions), i32(plan.head_chunks),
        i32(plan.cluster_merge))
    if plan.cluster_merge:  # one cluster per (sequence, KV head, row chunk): all its partitions
        chained_launch.launch_clustered(partition, grid, (variants.THREADS, 1, 1), args,
                                        _current_stream_ptr(), cluster=(1, plan.max_partitions, 1),
                                        shared_bytes=plan.variant.shared_bytes)
    else:
        partition(grid, (variants.THREADS,), args, shared_mem=plan.variant.shared_bytes)
    if plan.reduce_launch:
        reduce_grid = (shape.num_heads, plan.max_query_len, shape.num_seqs)
        reduce_args = (
            out, _ptr(lse), workspace.part_acc, workspace.part_max, workspace.part_sum, seq_lens,
            _ptr(query_start_loc), _ptr(sinks), i32(shape.sliding_window),
            i32(shape.num_tokens), i32(shape.num_heads), i32(shape.head_size),
            i32(plan.partition_size), i32(plan.max_partitions), i32(shape.capacity))
        reduce = kernels[plan.variant.reduce_name]
        arch = device_info(device_index).target.arch
        if variants.chains_reduce(arch) and chained_launch.available():
            chained_launch.launch_dependent(reduce, reduce_grid, (variants.THREADS, 1, 1),
                                            reduce_args, _current_stream_ptr())
        else:
            reduce(reduce_grid, (variants.THREADS,), reduce_args)
