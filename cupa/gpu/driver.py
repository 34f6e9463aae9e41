"""Kernel launches through the GPU driver's own entry points (ctypes), with argument blocks packed
once.

Why not cupy's `RawKernel.__call__`: it converts every argument on every call, ~9-15 us for a
decode kernel's arguments (28 when measured) on an H200 host, which is most of a short decode. A
`PreparedLaunch` builds the argument block once; a call rewrites the pointer arguments (one
slice assignment) and makes one ctypes call. The same handle cupy compiled is launched:

- CUDA: `cuLaunchKernelEx` from libcuda for every launch, with its attributes where it has any
  (sm_90: the reduce as a programmatic dependent of phase 1, which may start before phase 1
  drains, and phase 1 as thread-block clusters merging in distributed shared memory;
  docs/perf-log.md v10, v14). Its arguments are ctypes objects made once and it has no
  `argtypes`, so ctypes converts nothing per call: converting them was 1-3 us of a launch's 5-10
  on an H200 host (docs/perf-log.md v26 step 2). Drivers older than 12.0 have no
  `cuLaunchKernelEx`; plain launches then use `cuLaunchKernel`. Graph capture records these
  launches like any other.
- HIP: `hipModuleLaunchKernel` from libamdhip64, whose signature is cuLaunchKernel's (written for
  ROCm, not run on AMD hardware). HIP has no launch attributes here: the planner never asks for
  clusters or chained launches on AMD targets. This "plain" call takes prebuilt ctypes
  arguments too (no `argtypes`), so it converts nothing per call either; on CUDA,
  `CUPA_LAUNCH=plain` sends every launch through cuLaunchKernel the same way, which is how the
  GPU tests run HIP's launch code on an NVIDIA device (launches that need attributes then
  refuse and say which switches to set).

Where the library or an entry point is missing, the launch falls back to cupy's call, and
`CUPA_LAUNCH=cupy` (read once) forces that.
"""

from __future__ import annotations

import ctypes
import functools
import os

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
PORTABLE_CLUSTER = 8  # the largest cluster every sm_90 part runs without opting in
LAUNCH_FORMS = ("driver", "plain", "cupy")  # CUPA_LAUNCH
LAUNCH_KINDS = ("plain", "dependent", "cluster", "cluster-dependent")  # PreparedLaunch's forms


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4),
                ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attributes", ctypes.POINTER(_LaunchAttribute)), ("count", ctypes.c_uint)]


class Driver:
    """The launch entry points of the loaded driver library (CUDA or HIP)."""

    def __init__(self, library, plain, extended, set_attribute):
        self.library = library
        self.plain = plain            # cuLaunchKernel / hipModuleLaunchKernel
        self.extended = extended      # cuLaunchKernelEx, or None (HIP, driver < 12.0)
        self.set_attribute = set_attribute


@functools.lru_cache(maxsize=None)
def driver(is_hip: bool) -> Driver | None:
    """The driver of this platform, or None where it cannot be loaded (or CUPA_LAUNCH=cupy).
    CUPA_LAUNCH=plain leaves out cuLaunchKernelEx (CUDA launches as HIP's are made)."""
    form = os.environ.get("CUPA_LAUNCH", "driver")
    if form not in LAUNCH_FORMS:
        raise ValueError(f"CUPA_LAUNCH: one of {LAUNCH_FORMS}, got {form!r}")
    if form == "cupy":
        return None
    names = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6") if is_hip \
        else ("libcuda.so.1", "libcuda.so")
    library = None
    for name in names:
        try:
            library = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if library is None:
        return None
    plain = getattr(library, "hipModuleLaunchKernel" if is_hip else "cuLaunchKernel", None)
    if plain is None:
        return None
    # No argtypes here either: PreparedLaunch passes ctypes objects made once (handle, grid,
    # block and shared bytes, a stream object it updates, the parameter array, None).
    plain.restype = ctypes.c_int
    extended = set_attribute = None
    if not is_hip:
        extended = None if form == "plain" else getattr(library, "cuLaunchKernelEx", None)
        if extended is not None:
            # No argtypes: PreparedLaunch passes (config by reference, handle as c_void_p, the
            # parameter array, None), all ctypes already, so a call converts nothing.
            extended.restype = ctypes.c_int
        set_attribute = library.cuFuncSetAttribute
        set_attribute.restype = ctypes.c_int
        set_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return Driver(library, plain, extended, set_attribute)


def _attribute(kind: int, values) -> _LaunchAttribute:
    attribute = _LaunchAttribute(id=kind)
    for i, v in enumerate(values):
        attribute.value[i] = v
    return attribute


