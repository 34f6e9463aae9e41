"""GPU decode against the float64 reference. Runs unchanged on CUDA and ROCm; skips without a GPU.

Every check draws fresh random inputs, plants NaN in every cache slot and table entry that no
sequence uses, poisons the output before the launch, and compares by ||out - ref|| / ||ref||.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import cupa
from cupa.gpu import catalogue, dispatch
from cupa.arrays import gpu_available
from cupa.reference import paged_decode_reference

from cases import REL_BOUND, environ, make_case, rel_error

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

PARTITION = 256  # forced small partition size: exercises the reduce path with short sequences
# Lengths around tile (128) and partition (256) boundaries, plus longer ones.
LENGTHS = (1, 127, 128, 129, PARTITION - 1, PARTITION, PARTITION + 1, 2 * PARTITION + 3, 2000)


def to_gpu(case):
    """The case's arrays and keyword options, on the GPU."""
    import cupy
    return [cupy.asarray(x) for x in case.args()], case.options(cupy.asarray)


# The kernel modes the tests run, as the dispatch switches that select them.
KERNEL_MODES = {
    "auto": dict(CUPA_KERNEL="auto", CUPA_ROW_CHUNKS="auto", CUPA_DENSE="auto"),
    "portable": dict(CUPA_KERNEL="portable", CUPA_ROW_CHUNKS="auto", CUPA_DENSE="auto"),
    "row-chunks": dict(CUPA_KERNEL="auto", CUPA_ROW_CHUNKS="always", CUPA_DENSE="never"),
    # KvRing's 2-stage ring where the deep form serves by default (sm_80's at heads 192, 256),
    # in the 16-row kernel where more than 8 rows have it.
    "shallow": dict(CUPA_KERNEL="auto", CUPA_ROW_CHUNKS="never", CUPA_DENSE="auto",
                    CUPA_DEEP="never"),
    # The 16-row kernel, the dense and wide forms (dispatch.dense_variant, wide_variant) on
    # any problem.
    **dispatch.FORM_SWITCHES}


def kernel_modes(case, kv_format=None):
    """'auto' picks the tensor-core (NVIDIA) or matrix-core (AMD) kernel where it applies;
    check the portable one there too. Where the 16-row tensor-core kernel serves the rows,
    'auto' picks it or 8-row chunks of the 8-column kernel by the problem's size: both are
    checked in its place. Where the 8-column kernel has a dense form (catalogue.DENSE_KINDS, for
    the case's cache: 16-bit, or kv_format's fp8 codes), 'auto' picks it or the default form by
    the grid's size: both are checked, and so is the wide form where one exists (head 128, up
    to 16 rows, sm_90), which 'auto' picks for long partitions. Where 'auto' picks the deep form
    (catalogue.DEEP_KINDS, sm_90), the 2-stage ring sm_80 runs is checked too ('shallow').
    CUPA_TEST_KERNEL_MODES=auto
    checks 'auto' alone (tools/device_run.sh emulated: its portable pairs cover the portable
    kernel). Names for KERNEL_MODES."""
    if os.environ.get("CUPA_TEST_KERNEL_MODES") == "auto":
        return ("auto",)
    from cupa.gpu.device import device_info
    num_kv_heads, _, head_size = case.key_cache.shape[1:]
    rows = case.query.shape[1] // num_kv_heads
    if case.query_start_loc is not None:
        rows *= int(np.diff(case.query_start_loc).max())
    dtype = np.dtype(case.query.dtype).name
    arch = device_info().target.arch
    eight = dispatch.decode_variant(dtype, head_size, 1, arch, kv_format)
    own = dispatch.decode_variant(dtype, head_size, rows, arch, kv_format)
    # What dispatch picked, which also weighs the target's shared memory (fits_shared_memory).
    mma = isinstance(eight, catalogue.DecodeMmaVariant)
    dense = ("dense",) if dispatch.dense_variant(eight, arch) is not None else ()
    wide = ("wide",) if dispatch.wide_variant(own, rows, arch) is not None else ()
    shallow = ("shallow",) if mma and (eight.deep or own.deep) else ()
    if mma and own.heads == 16:
        return ("16-row", "row-chunks", *dense, *wide, *shallow, "portable")
    if mma:
        return ("auto", *dense, *wide, *shallow, "portable")
    return ("auto", "portable") if dispatch.matrix_eligible(dtype, head_size, arch) else ("auto",)


