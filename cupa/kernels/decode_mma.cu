// Phase 1 of paged decode on NVIDIA tensor cores (sm_80+, fp16/bf16 queries, head size 64, 128
// or 256, cache of the query type or fp8 codes). Two kernels: mma8 (query rows as the 8 columns;
// up to 8 rows; every head size) and mma16 (query rows as the 16 rows of an m-tile, one tile
// per warp, up to 64 rows per workgroup; head sizes 64 and 128). A query row is a (new token,
// query head) pair of the KV head: the heads of the GQA group, times the new tokens in
// multi-token decode (see begin_partition).
//
// With GQA the query heads of one KV head form a small matrix, so QK^T and PV are matrix products
// whose FMA cost on CUDA cores outgrows the memory time at group sizes of 4-8 and more. Here the
// query rows are an operand of mma.sync.m16n8k16 (rows past the group are zero).
//
// Memory: the workgroup streams its partition's K/V rows through a ring of shared-memory stages
// filled by cp.async (KvRing, KvStream), several chunks ahead of the warps; an XOR swizzle of
// the 16-byte units keeps the 8 rows an ldmatrix reads at one column in 8 different bank
// groups. The warps take their K and V fragments from the staged rows with ldmatrix (K) and
// ldmatrix.trans (V), 16-bit and fp8 caches alike (Frag: fp8 codes are read as 16-bit pairs and
// widened to float16 at use); P comes straight from the QK accumulators (the FA2 register reuse).
// Each warp computes 16-token steps of the staged chunks with its own running max and sum; the
// warps merge through shared memory at the end.
#include "common.cuh"
#include "decode_common.cuh"

// Workgroups per multiprocessor the register allocation must allow (a tuning knob).
#ifndef CUPA_MMA_MIN_BLOCKS
#define CUPA_MMA_MIN_BLOCKS 1
#endif

