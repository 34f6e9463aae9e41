// AMD matrix instructions, AMD operand layouts, and the emulated AMD build.
//
// Three builds include this header:
//   CUPA_HIP=1                      a real AMD target: the amd_* matrix wrappers below are the
//                                   compiler's MFMA/WMMA builtins, nothing is emulated.
//   CUPA_EMULATE_AMD=1, CUPA_HIP=0  an AMD target's semantics compiled by NVRTC for an NVIDIA
//                                   GPU (sm_70 on, wave64 sm_80 on), so GPU tests run wave64, MFMA
//                                   and WMMA code where no AMD GPU is available. The wrappers
//                                   compute their instruction lane by lane by AMD's documented
//                                   layouts, and emu_wave_* give 64-lane wavefront shuffles.
//   neither                         plain NVIDIA: only the layouts and constants exist.
// Kernels never test CUPA_EMULATE_AMD: they call the amd_* wrappers and the warp helpers of
// common.cuh (which route to emu_wave_* when emulating), and every emulated behaviour lives here.
//
// The header stands alone (no common.cuh types), so common.cuh may include it anywhere; it
// needs CUPA_WARP, CUPA_HIP and CUPA_THREADS, as every kernel does.
//
// Emulated target: -DCUPA_EMULATE_GFX=0x90a, 0x942, 0x1100 or 0x1201 (hex spelling the gfx
// name). Without it, CUPA_WARP=64 means gfx942 and CUPA_WARP=32 gfx1100. It decides which
// wrappers exist, as the target's instruction set does on real hardware.
//
// What is and is not emulated: docs/amd_emulation.md. The layouts are AMD's Matrix Instruction
// Calculator's (tests/data/amd_matrix/); tests/test_amd_layouts.py evaluates every formula
// below against every entry of those tables.
#pragma once

#ifndef CUPA_EMULATE_AMD
#define CUPA_EMULATE_AMD 0
#endif
#if CUPA_EMULATE_AMD && CUPA_HIP
#error "CUPA_EMULATE_AMD is an NVRTC build of AMD semantics: it needs CUPA_HIP=0"
#endif

#define CUPA_AMD_FN __device__ inline __attribute__((always_inline))
// One-expression index formulas; tests/test_amd_layouts.py reads them out of this file and
// evaluates them in Python, so each body stays a single `return` of + - * / % on its int
// arguments.
#define CUPA_AMD_LAYOUT static __device__ constexpr inline int

// ---------------------------------------------------------------------------------------------
// Target limits

// LDS (shared memory) one workgroup may allocate: 64 KiB on CDNA2/CDNA3 and RDNA3/RDNA4 (the
// decode kernels compile for those). NVIDIA gives far more, so an emulated run alone would not
// notice a kernel that cannot launch on AMD; assert against this instead, at compile time:
//     CUPA_ASSERT_AMD_LDS(static_bytes + max_dynamic_bytes);
// (a no-op on NVIDIA builds) and at launch, on the host, for AMD and emulated targets:
//     dynamic_bytes + kernel.attributes["shared_size_bytes"]
//         <= AMD_LDS_BYTES + (CUPA_EMU_SCRATCH_BYTES if emulated else 0)
// The emulation's own scratch (below) stands for AMD's cross-lane hardware, not for LDS a
// kernel allocates, so it is not charged against the 64 KiB; a kernel that does not use it is
// allowed that much slack by the host form (the compile-time form has none).
#define CUPA_AMD_LDS_BYTES 65536
constexpr int AMD_LDS_BYTES = CUPA_AMD_LDS_BYTES;
#if CUPA_HIP || CUPA_EMULATE_AMD
#define CUPA_ASSERT_AMD_LDS(bytes) \
    static_assert((bytes) <= CUPA_AMD_LDS_BYTES, "workgroup LDS above AMD's 64 KiB")
#else
#define CUPA_ASSERT_AMD_LDS(bytes) static_assert(true, "")
#endif

// ---------------------------------------------------------------------------------------------
// Operand layouts (AMD's; no modifiers: CBSZ = ABID = BLGP = 0, OPSEL = 0).
//
// One struct per layout. A is M x K, B is K x N, C and D are M x N, BLOCKS independent
// products per instruction. A and B share one formula with row = i for A[i][k] and row = j for
// B[k][j] (true of every instruction here; the tables test it).
//   ab_lane/ab_reg/ab_slot(block, row, k, copy): the lane, VGPR and element slot (bits
//       slot*BITS up) of copy `copy` (< COPIES) of that element.
//   d_block/d_row/d_col(lane, reg): the element of C and D that VGPR `reg` of `lane` holds.
// The real MFMA kernel places its operands with these same functions, emulated or not.

