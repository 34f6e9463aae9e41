"""PagedKVCache on the GPU: the write kernel bit-exact against the numpy write, copy-on-write and
swap on the device, and decode through the cache against the float64 reference. Skips without
a GPU; runs unchanged on CUDA and ROCm."""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.arrays import gpu_available
from cupa.reference import paged_decode_reference

from cases import DTYPES, REL_BOUND, rel_error

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")


def bits(array):
    """Raw bits of a host or device array, for bit-exact comparisons (NaN == NaN)."""
    host = cupa.arrays.to_host(array)
    return host.view({2: np.uint16, 4: np.uint32}[host.dtype.itemsize])


def blocks_of(cache, layer, seq_id, values=False):
    """Bits of a sequence's blocks (one layer, K or V), on the host."""
    storage = cache.value_cache(layer) if values else cache.key_cache(layer)
    table = cache.block_table(seq_id)
    if cache.backend == "gpu":
        table = cupa.arrays.cupy_module().asarray(table)
    return bits(storage[table])


def twin_caches(dtype, head_size, block_size, num_kv_heads=2, num_blocks=40, layers=2):
    """The same cache on the GPU and on numpy."""
    args = (layers, num_blocks, block_size, num_kv_heads, head_size, dtype)
    return cupa.PagedKVCache(*args, backend="gpu"), cupa.PagedKVCache(*args, backend="numpy")


def random_rows(rng, n, num_kv_heads, head_size, dtype):
    rows = rng.standard_normal((n, num_kv_heads, head_size)) * 3
    return rows.astype(DTYPES[dtype])