namespace cupa {

// The 16-bit type the tensor cores multiply in: the query's, or float16 for an fp8 cache (its
// codes widen exactly to float16; a bfloat16 query is rounded to float16, which keeps its 8
// mantissa bits and loses only magnitudes outside float16's range).
template <typename T, typename C> struct MmaTypeOf { typedef T type; };
template <typename T> struct MmaTypeOf<T, cupa_fp8> { typedef cupa_f16 type; };
template <typename T> struct MmaTypeOf<T, cupa_fp8_e4m3> { typedef cupa_f16 type; };

// Two consecutive query elements of type T as a packed pair of the mma type M.
template <typename T, typename M> struct QPair {
    CUPA_FN static u32 load(const T* p) {
        float f[2];
        Elem<T>::widen_word(*reinterpret_cast<const u32*>(p), f);
        return Elem<M>::narrow_word(f[0], f[1]);
    }
};
template <typename T> struct QPair<T, T> {
    CUPA_FN static u32 load(const T* p) { return *reinterpret_cast<const u32*>(p); }
};

template <typename T> struct MmaOp;

template <> struct MmaOp<cupa_f16> {
    CUPA_FN static void run(float* d, const u32* a, u32 b0, u32 b1) {
        asm(
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
        asm(
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


// ---- K/V staging ---------------------------------------------------------------------------
// The workgroup copies its partition's K/V rows into a ring of STAGES chunks of CHUNK tokens in
// shared memory, STAGES - 1 chunks ahead of the chunk the warps compute on. The copies hold no
// registers while in flight, so a workgroup keeps 24-64 KB of loads outstanding, and the warps of
// every row tile read the same staged rows (each K/V byte crosses from DRAM once per workgroup,
// whatever the number of rows).

// 16 (4) bytes global -> shared; with valid == false nothing is read and the bytes are zeroed.
CUPA_FN void copy16_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 ::"r"(shared_address(dst)), "l"(src), "r"(valid ? 16 : 0));
}
CUPA_FN void copy4_async(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 ::"r"(shared_address(dst)), "l"(src), "r"(valid ? 4 : 0));
}
CUPA_FN void commit_copies() { asm volatile("cp.async.commit_group;\n" ::); }
template <int PENDING> CUPA_FN void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}
CUPA_FN u32 dynamic_shared_bytes() {
    u32 n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}


// Layout of one stage: K rows, then V rows (CHUNK rows of ROW_BYTES each). After the stages:
// ID_SLOTS slots of CHUNK block ids (the block of each token of a chunk), which arrive by
// cp.async STAGES - 1 chunks ahead of the K/V copies that need them and also tell the warps
// which rows are readable (see KvStream::readable). variants.DecodeMmaVariant.shared_bytes
// mirrors BYTES.
template <typename C, int D>
struct KvRing {
    // 16-token steps a warp takes of every chunk, computed side by side: two for 1-byte caches
    // at head 128 (a stage then holds the bytes of a 16-bit one, and each barrier and softmax
    // reduction serves twice the tokens, which the fp8 step needs: it does the 16-bit step's
    // work for half the bytes), else one. (At head 64 the larger ring cost the fp8 kernel its
    // fifth workgroup per multiprocessor: slower where the grid needed them, docs/perf-log.md v12.)
    static constexpr int WARP_STEPS = sizeof(C) == 1 && D == 128 ? 2 : 1;
    static constexpr int CHUNK = 16 * (CUPA_THREADS / 32) * WARP_STEPS;
    static constexpr int ROW_BYTES = D * (int)sizeof(C);
    static constexpr int UNITS = ROW_BYTES / 16;            // 16-byte units per K/V row
    static constexpr int KV_BYTES = CHUNK * ROW_BYTES;
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;
    // STAGES - 1 chunks are in flight while the warps compute: 2-3, and 1 with the 64 KB stages
    // of float16 at head 256, where 2 stages are what fits sm_80's 163 KB (and one workgroup
    // per multiprocessor on sm_90).
    static constexpr int STAGES = KV_BYTES >= 32768 ? 2 : KV_BYTES >= 16384 ? 3 : 4;
    static constexpr int IDS_OFFSET = STAGES * STAGE_BYTES;
    static constexpr int ID_SLOTS = 2 * STAGES;  // see KvStream: chunks 0 .. 2 STAGES - 3 at once
    static constexpr int BYTES = IDS_OFFSET + ID_SLOTS * CHUNK * 4;
    // A copy pass is one cp.async a thread: whole rows, a warp's instruction covering 512
    // contiguous bytes (2-4 rows). Rows ROWS_PER_PASS apart share a swizzle (see pass_offset).
    static constexpr int ROWS_PER_PASS = CUPA_THREADS / UNITS;
    static constexpr int PASSES = CHUNK / ROWS_PER_PASS;
    static_assert(CHUNK % ROWS_PER_PASS == 0 && (ROWS_PER_PASS % 8 == 0 || ROWS_PER_PASS == 4),
                  "ring layout: a thread's copy rows share their swizzle (see pass_offset)");
    static_assert(CHUNK <= CUPA_THREADS, "one thread copies each token's block id");
    // A thread's rows in passes p and p + PHASES are 32 tokens apart: the same row of their
    // blocks, 32 being the largest block size (validation.SUPPORTED_BLOCK_SIZES). So each
    // phase's in-block offset is set once (KvStream::begin), and a row's address is one
    // multiply-add on its block id.
    static constexpr int MAX_BLOCK_SIZE = 32;
    static constexpr int PHASES = ROWS_PER_PASS >= MAX_BLOCK_SIZE ? 1 : MAX_BLOCK_SIZE / ROWS_PER_PASS;
    static_assert(CHUNK % MAX_BLOCK_SIZE == 0, "chunks start at the same row of a block");

    // Unit u of row r is stored at unit u ^ swizzle(r), so the 8 rows an ldmatrix reads at one
    // column (r .. r + 7, r a multiple of 8) sit in 8 different bank groups; 64-byte rows (fp8
    // at head 64) pair up in a 128-byte line. (A 16-byte row pad does the same and was measured
    // 7% slower at 1 GB: it misaligns the 128-byte cp.async writes.)
    CUPA_FN static int swizzle(int r) { return UNITS >= 8 ? (r & 7) : ((r >> 1) & 3); }