// v_mfma_f32_16x16x16_f16 / _bf16 (gfx90a: ..16x16x16f16, ..16x16x16bf16_1k), wave64.
// Lanes 16q..16q+15 hold k = 4q..4q+3 of rows 0..15; D row 4q + reg, column lane % 16.
struct AmdLayoutMfma16x16x16 {
    static constexpr int WAVE = 64, BLOCKS = 1, M = 16, N = 16, K = 16;
    static constexpr int AB_REGS = 2, D_REGS = 4, BITS = 16, COPIES = 1;
    CUPA_AMD_LAYOUT ab_lane(int block, int row, int k, int copy) { return 16 * (k / 4) + row; }
    CUPA_AMD_LAYOUT ab_reg(int block, int row, int k, int copy) { return (k / 2) % 2; }
    CUPA_AMD_LAYOUT ab_slot(int block, int row, int k, int copy) { return k % 2; }
    CUPA_AMD_LAYOUT d_block(int lane, int reg) { return 0; }
    CUPA_AMD_LAYOUT d_row(int lane, int reg) { return 4 * (lane / 16) + reg; }
    CUPA_AMD_LAYOUT d_col(int lane, int reg) { return lane % 16; }
};

// v_mfma_f32_4x4x4_16b_f16 / _bf16 (gfx90a: ..4x4x4f16, ..4x4x4bf16_1k), wave64: 16 blocks,
// block b in lanes 4b..4b+3.
struct AmdLayoutMfma4x4x4 {
    static constexpr int WAVE = 64, BLOCKS = 16, M = 4, N = 4, K = 4;
    static constexpr int AB_REGS = 2, D_REGS = 4, BITS = 16, COPIES = 1;
    CUPA_AMD_LAYOUT ab_lane(int block, int row, int k, int copy) { return 4 * block + row; }
    CUPA_AMD_LAYOUT ab_reg(int block, int row, int k, int copy) { return k / 2; }
    CUPA_AMD_LAYOUT ab_slot(int block, int row, int k, int copy) { return k % 2; }
    CUPA_AMD_LAYOUT d_block(int lane, int reg) { return lane / 4; }
    CUPA_AMD_LAYOUT d_row(int lane, int reg) { return reg; }
    CUPA_AMD_LAYOUT d_col(int lane, int reg) { return lane % 4; }
};

// v_mfma_f32_16x16x32_fp8_fp8 (gfx942), wave64: four fp8 per VGPR, lanes 16q.. hold
// k = 8q..8q+7. D as the 16x16x16 form.
struct AmdLayoutMfma16x16x32Fp8 {
    static constexpr int WAVE = 64, BLOCKS = 1, M = 16, N = 16, K = 32;
    static constexpr int AB_REGS = 2, D_REGS = 4, BITS = 8, COPIES = 1;
    CUPA_AMD_LAYOUT ab_lane(int block, int row, int k, int copy) { return 16 * (k / 8) + row; }
    CUPA_AMD_LAYOUT ab_reg(int block, int row, int k, int copy) { return (k / 4) % 2; }
    CUPA_AMD_LAYOUT ab_slot(int block, int row, int k, int copy) { return k % 4; }
    CUPA_AMD_LAYOUT d_block(int lane, int reg) { return 0; }
    CUPA_AMD_LAYOUT d_row(int lane, int reg) { return 4 * (lane / 16) + reg; }
    CUPA_AMD_LAYOUT d_col(int lane, int reg) { return lane % 16; }
};

// RDNA3 (gfx11) v_wmma_f32_16x16x16_f16 / _bf16, wave32. Each lane holds a whole row (A) or
// column (B), all 16 k, and the two half-waves hold the same data: lanes i and i + 16 are
// copies 0 and 1. D: row 2 * reg + lane / 16, column lane % 16.
struct AmdLayoutWmmaGfx11 {
    static constexpr int WAVE = 32, BLOCKS = 1, M = 16, N = 16, K = 16;
    static constexpr int AB_REGS = 8, D_REGS = 8, BITS = 16, COPIES = 2;
    CUPA_AMD_LAYOUT ab_lane(int block, int row, int k, int copy) { return 16 * copy + row; }
    CUPA_AMD_LAYOUT ab_reg(int block, int row, int k, int copy) { return k / 2; }
    CUPA_AMD_LAYOUT ab_slot(int block, int row, int k, int copy) { return k % 2; }
    CUPA_AMD_LAYOUT d_block(int lane, int reg) { return 0; }
    CUPA_AMD_LAYOUT d_row(int lane, int reg) { return 2 * reg + lane / 16; }
    CUPA_AMD_LAYOUT d_col(int lane, int reg) { return lane % 16; }
};

// RDNA4 (gfx12) v_wmma_f32_16x16x16_f16 / _bf16, wave32: no replication; lanes 0-15 hold
// k = 0..3 and 8..11, lanes 16-31 k = 4..7 and 12..15 (AMD's table; a kernel that places A and
// B with the same formula is indifferent to this order of k). D: row 8 * (lane / 16) + reg.
struct AmdLayoutWmmaGfx12 {
    static constexpr int WAVE = 32, BLOCKS = 1, M = 16, N = 16, K = 16;
    static constexpr int AB_REGS = 4, D_REGS = 8, BITS = 16, COPIES = 1;
    CUPA_AMD_LAYOUT ab_lane(int block, int row, int k, int copy) {
        return 16 * ((k / 4) % 2) + row;
    }
    CUPA_AMD_LAYOUT ab_reg(int block, int row, int k, int copy) {
        return 2 * (k / 8) + (k / 2) % 2;
    }
    CUPA_AMD_LAYOUT ab_slot(int block, int row, int k, int copy) { return k % 2; }
    CUPA_AMD_LAYOUT d_block(int lane, int reg) { return 0; }
    CUPA_AMD_LAYOUT d_row(int lane, int reg) { return 8 * (lane / 16) + reg; }
    CUPA_AMD_LAYOUT d_col(int lane, int reg) { return lane % 16; }
};

