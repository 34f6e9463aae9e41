"""The only place cupa launches kernels: a decode plan's phase 1 and reduce, and the cache write.

Launches are prepared once (kernels looked up, grids fixed, scalar arguments packed;
`cupa.gpu.driver.PreparedLaunch`) and a call passes only the device pointers, so nothing here
reads device memory back or allocates: a call only enqueues work on the stream.
"""

from __future__ import annotations

import functools
import operator

import numpy as np

from ..arrays import cupy_module
from ..problem import DecodeShape
from . import catalogue, dispatch
from .compiler import kernels as compiled_kernels
from .device import device_info
from .driver import PreparedLaunch, driver
from .planner import LaunchPlan

# Pointer arguments of the phase-1 kernel, in order (CUPA_PARTITION_PARAMS in decode_common.cuh).
PARTITION_POINTERS = ("out", "lse", "part_acc", "part_max", "part_sum", "query", "key_cache",
                      "value_cache", "kv_scales", "block_tables", "seq_lens", "query_start_loc",
                      "alibi_slopes", "sinks")
# The reduce kernel's pointer arguments, as indices into PARTITION_POINTERS.
REDUCE_POINTERS = tuple(PARTITION_POINTERS.index(name) for name in (
    "out", "lse", "part_acc", "part_max", "part_sum", "seq_lens", "query_start_loc", "sinks"))
_reduce_pointers = operator.itemgetter(*REDUCE_POINTERS)
WORKSPACE_ALIGNMENT = 256  # bytes between the partial arrays of one workspace allocation


