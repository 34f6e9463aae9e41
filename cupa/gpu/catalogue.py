"""The kernel catalogue: which compiled variants exist, what they are called, and the source that
builds them. Which variant serves a problem is `cupa.gpu.dispatch`'s business.

Everything that is a compile-time choice lives here; everything else (block size, number of heads,
GQA ratio and new tokens per sequence within a variant's row tile, partition size, lengths, the
fp8 format and scales) is a runtime argument, which keeps the variant count to
query dtypes x cache kinds x head sizes x row tiles.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..problem import FP8_QUERY_DTYPES, SUPPORTED_HEAD_SIZES

KERNEL_DIR = Path(__file__).parent.parent / "kernels"

# Threads per workgroup of every decode kernel (2 wavefronts on CDNA, 4 warps elsewhere), but
# the wide forms (WIDE_RING). A module's CUPA_THREADS is its variant's (module_defines).
THREADS = 128

# Storage type of each dtype as the kernels name it, and the short tag used in kernel names.
DTYPES = {
    "float16": ("f16", "cupa_f16"),
    "bfloat16": ("bf16", "cupa_bf16"),
    "float32": ("f32", "float"),
}
# Query rows one workgroup handles against the KV rows it reads (GQA packing). A row is a (new
# token, query head) pair of one KV head: the GQA group in plain decode, times the new tokens in
# multi-token decode. More rows than the largest tile are split into chunks of it across the
# grid; fewer use the smallest tile that holds them, with the spare rows masked off at run time.
HEAD_TILES = (1, 2, 4, 8)
# Cache storage besides "same dtype as the query", for float16 and bfloat16 queries:
#   FP8_CACHE: fp8 codes of either e4m3 format, widened in software (the format is a runtime
#     scale, see Elem<cupa_fp8> in common.cuh); every kernel family;
#   FP8_E4M3_NATIVE: OCP e4m3fn codes converted by the hardware (cvt on NVIDIA sm_89+, exact
#     values); the tensor-core kernels only.
#   FP8_AMD_NATIVE: codes in the format an AMD target's v_cvt_pk_f32_fp8 reads (AMD_NATIVE_FP8),
#     converted by it (exact values); the matrix-core kernel only.
FP8_CACHE = "fp8"
FP8_E4M3_NATIVE = "fp8_e4m3"
FP8_AMD_NATIVE = "fp8_amd"
_CACHE_TYPES = {FP8_CACHE: ("kv8", "cupa_fp8"), FP8_E4M3_NATIVE: ("kv8fn", "cupa_fp8_e4m3"),
                FP8_AMD_NATIVE: ("kv8hw", "cupa_fp8_amd")}
# The fp8 format an AMD target's v_cvt_pk_f32_fp8 reads, by arch prefix (CUPA_AMD_FP8_CVT in
# kernels/amd_emulation.cuh): e4m3fnuz on gfx94x, OCP e4m3 on gfx12. gfx950 also has the
# instruction, but which format it reads is not checked here: it widens in software.
AMD_NATIVE_FP8 = {"gfx940": "fp8_e4m3fnuz", "gfx941": "fp8_e4m3fnuz", "gfx942": "fp8_e4m3fnuz",
                  "gfx12": "fp8_e4m3"}


def amd_native_fp8(arch: str) -> str | None:
    """The fp8 format `arch` converts in hardware (AMD_NATIVE_FP8), or None."""
    for prefix, fmt in AMD_NATIVE_FP8.items():
        if arch.startswith(prefix):
            return fmt
    return None


def head_tile(rows: int) -> int:
    """Row tile for `rows` query rows per KV head."""
    for tile in HEAD_TILES:
        if rows <= tile:
            return tile
    return HEAD_TILES[-1]


def _cache_type(dtype: str, cache: str | None) -> str:
    """The kernels' cache storage type for a query dtype and cache kind."""
    return _CACHE_TYPES[cache][1] if cache else DTYPES[dtype][1]


def sm_number(arch: str) -> int:
    """80 for 'sm_80', 90 for 'sm_90a'; 0 for anything else (AMD)."""
    return int(arch[3:].rstrip("a")) if arch.startswith("sm_") else 0


def fp8_value_power(variant, exponent_bias: int) -> float:
    """What the host folds into the fp8 scales for `variant`: the hardware conversion gives the
    codes' values, the software one their values times 2^(bias - 15) (Elem<cupa_fp8>)."""
    native = variant.cache in (FP8_E4M3_NATIVE, FP8_AMD_NATIVE)
    return 1.0 if native else 2.0 ** (15 - exponent_bias)