// RDNA4 (gfx12) v_wmma_f32_16x16x16_fp8_fp8, wave32: lanes 16q.. hold k = 8q..8q+7, four a
// VGPR. D as the 16-bit form.
struct AmdLayoutWmmaGfx12Fp8 {
    static constexpr int WAVE = 32, BLOCKS = 1, M = 16, N = 16, K = 16;
    static constexpr int AB_REGS = 2, D_REGS = 8, BITS = 8, COPIES = 1;
    CUPA_AMD_LAYOUT ab_lane(int block, int row, int k, int copy) { return 16 * (k / 8) + row; }
    CUPA_AMD_LAYOUT ab_reg(int block, int row, int k, int copy) { return (k / 4) % 2; }
    CUPA_AMD_LAYOUT ab_slot(int block, int row, int k, int copy) { return k % 4; }
    CUPA_AMD_LAYOUT d_block(int lane, int reg) { return 0; }
    CUPA_AMD_LAYOUT d_row(int lane, int reg) { return 8 * (lane / 16) + reg; }
    CUPA_AMD_LAYOUT d_col(int lane, int reg) { return lane % 16; }
};

// ---------------------------------------------------------------------------------------------
// Which matrix instructions the target has (0/1 each). Real AMD: from the compiler's target
// macros. Emulated: from CUPA_EMULATE_GFX. NVIDIA: none. CUPA_AMD_FP8_CVT: the fp8 codes
// v_cvt_pk_f32_fp8 reads, 1 e4m3fnuz (gfx94x), 2 OCP e4m3 (gfx12), 0 no such instruction
// (or, on gfx950, none cupa relies on yet).
#if CUPA_EMULATE_AMD
#ifndef CUPA_EMULATE_GFX
#define CUPA_EMULATE_GFX (CUPA_WARP == 64 ? 0x942 : 0x1100)
#endif
#if CUPA_EMULATE_GFX != 0x90a && CUPA_EMULATE_GFX != 0x942 && CUPA_EMULATE_GFX != 0x1100 && \
    CUPA_EMULATE_GFX != 0x1201
#error "CUPA_EMULATE_GFX: one of 0x90a, 0x942, 0x1100, 0x1201"
#endif
#if (CUPA_EMULATE_GFX < 0x1000) != (CUPA_WARP == 64)
#error "emulated CDNA (gfx9) runs wave64 and RDNA (gfx11/12) wave32: CUPA_WARP does not match"
#endif
#define CUPA_AMD_MFMA (CUPA_EMULATE_GFX == 0x90a || CUPA_EMULATE_GFX == 0x942)
#define CUPA_AMD_MFMA_FP8 (CUPA_EMULATE_GFX == 0x942)
#define CUPA_AMD_WMMA_GFX11 (CUPA_EMULATE_GFX == 0x1100)
#define CUPA_AMD_WMMA_GFX12 (CUPA_EMULATE_GFX == 0x1201)
#define CUPA_AMD_FP8_CVT (CUPA_EMULATE_GFX == 0x942 ? 1 : CUPA_EMULATE_GFX == 0x1201 ? 2 : 0)
#elif CUPA_HIP && (defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || \
                   defined(__gfx942__) || defined(__gfx950__))
#define CUPA_AMD_MFMA 1
// gfx950's fp8 MFMA reads OCP e4m3, not gfx94x's e4m3fnuz: a different instruction for us.
#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define CUPA_AMD_MFMA_FP8 1
#define CUPA_AMD_FP8_CVT 1
#else
#define CUPA_AMD_MFMA_FP8 0
#define CUPA_AMD_FP8_CVT 0  // gfx950: its conversions' format is not checked here; software
#endif
#define CUPA_AMD_WMMA_GFX11 0
#define CUPA_AMD_WMMA_GFX12 0
#elif CUPA_HIP && defined(__GFX11__)
#define CUPA_AMD_MFMA 0
#define CUPA_AMD_MFMA_FP8 0
#define CUPA_AMD_WMMA_GFX11 (CUPA_WARP == 32)
#define CUPA_AMD_WMMA_GFX12 0
#elif CUPA_HIP && defined(__GFX12__)
#define CUPA_AMD_MFMA 0
#define CUPA_AMD_MFMA_FP8 0
#define CUPA_AMD_WMMA_GFX11 0
#define CUPA_AMD_WMMA_GFX12 (CUPA_WARP == 32)
#define CUPA_AMD_FP8_CVT 2
#else
#define CUPA_AMD_MFMA 0
#define CUPA_AMD_MFMA_FP8 0
#define CUPA_AMD_WMMA_GFX11 0
#define CUPA_AMD_WMMA_GFX12 0
#endif
#ifndef CUPA_AMD_FP8_CVT
#define CUPA_AMD_FP8_CVT 0
#endif

