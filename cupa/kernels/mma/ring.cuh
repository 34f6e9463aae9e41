// K/V staging: cp.async copies into a ring of shared-memory stages, several chunks ahead of the warps.
// A section of decode_mma.cu (which includes the sections in order); see its header.
#pragma once
#include "merge.cuh"

// The ring stages of a wide form (catalogue.module_defines); 0: KvRing's rule.
#ifndef CUPA_RING_STAGES
#define CUPA_RING_STAGES 0
#endif

namespace cupa {

// ---- K/V staging ---------------------------------------------------------------------------
// The workgroup copies its partition's K/V rows into a ring of STAGES chunks of CHUNK tokens in
// shared memory, STAGES - 1 chunks ahead of the chunk the warps compute on. The copies hold no
// registers while in flight, so a workgroup keeps 24-64 KB of loads outstanding, and the warps of
// every row tile read the same staged rows (each K/V byte crosses from DRAM once per workgroup,
// whatever the number of rows).

// 16 (4) bytes global -> shared; with valid == false nothing is read and the bytes are zeroed.
// The CPU build (cuda_on_cpu's shim) lands a copy at its thread's wait, poison until then.
#if CUPA_CPU
CUPA_FN void copy16_async(void* dst, const void* src, bool valid) {
    cupa_cpu_copy(dst, src, valid ? 16 : 0, 16);
}
CUPA_FN void copy4_async(void* dst, const void* src, bool valid) {
    cupa_cpu_copy(dst, src, valid ? 4 : 0, 4);
}
CUPA_FN void commit_copies() { cupa_cpu_commit_copies(); }
template <int PENDING> CUPA_FN void wait_copies() { cupa_cpu_wait_copies(PENDING); }
CUPA_FN u32 dynamic_shared_bytes() { return cupa_cpu_dynamic_shared_bytes; }
// The workgroup's dynamic shared memory: a static of the largest size on the CPU.
#define CUPA_DYNAMIC_SHARED(name) __shared__ cupa_u32x4 name[CUPA_CPU_DYNAMIC_SHARED_BYTES / 16]
#else
#define CUPA_DYNAMIC_SHARED(name) extern __shared__ cupa_u32x4 name[]
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
#endif


// The head size a K/V row is staged at in shared memory. Rows between heads 64 and 128 (80, 96,
// 112) at their own width, 160-224 bytes (16-bit) or 80-112 (fp8), so that a stage is a copy of
// the global rows' bytes in the same order (see KvRing::swizzle) and the ring holds as many
// stages as their bytes allow. Other head sizes: the next of 64, 128 and 256; a head size
// between them (192) is copied into the first D elements of a row of that size. The units
// past D are never copied, and no operand takes them: the warps compute D / 16 k16 steps and
// D / 16 output m-tiles. catalogue.staged_head_size mirrors it (docs/perf-log.md v41, v43).
__host__ __device__ constexpr int staged_head_size(int d) {
    return d > 64 && d < 128 ? d : d <= 64 ? 64 : d <= 128 ? 128 : 256;
}

// Layout of one stage: K rows, then V rows (CHUNK rows of ROW_BYTES each). After the stages:
// ID_SLOTS slots of CHUNK block ids (the block of each token of a chunk), which arrive by
// cp.async STAGES - 1 chunks ahead of the K/V copies that need them and also tell the warps
// which rows are readable (see KvStream::readable). variants.DecodeMmaVariant.shared_bytes
// mirrors BYTES. DENSE_STAGES > 0 makes the ring of a dense variant (see decode_mma.cu): that
// many stages, one step a warp; 0 takes the rules below.
template <typename C, int D, int DENSE_STAGES = 0>
struct KvRing {
    // 16-token steps a warp takes of every chunk, computed side by side: two for 1-byte caches
    // staged above head 64 (a stage then holds the bytes of a 16-bit one, and each barrier and
    // softmax reduction serves twice the tokens, which the fp8 step needs: it does the 16-bit
    // step's work for half the bytes), else one. (At head 64 the larger ring cost the fp8
    // kernel its fifth workgroup per multiprocessor: slower where the grid needed them,
    // docs/perf-log.md v12.)
    static constexpr int STAGED_D = staged_head_size(D);
    static constexpr int WARP_STEPS =
        DENSE_STAGES == 0 && sizeof(C) == 1 && STAGED_D > 64 && STAGED_D <= 128 ? 2 : 1;
    static constexpr int CHUNK = 16 * (CUPA_THREADS / 32) * WARP_STEPS;
    static constexpr int ROW_BYTES = STAGED_D * (int)sizeof(C);
    static constexpr int UNITS = ROW_BYTES / 16;            // 16-byte units per staged K/V row
    static constexpr int COPY_UNITS = D * (int)sizeof(C) / 16;  // those the row fills
    static_assert(D * (int)sizeof(C) % 16 == 0 && D % 16 == 0, "whole k16 steps and units");
    static constexpr int KV_BYTES = CHUNK * ROW_BYTES;
    static constexpr int STAGE_BYTES = 2 * KV_BYTES;
    // STAGES - 1 chunks are in flight while the warps compute: 2-3, and 1 with the 64 KB stages
    // of a 16-bit cache staged at head 256, where 2 stages are what fits sm_80's 163 KB. (Four
    // stages of chunks above 12 KB, e.g. head 112 at its own width, would not fit two
    // workgroups in a multiprocessor's 228 KB; head 96's 12 KB do.) A wide or deep form's
    // module sets its own (CUPA_RING_STAGES: the wide form's 64 KB stages of 8 warps' chunks
    // would get the rule's 2; the deep form is those 64 KB stages, 3 of them, in sm_90's 227 KB).
    static constexpr int STAGES = DENSE_STAGES > 0 ? DENSE_STAGES
                                  : CUPA_RING_STAGES > 0 ? CUPA_RING_STAGES
                                  : KV_BYTES >= 32768 ? 2 : KV_BYTES > 12288 ? 3 : 4;
    static constexpr int IDS_OFFSET = STAGES * STAGE_BYTES;
    static constexpr int ID_SLOTS = 2 * STAGES;  // see KvStream: chunks 0 .. 2 STAGES - 3 at once
    static constexpr int BYTES = IDS_OFFSET + ID_SLOTS * CHUNK * 4;
    // A copy pass is one cp.async a thread: whole rows, a warp's instruction covering 512
    // contiguous bytes (2-4 rows). Rows ROWS_PER_PASS apart share a swizzle (see pass_offset).
    // An own-width row (see staged_head_size) takes 8 rows a pass at 10-14 units (16-bit), 16 at
    // 5-7 (fp8), and the threads past COPY_THREADS copy nothing.
    static constexpr bool OWN_WIDTH = UNITS % 8 != 0 && UNITS > 4;
    static_assert(!OWN_WIDTH || UNITS < 16, "an own-width row: 5-7 or 10-14 units");
    static constexpr int ROWS_PER_PASS = OWN_WIDTH ? (UNITS > 8 ? 8 : 16) : CUPA_THREADS / UNITS;
    static constexpr int COPY_THREADS = ROWS_PER_PASS * UNITS;
    static constexpr int PASSES = CHUNK / ROWS_PER_PASS;
    // Whether a chunk's copy reads all its passes' block ids before it issues the first copy
    // (KvStream::copy_chunk): 0.4-3.4% faster from 8 x 4096 up, a workgroup streaming alone up
    // to 10% (docs/perf-log.md v46). Not in the default form of a 16-bit cache at head 64,
    // which serves only grids of less than a workgroup a multiprocessor and lost 1-2% at
    // 1 x 4096 in three sessions. Its dense form spills 4 bytes at its 128-register cap with
    // the ids and still gained 0.2-0.9% from 0.27 GB (v47).
    static constexpr bool IDS_FIRST = sizeof(C) == 1 || STAGED_D > 64 || DENSE_STAGES > 0;
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

