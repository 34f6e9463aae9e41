"""Planning a decode launch: row chunks, partition size and grid.

The plan depends only on shapes (and an optional length hint), never on array contents, so it
needs no device synchronisation. Partitions past a sequence's length exit at once, which is why a
length hint only tunes speed and can never make a result wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..problem import MAX_GRID_YZ, DecodeShape
from . import dispatch

# Two partitions merged within clusters are planned instead of more partitions and the reduce
# launch from this many workgroups per multiprocessor (measured at 0.97), for partitions of at
# most CLUSTER_PAIR_MAX_TOKENS (measured at 2048: faster; at 16384: slower).
CLUSTER_PAIR_DENSITY = 0.9
CLUSTER_PAIR_MAX_TOKENS = 4096


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


def make_plan(shape: DecodeShape, multiprocessors: int, *, arch: str = "",
              partition_size: int | None = None, max_seq_len: int | None = None,
              max_query_len: int = 1, residency=None, trusted=None) -> LaunchPlan:
    """max_query_len: the most new tokens of a sequence (1 without query_start_loc).
    residency: variant -> workgroups a multiprocessor holds at once, or None where unknown
    (cupa.gpu.occupancy on the GPU); it decides the wave-quantisation step, skipped without it.
    trusted: variant -> whether it may run here (cupa.selftest.first_use_guard on AMD devices);
    an untrusted AMD matrix-core variant gives way to the portable kernel."""
    rows = shape.group * max_query_len  # query rows per (sequence, KV head)
    variant = dispatch.decode_variant(shape.dtype, shape.head_size, rows, arch, shape.kv_format)
    if trusted is not None and not trusted(variant):
        variant = dispatch.decode_variant(shape.dtype, shape.head_size, rows, arch,
                                          shape.kv_format, matrix_cores=False)
    head_chunks = -(-rows // variant.rows)
    capacity = shape.capacity
    if partition_size is None:
        longest = capacity if max_seq_len is None else max(1, min(int(max_seq_len), capacity))
        if shape.sliding_window:  # only the window's partitions do work
            longest = min(longest, shape.sliding_window)
        workgroups = shape.num_seqs * shape.num_kv_heads * head_chunks
        # The variant says how short a partition may be (below that the fixed cost of a
        # workgroup outweighs the parallelism) and how many workgroups a multiprocessor should
        # get: long partitions at that density beat shorter ones filling every slot (sweeps in
        # docs/perf-log.md, v4 and v9). Splits are rounded to nearest: a grid just short of the
        # target is not worth a reduce.
        wanted = variant.workgroups_per_sm * multiprocessors
        splits = max(1, round(wanted / max(workgroups, 1)))
        # Wave quantisation: a grid of one to one and a half waves of resident workgroups runs as
        # two full waves; halved partitions make it three half-length waves.
        per_sm = residency(variant) if residency is not None else None
        resident = (per_sm or 0) * multiprocessors
        if splits == 1 and resident and resident < workgroups <= 1.5 * resident:
            splits = 2
        # Two partitions merged within a cluster (sm_90) beat more partitions and the reduce
        # launch for short one-token launches once two give about one workgroup per
        # multiprocessor: 8 x 4096 (64 x 2 workgroups of 2048 tokens) 50.7 -> 47.8 us. Longer
        # pairs lose bandwidth with half the workgroups (8 x 32768: 258.1 -> 266.9 us), and so
        # does the heavier 16-row kernel (4 new tokens on 8 x 4096: 64.2 -> 70.9 us);
        # docs/perf-log.md v14.
        if (splits > 2 and variant.rows == 8
                and 2 * workgroups >= CLUSTER_PAIR_DENSITY * multiprocessors):
            pair = _round_up(-(-longest // 2), variant.min_partition)
            if (pair <= CLUSTER_PAIR_MAX_TOKENS and -(-capacity // pair) == 2
                    and dispatch.merges_in_cluster(variant, arch, 2)):
                splits = 2
        if splits == 1:
            partition_size = capacity
        else:
            partition_size = max(variant.min_partition,
                                 _round_up(-(-longest // splits), variant.min_partition))
            # Fewer, longer partitions when the grid would exceed its y limit (very long caches).
            partition_size = max(partition_size, -(-capacity // MAX_GRID_YZ))
    else:
        partition_size = int(partition_size)
        if partition_size < 1:
            raise ValueError(f"partition_size: must be >= 1, got {partition_size}")
        if -(-capacity // partition_size) > MAX_GRID_YZ:
            raise ValueError(f"partition_size: {partition_size} gives more than {MAX_GRID_YZ} "
                             f"partitions for capacity {capacity}; use at least "
                             f"{-(-capacity // MAX_GRID_YZ)}")
    max_partitions = -(-capacity // partition_size)
    if max_partitions == 1:
        partition_size = capacity
    if shape.num_seqs > MAX_GRID_YZ:
        raise ValueError(f"query: at most {MAX_GRID_YZ} sequences per call, got {shape.num_seqs}")
    return LaunchPlan(variant=variant, head_chunks=head_chunks, partition_size=partition_size,
                      max_partitions=max_partitions, max_query_len=max_query_len,
                      cluster_merge=dispatch.merges_in_cluster(variant, arch, max_partitions))
