"""Launching a kernel as a programmatic dependent of the previous one on its stream (sm_90).

The reduce pass follows phase 1 on the same stream. Launched the ordinary way it starts only
after phase 1 has drained, and that gap plus its own setup cost ~4-5 us a call on the H200
(docs/perf.md, v10) - a quarter of a 1 x 4096 decode. With the launch attribute "programmatic
stream serialization" the reduce's workgroups may start as soon as every phase-1 workgroup has
executed `griddepcontrol.launch_dependents`; each waits in `griddepcontrol.wait` (after its own
setup) until phase 1 has completed and its writes are visible (decode_common.cuh).

cupy has no launch with attributes, so this calls the driver's cuLaunchKernelEx through ctypes
with the kernel handle cupy compiled; graph capture records the dependency like any launch.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attributes", ctypes.POINTER(_LaunchAttribute)), ("count", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _launch_kernel_ex():
    """cuLaunchKernelEx from the driver, or None where it is missing (driver < 12.0)."""
    try:
        launch = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return launch


def available() -> bool:
    return _launch_kernel_ex() is not None


def _argument(value):
    """A ctypes copy of one kernel argument as cupa passes them: cupy arrays (their device
    pointer), np.uint64 null pointers, np.int32 and np.float32 scalars."""
    # Scalars first: they are most of the arguments, and asking a numpy scalar for `.data`
    # builds a memoryview.
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    if isinstance(value, np.uint64):
        return ctypes.c_uint64(int(value))
    if hasattr(value, "data") and hasattr(value.data, "ptr"):
        return ctypes.c_uint64(value.data.ptr)
    raise TypeError(f"chained launch: unsupported kernel argument {type(value).__name__}")


def launch_dependent(kernel, grid: tuple, block: tuple, args: tuple, stream_ptr: int) -> None:
    """Launch cupy RawKernel `kernel` on the stream at `stream_ptr`, allowed to start before the
    stream's previous kernel has finished (the kernel must wait for it: griddepcontrol.wait)."""
    values = [_argument(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1
    config = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block),
                           shared_bytes=0, stream=stream_ptr,
                           attributes=ctypes.pointer(attribute), count=1)
    status = _launch_kernel_ex()(ctypes.byref(config), kernel.kernel.ptr, pointers, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {status}) for {kernel.name}")