# (partition size, merge form): forced short partitions merged by the reduce launch and within
# clusters (sm_90, tensor-core kernels; elsewhere the reduce again), the planner's choice, and one
# partition of the whole capacity.
PARTITIONINGS = ((PARTITION, "reduce"), (PARTITION, "cluster"), (None, "auto"),
                 ("capacity", "auto"))


def planned(args, options, **plan_options):
    """plan_decode with lse, and run(...) with the plan's lse and the given `out` poisoned (NaN)
    first: a row the kernels leave unwritten stays NaN."""
    import cupy
    per_call = {k: options[k] for k in ("query_start_loc", "alibi_slopes", "sinks")}
    plan = cupa.plan_decode(*args, **options, return_lse=True, **plan_options)

    def run(out=None):
        plan.lse.fill(np.nan)
        if out is None:
            plan.out.fill(np.nan)
        result, lse = plan.run(*args, **per_call, out=out)
        assert lse is plan.lse and result is (plan.out if out is None else out)
        cupy.cuda.get_current_stream().synchronize()
        return result, lse
    return plan, run


def check_lse(lse, ref_lse, where, rtol=1e-5, atol=2e-4):
    """lse against the reference: -inf exactly where the reference has it (rows with nothing to
    attend to), close elsewhere; NaN (the poison) nowhere."""
    import cupy
    got = cupy.asnumpy(lse).astype(np.float64)
    assert not np.isnan(got).any(), f"lse not written everywhere ({where})"
    np.testing.assert_allclose(got, ref_lse, rtol=rtol, atol=atol, err_msg=f"lse ({where})")


def run_and_check(case, dtype, **kwargs):
    """Decode on the GPU, every partitioning and merge form and every kernel that applies,
    against the reference: once through `cupa.decode` into a NaN-poisoned `out`, once through
    a plan with NaN-poisoned output and lse (decode's own lse would be a fresh allocation that
    could hold an earlier run's values)."""
    import cupy
    ref_out, ref_lse = paged_decode_reference(*case.args(), **case.options())
    args, options = to_gpu(case)
    capacity = case.block_tables.shape[1] * case.key_cache.shape[2]
    for mode in kernel_modes(case):
        for partition_size, merge in PARTITIONINGS:
            size = capacity if partition_size == "capacity" else partition_size
            where = f"kernel={mode}, partition_size={size}, merge={merge}"
            with environ(**KERNEL_MODES[mode], CUPA_MERGE=merge):
                out = cupy.full(case.query.shape, np.nan, dtype=case.query.dtype)
                result = cupa.decode(*args, **options, out=out, partition_size=size, **kwargs)
                assert result is out
                _, run = planned(args, options, partition_size=size, **kwargs)
                planned_out, lse = run(cupy.full(case.query.shape, np.nan, case.query.dtype))
            for got, how in ((out, "decode"), (planned_out, "plan")):
                got = cupy.asnumpy(got).astype(np.float64)
                assert np.isfinite(got).all(), f"non-finite output ({how}, {where})"
                err = rel_error(got, ref_out)
                assert err <= REL_BOUND[dtype], (f"rel error {err:.3g} > {REL_BOUND[dtype]} "
                                                 f"({how}, {where})")
            check_lse(lse, ref_lse, where)


@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_matrix(rng, dtype, head_size, block_size, group, alibi):
    lengths = list(LENGTHS) + [int(rng.integers(1, 3000))]
    case = make_case(rng, dtype=dtype, head_size=head_size, block_size=block_size,
                     num_kv_heads=2, group=group, seq_lens=lengths, alibi=alibi)
    run_and_check(case, dtype)


