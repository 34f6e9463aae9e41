// Phase 1 of paged decode on AMD matrix cores: MFMA (CDNA) or WMMA (RDNA3, RDNA4) 16x16x16
// instructions, fp16/bf16 queries, a cache of the query type or fp8 codes (widened to the
// query type in registers: by v_cvt_pk_f32_fp8 where the target reads the cache's format,
// in software otherwise), head sizes 64, 80, 96, 112, 128, 192 and 256. Phase 2 is
// decode_common.cuh's reduce.
//
// One workgroup per (row chunk of a KV head, partition, sequence), as every family
// (begin_partition): TILES 16-row tiles of query rows (GQA heads x new tokens). Each wavefront
// takes every WAVES-th 16-token tile of the partition and computes, for each row tile,
//   S^T  = K Q^T       A = K    (16 tokens x 16 d),  B = Q^T (16 d x 16 query rows)
//   O^T += V^T P^T     A = V^T  (16 d x 16 tokens),  B = P^T (16 tokens x 16 query rows)
// so the query rows are the instruction's columns: a lane's query row is lane % 16 in both
// products (matrix/core.cuh, fact 1), its running max and sum live in the lane, and O^T's
// accumulators of its row rescale without leaving it. The wavefronts merge through LDS at the
// end.
//
// A sum does not care about the order of its terms, so the kernel picks which d (QK) and which
// token (PV) each k-slot of the operands stands for, as long as A and B agree (fact 2):
//   QK: element e of chunk c in k-group g is d = g * K_RUN + c * ELEMS + e, so a lane reads one
//       contiguous run of its token's K row, and of its query row (staged in LDS).
//   PV: element e in k-group g is tile token g * ELEMS + e, the token S^T's accumulators hold
//       in that lane (fact 3), so P^T needs no LDS. Row i of V^T's chunk c is V's column
//       d = i * V_CHUNKS + c, so a lane reads a contiguous run of each of its tokens' V rows.
//       V_CHUNKS is D / 16 made even (80 and 112 have 5 and 7 chunks): the columns past D are
//       read as zeros and their rows of O^T never written.
// Tokens past seq_len or in blocks outside [0, num_blocks) are never read: their K and V
// operands are zero and their logits -inf, so garbage in unwritten slots cannot reach the
// output.
#include "decode_common.cuh"
#include "matrix/core.cuh"

namespace cupa {

// N consecutive elements of type C (4, 8, 16 or 32 bytes, or a pair of fp8 codes: the low
// half of one word) as words; zeros where `src` is null.
template <typename C, int N>
CUPA_FN void load_run(const C* src, u32* words) {
    constexpr int BYTES = N * (int)sizeof(C), WORDS = BYTES / 4;
    if constexpr (BYTES == 2) {  // V runs of fp8 codes at heads 80 and 96
        words[0] = src == nullptr ? 0u : (u32)*reinterpret_cast<const u16*>(src);
        return;
    }
    static_assert(BYTES == 2 || (BYTES % 4 == 0 && (BYTES <= 8 || BYTES % 16 == 0)),
                  "a run of 2, 4, 8 or 16k bytes");
    if (src == nullptr) {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) words[i] = 0u;
    } else if (BYTES == 4) {
        words[0] = *reinterpret_cast<const u32*>(src);
    } else if (BYTES == 8) {
        const cupa_u32x2 v = *reinterpret_cast<const cupa_u32x2*>(src);
        words[0] = v.x;
        words[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < WORDS; i += 4) {
            const cupa_u32x4 v = load16(reinterpret_cast<const u32*>(src) + i);
            words[i] = v.x; words[i + 1] = v.y; words[i + 2] = v.z; words[i + 3] = v.w;
        }
    }
}

// A run of N elements of cache type C (its words as loaded) as N / 2 words of two 16-bit
// values of matrix type T, element 2i in the low half of word i: the operand form.
//   T itself: the words as they are.
//   cupa_fp8 (software): a code becomes float16 holding its value times 2^(bias - 15)
//     (Elem<cupa_fp8>; the host folds the power into the scales), exactly; bfloat16 takes
//     that value, exactly.
//   cupa_fp8_amd (hardware): v_cvt_pk_f32_fp8 gives the codes' values, exactly, two a time.
template <typename T> CUPA_FN u32 from_half_bits(u32 half);
template <> CUPA_FN u32 from_half_bits<cupa_f16>(u32 half) { return half; }
template <> CUPA_FN u32 from_half_bits<cupa_bf16>(u32 half) {
    return float_to_bf16_bits(half_bits_to_float((u16)half));
}

