"""Cache layouts on the host side: `kv_layout` ("HND", "NHD") and strided cache views through
validation, the numpy backend, the reference and the kernels' launch arguments.

The kernels themselves read these layouts in tests/unit/test_kv_layout_kernels_cpu.py (every
target, on the CPU) and tests/gpu/test_gpu_kv_layout.py (on a device).
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.gpu.launch import partition_launch
from cupa.gpu.planner import make_plan
from cupa.validation import check_decode_args

from cases import FP8_REL_BOUND, REL_BOUND, kv_views, make_case, quantized_case, rel_error

# (kv_layout, interleaved, row_pad): contiguous NHD, and views of each order with K and V in one
# allocation or with padded rows.
VIEWS = [("NHD", False, 0), ("NHD", True, 0), ("NHD", False, 8), ("HND", True, 0),
         ("HND", False, 24), ("NHD", True, 16)]


def view_id(view):
    layout, interleaved, pad = view
    return f"{layout}{'-interleaved' if interleaved else ''}{f'-pad{pad}' if pad else ''}"


@pytest.mark.parametrize("view", VIEWS, ids=view_id)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_numpy_backend_reads_every_layout(rng, view, dtype):
    """The same problem in a view gives bit for bit the contiguous "HND" result, and the
    reference's within the dtype's bound; plan_decode's runs agree with decode."""
    layout, interleaved, pad = view
    case = make_case(rng, dtype=dtype, num_kv_heads=2, group=4, seq_lens=(0, 1, 37, 300),
                     alibi=True, sinks=True)
    key, value = kv_views(case.key_cache, case.value_cache, layout, interleaved=interleaved,
                          row_pad=pad)
    args = (case.query, key, value, case.block_tables, case.seq_lens)
    out, lse = cupa.decode(*args, **case.options(), kv_layout=layout, return_lse=True,
                           backend="numpy")
    want, want_lse = cupa.decode(*case.args(), **case.options(), return_lse=True,
                                 backend="numpy")
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)
    ref, _ = cupa.paged_decode_reference(*case.args(), **case.options())
    assert rel_error(out, ref) < REL_BOUND[dtype]
    plan = cupa.plan_decode(*args, **case.options(), kv_layout=layout, backend="numpy")
    np.testing.assert_array_equal(plan.run(*args, query_start_loc=None,
                                           alibi_slopes=case.alibi_slopes, sinks=case.sinks),
                                  out)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3fnuz"])
def test_numpy_backend_fp8_scales_follow_the_kv_head_axis(rng, fmt):
    """Per-KV-head fp8 scales apply along the layout's KV-head axis (dim 2 in "NHD"): the
    scales differ per head, so scaling along the token axis would not match."""
    case = make_case(rng, num_kv_heads=4, group=2, seq_lens=(1, 37, 300))
    codes, dequantized, (k_scale, v_scale) = quantized_case(case, fmt, rng)
    max_code = cupa.fp8.FP8_FORMATS[fmt].max_code
    key, value = kv_views(*codes, "NHD", interleaved=True, poison=max_code)
    out = cupa.decode(case.query, key, value, case.block_tables, case.seq_lens,
                      kv_format=fmt, k_scale=k_scale, v_scale=v_scale, kv_layout="NHD",
                      backend="numpy")
    ref, _ = cupa.paged_decode_reference(case.query, *dequantized, case.block_tables,
                                         case.seq_lens)
    assert rel_error(out, ref) < FP8_REL_BOUND


def test_reference_reads_nhd(rng):
    """The oracle's own "NHD": the same rows, viewed; other names are refused."""
    case = make_case(rng, num_kv_heads=2, group=2, seq_lens=(5, 40))
    key, value = kv_views(case.key_cache, case.value_cache, "NHD")
    got = cupa.paged_decode_reference(case.query, key, value, case.block_tables, case.seq_lens,
                                      kv_layout="NHD")
    want = cupa.paged_decode_reference(*case.args())
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="kv_layout: must be 'HND' or 'NHD', got 'NDH'"):
        cupa.paged_decode_reference(*case.args(), kv_layout="NDH")


def test_shape_holds_the_element_strides(rng):
    """DecodeShape.kv_strides: None for a contiguous "HND" cache (the default, so equal
    problems compare equal), else (block, KV head, token) in elements; cache_strides gives
    them either way."""
    case = make_case(rng, num_kv_heads=2, group=2, block_size=16, head_size=128,
                     seq_lens=(5, 40))
    blocks = case.key_cache.shape[0]
    shape = check_decode_args(*case.args())
    assert shape.kv_strides is None and shape.cache_strides == (2 * 16 * 128, 16 * 128, 128)
    assert check_decode_args(*case.args(), kv_layout="HND") == shape
    expected = {("NHD", False, 0): (16 * 2 * 128, 128, 2 * 128),
                ("NHD", True, 0): (2 * 16 * 2 * 128, 128, 2 * 128),
                ("HND", True, 0): (2 * 2 * 16 * 128, 16 * 128, 128),
                ("HND", False, 24): (2 * 16 * 152, 16 * 152, 152)}
    for (layout, interleaved, pad), strides in expected.items():
        key, value = kv_views(case.key_cache, case.value_cache, layout,
                              interleaved=interleaved, row_pad=pad)
        got = check_decode_args(case.query, key, value, case.block_tables, case.seq_lens,
                                kv_layout=layout)
        assert got.kv_strides == strides and got.cache_strides == strides
        assert (got.num_blocks, got.num_kv_heads, got.block_size) == (blocks, 2, 16)


def test_launch_passes_the_strides_last(rng):
    """Phase 1's scalars end with the caches' element strides: int64 block and KV-head
    strides, an int32 token stride (CUPA_PARTITION_PARAMS in decode_common.cuh)."""
    case = make_case(rng, num_kv_heads=2, group=4, seq_lens=(5, 40))
    key, value = kv_views(case.key_cache, case.value_cache, "NHD", interleaved=True)
    shape = check_decode_args(case.query, key, value, case.block_tables, case.seq_lens,
                              kv_layout="NHD")
    plan = make_plan(shape, 132, arch="sm_90")
    *_, scalars = partition_launch(plan, shape, 132)
    block, head, token = scalars[-3:]
    assert (type(block), type(head), type(token)) == (np.int64, np.int64, np.int32)
    assert (int(block), int(head), int(token)) == shape.kv_strides
