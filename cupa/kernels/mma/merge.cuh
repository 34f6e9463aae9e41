// Merging partial results: the partitions of a cluster (sm_90, distributed shared memory) and the warps of a workgroup.
// A section of decode_mma.cu (which includes the sections in order); see its header.
#pragma once
#include "ops.cuh"

namespace cupa {

// ---- Merging the partitions of a cluster (sm_90) ----------------------------------------------
// Where the planner chooses it (plan.py), the partitions of one (sequence, KV head, row chunk)
// run as one thread-block cluster and merge through distributed shared memory, with no reduce
// launch: every workgroup with work leaves its rows' max, sum and unnormalised output in its own
// shared memory, and after a cluster barrier each of them merges a slice of the rows' columns
// from all of them. The reduce launch measured 2.7-4.4 us a call even when chained, and a merge
// through global memory by the last workgroup was no cheaper (docs/perf-log.md v14); the cluster
// barrier and the shared-memory reads stay on chip. Workgroups without work exit at once:
// blocks that exited count as arrived at the barrier (checked on the H200).
constexpr int MAX_CLUSTER = 16;  // partitions a cluster merges (the non-portable sm_90 limit)

CUPA_FN u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// x, which the compiler must then keep in a register as it is: it can no longer rebuild a
// per-thread value from threadIdx, or a pointer from a uniform base plus an offset, inside the
// loop that uses it (which it does to save registers the kernel has to spare).
#if CUPA_CPU
CUPA_FN const unsigned char* pinned(const unsigned char* x) { return x; }
CUPA_FN int pinned(int x) { return x; }
CUPA_FN const unsigned char* offset_wide(const unsigned char* base, u32 a, u32 b) {
    return base + (u64)a * b;
}
#else
CUPA_FN const unsigned char* pinned(const unsigned char* x) {
    asm("" : "+l"(x));
    return x;
}
CUPA_FN int pinned(int x) {
    asm("" : "+r"(x));
    return x;
}

// base + a * b with a 32 x 32 -> 64-bit multiply-add: one instruction.
CUPA_FN const unsigned char* offset_wide(const unsigned char* base, u32 a, u32 b) {
    const unsigned char* r;
    asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(r) : "r"(a), "r"(b), "l"(base));
    return r;
}
#endif

CUPA_FN void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#elif CUPA_CPU
    cupa_cpu_cluster_sync();
#else
    __trap();  // the host launches clusters on sm_90+ only
#endif
}

// a and b to p, p + 1 (8-byte aligned) in one store.
CUPA_FN void store_pair(float* p, float a, float b) {
    cupa_u32x2 v;
    v.x = float_to_bits(a);
    v.y = float_to_bits(b);
    *reinterpret_cast<cupa_u32x2*>(p) = v;
}

// Four consecutive output elements, scaled by factor: one 8-byte store for 16-bit T where p is
// 8-byte aligned (always, for an output cupa allocates), else one store each.
template <typename T>
CUPA_FN void store_out4(T* p, const float* x, float factor) {
    if constexpr (sizeof(T) == 2) {
        if ((reinterpret_cast<u64>(p) & 7u) == 0) {
            cupa_u32x2 v;
            v.x = Elem<T>::narrow_word(x[0] * factor, x[1] * factor);
            v.y = Elem<T>::narrow_word(x[2] * factor, x[3] * factor);
            *reinterpret_cast<cupa_u32x2*>(p) = v;
            return;
        }
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) Elem<T>::store(p + e, x[e] * factor);
}

// Loads from the shared memory of the cluster's block `rank` at the address `local` has here.
CUPA_FN u32 cluster_address(u32 local, int rank) {
    u32 remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
#elif CUPA_CPU
    remote = cupa_cpu_cluster_address(local, rank);
#endif
    return remote;
}
CUPA_FN float cluster_load(u32 address) {
    float x = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(address) : "memory");
#elif CUPA_CPU
    x = cupa_cpu_cluster_load(address);
#endif
    return x;
}
CUPA_FN void cluster_load4(u32 address, float* x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(address) : "memory");
#elif CUPA_CPU
    cupa_cpu_cluster_load4(address, x);
#endif
}

