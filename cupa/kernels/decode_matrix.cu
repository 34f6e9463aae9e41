// Phase 1 of paged decode on AMD matrix cores: MFMA (CDNA) or WMMA (RDNA3, RDNA4) 16x16x16
// instructions, fp16/bf16 queries, a cache of the query type or fp8 codes (widened to the
// query type in registers: by v_cvt_pk_f32_fp8 where the target reads the cache's format,
// in software otherwise), head sizes 64, 80, 96, 112, 128, 192 and 256. Phase 2 is
// decode_common.cuh's reduce.
//
// One workgroup per (row chunk of a KV head, partition, sequence), as every family
// (begin_partition): TILES 16-row tiles of query rows (GQA heads x new tokens). Each wavefront
// (or pair of wavefronts, each with half of the head's columns: MatrixPartition::SPLIT) takes
// every WAVES-th (PAIRS-th) 16-token tile of the partition and computes, for each row tile,
//   S^T  = K Q^T       A = K    (16 tokens x 16 d),  B = Q^T (16 d x 16 query rows)
//   O^T += V^T P^T     A = V^T  (16 d x 16 tokens),  B = P^T (16 tokens x 16 query rows)
// so the query rows are the instruction's columns: a lane's query row is lane % 16 in both
// products (matrix/core.cuh, fact 1), its running max and sum live in the lane, and O^T's
// accumulators of its row rescale without leaving it. The wavefronts merge through LDS at the
// end.
//
// A sum does not care about the order of its terms, so the kernel picks which d (QK) and which
// token (PV) each k-slot of the operands stands for, as long as A and B agree (fact 2):
//   QK: element e of chunk c in k-group g is d = g * K_RUN + c * ELEMS + e, so a lane reads one
//       contiguous run of its token's K row, and of its query row (staged in LDS).
//   PV: element e in k-group g is tile token g * ELEMS + e, the token S^T's accumulators hold
//       in that lane (fact 3), so P^T needs no LDS. Row i of V^T's chunk c is V's column
//       d = i * V_CHUNKS + c, so a lane reads a contiguous run of each of its tokens' V rows.
//       V_CHUNKS is D / 16 made even (80 and 112 have 5 and 7 chunks): the columns past D are
//       read as zeros and their rows of O^T never written.
// Tokens past seq_len or in blocks outside [0, num_blocks) are never read where they point:
// their logits are -inf and their V operands zero (where the loads go ahead they read the
// cache's first row instead and drop it; fetch_run), so garbage in unwritten slots cannot
// reach the output.
#include "decode_common.cuh"
#include "matrix/core.cuh"