template <typename T, typename C, int N>
struct Widen {  // a 16-bit cache of the query type
    // (an fp8 type lands here only where its specialisation does not exist: cupa_fp8_amd on a
    // target without v_cvt_pk_f32_fp8)
    static_assert(sizeof(C) == 2, "no conversion of this cache type on this target");
    CUPA_FN static void run(const u32* raw, u32* out) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) out[i] = raw[i];
    }
};
template <typename T, int N>
struct Widen<T, cupa_fp8, N> {
    CUPA_FN static u32 code(const u32* raw, int i) {
        return from_half_bits<T>(Elem<cupa_fp8>::half_bits((raw[i / 4] >> (8 * (i % 4))) & 0xffu));
    }
    CUPA_FN static void run(const u32* raw, u32* out) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) out[i] = code(raw, 2 * i) | (code(raw, 2 * i + 1) << 16);
    }
};
#if CUPA_AMD_FP8_CVT
template <typename T, int N>
struct Widen<T, cupa_fp8_amd, N> {
    CUPA_FN static void run(const u32* raw, u32* out) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const amd_f32x2 f = i % 2 ? amd_cvt_pk_f32_fp8<true>(raw[i / 2])
                                      : amd_cvt_pk_f32_fp8<false>(raw[i / 2]);
            out[i] = Elem<T>::narrow_word(f.r[0], f.r[1]);  // exact: fp8 values fit both
        }
    }
};
#endif

// Element i of words of two 16-bit values.
CUPA_FN u32 half_of(const u32* words, int i) { return (words[i / 2] >> (16 * (i % 2))) & 0xffffu; }

template <typename T, typename C, int D, int TILES>
struct MatrixPartition {
    typedef MatrixTile<T, D> G;
    typedef typename G::Core Core;
    typedef typename G::AB AB;
    typedef typename G::Acc Acc;
    static constexpr int WAVES = CUPA_THREADS / CUPA_WARP;
    // O^T's 16-row tiles of d: D / 16, made even so that V runs are whole 16-bit pairs.
    static constexpr int V_CHUNKS = (G::CHUNKS + 1) / 2 * 2;
    // PV reads V in groups of chunks, each token's run of a group in one load, with at most 32
    // operand words of V per lane at a time: registers are what RDNA3's replicated operands
    // run short of (8 VGPRs per fragment). The group is the largest that divides V_CHUNKS and
    // loads as 4, 8 or 16k bytes (2 for fp8 codes where nothing larger divides: heads 80, 96).
    static constexpr int V_GROUP_WANTED = cmax(32 / G::REGS, 4 / (int)sizeof(C));
    static constexpr int v_group() {
        for (int g = cmin(V_CHUNKS, V_GROUP_WANTED); g >= 2; g -= 2) {
            const int bytes = g * (int)sizeof(C);
            if (V_CHUNKS % g == 0 && (bytes == 2 || bytes == 4 || bytes == 8 || bytes % 16 == 0))
                return g;
        }
        return 0;
    }
    static constexpr int V_GROUP = v_group();
    static_assert(V_GROUP > 0 && D % V_GROUP == 0, "V runs wholly inside or past the row");
    // LDS words: the query fragments during the loop ([tile][chunk][register][lane]), then
    // the merge slots of half the wavefronts ([accumulator][lane], then max and sum by lane).
    static constexpr int Q_WORDS = TILES * G::CHUNKS * G::REGS * CUPA_WARP;
    static constexpr int SLOT_WORDS = (V_CHUNKS * G::ACC + 2) * CUPA_WARP;
    static constexpr int MERGE_WORDS = (WAVES / 2) * SLOT_WORDS;
    static constexpr int LDS_WORDS = Q_WORDS > MERGE_WORDS ? Q_WORDS : MERGE_WORDS;
};