    // Where a thread's copy of pass p lands, from its pass-0 offset `dst` (row r0 < ROWS_PER_PASS).
    // Passes of 8 or more rows keep the row's swizzle; with 4-row passes (512-byte rows) the odd
    // passes' rows r0 + 4 (mod 8) flip bit 2 of the swizzle, i.e. 64 bytes of the offset.
    CUPA_FN static int pass_offset(int dst, int p) {
        const bool same = ROWS_PER_PASS % 8 == 0 || (p & 1) == 0;
        return p * ROWS_PER_PASS * ROW_BYTES + (same ? dst : dst ^ 64);
    }
};

// The copy side of the ring. Thread i copies unit i % UNITS of rows i / UNITS + p * ROWS_PER_PASS
// of each chunk (a warp covers whole rows: coalesced). The block ids a chunk's copies need come
// from the ring's id slots, themselves filled by cp.async: those of chunk k travel in the copy
// group of chunk k - STAGES + 1, so they have landed when the wait for that chunk returns, and no
// copy ever waits on a block-table read.
//   groups: [ids 0 .. 2S-3] (waited for in begin), then G_j = {K/V of chunk j, ids of j + S - 1}
//   stage(i): wait for G_0 .. G_i, copy chunk i + S - 1 (its ids came with G_i), ids of i + 2S - 2
//   id slot of chunk k: k % 2S; its previous chunk k - 2S was computed on before the barrier of
//   stage k - 2S + 1, and the slot is refilled after the barrier of stage k - 2S + 2.
// Rows past the partition's end or in a block outside the cache are zero-filled (never read).
template <typename C, int D>
struct KvStream {
    typedef KvRing<C, D> R;
    unsigned char* ring;
    // This thread's unit of its rows of phase f (passes p with p % PHASES == f) in block 0: the
    // row's address in block b is b * block_bytes past it.
    const unsigned char* k_src[R::PHASES];
    const unsigned char* v_src[R::PHASES];
    const i32* table;
    u32 block_bytes;  // bytes from one block to the next (all KV heads)
    int shift, end, num_blocks;
    int dst, start, chunks;

    CUPA_FN const i32* id_slot(int chunk) const {
        return reinterpret_cast<const i32*>(ring + R::IDS_OFFSET) + (chunk % R::ID_SLOTS) * R::CHUNK;
    }

    // Whether row r of `chunk` holds a token of the partition from a block inside the cache
    // (valid while the warps compute on the chunk).
    CUPA_FN bool readable(int chunk, int r) const {
        return start + chunk * R::CHUNK + r < end && (u32)id_slot(chunk)[r] < (u32)num_blocks;
    }

    // Thread t < CHUNK starts copying the block id of token t of `chunk` (zero past the end:
    // the readers check the end themselves).
    CUPA_FN void copy_ids(int chunk) {
        const int t = start + chunk * R::CHUNK + (int)threadIdx.x;
        if ((int)threadIdx.x < R::CHUNK && chunk < chunks) {
            const bool ok = t < end;
            i32* slot = const_cast<i32*>(id_slot(chunk)) + threadIdx.x;
            copy4_async(slot, table + (ok ? t >> shift : 0), ok);
        }
    }

    CUPA_FN void copy_chunk(int chunk) {
        unsigned char* stage = ring + (chunk % R::STAGES) * R::STAGE_BYTES;
        const int r0 = threadIdx.x / R::UNITS;
        const i32* ids = id_slot(chunk) + r0;
        const int t0 = start + chunk * R::CHUNK + r0;
#pragma unroll
        for (int p = 0; p < R::PASSES; ++p) {
            const i32 id = ids[p * R::ROWS_PER_PASS];
            const bool ok = t0 + p * R::ROWS_PER_PASS < end && (u32)id < (u32)num_blocks;
            // A row that is not copied reads nothing; its address stays inside the cache.
            const u32 block = ok ? (u32)id : 0u;
            unsigned char* to = stage + R::pass_offset(dst, p);
            copy16_async(to, offset_wide(k_src[p % R::PHASES], block, block_bytes), ok);
            copy16_async(to + R::KV_BYTES, offset_wide(v_src[p % R::PHASES], block, block_bytes), ok);
        }
    }