namespace cupa {

// N consecutive elements of type C (4, 8 or 16k bytes, or a pair of fp8 codes: the low half
// of one word) as words.
template <typename C, int N>
CUPA_FN void load_words(const C* src, u32* words) {
    constexpr int BYTES = N * (int)sizeof(C), WORDS = BYTES / 4;
    static_assert(BYTES == 2 || (BYTES % 4 == 0 && (BYTES <= 8 || BYTES % 16 == 0)),
                  "a run of 2, 4, 8 or 16k bytes");
    if constexpr (BYTES == 2) {  // V runs of fp8 codes at heads 80 and 96
        words[0] = (u32)*reinterpret_cast<const u16*>(src);
    } else if constexpr (BYTES == 4) {
        words[0] = *reinterpret_cast<const u32*>(src);
    } else if constexpr (BYTES == 8) {
        const cupa_u32x2 v = *reinterpret_cast<const cupa_u32x2*>(src);
        words[0] = v.x;
        words[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < WORDS; i += 4) {
            const cupa_u32x4 v = load16(reinterpret_cast<const u32*>(src) + i);
            words[i] = v.x; words[i + 1] = v.y; words[i + 2] = v.z; words[i + 3] = v.w;
        }
    }
}

// The run of N elements at element `within` (< D) of a cache row (the row's offset, or -1
// where there is nothing to read):
//   UNGUARDED (MatrixPartition::UNGUARDED): always a load, never a branch; -1 reads the
//     cache's first row instead (in bounds: the host asks for a block), and the caller drops
//     what came (`kept_or_zero`, or a logit of -inf), so that the compiler issues loads
//     together and their round trips overlap;
//   otherwise zeros, the load behind a test: each such load is a block of its own, waited for
//     before the next (18 round trips a tile on gfx942 where every load was so,
//     docs/perf-log.md v54), but it holds no registers ahead of its use.
template <typename C, int N, bool UNGUARDED>
CUPA_FN void fetch_run(const C* cache, i64 row, int within, u32* words) {
    if (!UNGUARDED && row < 0) {
#pragma unroll
        for (int i = 0; i < (N * (int)sizeof(C) + 3) / 4; ++i) words[i] = 0u;
    } else {
        load_words<C, N>(cache + (row >= 0 ? row : 0) + within, words);  // K: 16-byte loads
    }
}

// The words of a load whose token had something to read, zeros for one that had not.
template <int WORDS>
CUPA_FN void kept_or_zero(bool keep, u32* words) {
#pragma unroll
    for (int i = 0; i < WORDS; ++i) words[i] = keep ? words[i] : 0u;
}

// A run of N elements of cache type C (its words as loaded) as N / 2 words of two 16-bit
// values of matrix type T, element 2i in the low half of word i: the operand form.
//   T itself: the words as they are.
//   cupa_fp8 (software): a code becomes float16 holding its value times 2^(bias - 15)
//     (Elem<cupa_fp8>; the host folds the power into the scales), exactly; bfloat16 takes
//     that value, exactly.
//   cupa_fp8_amd (hardware): v_cvt_pk_f32_fp8 gives the codes' values, exactly, two a time.
template <typename T> CUPA_FN u32 from_half_bits(u32 half);
template <> CUPA_FN u32 from_half_bits<cupa_f16>(u32 half) { return half; }
template <> CUPA_FN u32 from_half_bits<cupa_bf16>(u32 half) {
    return float_to_bf16_bits(half_bits_to_float((u16)half));
}

template <typename T, typename C, int N>
struct Widen {  // a 16-bit cache of the query type
    // (an fp8 type lands here only where its specialisation does not exist: cupa_fp8_amd on a
    // target without v_cvt_pk_f32_fp8)
    static_assert(sizeof(C) == 2, "no conversion of this cache type on this target");
    CUPA_FN static void run(const u32* raw, u32* out) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) out[i] = raw[i];
    }
};
template <typename T, int N>
struct Widen<T, cupa_fp8, N> {
    CUPA_FN static u32 code(const u32* raw, int i) {
        return from_half_bits<T>(Elem<cupa_fp8>::half_bits((raw[i / 4] >> (8 * (i % 4))) & 0xffu));
    }
    CUPA_FN static void run(const u32* raw, u32* out) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) out[i] = code(raw, 2 * i) | (code(raw, 2 * i + 1) << 16);
    }
};
#if CUPA_AMD_FP8_CVT
template <typename T, int N>
struct Widen<T, cupa_fp8_amd, N> {
    CUPA_FN static void run(const u32* raw, u32* out) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const amd_f32x2 f = i % 2 ? amd_cvt_pk_f32_fp8<true>(raw[i / 2])
                                      : amd_cvt_pk_f32_fp8<false>(raw[i / 2]);
            out[i] = Elem<T>::narrow_word(f.r[0], f.r[1]);  // exact: fp8 values fit both
        }
    }
};
#endif

// Element i of words of two 16-bit values.
CUPA_FN u32 half_of(const u32* words, int i) { return (words[i / 2] >> (16 * (i % 2))) & 0xffffu; }

