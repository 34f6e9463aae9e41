"""cupa's decode kernels for an AMD target, built for the CPU and run there: the emulated AMD
build (kernels/amd_emulation.cuh: wave64 or wave32, MFMA or WMMA by AMD's layouts) compiled by
the host's C++ compiler with CUPA_CPU=1, its threads run as coroutines by
tests/helpers/cuda_on_cpu.py. The plan, the grid and every argument come from cupa itself
(gpu.planner.make_plan, gpu.launch.partition_launch and reduce_launch), so what runs is what an
AMD GPU would be asked to run: phase 1, then the reduce where the plan has one.

What this shows: the kernels' indexing, masking and merging, their wavefront collectives and the
matrix instructions' operand layouts, on any machine. What it cannot: the hardware's own
arithmetic, timing and memory ordering (real AMD: `python -m cupa selftest`; the emulated build
on an NVIDIA GPU: tests/gpu/test_gpu_amd_emulation.py and the GPU suite under CUPA_EMULATE).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cupa.fp8 import check_kv_format, kv_scales
from cupa.gpu import catalogue
from cupa.gpu.device import Target
from cupa.gpu.launch import (PARTITION_POINTERS, REDUCE_POINTERS, kv_scale_factors,
                             partition_launch, reduce_launch)
from cupa.gpu.planner import make_plan
from cupa.validation import check_decode_args
from cuda_on_cpu import compiler_missing, cpu_kernels  # noqa: F401 (compiler_missing: for skips)

# A small device: grids of a few waves from small problems (the planner splits for it).
MULTIPROCESSORS = 4


@dataclass
class CpuDecode:
    out: np.ndarray   # [num_tokens, num_heads, head_size], the query's dtype
    lse: np.ndarray   # float32 [num_tokens, num_heads]
    plan: object      # the gpu.planner.LaunchPlan that ran


def decode_on_cpu(arch: str, query, key_cache, value_cache, block_tables, seq_lens, *,
                  query_start_loc=None, scale=None, alibi_slopes=None, sliding_window=None,
                  logits_soft_cap=None, sinks=None, kv_format=None, k_scale=None,
                  v_scale=None, partition_size=None) -> CpuDecode:
    """Decode numpy arrays as cupa would on the AMD target `arch` ('gfx942', ...): planned for
    a device of MULTIPROCESSORS, built for the CPU, run. Outputs and partials start as NaN."""
    arrays = [np.ascontiguousarray(a) if a is not None else None
              for a in (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                        alibi_slopes, sinks)]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, alibi_slopes, \
        sinks = arrays
    shape = check_decode_args(query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc=query_start_loc, scale=scale,
                              alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, sinks=sinks, kv_format=kv_format)
    new_tokens = 1 if query_start_loc is None else int(np.diff(query_start_loc).max(initial=1))
    plan = make_plan(shape, MULTIPROCESSORS, arch=arch, partition_size=partition_size,
                     max_seq_len=int(seq_lens.max(initial=1)),
                     total_seq_len=int(seq_lens.sum()), max_query_len=new_tokens)
    defines = tuple(Target(arch, emulated=True).defines()) + ("-DCUPA_CPU=1",)
    kernels = cpu_kernels(catalogue.module_source(plan.variant), defines)

    fmt = check_kv_format(kv_format)
    factors = None
    if fmt is not None:
        factors = kv_scale_factors(plan, fmt, kv_scales(k_scale, shape.num_kv_heads, "k_scale"),
                                   kv_scales(v_scale, shape.num_kv_heads, "v_scale"))
    rows = shape.num_tokens * shape.num_heads
    out = np.full(query.shape, np.nan, query.dtype)
    lse = np.full((shape.num_tokens, shape.num_heads), np.nan, np.float32)
    partials = (None, None, None)
    if plan.reduce_launch:
        partials = (np.full(rows * plan.max_partitions * shape.head_size, np.nan, np.float32),
                    np.full(rows * plan.max_partitions, np.nan, np.float32),
                    np.full(rows * plan.max_partitions, np.nan, np.float32))
    pointers = dict(zip(PARTITION_POINTERS, (
        out, lse, *partials, query, key_cache, value_cache, factors, block_tables, seq_lens,
        query_start_loc, alibi_slopes, sinks)))
    grid, block, scalars = partition_launch(plan, shape, MULTIPROCESSORS)
    kernels[plan.variant.partition_name](grid, block, [*pointers.values(), *scalars])
    if plan.reduce_launch:
        grid, block, scalars = reduce_launch(plan, shape)
        reduce_pointers = [pointers[PARTITION_POINTERS[i]] for i in REDUCE_POINTERS]
        kernels[plan.variant.reduce_name](grid, block, [*reduce_pointers, *scalars])
    return CpuDecode(out=out, lse=lse, plan=plan)
