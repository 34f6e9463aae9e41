"""What a decode problem is: its limits, its shape, its options and its arrays.

Every limit of the public API lives here once; validation, the kernel catalogue and the tests
read them from this module.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# Query / cache dtypes and the numpy type that stores each (bfloat16 through ml_dtypes).
STORAGE_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                  "float32": np.dtype(np.float32)}
SUPPORTED_DTYPES = tuple(STORAGE_DTYPES)
SUPPORTED_HEAD_SIZES = (64, 80, 96, 112, 128, 192, 256)
# At most 32: the tensor-core kernels' copies rely on it (KvRing::MAX_BLOCK_SIZE in decode_mma.cu).
SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32)
# The caches' dimension orders: where the KV-head and token axes sit in a 4-d cache
# [num_blocks, ., ., head_size]. "HND" is cupa's own (PagedKVCache), "NHD" vLLM's
# flash-attention backend's. The kernels see only element strides (DecodeShape), so a
# strided view of either order (K and V interleaved per block, say) runs as it is.
KV_LAYOUTS = {"HND": ("num_blocks", "num_kv_heads", "block_size", "head_size"),
              "NHD": ("num_blocks", "block_size", "num_kv_heads", "head_size")}
DEFAULT_KV_LAYOUT = "HND"


def kv_axes(kv_layout: str) -> tuple[int, int]:
    """(KV-head axis, token axis) of a cache in the layout `kv_layout`."""
    dims = KV_LAYOUTS[kv_layout]
    return dims.index("num_kv_heads"), dims.index("block_size")


# Bounds the kernels' stride arithmetic relies on: every cache stride a multiple of 16 bytes
# (16-byte vector loads and copies of whole rows), a block's stride below 2^32 bytes (the
# tensor-core kernels step between blocks with a 32-bit product), and the token stride below
# 2^24 elements (a row's offset in its block is a 24-bit product: PagedRows, decode_common.cuh).
KV_STRIDE_ALIGN_BYTES = 16
MAX_KV_BLOCK_STRIDE_BYTES = 2**32 - 1
MAX_KV_TOKEN_STRIDE = 2**24 - 1
# Query dtypes an fp8 cache serves (the tensor cores and the kernels' fp8 variants).
FP8_QUERY_DTYPES = ("float16", "bfloat16")
MAX_QUERY_LEN = 16  # new tokens per sequence in one call (MAX_QUERY_LEN in decode_common.cuh)
# Grid limit shared by CUDA and HIP for the y and z dimensions: partitions and sequences.
MAX_GRID_YZ = 65535


@dataclass(frozen=True)
class DecodeShape:
    """Everything about one decode call that does not depend on array contents."""

    num_seqs: int
    num_tokens: int  # query rows: num_seqs, or query_start_loc[-1] in multi-token decode
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    dtype: str
    scale: float
    has_alibi: bool
    sliding_window: int = 0      # 0: attend to every position
    logits_soft_cap: float = 0.0  # 0: no soft-capping
    has_sinks: bool = False
    multi_token: bool = False  # query_start_loc given
    kv_format: str | None = None  # None: the cache holds the query dtype; else an fp8 format
    # Element strides (block, KV head, token) of both caches; None: contiguous "HND", the
    # default layout (validation stores None for it, so equal problems compare equal).
    kv_strides: tuple[int, int, int] | None = None

    @property
    def group(self) -> int:
        """Query heads per KV head (1 for MHA, num_heads for MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_itemsize(self) -> int:
        """Bytes of one cached K or V element: 1 for fp8 codes, else the storage dtype's."""
        return 1 if self.kv_format else STORAGE_DTYPES[self.dtype].itemsize

    @property
    def cache_strides(self) -> tuple[int, int, int]:
        """Element strides (block, KV head, token) of the caches the kernels address."""
        if self.kv_strides is not None:
            return self.kv_strides
        d = self.head_size
        return (self.num_kv_heads * self.block_size * d, self.block_size * d, d)

    @property
    def capacity(self) -> int:
        """Most tokens a sequence can hold with this block table width."""
        return self.max_blocks_per_seq * self.block_size


@dataclass(frozen=True)
class DecodeOptions:
    """What a plan fixes besides shapes: scalars and the presence of the optional arrays."""

    scale: float | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    kv_format: str | None = None
    return_lse: bool = False
    kv_layout: str = DEFAULT_KV_LAYOUT


# The arrays of a decode call, in the order every layer passes them (`DecodeInputs`).
INPUT_NAMES = ("query", "key_cache", "value_cache", "block_tables", "seq_lens",
               "query_start_loc", "alibi_slopes", "sinks")
REQUIRED_INPUTS = 5  # the first five are required, the others optional


@dataclass
class DecodeInputs:
    """The arrays of one call, as the backend's kind (cupy or numpy)."""

    query: object
    key_cache: object
    value_cache: object
    block_tables: object
    seq_lens: object
    query_start_loc: object = None
    alibi_slopes: object = None
    sinks: object = None

    def as_tuple(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.alibi_slopes, self.sinks)


def default_max_query_len(shape: DecodeShape) -> int:
    """Most new tokens a sequence can have when query_start_loc lives on the device: every
    sequence has at least one, so none has more than num_tokens - num_seqs + 1."""
    if not shape.multi_token:
        return 1
    return max(1, min(MAX_QUERY_LEN, shape.num_tokens - shape.num_seqs + 1))