template <typename T, typename C, int D, int TILES>
struct MatrixPartition {
    // The VGPRs a lane holds through a pass where a wavefront's tile spans d columns of the
    // head: O^T's accumulators (V_CHUNKS below) and the query fragments. The layout's counts
    // a lane holds do not depend on d (MatrixTile<T, 16>).
    typedef MatrixTile<T, 16> Unit;
    static constexpr int held_vgprs(int d) {
        return TILES * ((d / 16 + 1) / 2 * 2) * Unit::ACC + TILES * (d / 16) * Unit::REGS;
    }
    static constexpr int STEPPED_HELD_MAX = TILES > 1 && Unit::L::COPIES == 1 ? 192 : 160;
    // Wavefronts that share a tile, each with D / SPLIT of the head's columns: 2 where the
    // whole head's held arrays pass STEPPED_HELD_MAX and half of them do not (RDNA3 one tile
    // at 192 and 256 and two at 96 and 128, RDNA4 one at 256 and two at 192; docs/perf-log.md
    // v56). A wavefront of a pair reads only its half of each K and V row, sums S^T over its
    // half of d, and the pair adds its two halves through LDS (one barrier a tile); then both
    // run the same softmax and each accumulates its half of O^T. Everywhere else 1: a
    // wavefront a tile, as before.
    static constexpr int SPLIT = held_vgprs(D) > STEPPED_HELD_MAX && D % 32 == 0 &&
                                 held_vgprs(D / 2) <= STEPPED_HELD_MAX ? 2 : 1;
    static constexpr int DH = D / SPLIT;  // a wavefront's columns of the head
    typedef MatrixTile<T, DH> G;
    typedef typename G::Core Core;
    typedef typename G::AB AB;
    typedef typename G::Acc Acc;
    static constexpr int WAVES = CUPA_THREADS / CUPA_WARP;
    static constexpr int PAIRS = WAVES / SPLIT;  // tiles a workgroup runs at once
    // O^T's 16-row tiles of d: D / 16, made even so that V runs are whole 16-bit pairs.
    static constexpr int V_CHUNKS = (G::CHUNKS + 1) / 2 * 2;
    // PV reads V in groups of chunks, each token's run of a group in one load, with at most 32
    // operand words of V per lane at a time: registers are what RDNA3's replicated operands
    // run short of (8 VGPRs per fragment). The group is the largest that divides V_CHUNKS and
    // loads as 4, 8 or 16k bytes (2 for fp8 codes where nothing larger divides: heads 80, 96).
    static constexpr int V_GROUP_WANTED = cmax(32 / G::REGS, 4 / (int)sizeof(C));
    static constexpr int v_group() {
        for (int g = cmin(V_CHUNKS, V_GROUP_WANTED); g >= 2; g -= 2) {
            const int bytes = g * (int)sizeof(C);
            if (V_CHUNKS % g == 0 && (bytes == 2 || bytes == 4 || bytes == 8 || bytes % 16 == 0))
                return g;
        }
        return 0;
    }
    static constexpr int V_GROUP = v_group();
    static_assert(V_GROUP > 0 && DH % V_GROUP == 0, "V runs wholly inside or past the row");
    static constexpr int V_WORDS = (V_GROUP * (int)sizeof(C) + 3) / 4;  // a token's run, loaded
    // Whether group c0's columns of a lane are in its DH columns of the row (not so at heads
    // 80 and 112, and at 96 split in two).
    CUPA_FN static bool v_in_row(int col, int c0) { return V_CHUNKS * 16 == DH || col * V_CHUNKS + c0 < DH; }
    // How a tile's loads go, by the registers they would hold (VGPRs of a wavefront's 256,
    // for its DH columns; the limits are the most that did not spill with clang-19,
    // docs/perf-log.md v54 to v56):
    //   LOADS_AHEAD: all issued before the first MMA (K's whole run, V's groups, the next
    //     tile's block ids), so that a pass waits through one memory round trip (v54: 18 on
    //     gfx942 before). Where the pass's arrays fit 160: those held through it (O^T's
    //     accumulators, the query fragments, which the compiler keeps in registers once the
    //     chunk loop unrolls whole), K's run and V's runs as loaded. Every CDNA variant
    //     dispatch runs; RDNA4 one tile to head 128 (and 256, split) and two at 64; RDNA3 one
    //     tile at 64 (and two at 96 with an fp8 cache, split).
    //   STEPPED: where only the arrays held through the pass fit (160; 192 for two row tiles
    //     of RDNA4, whose operands are not replicated and whose tiles share a step's K and V
    //     words): no test around a load either, but K two chunks at a time, V a group at a
    //     time after the softmax, the next tile's block ids asked for at the end of the pass:
    //     4-10 round trips a pass (v55: 22-120 before). RDNA3 one tile at 80 to 128 (and 192
    //     and 256, split) and two at 64 (and 96 with a 16-bit cache, and 128, split); RDNA4
    //     one tile at 192, two at 80 to 128 (and 192, split). Holding K's and V's whole runs
    //     there spilled.
    //   otherwise (no variant dispatch runs since v56; e.g. RDNA3's two tiles at 192) as
    //     before v54, each load behind its test (fetch_run): K a chunk at a time, the chunk
    //     loop unrolled by 2, V a group at a time after the softmax.
    static constexpr int V_GROUPS = V_CHUNKS / V_GROUP;
    static constexpr int HELD_VGPRS = held_vgprs(DH);
    static constexpr int AHEAD_VGPRS = HELD_VGPRS + G::K_RUN / 2 + G::ELEMS * V_GROUPS * V_WORDS;
    static constexpr bool LOADS_AHEAD = AHEAD_VGPRS <= 160;
    static constexpr bool STEPPED = !LOADS_AHEAD && HELD_VGPRS <= STEPPED_HELD_MAX;
    static constexpr bool UNGUARDED = LOADS_AHEAD || STEPPED;
    // Chunks whose K loads go together, and the chunk loop's unrolling (none in steps: unrolled
    // whole, the loop kept its query fragments in registers and spilled).
    static constexpr int K_AT_ONCE = LOADS_AHEAD ? G::CHUNKS : STEPPED ? 2 : 1;
    static constexpr int K_UNROLL = UNGUARDED ? 1 : 2;
    // Whether the running max is lazy (decode_common.cuh's LAZY_MAX): where the loads go
    // ahead. Elsewhere the branch around the rescale cost registers there are not (on RDNA3
    // at head 128: 17 more VGPRs, a spill with an fp8 cache); there the max moves every tile.
    static constexpr bool LAZY = LOADS_AHEAD;
    // LDS words: during the loop the query fragments of each half ([half][tile][chunk]
    // [register][lane]) and, where a pair shares a tile, the halves of S^T it adds (two sets,
    // by the tile's parity, so that one barrier a tile suffices: [parity][wave][tile]
    // [accumulator][lane]); then the merge slots of half the wavefronts ([accumulator][lane],
    // then max and sum by lane).
    static constexpr int WAVE_Q_WORDS = TILES * G::CHUNKS * G::REGS * CUPA_WARP;  // a half's
    static constexpr int Q_WORDS = SPLIT * WAVE_Q_WORDS;
    static constexpr int S_WORDS = SPLIT > 1 ? 2 * WAVES * TILES * G::ACC * CUPA_WARP : 0;
    static constexpr int SLOT_WORDS = (V_CHUNKS * G::ACC + 2) * CUPA_WARP;
    static constexpr int MERGE_WORDS = (WAVES / 2) * SLOT_WORDS;
    static constexpr int LDS_WORDS = Q_WORDS + S_WORDS > MERGE_WORDS ? Q_WORDS + S_WORDS : MERGE_WORDS;
};

