// What every decode kernel shares: which work a phase-1 workgroup owns, where a token's K/V row
// lives, and phase 2 (merging the float32 partials of the partitions of one (sequence, head) into
// the final output and its log-sum-exp).
#pragma once
#include "common.cuh"

namespace cupa {

constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }

// The argument list every phase-1 kernel takes, in the order gpu.py passes it. A macro, so the
// kernels and their extern "C" wrappers cannot drift apart.
#define CUPA_PARTITION_PARAMS(T)                                                                 \
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_acc,                 \
        float* __restrict__ part_max, float* __restrict__ part_sum, const T* __restrict__ query, \
        const T* __restrict__ key_cache, const T* __restrict__ value_cache,                      \
        const i32* __restrict__ block_tables, const i32* __restrict__ seq_lens,                  \
        const float* __restrict__ alibi_slopes, const float* __restrict__ sinks, float scale,    \
        float soft_cap, i32 sliding_window, i32 num_heads, i32 num_kv_heads, i32 block_size,     \
        i32 max_blocks_per_seq, i32 num_blocks, i32 partition_size, i32 max_partitions,          \
        i32 head_chunks
#define CUPA_PARTITION_ARGS                                                                      \
    out, lse, part_acc, part_max, part_sum, query, key_cache, value_cache, block_tables,         \
        seq_lens, alibi_slopes, sinks, scale, soft_cap, sliding_window, num_heads, num_kv_heads, \
        block_size, max_blocks_per_seq, num_blocks, partition_size, max_partitions, head_chunks

// Logit soft-capping (Gemma 2): c * tanh(x / c) on the natural-log logit; x arrives and leaves
// in the log2 domain the kernels work in. cap <= 0 means off.
CUPA_FN float soft_cap_log2(float x, float cap) {
    if (cap <= 0.f) return x;
    const float a = x * LN2 / cap;
    const float e = fast_exp2(-2.f * LOG2E * (a < 0.f ? -a : a));  // exp(-2|a|), no library tanh
    const float t = (1.f - e) / (1.f + e);
    return cap * (a < 0.f ? -t : t) * LOG2E;
}

// Final normalisation of one head. m (log2 domain) and l are the running max and sum of its
// exp-weights; sink is its sink logit (natural log) or -inf. Returns the factor that turns the
// unnormalised output (weights relative to m) into the output, and sets the natural-log LSE.
CUPA_FN float finish_head(float m, float l, float sink, float& lse_out) {
    const float s2 = sink * LOG2E;
    const float top = max_f(m, s2);
    if (top == neg_inf()) {  // no readable token and no sink
        lse_out = neg_inf();
        return 0.f;
    }
    const float keep = fast_exp2(m - top);
    const float total = l * keep + fast_exp2(s2 - top);
    lse_out = (top + fast_log2(total)) * LN2;
    return keep / total;
}

CUPA_FN float sink_of(const float* sinks, i64 head, int num_heads) {
    return sinks != nullptr ? sinks[head % num_heads] : neg_inf();
}

// First token a sequence of seq_len tokens attends to.
CUPA_FN int window_start(int seq_len, int sliding_window) {
    return sliding_window > 0 && seq_len > sliding_window ? seq_len - sliding_window : 0;
}

// The slice of work of one phase-1 workgroup: grid x = (KV head, head chunk), y = partition,
// z = sequence. Lengths are clamped to the table's capacity, so a bad length on the device can
// never make a kernel read past the block table.
struct PartitionWork {
    int seq, kv_head, head0, nh, part;
    int seq_len, start, end;  // tokens [start, end) of a sequence of seq_len tokens
    i64 first_head;           // seq * num_heads + head0: row of the first head in q/out/lse
};

