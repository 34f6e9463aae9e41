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

// The argument list every phase-1 kernel takes, in the order cupa/gpu/launch.py passes it. A
// macro, so the kernels and their extern "C" wrappers cannot drift apart. T is the query/output
// storage type, C the cache's (T itself, or cupa_fp8 codes whose per-KV-head scales come in
// kv_scales). The stagger_* arguments serve the tensor-core kernels only (stagger_first_wave),
// and so does next_at_start (start_phase1_in_chain); kv_*_stride are the caches' element
// strides (the host's bounds: problem.py, KV_STRIDE_*).
#define CUPA_PARTITION_PARAMS(T, C)                                                              \
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_acc,                 \
        float* __restrict__ part_max, float* __restrict__ part_sum, const T* __restrict__ query, \
        const C* __restrict__ key_cache, const C* __restrict__ value_cache,                      \
        const float* __restrict__ kv_scales, const i32* __restrict__ block_tables,               \
        const i32* __restrict__ seq_lens, const i32* __restrict__ query_start_loc,              \
        const float* __restrict__ alibi_slopes, const float* __restrict__ sinks, float scale,    \
        float soft_cap, i32 sliding_window, i32 num_tokens, i32 num_heads, i32 num_kv_heads,     \
        i32 block_size, i32 max_blocks_per_seq, i32 num_blocks, i32 partition_size,              \
        i32 max_partitions, i32 head_chunks, i32 cluster_merge, i32 all_ids_early,             \
        i32 stagger_sms, i32 stagger_slots, i32 stagger_ns, i32 next_at_start,                   \
        i64 kv_block_stride, i64 kv_head_stride, i32 kv_token_stride
#define CUPA_PARTITION_ARGS                                                                      \
    out, lse, part_acc, part_max, part_sum, query, key_cache, value_cache, kv_scales,            \
        block_tables, seq_lens, query_start_loc, alibi_slopes, sinks, scale, soft_cap,           \
        sliding_window, num_tokens, num_heads, num_kv_heads, block_size, max_blocks_per_seq,     \
        num_blocks, partition_size, max_partitions, head_chunks, cluster_merge, all_ids_early,   \
        stagger_sms, stagger_slots, stagger_ns, next_at_start, kv_block_stride, kv_head_stride,  \
        kv_token_stride

// Most new tokens per sequence in one call (multi-token decode for speculative decoding).
constexpr int MAX_QUERY_LEN = 16;

// Logit soft-capping (Gemma 2): c * tanh(x / c) on the natural-log logit; x arrives and leaves
// in the log2 domain the kernels work in. cap <= 0 means off.
// (LN2 / cap is loop-invariant: callers' loops compute it once.)
CUPA_FN float soft_cap_log2(float x, float cap) {
    if (cap <= 0.f) return x;
    const float a = x * (LN2 / cap);
    const float e = fast_exp2(-2.f * LOG2E * (a < 0.f ? -a : a));  // exp(-2|a|), no library tanh
    const float t = fast_div(1.f - e, 1.f + e);
    return cap * (a < 0.f ? -t : t) * LOG2E;
}

// N raw q.k products to the log2 domain, soft-capped: the cap is tested once for all of them
// (a branch per element costs its test and branch even when the cap is off).
template <int N>
CUPA_FN void scale_and_cap(float* x, float qk_scale, float cap) {
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] *= qk_scale;
    if (cap > 0.f) {
#pragma unroll
        for (int e = 0; e < N; ++e) x[e] = soft_cap_log2(x[e], cap);
    }
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

// What logits subtract given their running max m: 0 instead of -inf while nothing was readable
// (exp2 then gives 0, never NaN).
CUPA_FN float subtrahend(float m) { return m == neg_inf() ? 0.f : m; }

// Lazy max (the tensor-core and AMD matrix kernels): a row's running max moves only when a
// logit passes it by more than LAZY_MAX (log2 units). Until then the step's exponentials stay
// below 2^LAZY_MAX, well inside float16 and bfloat16, and the warp skips the row-max shuffles,
// the corrections and the rescale. The result does not depend on the max used, as long as the
// sum and the output use the same one (the merges take each warp's and partition's own max).
constexpr float LAZY_MAX = 8.f;
CUPA_FN bool passes_max(float mx, float m) { return mx > m + LAZY_MAX; }  // true for m = -inf