// The max of a query row's logits over the lanes that hold its tokens: lane ^ 16, ^ 32 (the
// k-groups, or RDNA3's half-waves).
CUPA_FN float row_max(float lane_max) {
#pragma unroll
    for (int m = 16; m < CUPA_WARP; m <<= 1) lane_max = max_f(lane_max, warp_xor(lane_max, m));
    return lane_max;
}

// p = 2^(x - m) for a lane's logits (in log2 units), and their sum.
template <int N>
CUPA_FN float exponentials(const float* x, float m, float* p) {
    float sum = 0.0f;
#pragma unroll
    for (int a = 0; a < N; ++a) {
        p[a] = fast_exp2(x[a] - subtrahend(m));
        sum += p[a];
    }
    return sum;
}

// O^T's accumulators of one row tile times the factor its running max moved by.
template <int CHUNKS, int ACC, typename Acc>
CUPA_FN void rescale(Acc* o, float keep) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c)
#pragma unroll
        for (int a = 0; a < ACC; ++a) o[c].r[a] *= keep;
}

// The rows a lane reads in one 16-token tile: its K row's (token t0 + col) and its PV tokens'
// (t0 + pv_first + e). AHEAD: from block ids the kernel asks for a tile early (`ask`), so that
// the table's round trip hides behind the tile before (MatrixPartition::UNGUARDED). Otherwise
// from the table at each use (PagedRows::row), holding no registers through the pass.
template <int ELEMS, bool AHEAD>
struct TileRows {
    int k, v[ELEMS];  // block ids (AHEAD)
    CUPA_FN void ask(const PagedRows& rows, int t0, int col, int pv_first) {
        k = rows.block_id(t0 + col);
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) v[e] = rows.block_id(t0 + pv_first + e);
    }
    CUPA_FN i64 k_row(const PagedRows& rows, int t) const {
        return AHEAD ? rows.row_of(k, t) : rows.row(t);
    }
    CUPA_FN i64 v_row(const PagedRows& rows, int e, int t) const {
        return AHEAD ? rows.row_of(v[e], t) : rows.row(t);
    }
    // Which PV tokens (pv_t0 + e) are readable, a bit each.
    CUPA_FN u32 readable(const PagedRows& rows, int pv_t0) const {
        u32 bits = 0u;
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) bits |= (v_row(rows, e, pv_t0 + e) >= 0 ? 1u : 0u) << e;
        return bits;
    }
};

// V's chunks c0 .. c0 + V_GROUP - 1 of PV token e of a lane, if readable: a run of V_GROUP
// elements of the token's row at column d_base + col * V_CHUNKS + c0 (fetch_run; none for
// columns past the wavefront's DH, at heads 80 and 112 and at 96 split in two).
template <typename P, typename C, typename Rows>
CUPA_FN void load_v_run(const C* value_cache, const PagedRows& rows, const Rows& here,
                        u32 readable, int pv_t0, int d_base, int col, int c0, int e, u32* raw) {
    const bool in_row = P::v_in_row(col, c0);
    const i64 row = in_row && ((readable >> e) & 1u) ? here.v_row(rows, e, pv_t0 + e) : -1;
    fetch_run<C, P::V_GROUP, P::UNGUARDED>(
        value_cache, row, in_row ? d_base + col * P::V_CHUNKS + c0 : 0, raw);
}