    // Fetches the block ids of the first 2 STAGES - 2 chunks of tokens [start_, rows.end) (one
    // round trip), then starts the K/V copies of the first STAGES - 1 chunks.
    CUPA_FN void begin(unsigned char* ring_, const C* k, const C* v, const PagedRows& rows,
                       int start_) {
        ring = ring_;
        const int u = threadIdx.x % R::UNITS;
        const int r0 = threadIdx.x / R::UNITS;
        // Chunks start multiples of 32 tokens apart, so phase f's rows all sit at row
        // (start_ + r0 + f * ROWS_PER_PASS) mod block_size of their blocks.
#pragma unroll
        for (int f = 0; f < R::PHASES; ++f) {
            const int row = (start_ + r0 + f * R::ROWS_PER_PASS) & ((1 << rows.shift) - 1);
            const i64 unit = (rows.head_offset + (i64)row * D) * (i64)sizeof(C) + 16 * u;
            k_src[f] = pinned(reinterpret_cast<const unsigned char*>(k) + unit);
            v_src[f] = pinned(reinterpret_cast<const unsigned char*>(v) + unit);
        }
        table = rows.table;
        block_bytes = (u32)(rows.block_stride * (i64)sizeof(C));
        shift = rows.shift;
        end = rows.end;
        num_blocks = rows.num_blocks;
        dst = pinned(r0 * R::ROW_BYTES + 16 * (u ^ R::swizzle(r0)));
        start = start_;
        chunks = (end - start + R::CHUNK - 1) / R::CHUNK;
#pragma unroll
        for (int k = 0; k < 2 * R::STAGES - 2; ++k) copy_ids(k);
        commit_copies();
        wait_copies<0>();
        __syncthreads();
#pragma unroll
        for (int k = 0; k < R::STAGES - 1; ++k) {
            if (k < chunks) copy_chunk(k);
            commit_copies();  // empty groups too: the wait below counts groups
        }
    }

    // Waits until chunk i has landed (for every thread), starts chunk i + STAGES - 1 into the
    // stage chunk i - 1 used (every warp is past it: the barrier) and the ids of chunk
    // i + 2 STAGES - 2, returns chunk i's stage.
    CUPA_FN const unsigned char* stage(int i) {
        wait_copies<R::STAGES - 2>();
        __syncthreads();
        const int next = i + R::STAGES - 1;
        if (next < chunks) copy_chunk(next);
        copy_ids(i + 2 * R::STAGES - 2);
        commit_copies();
        return ring + (i % R::STAGES) * R::STAGE_BYTES;
    }

    // After the last chunk: the ring's memory may be reused (the warp merge).
    CUPA_FN void end_copies() {
        wait_copies<0>();
        __syncthreads();
    }
};

// The tensor-core kernels' prologue: which work this workgroup owns (begin_partition) and the
// start of its K/V stream. Returns false when the workgroup has no work. (Requesting the first
// block ids before the sequence's length was tried: level where every workgroup works, and
// workgroups with no work, such as those before a sliding window, then had to wait for ids
// they never used; docs/perf-log.md v13.)
template <typename T, typename C, int ROWS, int D>
CUPA_FN bool begin_stream(PartitionWork& w, KvStream<C, D>& kv, unsigned char* ring,
                          CUPA_PARTITION_PARAMS(T, C)) {
    if (!begin_partition<T, ROWS, D>(w, out, lse, seq_lens, query_start_loc, sinks,
                                     sliding_window, num_tokens, num_heads, num_kv_heads,
                                     block_size, max_blocks_per_seq, partition_size,
                                     max_partitions, head_chunks, cluster_merge))
        return false;
    kv.begin(ring, key_cache, value_cache,
             paged_rows(w, block_tables, max_blocks_per_seq, num_kv_heads, block_size,
                        num_blocks, D),
             w.start);
    return true;
}

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
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}
CUPA_FN void load_matrices_transposed(u32 (&r)[4], u32 address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
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
    CUPA_FN static int dim(int tau, int n) { return 8 * tau + n; }
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
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(y) : "r"(w), "n"(LO | (8 | LO) << 4 | HI << 8 | (8 | HI) << 12));
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
    CUPA_FN static int dim(int tau, int n) { return 16 * (tau >> 1) + 2 * n + (tau & 1); }
};
template <> struct Frag<cupa_fp8> : Fp8Frag<cupa_fp8> {};
template <> struct Frag<cupa_fp8_e4m3> : Fp8Frag<cupa_fp8_e4m3> {};