def workspace_bytes(plan: LaunchPlan, shape: DecodeShape) -> tuple[int, int, int]:
    """(total bytes, offset of part_max, offset of part_sum) of the phase-1 partials: float32
    accumulators [num_tokens, num_heads, max_partitions, head_size], then the running max (log2
    domain) and sum per (row, partition). Zero bytes where the reduce is not launched (one
    partition, or clusters merging on chip)."""
    if not plan.reduce_launch:
        return 0, 0, 0
    rows = shape.num_tokens * shape.num_heads * plan.max_partitions

    def aligned(n):
        return -(-n // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT

    acc = aligned(rows * shape.head_size * 4)
    stats = aligned(rows * 4)
    return acc + 2 * stats, acc, acc + stats


@functools.lru_cache(maxsize=64)
def _device_factors(raw: bytes, device_index: int):
    """One device copy per set of fp8 factors: a decode loop over the layers of a model reuses
    it instead of uploading the same few floats on every call. Read-only for the kernels."""
    cupy = cupy_module()
    with cupy.cuda.Device(device_index):
        return cupy.asarray(np.frombuffer(raw, dtype=np.float32))


def kv_scale_factors(plan: LaunchPlan, fmt, k_scale: np.ndarray, v_scale: np.ndarray):
    """The kernels' fp8 factors, float32 [2 * num_kv_heads] (K heads, then V heads), or None
    for a plain cache. A software-widening kernel sees a code's value times 2^(bias - 15), so
    that power of two is folded in here (catalogue.fp8_value_power)."""
    if fmt is None:
        return None
    power = np.float32(catalogue.fp8_value_power(plan.variant, fmt.exponent_bias))
    return np.concatenate([k_scale * power, v_scale * power]).astype(np.float32)


def kernel_kv_scales(plan: LaunchPlan, fmt, k_scale: np.ndarray, v_scale: np.ndarray,
                     device_index: int):
    """kv_scale_factors on the device (None for a plain cache)."""
    factors = kv_scale_factors(plan, fmt, k_scale, v_scale)
    return None if factors is None else _device_factors(factors.tobytes(), device_index)


def partition_launch(plan: LaunchPlan, shape: DecodeShape, multiprocessors: int) -> tuple:
    """(grid, block, scalars) of phase 1: the scalars follow the pointers of
    PARTITION_POINTERS in CUPA_PARTITION_PARAMS (decode_common.cuh), stagger_sms being the
    device's multiprocessors, the caches' strides last."""
    i32, i64, f32 = np.int32, np.int64, np.float32
    block_stride, head_stride, token_stride = shape.cache_strides
    grid = (shape.num_kv_heads * plan.head_chunks, plan.max_partitions, shape.num_seqs)
    scalars = (f32(shape.scale), f32(shape.logits_soft_cap), i32(shape.sliding_window),
               i32(shape.num_tokens), i32(shape.num_heads), i32(shape.num_kv_heads),
               i32(shape.block_size), i32(shape.max_blocks_per_seq), i32(shape.num_blocks),
               i32(plan.partition_size), i32(plan.max_partitions), i32(plan.head_chunks),
               i32(plan.cluster_merge), i32(plan.all_ids_early),
               i32(multiprocessors), i32(plan.stagger_slots), i32(plan.stagger_ns),
               i32(plan.next_call_at_start), i64(block_stride), i64(head_stride),
               i32(token_stride))
    return grid, (plan.variant.threads, 1, 1), scalars


def reduce_launch(plan: LaunchPlan, shape: DecodeShape) -> tuple:
    """(grid, block, scalars) of the reduce (CUPA_REDUCE_VARIANT's scalars, after the pointers
    of REDUCE_POINTERS)."""
    i32 = np.int32
    grid = (shape.num_heads, plan.max_query_len, shape.num_seqs)
    scalars = (i32(shape.sliding_window), i32(shape.num_tokens), i32(shape.num_heads),
               i32(shape.head_size), i32(plan.partition_size), i32(plan.max_partitions),
               i32(shape.capacity))
    return grid, (plan.variant.threads, 1, 1), scalars


def phase1_form(plan: LaunchPlan, arch: str, extended: bool) -> str:
    """Phase 1's launch form (driver.PreparedLaunch): a programmatic dependent of the kernel
    ahead where the target chains for this plan (dispatch.chains_phase1, planner.phase1_chains)
    and the driver has the extended launch; in a cluster where the plan merges in one."""
    chained = extended and dispatch.chains_phase1(arch, plan.phase1_chained)
    if plan.cluster_merge:
        return "cluster-dependent" if chained else "cluster"
    return "dependent" if chained else "plain"


class DecodeLaunch:
    """A plan's launches, prepared once: phase 1, then the reduce where the partitions neither
    are one nor merge within clusters. Call it with the 14 pointers of PARTITION_POINTERS; the
    partials' three come from one allocation of `workspace_bytes` (new_workspace), laid out
    as `partial_pointers` says."""

    def __init__(self, plan: LaunchPlan, shape: DecodeShape, device_index: int):
        info = device_info(device_index)
        is_hip = info.hip_runtime
        compiled = compiled_kernels(plan.variant, device_index)
        grid, block, scalars = partition_launch(plan, shape, info.multiprocessors)
        self.empty = shape.num_seqs == 0
        self.workspace_bytes, self._max_offset, self._sum_offset = workspace_bytes(plan, shape)
        # Chained launches (sm_90): the reduce starts during phase 1's last wave, and phase 1
        # during the kernel ahead of it where that kernel allows (a previous call's; both wait
        # for the kernel ahead before they read: decode_common.cuh).
        extended = _has_extended(is_hip)
        form = phase1_form(plan, info.target.arch, extended)
        chained = dispatch.chains_reduce(info.target.arch) and extended
        self.partition = PreparedLaunch(
            compiled[plan.variant.partition_name], grid, block,
            pointers=len(PARTITION_POINTERS), scalars=scalars, is_hip=is_hip,
            shared_bytes=plan.variant.shared_bytes, form=form,
            cluster=(1, plan.max_partitions, 1) if plan.cluster_merge else None)
        self.reduce = None
        if plan.reduce_launch:
            reduce_grid, reduce_block, reduce_scalars = reduce_launch(plan, shape)
            self.reduce = PreparedLaunch(
                compiled[plan.variant.reduce_name], reduce_grid, reduce_block,
                pointers=len(REDUCE_POINTERS), is_hip=is_hip, scalars=reduce_scalars,
                form="dependent" if chained else "plain")

    def new_workspace(self):
        """One device allocation for all partials (a cupy MemoryPointer), or None when unneeded.
        Allocated on the current stream: cupy's pool hands it on only to work ordered after."""
        return cupy_module().cuda.alloc(self.workspace_bytes) if self.workspace_bytes else None

    def partial_pointers(self, workspace) -> tuple[int, int, int]:
        """The (part_acc, part_max, part_sum) pointers in a workspace of new_workspace, or three
        nulls for None (no partials: the kernels never read them)."""
        if workspace is None:
            return 0, 0, 0
        acc = workspace.ptr
        return acc, acc + self._max_offset, acc + self._sum_offset

    def __call__(self, pointers: tuple, stream_ptr: int) -> None:
        if self.empty:
            return
        self.partition(pointers, stream_ptr)
        if self.reduce is not None:
            self.reduce(_reduce_pointers(pointers), stream_ptr)


def _has_extended(is_hip: bool) -> bool:
    loaded = driver(is_hip)
    return loaded is not None and loaded.extended is not None


def cache_write_form(*, num_kv_heads: int, head_size: int, block_size: int, num_blocks: int,
                     storage_itemsize: int) -> tuple[int, tuple]:
    """(threads per block, the scalars fixed for the cache) of its write kernel: one thread per
    16-byte vector of a token's cache rows (K and V), rounded up to whole warps. The row
    strides (int64, elements) follow those scalars, then an fp8 cache's tail."""
    vectors = 2 * num_kv_heads * head_size * storage_itemsize // 16
    threads = min(catalogue.THREADS, -(-vectors // 32) * 32)
    fixed = (np.int32(num_kv_heads), np.int32(head_size), np.int32(block_size),
             np.int64(num_blocks * block_size))
    return threads, fixed


class CacheWriteLaunch:
    """The KV-cache write of one cache (all its layers share the kernel and block): one thread
    block per token row, one thread per 16-byte vector of the cache row. Call it with the
    pointers of (key rows, value rows, key cache layer, value cache layer, int64 slots), the
    rows' strides and the token count."""

    POINTERS = 5

    def __init__(self, dtype: str, kv_format: str | None, *, num_kv_heads: int, head_size: int,
                 block_size: int, num_blocks: int, storage_itemsize: int, device_index: int):
        self.variant = catalogue.CacheWriteVariant(dtype, kv_format)
        self.kernel = compiled_kernels(self.variant, device_index)[self.variant.write_name]
        self.is_hip = device_info(device_index).hip_runtime
        self.threads, self.fixed = cache_write_form(num_kv_heads=num_kv_heads,
                                                    head_size=head_size, block_size=block_size,
                                                    num_blocks=num_blocks,
                                                    storage_itemsize=storage_itemsize)
        self._prepared: dict = {}

    def __call__(self, pointers: tuple, row_strides: tuple, num_tokens: int, stream_ptr: int,
                 fp8_tail: tuple = ()) -> None:
        """row_strides: (key token, key head, value token, value head) in elements; fp8_tail:
        the pointers of the two inverse-scale arrays and the format id (fp8 caches)."""
        self.prepared(row_strides, num_tokens, fp8_tail)(pointers, stream_ptr)

    def prepared(self, row_strides: tuple, num_tokens: int, fp8_tail: tuple = ()):
        """The PreparedLaunch of one (token count, strides): call it with the five pointers
        and a stream. A caller that writes arrays of one layout again may keep it."""
        key = (num_tokens, row_strides)
        launch = self._prepared.get(key)
        if launch is None:
            if len(self._prepared) > 256:  # a bounded memo of (token count, strides)
                self._prepared.clear()
            scalars = self.fixed + tuple(np.int64(s) for s in row_strides)
            if fp8_tail:
                # The inverse scales are pointers that sit after the scalars; they are fixed
                # for the cache's life, so they are packed as 64-bit values here.
                scalars += (np.int64(fp8_tail[0]), np.int64(fp8_tail[1]), np.int32(fp8_tail[2]))
            launch = self._prepared[key] = PreparedLaunch(
                self.kernel, (num_tokens, 1, 1), (self.threads, 1, 1), pointers=self.POINTERS,
                scalars=scalars, is_hip=self.is_hip)
        return launch