template <typename T, typename C, int D, int TILES>
CUPA_FN void decode_partition_matrix(CUPA_PARTITION_PARAMS(T, C)) {
    typedef MatrixPartition<T, C, D, TILES> P;
    typedef typename P::G G;
    typedef typename P::AB AB;
    typedef typename P::Acc Acc;
    typedef typename P::Core Core;
    typedef typename G::L L;
    constexpr int CHUNKS = G::CHUNKS, ELEMS = G::ELEMS, REGS = G::REGS, ACC = G::ACC;
    constexpr int WAVES = P::WAVES, PAIRS = P::PAIRS, SPLIT = P::SPLIT, DH = P::DH;
    constexpr int V_GROUP = P::V_GROUP, V_CHUNKS = P::V_CHUNKS;
    G::check();
    static_assert(sizeof(T) == 2 && (sizeof(C) == 2 || sizeof(C) == 1), "16-bit or fp8 cache");
    static_assert(P::V_GROUP % 2 == 0, "V runs of whole 16-bit pairs");
    __shared__ u32 lds[P::LDS_WORDS];
    CUPA_ASSERT_AMD_LDS(4 * P::LDS_WORDS);

    PartitionWork w;
    if (!begin_partition<T, 16 * TILES, D>(w, out, lse, seq_lens, query_start_loc, sinks,
                                           sliding_window, num_tokens, num_heads, num_kv_heads,
                                           block_size, max_blocks_per_seq, partition_size,
                                           max_partitions, head_chunks, cluster_merge))
        return;
    const PagedRows rows = paged_rows(w, block_tables, max_blocks_per_seq, block_size,
                                      num_blocks, kv_block_stride, kv_head_stride,
                                      kv_token_stride);
    const int tid = threadIdx.x, wave = tid / CUPA_WARP, lane = tid % CUPA_WARP;
    const int col = lane % 16, kgroup = G::kgroup(lane);
    // The tile stream this wavefront is in, and its columns of the head (P::SPLIT).
    const int pair = wave / SPLIT, half = wave % SPLIT, d_base = half * DH;

    // The query fragments (B of S^T) of each half, unscaled: lane l of a tile holds row
    // l % 16's run.
    for (int i = tid; i < SPLIT * TILES * CUPA_WARP; i += CUPA_THREADS) {
        const int h = SPLIT > 1 ? i / (TILES * CUPA_WARP) : 0;
        const int tile = SPLIT > 1 ? i / CUPA_WARP % TILES : i / CUPA_WARP;
        const int l = i % CUPA_WARP, r = 16 * tile + l % 16;
        const u32* q = r < w.nh ? reinterpret_cast<const u32*>(query + w.row_index(r) * D +
                                                               h * DH + G::kgroup(l) * G::K_RUN)
                                : nullptr;
        u32* q_lds = lds + h * P::WAVE_Q_WORDS;
#pragma unroll
        for (int j = 0; j < CHUNKS * REGS; ++j)
            q_lds[(tile * CHUNKS * REGS + j) * CUPA_WARP + l] = q != nullptr ? q[j] : 0u;
    }
    const u32* q_frags = lds + half * P::WAVE_Q_WORDS;  // this wavefront's half

    // This lane's query row of each tile: causal range, ALiBi slope, running max and sum.
    int first[TILES], pos[TILES];
    float slope[TILES], m_run[TILES], l_run[TILES];
    Acc o[TILES][V_CHUNKS];
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int r = 16 * tile + col;
        const bool row = r < w.nh;
        pos[tile] = row ? w.row_pos(r) : -1;  // -1: no token is seen
        first[tile] = row ? window_first(w.row_pos(r), sliding_window) : 0;
        slope[tile] = alibi_slopes != nullptr && row
                          ? alibi_slopes[w.row_index(r) % num_heads] * LOG2E : 0.0f;
        m_run[tile] = neg_inf();
        l_run[tile] = 0.0f;
#pragma unroll
        for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
            for (int a = 0; a < ACC; ++a) o[tile][c].r[a] = 0.0f;
    }
    const float qk_scale = scale * LOG2E * k_factor(kv_scales, w.kv_head);
    __syncthreads();

    // The block ids of this wavefront's first tile, where the loads have no tests: each pass
    // asks for the next tile's, with its own loads where they go ahead, at its end in steps.
    TileRows<ELEMS, P::UNGUARDED> ids;
    if constexpr (P::UNGUARDED) ids.ask(rows, w.start + 16 * pair, col, kgroup * ELEMS);

    // Where a pair shares a tile, every wavefront runs as many passes as the first pair (a
    // barrier a pass): a tile at or past the end has nothing readable, and adds nothing.
    int parity = 0;  // which of the two sets of S^T's halves this pass uses (P::S_WORDS)
    for (int t0 = w.start + 16 * pair; SPLIT > 1 ? t0 - 16 * pair < w.end : t0 < w.end;
         t0 += 16 * PAIRS) {
        // This tile's rows: K's (token t0 + col), and which of the PV tokens (pv_t0 + e) are
        // readable: here where V loads ahead, after S^T otherwise (earlier, RDNA3 took 8 more
        // VGPRs, an occupancy step).
        const TileRows<ELEMS, P::UNGUARDED> here = ids;
        const int pv_t0 = t0 + kgroup * ELEMS;
        const i64 k_row = here.k_row(rows, t0 + col);
        u32 readable = P::LOADS_AHEAD ? here.readable(rows, pv_t0) : 0u;

        // The tile's loads, issued together where they go ahead: V's groups of chunks, the
        // next tile's block ids, then K's run (the chunk loop below). A K row with nothing to
        // read reads the cache's first row there (fetch_run): its logits become -inf in the
        // softmax.
        u32 v_raw[P::V_GROUPS][ELEMS][P::V_WORDS];  // (where the loads go ahead)
        if constexpr (P::LOADS_AHEAD) {
#pragma unroll
            for (int g = 0; g < P::V_GROUPS; ++g)
#pragma unroll
                for (int e = 0; e < ELEMS; ++e)
                    load_v_run<P>(value_cache, rows, here, readable, pv_t0, d_base, col,
                                  g * V_GROUP, e, v_raw[g][e]);
            ids.ask(rows, t0 + 16 * PAIRS, col, kgroup * ELEMS);
        }

        // S^T = K Q^T for every row tile; this lane's K row is token t0 + col.
        Acc s[TILES];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int a = 0; a < ACC; ++a) s[tile].r[a] = 0.0f;
        // K_AT_ONCE chunks a step; in steps of 2 at heads 80 and 112 (an odd count) the last
        // step has one (a uniform test, which folds away elsewhere).
        constexpr int K_STEP = P::K_AT_ONCE;
        constexpr bool K_TAIL = CHUNKS % K_STEP != 0;
