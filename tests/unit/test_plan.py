"""Launch planning and kernel selection: pure functions of shapes, checked without a GPU."""

import os

import pytest

from cupa.gpu import catalogue, dispatch, planner
from cupa.gpu.planner import make_plan
from cupa.problem import MAX_GRID_YZ
from cupa.problem import DecodeShape

H200_SMS = 132


def shape(batch=1, seq_len=4096, heads=64, kv_heads=8, head_size=128, block_size=16,
          dtype="float16", window=0, kv_format=None):
    return DecodeShape(num_seqs=batch, num_tokens=batch, num_heads=heads, num_kv_heads=kv_heads,
                       head_size=head_size, num_blocks=batch * seq_len // block_size,
                       block_size=block_size, max_blocks_per_seq=-(-seq_len // block_size),
                       dtype=dtype, scale=0.1, has_alibi=False, sliding_window=window,
                       kv_format=kv_format)


@pytest.mark.parametrize("dtype, head_size, group, arch, expected", [
    ("float16", 128, 8, "sm_90", "cupa_decode_mma8_f16_d128"),
    ("bfloat16", 64, 2, "sm_80", "cupa_decode_mma8_bf16_d64"),
    ("float16", 128, 16, "sm_90", "cupa_decode_mma16_f16_d128"),
    ("float16", 128, 64, "sm_90", "cupa_decode_mma16_f16_d128"),
    ("float16", 128, 8, "sm_75", "cupa_decode_f16_d128_h8"),      # no mma.sync path below sm_80
    ("float16", 128, 8, "gfx942", "cupa_decode_xmma1_f16_d128"),  # AMD: matrix cores
    ("bfloat16", 64, 1, "gfx90a", "cupa_decode_xmma1_bf16_d64"),  # MHA: one padded tile
    ("float16", 128, 32, "gfx942", "cupa_decode_xmma2_f16_d128"),  # two 16-row tiles
    ("float16", 128, 32, "gfx1201", "cupa_decode_xmma2_f16_d128"),
    ("float16", 128, 32, "gfx1100", "cupa_decode_xmma2_f16_d128"),  # RDNA3: a wavefront pair
    ("float16", 112, 32, "gfx1100", "cupa_decode_xmma1_f16_d112"),  # RDNA3: one at head 112
    ("float16", 192, 32, "gfx1100", "cupa_decode_xmma1_f16_d192"),  # RDNA3: one at head 192
    ("float16", 192, 32, "gfx1201", "cupa_decode_xmma2_f16_d192"),  # RDNA4: a wavefront pair
    ("bfloat16", 64, 32, "gfx1100", "cupa_decode_xmma2_bf16_d64"),
    ("float16", 256, 32, "gfx1201", "cupa_decode_xmma1_f16_d256"),  # head 256: one tile
    ("float16", 128, 8, "gfx1030", "cupa_decode_f16_d128_h8"),    # RDNA2: no WMMA, portable
    ("float16", 128, 8, "gfx908", "cupa_decode_f16_d128_h8"),     # MI100: portable
    ("float32", 128, 8, "gfx942", "cupa_decode_f32_d128_h8"),     # fp32: portable
    ("float16", 96, 4, "gfx942", "cupa_decode_xmma1_f16_d96"),    # head 96: matrix cores too
    ("float16", 112, 32, "gfx1201", "cupa_decode_xmma1_f16_d112"),  # RDNA4: one at head 112
    ("bfloat16", 80, 32, "gfx942", "cupa_decode_xmma2_bf16_d80"),
    ("float16", 192, 32, "gfx90a", "cupa_decode_xmma1_f16_d192"),  # head 192: one tile
    ("float32", 128, 8, "sm_90", "cupa_decode_f32_d128_h8"),      # fp32: portable kernel
    ("float32", 96, 3, "sm_90", "cupa_decode_f32_d96_h4"),        # fp32 head 96: tile 4
    ("bfloat16", 256, 12, "sm_90", "cupa_decode_mma16_bf16_d256_deep"),  # query in shared
    ("float16", 256, 16, "sm_80", "cupa_decode_mma16_f16_d256"),  # 2 stages and the query
    ("bfloat16", 256, 8, "sm_90", "cupa_decode_mma8_bf16_d256_deep"),  # 3 stages on sm_90
    ("bfloat16", 256, 8, "sm_80", "cupa_decode_mma8_bf16_d256"),  # 2 on sm_80 (163 KB)
    ("float16", 256, 2, "sm_80", "cupa_decode_mma8_f16_d256"),
])
def test_kernel_selection(dtype, head_size, group, arch, expected):
    assert dispatch.decode_variant(dtype, head_size, group, arch).partition_name == expected


@pytest.mark.parametrize("rows, arch, expected", [
    (16, "sm_90", "cupa_decode_mma16_f16kv8fn_d256"),  # 99 KB of ring, 8 KB of query
    (16, "sm_80", "cupa_decode_mma16_f16kv8_d256"),
    # sm_89 gives a workgroup 99 KB: the 8-column kernel's ring fits, the 16-row kernel's ring
    # and query (106 KB) do not: row chunks
    (16, "sm_89", "cupa_decode_mma8_f16kv8fn_d256"),
    (8, "sm_89", "cupa_decode_mma8_f16kv8fn_d256"),
])
def test_more_rows_than_eight_fall_back_to_row_chunks_where_the_16_row_kernel_does_not_fit(
        rows, arch, expected):
    variant = dispatch.decode_variant("float16", 256, rows, arch, "fp8_e4m3")
    assert variant.partition_name == expected and dispatch.fits_shared_memory(variant, arch)


@pytest.mark.parametrize("dtype, head_size, rows, arch, fmt, expected", [
    ("float16", 96, 3, "sm_90", None, "cupa_decode_mma8_f16_d96"),
    ("bfloat16", 80, 16, "sm_80", None, "cupa_decode_mma16_bf16_d80"),
    ("float16", 112, 32, "sm_90", None, "cupa_decode_mma16_f16_d112"),
    ("float16", 192, 16, "sm_90", None, "cupa_decode_mma16_f16_d192_deep"),  # query in shared
    ("float16", 192, 32, "sm_90", "fp8_e4m3", "cupa_decode_mma16_f16kv8fn_d192"),
    ("bfloat16", 96, 4, "sm_90", "fp8_e4m3", "cupa_decode_mma8_bf16kv8fn_d96"),
    ("float16", 192, 8, "sm_80", "fp8_e4m3", "cupa_decode_mma8_f16kv8_d192"),
    ("float16", 96, 4, "sm_75", None, "cupa_decode_f16_d96_h4"),       # below sm_80: portable
])
def test_staged_head_sizes_on_the_tensor_cores(switch, dtype, head_size, rows, arch, fmt,
                                               expected):
    """Heads 80, 96, 112 and 192 on the tensor-core kernels by default (rows staged at their own
    width, 128 or 256), the 16-row one up to 112; CUPA_STAGED_HEADS=never leaves them to the
    portable kernel."""
    assert dispatch.decode_variant(dtype, head_size, rows, arch, fmt).partition_name == expected
    switch("CUPA_STAGED_HEADS", "never")
    assert isinstance(dispatch.decode_variant(dtype, head_size, rows, arch, fmt),
                      catalogue.DecodeVariant)


@pytest.mark.parametrize("head_size, cache, staged, stages", [
    (80, None, 80, 4),      # own width: 160-byte rows, 4 stages of 20 KB
    (96, None, 96, 4),      # own width: 192-byte rows, 4 stages of 24 KB
    (112, None, 112, 3),    # own width: 224-byte rows, 3 stages of 28 KB (4 would not fit twice)
    (80, "fp8", 80, 4),     # fp8 at own width (two steps a warp): 80-byte rows, 4 of 20 KB
    (96, "fp8", 96, 4),     # 96-byte rows, 4 stages of 24 KB
    (112, "fp8", 112, 3),   # 112-byte rows, 3 stages of 28 KB
    (128, "fp8", 128, 3),   # fp8 at head 128: 3 stages of 32 KB
    (192, None, 256, 2),    # staged at 256: sm_80's ring of 2 stages of 64 KB
])
def test_rows_staged_at_their_own_width_take_a_deeper_ring(head_size, cache, staged, stages):
    """Rows at heads 80, 96 and 112 (16-bit and fp8) are staged at their own width, so the ring
    of two workgroups a multiprocessor holds a fourth stage at 80 and 96; the others keep a
    staged width of 128 or 256 (KvRing in ring.cuh; the offline ring-layout check compares the
    kernel's bytes)."""
    assert catalogue.staged_head_size(head_size) == staged
    for heads in (8, 16):
        v = catalogue.DecodeMmaVariant("float16", head_size, heads, cache)
        assert v.warp_steps == (2 if cache else 1)
        chunk = 64 * v.warp_steps
        row_bytes = staged * (1 if cache else 2)
        ring = stages * 2 * chunk * row_bytes + 2 * stages * chunk * 4
        merge = 4 * heads * catalogue.merge_row_floats(heads, head_size) * 4  # padded rows
        query = 16 * head_size * 2 if v.shared_query else 0
        assert v.shared_bytes == max(ring, merge) + query, (heads, v)
        assert v.workgroups_per_sm == (1 if staged == 256 and not cache else 2)


@pytest.mark.parametrize("dtype, head_size, rows, arch, fmt, expected, power", [
    # OCP e4m3 on sm_89+: hardware conversion, exact values (power 1)
    ("float16", 128, 8, "sm_90", "fp8_e4m3", "cupa_decode_mma8_f16kv8fn_d128", 1),
    ("bfloat16", 128, 32, "sm_89", "fp8_e4m3", "cupa_decode_mma16_bf16kv8fn_d128", 1),
    # software widening elsewhere: values times 2^(bias - 15)
    ("float16", 128, 8, "sm_80", "fp8_e4m3", "cupa_decode_mma8_f16kv8_d128", 2 ** 8),
    ("float16", 128, 8, "sm_90", "fp8_e4m3fnuz", "cupa_decode_mma8_f16kv8_d128", 2 ** 7),
    ("bfloat16", 96, 4, "sm_75", "fp8_e4m3", "cupa_decode_bf16kv8_d96_h4", 2 ** 8),  # portable
    ("bfloat16", 96, 4, "sm_90", "fp8_e4m3", "cupa_decode_mma8_bf16kv8fn_d96", 1),  # staged
    # AMD: the target's own conversion where it reads the cache's format (exact values)
    ("float16", 128, 8, "gfx942", "fp8_e4m3fnuz", "cupa_decode_xmma1_f16kv8hw_d128", 1),
    ("bfloat16", 64, 40, "gfx1201", "fp8_e4m3", "cupa_decode_xmma2_bf16kv8hw_d64", 1),
    # ... and software widening where it does not, or has none
    ("float16", 128, 8, "gfx942", "fp8_e4m3", "cupa_decode_xmma1_f16kv8_d128", 2 ** 8),
    ("float16", 128, 8, "gfx90a", "fp8_e4m3fnuz", "cupa_decode_xmma1_f16kv8_d128", 2 ** 7),
    ("float16", 128, 8, "gfx950", "fp8_e4m3", "cupa_decode_xmma1_f16kv8_d128", 2 ** 8),
    ("bfloat16", 128, 8, "gfx1100", "fp8_e4m3", "cupa_decode_xmma1_bf16kv8_d128", 2 ** 8),
])
def test_fp8_kernel_selection(dtype, head_size, rows, arch, fmt, expected, power):
    from cupa.fp8 import FP8_FORMATS
    variant = dispatch.decode_variant(dtype, head_size, rows, arch, fmt)
    assert variant.partition_name == expected
    assert catalogue.fp8_value_power(variant, FP8_FORMATS[fmt].exponent_bias) == power
    assert variant.reduce_name == f"cupa_reduce_{catalogue.DTYPES[dtype][0]}"
    assert variant in catalogue.all_variants(arch)


# Shared memory per multiprocessor, and the most one workgroup may opt in to (CUDA guide, compute
# capability tables): sm_80 164 KB / 163 KB, sm_90 228 KB / 227 KB.
SHARED_PER_SM = {"sm_80": (167936, 166912), "sm_90": (233472, 232448)}


@pytest.mark.parametrize("arch", list(SHARED_PER_SM))
def test_tensor_core_kernels_fit_their_shared_memory(arch):
    """The K/V ring must fit: as many workgroups per multiprocessor on sm_90 as the planner aims
    at (two; one for the 16-bit head-192 and head-256 kernels and the wide forms, which exist
    from sm_90), at least one on sm_80; the merge buffer reuses it."""
    per_sm, per_block = SHARED_PER_SM[arch]
    variants = [v for v in catalogue.all_variants(arch)
                if isinstance(v, catalogue.DecodeMmaVariant)]
    assert any(v.wide for v in variants) == (arch == "sm_90")
    for v in variants:
        assert 0 < v.shared_bytes <= per_block, v
        if arch == "sm_90":  # + 1 KB reserved per workgroup
            assert v.workgroups_per_sm * (v.shared_bytes + 1024) <= per_sm, v
            staged = catalogue.staged_head_size(v.head_size)  # 192 is staged at 256
            one = v.wide or (staged == 256 and not v.cache)
            assert v.workgroups_per_sm == (1 if one else 2), v
        head_rows = 8 if v.heads == 8 else 16
        warps = v.threads // 32
        merge_row = catalogue.merge_row_floats(head_rows, v.head_size)
        assert v.shared_bytes >= warps * head_rows * merge_row * 4  # the merge buffer fits


def test_forcing_the_portable_kernel(switch):
    switch("CUPA_KERNEL", "portable")
    assert isinstance(dispatch.decode_variant("float16", 128, 8, "sm_90"), catalogue.DecodeVariant)


def test_row_chunks_cover_the_group():
    big = dict(batch=64, seq_len=4096, kv_heads=1)  # too big for 8-column row chunks
    plan = make_plan(shape(heads=64, **big), H200_SMS, arch="sm_90")
    assert plan.variant.heads == 16 and plan.variant.rows == 64 and plan.head_chunks == 1
    plan = make_plan(shape(heads=128, **big), H200_SMS, arch="sm_90")
    assert plan.variant.heads == 16 and plan.head_chunks == 2
    plan = make_plan(shape(heads=12, kv_heads=1, head_size=96), H200_SMS, arch="sm_90")
    assert plan.variant.heads == 8 and plan.head_chunks == 2


def test_row_chunks_cover_every_new_token():
    # group 8 x 4 new tokens = 32 rows: one 64-row mma16 workgroup; portable: 4 chunks of 8.
    plan = make_plan(shape(batch=16), H200_SMS, arch="sm_90", max_query_len=4)
    assert plan.variant.heads == 16 and plan.head_chunks == 1 and plan.max_query_len == 4
    plan = make_plan(shape(), H200_SMS, arch="gfx942", max_query_len=4)
    assert plan.variant.rows == 32 and plan.head_chunks == 1  # two 16-row matrix tiles
    plan = make_plan(shape(), H200_SMS, arch="gfx1030", max_query_len=4)
    assert plan.variant.heads == 8 and plan.head_chunks == 4  # portable: chunks of 8
    plan = make_plan(shape(heads=8, kv_heads=8), H200_SMS, arch="sm_90", max_query_len=3)
    assert plan.variant.heads == 8 and plan.head_chunks == 1  # MHA, 3 tokens: 3 rows


def multi_token_shape(batch, seq_len, heads, kv_heads, query_len, head_size):
    """A float16 problem of `query_len` new tokens per sequence (shape()'s, with query rows)."""
    return DecodeShape(num_seqs=batch, num_tokens=batch * query_len, num_heads=heads,
                       num_kv_heads=kv_heads, head_size=head_size,
                       num_blocks=batch * seq_len // 16, block_size=16,
                       max_blocks_per_seq=seq_len // 16, dtype="float16", scale=0.1,
                       has_alibi=False, multi_token=query_len > 1)


@pytest.mark.parametrize("batch, seq_len, heads, kv_heads, query_len, head_size, chunks", [
    # The 16-row kernel's problems that were faster as 8-row chunks on the H200 (v21), chunks x
    # K/V bytes at most 1 MB per multiprocessor (two chunks of a 16-bit cache: 512 KB, 128 KB
    # at head 64, since v24) and fewer (sequence, KV head) pairs than slots:
    (1, 4096, 64, 4, 1, 128, 2),      # group 16: 22.1 -> 15.9 us (v24: 15.3 -> 14.8)
    (1, 16384, 64, 4, 1, 128, 2),     # 0.5 MB (v24): 24.3 -> 23.8
    (8, 2048, 64, 4, 1, 128, 2),      # 0.5 MB (v24): 22.4 both
    (1, 4096, 32, 8, 4, 128, 2),      # group 4 x 4 new tokens: 26.7 -> 21.6
    (1, 4096, 64, 8, 4, 128, 4),      # group 8 x 4 new tokens: 30.1 -> 26.0
    (8, 4096, 64, 1, 1, 128, 8),      # MQA: 36.4 -> 31.6
    (1, 4096, 64, 4, 1, 64, 2),       # head 64, group 16 at 0.06 MB: 13.1 -> 12.7 (v24)
    # ... and those that were slower or level stay on the 16-row kernel (v24: its faster
    # prologue and merge, one workgroup a multiprocessor; row chunks -> 16-row):
    (12, 2048, 64, 4, 1, 128, 1),     # group 16 at 0.76 MB: 30.3 -> 27.6
    (16, 2048, 64, 4, 1, 128, 1),     # 1 MB: 34.0 -> 31.7
    (6, 4096, 64, 4, 1, 128, 1),      # 0.76 MB: 30.5 -> 28.5
    (8, 4096, 64, 4, 1, 128, 1),      # 1 MB: 33.4 -> 33.7 (v21, the earlier kernels: 38.3 -> 34.3)
    (1, 32768, 64, 4, 1, 128, 1),     # 1 MB: 35.1 -> 34.8 (v21: 43.9 -> 35.8)
    (32, 2048, 64, 4, 1, 128, 1),     # group 16 at 2 MB: 50.0 -> 48.1 (v23's 2 MB rule, gone)
    (16, 4096, 64, 4, 1, 128, 1),     # 53.2 -> 50.4
    (8, 8192, 64, 4, 1, 128, 1),      # 52.3 -> 50.8
    (2, 16384, 32, 8, 4, 128, 1),     # group 4 x 4 new tokens at 2 MB: 56.3 -> 54.2
    (8, 4096, 32, 8, 4, 128, 1),      # 56.4 -> 53.3
    (1, 32768, 32, 8, 4, 128, 1),     # 2 MB as 2 x 16384 (v21, the earlier kernels: 62.0 -> 56.1)
    (32, 2048, 64, 4, 1, 64, 1),      # head 64, group 16 at 0.5 MB: 34.5 -> 31.0
    (8, 4096, 64, 4, 1, 64, 1),       # 23.6 -> 22.0
    (16, 4096, 64, 4, 1, 64, 1),      # 38.0 -> 32.2
    (64, 1024, 64, 4, 1, 128, 1),     # 2 MB, but 256 KV heads: 53.6 -> 54.7 (v23)
    (48, 2048, 64, 4, 1, 128, 1),     # 3 MB: 70.5 -> 85.8
    (16, 8192, 64, 4, 1, 128, 1),     # 4 MB: 88.0 -> 94.2 (v21: 87.6 -> 110.1)
    (32, 4096, 64, 4, 1, 64, 1),      # head 64 at 2 MB: 52.2 -> 57.6
    (16, 4096, 64, 1, 1, 128, 1),     # MQA (8 chunks) at 2 MB: 45.3 -> 47.7
    (128, 1024, 64, 4, 1, 128, 1),    # 512 (sequence, KV head) pairs fill the machine
    (128, 1024, 64, 1, 1, 128, 1),    # MQA, 4 MB: 56.5 -> 96.8
    # Head 256, one tile of 16 rows a workgroup: MQA's 64 rows in 4 chunks of 16
    (64, 4096, 64, 1, 1, 256, 1),
])
def test_small_problems_run_row_chunks_of_the_eight_column_kernel(
        batch, seq_len, heads, kv_heads, query_len, head_size, chunks):
    problem = multi_token_shape(batch, seq_len, heads, kv_heads, query_len, head_size)
    plan = make_plan(problem, H200_SMS, arch="sm_90", max_seq_len=seq_len,
                     max_query_len=query_len)
    assert isinstance(plan.variant, catalogue.DecodeMmaVariant)
    rows = heads // kv_heads * query_len
    sixteen = -(-rows // plan.variant.rows)  # the 16-row kernel's chunks of its rows
    assert (plan.variant.heads, plan.head_chunks) == ((8, chunks) if chunks > 1 else (16, sixteen))
    if chunks > 1 and head_size < 256:  # the 16-row plan would also split the sequences
        assert not plan.cluster_merge  # and row chunks never pair partitions in clusters
    # Without length hints the capacity counts as every sequence's length: the same here.
    assert make_plan(problem, H200_SMS, arch="sm_90", max_query_len=query_len).head_chunks == \
        plan.head_chunks


@pytest.mark.parametrize("batch, seq_len, heads, kv_heads, query_len, partition", [
    # The 16-row kernel with one m-tile plans at most one workgroup a multiprocessor (132 on the
    # H200), its splits rounded down (planner.ONE_TILE_ROWS; group 16, v24, us):
    (40, 2048, 64, 4, 1, 2048),   # 160 workgroups unsplit: 58.1, against 73.9 in 320
    (24, 2048, 64, 4, 1, 2048),   # 96 unsplit: 41.3, against 52.7 in 288
    (12, 2048, 64, 4, 1, 1024),   # 48 x 2 (2.75 rounded down): 27.7, against 29.3 in 48 x 3
    (16, 4096, 64, 4, 1, 2048),   # 64 x 2: 50.2, against 52.0 in 64 x 4
    (8, 8192, 64, 4, 1, 2048),    # 32 x 4: 51.0, against 51.7 in 32 x 8
    (2, 16384, 64, 4, 1, 1024),   # 8 x 16: 33.0, against 36.8 in 8 x 32
    (8, 4096, 32, 8, 4, 2048),    # group 4 x 4 new tokens (16 rows): 64 x 2, 53.3
    # ... but with more tiles (MQA's 64 rows, a tile a warp) still two a multiprocessor:
    (128, 1024, 64, 1, 1, 512),   # 128 x 2: 43.3, against 50.8 unsplit
])
def test_the_one_tile_16_row_kernel_plans_one_workgroup_a_multiprocessor(
        switch, batch, seq_len, heads, kv_heads, query_len, partition):
    switch("CUPA_ROW_CHUNKS", "never")  # the 16-row kernel's own plan, whatever row chunks do
    problem = multi_token_shape(batch, seq_len, heads, kv_heads, query_len, 128)
    for residency in (None, lambda v: 2):
        plan = make_plan(problem, H200_SMS, arch="sm_90", max_seq_len=seq_len,
                         max_query_len=query_len, residency=residency)
        assert plan.variant.heads == 16 and plan.head_chunks == 1
        assert plan.partition_size == (partition if partition < seq_len else seq_len)
    # A ragged batch aims at one a multiprocessor too, but may split further (its tail).
    ragged = make_plan(problem, H200_SMS, arch="sm_90", max_seq_len=seq_len,
                       total_seq_len=batch * seq_len // 2, max_query_len=query_len)
    assert ragged.partition_size <= plan.partition_size


def test_row_chunks_of_an_fp8_cache_keep_the_larger_limit():
    """Group 16 at 32 x 2048 (two chunks: 2 MB of a 16-bit cache, 1 MB of fp8 a multiprocessor):
    the 16-row kernel for float16, row chunks for fp8 (v24: 32.1 us against the 16-row
    kernel's 33.2)."""
    for kv_format, expected in ((None, (16, 1)), ("fp8_e4m3", (8, 2))):
        plan = make_plan(shape(batch=32, seq_len=2048, kv_heads=4, kv_format=kv_format),
                         H200_SMS, arch="sm_90", max_seq_len=2048)
        assert (plan.variant.heads, plan.head_chunks) == expected, kv_format


def test_forcing_row_chunks_or_the_16_row_kernel(switch):
    small, large = shape(kv_heads=4), shape(batch=64, kv_heads=4)  # group 16
    assert make_plan(small, H200_SMS, arch="sm_90").head_chunks == 2
    assert make_plan(large, H200_SMS, arch="sm_90").head_chunks == 1
    switch("CUPA_ROW_CHUNKS", "always")
    plan = make_plan(large, H200_SMS, arch="sm_90")
    assert plan.variant.heads == 8 and plan.head_chunks == 2
    switch("CUPA_ROW_CHUNKS", "never")
    plan = make_plan(small, H200_SMS, arch="sm_90")
    assert plan.variant.heads == 16 and plan.head_chunks == 1
    # Above head 128 the 16-row kernel takes one tile of 16 rows a workgroup.
    plan = make_plan(shape(kv_heads=2, head_size=256), H200_SMS, arch="sm_90")
    assert plan.variant.heads == 16 and plan.variant.rows == 16 and plan.head_chunks == 2
    switch("CUPA_ROW_CHUNKS", "sometimes")
    with pytest.raises(ValueError, match="CUPA_ROW_CHUNKS"):
        make_plan(small, H200_SMS, arch="sm_90")


def test_switches_set_for_a_block_and_as_they_were_after_it(switch):
    switch("CUPA_DENSE", "never")
    switch("CUPA_WIDE", None)
    with dispatch.switches_set(dispatch.FORM_SWITCHES["wide"]):
        assert (dispatch.switches().wide, dispatch.switches().dense) == ("always", "never")
        assert dispatch.switches().row_chunks == "never"
    assert (dispatch.switches().wide, dispatch.switches().dense) == ("auto", "never")
    assert "CUPA_WIDE" not in os.environ  # unset before: unset again
    before = dispatch.switches()
    with dispatch.switches_set({}):  # nothing to set: the same object (decode's plan cache key)
        assert dispatch.switches() is before
    assert dispatch.switches() is before


def test_large_batches_use_one_partition():
    plan = make_plan(shape(batch=256, seq_len=2048), H200_SMS, arch="sm_90", max_seq_len=2048)
    assert plan.single_partition and plan.partition_size == 2048


def test_small_batches_split_long_sequences():
    plan = make_plan(shape(batch=1, seq_len=32768), H200_SMS, arch="sm_90", max_seq_len=32768)
    assert not plan.single_partition
    assert plan.partition_size % plan.variant.min_partition == 0
    assert plan.max_partitions * plan.partition_size >= 32768


@pytest.mark.parametrize("batch, seq_len, best", [
    # The partition size the v20 sweep found fastest (or within 0.5% of it) for the portable
    # kernel at GQA 8 on the H200 (docs/perf-log.md v20 step 2), the same in float16, float32
    # and head 96: about 8 workgroups a multiprocessor.
    (1, 4096, 256), (1, 32768, 256), (8, 4096, 256), (16, 16384, 2048), (32, 2048, 512),
    (64, 4096, 2048), (128, 1024, 1024), (256, 2048, 2048),
])
@pytest.mark.parametrize("dtype, head_size", [("float16", 128), ("float32", 128),
                                              ("float16", 96)])
def test_portable_partitions_are_the_measured_best(switch, batch, seq_len, best, dtype,
                                                   head_size):
    switch("CUPA_KERNEL", "portable")
    plan = make_plan(shape(batch=batch, seq_len=seq_len, dtype=dtype, head_size=head_size),
                     H200_SMS, arch="sm_90", max_seq_len=seq_len)
    assert isinstance(plan.variant, catalogue.DecodeVariant) and plan.variant.rows == 8
    assert plan.partition_size == best


def test_length_hint_and_window_shrink_partitions():
    capacity_plan = make_plan(shape(seq_len=131072), H200_SMS, arch="sm_90")
    hinted = make_plan(shape(seq_len=131072), H200_SMS, arch="sm_90", max_seq_len=4096)
    windowed = make_plan(shape(seq_len=131072, window=4096), H200_SMS, arch="sm_90")
    assert hinted.partition_size < capacity_plan.partition_size
    assert windowed.partition_size == hinted.partition_size


def test_grid_limits():
    huge = shape(seq_len=(MAX_GRID_YZ + 10) * 16)
    plan = make_plan(huge, H200_SMS, arch="sm_90")
    assert plan.max_partitions <= MAX_GRID_YZ
    with pytest.raises(ValueError, match="partition_size"):
        make_plan(huge, H200_SMS, arch="sm_90", partition_size=1)
    with pytest.raises(ValueError, match="partition_size: must be >= 1"):
        make_plan(shape(), H200_SMS, partition_size=0)


def test_forced_partition_size_covering_the_capacity_is_single():
    plan = make_plan(shape(seq_len=1000), H200_SMS, arch="sm_90", partition_size=4096)
    assert plan.single_partition and plan.partition_size == plan.max_partitions * 1008


# H200 properties as cupy reports them (sharedMemPerMultiprocessor, regsPerMultiprocessor,
# reservedSharedMemPerBlock); registers per thread from tools/kernel_regs.py on that device
# (head 128) and from ptxas offline (tools/kernel_sass.py, head 64).
H200_LIMITS = dict(registers_per_sm=65536, shared_per_sm=233472, reserved_shared=1024)


@pytest.mark.parametrize("dtype, head_size, heads, cache, dense, registers, expected", [
    ("float16", 128, 8, None, False, 160, 2),                    # the 98 KB ring limits it
    ("float16", 128, 8, catalogue.FP8_E4M3_NATIVE, False, 147, 2),  # 128-token chunks: same ring
    ("float16", 64, 8, None, False, 98, 3),
    ("float16", 64, 8, catalogue.FP8_E4M3_NATIVE, False, 91, 5),  # registers limit it
    ("float16", 128, 16, None, False, 203, 2),                   # registers and ring both
    ("float16", 64, 8, None, True, 127, 4),  # the dense form: a 3-stage ring, 128 registers
])
def test_residency_of_the_tensor_core_kernels(dtype, head_size, heads, cache, dense, registers,
                                              expected):
    from cupa.gpu.occupancy import workgroups_per_sm
    v = catalogue.DecodeMmaVariant(dtype, head_size, heads, cache, dense=dense)
    assert workgroups_per_sm(registers, v.shared_bytes, catalogue.THREADS, **H200_LIMITS) == expected


def h200_residency(variant):
    """Workgroups a multiprocessor of the H200 holds (measured, tools/kernel_regs.py) of the
    variants these tests plan: 4 of the dense forms; of the default forms, 3 at head 64 of a
    16-bit cache and 2 for fp8 at head 128."""
    return 4 if variant.dense else 3 if variant.head_size == 64 else 2


@pytest.mark.parametrize("kv_format, head_size, batch, seq_len, dense, partition_size", [
    # Head 64, float16, GQA 8 on the H200 (v22; default form -> dense form, planner's choice):
    (None, 64, 64, 4096, True, 4096),    # 146.5 -> 135.7 us: one wave of 512 workgroups, not two
    (None, 64, 64, 1024, True, 1024),    # 54.6 -> 46.4
    (None, 64, 128, 1024, True, 1024),   # 81.9 -> 78.9
    (None, 64, 256, 2048, True, 2048),   # 259.3 -> 257.9
    (None, 64, 16, 16384, True, 8192),   # 137.4 -> 136.5
    (None, 64, 32, 2048, True, 2048),    # 46.3 -> 45.5
    (None, 64, 4, 32768, True, 4096),    # 80.5 -> 79.2
    (None, 64, 1, 32768, True, 1024),    # level
    # ... fewer workgroups than multiprocessors keep the default form's deeper ring:
    (None, 64, 8, 4096, False, 2048),    # 128 workgroups: 31.2 against 34.4 dense
    (None, 64, 1, 4096, False, 256),     # 128 workgroups: 14.0 (13.6 dense)
    # fp8 e4m3 at head 128 (the default form holds 2): where the default form would split a
    # grid of 1-1.5 waves and the dense form runs it whole (v47, dense -> default form)
    ("fp8_e4m3", 128, 36, 4096, True, 4096),    # 87.1 -> 99.6 us
    ("fp8_e4m3", 128, 48, 4096, True, 4096),    # 108.5 -> 116.0
    ("fp8_e4m3", 128, 40, 2048, True, 2048),    # 54.5 -> 64.1
    ("fp8_e4m3", 128, 48, 8192, True, 8192),    # 196.1 -> 201.2
    # ... and the default form on the grids past it
    ("fp8_e4m3", 128, 52, 4096, False, 4096),   # 124.0 -> 119.0
    ("fp8_e4m3", 128, 64, 4096, False, 4096),   # 139.4 -> 139.1
    ("fp8_e4m3", 128, 72, 2048, False, 2048),   # 104.8 -> 93.7
    ("fp8_e4m3", 128, 128, 1024, False, 1024),  # 82.2 -> 79.7
    ("fp8_e4m3", 128, 256, 2048, False, 2048),  # 268.6 -> 263.3
    ("fp8_e4m3", 128, 16, 16384, False, 16384),  # 139.8 (140.5 dense); now the wide form
    ("fp8_e4m3", 128, 1, 32768, False, 2048),   # level; then 128 workgroups of 2048 (v23)
    ("fp8_e4m3", 128, 8, 4096, False, 2048),    # 31.1 (36.0 dense)
    # Head 64, 16-bit, past one dense wave: the dense form only where its grid is no longer
    # than the default form's by planner.wave_span (v48, dense -> default form)
    (None, 64, 96, 2048, False, 2048),   # 111.1 -> 106.6 us: the dense plan split, the default not
    (None, 64, 88, 1024, False, 1024),   # 63.7 -> 58.9
    (None, 64, 80, 8192, False, 8192),   # 330.7 -> 330.9 (read flush 325.4 -> 319.1)
    (None, 64, 72, 2048, False, 1024),   # 94.1 -> 90.6: equal partitions, its last wave 18% full
    (None, 64, 144, 1024, False, 1024),  # 87.6 -> 84.9
    (None, 64, 132, 1024, True, 1024),   # 77.7 -> 79.6: two whole dense waves
    (None, 64, 160, 1024, True, 1024),   # 91.9 -> 94.1: equal spans and partitions
    (None, 64, 112, 2048, True, 2048),   # 123.0 -> 126.6
])
def test_the_dense_form_serves_grids_with_the_workgroups_for_it(
        kv_format, head_size, batch, seq_len, dense, partition_size):
    for dtype in ("float16", "bfloat16"):
        plan = make_plan(shape(batch, seq_len, head_size=head_size, dtype=dtype,
                               kv_format=kv_format), H200_SMS, arch="sm_90",
                         residency=h200_residency)
        assert (plan.variant.dense, plan.partition_size) == (dense, partition_size)
        assert plan.variant.partition_name.endswith("_dense") == dense
        assert plan.variant.cache == (kv_format and catalogue.FP8_E4M3_NATIVE)


# From 16384 tokens, v48's 18 x 16384 (361.4 -> 298.8 us), fp8 20 x 16384 (219.4 -> 180.8) and
# MHA 5 x 16384 (377.7 -> 325.1) are planned by the long split since v50
# (test_long_sequences_below_a_wave_split_by_their_last_wave).
@pytest.mark.parametrize("batch, heads, kv_heads, head_size, kv_format, seq_len", [
    (20, 64, 8, 128, None, 4096),        # 110.5 -> 96.2 us (v48 step 2)
    (22, 64, 8, 128, None, 8192),        # 204.2 -> 189.6
    (17, 64, 8, 128, None, 8192),        # 185.8 -> 151.6
    (17, 64, 8, 128, None, 512),
    (20, 64, 8, 128, "fp8_e4m3", 8192),
    (5, 32, 32, 128, None, 8192),
    (20, 64, 8, 96, None, 4096),         # 87.8 -> 78.8
])
def test_a_split_grid_of_one_to_one_and_a_third_waves_runs_whole(
        batch, heads, kv_heads, head_size, kv_format, seq_len):
    """Two partitions of 136-176 (sequence, KV head) pairs make 1.03-1.33 waves of the
    default forms' 264 slots, and one wave holds only one partition of each: the whole
    sequence it is."""
    plan = make_plan(shape(batch, seq_len, heads=heads, kv_heads=kv_heads, head_size=head_size,
                           kv_format=kv_format), H200_SMS, arch="sm_90",
                     residency=h200_residency)
    assert plan.single_partition and not plan.variant.wide
    without = make_plan(shape(batch, seq_len, heads=heads, kv_heads=kv_heads,
                              head_size=head_size, kv_format=kv_format), H200_SMS, arch="sm_90")
    assert without.max_partitions == 2  # no residency, no wave quantisation


def test_a_split_grid_of_one_workgroup_a_multiprocessor_runs_whole_too():
    # Head 256's deep form holds one workgroup a multiprocessor: 10 x 16384's 80 pairs in two
    # partitions are 1.21 of its waves; whole, 52 multiprocessors idle, it ran 389.2 -> 319.2 us.
    deep = make_plan(shape(10, 16384, head_size=256), H200_SMS, arch="sm_90",
                     residency=lambda v: 1)
    assert deep.variant.deep and deep.single_partition
    # The wide form's own plan likewise, which then serves: 9 x 16384 161.9 -> 155.1 us.
    wide = make_plan(shape(9, 16384), H200_SMS, arch="sm_90", residency=wide_residency)
    assert wide.variant.wide and wide.single_partition


def test_wave_span_counts_whole_waves_of_a_slots_share():
    # 1152 workgroups of 1024 tokens on 132 multiprocessors: 3 waves of 4 (the last 18% full)
    # or 3 of 3 (91% full)
    assert planner.wave_span(1152, 1024, 4, 132) == 3 * 1024 * 4
    assert planner.wave_span(1152, 1024, 3, 132) == 3 * 1024 * 3
    assert planner.wave_span(528, 1024, 4, 132) == 1024 * 4
    assert planner.wave_span(529, 1024, 4, 132) == 2 * 1024 * 4
    no_longer = planner.dense_grid_no_longer
    assert no_longer((1152, 1024, 4), (1152, 1024, 3), 132) is False
    assert no_longer((1056, 1024, 4), (1056, 1024, 3), 132) is True     # 2 whole waves of 4
    assert no_longer((1280, 1024, 4), (1280, 1024, 3), 132) is True     # equal: same partitions
    assert no_longer((1280, 1024, 4), (640, 2048, 3), 132) is False     # equal: split by dense
    assert no_longer((512, 4096, 4), (1024, 2048, 3), 132) is True      # one dense wave
    assert no_longer((1152, 1024, 0), (1152, 1024, 3), 132) is True     # residency unknown


def test_every_dense_form_has_its_rule():
    assert set(dispatch.DENSE_FROM_WORKGROUPS_PER_SM) == set(catalogue.DENSE_KINDS)
    for v in catalogue.all_mma_variants():
        if v.dense:  # one step a warp, 3 stages: under a quarter of the shared memory
            assert v.warp_steps == 1 and v.ring_stages == catalogue.DENSE_RING["stages"]
            assert 4 * (v.shared_bytes + 1024) <= catalogue.SM90_SHARED_PER_SM


def test_the_dense_form_only_where_it_exists(switch):
    large = shape(128, 1024, head_size=64)
    assert make_plan(large, H200_SMS, arch="sm_90").variant.dense
    # Not on sm_80 (164 KB of shared memory: 3 such rings), not for fp8 at head 64 (its ring is
    # small already) or software-widened fp8, not for 16-bit caches at other head sizes, not
    # for the 16-row kernel.
    assert not make_plan(large, H200_SMS, arch="sm_80").variant.dense
    fp8 = shape(128, 1024, head_size=64, kv_format="fp8_e4m3")
    assert not make_plan(fp8, H200_SMS, arch="sm_90").variant.dense
    fnuz = shape(128, 1024, kv_format="fp8_e4m3fnuz")
    assert not make_plan(fnuz, H200_SMS, arch="sm_90").variant.dense
    assert make_plan(shape(40, 4096, kv_format="fp8_e4m3"), H200_SMS, arch="sm_90",
                     residency=h200_residency).variant.dense
    assert not make_plan(shape(128, 1024), H200_SMS, arch="sm_90").variant.dense
    sixteen = make_plan(shape(128, 1024, head_size=64, kv_heads=4), H200_SMS, arch="sm_90")
    assert sixteen.variant.heads == 16 and not sixteen.variant.dense
    switch("CUPA_DENSE", "always")
    assert make_plan(shape(1, 4096, head_size=64), H200_SMS, arch="sm_90").variant.dense
    assert make_plan(shape(256, 2048, kv_format="fp8_e4m3"), H200_SMS, arch="sm_90",
                     residency=h200_residency).variant.dense  # past its auto bound
    assert make_plan(shape(96, 2048, head_size=64), H200_SMS, arch="sm_90",
                     residency=h200_residency).variant.dense  # a longer grid by its span
    switch("CUPA_DENSE", "never")
    assert not make_plan(large, H200_SMS, arch="sm_90").variant.dense
    switch("CUPA_DENSE", "sometimes")
    with pytest.raises(ValueError, match="CUPA_DENSE"):
        make_plan(large, H200_SMS, arch="sm_90")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_size", [192, 256])
def test_the_deep_form_where_it_exists(switch, dtype, head_size):
    """Heads 192 and 256 over a 16-bit cache on sm_90: both kernels with a 3-stage ring (194
    KB, one workgroup a multiprocessor; the 16-row kernel's query after it), for every problem,
    row chunks included; the 2-stage ring on sm_80 (163 KB), for fp8 caches (their 3 stages
    take 98 KB already) and with CUPA_DEEP=never."""
    ring = 3 * 2 * 64 * 256 * 2 + 2 * 3 * 64 * 4
    for rows in (1, 8, 12, 64):
        deep = dispatch.decode_variant(dtype, head_size, rows, "sm_90")
        assert deep.deep and deep.heads == (8 if rows <= 8 else 16), rows
        assert deep.ring_stages == 3 and deep.workgroups_per_sm == 1 and deep.min_sm == 90
        query = 16 * head_size * 2 if rows > 8 else 0
        assert deep.shared_bytes == ring + query <= catalogue.shared_opt_in_bytes("sm_90")
        assert dict(catalogue.module_defines(deep))["CUPA_RING_STAGES"] == 3
        assert not dispatch.decode_variant(dtype, head_size, rows, "sm_80").deep
    plan = make_plan(shape(64, 4096, dtype=dtype, head_size=head_size), H200_SMS, arch="sm_90")
    assert plan.variant.deep
    for fmt in ("fp8_e4m3", "fp8_e4m3fnuz"):
        assert not dispatch.decode_variant(dtype, head_size, 8, "sm_90", fmt).deep
    assert dispatch.deep_variant(dispatch.decode_variant(dtype, head_size, 8, "sm_80"),
                                 "sm_80") is None
    switch("CUPA_DEEP", "never")
    plain = dispatch.decode_variant(dtype, head_size, 8, "sm_90")
    assert not plain.deep and plain.ring_stages == 0 and plain.shared_bytes < 163 * 1024
    assert dict(catalogue.module_defines(plain))["CUPA_RING_STAGES"] == 0


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100",
                                  "sm_120", "sm_130"])
def test_no_pick_needs_more_shared_memory_than_its_target_gives(arch):
    """Every variant and form dispatch picks gets its ring: consumer Ampere, Ada and Blackwell
    give a workgroup 99 KB, where a 16-bit cache at head 192 or 256 (129 KB) runs the portable
    kernel and the wide and deep forms (194-198 KB) do not exist; an unknown sm gets the least."""
    limit = catalogue.shared_opt_in_bytes(arch)
    assert limit == catalogue.SHARED_OPT_IN_BYTES.get(int(arch[3:]), 101376)
    for kv_format in (None, "fp8_e4m3", "fp8_e4m3fnuz"):
        for dtype in ("float16", "bfloat16"):
            for head_size in catalogue.SUPPORTED_HEAD_SIZES:
                for rows in (1, 8, 16, 64):
                    own = dispatch.decode_variant(dtype, head_size, rows, arch, kv_format)
                    forms = (own, dispatch.dense_variant(own, arch),
                             dispatch.wide_variant(own, rows, arch))
                    for v in forms:
                        assert v is None or getattr(v, "shared_bytes", 0) <= limit, v
    small = limit < 128 * 1024
    big = dispatch.decode_variant("float16", 256, 8, arch)
    assert isinstance(big, catalogue.DecodeVariant) == small
    assert isinstance(dispatch.decode_variant("float16", 256, 8, arch, "fp8_e4m3"),
                      catalogue.DecodeMmaVariant)
    assert isinstance(dispatch.decode_variant("float16", 128, 64, arch),
                      catalogue.DecodeMmaVariant)
    head128 = dispatch.decode_variant("float16", 128, 8, arch)
    assert (dispatch.wide_variant(head128, 8, arch) is None) == (
        small or catalogue.sm_number(arch) < catalogue.WIDE_MIN_SM)
    # The documented limits of the two targets the shared-memory test above checks.
    for name, (_, per_block) in SHARED_PER_SM.items():
        assert catalogue.shared_opt_in_bytes(name) == per_block


def wide_residency(variant):
    """h200_residency, with the wide forms' one workgroup a multiprocessor."""
    return 1 if variant.wide else h200_residency(variant)


@pytest.mark.parametrize("options, batch, seq_len, wide, partitions", [
    # One wave of partitions of 8192 tokens or more: the wide form. H200, v36, default -> wide
    # form (us):
    ({}, 16, 16384, True, 1),                       # 258.0 -> 256.0 (cluster pairs before)
    ({}, 4, 32768, True, 4),                        # 142.0 -> 140.4 (8 partitions before)
    (dict(dtype="bfloat16"), 16, 16384, True, 1),   # 257.8 -> 256.1
    (dict(kv_format="fp8_e4m3"), 16, 16384, True, 1),  # 141.7 -> 139.9
    (dict(kv_heads=4), 16, 16384, True, 2),         # group 16: 143.7 -> 140.0, in pairs
    # ... not for shorter partitions or a grid of more than one wave:
    (dict(kv_heads=4), 8, 16384, False, 4),         # 82.4 (83.1 wide: 4096-token partitions)
    (dict(kv_format="fp8_e4m3"), 8, 4096, False, 2),  # 31.1 (32.0)
    ({}, 1, 4096, False, 16),                       # 16.4 (17.2)
    ({}, 1, 32768, False, 16),                      # level
    ({}, 32, 2048, False, 1),                       # 76.7 (80.2: two waves)
    (dict(kv_heads=4), 128, 1024, False, 1),        # 81.2 (91.9)
    # ... nor where the form does not exist: head 64, more than 16 query rows.
    (dict(head_size=64), 16, 16384, False, 2),
    (dict(kv_heads=2), 16, 16384, False, 8),
])
def test_the_wide_form_serves_one_wave_of_long_partitions(options, batch, seq_len, wide,
                                                          partitions):
    plan = make_plan(shape(batch, seq_len, **options), H200_SMS, arch="sm_90",
                     max_seq_len=seq_len, residency=wide_residency)
    assert (plan.variant.wide, plan.max_partitions) == (wide, partitions)
    assert plan.variant.partition_name.endswith("_wide") == wide
    if wide:
        workgroups = batch * plan.head_chunks * shape(**options).num_kv_heads * partitions
        assert workgroups <= H200_SMS and plan.partition_size >= dispatch.WIDE_MIN_PARTITION_TOKENS
        assert plan.variant.threads == catalogue.WIDE_RING["threads"] and plan.stagger_slots == 0
        assert plan.all_ids_early  # one wave
        narrow = make_plan(shape(batch, seq_len, **options), H200_SMS, arch="sm_80",
                           max_seq_len=seq_len)
        assert not narrow.variant.wide  # the ring needs sm_90's shared memory


def test_the_wide_form_only_where_it_exists(switch):
    long = shape(16, 16384)
    ragged = make_plan(long, H200_SMS, arch="sm_90", max_seq_len=16384,
                       total_seq_len=16384 + 15 * 1024, residency=wide_residency)
    assert not ragged.variant.wide  # a ragged batch's partitions do not start together
    switch("CUPA_WIDE", "never")
    assert not make_plan(long, H200_SMS, arch="sm_90").variant.wide
    switch("CUPA_WIDE", "always")  # any plan, where the form exists
    small = make_plan(shape(1, 4096), H200_SMS, arch="sm_90", partition_size=256)
    assert small.variant.wide and small.partition_size == 256
    sixteen = make_plan(shape(1, 4096, kv_heads=4), H200_SMS, arch="sm_90")
    assert not sixteen.variant.wide  # row chunks of the 8-column kernel: no wide form
    assert make_plan(shape(8, 4096, kv_heads=4), H200_SMS, arch="sm_90").variant.wide
    for problem, arch in ((long, "sm_80"), (shape(16, 16384, head_size=64), "sm_90"),
                          (shape(16, 16384, dtype="float32"), "sm_90")):
        assert not getattr(make_plan(problem, H200_SMS, arch=arch).variant, "wide", False)
    switch("CUPA_MERGE", "cluster")  # a wide workgroup takes a multiprocessor: pairs at most
    assert not make_plan(shape(1, 4096), H200_SMS, arch="sm_90", partition_size=512).cluster_merge
    assert make_plan(shape(1, 4096), H200_SMS, arch="sm_90", partition_size=2048).cluster_merge
    switch("CUPA_WIDE", "sometimes")
    with pytest.raises(ValueError, match="CUPA_WIDE"):
        make_plan(long, H200_SMS, arch="sm_90")


def test_a_wide_plan_launches_both_its_kernels_with_its_threads(monkeypatch):
    """The launch's block is the variant's (both kernels of its module were compiled with its
    CUPA_THREADS): 256 threads for the wide form's phase 1 and reduce, 128 otherwise."""
    from collections import defaultdict
    from types import SimpleNamespace

    from cupa.gpu import launch
    info = SimpleNamespace(hip_runtime=False, multiprocessors=H200_SMS,
                           target=SimpleNamespace(arch="sm_90"))
    blocks = []
    monkeypatch.setattr(launch, "device_info", lambda index: info)
    monkeypatch.setattr(launch, "compiled_kernels", lambda variant, index: defaultdict(object))
    monkeypatch.setattr(launch, "_has_extended", lambda is_hip: True)
    monkeypatch.setattr(launch, "PreparedLaunch",
                        lambda kernel, grid, block, **kwargs: blocks.append(block))
    for problem, threads in ((shape(4, 32768), 256), (shape(1, 32768), 128)):
        plan = make_plan(problem, H200_SMS, arch="sm_90", max_seq_len=32768,
                         residency=wide_residency)
        assert plan.reduce_launch and plan.variant.threads == threads
        blocks.clear()
        launch.DecodeLaunch(plan, problem, 0)
        assert blocks == [(threads, 1, 1)] * 2


def test_a_wide_module_defines_its_threads_and_ring():
    wide = catalogue.DecodeMmaVariant("float16", 128, 16, wide=True)
    source = catalogue.module_source(wide)
    assert source.startswith("#define CUPA_THREADS 256\n#define CUPA_RING_STAGES 3\n")
    assert catalogue.module_source(catalogue.DecodeMmaVariant("float16", 128, 16)).startswith(
        "#define CUPA_THREADS 128\n#define CUPA_RING_STAGES 0\n")
    assert wide.rows == 128 and wide.shared_bytes == 3 * 2 * 128 * 256 + 2 * 3 * 128 * 4
    fp8 = catalogue.DecodeMmaVariant("float16", 128, 8, catalogue.FP8_E4M3_NATIVE, wide=True)
    assert fp8.shared_bytes == 3 * 2 * 256 * 128 + 2 * 3 * 256 * 4  # 256-token chunks
    with pytest.raises(ValueError, match="module defines"):
        catalogue.batch_source([wide, catalogue.DecodeMmaVariant("float16", 128, 8)])
    from cupa.gpu.offline import variant_batches
    for batch in variant_batches(catalogue.all_variants("sm_90")):
        assert len({catalogue.module_defines(v) for v in batch}) == 1
        catalogue.batch_source(batch)
    assert not any(getattr(v, "wide", False) for v in catalogue.all_variants("sm_80"))


@pytest.mark.parametrize("options, batch, seq_len, partition_size", [
    # Few long sequences on the 8-column kernel at head 128, merged by the reduce: one workgroup
    # a multiprocessor (planner.ONE_PER_SM_DENSITY). H200, v23, before -> after (us):
    ({}, 1, 32768, 2048),                                # 51.8 -> 50.4
    ({}, 1, 16384, 1024),                                # 34.4 -> 32.6
    ({}, 4, 8192, 2048),                                 # 50.6 -> 50.1
    ({}, 1, 65536, 4096),                                # 82.6 -> 82.0
    (dict(kv_format="fp8_e4m3"), 1, 32768, 2048),        # 35.4 -> 33.6
    (dict(kv_format="fp8_e4m3fnuz"), 1, 16384, 1024),    # 24.8 -> 23.6
    (dict(heads=32, kv_heads=32), 1, 4096, 1024),        # MHA: 30.9 -> 30.4
    # ... not past 4096 tokens a partition (MHA 1 x 32768: 139.3 at 4096, 141.0 at 8192; 1 x
    # 131072 level), not where the grid would leave a tenth of the machine idle (3 x 16384:
    # 120 workgroups of 3328, 67.5, against 264 of 1536, 66.0), not at head 64 (2 x 16384:
    # 31.9 at 1024, 32.7 at 2048), not for row chunks (group 16 1 x 32768: 35.2 against 44.7):
    (dict(heads=32, kv_heads=32), 1, 32768, 4096),
    ({}, 1, 131072, 4096),
    ({}, 3, 16384, 1536),
    (dict(head_size=64), 2, 16384, 1024),
    (dict(kv_heads=4), 1, 32768, 1024),
])
def test_few_long_sequences_take_one_workgroup_a_multiprocessor(switch, options, batch, seq_len,
                                                                partition_size):
    switch("CUPA_WIDE", "never")  # the default form's rule (the wide form's: test_the_wide_form_*)
    plan = make_plan(shape(batch, seq_len, **options), H200_SMS, arch="sm_90",
                     residency=h200_residency)
    assert plan.partition_size == partition_size and plan.reduce_launch


def test_a_ragged_batch_keeps_two_workgroups_a_multiprocessor():
    # One 32768-token sequence among three of 256: their workgroups share the machine, so the
    # long one is split as by the uniform rule (32 partitions), not into 16.
    plan = make_plan(shape(4, 32768), H200_SMS, arch="sm_90", max_seq_len=32768,
                     total_seq_len=32768 + 3 * 256, residency=h200_residency)
    assert (plan.partition_size, plan.max_partitions) == (1024, 32)


def test_a_split_grid_just_over_one_wave_takes_the_partitions_that_fit_in_one():
    # 5 x 8192 at GQA 8: 7 partitions of 1280 make 280 workgroups on 264 slots; 6 of 1536 make
    # 240. H200, v23: float16 66.6 -> 59.5 us, fp8 44.9 -> 39.2.
    for options in ({}, dict(kv_format="fp8_e4m3")):
        problem = shape(5, 8192, **options)
        plan = make_plan(problem, H200_SMS, arch="sm_90", residency=h200_residency)
        assert (plan.partition_size, plan.max_partitions) == (1536, 6)
        # Without the residency (no GPU) the step is skipped.
        assert make_plan(problem, H200_SMS, arch="sm_90").partition_size == 1280


def test_planner_halves_partitions_of_a_grid_just_over_one_wave():
    fp8 = shape(batch=64, seq_len=4096, kv_format="fp8_e4m3")  # 512 workgroups
    # 2 resident a multiprocessor: 1.9 waves, one partition; 3 resident: 1.3 waves, two halves.
    assert make_plan(fp8, H200_SMS, arch="sm_90", residency=lambda v: 2).max_partitions == 1
    three = make_plan(fp8, H200_SMS, arch="sm_90", residency=lambda v: 3)
    assert three.max_partitions == 2 and three.partition_size == 2048
    # Beyond one and a half waves the halves would make as many waves: left alone.
    assert make_plan(shape(batch=128, seq_len=4096), H200_SMS, arch="sm_90",
                     residency=lambda v: 3).max_partitions == 1
    # Unknown residency (no GPU, or the portable kernels): no such step.
    assert make_plan(fp8, H200_SMS, arch="sm_90").max_partitions == 1
    assert make_plan(fp8, H200_SMS, arch="sm_90", residency=lambda v: None).max_partitions == 1
    # The 16-row kernel does not (group 16 at 96 x 1024, 384 workgroups: 84.7 whole, 93.5
    # halved).
    sixteen = make_plan(shape(batch=96, seq_len=1024, kv_heads=4), H200_SMS, arch="sm_90",
                        residency=lambda v: 2)
    assert sixteen.variant.heads == 16 and sixteen.max_partitions == 1


@pytest.mark.parametrize("options, batch, seq_len, partitions", [
    # Up to 1.25 waves whole: four quarters (H200, v49, against the old two halves).
    ({}, 34, 8192, 4),                             # 296.8 -> 281.7 us
    ({}, 38, 4096, 4),                             # 178.0 -> 172.1
    ({}, 40, 4096, 4),                             # 1.2% (v23's halves: 211.0 -> 185.8 whole)
    (dict(heads=32, kv_heads=32), 9, 2048, 4),     # MHA: 97.8 -> 88.0
    (dict(head_size=96), 38, 4096, 4),             # 140.5 -> 134.9
    (dict(dtype="bfloat16"), 36, 4096, 4),         # 173.9 -> 164.1
    (dict(head_size=256), 17, 4096, 4),            # the deep form: 168.6 -> 162.7
    # Past 1.25 waves: the halves (their third wave over half full) ...
    ({}, 42, 4096, 2),
    ({}, 48, 8192, 2),
    ({}, 42, 2048, 2),
    # ... or whole at up to 1024 tokens, and at 2048 past 1.3 waves.
    ({}, 34, 1024, 1),                             # 57.9 -> 55.3
    ({}, 48, 1024, 1),                             # 69.4 -> 63.0
    ({}, 46, 2048, 1),                             # 110.8 -> 107.9
    (dict(heads=32, kv_heads=32), 12, 2048, 1),    # MHA: 112.7 -> 110.0
    # fp8 alike where it has no dense form (head 96) ...
    (dict(kv_format="fp8_e4m3", head_size=96), 38, 4096, 4),  # 86.4 -> 80.9
    (dict(kv_format="fp8_e4m3", head_size=96), 46, 2048, 1),  # 59.4 -> 54.3
    (dict(kv_format="fp8_e4m3", head_size=96), 40, 1024, 1),  # 39.1 -> 29.7
    # ... while fp8 at head 128 and head 64's 16-bit cache keep the halves, from which their
    # dense forms' rules take these grids: run whole on the dense form.
    (dict(kv_format="fp8_e4m3"), 36, 2048, 1),     # dense 51.2, default in four 58.6
    (dict(head_size=64), 60, 2048, 1),             # 480 workgroups, 1.2 waves of 3
])
def test_a_grid_just_over_one_wave_splits_by_its_last_wave(options, batch, seq_len, partitions):
    plan = make_plan(shape(batch, seq_len, **options), H200_SMS, arch="sm_90",
                     residency=lambda v: 1 if v.deep else h200_residency(v))
    assert plan.max_partitions == partitions and not plan.variant.wide
    dense_kind = options.get("head_size", 128) == (128 if options.get("kv_format") else 64)
    assert plan.variant.dense == dense_kind


@pytest.mark.parametrize("options, batch, seq_len, partition_size", [
    # H200, whole -> the long split (v50, µs; held out from the sweep the rule was read off):
    ({}, 19, 16384, 2048),                         # 312.6 -> 307.6 (152 workgroups)
    ({}, 21, 16384, 4096),                         # 348.6 -> 339.2
    ({}, 23, 16384, 4096),                         # 383.6 -> 362.6
    ({}, 25, 16384, 2048),                         # 408.4 -> 394.4
    ({}, 27, 16384, 2048),                         # 434.5 -> 427.4
    ({}, 13, 32768, 2048),                         # 423.6 -> 419.9 (the wide form whole before)
    ({}, 15, 32768, 4096),                         # 469.3 -> 466.6
    ({}, 12, 16384, 2048),                         # 210.0 -> 199.9
    ({}, 23, 65536, 2048),                         # 1534.3 -> 1425.9
    ({}, 18, 16384, 2048),                         # the miss: 295.6 -> 300.9
    (dict(dtype="bfloat16"), 23, 16384, 4096),     # 384.4 -> 361.7
    (dict(kv_format="fp8_e4m3"), 17, 16384, 2048),  # 169.8 -> 159.9 (not the dense form)
    (dict(kv_format="fp8_e4m3"), 20, 32768, 4096),  # 345.2 -> 329.1
    (dict(kv_format="fp8_e4m3", head_size=96), 12, 16384, 2048),  # 99.8 -> 92.9 (cluster pair)
    (dict(heads=64, kv_heads=64), 3, 32768, 4096),  # MHA: 771.4 -> 716.9
    (dict(heads=64, kv_heads=16), 11, 16384, 4096),  # group 4: 366.2 -> 352.0
    (dict(head_size=96), 19, 16384, 2048),         # 258.6 -> 238.1
])
def test_long_sequences_below_a_wave_split_by_their_last_wave(options, batch, seq_len,
                                                              partition_size):
    """Workgroups 0.7 x the multiprocessors to 0.85 x the default form's slots (264), from
    16384 tokens: partitions of 2048 or 4096 tokens, whichever grid fills its last wave the
    more, on the default form (neither dense nor wide)."""
    plan = make_plan(shape(batch, seq_len, **options), H200_SMS, arch="sm_90",
                     residency=h200_residency)
    assert plan.partition_size == partition_size
    assert not (plan.variant.dense or plan.variant.wide or plan.cluster_merge)
    workgroups = batch * shape(batch, seq_len, **options).num_kv_heads
    fills = {size: (workgroups * (seq_len // size) - 1) % 264 + 1 for size in (2048, 4096)}
    assert fills[partition_size] == max(fills.values())


@pytest.mark.parametrize("options, batch, seq_len, kwargs, whole_form", [
    ({}, 16, 16384, {}, "wide"),          # the wide form on every multiprocessor: 2.6% faster
    ({}, 11, 16384, {}, None),            # 88 workgroups: below 0.7 of the multiprocessors
    ({}, 30, 16384, {}, "default"),       # 240 workgroups: past 0.85 of the slots
    ({}, 20, 8192, {}, "default"),        # 8192 tokens: whole was best
    (dict(window=4096), 20, 32768, {}, None),       # sliding windows: not measured
    (dict(head_size=64), 20, 16384, {}, None),      # head 64: not measured
    (dict(head_size=256), 20, 16384, {}, None),     # the deep form: one a multiprocessor
    (dict(heads=64, kv_heads=4), 40, 16384, {}, None),  # the 16-row kernel
    ({}, 20, 16384, dict(arch="sm_80"), None),      # before sm_90: not measured
    ({}, 20, 16384, dict(residency=None), None),    # residency unknown: no wave to fill
    ({}, 20, 16384, dict(total_seq_len=20 * 16384 // 2), None),  # ragged
])
def test_where_long_sequences_are_not_split_by_their_last_wave(monkeypatch, options, batch,
                                                               seq_len, kwargs, whole_form):
    """Outside the rule's measured ground the plan is the one without the rule (here: with its
    shortest length out of reach); where that is whole, the form is named."""
    problem = shape(batch, seq_len, **options)
    kwargs = dict(dict(arch="sm_90", residency=h200_residency, max_seq_len=seq_len), **kwargs)
    plan = make_plan(problem, H200_SMS, **kwargs)
    monkeypatch.setattr(planner, "LONG_SPLIT_MIN_TOKENS", 1 << 30)
    assert plan == make_plan(problem, H200_SMS, **kwargs)
    if whole_form is not None:
        assert plan.single_partition and plan.variant.wide == (whole_form == "wide")


@pytest.mark.parametrize("arch, chained", [("sm_80", False), ("sm_89", False), ("sm_90", True),
                                           ("sm_90a", True), ("gfx942", False)])
def test_reduce_is_chained_from_sm90(switch, arch, chained):
    switch("CUPA_CHAINED_REDUCE", None)
    assert dispatch.chains_reduce(arch) is chained
    switch("CUPA_CHAINED_REDUCE", "0")
    assert not dispatch.chains_reduce(arch)


@pytest.mark.parametrize("options, batch, seq_len", [
    # H200, eager calls back to back. The band's grids, launched plainly by v50 step 2
    # (chained, the next call allowed at phase 1's start -> plain, µs); since v53 a tensor-core
    # phase 1 of one partition allows the next call once its chunks are done, and chained they
    # beat plain (v53 step 1: plain -> chained):
    ({}, 17, 4096),                         # 136 of 264 slots: 110.4 -> 73.5; 75.4 -> 74.0
    ({}, 17, 8192),                         # 217.8 -> 142.9; 142.8 -> 140.9
    ({}, 20, 1024),                         # 160: 32.8 -> 26.5; 27.0 -> 25.6
    ({}, 25, 1024),                         # 200: 34.0 -> 31.7; 32.0 -> 30.3
    ({}, 30, 4096),                         # 240: 123.5 -> 118.2; 124.0 -> 120.3
    (dict(kv_format="fp8_e4m3"), 20, 8192),  # 115.8 -> 88.5; 89.1 -> 86.6
    (dict(heads=64, kv_heads=4), 40, 2048),  # group 16, 160: 61.4 -> 48.0; 48.4 -> 46.6
    (dict(head_size=64), 40, 4096),         # dense form, 320 of 528: 114.3 -> 83.1; 84.3 -> 82.0
    # Grids outside the band, chained before v53 too:
    ({}, 12, 1024),                         # 96, under half: 18.3 -> 17.0 chained; v53 mixed
    ({}, 32, 2048),                         # 256, nearly full: 68.0 -> 66.8
    ({}, 64, 4096),                         # two waves
])
def test_phase1_of_one_partition_is_chained_on_every_grid(options, batch, seq_len):
    plan = make_plan(shape(batch, seq_len, **options), H200_SMS, arch="sm_90",
                     max_seq_len=seq_len, residency=h200_residency)
    assert isinstance(plan.variant, catalogue.DecodeMmaVariant) and plan.single_partition
    assert plan.phase1_chained


@pytest.mark.parametrize("batch, seq_len, workgroups, merge, chained", [
    # Phase 1 allows what follows it at its start where its partitions merge after the chunks;
    # the next call is allowed at the start of the reduce, or of a cluster-merging phase 1.
    (5, 8192, 240, "reduce", False),   # 6 partitions a sequence, 240 of 264 slots
    (7, 8192, 224, "reduce", False),
    (1, 32768, 128, "reduce", True),   # under half
    (10, 2048, 160, "cluster", False),  # cluster pairs: 34.2 -> 28.4 plain (v50 step 2)
    (8, 4096, 128, "cluster", True),    # under half
    (1, 4096, 128, "cluster", True),    # one cluster of 16 a KV head: 12.5 -> 11.2 chained
])
def test_phase1_of_partitions_is_plain_on_a_wave_just_over_half_full(batch, seq_len, workgroups,
                                                                     merge, chained):
    plan = make_plan(shape(batch, seq_len), H200_SMS, arch="sm_90", max_seq_len=seq_len,
                     residency=h200_residency)
    assert plan.max_partitions > 1 and plan.cluster_merge is (merge == "cluster")
    assert 8 * batch * plan.max_partitions == workgroups
    assert plan.phase1_chained is chained
    # Without a residency (no GPU), chained.
    assert make_plan(shape(batch, seq_len), H200_SMS, arch="sm_90",
                     max_seq_len=seq_len).phase1_chained


@pytest.mark.parametrize("workgroups, in_band", [(80, False), (132, False), (133, True),
                                                 (250, True), (251, False), (300, False)])
def test_phase1_chaining_band_counts_the_slots_of_the_form_that_runs(workgroups, in_band):
    """The band (UNCHAINED_FROM_SLOTS to UNCHAINED_TO_SLOTS of the resident slots) applies
    where the next call is allowed at the start of the kernel ahead of it: the reduce, a
    tensor-core phase 1 of several partitions, the portable kernel."""
    mma = make_plan(shape(20, 4096), H200_SMS, arch="sm_90", max_seq_len=4096).variant
    portable = make_plan(shape(20, 4096, head_size=32), H200_SMS, arch="sm_90",
                         max_seq_len=4096).variant
    assert isinstance(mma, catalogue.DecodeMmaVariant)
    assert not isinstance(portable, catalogue.DecodeMmaVariant)
    two_a_sm = lambda v: 2  # noqa: E731
    # (variant, workgroups, multiprocessors, residency, next_at_start)
    assert planner.phase1_chains(mma, workgroups, H200_SMS, two_a_sm, True) is not in_band
    assert planner.phase1_chains(portable, workgroups, H200_SMS, two_a_sm, True) is not in_band
    assert planner.phase1_chains(mma, workgroups, H200_SMS, two_a_sm, False)
    # One workgroup a multiprocessor: 80 of its 132 slots is past half.
    assert planner.phase1_chains(mma, 80, H200_SMS, lambda v: 1, True) is False
    assert planner.phase1_chains(mma, workgroups, H200_SMS, None, True)  # unknown: chained


@pytest.mark.parametrize("options, batch, seq_len, at_start", [
    # A tensor-core grid of one partition lets the next call in after its chunks where it fills
    # more than half its slots, at its start where the whole next grid fits the free slots
    # (v53 step 1, eager µs, allowed at the start -> after the chunks):
    (dict(heads=64, kv_heads=4), 32, 2048, True),    # 128 of 264: 37.6 -> 38.7
    (dict(heads=64, kv_heads=4), 33, 2048, True),    # 132: 38.2 -> 39.8
    (dict(heads=64, kv_heads=4), 40, 2048, False),   # 160: 47.9 -> 46.6
    ({}, 20, 1024, False),                           # 160: 27.1 -> 25.6
    ({}, 128, 1024, False),                          # 4 waves: 130.4 -> 129.0
    # Several partitions: at the start (8 x 4096's cluster pairs 37.7 -> 39.8 after the chunks).
    ({}, 8, 4096, True),
    ({}, 1, 32768, True),                            # the reduce: 39.1 -> 41.5 (probe)
])
def test_phase1_lets_the_next_call_in_late_only_past_half_its_slots(options, batch, seq_len,
                                                                    at_start):
    problem = shape(batch, seq_len, **options)
    plan = make_plan(problem, H200_SMS, arch="sm_90", max_seq_len=seq_len,
                     residency=h200_residency)
    assert plan.next_call_at_start is at_start
    assert plan.phase1_chained or at_start
    # Without a residency (no GPU): at the start, as before v53.
    assert make_plan(problem, H200_SMS, arch="sm_90", max_seq_len=seq_len).next_call_at_start
    # The portable kernel allows at its start whatever its grid (start_in_chain).
    portable = make_plan(shape(40, 2048, head_size=32), H200_SMS, arch="sm_90",
                         max_seq_len=2048).variant
    assert planner.next_call_at_start(portable, 160, H200_SMS, lambda v: 2, True)


@pytest.mark.parametrize("plan_chained, arch, extended, cluster, form", [
    (True, "sm_90", True, False, "dependent"),
    (True, "sm_90", True, True, "cluster-dependent"),
    (False, "sm_90", True, False, "plain"),       # the planner's rule (phase1_chains)
    (False, "sm_90", True, True, "cluster"),
    (True, "sm_80", True, False, "plain"),        # the target does not chain
    (True, "sm_90", False, False, "plain"),       # no extended launch in the driver
])
def test_phase1_launch_form_follows_the_plan_and_the_target(switch, plan_chained, arch, extended,
                                                            cluster, form):
    from dataclasses import replace

    from cupa.gpu.launch import phase1_form
    switch("CUPA_CHAINED_PHASE1", None)
    plan = replace(make_plan(shape(8, 4096), H200_SMS, arch="sm_90"),
                   phase1_chained=plan_chained, cluster_merge=cluster)
    assert phase1_form(plan, arch, extended) == form
    switch("CUPA_CHAINED_PHASE1", "0")
    assert phase1_form(plan, arch, extended) == ("cluster" if cluster else "plain")
    switch("CUPA_CHAINED_PHASE1", "always")  # whatever the plan says
    chained = extended and arch == "sm_90"
    assert phase1_form(plan, arch, extended) == (("cluster-" if cluster else "") + "dependent"
                                                 if chained else "cluster" if cluster else "plain")


@pytest.mark.parametrize("arch, chained", [("sm_80", False), ("sm_89", False), ("sm_90", True),
                                           ("sm_90a", True), ("gfx942", False)])
def test_phase1_is_chained_from_sm90(switch, arch, chained):
    """Phase 1 as a dependent of the kernel ahead, by its own switch (not the reduce's)."""
    switch("CUPA_CHAINED_PHASE1", None)
    switch("CUPA_CHAINED_REDUCE", "0")
    assert dispatch.chains_phase1(arch) is chained
    switch("CUPA_CHAINED_PHASE1", "0")
    switch("CUPA_CHAINED_REDUCE", None)
    assert not dispatch.chains_phase1(arch)
    assert dispatch.chains_reduce(arch) is chained


def test_prepared_launch_forms_and_their_attributes(monkeypatch):
    """Each launch form packs its attributes: none, programmatic serialization, the cluster's
    dimensions, or both; an unknown form is refused before anything is launched."""
    from cupa.gpu import driver

    fake = driver.Driver(library=None, plain=None, extended=object(), set_attribute=None)
    monkeypatch.setattr(driver, "driver", lambda is_hip: fake)

    class Kernel:
        name = "k"

        class kernel:
            ptr = 0

    def launch(form, cluster=None):
        return driver.PreparedLaunch(Kernel, (4, 2, 1), (128, 1, 1), pointers=2, scalars=(),
                                     is_hip=False, form=form, cluster=cluster)

    assert launch("plain")._config.count == 0  # cuLaunchKernelEx with no attribute
    dependent = launch("dependent")._config
    assert dependent.count == 1
    assert dependent.attributes[0].id == driver._PROGRAMMATIC_STREAM_SERIALIZATION
    both = launch("cluster-dependent", cluster=(1, 2, 1))._config
    assert both.count == 2
    assert [both.attributes[i].id for i in range(2)] == [
        driver._CLUSTER_DIMENSION, driver._PROGRAMMATIC_STREAM_SERIALIZATION]
    assert list(both.attributes[0].value[:3]) == [1, 2, 1]
    with pytest.raises(ValueError, match="launch form"):
        launch("eager")


def test_prepared_launch_scalars_keep_their_c_types():
    """What the driver receives for each kind of scalar the launches pack."""
    import ctypes

    import numpy as np

    from cupa.gpu import driver

    assert isinstance(driver._scalar(np.int32(-7)), ctypes.c_int32)
    assert driver._scalar(np.int32(-7)).value == -7
    assert driver._scalar(np.int64(1 << 40)).value == 1 << 40
    assert driver._scalar(np.float32(0.5)).value == 0.5
    with pytest.raises(TypeError, match="np.int32"):
        driver._scalar(3)  # a Python int would be ambiguous: never packed


@pytest.mark.parametrize("entry", ["cuLaunchKernelEx", "cuLaunchKernel"])
def test_prepared_launch_packs_pointers_then_scalars(monkeypatch, entry):
    """The argument block a PreparedLaunch hands the driver: one slot per pointer, then the
    scalars, each slot pointing at its value; a call rewrites only the pointer slots. CUDA
    launches go through cuLaunchKernelEx (its config carrying grid, block, shared memory and
    stream); a driver without it (before 12.0, or CUPA_LAUNCH=plain) gets cuLaunchKernel with
    the same block, the argument list HIP's hipModuleLaunchKernel takes."""
    import ctypes

    import numpy as np

    from cupa.gpu import driver

    seen = []

    def record(handle, grid, block, shared, stream, params):
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        seen.append((handle, tuple(grid), tuple(block), shared, stream,
                     [ctypes.c_uint64.from_address(slots[i]).value for i in range(2)],
                     ctypes.c_int32.from_address(slots[2]).value,
                     ctypes.c_float.from_address(slots[3]).value))
        return 0

    def fake_plain(handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        # ctypes objects too (the entry point has no argtypes): handle and stream as pointers,
        # the six dimensions and the shared bytes as unsigned ints
        assert isinstance(handle, ctypes.c_void_p) and isinstance(stream, ctypes.c_void_p)
        dims = (gx, gy, gz, bx, by, bz, shared)
        assert all(type(d) is ctypes.c_uint for d in dims) and extra is None
        gx, gy, gz, bx, by, bz, shared = (d.value for d in dims)
        return record(handle.value, (gx, gy, gz), (bx, by, bz), shared, stream.value, params)

    def fake_extended(config_ref, handle, params, extra):
        # ctypes objects, as the real entry point (no argtypes) receives them
        assert isinstance(handle, ctypes.c_void_p) and extra is None
        config = config_ref._obj
        assert config.count == 0
        return record(handle.value, config.grid, config.block, config.shared_bytes,
                      config.stream, params)

    extended = fake_extended if entry == "cuLaunchKernelEx" else None
    monkeypatch.setattr(driver, "driver", lambda is_hip: driver.Driver(None, fake_plain,
                                                                        extended, None))

    class Kernel:
        name = "k"

        class kernel:
            ptr = 0xABC

    launch = driver.PreparedLaunch(Kernel, (3, 2, 1), (128, 1, 1), pointers=2,
                                   scalars=(np.int32(5), np.float32(0.25)), is_hip=False,
                                   shared_bytes=64)
    launch((0x1000, 0), 77)
    launch((0x2000, 0x3000), 78)
    assert seen == [(0xABC, (3, 2, 1), (128, 1, 1), 64, 77, [0x1000, 0], 5, 0.25),
                    (0xABC, (3, 2, 1), (128, 1, 1), 64, 78, [0x2000, 0x3000], 5, 0.25)]


@pytest.mark.parametrize("form, has_extended", [("driver", True), ("plain", False)])
def test_launch_switch_picks_the_driver_entry_points(monkeypatch, form, has_extended):
    """CUPA_LAUNCH=driver takes cuLaunchKernelEx where libcuda has it; plain leaves it out, so
    CUDA launches take cuLaunchKernel as HIP's take hipModuleLaunchKernel. Neither entry point
    gets argtypes (PreparedLaunch passes ctypes objects); an unknown form is refused."""
    import ctypes
    import types

    from cupa.gpu import driver

    class Library:
        def __init__(self, name):
            self.cuLaunchKernel, self.cuLaunchKernelEx = types.SimpleNamespace(), \
                types.SimpleNamespace()
            self.cuFuncSetAttribute = types.SimpleNamespace()

    monkeypatch.setattr(ctypes, "CDLL", Library)
    monkeypatch.setenv("CUPA_LAUNCH", form)
    driver.driver.cache_clear()
    try:
        loaded = driver.driver(False)
        assert (loaded.extended is not None) is has_extended
        assert not hasattr(loaded.plain, "argtypes") and loaded.plain.restype is ctypes.c_int
        monkeypatch.setenv("CUPA_LAUNCH", "fast")
        driver.driver.cache_clear()
        with pytest.raises(ValueError, match="CUPA_LAUNCH"):
            driver.driver(False)
    finally:
        monkeypatch.undo()
        driver.driver.cache_clear()


def test_launches_with_attributes_without_the_driver_call_say_what_to_do(monkeypatch):
    from cupa.gpu import driver
    monkeypatch.setattr(driver, "driver", lambda is_hip: None)
    with pytest.raises(RuntimeError, match="CUPA_MERGE=reduce"):
        driver.PreparedLaunch(None, (1, 2, 1), (128, 1, 1), pointers=0, scalars=(),
                              is_hip=False, form="cluster", cluster=(1, 2, 1))


@pytest.mark.parametrize("problem, cluster", [
    (dict(batch=1, seq_len=4096), 16),    # 16 partitions of 256: 128 workgroups
    (dict(batch=1, seq_len=2048), 8),
    (dict(batch=2, seq_len=4096), 8),     # 8 of 512
    (dict(batch=1, seq_len=8192), 16),    # 16 of 512
    (dict(batch=1, seq_len=4096, head_size=64), 16),
    (dict(batch=1, seq_len=4096, kv_format="fp8_e4m3"), 16),
    (dict(batch=1, seq_len=16384), 0),    # 1024-token partitions: no longer host-bound
    (dict(batch=1, seq_len=32768, kv_format="fp8_e4m3"), 0),
    (dict(batch=1, seq_len=4096, head_size=256), 0),  # one workgroup a multiprocessor
    (dict(batch=4, seq_len=4096), 0),     # 4 of 1024
    (dict(batch=1, seq_len=4096, heads=128), 0),  # group 16: row chunks, left to the reduce
])
def test_small_launches_merge_in_one_cluster(switch, problem, cluster):
    """Launches of the 8-column kernel in one wave of at most one workgroup a multiprocessor,
    each reading at most 512 tokens (256 KB of K/V), merge all their partitions in one cluster
    on sm_90 (planner.SMALL_LAUNCH_*): one launch where the reduce would be a second."""
    switch("CUPA_MERGE", None)
    L = problem["seq_len"]
    plan = make_plan(shape(**problem), H200_SMS, arch="sm_90", max_seq_len=L)
    if cluster:
        assert plan.cluster_merge and not plan.reduce_launch
        assert plan.max_partitions == cluster
    else:
        assert not plan.cluster_merge and plan.reduce_launch
    s = shape(**problem)
    assert make_plan(s, H200_SMS, arch="sm_80", max_seq_len=L).reduce_launch  # no clusters
    ragged = make_plan(s, H200_SMS, arch="sm_90", max_seq_len=L, total_seq_len=L // 2)
    assert ragged.reduce_launch or ragged.single_partition or s.num_seqs == 1
    switch("CUPA_MERGE", "reduce")
    assert make_plan(s, H200_SMS, arch="sm_90", max_seq_len=L).reduce_launch


def test_partitions_merge_in_clusters_of_two_on_sm90(switch):
    switch("CUPA_MERGE", None)
    switch("CUPA_WIDE", "never")  # the default form's plans (16 x 16384 is the wide form's)
    two = make_plan(shape(batch=16, seq_len=16384), H200_SMS, arch="sm_90", max_seq_len=16384)
    assert two.max_partitions == 2 and two.cluster_merge and not two.reduce_launch
    many = make_plan(shape(batch=1, seq_len=32768), H200_SMS, arch="sm_90", max_seq_len=32768)
    assert many.max_partitions > 2 and not many.cluster_merge and many.reduce_launch
    on_sm80 = make_plan(shape(batch=16, seq_len=16384), H200_SMS, arch="sm_80")
    assert on_sm80.max_partitions == 2 and not on_sm80.cluster_merge and on_sm80.reduce_launch
    portable = make_plan(shape(batch=16, seq_len=16384, dtype="float32"), H200_SMS, arch="sm_90")
    assert portable.max_partitions > 1 and not portable.cluster_merge  # the portable kernel
    single = make_plan(shape(batch=256, seq_len=2048), H200_SMS, arch="sm_90", max_seq_len=2048)
    assert single.single_partition and not single.cluster_merge and not single.reduce_launch

    switch("CUPA_MERGE", "cluster")  # wherever the kernel can: up to 16 blocks
    assert make_plan(shape(batch=1, seq_len=4096), H200_SMS, arch="sm_90",
                     max_seq_len=4096).cluster_merge
    assert not make_plan(shape(batch=1, seq_len=4096), H200_SMS, arch="sm_90",
                         partition_size=128).cluster_merge  # 32 partitions: the reduce
    switch("CUPA_MERGE", "reduce")
    assert not make_plan(shape(batch=16, seq_len=16384), H200_SMS, arch="sm_90").cluster_merge
    switch("CUPA_MERGE", "sometimes")
    with pytest.raises(ValueError, match="CUPA_MERGE"):
        make_plan(shape(batch=16, seq_len=16384), H200_SMS, arch="sm_90")


def test_short_one_token_launches_pair_their_partitions_in_clusters(switch):
    """From about one workgroup per multiprocessor, short one-token launches on sm_90 take two
    partitions merged within clusters instead of more partitions and the reduce launch."""
    switch("CUPA_MERGE", None)
    switch("CUPA_WIDE", "never")  # the default form's plans (8 x 32768 is the wide form's)
    paired = make_plan(shape(batch=8, seq_len=4096), H200_SMS, arch="sm_90", max_seq_len=4096)
    assert paired.max_partitions == 2 and paired.cluster_merge
    longer = make_plan(shape(batch=8, seq_len=32768), H200_SMS, arch="sm_90", max_seq_len=32768)
    assert longer.max_partitions == 4 and longer.reduce_launch  # pairs of 16384 tokens: slower
    fewer = make_plan(shape(batch=4, seq_len=8192), H200_SMS, arch="sm_90", max_seq_len=8192)
    assert fewer.max_partitions > 2  # 64 workgroups would be half the multiprocessors
    tokens = DecodeShape(num_seqs=8, num_tokens=32, num_heads=64, num_kv_heads=8, head_size=128,
                         num_blocks=8 * 256, block_size=16, max_blocks_per_seq=256,
                         dtype="float16", scale=0.1, has_alibi=False, sliding_window=0)
    assert make_plan(tokens, H200_SMS, arch="sm_90", max_seq_len=4096,
                     max_query_len=4).max_partitions == 4  # the 16-row kernel: slower in pairs
    assert make_plan(shape(batch=8, seq_len=4096), H200_SMS, arch="sm_80",
                     max_seq_len=4096).max_partitions == 4
    switch("CUPA_MERGE", "reduce")  # one a multiprocessor still (ONE_A_SM_FRACTION), reduced
    by_reduce = make_plan(shape(batch=8, seq_len=4096), H200_SMS, arch="sm_90", max_seq_len=4096)
    assert by_reduce.max_partitions == 2 and by_reduce.reduce_launch


@pytest.mark.parametrize("options, batch, seq_len, partitions", [
    # 96-128 (sequence, KV head) pairs whole, not a cluster pair (H200, v49, µs):
    ({}, 12, 1024, 1),                             # 25.3 -> 23.9
    ({}, 16, 1024, 1),                             # 29.9 -> 28.1
    ({}, 12, 512, 1),                              # 17.4 -> 15.6
    ({}, 12, 4096, 1),                             # 66.8 -> 63.2
    (dict(kv_format="fp8_e4m3"), 12, 1024, 1),     # 17.8 -> 15.6
    (dict(dtype="bfloat16"), 12, 4096, 1),         # 65.6 -> 62.8
    (dict(heads=32, kv_heads=32), 3, 4096, 1),     # MHA: 65.3 -> 61.7
    (dict(head_size=96), 13, 4096, 1),             # 56.3 -> 53.9
    # 3-7 sequences in the partitions that fit, not two a multiprocessor:
    ({}, 6, 1024, 2),                              # 18.8 -> 17.2
    ({}, 7, 2048, 2),                              # 29.7 -> 27.5
    ({}, 6, 4096, 2),                              # 42.0 -> 40.0
    ({}, 5, 2048, 3),                              # 23.9 -> 23.6
    ({}, 3, 2048, 4),                              # 18.2 -> 17.2
    (dict(kv_format="fp8_e4m3"), 7, 4096, 2),      # 30.3 -> 27.8
    (dict(head_size=96), 4, 2048, 4),              # 18.8 -> 17.3
])
def test_short_sequences_run_one_workgroup_a_multiprocessor(switch, options, batch, seq_len,
                                                            partitions):
    """Each sequence in as many partitions as leave one workgroup a multiprocessor, where
    that fills at least ONE_A_SM_FRACTION of them."""
    switch("CUPA_MERGE", None)
    plan = make_plan(shape(batch, seq_len, **options), H200_SMS, arch="sm_90",
                     max_seq_len=seq_len)
    assert plan.max_partitions == partitions and not plan.variant.wide
    assert batch * plan.max_partitions * shape(**options).num_kv_heads <= H200_SMS


def test_where_one_workgroup_a_multiprocessor_is_not_planned(switch):
    switch("CUPA_MERGE", None)
    switch("CUPA_WIDE", "never")
    pairs = [make_plan(shape(10, 4096), H200_SMS, arch="sm_90"),  # 80 pairs: 2.9% faster paired
             make_plan(shape(12, 4096, head_size=64), H200_SMS, arch="sm_90")]  # 39.3 vs 43.1
    assert all(p.max_partitions == 2 and p.cluster_merge for p in pairs)
    assert make_plan(shape(12, 8192, head_size=96), H200_SMS, arch="sm_90").max_partitions > 1
    assert make_plan(shape(12, 4096), H200_SMS, arch="sm_80").max_partitions > 1
    assert make_plan(shape(6, 1024), H200_SMS, arch="sm_80").max_partitions == 4
    window = make_plan(shape(8, 32768, window=4096), H200_SMS, arch="sm_90", max_seq_len=32768)
    assert window.partition_size == 1024  # sliding windows: not measured, the uniform rule


def test_forcing_the_portable_kernel_on_amd(switch):
    switch("CUPA_KERNEL", "portable")
    assert isinstance(dispatch.decode_variant("float16", 128, 8, "gfx942"), catalogue.DecodeVariant)


def test_an_untrusted_matrix_variant_gives_way_to_the_portable_kernel():
    asked = []

    def trusted(variant):
        asked.append(variant)
        return not isinstance(variant, catalogue.DecodeMatrixVariant)

    plan = make_plan(shape(), 304, arch="gfx942", trusted=trusted)
    assert isinstance(asked[0], catalogue.DecodeMatrixVariant)
    assert plan.variant == catalogue.DecodeVariant("float16", 128, 8)
    assert make_plan(shape(), 304, arch="gfx942", trusted=lambda v: True).variant == asked[0]


def nominal_residency(variant):
    return variant.workgroups_per_sm


@pytest.mark.parametrize("problem, lengths, early", [
    (dict(batch=1, seq_len=4096, kv_heads=4), None, True),   # group 16: 128 row-chunk workgroups
    (dict(batch=1, seq_len=32768), None, True),               # 128 workgroups and the reduce
    (dict(batch=16, seq_len=16384), None, True),              # 256 on 264 slots (pairs)
    (dict(batch=1, seq_len=4096), None, True),                # one cluster
    (dict(batch=128, seq_len=1024), None, False),             # 1024 workgroups: four waves
    (dict(batch=64, seq_len=32768), 64 * 1024, False),        # ragged, many waves
])
def test_every_partition_asks_for_block_ids_early_only_where_no_slot_waits(
        switch, problem, lengths, early):
    """Every partition requests its first block ids before the length (LaunchPlan.all_ids_early)
    where the grid is one wave or merges in clusters; in a grid of several waves only a
    sequence's first partition does, as an empty workgroup's wait would hold its slot."""
    switch("CUPA_MERGE", None)
    L = problem["seq_len"]
    plan = make_plan(shape(**problem), H200_SMS, arch="sm_90", max_seq_len=L,
                     total_seq_len=lengths, residency=nominal_residency)
    assert plan.all_ids_early is early, plan
    unknown = make_plan(shape(**problem), H200_SMS, arch="sm_90", max_seq_len=L,
                        total_seq_len=lengths)  # residency unknown: only where clusters merge
    assert unknown.all_ids_early is unknown.cluster_merge


@pytest.mark.parametrize("problem, arch, lengths, stagger", [
    (dict(batch=128, seq_len=1024), "sm_90", None, (2, 5000)),     # 1024 on 264 slots
    (dict(batch=256, seq_len=2048), "sm_90", None, (2, 5000)),
    (dict(batch=128, seq_len=1024, head_size=64), "sm_90", None, (4, 2500)),  # dense form
    (dict(batch=128, seq_len=1024, kv_heads=4), "sm_90", None, (2, 5000)),  # 16-row kernel
    (dict(batch=32, seq_len=2048), "sm_90", None, (0, 0)),         # 256 on 264: one wave
    (dict(batch=16, seq_len=16384), "sm_90", None, (0, 0)),        # cluster pairs
    (dict(batch=64, seq_len=32768), "sm_90", 64 * 1024, (0, 0)),   # ragged
    # a sliding window: 1024 workgroups of which 128 read (the busy ones' block ids would
    # count the empty ones as the first wave) and 256 of which 64 read
    (dict(batch=1, seq_len=32768, window=4096), "sm_90", None, (0, 0)),
    (dict(batch=8, seq_len=32768, window=4096), "sm_90", None, (0, 0)),
    (dict(batch=128, seq_len=1024), "sm_80", None, (0, 0)),        # measured on sm_90 only
    (dict(batch=128, seq_len=1024), "gfx942", None, (0, 0)),       # AMD matrix cores
    (dict(batch=128, seq_len=1024, dtype="float32"), "sm_90", None, (0, 0)),  # portable kernel
])
def test_the_first_wave_is_staggered_only_in_uniform_grids_of_several_waves(
        switch, problem, arch, lengths, stagger):
    """A uniform batch's tensor-core grid of more than one wave on sm_90 starts the first wave's
    k-th workgroup of a multiprocessor k steps late, the steps spreading its slots over
    STAGGER_SPREAD_NS (planner.first_wave_stagger); nowhere else (not where partitions of the
    grid are empty), and never without the residency or with CUPA_STAGGER=never."""
    def h200_residency(variant):  # as the H200 measures it: the dense forms hold four
        return (catalogue.DENSE_RING["workgroups"] if getattr(variant, "dense", False)
                else variant.workgroups_per_sm)

    switch("CUPA_MERGE", None)
    switch("CUPA_STAGGER", None)
    L = problem["seq_len"]
    plan = make_plan(shape(**problem), H200_SMS, arch=arch, max_seq_len=L, total_seq_len=lengths,
                     residency=h200_residency)
    assert (plan.stagger_slots, plan.stagger_ns) == stagger, plan
    if stagger[0]:
        assert stagger[0] * stagger[1] == planner.STAGGER_SPREAD_NS
        assert stagger[0] == h200_residency(plan.variant)
    unknown = make_plan(shape(**problem), H200_SMS, arch=arch, max_seq_len=L,
                        total_seq_len=lengths)
    assert (unknown.stagger_slots, unknown.stagger_ns) == (0, 0)
    switch("CUPA_STAGGER", "never")
    never = make_plan(shape(**problem), H200_SMS, arch=arch, max_seq_len=L,
                      total_seq_len=lengths, residency=h200_residency)
    assert (never.stagger_slots, never.stagger_ns) == (0, 0)


def _store_banks(lanes, row_floats, words):
    """Bank of each lane's store: lanes maps a lane to (row, first float), words is 1 or 2."""
    return {lane: [(row * row_floats + dim + k) % 32 for k in range(words)]
            for lane, (row, dim) in lanes.items()}


def _wavefronts(banks, words):
    """Shared-memory wavefronts one store instruction takes: per group of lanes served at once
    (32 for 4-byte stores, 16 for 8-byte ones), the most lanes that share a bank."""
    group = 32 // words
    most = 0
    for start in range(0, 32, group):
        count = {}
        for lane in range(start, start + group):
            for bank in banks[lane]:
                count[bank] = count.get(bank, 0) + 1
        most = max(most, max(count.values()))
    return most * (32 // group)


@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
def test_merge_buffer_rows_spread_each_store_over_the_banks(head_size):
    """The warps' stores of their output rows to the merge buffer (mma8.cuh, mma16.cuh; lane =
    4 g + c) with merge_row_floats between rows: the 8-column kernel writes rows 2c and 2c + 1
    at head dim 16 i + g (16-bit cache, 4 bytes a lane) or the pair 16 i + 2g, + 1 (fp8), the
    16-row kernel rows g and g + 8 at the pair 8 j + 2c, + 1 (16-bit) or at 16 (j / 2) + 4c +
    j % 2 (fp8, 4 bytes). An unpadded row (a multiple of 32 banks) took 4 (8-column) and 8
    (16-row) wavefronts an instruction; now each takes the fewest its bytes need (one per 128
    bytes), but the 16-row kernel's fp8 stores four (its rows would want another pad than its
    16-bit pairs)."""
    lanes = range(32)
    g, c = (lambda lane: lane >> 2), (lambda lane: lane & 3)
    row8 = catalogue.merge_row_floats(8, head_size)
    row16 = catalogue.merge_row_floats(16, head_size)
    for i in range(head_size // 16):
        f16 = _store_banks({x: (2 * c(x), 16 * i + g(x)) for x in lanes}, row8, 1)
        assert _wavefronts(f16, 1) == 1
        fp8 = _store_banks({x: (2 * c(x), 16 * i + 2 * g(x)) for x in lanes}, row8, 2)
        assert _wavefronts(fp8, 2) == 2
    for j in range(head_size // 8):
        f16 = _store_banks({x: (g(x), 8 * j + 2 * c(x)) for x in lanes}, row16, 2)
        assert _wavefronts(f16, 2) == 2
        fp8 = _store_banks({x: (g(x), 16 * (j // 2) + 4 * c(x) + j % 2) for x in lanes}, row16, 1)
        assert _wavefronts(fp8, 1) == 4
    # rows head_size floats apart, as before v45: the 16-row kernel's 16-bit stores, one float
    # a lane, took 8 wavefronts (4 at heads 80 and 112)
    unpadded = _store_banks({x: (g(x), 2 * c(x)) for x in lanes}, head_size, 1)
    assert _wavefronts(unpadded, 1) == (8 if head_size % 32 == 0 else 4)
