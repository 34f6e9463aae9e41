"""Runs CUDA kernel sources on the CPU: the example engine's fused kernels (examples/llm/fused.py)
and cupa's decode kernels, in their emulated AMD build or their NVIDIA build
(tests/helpers/decode_on_cpu.py), so that their arithmetic and the host code around them can be
tested without a GPU.

The source is compiled with the host C++ compiler after a shim for the CUDA built-ins it uses:
threadIdx / blockIdx (three-dimensional grids), blockDim / gridDim, __shared__ (a static: the
workgroups of a launch run one after another; those of a thread-block cluster together, the
runner swapping each one's copy of the statics in as it moves between them), __syncthreads,
the warp shuffles and ballot, and cupa_cpu_sync_group, the barrier of a warp or an AMD
wavefront (amd_emulation.cuh's wave_sync under CUPA_CPU). A workgroup's threads are coroutines
that switch at each barrier; the shuffles exchange through one word a thread between two
barriers of their group, and the tensor-core instructions the NVIDIA kernels call under
CUPA_CPU (cupa_cpu_mma_m16n8k16, cupa_cpu_ldmatrix, cupa_cpu_movmatrix) through eight words a
lane, each lane then computing its own part by the PTX ISA's fragment layouts. The fused
kernels take their source's HIP branch (`_Float16`, which the host compiler has too); the
decode kernels are built with CUPA_CPU=1 (kernels/common.cuh). Each kernel gets a
`run_<name>(grid, block, dynamic shared bytes, cluster, args...)` entry point, called like a
cupy RawKernel, `kernel(grid, block, args, shared_mem=..., cluster=...)`, on numpy arrays
(their host addresses are the pointers). SANITIZE builds under AddressSanitizer and
UndefinedBehaviorSanitizer (tests/helpers/sanitized_run.py).

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
#include <cstdint>
#include <cstring>
#include <dlfcn.h>
#include <algorithm>
#include <functional>
#include <sys/mman.h>
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
// barrier: __syncthreads (all its workgroup's threads), a group barrier (the `width`
// consecutive threads of a warp or wavefront, cupa_cpu_sync_group) or the cluster barrier. A
// pass runs every thread that is not waiting; a barrier opens once every live thread it names
// has reached it (a thread that has exited counts as arrived), so no thread passes one before
// the others arrived. Workgroups run one after another, or a thread-block cluster's together.
enum { RUNNABLE = 0, AT_WORKGROUP_BARRIER = -1, AT_CLUSTER_BARRIER = -2 };  // > 0: a group's
static ucontext_t scheduler;
static std::vector<ucontext_t> contexts;
static std::vector<char> finished;
static std::vector<int> waiting;
static std::vector<unsigned> exchange_words;  // one a thread, for the shuffles
static std::function<void()> kernel_body;
static unsigned running;
// cp.async copies not landed yet, per thread (cupa_cpu_copy below).
struct PendingCopy { void* dst; const void* src; int valid, bytes; };
static std::vector<std::vector<PendingCopy>> open_copies;  // a thread's uncommitted copies
static std::vector<std::vector<std::vector<PendingCopy>>> committed_copies;  // its groups

// Shared memory of the blocks of a cluster. __shared__ variables are statics, one copy each: the
// running block's values live there, the others' wait in cluster_shared, which holds each
// block's bytes of every shared range end to end (each starts as poison, 0xff, as a GPU's holds
// anything). The ranges are the kernels' function-local statics, which cuda_on_cpu.py reads off
// the library's symbol table (cupa_cpu_register_shared).
static char shared_anchor;  // a static of this library: its base for dladdr, and shared_base
struct SharedRange { char* start; size_t bytes, offset; };  // offset: in a block's copy
static std::vector<SharedRange> shared_ranges;
static size_t shared_total;
extern "C" __attribute__((visibility("default")))
void cupa_cpu_register_shared(const unsigned long* addresses, const unsigned long* sizes, int n) {
    Dl_info info;
    dladdr((void*)&shared_anchor, &info);  // this library's own (a hidden static)
    shared_ranges.clear();
    shared_total = 0;
    for (int i = 0; i < n; ++i) {
        shared_ranges.push_back({(char*)info.dli_fbase + addresses[i], sizes[i], shared_total});
        shared_total += sizes[i];
    }
}
static std::vector<std::vector<char>> cluster_shared;
static int resident_block = -1;  // the cluster's block whose shared memory the statics hold
static void make_resident(int rank) {
    if (cluster_shared.size() < 2 || rank == resident_block) return;
    for (const SharedRange& r : shared_ranges) {
        if (resident_block >= 0)
            memcpy(cluster_shared[resident_block].data() + r.offset, r.start, r.bytes);
        memcpy(r.start, cluster_shared[rank].data() + r.offset, r.bytes);
    }
    resident_block = rank;
}
// Where byte `offset` of block `rank`'s copy of the shared ranges lives now.
static const char* shared_of_block(int rank, size_t offset) {
    if (rank == resident_block || cluster_shared.size() < 2) {
        for (const SharedRange& r : shared_ranges)
            if (offset >= r.offset && offset < r.offset + r.bytes)
                return r.start + (offset - r.offset);
        fprintf(stderr, "cuda_on_cpu: no shared range at offset %zu\n", offset);
        abort();
    }
    return cluster_shared[rank].data() + offset;
}
static size_t shared_offset_of(const char* p) {  // p's offset in a block's copy
    for (const SharedRange& r : shared_ranges)
        if (p >= r.start && p < r.start + r.bytes) return r.offset + (p - r.start);
    fprintf(stderr, "cuda_on_cpu: %p is in no __shared__ variable\n", (const void*)p);
    abort();
}

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
static void cupa_cpu_cluster_sync() { wait_at(AT_CLUSTER_BARRIER); }
static void thread_main() { kernel_body(); finished[running] = 1; }

// Opens the barriers every live thread they name has reached, among `threads` threads in
// workgroups of `block`; true if one opened.
static bool open_barriers(unsigned threads, unsigned block) {
    auto open_if_all_at = [&](unsigned first, unsigned last, int barrier) {
        bool all_there = true, any_live = false;
        for (unsigned t = first; t < last; ++t)
            if (!finished[t]) {
                any_live = true;
                all_there = all_there && waiting[t] == barrier;
            }
        if (!any_live || !all_there) return false;
        for (unsigned t = first; t < last; ++t) waiting[t] = RUNNABLE;
        return true;
    };
    if (open_if_all_at(0, threads, AT_CLUSTER_BARRIER)) return true;
    bool opened = false;
    for (unsigned first = 0; first < threads; first += block)
        opened = open_if_all_at(first, first + block, AT_WORKGROUP_BARRIER) || opened;
    if (opened) return true;
    for (unsigned t = 0; t < threads; ++t) {
        const int width = waiting[t];
        if (finished[t] || width <= 0) continue;
        const unsigned first = t / width * width, end = (t / block + 1) * block;
        const unsigned last = first + width < end ? first + width : end;
        bool whole = true;
        for (unsigned u = first; u < last; ++u) whole = whole && (finished[u] || waiting[u] == width);
        if (whole) {
            for (unsigned u = first; u < last; ++u) waiting[u] = RUNNABLE;
            opened = true;
        }
    }
    return opened;
}

// Coroutine stacks, mapped once and grown as needed (pages are touched only as used).
static char* thread_stacks(size_t bytes) {
    static char* stacks = nullptr;
    static size_t mapped = 0;
    if (bytes > mapped) {
        if (stacks) munmap(stacks, mapped);
        stacks = (char*)mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                             MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (stacks == MAP_FAILED) { perror("cuda_on_cpu: stacks"); abort(); }
        mapped = bytes;
    }
    return stacks;
}

// The order a pass runs the threads in: by index, or by CUPA_CPU_SCHEDULE, read at each launch:
// "reverse", or a number that seeds a fresh random order for every pass. Between two barriers
// the threads' segments run one after another in that order, so a kernel whose results change
// with the order reads what another thread writes without a barrier between: a race.
// A warp's shuffles are barriers of its own, which cut every thread's segment at the same
// places; "ahead" (or "ahead-reverse") lets one warp run on through them instead: each pass
// runs only the first thread that can run, by index (or from the last), so the first warp
// reaches the next workgroup barrier before the next warp starts. That shows what a warp
// running ahead of the others does, e.g. overwriting what they have yet to read.
static unsigned long long schedule_state;
static int schedule_mode;  // 0 by index, 1 reversed, 2 random, 3 ahead, 4 ahead from the last
static void read_schedule() {
    const char* value = getenv("CUPA_CPU_SCHEDULE");
    schedule_mode = 0;
    if (value == nullptr || *value == 0) return;
    if (strcmp(value, "reverse") == 0) { schedule_mode = 1; return; }
    if (strcmp(value, "ahead") == 0) { schedule_mode = 3; return; }
    if (strcmp(value, "ahead-reverse") == 0) { schedule_mode = 4; return; }
    schedule_mode = 2;
    schedule_state = strtoull(value, nullptr, 10) * 2654435761ULL + 1;
}
static void schedule_order(std::vector<unsigned>& order) {
    for (unsigned t = 0; t < order.size(); ++t) order[t] = t;
    if (schedule_mode == 1 || schedule_mode == 4) std::reverse(order.begin(), order.end());
    if (schedule_mode == 2)
        for (size_t i = order.size(); i > 1; --i) {  // Fisher-Yates by a 64-bit LCG
            schedule_state = schedule_state * 6364136223846793005ULL + 1442695040888963407ULL;
            std::swap(order[i - 1], order[(schedule_state >> 33) % i]);
        }
}

// Runs `body` over `grid` in workgroups of `block` threads, the workgroups of each cluster of
// `cluster` together (all of them, or one at a time without clusters).
template <typename F> static void launch(Dim3 grid, unsigned block, Dim3 cluster, F body) {
    const size_t stack_bytes = 1 << 17;
    const unsigned size = cluster.x * cluster.y * cluster.z, threads = size * block;
    char* const stacks = thread_stacks(threads * stack_bytes);
    gridDim = grid;
    blockDim = {block, 1, 1};
    kernel_body = body;
    contexts.assign(threads, ucontext_t());
    exchange_words.assign(threads, 0u);
    std::vector<unsigned> order(threads);
    read_schedule();
    for (unsigned z = 0; z < grid.z; z += cluster.z)
    for (unsigned y = 0; y < grid.y; y += cluster.y)
    for (unsigned x = 0; x < grid.x; x += cluster.x) {
        finished.assign(threads, 0);
        waiting.assign(threads, RUNNABLE);
        open_copies.assign(threads, {});
        committed_copies.assign(threads, {});
        cluster_shared.assign(size > 1 ? size : 0, std::vector<char>(shared_total, (char)0xff));
        resident_block = -1;
        for (unsigned t = 0; t < threads; ++t) {
            getcontext(&contexts[t]);
            contexts[t].uc_stack.ss_sp = stacks + t * stack_bytes;
            contexts[t].uc_stack.ss_size = stack_bytes;
            contexts[t].uc_link = &scheduler;
            makecontext(&contexts[t], thread_main, 0);
        }
        for (;;) {
            bool ran = false, live = false;
            schedule_order(order);
            for (unsigned t : order) {
                if (finished[t] || waiting[t] != RUNNABLE) continue;
                const unsigned rank = t / block;  // x fastest within the cluster
                make_resident((int)rank);
                running = t;
                threadIdx.x = t % block;
                blockIdx.x = x + rank % cluster.x;
                blockIdx.y = y + rank / cluster.x % cluster.y;
                blockIdx.z = z + rank / (cluster.x * cluster.y);
                swapcontext(&scheduler, &contexts[t]);
                ran = true;
                if (schedule_mode >= 3) break;  // "ahead": one thread a pass
            }
            for (unsigned t = 0; t < threads; ++t) live = live || !finished[t];
            if (!live) break;
            if (!open_barriers(threads, block) && !ran) {
                fprintf(stderr, "cuda_on_cpu: workgroup (%u, %u, %u)'s cluster stuck: its threads "
                        "wait at barriers that cannot open\n", x, y, z);
                abort();
            }
        }
    }
    cluster_shared.clear();
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
static int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
static int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, !predicate) == 0; }
static void __syncwarp(unsigned = 0xffffffffu) { cupa_cpu_sync_group(32); }
static float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static int __ffs(int x) { return __builtin_ffs(x); }

// ---- PTX of the NVIDIA tensor-core kernels, for their CPU build (kernels/mma/*.cuh under
// CUPA_CPU): the warp-wide instructions exchange their lanes' operands through lane_words
// between two barriers of the warp, then each lane computes what the instruction gives it.
// Shared memory is the library's statics; a "shared address" is a 32-bit offset from
// shared_base, 2 GiB below one of them (all statics of the library lie within that).
static unsigned lane_words[16 * 1024][8];  // up to a cluster of 16 workgroups of 1024
static const uintptr_t shared_base = (uintptr_t)&shared_anchor - 0x80000000u;
static unsigned __cvta_generic_to_shared(const void* p) {
    return (unsigned)((uintptr_t)p - shared_base);
}
static const char* shared_at(unsigned address) { return (const char*)(shared_base + address); }
static void __trap() { fprintf(stderr, "cuda_on_cpu: __trap()\n"); abort(); }
#define CUPA_CPU_DYNAMIC_SHARED_BYTES 232448  // sm_90's most
static unsigned cupa_cpu_dynamic_shared_bytes;  // the launch's
static unsigned cupa_cpu_lane() { return running % 32; }
static unsigned cupa_cpu_word_of(unsigned lane, int i) {  // word i of `lane` of this warp
    return lane_words[running / 32 * 32 + lane][i];
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i .. 8i + 7 give the rows of
// matrix i; lane (g, c) = (lane / 4, lane % 4) receives row g's 16-bit columns 2c, 2c + 1 (or,
// transposed, column g of rows 2c and 2c + 1).
static void cupa_cpu_ldmatrix(unsigned (&r)[4], unsigned address, bool transposed) {
    const unsigned lane = cupa_cpu_lane(), g = lane / 4, c = lane % 4;
    lane_words[running][0] = address;
    cupa_cpu_sync_group(32);
    for (int i = 0; i < 4; ++i) {
        if (!transposed) {
            memcpy(&r[i], shared_at(cupa_cpu_word_of(8 * i + g, 0) + 4 * c), 4);
        } else {
            unsigned short lo, hi;
            memcpy(&lo, shared_at(cupa_cpu_word_of(8 * i + 2 * c, 0) + 2 * g), 2);
            memcpy(&hi, shared_at(cupa_cpu_word_of(8 * i + 2 * c + 1, 0) + 2 * g), 2);
            r[i] = lo | (unsigned)hi << 16;
        }
    }
    cupa_cpu_sync_group(32);
}

// movmatrix.sync.aligned.m8n8.trans.b16: lane (g, c) holds row g's columns 2c, 2c + 1 and
// receives those of the transposed matrix, column g of rows 2c and 2c + 1.
static unsigned cupa_cpu_movmatrix(unsigned x) {
    const unsigned lane = cupa_cpu_lane(), g = lane / 4, c = lane % 4;
    lane_words[running][0] = x;
    cupa_cpu_sync_group(32);
    unsigned r = 0;
    for (int j = 0; j < 2; ++j) {
        const unsigned row = 2 * c + j;  // the source element (row, g)
        const unsigned word = cupa_cpu_word_of(4 * row + g / 2, 0);
        r |= ((word >> (16 * (g % 2))) & 0xffffu) << (16 * j);
    }
    cupa_cpu_sync_group(32);
    return r;
}

static float cupa_cpu_half(unsigned bits16, bool bf16) {
    if (bf16) { unsigned u = bits16 << 16; float f; memcpy(&f, &u, 4); return f; }
    _Float16 h; unsigned short s = (unsigned short)bits16; memcpy(&h, &s, 2); return (float)h;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: D = A B + D, A 16 x 16, B 16 x 8. Lane
// (g, c): a = A[g][2c..], A[g + 8][2c..], A[g][2c + 8..], A[g + 8][2c + 8..] (pairs, low half
// first); b = B[2c..][g], B[2c + 8..][g]; d = D[g][2c], D[g][2c + 1], D[g + 8][2c],
// D[g + 8][2c + 1].
static void cupa_cpu_mma_m16n8k16(float* d, const unsigned* a, unsigned b0, unsigned b1,
                                  bool bf16) {
    const unsigned lane = cupa_cpu_lane(), g = lane / 4, c = lane % 4;
    unsigned* mine = lane_words[running];
    mine[0] = a[0]; mine[1] = a[1]; mine[2] = a[2]; mine[3] = a[3]; mine[4] = b0; mine[5] = b1;
    cupa_cpu_sync_group(32);
    auto element = [&](unsigned owner, int word, int k) {
        return cupa_cpu_half(cupa_cpu_word_of(owner, word) >> (16 * (k % 2)) & 0xffffu, bf16);
    };
    auto a_at = [&](unsigned row, int k) {  // A[row][k]
        const int word = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return element(4 * (row % 8) + (k % 8) / 2, word, k);
    };
    auto b_at = [&](int k, unsigned n) { return element(4 * n + (k % 8) / 2, k >= 8 ? 5 : 4, k); };
    for (int e = 0; e < 4; ++e) {
        const unsigned row = g + (e >= 2 ? 8 : 0), col = 2 * c + e % 2;
        float acc = d[e];
        for (int k = 0; k < 16; ++k) acc = std::fma(a_at(row, k), b_at(k, col), acc);
        d[e] = acc;
    }
    cupa_cpu_sync_group(32);
}

// mapa.shared::cluster and ld.shared::cluster: a remote address is the block's rank in bits
// 24-30 over the byte's offset in a block's copy of the shared ranges, bit 31 set.
static unsigned cupa_cpu_cluster_address(unsigned local, int rank) {
    return 0x80000000u | (unsigned)rank << 24 | (unsigned)shared_offset_of(shared_at(local));
}
static const char* cupa_cpu_cluster_byte(unsigned address) {
    return shared_of_block((int)(address >> 24 & 0x7fu), address & 0xffffffu);
}
static float cupa_cpu_cluster_load(unsigned address) {
    float x; memcpy(&x, cupa_cpu_cluster_byte(address), 4); return x;
}
static void cupa_cpu_cluster_load4(unsigned address, float* x) {
    memcpy(x, cupa_cpu_cluster_byte(address), 16);
}

// prmt.b32 (default mode): result byte i is byte (selector nibble i & 7) of {b, a}, or with the
// nibble's bit 3 that byte's sign bit replicated.
static unsigned cupa_cpu_prmt(unsigned a, unsigned b, unsigned selector) {
    const unsigned long long bytes = a | (unsigned long long)b << 32;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) {
        const unsigned nibble = selector >> (4 * i) & 0xfu;
        unsigned byte = bytes >> (8 * (nibble & 7u)) & 0xffu;
        if (nibble & 8u) byte = byte & 0x80u ? 0xffu : 0u;
        r |= byte << (8 * i);
    }
    return r;
}

// cvt.rn.f16x2.e4m3x2: two OCP e4m3fn codes as float16 (exact; 0x7f / 0xff NaN), lo in the
// low half.
static unsigned cupa_cpu_e4m3x2(unsigned lo, unsigned hi) {
    auto widen = [](unsigned code) -> unsigned {
        const unsigned sign = code >> 7, exponent = code >> 3 & 0xfu, mantissa = code & 7u;
        float value;
        if (exponent == 15 && mantissa == 7) value = NAN;
        else if (exponent == 0) value = std::ldexp((float)mantissa, -9);
        else value = std::ldexp(1.0f + mantissa / 8.0f, (int)exponent - 7);
        _Float16 h = (_Float16)(sign ? -value : value);
        unsigned short bits; memcpy(&bits, &h, 2); return bits;
    };
    return widen(lo) | widen(hi) << 16;
}

// cp.async of `bytes` (4 or 16) from src, zero-filled past `valid` bytes. A copy lands when
// its thread waits for its group (cp.async.wait_group), not before: until then its bytes hold
// poison (0xff: NaN in 16-bit floats, -1 as a block id), as a GPU's may hold anything. So a read
// before the wait, or of another thread's copy before a barrier after that thread's wait, or a
// copy issued into a stage still being read, shows in the results.
static void land(const PendingCopy& c) {
    memset(c.dst, 0, c.bytes);
    if (c.valid) memcpy(c.dst, c.src, c.valid);
}
static void cupa_cpu_copy(void* dst, const void* src, int valid, int bytes) {
    memset(dst, 0xff, bytes);
    open_copies[running].push_back({dst, src, valid, bytes});
}
static void cupa_cpu_commit_copies() {
    committed_copies[running].push_back(std::move(open_copies[running]));
    open_copies[running].clear();
}
static void cupa_cpu_wait_copies(int pending) {
    auto& groups = committed_copies[running];
    while ((int)groups.size() > pending) {
        for (const PendingCopy& c : groups.front()) land(c);
        groups.erase(groups.begin());
    }
}

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
    """C++ wrappers run_<kernel>(grid x, y, z, block, dynamic shared bytes, cluster x, y, z,
    params) and each kernel's parameter types."""
    wrappers, signatures = [], []
    for name, params in _KERNEL.findall(expanded):
        params = [p.strip() for p in params.split(",")]
        names = [p.split()[-1].lstrip("*") for p in params]
        wrappers.append(f'extern "C" __attribute__((visibility("default"))) void run_{name}('
                        f'unsigned gx, unsigned gy, unsigned gz, unsigned block, unsigned shared, '
                        f'unsigned cx, unsigned cy, unsigned cz, {", ".join(params)}) {{ '
                        f'cupa_cpu_dynamic_shared_bytes = shared; '
                        f'launch(Dim3{{gx, gy, gz}}, block, Dim3{{cx, cy, cz}}, '
                        f'[&] {{ {name}({", ".join(names)}); }}); }}')
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
        function.argtypes = [ctypes.c_uint] * 8 + [_argtype(p) for p in params]
        function.restype = None

    def __call__(self, grid, block, args, shared_mem=0, cluster=(1, 1, 1)):
        """grid: up to three dimensions; args: numpy arrays (their addresses), None (a null
        pointer) and scalars, one per parameter; shared_mem: the dynamic shared bytes (at most
        CUPA_CPU_DYNAMIC_SHARED_BYTES); cluster: the thread-block cluster's dimensions (its
        workgroups run together, each with its own shared memory)."""
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments, got {len(args)}")
        values = [a.ctypes.data if isinstance(a, np.ndarray) else None if a is None else
                  int(a) if isinstance(a, (np.integer, int)) else float(a) for a in args]
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        cx, cy, cz = (tuple(cluster) + (1, 1))[:3]
        self.function(gx, gy, gz, block[0], shared_mem, cx, cy, cz, *values)


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
def _library(source: str, defines: tuple, flags: tuple):
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
    _register_shared(loaded, library)
    return {name: CpuKernel(getattr(loaded, f"run_{name}"), params)
            for name, params in signatures}


def _register_shared(loaded, library: Path) -> None:
    """Tell the library where its kernels' __shared__ variables are, for the clusters: its
    local data symbols in namespace cupa (function-local statics, _ZZN4cupa...: the kernels
    have no statics but their shared memory)."""
    listing = subprocess.run(["nm", "--defined-only", "-S", str(library)], capture_output=True,
                             text=True, check=True).stdout
    ranges = [(int(address, 16), int(size, 16)) for address, size, kind, name in
              (line.split() for line in listing.splitlines() if len(line.split()) == 4)
              if kind in "bd" and name.startswith("_ZZN4cupa")]
    addresses = (ctypes.c_ulong * len(ranges))(*(a for a, _ in ranges))
    sizes = (ctypes.c_ulong * len(ranges))(*(n for _, n in ranges))
    loaded.cupa_cpu_register_shared(addresses, sizes, len(ranges))


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