@pytest.mark.parametrize("group", [3, 5, 6, 12, 32, 64])
def test_uneven_and_large_groups(rng, group):
    case = make_case(rng, dtype="float16", head_size=128, block_size=16, num_kv_heads=1,
                     group=group, seq_lens=(1, 300, 1031))
    run_and_check(case, "float16")


def test_empty_sequences_and_lse(rng):
    import cupy
    case = make_case(rng, dtype="float16", head_size=64, block_size=16, group=4,
                     seq_lens=(0, 5, 0, 700))
    run_and_check(case, "float16")
    args, options = to_gpu(case)
    out = cupy.full(case.query.shape, np.nan, dtype=case.query.dtype)
    cupa.decode(*args, out=out)
    _, run = planned(args, options)
    planned_out, lse = run()
    for got in (out, planned_out):
        assert (cupy.asnumpy(got[[0, 2]]) == 0).all()
    assert np.isneginf(cupy.asnumpy(lse[[0, 2]])).all()


def test_long_context_million_tokens(rng):
    n = 1 << 20
    case = make_case(rng, dtype="float16", head_size=64, block_size=32, num_kv_heads=1, group=4,
                     seq_lens=(n, 3), shared_blocks=False, spare_columns=1)
    run_and_check(case, "float16")


def test_many_sequences_single_partition(rng):
    case = make_case(rng, dtype="bfloat16", head_size=128, block_size=16, num_kv_heads=8,
                     group=8, seq_lens=rng.integers(1, 600, size=80))
    run_and_check(case, "bfloat16")


@pytest.mark.parametrize("chained", ["1", "0"], ids=["chained_reduce", "ordinary_reduce"])
def test_reduce_launch_forms(rng, switch, chained):
    """The reduce launched as a programmatic dependent of phase 1 (sm_90) and the ordinary way
    give the same, correct results, with many partitions (up to 36: more than a cluster merges)
    and with sinks and empty sequences."""
    switch("CUPA_CHAINED_REDUCE", chained)
    case = make_case(rng, dtype="float16", head_size=128, block_size=16, num_kv_heads=2,
                     group=8, seq_lens=(0, 1, 257, 3000, 9000), sinks=True)
    run_and_check(case, "float16")


@pytest.mark.parametrize("chained", ["1", "0"], ids=["chained_phase1", "ordinary_phase1"])
@pytest.mark.parametrize("partition_size, merge", [(256, "reduce"), (256, "cluster"),
                                                   (None, "auto"), ("capacity", "auto")],
                         ids=["reduce", "cluster", "planned", "one_partition"])
@pytest.mark.parametrize("group, row_chunks", [(8, None), (16, "never")],
                         ids=["8_columns", "16_rows"])
