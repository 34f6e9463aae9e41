"""Runs CUDA kernel sources on the CPU: the example engine's fused kernels (examples/llm/fused.py)
and cupa's decode kernels in their emulated AMD build (tests/helpers/decode_on_cpu.py), so that
their arithmetic and the host code around them can be tested without a GPU.

The source is compiled with the host C++ compiler after a shim for the CUDA built-ins it uses:
threadIdx / blockIdx (three-dimensional grids), blockDim / gridDim, __shared__ (a static: the
workgroups of a launch run one after another), __syncthreads, the warp shuffles and ballot, and
cupa_cpu_sync_group, the barrier of a warp or an AMD wavefront (amd_emulation.cuh's wave_sync
under CUPA_CPU). A workgroup's threads are coroutines that switch at each barrier; the shuffles
exchange through one word a thread between two barriers of their group. The fused kernels take
their source's HIP branch (`_Float16`, which the host compiler has too); the decode kernels are
built with CUPA_CPU=1 (kernels/common.cuh). Each kernel gets a `run_<name>(grid, block, args...)`
entry point, called like a cupy RawKernel, `kernel(grid, block, args)`, on numpy arrays (their
host addresses are the pointers).

What this cannot show: anything about the GPU itself (warp scheduling, memory ordering beyond
the barriers, the device's own exp2 / expf / cosf, fused multiply-adds where the source leaves
them to the compiler). The startup check of llm.model.Model, tests/gpu and the emulated GPU
suite cover those on a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <ucontext.h>
#include <vector>
struct Dim3 { unsigned x, y, z; };
static Dim3 threadIdx = {0, 0, 0}, blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
#define __global__
#define __device__
#define __host__
#define __shared__ static
#define __launch_bounds__(...)

// The threads of a workgroup are coroutines on one OS thread. Each runs until it reaches a
// barrier: __syncthreads (all the workgroup's threads) or a group barrier (the `width`
// consecutive threads of a warp or wavefront, cupa_cpu_sync_group). A pass runs every thread
// that is not waiting; a barrier opens once every live thread it names has reached it, so no
// thread passes one before the others arrived. Workgroups run one after another.
enum { RUNNABLE = 0, AT_WORKGROUP_BARRIER = -1 };  // > 0: at the barrier of its group of that width
static ucontext_t scheduler;
static std::vector<ucontext_t> contexts;
static std::vector<char> finished;
static std::vector<int> waiting;
static std::vector<unsigned> exchange_words;  // one a thread, for the shuffles
static std::function<void()> kernel_body;
static unsigned running;

// The empty asm is a compiler barrier: the other threads read and write shared memory while
// this one waits, and the compiler may otherwise keep a static's values in registers across
// swapcontext, which it can prove never sees them.
static void wait_at(int barrier) {
    waiting[running] = barrier;
    asm volatile("" ::: "memory");
    swapcontext(&contexts[running], &scheduler);
    asm volatile("" ::: "memory");
}
static void __syncthreads() { wait_at(AT_WORKGROUP_BARRIER); }
static void cupa_cpu_sync_group(int width) { wait_at(width); }
static void thread_main() { kernel_body(); finished[running] = 1; }

static bool open_barriers(unsigned block) {
    bool all_there = true, any_live = false;
    for (unsigned t = 0; t < block; ++t)
        if (!finished[t]) {
            any_live = true;
            all_there = all_there && waiting[t] == AT_WORKGROUP_BARRIER;
        }
    if (any_live && all_there) {
        for (unsigned t = 0; t < block; ++t) waiting[t] = RUNNABLE;
        return true;
    }
    bool opened = false;
    for (unsigned t = 0; t < block; ++t) {
        const int width = waiting[t];
        if (finished[t] || width <= 0) continue;
        const unsigned first = t / width * width, last = first + width < block ? first + width : block;
        bool whole = true;
        for (unsigned u = first; u < last; ++u) whole = whole && (finished[u] || waiting[u] == width);
        if (whole) {
            for (unsigned u = first; u < last; ++u) waiting[u] = RUNNABLE;
            opened = true;
        }
    }
    return opened;
}

template <typename F> static void launch(Dim3 grid, unsigned block, F body) {
    const size_t stack_bytes = 1 << 17;
    static std::vector<char> stacks;  // kept: zeroing megabytes per launch would dominate
    if (stacks.size() < block * stack_bytes) stacks.resize(block * stack_bytes);
    gridDim = grid;
    blockDim = {block, 1, 1};
    kernel_body = body;
    contexts.assign(block, ucontext_t());
    exchange_words.assign(block, 0u);
    for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx.x = x; blockIdx.y = y; blockIdx.z = z;
        finished.assign(block, 0);
        waiting.assign(block, RUNNABLE);
        for (unsigned t = 0; t < block; ++t) {
            getcontext(&contexts[t]);
            contexts[t].uc_stack.ss_sp = stacks.data() + t * stack_bytes;
            contexts[t].uc_stack.ss_size = stack_bytes;
            contexts[t].uc_link = &scheduler;
            makecontext(&contexts[t], thread_main, 0);
        }
        for (;;) {
            bool ran = false, live = false;
            for (unsigned t = 0; t < block; ++t) {
                if (finished[t] || waiting[t] != RUNNABLE) continue;
                running = t;
                threadIdx.x = t;
                swapcontext(&scheduler, &contexts[t]);
                ran = true;
            }
            for (unsigned t = 0; t < block; ++t) live = live || !finished[t];
            if (!live) break;
            if (!open_barriers(block) && !ran) {
                fprintf(stderr, "cuda_on_cpu: workgroup (%u, %u, %u) stuck: its threads wait at "
                        "barriers that cannot open\n", x, y, z);
                abort();
            }
        }
    }
}

// Warp operations of a group of `width` threads (CUDA's, at the width given), by exchange.
static unsigned exchange(unsigned word, unsigned src_lane, int width) {
    exchange_words[running] = word;
    cupa_cpu_sync_group(width);
    const unsigned got = exchange_words[running / width * width + src_lane % width];
    cupa_cpu_sync_group(width);
    return got;
}
template <typename T> static T exchanged(T v, unsigned src_lane, int width) {
    static_assert(sizeof(T) == 4, "32-bit shuffles");
    unsigned word;
    memcpy(&word, &v, 4);
    word = exchange(word, src_lane, width);
    memcpy(&v, &word, 4);
    return v;
}
template <typename T> static T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const unsigned lane = running % width, src = lane ^ (unsigned)mask;
    return exchanged(v, src < (unsigned)width ? src : lane, width);
}
template <typename T> static T __shfl_sync(unsigned, T v, int src_lane, int width = 32) {
    return exchanged(v, (unsigned)src_lane, width);
}
static unsigned __ballot_sync(unsigned, int predicate) {
    exchange_words[running] = predicate != 0;
    cupa_cpu_sync_group(32);
    unsigned bits = 0;
    for (unsigned l = 0; l < 32; ++l) bits |= exchange_words[running / 32 * 32 + l] << l;
    cupa_cpu_sync_group(32);
    return bits;
}
static void __syncwarp(unsigned = 0xffffffffu) { cupa_cpu_sync_group(32); }
static float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static int __ffs(int x) { return __builtin_ffs(x); }

// fma.rn.f32, and with ftz its flush of subnormal inputs and result to zero (as the sign says).
static float flushed(float x) { return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x; }
static float cupa_cpu_fma(float a, float b, float c, bool ftz) {
    if (!ftz) return std::fma(a, b, c);
    return flushed(std::fma(flushed(a), flushed(b), flushed(c)));
}
"""

