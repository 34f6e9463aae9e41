"""Dispatch policy: which kernel variant serves a problem on a target, and how its partitions
are merged and chained. The catalogue (`cupa.gpu.catalogue`) says what exists; this says when
each is used.

The environment switches (CUPA_KERNEL, CUPA_MERGE, CUPA_ROW_CHUNKS, CUPA_DENSE, CUPA_WIDE,
CUPA_DEEP, CUPA_STAGGER, CUPA_STAGED_HEADS, CUPA_CHAINED_REDUCE, CUPA_CHAINED_PHASE1) are for
tests and benchmarks. They are read once, at first use; code that changes them within a process
calls `reload_switches()` afterwards, or sets them with `set_switches()` (plans made before keep
what they were made with).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, replace

from .catalogue import (DEEP_KINDS, DEEP_MIN_SM, DENSE_KINDS, FP8_AMD_NATIVE, FP8_CACHE,
                        FP8_E4M3_NATIVE, MATRIX_DTYPES, MATRIX_HEAD_SIZES, MAX_CLUSTER,
                        MMA_DTYPES, MMA_HEAD_SIZES, MMA_STAGED_HEAD_SIZES,
                        NVIDIA_ONLY_FAMILIES, WIDE_HEAD_SIZES,
                        WIDE_MIN_SM, DecodeMatrixVariant, DecodeMmaVariant, DecodeVariant,
                        amd_native_fp8, head_tile, matrix_core_family, matrix_tiles,
                        shared_opt_in_bytes, sm_number)

MMA_MIN_SM = NVIDIA_ONLY_FAMILIES["decode_mma"]
# Query heads per KV head from which the tensor-core kernels are used. Even plain MHA (one head
# in an 8-column tile) leaves the tensor cores far from busy, so this is 1 unless the bench says
# otherwise.
MMA_MIN_GROUP = 1
NATIVE_FP8_MIN_SM = 89  # cvt e4m3x2 (hardware fp8 widening)
# From sm_90 the reduce is launched as a programmatic dependent of phase 1 (cupa.gpu.driver;
# griddepcontrol in the kernels), so its launch overlaps phase 1's last wave.
CHAINED_REDUCE_MIN_SM = 90
# ... and phase 1 as a programmatic dependent of the kernel ahead of it: where that kernel allows
# it early (a previous call's reduce or phase 1), phase 1's workgroups become resident while it
# drains and wait for it before they read anything, so back-to-back calls lose no launch gap
# between them (docs/perf-log.md v25 step 5). A kernel that does not allow it (a user's, the
# bench's L2 flush) starts it when it ends, as without the attribute.
CHAINED_PHASE1_MIN_SM = 90
# CUPA_CHAINED_PHASE1: 1 (where the plan allows it: planner.phase1_chains), 0 (never: ordinary
# phase-1 launches) or always (wherever the target chains, whatever the plan says).
CHAINED_PHASE1_FORMS = ("1", "0", "always")
# From sm_90 the partitions of a (sequence, KV head) may run as one thread-block cluster and
# merge through distributed shared memory instead of a reduce launch (merge_cluster in
# decode_mma.cu), for the tensor-core kernels and up to MAX_CLUSTER partitions. The planner uses
# clusters of 2 (16 x 16384: 263.0 -> 257.6 us), and up to MAX_CLUSTER for small launches
# (planner.SMALL_LAUNCH_*), where a call's host time exceeds its GPU time and the reduce is a
# second launch to enqueue. Larger clusters elsewhere measured level or slower: clusters of 4 at
# 8 x 4096 50.5 -> 69.4 us, since only 62 such clusters (248 blocks) are resident at once on the
# H200 against 264 blocks without clusters, so 64 of them took two waves (docs/perf-log.md v14).
CLUSTER_MERGE_MIN_SM = 90
PLANNED_CLUSTER = 2  # the largest cluster the planner chooses, outside small launches
# More than 8 query rows on a small problem run as row chunks of the 8-column kernel (8 rows a
# workgroup) instead of the 16-row kernel: more workgroups, each with a shorter matrix and softmax
# chain, but each K/V byte crosses from L2 to the multiprocessors once per chunk (the chunks of a
# KV head sit side by side in the grid, so DRAM still serves it once). That pays while the
# launch is latency-bound: the sequences' KV heads alone leave multiprocessors idle (the 16-row
# plan splits sequences into partitions) and the chunks' reads together stay within
# ROW_CHUNKS_MAX_BYTES_PER_SM. H200 (docs/perf-log.md v21), chunks x K/V bytes per multiprocessor:
#   up to 1 MB always faster: group 16 at 1 x 4096 22.1 -> 15.9 us, 1 x 32768 43.9 -> 35.8; fp8
#   1 x 4096 24.4 -> 14.4; 64 rows (MQA) 1 x 4096 34.9 -> 15.7;
#   2 MB mixed (group 16 32 x 2048 54.2 -> 48.5, 16 x 4096 56.6 -> 60.0; MQA 32 x 2048 level);
#   4 MB slower (group 16 16 x 8192 87.6 -> 110.1; MQA 128 x 1024 56.5 -> 96.8): the L2 traffic.
# Since v24 (the 16-row kernel's faster prologue and merge, and its plan of one workgroup a
# multiprocessor, planner.ONE_TILE_ROWS) for two chunks of an fp8 cache: fp8 group 16, row
# chunks against the 16-row kernel, 32 x 2048 (1 MB) 32.1 against 33.2 us, 8 x 4096 (0.5 MB)
# 23.5 against 24.4; 2 MB level (32 x 4096). v23's 2 MB for two chunks at head 128 is gone.
# (More chunks, as MQA's 8, were not measured again.)
ROW_CHUNKS_MAX_BYTES_PER_SM = 1 << 20
# Two chunks (9-16 rows, the one-tile 16-row kernel's launches) of a 16-bit cache, by head size
# (that kernel holds 2 workgroups a multiprocessor at head 128, 3 at head 64). Group 16, row
# chunks -> 16-row (v24): at head 128, 0.76-1 MB slower for row chunks where the batch has many
# sequences (12 x 2048 30.3 -> 27.6 us, 16 x 2048 34.0 -> 31.7, 6 x 4096 30.5 -> 28.5) and level
# with few (1 x 32768 35.1 -> 34.8, 8 x 4096 33.4 -> 33.7, 3 x 8192 28.1 -> 27.9), 2 MB slower
# (8 x 8192 52.3 -> 50.8, 16 x 4096 53.2 -> 50.4; group 4 x 4 new tokens at 8 x 4096 56.4 ->
# 53.3), 0.5 MB level (8 x 2048 22.4 both, 2 x 8192 22.5 -> 22.7) to faster (1 x 16384 23.8
# against 24.3, 1 x 4096 at 0.13 MB 14.8 against 15.3); at head 64, 0.5 MB slower (1 x 32768
# 25.1 -> 23.9, 8 x 4096 23.6 -> 22.0, 32 x 2048 34.5 -> 31.0, 16 x 4096 38.0 -> 32.2), 0.06 MB
# faster (1 x 4096 12.7 against 13.1). Above head 128 (v40: one tile, one workgroup a
# multiprocessor) the general limit holds: at 16.8 MB, 1 x 4096 is faster as row chunks (head
# 256 18.0 against 19.4 us, 192 16.7 against 17.8), at 134 MB 1 x 32768 and 8 x 4096 slower
# (55.1 against 53.6, 54.4 against 52.5 at head 256).
ROW_CHUNKS_TWO_16BIT_MAX_BYTES_PER_SM = {128: 1 << 19, 64: 1 << 17}
KERNEL_FORMS = ("auto", "portable")  # CUPA_KERNEL; portable: never tensor or matrix cores
MERGE_FORMS = ("auto", "cluster", "reduce")
# CUPA_ROW_CHUNKS, where the 16-row kernel serves: auto (the rule above), always (8-row chunks of
# the 8-column kernel), never (the 16-row kernel).
ROW_CHUNK_FORMS = ("auto", "always", "never")
# The dense form of the 8-column kernel (catalogue.DENSE_RING: 4 workgroups a multiprocessor, 3
# ring stages) where it exists (catalogue.DENSE_KINDS), on sm_90, for grids of at least this
# many busy workgroups per multiprocessor. H200 (docs/perf-log.md v22), planner's choice,
# default -> dense form:
#   head 64, float16: 64 x 4096 146.5 -> 135.7 us (one wave of 512 workgroups instead of two),
#   64 x 1024 54.6 -> 46.4, 128 x 1024 81.9 -> 78.9, 4 x 32768 80.5 -> 79.2, 256 x 2048 259.3 ->
#   257.9, 16 x 16384 137.4 -> 136.5, 32 x 2048 46.3 -> 45.5, 1 x 32768 level; 128 workgroups,
#   one a multiprocessor, need the deeper ring: 8 x 4096 31.2 -> 34.4 us;
#   fp8 e4m3 at head 128 (the dense form has 64-token chunks, the default 128), then: 128 x 1024
#   87.2 -> 83.7 us, 256 x 2048 271.9 -> 265.3, 64 x 4096 141.1 -> 139.9 (3.9 workgroups a
#   multiprocessor); 16 x 16384 139.8 -> 140.5 and 1 x 32768 level (1.9); 8 x 4096 31.1 -> 36.0
#   (v47 found the first three reversed or level: see the bound below).
DENSE_MIN_SM = 90
DENSE_FROM_WORKGROUPS_PER_SM = {(None, 64): 1, (FP8_E4M3_NATIVE, 128): 3}
# ... and for fp8 at head 128 only while the dense form's own plan has at most this many busy
# workgroups a multiprocessor: where the default form (2 a multiprocessor) would split a grid of
# 1-1.5 waves into twice the partitions (planner's wave quantisation) and the dense form runs it
# whole in one wave. Since v45-v47 the default form is level or faster on the other grids
# measured (64 x 2048, 1.94 waves, 0.6% behind: level within the runs' spread). H200, fp8
# e4m3, dense -> default form (docs/perf-log.md v47 step 2): in the window 36 x 4096 87.1 ->
# 99.6 us, 40 x 4096 94.1 -> 105.4, 48 x 4096 108.5 -> 116.0, 40 x 2048 54.5 -> 64.1,
# 48 x 8192 196.1 -> 201.2; past it 52 x 4096 124.0 -> 119.0, 56 x 4096 127.7 -> 125.6,
# 64 x 4096 139.4 -> 139.1, 72 x 2048 104.8 -> 93.7, 128 x 1024 82.2 -> 79.7, 256 x 2048 268.6
# -> 263.3.
DENSE_UP_TO_WORKGROUPS_PER_SM = {(FP8_E4M3_NATIVE, 128): 3}
# ... and for these kinds, on a grid of more than one wave of the dense form, only where that
# grid is no longer than the default form's by planner.wave_span (ties: where the dense plan's
# partitions are no shorter). The default form's fewer or fuller waves win where the dense
# plan splits partitions the default plan keeps whole, or leaves its last wave nearly empty.
# H200, GQA 8, head 64, float16, dense -> default form (docs/perf-log.md v48):
#   the dense plan split, the default not: 80 x 2048 99.3 -> 93.6 us, 96 x 2048 111.1 -> 106.6,
#   88 x 1024 63.7 -> 58.9, 76 x 2048 95.7 -> 88.7, 96 x 512 43.7 -> 38.2, 96 x 4096 197.8 ->
#   194.7, 80 x 8192 330.7 -> 330.9 (read flush 325.4 -> 319.1); bf16 96 x 2048 110.8 -> 106.9;
#   equal partitions, the dense grid's last wave 6-18% full: 72 x 2048 94.1 -> 90.6, 144 x 1024
#   87.6 -> 84.9, 140 x 2048 153.6 -> 148.8, 68 x 2048 88.4 -> 87.1, 72 x 1024 57.7 -> 57.1,
#   136 x 1024 81.6 -> 81.7;
#   the dense form kept: 132 x 1024 77.7 -> 79.6, 160 x 1024 91.9 -> 94.1, 112 x 2048 123.0 ->
#   126.6, 120 x 2048 130.3 -> 132.1, 192 x 1024 106.6 -> 107.6, 264 x 1024 139.7 -> 141.9,
#   100 x 2048 111.2 -> 111.5; its one miss: 200 x 2048 201.4 -> 202.7 (spans 16 and 15).
DENSE_BY_WAVE_SPAN = frozenset({(None, 64)})
# CUPA_DENSE: auto (the rule above), always (wherever the dense form exists) or never.
DENSE_FORMS = ("auto", "always", "never")
# The wide form of the tensor-core kernels (catalogue.WIDE_RING: 8 warps, one workgroup a
# multiprocessor, 3 stages of 128-token chunks) for query rows that fit one tile of 16, where
# the planner's partitions for it are long and its grid is one wave (planner.make_plan).
# H200, planner's choice, default -> wide form, in us (docs/perf-log.md v36):
#   partitions of 8192 or more: GQA 8 16 x 16384 258.0 -> 256.0 (one partition of 16384
#   instead of cluster pairs of 8192), 4 x 32768 142.0 -> 140.4 (8192 x 4 instead of 4096 x 8);
#   fp8 16 x 16384 141.7 -> 139.9; group 16 16 x 16384 143.7 -> 140.0 (pairs of 8192 both);
#   bf16 16 x 16384 257.8 -> 256.1;
#   shorter ones lose: group 16 8 x 16384 (4096 x 4) 82.4 -> 83.1, fp8 8 x 4096 (2048 x 2)
#   31.1 -> 32.0, GQA 8 1 x 4096 16.4 -> 17.2; 1 x 32768 (2048 x 16) level; grids of more
#   than one wave a lot: GQA 8 32 x 2048 76.7 -> 80.2, group 16 128 x 1024 81.2 -> 91.9.
WIDE_MIN_PARTITION_TOKENS = 8192
# CUPA_WIDE: auto (the rule above), always (wherever the wide form exists) or never.
WIDE_FORMS = ("auto", "always", "never")
# CUPA_DEEP: auto (the deep form wherever it exists: catalogue.DEEP_RING) or never (KvRing's
# 2-stage ring, sm_80's, which the GPU tests run on sm_90 this way).
DEEP_FORMS = ("auto", "never")
# CUPA_STAGGER: auto (planner.first_wave_stagger) or never.
STAGGER_FORMS = ("auto", "never")
# CUPA_STAGED_HEADS: whether the tensor-core kernels serve the head sizes between 64, 128 and 256
# (catalogue.MMA_STAGED_HEAD_SIZES: 80, 96, 112, 192), their rows staged at the next of those:
# auto (they do) or never (the portable kernel). Measured on the H200 (docs/perf-log.md v38,
# tools/ab_switch.py, GPU time at 1 x 4096 .. 16 x 16384): the portable kernel's time over theirs
# is 2.6-5.8x at GQA 8 heads 96 and 112, 2.2-4.6x at head 80, 2.8-7.7x at head 192, 4.1-6.0x
# with an fp8 cache at head 96 and 1.30-1.47x at MHA head 80: never loses.
STAGED_HEAD_FORMS = ("auto", "never")


# Compared and hashed by identity (eq=False): switches() returns one object until
# reload_switches(), and cupa.decode's plan cache keys on it, which a field-wise hash would cost
# a third of a microsecond on every call.
@dataclass(frozen=True, eq=False)
class Switches:
    kernel: str = "auto"          # CUPA_KERNEL: auto, or portable (no tensor / matrix cores)
    merge: str = "auto"           # CUPA_MERGE: auto, cluster (wherever possible) or reduce
    row_chunks: str = "auto"      # CUPA_ROW_CHUNKS: auto, always or never (ROW_CHUNK_FORMS)
    dense: str = "auto"           # CUPA_DENSE: auto, always or never (DENSE_FORMS)
    wide: str = "auto"            # CUPA_WIDE: auto, always or never (WIDE_FORMS)
    deep: str = "auto"            # CUPA_DEEP: auto or never (DEEP_FORMS)
    stagger: str = "auto"         # CUPA_STAGGER: auto or never (STAGGER_FORMS)
    staged_heads: str = "auto"    # CUPA_STAGED_HEADS: auto or never (STAGED_HEAD_FORMS)
    chained_reduce: bool = True   # CUPA_CHAINED_REDUCE=0: ordinary reduce launches
    chained_phase1: str = "1"     # CUPA_CHAINED_PHASE1: 1, 0 or always (CHAINED_PHASE1_FORMS)


def _form(name: str, forms: tuple) -> str:
    """The environment variable `name`, one of `forms` (the first when unset)."""
    value = os.environ.get(name, forms[0])
    if value not in forms:
        raise ValueError(f"{name}: one of {forms}, got {value!r}")
    return value


@functools.lru_cache(maxsize=1)
def switches() -> Switches:
    """The environment switches, read once (see the module docstring)."""
    return Switches(kernel=_form("CUPA_KERNEL", KERNEL_FORMS),
                    merge=_form("CUPA_MERGE", MERGE_FORMS),
                    row_chunks=_form("CUPA_ROW_CHUNKS", ROW_CHUNK_FORMS),
                    dense=_form("CUPA_DENSE", DENSE_FORMS),
                    wide=_form("CUPA_WIDE", WIDE_FORMS),
                    deep=_form("CUPA_DEEP", DEEP_FORMS),
                    stagger=_form("CUPA_STAGGER", STAGGER_FORMS),
                    staged_heads=_form("CUPA_STAGED_HEADS", STAGED_HEAD_FORMS),
                    chained_reduce=os.environ.get("CUPA_CHAINED_REDUCE", "1") != "0",
                    chained_phase1=_form("CUPA_CHAINED_PHASE1", CHAINED_PHASE1_FORMS))


def reload_switches() -> None:
    """Read the environment switches again at their next use."""
    switches.cache_clear()


def set_switches(values: dict) -> None:
    """Set the CUPA_* environment switches in `values` in this process (None unsets one) and
    have them read again at their next use (tests and A/B tools)."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    reload_switches()


