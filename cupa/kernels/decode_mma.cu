// Phase 1 of paged decode on NVIDIA tensor cores (sm_80+, fp16/bf16, head size 64 or 128).
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
#include "reduce.cuh"

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

template <typename T, int D>
CUPA_FN void decode_partition_mma(
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_acc,
    float* __restrict__ part_max, float* __restrict__ part_sum, const T* __restrict__ query,
    const T* __restrict__ key_cache, const T* __restrict__ value_cache,
    const i32* __restrict__ block_tables, const i32* __restrict__ seq_lens,
    const float* __restrict__ alibi_slopes, float scale, i32 num_heads, i32 num_kv_heads,
    i32 block_size, i32 max_blocks_per_seq, i32 num_blocks, i32 partition_size,
    i32 max_partitions, i32 head_chunks) {
    constexpr int HT = 16;                  // heads per workgroup = mma M
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int STEP = 16;                // tokens per warp step = mma K of the PV product
    constexpr int QK_BLOCKS = D / 32;       // 32-column blocks of the head dim (2 k16 steps each)
    constexpr int V_BLOCKS = D / 64;        // 64-column blocks of V per token
    constexpr int NT = D / 8;               // n-tiles of the output
    static_assert(D % 64 == 0, "mma decode handles head sizes that are multiples of 64");

    __shared__ float o_s[NWARPS][HT][D];
    __shared__ float m_s[NWARPS][HT], l_s[NWARPS][HT];

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, c = lane & 3;
    const int group = num_heads / num_kv_heads;
    const int kv_head = blockIdx.x / head_chunks;
    const int chunk = blockIdx.x % head_chunks;
    const int head0 = kv_head * group + chunk * HT;
    const int nh = cmin(HT, group - chunk * HT);
    const int part = blockIdx.y;
    const int seq = blockIdx.z;
    const bool single = max_partitions == 1;

    int seq_len = seq_lens[seq];
    seq_len = seq_len < 0 ? 0 : cmin(seq_len, max_blocks_per_seq * block_size);
    const int start = part * partition_size;
    if (start >= seq_len) {
        if (single && part == 0) {
            for (int i = tid; i < nh * D; i += CUPA_THREADS)
                Elem<T>::store(out + ((i64)seq * num_heads + head0) * D + i, 0.0f);
            if (lse != nullptr && tid < nh) lse[(i64)seq * num_heads + head0 + tid] = neg_inf();
        }
        return;
    }
    const int end = cmin(start + partition_size, seq_len);

    // Q as A fragments, permuted like K (see the header). Rows past the group are zero.
    u32 qf[QK_BLOCKS][2][4];
    {
        const T* q_seq = query + ((i64)seq * num_heads + head0) * D;
        const cupa_u32x4 zero = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            const cupa_u32x4 qa = g < nh ? load16(q_seq + g * D + 32 * b + 8 * c) : zero;
            const cupa_u32x4 qb = g + 8 < nh ? load16(q_seq + (g + 8) * D + 32 * b + 8 * c) : zero;
            qf[b][0][0] = qa.x; qf[b][0][1] = qb.x; qf[b][0][2] = qa.y; qf[b][0][3] = qb.y;
            qf[b][1][0] = qa.z; qf[b][1][1] = qb.z; qf[b][1][2] = qa.w; qf[b][1][3] = qb.w;
        }
    }
    const float qk_scale = scale * LOG2E;
    const float slope_lo = (alibi_slopes != nullptr && g < nh) ? alibi_slopes[head0 + g] * LOG2E : 0.f;
    const float slope_hi =
        (alibi_slopes != nullptr && g + 8 < nh) ? alibi_slopes[head0 + g + 8] * LOG2E : 0.f;

    const i32* table = block_tables + (i64)seq * max_blocks_per_seq;
    const i64 head_offset = (i64)kv_head * block_size * D;
    const i64 block_stride = (i64)num_kv_heads * block_size * D;
    // Element offset of token t's K/V row, or -1 past the end or in a block outside the cache.
    auto row_of = [&](int t) -> i64 {
        if (t >= end) return -1;
        const int block = table[t / block_size];
        if (block < 0 || block >= num_blocks) return -1;
        return (i64)block * block_stride + head_offset + (i64)(t % block_size) * D;
    };

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m_lo = neg_inf(), m_hi = neg_inf();  // running max of rows g and g + 8 (log2 domain)
    float l_lo = 0.f, l_hi = 0.f;              // this lane's share of the running sums

    const cupa_u32x4 zero = {0u, 0u, 0u, 0u};
    for (int base = start + warp * STEP; base < end; base += NWARPS * STEP) {
        // Issue every load of the step first: K rows g and g + 8, V rows 2c, 2c+1, 2c+8, 2c+9.
        const i64 k_row0 = row_of(base + g), k_row1 = row_of(base + g + 8);
        cupa_u32x4 kv0[QK_BLOCKS], kv1[QK_BLOCKS];
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            kv0[b] = k_row0 >= 0 ? load16(key_cache + k_row0 + 32 * b + 8 * c) : zero;
            kv1[b] = k_row1 >= 0 ? load16(key_cache + k_row1 + 32 * b + 8 * c) : zero;
        }
        i64 v_rows[4];
        v_rows[0] = row_of(base + 2 * c);
        v_rows[1] = row_of(base + 2 * c + 1);
        v_rows[2] = row_of(base + 2 * c + 8);
        v_rows[3] = row_of(base + 2 * c + 9);
        cupa_u32x4 vv[4][V_BLOCKS];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int b = 0; b < V_BLOCKS; ++b)
                vv[r][b] = v_rows[r] >= 0 ? load16(value_cache + v_rows[r] + 64 * b + 8 * g) : zero;

        // S = Q K^T for tokens base + 0..7 (s0) and base + 8..15 (s1).
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            MmaOp<T>::run(s0, qf[b][0], kv0[b].x, kv0[b].y);
            MmaOp<T>::run(s0, qf[b][1], kv0[b].z, kv0[b].w);
            MmaOp<T>::run(s1, qf[b][0], kv1[b].x, kv1[b].y);
            MmaOp<T>::run(s1, qf[b][1], kv1[b].z, kv1[b].w);
        }
        // Scale, ALiBi, mask. Element (i) of s0/s1: row g (i < 2) or g + 8, token 2c + (i & 1).
        float s[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int t = base + (i < 4 ? 0 : 8) + 2 * c + (i & 1);
            const float raw = i < 4 ? s0[i] : s1[i - 4];
            const float slope = (i & 2) ? slope_hi : slope_lo;
            const bool valid = (i < 4 ? (i & 1 ? v_rows[1] : v_rows[0])
                                      : (i & 1 ? v_rows[3] : v_rows[2])) >= 0;
            s[i] = valid ? raw * qk_scale + slope * (float)(t - (seq_len - 1)) : neg_inf();
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
            MmaOp<T>::run(acc[j], pf, pair_halves(vv[0][b], vv[1][b], e),
                          pair_halves(vv[2][b], vv[3][b], e));
        }
    }

    // Merge the warps: each writes its rows' max, sum and unnormalised output.
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

    for (int i = tid; i < nh * D; i += CUPA_THREADS) {
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
        const i64 head = (i64)seq * num_heads + head0 + h;
        if (single) {
            Elem<T>::store(out + head * D + d, l > 0.f ? o / l : 0.f);
            if (d == 0 && lse != nullptr) lse[head] = l > 0.f ? (m + fast_log2(l)) * LN2 : neg_inf();
        } else {
            part_acc[(head * max_partitions + part) * D + d] = o;
            if (d == 0) {
                part_max[head * max_partitions + part] = m;
                part_sum[head * max_partitions + part] = l;
            }
        }
    }
}

}  // namespace cupa

#define CUPA_DECODE_MMA_VARIANT(NAME, T, D)                                                      \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS) NAME(                            \
        T* out, float* lse, float* part_acc, float* part_max, float* part_sum, const T* query,   \
        const T* key_cache, const T* value_cache, const i32* block_tables, const i32* seq_lens,  \
        const float* alibi_slopes, float scale, i32 num_heads, i32 num_kv_heads, i32 block_size, \
        i32 max_blocks_per_seq, i32 num_blocks, i32 partition_size, i32 max_partitions,         \
        i32 head_chunks) {                                                                       \
        cupa::decode_partition_mma<T, D>(out, lse, part_acc, part_max, part_sum, query,         \
                                         key_cache, value_cache, block_tables, seq_lens,         \
                                         alibi_slopes, scale, num_heads, num_kv_heads,           \
                                         block_size, max_blocks_per_seq, num_blocks,             \
                                         partition_size, max_partitions, head_chunks);           \
    }
