// Fragments: ldmatrix loads of staged K/V rows, fp8 widening, query pairs and the lazy running max.
// A section of decode_mma.cu (which includes the sections in order); see its header.
#pragma once
#include "ring.cuh"

namespace cupa {

// ---- Fragments ------------------------------------------------------------------------------
// A warp step covers 16 tokens (rows r0 .. r0 + 15 of a stage). Its K rows are read with
// ldmatrix.x4 and its V rows with ldmatrix.x4.trans, one instruction per 32-byte column block j
// of a row: four 8x8 matrices of 16-bit words, rows 0-7 or 8-15 of 16-byte unit 2j or 2j + 1.
// Lane (g, c) = (lane / 4, lane % 4) receives bytes 4c .. 4c + 3 of K row g (or g + 8), and the
// 16-bit column g of V rows 2c and 2c + 1 (or 2c + 8, 2c + 9; low half: the even token).
// The order of the four matrices is chosen per operand so that the words an mma takes
// together arrive in consecutive registers (no moves): "rows inner" = rows 0-7 and 8-15 of the
// first unit, then of the second; otherwise both units of rows 0-7, then of rows 8-15.
CUPA_FN void load_matrices(u32 (&r)[4], u32 address) {
#if CUPA_CPU
    cupa_cpu_ldmatrix(r, address, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
#endif
}
CUPA_FN void load_matrices_transposed(u32 (&r)[4], u32 address) {
#if CUPA_CPU
    cupa_cpu_ldmatrix(r, address, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
#endif
}

// What the words mean, per cache type. The summed index of QK (the head dim) may be permuted as
// long as Q follows: k16 step s multiplies Q elements q_dim(s, h, c), +1 (h = 0: k = 2c, 2c + 1;
// h = 1: k = 2c + 8, 2c + 9) with k_operand of the K word of unit k_unit(s, h). The output comes
// in dim tiles tau of 8 head dims taken from V unit v_unit(tau): lane column n of tile tau is
// head dim dim(tau, n), and v_operand turns a V word into that dim of two tokens.
// 16-bit caches: a unit is 8 dims, words are mma operands as they are.
template <typename C> struct Frag {
    CUPA_FN static int q_dim(int s, int h, int c) { return 16 * s + 8 * h + 2 * c; }
    CUPA_FN static int k_unit(int s, int h) { return 2 * s + h; }
    CUPA_FN static u32 k_operand(u32 word, int) { return word; }
    CUPA_FN static int v_unit(int tau) { return tau; }
    CUPA_FN static u32 v_operand(u32 word, int) { return word; }
    __host__ __device__ static constexpr int dim(int tau, int n) { return 8 * tau + n; }
};

// Two fp8 codes of a word w, bytes LO and HI (0-3), as a float16 pair, byte LO in the low half.
// Software (either e4m3 format): prmt sign-extends each code to 16 bits in place, and shifting
// that left by 7 lands sign, exponent and mantissa on float16's fields but for a copy of the
// sign on the exponent's top bit, which the mask clears. The result is the code's value times
// 2^(bias - 15) for every finite code, subnormals included (a zero exponent field is subnormal
// in both formats); NaN codes come out finite (only a NaN input writes them). Three integer
// instructions a pair. OCP e4m3fn on sm_89+ takes the hardware conversion instead: exact values,
// one instruction, and faster on the H200 than the software path or a mix of the two (K by one,
// V by the other), docs/perf-log.md v15. variants.fp8_value_power tells the host which is which.
template <int LO, int HI>
CUPA_FN u32 fp8_pair_software(u32 w) {
    u32 y;
#if CUPA_CPU
    y = cupa_cpu_prmt(w, 0u, LO | (8 | LO) << 4 | HI << 8 | (8 | HI) << 12);
#else
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(y) : "r"(w), "n"(LO | (8 | LO) << 4 | HI << 8 | (8 | HI) << 12));
#endif
    return (y << 7) & 0xbf80bf80u;
}
template <int LO, int HI>
CUPA_FN u32 fp8_pair_hardware(u32 w) {
    static_assert((LO == 0 && HI == 1) || (LO == 2 && HI == 3) || HI == LO + 2, "pairs 01 23 02 13");
    u32 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // An adjacent pair is read in place (no permute): the half is picked inside the asm.
    if constexpr (LO == 0 && HI == 1)
        asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(r) : "r"(w));
    else if constexpr (LO == 2 && HI == 3)
        asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.rn.f16x2.e4m3x2 %0, hi; }" : "=r"(r) : "r"(w));
    else  // bytes 0, 2 or 1, 3: one permute (shared by both pairs) regroups them
        r = fp8_pair_hardware<2 * LO, 2 * LO + 1>(__byte_perm(w, 0u, 0x3120));
#elif CUPA_CPU
    r = cupa_cpu_e4m3x2(w >> (8 * LO) & 0xffu, w >> (8 * HI) & 0xffu);
#else
    r = 0u;  // compiled for older targets but never run: variants.py picks it on sm_89+ only
#endif
    return r;
}
template <typename C> struct Fp8Widen {
    template <int LO, int HI> CUPA_FN static u32 pair(u32 w) { return fp8_pair_software<LO, HI>(w); }
};
template <> struct Fp8Widen<cupa_fp8_e4m3> {
    template <int LO, int HI> CUPA_FN static u32 pair(u32 w) { return fp8_pair_hardware<LO, HI>(w); }
};