@contextlib.contextmanager
def switches_set(values: dict):
    """set_switches(values) for a block, and the switches as they were after it. No values:
    nothing is read again (a new switches() object would make cupa.decode's cached plans miss
    once)."""
    saved = {name: os.environ.get(name) for name in values}
    if values:
        set_switches(values)
    try:
        yield
    finally:
        if values:
            set_switches(saved)


def mma_eligible(dtype: str, head_size: int, rows: int, arch: str) -> bool:
    """Whether the tensor-core kernel serves this problem (`rows` query rows per KV head) on
    this target by dtype, head size and rows; decode_variant also needs the variant's ring to
    fit the target's shared memory (fits_shared_memory)."""
    chosen = switches()
    if chosen.kernel == "portable" or sm_number(arch) < MMA_MIN_SM:
        return False
    staged = chosen.staged_heads == "auto" and head_size in MMA_STAGED_HEAD_SIZES
    return (dtype in MMA_DTYPES and (head_size in MMA_HEAD_SIZES or staged)
            and rows >= MMA_MIN_GROUP)


def matrix_eligible(dtype: str, head_size: int, arch: str) -> bool:
    """Whether the AMD matrix-core kernel serves this problem on this target (any number of
    query rows: more than its tile are chunked across the grid)."""
    return (switches().kernel != "portable" and matrix_core_family(arch) is not None
            and dtype in MATRIX_DTYPES and head_size in MATRIX_HEAD_SIZES)


