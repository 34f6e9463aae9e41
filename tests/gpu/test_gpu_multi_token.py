"""Multi-token decode and graph-captured plans on the GPU, against the float64 reference.

Skips without a GPU; runs unchanged on CUDA and ROCm.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.reference import paged_decode_reference

from cases import REL_BOUND, environ, make_case, rel_error
from test_gpu_decode import KERNEL_MODES, check_lse, kernel_modes, run_and_check

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

# "short": at most 4 new tokens (rows fit the 8-column tensor-core kernel up to group 2);
# "long": up to 16 (several 16-row tiles, and chunks of 64 rows for groups of 8 and more).
NEW_TOKENS = {"short": (2, 4, 1, 3, 4), "long": (16, 1, 7, 3, 12)}
FEATURES = {"plain": {},
            "all": dict(sliding_window=300, logits_soft_cap=10.0, sinks=True, alibi=True)}
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("new_tokens", list(NEW_TOKENS))
@pytest.mark.parametrize("group", [1, 2, 8, 16])
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_multi_token_matrix(rng, dtype, head_size, group, new_tokens, feature):
    block_size = (8, 16, 32)[HEAD_SIZES.index(head_size) % 3]
    case = make_case(rng, dtype=dtype, head_size=head_size, block_size=block_size,
                     num_kv_heads=2, group=group, seq_lens=(1, 255, 257, 700, 2000),
                     new_tokens=NEW_TOKENS[new_tokens], **FEATURES[feature])
    run_and_check(case, dtype)


def test_host_query_start_loc_and_hint(rng):
    """A host query_start_loc is read for the grid; a device one with max_query_len too."""
    import cupy
    case = make_case(rng, dtype="float16", head_size=128, group=4, seq_lens=(40, 900, 3),
                     new_tokens=(5, 2, 3))
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    args = [cupy.asarray(x) for x in case.args()]
    for loc, hint in ((case.query_start_loc, None), (cupy.asarray(case.query_start_loc), 5)):
        out = cupy.full(case.query.shape, np.nan, dtype=case.query.dtype)
        cupa.decode(*args, query_start_loc=loc, max_query_len=hint, partition_size=256, out=out)
        got = cupy.asnumpy(out)
        assert np.isfinite(got).all() and rel_error(got, ref) <= REL_BOUND["float16"]


@pytest.mark.parametrize("dtype, head_size, group", [("float16", 128, 8), ("float32", 64, 2),
                                                     ("bfloat16", 128, 16)])
def test_device_query_start_loc_is_clamped_into_the_query(rng, dtype, head_size, group):
    """A device query_start_loc whose entries after the real sequences are the extremes of
    int32: each end of a span is clamped into the query, so those sequences own no row (the
    span [4, 2^31 - 1) and [2^31 - 1, -2^31) both become [4, 4)), and the real sequences'
    rows are the reference's. Every kernel that applies (tests/unit/test_kernels_sanitized_cpu.py
    runs the AMD builds of the same case under the sanitizers)."""
    import cupy
    case = make_case(rng, dtype=dtype, head_size=head_size, group=group,
                     seq_lens=(300, 137, 1, 1), new_tokens=(2, 2, 1, 1))
    ref, _ = paged_decode_reference(case.query[:4], case.key_cache, case.value_cache,
                                    case.block_tables[:2], case.seq_lens[:2],
                                    **dict(case.options(), query_start_loc=np.array([0, 2, 4],
                                                                                    np.int32)))
    starts = cupy.asarray(np.array([0, 2, 4, 2**31 - 1, -2**31], np.int32))
    query = cupy.asarray(case.query[:4])
    args = [query] + [cupy.asarray(x) for x in case.args()[1:]]
    for mode in kernel_modes(case):
        for partition_size in (None, 128):
            out = cupy.full(query.shape, np.nan, dtype=query.dtype)
            with environ(**KERNEL_MODES[mode]):
                cupa.decode(*args, query_start_loc=starts, max_query_len=2, out=out,
                            partition_size=partition_size)
            got = cupy.asnumpy(out)
            where = f"kernel={mode}, partition_size={partition_size}"
            assert np.isfinite(got.astype(np.float32)).all(), where
            assert rel_error(got, ref) <= REL_BOUND[dtype], where


def _fixed_case(rng, seq_lens, new_tokens, num_blocks, width, **kwargs):
    """A random case with a given cache size and table width (so graph arrays keep shapes)."""
    block_size = 16
    needed = max(-(-int(n) // block_size) for n in seq_lens)
    return make_case(rng, dtype="bfloat16", head_size=128, block_size=block_size,
                     num_kv_heads=2, group=8, seq_lens=seq_lens, new_tokens=new_tokens,
                     num_blocks=num_blocks, spare_columns=width - needed, **kwargs)


@pytest.mark.parametrize("merge", [None, "reduce", "cluster"],
                         ids=["single", "split_reduce", "split_cluster"])
def test_graph_capture_replays_with_new_contents(rng, switch, merge):
    """Replays of a captured plan decode new contents; split plans merge their partitions with
    the reduce launch or within clusters (sm_90)."""
    import cupy
    partitioned = merge is not None
    if partitioned:
        switch("CUPA_MERGE", merge)
    num_blocks, width = 300, 160  # capacity 2560 tokens
    trials = [((2500, 30, 1, 700), (4, 1, 2, 3)), ((17, 2560, 900, 5), (3, 3, 2, 2)),
              ((1, 4, 2000, 64), (1, 4, 4, 1))]
    first = _fixed_case(rng, *trials[0], num_blocks, width, sinks=True)
    arrays = [cupy.asarray(x) for x in first.args()]
    loc, sinks = cupy.asarray(first.query_start_loc), cupy.asarray(first.sinks)
    plan = cupa.plan_decode(*arrays, query_start_loc=loc, sinks=sinks, max_query_len=4,
                            max_seq_len=2560, return_lse=True,
                            partition_size=256 if partitioned else 2560)
    assert (plan.max_partitions > 1) == partitioned
    if partitioned:  # clusters where the kernel can (sm_90, tensor cores), else the reduce
        from cupa.gpu import dispatch
        from cupa.gpu.device import device_info
        launch = plan._launch_plan
        clusters = dispatch.merges_in_cluster(launch.variant, device_info().target.arch,
                                              plan.max_partitions, launch.head_chunks)
        assert plan.merge == ("cluster" if clusters else "reduce")
    else:
        assert plan.merge == "single"
    plan.run(*arrays, query_start_loc=loc, sinks=sinks)  # compiles outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        out, lse = plan.run(*arrays, query_start_loc=loc, sinks=sinks)
        graph = stream.end_capture()
    assert out is plan.out and lse is plan.lse

    for seq_lens, new_tokens in trials:
        case = _fixed_case(rng, seq_lens, new_tokens, num_blocks, width, sinks=True)
        with stream:  # new contents in the captured arrays, on the graph's stream
            for device, host in zip(arrays + [loc, sinks],
                                    list(case.args()) + [case.query_start_loc, case.sinks]):
                device[...] = cupy.asarray(host)
            out.fill(np.nan)
            lse.fill(np.nan)
            graph.launch(stream)
        stream.synchronize()
        ref, ref_lse = paged_decode_reference(*case.args(), **case.options())
        got = cupy.asnumpy(out)
        assert np.isfinite(got.astype(np.float32)).all()
        assert rel_error(got, ref) <= REL_BOUND["bfloat16"]
        check_lse(lse, ref_lse, f"replay of {seq_lens}")
