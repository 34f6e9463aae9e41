"""The GPU platform and its BLAS: a matmul that can be recorded in a CUDA / HIP graph (ctypes).

cupy refuses every cuBLAS call while a stream is capturing (its wrappers raise
NotImplementedError before setting the stream), although cuBLAS itself supports stream capture.
So the graph-captured decode step calls the GEMM directly: on its own handle, bound once
(outside any capture) to the capture stream, with its own workspace, so that nothing in the
library allocates or switches streams while recording. The same call writes float32 output
straight from float16 / bfloat16 inputs (float32 accumulation), which also saves the cast kernel
that `(x @ w.T).astype(float32)` launches.

The call is `cublasGemmEx` on CUDA (cublas.py) and its twin `hipblasGemmEx` on ROCm
(hipblas.py); they differ only in names and enum values (a BlasApi each). `graph_gemm_type()`
picks one from `gpu_is_hip()`, the one platform predicate of the examples.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

import numpy as np

_WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends for Hopper; plenty for earlier GPUs


class BlasError(RuntimeError):
    pass


def gpu_is_hip() -> bool:
    """Whether cupy runs on ROCm/HIP (False without cupy). Everything in the examples that
    differs between CUDA and ROCm asks this one function."""
    try:
        import cupy
    except ImportError:
        return False
    return bool(getattr(cupy.cuda.runtime, "is_hip", False))


def graph_gemm_type(hip: bool | None = None):
    """The capturable GEMM class of this platform (of `hip` when given): hipBLAS on ROCm,
    cuBLAS on CUDA. Both take (stream) and are called as gemm(x, weight)."""
    if gpu_is_hip() if hip is None else hip:
        from .hipblas import HipblasGraphGemm
        return HipblasGraphGemm
    from .cublas import GraphGemm
    return GraphGemm


@dataclass(frozen=True)
class BlasApi:
    """What GraphGemm needs to know of one BLAS library: where it is, its function names and
    the enum values of its GemmEx call."""

    name: str                 # for messages
    file_prefix: str          # matched against the libraries this process has loaded
    find_library: str         # ctypes.util.find_library's name
    fallback_files: tuple     # tried last, in order
    create: str
    destroy: str
    set_stream: str
    set_workspace: str | None  # None, or a function that may be missing (then not called)
    gemm_ex: tuple            # candidate names, the first one the library exports is used
    data_types: tuple         # (numpy dtype name, library data type value) pairs
    op_n: int
    op_t: int
    compute_32f: int
    gemm_default: int

    def data_type(self, dtype_name: str) -> int:
        return dict(self.data_types)[dtype_name]

    def supports(self, dtype_name: str) -> bool:
        return dtype_name in dict(self.data_types)


_LIBRARIES: dict = {}  # api.name -> (ctypes library, its GemmEx function)


def blas_library(api: BlasApi):
    """(library, GemmEx function) of `api`: the library cupy already loaded (found in this
    process's mappings), else the one the loader finds."""
    if api.name in _LIBRARIES:
        return _LIBRARIES[api.name]
    import cupy
    # A float32 product makes cupy load its BLAS (float32 is safe on every platform).
    (cupy.ones((2, 2), dtype=cupy.float32) @ cupy.ones((2, 2), dtype=cupy.float32)).sum()
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith(api.file_prefix):
                    candidates.append(path)
    except OSError:
        pass
    found = ctypes.util.find_library(api.find_library)
    candidates += ([found] if found else []) + list(api.fallback_files)
    for name in dict.fromkeys(candidates):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        gemm = _declare(lib, api)
        if gemm is None:
            continue
        _LIBRARIES[api.name] = lib, gemm
        return lib, gemm
    raise BlasError(f"{api.name} not found, or without {' / '.join(api.gemm_ex)} (looked in "
                    f"this process's libraries and the loader path)")


def _declare(lib, api: BlasApi):
    """Set argument and result types of the functions used; returns the GemmEx function, or
    None if this library exports none of its names."""
    p, i = ctypes.c_void_p, ctypes.c_int
    gemm = next((getattr(lib, n) for n in api.gemm_ex if hasattr(lib, n)), None)
    if gemm is None:
        return None
    signatures = {api.create: [ctypes.POINTER(p)], api.destroy: [p], api.set_stream: [p, p]}
    if api.set_workspace and hasattr(lib, api.set_workspace):
        signatures[api.set_workspace] = [p, p, ctypes.c_size_t]
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, i
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
    # compute type, algorithm: the same order in cuBLAS and hipBLAS.
    gemm.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    gemm.restype = i
    return gemm


@dataclass(frozen=True)
class _GemmWeight:
    array: object          # the caller's weight, kept so that its id is not reused
    contiguous: object     # the weight itself, or its C-contiguous copy
    dtype: np.dtype
    data_type: int         # the BLAS library's value for dtype
    out_features: int
    ptr: int


class CapturableGemm:
    """y = x @ weight.T as float32, for x [T, in] and weight [out, in] of one dtype (float16,
    bfloat16 or float32), on `stream` — also while `stream` is being captured. Subclasses set
    `api` (cublas.GraphGemm, hipblas.HipblasGraphGemm)."""

    api: BlasApi

    def __init__(self, stream):
        import cupy
        self._cupy = cupy
        self._lib, self._gemm = blas_library(self.api)
        self._handle = ctypes.c_void_p()
        self._check(getattr(self._lib, self.api.create)(ctypes.byref(self._handle)), "create")
        self._check(getattr(self._lib, self.api.set_stream)(self._handle,
                                                            ctypes.c_void_p(stream.ptr)),
                    "set stream")
        self._workspace = None
        set_workspace = self.api.set_workspace
        if set_workspace and hasattr(self._lib, set_workspace):
            self._workspace = cupy.empty(_WORKSPACE_BYTES, dtype=np.uint8)
            self._check(getattr(self._lib, set_workspace)(
                self._handle, ctypes.c_void_p(self._workspace.data.ptr), _WORKSPACE_BYTES),
                "set workspace")
        self._set_call_state()
        self.stream = stream

    def _set_call_state(self) -> None:
        """What calls read besides the handle: the host scalars alpha = 1 and beta = 0 (the
        default pointer mode reads them when the call is made or recorded), the library's data
        type values, and what is known of each weight (worked out at its first product)."""
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._one_ref, self._zero_ref = ctypes.byref(self._one), ctypes.byref(self._zero)
        self._data_types = dict(self.api.data_types)
        self._weights: dict = {}  # id(weight) -> _GemmWeight

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise BlasError(f"{self.api.name} {what} failed with status {status}")

    def __call__(self, x, weight, out=None):
        """out: a C-contiguous float32 [T, out_features] to write y into, else a new array."""
        cupy, api = self._cupy, self.api
        known = self._weights.get(id(weight))
        if known is None or known.array is not weight:
            known = self._weights[id(weight)] = self._weight(weight)
        if x.dtype != known.dtype or not x.flags.c_contiguous:  # (a call costs more than this)
            x = cupy.ascontiguousarray(x, dtype=known.dtype)
        rows, inner = x.shape
        y = cupy.empty((rows, known.out_features), dtype=np.float32) if out is None else out
        if rows == 0:
            return y
        # Row-major y [T, out] is column-major y^T [out, T] = W (column-major W^T, transposed)
        # times x^T (column-major [in, T]).
        self._check(self._gemm(
            self._handle, api.op_t, api.op_n, known.out_features, rows, inner, self._one_ref,
            known.ptr, known.data_type, inner, x.data.ptr, known.data_type, inner,
            self._zero_ref, y.data.ptr, self._data_types["float32"], known.out_features,
            api.compute_32f, api.gemm_default), "GemmEx")
        return y

    def _weight(self, weight) -> "_GemmWeight":
        """What every product with `weight` needs, worked out at its first: the weights of a
        model are the same arrays at every step."""
        dtype = np.dtype(weight.dtype).name
        if not self.api.supports(dtype):
            raise TypeError(f"{type(self).__name__}: weight dtype {dtype} is not supported")
        contiguous = self._cupy.ascontiguousarray(weight)
        return _GemmWeight(weight, contiguous, contiguous.dtype, self._data_types[dtype],
                           contiguous.shape[0], contiguous.data.ptr)

    def check(self, dtype) -> None:
        """One small product against cupy's float32 matmul (raises BlasError if they
        disagree)."""
        cupy = self._cupy
        rng = np.random.default_rng(0)
        with self.stream:  # all on one stream: the product must see the finished inputs
            x = cupy.asarray(rng.standard_normal((5, 96), dtype=np.float32)).astype(dtype)
            w = cupy.asarray(rng.standard_normal((40, 96), dtype=np.float32)).astype(dtype)
            got = self(x, w)
            want = x.astype(np.float32) @ w.astype(np.float32).T
            error = float(cupy.abs(got - want).max() / cupy.abs(want).max())
        if not error <= 1e-2:  # float32 accumulation of rounded inputs: ~1e-6 expected
            raise BlasError(f"{self.api.name} GemmEx disagrees with cupy's matmul ({error:.1e})")

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            try:
                getattr(self._lib, self.api.destroy)(handle)
            except Exception:  # interpreter shutdown: the runtime may already be gone
                pass