def test_back_to_back_runs_sharing_a_workspace(rng, switch, chained, partition_size, merge,
                                               group, row_chunks):
    """Runs of one plan issued back to back, nothing between them, each on its own query into
    its own output: on sm_90 each run's phase 1 is a programmatic dependent of the previous
    run's last kernel and may be resident before that kernel ends, so it must not read or
    write (the shared partials) before it has waited for it. Both tensor-core kernels (group 8:
    the 8-column kernel, 16: the 16-row one), each allowing what follows it at its start or,
    for a grid of one partition past half its slots (72 sequences here), after its chunks.
    Every output is checked."""
    import cupy
    switch("CUPA_CHAINED_PHASE1", chained)
    switch("CUPA_MERGE", merge)
    switch("CUPA_ROW_CHUNKS", row_chunks)
    one_partition = partition_size == "capacity"
    case = make_case(rng, dtype="float16", head_size=128, block_size=16, num_kv_heads=4,
                     group=group, seq_lens=(5, 700, 1500, 2048, 0, 1023) * (12 if one_partition
                                                                              else 1))
    if one_partition:  # the table's whole width (its spare columns too) in one partition
        partition_size = case.block_tables.shape[1] * 16
    args, options = to_gpu(case)
    plan = cupa.plan_decode(*args, **options, partition_size=partition_size)
    variant = plan._launch_plan.variant
    if one_partition:
        assert plan._launch_plan.single_partition
        if isinstance(variant, catalogue.DecodeMmaVariant):  # 288 workgroups: past half the
            assert not plan._launch_plan.next_call_at_start  # slots at up to 4 a multiprocessor
    if isinstance(variant, catalogue.DecodeMmaVariant):  # NVIDIA's tensor cores (sm_80 on)
        assert ("mma16" in variant.partition_name) is (group == 16), variant.partition_name
    queries = [cupy.asarray(rng.standard_normal(case.query.shape).astype(case.query.dtype))
               for _ in range(6)]
    outs = [cupy.full(case.query.shape, np.nan, dtype=case.query.dtype) for _ in queries]
    for query, out in zip(queries, outs):
        plan.run(query, *args[1:], out=out)
    cupy.cuda.get_current_stream().synchronize()
    for k, (query, out) in enumerate(zip(queries, outs)):
        host_args = (cupy.asnumpy(query),) + tuple(case.args()[1:])
        ref, _ = paged_decode_reference(*host_args, **case.options())
        err = rel_error(cupy.asnumpy(out).astype(np.float64), ref)
        assert err <= REL_BOUND["float16"], f"run {k} ({plan.merge}): rel error {err:.3g}"


@pytest.mark.parametrize("num_partitions", [2, 8, 9, 16])
def test_cluster_merge_sizes(rng, switch, num_partitions):
    """Partitions merged within clusters of 2 to 16 blocks (above 8 the kernel opts in to
    non-portable sizes), where the tensor-core kernels run on sm_90; ragged lengths leave some
    blocks of a cluster without work, one sequence has a single partition with work, and one
    none."""
    import cupy
    from cupa.gpu.device import device_info
    switch("CUPA_MERGE", "cluster")
    lengths = (0, 100, 256 * num_partitions - 5, 257, 128 * num_partitions + 3)
    case = make_case(rng, dtype="bfloat16", head_size=128, block_size=16, num_kv_heads=2,
                     group=8, seq_lens=lengths, sinks=True, spare_columns=0)
    args, options = to_gpu(case)
    plan = cupa.plan_decode(*args, **options, return_lse=True, partition_size=256)
    assert plan.max_partitions == num_partitions
    clusters = dispatch.merges_in_cluster(plan._launch_plan.variant, device_info().target.arch,
                                          num_partitions, plan._launch_plan.head_chunks)
    assert plan.merge == ("cluster" if clusters else "reduce")
    ref, ref_lse = paged_decode_reference(*case.args(), **case.options())
    for run in range(2):  # a second run on the same plan, its outputs poisoned again
        plan.out.fill(np.nan)
        plan.lse.fill(np.nan)
        out, lse = plan.run(*args, sinks=options["sinks"])
        assert out is plan.out and lse is plan.lse
        got = cupy.asnumpy(out)
        assert np.isfinite(got.astype(np.float32)).all(), f"run {run}: non-finite output"
        assert rel_error(got, ref) <= REL_BOUND["bfloat16"], f"run {run}"
        check_lse(lse, ref_lse, f"run {run}")