CUPA_FN float sink_of(const float* sinks, i64 head, int num_heads) {
    return sinks != nullptr ? sinks[head % num_heads] : neg_inf();
}

// First position the query at position `pos` attends to.
CUPA_FN int window_first(int pos, int sliding_window) {
    return sliding_window > 0 && pos + 1 > sliding_window ? pos + 1 - sliding_window : 0;
}

// The new tokens of sequence `seq`: query rows [tok0, tok0 + q_len). Without query_start_loc
// every sequence has one. Values from the device are clamped into the query array, each end
// before any difference is taken (a difference of two raw int32 entries can overflow).
CUPA_FN void query_span(const i32* query_start_loc, int seq, int num_tokens, int& tok0,
                        int& q_len) {
    if (query_start_loc == nullptr) {
        tok0 = seq;
        q_len = 1;
        return;
    }
    tok0 = cmin(cmax(query_start_loc[seq], 0), num_tokens);
    const int end = cmin(cmax(query_start_loc[seq + 1], tok0), num_tokens);
    q_len = cmin(end - tok0, MAX_QUERY_LEN);
}

CUPA_FN int clamp_len(int len, int capacity) { return len < 0 ? 0 : cmin(len, capacity); }

// The partitions a sequence's rows are merged over: [first, end) of size partition_size. Every
// row of the sequence uses the same set, from its first new token's window start to seq_len.
CUPA_FN int first_partition(int seq_len, int q_len, int sliding_window, int partition_size) {
    return window_first(seq_len - q_len, sliding_window) / partition_size;
}

