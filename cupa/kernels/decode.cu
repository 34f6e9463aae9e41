// Two-phase paged decode attention (portable path: CUDA cores / VALU, float32 accumulation).
//
// Phase 1, decode_partition: one workgroup per (row chunk of a KV head, partition, sequence). The
// rows are the (new token, query head) pairs of the KV head (one token per sequence in plain
// decode; up to MAX_QUERY_LEN with query_start_loc). It reads each K/V row of its partition once
// and applies it to every row of the chunk (GQA packing), keeping a running max and exp-sum per
// row (online softmax, log2 domain); each row is masked to its own causal range and window. With
// a single partition it writes the final output; otherwise it writes float32 partials that
// phase 2, decode_reduce, merges. The cache is of type T or fp8 codes (C = cupa_fp8).
//
// Work inside phase 1 goes tile by tile (TILE = CUPA_THREADS tokens):
//   1. QK: one thread per token, all heads of the chunk; the K row is read in 16-byte vectors and
//      the (pre-scaled) queries come from shared memory as broadcasts.
//   2. softmax update: one warp per head over the tile's logits in shared memory.
//   3. PV: threads split as (16-byte column chunk) x (head slot) x (token lane); each V vector is
//      read from global memory by the head slots sharing it (one coalesced request), and the
//      token lanes are summed once per partition through shared memory.
// Tokens at or past seq_len and tokens in blocks whose id is not in [0, num_blocks) never have
// their own rows read: their K row is skipped and their logit is -inf; in PV their V loads read
// the cache's first row instead (validation asks for a block) and what those bring is zeroed. So
// garbage (even NaN) in unwritten cache slots or table entries cannot reach the output.
#include "common.cuh"
#include "decode_common.cuh"

