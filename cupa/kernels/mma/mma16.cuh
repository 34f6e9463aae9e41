// The 16-row kernel: 9-64 query rows as the M=16 rows of each warp's m-tile.
// A section of decode_mma.cu (which includes the sections in order); see its header.
#pragma once
#include "fragments.cuh"

namespace cupa {

// ---- 9-64 query rows: rows are the M=16 rows of a warp's m-tile (S = Q K^T, O = P V). ------
// The workgroup's rows form up to NWARPS tiles of 16; the warps split evenly over the tiles (one
// tile: all four warps; two: two each; three or four: one each), and the warps of a tile share
// the 16-token steps of each staged chunk. Every tile reads the same staged K/V rows.
//
// Above head 128 (Mma16Shape::SHARED_QUERY) a warp's 16 x D output accumulators alone take 128
// registers at head 256; the query's A fragments beside them (64 more) and a whole step's K and
// V words (128) would spill. There the workgroup holds one tile (more rows run as 16-row chunks
// across the grid), the tile's query sits in shared memory after the ring and is read with
// ldmatrix at each k16 step, and each step's K and V words are loaded block by block where
// they are used. catalogue.DecodeMmaVariant (rows, shared_bytes) mirrors this.
template <typename C, int D>
struct Mma16Shape {
    static constexpr int TILE_ROWS = 16;  // rows per warp tile = mma M
    static constexpr bool SHARED_QUERY = D > 128;
    static constexpr int TILES = SHARED_QUERY ? 1 : CUPA_THREADS / 32;
    static constexpr int ROWS = TILE_ROWS * TILES;  // query rows a workgroup takes
    static constexpr int QUERY_OFFSET = mma_shared_bytes<C, D, TILE_ROWS>();
    static constexpr int QUERY_ROW_BYTES = D * 2;  // 16-bit query rows
    static constexpr int BYTES = QUERY_OFFSET + (SHARED_QUERY ? TILE_ROWS * QUERY_ROW_BYTES : 0);
};

// The tile's query in shared memory: row r, 16-byte unit u at unit u ^ (r & 7) (rows are whole
// multiples of 128 bytes, so the 8 rows an ldmatrix reads at one column sit in 8 different bank
// groups). Position 16 s + 8 h + 2 c of a row holds query dims F::q_dim(s, h, c) and + 1, so
// that ldmatrix hands each lane the A fragment the register path builds (qf below).
template <typename T, typename M, typename C, int D>
struct SharedQuery {
    typedef Mma16Shape<C, D> S;
    typedef Frag<C> F;
    static constexpr int PAIRS = D / 2;                    // 32-bit words of a row
    static constexpr int THREADS_PER_ROW = CUPA_THREADS / S::TILE_ROWS;
    u32 base;      // this lane's ldmatrix address: its row of the tile
    int unit_xor;  // the unit it reads at step s is unit_xor ^ 2 (s % 4), + 8 (s / 4)

