// Phase 1 of paged decode on NVIDIA tensor cores (sm_80+, fp16/bf16, head size 64 or 128).
// Two kernels: mma16 (query heads as the 16 rows; groups of 9-16, and chunks of 16 for larger
// groups) and mma8 (heads as the 8 columns; groups of 2-8).
//
// With GQA the query heads of one KV head form a small matrix, so QK^T and PV are matrix products
// whose FMA cost on CUDA cores outgrows the memory time at group sizes of 4-8 and more. Here the
// up-to-16 query heads of a chunk are the M=16 rows of mma.sync.m16n8k16 (rows past the group are
// zero), and every K/V row is read once from global memory straight into registers.
//
// Register layout without shared memory or ldmatrix: the order of the summed index of a matrix
// product does not matter, so we permute it to make every global load 16 bytes wide.
//   QK (S = Q K^T, k = head dim): lane (g = lane/4, c = lane%4) loads K[token g][32b + 8c .. +8]
//     and feeds its four 32-bit words as the B fragments of two k16 steps; Q's A fragments are
//     loaded with the same permutation once per workgroup.
//   PV (O = P V, k = token): P comes straight from the QK accumulators (the FA2 register reuse);
//     n-tile j of the output maps to head-dim column 64*(j/8) + 8*n + j%8, so lane (g, c) loads
//     V[token][64b + 8g .. +8] for its four tokens {2c, 2c+1, 2c+8, 2c+9} and packs pairs of them
//     with one byte-permute per B fragment. Output columns come back as 16 contiguous values
//     per 64-column block.
// Each warp of the workgroup takes every NWARPS-th 16-token step of the partition with its own
// running max and sum; the warps merge through shared memory at the end.
#include "common.cuh"
#include "decode_common.cuh"

// Workgroups per multiprocessor the register allocation must allow (a tuning knob).
#ifndef CUPA_MMA_MIN_BLOCKS
#define CUPA_MMA_MIN_BLOCKS 1
#endif

