// Phase 1 of paged decode on NVIDIA tensor cores (sm_80+, fp16/bf16 queries, head size 64, 128
// or 256, or 80, 96, 112 and 192 staged at the next of those or at their own width (KvRing),
// cache of the query type or fp8 codes). Two kernels: mma8 (query rows as the 8 columns; up to
// 8 rows; every head size) and mma16 (query rows as the 16 rows of an m-tile, one tile per warp,
// up to 64 rows per workgroup; above head 128 one tile a workgroup, its query in shared
// memory: Mma16Shape). A query row is a (new token, query head) pair of the KV
// head: the heads of the GQA group, times the new tokens in multi-token decode (see
// begin_partition).
//
// With GQA the query heads of one KV head form a small matrix, so QK^T and PV are matrix products
// whose FMA cost on CUDA cores outgrows the memory time at group sizes of 4-8 and more. Here the
// query rows are an operand of mma.sync.m16n8k16 (rows past the group are zero).
//
// Memory: the workgroup streams its partition's K/V rows through a ring of shared-memory stages
// filled by cp.async (KvRing, KvStream), several chunks ahead of the warps; an XOR swizzle of
// the 16-byte units keeps the 8 rows an ldmatrix reads at one column in 8 different bank
// groups, and each 128-byte line of the rows in one line of the stage (one L2 request). The
// warps take their K and V fragments from the staged rows with ldmatrix (K) and ldmatrix.trans
// (V), 16-bit and fp8 caches alike (Frag: fp8 codes are read as 16-bit pairs and widened to
// float16 at use); P comes straight from the QK accumulators (the FA2 register reuse).
// Each warp computes 16-token steps of the staged chunks with its own running max and sum; the
// warps merge through shared memory at the end.
// The sections, each including the one before: ops, merge, ring, fragments, mma16, mma8.
#include "mma/mma8.cuh"

#define CUPA_DECODE_MMA_VARIANT(NAME, KERNEL, T, C, D)                                           \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS, CUPA_MMA_MIN_BLOCKS)             \
        NAME(CUPA_PARTITION_PARAMS(T, C)) {                                                      \
        cupa::start_phase1_in_chain(next_at_start); /* see decode_common.cuh */                \
        cupa::KERNEL<T, C, D>(CUPA_PARTITION_ARGS);                                              \
    }

// A dense form of the 8-column kernel: a ring of STAGES stages of one step a warp and registers
// capped so that WORKGROUPS workgroups share a multiprocessor (catalogue.DENSE_RING: 3 and 4;
// the default forms hold 3 at head 64 and 2 for fp8 at head 128). More warps a multiprocessor,
// fewer chunks in flight per workgroup: faster on grids with workgroups enough for them
// (docs/perf-log.md v22).
#define CUPA_DECODE_MMA_DENSE_VARIANT(NAME, T, C, D, STAGES, WORKGROUPS)                          \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS, WORKGROUPS)                      \
        NAME(CUPA_PARTITION_PARAMS(T, C)) {                                                      \
        cupa::start_phase1_in_chain(next_at_start);                                              \
        cupa::decode_partition_mma8<T, C, D, STAGES>(CUPA_PARTITION_ARGS);                       \
    }