def chains_reduce(arch: str) -> bool:
    """Whether the reduce on `arch` is launched as a programmatic dependent of phase 1."""
    return switches().chained_reduce and sm_number(arch) >= CHAINED_REDUCE_MIN_SM


def chains_phase1(arch: str, plan_allows: bool = True) -> bool:
    """Whether phase 1 on `arch` is launched as a programmatic dependent of the kernel ahead of
    it (see CHAINED_PHASE1_MIN_SM), for a plan that does or does not allow it
    (planner.phase1_chains; CHAINED_PHASE1_FORMS)."""
    form = switches().chained_phase1
    return (form != "0" and sm_number(arch) >= CHAINED_PHASE1_MIN_SM
            and (plan_allows or form == "always"))


def merges_in_cluster(variant, arch: str, max_partitions: int, head_chunks: int = 1,
                      planned: int = PLANNED_CLUSTER) -> bool:
    """Whether a launch of `variant` with `max_partitions` partitions (and `head_chunks` row
    chunks per KV head) merges them within clusters: the planner's rule (auto: clusters of up to
    `planned`, the planner's largest for this launch), wherever the kernel can up to MAX_CLUSTER
    (cluster) or never (reduce). The planner's rule leaves row chunks to the reduce: group 16 at
    8 x 4096 41.1 us in pairs against 33.8 in 4 partitions (docs/perf-log.md v21), 16 x 4096 in
    2 partitions 55.8 against 54.0 (v23), 1 x 4096 in one cluster of 16 15.4 against 14.8
    (v27)."""
    planned = planned if head_chunks == 1 else 1
    largest = {"auto": planned, "cluster": MAX_CLUSTER, "reduce": 1}[switches().merge]
    if getattr(variant, "wide", False):  # a workgroup a multiprocessor: only the planned pairs
        largest = min(largest, PLANNED_CLUSTER)
    return (isinstance(variant, DecodeMmaVariant) and sm_number(arch) >= CLUSTER_MERGE_MIN_SM
            and 1 < max_partitions <= largest)