// Programmatic dependent launch (sm_90; cupa/gpu/launch.py). The reduce is a dependent of phase 1,
// so its workgroups start while phase 1's last wave runs and wait here, after their own setup,
// until phase 1 has finished and its writes are visible. Phase 1 is a dependent of whatever
// kernel is ahead of it, which starts it early only if that kernel allows it (a previous call's
// reduce or phase 1 does): its workgroups wait here before they read anything (start_in_chain,
// the first call of every phase-1 entry point), so they may be resident, not working, while the
// kernel ahead drains. Both allow their own dependents only once they have waited
// (start_in_chain; the tensor-core phase 1 allows the next call later still,
// start_phase1_in_chain). Without the launch attribute, and on other targets, these are no-ops.
CUPA_FN void wait_for_primary_grid() {
#if !CUPA_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
CUPA_FN void allow_dependent_grid() {
#if !CUPA_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Wait for the kernel ahead, then let the dependent kernel (the reduce, or the next call's phase
// 1) start: a phase-1 workgroup's first step, and the reduce's once its setup is done. Allowing
// them before the wait let the next calls' workgroups become resident ahead of time, several
// grids deep: back to back, 8 x 4096 and group 16's 32 x 2048 were then 9-10% slower
// (docs/perf-log.md v25 step 5).
CUPA_FN void start_in_chain() {
    wait_for_primary_grid();
    allow_dependent_grid();
}
// A tensor-core phase-1 workgroup's chain. It waits for the kernel ahead first, then lets what
// follows it start either at once (start_phase1_in_chain) or once its chunks are done
// (allow_next_call), as the host's plan says (next_at_start: LaunchPlan.next_call_at_start).
// At once: a reduce's workgroups wait, resident, for phase 1's end, and a next grid that fits
// the free slots starts without a launch gap. After the chunks, for a grid of one partition
// filling more than half its slots: allowed at the start, the next grid was dispatched while
// this one held all its slots and landed beside it, not where slots freed (docs/perf-log.md
// v50 step 2, v53 step 1).
CUPA_FN void start_phase1_in_chain(int next_at_start) {
    wait_for_primary_grid();
    if (next_at_start) allow_dependent_grid();
}
CUPA_FN void allow_next_call(int next_at_start) {
    if (!next_at_start) allow_dependent_grid();
}

// The slice of work of one phase-1 workgroup: grid x = (KV head, row chunk), y = partition,
// z = sequence. A sequence with q_len new tokens has q_len * group query rows per KV head,
// token-major (row = token * group + head in group); a workgroup takes up to ROWS of them, so
// each K/V row it reads serves every query head and new token of the chunk. Lengths are clamped
// to the table's capacity, so a bad length on the device can never read past the block table.
struct PartitionWork {
    int seq, kv_head, part, num_heads, group;
    int q_len, tok0;  // new tokens of the sequence: query rows [tok0, tok0 + q_len)
    int row0, nh;     // this workgroup's rows: row0 .. row0 + nh - 1 of the sequence's rows
    int seq_len, start, end;  // tokens [start, end) of a sequence of seq_len tokens
    int first, parts;  // the sequence's partitions with work: [first, first + parts)
    // Whether this workgroup writes the final output and lse itself: a single-partition launch,
    // or the only partition with work when the launch merges within a cluster.
    bool writes_output;

    // Index of local row r in the [num_tokens * num_heads] rows of query, out and lse.
    CUPA_FN i64 row_index(int r) const {
        const int x = row0 + r;
        return (i64)(tok0 + x / group) * num_heads + kv_head * group + x % group;
    }
    // Position of local row r's token: it attends to [window_first(pos), pos] (causal).
    CUPA_FN int row_pos(int r) const { return seq_len - q_len + (row0 + r) / group; }
};

// Fills `w`; returns false when the workgroup has no work, after writing the zero output and
// -inf lse of an empty sequence if this workgroup owns them (single-partition launches only).
template <typename T, int ROWS, int D>
CUPA_FN bool begin_partition(PartitionWork& w, T* out, float* lse, const i32* seq_lens,
                             const i32* query_start_loc, const float* sinks, i32 sliding_window,
                             i32 num_tokens, i32 num_heads, i32 num_kv_heads, i32 block_size,
                             i32 max_blocks_per_seq, i32 partition_size, i32 max_partitions,
                             i32 head_chunks, i32 cluster_merge) {
    begin_workgroup();  // before any return: every thread of the workgroup takes part
    // Every phase-1 entry point has waited first (start_in_chain, start_phase1_in_chain):
    // launched as a programmatic dependent (sm_90), nothing here is read or written before the
    // kernel ahead has finished.
    w.num_heads = num_heads;
    w.group = num_heads / num_kv_heads;
    const int chunk = blockIdx.x % head_chunks;
    w.kv_head = blockIdx.x / head_chunks;
    w.part = blockIdx.y;
    w.seq = blockIdx.z;
    const int raw_len = seq_lens[w.seq];  // loaded together with query_start_loc's entries
    query_span(query_start_loc, w.seq, num_tokens, w.tok0, w.q_len);
    w.row0 = chunk * ROWS;
    w.nh = cmin(ROWS, w.q_len * w.group - w.row0);
    if (w.nh <= 0) return false;  // a chunk past this sequence's rows
    w.seq_len = clamp_len(raw_len, max_blocks_per_seq * block_size);
    // Partitions wholly before the sliding window exit here, so work scales with the window.
    w.start = cmax(w.part * partition_size, window_first(w.seq_len - w.q_len, sliding_window));
    w.end = cmin(w.part * partition_size + partition_size, w.seq_len);
    w.first = first_partition(w.seq_len, w.q_len, sliding_window, partition_size);
    w.parts = (w.seq_len + partition_size - 1) / partition_size - w.first;
    // Without a reduce launch, the sequence's own partitions write its output.
    const bool merged_here = max_partitions == 1 || cluster_merge;
    w.writes_output = merged_here && w.parts == 1;
    if (w.start < w.end) return true;
    // An empty sequence: zeros, lse = sink or -inf.
    if (merged_here && w.parts == 0 && w.part == 0) {
        for (int i = threadIdx.x; i < w.nh * D; i += CUPA_THREADS)
            Elem<T>::store(out + w.row_index(i / D) * D + i % D, 0.0f);
        const int h = threadIdx.x;
        if (lse != nullptr && h < w.nh) {
            const i64 row = w.row_index(h);
            finish_head(neg_inf(), 0.f, sink_of(sinks, row, num_heads), lse[row]);
        }
    }
    return false;
}

// Dequantisation factors of a KV head: 1 for a plain cache; for fp8 the host folds the format's
// power of two (see Elem<cupa_fp8>) into the per-head scales.
CUPA_FN float k_factor(const float* kv_scales, int kv_head) {
    return kv_scales != nullptr ? kv_scales[kv_head] : 1.f;
}
CUPA_FN float v_factor(const float* kv_scales, int kv_head, int num_kv_heads) {
    return kv_scales != nullptr ? kv_scales[num_kv_heads + kv_head] : 1.f;
}

// Where the K/V rows of one (sequence, KV head) live in the paged cache: any dimension order
// and strides (elements), each row of D elements contiguous.
struct PagedRows {
    const i32* table;   // this sequence's block table row
    i64 head_offset;    // kv_head * the KV-head stride
    i64 block_stride;   // from one block to the next
    u32 token_stride;   // from one row of a block to the next (below 2^24: the host's bound)
    u32 row_mask;       // block_size - 1
    int shift;          // log2(block_size): block sizes are powers of two (checked on the host)
    int num_blocks, end;

    // Element offset of token t's row given its block id, or -1 for an id outside the cache
    // (or the -1 that marks a token past `end`).
    CUPA_FN i64 row_in_block(int block, int t) const {
        if (block < 0 || block >= num_blocks) return -1;
        return offset(block, t);
    }
    // The same for any block id (no test): a row's offset in its block has two factors of at
    // most 24 significant bits (the masks of paged_rows), so AMD's compiler issues its
    // full-rate 24-bit multiply, not the quarter-rate 32-bit one.
    CUPA_FN i64 offset(int block, int t) const {
        return (i64)block * block_stride + head_offset + (i64)(((u32)t & row_mask) * token_stride);
    }

    // Element offset of token t's row, or -1 at or past `end` or in a block outside the cache.
    CUPA_FN i64 row(int t) const {
        return t < end ? row_in_block(table[t >> shift], t) : -1;
    }

    // The same in two steps, for loads asked for ahead with no branch around them: the block
    // id (a token at or past `end` reads the last token's, inside the table; needs end >= 1),
    // then the row from it.
    CUPA_FN int block_id(int t) const { return table[(t < end ? t : end - 1) >> shift]; }
    CUPA_FN i64 row_of(int block, int t) const {
        return t < end && (u32)block < (u32)num_blocks ? offset(block, t) : -1;  // a select
    }
};

CUPA_FN PagedRows paged_rows(const PartitionWork& w, const i32* block_tables, int max_blocks_per_seq,
                             int block_size, int num_blocks, i64 kv_block_stride,
                             i64 kv_head_stride, int kv_token_stride) {
    PagedRows r;
    r.table = block_tables + (i64)w.seq * max_blocks_per_seq;
    r.head_offset = (i64)w.kv_head * kv_head_stride;
    r.block_stride = kv_block_stride;
    r.token_stride = (u32)kv_token_stride & 0xffffffu;
    r.row_mask = (u32)(block_size - 1) & 31u;  // block sizes are at most 32 (problem.py)
    r.shift = __ffs(block_size) - 1;
    r.num_blocks = num_blocks;
    r.end = w.end;
    return r;
}

// Phase 2: merge the partitions of one query row (grid x = head, y = new token, z = sequence).
// This pass sits between phase 1 and the output, so its latency is what counts, and that is
// the number of dependent memory round trips. Warp w merges partitions w, w + NWARPS, ... with
// an online max (lane l owns 16-byte column groups l, l + CUPA_WARP, ...), so a warp's loads of
// max, sum and partial output for all its partitions are independent and issued together; one
// barrier and a merge of NWARPS rows through shared memory finish the row. (The first form
// reduced max and sum across the workgroup before reading the columns: ~5 us a call,
// docs/perf-log.md v10.)
template <typename T>
CUPA_FN void decode_reduce(T* __restrict__ out, float* __restrict__ lse,
                           const float* __restrict__ part_acc, const float* __restrict__ part_max,
                           const float* __restrict__ part_sum, const i32* __restrict__ seq_lens,
                           const i32* __restrict__ query_start_loc,
                           const float* __restrict__ sinks, i32 sliding_window, i32 num_tokens,
                           i32 num_heads, i32 head_size, i32 partition_size, i32 max_partitions,
                           i32 capacity) {
    constexpr int NWARPS = CUPA_THREADS / CUPA_WARP;
    constexpr int MAX_D = 256;
    constexpr int GROUPS = MAX_D / 4 / CUPA_WARP;  // 16-byte column groups per lane (at most)
    __shared__ float m_s[NWARPS], l_s[NWARPS];
    __shared__ float o_s[NWARPS][MAX_D];

    const int tid = threadIdx.x, warp = tid / CUPA_WARP, lane = tid % CUPA_WARP;
    const int seq = blockIdx.z;
    int tok0, q_len;
    query_span(query_start_loc, seq, num_tokens, tok0, q_len);
    if ((int)blockIdx.y >= q_len) return;
    const i64 head = (i64)(tok0 + blockIdx.y) * num_heads + blockIdx.x;  // row of q/out/lse
    const int seq_len = clamp_len(seq_lens[seq], capacity);
    // Partitions [first, first + n) were written by phase 1; the others were not.
    const int first = first_partition(seq_len, q_len, sliding_window, partition_size);
    const int n = (seq_len + partition_size - 1) / partition_size - first;
    const float* pm = part_max + head * max_partitions + first;
    const float* ps = part_sum + head * max_partitions + first;
    const float* pa = part_acc + (head * max_partitions + first) * head_size;
    start_in_chain();  // waits for phase 1, then lets the next call's phase 1 start

    float m = neg_inf(), l = 0.0f;  // this warp's running max (log2 domain) and sum
    float acc[GROUPS][4];
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.0f;
#pragma unroll 8
    for (int p = warp; p < n; p += NWARPS) {
        const float mp = pm[p], sp = ps[p];
        float v[GROUPS][4];
#pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            const int col = 4 * (lane + g * CUPA_WARP);
            cupa_u32x4 w = {0u, 0u, 0u, 0u};
            if (col < head_size)
                w = *reinterpret_cast<const cupa_u32x4*>(pa + (i64)p * head_size + col);
            v[g][0] = bits_to_float(w.x); v[g][1] = bits_to_float(w.y);
            v[g][2] = bits_to_float(w.z); v[g][3] = bits_to_float(w.w);
        }
        const float next = max_f(m, mp);
        if (next == neg_inf()) continue;  // nothing readable so far
        const float keep = fast_exp2(m - next), take = fast_exp2(mp - next);
        l = l * keep + sp * take;
#pragma unroll
        for (int g = 0; g < GROUPS; ++g)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[g][e] = acc[g][e] * keep + v[g][e] * take;
        m = next;
    }
    if (lane == 0) {
        m_s[warp] = m;
        l_s[warp] = l;
    }
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) {
        const int col = 4 * (lane + g * CUPA_WARP);
        if (col < head_size)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_s[warp][col + e] = acc[g][e];
    }
    __syncthreads();

    float top = neg_inf();
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) top = max_f(top, m_s[w]);
    const float use = subtrahend(top);  // an empty sequence: zeros
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) total += fast_exp2(m_s[w] - use) * l_s[w];
    float lse_value;
    const float factor = finish_head(top, total, sink_of(sinks, head, num_heads), lse_value);
    for (int d = tid; d < head_size; d += CUPA_THREADS) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < NWARPS; ++w) o += fast_exp2(m_s[w] - use) * o_s[w][d];
        Elem<T>::store(out + head * head_size + d, o * factor);
    }
    if (lse != nullptr && tid == 0) lse[head] = lse_value;
}

}  // namespace cupa

#define CUPA_REDUCE_VARIANT(NAME, T)                                                             \
    extern "C" __global__ void __launch_bounds__(CUPA_THREADS) NAME(                            \
        T* out, float* lse, const float* part_acc, const float* part_max, const float* part_sum, \
        const i32* seq_lens, const i32* query_start_loc, const float* sinks, i32 sliding_window, \
        i32 num_tokens, i32 num_heads, i32 head_size, i32 partition_size, i32 max_partitions,    \
        i32 capacity) {                                                                          \
        cupa::decode_reduce<T>(out, lse, part_acc, part_max, part_sum, seq_lens,                \
                               query_start_loc, sinks, sliding_window, num_tokens, num_heads,   \
                               head_size, partition_size, max_partitions, capacity);            \
    }