// fp8 caches: a unit is 16 dims, so one K word (4 codes) feeds both halves of a k16 step, and a
// V word holds dims 2g and 2g + 1 of two tokens (bytes 0, 1 of one token, 2, 3 of the next), so
// bytes 0 and 2 are one dim's token pair and bytes 1 and 3 the next dim's (two dim tiles per
// unit). Codes are widened to float16 here, at use, so the loads stay in flight.
template <typename C> struct Fp8Frag {
    typedef Fp8Widen<C> W;
    CUPA_FN static int q_dim(int s, int h, int c) { return 16 * s + 4 * c + 2 * h; }
    CUPA_FN static int k_unit(int s, int) { return s; }
    CUPA_FN static u32 k_operand(u32 word, int h) {
        return h ? W::template pair<2, 3>(word) : W::template pair<0, 1>(word);
    }
    CUPA_FN static int v_unit(int tau) { return tau >> 1; }
    CUPA_FN static u32 v_operand(u32 word, int tau) {
        return (tau & 1) ? W::template pair<1, 3>(word) : W::template pair<0, 2>(word);
    }
    __host__ __device__ static constexpr int dim(int tau, int n) {
        return 16 * (tau >> 1) + 2 * n + (tau & 1);
    }
};
template <> struct Frag<cupa_fp8> : Fp8Frag<cupa_fp8> {};
template <> struct Frag<cupa_fp8_e4m3> : Fp8Frag<cupa_fp8_e4m3> {};

// Which output dims sit side by side, so that the warps' stores to the merge buffer can pair
// them (dim is linear in both arguments): lane columns 2c and 2c + 1 of a dim tile (the 16-row
// kernel's two values of a row), or dim tiles 2i and 2i + 1 of a lane column (the 8-column
// kernel's two values of a row).
template <typename F> __host__ __device__ constexpr bool column_pairs_adjacent() {
    return F::dim(0, 1) == F::dim(0, 0) + 1;
}
template <typename F> __host__ __device__ constexpr bool tile_pairs_adjacent() {
    return F::dim(1, 0) == F::dim(0, 0) + 1;
}