#pragma unroll(P::K_UNROLL)
        for (int c0 = 0; c0 < CHUNKS; c0 += K_STEP) {
            u32 raw[K_STEP][ELEMS * sizeof(C) / 4];
#pragma unroll
            for (int b = 0; b < K_STEP; ++b)
                if (!K_TAIL || c0 + b < CHUNKS)
                    fetch_run<C, ELEMS, P::UNGUARDED>(
                        key_cache, k_row, d_base + kgroup * G::K_RUN + (c0 + b) * ELEMS, raw[b]);
            if constexpr (P::UNGUARDED) schedule_fence();  // the loads above stay together
#pragma unroll
            for (int b = 0; b < K_STEP; ++b) {
                if (K_TAIL && c0 + b >= CHUNKS) continue;
                AB k;
                Widen<T, C, ELEMS>::run(raw[b], k.r);
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile) {
                    AB q;
#pragma unroll
                    for (int j = 0; j < REGS; ++j)
                        q.r[j] = q_frags[((tile * CHUNKS + c0 + b) * REGS + j) * CUPA_WARP + lane];
                    s[tile] = Core::mma(k, q, s[tile]);
                }
            }
        }

        // A pair's S^T: each wavefront's half of the sum over d, added through LDS. a + b and
        // b + a are the same float, so both run the same softmax to the bit (and write the
        // same max and sum).
        if constexpr (SPLIT > 1) {
            float* halves = reinterpret_cast<float*>(lds + P::Q_WORDS) +
                            parity * WAVES * TILES * ACC * CUPA_WARP;
#pragma unroll
            for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
                for (int a = 0; a < ACC; ++a)
                    halves[((wave * TILES + tile) * ACC + a) * CUPA_WARP + lane] = s[tile].r[a];
            __syncthreads();
#pragma unroll
            for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
                for (int a = 0; a < ACC; ++a)
                    s[tile].r[a] += halves[(((wave ^ 1) * TILES + tile) * ACC + a) * CUPA_WARP + lane];
            parity ^= 1;
        }

        if constexpr (!P::LOADS_AHEAD) readable = here.readable(rows, pv_t0);

        // Online softmax per row tile, then P^T as 16-bit operand.
        AB p_op[TILES];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
            float x[ACC];
#pragma unroll
            for (int a = 0; a < ACC; ++a) x[a] = s[tile].r[a];
            scale_and_cap<ACC>(x, qk_scale, soft_cap);
            float tile_max = neg_inf();