# extern "C" __global__ void [__launch_bounds__(...)] name(params) { ... } in the source (after
# macro expansion).
_KERNEL = re.compile(r'extern "C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?'
                     r'(\w+)\s*\(([^)]*)\)\s*\{')


def compiler_missing() -> str | None:
    return None if shutil.which("g++") else "no g++ to build the kernels for the CPU"


def _expanded(source: str, defines: tuple) -> str:
    """The kernel source after the preprocessor (its macros stamp the kernels)."""
    result = subprocess.run(["g++", "-std=c++20", "-E", "-P", *defines, "-x", "c++", "-"],
                            input=source, capture_output=True, text=True, check=True)
    return result.stdout


def _entry_points(expanded: str) -> tuple[str, list]:
    """C++ wrappers run_<kernel>(grid x, y, z, block, params) and each kernel's parameter
    types."""
    wrappers, signatures = [], []
    for name, params in _KERNEL.findall(expanded):
        params = [p.strip() for p in params.split(",")]
        names = [p.split()[-1].lstrip("*") for p in params]
        wrappers.append(f'extern "C" __attribute__((visibility("default"))) void run_{name}('
                        f'unsigned gx, unsigned gy, unsigned gz, unsigned block, '
                        f'{", ".join(params)}) {{ launch(Dim3{{gx, gy, gz}}, block, [&] {{ '
                        f'{name}({", ".join(names)}); }}); }}')
        signatures.append((name, params))
    return "\n".join(wrappers), signatures