// The K and V words of one warp step, as loaded. K_ROWS_INNER picks the matrix order of K (and
// the other one for V): the 8-column kernel takes K as an A operand (rows inner), the 16-row
// kernel as B operands (units inner). DENSE_STAGES: the ring's (KvRing).
template <typename C, int D, bool K_ROWS_INNER, int DENSE_STAGES = 0>
struct KvStep {
    typedef KvRing<C, D, DENSE_STAGES> R;
    typedef Frag<C> F;
    // 32-byte column blocks that hold the row: fp8 rows at heads 80 and 112 end in a half block
    // (see lane_offsets).
    static constexpr int BLOCKS = (D * (int)sizeof(C) + 31) / 32;
    u32 k[BLOCKS][4], v[BLOCKS][4];

    // A lane's byte offsets from a step's first row for column blocks j = 0..LANE_BLOCKS - 1 (K,
    // then V). Block j + 4 is 128 bytes past block j: the swizzle is an XOR of fewer than 8
    // units, the same for all units of a row (KvRing::swizzle). The unit past a half block's end
    // is read again from the block's first: a row staged at its own width has none there, and
    // the bytes that follow belong to the next row or, past a stage's last, to a stage whose
    // copies may be landing (no operand takes those words either way).
    static constexpr int LANE_BLOCKS = BLOCKS < 4 ? BLOCKS : 4;
    struct Lanes { u32 k[LANE_BLOCKS], v[LANE_BLOCKS]; };
    CUPA_FN static void lane_offsets(int lane, bool rows_inner, u32* out) {
        const int matrix = lane >> 3;
        const int row = (lane & 7) + 8 * (rows_inner ? matrix & 1 : matrix >> 1);
        const int unit = rows_inner ? matrix >> 1 : matrix & 1;
#pragma unroll
        for (int j = 0; j < LANE_BLOCKS; ++j) {
            const int u = 2 * j + unit < R::COPY_UNITS ? 2 * j + unit : 2 * j;
            out[j] = (u32)pinned(row * R::ROW_BYTES + 16 * R::stored_unit(u, row));
        }
    }
    CUPA_FN static u32 block_offset(const u32* offsets, int j) {
        return j < LANE_BLOCKS ? offsets[j] : offsets[j & 3] + 128 * (j >> 2);
    }
    CUPA_FN static Lanes lanes(int lane) {
        Lanes l;
        lane_offsets(lane, K_ROWS_INNER, l.k);
        lane_offsets(lane, !K_ROWS_INNER, l.v);
        return l;
    }
    CUPA_FN static u32 word(const u32 (*w)[4], int unit, int row_half, bool rows_inner) {
        return w[unit >> 1][rows_inner ? 2 * (unit & 1) + row_half : (unit & 1) + 2 * row_half];
    }

    // Rows r0 .. r0 + 15 of a stage (r0 a multiple of 16): the K or V words of column block j,
    // all of K, all of V, or both.
    CUPA_FN void load_k_words(const unsigned char* stage, int r0, const Lanes& l, int j) {
        const u32 rows = shared_address(stage) + r0 * R::ROW_BYTES;
        load_matrices(k[j], rows + block_offset(l.k, j));
    }
    CUPA_FN void load_v_words(const unsigned char* stage, int r0, const Lanes& l, int j) {
        const u32 rows = shared_address(stage) + r0 * R::ROW_BYTES + R::KV_BYTES;
        load_matrices_transposed(v[j], rows + block_offset(l.v, j));
    }
    CUPA_FN void load_k(const unsigned char* stage, int r0, const Lanes& l) {
#pragma unroll
        for (int j = 0; j < BLOCKS; ++j) load_k_words(stage, r0, l, j);
    }
    CUPA_FN void load_v(const unsigned char* stage, int r0, const Lanes& l) {
#pragma unroll
        for (int j = 0; j < BLOCKS; ++j) load_v_words(stage, r0, l, j);
    }
    CUPA_FN void load(const unsigned char* stage, int r0, const Lanes& l) {
        load_k(stage, r0, l);
        load_v(stage, r0, l);
    }
    // Block by block, where the words are used (the 16-row kernel above head 128): the column
    // block k16 step s (dim tile tau) takes its words from, and whether s (tau) is the first to
    // take them.
    CUPA_FN static int k_block(int s) { return F::k_unit(s, 0) >> 1; }
    CUPA_FN static int v_block(int tau) { return F::v_unit(tau) >> 1; }
    CUPA_FN static bool k_block_starts(int s) { return s == 0 || k_block(s) != k_block(s - 1); }
    CUPA_FN static bool v_block_starts(int tau) {
        return tau == 0 || v_block(tau) != v_block(tau - 1);
    }
    // Half h of k16 step s, K rows g (rows = 0) or g + 8, as an mma operand.
    CUPA_FN u32 k_op(int s, int h, int rows) const {
        return F::k_operand(word(k, F::k_unit(s, h), rows, K_ROWS_INNER), h);
    }
    // Dim tile tau of tokens 2c, 2c + 1 (half 0) or 2c + 8, 2c + 9, as an mma operand.
    CUPA_FN u32 v_op(int tau, int half) const {
        return F::v_operand(word(v, F::v_unit(tau), half, !K_ROWS_INNER), tau);
    }
};