// Operands as VGPRs: r[n] is the n-th register of this lane's operand, 16-bit elements two to a
// register (the lower k in bits 15:0), fp8 four (the lowest k in bits 7:0). That is how the
// layouts above count, and what common.cuh's bit-container types pack into.
struct amd_u32x2 { unsigned int r[2]; };
struct amd_u32x4 { unsigned int r[4]; };
struct amd_u32x8 { unsigned int r[8]; };
struct amd_f32x2 { float r[2]; };
struct amd_f32x4 { float r[4]; };
struct amd_f32x8 { float r[8]; };

// ---------------------------------------------------------------------------------------------
// The emulation (NVRTC, or the host compiler for CUPA_CPU)
#if CUPA_EMULATE_AMD

namespace cupa_emu {

// A wavefront is CUPA_WARP consecutive threads of the workgroup, as on AMD; wave64 is two
// NVIDIA warps. Every lane of a wavefront must reach each wave-collective call below (no early
// exits or lane-divergent branches around them; shuffle sources may differ per lane, xor masks
// may not), and the workgroup must be whole wavefronts of at most CUPA_THREADS threads.
constexpr int WAVES = CUPA_THREADS / CUPA_WARP;
static_assert(CUPA_THREADS % CUPA_WARP == 0, "workgroups are whole wavefronts");

// Per-wavefront scratch, in 32-bit words: the largest user is RDNA3's WMMA (A and B, 8 VGPRs
// each, 32 lanes); wave64's are the MFMAs (2 + 2 VGPRs, 64 lanes) and the shuffles (64 lanes).
constexpr int WORDS = CUPA_WARP == 64 ? 4 * 64 : 16 * 32;
__shared__ unsigned int scratch[WAVES][WORDS];

CUPA_AMD_FN int thread_rank() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
CUPA_AMD_FN int lane() { return thread_rank() % CUPA_WARP; }
CUPA_AMD_FN unsigned int* wave_scratch() { return scratch[thread_rank() / CUPA_WARP]; }

// wave64's barrier: one mbarrier per wavefront (64 arrivals a phase), in shared memory. Not a
// named barrier (`bar.sync 1 + wave, 64`), though that orders the same: compute-sanitizer's
// racecheck (2025.3) then reports hazards between wavefronts across later __syncthreads
// whenever some wavefronts ran more named barriers than others, as a workgroup's waves do
// (docs/amd_emulation.md, "Under compute-sanitizer"); with mbarriers it reports none.
__shared__ unsigned long long wave_barriers[WAVES];

#if !CUPA_CPU
CUPA_AMD_FN unsigned int wave_barrier_address() {
    return (unsigned int)__cvta_generic_to_shared(&wave_barriers[thread_rank() / CUPA_WARP]);
}
#endif

// Every thread of the workgroup, before the first wavefront operation: initialises wave64's
// barriers (nothing for wave32, or on the CPU).
CUPA_AMD_FN void begin_workgroup() {
#if !CUPA_CPU && CUPA_WARP == 64
#if __CUDA_ARCH__ < 800
#error "the emulated wave64 barrier is an mbarrier: it needs sm_80 or later"
#endif
    if (lane() == 0)
        asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(wave_barrier_address()),
                     "r"(CUPA_WARP) : "memory");
    __syncthreads();
#endif
}

// Wavefront barrier with memory ordering among its lanes (the mbarrier's arrive releases, its
// wait acquires), so the other wavefronts run on; wave32 is one NVIDIA warp. The CPU build
// (CUPA_CPU) meets its wavefront's coroutines at its scheduler's barrier instead.
CUPA_AMD_FN void wave_sync() {
#if CUPA_CPU
    cupa_cpu_sync_group(CUPA_WARP);
#elif CUPA_WARP == 64
    const unsigned int bar = wave_barrier_address();
    unsigned long long phase;
    asm volatile("mbarrier.arrive.shared.b64 %0, [%1];" : "=l"(phase) : "r"(bar) : "memory");
    unsigned int done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.test_wait.shared.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(bar), "l"(phase) : "memory");
    } while (!done);
#else
    __syncwarp();
#endif
}

// Exchange through scratch: write, barrier, read, barrier. The second barrier keeps the next
// exchange's writes from overtaking a slow lane's read of this one.
CUPA_AMD_FN unsigned int exchange(unsigned int v, int src) {
    unsigned int* s = wave_scratch();
    s[lane()] = v;
    wave_sync();
    const unsigned int r = s[src];
    wave_sync();
    return r;
}

// lane ^ lane_mask, HIP's way: a partner outside the wavefront (lane_mask >= CUPA_WARP, or
// negative) means the lane's own value. The mask must be the same in all lanes of the
// wavefront (a loop constant wherever cupa shuffles): wave64 picks the warp-shuffle or the
// barrier path on it, and lanes on different paths would never meet at the barrier.
CUPA_AMD_FN unsigned int xor_bits(unsigned int v, int lane_mask) {
    const unsigned int mask = (unsigned int)lane_mask;
#if CUPA_WARP == 64
    // Within a half-wave (bit 5 clear), an NVIDIA warp shuffle is the same exchange.
    if (mask < 32u) return __shfl_xor_sync(0xffffffffu, v, (int)mask, 32);
    const unsigned int l = (unsigned int)lane(), src = l ^ mask;
    return exchange(v, (int)(src < 64u ? src : l));
#else
    // Branch-free, so every lane of the warp reaches the shuffle whatever its mask.
    const unsigned int r = __shfl_xor_sync(0xffffffffu, v, (int)(mask & 31u), 32);
    return mask < 32u ? r : v;
#endif
}

