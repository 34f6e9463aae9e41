// The 8-column kernel: up to 8 query rows as the N=8 columns.
// A section of decode_mma.cu (which includes the sections in order); see its header.
#pragma once
#include "mma16.cuh"

namespace cupa {

// ---- Up to 8 query rows: rows are the N=8 columns (S^T = K Q^T, O^T = V^T P^T). -------------
// Half the registers and mma work of the 16-row form when the rows fit in 8. K rows are the A
// operand of S^T (m = token), V^T that of O^T (m = head dim: m-tile i is dim tiles 2i and 2i + 1,
// rows g and g + 8). P^T reaches the B layout of the PV product through one movmatrix transpose
// per 8x8 tile. Each warp takes KvRing::WARP_STEPS 16-token steps of every staged chunk.
CUPA_FN u32 transpose8x8(u32 x) {
#if CUPA_CPU
    return cupa_cpu_movmatrix(x);
#else
    u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
#endif
}

template <typename T, typename C, int D, int DENSE_STAGES = 0>
CUPA_FN void decode_partition_mma8(
    CUPA_PARTITION_PARAMS(T, C)) {
    typedef typename MmaTypeOf<T, C>::type M;
    typedef KvRing<C, D, DENSE_STAGES> R;
    typedef Frag<C> F;
    constexpr int HT = 8;                   // rows per workgroup = mma N
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int STEP = 16;
    constexpr int KSTEPS = D / 16;
    constexpr int MT = D / 16;              // m-tiles of the output (head-dim rows)
    static_assert(D % 16 == 0 && D <= 256, "whole k16 steps; rows staged as KvRing says");
    constexpr int WS = R::WARP_STEPS;       // steps per warp and chunk
    constexpr bool V_LATE = D > 128;
    static_assert(R::CHUNK == NWARPS * WS * STEP, "WS steps per warp and chunk");

    CUPA_PHASE_STAMP(PHASE_START);
    CUPA_DYNAMIC_SHARED(dynamic_shared);
    __shared__ float m_s[NWARPS][HT], l_s[NWARPS][HT];
    if (dynamic_shared_bytes() < (u32)mma_shared_bytes<C, D, HT, DENSE_STAGES>()) __trap();

    PartitionWork w;
    KvStream<C, D, DENSE_STAGES> kv;  // its first ids perhaps requested early: see early_ids
    unsigned char* const ring = reinterpret_cast<unsigned char*>(dynamic_shared);
    const bool ids_started = early_ids(kv, ring, block_tables, max_blocks_per_seq, block_size,
                                       partition_size, sliding_window, all_ids_early);
    if (!claim_partition<T, C, HT, D>(w, CUPA_PARTITION_ARGS)) {
        finish_early_ids(ids_started);
        return;
    }
    CUPA_PHASE_STAMP(PHASE_CLAIMED);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    typedef KvStep<C, D, true, DENSE_STAGES> Step;
    const typename Step::Lanes lanes = Step::lanes(lane);

    // Q^T as B fragments: row g, in the head-dim order of K (Frag::q_dim).
    const QueryRow<T, M, D> q_row(query, w, g);
    u32 qb[KSTEPS][2];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) qb[s][h] = q_row.pair(F::q_dim(s, h, c));
    const float qk_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    RowMask mask_e, mask_o;  // rows 2c and 2c + 1, this lane's columns
    mask_e.init(w, 2 * c, alibi_slopes, sliding_window);
    mask_o.init(w, 2 * c + 1, alibi_slopes, sliding_window);
    start_stream(kv, ring, w, key_cache, value_cache, block_tables, max_blocks_per_seq,
                 block_size, num_blocks, kv_block_stride, kv_head_stride, kv_token_stride,
                 ids_started);
    CUPA_PHASE_STAMP(PHASE_STREAM_STARTED);

    float acc[MT][4];  // O^T: rows dims F::dim(2i, g) / F::dim(2i + 1, g), columns rows 2c, 2c+1
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_e = neg_inf(), m_o = neg_inf();  // running max of rows 2c and 2c + 1
    float l_e = 0.f, l_o = 0.f;              // this lane's share of their sums

