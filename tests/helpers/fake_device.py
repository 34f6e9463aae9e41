"""A stand-in for cupy where no GPU is: just what PagedKVCache.write and its launch read of device
arrays (shape, strides, dtype, flags, data.ptr), over host memory. For CPU tests and timings of
host-side logic (tests/unit/test_cache_write_repeat.py, tools/cache_host_cpu.py); nothing runs
on a device, so pointers are host addresses and no kernel reads them."""

from __future__ import annotations

import types

import numpy as np


class FakeDeviceArray:
    """What write reads of a cupy.ndarray, over host memory (pointers are host addresses)."""

    def __init__(self, host: np.ndarray):
        self.host = host
        self.data = types.SimpleNamespace(ptr=host.ctypes.data)

    shape = property(lambda self: self.host.shape)
    strides = property(lambda self: self.host.strides)
    dtype = property(lambda self: self.host.dtype)
    itemsize = property(lambda self: self.host.itemsize)
    ndim = property(lambda self: self.host.ndim)
    flags = property(lambda self: self.host.flags)

    def __len__(self):
        return len(self.host)

    def __getitem__(self, index):
        return FakeDeviceArray(self.host[index])

    def reshape(self, *shape):
        return FakeDeviceArray(self.host.reshape(*shape))


def fake_cupy(stream_ptr: int):
    """A module with what PagedKVCache's GPU write asks of cupy: FakeDeviceArray as its
    ndarray, ascontiguousarray, and a current stream of pointer `stream_ptr`."""
    def ascontiguousarray(x, dtype=None):
        return FakeDeviceArray(np.ascontiguousarray(x.host, dtype=dtype))

    stream = types.SimpleNamespace(ptr=stream_ptr)
    return types.SimpleNamespace(
        ndarray=FakeDeviceArray, ascontiguousarray=ascontiguousarray,
        cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