// Fills `w`; returns false when the partition is empty, after writing the zero output and -inf
// lse of an empty sequence if this workgroup owns them (single-partition launches only).
template <typename T, int HT, int D>
CUPA_FN bool begin_partition(PartitionWork& w, T* out, float* lse, const i32* seq_lens,
                             const float* sinks, i32 sliding_window, i32 num_heads,
                             i32 num_kv_heads, i32 block_size, i32 max_blocks_per_seq,
                             i32 partition_size, i32 max_partitions, i32 head_chunks) {
    const int group = num_heads / num_kv_heads;
    const int chunk = blockIdx.x % head_chunks;
    w.kv_head = blockIdx.x / head_chunks;
    w.head0 = w.kv_head * group + chunk * HT;
    w.nh = cmin(HT, group - chunk * HT);
    w.part = blockIdx.y;
    w.seq = blockIdx.z;
    w.first_head = (i64)w.seq * num_heads + w.head0;
    const int len = seq_lens[w.seq];
    w.seq_len = len < 0 ? 0 : cmin(len, max_blocks_per_seq * block_size);
    // Partitions wholly before the sliding window exit here, so work scales with the window.
    w.start = cmax(w.part * partition_size, window_start(w.seq_len, sliding_window));
    w.end = cmin(w.part * partition_size + partition_size, w.seq_len);
    if (w.start < w.end) return true;
    if (max_partitions == 1 && w.part == 0) {  // an empty sequence: zeros, lse = sink or -inf
        for (int i = threadIdx.x; i < w.nh * D; i += CUPA_THREADS)
            Elem<T>::store(out + w.first_head * D + i, 0.0f);
        const int h = threadIdx.x;
        if (lse != nullptr && h < w.nh) {
            finish_head(neg_inf(), 0.f, sink_of(sinks, w.first_head + h, num_heads),
                        lse[w.first_head + h]);
        }
    }
    return false;
}

// Where the K/V rows of one (sequence, KV head) live in the paged cache.
struct PagedRows {
    const i32* table;  // this sequence's block table row
    i64 head_offset;   // kv_head * block_size * D
    i64 block_stride;  // num_kv_heads * block_size * D
    int shift;         // log2(block_size): block sizes are powers of two (checked on the host)
    int num_blocks, end, D;

    // Element offset of token t's row given its block id, or -1 for an id outside the cache
    // (or the -1 that marks a token past `end`).
    CUPA_FN i64 row_in_block(int block, int t) const {
        if (block < 0 || block >= num_blocks) return -1;
        return (i64)block * block_stride + head_offset + (i64)(t & ((1 << shift) - 1)) * D;
    }

    // Element offset of token t's row, or -1 at or past `end` or in a block outside the cache.
    CUPA_FN i64 row(int t) const {
        return t < end ? row_in_block(table[t >> shift], t) : -1;
    }
};

CUPA_FN PagedRows paged_rows(const PartitionWork& w, const i32* block_tables, int max_blocks_per_seq,
                             int num_kv_heads, int block_size, int num_blocks, int D) {
    PagedRows r;
    r.table = block_tables + (i64)w.seq * max_blocks_per_seq;
    r.head_offset = (i64)w.kv_head * block_size * D;
    r.block_stride = (i64)num_kv_heads * block_size * D;
    r.shift = __ffs(block_size) - 1;
    r.num_blocks = num_blocks;
    r.end = w.end;
    r.D = D;
    return r;
}

