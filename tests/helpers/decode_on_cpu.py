"""cupa's decode kernels built for the CPU and run there: an AMD target's emulated build
(kernels/amd_emulation.cuh: wave64 or wave32, MFMA or WMMA by AMD's layouts), or an NVIDIA
target's own build, whose tensor-core PTX (mma.sync, ldmatrix, movmatrix, cp.async, prmt, the
fp8 conversion) the runner's shim carries out lane by lane; compiled by the host's C++ compiler
with CUPA_CPU=1, its threads run as coroutines by tests/helpers/cuda_on_cpu.py. The plan, the
grid and every argument come from cupa itself (gpu.planner.make_plan, gpu.launch.partition_launch
and reduce_launch), so what runs is what the GPU would be asked to run: phase 1, then the reduce
where the plan has one, or the cluster merge (a cluster's workgroups run together, each with
its own shared memory); chained launches run one after another.

What this shows: the kernels' indexing, masking and merging, their warp and wavefront
collectives and the matrix instructions' operand layouts, on any machine. What it cannot: the
hardware's own arithmetic, timing and memory ordering (real AMD: `python -m cupa selftest`; the
GPU suite on NVIDIA, and under CUPA_EMULATE for the AMD builds).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass

import numpy as np

from cupa.fp8 import check_kv_format, kv_scales
from cupa.gpu import catalogue, dispatch
from cupa.gpu.device import Target
from cupa.gpu.launch import (PARTITION_POINTERS, REDUCE_POINTERS, kv_scale_factors,
                             partition_launch, reduce_launch)
from cupa.gpu.planner import make_plan
from cupa.problem import default_max_query_len
from cupa.reference import paged_decode_reference
from cupa.validation import check_decode_args, check_kv_layout
from cases import FP8_REL_BOUND, REL_BOUND, environ, make_case, quantized_case, rel_error
from cuda_on_cpu import cpu_kernels
import fuzz_draws

# A small device: grids of a few waves from small problems (the planner splits for it).
MULTIPROCESSORS = 4
# The selftest's cases plan as on the targets' usual devices (H200 and A100 for NVIDIA): its
# small problems keep the variant they name there, and on 4 multiprocessors sm_90's head-64
# plans would take the dense form instead (a size rule, dispatch.DENSE_FROM_WORKGROUPS_PER_SM).
SELFTEST_MULTIPROCESSORS = {"sm_90": 132, "sm_80": 108}
# The arrays the kernels write: the outputs and the phase-1 partials.
WRITTEN = frozenset({"out", "lse", "part_acc", "part_max", "part_sum"})


@dataclass
class CpuDecode:
    out: np.ndarray   # [num_tokens, num_heads, head_size], the query's dtype
    lse: np.ndarray   # float32 [num_tokens, num_heads]
    plan: object      # the gpu.planner.LaunchPlan that ran


def decode_on_cpu(arch: str, query, key_cache, value_cache, block_tables, seq_lens, *,
                  query_start_loc=None, scale=None, alibi_slopes=None, sliding_window=None,
                  logits_soft_cap=None, sinks=None, kv_format=None, k_scale=None,
                  v_scale=None, kv_layout=None, partition_size=None, max_seq_len=None,
                  hints_from_arrays=True, max_query_len=None, place=None,
                  sanitize=False, multiprocessors=MULTIPROCESSORS) -> CpuDecode:
    """Decode numpy arrays as cupa would on the target `arch` (an AMD 'gfx942', ..., in its
    emulated build; or NVIDIA 'sm_80', 'sm_90', the tensor-core kernels' PTX by cuda_on_cpu's
    shim): planned for a device of `multiprocessors`, built for the CPU, run. Outputs and
    partials start as NaN.
    The plan gets the length hints cupa.decode reads from host arrays, or with
    hints_from_arrays=False only `max_seq_len` and `max_query_len` (default: the most new
    tokens the shapes allow), as for arrays on the device.

    place(name, array, writable) -> array, if given, puts each array the kernels get where
    they will see it (guarded_memory.GuardedArena.place), the outputs and partials writable;
    sanitize builds the kernels under the sanitizers (in a sanitized_run.py process).
    The caches keep their strides (a view in kv_layout's order is read in place); every other
    array is made contiguous."""
    arrays = [a if a is None or i in (1, 2) else np.ascontiguousarray(a)
              for i, a in enumerate((query, key_cache, value_cache, block_tables, seq_lens,
                                     query_start_loc, alibi_slopes, sinks))]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, alibi_slopes, \
        sinks = arrays
    shape = check_decode_args(query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc=query_start_loc, scale=scale,
                              alibi_slopes=alibi_slopes, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, sinks=sinks, kv_format=kv_format,
                              kv_layout=check_kv_layout(kv_layout))
    if query_start_loc is None:
        new_tokens = 1
    elif hints_from_arrays:
        new_tokens = int(np.diff(query_start_loc).max(initial=1))
    else:  # as cupa.decode plans a device query_start_loc
        new_tokens = max_query_len or default_max_query_len(shape)
    if hints_from_arrays:
        max_seq_len, total_seq_len = int(seq_lens.max(initial=1)), int(seq_lens.sum())
    else:
        total_seq_len = None
    plan = make_plan(shape, multiprocessors, arch=arch, partition_size=partition_size,
                     max_seq_len=max_seq_len, total_seq_len=total_seq_len,
                     max_query_len=new_tokens)
    target = Target(arch, emulated=arch.startswith("gfx"))
    defines = tuple(target.defines()) + ("-DCUPA_CPU=1",)
    kernels = cpu_kernels(catalogue.module_source(plan.variant), defines, sanitize=sanitize)

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
    if place is not None:
        pointers = {name: place(name, array, writable=name in WRITTEN)
                    for name, array in pointers.items()}
        out, lse = pointers["out"], pointers["lse"]
    grid, block, scalars = partition_launch(plan, shape, multiprocessors)
    cluster = (1, plan.max_partitions, 1) if plan.cluster_merge else (1, 1, 1)
    kernels[plan.variant.partition_name](grid, block, [*pointers.values(), *scalars],
                                         shared_mem=plan.variant.shared_bytes, cluster=cluster)
    if plan.reduce_launch:
        grid, block, scalars = reduce_launch(plan, shape)
        reduce_pointers = [pointers[PARTITION_POINTERS[i]] for i in REDUCE_POINTERS]
        kernels[plan.variant.reduce_name](grid, block, [*reduce_pointers, *scalars])
    return CpuDecode(out=out, lse=lse, plan=plan)


def selftest_runner(arch: str):
    """A runner for cupa.selftest.run_cases: each case's problem decoded on the CPU build for
    `arch` as selftest.run_on_gpu decodes it on a device (planned, then in 256-token
    partitions; the kernel planned must be the case's)."""
    from cupa import selftest

    def run(case, rng):
        problem = selftest.make_problem(case, rng)
        key_ref, value_ref = problem["reference_caches"]
        args = [problem[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                     "seq_lens")]
        ref, _ = paged_decode_reference(args[0], key_ref, value_ref, *args[3:])
        pages = selftest.nhd_pages(args[1], args[2])
        outcome = selftest.Outcome()
        for partition_size, kv_layout in selftest.RUNS:
            if kv_layout == "NHD":
                args[1:3] = pages[:, 0], pages[:, 1]
            with dispatch.switches_set(dispatch.FORM_SWITCHES.get(case.form, {})):
                result = decode_on_cpu(arch, *args, **problem["options"],
                                       partition_size=partition_size, kv_layout=kv_layout,
                                       multiprocessors=SELFTEST_MULTIPROCESSORS.get(
                                           arch, MULTIPROCESSORS),
                                       max_seq_len=max(selftest.SEQ_LENS),
                                       hints_from_arrays=False)
            if result.plan.variant != case.variant:
                outcome.failure = f"planned {result.plan.variant}, not {case.variant}"
                return outcome
            label = selftest.run_label(partition_size, kv_layout, result.plan.max_partitions)
            out = result.out.astype(np.float64)
            outcome.errors[label] = rel_error(out, ref) if np.isfinite(out).all() else np.nan
        return outcome
    return run


def check_result(result: CpuDecode, case, bound, reference_caches=None):
    """A CPU run of `case` (cases.make_case) against the reference: every output written,
    ||out - ref|| / ||ref|| within `bound`, the log-sum-exp likewise (-inf exactly where the
    reference has it: empty rows without sinks). reference_caches: the dequantised caches of
    an fp8 case."""
    key_cache, value_cache = reference_caches or (case.key_cache, case.value_cache)
    ref, ref_lse = paged_decode_reference(case.query, key_cache, value_cache,
                                          case.block_tables, case.seq_lens, **case.options())
    assert np.isfinite(result.out.astype(np.float32)).all(), result.plan.variant
    assert rel_error(result.out, ref) < bound, result.plan.variant
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(result.lse), finite)
    assert rel_error(result.lse[finite], ref_lse[finite]) < bound
    assert (result.lse[~finite] == -np.inf).all()


# The lengths the kernel tests mix: empty, one token, one whole block, a tail, several partitions.
LENGTHS = (0, 1, 16, 37, 300)


def check_options_together(rng, arch: str, variant_class):
    """A sliding window, ALiBi, a soft cap and attention sinks together on shared blocks, in
    64-token partitions at `arch`, which must launch a `variant_class` kernel."""
    case = make_case(rng, num_kv_heads=2, group=4, seq_lens=(1, 37, 300), alibi=True,
                     sliding_window=70, logits_soft_cap=20.0, sinks=True)
    result = decode_on_cpu(arch, *case.args(), **case.options(), partition_size=64)
    assert isinstance(result.plan.variant, variant_class)
    check_result(result, case, REL_BOUND["float16"])


def check_fp8_case(rng, arch: str, fmt: str, head_size: int, group: int, variant_class):
    """An fp8 cache of format `fmt` with per-KV-head scales at `arch` (which must launch a
    `variant_class` kernel), against the reference on the dequantised cache."""
    case = make_case(rng, head_size=head_size, num_kv_heads=2, group=group, seq_lens=LENGTHS)
    (key_codes, value_codes), dequantized, (k_scale, v_scale) = quantized_case(case, fmt, rng)
    result = decode_on_cpu(arch, case.query, key_codes, value_codes, case.block_tables,
                           case.seq_lens, **case.options(), kv_format=fmt, k_scale=k_scale,
                           v_scale=v_scale)
    assert isinstance(result.plan.variant, variant_class)
    check_result(result, case, FP8_REL_BOUND, reference_caches=dequantized)


def check_fuzz_draws(targets: tuple, count: int):
    """`count` of the GPU fuzz's random configurations (tests/helpers/fuzz_draws.py), each at a
    random one of `targets`, against the reference; a fresh seed a run, printed
    (CUPA_FUZZ_SEED=<seed> replays one). Fails with every configuration that did."""
    seed = fuzz_draws.fresh_seed()
    rng = np.random.default_rng(seed)
    failures = []
    for _ in range(count):
        d, arch = fuzz_draws.draw(rng), str(rng.choice(targets))
        p = fuzz_draws.problem(d)
        with environ(CUPA_KERNEL=d.kernel):
            result = decode_on_cpu(arch, *p.args, **p.case.options(), **p.fp8,
                                   partition_size=d.partition_size)
        found = fuzz_draws.compare(p, result.out, result.lse)
        if found is not None:
            failures.append(f"{arch}, {result.plan.variant}: {found}: {d}")
    assert not failures, (f"{len(failures)} of {count} configurations failed (seed {seed}):\n"
                          + "\n".join(failures))


def check_selftest_sample(arch: str, sample: int):
    """`python -m cupa selftest`'s cases for `arch` (every variant dispatch can pick there,
    each with its fewest query rows: what a device checks on a variant's first use), run by
    the selftest's own table and bounds on the CPU build: `sample` of them at random, the seed
    printed (CUPA_FUZZ_SEED replays it), or all with CUPA_SELFTEST_CPU_CASES=all."""
    from cupa import selftest
    cases = selftest.cases_for(arch)
    if os.environ.get("CUPA_SELFTEST_CPU_CASES") != "all":
        picks = np.random.default_rng(fuzz_draws.fresh_seed()).choice(len(cases), sample,
                                                                       replace=False)
        cases = [cases[i] for i in sorted(picks)]
    report = io.StringIO()
    assert selftest.run_cases(cases, selftest_runner(arch), out=report) == 0, report.getvalue()