// HIP's __shfl at width CUPA_WARP: the source lane modulo the wavefront (any value, any lane).
CUPA_AMD_FN unsigned int shfl_bits(unsigned int v, int src_lane) {
#if CUPA_WARP == 64
    return exchange(v, src_lane & 63);
#else
    return __shfl_sync(0xffffffffu, v, src_lane & 31, 32);
#endif
}

// Subnormals. AMD documents that gfx90a's (MI200's) f16 and bf16 MFMAs flush subnormal input
// and output data to zero (ROCm MIOpen docs, "MI200 matrix fused multiply-add (MFMA) behavior
// specifics"); for the other targets no flushing is documented, so they are emulated with IEEE
// subnormals. Either way explicitly: fmaf would follow NVRTC's -ftz=true, which cupy sets.
#define CUPA_EMU_MMA_FLUSHES (CUPA_EMULATE_GFX == 0x90a)

CUPA_AMD_FN float mma_step(float a, float b, float acc) {
#if CUPA_CPU
    return cupa_cpu_fma(a, b, acc, CUPA_EMU_MMA_FLUSHES);
#else
    float r;
#if CUPA_EMU_MMA_FLUSHES
    asm("fma.rn.ftz.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(acc));
#else
    asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(acc));
#endif
    return r;
#endif  // CUPA_CPU
}

// Element decoding, exact. The matrix cores' inputs are f16, bf16 or e4m3 (two encodings).
enum { F16 = 0, BF16 = 1, FP8_FNUZ = 2, FP8_OCP = 3 };

template <int FMT>
CUPA_AMD_FN float decode(unsigned int code) {
    if (FMT == F16) {
        // f16 subnormals are float32 normals, so ftz alone would keep them: flush them here.
        if (CUPA_EMU_MMA_FLUSHES && (code & 0x7c00u) == 0u) return (code & 0x8000u) ? -0.0f : 0.0f;
#if CUPA_CPU
        return (float)__builtin_bit_cast(_Float16, (unsigned short)code);
#else
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)code));
        return f;
#endif
    } else if (FMT == BF16) {
        return __uint_as_float(code << 16);
    } else {
        // e4m3: bias 8 (gfx94x's fnuz: 0x80 is the only NaN, no -0) or 7 (OCP: S.1111.111 is
        // NaN); exponent 0 is subnormal, m * 2^(1 - bias - 3).
        const int bias = FMT == FP8_FNUZ ? 8 : 7;
        const bool nan = FMT == FP8_FNUZ ? code == 0x80u : (code & 0x7fu) == 0x7fu;
        if (nan) return __uint_as_float(0x7fc00000u);
        const unsigned int e = (code >> 3) & 15u, m = code & 7u;
        const float magnitude =
            e == 0 ? (float)m * __uint_as_float((unsigned int)(127 + 1 - bias - 3) << 23)
                   : __uint_as_float(((e + 127u - bias) << 23) | (m << 20));
        return (code & 0x80u) ? -magnitude : magnitude;
    }
}

// D = A B + C for one wavefront, lane by lane: every lane stores its A and B registers in the
// wavefront's scratch, then computes its own D registers, each from the K products that the
// layout places in other lanes' registers. Float32, k ascending from C, one rounding a step
// (an fma whose product is exact: always for f16 and fp8, for bf16 unless it leaves float32's
// range; subnormals as mma_step says), so one fixed, reproducible order; tests/amd_layouts.py's
// reference_mma computes the same bits. The hardware's order and internal precision are not documented and not claimed.
// Replicated operands (RDNA3) must agree in all copies: the hardware's choice of copy is
// unspecified, so any disagreement makes the D elements it feeds NaN.
template <class L, int FMT>
CUPA_AMD_FN void mma(const unsigned int* a, const unsigned int* b, const float* c, float* d) {
    static_assert(L::WAVE == CUPA_WARP, "instruction for another wavefront size");
    static_assert(2 * L::AB_REGS * L::WAVE <= WORDS, "scratch too small");
    unsigned int* s = wave_scratch();
    const unsigned int* sb = s + L::AB_REGS * L::WAVE;
    const int l = lane();
#pragma unroll
    for (int r = 0; r < L::AB_REGS; ++r) {
        s[r * L::WAVE + l] = a[r];
        s[(L::AB_REGS + r) * L::WAVE + l] = b[r];
    }
    wave_sync();
    constexpr unsigned int MASK = (1u << L::BITS) - 1u;
#pragma unroll
    for (int r = 0; r < L::D_REGS; ++r) {
        const int blk = L::d_block(l, r), i = L::d_row(l, r), j = L::d_col(l, r);
        float acc = c[r];
        bool poisoned = false;
#pragma unroll 4
        for (int k = 0; k < L::K; ++k) {
            unsigned int ak = 0, bk = 0;
#pragma unroll
            for (int copy = 0; copy < L::COPIES; ++copy) {
                const unsigned int av = (s[L::ab_reg(blk, i, k, copy) * L::WAVE +
                                           L::ab_lane(blk, i, k, copy)] >>
                                         (L::ab_slot(blk, i, k, copy) * L::BITS)) & MASK;
                const unsigned int bv = (sb[L::ab_reg(blk, j, k, copy) * L::WAVE +
                                            L::ab_lane(blk, j, k, copy)] >>
                                         (L::ab_slot(blk, j, k, copy) * L::BITS)) & MASK;
                if (copy == 0) {
                    ak = av;
                    bk = bv;
                } else {
                    poisoned |= av != ak || bv != bk;
                }
            }
            acc = mma_step(decode<FMT>(ak), decode<FMT>(bk), acc);
        }
        d[r] = poisoned ? __uint_as_float(0x7fc00000u) : acc;
    }
    wave_sync();
}

}  // namespace cupa_emu

