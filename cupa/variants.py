"""The compiled kernel variants: which exist, what they are called, and the source that builds them.

Everything that is a compile-time choice lives here; everything else (block size, number of heads,
GQA ratio within a variant's head tile, partition size, lengths) is a runtime argument, which keeps
the variant count to dtypes x head sizes x head tiles.
"""

from __future__ import annotations

import functools
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


@dataclass(frozen=True)
class DecodeVariant:
    """Phase 1 (partition) kernel plus the phase 2 (reduce) kernel of the same dtype."""

    dtype: str
    head_size: int
    heads: int  # head tile

    @property
    def tag(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def partition_name(self) -> str:
        return f"cupa_decode_{self.tag}_d{self.head_size}_h{self.heads}"

    @property
    def reduce_name(self) -> str:
        return f"cupa_reduce_{self.tag}"

    def instantiations(self) -> list[str]:
        ctype = DTYPES[self.dtype][1]
        return [f"CUPA_DECODE_VARIANT({self.partition_name}, {ctype}, {self.head_size}, "
                f"{self.heads})",
                f"CUPA_REDUCE_VARIANT({self.reduce_name}, {ctype})"]


def decode_variant(dtype: str, head_size: int, group: int) -> DecodeVariant:
    return DecodeVariant(dtype, head_size, head_tile(group))


def all_decode_variants() -> list[DecodeVariant]:
    return [DecodeVariant(dtype, d, h) for dtype in DTYPES for d in HEAD_SIZES for h in HEAD_TILES]


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


def module_source(variant: DecodeVariant) -> str:
    """Self-contained source of the module holding one decode variant."""
    return _expanded("decode.cu") + "\n" + "\n".join(variant.instantiations()) + "\n"
