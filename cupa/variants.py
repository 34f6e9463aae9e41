"""The compiled kernel variants: which exist, what they are called, and the source that builds them.

Everything that is a compile-time choice lives here; everything else (block size, number of heads,
GQA ratio within a variant's head tile, partition size, lengths) is a runtime argument, which keeps
the variant count to dtypes x head sizes x head tiles.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from pathlib import Path

KERNEL_DIR = Path(__file__).parent / "kernels"

# Threads per workgroup of every decode kernel (2 wavefronts on CDNA, 4 warps elsewhere).
THREADS = 128

# Storage type of each dtype as the kernels name it, and the short tag used in kernel names.
DTYPES = {
    "float16": ("f16", "cupa_f16"),
    "bfloat16": ("bf16", "cupa_bf16"),
    "float32": ("f32", "float"),
}
HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
# Query heads one workgroup handles against the KV rows it reads (GQA packing). Groups larger than
# the largest tile are split into chunks of it across the grid; smaller ones use the smallest tile
# that holds them, with the spare heads masked off at run time.
HEAD_TILES = (1, 2, 4, 8)


def head_tile(group: int) -> int:
    """Head tile for `group` query heads per KV head."""
    for tile in HEAD_TILES:
        if group <= tile:
            return tile
    return HEAD_TILES[-1]


class _TwoPhase:
    """What every decode variant shares: a phase-1 kernel (`partition_name`, per class) and the
    phase-2 reduce kernel of its dtype, compiled into the same module.

    Every variant class offers the same three members, which is all the compiler needs:
    `source_file`, `entry_names` and `instantiations()`.
    """

    @property
    def tag(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def reduce_name(self) -> str:
        return f"cupa_reduce_{self.tag}"

    @property
    def entry_names(self) -> tuple[str, ...]:
        return (self.partition_name, self.reduce_name)

    def reduce_instantiation(self) -> str:
        return f"CUPA_REDUCE_VARIANT({self.reduce_name}, {DTYPES[self.dtype][1]})"


@dataclass(frozen=True)
class DecodeVariant(_TwoPhase):
    """The portable phase-1 kernel (decode.cu) with a compile-time head tile."""

    dtype: str
    head_size: int
    heads: int  # head tile
    source_file = "decode.cu"
    # Partitioning hints for the planner: the fewest tokens a partition should hold, and how many
    # workgroups per multiprocessor to aim for before splitting sequences further.
    min_partition = 256
    workgroups_per_sm = 4

    @property
    def partition_name(self) -> str:
        return f"cupa_decode_{self.tag}_d{self.head_size}_h{self.heads}"

    def instantiations(self) -> list[str]:
        ctype = DTYPES[self.dtype][1]
        return [f"CUPA_DECODE_VARIANT({self.partition_name}, {ctype}, {self.head_size}, "
                f"{self.heads})", self.reduce_instantiation()]


@dataclass(frozen=True)
class DecodeMmaVariant(_TwoPhase):
    """Phase 1 on NVIDIA tensor cores (mma.sync, sm_80+), fp16/bf16, head sizes 64 and 128.

    heads=8: the group's query heads are the N=8 columns (groups of 2-8); heads=16: they are the
    M=16 rows (groups of 9-16, and chunks of 16 of larger groups).
    """

    dtype: str
    head_size: int
    heads: int
    source_file = "decode_mma.cu"
    # About 2 workgroups fit on a multiprocessor (~250 registers a thread): aim for one wave of
    # long partitions. Shorter partitions and more waves were measured slower (docs/perf.md,
    # v3-v4): each partition's fixed cost and the reduce pass outweigh the better balance.
    min_partition = 256
    workgroups_per_sm = 2

    @property
    def partition_name(self) -> str:
        return f"cupa_decode_mma{self.heads}_{self.tag}_d{self.head_size}"

    def instantiations(self) -> list[str]:
        ctype = DTYPES[self.dtype][1]
        kernel = f"decode_partition_mma{self.heads}"
        return [f"CUPA_DECODE_MMA_VARIANT({self.partition_name}, {kernel}, {ctype}, "
                f"{self.head_size})", self.reduce_instantiation()]


MMA_DTYPES = ("float16", "bfloat16")
MMA_HEAD_SIZES = (64, 128)
MMA_HEAD_TILES = (8, 16)
MMA_MIN_SM = 80
# Query heads per KV head from which the tensor-core kernels are used. Even plain MHA (one head
# in an 8-column tile) leaves the tensor cores far from busy, so this is 1 unless the bench says
# otherwise.
MMA_MIN_GROUP = 1


def mma_eligible(dtype: str, head_size: int, group: int, arch: str) -> bool:
    """Whether the tensor-core kernel serves this problem on this target."""
    if os.environ.get("CUPA_KERNEL", "auto") == "portable":
        return False
    if not arch.startswith("sm_") or int(arch[3:].rstrip("a")) < MMA_MIN_SM:
        return False
    return dtype in MMA_DTYPES and head_size in MMA_HEAD_SIZES and group >= MMA_MIN_GROUP


def decode_variant(dtype: str, head_size: int, group: int, arch: str = ""):
    """The phase-1 variant for a problem on a target. CUPA_KERNEL=portable in the environment
    forces the portable kernel (for tests and benchmarks)."""
    if mma_eligible(dtype, head_size, group, arch):
        return DecodeMmaVariant(dtype, head_size, 8 if group <= 8 else 16)
    return DecodeVariant(dtype, head_size, head_tile(group))


def all_decode_variants() -> list[DecodeVariant]:
    return [DecodeVariant(dtype, d, h) for dtype in DTYPES for d in HEAD_SIZES for h in HEAD_TILES]


def all_mma_variants() -> list[DecodeMmaVariant]:
    return [DecodeMmaVariant(dtype, d, h) for dtype in MMA_DTYPES for d in MMA_HEAD_SIZES
            for h in MMA_HEAD_TILES]


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


@functools.lru_cache(maxsize=None)
def _expanded(filename: str) -> str:
    """Kernel file text with our own `#include "..."` lines inlined (each file once).

    hipRTC has no include path for package files, so the source is made self-contained here and
    the same text goes to NVRTC, hipRTC and the offline compilers.
    """
    seen: set[str] = set()

    def expand(name: str) -> str:
        if name in seen:
            return ""
        seen.add(name)
        text = (KERNEL_DIR / name).read_text()
        text = text.replace("#pragma once", "")
        return _INCLUDE.sub(lambda m: expand(m.group(1)), text)

    return expand(filename)


def module_source(variant) -> str:
    """Self-contained source of the module holding one variant (of any kernel family)."""
    return _expanded(variant.source_file) + "\n" + "\n".join(variant.instantiations()) + "\n"


# Kernel families register a function listing all their variants, for the offline compile check.
VARIANT_FAMILIES = {"decode": all_decode_variants, "decode_mma": all_mma_variants}
# Families that exist only for NVIDIA targets.
NVIDIA_ONLY_FAMILIES = {"decode_mma"}


def all_variants(arch: str | None = None) -> list:
    """Every variant, or those that exist for `arch` ('sm_90', 'gfx942', ...)."""
    hip = arch is not None and arch.startswith("gfx")
    return [v for name, family in VARIANT_FAMILIES.items()
            if not (hip and name in NVIDIA_ONLY_FAMILIES) for v in family()]


@dataclass(frozen=True)
class CacheWriteVariant:
    """The KV-cache write kernel of one dtype (head size and block size are runtime args)."""

    dtype: str
    source_file = "cache_write.cu"

    @property
    def write_name(self) -> str:
        return f"cupa_cache_write_{DTYPES[self.dtype][0]}"

    @property
    def entry_names(self) -> tuple[str, ...]:
        return (self.write_name,)

    def instantiations(self) -> list[str]:
        return [f"CUPA_CACHE_WRITE_VARIANT({self.write_name}, {DTYPES[self.dtype][1]})"]


def all_cache_write_variants() -> list[CacheWriteVariant]:
    return [CacheWriteVariant(dtype) for dtype in DTYPES]


VARIANT_FAMILIES["cache_write"] = all_cache_write_variants