// The first call of every kernel that uses what follows, by every thread (common.cuh's
// begin_workgroup, which begin_partition makes).
CUPA_AMD_FN void emu_begin_workgroup() { cupa_emu::begin_workgroup(); }

// Wavefront-wide cross-lane operations, HIP's semantics at width CUPA_WARP. common.cuh's
// warp_xor routes here when emulating, so warp_max / warp_sum keep their butterfly order.
CUPA_AMD_FN float emu_wave_xor(float v, int lane_mask) {
    return __uint_as_float(cupa_emu::xor_bits(__float_as_uint(v), lane_mask));
}
CUPA_AMD_FN unsigned int emu_wave_xor(unsigned int v, int lane_mask) {
    return cupa_emu::xor_bits(v, lane_mask);
}
CUPA_AMD_FN int emu_wave_xor(int v, int lane_mask) {
    return (int)cupa_emu::xor_bits((unsigned int)v, lane_mask);
}
CUPA_AMD_FN float emu_wave_shfl(float v, int src_lane) {
    return __uint_as_float(cupa_emu::shfl_bits(__float_as_uint(v), src_lane));
}
CUPA_AMD_FN unsigned int emu_wave_shfl(unsigned int v, int src_lane) {
    return cupa_emu::shfl_bits(v, src_lane);
}
CUPA_AMD_FN int emu_wave_shfl(int v, int src_lane) {
    return (int)cupa_emu::shfl_bits((unsigned int)v, src_lane);
}

// Bit n set when lane n's predicate holds (bits above CUPA_WARP clear), as HIP's __ballot.
CUPA_AMD_FN unsigned long long emu_wave_ballot(int predicate) {
    const unsigned int half = __ballot_sync(0xffffffffu, predicate);
#if CUPA_WARP == 64
    unsigned int* s = cupa_emu::wave_scratch();
    const int l = cupa_emu::lane();
    if ((l & 31) == 0) s[l >> 5] = half;
    cupa_emu::wave_sync();
    const unsigned long long r = s[0] | ((unsigned long long)s[1] << 32);
    cupa_emu::wave_sync();
    return r;
#else
    return half;
#endif
}
CUPA_AMD_FN bool emu_wave_any(int predicate) { return emu_wave_ballot(predicate) != 0ull; }
CUPA_AMD_FN bool emu_wave_all(int predicate) {
    return emu_wave_ballot(predicate) == (CUPA_WARP == 64 ? ~0ull : 0xffffffffull);
}

// The same butterflies as common.cuh's warp_max / warp_sum, for callers outside common.cuh.
CUPA_AMD_FN float emu_wave_max(float v) {
#pragma unroll
    for (int m = CUPA_WARP / 2; m > 0; m >>= 1) {
        const float o = emu_wave_xor(v, m);
        v = v > o ? v : o;
    }
    return v;
}
CUPA_AMD_FN float emu_wave_sum(float v) {
#pragma unroll
    for (int m = CUPA_WARP / 2; m > 0; m >>= 1) v += emu_wave_xor(v, m);
    return v;
}

// Shared memory the emulation adds to a kernel that uses it (see CUPA_ASSERT_AMD_LDS).
#define CUPA_EMU_SCRATCH_BYTES \
    (CUPA_THREADS / CUPA_WARP * ((CUPA_WARP == 64 ? 4 * 64 : 16 * 32) * 4 + 8))
static_assert(CUPA_EMU_SCRATCH_BYTES ==
                  sizeof(cupa_emu::scratch) + sizeof(cupa_emu::wave_barriers),
              "scratch size restated");

#define CUPA_AMD_EMULATED_MMA(LAYOUT, FMT, DTYPE, A, B, C) \
    DTYPE d_;                                             \
    cupa_emu::mma<LAYOUT, cupa_emu::FMT>(A.r, B.r, C.r, d_.r); \
    return d_;
#else
#define CUPA_EMU_SCRATCH_BYTES 0
#endif  // CUPA_EMULATE_AMD

// ---------------------------------------------------------------------------------------------
// The matrix instructions: one wrapper per instruction, defined where the target has it.
// Real AMD: the builtin, with no modifiers. Emulated: cupa_emu::mma by the layout named.

#if CUPA_HIP
#define CUPA_AMD_VEC(T, N) T __attribute__((ext_vector_type(N)))
#define CUPA_AMD_BITCAST(T, v) __builtin_bit_cast(T, v)
#endif

