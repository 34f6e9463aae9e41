"""The GPU backend's table uploads (`PagedKVCache.tables`), with a stand-in for cupy: two pinned
host buffers take turns, so a call waits only for the upload of the call before last, and every
upload carries the call's own [lens | tables]."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from cupa import arrays
from cupa.cache.paged import _TableBuffers

from fake_device import FakeDeviceArray


class Log(list):
    """What the stand-in device did, in order: ("copy", host address, values copied),
    ("record", event), ("wait", event)."""


def recording_cupy(log: Log):
    class Event:
        def __init__(self, **_):
            self.recorded = 0

        def record(self, stream):
            self.recorded += 1
            log.append(("record", self))

        def synchronize(self):
            assert self.recorded, "waited on an event never recorded"
            log.append(("wait", self))

    def device_empty(n, dtype):
        array = FakeDeviceArray(np.full(n, -7, dtype))

        def copy(source, nbytes, stream):
            ctypes.memmove(array.host.ctypes.data, source, nbytes)
            log.append(("copy", source, array.host[:nbytes // 4].copy()))

        array.data.copy_from_host_async = copy
        return array

    stream = types.SimpleNamespace(ptr=0)
    return types.SimpleNamespace(
        empty=device_empty,
        cuda=types.SimpleNamespace(Event=Event, get_current_stream=lambda: stream))


@pytest.fixture
def uploads(monkeypatch):
    log = Log()
    monkeypatch.setattr(arrays, "cupy_module", lambda: recording_cupy(log))
    return _TableBuffers(on_gpu=True), log


def fill_and_publish(buffers, rows, width, rng):
    packed = rng.integers(0, 1 << 20, rows + rows * width, dtype=np.int32)
    host = buffers.host_buffer(len(packed))
    host[:len(packed)] = packed
    tables, lens = buffers.publish(rows, width)
    return packed, host.ctypes.data, tables, lens


def test_each_call_waits_for_the_upload_of_the_call_before_last(uploads, rng):
    buffers, log = uploads
    hosts, events = [], []
    for call, (rows, width) in enumerate([(4, 3)] * 3 + [(8, 40)] * 3):  # then grown
        start = len(log)
        packed, host, tables, lens = fill_and_publish(buffers, rows, width, rng)
        steps = log[start:]
        waits = [s[1] for s in steps if s[0] == "wait"]
        copies = [s for s in steps if s[0] == "copy"]
        records = [s[1] for s in steps if s[0] == "record"]
        assert len(copies) == 1 and len(records) == 1, steps
        assert copies[0][1] == host  # from this call's host buffer ...
        np.testing.assert_array_equal(copies[0][2], packed)  # ... this call's values
        np.testing.assert_array_equal(lens.host, packed[:rows])
        np.testing.assert_array_equal(tables.host, packed[rows:].reshape(rows, width))
        # The wait comes before the buffer is refilled, on the event of the call before last.
        assert waits == ([] if call < 2 else [events[call - 2]]), (call, steps)
        assert not waits or steps.index(("wait", waits[0])) < steps.index(copies[0])
        if call >= 2 and call not in (3, 4):  # calls 3 and 4 grew the two buffers
            assert host == hosts[call - 2]
        if call >= 1:
            assert host != hosts[call - 1]
        hosts.append(host)
        events.append(records[0])
    assert len({id(e) for e in events}) == 2  # one event per host buffer, kept


def test_the_numpy_backend_keeps_one_host_buffer(rng):
    buffers = _TableBuffers(on_gpu=False)
    _, first, tables, lens = fill_and_publish(buffers, 3, 2, rng)
    packed, second, tables, lens = fill_and_publish(buffers, 3, 2, rng)
    assert first == second and tables.base is not None
    np.testing.assert_array_equal(tables, packed[3:].reshape(3, 2))
