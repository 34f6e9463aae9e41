"""cuBLAS for the capturable matmul (blas.py): cublasGemmEx through ctypes (CUDA only)."""

from __future__ import annotations

from .blas import BlasApi, BlasError, CapturableGemm

CublasError = BlasError  # the name this module's error had before hipBLAS joined

# cudaDataType_t values (library_types.h) and cuBLAS enums (cublas_api.h).
CUBLAS = BlasApi(
    name="cuBLAS", file_prefix="libcublas.so", find_library="cublas",
    fallback_files=("libcublas.so.13", "libcublas.so.12", "libcublas.so"),
    create="cublasCreate_v2", destroy="cublasDestroy_v2", set_stream="cublasSetStream_v2",
    set_workspace="cublasSetWorkspace_v2", gemm_ex=("cublasGemmEx",),
    data_types=(("float32", 0), ("float16", 2), ("bfloat16", 14)),
    op_n=0, op_t=1, compute_32f=68, gemm_default=-1)


class GraphGemm(CapturableGemm):
    """The capturable matmul on cuBLAS: gemm(x, weight) -> float32 x @ weight.T, check(dtype)."""

    api = CUBLAS