#if CUPA_AMD_MFMA
// v_mfma_f32_16x16x16_f16 (gfx90a: v_mfma_f32_16x16x16f16); layout AmdLayoutMfma16x16x16.
CUPA_AMD_FN amd_f32x4 amd_mfma_f32_16x16x16_f16(amd_u32x2 a, amd_u32x2 b, amd_f32x4 c) {
#if CUPA_EMULATE_AMD
    CUPA_AMD_EMULATED_MMA(AmdLayoutMfma16x16x16, F16, amd_f32x4, a, b, c)
#else
    typedef CUPA_AMD_VEC(_Float16, 4) h4;
    typedef CUPA_AMD_VEC(float, 4) f4;
    return CUPA_AMD_BITCAST(amd_f32x4, __builtin_amdgcn_mfma_f32_16x16x16f16(
        CUPA_AMD_BITCAST(h4, a), CUPA_AMD_BITCAST(h4, b), CUPA_AMD_BITCAST(f4, c), 0, 0, 0));
#endif
}

// v_mfma_f32_16x16x16_bf16 (gfx90a: v_mfma_f32_16x16x16bf16_1k); layout AmdLayoutMfma16x16x16.
CUPA_AMD_FN amd_f32x4 amd_mfma_f32_16x16x16_bf16(amd_u32x2 a, amd_u32x2 b, amd_f32x4 c) {
#if CUPA_EMULATE_AMD
    CUPA_AMD_EMULATED_MMA(AmdLayoutMfma16x16x16, BF16, amd_f32x4, a, b, c)
#else
    typedef CUPA_AMD_VEC(short, 4) s4;
    typedef CUPA_AMD_VEC(float, 4) f4;
    return CUPA_AMD_BITCAST(amd_f32x4, __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(
        CUPA_AMD_BITCAST(s4, a), CUPA_AMD_BITCAST(s4, b), CUPA_AMD_BITCAST(f4, c), 0, 0, 0));
#endif
}

// v_mfma_f32_4x4x4_16b_f16 (gfx90a: v_mfma_f32_4x4x4f16); layout AmdLayoutMfma4x4x4.
CUPA_AMD_FN amd_f32x4 amd_mfma_f32_4x4x4_f16(amd_u32x2 a, amd_u32x2 b, amd_f32x4 c) {
#if CUPA_EMULATE_AMD
    CUPA_AMD_EMULATED_MMA(AmdLayoutMfma4x4x4, F16, amd_f32x4, a, b, c)
#else
    typedef CUPA_AMD_VEC(_Float16, 4) h4;
    typedef CUPA_AMD_VEC(float, 4) f4;
    return CUPA_AMD_BITCAST(amd_f32x4, __builtin_amdgcn_mfma_f32_4x4x4f16(
        CUPA_AMD_BITCAST(h4, a), CUPA_AMD_BITCAST(h4, b), CUPA_AMD_BITCAST(f4, c), 0, 0, 0));
#endif
}

// v_mfma_f32_4x4x4_16b_bf16 (gfx90a: v_mfma_f32_4x4x4bf16_1k); layout AmdLayoutMfma4x4x4.
CUPA_AMD_FN amd_f32x4 amd_mfma_f32_4x4x4_bf16(amd_u32x2 a, amd_u32x2 b, amd_f32x4 c) {
#if CUPA_EMULATE_AMD
    CUPA_AMD_EMULATED_MMA(AmdLayoutMfma4x4x4, BF16, amd_f32x4, a, b, c)
#else
    typedef CUPA_AMD_VEC(short, 4) s4;
    typedef CUPA_AMD_VEC(float, 4) f4;
    return CUPA_AMD_BITCAST(amd_f32x4, __builtin_amdgcn_mfma_f32_4x4x4bf16_1k(
        CUPA_AMD_BITCAST(s4, a), CUPA_AMD_BITCAST(s4, b), CUPA_AMD_BITCAST(f4, c), 0, 0, 0));
#endif
}
#endif  // CUPA_AMD_MFMA

#if CUPA_AMD_MFMA_FP8
// v_mfma_f32_16x16x32_fp8_fp8 (gfx94x: e4m3fnuz inputs); layout AmdLayoutMfma16x16x32Fp8.
CUPA_AMD_FN amd_f32x4 amd_mfma_f32_16x16x32_fp8_fp8(amd_u32x2 a, amd_u32x2 b, amd_f32x4 c) {
#if CUPA_EMULATE_AMD
    CUPA_AMD_EMULATED_MMA(AmdLayoutMfma16x16x32Fp8, FP8_FNUZ, amd_f32x4, a, b, c)
#else
    typedef CUPA_AMD_VEC(float, 4) f4;
    return CUPA_AMD_BITCAST(amd_f32x4, __builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8(
        CUPA_AMD_BITCAST(long, a), CUPA_AMD_BITCAST(long, b), CUPA_AMD_BITCAST(f4, c), 0, 0, 0));
#endif
}
#endif  // CUPA_AMD_MFMA_FP8