// The K and V words of one warp step, as loaded. K_ROWS_INNER picks the matrix order of K (and
// the other one for V): the 8-column kernel takes K as an A operand (rows inner), the 16-row
// kernel as B operands (units inner).
template <typename C, int D, bool K_ROWS_INNER>
struct KvStep {
    typedef KvRing<C, D> R;
    typedef Frag<C> F;
    static constexpr int BLOCKS = R::ROW_BYTES / 32;  // 32-byte column blocks of a row
    u32 k[BLOCKS][4], v[BLOCKS][4];

    // A lane's byte offsets from a step's first row for column blocks j = 0..3 (K, then V);
    // block j + 4 is 128 bytes past block j (the swizzle only permutes units within 128 bytes).
    struct Lanes { u32 k[4], v[4]; };
    CUPA_FN static void lane_offsets(int lane, bool rows_inner, u32* out) {
        const int matrix = lane >> 3;
        const int row = (lane & 7) + 8 * (rows_inner ? matrix & 1 : matrix >> 1);
        const int unit = rows_inner ? matrix >> 1 : matrix & 1;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            out[j] = (u32)pinned(row * R::ROW_BYTES + 16 * ((2 * j + unit) ^ R::swizzle(row)));
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

    // Rows r0 .. r0 + 15 of a stage (r0 a multiple of 16): K, V or both.
    CUPA_FN void load_k(const unsigned char* stage, int r0, const Lanes& l) {
        const u32 rows = shared_address(stage) + r0 * R::ROW_BYTES;
#pragma unroll
        for (int j = 0; j < BLOCKS; ++j) load_matrices(k[j], rows + l.k[j & 3] + 128 * (j >> 2));
    }
    CUPA_FN void load_v(const unsigned char* stage, int r0, const Lanes& l) {
        const u32 rows = shared_address(stage) + r0 * R::ROW_BYTES + R::KV_BYTES;
#pragma unroll
        for (int j = 0; j < BLOCKS; ++j)
            load_matrices_transposed(v[j], rows + l.v[j & 3] + 128 * (j >> 2));
    }
    CUPA_FN void load(const unsigned char* stage, int r0, const Lanes& l) {
        load_k(stage, r0, l);
        load_v(stage, r0, l);
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

// Bytes of dynamic shared memory a kernel needs: the ring, reused by the warps' merge buffer.
template <typename C, int D, int TILE_ROWS>
__host__ __device__ constexpr int mma_shared_bytes() {
    return cmax(KvRing<C, D>::BYTES, (CUPA_THREADS / 32) * TILE_ROWS * D * (int)sizeof(float));
}

// Query elements dim, dim + 1 of local row r as an mma-type pair; zero past the chunk.
template <typename T, typename M, int D>
CUPA_FN u32 query_pair(const T* query, const PartitionWork& w, int r, int dim) {
    return r < w.nh ? QPair<T, M>::load(query + w.row_index(r) * D + dim) : 0u;
}

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

// Lazy max: a row's running max moves only when a logit passes it by more than LAZY_MAX (log2
// units). Until then the step's exponentials stay below 2^LAZY_MAX, well inside float16 and
// bfloat16, and the warp skips the row-max shuffles, the corrections and the rescale. The
// result does not depend on the max used, as long as the sum and the output use the same one
// (the merges take each warp's and partition's own max).
constexpr float LAZY_MAX = 8.f;
CUPA_FN bool passes_max(float mx, float m) { return mx > m + LAZY_MAX; }  // true for m = -inf

// ---- 9-64 query rows: rows are the M=16 rows of a warp's m-tile (S = Q K^T, O = P V). ------
// The workgroup's rows form up to NWARPS tiles of 16; the warps split evenly over the tiles (one
// tile: all four warps; two: two each; three or four: one each), and the warps of a tile share
// the 16-token steps of each staged chunk. Every tile reads the same staged K/V rows.
template <typename T, typename C, int D>
CUPA_FN void decode_partition_mma16(
    CUPA_PARTITION_PARAMS(T, C)) {
    typedef typename MmaTypeOf<T, C>::type M;
    typedef KvRing<C, D> R;
    typedef Frag<C> F;
    constexpr int TILE_ROWS = 16;           // rows per warp tile = mma M
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int ROWS = TILE_ROWS * NWARPS;
    constexpr int STEP = 16;                // tokens per warp step = mma K of the PV product
    constexpr int KSTEPS = D / 16;          // k16 steps of the head dim
    constexpr int NT = D / 8;               // dim tiles = n-tiles of the output
    static_assert(D % 64 == 0, "mma decode handles head sizes that are multiples of 64");

    extern __shared__ cupa_u32x4 dynamic_shared[];
    __shared__ float m_s[NWARPS][TILE_ROWS], l_s[NWARPS][TILE_ROWS];
    if (dynamic_shared_bytes() < (u32)mma_shared_bytes<C, D, TILE_ROWS>()) __trap();

    PartitionWork w;
    KvStream<C, D> kv;
    if (!begin_stream<T, C, ROWS, D>(w, kv, reinterpret_cast<unsigned char*>(dynamic_shared),
                                     CUPA_PARTITION_ARGS))
        return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    const int tiles = (w.nh + TILE_ROWS - 1) / TILE_ROWS;
    const int warps_per_tile = NWARPS / tiles;
    const int tile = warp / warps_per_tile, slot = warp % warps_per_tile;
    const int r_lo = tile * TILE_ROWS + g, r_hi = r_lo + 8;  // this lane's local rows
    const typename KvStep<C, D, false>::Lanes lanes = KvStep<C, D, false>::lanes(lane);

    // Q as A fragments, in the head-dim order of K (Frag::q_dim). Rows past the chunk are zero.
    u32 qf[KSTEPS][4];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            qf[s][2 * h] = query_pair<T, M, D>(query, w, r_lo, F::q_dim(s, h, c));
            qf[s][2 * h + 1] = query_pair<T, M, D>(query, w, r_hi, F::q_dim(s, h, c));
        }
    }
    const float qk_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    RowMask mask_lo, mask_hi;
    mask_lo.init(w, r_lo, alibi_slopes, sliding_window);
    mask_hi.init(w, r_hi, alibi_slopes, sliding_window);

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
        for (int step = first_step; step < STEPS; step += warps_per_tile) {
            const int base = w.start + i * R::CHUNK + step * STEP;
            KvStep<C, D, false> cur;
            cur.load(stage, step * STEP, lanes);
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
                MmaOp<M>::run((s & 1) ? s0b : s0, qf[s], cur.k_op(s, 0, 0), cur.k_op(s, 1, 0));
                MmaOp<M>::run((s & 1) ? s1b : s1, qf[s], cur.k_op(s, 0, 1), cur.k_op(s, 1, 1));
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
            if (__any_sync(0xffffffffu, passes_max(mx_lo, m_lo) || passes_max(mx_hi, m_hi))) {
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
            if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    acc[j][0] *= corr_lo; acc[j][1] *= corr_lo;
                    acc[j][2] *= corr_hi; acc[j][3] *= corr_hi;
                }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
                MmaOp<M>::run(acc[j], pf, cur.v_op(j, 0), cur.v_op(j, 1));
        }
    }
    kv.end_copies();

