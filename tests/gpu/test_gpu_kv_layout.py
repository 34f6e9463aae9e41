"""Cache layouts on the GPU: "NHD" caches and strided views (K and V interleaved per block,
padded rows) and blocks of 1, 2 and 4 tokens, read in place by every kernel, against the
float64 reference; the plan cache keeps layouts apart; misaligned views are refused, cached
plans included.

Skips without a GPU; runs unchanged on CUDA and ROCm. The CPU twin of the kernels' part is
tests/unit/test_kv_layout_kernels_cpu.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.fp8 import FP8_FORMATS
from cupa.reference import paged_decode_reference

from cases import (FP8_REL_BOUND, REL_BOUND, environ, kv_views, make_case, quantized_case,
                   rel_error)
from test_gpu_decode import KERNEL_MODES, PARTITIONINGS, kernel_modes

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

LENGTHS = (0, 1, 16, 37, 300, 2000)
# (kv_layout, interleaved, row_pad)
VIEWS = {"nhd": ("NHD", False, 0), "nhd-interleaved": ("NHD", True, 0),
         "hnd-interleaved": ("HND", True, 0), "nhd-padded": ("NHD", False, 8)}


def device_view(view):
    """A numpy view of kv_views on the device: its whole allocation uploaded, the same view
    taken there (same offset and strides)."""
    import cupy
    base = view.base
    device_base = cupy.asarray(base)
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return cupy.ndarray(view.shape, device_base.dtype, device_base.data + offset,
                        strides=view.strides)


def decode_views(case, view, caches=None, poison=np.nan, **options):
    """Every kernel mode and partitioning of the case with its caches (or `caches`, fp8 codes)
    as `view`: yields (out as numpy, where) for each."""
    import cupy
    layout, interleaved, pad = VIEWS[view]
    views = kv_views(*(caches or (case.key_cache, case.value_cache)), layout,
                     interleaved=interleaved, row_pad=pad, poison=poison)
    key, value = (device_view(v) for v in views)
    args = (cupy.asarray(case.query), key, value, cupy.asarray(case.block_tables),
            cupy.asarray(case.seq_lens))
    capacity = case.block_tables.shape[1] * case.key_cache.shape[2]
    for mode in kernel_modes(case, options.get("kv_format")):
        for partition_size, merge in PARTITIONINGS:
            size = capacity if partition_size == "capacity" else partition_size
            with environ(**KERNEL_MODES[mode], CUPA_MERGE=merge):
                out = cupy.full(case.query.shape, np.nan, dtype=case.query.dtype)
                cupa.decode(*args, **case.options(cupy.asarray), **options, kv_layout=layout,
                            out=out, partition_size=size)
            yield cupy.asnumpy(out).astype(np.float64), f"{mode}, {size}, {merge}"


@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("dtype, head_size, group", [("float16", 128, 8), ("bfloat16", 64, 16),
                                                     ("float16", 256, 1), ("float32", 96, 4)])
def test_views_match_the_reference(rng, view, dtype, head_size, group):
    case = make_case(rng, dtype=dtype, head_size=head_size, num_kv_heads=2, group=group,
                     seq_lens=LENGTHS, alibi=True)
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    for got, where in decode_views(case, view):
        assert np.isfinite(got).all(), where
        assert rel_error(got, ref) <= REL_BOUND[dtype], where


@pytest.mark.parametrize("view", ["hnd-interleaved", "nhd-interleaved"])
@pytest.mark.parametrize("block_size", [1, 2, 4])
@pytest.mark.parametrize("dtype, head_size, group", [("float16", 128, 8), ("bfloat16", 64, 2)])
def test_small_blocks(rng, view, block_size, dtype, head_size, group):
    """Blocks of 1, 2 and 4 tokens (1: token-level paging)."""
    case = make_case(rng, dtype=dtype, head_size=head_size, block_size=block_size,
                     num_kv_heads=2, group=group, seq_lens=LENGTHS, sliding_window=500)
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    for got, where in decode_views(case, view):
        assert np.isfinite(got).all(), where
        assert rel_error(got, ref) <= REL_BOUND[dtype], where


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3fnuz"])
def test_fp8_cache_in_nhd(rng, fmt):
    case = make_case(rng, num_kv_heads=4, group=4, seq_lens=LENGTHS)
    codes, dequantized, (k_scale, v_scale) = quantized_case(case, fmt, rng)
    ref, _ = paged_decode_reference(case.query, *dequantized, case.block_tables, case.seq_lens)
    for got, where in decode_views(case, "nhd-interleaved", poison=FP8_FORMATS[fmt].max_code,
                                   caches=codes, kv_format=fmt, k_scale=k_scale,
                                   v_scale=v_scale):
        assert rel_error(got, ref) <= FP8_REL_BOUND, where


def test_cached_plans_keep_layouts_apart(rng):
    """16 KV heads in blocks of 16: "HND" and "NHD" caches have the same shape, dtype and
    strides, so only kv_layout tells the plan cache's entries apart."""
    import cupy
    case = make_case(rng, num_kv_heads=16, block_size=16, group=2, seq_lens=(37, 300))
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    hnd = [cupy.asarray(a) for a in case.args()]
    nhd_key, nhd_value = (cupy.asarray(np.ascontiguousarray(c.swapaxes(1, 2)))
                          for c in (case.key_cache, case.value_cache))
    nhd = [hnd[0], nhd_key, nhd_value, *hnd[3:]]
    assert nhd_key.shape == hnd[1].shape and nhd_key.strides == hnd[1].strides
    cupa.clear_plan_cache()
    for _ in range(2):  # planned, then from the plan cache
        for args, layout in ((hnd, None), (nhd, "NHD"), (nhd, "NHD"), (hnd, "HND")):
            got = cupy.asnumpy(cupa.decode(*args, **case.options(cupy.asarray),
                                           kv_layout=layout))
            assert rel_error(got, ref) <= REL_BOUND["float16"], layout


