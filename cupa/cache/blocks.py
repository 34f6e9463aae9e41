"""Pure-Python bookkeeping of KV-cache blocks: free list, reference counts, prefix-cache hashes.

No array data lives here, only block ids. `cupa.cache.sequences.SequenceTable` decides when
blocks are shared, copied or swapped, and `cupa.cache.PagedKVCache` moves their data; this
module only answers "which block is free", "who still uses this block" and "which block already
holds these tokens".

Every block is in exactly one of three states:
  in use      reference count >= 1 (one count per sequence whose table holds it)
  evictable   reference count 0, but it holds a full block registered in the prefix cache, so a
              later sequence with the same tokens can take it back; evicted least recently freed
              first, and only when the free list is empty
  free        reference count 0 and no cached content
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np

# Hash of the empty prefix: the parent of a sequence's first block.
ROOT_HASH = b"cupa-prefix-root"


class OutOfBlocksError(MemoryError):
    """The cache has too few free blocks for the request; nothing was changed."""


def block_hash(parent: bytes, token_ids) -> bytes:
    """Chained hash of one full block: it names the block's tokens and every token before them,
    so equal hashes mean equal prefixes (up to a 128-bit collision)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    return hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest()


class BlockAllocator:
    """Free list, reference counts, fill counts and the prefix-cache index of a block pool."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        # numpy so that `write` can check thousands of slots at once.
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self.fill = np.zeros(num_blocks, dtype=np.int32)  # reserved tokens held by each block
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_of_block: dict[int, bytes] = {}
        self._block_of_hash: dict[bytes, int] = {}

    # --- queries ---------------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_free(self) -> int:
        """Blocks allocations take before evicting any cached block."""
        return len(self._free)

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def evictable_blocks(self) -> list[int]:
        return list(self._evictable)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def lookup(self, digest: bytes) -> int | None:
        """The block registered for this prefix hash, in use or evictable, or None."""
        return self._block_of_hash.get(digest)

    # --- changes (callers check availability first, so these fail only on misuse) ----------

    def allocate(self) -> int:
        """A block with reference count 1: from the free list, else the least recently freed
        cached block (whose prefix entry is dropped)."""
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of_hash[self._hash_of_block.pop(block)]
        else:
            raise OutOfBlocksError("no free block left")
        self.refcount[block] = 1
        self.fill[block] = 0
        return block

    def allocate_many(self, count: int) -> np.ndarray:
        """`count` blocks (int64), the ones `allocate` would hand out called `count` times, in
        that order; the free-list case in one pass (a decode step opens many blocks at once)."""
        free = self._free
        if count > len(free):
            return np.array([self.allocate() for _ in range(count)], dtype=np.int64)
        blocks = np.array([free.popleft() for _ in range(count)], dtype=np.int64)
        self.refcount[blocks] = 1
        self.fill[blocks] = 0
        return blocks

    def incref(self, block: int):
        """One more user of `block`; an evictable block comes back into use."""
        if self.refcount[block] == 0:
            if block not in self._evictable:
                raise AssertionError(f"incref of free block {block}")
            del self._evictable[block]
        self.refcount[block] += 1

    def decref(self, block: int):
        """One user fewer; at zero the block becomes evictable (cached content) or free."""
        if self.refcount[block] <= 0:
            raise AssertionError(f"decref of unused block {block}")
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            if block in self._hash_of_block:
                self._evictable[block] = None
            else:
                self.fill[block] = 0
                self._free.append(block)

    def register(self, block: int, digest: bytes) -> bool:
        """Index a full in-use block under its prefix hash. A hash already indexed keeps its
        first block (the newer copy stays unindexed and is freed normally). True if indexed."""
        if digest in self._block_of_hash or block in self._hash_of_block:
            return False
        self._block_of_hash[digest] = block
        self._hash_of_block[block] = digest
        return True
