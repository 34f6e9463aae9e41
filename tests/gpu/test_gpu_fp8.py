"""fp8 on the GPU: fp8.cuh's device functions bit for bit against the host conversion and
ml_dtypes, the fp8 cache write kernel against quantize_fp8 (per-head scales, strided rows, padding
slots, NaN and saturation), block copies on the device, the cupy path of quantize_fp8 /
dequantize_fp8, and decode through an fp8 cache. Skips without a GPU; runs unchanged on CUDA and
ROCm."""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.fp8 import FP8_FORMATS, dequantize_fp8, decode_table, quantize_fp8
from cupa.reference import paged_decode_reference

import fp8_probe
from cases import DTYPES, REL_BOUND, rel_error
from test_fp8 import oracle, random_floats, special_values
from test_gpu_cache import write_twins

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

FORMATS = list(FP8_FORMATS)


# --- (a) the device functions -------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
def test_device_decode_every_code(name):
    kernel_id = FP8_FORMATS[name].kernel_id
    got = fp8_probe.gpu_decode(np.arange(256, dtype=np.uint8), kernel_id)
    want = decode_table(name)  # equals ml_dtypes bit for bit (tests/unit/test_fp8.py)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", FORMATS)
def test_device_encode_matches_host(rng, name):
    kernel_id = FP8_FORMATS[name].kernel_id
    x = np.concatenate([special_values(name), random_floats(rng, 1_000_000)])
    got = fp8_probe.gpu_encode(x, kernel_id)
    want = quantize_fp8(x, name)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(x.view(np.uint32)[i]), hex(got[i]), hex(want[i]))
                           for i in bad[:5]]
    np.testing.assert_array_equal(got, oracle(x, name))


# --- (b) the cache write kernel -----------------------------------------------------------------

def twin_caches(rng, name, dtype, head_size, block_size, num_kv_heads=2, num_blocks=40,
                layers=2):
    """The same fp8 cache on the GPU and on numpy, with per-head scales that are not powers of
    two (so 1 / scale is rounded)."""
    k_scale = rng.uniform(0.01, 0.3, num_kv_heads).astype(np.float32)
    v_scale = rng.uniform(0.01, 0.3, num_kv_heads).astype(np.float32)
    args = (layers, num_blocks, block_size, num_kv_heads, head_size, dtype)
    kw = dict(kv_format=name, k_scale=k_scale, v_scale=v_scale)
    return (cupa.PagedKVCache(*args, backend="gpu", **kw),
            cupa.PagedKVCache(*args, backend="numpy", **kw))


def random_rows(rng, n, num_kv_heads, head_size, dtype, specials=True):
    """Rows over the whole fp8 range and beyond, with NaN of both signs, infinities, values to
    saturate and values to flush planted (storable in float16 too)."""
    rows = rng.standard_normal((n, num_kv_heads, head_size)) * np.exp2(
        rng.uniform(-12, 8, (n, num_kv_heads, 1)))
    if specials:
        flat = rows.reshape(-1)
        picks = rng.choice(flat.size, min(flat.size, 8), replace=False)
        flat[picks] = [np.nan, -np.nan, np.inf, -np.inf, 6e4, -6e4, 1e-7, -1e-7][:len(picks)]
    return rows.astype(DTYPES[dtype])


def codes(array):
    return cupa.arrays.to_host(array)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", FORMATS)
def test_fp8_write_kernel_matches_host(rng, name, dtype, head_size, block_size):
    gpu, host = twin_caches(rng, name, dtype, head_size, block_size)
    padded, rows = write_twins(rng, gpu, host, head_size, dtype, make_rows=random_rows)
    keep = padded >= 0
    used = padded[keep]
    blocks, offsets = used // block_size, used % block_size
    for layer, (k, v) in enumerate(rows):  # directly against quantize_fp8, per-head scales
        np.testing.assert_array_equal(codes(gpu.key_cache(layer))[blocks, :, offsets],
                                      quantize_fp8(k[keep], name, gpu.k_scale[:, None]))
        np.testing.assert_array_equal(codes(gpu.value_cache(layer))[blocks, :, offsets],
                                      quantize_fp8(v[keep], name, gpu.v_scale[:, None]))
    for layer in range(2):  # and everywhere, untouched slots included
        np.testing.assert_array_equal(codes(gpu.key_cache(layer)), host.key_cache(layer))
        np.testing.assert_array_equal(codes(gpu.value_cache(layer)), host.value_cache(layer))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("name", FORMATS)
def test_fp8_write_strided_rows_and_device_slots_past_cache(rng, name, dtype):
    import cupy
    gpu, host = twin_caches(rng, name, dtype, 128, 16)
    slots = gpu.extend([0], 20)
    host.extend([0], 20)
    fused = cupy.asarray(random_rows(rng, 20, 6, 128, dtype))
    k, v = fused[:, 2:4], fused[:, 4:6]  # views of a fused QKV projection
    gpu.write(0, slots, k, v)
    host.write(0, slots, cupy.asnumpy(k), cupy.asnumpy(v))
    np.testing.assert_array_equal(codes(gpu.key_cache(0)), host.key_cache(0))
    np.testing.assert_array_equal(codes(gpu.value_cache(0)), host.value_cache(0))
    # Device slots are not checked on the host; the kernel skips those past the cache.
    before = codes(gpu.key_cache(1)).copy()
    bad = cupy.asarray(np.array([10**9, 40 * 16], np.int64))
    gpu.write(1, bad, k[:2], v[:2])
    np.testing.assert_array_equal(codes(gpu.key_cache(1)), before)