def test_misaligned_cache_views_are_refused(rng):
    """A view that starts 2 bytes into its allocation: refused when planned, and by a cached
    plan (whose signature, shapes, dtypes and strides, cannot see an address)."""
    import cupy
    case = make_case(rng, num_kv_heads=2, group=4, seq_lens=(37, 300))
    args = [cupy.asarray(a) for a in case.args()]
    flat = cupy.empty(case.key_cache.size + 8, case.key_cache.dtype)
    shifted = flat[1:1 + case.key_cache.size].reshape(case.key_cache.shape)
    shifted[...] = args[1]
    cupa.clear_plan_cache()
    with pytest.raises(ValueError, match="key_cache: its first element must be 16-byte aligned"):
        cupa.decode(args[0], shifted, *args[2:])
    cupa.decode(*args)  # planned and cached on aligned arrays of the same signature
    with pytest.raises(ValueError, match="key_cache: its first element must be 16-byte aligned"):
        cupa.decode(args[0], shifted, *args[2:])
    value_shifted = cupy.empty_like(flat)[1:1 + case.key_cache.size].reshape(
        case.key_cache.shape)
    value_shifted[...] = args[2]
    with pytest.raises(ValueError, match="value_cache: its first element must be 16-byte"):
        cupa.decode(args[0], args[1], value_shifted, *args[3:])


@pytest.mark.parametrize("engine", ["vllm-flash", "flashinfer"])
def test_torch_caches_of_serving_engines(rng, engine):
    """The caches as the engines allocate them, torch tensors read in place: vLLM's
    flash-attention layout [2, num_blocks, block_size, num_kv_heads, head_size] (K = kv[0]) and
    FlashInfer's [num_blocks, 2, block_size, num_kv_heads, head_size] (K = kv[:, 0])."""
    torch = pytest.importorskip("torch")
    import cupy
    case = make_case(rng, num_kv_heads=4, group=4, seq_lens=(1, 37, 300, 2000))
    ref, _ = paged_decode_reference(*case.args(), **case.options())
    pages = np.stack([c.swapaxes(1, 2) for c in (case.key_cache, case.value_cache)],
                     axis=0 if engine == "vllm-flash" else 1)
    kv = torch.from_dlpack(cupy.asarray(np.ascontiguousarray(pages)))
    key, value = (kv[0], kv[1]) if engine == "vllm-flash" else (kv[:, 0], kv[:, 1])
    query, tables, lens = (torch.from_dlpack(cupy.asarray(a))
                           for a in (case.query, case.block_tables, case.seq_lens))
    out = cupa.decode(query, key, value, tables, lens, kv_layout="NHD")
    assert isinstance(out, torch.Tensor)
    assert rel_error(cupy.asnumpy(cupy.from_dlpack(out)), ref) <= REL_BOUND["float16"]
