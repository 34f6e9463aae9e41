"""Decode from an fp8 cache on the GPU against the float64 reference on the dequantised cache.

Both formats, per-tensor and per-head scales, every head size, block size and GQA ratio of the
core matrix. Every slot that holds no token has the format's largest code (cases.poison_fp8: NaN
codes would be read as numbers by the software widening), so that one slot read too many breaks
the bound (tests/unit/test_poisoned_cases.py). Skips without a GPU; runs unchanged on CUDA and
ROCm.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.reference import paged_decode_reference

from cases import FP8_REL_BOUND, environ, make_case, poison_fp8, quantized_case, rel_error
from test_gpu_decode import KERNEL_MODES, PARTITION, check_lse, kernel_modes, planned

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

FORMATS = ("fp8_e4m3", "fp8_e4m3fnuz")


def check_fp8(case, fmt, rng, per_head=True):
    check_fp8_codes(case, fmt, *quantized_case(case, fmt, rng, per_head))


def check_fp8_codes(case, fmt, codes, dequantized, scales):
    """Every kernel and merge form on the case's query with caches of fp8 `codes` (poisoned by
    cases.poison_fp8 where no token is), against the reference on their `dequantized` values:
    through `cupa.decode` into a NaN-poisoned `out`, and through a plan whose output and lse are
    NaN-poisoned before the run."""
    import cupy
    (k8, v8), (k_ref, v_ref), (k_scale, v_scale) = codes, dequantized, scales
    q, _, _, tables, lens = case.args()
    options = case.options()
    ref, ref_lse = paged_decode_reference(q, k_ref, v_ref, tables, lens, **options)
    args = [cupy.asarray(x) for x in (q, k8, v8, tables, lens)]
    device_options = case.options(cupy.asarray)
    fp8 = dict(kv_format=fmt, k_scale=k_scale, v_scale=v_scale)
    for mode in kernel_modes(case, fmt):
        for partition_size, merge in ((PARTITION, "reduce"), (PARTITION, "cluster"),
                                      (None, "auto")):
            where = f"kernel={mode}, partition_size={partition_size}, merge={merge}, {fmt}"
            with environ(**KERNEL_MODES[mode], CUPA_MERGE=merge):
                out = cupy.full(q.shape, np.nan, dtype=q.dtype)
                assert cupa.decode(*args, **device_options, **fp8, out=out,
                                   partition_size=partition_size) is out
                _, run = planned(args, device_options, **fp8, partition_size=partition_size)
                planned_out, lse = run(cupy.full(q.shape, np.nan, dtype=q.dtype))
            for got, how in ((out, "decode"), (planned_out, "plan")):
                got = cupy.asnumpy(got).astype(np.float64)
                assert np.isfinite(got).all(), f"non-finite output ({how}, {where})"
                err = rel_error(got, ref)
                assert err <= FP8_REL_BOUND, f"rel error {err:.3g} ({how}, {where})"
            check_lse(lse, ref_lse, where, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_matrix(rng, dtype, head_size, block_size, group, fmt):
    case = make_case(rng, dtype=dtype, head_size=head_size, block_size=block_size,
                     num_kv_heads=2, group=group, seq_lens=(1, 255, 257, 700, 2000))
    check_fp8(case, fmt, rng, per_head=bool(group % 2))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
def test_fp8_every_finite_code(rng, fmt, head_size):
    """Caches drawn uniformly from all finite codes: subnormals, both zeros and the largest
    magnitudes go through each kernel's widening (the hardware conversion and the software
    one), which N(0, 1) data at the usual scales reaches only in part. At heads 80 and 112 an
    fp8 row ends half-way through the tensor-core kernels' last 32-byte column block."""
    case = make_case(rng, dtype="float16", head_size=head_size, block_size=16, num_kv_heads=2,
                     group=8, seq_lens=(300, 1000))
    nan_codes = {"fp8_e4m3": (0x7f, 0xff), "fp8_e4m3fnuz": (0x80,)}[fmt]
    finite = np.array([c for c in range(256) if c not in nan_codes], dtype=np.uint8)
    scales = (1 / 256, 1 / 64)  # logits of a few units, values up to 7
    codes = poison_fp8(case, *(rng.choice(finite, size=c.shape)
                               for c in (case.key_cache, case.value_cache)), fmt)
    dequantized = [cupa.dequantize_fp8(c, fmt, s) for c, s in zip(codes, scales)]
    check_fp8_codes(case, fmt, codes, dequantized, scales)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp8_with_every_feature(rng, fmt):
    case = make_case(rng, dtype="bfloat16", head_size=128, block_size=16, num_kv_heads=2,
                     group=8, seq_lens=(1, 300, 2000), new_tokens=(1, 4, 16),
                     sliding_window=500, logits_soft_cap=10.0, sinks=True, alibi=True)
    check_fp8(case, fmt, rng)


def test_fp8_needs_uint8_caches_and_16_bit_queries(rng):
    import cupy
    case = make_case(rng, dtype="float32", head_size=64, seq_lens=(5,))
    args = [cupy.asarray(x) for x in case.args()]
    with pytest.raises(TypeError, match="fp8 cache needs a query of dtype"):
        cupa.decode(*args, kv_format="fp8_e4m3")
    case = make_case(rng, dtype="float16", head_size=64, seq_lens=(5,))
    args = [cupy.asarray(x) for x in case.args()]
    with pytest.raises(TypeError, match="must be uint8"):
        cupa.decode(*args, kv_format="fp8_e4m3")