namespace cupa {

template <typename T> struct MmaOp;

template <> struct MmaOp<cupa_f16> {
    CUPA_FN static void run(float* d, const u32* a, u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats to a packed pair, the first in the low half.
    CUPA_FN static u32 pack(float lo, float hi) {
        return (u32)float_to_half_bits(lo) | ((u32)float_to_half_bits(hi) << 16);
    }
};

template <> struct MmaOp<cupa_bf16> {
    CUPA_FN static void run(float* d, const u32* a, u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    CUPA_FN static u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

CUPA_FN u32 word(const cupa_u32x4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Half e (0..7) of vector a in the low 16 bits, half e of vector b in the high 16 bits.
CUPA_FN u32 pair_halves(const cupa_u32x4& a, const cupa_u32x4& b, int e) {
    return __byte_perm(word(a, e >> 1), word(b, e >> 1), (e & 1) ? 0x7632 : 0x5410);
}

// Epilogue shared by the mma kernels: each warp left its unnormalised output rows, running max
// and sum in shared memory; combine them and write the final output (one partition) or this
// partition's float32 partials.
template <typename T, int D, int HT, int NWARPS>
CUPA_FN void merge_warps_and_store(const float (*o_s)[HT][D], const float (*m_s)[HT],
                                   const float (*l_s)[HT], T* out, float* lse, float* part_acc,
                                   float* part_max, float* part_sum, const float* sinks,
                                   int num_heads, i64 first_head, int nh, int part,
                                   int max_partitions) {
    for (int i = threadIdx.x; i < nh * D; i += CUPA_THREADS) {
        const int h = i / D, d = i % D;
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) m = max_f(m, m_s[w][h]);
        const float use = m == neg_inf() ? 0.f : m;
        float l = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float f = fast_exp2(m_s[w][h] - use);
            l += f * l_s[w][h];
            o += f * o_s[w][h][d];
        }
        const i64 head = first_head + h;
        if (max_partitions == 1) {
            float lse_value;
            const float factor = finish_head(m, l, sink_of(sinks, head, num_heads), lse_value);
            Elem<T>::store(out + head * D + d, o * factor);
            if (d == 0 && lse != nullptr) lse[head] = lse_value;
        } else {
            part_acc[(head * max_partitions + part) * D + d] = o;
            if (d == 0) {
                part_max[head * max_partitions + part] = m;
                part_sum[head * max_partitions + part] = l;
            }
        }
    }
}

// One 16-token step of a warp. A lane touches tokens g and g + 8 (K rows) and 2c, 2c + 1, 2c + 8,
// 2c + 9 (V rows). The step is loaded in two stages, each one step ahead of its use:
//   StepBlocks: the block ids of those six tokens (block-table reads);
//   KvStep:     the K/V vectors themselves, whose addresses need the block ids.
// So in steady state a warp has the table reads of step s + 2 and the K/V reads of step s + 1 in
// flight while it computes step s, and no K/V load waits on a table read.
struct StepBlocks {
    i32 id[6];  // -1 past the partition's end
};

CUPA_FN StepBlocks step_blocks(const PagedRows& rows, int base, int g, int c) {
    const int offsets[6] = {g, g + 8, 2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
    StepBlocks s;
#pragma unroll
    for (int i = 0; i < 6; ++i) {
        const int t = base + offsets[i];
        s.id[i] = t < rows.end ? rows.table[t >> rows.shift] : -1;
    }
    return s;
}

template <typename T, int D>
struct KvStep {
    static constexpr int QK_BLOCKS = D / 32;  // 16-byte K vectors per row a lane reads
    static constexpr int V_VECS = D / 64;     // 16-byte V vectors per row a lane reads
    cupa_u32x4 k0[QK_BLOCKS], k1[QK_BLOCKS], v[4][V_VECS];
    bool k_valid[2], v_valid[4];

    // V vector b of a lane starts at column v_col0 + b * v_stride (the kernels' V layouts differ).
    CUPA_FN void load(const T* key_cache, const T* value_cache, const PagedRows& rows,
                      const StepBlocks& blocks, int base, int g, int c, int v_col0,
                      int v_stride) {
        const int offsets[6] = {g, g + 8, 2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
        i64 row[6];
#pragma unroll
        for (int i = 0; i < 6; ++i) row[i] = rows.row_in_block(blocks.id[i], base + offsets[i]);
        const cupa_u32x4 zero = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            k0[b] = row[0] >= 0 ? load16(key_cache + row[0] + 32 * b + 8 * c) : zero;
            k1[b] = row[1] >= 0 ? load16(key_cache + row[1] + 32 * b + 8 * c) : zero;
        }
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int b = 0; b < V_VECS; ++b)
                v[t][b] = row[2 + t] >= 0
                              ? load16(value_cache + row[2 + t] + v_col0 + b * v_stride) : zero;
        k_valid[0] = row[0] >= 0;
        k_valid[1] = row[1] >= 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) v_valid[t] = row[2 + t] >= 0;
    }
};

template <typename T>
CUPA_FN cupa_u32x4 load_or_zero(const T* base, i64 row, int offset) {
    const cupa_u32x4 zero = {0u, 0u, 0u, 0u};
    return row >= 0 ? load16(base + row + offset) : zero;
}

// ---- Group of 9-16 query heads: heads are the M=16 rows (S = Q K^T, O = P V). ----------------
template <typename T, int D>
CUPA_FN void decode_partition_mma16(
    CUPA_PARTITION_PARAMS(T)) {
    constexpr int HT = 16;                  // heads per workgroup = mma M
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int STEP = 16;                // tokens per warp step = mma K of the PV product
    constexpr int QK_BLOCKS = D / 32;       // 32-column blocks of the head dim (2 k16 steps each)
    constexpr int NT = D / 8;               // n-tiles of the output
    static_assert(D % 64 == 0, "mma decode handles head sizes that are multiples of 64");

    __shared__ float o_s[NWARPS][HT][D];
    __shared__ float m_s[NWARPS][HT], l_s[NWARPS][HT];

    PartitionWork w;
    if (!begin_partition<T, HT, D>(w, out, lse, seq_lens, sinks, sliding_window, num_heads,
                                   num_kv_heads, block_size, max_blocks_per_seq, partition_size,
                                   max_partitions, head_chunks))
        return;
    const PagedRows rows = paged_rows(w, block_tables, max_blocks_per_seq, num_kv_heads,
                                      block_size, num_blocks, D);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    const int nh = w.nh;

    // Q as A fragments, permuted like K (see the header). Rows past the group are zero.
    u32 qf[QK_BLOCKS][2][4];
    {
        const T* q = query + w.first_head * D;
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            const cupa_u32x4 qa = load_or_zero(q, g < nh ? (i64)g * D : -1, 32 * b + 8 * c);
            const cupa_u32x4 qb = load_or_zero(q, g + 8 < nh ? (i64)(g + 8) * D : -1, 32 * b + 8 * c);
            qf[b][0][0] = qa.x; qf[b][0][1] = qb.x; qf[b][0][2] = qa.y; qf[b][0][3] = qb.y;
            qf[b][1][0] = qa.z; qf[b][1][1] = qb.z; qf[b][1][2] = qa.w; qf[b][1][3] = qb.w;
        }
    }
    const float qk_scale = scale * LOG2E;
    const bool alibi = alibi_slopes != nullptr;
    const float slope_lo = alibi && g < nh ? alibi_slopes[w.head0 + g] * LOG2E : 0.f;
    const float slope_hi = alibi && g + 8 < nh ? alibi_slopes[w.head0 + g + 8] * LOG2E : 0.f;

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m_lo = neg_inf(), m_hi = neg_inf();  // running max of rows g and g + 8 (log2 domain)
    float l_lo = 0.f, l_hi = 0.f;              // this lane's share of the running sums

    constexpr int STRIDE = NWARPS * STEP;
    int base = w.start + warp * STEP;
    KvStep<T, D> cur;
    cur.load(key_cache, value_cache, rows, step_blocks(rows, base, g, c), base, g, c, 8 * g, 64);
    StepBlocks blocks_next = step_blocks(rows, base + STRIDE, g, c);
    for (; base < w.end; base += STRIDE) {
        const StepBlocks blocks_after = step_blocks(rows, base + 2 * STRIDE, g, c);
        KvStep<T, D> next;
        if (base + STRIDE < w.end)
            next.load(key_cache, value_cache, rows, blocks_next, base + STRIDE, g, c, 8 * g, 64);

        // S = Q K^T for tokens base + 0..7 (s0) and base + 8..15 (s1).
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            MmaOp<T>::run(s0, qf[b][0], cur.k0[b].x, cur.k0[b].y);
            MmaOp<T>::run(s0, qf[b][1], cur.k0[b].z, cur.k0[b].w);
            MmaOp<T>::run(s1, qf[b][0], cur.k1[b].x, cur.k1[b].y);
            MmaOp<T>::run(s1, qf[b][1], cur.k1[b].z, cur.k1[b].w);
        }
        // Scale, ALiBi, mask. Element i: row g (i & 2 == 0) or g + 8, V token (i & 1) | (i & 4) >> 1.
        float s[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int tok = (i & 1) | ((i & 4) >> 1);  // 0: 2c, 1: 2c+1, 2: 2c+8, 3: 2c+9
            const int t = base + 2 * c + (i & 1) + (i & 4 ? 8 : 0);
            const float raw = i < 4 ? s0[i] : s1[i - 4];
            const float slope = (i & 2) ? slope_hi : slope_lo;
            s[i] = cur.v_valid[tok] ? soft_cap_log2(raw * qk_scale, soft_cap) +
                                          slope * (float)(t - (w.seq_len - 1))
                                    : neg_inf();
        }
        // Online softmax per row; the four lanes of a quad share a row.
        float mx_lo = max_f(max_f(s[0], s[1]), max_f(s[4], s[5]));
        float mx_hi = max_f(max_f(s[2], s[3]), max_f(s[6], s[7]));
        mx_lo = max_f(mx_lo, warp_xor(mx_lo, 1));
        mx_lo = max_f(mx_lo, warp_xor(mx_lo, 2));
        mx_hi = max_f(mx_hi, warp_xor(mx_hi, 1));
        mx_hi = max_f(mx_hi, warp_xor(mx_hi, 2));
        const float new_lo = max_f(m_lo, mx_lo), new_hi = max_f(m_hi, mx_hi);
        // Subtract 0 instead of -inf while nothing was readable, so exp2 gives 0 and never NaN.
        const float use_lo = new_lo == neg_inf() ? 0.f : new_lo;
        const float use_hi = new_hi == neg_inf() ? 0.f : new_hi;
        const float corr_lo = fast_exp2(m_lo - use_lo), corr_hi = fast_exp2(m_hi - use_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        float p[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) p[i] = fast_exp2(s[i] - ((i & 2) ? use_hi : use_lo));
        l_lo = l_lo * corr_lo + p[0] + p[1] + p[4] + p[5];
        l_hi = l_hi * corr_hi + p[2] + p[3] + p[6] + p[7];
        // P as the A fragment: rows g / g+8, tokens 2c.. (k 0-7) and 8 + 2c.. (k 8-15).
        u32 pf[4];
        pf[0] = MmaOp<T>::pack(p[0], p[1]);
        pf[1] = MmaOp<T>::pack(p[2], p[3]);
        pf[2] = MmaOp<T>::pack(p[4], p[5]);
        pf[3] = MmaOp<T>::pack(p[6], p[7]);
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            acc[j][0] *= corr_lo; acc[j][1] *= corr_lo;
            acc[j][2] *= corr_hi; acc[j][3] *= corr_hi;
            const int b = j >> 3, e = j & 7;
            MmaOp<T>::run(acc[j], pf, pair_halves(cur.v[0][b], cur.v[1][b], e),
                          pair_halves(cur.v[2][b], cur.v[3][b], e));
        }
        cur = next;
        blocks_next = blocks_after;
    }

