// Phase 1 of paged decode on NVIDIA tensor cores (sm_80+, fp16/bf16 queries, head size 64 or
// 128, cache of the query type or fp8 codes). Two kernels: mma8 (query rows as the 8 columns;
// up to 8 rows) and mma16 (query rows as the 16 rows of an m-tile, one tile per warp, up to 64
// rows per workgroup). A query row is a (new token, query head) pair of the KV head: the heads of
// the GQA group, times the new tokens in multi-token decode (see begin_partition).
//
// With GQA the query heads of one KV head form a small matrix, so QK^T and PV are matrix products
// whose FMA cost on CUDA cores outgrows the memory time at group sizes of 4-8 and more. Here the
// query rows are an operand of mma.sync.m16n8k16 (rows past the group are zero).
//
// Memory: the workgroup streams its partition's K/V rows through a ring of shared-memory stages
// filled by cp.async (KvStream), several chunks ahead; the warps read their fragments from the
// staged rows. Fragment layout without ldmatrix: the order of the summed index of a matrix
// product does not matter, so we permute it to make every fragment read 16 (fp8: 8) bytes wide.
//   QK (S = Q K^T, k = head dim): lane (g = lane/4, c = lane%4) reads K[token g][32b + 8c .. +8]
//     and feeds its four 32-bit words as the B fragments of two k16 steps; Q's A fragments are
//     loaded with the same permutation once per workgroup.
//   PV (O = P V, k = token): P comes straight from the QK accumulators (the FA2 register reuse);
//     n-tile j of the output maps to head-dim column 64*(j/8) + 8*n + j%8, so lane (g, c) reads
//     V[token][64b + 8g .. +8] for its four tokens {2c, 2c+1, 2c+8, 2c+9} and packs pairs of them
//     with one byte-permute per B fragment. Output columns come back as 16 contiguous values
//     per 64-column block.
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

// 8 consecutive elements of a K/V row: `load8` fetches them as they are stored (Raw, what a
// lane keeps in flight while the previous step computes), `widen` turns them into four words of
// packed 16-bit pairs of the mma type when the step uses them. Widening at use, not at load,
// keeps the loads asynchronous: an fp8 conversion right after the load would wait for it.
template <typename C> struct KvLoad {
    typedef cupa_u32x4 Raw;
    CUPA_FN static Raw load8(const C* p) { return load16(p); }
    CUPA_FN static cupa_u32x4 widen(const Raw& r) { return r; }
};
struct Fp8Raw { u32 lo, hi; };  // 8 codes
CUPA_FN Fp8Raw load8_codes(const void* p) {
    const u64 w = *reinterpret_cast<const u64*>(p);
    const Fp8Raw r = {(u32)w, (u32)(w >> 32)};
    return r;
}
// Either e4m3 format, in software (see Elem<cupa_fp8>): values times 2^(bias - 15).
template <> struct KvLoad<cupa_fp8> {
    typedef Fp8Raw Raw;
    CUPA_FN static Raw load8(const cupa_fp8* p) { return load8_codes(p); }
    CUPA_FN static cupa_u32x4 widen(const Raw& r) {
        typedef Elem<cupa_fp8> E;
        const cupa_u32x4 w = {E::half_pair(r.lo, false), E::half_pair(r.lo, true),
                              E::half_pair(r.hi, false), E::half_pair(r.hi, true)};
        return w;
    }
};
// OCP e4m3fn with the hardware conversion where there is one (sm_89+): exact values. Below
// sm_89 the software widening, so values times 2^-8; variants.fp8_value_power tells the host.
template <> struct KvLoad<cupa_fp8_e4m3> {
    typedef Fp8Raw Raw;
    CUPA_FN static Raw load8(const cupa_fp8_e4m3* p) { return load8_codes(p); }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // Codes of bytes 0-1 (hi = false) or 2-3 of w as a float16 pair, byte 0 in the low half.
    CUPA_FN static u32 cvt_pair(u32 w, bool hi) {
        u32 r;
        const u16 two = (u16)(hi ? w >> 16 : w & 0xffffu);
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(two));
        return r;
    }
    CUPA_FN static cupa_u32x4 widen(const Raw& r) {
        const cupa_u32x4 w = {cvt_pair(r.lo, false), cvt_pair(r.lo, true),
                              cvt_pair(r.hi, false), cvt_pair(r.hi, true)};
        return w;
    }
