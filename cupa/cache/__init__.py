"""The paged KV cache: block bookkeeping (`blocks`) and the storage of every layer (`paged`)."""

from .blocks import OutOfBlocksError
from .paged import PagedKVCache

__all__ = ["PagedKVCache", "OutOfBlocksError"]