// Phase 2: merge the partitions of one (sequence, head). Partitions are visited in chunks of
// CUPA_THREADS, so there is no compile-time cap on their number.
template <typename T>
CUPA_FN void decode_reduce(T* __restrict__ out, float* __restrict__ lse,
                           const float* __restrict__ part_acc, const float* __restrict__ part_max,
                           const float* __restrict__ part_sum, const i32* __restrict__ seq_lens,
                           const float* __restrict__ sinks, i32 sliding_window, i32 num_heads,
                           i32 head_size, i32 partition_size, i32 max_partitions,
                           i32 capacity) {
    constexpr int NWARPS = CUPA_THREADS / CUPA_WARP;
    __shared__ float w_s[CUPA_THREADS];
    __shared__ float warp_s[NWARPS];
    __shared__ float global_max_s, total_s;

    const int tid = threadIdx.x, warp = tid / CUPA_WARP, lane = tid % CUPA_WARP;
    const i64 head = blockIdx.x;  // seq * num_heads + h
    const int seq = (int)(head / num_heads);
    int seq_len = seq_lens[seq];
    seq_len = seq_len < 0 ? 0 : cmin(seq_len, capacity);
    // Partitions [first, first + n) hold this sequence's window; the others were never written.
    const int first = window_start(seq_len, sliding_window) / partition_size;
    const int n = (seq_len + partition_size - 1) / partition_size - first;
    const float* pm = part_max + head * max_partitions + first;
    const float* ps = part_sum + head * max_partitions + first;
    const float* pa = part_acc + (head * max_partitions + first) * head_size;
    const float sink = sink_of(sinks, head, num_heads);

    float m = neg_inf();
    for (int p = tid; p < n; p += CUPA_THREADS) m = max_f(m, pm[p]);
    m = warp_max(m);
    if (lane == 0) warp_s[warp] = m;
    __syncthreads();
    if (tid == 0) {
        float v = warp_s[0];
        for (int w = 1; w < NWARPS; ++w) v = max_f(v, warp_s[w]);
        global_max_s = v;
    }
    __syncthreads();
    const float global_max = global_max_s;

    if (global_max == neg_inf()) {  // empty sequence (or nothing readable)
        for (int d = tid; d < head_size; d += CUPA_THREADS)
            Elem<T>::store(out + head * head_size + d, 0.0f);
        if (lse != nullptr && tid == 0) finish_head(neg_inf(), 0.f, sink, lse[head]);
        return;
    }

    float total = 0.0f;
    for (int p = tid; p < n; p += CUPA_THREADS) total += fast_exp2(pm[p] - global_max) * ps[p];
    total = warp_sum(total);
    __syncthreads();
    if (lane == 0) warp_s[warp] = total;
    __syncthreads();
    if (tid == 0) {
        float v = 0.0f;
        for (int w = 0; w < NWARPS; ++w) v += warp_s[w];
        total_s = v;
    }

    // Each thread owns columns d = tid, tid + CUPA_THREADS, ... (at most 2 for head sizes <= 256).
    constexpr int MAX_COLS = (256 + CUPA_THREADS - 1) / CUPA_THREADS;
    float col[MAX_COLS];
#pragma unroll
    for (int c = 0; c < MAX_COLS; ++c) col[c] = 0.0f;
    for (int base = 0; base < n; base += CUPA_THREADS) {
        __syncthreads();
        const int p = base + tid;
        w_s[tid] = p < n ? fast_exp2(pm[p] - global_max) : 0.0f;
        __syncthreads();
        const int count = cmin(CUPA_THREADS, n - base);
        // Unrolled so that several partitions' loads are in flight at once.
#pragma unroll 8
        for (int j = 0; j < count; ++j) {
            const float w = w_s[j];
            const float* row = pa + (i64)(base + j) * head_size;
#pragma unroll
            for (int c = 0; c < MAX_COLS; ++c) {
                const int d = tid + c * CUPA_THREADS;
                if (d < head_size) col[c] += w * row[d];
            }
        }
    }
    float lse_value;
    const float factor = finish_head(global_max, total_s, sink, lse_value);
#pragma unroll
    for (int c = 0; c < MAX_COLS; ++c) {
        const int d = tid + c * CUPA_THREADS;
        if (d < head_size) Elem<T>::store(out + head * head_size + d, col[c] * factor);
    }
    if (lse != nullptr && tid == 0) lse[head] = lse_value;
}

}  // namespace cupa

#define CUPA_REDUCE_VARIANT(NAME, T)                                                             \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS) NAME(                            \
        T* out, float* lse, const float* part_acc, const float* part_max, const float* part_sum, \
        const i32* seq_lens, const float* sinks, i32 sliding_window, i32 num_heads,              \
        i32 head_size, i32 partition_size, i32 max_partitions, i32 capacity) {                   \
        cupa::decode_reduce<T>(out, lse, part_acc, part_max, part_sum, seq_lens, sinks,         \
                               sliding_window, num_heads, head_size, partition_size,             \
                               max_partitions, capacity);                                        \
    }