// The cross-partition merge: row r's max and sum are row_m[r], row_l[r] and its unnormalised
// output o_s[w0][tr] in every working block of the cluster (its rank is its partition). Each
// working block takes an equal, contiguous slice of the (row, 4 columns) units, so that each
// pulls 1/parts of the partials over the cluster's network; each unit's loads from all
// partitions are issued before any is used.
template <typename T, int D, int TILE_ROWS, int ROW>
CUPA_FN void merge_cluster(float (*o_s)[TILE_ROWS][ROW], const float* row_m, const float* row_l,
                           int warps_per_tile, T* out, float* lse, const float* sinks,
                           const PartitionWork& w) {
    constexpr int GROUPS = D / 4;
    cluster_sync();  // every working block's rows are in its shared memory
    const int units = w.nh * GROUPS;
    const int slice = (units + w.parts - 1) / w.parts;
    const int slice_start = (w.part - w.first) * slice;
    const int slice_end = cmin(slice_start + slice, units);
    for (int u = slice_start + threadIdx.x; u < slice_end; u += CUPA_THREADS) {
        const int r = u / GROUPS, col = 4 * (u % GROUPS);
        const int tr = r % TILE_ROWS, w0 = (r / TILE_ROWS) * warps_per_tile;
        float mp[MAX_CLUSTER], lp[MAX_CLUSTER], op[MAX_CLUSTER][4];
#pragma unroll
        for (int p = 0; p < MAX_CLUSTER; ++p) {
            if (p >= w.parts) break;
            mp[p] = cluster_load(cluster_address(shared_address(row_m + r), w.first + p));
            lp[p] = cluster_load(cluster_address(shared_address(row_l + r), w.first + p));
            cluster_load4(cluster_address(shared_address(&o_s[w0][tr][col]), w.first + p),
                          op[p]);
        }
        float top = neg_inf();
#pragma unroll
        for (int p = 0; p < MAX_CLUSTER; ++p)
            if (p < w.parts) top = max_f(top, mp[p]);
        const float use = subtrahend(top);
        float total = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int p = 0; p < MAX_CLUSTER; ++p) {
            if (p >= w.parts) break;
            const float f = fast_exp2(mp[p] - use);
            total += f * lp[p];
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[e] += f * op[p][e];
        }
        const i64 head = w.row_index(r);
        float lse_value;
        const float factor = finish_head(top, total, sink_of(sinks, head, w.num_heads), lse_value);
        store_out4(out + head * D + col, acc, factor);
        if (lse != nullptr && col == 0) lse[head] = lse_value;
    }
    cluster_sync();  // no block leaves while another still reads its shared memory
}