@pytest.mark.parametrize("name", FORMATS)
def test_fp8_copy_on_write_and_swap_on_device(rng, name):
    gpu, host = twin_caches(rng, name, "bfloat16", 64, 16, num_blocks=12)
    seed = int(rng.integers(2**31))
    for cache in (gpu, host):
        rows_rng = np.random.default_rng(seed)
        slots = cache.extend([0], 21)
        for layer in range(2):
            rows = random_rows(rows_rng, 21, 2, 64, "bfloat16")
            cache.write(layer, slots, rows, -rows)
        cache.fork(0, 1)
        slots = cache.extend([1], 3)  # copies the shared partial block in both layers
        for layer in range(2):
            rows = random_rows(rows_rng, 3, 2, 64, "bfloat16")
            cache.write(layer, slots, rows, rows)
        cache.swap_out(0)
        cache.extend([2], 60)
        cache.free(2)
        cache.swap_in(0)
    for layer in range(2):
        for s in (0, 1):
            assert np.array_equal(gpu.block_table(s), host.block_table(s))
            table = gpu.block_table(s)
            np.testing.assert_array_equal(codes(gpu.key_cache(layer))[table],
                                          host.key_cache(layer)[table])
            np.testing.assert_array_equal(codes(gpu.value_cache(layer))[table],
                                          host.value_cache(layer)[table])


# --- (c) the cupy path of the conversions -------------------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
def test_cupy_conversions_equal_numpy(rng, name):
    import cupy
    x = np.concatenate([special_values(name), random_floats(rng, 200_000)])
    got = quantize_fp8(cupy.asarray(x), name, 0.37)
    assert isinstance(got, cupy.ndarray) and got.dtype == np.uint8
    np.testing.assert_array_equal(got.get(), quantize_fp8(x, name, 0.37))
    with np.errstate(over="ignore"):
        half = x.astype(np.float16)
    np.testing.assert_array_equal(quantize_fp8(cupy.asarray(half), name).get(),
                                  quantize_fp8(half, name))
    rows = (rng.standard_normal((9, 4, 32)) * 30).astype(np.float32)
    per_head = rng.uniform(0.05, 2, 4).astype(np.float32)
    for scale in (per_head[:, None], cupy.asarray(per_head[:, None])):
        np.testing.assert_array_equal(quantize_fp8(cupy.asarray(rows), name, scale).get(),
                                      quantize_fp8(rows, name, per_head[:, None]))
    all_codes = rng.integers(0, 256, (9, 4, 32)).astype(np.uint8)
    back = dequantize_fp8(cupy.asarray(all_codes), name, per_head[:, None])
    assert isinstance(back, cupy.ndarray) and back.dtype == np.float32
    want = dequantize_fp8(all_codes, name, per_head[:, None])
    # Bit for bit except NaN payloads, which a multiply may canonicalise.
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(back.get()), nan)
    np.testing.assert_array_equal(back.get()[~nan].view(np.uint32), want[~nan].view(np.uint32))
    np.testing.assert_array_equal(dequantize_fp8(cupy.asarray(all_codes), name).get().view(
        np.uint32), dequantize_fp8(all_codes, name).view(np.uint32))  # no multiply: exact NaNs


# --- decode through an fp8 cache ----------------------------------------------------------------

@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", FORMATS)
def test_decode_through_fp8_cache_matches_reference(rng, name, dtype, group):
    import cupy
    head_size, block_size, kv_heads = 128, 16, 2
    k_scale = rng.uniform(0.01, 0.05, kv_heads).astype(np.float32)
    cache = cupa.PagedKVCache(1, 400, block_size, kv_heads, head_size, dtype, backend="gpu",
                              kv_format=name, k_scale=k_scale, v_scale=0.02)
    seq_ids = ["a", "b", "c", "d"]
    slots = cache.extend(seq_ids, [1, 17, 300, 1031])
    shape = (len(slots), kv_heads, head_size)
    cache.write(0, slots, rng.standard_normal(shape).astype(DTYPES[dtype]),
                rng.standard_normal(shape).astype(DTYPES[dtype]))
    query = cupy.asarray((rng.standard_normal((4, kv_heads * group, head_size))
                          ).astype(DTYPES[dtype]))
    out = cache.decode(0, query, seq_ids)
    tables, lens = (cupy.asnumpy(x) for x in cache.tables(seq_ids))
    keys = dequantize_fp8(codes(cache.key_cache(0)), name, cache.k_scale[:, None, None])
    values = dequantize_fp8(codes(cache.value_cache(0)), name, cache.v_scale[:, None, None])
    ref, _ = paged_decode_reference(cupy.asnumpy(query), keys, values, tables, lens)
    err = rel_error(cupy.asnumpy(out), ref)
    assert err <= REL_BOUND[dtype], f"rel error {err:.3g}"