    // Each warp leaves its rows' max, sum and unnormalised output for the merge.
    l_lo += warp_xor(l_lo, 1);
    l_lo += warp_xor(l_lo, 2);
    l_hi += warp_xor(l_hi, 1);
    l_hi += warp_xor(l_hi, 2);
    if (c == 0) {
        m_s[warp][g] = m_lo; m_s[warp][g + 8] = m_hi;
        l_s[warp][g] = l_lo; l_s[warp][g + 8] = l_hi;
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int d = 64 * (j >> 3) + 16 * c + (j & 7);
        o_s[warp][g][d] = acc[j][0];
        o_s[warp][g][d + 8] = acc[j][1];
        o_s[warp][g + 8][d] = acc[j][2];
        o_s[warp][g + 8][d + 8] = acc[j][3];
    }
    __syncthreads();
    merge_warps_and_store<T, D, HT, NWARPS>(o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum,
                                            sinks, num_heads, w.first_head, nh, w.part,
                                            max_partitions);
}

// ---- Group of 2-8 query heads: heads are the N=8 columns (S^T = K Q^T, O^T = V^T P^T). -------
// Half the registers and mma work of the 16-row form when the group fits in 8. K and V rows are
// the A operands, loaded 16 bytes at a time with the same index permutations as above (for V the
// permuted index is the head dim: m-tile i, row r <-> column (D/8)*(r%8) + (D/16)*(r/8) + i, so a
// lane's rows of every m-tile are D/8 contiguous columns). P^T reaches the B layout of the PV
// product through one movmatrix transpose per 8x8 tile. K and V of the next step are loaded
// while the current one is computed.
CUPA_FN u32 transpose8x8(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

template <typename T, int D>
CUPA_FN void decode_partition_mma8(
    CUPA_PARTITION_PARAMS(T)) {
    constexpr int HT = 8;                   // heads per workgroup = mma N
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int STEP = 16;
    constexpr int QK_BLOCKS = D / 32;
    constexpr int MT = D / 16;              // m-tiles of the output (head-dim rows)
    static_assert(D % 64 == 0, "mma decode handles head sizes that are multiples of 64");

    __shared__ float o_s[NWARPS][HT][D];
    __shared__ float m_s[NWARPS][HT], l_s[NWARPS][HT];

    PartitionWork w;
    if (!begin_partition<T, HT, D>(w, out, lse, seq_lens, sinks, sliding_window, num_heads,
                                   num_kv_heads, block_size, max_blocks_per_seq, partition_size,
                                   max_partitions, head_chunks))
        return;
    const PagedRows rows = paged_rows(w, block_tables, max_blocks_per_seq, num_kv_heads,
                                      block_size, num_blocks, D);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    const int nh = w.nh;

    // Q^T as B fragments: lane (g, c) holds head g, columns 32b + 8c .. +8.
    cupa_u32x4 qv[QK_BLOCKS];
    {
        const T* q = query + w.first_head * D;
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b)
            qv[b] = load_or_zero(q, g < nh ? (i64)g * D : -1, 32 * b + 8 * c);
    }
    const float qk_scale = scale * LOG2E;
    const bool alibi = alibi_slopes != nullptr;
    const float slope_e = alibi && 2 * c < nh ? alibi_slopes[w.head0 + 2 * c] * LOG2E : 0.f;
    const float slope_o = alibi && 2 * c + 1 < nh ? alibi_slopes[w.head0 + 2 * c + 1] * LOG2E : 0.f;

    float acc[MT][4];  // O^T: rows d(i, g) / d(i, g+8), columns heads 2c, 2c + 1
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_e = neg_inf(), m_o = neg_inf();  // running max of heads 2c and 2c + 1
    float l_e = 0.f, l_o = 0.f;              // this lane's share of their sums

    constexpr int STRIDE = NWARPS * STEP;
    const int v_col0 = (D / 8) * g;  // a lane's V columns: D/8 contiguous ones
    int base = w.start + warp * STEP;
    KvStep<T, D> cur;
    cur.load(key_cache, value_cache, rows, step_blocks(rows, base, g, c), base, g, c, v_col0, 8);
    StepBlocks blocks_next = step_blocks(rows, base + STRIDE, g, c);
    for (; base < w.end; base += STRIDE) {
        const StepBlocks blocks_after = step_blocks(rows, base + 2 * STRIDE, g, c);
        KvStep<T, D> next;
        if (base + STRIDE < w.end)
            next.load(key_cache, value_cache, rows, blocks_next, base + STRIDE, g, c, v_col0, 8);

        // S^T for tokens base + g (st[0], st[1]) and base + g + 8 (st[2], st[3]), heads 2c, 2c+1.
        float st[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            const u32 a1[4] = {cur.k0[b].x, cur.k1[b].x, cur.k0[b].y, cur.k1[b].y};
            const u32 a2[4] = {cur.k0[b].z, cur.k1[b].z, cur.k0[b].w, cur.k1[b].w};
            MmaOp<T>::run(st, a1, qv[b].x, qv[b].y);
            MmaOp<T>::run(st, a2, qv[b].z, qv[b].w);
        }
        const float d0 = (float)(base + g - (w.seq_len - 1));
        const float d1 = d0 + 8.f;
        float s[4];
        const float slope[4] = {slope_e * d0, slope_o * d0, slope_e * d1, slope_o * d1};
#pragma unroll
        for (int i = 0; i < 4; ++i)
            s[i] = cur.k_valid[i >> 1] ? soft_cap_log2(st[i] * qk_scale, soft_cap) + slope[i]
                                       : neg_inf();
        // Online softmax per head (column): the 8 lanes with the same c share a head pair.
        float mx_e = max_f(s[0], s[2]), mx_o = max_f(s[1], s[3]);
#pragma unroll
        for (int mask = 4; mask < 32; mask <<= 1) {
            mx_e = max_f(mx_e, warp_xor(mx_e, mask));
            mx_o = max_f(mx_o, warp_xor(mx_o, mask));
        }
        const float new_e = max_f(m_e, mx_e), new_o = max_f(m_o, mx_o);
        const float use_e = new_e == neg_inf() ? 0.f : new_e;
        const float use_o = new_o == neg_inf() ? 0.f : new_o;
        const float corr_e = fast_exp2(m_e - use_e), corr_o = fast_exp2(m_o - use_o);
        m_e = new_e;
        m_o = new_o;
        const float p0 = fast_exp2(s[0] - use_e), p1 = fast_exp2(s[1] - use_o);
        const float p2 = fast_exp2(s[2] - use_e), p3 = fast_exp2(s[3] - use_o);
        l_e = l_e * corr_e + p0 + p2;
        l_o = l_o * corr_o + p1 + p3;
        // P^T tiles (tokens x heads) -> B fragments: head g, tokens 2c, 2c+1 (+8).
        const u32 pb0 = transpose8x8(MmaOp<T>::pack(p0, p1));
        const u32 pb1 = transpose8x8(MmaOp<T>::pack(p2, p3));
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            acc[i][0] *= corr_e; acc[i][1] *= corr_o;
            acc[i][2] *= corr_e; acc[i][3] *= corr_o;
            // Column i (row g) and D/16 + i (row g + 8) of this lane's D/8 columns.
            const int lo = i, hi = MT + i;
            const u32 a[4] = {pair_halves(cur.v[0][lo >> 3], cur.v[1][lo >> 3], lo & 7),
                              pair_halves(cur.v[0][hi >> 3], cur.v[1][hi >> 3], hi & 7),
                              pair_halves(cur.v[2][lo >> 3], cur.v[3][lo >> 3], lo & 7),
                              pair_halves(cur.v[2][hi >> 3], cur.v[3][hi >> 3], hi & 7)};
            MmaOp<T>::run(acc[i], a, pb0, pb1);
        }
        cur = next;
        blocks_next = blocks_after;
    }