# Scalar parameter types, as spelled in the kernels (cupa's common.cuh typedefs included).
_CTYPES = {"int": ctypes.c_int32, "i32": ctypes.c_int32, "long long": ctypes.c_int64,
           "i64": ctypes.c_int64, "float": ctypes.c_float}


def _argtype(param: str):
    if "*" in param:
        return ctypes.c_void_p
    base = " ".join(w for w in param.split()[:-1] if w != "const")
    return _CTYPES[base]


class CpuKernel:
    """A compiled kernel, called as a cupy RawKernel: kernel(grid, block, args)."""

    def __init__(self, function, params):
        self.function, self.name = function, function.__name__
        self.params = params
        function.argtypes = [ctypes.c_uint] * 4 + [_argtype(p) for p in params]
        function.restype = None

    def __call__(self, grid, block, args):
        """grid: up to three dimensions; args: numpy arrays (their addresses), None (a null
        pointer) and scalars, one per parameter."""
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        values = [a.ctypes.data if isinstance(a, np.ndarray) else None if a is None else
                  int(a) if isinstance(a, (np.integer, int)) else float(a) for a in args]
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        self.function(gx, gy, gz, block[0], *values)


# Hidden symbols: builds for different targets share kernel names, and a process that loads
# two of them must not have one's launcher call the other's kernel.
_COMPILE = ("g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-fvisibility=hidden",
            "-ffp-contract=off")
# AddressSanitizer and UndefinedBehaviorSanitizer, every finding fatal; -g names the source lines
# of the generated code in a report. A library built so loads only into a process that has the
# ASan runtime preloaded (tests/helpers/sanitized_run.py starts one).
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer", "-g")


def asan_preloaded() -> bool:
    return hasattr(ctypes.CDLL(None), "__asan_init")


@functools.lru_cache(maxsize=None)
def _library(source: str, defines: tuple = ("-D__HIP__",), flags: tuple = ()):
    expanded = _expanded(source, defines)
    wrappers, signatures = _entry_points(expanded)
    code = SHIM + expanded + "\n" + wrappers + "\n"
    command = _COMPILE + flags
    digest = hashlib.sha256((repr(command) + code).encode()).hexdigest()[:16]
    build = Path(tempfile.gettempdir()) / f"cupa-cuda-on-cpu-{digest}"
    library = build / "kernels.so"
    if not library.exists():  # built once per machine; a concurrent build renames over it
        build.mkdir(exist_ok=True)
        own_code, own_library = (build / f"kernels-{os.getpid()}{ext}" for ext in (".cpp", ".so"))
        own_code.write_text(code)
        subprocess.run([*command, str(own_code), "-o", str(own_library)], check=True)
        own_library.replace(library)
    loaded = ctypes.CDLL(str(library))
    return {name: CpuKernel(getattr(loaded, f"run_{name}"), params)
            for name, params in signatures}


def _sanitizer_flags(sanitize: bool) -> tuple:
    """SANITIZE if asked, or for every build with CUPA_CPU_SANITIZE=1 (a whole test file in a
    process with the ASan runtime preloaded; docs/amd_emulation.md), else none."""
    if not (sanitize or os.environ.get("CUPA_CPU_SANITIZE") == "1"):
        return ()
    if not asan_preloaded():
        raise RuntimeError("a sanitized build needs the ASan runtime preloaded: run it through "
                           "tests/helpers/sanitized_run.py, or preload it (LD_PRELOAD)")
    return SANITIZE


def fused_kernels(source: str) -> dict:
    """{kernel name: CpuKernel} of a fused.py source (its HIP branch)."""
    return _library(source, ("-D__HIP__",), _sanitizer_flags(False))


def cpu_kernels(source: str, defines: tuple, *, sanitize: bool = False) -> dict:
    """{kernel name: CpuKernel} of a kernel source built with `defines` (-DNAME=VALUE ...),
    under the sanitizers if asked (_sanitizer_flags)."""
    return _library(source, tuple(defines), _sanitizer_flags(sanitize))
