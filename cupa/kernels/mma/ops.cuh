// The tensor cores' operations: the 16-bit type they multiply in, query pairs and mma.sync m16n8k16.
// A section of decode_mma.cu (which includes the sections in order); see its header.
#pragma once
#include "../common.cuh"
#include "../decode_common.cuh"

// Workgroups per multiprocessor the register allocation must allow (a tuning knob).
#ifndef CUPA_MMA_MIN_BLOCKS
#define CUPA_MMA_MIN_BLOCKS 1
#endif

namespace cupa {

// Per-phase timestamps, for kernel development only (-DCUPA_PHASE_STAMPS through
// CUPA_EXTRA_OPTIONS; tools/phase_stamps.py reads them). Thread 0 of each workgroup records
// clock64 at mark k in cupa_phase_stamps[block][k], the global timer at the first and last marks
// and its multiprocessor. The marks (PHASE_*) are the kernels' phases; without the flag
// CUPA_PHASE_STAMP is empty.
enum { PHASE_START, PHASE_CLAIMED, PHASE_STREAM_STARTED, PHASE_FIRST_CHUNK, PHASE_CHUNKS_DONE,
       PHASE_COPIES_ENDED, PHASE_ROWS_SHARED, PHASE_DONE, PHASE_TIMER_START, PHASE_TIMER_END,
       PHASE_SM, PHASE_COLUMNS = 16 };
// The workgroup's place in the grid's launch order (x fastest, then y, then z).
CUPA_FN unsigned linear_block_id() {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
// The global timer, in nanoseconds.
CUPA_FN unsigned long long global_timer_ns() {
#if CUPA_CPU
    return 0;  // no stamps on the CPU
#else
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}

#ifdef CUPA_PHASE_STAMPS
constexpr unsigned PHASE_BLOCKS = 16384;  // workgroups recorded (the first of larger grids)
extern "C" __device__ unsigned long long cupa_phase_stamps[PHASE_BLOCKS][PHASE_COLUMNS];
__device__ unsigned long long cupa_phase_stamps[PHASE_BLOCKS][PHASE_COLUMNS];
CUPA_FN void phase_stamp(int k) {
    const unsigned b = linear_block_id();
    if (threadIdx.x != 0 || b >= PHASE_BLOCKS) return;
    unsigned long long* row = cupa_phase_stamps[b];
    row[k] = clock64();
    const unsigned long long t = global_timer_ns();
    if (k == PHASE_START) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        row[PHASE_TIMER_START] = t;
        row[PHASE_SM] = sm;
    }
    if (k == PHASE_DONE) row[PHASE_TIMER_END] = t;
}
#define CUPA_PHASE_STAMP(k) cupa::phase_stamp(cupa::k)
#else
#define CUPA_PHASE_STAMP(k)
#endif

// The 16-bit type the tensor cores multiply in: the query's, or float16 for an fp8 cache (its
// codes widen exactly to float16; a bfloat16 query is rounded to float16, which keeps its 8
// mantissa bits and loses only magnitudes outside float16's range).
template <typename T, typename C> struct MmaTypeOf { typedef T type; };
template <typename T> struct MmaTypeOf<T, cupa_fp8> { typedef cupa_f16 type; };
template <typename T> struct MmaTypeOf<T, cupa_fp8_e4m3> { typedef cupa_f16 type; };

// Two consecutive query elements of type T as a packed pair of the mma type M.
template <typename T, typename M> struct QPair {
    CUPA_FN static u32 load(const T* p) {
        float f[2];
        Elem<T>::widen_word(*reinterpret_cast<const u32*>(p), f);
        return Elem<M>::narrow_word(f[0], f[1]);
    }
};
template <typename T> struct QPair<T, T> {
    CUPA_FN static u32 load(const T* p) { return *reinterpret_cast<const u32*>(p); }
};

template <typename T> struct MmaOp;

template <> struct MmaOp<cupa_f16> {
    CUPA_FN static void run(float* d, const u32* a, u32 b0, u32 b1) {
#if CUPA_CPU
        cupa_cpu_mma_m16n8k16(d, a, b0, b1, false);
#else
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
    }
    // Two floats to a packed pair, the first in the low half.
    CUPA_FN static u32 pack(float lo, float hi) {
        return (u32)float_to_half_bits(lo) | ((u32)float_to_half_bits(hi) << 16);
    }
};

template <> struct MmaOp<cupa_bf16> {
    CUPA_FN static void run(float* d, const u32* a, u32 b0, u32 b1) {
#if CUPA_CPU
        cupa_cpu_mma_m16n8k16(d, a, b0, b1, true);
#else
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
    }
    CUPA_FN static u32 pack(float lo, float hi) {
#if CUPA_CPU
        return (u32)float_to_bf16_bits(lo) | ((u32)float_to_bf16_bits(hi) << 16);
#else
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
#endif
    }
};

}  // namespace cupa