// Epilogue shared by the mma kernels. Rows come in tiles of TILE_ROWS; the warps of a tile
// (warps_per_tile consecutive warps) each left its unnormalised output rows, running max and sum
// in shared memory. Combine them and write the final output (one partition), this partition's
// float32 partials for the reduce launch, or (cluster merge) the combined rows in place of the
// first warp's o_s rows for merge_cluster; v_scale is the fp8 value scale (1 otherwise).
// One pass with no barrier: each row takes `tpr` threads (a power of two, as many as the rows
// leave), which each work out the row's warp weights, sum and output index once and then merge
// every tpr-th group of 4 columns. The two-pass form (weights by one thread a row, a barrier,
// then one element a thread, its index computed per element) took 6.4 us a workgroup in the
// 16-row kernel and 1.4 us in the 8-column one; this one 1.5 and 0.9 (docs/perf-log.md v24),
// and since v45 (every warp's load of a group issued before the sum, 8-byte output stores)
// 1.2 in the 16-row kernel (group 16, 128 x 1024; 1.6 before).
template <typename T, int D, int TILE_ROWS, int NWARPS, int ROW>
CUPA_FN void merge_warps_and_store(float (*o_s)[TILE_ROWS][ROW], float (*m_s)[TILE_ROWS],
                                   float (*l_s)[TILE_ROWS], T* out, float* lse,
                                   float* part_acc, float* part_max, float* part_sum,
                                   const float* sinks, const PartitionWork& w,
                                   int warps_per_tile, float v_scale, int max_partitions,
                                   int cluster_merge) {
    constexpr int MAX_ROWS = NWARPS * TILE_ROWS;
    constexpr int GROUPS = D / 4;  // 4-column groups of a row
    __shared__ float row_m[MAX_ROWS], row_l[MAX_ROWS];  // the cluster merge's inputs
    const bool in_cluster = cluster_merge && !w.writes_output;
    int tpr_log = 0;  // tpr = 1 << tpr_log, at most GROUPS (shifts, not divisions)
    while ((2 << tpr_log) <= GROUPS && (2 << tpr_log) * w.nh <= CUPA_THREADS) ++tpr_log;
    const int tpr = 1 << tpr_log;
    const int first_group = threadIdx.x & (tpr - 1);
    for (int r = threadIdx.x >> tpr_log; r < w.nh; r += CUPA_THREADS >> tpr_log) {
        const int tr = r % TILE_ROWS, w0 = (r / TILE_ROWS) * warps_per_tile;
        float m = neg_inf();
#pragma unroll
        for (int k = 0; k < NWARPS; ++k)
            if (k < warps_per_tile) m = max_f(m, m_s[w0 + k][tr]);
        const float use = subtrahend(m);
        float l = 0.f, weight[NWARPS];  // the warps' weights in the merged output
#pragma unroll
        for (int k = 0; k < NWARPS; ++k) {
            const float f = k < warps_per_tile ? fast_exp2(m_s[w0 + k][tr] - use) : 0.f;
            if (k < warps_per_tile) l += f * l_s[w0 + k][tr];
            weight[k] = f * v_scale;
        }
        const i64 head = w.row_index(r);
        const i64 slot = head * max_partitions + w.part;  // the reduce's partials
        float factor = 1.f;  // normalisation of the final output
        if (w.writes_output) {
            float lse_value;
            factor = finish_head(m, l, sink_of(sinks, head, w.num_heads), lse_value);
            if (lse != nullptr && first_group == 0) lse[head] = lse_value;
        } else if (first_group == 0) {
            if (in_cluster) {
                row_m[r] = m;
                row_l[r] = l;
            } else {
                part_max[slot] = m;
                part_sum[slot] = l;
            }
        }
        for (int group = first_group; group < GROUPS; group += tpr) {
            const int col = 4 * group;
            // Every warp's load issued before any is used (a warp past the tile reads zeros:
            // its weight is 0, and its rows may lie past the buffer).
            float x[NWARPS][4];
#pragma unroll
            for (int k = 0; k < NWARPS; ++k) {
                cupa_u32x4 raw = {0u, 0u, 0u, 0u};
                if (k < warps_per_tile)
                    raw = *reinterpret_cast<const cupa_u32x4*>(&o_s[w0 + k][tr][col]);
                Elem<float>::widen(raw, x[k]);
            }
            float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int k = 0; k < NWARPS; ++k)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[e] += weight[k] * x[k][e];
            if (w.writes_output) {
                store_out4(out + head * D + col, o, factor);
            } else if (in_cluster) {  // read above by this thread only
                *reinterpret_cast<cupa_u32x4*>(&o_s[w0][tr][col]) = Elem<float>::narrow(o);
            } else {
                *reinterpret_cast<cupa_u32x4*>(part_acc + slot * D + col) = Elem<float>::narrow(o);
            }
        }
    }
    if (in_cluster) merge_cluster<T, D, TILE_ROWS>(o_s, row_m, row_l, warps_per_tile, out, lse,
                                                  sinks, w);
}

// The visible range and ALiBi slope of one query row, in the log2 domain: the row attends to
// tokens [first, pos]. Rows past the chunk (r >= nh) see nothing.
struct RowMask {
    int first, pos;
    float slope;
    CUPA_FN void init(const PartitionWork& w, int r, const float* alibi_slopes,
                      int sliding_window) {
        const bool row = r < w.nh;
        pos = row ? w.row_pos(r) : -1;
        first = row ? window_first(pos, sliding_window) : 0;
        slope = alibi_slopes != nullptr && row
                    ? alibi_slopes[w.row_index(r) % w.num_heads] * LOG2E : 0.f;
    }
    // The final log2-domain logit of token t from its scaled, soft-capped q.k (scale_and_cap),
    // or -inf if the row does not see it.
    CUPA_FN float logit(float x, int t, bool readable) const {
        return readable && t >= first && t <= pos ? x + slope * (float)(t - pos) : neg_inf();
    }
};

}  // namespace cupa