def test_a_staggered_first_wave_changes_no_output(rng, switch):
    """A uniform batch whose grid takes several waves starts its first wave staggered on sm_90
    (planner.first_wave_stagger): the output matches the reference and, bit for bit, the same
    problem's without the stagger."""
    import cupy
    from cupa.gpu import planner
    from cupa.gpu.catalogue import sm_number
    from cupa.gpu.device import device_info
    lengths = tuple(int(n) for n in rng.integers(460, 513, 96))  # 768 workgroups
    case = make_case(rng, dtype="float16", head_size=128, num_kv_heads=8, group=8,
                     seq_lens=lengths)
    args, options = to_gpu(case)
    outs = []
    for setting in (None, "never"):
        switch("CUPA_STAGGER", setting)
        plan = cupa.plan_decode(*args, **options, max_seq_len=512)
        launch = plan._launch_plan
        arch = device_info().target.arch
        expect = (setting is None and arch.startswith("sm_")
                  and sm_number(arch) >= planner.STAGGER_MIN_SM
                  and isinstance(launch.variant, catalogue.DecodeMmaVariant))
        assert (launch.stagger_ns > 0) == expect, launch
        plan.out.fill(np.nan)
        outs.append(cupy.asnumpy(plan.run(*args)))
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    assert np.isfinite(outs[0].astype(np.float32)).all()
    assert rel_error(outs[0], ref) <= REL_BOUND["float16"]
    assert np.array_equal(outs[0], outs[1])


def test_numpy_inputs_give_numpy_outputs(rng):
    case = make_case(rng, dtype="float16", head_size=128, group=2, seq_lens=(33, 400))
    out = cupa.decode(*case.args(), backend="gpu")
    assert isinstance(out, np.ndarray) and out.dtype == np.float16
    ref, _ = paged_decode_reference(*case.args())
    assert rel_error(out, ref) <= REL_BOUND["float16"]
    given = np.full(case.query.shape, np.nan, np.float16)  # a host `out`, poisoned
    assert cupa.decode(*case.args(), backend="gpu", out=given) is given
    assert np.isfinite(given).all() and rel_error(given, ref) <= REL_BOUND["float16"]


def poisoned_out(case):
    import cupy
    return cupy.full(case.query.shape, np.nan, dtype=case.query.dtype)


def test_device_tables_are_clamped_not_read_out_of_bounds(rng):
    """Device tables are not checked on the host: lengths past capacity clamp to it."""
    import cupy
    case = make_case(rng, dtype="float32", head_size=64, block_size=8, group=2,
                     seq_lens=(40, 24), spare_columns=0)
    capacity = case.block_tables.shape[1] * 8
    args, _ = to_gpu(case)
    args[4] = cupy.asarray(np.array([capacity + 1000, 24], np.int32))
    clamped = case.seq_lens.copy()
    clamped[0] = capacity
    ref, _ = paged_decode_reference(*case.args()[:4], clamped)
    out = cupa.decode(*args, out=poisoned_out(case))
    assert rel_error(cupy.asnumpy(out), ref) <= REL_BOUND["float32"]


@pytest.mark.parametrize("bad_id", ["far_past", "num_blocks", "minus_one", "most_negative"])
@pytest.mark.parametrize("column", [0, 16, 24])
@pytest.mark.parametrize("dtype, head_size, group", [("float32", 64, 2), ("bfloat16", 128, 8)],
                         ids=["f32-d64-g2", "bf16-d128-g8"])
