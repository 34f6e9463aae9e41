// The AMD matrix instruction a decode tile runs on, and how the tile's operands sit in lanes.
//
// One 16x16x16 instruction per target, by 16-bit element type: MFMA on CDNA (gfx90a, gfx94x,
// gfx950), WMMA on RDNA3 (gfx11) and RDNA4 (gfx12), whose layouts differ. The layouts, the
// wrappers and their emulation are amd_emulation.cuh's; this file only picks one and names
// the facts of it that decode_matrix.cu builds on. They hold for all three and are checked at
// compile time (MatrixTile::check, called from the kernel, so that its constexpr calls of the
// layouts' __device__ formulas are in device code):
//   1. A lane holds row (A) or column (B) lane % 16 of an operand, and the C/D elements of
//      column lane % 16.
//   2. The k of an operand element depends on the lane only through its k-group: lane / 16,
//      modulo the copies of a replicated layout (RDNA3 holds A and B in both half-waves).
//   3. S^T's accumulator r of a lane holds tile token d_row(lane, r); that token is either the
//      lane's own PV element r (MFMA, RDNA4: P^T is packed in place), or element 2r + half-wave
//      (RDNA3: the other half of the elements comes from lane ^ 16).
// tests/unit/test_amd_layouts.py checks 1 and 2 against AMD's tables as well.
#pragma once
#include "../common.cuh"

#if !(CUPA_AMD_MFMA || CUPA_AMD_WMMA_GFX11 || CUPA_AMD_WMMA_GFX12)
#error "decode_matrix.cu needs an AMD target with MFMA or WMMA instructions (or its emulation)"
#endif

namespace cupa {

template <typename T> struct MatrixCore;

#define CUPA_MATRIX_CORE(T, LAYOUT, AB_TYPE, ACC_TYPE, INSTRUCTION)                              \
    template <> struct MatrixCore<T> {                                                          \
        typedef LAYOUT L;                                                                        \
        typedef AB_TYPE AB;                                                                      \
        typedef ACC_TYPE Acc;                                                                    \
        CUPA_FN static Acc mma(const AB& a, const AB& b, const Acc& c) {                          \
            return INSTRUCTION(a, b, c);                                                         \
        }                                                                                        \
    };
#if CUPA_AMD_MFMA
CUPA_MATRIX_CORE(cupa_f16, AmdLayoutMfma16x16x16, amd_u32x2, amd_f32x4,
                 amd_mfma_f32_16x16x16_f16)
CUPA_MATRIX_CORE(cupa_bf16, AmdLayoutMfma16x16x16, amd_u32x2, amd_f32x4,
                 amd_mfma_f32_16x16x16_bf16)
#elif CUPA_AMD_WMMA_GFX11
CUPA_MATRIX_CORE(cupa_f16, AmdLayoutWmmaGfx11, amd_u32x8, amd_f32x8,
                 amd_wmma_gfx11_f32_16x16x16_f16)
CUPA_MATRIX_CORE(cupa_bf16, AmdLayoutWmmaGfx11, amd_u32x8, amd_f32x8,
                 amd_wmma_gfx11_f32_16x16x16_bf16)
#else
CUPA_MATRIX_CORE(cupa_f16, AmdLayoutWmmaGfx12, amd_u32x4, amd_f32x8,
                 amd_wmma_gfx12_f32_16x16x16_f16)
CUPA_MATRIX_CORE(cupa_bf16, AmdLayoutWmmaGfx12, amd_u32x4, amd_f32x8,
                 amd_wmma_gfx12_f32_16x16x16_bf16)
#endif
#undef CUPA_MATRIX_CORE

// A decode tile of head size D on the instruction for T: 16 tokens x 16 query rows.
template <typename T, int D>
struct MatrixTile {
    typedef MatrixCore<T> Core;
    typedef typename Core::L L;
    typedef typename Core::AB AB;
    typedef typename Core::Acc Acc;
    static constexpr int REGS = L::AB_REGS;                   // operand VGPRs of a lane
    static constexpr int ELEMS = 2 * REGS;                    // its 16-bit operand elements
    static constexpr int ACC = L::D_REGS;                     // its accumulators
    static constexpr int KGROUPS = L::WAVE / 16 / L::COPIES;  // lanes / 16, less the copies
    static constexpr int CHUNKS = D / 16;  // QK: k steps over d; PV: 16-row tiles of d
    static constexpr int K_RUN = D / KGROUPS;  // contiguous K / query elements of one lane
    static_assert(L::WAVE == CUPA_WARP && L::BLOCKS == 1 && L::BITS == 16, "a 16-bit wave op");
    static_assert(L::M == 16 && L::N == 16 && L::K == 16, "a 16x16x16 instruction");
    static_assert(KGROUPS * ELEMS == 16 && D % 16 == 0, "tile shape");

    CUPA_FN static int kgroup(int lane) { return lane / 16 % KGROUPS; }

    // The PV element (token of the tile, less kgroup * ELEMS) that S^T's accumulator r holds.
    static __device__ constexpr int acc_element(int lane, int r) {
        return L::d_row(lane, r) - lane / 16 % KGROUPS * ELEMS;
    }
    // Fact 3's first form: accumulator r is element r.
    static __device__ constexpr bool in_place() {
        for (int lane = 0; lane < L::WAVE; ++lane)
            for (int r = 0; r < ACC; ++r)
                if (ACC != ELEMS || acc_element(lane, r) != r) return false;
        return true;
    }
    // Fact 3's second form: accumulator r is element 2r + half-wave, the operand replicated.
    static __device__ constexpr bool interleaved() {
        for (int lane = 0; lane < L::WAVE; ++lane)
            for (int r = 0; r < ACC; ++r)
                if (L::COPIES != 2 || 2 * ACC != ELEMS || acc_element(lane, r) != 2 * r + lane / 16)
                    return false;
        return true;
    }
    // Facts 1 and 2 (the operand side: AmdLayout's A and B share one formula, row = lane % 16
    // and the k-group of every k).
    static __device__ constexpr bool lanes_by_column() {
        for (int lane = 0; lane < L::WAVE; ++lane)
            for (int r = 0; r < ACC; ++r)
                if (L::d_col(lane, r) != lane % 16) return false;
        for (int row = 0; row < 16; ++row)
            for (int k = 0; k < 16; ++k)
                for (int copy = 0; copy < L::COPIES; ++copy) {
                    const int lane = L::ab_lane(0, row, k, copy);
                    if (lane % 16 != row || lane / 16 % KGROUPS != L::ab_lane(0, 0, k, 0) / 16 % KGROUPS)
                        return false;
                }
        return true;
    }
    CUPA_FN static void check() {
        static_assert(lanes_by_column(), "a lane's operand row and accumulator column differ");
        static_assert(in_place() || interleaved(), "S^T's accumulators are not P^T's elements");
    }
};

}  // namespace cupa