template <typename T, typename C, int D, int TILES>
CUPA_FN void decode_partition_matrix(CUPA_PARTITION_PARAMS(T, C)) {
    typedef MatrixPartition<T, C, D, TILES> P;
    typedef typename P::G G;
    typedef typename P::AB AB;
    typedef typename P::Acc Acc;
    typedef typename P::Core Core;
    typedef typename G::L L;
    constexpr int CHUNKS = G::CHUNKS, ELEMS = G::ELEMS, REGS = G::REGS, ACC = G::ACC;
    constexpr int WAVES = P::WAVES, V_GROUP = P::V_GROUP, V_CHUNKS = P::V_CHUNKS;
    G::check();
    static_assert(sizeof(T) == 2 && (sizeof(C) == 2 || sizeof(C) == 1), "16-bit or fp8 cache");
    static_assert(P::V_GROUP % 2 == 0, "V runs of whole 16-bit pairs");
    __shared__ u32 lds[P::LDS_WORDS];
    CUPA_ASSERT_AMD_LDS(4 * P::LDS_WORDS);

    PartitionWork w;
    if (!begin_partition<T, 16 * TILES, D>(w, out, lse, seq_lens, query_start_loc, sinks,
                                           sliding_window, num_tokens, num_heads, num_kv_heads,
                                           block_size, max_blocks_per_seq, partition_size,
                                           max_partitions, head_chunks, cluster_merge))
        return;
    const PagedRows rows = paged_rows(w, block_tables, max_blocks_per_seq, block_size,
                                      num_blocks, kv_block_stride, kv_head_stride,
                                      kv_token_stride);
    const int tid = threadIdx.x, wave = tid / CUPA_WARP, lane = tid % CUPA_WARP;
    const int col = lane % 16, kgroup = G::kgroup(lane);

    // The query fragments (B of S^T), unscaled: lane l of a tile holds row l % 16's run.
    for (int i = tid; i < TILES * CUPA_WARP; i += CUPA_THREADS) {
        const int tile = i / CUPA_WARP, l = i % CUPA_WARP, r = 16 * tile + l % 16;
        const u32* q = r < w.nh ? reinterpret_cast<const u32*>(query + w.row_index(r) * D +
                                                               G::kgroup(l) * G::K_RUN)
                                : nullptr;
#pragma unroll
        for (int j = 0; j < CHUNKS * REGS; ++j)
            lds[(tile * CHUNKS * REGS + j) * CUPA_WARP + l] = q != nullptr ? q[j] : 0u;
    }

    // This lane's query row of each tile: causal range, ALiBi slope, running max and sum.
    int first[TILES], pos[TILES];
    float slope[TILES], m_run[TILES], l_run[TILES];
    Acc o[TILES][V_CHUNKS];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int r = 16 * tile + col;
        const bool row = r < w.nh;
        pos[tile] = row ? w.row_pos(r) : -1;  // -1: no token is seen
        first[tile] = row ? window_first(w.row_pos(r), sliding_window) : 0;
        slope[tile] = alibi_slopes != nullptr && row
                          ? alibi_slopes[w.row_index(r) % num_heads] * LOG2E : 0.0f;
        m_run[tile] = neg_inf();
        l_run[tile] = 0.0f;
#pragma unroll
        for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
            for (int a = 0; a < ACC; ++a) o[tile][c].r[a] = 0.0f;
    }
    const float qk_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    __syncthreads();

    for (int t0 = w.start + 16 * wave; t0 < w.end; t0 += 16 * WAVES) {
        // S^T = K Q^T for every row tile; this lane's K row is token t0 + col.
        Acc s[TILES];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int a = 0; a < ACC; ++a) s[tile].r[a] = 0.0f;
        const i64 k_row = rows.row(t0 + col);
        const C* k_run = k_row >= 0 ? key_cache + k_row + kgroup * G::K_RUN : nullptr;
        // Not unrolled whole: the compiler would hoist every chunk's K loads, which RDNA3's
        // replicated operands (a whole K row a lane) cannot hold in registers.