def test_block_ids_outside_the_cache_are_left_out(rng, dtype, head_size, group, bad_id,
                                                   column):
    """A used block id outside [0, num_blocks) in a device table: the kernel contract is that
    its tokens are never read (logit -inf), so the result is the reference over the sequence's
    other tokens (its table without that column, its length one block shorter); the other
    sequence is untouched. Every kernel that applies, one partition and two (the block at the
    start of the second, column 16, in the first, or the last)."""
    import cupy
    block_size = 8
    case = make_case(rng, dtype=dtype, head_size=head_size, block_size=block_size,
                     group=group, seq_lens=(300, 200), spare_columns=0)
    num_blocks = case.key_cache.shape[0]
    bad = {"far_past": 10**9, "num_blocks": num_blocks, "minus_one": -1,
           "most_negative": -2**31}[bad_id]
    tables = case.block_tables.copy()
    tables[1, column] = bad  # sequence 1 has 25 full blocks: tokens 8c .. 8c + 7 go
    args, _ = to_gpu(case)
    args[3] = cupy.asarray(tables)
    # Without ALiBi, window or several new tokens, positions do not enter the softmax: leaving
    # the block out is the same as a table without that column and 8 tokens fewer.
    kept = case.block_tables.copy()
    kept[1] = np.concatenate([np.delete(case.block_tables[1], column), case.block_tables[1, -1:]])
    lens = case.seq_lens - np.array([0, block_size], np.int32)
    ref, _ = paged_decode_reference(case.query, case.key_cache, case.value_cache, kept, lens)
    for mode in kernel_modes(case):
        for partition_size in (None, 128):
            with environ(**KERNEL_MODES[mode]):
                out = cupa.decode(*args, out=poisoned_out(case), partition_size=partition_size)
            out = cupy.asnumpy(out).astype(np.float64)
            where = f"kernel={mode}, partition_size={partition_size}"
            assert np.isfinite(out).all(), where
            for s in range(2):
                err = rel_error(out[s], ref[s])
                assert err <= REL_BOUND[dtype], f"sequence {s}: rel error {err:.3g} ({where})"


def test_stream_and_foreign_arrays(rng):
    import cupy
    case = make_case(rng, dtype="float16", head_size=96, group=4, seq_lens=(5, 900))
    args, _ = to_gpu(case)
    stream = cupy.cuda.Stream(non_blocking=True)
    # The uploads ran on the default stream, which a non-blocking stream does not wait for: their
    # DMA may still be in flight (the likely cause of a one-off failure under load).
    given = poisoned_out(case)
    stream.wait_event(cupy.cuda.get_current_stream().record())
    out = cupa.decode(*args, stream=stream, out=given)
    stream.synchronize()
    assert out is given
    ref, _ = paged_decode_reference(*case.args())
    assert rel_error(cupy.asnumpy(out), ref) <= REL_BOUND["float16"]

    class Foreign:  # a minimal non-cupy device array, as torch or numba would expose
        def __init__(self, a):
            self.__cuda_array_interface__ = a.__cuda_array_interface__
    given = poisoned_out(case)
    out = cupa.decode(*(Foreign(a) for a in args), out=Foreign(given))
    assert rel_error(cupy.asnumpy(given), ref) <= REL_BOUND["float16"]
    out = cupa.decode(*(Foreign(a) for a in args))
    assert rel_error(cupy.asnumpy(cupy.asarray(out)), ref) <= REL_BOUND["float16"]


def test_repeated_calls_are_deterministic(rng):
    import cupy
    case = make_case(rng, dtype="bfloat16", head_size=128, group=8, seq_lens=(3000, 1, 513))
    args, _ = to_gpu(case)
    ref, _ = paged_decode_reference(*case.args())
    first = cupa.decode(*args, partition_size=256, out=poisoned_out(case))
    assert rel_error(cupy.asnumpy(first), ref) <= REL_BOUND["bfloat16"]
    first = cupy.asnumpy(first).view(np.uint16)
    for _ in range(3):
        again = cupa.decode(*args, partition_size=256, out=poisoned_out(case))
        np.testing.assert_array_equal(first, cupy.asnumpy(again).view(np.uint16))


def test_tensor_core_kernel_is_chosen_where_it_applies():
    from cupa.gpu.device import device_info
    from cupa.gpu.planner import make_plan
    from cupa.problem import DecodeShape
    arch = device_info().target.arch
    shape = DecodeShape(num_seqs=4, num_tokens=4, num_heads=64, num_kv_heads=8, head_size=128, num_blocks=64,
                        block_size=16, max_blocks_per_seq=16, dtype="float16", scale=0.1,
                        has_alibi=False)
    variant = make_plan(shape, 132, arch=arch).variant
    nvidia_ampere_plus = arch.startswith("sm_") and int(arch[3:]) >= 80
    assert isinstance(variant, catalogue.DecodeMmaVariant) == nvidia_ampere_plus
    amd_matrix_cores = (catalogue.matrix_core_family(arch) is not None
                        and dispatch.switches().kernel != "portable")
    assert isinstance(variant, catalogue.DecodeMatrixVariant) == amd_matrix_cores


