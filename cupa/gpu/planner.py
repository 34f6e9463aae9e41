"""Planning a decode launch: row chunks, partition size and grid.

The plan depends only on shapes (and optional length hints: the longest sequence, the total of
all lengths), never on array contents, so it needs no device synchronisation. Partitions past a
sequence's length exit at once, which is why a length hint only tunes speed and can never make a
result wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..problem import MAX_GRID_YZ, DecodeShape
from . import dispatch
from .catalogue import MAX_CLUSTER, DecodeMmaVariant, sm_number

# Two partitions merged within clusters are planned instead of more partitions and the reduce
# launch from this many workgroups per multiprocessor (measured at 0.97), for partitions of at
# most CLUSTER_PAIR_MAX_TOKENS (measured at 2048: faster; at 16384: slower).
CLUSTER_PAIR_DENSITY = 0.9
CLUSTER_PAIR_MAX_TOKENS = 4096

# Ragged batches (a total length below num_seqs x the longest). The grid runs the sequences in
# order, so the partitions of a long sequence start whenever the grid reaches it, not together in
# the first wave as in a uniform batch, and the last of them to start ends the launch up to one
# partition late. The emptier the batch, the more splits, up to this many times the uniform
# rule's for the same work, keep that tail short. In a model of the launch (docs/perf-log.md,
# v17) that gave the bench's longtail64 2560-token partitions at 93% of the copy floor (the best
# of the sweep) and mixed128 3328 at 92% (best: 95%); the uniform rule for the same work reached
# 83% / 87%, one partition (the plan from the longest length alone) 36% / 49%.
RAGGED_TAIL_SPLITS = 3
# ... but never a grid of more than this many waves of workgroups: every partition past a short
# sequence's end still launches a workgroup that loads its length and exits. With one 32768-token
# sequence among 255 of 16 tokens the model's best split made a grid of 62 waves at 0.5 us per
# empty workgroup (39 at 2 us; unmeasured on the device).
RAGGED_MAX_GRID_WAVES = 64
# Few long sequences of the 8-column kernel at head 128, merged by the reduce: one workgroup a
# multiprocessor with partitions up to CLUSTER_PAIR_MAX_TOKENS beats two of half the length
# (fewer partials to merge, half the fixed cost per token), where such a grid fills at least this
# fraction of the multiprocessors (docs/perf-log.md v23: at 0.97 1-5% faster, at 0.91 2% slower).
ONE_PER_SM_HEAD_SIZES = (128,)
ONE_PER_SM_DENSITY = 0.95
# The 16-row kernel with one m-tile (at most this many query rows: its four warps split each
# chunk's tokens) aims at one workgroup a multiprocessor, not the variant's two, and a uniform
# batch never gets more. Group 16 on the H200, the 16-row kernel split for two a multiprocessor
# -> for at most one (docs/perf-log.md v24): 40 x 2048 73.9 -> 58.1 us, 24 x 2048 52.7 -> 41.3,
# 16 x 4096 52.0 -> 50.2, 4 x 8192 34.5 -> 32.8, 2 x 16384 36.8 -> 33.0, 1 x 16384 29.0 -> 24.6,
# 32 x 2048 50.0 -> 48.5. Rounded down rather than to nearest: 12 x 2048 27.7 in 96 workgroups
# against 29.3 in 144 (though 20 x 2048 lost by it: 40.0 in 80 against 38.0 in 160). With more
# tiles (MQA's 64 rows, a tile a warp) two still win: MQA 128 x 1024 43.3 us in 256 workgroups,
# 50.8 in 128.
ONE_TILE_ROWS = 16
# Small launches merge their partitions in one cluster of up to MAX_CLUSTER (sm_90) instead of by
# the reduce launch (_small_launch): the 8-column kernel in one wave of at most one workgroup a
# multiprocessor, each workgroup reading at most SMALL_LAUNCH_MAX_TOKENS tokens and
# SMALL_LAUNCH_MAX_BYTES of K/V, in a form of two or more workgroups a multiprocessor (not head
# 256's), whose clusters of 16 leave room for such a grid (224 blocks resident at head 128,
# docs/perf-log.md v14 step 7). There a call's host time (20-30 us on the H200's hosts) is about
# twice its GPU time back to back, and the reduce is a second launch to enqueue (~5 us). H200,
# GQA 8, head 128, reduce -> cluster (docs/perf-log.md v26 step 4), eager back-to-back calls:
# 1 x 4096 (16 partitions of 256) 33.3 / 31.2 -> 22.3 / 24.8 us, 1 x 8192 30.6 / 28.5 -> 22.6 /
# 21.6, 2 x 4096 33.6 / 28.3 -> 25.1 / 20.1, 1 x 2048 32.1 / 29.8 -> 22.0 / 25.1; head 64 1 x 4096
# 26.5 / 30.4 -> 19.2 / 23.7. The kernels' own time (L2 flushed) moved by -0.6 to +0.75 us (1 x
# 4096: 16.15 -> 16.9) until every block merged an equal slice (merge_cluster; v27 step 1: 1 x
# 4096 16.4, the reduce's). From 1024-token partitions a call is no longer host-bound and
# clusters lose: 1 x 16384 back to back 24.5 -> 32.0 us, 1 x 32768 40.1 -> 55.3 (v27: again).
SMALL_LAUNCH_MAX_TOKENS = 512
SMALL_LAUNCH_MAX_BYTES = 256 << 10
# Grids of more than one wave of the tensor-core kernels (sm_90) start the first wave's
# workgroups of a multiprocessor spread over STAGGER_SPREAD_NS: slot k of n waits k x
# STAGGER_SPREAD_NS / n after its claim (stagger_first_wave in kernels/mma/ring.cuh), so that
# the slots of a multiprocessor do not end and restart together, each wave's prologue unhidden.
# H200, uniform batches, no stagger -> k x step (docs/perf-log.md v34): GQA 8 at 128 x 1024
# (1024 workgroups, two a multiprocessor) 142.0 -> 139.5 us at 4 us, 139.2 at 6, 139.5 at 8,
# 141.6 at 16; 256 x 2048 496.1 -> 494.1 at 4-6 us, 500.4 at 30; 96 x 1024 111.3 -> 110.3 at
# 10; group 16 at 128 x 1024 82.2 -> 81.5 at 5 (bf16 82.6 -> 81.5 at 8); head 64 (its dense
# form, four a multiprocessor) 77.8 -> 77.1 at 2.5 us steps, 78.5 at 9; but 64 x 4096 255.4 ->
# 261.3 at 30. A grid of one wave has no restarts to spread and pays the wait: 32 x 2048 76.8 ->
# 77.9 at 10.
STAGGER_MIN_SM = 90
STAGGER_SPREAD_NS = 10_000
# Short sequences of a uniform batch run one workgroup a multiprocessor: each sequence in as many
# partitions as fit (multiprocessors // its workgroups, at least one; the uniform rule aims at two
# a multiprocessor), where that grid fills at least ONE_A_SM_FRACTION of the multiprocessors; for
# the 8-column kernel's forms of two or more workgroups a multiprocessor, from head
# ONE_A_SM_MIN_HEAD_SIZE, on sm_90, up to ONE_A_SM_MAX_TOKENS a sequence. A workgroup alone on
# its multiprocessor streams faster than a slot of a full one, and fewer partitions merge.
# H200, GQA 8, uniform rule -> this one (docs/perf-log.md v49), µs:
#   12-16 sequences whole (96-128 workgroups; a cluster pair before): float16 12 x 1024 25.3 ->
#   23.9, 16 x 1024 29.9 -> 28.1, 12 x 512 17.4 -> 15.6, 12 x 2048 40.5 -> 38.6, 12 x 4096
#   66.8 -> 63.2; fp8 12 x 1024 17.8 -> 15.6; bf16 12 x 4096 65.6 -> 62.8; head 96 13 x 4096
#   56.3 -> 53.9; MHA 3 x 4096 65.3 -> 61.7;
#   3-7 sequences in 2-5 partitions (4-8 before): 6 x 1024 18.8 -> 17.2, 7 x 2048 29.7 ->
#   27.5, 6 x 4096 42.0 -> 40.0, 3 x 2048 18.2 -> 17.2, 5 x 2048 23.9 -> 23.6; fp8 7 x 4096
#   30.3 -> 27.8; head 96 4 x 2048 18.8 -> 17.3. Eager calls back to back 0.64-1.0x the time,
#   the most where the new plan merges in one launch and the old needed the reduce (3 x 2048
#   23.7 -> 15.2, 6 x 4096 36.5 -> 31.1; 12 x 4096 62.4 -> 53.7).
# Below the fraction the pair held (10 x 4096, 80 workgroups alone on 61% of the
# multiprocessors: 2.9% faster paired), and head 64's pair won at 12 x 4096 (39.3 against 43.1).
# Sliding windows and targets before sm_90 were not measured, and keep the uniform rule.
ONE_A_SM_FRACTION = 0.7
ONE_A_SM_MIN_HEAD_SIZE = 96
ONE_A_SM_MIN_SM = 90
ONE_A_SM_MAX_TOKENS = 4096  # measured up to 4096 (at head 128 the wide form serves from 8192)
# A grid of one to one and a half waves of resident workgroups, whole, runs as two waves, the
# second part-full (wave quantisation, _over_one_wave_splits). Up to QUARTER_SPLIT_MAX_WAVES
# the sequences split in four (4.1-5 waves of quarter partitions, whose part-full last wave is
# short); past it in two (2.5-3 waves, the last over half full); and whole where a partition's
# fixed cost outweighs any tail: at most WHOLE_TOKENS tokens, or WHOLE_LATE_TOKENS past
# WHOLE_LATE_FROM_WAVES. H200, GQA 8, head 128, float16, best split against the old two
# (docs/perf-log.md v49): 34-40 x 2048-8192 in four 1.2-6.6% faster (34 x 8192 296.8 -> 281.7
# us, 38 x 4096 178.0 -> 172.1), 42-48 x 4096-8192 best in two still, 46-48 x 2048 whole
# 2.3-2.9% faster, 34-48 x 1024 whole 2.6-10% faster; the same choices won at MHA, group 4,
# bf16, heads 80 and 96, head 256's deep form (one a multiprocessor: 17 x 4096 168.6 -> 162.7)
# and fp8 at head 96 (34 x 4096 82.3 -> 74.3 in four, 40 x 1024 39.1 -> 29.7 whole). v23 first
# split such grids, in two: 40 x 4096 211.0 us whole, 185.8 halved. Heads below 80 (head 64's
# forms hold 3-5 workgroups a multiprocessor) were not measured.
QUARTER_SPLIT_MAX_WAVES = 1.25
QUARTER_SPLIT_MIN_HEAD_SIZE = 80
WHOLE_TOKENS = 1024
WHOLE_LATE_TOKENS = 2048
WHOLE_LATE_FROM_WAVES = 1.3
# Long sequences of a uniform batch whose grid, whole, is less than one wave of the default form
# (LONG_SPLIT_MIN_SM_FRACTION of the multiprocessors to LONG_SPLIT_MAX_SLOT_FRACTION of the
# resident slots) run in partitions of one of LONG_SPLIT_TOKENS, the one whose grid fills its
# last wave of resident workgroups the more (ties: the longer): several waves of short
# partitions balance the multiprocessors, where one wave of whole sequences leaves some with
# two workgroups and some with one. From LONG_SPLIT_MIN_TOKENS tokens (at 8192 whole won), for
# the 8-column kernel's default forms of two or more workgroups a multiprocessor from head
# LONG_SPLIT_MIN_HEAD_SIZE, on sm_90. Not where the wide form whole covers nearly every
# multiprocessor (LONG_SPLIT_WIDE_FRACTION of them to all): 16 x 16384 whole 2.6% faster.
# H200, GQA 8, head 128, float16, whole -> this rule (docs/perf-log.md v50), µs, held out from
# the sweep the rule was read off: 19 x 16384 312.6 -> 307.6 (2048), 21 x 16384 348.6 ->
# 339.2 (4096), 23 x 16384 383.6 -> 362.6 (4096), 25 x 16384 408.4 -> 394.4 (2048), 27 x 16384
# 434.5 -> 427.4 (2048), 13 x 32768 423.6 -> 419.9 (2048), 15 x 32768 469.3 -> 466.6 (4096);
# its miss: 18 x 16384 295.6 -> 300.9. The same choice at bf16, fp8, MHA, group 4 and head 96:
# fp8 23 x 16384 204.9 -> 195.1, MHA 3 x 32768 771.4 -> 716.9, head 96 19 x 16384 258.6 ->
# 238.1; fp8's 13 x 32768 lost 1.4% (220.2 -> 223.2).
LONG_SPLIT_TOKENS = (2048, 4096)
LONG_SPLIT_MIN_TOKENS = 16384
LONG_SPLIT_MIN_HEAD_SIZE = 96
LONG_SPLIT_MIN_SM = 90
LONG_SPLIT_MIN_SM_FRACTION = 0.7
LONG_SPLIT_MAX_SLOT_FRACTION = 0.85
LONG_SPLIT_WIDE_FRACTION = 0.95
# Phase 1 is launched as a programmatic dependent of the kernel ahead (dispatch.chains_phase1: a
# back-to-back call's workgroups become resident in the free slots while the previous call
# drains). Where the kernel ahead of the next call allows it at its start (decode_common.cuh:
# start_in_chain in the portable and AMD kernels and the reduce, start_phase1_in_chain in a
# tensor-core phase 1 with next_call_at_start), phase 1 is launched plainly where its grid is one
# wave that fills more than UNCHAINED_FROM_SLOTS and less than UNCHAINED_TO_SLOTS of the resident
# slots. There the free slots hold only part of the next call's grid, and back to back its calls
# ran 2-52% slower chained than launched plainly, the most just past half (H200, eager calls back
# to back, chained -> plain, docs/perf-log.md v50 step 2, µs): GQA 8 17 x 4096 (136 of 264 slots)
# 110.4 -> 73.5, 17 x 8192 217.8 -> 142.9, 20 x 4096 114.7 -> 85.3, 20 x 1024 32.8 -> 26.5,
# 26 x 4096 119.0 -> 106.0, 30 x 4096 (240) 123.5 -> 118.2; bf16, fp8, head 96, MHA and group 16
# alike; head 256 at 20 x 4096 (80 of its 132) 114.5 -> 84.7; head 64's dense form at 40 x 4096
# (320 of 528) 114.3 -> 83.1. At half or less the next grid fits the free slots and chaining gains
# (12 x 1024 18.3 -> 17.0, group 16 33 x 2048 at exactly half 39.0 -> 37.6), and on nearly full
# grids too (32 x 2048, 256 of 264: 68.0 -> 66.8). A tensor-core phase 1 of one partition past
# half its slots allows the next call only once its chunks are done (allow_next_call), and chained
# it beats plain launches on that band too: 17 x 8192 142.8 -> 140.9, 20 x 4096 85.2 -> 83.3,
# 25 x 1024 32.0 -> 30.3 (plain -> chained, docs/perf-log.md v53 step 1).
UNCHAINED_FROM_SLOTS = 0.5
UNCHAINED_TO_SLOTS = 0.95
# Batches at least this full plan as uniform ones, the steps measured on uniform batches (wave
# quantisation, paired partitions) included: a nearly uniform batch's partitions start together.
NEARLY_UNIFORM_FILL = 0.9


@dataclass(frozen=True)
class LaunchPlan:
    variant: object  # a catalogue.DecodeVariant or DecodeMmaVariant
    head_chunks: int       # workgroups per KV head (more query rows than the variant's tile)
    partition_size: int    # tokens per partition
    max_partitions: int    # partitions of the longest possible sequence
    max_query_len: int = 1  # new tokens per sequence the grid covers
    # The partitions of each (sequence, KV head, row chunk) run as one thread-block cluster and
    # merge on chip, with no reduce launch (dispatch.merges_in_cluster).
    cluster_merge: bool = False
    # Every partition, not only a sequence's first, asks for its first block ids before it reads
    # the length (early_ids in kernels/mma/ring.cuh): where the grid is one wave
    # (one_wave) or merges in clusters, an empty workgroup that waits for them delays nobody.
    all_ids_early: bool = False
    # The first wave's workgroups of a multiprocessor start stagger_ns apart, up to stagger_slots
    # of them (first_wave_stagger; 0: at once).
    stagger_slots: int = 0
    stagger_ns: int = 0
    # Phase 1 may launch as a programmatic dependent of the kernel ahead, where the target
    # chains at all (dispatch.chains_phase1; phase1_chains).
    phase1_chained: bool = True
    # A tensor-core phase 1 lets what follows it start at its own start, not after its chunks
    # (next_call_at_start; the kernel's start_phase1_in_chain).
    next_call_at_start: bool = True

    @property
    def single_partition(self) -> bool:
        """One partition covers every sequence: phase 1 writes the output, no reduce pass."""
        return self.max_partitions == 1

    @property
    def reduce_launch(self) -> bool:
        """Whether phase 2 runs as its own launch (the reduce kernel, over global partials)."""
        return not self.single_partition and not self.cluster_merge


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def batch_fill(num_seqs: int, longest: int, total_seq_len: int | None) -> float:
    """How full the batch is: the total of its lengths over num_seqs x the longest, 1 for a
    uniform batch or without a total. The total is clamped to what the batch can hold, from one
    sequence of the longest length to every sequence that long (a sliding window caps the
    longest, so a total past the window's reads counts as full)."""
    if total_seq_len is None or num_seqs <= 0:
        return 1.0
    full = num_seqs * longest
    return min(max(int(total_seq_len), longest), full) / full


def make_plan(shape: DecodeShape, multiprocessors: int, *, arch: str = "",
              partition_size: int | None = None, max_seq_len: int | None = None,
              total_seq_len: int | None = None, max_query_len: int = 1, residency=None,
              trusted=None) -> LaunchPlan:
    """max_seq_len, total_seq_len: hints of the longest length and of the sum of all lengths
    (None: the table's capacity, and every sequence that long).
    max_query_len: the most new tokens of a sequence (1 without query_start_loc).
    residency: variant -> workgroups a multiprocessor holds at once, or None where unknown
    (cupa.gpu.occupancy on the GPU); it decides the wave-quantisation step, skipped without it.
    trusted: variant -> whether it may run here (cupa.selftest.first_use_guard on AMD devices);
    an untrusted AMD matrix-core variant gives way to the portable kernel."""
    rows = shape.group * max_query_len  # query rows per (sequence, KV head)
    variant = dispatch.decode_variant(shape.dtype, shape.head_size, rows, arch, shape.kv_format)
    if trusted is not None and not trusted(variant):
        variant = dispatch.decode_variant(shape.dtype, shape.head_size, rows, arch,
                                          shape.kv_format, matrix_cores=False)
    capacity = shape.capacity
    longest = capacity if max_seq_len is None else max(1, min(int(max_seq_len), capacity))
    if shape.sliding_window:  # only the window's partitions do work
        longest = min(longest, shape.sliding_window)
    fill = batch_fill(shape.num_seqs, longest, total_seq_len)
    if dispatch.runs_as_row_chunks(variant, rows, shape.num_seqs * shape.num_kv_heads,
                            kv_read_bytes(shape, longest, fill), multiprocessors):
        variant = dispatch.decode_variant(shape.dtype, shape.head_size, 8, arch, shape.kv_format)
    head_chunks = -(-rows // variant.rows)
    planned = partition_size is None
    if planned:
        partition_size = _planned_partition_size(shape, variant, rows, head_chunks,
                                                 multiprocessors, arch, longest, fill, residency)
    else:
        partition_size = _forced_partition_size(partition_size, capacity)
    # The dense form of the kernel where the grid has the workgroups for it; its own residency
    # then plans the partitions again, and its rule may still prefer the default form's plan.
    per_seq = shape.num_kv_heads * head_chunks
    heads = shape.num_seqs * per_seq  # (sequence, KV head, row chunk) triples
    busy = busy_workgroups(heads, longest, partition_size, fill)
    # A plan of long sequences split by LONG_SPLIT_TOKENS stays on the default form: the
    # splits were measured there, and neither the dense nor the wide form was.
    long_split = planned and long_partition_splits(shape, variant, arch, head_chunks, longest,
                                                   fill, multiprocessors, residency) > 0
    dense = None if long_split else dispatch.dense_form(variant, busy, multiprocessors, arch)
    if dense is not None:
        dense_size = (_planned_partition_size(shape, dense, rows, head_chunks, multiprocessors,
                                              arch, longest, fill, residency)
                      if planned else partition_size)
        dense_busy = busy_workgroups(heads, longest, dense_size, fill)
        no_longer = dense_grid_no_longer(
            (dense_busy, min(dense_size, longest), resident_per_sm(dense, residency)),
            (busy, min(partition_size, longest), resident_per_sm(variant, residency)),
            multiprocessors)
        if dispatch.dense_plan_kept(dense, dense_busy, multiprocessors, no_longer):
            variant, partition_size = dense, dense_size
    # The wide form where its own plan is one wave of long partitions (or where forced).
    wide = dispatch.wide_form(variant, rows, arch) if head_chunks == 1 else None
    if wide is not None:
        forced = dispatch.switches().wide == "always"
        if forced or (fill >= NEARLY_UNIFORM_FILL and heads <= multiprocessors
                      and longest >= dispatch.WIDE_MIN_PARTITION_TOKENS and not long_split):
            wide_size = (_planned_partition_size(shape, wide, rows, head_chunks, multiprocessors,
                                                 arch, longest, fill, residency)
                         if planned else partition_size)
            grid = heads * -(-capacity // wide_size)
            if forced or (grid <= multiprocessors
                          and min(wide_size, longest) >= dispatch.WIDE_MIN_PARTITION_TOKENS):
                variant, partition_size = wide, wide_size
    max_partitions = -(-capacity // partition_size)
    if max_partitions == 1:
        partition_size = capacity
    if shape.num_seqs > MAX_GRID_YZ:
        raise ValueError(f"query: at most {MAX_GRID_YZ} sequences per call, got {shape.num_seqs}")
    workgroups = heads * max_partitions
    small = _small_launch(shape, variant, partition_size, workgroups, multiprocessors, fill)
    cluster = dispatch.merges_in_cluster(variant, arch, max_partitions, head_chunks,
                                         planned=MAX_CLUSTER if small else dispatch.PLANNED_CLUSTER)
    slots, step = first_wave_stagger(variant, arch, workgroups, multiprocessors, residency, fill,
                                     cluster, max_partitions == -(-longest // partition_size))
    at_start = next_call_at_start(variant, workgroups, multiprocessors, residency,
                                  max_partitions == 1)
    return LaunchPlan(variant=variant, head_chunks=head_chunks, partition_size=partition_size,
                      max_partitions=max_partitions, max_query_len=max_query_len,
                      cluster_merge=cluster,
                      all_ids_early=cluster or one_wave(variant, workgroups, multiprocessors,
                                                        residency),
                      stagger_slots=slots, stagger_ns=step,
                      phase1_chained=phase1_chains(variant, workgroups, multiprocessors,
                                                   residency, at_start),
                      next_call_at_start=at_start)


def busy_workgroups(heads: int, longest: int, partition_size: int, fill: float) -> int:
    """Workgroups with work in a grid of `partition_size`-token partitions over `heads`
    (sequence, KV head, row chunk) triples, fill x of them as long as the longest."""
    return round(fill * heads * -(-longest // partition_size))


def wave_span(workgroups: int, partition_tokens: int, per_sm: int, multiprocessors: int) -> int:
    """How long a grid of `workgroups` busy workgroups of `partition_tokens` tokens runs, in
    tokens a multiprocessor streams: its waves of per_sm workgroups a multiprocessor, rounded
    up, each as long as a partition streamed at 1/per_sm of the multiprocessor's rate."""
    return -(-workgroups // (per_sm * multiprocessors)) * partition_tokens * per_sm


def dense_grid_no_longer(dense: tuple, default: tuple, multiprocessors: int) -> bool:
    """Whether the dense form's grid is no longer than the default form's (see
    dispatch.DENSE_BY_WAVE_SPAN). Each grid is (busy workgroups, tokens a partition,
    workgroups a multiprocessor). Up to one wave of the dense form, and where a residency is
    unknown, it is (v22's rule: its four workgroups a multiprocessor hide what the default
    form's fewer cannot); past that, by wave_span, ties going to the longer partitions."""
    (busy, tokens, per_sm), (default_busy, default_tokens, default_per_sm) = dense, default
    if not per_sm or not default_per_sm or busy <= per_sm * multiprocessors:
        return True
    span = wave_span(busy, tokens, per_sm, multiprocessors)
    default_span = wave_span(default_busy, default_tokens, default_per_sm, multiprocessors)
    return span < default_span or (span == default_span and tokens >= default_tokens)


def resident_per_sm(variant, residency) -> int:
    """Workgroups of `variant` a multiprocessor holds at once, 0 where unknown (no residency)."""
    return (residency(variant) if residency is not None else 0) or 0


def one_wave(variant, workgroups: int, multiprocessors: int, residency) -> bool:
    """Whether a grid of `workgroups` runs as one wave: all resident at once (False where the
    residency is unknown)."""
    return 0 < workgroups <= resident_per_sm(variant, residency) * multiprocessors


def next_call_at_start(variant, workgroups: int, multiprocessors: int, residency,
                       single_partition: bool) -> bool:
    """Whether phase 1 lets what follows it start at its own start: all but a tensor-core grid
    of one partition filling more than UNCHAINED_FROM_SLOTS of its resident slots, which lets
    the next call in once its chunks are done (at the start wherever the residency is
    unknown)."""
    slots = resident_per_sm(variant, residency) * multiprocessors
    return (not isinstance(variant, DecodeMmaVariant) or not single_partition or not slots
            or workgroups <= UNCHAINED_FROM_SLOTS * slots)


def phase1_chains(variant, workgroups: int, multiprocessors: int, residency,
                  next_at_start: bool) -> bool:
    """Whether phase 1 may launch as a dependent of the kernel ahead: always where the kernel
    ahead of the next call lets it in late (not `next_at_start`); otherwise not where its grid
    of `workgroups` is one wave between UNCHAINED_FROM_SLOTS and UNCHAINED_TO_SLOTS of the
    resident slots (chained wherever the residency is unknown)."""
    if not next_at_start:
        return True
    slots = resident_per_sm(variant, residency) * multiprocessors
    return not UNCHAINED_FROM_SLOTS * slots < workgroups < UNCHAINED_TO_SLOTS * slots


def first_wave_stagger(variant, arch: str, workgroups: int, multiprocessors: int, residency,
                       fill: float, cluster: bool, every_partition_busy: bool) -> tuple:
    """(slots, step in ns) of the first wave's stagger (STAGGER_SPREAD_NS), or (0, 0): a uniform
    batch's grid of more than one wave of a tensor-core kernel that holds two or more workgroups
    a multiprocessor, on sm_90, merging by the reduce or in one partition (a cluster's
    workgroups start together by design).
    every_partition_busy: whether the longest sequence has work in every partition of the grid.
    The kernel takes a workgroup's slot from its block id, which counts the partitions that exit
    at once (past the longest length, or before a sliding window) as if they ran: there the
    first wave's busy workgroups would wait for nothing (the window rows of session 29's bench,
    128 partitions of which 16 read, were 4-5% slower)."""
    per_sm = resident_per_sm(variant, residency)
    if (dispatch.switches().stagger == "never" or cluster or fill < NEARLY_UNIFORM_FILL
            or not every_partition_busy
            or not isinstance(variant, DecodeMmaVariant) or sm_number(arch) < STAGGER_MIN_SM
            or per_sm < 2 or one_wave(variant, workgroups, multiprocessors, residency)):
        return 0, 0
    return per_sm, STAGGER_SPREAD_NS // per_sm


def _small_launch(shape: DecodeShape, variant, partition_size: int, workgroups: int,
                  multiprocessors: int, fill: float) -> bool:
    """Whether a launch of `workgroups` workgroups is a small one (SMALL_LAUNCH_MAX_TOKENS),
    whose partitions the planner merges in one cluster rather than by the reduce launch."""
    kv_bytes = 2 * partition_size * shape.head_size * shape.kv_itemsize  # a workgroup's K and V
    return (fill >= NEARLY_UNIFORM_FILL and isinstance(variant, DecodeMmaVariant)
            and variant.rows == 8 and variant.workgroups_per_sm >= 2
            and workgroups <= multiprocessors and partition_size <= SMALL_LAUNCH_MAX_TOKENS
            and kv_bytes <= SMALL_LAUNCH_MAX_BYTES)


def _planned_partition_size(shape: DecodeShape, variant, rows: int, head_chunks: int,
                            multiprocessors: int, arch: str, longest: int, fill: float,
                            residency) -> int:
    """The planner's partition size for `variant` (see make_plan); rows: the query rows of a
    (sequence, KV head)."""
    capacity = shape.capacity
    per_seq = shape.num_kv_heads * head_chunks
    workgroups = shape.num_seqs * per_seq
    # The variant says how short a partition may be (below that the fixed cost of a
    # workgroup outweighs the parallelism) and how many workgroups a multiprocessor should
    # get: long partitions at that density beat shorter ones filling every slot (sweeps in
    # docs/perf-log.md, v4 and v9). Splits are rounded to nearest: a grid just short of the
    # target is not worth a reduce.
    sixteen = isinstance(variant, DecodeMmaVariant) and variant.heads == 16
    one_tile = sixteen and rows <= ONE_TILE_ROWS
    wanted = (1 if one_tile else variant.workgroups_per_sm) * multiprocessors
    splits = _splits(wanted, workgroups, per_seq, fill)
    uniform = fill >= NEARLY_UNIFORM_FILL
    one = multiprocessors // max(workgroups, 1)  # partitions of each, one a multiprocessor
    if one_tile and uniform:  # at most one a multiprocessor (ONE_TILE_ROWS)
        splits = max(1, min(splits, one))
    eight_column = _eight_column_whole_rows(variant, head_chunks)
    if (uniform and splits > one >= 1 and longest <= ONE_A_SM_MAX_TOKENS
            and not shape.sliding_window and eight_column
            and variant.workgroups_per_sm >= 2 and variant.head_size >= ONE_A_SM_MIN_HEAD_SIZE
            and sm_number(arch) >= ONE_A_SM_MIN_SM
            and ONE_A_SM_FRACTION * multiprocessors <= one * workgroups):
        splits = one  # ONE_A_SM_FRACTION
    # Two partitions merged within a cluster (sm_90) beat more partitions and the reduce
    # launch for short one-token launches once two give about one workgroup per
    # multiprocessor: 8 x 4096 (64 x 2 workgroups of 2048 tokens) 50.7 -> 47.8 us. Longer
    # pairs lose bandwidth with half the workgroups (8 x 32768: 258.1 -> 266.9 us), and so
    # does the heavier 16-row kernel (4 new tokens on 8 x 4096: 64.2 -> 70.9 us);
    # docs/perf-log.md v14. Not for row chunks, which read half the bytes of those
    # workgroups and want the parallelism (group 16 at 8 x 4096: 33.8 us in 4 partitions
    # and a reduce, 41.1 us paired; v21).
    if (uniform and splits > 2 and variant.rows == 8 and head_chunks == 1
            and 2 * workgroups >= CLUSTER_PAIR_DENSITY * multiprocessors):
        pair = _split_size(longest, 2, variant)
        if (pair <= CLUSTER_PAIR_MAX_TOKENS and -(-capacity // pair) == 2
                and dispatch.merges_in_cluster(variant, arch, 2)):
            splits = 2
    # More partitions, merged by the reduce, of a few long sequences: one workgroup a
    # multiprocessor (see ONE_PER_SM_DENSITY) where the head size is one measured to gain.
    # H200, GQA 8, before -> after: float16 1 x 32768 51.8 -> 50.4 us (16 partitions of 2048
    # instead of 32 of 1024), 1 x 16384 34.4 -> 32.6; fp8 1 x 32768 35.4 -> 33.6; MHA 1 x 4096
    # 30.9 -> 30.4. Head 64 was level or slower (docs/perf-log.md v23).
    if (uniform and splits > one >= 3 and eight_column
            and variant.head_size in ONE_PER_SM_HEAD_SIZES
            and one * workgroups >= ONE_PER_SM_DENSITY * multiprocessors
            and _split_size(longest, one, variant) <= CLUSTER_PAIR_MAX_TOKENS):
        splits = one
    # Wave quantisation (QUARTER_SPLIT_MAX_WAVES): a grid of one to one and a half waves of
    # resident workgroups runs as two waves. Neither this step nor the split grid's below for
    # the 16-row kernel, whose workgroups cost more to start and finish: group 16 at 96 x 1024
    # (384 workgroups on 264 slots) 84.7 us whole, 93.5 halved; 80 x 1024 82.4 and 89.3;
    # 96 x 2048 135.0 and 138.3 (docs/perf-log.md v23).
    resident = 0 if sixteen else resident_per_sm(variant, residency) * multiprocessors
    if uniform and splits == 1 and resident and resident < workgroups <= 1.5 * resident:
        splits = _over_one_wave_splits(variant, arch, workgroups / resident, longest)
    # Wave quantisation of a split grid: one of one to one and a half waves of resident
    # workgroups takes the most partitions that fit in one wave. 5 x 8192, GQA 8: 7 partitions
    # (280 workgroups on 264 slots) -> 6: float16 66.6 -> 59.5 us, fp8 44.9 -> 39.2 (v23).
    # That may be one, the whole sequence, 2 partitions -> 1 (docs/perf-log.md v48): GQA 8,
    # 17-22 sequences, float16 18 x 16384 361.4 -> 298.8 us, 20 x 4096 110.5 -> 96.2, 20 x
    # 2048 65.2 -> 55.0, 17 x 8192 185.8 -> 151.6, 22 x 16384 395.4 -> 374.6; fp8 20 x 16384
    # 219.4 -> 180.8; MHA 5 x 16384 384.6 -> 328.4. Also where it leaves multiprocessors
    # idle, the forms of one workgroup a multiprocessor at 9-11 sequences: head 256's deep
    # form 10 x 16384 389.2 -> 319.2, 9 x 8192 194.3 -> 151.6, 11 x 4096 114.6 -> 99.7; the
    # wide form's plan, then one partition (planner step 9): 9 x 16384 161.9 -> 155.1,
    # 10 x 8192 96.5 -> 93.6, fp8 11 x 8192 62.2 -> 59.5.
    partitions = -(-longest // _split_size(longest, splits, variant))
    if (uniform and splits > 1 and resident < partitions * workgroups <= 1.5 * resident
            and workgroups <= resident):
        splits = resident // workgroups
    long_splits = long_partition_splits(shape, variant, arch, head_chunks, longest, fill,
                                        multiprocessors, residency)
    if long_splits:
        splits = long_splits  # LONG_SPLIT_TOKENS
    if splits == 1:
        return capacity
    # Fewer, longer partitions when the grid would exceed its y limit (very long caches).
    return max(_split_size(longest, splits, variant), -(-capacity // MAX_GRID_YZ))


def long_partition_splits(shape: DecodeShape, variant, arch: str, head_chunks: int,
                          longest: int, fill: float, multiprocessors: int, residency) -> int:
    """Partitions of the longest sequence by LONG_SPLIT_TOKENS on `variant`, or 0 where that
    rule does not apply."""
    per_sm = resident_per_sm(variant, residency)
    slots = per_sm * multiprocessors
    workgroups = shape.num_seqs * shape.num_kv_heads * head_chunks  # a partition's
    if not (fill >= NEARLY_UNIFORM_FILL and not shape.sliding_window and per_sm >= 2
            and dispatch.plain_form(variant) and _eight_column_whole_rows(variant, head_chunks)
            and variant.head_size >= LONG_SPLIT_MIN_HEAD_SIZE
            and sm_number(arch) >= LONG_SPLIT_MIN_SM and longest >= LONG_SPLIT_MIN_TOKENS
            and LONG_SPLIT_MIN_SM_FRACTION * multiprocessors <= workgroups
            <= LONG_SPLIT_MAX_SLOT_FRACTION * slots
            and not LONG_SPLIT_WIDE_FRACTION * multiprocessors <= workgroups <= multiprocessors):
        return 0

    def last_wave(splits: int) -> int:  # resident workgroups of the grid's last wave
        return (workgroups * splits - 1) % slots + 1
    # Fewest splits first: max keeps the first of equals, so ties go to the longer partitions.
    candidates = sorted(-(-longest // tokens) for tokens in LONG_SPLIT_TOKENS)
    return max(candidates, key=last_wave)


def _eight_column_whole_rows(variant, head_chunks: int) -> bool:
    """Whether `variant` is the 8-column tensor-core kernel (any form) holding all of a KV
    head's query rows in one workgroup (no row chunks)."""
    return isinstance(variant, DecodeMmaVariant) and variant.rows == 8 and head_chunks == 1


def _over_one_wave_splits(variant, arch: str, waves: float, longest: int) -> int:
    """Partitions of a uniform grid of `waves` (1 to 1.5) waves whole (QUARTER_SPLIT_MAX_WAVES).
    The forms that have a dense form (fp8 e4m3 at head 128, a 16-bit cache at head 64), the
    dense forms themselves and heads below QUARTER_SPLIT_MIN_HEAD_SIZE keep v23's halves: the
    dense forms' rules take the grids they serve from those halves (dispatch.
    DENSE_UP_TO_WORKGROUPS_PER_SM, DENSE_BY_WAVE_SPAN), fp8's dense form 2.5-15% faster than
    the halves (v47) and 2.5-13% faster than the quarters (v49)."""
    if (getattr(variant, "dense", False) or dispatch.dense_variant(variant, arch) is not None
            or variant.head_size < QUARTER_SPLIT_MIN_HEAD_SIZE):
        return 2
    if longest <= WHOLE_TOKENS or (longest <= WHOLE_LATE_TOKENS
                                   and waves > WHOLE_LATE_FROM_WAVES):
        return 1
    return 4 if waves <= QUARTER_SPLIT_MAX_WAVES else 2


def _split_size(longest: int, splits: int, variant) -> int:
    """Tokens per partition for `splits` partitions of the longest sequence: a multiple of the
    variant's shortest partition."""
    return max(variant.min_partition, _round_up(-(-longest // splits), variant.min_partition))


def _forced_partition_size(partition_size, capacity: int) -> int:
    """A caller's partition size, checked."""
    partition_size = int(partition_size)
    if partition_size < 1:
        raise ValueError(f"partition_size: must be >= 1, got {partition_size}")
    if -(-capacity // partition_size) > MAX_GRID_YZ:
        raise ValueError(f"partition_size: {partition_size} gives more than {MAX_GRID_YZ} "
                         f"partitions for capacity {capacity}; use at least "
                         f"{-(-capacity // MAX_GRID_YZ)}")
    return partition_size


def kv_read_bytes(shape: DecodeShape, longest: int, fill: float) -> int:
    """The K/V bytes a launch reads, from the longest length and the batch's fill."""
    tokens = round(fill * shape.num_seqs * longest)
    return 2 * tokens * shape.num_kv_heads * shape.head_size * shape.kv_itemsize


def _splits(wanted: int, workgroups: int, per_seq: int, fill: float) -> int:
    """Partitions of the longest sequence. The uniform rule: enough for `wanted` workgroups,
    counting those of fill x num_seqs sequences of the longest length (the others' partitions
    past their ends exit at once). A ragged batch (fill < 1) gets up to RAGGED_TAIL_SPLITS times
    that, the more the emptier it is (so a nearly uniform batch plans nearly as a uniform one),
    its longest sequence split no finer than alone (in a batch of one), into a grid of at most
    RAGGED_MAX_GRID_WAVES waves. workgroups: the grid's per partition; per_seq: a sequence's."""
    busy = fill * workgroups
    tail = 1 + (RAGGED_TAIL_SPLITS - 1) * (1 - fill)
    splits = max(1, round(tail * wanted / max(busy, 1)))
    if fill < 1:
        alone = round(wanted / per_seq)
        grid_bound = RAGGED_MAX_GRID_WAVES * wanted // max(workgroups, 1)
        splits = max(1, min(splits, alone, grid_bound))
    return splits
