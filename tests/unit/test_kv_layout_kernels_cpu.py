"""Every kernel reads caches in "NHD" order and in strided views, and blocks of 1, 2 and 4
tokens, on the CPU
(tests/helpers/decode_on_cpu.py): the AMD targets' emulated builds (matrix-core and portable
kernels) and the NVIDIA tensor-core kernels in each form, planned and launched with cupa's own
arguments, the caches' element strides among them.

Each view holds poison between its elements (NaN, or the largest fp8 code), so a row read at a
wrong stride, or the other half of an interleaved K/V allocation, reaches it. The GPU twin is
tests/gpu/test_gpu_kv_layout.py.
"""

from __future__ import annotations

import pytest

from cupa.fp8 import FP8_FORMATS
from cupa.gpu import dispatch
from cupa.gpu.catalogue import DecodeMatrixVariant, DecodeMmaVariant, DecodeVariant

from cases import FP8_REL_BOUND, REL_BOUND, environ, kv_views, make_case, quantized_case
from cuda_on_cpu import compiler_missing
from decode_on_cpu import LENGTHS, check_result, decode_on_cpu

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason=compiler_missing() or "")

# (kv_layout, interleaved, row_pad)
VIEWS = {"nhd": ("NHD", False, 0), "nhd-interleaved": ("NHD", True, 0),
         "hnd-interleaved": ("HND", True, 0), "nhd-padded": ("NHD", False, 8),
         "hnd-padded": ("HND", False, 24)}
# (target, CUPA_KERNEL, form switches, the variant class the plan must launch)
KERNELS = {"gfx942-matrix": ("gfx942", "auto", None, DecodeMatrixVariant),
           "gfx1100-matrix": ("gfx1100", "auto", None, DecodeMatrixVariant),
           "gfx90a-portable": ("gfx90a", "portable", None, DecodeVariant),
           "gfx1201-portable": ("gfx1201", "portable", None, DecodeVariant),
           "sm_90-8-column": ("sm_90", "auto", None, DecodeMmaVariant),
           "sm_80-16-row": ("sm_80", "auto", "16-row", DecodeMmaVariant),
           "sm_90-dense": ("sm_90", "auto", "dense", DecodeMmaVariant),
           "sm_90-wide": ("sm_90", "auto", "wide", DecodeMmaVariant)}


def run(case, view, kernel, partition_size, **options):
    """The case decoded on the CPU build of `kernel` with its caches as `view`."""
    layout, interleaved, pad = VIEWS[view]
    arch, which, form, variant_class = KERNELS[kernel]
    key, value = kv_views(case.key_cache, case.value_cache, layout, interleaved=interleaved,
                          row_pad=pad)
    with environ(**{"CUPA_KERNEL": which, **dispatch.FORM_SWITCHES.get(form, {})}):
        result = decode_on_cpu(arch, case.query, key, value, case.block_tables, case.seq_lens,
                               **case.options(), kv_layout=layout,
                               partition_size=partition_size, **options)
    assert isinstance(result.plan.variant, variant_class), result.plan.variant
    return result


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernels_read_every_layout(rng, kernel, view):
    """GQA 4, head 128, 64-token partitions merged by the reduce (sm_90: within clusters where
    the plan merges there)."""
    case = make_case(rng, num_kv_heads=2, group=4, seq_lens=LENGTHS)
    check_result(run(case, view, kernel, 64), case, REL_BOUND["float16"])


@pytest.mark.parametrize("kernel", ["gfx942-matrix", "sm_90-8-column", "gfx1100-matrix"])
@pytest.mark.parametrize("block_size", [8, 32])
def test_nhd_at_other_block_sizes(rng, kernel, block_size):
    """A block's rows num_kv_heads * head_size apart at block sizes 8 and 32, bfloat16, with
    ALiBi, a window and several new tokens."""
    case = make_case(rng, dtype="bfloat16", block_size=block_size, num_kv_heads=4, group=2,
                     seq_lens=LENGTHS, alibi=True, sliding_window=200, new_tokens=2)
    check_result(run(case, "nhd-interleaved", kernel, None), case, REL_BOUND["bfloat16"])


@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("kernel", KERNELS)
def test_small_blocks(rng, kernel, block_size):
    """Blocks of 1, 2 and 4 tokens (1: token-level paging), "HND" and "NHD" interleaved;
    lengths that end inside and on a block, partitions of 64 and the planner's."""
    case = make_case(rng, block_size=block_size, num_kv_heads=2, group=4,
                     seq_lens=(0, 1, 3, 16, 37, 300))
    for view, partition_size in (("hnd-interleaved", 64), ("nhd-interleaved", None)):
        check_result(run(case, view, kernel, partition_size), case, REL_BOUND["float16"])


@pytest.mark.parametrize("kernel, fmt", [("sm_90-8-column", "fp8_e4m3"),
                                         ("gfx942-matrix", "fp8_e4m3fnuz"),
                                         ("gfx1201-portable", "fp8_e4m3")])
def test_fp8_cache_in_nhd(rng, kernel, fmt):
    """fp8 codes in an interleaved "NHD" view, per-KV-head scales (different per head)."""
    case = make_case(rng, num_kv_heads=4, group=4, seq_lens=LENGTHS)
    codes, dequantized, (k_scale, v_scale) = quantized_case(case, fmt, rng)
    arch, which, form, variant_class = KERNELS[kernel]
    key, value = kv_views(*codes, "NHD", interleaved=True, poison=FP8_FORMATS[fmt].max_code)
    with environ(CUPA_KERNEL=which):
        result = decode_on_cpu(arch, case.query, key, value, case.block_tables, case.seq_lens,
                               **case.options(), kv_format=fmt, k_scale=k_scale,
                               v_scale=v_scale, kv_layout="NHD", partition_size=64)
    assert isinstance(result.plan.variant, variant_class), result.plan.variant
    check_result(result, case, FP8_REL_BOUND, reference_caches=dequantized)
