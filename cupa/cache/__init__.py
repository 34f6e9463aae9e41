"""The paged KV cache: block bookkeeping (`blocks`), the sequences that hold blocks (`sequences`)
and the storage of every layer (`paged`)."""

from .blocks import OutOfBlocksError
from .paged import PagedKVCache

__all__ = ["PagedKVCache", "OutOfBlocksError"]