    // Unit u of row r is stored at unit u ^ swizzle(r), which keeps two things:
    // - the 8 rows an ldmatrix reads at one column (r .. r + 7, r a multiple of 8) sit in 8
    //   different bank groups. Row r starts at unit UNITS * r, so LINE_ROWS consecutive rows
    //   start on LINE_ROWS different bank groups, multiples of LINE_UNITS (the largest power of
    //   two, up to 8, dividing UNITS); the swizzle, constant over such a run, gives each run a
    //   different low part;
    // - a 128-byte line of the global rows lands in one 128-byte line of the stage under one XOR
    //   of its units: the stage holds the rows' bytes in their global order, a line's units
    //   belong to rows of one run, and XOR by less than LINE_UNITS stays inside a row. Otherwise
    //   the L2 gets two requests for that line: 1.67 a line at head 96 with v41's own-width
    //   swizzle (the head by r & 7, the tail by (r >> 1) & 3), where phase 1 ran up to 13%
    //   longer (docs/perf-log.md v43).
    // Rows of whole 128-byte groups: r & 7; 64-byte rows (fp8 at head 64): (r >> 1) & 3; own
    // width: (r >> 1) & 3 at head 96, (r >> 2) & 1 at heads 80 and 112 and fp8 at 96, none for
    // fp8 at 80 and 112 (an odd number of units a row already spreads 8 rows over 8 bank
    // groups). (A 16-byte row pad keeps the banks apart too, and was measured 7% slower at 1 GB:
    // it misaligns the 128-byte writes.)
    static constexpr int LINE_UNITS =
        UNITS % 8 == 0 ? 8 : UNITS % 4 == 0 ? 4 : UNITS % 2 == 0 ? 2 : 1;
    static constexpr int LINE_ROWS = 8 / LINE_UNITS;
    CUPA_FN static int swizzle(int r) { return (r / LINE_ROWS) & (LINE_UNITS - 1); }
    CUPA_FN static int stored_unit(int u, int r) { return u ^ swizzle(r); }