#pragma unroll
            for (int a = 0; a < ACC; ++a) {
                const int t = t0 + L::d_row(lane, a);
                const bool seen = ((readable >> G::acc_element(lane, a)) & 1u) &&
                                  t >= first[tile] && t <= pos[tile];
                x[a] = seen ? x[a] + slope[tile] * (float)(t - pos[tile]) : neg_inf();
                tile_max = max_f(tile_max, x[a]);
            }
            // P::LAZY: the running max moves only where some logit of the wavefront passes it
            // by more than LAZY_MAX, mostly in the first tiles; then the row's max over the
            // other lanes holding its tokens, and O^T and the sum rescaled; otherwise none of
            // that. Not lazy: every tile, in that order (which the registers of RDNA3's two
            // tiles at head 96 need: the lazy form's order spilled there).
            float p[ACC];
            if constexpr (P::LAZY) {
                if (warp_any(passes_max(tile_max, m_run[tile]))) {
                    const float m_new = max_f(m_run[tile], row_max(tile_max));
                    const float keep = fast_exp2(m_run[tile] - subtrahend(m_new));  // 0 from -inf
                    l_run[tile] *= keep;
                    m_run[tile] = m_new;
                    rescale<V_CHUNKS, ACC>(o[tile], keep);
                }
                l_run[tile] += exponentials<ACC>(x, m_run[tile], p);  // this lane's share
            } else {
                const float m_new = max_f(m_run[tile], row_max(tile_max));
                const float keep = fast_exp2(m_run[tile] - subtrahend(m_new));
                l_run[tile] = l_run[tile] * keep + exponentials<ACC>(x, m_new, p);
                m_run[tile] = m_new;
                rescale<V_CHUNKS, ACC>(o[tile], keep);
            }
            if constexpr (G::in_place()) {
#pragma unroll
                for (int j = 0; j < REGS; ++j) p_op[tile].r[j] = Elem<T>::narrow_word(p[2 * j], p[2 * j + 1]);
            } else {  // RDNA3: tokens 2j + half from here, 2j + (1 - half) from lane ^ 16
                const bool upper = lane >= 16;
#pragma unroll
                for (int j = 0; j < REGS; ++j) {
                    const float other = warp_xor(p[j], 16);
                    p_op[tile].r[j] = upper ? Elem<T>::narrow_word(other, p[j])
                                            : Elem<T>::narrow_word(p[j], other);
                }
            }
        }

        // O^T += V^T P^T, V in groups of V_GROUP chunks: a run of V_GROUP elements of each
        // token's row at column col * V_CHUNKS + c0 (loaded above where the loads go ahead).
#pragma unroll
        for (int c0 = 0; c0 < V_CHUNKS; c0 += V_GROUP) {
            const bool in_row = P::v_in_row(col, c0);
            u32 wide[ELEMS][V_GROUP / 2];  // each token's run, as 16-bit pairs
            u32 group[P::STEPPED ? ELEMS : 1][P::V_WORDS];  // in steps: the group's loads at once
            if constexpr (P::STEPPED) {
#pragma unroll
                for (int e = 0; e < ELEMS; ++e)
                    load_v_run<P>(value_cache, rows, here, readable, pv_t0, d_base, col, c0, e,
                                  group[e]);
                schedule_fence();
            }
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) {
                // Loaded ahead or in steps: the words as they came, those with nothing to read
                // zeroed. Otherwise loaded here, a token at a time (the base form's registers).
                u32 fetched[P::V_WORDS];
                u32* raw = P::LOADS_AHEAD ? v_raw[c0 / V_GROUP][e] : P::STEPPED ? group[e] : fetched;
                if constexpr (P::UNGUARDED)
                    kept_or_zero<P::V_WORDS>(in_row && ((readable >> e) & 1u), raw);
                else
                    load_v_run<P>(value_cache, rows, here, readable, pv_t0, d_base, col, c0, e,
                                  raw);
                Widen<T, C, V_GROUP>::run(raw, wide[e]);
            }
