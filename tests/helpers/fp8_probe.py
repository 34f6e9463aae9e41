"""Probes of cupa/kernels/fp8.cuh for the tests: two tiny GPU kernels built like every cupa variant
(cupa.catalogue.module_source, cupa.compiler.kernels), and the same functions compiled for the
host with clang, so that CPU-only CI runs the device code too."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

import numpy as np

from cupa.gpu import catalogue

PROBE_KERNELS = r"""
extern "C" __global__ void cupa_fp8_probe_encode(const float* x, u8* codes, i64 n, i32 fmt) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) codes[i] = fp8_encode(x[i], fmt);
}
extern "C" __global__ void cupa_fp8_probe_decode(const u8* codes, float* x, i64 n, i32 fmt) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = fp8_decode(codes[i], fmt);
}
"""


@dataclass(frozen=True)
class Fp8ProbeVariant:
    """A 'variant' in the sense of cupa.compiler: fp8.cuh plus the probe kernels."""

    source_file = "fp8.cuh"
    entry_names = ("cupa_fp8_probe_encode", "cupa_fp8_probe_decode")

    def instantiations(self) -> list[str]:
        return [PROBE_KERNELS]


def gpu_encode(x: np.ndarray, kernel_id: int) -> np.ndarray:
    import cupy
    from cupa.gpu.compiler import kernels
    x = cupy.asarray(np.ascontiguousarray(x, np.float32))
    codes = cupy.empty(x.size, cupy.uint8)
    kernels(Fp8ProbeVariant())["cupa_fp8_probe_encode"](
        (-(-x.size // 256),), (256,), (x, codes, np.int64(x.size), np.int32(kernel_id)))
    return codes.get()


def gpu_decode(codes: np.ndarray, kernel_id: int) -> np.ndarray:
    import cupy
    from cupa.gpu.compiler import kernels
    codes = cupy.asarray(np.ascontiguousarray(codes, np.uint8))
    x = cupy.empty(codes.size, cupy.float32)
    kernels(Fp8ProbeVariant())["cupa_fp8_probe_decode"](
        (-(-codes.size // 256),), (256,), (codes, x, np.int64(codes.size), np.int32(kernel_id)))
    return x.get()


# --- host build ----------------------------------------------------------------------------------

# What fp8.cuh takes from common.cuh, for a plain C++ compile.
_HOST_PRELUDE = r"""
typedef unsigned char u8; typedef unsigned int u32; typedef int i32; typedef long long i64;
#define CUPA_FN static inline
static inline float bits_to_float(u32 u) { return __builtin_bit_cast(float, u); }
static inline u32 float_to_bits(float f) { return __builtin_bit_cast(u32, f); }
"""

_HOST_MAIN = r"""
#include <stdio.h>
#include <stdlib.h>
// usage: probe encode|decode kernel_id count < input > output (raw float32 / uint8)
int main(int argc, char** argv) {
    const int fmt = atoi(argv[2]);
    const long n = atol(argv[3]);
    if (argv[1][0] == 'e') {
        float* x = (float*)malloc(n * 4); u8* c = (u8*)malloc(n);
        if (fread(x, 4, n, stdin) != (size_t)n) return 2;
        for (long i = 0; i < n; ++i) c[i] = fp8_encode(x[i], fmt);
        fwrite(c, 1, n, stdout);
    } else {
        u8* c = (u8*)malloc(n); float* x = (float*)malloc(n * 4);
        if (fread(c, 1, n, stdin) != (size_t)n) return 2;
        for (long i = 0; i < n; ++i) x[i] = fp8_decode(c[i], fmt);
        fwrite(x, 4, n, stdout);
    }
    return 0;
}
"""


def host_compiler() -> str | None:
    for name in (os.environ.get("CUPA_HIP_CLANG"), "clang-19", "clang", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build_host_probe(directory: str) -> str:
    """Compile fp8.cuh's functions for the CPU (clang; `#include "common.cuh"` replaced by a
    prelude of the few helpers used). Returns the executable's path."""
    source = (catalogue.KERNEL_DIR / "fp8.cuh").read_text()
    source = source.replace("#pragma once", "").replace('#include "common.cuh"', _HOST_PRELUDE)
    path = os.path.join(directory, "fp8_probe.cpp")
    exe = os.path.join(directory, "fp8_probe")
    with open(path, "w") as f:
        f.write(source + _HOST_MAIN)
    subprocess.run([host_compiler(), "-x", "c++", "-std=c++17", "-O2", path, "-o", exe],
                   check=True, capture_output=True, text=True)
    return exe


def host_run(exe: str, mode: str, data: np.ndarray, kernel_id: int) -> np.ndarray:
    out = subprocess.run([exe, mode, str(kernel_id), str(data.size)], input=data.tobytes(),
                         capture_output=True, check=True).stdout
    return np.frombuffer(out, np.uint8 if mode == "encode" else np.float32)