#pragma unroll 2
        for (int c = 0; c < CHUNKS; ++c) {
            u32 raw[ELEMS * sizeof(C) / 4];
            load_run<C, ELEMS>(k_run != nullptr ? k_run + c * ELEMS : nullptr, raw);
            AB k;
            Widen<T, C, ELEMS>::run(raw, k.r);
#pragma unroll
            for (int tile = 0; tile < TILES; ++tile) {
                AB q;
#pragma unroll
                for (int j = 0; j < REGS; ++j)
                    q.r[j] = lds[((tile * CHUNKS + c) * REGS + j) * CUPA_WARP + lane];
                s[tile] = Core::mma(k, q, s[tile]);
            }
        }

        // Which of this lane's PV tokens (k-group g: tile tokens g * ELEMS + e) are readable:
        // a bit each, their rows found again when V is read (16 int64 rows would hold 32
        // VGPRs through the softmax).
        const int pv_t0 = t0 + kgroup * ELEMS;
        u32 readable = 0u;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) readable |= (rows.row(pv_t0 + e) >= 0 ? 1u : 0u) << e;

        // Online softmax per row tile, then P^T as 16-bit operand.
        AB p_op[TILES];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            float x[ACC];
#pragma unroll
            for (int a = 0; a < ACC; ++a) x[a] = s[tile].r[a];
            scale_and_cap<ACC>(x, qk_scale, soft_cap);
            float tile_max = neg_inf();
#pragma unroll
            for (int a = 0; a < ACC; ++a) {
                const int t = t0 + L::d_row(lane, a);
                const bool seen = ((readable >> G::acc_element(lane, a)) & 1u) &&
                                  t >= first[tile] && t <= pos[tile];
                x[a] = seen ? x[a] + slope[tile] * (float)(t - pos[tile]) : neg_inf();
                tile_max = max_f(tile_max, x[a]);
            }
            // The other lanes of this query row: lane ^ 16, ^ 32 (the k-groups, or RDNA3's
            // half-waves, which hold the tile's other tokens).
#pragma unroll
            for (int m = 16; m < CUPA_WARP; m <<= 1) tile_max = max_f(tile_max, warp_xor(tile_max, m));
            const float m_new = max_f(m_run[tile], tile_max);
            const float keep = fast_exp2(m_run[tile] - subtrahend(m_new));  // 0 from -inf
            float p[ACC], sum = 0.0f;
#pragma unroll
            for (int a = 0; a < ACC; ++a) {
                p[a] = fast_exp2(x[a] - subtrahend(m_new));
                sum += p[a];
            }
            l_run[tile] = l_run[tile] * keep + sum;  // this lane's share; summed at the end
            m_run[tile] = m_new;
#pragma unroll
            for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
                for (int a = 0; a < ACC; ++a) o[tile][c].r[a] *= keep;
            if constexpr (G::in_place()) {
#pragma unroll
                for (int j = 0; j < REGS; ++j) p_op[tile].r[j] = Elem<T>::narrow_word(p[2 * j], p[2 * j + 1]);
            } else {  // RDNA3: tokens 2j + half from here, 2j + (1 - half) from lane ^ 16
                const bool upper = lane >= 16;
#pragma unroll
                for (int j = 0; j < REGS; ++j) {
                    const float other = warp_xor(p[j], 16);
                    p_op[tile].r[j] = upper ? Elem<T>::narrow_word(other, p[j])
                                            : Elem<T>::narrow_word(p[j], other);
                }
            }
        }

        // O^T += V^T P^T, V read in groups of V_GROUP chunks: a run of V_GROUP elements of each
        // token's row at column col * V_CHUNKS + c0 (zeros past the row: heads 80 and 112).
#pragma unroll
        for (int c0 = 0; c0 < V_CHUNKS; c0 += V_GROUP) {
            u32 wide[ELEMS][V_GROUP / 2];  // each token's run, as 16-bit pairs
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) {
                i64 row = (readable >> e) & 1u ? rows.row(pv_t0 + e) : -1;
                if constexpr (V_CHUNKS * 16 != D)  // heads 80, 112: no columns past the row
                    row = col * V_CHUNKS + c0 < D ? row : -1;
                u32 raw[(V_GROUP * sizeof(C) + 3) / 4];
                load_run<C, V_GROUP>(row >= 0 ? value_cache + row + col * V_CHUNKS + c0 : nullptr,
                                     raw);
                Widen<T, C, V_GROUP>::run(raw, wide[e]);
            }