#pragma unroll
            for (int c = 0; c < V_GROUP; ++c) {
                AB v;
#pragma unroll
                for (int j = 0; j < REGS; ++j)
                    v.r[j] = half_of(wide[2 * j], c) | (half_of(wide[2 * j + 1], c) << 16);
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile)
                    o[tile][c0 + c] = Core::mma(v, p_op[tile], o[tile][c0 + c]);
            }
        }
        // In steps, the next tile's block ids: asked for here, they hold no registers through
        // the pass (asked for at its start, RDNA3 lost an occupancy step or spilled, v55).
        if constexpr (P::STEPPED) ids.ask(rows, t0 + 16 * PAIRS, col, kgroup * ELEMS);
    }

    // Each lane summed only its own tokens' weights.
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
        for (int m = 16; m < CUPA_WARP; m <<= 1) l_run[tile] += warp_xor(l_run[tile], m);

    // Merge the tile streams, a tree through LDS: the upper half writes, the lower half adds
    // (each wavefront of a pair with the same half of the columns in the other pairs).
    __syncthreads();  // the query fragments are read no more
    float* slots = reinterpret_cast<float*>(lds);
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int span = PAIRS / 2; span >= 1; span /= 2) {
            if (pair >= span && pair < 2 * span) {
                float* slot = slots + ((pair - span) * SPLIT + half) * P::SLOT_WORDS;
#pragma unroll
                for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
                    for (int a = 0; a < ACC; ++a) slot[(c * ACC + a) * CUPA_WARP + lane] = o[tile][c].r[a];
                slot[V_CHUNKS * ACC * CUPA_WARP + lane] = m_run[tile];
                slot[(V_CHUNKS * ACC + 1) * CUPA_WARP + lane] = l_run[tile];
            }
            __syncthreads();
            if (pair < span) {
                const float* slot = slots + (pair * SPLIT + half) * P::SLOT_WORDS;
                const float m_other = slot[V_CHUNKS * ACC * CUPA_WARP + lane];
                const float l_other = slot[(V_CHUNKS * ACC + 1) * CUPA_WARP + lane];
                const float m_new = max_f(m_run[tile], m_other);
                const float keep = fast_exp2(m_run[tile] - subtrahend(m_new));
                const float take = fast_exp2(m_other - subtrahend(m_new));
#pragma unroll
                for (int c = 0; c < V_CHUNKS; ++c)
#pragma unroll
                    for (int a = 0; a < ACC; ++a)
                        o[tile][c].r[a] = o[tile][c].r[a] * keep +
                                          slot[(c * ACC + a) * CUPA_WARP + lane] * take;
                l_run[tile] = l_run[tile] * keep + l_other * take;
                m_run[tile] = m_new;
            }
            __syncthreads();
        }
    }
    if (pair != 0) return;

    // The first pair writes (one wavefront, unless split): O^T's accumulator a of chunk c is
    // row col's column d_base + d_row(lane, a) * V_CHUNKS + c (none past the wavefront's DH).
    // The halves of a pair hold the same max and sum: the first writes them.
    const float v_scale = v_factor(kv_scales, w.kv_head, num_kv_heads);
    const bool single = w.writes_output;
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
        const int r = 16 * tile + col;
        if (r >= w.nh) continue;
        const i64 head = w.row_index(r);
        float factor = v_scale, lse_value = 0.0f;
        if (single) factor *= finish_head(m_run[tile], l_run[tile], sink_of(sinks, head, num_heads),
                                          lse_value);
#pragma unroll
        for (int a = 0; a < ACC; ++a) {
            const int d0 = L::d_row(lane, a) * V_CHUNKS;
#pragma unroll
            for (int c = 0; c < V_CHUNKS; ++c) {
                if constexpr (V_CHUNKS * 16 != DH) {
                    if (d0 + c >= DH) continue;  // a padded column (heads 80, 112; 96 split)
                }
                const float value = o[tile][c].r[a] * factor;
                if (single)
                    Elem<T>::store(out + head * D + d_base + d0 + c, value);
                else
                    part_acc[(head * max_partitions + w.part) * D + d_base + d0 + c] = value;
            }
        }
        if (lane < 16 && half == 0) {
            if (single) {
                if (lse != nullptr) lse[head] = lse_value;
            } else {
                part_max[head * max_partitions + w.part] = m_run[tile];
                part_sum[head * max_partitions + w.part] = l_run[tile];
            }
        }
    }
}

}  // namespace cupa

// On CDNA at most 256 registers a lane (2 wavefronts a SIMD, what the planner launches there),
// so that LLVM selects the MFMAs' VGPR form: O's accumulators then stay where the lazy max's
// rescale works on them, not copied between AGPRs and VGPRs every tile (72 v_accvgpr moves a
// tile on gfx942 before, docs/perf-log.md v54).
#if CUPA_HIP && CUPA_AMD_MFMA
#define CUPA_MATRIX_KERNEL_BOUNDS __launch_bounds__(CUPA_THREADS) __attribute__((amdgpu_waves_per_eu(2)))
#else
#define CUPA_MATRIX_KERNEL_BOUNDS __launch_bounds__(CUPA_THREADS)
#endif
#define CUPA_DECODE_MATRIX_VARIANT(NAME, T, C, D, TILES)                                         \
    extern "C" __global__ void CUPA_MATRIX_KERNEL_BOUNDS                                        \
        NAME(CUPA_PARTITION_PARAMS(T, C)) {                                                      \
        cupa::start_in_chain(); /* see decode_common.cuh */                                     \
        cupa::decode_partition_matrix<T, C, D, TILES>(CUPA_PARTITION_ARGS);                      \
    }
