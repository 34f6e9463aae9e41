"""PagedKVCache.write's repeat path on the GPU backend, checked on the CPU with a stand-in for
cupy: a write of device arrays laid out like the previous one skips the checks and launches the
kept PreparedLaunch. It must launch exactly what the full path launches (same launch, same
pointers, same stream), fall back to the full path for anything else (a misaligned row, other
dtypes or shapes, host slots, int32 slots, a bad layer) and raise the same errors.

The kernel itself is not run here (tests/gpu/test_gpu_cache.py runs it): the launch records
its arguments.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa import arrays

from fake_device import FakeDeviceArray, fake_cupy

HEADS, HEAD_SIZE, BLOCK_SIZE = 2, 64, 8


class RecordingWriteLaunch:
    """CacheWriteLaunch's interface; its launches append what they were called with, the
    storage pointers as offsets into the cache's K and V (two caches compare alike)."""

    def __init__(self, log: list, keys_ptr: int, values_ptr: int):
        self.log, self.prepared_for = log, {}
        self.bases = (0, 0, keys_ptr, values_ptr, 0)

    def prepared(self, row_strides, num_tokens, fp8_tail=()):
        key = (num_tokens, row_strides, fp8_tail)
        if key not in self.prepared_for:
            self.prepared_for[key] = lambda pointers, stream: self.log.append(
                (key, tuple(p - base for p, base in zip(pointers, self.bases)), stream))
        return self.prepared_for[key]


def gpu_cache_on_the_cpu(log: list):
    """A float16 cache whose storage and launches are fakes of the GPU backend's."""
    cache = cupa.PagedKVCache(3, 16, BLOCK_SIZE, HEADS, HEAD_SIZE, "float16", backend="numpy")
    cache.backend = "gpu"
    cache._keys, cache._values = FakeDeviceArray(cache._keys), FakeDeviceArray(cache._values)
    cache._write_launch = RecordingWriteLaunch(log, cache._keys.data.ptr,
                                               cache._values.data.ptr)
    return cache


def qkv_rows(rng, tokens, offset=0):
    """k, v: strided views of one fused [tokens, 3 heads-worth] buffer, as a model's QKV
    split gives them (offset elements shift the whole buffer: misaligned rows)."""
    flat = rng.standard_normal(offset + tokens * 2 * HEADS * HEAD_SIZE).astype(np.float16)
    kv = flat[offset:].reshape(tokens, 2 * HEADS, HEAD_SIZE)
    return FakeDeviceArray(kv[:, :HEADS]), FakeDeviceArray(kv[:, HEADS:])


def device_slots(cache, tokens, dtype=np.int64):
    return FakeDeviceArray(cache.extend(list(range(tokens)), 1).astype(dtype))


def test_a_repeat_write_launches_what_the_full_path_launches(monkeypatch):
    cupy = fake_cupy(stream_ptr=0x5EA)
    monkeypatch.setattr(arrays, "cupy_module", lambda: cupy)
    rng = np.random.default_rng(0)
    fast_log, full_log = [], []
    fast, full = gpu_cache_on_the_cpu(fast_log), gpu_cache_on_the_cpu(full_log)
    for cache in (fast, full):
        cache.extend(list(range(4)), 3)

    def write_both(layer, slots, key, value):
        outcomes = []
        for cache in (fast, full):
            full._repeat_write = None  # the full path every time
            try:
                cache.write(layer, slots, key, value)
                outcomes.append(None)
            except (ValueError, TypeError) as exc:
                outcomes.append((type(exc), str(exc)))
        assert outcomes[0] == outcomes[1]
        assert fast_log == full_log
        return outcomes[0]

    checked = []
    check_rows = fast._check_rows
    fast._check_rows = lambda *args: checked.append(args) or check_rows(*args)
    slots = device_slots(fast, 4)
    device_slots(full, 4)
    for layer in (0, 1, 2, 1):  # every layer's rows: new arrays of one layout
        write_both(layer, slots, *qkv_rows(rng, 4))
    kept = fast._repeat_write
    assert kept is not None and len(fast_log) == 4
    assert len(checked) == 1  # the first write only: the others took the repeat path
    write_both(0, slots, *qkv_rows(rng, 4, offset=3))  # misaligned: copied, full path
    write_both(1, slots, *qkv_rows(rng, 4))
    assert fast._repeat_write is kept
    # int32 slots are converted (full path); the kept layout is not theirs.
    write_both(2, FakeDeviceArray(slots.host.astype(np.int32)), *qkv_rows(rng, 4))
    # Host slots are checked against the reservations (not the reserved slots: refused).
    bad_host = np.arange(4, dtype=np.int64) + 100
    assert "not reserved" in write_both(0, bad_host, *qkv_rows(rng, 4))[1]
    k, v = qkv_rows(rng, 4)
    for layer in (3, -1, True, 1.0):
        assert write_both(layer, slots, k, v)[0] is ValueError
    k32 = FakeDeviceArray(k.host.astype(np.float32))
    assert "dtype" in write_both(0, slots, k32, k32)[1]
    assert "shape" in write_both(0, slots, k, FakeDeviceArray(v.host[:3]))[1]
    assert "slots" in write_both(0, slots[:3], k, v)[1]
    assert fast._repeat_write is kept
    # Fewer tokens: another layout, kept in turn.
    write_both(0, slots[:2], *qkv_rows(rng, 2))
    assert fast._repeat_write is not kept
    assert len(fast_log) == 8


def test_the_numpy_backend_keeps_no_repeat_write():
    cache = cupa.PagedKVCache(1, 8, BLOCK_SIZE, HEADS, HEAD_SIZE, "float16", backend="numpy")
    slots = cache.extend([0], 2)
    rows = np.ones((2, HEADS, HEAD_SIZE), np.float16)
    cache.write(0, slots, rows, rows)
    assert cache._repeat_write is None
    with pytest.raises(ValueError, match="not reserved"):
        cache.write(0, slots + 2, rows, rows)
