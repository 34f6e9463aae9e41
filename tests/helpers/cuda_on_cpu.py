"""Runs the example engine's fused CUDA kernels (examples/llm/fused.py) on the CPU, so their
arithmetic and the host code around them can be tested without a GPU.

The kernel source is compiled with the host C++ compiler after a shim for the CUDA built-ins it
uses: threadIdx / blockIdx, blockDim / gridDim, __syncthreads and __shared__ (a static: the
workgroups of a launch run one after another, their threads as coroutines that switch at each
__syncthreads). The source's HIP branch is taken for the float16 conversion (`_Float16`, which
the host compiler has too). Each kernel gets a `run_<name>(grid, block, args...)` entry point,
and `fused_kernels()` returns objects called like cupy RawKernels, `kernel(grid, block, args)`,
on numpy arrays (their host addresses are the pointers).

What this cannot show: anything about the GPU itself (warp scheduling, memory ordering beyond
the barriers, the device's own expf / cosf, fused multiply-adds). The startup check of
llm.model.Model and tests/gpu cover those on a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SHIM = r"""
#include <cmath>
#include <functional>
#include <ucontext.h>
#include <vector>
struct Dim3 { unsigned x = 1, y = 1, z = 1; };
static Dim3 threadIdx, blockIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __shared__ static

// The threads of a workgroup are coroutines on one OS thread: each runs until its next
// __syncthreads, then the next one runs; a round ends when all have reached the barrier, so
// none passes it before all arrived. Workgroups run one after another.
static ucontext_t scheduler;
static std::vector<ucontext_t> contexts;
static std::vector<char> finished;
static std::function<void()> kernel_body;
static unsigned running;
static void __syncthreads() { swapcontext(&contexts[running], &scheduler); }
static void thread_main() { kernel_body(); finished[running] = 1; }

template <typename F> static void launch(unsigned grid, unsigned block, F body) {
    const size_t stack_bytes = 1 << 16;
    static std::vector<char> stacks;  // kept: zeroing megabytes per launch would dominate
    if (stacks.size() < block * stack_bytes) stacks.resize(block * stack_bytes);
    gridDim.x = grid;
    blockDim.x = block;
    kernel_body = body;
    contexts.assign(block, ucontext_t());
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        finished.assign(block, 0);
        for (unsigned t = 0; t < block; ++t) {
            getcontext(&contexts[t]);
            contexts[t].uc_stack.ss_sp = stacks.data() + t * stack_bytes;
            contexts[t].uc_stack.ss_size = stack_bytes;
            contexts[t].uc_link = &scheduler;
            makecontext(&contexts[t], thread_main, 0);
        }
        for (bool waiting = true; waiting;) {
            waiting = false;
            for (unsigned t = 0; t < block; ++t) {
                if (finished[t]) continue;
                running = t;
                threadIdx.x = t;
                swapcontext(&scheduler, &contexts[t]);
                waiting = waiting || !finished[t];
            }
        }
    }
}
"""

# extern "C" __global__ void name(params) { ... } in the source (after macro expansion).
_KERNEL = re.compile(r'extern "C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)\s*\{')


def compiler_missing() -> str | None:
    return None if shutil.which("g++") else "no g++ to build the kernels for the CPU"


def _expanded(source: str) -> str:
    """The kernel source after the preprocessor (its macros stamp the kernels), HIP branch."""
    result = subprocess.run(["g++", "-std=c++20", "-E", "-P", "-D__HIP__", "-x", "c++", "-"],
                            input=source, capture_output=True, text=True, check=True)
    return result.stdout


def _entry_points(expanded: str) -> tuple[str, list]:
    """C++ wrappers run_<kernel>(grid, block, params) and each kernel's parameter types."""
    wrappers, signatures = [], []
    for name, params in _KERNEL.findall(expanded):
        params = [p.strip() for p in params.split(",")]
        names = [p.split()[-1].lstrip("*") for p in params]
        wrappers.append(f'extern "C" void run_{name}(unsigned grid, unsigned block, '
                        f'{", ".join(params)}) {{ launch(grid, block, [&] {{ {name}('
                        f'{", ".join(names)}); }}); }}')
        signatures.append((name, params))
    return "\n".join(wrappers), signatures


_CTYPES = {"int": ctypes.c_int32, "long long": ctypes.c_int64, "float": ctypes.c_float}


def _argtype(param: str):
    if "*" in param:
        return ctypes.c_void_p
    base = " ".join(w for w in param.split()[:-1] if w != "const")
    return _CTYPES[base]


class CpuKernel:
    """A compiled kernel, called as a cupy RawKernel: kernel(grid, block, args)."""

    def __init__(self, function, params):
        self.function, self.name = function, function.__name__
        function.argtypes = [ctypes.c_uint, ctypes.c_uint] + [_argtype(p) for p in params]
        function.restype = None

    def __call__(self, grid, block, args):
        values = [a.ctypes.data if isinstance(a, np.ndarray) else
                  int(a) if isinstance(a, (np.integer, int)) else float(a) for a in args]
        self.function(grid[0], block[0], *values)


@functools.lru_cache(maxsize=None)
def _library(source: str):
    expanded = _expanded(source)
    wrappers, signatures = _entry_points(expanded)
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    build = Path(tempfile.gettempdir()) / f"cupa-cuda-on-cpu-{digest}"
    build.mkdir(exist_ok=True)
    library = build / "kernels.so"
    if not library.exists():
        code = build / "kernels.cpp"
        code.write_text(SHIM + expanded + "\n" + wrappers + "\n")
        subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC",
                        "-ffp-contract=off", str(code), "-o", str(library)], check=True)
    loaded = ctypes.CDLL(str(library))
    return {name: CpuKernel(getattr(loaded, f"run_{name}"), params)
            for name, params in signatures}


def fused_kernels(source: str) -> dict:
    """{kernel name: CpuKernel} of a fused.py source."""
    return _library(source)