    // 16-bit caches are software-pipelined over chunks: the next chunk's stage is taken (its
    // barrier) and its fragments loaded right after this chunk's QK product and masks, so those
    // loads overlap this chunk's softmax and PV chain (the stage refilled there is this chunk's,
    // whose fragments are in registers by then). Float16 at head 128: 0.4-4% faster on the
    // bench shapes (the most at 1 x 4096), 0.4% slower at 256 x 2048. fp8 (two steps a warp:
    // 208 instead of 146 registers) was level to 2% slower and head 256 (V after QK) spills, so
    // those take each chunk's stage and fragments at its top (docs/perf-log.md v13).
    constexpr bool PIPELINED = sizeof(C) == 2 && !V_LATE;
    int r0[WS];  // this warp's WS steps: rows r0[u] .. r0[u] + 15 of a stage
#pragma unroll
    for (int u = 0; u < WS; ++u) r0[u] = (warp * WS + u) * STEP;
    // Up to head 128 K and V are loaded together; at 256 their 128 registers would not fit
    // beside the rest, so V follows the QK product.
    auto load_chunk = [&](const unsigned char* st, int chunk, Step (&f)[WS],
                          bool (&valid)[WS][2]) {
#pragma unroll
        for (int u = 0; u < WS; ++u) {
            if (V_LATE) f[u].load_k(st, r0[u], lanes);
            else f[u].load(st, r0[u], lanes);
            valid[u][0] = kv.readable(chunk, r0[u] + g);
            valid[u][1] = kv.readable(chunk, r0[u] + g + 8);
        }
    };
    const unsigned char* stage = nullptr;
    Step cur[WS];
    bool k_valid[WS][2];
    if (PIPELINED) {
        stage = kv.stage(0);
        CUPA_PHASE_STAMP(PHASE_FIRST_CHUNK);
        load_chunk(stage, 0, cur, k_valid);
    }
    for (int chunk = 0; chunk < kv.chunks; ++chunk) {
        if (!PIPELINED) {
            stage = kv.stage(chunk);
            if (chunk == 0) CUPA_PHASE_STAMP(PHASE_FIRST_CHUNK);
            load_chunk(stage, chunk, cur, k_valid);
        }
        // The WS steps side by side: independent QK chains, one max and sum update and one
        // rescale for all of them.
        // S^T for tokens r0 + g (st[0], st[1]) and r0 + g + 8 (st[2], st[3]), rows 2c, 2c+1;
        // two independent accumulators per step (even and odd k16 steps) summed at the end.
        float st[WS][4], st2[WS][4];
#pragma unroll
        for (int u = 0; u < WS; ++u)
#pragma unroll
            for (int i = 0; i < 4; ++i) st[u][i] = st2[u][i] = 0.f;
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
            for (int u = 0; u < WS; ++u) {
                const u32 a[4] = {cur[u].k_op(s, 0, 0), cur[u].k_op(s, 0, 1),
                                  cur[u].k_op(s, 1, 0), cur[u].k_op(s, 1, 1)};
                MmaOp<M>::run((s & 1) ? st2[u] : st[u], a, qb[s][0], qb[s][1]);
            }
        }
        // Logits: rows 2c (even i) and 2c + 1 (odd i); tokens r0 + g and r0 + g + 8.
        const int base = w.start + chunk * R::CHUNK;
        float s[WS][4];
#pragma unroll
        for (int u = 0; u < WS; ++u)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[u][i] = st[u][i] + st2[u][i];
        scale_and_cap<4 * WS>(&s[0][0], qk_scale, soft_cap);
        float mx_e = neg_inf(), mx_o = neg_inf();
#pragma unroll
        for (int u = 0; u < WS; ++u) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                s[u][i] = ((i & 1) ? mask_o : mask_e).logit(
                    s[u][i], base + r0[u] + g + 8 * (i >> 1), k_valid[u][i >> 1]);
            mx_e = max_f(mx_e, max_f(s[u][0], s[u][2]));
            mx_o = max_f(mx_o, max_f(s[u][1], s[u][3]));
            if (V_LATE) cur[u].load_v(stage, r0[u], lanes);
        }
        // Pipelined: the next chunk's barrier, then its fragments.
        Step nxt[WS];
        bool n_valid[WS][2];
        if (PIPELINED && chunk + 1 < kv.chunks) {
            stage = kv.stage(chunk + 1);
            load_chunk(stage, chunk + 1, nxt, n_valid);
        }
        // Online softmax per row (column): the 8 lanes with the same c share a row pair. The
        // maxima move only when some logit of the warp passes them by LAZY_MAX.
        float corr_e = 1.f, corr_o = 1.f;
        float use_e = subtrahend(m_e), use_o = subtrahend(m_o);
        bool moved = false;
        if (warp_any(passes_max(mx_e, m_e) || passes_max(mx_o, m_o))) {
#pragma unroll
            for (int mask = 4; mask < 32; mask <<= 1) {
                mx_e = max_f(mx_e, warp_xor(mx_e, mask));
                mx_o = max_f(mx_o, warp_xor(mx_o, mask));
            }
            moved = update_max(m_e, mx_e, corr_e, use_e) | update_max(m_o, mx_o, corr_o, use_o);
            l_e *= corr_e;
            l_o *= corr_o;
        }
        // P^T tiles (tokens x rows) -> B fragments: row g, tokens 2c, 2c+1 (+8).
        u32 pb[WS][2];