def runs_as_row_chunks(variant, rows: int, seq_kv_heads: int, kv_bytes: int,
                       multiprocessors: int) -> bool:
    """Whether a problem the 16-row tensor-core kernel would serve runs as row chunks of the
    8-column kernel instead (see ROW_CHUNKS_MAX_BYTES_PER_SM). seq_kv_heads: sequences x KV
    heads; kv_bytes: the K/V bytes the launch reads (an estimate from the length hints)."""
    if not (isinstance(variant, DecodeMmaVariant) and variant.heads == 16):
        return False
    form = switches().row_chunks
    if form != "auto":
        return form == "always"
    chunks = -(-rows // 8)
    wanted = variant.workgroups_per_sm * multiprocessors
    if seq_kv_heads >= wanted:
        return False
    limit = ROW_CHUNKS_MAX_BYTES_PER_SM
    if chunks == 2 and not variant.cache:
        limit = ROW_CHUNKS_TWO_16BIT_MAX_BYTES_PER_SM.get(variant.head_size, limit)
    return chunks * kv_bytes <= limit * multiprocessors


def fits_shared_memory(variant, arch: str) -> bool:
    """Whether a workgroup of `variant` gets its dynamic shared memory on this target
    (catalogue.SHARED_OPT_IN_BYTES; the kernels with more than the default 48 KB are NVIDIA's)."""
    return getattr(variant, "shared_bytes", 0) <= shared_opt_in_bytes(arch)


def form_that_fits(variant, arch: str, **form):
    """replace(variant, **form) (dense=True, ...) if its workgroup gets its shared memory on
    this target, else None."""
    formed = replace(variant, **form)
    return formed if fits_shared_memory(formed, arch) else None


def plain_form(variant) -> bool:
    """Whether `variant` is a tensor-core variant in none of its forms (dense, wide, deep)."""
    return (isinstance(variant, DecodeMmaVariant)
            and not (variant.dense or variant.wide or variant.deep))


def dense_variant(variant, arch: str):
    """The dense form of `variant` if it exists on this target (an 8-column variant of
    DENSE_KINDS, from DENSE_MIN_SM), whatever the switches say, else None."""
    if not (plain_form(variant) and variant.heads == 8 and sm_number(arch) >= DENSE_MIN_SM
            and (variant.cache, variant.head_size) in DENSE_KINDS):
        return None
    return form_that_fits(variant, arch, dense=True)


def dense_form(variant, workgroups: int, multiprocessors: int, arch: str):
    """The dense form of `variant` if a launch of `workgroups` busy workgroups on this target
    runs on it (see DENSE_FROM_WORKGROUPS_PER_SM), else None."""
    dense, form = dense_variant(variant, arch), switches().dense
    if dense is None or form == "never":
        return None
    per_sm = DENSE_FROM_WORKGROUPS_PER_SM[(variant.cache, variant.head_size)]
    return dense if form == "always" or workgroups >= per_sm * multiprocessors else None


def dense_plan_kept(dense, workgroups: int, multiprocessors: int, no_longer: bool) -> bool:
    """Whether a launch stays on the dense form `dense` (from dense_form) once the form's own
    plan has `workgroups` busy workgroups (DENSE_UP_TO_WORKGROUPS_PER_SM) and its grid is or is
    not `no_longer` than the default form's (asked of DENSE_BY_WAVE_SPAN's kinds); always where
    the switch says so."""
    kind = (dense.cache, dense.head_size)
    most = DENSE_UP_TO_WORKGROUPS_PER_SM.get(kind)
    return switches().dense == "always" or (
        (most is None or workgroups <= most * multiprocessors)
        and (no_longer or kind not in DENSE_BY_WAVE_SPAN))


def wide_variant(variant, rows: int, arch: str):
    """The wide form of `variant` for `rows` query rows per KV head if it exists on this target
    (WIDE_HEAD_SIZES, up to one tile of 16 rows, from WIDE_MIN_SM), whatever the switches say,
    else None."""
    if not (plain_form(variant) and variant.head_size in WIDE_HEAD_SIZES and rows <= 16
            and sm_number(arch) >= WIDE_MIN_SM):
        return None
    return form_that_fits(variant, arch, wide=True)


def deep_variant(variant, arch: str):
    """The deep form of `variant` if it exists on this target (DEEP_KINDS, from DEEP_MIN_SM),
    whatever the switches say, else None."""
    if not (plain_form(variant) and sm_number(arch) >= DEEP_MIN_SM
            and (variant.cache, variant.head_size) in DEEP_KINDS):
        return None
    return form_that_fits(variant, arch, deep=True)


def wide_form(variant, rows: int, arch: str):
    """wide_variant where the switch allows it (CUPA_WIDE), else None. Whether a launch runs on
    it is the planner's rule (WIDE_MIN_PARTITION_TOKENS), unless the switch says always."""
    return None if switches().wide == "never" else wide_variant(variant, rows, arch)


# The planner's choices by a problem's size, each as the switches that make it on any problem
# where the variant exists: the 16-row kernel (small problems run as row chunks of the 8-column
# one, runs_as_row_chunks), and the dense and wide forms (dense_form, wide_form). How the
# selftest and the GPU tests reach them with small problems.
FORM_SWITCHES = {"16-row": {"CUPA_KERNEL": "auto", "CUPA_ROW_CHUNKS": "never",
                            "CUPA_DENSE": "auto"},
                 "dense": {"CUPA_KERNEL": "auto", "CUPA_ROW_CHUNKS": "always",
                           "CUPA_DENSE": "always"},
                 "wide": {"CUPA_KERNEL": "auto", "CUPA_ROW_CHUNKS": "never",
                          "CUPA_DENSE": "never", "CUPA_WIDE": "always"}}


def size_form(variant) -> str | None:
    """The FORM_SWITCHES entry under which the planner launches `variant` whatever the
    problem's size, or None where no size rule stands between a problem and its variant."""
    if not isinstance(variant, DecodeMmaVariant):
        return None
    if variant.dense:
        return "dense"
    if variant.wide:
        return "wide"
    return "16-row" if variant.heads == 16 else None


def decode_variant(dtype: str, head_size: int, rows: int, arch: str = "",
                   kv_format: str | None = None, *, matrix_cores: bool = True):
    """The phase-1 variant for a problem on a target: `rows` = query rows per KV head (GQA group
    x new tokens per sequence), `kv_format` = None or an fp8 format name. matrix_cores=False:
    never the AMD matrix-core kernel (one that failed its first-use check here)."""
    cache = None if kv_format is None else FP8_CACHE
    if mma_eligible(dtype, head_size, rows, arch):
        native = kv_format == FP8_E4M3_NATIVE and sm_number(arch) >= NATIVE_FP8_MIN_SM
        # More than 8 rows: the 16-row kernel, or where its ring and query do not fit the
        # target's shared memory (fp8 at heads 192, 256 on sm_86, sm_89, sm_120), row chunks
        # of the 8-column one.
        for heads in (16, 8) if rows > 8 else (8,):
            variant = DecodeMmaVariant(dtype, head_size, heads,
                                       FP8_E4M3_NATIVE if native else cache)
            # The deep form serves wherever it exists: no problem size was measured slower on it.
            deep = deep_variant(variant, arch) if switches().deep == "auto" else None
            if deep is not None:
                return deep
            if fits_shared_memory(variant, arch):
                return variant
        # Too little shared memory for any ring (a 16-bit cache at head 192 or 256 on sm_86,
        # sm_89 or sm_120): the portable kernel.
    if matrix_cores and matrix_eligible(dtype, head_size, arch):
        if kv_format is not None and kv_format == amd_native_fp8(arch):
            cache = FP8_AMD_NATIVE  # the target's own fp8 conversion
        return DecodeMatrixVariant(dtype, head_size, matrix_tiles(rows, head_size, arch), cache)
    return DecodeVariant(dtype, head_size, head_tile(rows), cache)
