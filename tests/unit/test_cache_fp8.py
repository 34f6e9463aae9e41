"""PagedKVCache with an fp8 kv_format on the numpy backend: writes store quantize_fp8 codes with
per-head scales, block copies (copy-on-write, swap, prefix reuse) keep the codes, argument checks,
and decode through the cache against the float64 reference on the dequantised cache."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupa
from cupa.fp8 import FP8_FORMATS, dequantize_fp8, quantize_fp8
from cases import REL_BOUND, Case, rel_error
from test_reference import dense_attention

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
FORMATS = list(FP8_FORMATS)
HEADS, HEAD_SIZE = 3, 64



def fp8_cache(rng, name, dtype="float16", num_blocks=24, block_size=8, prefix=False, layers=2,
              head_size=HEAD_SIZE):
    k_scale = rng.uniform(0.02, 0.2, HEADS).astype(np.float32)
    return cupa.PagedKVCache(layers, num_blocks, block_size, HEADS, head_size, dtype,
                             backend="numpy", enable_prefix_caching=prefix, kv_format=name,
                             k_scale=k_scale, v_scale=float(rng.uniform(0.02, 0.2)))


def random_rows(rng, n, dtype, head_size=HEAD_SIZE, specials=False):
    rows = rng.standard_normal((n, HEADS, head_size)) * 4
    if specials and n:  # saturation, NaN and underflow go through the cache too
        flat = rows.reshape(-1)
        picks = rng.choice(flat.size, 6, replace=False)
        flat[picks] = [6e4, -6e4, np.inf, -np.inf, np.nan, 1e-9]
    return rows.astype(DTYPES[dtype])


def stored_rows(cache, layer, slots, values=False):
    """Codes at `slots` [tokens, heads, head_size] (padding slots skipped)."""
    storage = cache.value_cache(layer) if values else cache.key_cache(layer)
    slots = slots[slots >= 0]
    return storage[slots // cache.block_size, :, slots % cache.block_size]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", FORMATS)
def test_write_stores_codes_with_per_head_scales(rng, name, dtype):
    cache = fp8_cache(rng, name, dtype)
    assert cache.kv_format == name
    assert cache.key_cache(0).dtype == np.uint8 and cache.key_cache(0).shape == (24, HEADS, 8,
                                                                                 HEAD_SIZE)
    assert cache.k_scale.dtype == np.float32 and cache.k_scale.shape == (HEADS,)
    assert cache.v_scale.tolist() == [cache.v_scale[0]] * HEADS
    with pytest.raises(ValueError):
        cache.k_scale[0] = 1.0  # read-only: the scales are fixed for the cache's life
    slots = cache.extend(["a", "b"], [13, 5])
    padded = np.concatenate([slots[:4], [-1, -7], slots[4:]])
    for layer in range(2):
        k = random_rows(rng, len(padded), dtype, specials=True)
        v = random_rows(rng, len(padded), dtype, specials=True)
        cache.write(layer, padded, k, v)
        keep = padded >= 0
        want_k = quantize_fp8(k[keep], name, cache.k_scale[:, None])
        want_v = quantize_fp8(v[keep], name, cache.v_scale[:, None])
        np.testing.assert_array_equal(stored_rows(cache, layer, padded), want_k)
        np.testing.assert_array_equal(stored_rows(cache, layer, padded, values=True), want_v)
        # Per head: each head's codes use that head's scale.
        for h in range(HEADS):
            np.testing.assert_array_equal(want_k[:, h],
                                          quantize_fp8(k[keep][:, h], name, cache.k_scale[h]))
    # Strided rows (views of a fused projection) are accepted.
    slots = cache.extend(["c"], 4)
    fused = random_rows(rng, 4, dtype, head_size=3 * HEAD_SIZE)
    k, v = fused[..., HEAD_SIZE:2 * HEAD_SIZE], fused[..., 2 * HEAD_SIZE:]
    cache.write(0, slots, k, v)
    np.testing.assert_array_equal(stored_rows(cache, 0, slots),
                                  quantize_fp8(k, name, cache.k_scale[:, None]))


@pytest.mark.parametrize("name", FORMATS)
def test_copies_keep_codes(rng, name):
    """Copy-on-write, swap and prefix reuse move raw codes."""
    cache = fp8_cache(rng, name, "bfloat16", num_blocks=12, prefix=True)
    prompt = list(range(19))
    slots = cache.extend(["a"], 19, token_ids=[prompt])
    for layer in range(2):
        cache.write(layer, slots, random_rows(rng, 19, "bfloat16", specials=True),
                    random_rows(rng, 19, "bfloat16", specials=True))
    blocks = lambda seq, layer, values=False: (  # noqa: E731
        (cache.value_cache(layer) if values else cache.key_cache(layer))[
            cache.block_table(seq)].copy())
    before = {(layer, values): blocks("a", layer, values) for layer in range(2)
              for values in (False, True)}
    cache.fork("a", "b")
    slots = cache.extend(["b"], 2, token_ids=[[7, 7]])  # copies the shared partial block
    assert cache.block_table("b")[2] != cache.block_table("a")[2]
    for (layer, values), codes in before.items():
        np.testing.assert_array_equal(blocks("b", layer, values)[:, :, :3], codes[:, :, :3])
        np.testing.assert_array_equal(blocks("a", layer, values), codes)
    cache.swap_out("a")
    cache.extend(["x"], 40)  # overwrite the freed space meanwhile
    cache.write(0, cache.extend(["x"], 0), random_rows(rng, 0, "bfloat16"),
                random_rows(rng, 0, "bfloat16"))
    cache.free("x")
    cache.swap_in("a")
    for (layer, values), codes in before.items():
        np.testing.assert_array_equal(blocks("a", layer, values), codes)
    slots = cache.extend(["c"], 17, token_ids=[prompt[:17]])  # reuses a's two full blocks
    assert cache.num_cached_tokens("c") == 16
    np.testing.assert_array_equal(cache.key_cache(1)[cache.block_table("c")[:2]],
                                  before[(1, False)][:2])


def test_constructor_checks(rng):
    make = lambda **kw: cupa.PagedKVCache(1, 4, 8, 2, kw.pop("head_size", 64),  # noqa: E731
                                          backend="numpy", **kw)
    with pytest.raises(ValueError, match="head_size"):
        make(head_size=72, kv_format="fp8_e4m3")  # 72 bytes: not a multiple of 16
    with pytest.raises(ValueError, match="head_size"):
        make(head_size=72)  # 144 bytes of float16, but not a head size decode serves
    make(head_size=80)
    with pytest.raises(ValueError, match="kv_format") as info:
        make(kv_format="fp8")
    assert "fp8_e4m3fnuz" in str(info.value)
    with pytest.raises(ValueError, match="k_scale"):
        make(k_scale=0.5)  # scales without an fp8 format
    for bad in (0.0, -1.0, np.nan, [1.0, 2.0, 3.0]):
        with pytest.raises(ValueError, match="v_scale"):
            make(kv_format="fp8_e4m3fnuz", v_scale=bad)
    plain = make(kv_format="float16")  # the dtype itself: a plain cache
    assert plain.kv_format is None and plain.k_scale is None
    fp8 = make(kv_format="fp8_e4m3", k_scale=np.array([1.0, 2.0]))
    assert fp8.key_cache(0).nbytes * 2 == plain.key_cache(0).nbytes  # half of float16's memory
    assert fp8.k_scale.tolist() == [1.0, 2.0] and fp8.v_scale.tolist() == [1.0, 1.0]
    q = np.ones((1, 4, 64), np.float16)
    fp8.extend([0], 3)
    for key in ("kv_format", "k_scale", "v_scale"):
        with pytest.raises(ValueError, match=key):
            fp8.decode(0, q, [0], **{key: None})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])  # cupa.decode's fp8 query dtypes
@pytest.mark.parametrize("name", FORMATS)
def test_decode_through_fp8_cache_matches_reference(rng, name, dtype):
    cache = fp8_cache(rng, name, dtype, num_blocks=40, layers=1, head_size=64)
    seq_ids = ["a", "b", "c"]
    slots = cache.extend(seq_ids, [1, 9, 70])
    cache.write(0, slots, random_rows(rng, len(slots), dtype, 64),
                random_rows(rng, len(slots), dtype, 64))
    query = (rng.standard_normal((3, 2 * HEADS, 64))).astype(DTYPES[dtype])
    out, lse = cache.decode(0, query, seq_ids, return_lse=True)
    tables, lens = cache.tables(seq_ids)
    keys = dequantize_fp8(cache.key_cache(0), name, cache.k_scale[:, None, None])
    values = dequantize_fp8(cache.value_cache(0), name, cache.v_scale[:, None, None])
    # The dense oracle, not cupa.reference: the numpy backend's decode is that.
    ref, ref_lse = dense_attention(Case(query, keys, values, tables, lens, None, 64 ** -0.5))
    assert rel_error(out, ref) <= REL_BOUND[dtype]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)