    // Each warp leaves its rows' max, sum and unnormalised output for the merge.
    float (*o_s)[TILE_ROWS][D] = reinterpret_cast<float (*)[TILE_ROWS][D]>(dynamic_shared);
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
        o_s[warp][g][d0] = acc[j][0];
        o_s[warp][g][d1] = acc[j][1];
        o_s[warp][g + 8][d0] = acc[j][2];
        o_s[warp][g + 8][d1] = acc[j][3];
    }
    __syncthreads();
    merge_warps_and_store<T, D, TILE_ROWS, NWARPS>(
        o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum, sinks, w, warps_per_tile,
        v_factor(kv_scales, w.kv_head, num_kv_heads), max_partitions, cluster_merge);
}

// ---- Up to 8 query rows: rows are the N=8 columns (S^T = K Q^T, O^T = V^T P^T). -------------
// Half the registers and mma work of the 16-row form when the rows fit in 8. K rows are the A
// operand of S^T (m = token), V^T that of O^T (m = head dim: m-tile i is dim tiles 2i and 2i + 1,
// rows g and g + 8). P^T reaches the B layout of the PV product through one movmatrix transpose
// per 8x8 tile. Each warp takes KvRing::WARP_STEPS 16-token steps of every staged chunk.
CUPA_FN u32 transpose8x8(u32 x) {
    u32 y;
    asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
    return y;
}