#pragma unroll
        for (int u = 0; u < WS; ++u) {
            const float p0 = fast_exp2(s[u][0] - use_e), p1 = fast_exp2(s[u][1] - use_o);
            const float p2 = fast_exp2(s[u][2] - use_e), p3 = fast_exp2(s[u][3] - use_o);
            l_e += p0 + p2;
            l_o += p1 + p3;
            pb[u][0] = transpose8x8(MmaOp<M>::pack(p0, p1));
            pb[u][1] = transpose8x8(MmaOp<M>::pack(p2, p3));
        }
        if (warp_any(moved)) {
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                acc[i][0] *= corr_e; acc[i][1] *= corr_o;
                acc[i][2] *= corr_e; acc[i][3] *= corr_o;
            }
        }
#pragma unroll
        for (int u = 0; u < WS; ++u) {
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const u32 a[4] = {cur[u].v_op(2 * i, 0), cur[u].v_op(2 * i + 1, 0),
                                  cur[u].v_op(2 * i, 1), cur[u].v_op(2 * i + 1, 1)};
                MmaOp<M>::run(acc[i], a, pb[u][0], pb[u][1]);
            }
        }
        if (PIPELINED) {
#pragma unroll
            for (int u = 0; u < WS; ++u) {
                cur[u] = nxt[u];
                k_valid[u][0] = n_valid[u][0];
                k_valid[u][1] = n_valid[u][1];
            }
        }
    }
    CUPA_PHASE_STAMP(PHASE_CHUNKS_DONE);
    allow_next_call(next_at_start);
    kv.end_copies();
    CUPA_PHASE_STAMP(PHASE_COPIES_ENDED);

    constexpr int MERGE_ROW = merge_row_floats<HT, D>();
    float (*o_s)[HT][MERGE_ROW] = reinterpret_cast<float (*)[HT][MERGE_ROW]>(dynamic_shared);
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
        const int d_lo = F::dim(2 * i, g), d_hi = F::dim(2 * i + 1, g);
        if constexpr (tile_pairs_adjacent<F>()) {
            store_pair(&o_s[warp][2 * c][d_lo], acc[i][0], acc[i][2]);
            store_pair(&o_s[warp][2 * c + 1][d_lo], acc[i][1], acc[i][3]);
        } else {
            o_s[warp][2 * c][d_lo] = acc[i][0];
            o_s[warp][2 * c + 1][d_lo] = acc[i][1];
            o_s[warp][2 * c][d_hi] = acc[i][2];
            o_s[warp][2 * c + 1][d_hi] = acc[i][3];
        }
    }
    __syncthreads();
    CUPA_PHASE_STAMP(PHASE_ROWS_SHARED);
    merge_warps_and_store<T, D, HT, NWARPS>(o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum,
                                            sinks, w, NWARPS,
                                            v_factor(kv_scales, w.kv_head, num_kv_heads),
                                            max_partitions, cluster_merge);
    CUPA_PHASE_STAMP(PHASE_DONE);
}

}  // namespace cupa