def write_twins(rng, gpu, host, head_size, dtype, make_rows=None):
    """Reserve four sequences in both caches and write random rows of two layers, with padding
    tokens interleaved in shuffled order (a slot's position in the batch is free). The GPU write
    takes numpy inputs for layer 0 (uploaded by write) and int32 device slots for layer 1.
    make_rows(rng, n, num_kv_heads, head_size, dtype) draws the rows (default random_rows).
    Returns the padded slots and each layer's (K, V) rows."""
    import cupy
    make_rows = make_rows or random_rows
    block_size = gpu.block_size
    lengths = [1, block_size - 1, 3 * block_size + 5, int(rng.integers(1, 200))]
    seq_ids = list(range(len(lengths)))
    slots = gpu.extend(seq_ids, lengths)
    assert np.array_equal(slots, host.extend(seq_ids, lengths))
    padded = np.concatenate([slots, -np.ones(7, np.int64)])
    padded = padded[rng.permutation(len(padded))]
    rows = []
    for layer in range(2):
        k = make_rows(rng, len(padded), 2, head_size, dtype)
        v = make_rows(rng, len(padded), 2, head_size, dtype)
        host.write(layer, padded, k, v)
        if layer == 0:
            gpu.write(layer, padded, k, v)
        else:
            gpu.write(layer, cupy.asarray(padded.astype(np.int32)), cupy.asarray(k),
                      cupy.asarray(v))
        rows.append((k, v))
    return padded, rows


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 192, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_write_kernel_matches_numpy(rng, dtype, head_size, block_size):
    gpu, host = twin_caches(dtype, head_size, block_size)
    write_twins(rng, gpu, host, head_size, dtype)
    for layer in range(2):
        np.testing.assert_array_equal(bits(gpu.key_cache(layer)), bits(host.key_cache(layer)))
        np.testing.assert_array_equal(bits(gpu.value_cache(layer)),
                                      bits(host.value_cache(layer)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_write_strided_rows_and_device_slots_past_cache(rng, dtype):
    import cupy
    gpu, host = twin_caches(dtype, 128, 16)
    slots = gpu.extend([0], 20)
    host.extend([0], 20)
    fused = cupy.asarray(rng.standard_normal((20, 6, 128)).astype(DTYPES[dtype]))
    k, v = fused[:, 2:4], fused[:, 4:6]  # views of a fused QKV projection
    gpu.write(0, slots, k, v)
    host.write(0, slots, cupy.asnumpy(k), cupy.asnumpy(v))
    np.testing.assert_array_equal(bits(gpu.key_cache(0)), bits(host.key_cache(0)))
    np.testing.assert_array_equal(bits(gpu.value_cache(0)), bits(host.value_cache(0)))
    # Device slots are not checked on the host; the kernel skips those past the cache.
    before = bits(gpu.key_cache(1)).copy()
    bad = cupy.asarray(np.array([10**9, 40 * 16], np.int64))
    gpu.write(1, bad, k[:2], v[:2])
    np.testing.assert_array_equal(bits(gpu.key_cache(1)), before)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_copy_on_write_and_swap_on_device(rng, dtype):
    gpu, host = twin_caches(dtype, 64, 16, num_blocks=12)
    seed = int(rng.integers(2**31))  # the same rows for both caches
    for cache in (gpu, host):
        rng_copy = np.random.default_rng(seed)
        slots = cache.extend([0], 21)
        for layer in range(2):
            rows = random_rows(rng_copy, 21, 2, 64, dtype)
            cache.write(layer, slots, rows, -rows)
        cache.fork(0, 1)
        slots = cache.extend([1], 3)  # copies the shared partial block in both layers
        for layer in range(2):
            rows = random_rows(rng_copy, 3, 2, 64, dtype)
            cache.write(layer, slots, rows, rows)
        cache.swap_out(0)
        cache.extend([2], 60)  # take over the freed space meanwhile
        cache.free(2)
        cache.swap_in(0)
    for s in (0, 1):
        assert np.array_equal(gpu.block_table(s), host.block_table(s))
    for layer in range(2):
        for s in (0, 1):
            for values in (False, True):
                np.testing.assert_array_equal(blocks_of(gpu, layer, s, values),
                                              blocks_of(host, layer, s, values))
    keys_out = blocks_of(gpu, 1, 0)
    gpu.swap_out(0)
    gpu.swap_in(0)
    np.testing.assert_array_equal(blocks_of(gpu, 1, 0), keys_out)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_decode_through_cache_matches_reference(rng, dtype, group):
    import cupy
    head_size, block_size, kv_heads = 128, 16, 2
    cache = cupa.PagedKVCache(1, 400, block_size, kv_heads, head_size, dtype, backend="gpu")
    lengths = [1, 17, 300, 1031]
    seq_ids = ["a", "b", "c", "d"]
    slots = cache.extend(seq_ids, lengths)
    k = random_rows(rng, len(slots), kv_heads, head_size, dtype)
    v = random_rows(rng, len(slots), kv_heads, head_size, dtype)
    cache.write(0, slots, k, v)
    cache.fork("c", "e")
    seq_ids.append("e")
    for step in range(3):  # decode loop: append one token each, write, decode
        slots = cache.extend(seq_ids, 1)
        cache.write(0, cupy.asarray(slots), cupy.asarray(random_rows(rng, 5, 2, 128, dtype)),
                    cupy.asarray(random_rows(rng, 5, 2, 128, dtype)))
        query = cupy.asarray(random_rows(rng, 5, kv_heads * group, head_size, dtype))
        out = cupy.full(query.shape, np.nan, dtype=query.dtype)
        result = cache.decode(0, query, seq_ids, out=out)
        assert result is out
        tables, lens = (cupy.asnumpy(x) for x in cache.tables(seq_ids))
        ref, _ = paged_decode_reference(cupy.asnumpy(query), cupy.asnumpy(cache.key_cache(0)),
                                        cupy.asnumpy(cache.value_cache(0)), tables, lens)
        err = rel_error(cupy.asnumpy(out), ref)
        assert err <= REL_BOUND[dtype], f"step {step}: rel error {err:.3g}"
    host_out = cache.decode(0, cupy.asnumpy(query), seq_ids)
    assert isinstance(host_out, np.ndarray)


def test_tables_reuse_device_buffers(rng):
    import cupy
    cache = cupa.PagedKVCache(1, 64, 16, 1, 64, "float16", backend="gpu")
    cache.extend([0, 1], [40, 3])
    tables, lens = cache.tables([0, 1], max_blocks=8)
    assert isinstance(tables, cupy.ndarray) and tables.dtype == np.int32
    pointers = (tables.data.ptr, lens.data.ptr)
    for _ in range(5):
        cache.extend([0, 1], 1)
        tables, lens = cache.tables([0, 1], max_blocks=8)
        assert (tables.data.ptr, lens.data.ptr) == pointers
    np.testing.assert_array_equal(cupy.asnumpy(lens), [45, 8])
    np.testing.assert_array_equal(cupy.asnumpy(tables)[0, :3], cache.block_table(0))
    assert (cupy.asnumpy(tables)[1, 1:] == -1).all()