class _TwoPhase:
    """What every decode variant shares: a phase-1 kernel (`partition_name`, per class) and the
    phase-2 reduce kernel of its dtype, compiled into the same module.

    Every variant class offers the same three members, which is all the compiler needs:
    `source_file`, `entry_names` and `instantiations()`.
    """

    threads = THREADS  # per workgroup, of both kernels (a wide form has its own)

    @property
    def tag(self) -> str:
        """Query dtype tag, plus the cache kind's (kv8: software fp8, kv8fn: hardware e4m3)."""
        return DTYPES[self.dtype][0] + (_CACHE_TYPES[self.cache][0] if self.cache else "")

    @property
    def reduce_name(self) -> str:  # the reduce depends on the output dtype only
        return f"cupa_reduce_{DTYPES[self.dtype][0]}"

    @property
    def entry_names(self) -> tuple[str, ...]:
        return (self.partition_name, self.reduce_name)

    def reduce_instantiation(self) -> str:
        return f"CUPA_REDUCE_VARIANT({self.reduce_name}, {DTYPES[self.dtype][1]})"

    def partition_instantiation(self, macro: str, tile: int) -> str:
        """`macro`(entry name, query type, cache type, head size, row tile): the phase-1 line
        of the kernels whose macro takes their tile last (portable, AMD matrix cores)."""
        return (f"{macro}({self.partition_name}, {DTYPES[self.dtype][1]}, "
                f"{_cache_type(self.dtype, self.cache)}, {self.head_size}, {tile})")


@dataclass(frozen=True)
class DecodeVariant(_TwoPhase):
    """The portable phase-1 kernel (decode.cu) with a compile-time row tile."""

    dtype: str
    head_size: int
    heads: int  # row tile
    cache: str | None = None  # None: cache dtype = query dtype; FP8_CACHE: fp8 codes
    source_file = "decode.cu"
    # Partitioning hints for the planner: the fewest tokens a partition should hold, and how many
    # workgroups per multiprocessor to aim for before splitting sequences further. 8, not the
    # tensor-core kernels' 2: this kernel computes on CUDA cores, one row tile per workgroup, and
    # more of them in flight hide its latency. On the H200 (sweeps of v20 in docs/perf-log.md)
    # 8 gave the best partition size, or within 0.5% of it, on every bench shape at GQA 8 in
    # float16, float32 and head 96, and 0.59-0.82x the time of 4's choice on the mid-size
    # shapes (1 x 32768, 8 x 4096, 16 x 16384, 32 x 2048, 64 x 4096).
    min_partition = 256
    workgroups_per_sm = 8
    shared_bytes = 0  # static shared memory only

    @property
    def rows(self) -> int:
        """Query rows per workgroup."""
        return self.heads

    @property
    def partition_name(self) -> str:
        return f"cupa_decode_{self.tag}_d{self.head_size}_h{self.heads}"

    def instantiations(self) -> list[str]:
        return [self.partition_instantiation("CUPA_DECODE_VARIANT", self.heads),
                self.reduce_instantiation()]


SM90_SHARED_PER_SM = 228 * 1024  # shared memory of an H100 / H200 multiprocessor
# The most dynamic shared memory one workgroup may opt in to, by NVIDIA compute capability (CUDA
# C++ Programming Guide, technical specifications per compute capability): 163 KB on sm_80 and
# sm_87, 99 KB on sm_86, sm_89 and sm_120 (consumer Ampere, Ada and Blackwell), 227 KB on sm_90,
# sm_100 and sm_103. A larger ring fails to launch there, so dispatch never picks one
# (dispatch.fits_shared_memory); an sm this table lacks gets the least of them.
SHARED_OPT_IN_BYTES = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
                       103: 232448, 120: 101376}


def shared_opt_in_bytes(arch: str) -> int:
    """SHARED_OPT_IN_BYTES for an NVIDIA target ('sm_90'), the least of them for others."""
    return SHARED_OPT_IN_BYTES.get(sm_number(arch), min(SHARED_OPT_IN_BYTES.values()))