    // Where a thread's copy of pass p lands, from its pass-0 offset `dst` (row r0 < ROWS_PER_PASS).
    // Passes of 8 or more rows keep the row's swizzle; with 4-row passes (512-byte rows) the odd
    // passes' rows r0 + 4 (mod 8) flip bit 2 of the swizzle, i.e. 64 bytes of the offset.
    CUPA_FN static int pass_offset(int dst, int p) {
        const bool same = ROWS_PER_PASS % 8 == 0 || (p & 1) == 0;
        return p * ROWS_PER_PASS * ROW_BYTES + (same ? dst : dst ^ 64);
    }
};

// The copy side of the ring. Thread i copies unit i % UNITS of rows i / UNITS + p * ROWS_PER_PASS
// of each chunk (a warp covers whole rows: coalesced), if that unit holds part of the row
// (COPY_UNITS). The block ids a chunk's copies need come from the ring's id slots, themselves
// filled by cp.async: those of chunk k travel in the copy group of chunk k - STAGES + 1, so they
// have landed when the wait for that chunk returns, and no copy ever waits on a block-table read.
//   groups: [ids 0 .. 2S-3] (waited for in begin), then G_j = {K/V of chunk j, ids of j + S - 1}
//   stage(i): wait for G_0 .. G_i, copy chunk i + S - 1 (its ids came with G_i), ids of i + 2S - 2
//   id slot of chunk k: k % 2S; its previous chunk k - 2S was computed on before the barrier of
//   stage k - 2S + 1, and the slot is refilled after the barrier of stage k - 2S + 2.
// Rows past the partition's end or in a block outside the cache are zero-filled (never read).
template <typename C, int D, int DENSE_STAGES = 0>
struct KvStream {
    typedef KvRing<C, D, DENSE_STAGES> R;
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
        if (R::COPY_UNITS < R::UNITS && (int)threadIdx.x % R::UNITS >= R::COPY_UNITS) return;
        if (R::COPY_THREADS < CUPA_THREADS && (int)threadIdx.x >= R::COPY_THREADS) return;
        // The copies' asm volatile keeps a shared-memory read from moving above an earlier copy,
        // so ids read inside the copy loop each waited for their own round trip.
        i32 pass_ids[R::PASSES];
        if constexpr (R::IDS_FIRST) {
#pragma unroll
            for (int p = 0; p < R::PASSES; ++p) pass_ids[p] = ids[p * R::ROWS_PER_PASS];
        }
#pragma unroll
        for (int p = 0; p < R::PASSES; ++p) {
            const i32 id = R::IDS_FIRST ? pass_ids[p] : ids[p * R::ROWS_PER_PASS];
            const bool ok = t0 + p * R::ROWS_PER_PASS < end && (u32)id < (u32)num_blocks;
            // A row that is not copied reads nothing; its address stays inside the cache.
            const u32 block = ok ? (u32)id : 0u;
            unsigned char* to = stage + R::pass_offset(dst, p);
            copy16_async(to, offset_wide(k_src[p % R::PHASES], block, block_bytes), ok);
            copy16_async(to + R::KV_BYTES, offset_wide(v_src[p % R::PHASES], block, block_bytes), ok);
        }
    }

