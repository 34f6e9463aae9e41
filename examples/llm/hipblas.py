"""hipBLAS for the capturable matmul (blas.py) on ROCm: hipblasGemmEx through ctypes.

Written for ROCm (cupy-rocm-7-0, hipBLAS 2.x / 3.x), not run on AMD hardware yet.

cupy-rocm forwards stream capture (cudaStreamBeginCapture / EndCapture, GraphInstantiate,
GraphLaunch) to the HIP runtime, so the graph path of graphs.py can run on ROCm once its matmuls
avoid cupy's BLAS wrappers, which refuse to run during a capture as on CUDA. hipBLAS mirrors
cuBLAS call for call; only the names and enum values differ:
- data types are hipDataType, numbered as CUDA's (HIP_R_32F 0, HIP_R_16F 2, HIP_R_16BF 14):
  hipBLAS 3.0 (ROCm 7) takes them in hipblasGemmEx; hipBLAS 2.x (ROCm 6) only in
  hipblasGemmEx_v2 (its hipblasGemmEx takes the old hipblasDatatype_t), so _v2 is preferred
  wherever it is exported;
- the compute type is hipblasComputeType_t (HIPBLAS_COMPUTE_32F = 2), operations are 111 / 112
  (HIPBLAS_OP_N / _T) and the default algorithm is 160 (HIPBLAS_GEMM_DEFAULT);
- hipblasSetWorkspace exists only in newer hipBLAS; without it rocBLAS keeps its own workspace,
  which the warm-up run before each capture sizes (should it have to grow inside a capture, the
  capture fails and the engine falls back to eager steps).
Unlike cupy's hipBLAS shim, which aborts the process on a bfloat16 type it cannot convert, a bad
argument here comes back as a status (BlasError).
"""

from __future__ import annotations

from .blas import BlasApi, CapturableGemm

HIPBLAS = BlasApi(
    name="hipBLAS", file_prefix="libhipblas.so", find_library="hipblas",
    fallback_files=("libhipblas.so.3", "libhipblas.so.2", "libhipblas.so",
                    "/opt/rocm/lib/libhipblas.so"),
    create="hipblasCreate", destroy="hipblasDestroy", set_stream="hipblasSetStream",
    set_workspace="hipblasSetWorkspace", gemm_ex=("hipblasGemmEx_v2", "hipblasGemmEx"),
    data_types=(("float32", 0), ("float16", 2), ("bfloat16", 14)),
    op_n=111, op_t=112, compute_32f=2, gemm_default=160)


class HipblasGraphGemm(CapturableGemm):
    """The capturable matmul on hipBLAS: the interface of cublas.GraphGemm."""

    api = HIPBLAS
