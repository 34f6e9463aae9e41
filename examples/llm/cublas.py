"""A cuBLAS matmul that can be recorded in a CUDA graph (ctypes; CUDA only).

cupy refuses every cuBLAS call while a stream is capturing (its wrappers raise
NotImplementedError before setting the stream), although cuBLAS itself supports stream capture.
So the graph-captured decode step calls `cublasGemmEx` directly: on its own handle, bound once
(outside any capture) to the capture stream, with its own workspace, so that nothing in cuBLAS
allocates or switches streams while recording. The same call writes float32 output straight
from float16 / bfloat16 inputs (float32 accumulation), which also saves the cast kernel that
`(x @ w.T).astype(float32)` launches.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import numpy as np

# cudaDataType_t values (library_types.h) and cuBLAS enums (cublas_api.h).
_CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_WORKSPACE_BYTES = 32 << 20  # what cuBLAS recommends for Hopper; plenty for earlier GPUs


class CublasError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _library():
    """The libcublas that cupy already loaded (found in this process's mappings), else the one
    the loader finds."""
    import cupy
    (cupy.ones((2, 2), dtype=cupy.float32) @ cupy.ones((2, 2), dtype=cupy.float32)).sum()
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libcublas.so"):
                    candidates.append(path)
    except OSError:
        pass
    found = ctypes.util.find_library("cublas")
    candidates += ([found] if found else []) + ["libcublas.so.13", "libcublas.so.12",
                                                "libcublas.so"]
    for name in dict.fromkeys(candidates):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        _declare(lib)
        return lib
    raise CublasError("libcublas not found (looked in this process's libraries and the loader "
                      "path)")


def _declare(lib) -> None:
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(p)]
    lib.cublasDestroy_v2.argtypes = [p]
    lib.cublasSetStream_v2.argtypes = [p, p]
    lib.cublasSetWorkspace_v2.argtypes = [p, p, ctypes.c_size_t]
    lib.cublasGemmEx.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    for name in ("cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2",
                 "cublasSetWorkspace_v2", "cublasGemmEx"):
        getattr(lib, name).restype = i


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasError(f"{what} failed with cuBLAS status {status}")


class GraphGemm:
    """y = x @ weight.T as float32, for x [T, in] and weight [out, in] of one dtype (float16,
    bfloat16 or float32), on `stream` — also while `stream` is being captured."""

    def __init__(self, stream):
        import cupy
        self._cupy, self._lib = cupy, _library()
        self._handle = ctypes.c_void_p()
        _check(self._lib.cublasCreate_v2(ctypes.byref(self._handle)), "cublasCreate")
        _check(self._lib.cublasSetStream_v2(self._handle, ctypes.c_void_p(stream.ptr)),
               "cublasSetStream")
        self._workspace = cupy.empty(_WORKSPACE_BYTES, dtype=np.uint8)
        _check(self._lib.cublasSetWorkspace_v2(self._handle,
                                               ctypes.c_void_p(self._workspace.data.ptr),
                                               _WORKSPACE_BYTES), "cublasSetWorkspace")
        # Host scalars (the default pointer mode): read when the call is made or recorded.
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.stream = stream

    def __call__(self, x, weight):
        cupy = self._cupy
        dtype = np.dtype(weight.dtype).name
        if dtype not in _CUDA_TYPES:
            raise TypeError(f"GraphGemm: weight dtype {dtype} is not supported")
        x = cupy.ascontiguousarray(x.astype(weight.dtype, copy=False))
        weight = cupy.ascontiguousarray(weight)
        rows, inner = x.shape
        out_features = weight.shape[0]
        y = cupy.empty((rows, out_features), dtype=np.float32)
        if rows == 0:
            return y
        # Row-major y [T, out] is column-major y^T [out, T] = W (column-major W^T, transposed)
        # times x^T (column-major [in, T]).
        cuda_type = _CUDA_TYPES[dtype]
        _check(self._lib.cublasGemmEx(
            self._handle, _CUBLAS_OP_T, _CUBLAS_OP_N, out_features, rows, inner,
            ctypes.byref(self._one), ctypes.c_void_p(weight.data.ptr), cuda_type, inner,
            ctypes.c_void_p(x.data.ptr), cuda_type, inner, ctypes.byref(self._zero),
            ctypes.c_void_p(y.data.ptr), _CUDA_TYPES["float32"], out_features,
            _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT), "cublasGemmEx")
        return y

    def check(self, dtype) -> None:
        """One small product against cupy's matmul (raises CublasError if they disagree)."""
        cupy = self._cupy
        rng = np.random.default_rng(0)
        with self.stream:  # all on one stream: the product must see the finished inputs
            x = cupy.asarray(rng.standard_normal((5, 96), dtype=np.float32)).astype(dtype)
            w = cupy.asarray(rng.standard_normal((40, 96), dtype=np.float32)).astype(dtype)
            got = self(x, w)
            want = x.astype(np.float32) @ w.astype(np.float32).T
            error = float(cupy.abs(got - want).max() / cupy.abs(want).max())
        if not error <= 1e-2:  # float32 accumulation of rounded inputs: ~1e-6 expected
            raise CublasError(f"cublasGemmEx disagrees with cupy's matmul ({error:.1e})")

    def __del__(self):
        handle = getattr(self, "_handle", None)
        if handle is not None and handle.value:
            try:
                self._lib.cublasDestroy_v2(handle)
            except Exception:  # interpreter shutdown: CUDA may already be gone
                pass