#pragma unroll
            for (int c = 0; c < V_GROUP; ++c) {
                AB v;
#pragma unroll
                for (int j = 0; j < REGS; ++j)
                    v.r[j] = half_of(wide[2 * j], c) | (half_of(wide[2 * j + 1], c) << 16);
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile)
                    o[tile][c0 + c] = Core::mma(v, p_op[tile], o[tile][c0 + c]);
            }
        }
    }

    // Each lane summed only its own tokens' weights.
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
        for (int m = 16; m < CUPA_WARP; m <<= 1) l_run[tile] += warp_xor(l_run[tile], m);

    // Merge the wavefronts, a tree through LDS: the upper half writes, the lower half adds.
    __syncthreads();  // the query fragments are read no more
    float* slots = reinterpret_cast<float*>(lds);
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int half = WAVES / 2; half >= 1; half /= 2) {
            if (wave >= half && wave < 2 * half) {
                float* slot = slots + (wave - half) * P::SLOT_WORDS;
#pragma unroll
                for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
                    for (int a = 0; a < ACC; ++a) slot[(c * ACC + a) * CUPA_WARP + lane] = o[tile][c].r[a];
                slot[V_CHUNKS * ACC * CUPA_WARP + lane] = m_run[tile];
                slot[(V_CHUNKS * ACC + 1) * CUPA_WARP + lane] = l_run[tile];
            }
            __syncthreads();
            if (wave < half) {
                const float* slot = slots + wave * P::SLOT_WORDS;
                const float m_other = slot[V_CHUNKS * ACC * CUPA_WARP + lane];
                const float l_other = slot[(V_CHUNKS * ACC + 1) * CUPA_WARP + lane];
                const float m_new = max_f(m_run[tile], m_other);
                const float keep = fast_exp2(m_run[tile] - subtrahend(m_new));
                const float take = fast_exp2(m_other - subtrahend(m_new));
#pragma unroll
                for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
                    for (int a = 0; a < ACC; ++a)
                        o[tile][c].r[a] = o[tile][c].r[a] * keep +
                                          slot[(c * ACC + a) * CUPA_WARP + lane] * take;
                l_run[tile] = l_run[tile] * keep + l_other * take;
                m_run[tile] = m_new;
            }
            __syncthreads();
        }
    }
    if (wave != 0) return;

    // Wavefront 0 writes: O^T's accumulator a of chunk c is row col's column
    // d_row(lane, a) * V_CHUNKS + c (none past D).
    const float v_scale = v_factor(kv_scales, w.kv_head, num_kv_heads);
    const bool single = w.writes_output;
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int r = 16 * tile + col;
        if (r >= w.nh) continue;
        const i64 head = w.row_index(r);
        float factor = v_scale, lse_value = 0.0f;
        if (single) factor *= finish_head(m_run[tile], l_run[tile], sink_of(sinks, head, num_heads),
                                          lse_value);
#pragma unroll
        for (int a = 0; a < ACC; ++a) {
            const int d0 = L::d_row(lane, a) * V_CHUNKS;
#pragma unroll
            for (int c = 0; c < V_CHUNKS; ++c) {
                if constexpr (V_CHUNKS * 16 != D) {
                    if (d0 + c >= D) continue;  // a padded column (heads 80, 112)
                }
                const float value = o[tile][c].r[a] * factor;
                if (single)
                    Elem<T>::store(out + head * D + d0 + c, value);
                else
                    part_acc[(head * max_partitions + w.part) * D + d0 + c] = value;
            }
        }
        if (lane < 16) {
            if (single) {
                if (lse != nullptr) lse[head] = lse_value;
            } else {
                part_max[head * max_partitions + w.part] = m_run[tile];
                part_sum[head * max_partitions + w.part] = l_run[tile];
            }
        }
    }
}

}  // namespace cupa

#define CUPA_DECODE_MATRIX_VARIANT(NAME, T, C, D, TILES)                                         \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS)                                  \
        NAME(CUPA_PARTITION_PARAMS(T, C)) {                                                      \
        cupa::start_in_chain(); /* see decode_common.cuh */                                     \
        cupa::decode_partition_matrix<T, C, D, TILES>(CUPA_PARTITION_ARGS);                      \
    }