@dataclass(frozen=True)
class DecodeMmaVariant(_TwoPhase):
    """Phase 1 on NVIDIA tensor cores (mma.sync, sm_80+), fp16/bf16, the head sizes of
    MMA_HEAD_SIZES and MMA_STAGED_HEAD_SIZES.

    heads=8: the query rows are the N=8 columns (up to 8 rows); heads=16: they are the M=16 rows
    of one m-tile per warp (9-64 rows, and chunks of 64 of more; one tile and chunks of 16 at
    MMA16_SHARED_QUERY_HEAD_SIZES). dense: the 8-column kernel's dense form (DENSE_RING), for
    the (cache, head size) pairs of DENSE_KINDS. wide: either kernel's wide form (WIDE_RING), at
    WIDE_HEAD_SIZES from WIDE_MIN_SM. deep: either kernel's deep form (DEEP_RING), for the pairs
    of DEEP_KINDS from DEEP_MIN_SM.
    """

    dtype: str
    head_size: int
    heads: int
    cache: str | None = None
    dense: bool = False
    wide: bool = False
    deep: bool = False
    source_file = "decode_mma.cu"
    # Aim for one wave of long partitions, about 2 workgroups a multiprocessor (the shared-memory
    # ring of a float16 head-128 workgroup is 98 KB). Shorter partitions and more waves were
    # measured slower (docs/perf-log.md, v3-v4), and so was filling the 3 slots the fp8 and head-64
    # kernels have (v9): each partition's fixed cost and the reduce pass outweigh the better
    # balance. The residency itself (cupa.occupancy) only decides wave quantisation (planner.py).
    min_partition = 256

    @property
    def workgroups_per_sm(self) -> int:
        """2, or 1 where the ring alone takes over half of an sm_90 multiprocessor's 228 KB of
        shared memory (a 16-bit cache staged at head 256: 129 KB, 194 KB in the deep form)."""
        return 1 if self.shared_bytes > SM90_SHARED_PER_SM // 2 else 2

    @property
    def warp_steps(self) -> int:
        """16-token steps each warp computes side by side per chunk (KvRing::WARP_STEPS)."""
        staged = staged_head_size(self.head_size)
        return 2 if self.cache and 64 < staged <= 128 and not self.dense else 1

    @property
    def threads(self) -> int:
        """Threads per workgroup: the wide form's, or every decode kernel's."""
        return WIDE_RING["threads"] if self.wide else THREADS

    @property
    def min_sm(self) -> int:
        """The first sm the variant exists for: the wide and deep forms' rings need sm_90's
        shared memory."""
        return (WIDE_MIN_SM if self.wide else DEEP_MIN_SM if self.deep
                else NVIDIA_ONLY_FAMILIES["decode_mma"])

    @property
    def ring_stages(self) -> int:
        """The stages the kernel's ring is given (KvRing's DENSE_STAGES or CUPA_RING_STAGES):
        the dense, wide or deep form's, or 0 for the rule of KvRing (see shared_bytes)."""
        return (DENSE_RING["stages"] if self.dense else WIDE_RING["stages"] if self.wide
                else DEEP_RING["stages"] if self.deep else 0)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory of a workgroup: the K/V ring (KvRing in decode_mma.cu: stages of
        a chunk of K and V, 16 tokens for each warp and warp step (64 tokens, 128 for fp8 at
        heads 80-128, twice that in the wide form); kv_ring_stages of them, or ring_stages;
        then twice as many slots of a chunk's int32 block ids), which the warps' merge buffer
        reuses; then the 16-row kernel's tile of 16-bit query rows where it reads them from
        there (MMA16_SHARED_QUERY_HEAD_SIZES). Rows are staged at staged_head_size. The kernel
        traps if given less."""
        chunk = 16 * (self.threads // 32) * self.warp_steps
        kv_bytes = chunk * staged_head_size(self.head_size) * (1 if self.cache else 2)
        stages = self.ring_stages or kv_ring_stages(kv_bytes)
        ring = stages * 2 * kv_bytes + 2 * stages * chunk * 4
        # heads = rows of a tile
        merge = (self.threads // 32) * self.heads * merge_row_floats(self.heads, self.head_size) * 4
        query = 16 * self.head_size * 2 if self.shared_query else 0
        return max(ring, merge) + query

    @property
    def shared_query(self) -> bool:
        """Whether the 16-row kernel reads its one tile's query from shared memory."""
        return self.heads == 16 and self.head_size in MMA16_SHARED_QUERY_HEAD_SIZES

    @property
    def rows(self) -> int:
        """Query rows per workgroup: 8 columns, or a 16-row tile for each warp (one tile where
        the query is read from shared memory)."""
        if self.heads == 8:
            return 8
        return 16 if self.shared_query else 16 * (self.threads // 32)

    @property
    def partition_name(self) -> str:
        form = "_dense" if self.dense else "_wide" if self.wide else "_deep" if self.deep else ""
        return f"cupa_decode_mma{self.heads}_{self.tag}_d{self.head_size}{form}"

    def instantiations(self) -> list[str]:
        ctype = DTYPES[self.dtype][1]
        cache = _cache_type(self.dtype, self.cache)
        if self.dense:
            phase1 = (f"CUPA_DECODE_MMA_DENSE_VARIANT({self.partition_name}, {ctype}, {cache}, "
                      f"{self.head_size}, {self.ring_stages}, {DENSE_RING['workgroups']})")
        else:
            phase1 = (f"CUPA_DECODE_MMA_VARIANT({self.partition_name}, "
                      f"decode_partition_mma{self.heads}, {ctype}, {cache}, {self.head_size})")
        return [phase1, self.reduce_instantiation()]


MMA_DTYPES = ("float16", "bfloat16")
MMA_HEAD_SIZES = (64, 128, 256)
# The other supported head sizes. A tensor-core kernel stages their K/V rows in shared memory at
# the next of MMA_HEAD_SIZES or at OWN_WIDTH_HEAD_SIZES' own width (staged_head_size) and
# computes at their own size: whole k16 steps and 16-dim output tiles. Whether they run there is
# dispatch's CUPA_STAGED_HEADS.
MMA_STAGED_HEAD_SIZES = tuple(d for d in SUPPORTED_HEAD_SIZES if d not in MMA_HEAD_SIZES)
MMA_HEAD_TILES = (8, 16)
# The 16-row kernel keeps a 16-row tile's query fragments and output accumulators in registers
# up to head 128. Above it they would take 192 registers a thread at head 256 (144 at 192), so
# there the kernel holds one tile a workgroup and reads the tile's query from shared memory
# (Mma16Shape::SHARED_QUERY in mma16.cuh; more rows run as 16-row chunks across the grid).
MMA16_SHARED_QUERY_HEAD_SIZES = tuple(d for d in SUPPORTED_HEAD_SIZES if d > 128)


# K/V rows staged at their own width (160-224 bytes 16-bit, 80-112 fp8): a stage holds the global
# rows' bytes in their order, each 128-byte line under one swizzle (KvRing::swizzle in ring.cuh),
# and the ring holds 4 stages at heads 80 and 96, 3 at 112. On the H200 up to 12% faster than
# rows staged at 128 (16-bit), 4-15% (fp8) (docs/perf-log.md v41, v43). The same rule as the
# kernel's: the head sizes between 64 and 128.
OWN_WIDTH_HEAD_SIZES = tuple(d for d in SUPPORTED_HEAD_SIZES if 64 < d < 128)


def kv_ring_stages(kv_bytes: int) -> int:
    """KvRing's stages (ring.cuh, STAGES) where no form sets them, by the bytes of a chunk of K:
    2 from 32 KB, 3 above 12 KB (4 would not fit two workgroups a multiprocessor), else 4."""
    return 2 if kv_bytes >= 32768 else 3 if kv_bytes > 12288 else 4


def staged_head_size(head_size: int) -> int:
    """The head size a tensor-core kernel stages a K/V row at in shared memory (KvRing's
    staged_head_size in ring.cuh): its own at OWN_WIDTH_HEAD_SIZES, else the next of 64, 128
    and 256."""
    if head_size in OWN_WIDTH_HEAD_SIZES:
        return head_size
    return next(size for size in MMA_HEAD_SIZES if head_size <= size)


def merge_row_floats(tile_rows: int, head_size: int) -> int:
    """Floats between the rows of the tensor-core kernels' merge buffer (merge_row_floats in
    fragments.cuh): the head size plus a pad that spreads a store's rows over the banks."""
    return head_size + (4 if tile_rows == 8 else 8)


MAX_CLUSTER = 16  # decode_mma.cu's MAX_CLUSTER; above 8 a kernel opts in to non-portable sizes
# The dense form of the 8-column kernel (CUPA_DECODE_MMA_DENSE_VARIANT in decode_mma.cu): a ring of
# 3 stages of 64-token chunks, one 16-token step a warp, registers capped by the launch bounds
# for 4 workgroups a multiprocessor (16 warps), for these (cache, head size) pairs. On the H200
# the default forms hold 3 workgroups at head 64 of a 16-bit cache (4 stages, 66 KB of ring and
# ids, 142 registers) and 2 for hardware-widened fp8 at head 128 (3 stages of 128-token chunks,
# 98 KB); the dense forms 4 (50 KB, 127 registers, no spills). When they serve is
# dispatch.dense_form's business.
DENSE_RING = {"stages": 3, "workgroups": 4}
DENSE_KINDS = ((None, 64), (FP8_E4M3_NATIVE, 128))
# The wide form of both tensor-core kernels at head 128: workgroups of 8 warps, one a
# multiprocessor, with a ring of 3 stages of 128-token chunks (256 for fp8): 195-198 KB, so
# sm_90's 227 KB a workgroup (WIDE_MIN_SM; sm_80 gives 163). Twice the warps of the default
# form's workgroup and 128 KB in flight, without a second workgroup's merge and prologue. When
# it serves is dispatch.wide_form's and the planner's business (docs/perf-log.md v36).
WIDE_RING = {"threads": 256, "stages": 3}
WIDE_HEAD_SIZES = (128,)
WIDE_MIN_SM = 90
# The deep form of the tensor-core kernels where a 16-bit cache's rows are staged at head 256
# (heads 192 and 256): a ring of 3 stages of 64 KB instead of KvRing's 2 (194 KB, where sm_80
# gives a workgroup 163 KB; DEEP_MIN_SM), so two chunks are in flight while the warps compute,
# not one.
# Still one workgroup a multiprocessor. H200, GPU time, rule -> deep (docs/perf-log.md v39):
# head 192 1.06-1.26x faster (16 x 16384 475.1 -> 376.0 us), head 256 1.01-1.05x (64 x 4096
# 519.6 -> 499.2), head 256 at group 16 (row chunks) 1.07-1.24x (1 x 32768 68.2 -> 55.0). The
# 16-row kernel at these heads (v40) runs in it too (its 2-stage form, CUPA_DEEP=never, is
# tested, not timed). It serves wherever it exists (dispatch.deep_variant).
DEEP_RING = {"stages": 3}
DEEP_KINDS = tuple((None, d) for d in MMA_HEAD_SIZES + MMA_STAGED_HEAD_SIZES
                   if staged_head_size(d) == 256)
DEEP_MIN_SM = 90


def all_decode_variants() -> list[DecodeVariant]:
    plain = [DecodeVariant(dtype, d, h) for dtype in DTYPES for d in SUPPORTED_HEAD_SIZES
             for h in HEAD_TILES]
    fp8 = [DecodeVariant(dtype, d, h, FP8_CACHE) for dtype in FP8_QUERY_DTYPES
           for d in SUPPORTED_HEAD_SIZES for h in HEAD_TILES]
    return plain + fp8


def all_mma_variants() -> list[DecodeMmaVariant]:
    plain = [DecodeMmaVariant(dtype, d, h, cache) for dtype in MMA_DTYPES
             for d in MMA_HEAD_SIZES + MMA_STAGED_HEAD_SIZES for h in MMA_HEAD_TILES
             for cache in (None, FP8_CACHE, FP8_E4M3_NATIVE)]
    dense = [DecodeMmaVariant(dtype, d, 8, cache, dense=True) for dtype in MMA_DTYPES
             for cache, d in DENSE_KINDS]
    wide = [replace(v, wide=True) for v in plain if v.head_size in WIDE_HEAD_SIZES]
    deep = [replace(v, deep=True) for v in plain if (v.cache, v.head_size) in DEEP_KINDS]
    return plain + dense + wide + deep


# AMD matrix cores (decode_matrix.cu): the processors with a 16x16x16 f16/bf16 instruction of
# the layouts amd_emulation.cuh implements, by family. gfx908 (MI100) lacks the bf16 form used
# here and RDNA1/2 have no WMMA: they run the portable kernel.
MATRIX_CORE_ARCHS = {"mfma": ("gfx90a", "gfx940", "gfx941", "gfx942", "gfx950"),
                     "wmma": ("gfx11", "gfx12")}  # wmma: prefixes of every RDNA3 / RDNA4 part
MATRIX_DTYPES = ("float16", "bfloat16")
MATRIX_HEAD_SIZES = SUPPORTED_HEAD_SIZES  # 80 and 112 with V^T padded to whole tile pairs
# Row tiles (16 query rows each) per workgroup: one up to 16 rows, two above (chunks of 32),
# except where two tiles do not fit a lane's 256 VGPRs (clang-19's code objects: heads 192 and
# 256 on CDNA, its two tiles taking 272-280 VGPRs at 192; RDNA4 at head 112, 200-264 bytes of
# spills a lane at two tiles; RDNA3 at heads 80 and 112, whose replicated operands spill
# 36-704 bytes at two tiles, and at 192, where not even a wavefront pair's halves fit).
# RDNA3's two tiles at 128 and RDNA4's at 192 run as wavefront pairs since v56 (decode_matrix.cu's
# SPLIT: 4-9 round trips a tile, no spill; docs/perf-log.md v56). 256 has no two-tile variant.
MATRIX_TILES = (1, 2)
ONE_TILE_HEAD_SIZES = {"cdna": (192, 256), "rdna4": (112, 256), "rdna3": (80, 112, 192, 256)}


def matrix_core_family(arch: str) -> str | None:
    """'mfma', 'wmma' or None: the AMD matrix instruction family of a gfx target."""
    if arch in MATRIX_CORE_ARCHS["mfma"]:
        return "mfma"
    if arch.startswith(MATRIX_CORE_ARCHS["wmma"]):
        return "wmma"
    return None


def matrix_generation(arch: str) -> str | None:
    """'cdna' (MFMA), 'rdna3' or 'rdna4' (WMMA, different layouts), or None without matrix
    cores."""
    family = matrix_core_family(arch)
    if family is None:
        return None
    return "cdna" if family == "mfma" else "rdna3" if arch.startswith("gfx11") else "rdna4"


def matrix_tiles(rows: int, head_size: int, arch: str) -> int:
    """Row tiles of the matrix-core variant for `rows` query rows per KV head on `arch`."""
    one_tile = ONE_TILE_HEAD_SIZES.get(matrix_generation(arch), ())
    return 1 if rows <= 16 or head_size in one_tile else 2


@dataclass(frozen=True)
class DecodeMatrixVariant(_TwoPhase):
    """Phase 1 on AMD matrix cores (decode_matrix.cu: MFMA on CDNA, WMMA on RDNA3/RDNA4, the
    instruction picked by the compile target), fp16/bf16 queries, every head size, a
    cache of the query type or fp8 codes. tiles: 16-row tiles of query rows per workgroup."""

    dtype: str
    head_size: int
    tiles: int
    cache: str | None = None  # None, FP8_CACHE or FP8_AMD_NATIVE
    source_file = "decode_matrix.cu"
    min_partition = 256
    workgroups_per_sm = 4  # per compute unit on AMD
    shared_bytes = 0  # static LDS only

    @property
    def rows(self) -> int:
        return 16 * self.tiles

    @property
    def partition_name(self) -> str:
        return f"cupa_decode_xmma{self.tiles}_{self.tag}_d{self.head_size}"

    def instantiations(self) -> list[str]:
        return [self.partition_instantiation("CUPA_DECODE_MATRIX_VARIANT", self.tiles),
                self.reduce_instantiation()]


def all_matrix_variants() -> list[DecodeMatrixVariant]:
    return [DecodeMatrixVariant(dtype, d, tiles, cache) for dtype in MATRIX_DTYPES
            for d in MATRIX_HEAD_SIZES for tiles in MATRIX_TILES
            for cache in (None, FP8_CACHE, FP8_AMD_NATIVE) if tiles == 1 or d != 256]


def matrix_variant_exists(variant: DecodeMatrixVariant, arch: str) -> bool:
    """Whether `variant` compiles for `arch`: a target with matrix cores, and for a hardware fp8
    cache one whose v_cvt_pk_f32_fp8 reads a format cupa knows."""
    if matrix_core_family(arch) is None:
        return False
    return variant.cache != FP8_AMD_NATIVE or amd_native_fp8(arch) is not None


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def expanded_source(filename: str) -> str:
    """Kernel file text with our own `#include "..."` lines inlined (each file once).

    hipRTC has no include path for package files, so the source is made self-contained here and
    the same text goes to NVRTC, hipRTC and the offline compilers.
    """
    seen: set[Path] = set()

    def expand(path: Path) -> str:
        path = path.resolve()
        if path in seen:
            return ""
        seen.add(path)
        text = path.read_text().replace("#pragma once", "")
        # An include names a file relative to the including one, as a compiler reads it.
        return _INCLUDE.sub(lambda m: expand(path.parent / m.group(1)), text)

    return expand(KERNEL_DIR / filename)


def module_defines(variant) -> tuple:
    """The compile-time constants of a variant's module, (name, value) pairs defined at the top
    of its source: the workgroup's threads (CUPA_THREADS), and a wide or deep form's ring stages
    (CUPA_RING_STAGES; 0: KvRing's rule; a dense form's come as a template argument)."""
    stages = 0 if getattr(variant, "dense", False) else getattr(variant, "ring_stages", 0)
    return (("CUPA_THREADS", getattr(variant, "threads", THREADS)), ("CUPA_RING_STAGES", stages))


def module_source(variant) -> str:
    """Self-contained source of the module holding one variant (of any kernel family)."""
    return batch_source([variant])


def batch_source(group) -> str:
    """One source instantiating every variant of `group` (all of one source file and one set of
    module_defines), each entry point once (variants of a dtype share their reduce kernel)."""
    files = {v.source_file for v in group}
    if len(files) != 1:
        raise ValueError(f"a batch must come from one source file, got {sorted(files)}")
    defines = {module_defines(v) for v in group}
    if len(defines) != 1:
        raise ValueError(f"a batch must share its module defines, got {sorted(defines)}")
    prelude = "".join(f"#define {name} {value}\n" for name, value in defines.pop())
    lines = list(dict.fromkeys(line for v in group for line in v.instantiations()))
    return prelude + expanded_source(files.pop()) + "\n" + "\n".join(lines) + "\n"


# Kernel families register a function listing all their variants, for the offline compile check.
VARIANT_FAMILIES = {"decode": all_decode_variants, "decode_mma": all_mma_variants,
                    "decode_matrix": all_matrix_variants}
# Families that exist only for NVIDIA targets, from this sm on (mma.sync m16n8k16, cp.async).
NVIDIA_ONLY_FAMILIES = {"decode_mma": 80}
# Families that exist only for AMD targets with matrix cores (matrix_core_family).
AMD_MATRIX_FAMILIES = ("decode_matrix",)


def all_variants(arch: str | None = None) -> list:
    """Every variant, or those that exist for `arch` ('sm_90', 'gfx942', ...)."""
    def exists(name, variant):
        if arch is None:
            return True
        if name in NVIDIA_ONLY_FAMILIES:
            first = getattr(variant, "min_sm", NVIDIA_ONLY_FAMILIES[name])
            return not arch.startswith("gfx") and sm_number(arch) >= first
        if name in AMD_MATRIX_FAMILIES:
            return matrix_variant_exists(variant, arch)
        return True
    return [v for name, family in VARIANT_FAMILIES.items() for v in family() if exists(name, v)]


@dataclass(frozen=True)
class CacheWriteVariant:
    """The KV-cache write kernel of one dtype (head size and block size are runtime args).

    kv_format None copies rows of `dtype` as they are; 'fp8' (or any fp8 format name, which
    becomes 'fp8') quantises them to fp8 codes. One kernel serves every fp8 format: the format
    and the per-head scales are runtime arguments.
    """

    dtype: str
    kv_format: str | None = None
    source_file = "cache_write.cu"

    def __post_init__(self):
        if self.kv_format is not None:
            if not str(self.kv_format).startswith("fp8"):
                raise ValueError(f"kv_format: None or an fp8 format, got {self.kv_format!r}")
            object.__setattr__(self, "kv_format", "fp8")

    @property
    def write_name(self) -> str:
        suffix = "_fp8" if self.kv_format else ""
        return f"cupa_cache_write_{DTYPES[self.dtype][0]}{suffix}"

    @property
    def entry_names(self) -> tuple[str, ...]:
        return (self.write_name,)

    def instantiations(self) -> list[str]:
        macro = "CUPA_CACHE_WRITE_FP8_VARIANT" if self.kv_format else "CUPA_CACHE_WRITE_VARIANT"
        return [f"{macro}({self.write_name}, {DTYPES[self.dtype][1]})"]


def all_cache_write_variants() -> list[CacheWriteVariant]:
    return [CacheWriteVariant(dtype, kv_format) for kv_format in (None, "fp8")
            for dtype in DTYPES]


VARIANT_FAMILIES["cache_write"] = all_cache_write_variants