// The warps' merge buffer (o_s, over the ring once the chunks are done): each warp's TILE_ROWS
// rows of D unnormalised output floats, merge_row_floats apart. Rows D floats apart (D a
// multiple of 16) put the rows one store instruction writes on one or two sets of the same
// banks: the 8-column kernel's lanes write rows 2c and 2c + 1 (c = lane % 4), up to 4-way, the
// 16-row kernel's rows g (lane / 4), up to 8-way. A pad of 4 floats puts rows 2c 8c banks apart,
// one of 8 floats rows g 8g banks apart (they store float pairs: 16 lanes a wavefront), so each
// store takes the fewest wavefronts its bytes need, but the 16-row kernel's fp8 stores (single
// floats, 4 wavefronts, from 8). catalogue.merge_row_floats mirrors it (docs/perf-log.md v45).
template <int TILE_ROWS, int D>
__host__ __device__ constexpr int merge_row_floats() {
    return D + (TILE_ROWS == 8 ? 4 : 8);
}

// Bytes of dynamic shared memory a kernel needs: the ring, reused by the warps' merge buffer.
template <typename C, int D, int TILE_ROWS, int DENSE_STAGES = 0>
__host__ __device__ constexpr int mma_shared_bytes() {
    return cmax(KvRing<C, D, DENSE_STAGES>::BYTES,
                (CUPA_THREADS / 32) * TILE_ROWS * merge_row_floats<TILE_ROWS, D>() *
                    (int)sizeof(float));
}

// The query of local row r, read as mma-type pairs; past the chunk (r >= nh) it reads row 0.
// Such a row's products never reach an output: RowMask makes every logit of it -inf (whatever
// the product), so its P is 0 and the merge stores rows below nh only. Not zeroing its words
// leaves the loads unused until the first QK product, so the warps go on to issue the first K/V
// copies while they are in flight (a select on each word made them wait: docs/perf-log.md v45).
// The row's index (two integer divisions) is computed once and every load is unconditional: a
// branch and index per load cost the 16-row kernel's 32 loads 5-7 us a workgroup (v24).
template <typename T, typename M, int D>
struct QueryRow {
    const T* row;
    CUPA_FN QueryRow(const T* query, const PartitionWork& w, int r)
        : row(query + w.row_index(r < w.nh ? r : 0) * D) {}
    // Elements dim, dim + 1.
    CUPA_FN u32 pair(int dim) const { return QPair<T, M>::load(row + dim); }
};

// One row's online-softmax step: the running max m takes in the step's max mx; corr rescales
// what was summed so far, use is what the step's logits subtract. Returns whether the max moved:
// when no row of a warp's moved, corr is 1 everywhere and the accumulators need no rescale.
CUPA_FN bool update_max(float& m, float mx, float& corr, float& use) {
    const float next = max_f(m, mx);
    use = subtrahend(next);
    corr = fast_exp2(m - use);
    const bool moved = next != m;
    m = next;
    return moved;
}

}  // namespace cupa