// The 16-bit WMMA wrappers differ only in name, layout, element type and builtin: one macro.
// NAME(A a, A b, amd_f32x8 c) with A the operand's register struct; ELEM x N the builtin's
// vector type for it.
#define CUPA_AMD_WMMA16(NAME, LAYOUT, FMT, A, ELEM, N, BUILTIN)                                  \
    CUPA_AMD_FN amd_f32x8 NAME(A a, A b, amd_f32x8 c) {                                          \
        CUPA_AMD_WMMA16_BODY(LAYOUT, FMT, ELEM, N, BUILTIN)                                      \
    }
#if CUPA_EMULATE_AMD
#define CUPA_AMD_WMMA16_BODY(LAYOUT, FMT, ELEM, N, BUILTIN)                                      \
    CUPA_AMD_EMULATED_MMA(LAYOUT, FMT, amd_f32x8, a, b, c)
#else
#define CUPA_AMD_WMMA16_BODY(LAYOUT, FMT, ELEM, N, BUILTIN)                                      \
    typedef CUPA_AMD_VEC(ELEM, N) in_t;                                                          \
    typedef CUPA_AMD_VEC(float, 8) f8;                                                           \
    return CUPA_AMD_BITCAST(amd_f32x8, BUILTIN(CUPA_AMD_BITCAST(in_t, a),                        \
                                               CUPA_AMD_BITCAST(in_t, b),                        \
                                               CUPA_AMD_BITCAST(f8, c)));
#endif

#if CUPA_AMD_WMMA_GFX11
// RDNA3 v_wmma_f32_16x16x16_f16 / _bf16, wave32; layout AmdLayoutWmmaGfx11 (A, B in both
// half-waves).
CUPA_AMD_WMMA16(amd_wmma_gfx11_f32_16x16x16_f16, AmdLayoutWmmaGfx11, F16, amd_u32x8, _Float16, 16,
                __builtin_amdgcn_wmma_f32_16x16x16_f16_w32)
CUPA_AMD_WMMA16(amd_wmma_gfx11_f32_16x16x16_bf16, AmdLayoutWmmaGfx11, BF16, amd_u32x8, short, 16,
                __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32)
#endif  // CUPA_AMD_WMMA_GFX11

#if CUPA_AMD_WMMA_GFX12
// RDNA4 v_wmma_f32_16x16x16_f16 / _bf16, wave32; layout AmdLayoutWmmaGfx12.
CUPA_AMD_WMMA16(amd_wmma_gfx12_f32_16x16x16_f16, AmdLayoutWmmaGfx12, F16, amd_u32x4, _Float16, 8,
                __builtin_amdgcn_wmma_f32_16x16x16_f16_w32_gfx12)
CUPA_AMD_WMMA16(amd_wmma_gfx12_f32_16x16x16_bf16, AmdLayoutWmmaGfx12, BF16, amd_u32x4, short, 8,
                __builtin_amdgcn_wmma_f32_16x16x16_bf16_w32_gfx12)

// RDNA4 v_wmma_f32_16x16x16_fp8_fp8 (OCP e4m3 inputs), wave32; layout AmdLayoutWmmaGfx12Fp8.
CUPA_AMD_FN amd_f32x8 amd_wmma_gfx12_f32_16x16x16_fp8_fp8(amd_u32x2 a, amd_u32x2 b, amd_f32x8 c) {
#if CUPA_EMULATE_AMD
    CUPA_AMD_EMULATED_MMA(AmdLayoutWmmaGfx12Fp8, FP8_OCP, amd_f32x8, a, b, c)
#else
    typedef CUPA_AMD_VEC(int, 2) i2;
    typedef CUPA_AMD_VEC(float, 8) f8;
    return CUPA_AMD_BITCAST(amd_f32x8, __builtin_amdgcn_wmma_f32_16x16x16_fp8_fp8_w32_gfx12(
        CUPA_AMD_BITCAST(i2, a), CUPA_AMD_BITCAST(i2, b), CUPA_AMD_BITCAST(f8, c)));
#endif
}
#endif  // CUPA_AMD_WMMA_GFX12

#if CUPA_AMD_FP8_CVT
// v_cvt_pk_f32_fp8: the fp8 codes in bytes 0-1 (HIGH false) or 2-3 (HIGH true) of a word as
// two floats, exactly (format: CUPA_AMD_FP8_CVT). The byte pair is the instruction's
// immediate, so a template argument. Emulated by the exact decoding above.
template <bool HIGH>
CUPA_AMD_FN amd_f32x2 amd_cvt_pk_f32_fp8(unsigned int word) {
    amd_f32x2 f;
    const unsigned int pair = HIGH ? word >> 16 : word & 0xffffu;
#if CUPA_EMULATE_AMD
    constexpr int FMT = CUPA_AMD_FP8_CVT == 1 ? cupa_emu::FP8_FNUZ : cupa_emu::FP8_OCP;
    f.r[0] = cupa_emu::decode<FMT>(pair & 0xffu);
    f.r[1] = cupa_emu::decode<FMT>(pair >> 8);
#else
    typedef CUPA_AMD_VEC(float, 2) f2;
    const f2 v = __builtin_amdgcn_cvt_pk_f32_fp8((int)word, HIGH);
    f.r[0] = v.x;
    f.r[1] = v.y;
    (void)pair;
#endif
    return f;
}
#endif  // CUPA_AMD_FP8_CVT