GPU_FEATURES = {
    "window": dict(sliding_window=300),  # spans partition boundaries of PARTITION = 256
    "softcap": dict(logits_soft_cap=3.0),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=1000, logits_soft_cap=10.0, sinks=True, alibi=True),
}


@pytest.mark.parametrize("feature", list(GPU_FEATURES))
@pytest.mark.parametrize("head_size, group", [(128, 8), (128, 16), (96, 3), (64, 1)],
                         ids=["mma8", "mma16", "portable", "mha"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_features(rng, dtype, head_size, group, feature):
    case = make_case(rng, dtype=dtype, head_size=head_size, block_size=16, num_kv_heads=2,
                     group=group, seq_lens=(0, 1, 255, 257, 700, 3000), **GPU_FEATURES[feature])
    run_and_check(case, dtype)


def test_merge_states_on_device(rng):
    import cupy
    case = make_case(rng, dtype="bfloat16", head_size=128, group=8, seq_lens=(2000,),
                     shared_blocks=False)
    args, options = to_gpu(case)
    q, k, v, tables, lens = args
    split_blocks = 40  # 640 tokens
    rest_tables = cupy.roll(tables, -split_blocks, axis=1)
    halves = []
    for part_tables, length in ((tables, 640), (rest_tables, 1360)):
        part = [q, k, v, part_tables, cupy.asarray(np.array([length], np.int32))]
        _, run = planned(part, options)  # outputs and lse poisoned before the run
        halves.append([x.copy() for x in run()])
    out, lse = cupa.merge_states(*halves[0], *halves[1])
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype
    ref, ref_lse = paged_decode_reference(*case.args())
    assert rel_error(cupy.asnumpy(out), ref) <= REL_BOUND["bfloat16"]
    check_lse(lse, ref_lse, "merged")


@pytest.mark.parametrize("seq_lens, num_kv_heads, group, expected", [
    ((32768,), 8, 8, (8, 1, 2048, 16)),    # one workgroup a multiprocessor (ONE_PER_SM_DENSITY)
    ((8192,) * 5, 8, 8, (8, 1, 1536, 6)),  # a split grid fitted to one wave
    ((2048,) * 32, 4, 16, (16, 1, 2048, 1)),  # the one-tile 16-row kernel, unsplit (v24)
    ((4096,) * 16, 4, 16, (16, 1, 2048, 2)),  # ... one a multiprocessor: a cluster pair
], ids=["few-long", "one-wave", "one-tile-unsplit", "one-tile-pair"])
def test_the_planners_own_choices_on_long_problems(rng, seq_lens, num_kv_heads, group, expected):
    """The planner's partitions (no forced size) for the problems its v23-v24 rules decide,
    against the reference; on an H200 (132 multiprocessors, sm_90) also the plan those rules
    give: (columns of the kernel, row chunks, partition size, partitions)."""
    import cupy
    from cupa.gpu.device import device_info
    case = make_case(rng, dtype="float16", head_size=128, num_kv_heads=num_kv_heads,
                     group=group, seq_lens=seq_lens, spare_columns=0)
    args, options = to_gpu(case)
    plan, run = planned(args, options)
    info = device_info()
    if info.multiprocessors == 132 and info.target.arch == "sm_90":
        launch = plan._launch_plan
        assert (launch.variant.heads, launch.head_chunks, launch.partition_size,
                launch.max_partitions) == expected
    out, lse = run()
    ref, ref_lse = paged_decode_reference(*case.args(), **case.options())
    err = rel_error(cupy.asnumpy(out).astype(np.float64), ref)
    assert err <= REL_BOUND["float16"], f"rel error {err:.3g}"
    check_lse(lse, ref_lse, "planner's choice")