    // Thread t stores pairs t % 8, + 8, ... of row t / 8 (16 rows x 8 threads).
    CUPA_FN static void store(unsigned char* shared, const T* query, const PartitionWork& w) {
        static_assert(CUPA_THREADS == S::TILE_ROWS * THREADS_PER_ROW, "8 threads a row");
        const int r = (int)threadIdx.x / THREADS_PER_ROW;
        const QueryRow<T, M, D> row(query, w, r);
        u32* words = reinterpret_cast<u32*>(shared + S::QUERY_OFFSET + r * S::QUERY_ROW_BYTES);
#pragma unroll
        for (int i = 0; i < PAIRS / THREADS_PER_ROW; ++i) {
            const int pos = (int)threadIdx.x % THREADS_PER_ROW + THREADS_PER_ROW * i;
            const int s = pos / 8, h = (pos / 4) & 1, c = pos & 3;
            words[4 * ((pos / 4) ^ (r & 7)) + c] = row.pair(F::q_dim(s, h, c));
        }
    }
    // ldmatrix.x4 matrices 0-3: rows 0-7 / 8-15 of unit 2s, then of unit 2s + 1 (qf's order).
    CUPA_FN SharedQuery(const unsigned char* shared, int lane) {
        const int r = (lane & 7) + 8 * ((lane >> 3) & 1);
        base = shared_address(shared + S::QUERY_OFFSET) + r * S::QUERY_ROW_BYTES;
        unit_xor = (lane >> 4) ^ (r & 7);
    }
    CUPA_FN void load(u32 (&a)[4], int s) const {
        load_matrices(a, base + 128 * (s >> 2) + 16 * (unit_xor ^ (2 * (s & 3))));
    }
};

template <typename T, typename C, int D>
CUPA_FN void decode_partition_mma16(
    CUPA_PARTITION_PARAMS(T, C)) {
    typedef typename MmaTypeOf<T, C>::type M;
    typedef KvRing<C, D> R;
    typedef Frag<C> F;
    typedef Mma16Shape<C, D> Shape;
    constexpr int TILE_ROWS = Shape::TILE_ROWS;
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int ROWS = Shape::ROWS;
    constexpr bool SHARED_QUERY = Shape::SHARED_QUERY;
    constexpr int STEP = 16;                // tokens per warp step = mma K of the PV product
    constexpr int KSTEPS = D / 16;          // k16 steps of the head dim
    constexpr int NT = D / 8;               // dim tiles = n-tiles of the output
    static_assert(D % 16 == 0 && D <= 256, "whole k16 steps; rows staged as KvRing says");

    CUPA_PHASE_STAMP(PHASE_START);
    CUPA_DYNAMIC_SHARED(dynamic_shared);
    __shared__ float m_s[NWARPS][TILE_ROWS], l_s[NWARPS][TILE_ROWS];
    if (dynamic_shared_bytes() < (u32)Shape::BYTES) __trap();

    PartitionWork w;
    KvStream<C, D> kv;  // its first ids perhaps requested early: see early_ids
    unsigned char* const ring = reinterpret_cast<unsigned char*>(dynamic_shared);
    const bool ids_started = early_ids(kv, ring, block_tables, max_blocks_per_seq, block_size,
                                       partition_size, sliding_window, all_ids_early);
    if (!claim_partition<T, C, ROWS, D>(w, CUPA_PARTITION_ARGS)) {
        finish_early_ids(ids_started);
        return;
    }
    CUPA_PHASE_STAMP(PHASE_CLAIMED);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    const int tiles = (w.nh + TILE_ROWS - 1) / TILE_ROWS;
    const int warps_per_tile = NWARPS / tiles;
    const int tile = warp / warps_per_tile, slot = warp % warps_per_tile;
    const int r_lo = tile * TILE_ROWS + g, r_hi = r_lo + 8;  // this lane's local rows
    const typename KvStep<C, D, false>::Lanes lanes = KvStep<C, D, false>::lanes(lane);

    // Q as A fragments, in the head-dim order of K (Frag::q_dim). Rows past the chunk: QueryRow.
    // Above head 128 the fragments are read from shared memory at each step instead (the
    // barrier in start_stream orders the stores before the first read).
    u32 qf[SHARED_QUERY ? 1 : KSTEPS][4];
    if constexpr (SHARED_QUERY) {
        SharedQuery<T, M, C, D>::store(ring, query, w);
    } else {
        const QueryRow<T, M, D> q_lo(query, w, r_lo), q_hi(query, w, r_hi);
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                qf[s][2 * h] = q_lo.pair(F::q_dim(s, h, c));
                qf[s][2 * h + 1] = q_hi.pair(F::q_dim(s, h, c));
            }
        }
    }
    const SharedQuery<T, M, C, D> q_shared(ring, lane);
    const float qk_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    RowMask mask_lo, mask_hi;
    mask_lo.init(w, r_lo, alibi_slopes, sliding_window);
    mask_hi.init(w, r_hi, alibi_slopes, sliding_window);
    start_stream(kv, ring, w, key_cache, value_cache, block_tables, max_blocks_per_seq,
                 block_size, num_blocks, kv_block_stride, kv_head_stride, kv_token_stride,
                 ids_started);
    CUPA_PHASE_STAMP(PHASE_STREAM_STARTED);

    float acc[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    float m_lo = neg_inf(), m_hi = neg_inf();  // running max of rows r_lo and r_hi (log2 domain)
    float l_lo = 0.f, l_hi = 0.f;              // this lane's share of the running sums

    // A warp without a tile (three tiles on four warps) only helps with the copies.
    constexpr int STEPS = R::CHUNK / STEP;  // 16-token steps of a chunk
    const int first_step = tile < tiles ? slot : STEPS;
    for (int i = 0; i < kv.chunks; ++i) {
        const unsigned char* stage = kv.stage(i);
        if (i == 0) CUPA_PHASE_STAMP(PHASE_FIRST_CHUNK);
        for (int step = first_step; step < STEPS; step += warps_per_tile) {
            const int base = w.start + i * R::CHUNK + step * STEP;
            KvStep<C, D, false> cur;
            if constexpr (!SHARED_QUERY) cur.load(stage, step * STEP, lanes);
            bool v_valid[4];  // tokens 2c, 2c + 1, 2c + 8, 2c + 9 of the step
#pragma unroll
            for (int t = 0; t < 4; ++t)
                v_valid[t] = kv.readable(i, step * STEP + 2 * c + (t & 1) + 8 * (t >> 1));

            // S = Q K^T for tokens base + 0..7 (s0) and base + 8..15 (s1), each summed in two
            // independent accumulators (even and odd k16 steps) to halve the chain of
            // dependent mma's.
            float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
            float s0b[4] = {0.f, 0.f, 0.f, 0.f}, s1b[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
                const u32* a = qf[SHARED_QUERY ? 0 : s];
                if constexpr (SHARED_QUERY) {
                    if (cur.k_block_starts(s))
                        cur.load_k_words(stage, step * STEP, lanes, cur.k_block(s));
                    q_shared.load(qf[0], s);
                }
                MmaOp<M>::run((s & 1) ? s0b : s0, a, cur.k_op(s, 0, 0), cur.k_op(s, 1, 0));
                MmaOp<M>::run((s & 1) ? s1b : s1, a, cur.k_op(s, 0, 1), cur.k_op(s, 1, 1));
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s0[e] += s0b[e];
                s1[e] += s1b[e];
            }
            // Scale, soft-cap, ALiBi, masks. Element e: row r_lo (e & 2 == 0) or r_hi, token
            // 2c + (e & 1) + 8 (e >> 2).
            float s[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) s[e] = e < 4 ? s0[e] : s1[e - 4];
            scale_and_cap<8>(s, qk_scale, soft_cap);
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int tok = (e & 1) | ((e & 4) >> 1);  // 0: 2c, 1: 2c+1, 2: 2c+8, 3: 2c+9
                const int t = base + 2 * c + (e & 1) + (e & 4 ? 8 : 0);
                s[e] = ((e & 2) ? mask_hi : mask_lo).logit(s[e], t, v_valid[tok]);
            }
            // Online softmax per row; the four lanes of a quad share a row.
            float mx_lo = max_f(max_f(s[0], s[1]), max_f(s[4], s[5]));
            float mx_hi = max_f(max_f(s[2], s[3]), max_f(s[6], s[7]));
            float corr_lo = 1.f, corr_hi = 1.f;
            float use_lo = subtrahend(m_lo), use_hi = subtrahend(m_hi);
            bool moved = false;
            if (warp_any(passes_max(mx_lo, m_lo) || passes_max(mx_hi, m_hi))) {
                mx_lo = max_f(mx_lo, warp_xor(mx_lo, 1));
                mx_lo = max_f(mx_lo, warp_xor(mx_lo, 2));
                mx_hi = max_f(mx_hi, warp_xor(mx_hi, 1));
                mx_hi = max_f(mx_hi, warp_xor(mx_hi, 2));
                moved = update_max(m_lo, mx_lo, corr_lo, use_lo) |
                        update_max(m_hi, mx_hi, corr_hi, use_hi);
                l_lo *= corr_lo;
                l_hi *= corr_hi;
            }
            float p[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) p[e] = fast_exp2(s[e] - ((e & 2) ? use_hi : use_lo));
            l_lo += p[0] + p[1] + p[4] + p[5];
            l_hi += p[2] + p[3] + p[6] + p[7];
            // P as the A fragment: rows r_lo / r_hi, tokens 2c.. (k 0-7) and 8 + 2c.. (k 8-15).
            u32 pf[4];
            pf[0] = MmaOp<M>::pack(p[0], p[1]);
            pf[1] = MmaOp<M>::pack(p[2], p[3]);
            pf[2] = MmaOp<M>::pack(p[4], p[5]);
            pf[3] = MmaOp<M>::pack(p[6], p[7]);
            if (warp_any(moved)) {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    acc[j][0] *= corr_lo; acc[j][1] *= corr_lo;
                    acc[j][2] *= corr_hi; acc[j][3] *= corr_hi;
                }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                if constexpr (SHARED_QUERY)
                    if (cur.v_block_starts(j))
                        cur.load_v_words(stage, step * STEP, lanes, cur.v_block(j));
                MmaOp<M>::run(acc[j], pf, cur.v_op(j, 0), cur.v_op(j, 1));
            }
        }
    }
    CUPA_PHASE_STAMP(PHASE_CHUNKS_DONE);
    allow_next_call(next_at_start);
    kv.end_copies();
    CUPA_PHASE_STAMP(PHASE_COPIES_ENDED);

    // Each warp leaves its rows' max, sum and unnormalised output for the merge.
    constexpr int MERGE_ROW = merge_row_floats<TILE_ROWS, D>();
    float (*o_s)[TILE_ROWS][MERGE_ROW] =
        reinterpret_cast<float (*)[TILE_ROWS][MERGE_ROW]>(dynamic_shared);
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
        const int d0 = F::dim(j, 2 * c), d1 = F::dim(j, 2 * c + 1);
        if constexpr (column_pairs_adjacent<F>()) {
            store_pair(&o_s[warp][g][d0], acc[j][0], acc[j][1]);
            store_pair(&o_s[warp][g + 8][d0], acc[j][2], acc[j][3]);
        } else {
            o_s[warp][g][d0] = acc[j][0];
            o_s[warp][g][d1] = acc[j][1];
            o_s[warp][g + 8][d0] = acc[j][2];
            o_s[warp][g + 8][d1] = acc[j][3];
        }
    }
    __syncthreads();
    CUPA_PHASE_STAMP(PHASE_ROWS_SHARED);
    merge_warps_and_store<T, D, TILE_ROWS, NWARPS>(
        o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum, sinks, w, warps_per_tile,
        v_factor(kv_scales, w.kv_head, num_kv_heads), max_partitions, cluster_merge);
    CUPA_PHASE_STAMP(PHASE_DONE);
}

}  // namespace cupa
