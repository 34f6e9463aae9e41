"""Host cost of the KV cache's per-step calls, measured on the CPU (no GPU needed): the figures
`cupa.bench.host` takes on a GPU machine (extend + tables of 32 sequences, a 32-row write),
for comparing two versions of the code on one machine. Report ratios between versions: a CPU
here is not the GPU machine's host.

- extend(ids, 1) + tables(ids), 32 sequences of 512+ tokens: the numpy backend (the same
  bookkeeping as the GPU backend; tables() there adds one upload), plus the device calls one
  tables() makes on the GPU backend, counted with a stand-in for cupy.
- write(layer, slots, k, v) of 32 rows: the GPU backend's Python, with device arrays stood in
  for by tests/helpers/fake_device.py and the driver's launch call replaced by a no-op (the
  PreparedLaunch around it is real), so the figure is write's own cost above the launch.

    python3 tools/cache_host_cpu.py
"""
import sys
import time
import types
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "helpers"))

import cupa  # noqa: E402
from cupa import arrays  # noqa: E402
from cupa.bench.host import EXTEND_SEQS  # noqa: E402
from cupa.cache.paged import _TableBuffers  # noqa: E402
from cupa.gpu import driver, launch  # noqa: E402
from fake_device import FakeDeviceArray, fake_cupy  # noqa: E402

PROMPT, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 512, 16, 8, 128  # cupa.bench.host's problem


def best_us(make_call, calls: int, rounds: int = 15) -> float:
    """Microseconds per call, the best of `rounds` runs of `calls` calls, each run on a fresh
    call from make_call() (a fresh cache: steps then cross block boundaries as in a decode)."""
    best = float("inf")
    for _ in range(rounds):
        call = make_call()
        for _ in range(5):
            call()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def decode_cache(prefix_caching=False):
    cache = cupa.PagedKVCache(2, 4 * EXTEND_SEQS * 64, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                              "float16", backend="numpy", enable_prefix_caching=prefix_caching)
    ids = list(range(EXTEND_SEQS))
    cache.extend(ids, PROMPT, token_ids=[[i] * PROMPT for i in ids] if prefix_caching else None)
    return cache, ids


def step_calls():
    def extend_and_tables():
        cache, ids = decode_cache()

        def call():
            cache.extend(ids, 1)
            cache.tables(ids)
        return call

    def extend_only():
        cache, ids = decode_cache()
        return lambda: cache.extend(ids, 1)

    def tables_only():
        cache, ids = decode_cache()
        cache.extend(ids, 1)
        return lambda: cache.tables(ids)

    def extend_with_token_ids():
        cache, ids = decode_cache(prefix_caching=True)
        tokens = [[7]] * len(ids)
        return lambda: cache.extend(ids, 1, token_ids=tokens)

    return {"extend(ids, 1) + tables(ids)": extend_and_tables, "extend(ids, 1)": extend_only,
            "tables(ids)": tables_only,
            "extend(ids, 1, token_ids), prefix caching": extend_with_token_ids}


def tables_device_calls() -> Counter:
    """The device calls of one steady-state tables() on the GPU backend (a stand-in cupy
    counts them)."""
    calls = Counter()
    cache, ids = decode_cache()

    def device_array(n, dtype):
        array = FakeDeviceArray(np.empty(n, dtype))
        array.data.copy_from_host_async = lambda *args: calls.update(["copy_from_host_async"])
        return array

    class Event:
        def __init__(self, **_):
            pass

        synchronize = staticmethod(lambda: calls.update(["event.synchronize"]))
        record = staticmethod(lambda stream: calls.update(["event.record"]))

    stream = types.SimpleNamespace(ptr=0)
    fake = types.SimpleNamespace(empty=device_array, cuda=types.SimpleNamespace(
        Event=Event, get_current_stream=lambda: calls.update(["get_current_stream"]) or stream))
    real, arrays.cupy_module = arrays.cupy_module, lambda: fake
    try:
        cache._table_buffers = _TableBuffers(on_gpu=True)  # the GPU backend's two host buffers
        for _ in range(3):  # both host buffers at the steps' size, views made once
            cache.extend(ids, 1)  # 33 blocks each: the width of the steps below
            cache.tables(ids)
        calls.clear()
        cache.extend(ids, 1)
        cache.tables(ids)
    finally:
        arrays.cupy_module = real
    return calls


def write_call(same_arrays: bool):
    """A GPU-backend write of EXTEND_SEQS one-token rows on stand-in device arrays."""
    fake = fake_cupy(stream_ptr=7)
    arrays.cupy_module = lambda: fake
    driver.driver = lambda is_hip: driver.Driver(None, lambda *args: 0, None, None)
    cache = cupa.PagedKVCache(2, 4 * EXTEND_SEQS * 64, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                              "float16", backend="numpy")
    slots = cache.extend(list(range(EXTEND_SEQS)), PROMPT).reshape(EXTEND_SEQS, PROMPT)[:, -1]
    cache.backend = "gpu"
    cache._keys, cache._values = FakeDeviceArray(cache._keys), FakeDeviceArray(cache._values)
    writer = launch.CacheWriteLaunch.__new__(launch.CacheWriteLaunch)  # no kernel to compile
    writer.kernel = types.SimpleNamespace(name="write", kernel=types.SimpleNamespace(ptr=1))
    writer.is_hip, writer._prepared = False, {}
    writer.threads, writer.fixed = launch.cache_write_form(
        num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
        num_blocks=cache.num_blocks, storage_itemsize=2)
    cache._write_launch = writer
    device_slots = FakeDeviceArray(np.ascontiguousarray(slots))
    qkv = np.ones((EXTEND_SEQS, 3 * KV_HEADS, HEAD_SIZE), np.float16)

    def key_value():  # views of one projection's output, as a model's split gives them
        return (FakeDeviceArray(qkv[:, KV_HEADS:2 * KV_HEADS]),
                FakeDeviceArray(qkv[:, 2 * KV_HEADS:]))

    if same_arrays:
        rows = key_value()
        return lambda: cache.write(0, device_slots, *rows)
    first, second = key_value(), key_value()
    return lambda: (cache.write(0, device_slots, *first), cache.write(1, device_slots, *second))


def main():
    for name, make in step_calls().items():
        print(f"{name:>45}: {best_us(make, calls=200):6.1f} us")
    counted = tables_device_calls()
    print(f"{'device calls of one tables() (GPU backend)':>45}: "
          + ", ".join(f"{n} {call}" for call, n in sorted(counted.items())))
    real = arrays.cupy_module, driver.driver
    try:
        print(f"{'write, 32 rows, same arrays (no launch)':>45}: "
              f"{best_us(lambda: write_call(True), calls=2000):6.2f} us")
        print(f"{'write, 32 rows, 2 layers of new views (each)':>45}: "
              f"{best_us(lambda: write_call(False), calls=1000) / 2:6.2f} us")
    finally:
        arrays.cupy_module, driver.driver = real


if __name__ == "__main__":
    main()