#else
    CUPA_FN static cupa_u32x4 widen(const Raw& r) { return KvLoad<cupa_fp8>::widen(r); }
#endif
};

// 8 consecutive query elements of type T as packed pairs of the mma type M.
template <typename T, typename M> struct QLoad {
    CUPA_FN static cupa_u32x4 load8(const T* p) {
        float f[8];
        Elem<T>::widen(load16(p), f);
        return Elem<M>::narrow(f);
    }
};
template <typename T> struct QLoad<T, T> {
    CUPA_FN static cupa_u32x4 load8(const T* p) { return load16(p); }
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

CUPA_FN u32 word(const cupa_u32x4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Half e (0..7) of vector a in the low 16 bits, half e of vector b in the high 16 bits.
CUPA_FN u32 pair_halves(const cupa_u32x4& a, const cupa_u32x4& b, int e) {
    return __byte_perm(word(a, e >> 1), word(b, e >> 1), (e & 1) ? 0x7632 : 0x5410);
}

// Epilogue shared by the mma kernels. Rows come in tiles of TILE_ROWS; the warps of a tile
// (warps_per_tile consecutive warps) each left its unnormalised output rows, running max and sum
// in shared memory. Combine them and write the final output (one partition) or this partition's
// float32 partials; v_scale is the fp8 value scale (1 otherwise).
template <typename T, int D, int TILE_ROWS, int NWARPS>
CUPA_FN void merge_warps_and_store(const float (*o_s)[TILE_ROWS][D], const float (*m_s)[TILE_ROWS],
                                   const float (*l_s)[TILE_ROWS], T* out, float* lse,
                                   float* part_acc, float* part_max, float* part_sum,
                                   const float* sinks, const PartitionWork& w,
                                   int warps_per_tile, float v_scale, int max_partitions) {
    for (int i = threadIdx.x; i < w.nh * D; i += CUPA_THREADS) {
        const int r = i / D, d = i % D;
        const int tr = r % TILE_ROWS, w0 = (r / TILE_ROWS) * warps_per_tile;
        float m = neg_inf();
        for (int k = 0; k < warps_per_tile; ++k) m = max_f(m, m_s[w0 + k][tr]);
        const float use = m == neg_inf() ? 0.f : m;
        float l = 0.f, o = 0.f;
        for (int k = 0; k < warps_per_tile; ++k) {
            const float f = fast_exp2(m_s[w0 + k][tr] - use);
            l += f * l_s[w0 + k][tr];
            o += f * o_s[w0 + k][tr][d];
        }
        o *= v_scale;
        const i64 head = w.row_index(r);
        if (max_partitions == 1) {
            float lse_value;
            const float factor = finish_head(m, l, sink_of(sinks, head, w.num_heads), lse_value);
            Elem<T>::store(out + head * D + d, o * factor);
            if (d == 0 && lse != nullptr) lse[head] = lse_value;
        } else {
            part_acc[(head * max_partitions + w.part) * D + d] = o;
            if (d == 0) {
                part_max[head * max_partitions + w.part] = m;
                part_sum[head * max_partitions + w.part] = l;
            }
        }
    }
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
    // The final log2-domain logit of token t from its raw q.k, or -inf if the row does not see it.
    CUPA_FN float logit(float raw, int t, bool readable, float qk_scale, float soft_cap) const {
        return readable && t >= first && t <= pos
                   ? soft_cap_log2(raw * qk_scale, soft_cap) + slope * (float)(t - pos)
                   : neg_inf();
    }
};

// ---- K/V staging ---------------------------------------------------------------------------
// The workgroup copies its partition's K/V rows into a ring of STAGES chunks of CHUNK tokens in
// shared memory with cp.async, STAGES - 1 chunks ahead of the chunk the warps compute on. The
// copies hold no registers while in flight, so a workgroup keeps 24-64 KB of loads outstanding
// at 130-210 registers a thread, and the warps of every row tile read the same staged rows
// (each K/V byte crosses from DRAM once per workgroup, whatever the number of rows).

CUPA_FN u32 shared_address(const void* p) { return (u32)__cvta_generic_to_shared(p); }

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

// Layout of one stage: K rows, V rows (CHUNK x D elements of C each), one readable flag per token
// (0 past the partition's end or for a block id outside the cache; such rows are zero-filled).
// After the stages: ID_SLOTS slots of CHUNK block ids (the block of each token of a chunk), which
// arrive by cp.async STAGES - 1 chunks ahead of the K/V copies that need them.
// variants.DecodeMmaVariant.shared_bytes mirrors BYTES.
template <typename C, int D>
struct KvRing {
    static constexpr int CHUNK = 16 * (CUPA_THREADS / 32);  // one 16-token step per warp
    static constexpr int ROW_BYTES = D * (int)sizeof(C);
    static constexpr int UNITS = ROW_BYTES / 16;            // 16-byte units per K/V row
    static constexpr int KV_BYTES = CHUNK * ROW_BYTES;
    static constexpr int STAGE_BYTES = 2 * KV_BYTES + CHUNK;
    static constexpr int STAGES = KV_BYTES >= 16384 ? 3 : 4;
    static constexpr int IDS_OFFSET = STAGES * STAGE_BYTES;
    static constexpr int ID_SLOTS = 2 * STAGES;  // see KvStream: chunks 0 .. 2 STAGES - 3 at once
    static constexpr int BYTES = IDS_OFFSET + ID_SLOTS * CHUNK * 4;
    static constexpr int ROWS_PER_PASS = CUPA_THREADS / UNITS;  // rows one copy instruction covers
    static constexpr int PASSES = CHUNK / ROWS_PER_PASS;
    static_assert(STAGE_BYTES % 16 == 0 && CHUNK % ROWS_PER_PASS == 0, "ring layout");

    // The units of row r are stored permuted (unit ^ swizzle(r)): the fragment reads of KvStep
    // touch one unit on each of 2-4 rows at a time, and unpermuted rows would all start on the
    // same bank. The permutation depends on the element size because the read patterns do.
    CUPA_FN static int swizzle(int r) {
        return sizeof(C) == 2 ? ((((r >> 1) & 3) << 1) ^ ((r & 1) << 2))
                              : (((r & 3) ^ ((r >> 1) & 3)) << 1);
    }
    // Byte offset of element e (a multiple of 8) of row r in a stage's K (or V) rows.
    CUPA_FN static int offset(int r, int e) {
        const int byte = e * (int)sizeof(C);
        return r * ROW_BYTES + ((((byte >> 4) ^ swizzle(r)) & (UNITS - 1)) << 4) + (byte & 15);
    }
};

// The copy side of the ring. Thread i copies unit i % UNITS of rows i / UNITS + p * ROWS_PER_PASS
// of each chunk (a warp covers whole rows: coalesced). The block ids a chunk's copies need come
// from the ring's id slots, themselves filled by cp.async: those of chunk k travel in the copy
// group of chunk k - STAGES + 1, so they have landed when the wait for that chunk returns, and no
// copy ever waits on a block-table read (in v7 each chunk's copies stalled on one).
//   groups: [ids 0 .. 2S-3] (waited for in begin), then G_j = {K/V of chunk j, ids of j + S - 1}
//   stage(i): wait for G_0 .. G_i, copy chunk i + S - 1 (its ids came with G_i), ids of i + 2S - 2
//   id slot of chunk k: k % 2S; its previous chunk k - 2S was copied at stage k - 3S + 1, before
//   the barrier of the stage k - 2S + 2 that overwrites it.
template <typename C, int D>
struct KvStream {
    typedef KvRing<C, D> R;
    // Every row a thread copies has the same swizzle (rows r0 + p * ROWS_PER_PASS share their
    // low three bits, which is all swizzle() reads), so its destinations are one offset plus
    // compile-time steps, and its sources one per-thread base plus a 32 x 32-bit product.
    static_assert(R::ROWS_PER_PASS % 8 == 0, "a thread's rows share their swizzle");
    unsigned char* ring;
    const unsigned char* k_src;  // this thread's 16-byte unit of the KV head's rows, block 0
    const unsigned char* v_src;
    const i32* table;
    u32 block_bytes;  // bytes from one block to the next (all KV heads)
    int row_mask, shift, end, num_blocks;
    int dst, start, chunks;

    CUPA_FN i32* id_slot(int chunk) const {
        return reinterpret_cast<i32*>(ring + R::IDS_OFFSET) + (chunk % R::ID_SLOTS) * R::CHUNK;
    }

    // Thread t < CHUNK starts copying the block id of token t of `chunk` (zero past the end:
    // copy_chunk checks the end itself).
    CUPA_FN void copy_ids(int chunk) {
        const int t = start + chunk * R::CHUNK + (int)threadIdx.x;
        if ((int)threadIdx.x < R::CHUNK && chunk < chunks) {
            const bool ok = t < end;
            copy4_async(id_slot(chunk) + threadIdx.x, table + (ok ? t >> shift : 0), ok);
        }
    }

    CUPA_FN void copy_chunk(int chunk) {
        unsigned char* stage = ring + (chunk % R::STAGES) * R::STAGE_BYTES;
        const i32* ids = id_slot(chunk);
        const int r0 = threadIdx.x / R::UNITS;
        const int t0 = start + chunk * R::CHUNK + r0;
        const bool flag_writer = threadIdx.x % R::UNITS == 0;
#pragma unroll
        for (int p = 0; p < R::PASSES; ++p) {
            const int r = r0 + p * R::ROWS_PER_PASS, t = t0 + p * R::ROWS_PER_PASS;
            const i32 id = ids[r];
            const bool ok = t < end && (u32)id < (u32)num_blocks;
            // Rows that are not copied read from offset 0 (valid memory, never dereferenced).
            const u32 block = ok ? (u32)id : 0u;
            const u32 row = ok ? (u32)((t & row_mask) * R::ROW_BYTES) : 0u;
            const u64 src = (u64)block * block_bytes + row;
            unsigned char* to = stage + dst + p * R::ROWS_PER_PASS * R::ROW_BYTES;
            copy16_async(to, k_src + src, ok);
            copy16_async(to + R::KV_BYTES, v_src + src, ok);
            if (flag_writer) stage[2 * R::KV_BYTES + r] = ok;
        }
    }

    // Fetches the block ids of the first 2 STAGES - 2 chunks of tokens [start_, rows.end) (one
    // round trip), then starts the K/V copies of the first STAGES - 1 chunks.
    CUPA_FN void begin(unsigned char* ring_, const C* k, const C* v, const PagedRows& rows,
                       int start_) {
        ring = ring_;
        const int u = threadIdx.x % R::UNITS;
        const i64 unit = rows.head_offset * (i64)sizeof(C) + 16 * u;
        k_src = reinterpret_cast<const unsigned char*>(k) + unit;
        v_src = reinterpret_cast<const unsigned char*>(v) + unit;
        table = rows.table;
        block_bytes = (u32)(rows.block_stride * (i64)sizeof(C));
        shift = rows.shift;
        row_mask = (1 << rows.shift) - 1;
        end = rows.end;
        num_blocks = rows.num_blocks;
        dst = R::offset(threadIdx.x / R::UNITS, u * (16 / (int)sizeof(C)));
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

// The K/V fragments of one 16-token step of a warp, read from a stage: lane (g, c) takes K rows
// g and g + 8 (elements 32b + 8c .. +8, see the header) and V rows 2c, 2c + 1, 2c + 8, 2c + 9
// (elements 64b + 8g .. +8), as stored; KvLoad widens them at use.
template <typename C, int D>
struct KvStep {
    typedef KvRing<C, D> R;
    static constexpr int QK_BLOCKS = D / 32;  // 16-byte K vectors per row a lane reads
    static constexpr int V_VECS = D / 64;     // 8-element V vectors per row a lane reads
    typedef typename KvLoad<C>::Raw Raw;
    Raw k0[QK_BLOCKS], k1[QK_BLOCKS], v[4][V_VECS];
    bool k_valid[2], v_valid[4];

    CUPA_FN void load(const unsigned char* stage, int r0, int g, int c) {
        const unsigned char* k_s = stage;
        const unsigned char* v_s = stage + R::KV_BYTES;
        const unsigned char* ok_s = stage + 2 * R::KV_BYTES;
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            k0[b] = KvLoad<C>::load8(
                reinterpret_cast<const C*>(k_s + R::offset(r0 + g, 32 * b + 8 * c)));
            k1[b] = KvLoad<C>::load8(
                reinterpret_cast<const C*>(k_s + R::offset(r0 + g + 8, 32 * b + 8 * c)));
        }
        const int v_rows[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
#pragma unroll
            for (int b = 0; b < V_VECS; ++b)
                v[t][b] = KvLoad<C>::load8(
                    reinterpret_cast<const C*>(v_s + R::offset(r0 + v_rows[t], 64 * b + 8 * g)));
            v_valid[t] = ok_s[r0 + v_rows[t]] != 0;
        }
        k_valid[0] = ok_s[r0 + g] != 0;
        k_valid[1] = ok_s[r0 + g + 8] != 0;
    }

    // The V vectors as mma-type pairs (see KvLoad).
    CUPA_FN void widen_v(cupa_u32x4 (*out)[V_VECS]) const {
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int b = 0; b < V_VECS; ++b) out[t][b] = KvLoad<C>::widen(v[t][b]);
    }
};

// Bytes of dynamic shared memory a kernel needs: the ring, reused by the warps' merge buffer.
template <typename C, int D, int TILE_ROWS>
__host__ __device__ constexpr int mma_shared_bytes() {
    return cmax(KvRing<C, D>::BYTES, (CUPA_THREADS / 32) * TILE_ROWS * D * (int)sizeof(float));
}

// Query elements [offset, offset + 8) of local row r as mma-type pairs; zero past the chunk.
template <typename T, typename M, int D>
CUPA_FN cupa_u32x4 query_or_zero(const T* query, const PartitionWork& w, int r, int offset) {
    const cupa_u32x4 zero = {0u, 0u, 0u, 0u};
    return r < w.nh ? QLoad<T, M>::load8(query + w.row_index(r) * D + offset) : zero;
}

// ---- 9-64 query rows: rows are the M=16 rows of a warp's m-tile (S = Q K^T, O = P V). ------
// The workgroup's rows form up to NWARPS tiles of 16; the warps split evenly over the tiles (one
// tile: all four warps; two: two each; three or four: one each), and the warps of a tile share
// the four 16-token steps of each staged chunk. Every tile reads the same staged K/V rows.
template <typename T, typename C, int D>
CUPA_FN void decode_partition_mma16(
    CUPA_PARTITION_PARAMS(T, C)) {
    typedef typename MmaTypeOf<T, C>::type M;
    typedef KvRing<C, D> R;
    constexpr int TILE_ROWS = 16;           // rows per warp tile = mma M
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int ROWS = TILE_ROWS * NWARPS;
    constexpr int STEP = 16;                // tokens per warp step = mma K of the PV product
    constexpr int QK_BLOCKS = D / 32;       // 32-column blocks of the head dim (2 k16 steps each)
    constexpr int NT = D / 8;               // n-tiles of the output
    static_assert(D % 64 == 0, "mma decode handles head sizes that are multiples of 64");

    extern __shared__ cupa_u32x4 dynamic_shared[];
    __shared__ float m_s[NWARPS][TILE_ROWS], l_s[NWARPS][TILE_ROWS];
    if (dynamic_shared_bytes() < (u32)mma_shared_bytes<C, D, TILE_ROWS>()) __trap();

    PartitionWork w;
    if (!begin_partition<T, ROWS, D>(w, out, lse, seq_lens, query_start_loc, sinks,
                                     sliding_window, num_tokens, num_heads, num_kv_heads,
                                     block_size, max_blocks_per_seq, partition_size,
                                     max_partitions, head_chunks))
        return;
    const PagedRows rows = paged_rows(w, block_tables, max_blocks_per_seq, num_kv_heads,
                                      block_size, num_blocks, D);
    KvStream<C, D> kv;
    kv.begin(reinterpret_cast<unsigned char*>(dynamic_shared), key_cache, value_cache, rows,
             w.start);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;
    const int tiles = (w.nh + TILE_ROWS - 1) / TILE_ROWS;
    const int warps_per_tile = NWARPS / tiles;
    const int tile = warp / warps_per_tile, slot = warp % warps_per_tile;
    const int r_lo = tile * TILE_ROWS + g, r_hi = r_lo + 8;  // this lane's local rows

    // Q as A fragments, permuted like K (see the header). Rows past the chunk are zero.
    u32 qf[QK_BLOCKS][2][4];
#pragma unroll
    for (int b = 0; b < QK_BLOCKS; ++b) {
        const cupa_u32x4 qa = query_or_zero<T, M, D>(query, w, r_lo, 32 * b + 8 * c);
        const cupa_u32x4 qb = query_or_zero<T, M, D>(query, w, r_hi, 32 * b + 8 * c);
        qf[b][0][0] = qa.x; qf[b][0][1] = qb.x; qf[b][0][2] = qa.y; qf[b][0][3] = qb.y;
        qf[b][1][0] = qa.z; qf[b][1][1] = qb.z; qf[b][1][2] = qa.w; qf[b][1][3] = qb.w;
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
    const int first_step = tile < tiles ? slot : NWARPS;
    for (int i = 0; i < kv.chunks; ++i) {
        const unsigned char* stage = kv.stage(i);
        for (int step = first_step; step < NWARPS; step += warps_per_tile) {
            const int base = w.start + i * R::CHUNK + step * STEP;
            KvStep<C, D> cur;
            cur.load(stage, step * STEP, g, c);

            // S = Q K^T for tokens base + 0..7 (s0) and base + 8..15 (s1), each summed in two
            // independent accumulators (halves of the head dim's k16 steps) to halve the chain
            // of dependent mma's.
            float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
            float s0b[4] = {0.f, 0.f, 0.f, 0.f}, s1b[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int b = 0; b < QK_BLOCKS; ++b) {
                const cupa_u32x4 k0 = KvLoad<C>::widen(cur.k0[b]);
                const cupa_u32x4 k1 = KvLoad<C>::widen(cur.k1[b]);
                MmaOp<M>::run(s0, qf[b][0], k0.x, k0.y);
                MmaOp<M>::run(s0b, qf[b][1], k0.z, k0.w);
                MmaOp<M>::run(s1, qf[b][0], k1.x, k1.y);
                MmaOp<M>::run(s1b, qf[b][1], k1.z, k1.w);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s0[e] += s0b[e];
                s1[e] += s1b[e];
            }
            // Scale, soft-cap, ALiBi, masks. Element i: row r_lo (i & 2 == 0) or r_hi, V token
            // (i & 1) | (i & 4) >> 1.
            float s[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const int tok = (e & 1) | ((e & 4) >> 1);  // 0: 2c, 1: 2c+1, 2: 2c+8, 3: 2c+9
                const int t = base + 2 * c + (e & 1) + (e & 4 ? 8 : 0);
                const float raw = e < 4 ? s0[e] : s1[e - 4];
                s[e] = ((e & 2) ? mask_hi : mask_lo).logit(raw, t, cur.v_valid[tok], qk_scale,
                                                           soft_cap);
            }
            // Online softmax per row; the four lanes of a quad share a row.
            float mx_lo = max_f(max_f(s[0], s[1]), max_f(s[4], s[5]));
            float mx_hi = max_f(max_f(s[2], s[3]), max_f(s[6], s[7]));
            mx_lo = max_f(mx_lo, warp_xor(mx_lo, 1));
            mx_lo = max_f(mx_lo, warp_xor(mx_lo, 2));
            mx_hi = max_f(mx_hi, warp_xor(mx_hi, 1));
            mx_hi = max_f(mx_hi, warp_xor(mx_hi, 2));
            const float new_lo = max_f(m_lo, mx_lo), new_hi = max_f(m_hi, mx_hi);
            // Subtract 0 instead of -inf while nothing was readable: exp2 gives 0, never NaN.
            const float use_lo = new_lo == neg_inf() ? 0.f : new_lo;
            const float use_hi = new_hi == neg_inf() ? 0.f : new_hi;
            const float corr_lo = fast_exp2(m_lo - use_lo), corr_hi = fast_exp2(m_hi - use_hi);
            m_lo = new_lo;
            m_hi = new_hi;
            float p[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) p[e] = fast_exp2(s[e] - ((e & 2) ? use_hi : use_lo));
            l_lo = l_lo * corr_lo + p[0] + p[1] + p[4] + p[5];
            l_hi = l_hi * corr_hi + p[2] + p[3] + p[6] + p[7];
            // P as the A fragment: rows r_lo / r_hi, tokens 2c.. (k 0-7) and 8 + 2c.. (k 8-15).
            u32 pf[4];
            pf[0] = MmaOp<M>::pack(p[0], p[1]);
            pf[1] = MmaOp<M>::pack(p[2], p[3]);
            pf[2] = MmaOp<M>::pack(p[4], p[5]);
            pf[3] = MmaOp<M>::pack(p[6], p[7]);
            cupa_u32x4 v[4][KvStep<C, D>::V_VECS];
            cur.widen_v(v);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                acc[j][0] *= corr_lo; acc[j][1] *= corr_lo;
                acc[j][2] *= corr_hi; acc[j][3] *= corr_hi;
                const int b = j >> 3, e = j & 7;
                MmaOp<M>::run(acc[j], pf, pair_halves(v[0][b], v[1][b], e),
                              pair_halves(v[2][b], v[3][b], e));
            }
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
        const int d = 64 * (j >> 3) + 16 * c + (j & 7);
        o_s[warp][g][d] = acc[j][0];
        o_s[warp][g][d + 8] = acc[j][1];
        o_s[warp][g + 8][d] = acc[j][2];
        o_s[warp][g + 8][d + 8] = acc[j][3];
    }
    __syncthreads();
    merge_warps_and_store<T, D, TILE_ROWS, NWARPS>(
        o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum, sinks, w, warps_per_tile,
        v_factor(kv_scales, w.kv_head, num_kv_heads), max_partitions);
}

// ---- Up to 8 query rows: rows are the N=8 columns (S^T = K Q^T, O^T = V^T P^T). -------------
// Half the registers and mma work of the 16-row form when the rows fit in 8. K and V rows are
// the A operands, read 16 bytes at a time with the same index permutations as above (for V the
// permuted index is the head dim: m-tile i, row g <-> column d(i), row g + 8 <-> d(MT + i) with
// d(k) = 64 (k / 8) + 8 g + k % 8, so a lane's V elements are the 8g.. vectors KvStep reads for
// the 16-row form too). P^T reaches the B layout of the PV product through one movmatrix
// transpose per 8x8 tile. Each warp takes one 16-token step of every staged chunk.
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
    constexpr int HT = 8;                   // rows per workgroup = mma N
    constexpr int NWARPS = CUPA_THREADS / 32;
    constexpr int STEP = 16;
    constexpr int QK_BLOCKS = D / 32;
    constexpr int MT = D / 16;              // m-tiles of the output (head-dim rows)
    static_assert(D % 64 == 0, "mma decode handles head sizes that are multiples of 64");
    static_assert(R::CHUNK == NWARPS * STEP, "one step per warp and chunk");

    extern __shared__ cupa_u32x4 dynamic_shared[];
    __shared__ float m_s[NWARPS][HT], l_s[NWARPS][HT];
    if (dynamic_shared_bytes() < (u32)mma_shared_bytes<C, D, HT>()) __trap();

    PartitionWork w;
    if (!begin_partition<T, HT, D>(w, out, lse, seq_lens, query_start_loc, sinks, sliding_window,
                                   num_tokens, num_heads, num_kv_heads, block_size,
                                   max_blocks_per_seq, partition_size, max_partitions,
                                   head_chunks))
        return;
    const PagedRows rows = paged_rows(w, block_tables, max_blocks_per_seq, num_kv_heads,
                                      block_size, num_blocks, D);
    KvStream<C, D> kv;
    kv.begin(reinterpret_cast<unsigned char*>(dynamic_shared), key_cache, value_cache, rows,
             w.start);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane >> 2, c = lane & 3;

    // Q^T as B fragments: lane (g, c) holds row g, columns 32b + 8c .. +8.
    cupa_u32x4 qv[QK_BLOCKS];
#pragma unroll
    for (int b = 0; b < QK_BLOCKS; ++b) qv[b] = query_or_zero<T, M, D>(query, w, g, 32 * b + 8 * c);
    const float qk_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    RowMask mask_e, mask_o;  // rows 2c and 2c + 1, this lane's columns
    mask_e.init(w, 2 * c, alibi_slopes, sliding_window);
    mask_o.init(w, 2 * c + 1, alibi_slopes, sliding_window);

    float acc[MT][4];  // O^T: rows d(i, g) / d(i, g+8), columns heads 2c, 2c + 1
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m_e = neg_inf(), m_o = neg_inf();  // running max of rows 2c and 2c + 1
    float l_e = 0.f, l_o = 0.f;              // this lane's share of their sums

    for (int chunk = 0; chunk < kv.chunks; ++chunk) {
        const unsigned char* stage = kv.stage(chunk);
        const int base = w.start + chunk * R::CHUNK + warp * STEP;
        KvStep<C, D> cur;
        cur.load(stage, warp * STEP, g, c);

        // S^T for tokens base + g (st[0], st[1]) and base + g + 8 (st[2], st[3]), heads 2c, 2c+1;
        // two independent accumulators (see the 16-row kernel) summed at the end.
        float st[4] = {0.f, 0.f, 0.f, 0.f}, st2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int b = 0; b < QK_BLOCKS; ++b) {
            const cupa_u32x4 k0 = KvLoad<C>::widen(cur.k0[b]), k1 = KvLoad<C>::widen(cur.k1[b]);
            const u32 a1[4] = {k0.x, k1.x, k0.y, k1.y};
            const u32 a2[4] = {k0.z, k1.z, k0.w, k1.w};
            MmaOp<M>::run(st, a1, qv[b].x, qv[b].y);
            MmaOp<M>::run(st2, a2, qv[b].z, qv[b].w);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) st[i] += st2[i];
        float s[4];  // rows 2c (even i) and 2c + 1 (odd i); tokens base + g and base + g + 8
#pragma unroll
        for (int i = 0; i < 4; ++i)
            s[i] = ((i & 1) ? mask_o : mask_e).logit(st[i], base + g + 8 * (i >> 1),
                                                     cur.k_valid[i >> 1], qk_scale, soft_cap);
        // Online softmax per row (column): the 8 lanes with the same c share a row pair.
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
        // P^T tiles (tokens x rows) -> B fragments: row g, tokens 2c, 2c+1 (+8).
        const u32 pb0 = transpose8x8(MmaOp<M>::pack(p0, p1));
        const u32 pb1 = transpose8x8(MmaOp<M>::pack(p2, p3));
        cupa_u32x4 v[4][KvStep<C, D>::V_VECS];
        cur.widen_v(v);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            acc[i][0] *= corr_e; acc[i][1] *= corr_o;
            acc[i][2] *= corr_e; acc[i][3] *= corr_o;
            // Head-dim rows d(i) (lane row g) and d(MT + i) (row g + 8); see above.
            const int lo = i, hi = MT + i;
            const u32 a[4] = {pair_halves(v[0][lo >> 3], v[1][lo >> 3], lo & 7),
                              pair_halves(v[0][hi >> 3], v[1][hi >> 3], hi & 7),
                              pair_halves(v[2][lo >> 3], v[3][lo >> 3], lo & 7),
                              pair_halves(v[2][hi >> 3], v[3][hi >> 3], hi & 7)};
            MmaOp<M>::run(acc[i], a, pb0, pb1);
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
        const int d_lo = 64 * (i >> 3) + 8 * g + (i & 7);
        const int d_hi = 64 * ((MT + i) >> 3) + 8 * g + ((MT + i) & 7);
        o_s[warp][2 * c][d_lo] = acc[i][0];
        o_s[warp][2 * c + 1][d_lo] = acc[i][1];
        o_s[warp][2 * c][d_hi] = acc[i][2];
        o_s[warp][2 * c + 1][d_hi] = acc[i][3];
    }
    __syncthreads();
    merge_warps_and_store<T, D, HT, NWARPS>(o_s, m_s, l_s, out, lse, part_acc, part_max, part_sum,
                                            sinks, w, NWARPS,
                                            v_factor(kv_scales, w.kv_head, num_kv_heads),
                                            max_partitions);
}

}  // namespace cupa

#define CUPA_DECODE_MMA_VARIANT(NAME, KERNEL, T, C, D)                                           \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS, CUPA_MMA_MIN_BLOCKS)             \
        NAME(CUPA_PARTITION_PARAMS(T, C)) {                                                      \
        cupa::KERNEL<T, C, D>(CUPA_PARTITION_ARGS);                                              \
    }