template <typename T, typename C, int D>
CUPA_FN void decode_partition_mma8(
    CUPA_PARTITION_PARAMS(T, C)) {
    typedef typename MmaTypeOf<T, C>::type M;
    typedef KvRing<C, D> R;
    typedef Frag<C> F;
    constexpr int HT = 8;                   // rows per workgroup = mma N
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int STEP = 16;
    constexpr int KSTEPS = D / 16;
    constexpr int MT = D / 16;              // m-tiles of the output (head-dim rows)
    static_assert(D % 64 == 0, "mma decode handles head sizes that are multiples of 64");
    constexpr int WS = R::WARP_STEPS;       // steps per warp and chunk
    constexpr bool V_LATE = D > 128;
    static_assert(R::CHUNK == NWARPS * WS * STEP, "WS steps per warp and chunk");

    extern __shared__ cupa_u32x4 dynamic_shared[];
    __shared__ float m_s[NWARPS][HT], l_s[NWARPS][HT];
    if (dynamic_shared_bytes() < (u32)mma_shared_bytes<C, D, HT>()) __trap();

    PartitionWork w;
    KvStream<C, D> kv;
    if (!begin_stream<T, C, HT, D>(w, kv, reinterpret_cast<unsigned char*>(dynamic_shared),
                                   CUPA_PARTITION_ARGS))
        return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    const typename KvStep<C, D, true>::Lanes lanes = KvStep<C, D, true>::lanes(lane);

    // Q^T as B fragments: row g, in the head-dim order of K (Frag::q_dim).
    u32 qb[KSTEPS][2];
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
        for (int h = 0; h < 2; ++h) qb[s][h] = query_pair<T, M, D>(query, w, g, F::q_dim(s, h, c));
    const float qk_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    RowMask mask_e, mask_o;  // rows 2c and 2c + 1, this lane's columns
    mask_e.init(w, 2 * c, alibi_slopes, sliding_window);
    mask_o.init(w, 2 * c + 1, alibi_slopes, sliding_window);

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
    auto load_chunk = [&](const unsigned char* st, int chunk, KvStep<C, D, true> (&f)[WS],
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
    KvStep<C, D, true> cur[WS];
    bool k_valid[WS][2];
    if (PIPELINED) {
        stage = kv.stage(0);
        load_chunk(stage, 0, cur, k_valid);
    }
    for (int chunk = 0; chunk < kv.chunks; ++chunk) {
        if (!PIPELINED) {
            stage = kv.stage(chunk);
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
        KvStep<C, D, true> nxt[WS];
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
        if (__any_sync(0xffffffffu, passes_max(mx_e, m_e) || passes_max(mx_o, m_o))) {
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
        if (__any_sync(0xffffffffu, moved)) {
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
    kv.end_copies();

    float (*o_s)[HT][D] = reinterpret_cast<float (*)[HT][D]>(dynamic_shared);
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
        o_s[warp][2 * c][d_lo] = acc[i][0];
        o_s[warp][2 * c + 1][d_lo] = acc[i][1];
        o_s[warp][2 * c][d_hi] = acc[i][2];
        o_s[warp][2 * c + 1][d_hi] = acc[i][3];
    }
    __syncthreads();
    merge_warps_and_store<T, D, HT, NWARPS>(o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum,
                                            sinks, w, NWARPS,
                                            v_factor(kv_scales, w.kv_head, num_kv_heads),
                                            max_partitions, cluster_merge);
}

}  // namespace cupa

#define CUPA_DECODE_MMA_VARIANT(NAME, KERNEL, T, C, D)                                           \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS, CUPA_MMA_MIN_BLOCKS)             \
        NAME(CUPA_PARTITION_PARAMS(T, C)) {                                                      \
        cupa::allow_dependent_grid(); /* the reduce may start its setup now */                   \
        cupa::KERNEL<T, C, D>(CUPA_PARTITION_ARGS);                                              \
    }