namespace cupa {

// How the PV step spreads a tile over the workgroup, for cache type C, head size D and HT rows
// per workgroup. Kept in one place so the kernel and its shared-memory sizes agree.
template <typename C, int D, int HT>
struct PvLayout {
    static constexpr int VEC = Elem<C>::VEC;            // elements per 16-byte vector
    static constexpr int CHUNKS = D / VEC;              // 16-byte vectors per row
    static constexpr int ROWS = CUPA_THREADS / CHUNKS;  // threads available per column chunk
    // Heads per thread: at least 2 (each V vector feeds two heads' FMAs) and enough that the head
    // slots fit in ROWS.
    static constexpr int HPT = cmin(HT, cmax(2, (HT + ROWS - 1) / ROWS));
    static constexpr int SLOTS = HT / HPT;              // head slots
    static constexpr int LANES = ROWS / SLOTS;          // token lanes, summed at partition end
    static constexpr int ACTIVE = CHUNKS * SLOTS * LANES;
    // Token lanes whose sums lane 0 adds a step at the partition's end: at most 64 floats in
    // flight. clang loaded all lanes at once: 15 to 31 lanes of 16 or 32 floats (an fp8 cache
    // at one or two rows, 16 bits at two) took 140-512 VGPRs with spills, and that set the
    // whole kernel's occupancy, down to one wavefront a SIMD on gfx942 (docs/perf-log.md v58).
    static constexpr int SUM_STEP = cmax(1, 64 / (HPT * VEC));
    // V vectors a PV thread loads before it uses the first (docs/perf-log.md v57): 8 turns a
    // tile's 64 dependent loads a thread (GQA 8, head 128, 16 bits) into 8 round trips, for
    // the registers of 8 vectors in flight (gfx942: 64 -> 84 VGPRs, occupancy unchanged).
    static constexpr int BATCH = 8;
    static_assert(D % VEC == 0, "head size must be a whole number of 16-byte vectors");
    static_assert(HT % HPT == 0 && SLOTS <= ROWS && LANES >= 1, "bad PV layout");
};

template <typename T, typename C, int D, int HT>
CUPA_FN void decode_partition(
    CUPA_PARTITION_PARAMS(T, C)) {
    typedef PvLayout<C, D, HT> L;
    constexpr int TILE = CUPA_THREADS;
    constexpr int NWARPS = CUPA_THREADS / CUPA_WARP;
    constexpr int VEC = L::VEC;

    __shared__ float q_s[HT][D];        // query * scale * log2(e)
    __shared__ float p_s[HT][TILE];     // the tile's logits, then its probabilities
    __shared__ i64 row_s[TILE];         // element offset of each token's K/V row, -1 if unreadable
    __shared__ float m_s[HT], l_s[HT], corr_s[HT], slope_s[HT];
    __shared__ int first_s[HT], pos_s[HT];  // each row attends to tokens [first, pos]
    __shared__ float red_s[L::LANES > 1 ? L::LANES - 1 : 1][HT][D];

    PartitionWork w;
    if (!begin_partition<T, HT, D>(w, out, lse, seq_lens, query_start_loc, sinks, sliding_window,
                                   num_tokens, num_heads, num_kv_heads, block_size,
                                   max_blocks_per_seq, partition_size, max_partitions,
                                   head_chunks, cluster_merge))
        return;
    const PagedRows rows = paged_rows(w, block_tables, max_blocks_per_seq, block_size,
                                      num_blocks, kv_block_stride, kv_head_stride,
                                      kv_token_stride);
    const int tid = threadIdx.x;
    const int nh = w.nh, start = w.start, end = w.end;
    // Here that means max_partitions == 1: the host merges in clusters only with the
    // tensor-core kernels.
    const bool single = w.writes_output;

    const float q_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    for (int i = tid; i < HT * D; i += CUPA_THREADS) {
        const int h = i / D;
        q_s[h][i % D] = h < nh ? Elem<T>::load(query + w.row_index(h) * D + i % D) * q_scale
                               : 0.0f;
    }
    if (tid < HT) {
        m_s[tid] = neg_inf();
        l_s[tid] = 0.0f;
        const bool row = tid < nh;
        slope_s[tid] = alibi_slopes != nullptr && row
                           ? alibi_slopes[w.row_index(tid) % num_heads] * LOG2E : 0.0f;
        pos_s[tid] = row ? w.row_pos(tid) : -1;
        first_s[tid] = row ? window_first(w.row_pos(tid), sliding_window) : 0;
    }

    // PV role of this thread
    const int pv_chunk = tid % L::CHUNKS;
    const int pv_slot = (tid / L::CHUNKS) % L::SLOTS;
    const int pv_lane = tid / (L::CHUNKS * L::SLOTS);
    const bool pv_active = tid < L::ACTIVE;
    float acc[L::HPT][VEC];
#pragma unroll
    for (int i = 0; i < L::HPT; ++i)
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[i][v] = 0.0f;

    __syncthreads();

    for (int tile = start; tile < end; tile += TILE) {
        // 1. QK: thread tid scores token tile + tid against every head of the chunk.
        {
            const int t = tile + tid;
            const i64 row = rows.row(t);
            row_s[tid] = row;
            float logit[HT];
#pragma unroll
            for (int h = 0; h < HT; ++h) logit[h] = 0.0f;
            if (row >= 0) {
                const C* k_row = key_cache + row;
#pragma unroll 4
                for (int c = 0; c < L::CHUNKS; ++c) {
                    float k[VEC];
                    Elem<C>::widen(load16(k_row + c * VEC), k);
#pragma unroll
                    for (int h = 0; h < HT; ++h) {
                        if (h < nh) {
#pragma unroll
                            for (int v = 0; v < VEC; ++v) logit[h] += q_s[h][c * VEC + v] * k[v];
                        }
                    }
                }
            }
#pragma unroll
            for (int h = 0; h < HT; ++h) {
                const bool seen = row >= 0 && t >= first_s[h] && t <= pos_s[h];
                const float distance = (float)(t - pos_s[h]);  // <= 0 for ALiBi
                p_s[h][tid] = seen ? soft_cap_log2(logit[h], soft_cap) + slope_s[h] * distance
                                   : neg_inf();
            }
        }
        __syncthreads();

        // 2. online softmax: one warp per head.
        {
            const int warp = tid / CUPA_WARP, lane = tid % CUPA_WARP;
            for (int h = warp; h < nh; h += NWARPS) {
                float tile_max = neg_inf();
                for (int j = lane; j < TILE; j += CUPA_WARP) tile_max = max_f(tile_max, p_s[h][j]);
                tile_max = warp_max(tile_max);
                const float m_old = m_s[h];
                const float m_new = max_f(m_old, tile_max);
                float sum = 0.0f;
                for (int j = lane; j < TILE; j += CUPA_WARP) {
                    // m_new == -inf only if nothing was readable so far: keep everything at 0.
                    const float p = m_new == neg_inf() ? 0.0f : fast_exp2(p_s[h][j] - m_new);
                    p_s[h][j] = p;
                    sum += p;
                }
                sum = warp_sum(sum);
                warp_barrier();  // every lane has read m_s[h] before lane 0 replaces it
                if (lane == 0) {
                    const float corr = m_old == neg_inf() ? 0.0f : fast_exp2(m_old - m_new);
                    corr_s[h] = corr;
                    l_s[h] = l_s[h] * corr + sum;
                    m_s[h] = m_new;
                }
            }
        }
        __syncthreads();

        // 3. PV: acc[i] += p[h][t] * V[t] for this thread's heads, column chunk and token lane.
        if (pv_active) {
#pragma unroll
            for (int i = 0; i < L::HPT; ++i) {
                const int h = pv_slot * L::HPT + i;
                const float corr = h < nh ? corr_s[h] : 0.0f;
#pragma unroll
                for (int v = 0; v < VEC; ++v) acc[i][v] *= corr;
            }
            const int tile_len = cmin(TILE, end - tile);
            // L::BATCH tokens a step: their V loads are all issued before the first is used,
            // so a step waits through one memory round trip, not one a token. A token past the
            // tile or with nothing to read loads the cache's first row instead and zeroes what
            // it loaded (that row may hold NaN): no branch around a load, which would make each
            // load wait for the one before (docs/perf-log.md v57).
            for (int j0 = pv_lane; j0 < tile_len; j0 += L::BATCH * L::LANES) {
                cupa_u32x4 raw[L::BATCH];
                bool seen[L::BATCH];
#pragma unroll
                for (int b = 0; b < L::BATCH; ++b) {
                    const int j = j0 + b * L::LANES;
                    const i64 row = j < tile_len ? row_s[j] : -1;
                    seen[b] = row >= 0;
                    raw[b] = load16(value_cache + (seen[b] ? row : 0) + pv_chunk * VEC);
                }
                schedule_fence();
#pragma unroll
                for (int b = 0; b < L::BATCH; ++b) {
                    if (!seen[b]) raw[b] = cupa_u32x4{0u, 0u, 0u, 0u};
                    // Past the tile, p is another token's (clamped into p_s); any finite p
                    // times the zeroed row adds nothing, and p_s holds probabilities.
                    const int j = cmin(j0 + b * L::LANES, TILE - 1);
                    float val[VEC];
                    Elem<C>::widen(raw[b], val);
#pragma unroll
                    for (int i = 0; i < L::HPT; ++i) {
                        const float p = p_s[pv_slot * L::HPT + i][j];
#pragma unroll
                        for (int v = 0; v < VEC; ++v) acc[i][v] += p * val[v];
                    }
                }
            }
        }
        __syncthreads();  // p_s and row_s are rewritten by the next tile
    }

    // Sum the token lanes.
    if (L::LANES > 1) {
        if (pv_active && pv_lane > 0) {
#pragma unroll
            for (int i = 0; i < L::HPT; ++i)
#pragma unroll
                for (int v = 0; v < VEC; ++v)
                    red_s[pv_lane - 1][pv_slot * L::HPT + i][pv_chunk * VEC + v] = acc[i][v];
        }
        __syncthreads();
        if (pv_active && pv_lane == 0) {
            // L::SUM_STEP lanes a step: left to it, clang loads every lane's sums before it
            // adds the first.
#pragma unroll 1
            for (int lane0 = 0; lane0 < L::LANES - 1; lane0 += L::SUM_STEP)
#pragma unroll
                for (int lane = lane0; lane < lane0 + L::SUM_STEP; ++lane) {
                    if (lane >= L::LANES - 1) break;
#pragma unroll
                    for (int i = 0; i < L::HPT; ++i)
#pragma unroll
                        for (int v = 0; v < VEC; ++v)
                            acc[i][v] += red_s[lane][pv_slot * L::HPT + i][pv_chunk * VEC + v];
                }
        }
    }

    if (pv_active && pv_lane == 0) {
        const float v_scale = v_factor(kv_scales, w.kv_head, num_kv_heads);
#pragma unroll
        for (int i = 0; i < L::HPT; ++i) {
            const int h = pv_slot * L::HPT + i;
            if (h >= nh) continue;
            const i64 head = w.row_index(h);
            float factor = v_scale;
            if (single) {
                float unused_lse;
                factor *= finish_head(m_s[h], l_s[h], sink_of(sinks, head, num_heads), unused_lse);
            }
            float o[VEC];
#pragma unroll
            for (int v = 0; v < VEC; ++v) o[v] = acc[i][v] * factor;
            if (single) {
                // A 16-byte vector of the cache type may span several of the output type.
#pragma unroll
                for (int v = 0; v < VEC; v += Elem<T>::VEC)
                    store16(out + head * D + pv_chunk * VEC + v, Elem<T>::narrow(&o[v]));
            } else {
                float* dst = part_acc + (head * max_partitions + w.part) * D + pv_chunk * VEC;
#pragma unroll
                for (int v = 0; v < VEC; v += 4) store16(dst + v, Elem<float>::narrow(&o[v]));
            }
        }
    }
    if (tid < nh) {
        const i64 head = w.row_index(tid);
        if (single) {
            if (lse != nullptr)
                finish_head(m_s[tid], l_s[tid], sink_of(sinks, head, num_heads), lse[head]);
        } else {
            part_max[head * max_partitions + w.part] = m_s[tid];
            part_sum[head * max_partitions + w.part] = l_s[tid];
        }
    }
}

}  // namespace cupa

// One extern "C" entry point per variant, so both NVRTC's and hipRTC's disk caches key on a plain
// name. The host appends CUPA_DECODE_VARIANT / CUPA_REDUCE_VARIANT lines for what it needs
// (CUPA_REDUCE_VARIANT lives in decode_common.cuh).
#define CUPA_DECODE_VARIANT(NAME, T, C, D, HT)                                                   \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS)                                  \
        NAME(CUPA_PARTITION_PARAMS(T, C)) {                                                      \
        cupa::start_in_chain(); /* see decode_common.cuh */                                     \
        cupa::decode_partition<T, C, D, HT>(CUPA_PARTITION_ARGS);                                \
    }
