"""Kernel launches with driver launch attributes (sm_90): the reduce as a programmatic dependent
of phase 1, and phase 1 as thread-block clusters.

The reduce pass follows phase 1 on the same stream. Launched the ordinary way it starts only
after phase 1 has drained, and that gap plus its own setup cost ~4-5 us a call on the H200
(docs/perf-log.md, v10) - a quarter of a 1 x 4096 decode. With the launch attribute "programmatic
stream serialization" the reduce's workgroups may start as soon as every phase-1 workgroup has
executed `griddepcontrol.launch_dependents`; each waits in `griddepcontrol.wait` (after its own
setup) until phase 1 has completed and its writes are visible (decode_common.cuh).

With the "cluster dimension" attribute, the partitions of a (sequence, KV head) run as one
cluster and merge through distributed shared memory, with no reduce at all (merge_cluster in
decode_mma.cu; docs/perf-log.md v14).

cupy has no launch with attributes, so this calls the driver's cuLaunchKernelEx through ctypes
with the kernel handle cupy compiled; graph capture records these launches like any other.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
PORTABLE_CLUSTER = 8  # the largest cluster every sm_90 part runs without opting in


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attributes", ctypes.POINTER(_LaunchAttribute)), ("count", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver():
    """The driver library, or None where it or cuLaunchKernelEx is missing (driver < 12.0)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        launch = driver.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                       ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    driver.cuFuncSetAttribute.restype = ctypes.c_int
    driver.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return driver


def _launch_kernel_ex():
    driver = _driver()
    return driver.cuLaunchKernelEx if driver is not None else None


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


def _launch(kernel, grid: tuple, block: tuple, args: tuple, stream_ptr: int,
            attributes: list, shared_bytes: int = 0) -> None:
    values = [_argument(a) for a in args]
    pointers = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    table = (_LaunchAttribute * len(attributes))(*attributes)
    config = _LaunchConfig(grid=(ctypes.c_uint * 3)(*grid), block=(ctypes.c_uint * 3)(*block),
                           shared_bytes=shared_bytes, stream=stream_ptr, attributes=table,
                           count=len(attributes))
    status = _launch_kernel_ex()(ctypes.byref(config), kernel.kernel.ptr, pointers, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {status}) for {kernel.name}")


def launch_dependent(kernel, grid: tuple, block: tuple, args: tuple, stream_ptr: int) -> None:
    """Launch cupy RawKernel `kernel` on the stream at `stream_ptr`, allowed to start before the
    stream's previous kernel has finished (the kernel must wait for it: griddepcontrol.wait)."""
    attribute = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attribute.value[0] = 1
    _launch(kernel, grid, block, args, stream_ptr, [attribute])


_non_portable = set()  # kernel handles allowed clusters above PORTABLE_CLUSTER


def launch_clustered(kernel, grid: tuple, block: tuple, args: tuple, stream_ptr: int, *,
                     cluster: tuple, shared_bytes: int) -> None:
    """Launch `kernel` in thread-block clusters of `cluster` (x, y, z) blocks, which must divide
    `grid`; a kernel in clusters larger than 8 opts in to non-portable sizes first."""
    if _driver() is None:
        raise RuntimeError("cluster launch: the CUDA driver has no cuLaunchKernelEx (driver >= "
                           "12.0 needed); set CUPA_MERGE=reduce")
    size = cluster[0] * cluster[1] * cluster[2]
    handle = kernel.kernel.ptr
    if size > PORTABLE_CLUSTER and handle not in _non_portable:
        status = _driver().cuFuncSetAttribute(handle, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
        if status != 0:
            raise RuntimeError(f"cuFuncSetAttribute failed (CUresult {status}) for {kernel.name}")
        _non_portable.add(handle)
    attribute = _LaunchAttribute(id=_CLUSTER_DIMENSION)
    attribute.value[0], attribute.value[1], attribute.value[2] = cluster
    _launch(kernel, grid, block, args, stream_ptr, [attribute], shared_bytes)