def _scalar(value):
    """A ctypes copy of one scalar kernel argument (cupa passes np.int32 / np.int64 /
    np.float32 scalars; pass np types, since cupy does not type-check its arguments either)."""
    if isinstance(value, np.int32):
        return ctypes.c_int32(int(value))
    if isinstance(value, np.int64):
        return ctypes.c_int64(int(value))
    if isinstance(value, np.float32):
        return ctypes.c_float(float(value))
    raise TypeError(f"kernel launch: unsupported scalar argument {type(value).__name__} "
                    f"(pass np.int32, np.int64 or np.float32)")


class PreparedLaunch:
    """One kernel launch whose arguments are `pointers` device pointers followed by `scalars`,
    packed once. Calling it with the pointers (ints, 0 for null) and a stream launches.

    form: "plain", "dependent" (may start before the stream's previous kernel finishes; the
    kernel waits with griddepcontrol.wait), "cluster" (thread-block clusters of `cluster`) or
    "cluster-dependent" (both).
    """

    def __init__(self, kernel, grid, block, *, pointers: int, scalars: tuple, is_hip: bool,
                 shared_bytes: int = 0, form: str = "plain", cluster: tuple | None = None):
        self.kernel, self.grid, self.block = kernel, tuple(grid), tuple(block)
        self.shared_bytes, self.form = int(shared_bytes), form
        self._scalar_values = scalars
        self._driver = driver(is_hip)
        if form != "plain" and (self._driver is None or self._driver.extended is None):
            raise RuntimeError(f"{form} launch: no cuLaunchKernelEx (a CUDA driver >= 12.0 is "
                               f"needed, and CUPA_LAUNCH=plain leaves it out); set "
                               f"CUPA_MERGE=reduce, CUPA_CHAINED_REDUCE=0 and "
                               f"CUPA_CHAINED_PHASE1=0")
        self.pointers = (ctypes.c_uint64 * pointers)()
        self._scalars = [_scalar(v) for v in scalars]
        base = ctypes.addressof(self.pointers)
        addresses = [base + 8 * i for i in range(pointers)]
        addresses += [ctypes.addressof(s) for s in self._scalars]
        self._params = (ctypes.c_void_p * len(addresses))(*addresses)
        self._handle = kernel.kernel.ptr
        self._handle_arg = ctypes.c_void_p(self._handle)
        if form not in LAUNCH_KINDS:
            raise ValueError(f"launch form: one of {LAUNCH_KINDS}, got {form!r}")
        attributes = []
        if form.startswith("cluster"):
            self._opt_in_cluster(cluster)
            attributes.append(_attribute(_CLUSTER_DIMENSION, cluster))
        if form.endswith("dependent"):
            attributes.append(_attribute(_PROGRAMMATIC_STREAM_SERIALIZATION, (1,)))
        # Every CUDA launch goes through cuLaunchKernelEx where the driver has it (the module
        # docstring says why); _config is None for the others (HIP, drivers before 12.0).
        self._config = None
        if self._driver is not None and self._driver.extended is not None:
            self._attributes = (_LaunchAttribute * max(1, len(attributes)))(*attributes)
            self._config = _LaunchConfig(grid=(ctypes.c_uint * 3)(*self.grid),
                                         block=(ctypes.c_uint * 3)(*self.block),
                                         shared_bytes=self.shared_bytes, stream=None,
                                         attributes=self._attributes, count=len(attributes))
            self._config_ref = ctypes.byref(self._config)
        else:  # HIP's launch, or CUDA's before 12.0: cuLaunchKernel's argument list
            self._plain_head = (self._handle_arg,
                                *(ctypes.c_uint(d) for d in self.grid + self.block),
                                ctypes.c_uint(self.shared_bytes))
            self._stream_arg = ctypes.c_void_p()

    def _opt_in_cluster(self, cluster):
        if cluster[0] * cluster[1] * cluster[2] > PORTABLE_CLUSTER:
            status = self._driver.set_attribute(self._handle, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            if status != 0:
                raise RuntimeError(f"cuFuncSetAttribute failed (CUresult {status}) for "
                                   f"{self.kernel.name}")

    def __call__(self, pointers, stream_ptr: int) -> None:
        self.pointers[:] = pointers
        if self._driver is None:
            self._cupy_launch(pointers)
            return
        if self._config is not None:
            self._config.stream = stream_ptr
            status = self._driver.extended(self._config_ref, self._handle_arg, self._params, None)
        else:
            self._stream_arg.value = stream_ptr
            status = self._driver.plain(*self._plain_head, self._stream_arg, self._params, None)
        if status != 0:
            raise RuntimeError(f"kernel launch failed (driver status {status}) for "
                               f"{self.kernel.name}, grid {self.grid}, block {self.block}, "
                               f"{self.shared_bytes} bytes of dynamic shared memory")

    def _cupy_launch(self, pointers):
        """cupy's own launch, on the current stream (the caller's `with stream:`)."""
        args = tuple(np.uint64(p) for p in pointers) + tuple(self._scalar_values)
        self.kernel(self.grid, self.block, args, shared_mem=self.shared_bytes)