    // Starts copying the block ids of the first 2 STAGES - 2 chunks of tokens [start_, end_)
    // (early_ids: end_ is the partition's nominal end, before the length is known).
    CUPA_FN void begin_ids(unsigned char* ring_, const i32* table_, int start_, int end_,
                           int shift_) {
        ring = ring_;
        table = table_;
        start = start_;
        end = end_;
        shift = shift_;
        chunks = (end - start + R::CHUNK - 1) / R::CHUNK;
#pragma unroll
        for (int k = 0; k < 2 * R::STAGES - 2; ++k) copy_ids(k);
        commit_copies();
    }

    // Fetches the block ids of the first 2 STAGES - 2 chunks of tokens [start_, rows.end) (one
    // round trip) unless begin_ids has (ids_started), then starts the K/V copies of the first
    // STAGES - 1 chunks.
    CUPA_FN void begin(unsigned char* ring_, const C* k, const C* v, const PagedRows& rows,
                       int start_, bool ids_started) {
        if (!ids_started) begin_ids(ring_, rows.table, start_, rows.end, rows.shift);
        const int u = threadIdx.x % R::UNITS;
        const int r0 = threadIdx.x / R::UNITS;
        // Chunks start multiples of 32 tokens apart, so phase f's rows all sit at row
        // (start_ + r0 + f * ROWS_PER_PASS) mod block_size of their blocks. A row's byte offset
        // in its block is below 2^30 (rows < 32, token strides < 2^24 elements of at most 2
        // bytes): one 32-bit multiply a phase on the prologue's path (docs/perf-log.md v53).
        const i64 head_unit = rows.head_offset * (i64)sizeof(C) + 16 * u;
        const u32 row_bytes = rows.token_stride * (u32)sizeof(C);
#pragma unroll
        for (int f = 0; f < R::PHASES; ++f) {
            const u32 row = (u32)(start_ + r0 + f * R::ROWS_PER_PASS) & ((1u << rows.shift) - 1u);
            const i64 unit = head_unit + (i64)(row * row_bytes);
            k_src[f] = pinned(reinterpret_cast<const unsigned char*>(k) + unit);
            v_src[f] = pinned(reinterpret_cast<const unsigned char*>(v) + unit);
        }
        block_bytes = (u32)(rows.block_stride * (i64)sizeof(C));
        end = rows.end;  // the real end: the early ids past it are never used
        num_blocks = rows.num_blocks;
        dst = pinned(r0 * R::ROW_BYTES + 16 * R::stored_unit(u, r0));
        chunks = (end - start + R::CHUNK - 1) / R::CHUNK;
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

// The tensor-core kernels' prologue, in two calls with the query loads between them:
// claim_partition says which work this workgroup owns (false: none), start_stream fetches the
// block ids of its first chunks (one round trip) and starts its K/V copies. Query fragments
// loaded between the two are in flight during the ids' round trip instead of after it
// (docs/perf-log.md v24 step 2).
//
// early_ids, before both where it returns true: without a sliding window a partition's tokens
// are fixed by the grid (from part * partition_size, up to the table's capacity), so its first
// block ids are requested before claim_partition reads the sequence's length and the two round
// trips overlap; start_stream then only sets the real end. A workgroup that finds no work
// must wait for its early copies before it exits (finish_early_ids), so in a grid of several
// waves only a sequence's first partition, the one that has work whenever the sequence has
// tokens, asks early: with every partition asking, the empty partitions past the short
// sequences of a ragged batch held their slots longer (longtail64 +1.3%). Where the planner
// finds that a slot held longer delays nobody (all_ids_early: a grid of one wave, or one
// merging in clusters), every partition asks (group 16's 1 x 4096, one wave merged by the
// reduce: 14.9 -> 14.7 us; docs/perf-log.md v28 step 6, v29). With a window the start moves
// with the length, and the ids follow it. (Folded into claim_partition, the same code took
// NVRTC 13.0 to 221 registers from 208 and spilled the dense forms: v29.)
template <typename C, int D, int DENSE_STAGES>
CUPA_FN bool early_ids(KvStream<C, D, DENSE_STAGES>& kv, unsigned char* ring,
                       const i32* block_tables, int max_blocks_per_seq, int block_size,
                       int partition_size, int sliding_window, int all_ids_early) {
    if (sliding_window > 0 || (blockIdx.y != 0 && !all_ids_early)) return false;
    const int start = (int)blockIdx.y * partition_size;  // begin_partition's w.start
    kv.begin_ids(ring, block_tables + (i64)blockIdx.z * max_blocks_per_seq, start,
                 cmin(start + partition_size, max_blocks_per_seq * block_size),
                 __ffs(block_size) - 1);
    return true;
}

// A workgroup leaving without work: its early id copies land in its shared memory first.
CUPA_FN void finish_early_ids(bool started) {
    if (started) wait_copies<0>();
}
// In a grid of several waves, the workgroups that share a multiprocessor would start together,
// end together and start their successors together: every wave's prologue (three dependent
// round trips, ~5 us) would leave the multiprocessor reading nothing, the other workgroups
// being in theirs too. Per-phase stamps of 128 x 1024 showed exactly that (docs/perf-log.md
// v34). So the first wave's k-th workgroup of a multiprocessor (slot k, 0 < k < stagger_slots)
// waits k * stagger_ns after its claim; the slots then stay apart in the later waves, each
// prologue in the shadow of the others' streaming. Slot k is taken as the linear block id over
// stagger_sms, the order in which the hardware fills the multiprocessors (124 of 132 distinct
// multiprocessors for the first 132 ids, in the same stamps). stagger_ns 0: off (planner).
CUPA_FN void stagger_first_wave(int stagger_sms, int stagger_slots, int stagger_ns) {
#if !CUPA_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    if (stagger_ns <= 0) return;
    const unsigned slot = linear_block_id() / (unsigned)stagger_sms;
    if (slot == 0 || slot >= (unsigned)stagger_slots) return;
    const unsigned long long wait = (unsigned long long)slot * (unsigned)stagger_ns;
    const unsigned long long t0 = global_timer_ns();
    do __nanosleep(256);
    while (global_timer_ns() - t0 < wait);
#endif
}

template <typename T, typename C, int ROWS, int D>
CUPA_FN bool claim_partition(PartitionWork& w, CUPA_PARTITION_PARAMS(T, C)) {
    if (!begin_partition<T, ROWS, D>(w, out, lse, seq_lens, query_start_loc, sinks,
                                     sliding_window, num_tokens, num_heads, num_kv_heads,
                                     block_size, max_blocks_per_seq, partition_size,
                                     max_partitions, head_chunks, cluster_merge))
        return false;
    stagger_first_wave(stagger_sms, stagger_slots, stagger_ns);
    return true;
}

template <typename C, int D, int DENSE_STAGES>
CUPA_FN void start_stream(KvStream<C, D, DENSE_STAGES>& kv, unsigned char* ring,
                          const PartitionWork& w, const C* key_cache, const C* value_cache,
                          const i32* block_tables, int max_blocks_per_seq, int block_size,
                          int num_blocks, i64 kv_block_stride, i64 kv_head_stride,
                          int kv_token_stride, bool ids_started) {
    kv.begin(ring, key_cache, value_cache,
             paged_rows(w, block_tables, max_blocks_per_seq, block_size, num_blocks,
                        kv_block_stride, kv_head_stride, kv_token_stride),
             w.start, ids_started);
}

}  // namespace cupa
