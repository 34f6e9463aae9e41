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

CUPA_FN void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __trap();  // the host launches clusters on sm_90+ only
#endif
}

// Loads from the shared memory of the cluster's block `rank` at the address `local` has here.
CUPA_FN u32 cluster_address(u32 local, int rank) {
    u32 remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
#endif
    return remote;
}
CUPA_FN float cluster_load(u32 address) {
    float x = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(x) : "r"(address) : "memory");
#endif
    return x;
}
CUPA_FN void cluster_load4(u32 address, float* x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(x[0]), "=f"(x[1]), "=f"(x[2]), "=f"(x[3]) : "r"(address) : "memory");
#endif
}

// The cross-partition merge: row r's max and sum are row_m[r], row_l[r] and its unnormalised
// output o_s[w0][tr] in every working block of the cluster (its rank is its partition). Each
// working block takes a slice of the (row, 4 columns) units; each unit's loads from all
// partitions are issued before any is used.
template <typename T, int D, int TILE_ROWS>
CUPA_FN void merge_cluster(float (*o_s)[TILE_ROWS][D], const float* row_m, const float* row_l,
                           int warps_per_tile, T* out, float* lse, const float* sinks,
                           const PartitionWork& w) {
    constexpr int GROUPS = D / 4;
    cluster_sync();  // every working block's rows are in its shared memory
    const int units = w.nh * GROUPS;
    for (int u = (w.part - w.first) * CUPA_THREADS + threadIdx.x; u < units;
         u += w.parts * CUPA_THREADS) {
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
#pragma unroll
        for (int e = 0; e < 4; ++e) Elem<T>::store(out + head * D + col + e, acc[e] * factor);
        if (lse != nullptr && col == 0) lse[head] = lse_value;
    }
    cluster_sync();  // no block leaves while another still reads its shared memory
}

// Epilogue shared by the mma kernels. Rows come in tiles of TILE_ROWS; the warps of a tile
// (warps_per_tile consecutive warps) each left its unnormalised output rows, running max and sum
// in shared memory. Combine them and write the final output (one partition), this partition's
// float32 partials for the reduce launch, or (cluster merge) the combined rows in place of the
// first warp's o_s rows for merge_cluster; v_scale is the fp8 value scale (1 otherwise). One
// thread per row first turns the row's maxima into the warps' weights (in place of m_s) and its
// normalisation factor (in place of the first warp's l_s), so the loop over the row's elements
// only multiplies and adds.
template <typename T, int D, int TILE_ROWS, int NWARPS>
CUPA_FN void merge_warps_and_store(float (*o_s)[TILE_ROWS][D], float (*m_s)[TILE_ROWS],
                                   float (*l_s)[TILE_ROWS], T* out, float* lse,
                                   float* part_acc, float* part_max, float* part_sum,
                                   const float* sinks, const PartitionWork& w,
                                   int warps_per_tile, float v_scale, int max_partitions,
                                   int cluster_merge) {
    constexpr int MAX_ROWS = NWARPS * TILE_ROWS;
    __shared__ float row_m[MAX_ROWS], row_l[MAX_ROWS];  // the cluster merge's inputs
    const bool in_cluster = cluster_merge && !w.writes_output;
    for (int r = threadIdx.x; r < w.nh; r += CUPA_THREADS) {
        const int tr = r % TILE_ROWS, w0 = (r / TILE_ROWS) * warps_per_tile;
        float m = neg_inf();
        for (int k = 0; k < warps_per_tile; ++k) m = max_f(m, m_s[w0 + k][tr]);
        const float use = subtrahend(m);
        float l = 0.f;
        for (int k = 0; k < warps_per_tile; ++k) {
            const float f = fast_exp2(m_s[w0 + k][tr] - use);
            l += f * l_s[w0 + k][tr];
            m_s[w0 + k][tr] = f * v_scale;
        }
        const i64 head = w.row_index(r);
        float factor = 1.f;
        if (w.writes_output) {
            float lse_value;
            factor = finish_head(m, l, sink_of(sinks, head, w.num_heads), lse_value);
            if (lse != nullptr) lse[head] = lse_value;
        } else if (in_cluster) {
            row_m[r] = m;
            row_l[r] = l;
        } else {
            part_max[head * max_partitions + w.part] = m;
            part_sum[head * max_partitions + w.part] = l;
        }
        l_s[w0][tr] = factor;
    }
    __syncthreads();
#pragma unroll 4
    for (int i = threadIdx.x; i < w.nh * D; i += CUPA_THREADS) {
        const int r = i / D, d = i % D;
        const int tr = r % TILE_ROWS, w0 = (r / TILE_ROWS) * warps_per_tile;
        float o = 0.f;
        for (int k = 0; k < warps_per_tile; ++k) o += m_s[w0 + k][tr] * o_s[w0 + k][tr][d];
        const i64 head = w.row_index(r);
        if (w.writes_output) Elem<T>::store(out + head * D + d, o * l_s[w0][tr]);
        else if (in_cluster) o_s[w0][tr][d] = o;  // read above by this thread only
        else part_acc[(head * max_partitions + w.part) * D + d] = o;
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