#pragma unroll
    for (int mask = 4; mask < 32; mask <<= 1) {
        l_e += warp_xor(l_e, mask);
        l_o += warp_xor(l_o, mask);
    }
    if (g == 0) {
        m_s[warp][2 * c] = m_e; m_s[warp][2 * c + 1] = m_o;
        l_s[warp][2 * c] = l_e; l_s[warp][2 * c + 1] = l_o;
    }
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int d_lo = (D / 8) * g + i, d_hi = d_lo + MT;
        o_s[warp][2 * c][d_lo] = acc[i][0];
        o_s[warp][2 * c + 1][d_lo] = acc[i][1];
        o_s[warp][2 * c][d_hi] = acc[i][2];
        o_s[warp][2 * c + 1][d_hi] = acc[i][3];
    }
    __syncthreads();
    merge_warps_and_store<T, D, HT, NWARPS>(o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum,
                                            sinks, num_heads, w.first_head, nh, w.part,
                                            max_partitions);
}

}  // namespace cupa

#define CUPA_DECODE_MMA_VARIANT(NAME, KERNEL, T, D)                                              \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS, CUPA_MMA_MIN_BLOCKS)             \
        NAME(CUPA_PARTITION_PARAMS(T)) {                                                         \
        cupa::KERNEL<T, D>(CUPA_PARTITION_ARGS);                                                 \
    }
