"""`cupa.PagedKVCache`: paged K/V storage for every layer, plus the sequences that use it.

Storage is two arrays (K and V) of shape [num_layers, num_blocks, num_kv_heads, block_size,
head_size] on the cache's device (cupy) or host (numpy), of `dtype` or, with an fp8 `kv_format`,
of uint8 fp8 codes with per-KV-head scales (cupa.fp8). A block id names the same block in every
layer, so one block table serves all layers and block copies (copy-on-write, swap) move all layers
at once. Bookkeeping (free list, reference counts, prefix hashes) is in `cupa.cache.blocks`.

Every public method validates all of its arguments before changing anything, so an error leaves
the cache exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

import numpy as np

from .. import arrays
from ..api import decode, resolve_backend
from ..fp8 import check_kv_format, kv_scales, quantize_fp8
from ..problem import STORAGE_DTYPES
from ..validation import dtype_name
from .blocks import ROOT_HASH, BlockAllocator, OutOfBlocksError, block_hash

# Same-size unsigned integers: block copies move raw bits, which is exact for every dtype and
# needs no bfloat16 support from the array library's copy kernels.
BIT_DTYPES = {2: np.uint16, 4: np.uint32, 1: np.uint8}

__all__ = ["PagedKVCache", "OutOfBlocksError"]


@dataclass
class _Sequence:
    """One sequence's view of the cache."""

    table: np.ndarray             # int32 block ids; the first `num_blocks` entries are used
    num_blocks: int = 0
    num_tokens: int = 0           # reserved tokens (= seq_len)
    # Prefix-hash chain: hash of the last full block and the token ids of the partial block after
    # it. `pending` is None once a token id is unknown (extended without token_ids): from then on
    # the sequence's blocks cannot be named by content.
    parent_hash: bytes = ROOT_HASH
    pending: list | None = field(default_factory=list)
    cached_tokens: int = 0        # tokens that came from the prefix cache (needed no prefill)
    swapped: tuple | None = None  # (host keys, host values) while swapped out

    @property
    def blocks(self) -> np.ndarray:
        return self.table[:self.num_blocks]

    def append_blocks(self, ids):
        need = self.num_blocks + len(ids)
        if need > len(self.table):  # grow geometrically: appends stay O(1) amortised
            grown = np.empty(max(need, 2 * len(self.table), 4), dtype=np.int32)
            grown[:self.num_blocks] = self.blocks
            self.table = grown
        self.table[self.num_blocks:need] = ids
        self.num_blocks = need

    def copy(self) -> "_Sequence":
        return _Sequence(table=self.blocks.copy(), num_blocks=self.num_blocks,
                         num_tokens=self.num_tokens, parent_hash=self.parent_hash,
                         pending=None if self.pending is None else list(self.pending),
                         cached_tokens=self.cached_tokens)


@dataclass
class _ExtendPlan:
    """What `extend` will do to one sequence, worked out before anything changes."""

    seq_id: Hashable
    num_new: int
    tokens: list | None           # the new token ids, when given
    cow: bool = False             # copy the shared partial last block first
    hits: list = field(default_factory=list)        # cached blocks to reuse, in order
    fresh: int = 0                # blocks to allocate
    full_hashes: list = field(default_factory=list)  # hash of every block this extend fills


class _TableBuffers:
    """Persistent host + device int32 buffers behind `tables()`: [seq_lens | block tables].

    Reused across calls and grown only when too small, so a steady decode loop allocates
    nothing. The host side is pinned when cupy allows it, making the one upload per call
    asynchronous; an event guards the host buffer against being refilled before the previous
    upload has read it.
    """

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.host = np.empty(0, dtype=np.int32)
        self.device = None
        self.upload_done = None

    def host_buffer(self, size: int) -> np.ndarray:
        if self.upload_done is not None:
            self.upload_done.synchronize()
        if size > len(self.host):
            capacity = max(size, 2 * len(self.host), 256)
            self.host = self._new_host(capacity)
            if self.on_gpu:
                self.device = arrays.cupy_module().empty(capacity, dtype=np.int32)
        return self.host

    def _new_host(self, capacity: int) -> np.ndarray:
        if self.on_gpu:
            try:
                import cupyx
                return cupyx.empty_pinned((capacity,), dtype=np.int32)
            except Exception:  # pinned memory is an optimisation only
                pass
        return np.empty(capacity, dtype=np.int32)

    def publish(self, size: int):
        """The first `size` entries as the arrays handed out (uploaded on the GPU)."""
        if not self.on_gpu:
            return self.host[:size]
        cupy = arrays.cupy_module()
        stream = cupy.cuda.get_current_stream()
        self.device.data.copy_from_host_async(self.host.ctypes.data, size * 4, stream)
        self.upload_done = stream.record()
        return self.device[:size]


class PagedKVCache:
    """Paged K/V cache of a whole model, with sequence bookkeeping. See docs/cache.md.

    num_layers, num_blocks, block_size, num_kv_heads, head_size: the storage shape; every layer
        has its own [num_blocks, num_kv_heads, block_size, head_size] K and V arrays.
    dtype: 'float16', 'bfloat16' or 'float32': the K/V rows written and the queries
        (numpy storage of bfloat16 is ml_dtypes.bfloat16).
    backend: 'gpu', 'numpy' or None (GPU when one is usable).
    enable_prefix_caching: name full blocks by a chained hash of their token ids, reuse them for
        later sequences with the same prefix, and keep freed ones until their space is needed.
    kv_format: None (store K/V as `dtype`), 'fp8_e4m3' (OCP e4m3fn) or 'fp8_e4m3fnuz' (AMD
        MI300). With fp8 the K/V arrays hold uint8 codes (half of float16's memory): `write`
        stores the code of x / scale of each element (round to nearest even, saturating; see
        cupa.fp8) and `decode` reads code value * scale. head_size must be a multiple of 16.
        cupa.fp8.default_kv_format(arch) names the format with hardware support on a GPU.
        `decode` of an fp8 cache takes the query dtypes cupa.decode's fp8 kernels serve
        (float16, bfloat16).
    k_scale, v_scale: fp8 only: one positive scale for all KV heads or a float32 array
        [num_kv_heads] (default 1). Kept as read-only float32 numpy arrays `k_scale`, `v_scale`.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_size: int, dtype="float16", *, backend=None,
                 enable_prefix_caching: bool = False, kv_format=None, k_scale=None,
                 v_scale=None):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("block_size", block_size), ("num_kv_heads", num_kv_heads),
                            ("head_size", head_size)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        self.dtype = dtype_name(dtype) if not isinstance(dtype, str) else dtype
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype: must be one of {tuple(STORAGE_DTYPES)}, got {dtype!r}")
        # kv_format equal to dtype is the plain cache too.
        self._fp8 = check_kv_format(None if kv_format == self.dtype else kv_format)
        if self._fp8 is None and (k_scale is not None or v_scale is not None):
            raise ValueError("k_scale, v_scale: only an fp8 kv_format has scales")
        storage = np.dtype(np.uint8 if self._fp8 else STORAGE_DTYPES[self.dtype])
        if (head_size * storage.itemsize) % 16:
            raise ValueError(f"head_size: rows of head_size x {storage.itemsize} bytes must be a "
                             f"multiple of 16 bytes (vectorised writes), got {head_size}")
        self.num_layers, self.num_blocks = int(num_layers), int(num_blocks)
        self.block_size, self.num_kv_heads = int(block_size), int(num_kv_heads)
        self.head_size = int(head_size)
        self.backend = resolve_backend(backend)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.kv_format = self._fp8.name if self._fp8 else None
        # Scales are fixed for the cache's life: the GPU write uses device copies of 1 / scale.
        self.k_scale = kv_scales(k_scale, self.num_kv_heads, "k_scale") if self._fp8 else None
        self.v_scale = kv_scales(v_scale, self.num_kv_heads, "v_scale") if self._fp8 else None
        for scale in (self.k_scale, self.v_scale):
            if scale is not None:
                scale.flags.writeable = False

        xp = arrays.cupy_module() if self.backend == "gpu" else np
        if self._fp8 and self.backend == "gpu":
            self._inv_scales = tuple(xp.asarray(np.float32(1) / s)
                                     for s in (self.k_scale, self.v_scale))
        shape = (self.num_layers, self.num_blocks, self.num_kv_heads, self.block_size,
                 self.head_size)
        self._storage_dtype = storage
        self._keys = xp.zeros(shape, dtype=storage)
        self._values = xp.zeros(shape, dtype=storage)
        bits = BIT_DTYPES[storage.itemsize]
        self._key_bits = self._keys.view(bits)
        self._value_bits = self._values.view(bits)
        self._allocator = BlockAllocator(self.num_blocks, self.block_size)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._table_buffers = _TableBuffers(self.backend == "gpu")
        self._write_launch = None

    # --- storage ---------------------------------------------------------------------------

    def key_cache(self, layer: int):
        """Layer `layer`'s keys: [num_blocks, num_kv_heads, block_size, head_size] (a view)."""
        return self._keys[self._check_layer(layer)]

    def value_cache(self, layer: int):
        """Layer `layer`'s values, shaped like `key_cache(layer)` (a view)."""
        return self._values[self._check_layer(layer)]

    @property
    def num_free_blocks(self) -> int:
        """Blocks new tokens can take: free ones plus evictable prefix-cached ones."""
        return self._allocator.num_available

    @property
    def num_cached_blocks(self) -> int:
        """Freed blocks kept for prefix reuse (counted in num_free_blocks)."""
        return self._allocator.num_evictable

    # --- sequences -------------------------------------------------------------------------

    @property
    def seq_ids(self) -> list:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def seq_len(self, seq_id) -> int:
        return self._get(seq_id).num_tokens

    def block_table(self, seq_id) -> np.ndarray:
        """The sequence's block ids, in order (a host copy)."""
        return self._on_device(seq_id, "read the block table of").blocks.copy()

    def is_swapped(self, seq_id) -> bool:
        return self._get(seq_id).swapped is not None

    def num_cached_tokens(self, seq_id) -> int:
        """Tokens of this sequence taken from the prefix cache (their K/V needed no prefill)."""
        return self._get(seq_id).cached_tokens

    def extend(self, seq_ids: Sequence, num_new_tokens, *, token_ids=None) -> np.ndarray:
        """Reserve cache slots for new tokens; returns their flat slots (int64, in `seq_ids` order).

        num_new_tokens: one int for all sequences, or one per sequence. Unknown ids are new,
        empty sequences. A shared partial last block (after `fork`) is copied first, in every
        layer, so the other sequences never see this one's tokens.

        token_ids: optional, one sequence of ints per sequence (len = its new tokens). With
        prefix caching on, leading full blocks already cached under the same prefix are reused;
        their slots come back as -1 (nothing to write) and `num_cached_tokens` counts them. The
        block holding a sequence's last new token is never reused, so at least one token is
        always computed. Reused blocks hold what their first writer wrote: write the K/V of
        reserved slots before decoding any sequence that may reuse them.

        Atomic: raises OutOfBlocksError (a MemoryError) and changes nothing when the blocks do
        not suffice.
        """
        seq_ids = list(seq_ids)
        counts = self._new_token_counts(seq_ids, num_new_tokens)
        tokens = self._new_token_ids(seq_ids, counts, token_ids)
        plans = self._plan_extend(seq_ids, counts, tokens)
        self._check_available(plans)

        # Revive every reused block before any allocation, so that no allocation evicts a block
        # another sequence of this call is about to reuse.
        for plan in plans:
            for block in plan.hits:
                self._allocator.incref(block)
        copies = []  # (source, destination) block pairs for copy-on-write
        slots = [self._commit_extend(plan, copies) for plan in plans]
        if copies:
            self._copy_blocks([s for s, _ in copies], [d for _, d in copies])
        return np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)

    def fork(self, parent_id, child_id):
        """A new sequence `child_id` sharing all of the parent's blocks (copy-on-write)."""
        parent = self._on_device(parent_id, "fork")
        if child_id in self._seqs:
            raise ValueError(f"child_id: sequence {child_id!r} already exists")
        for block in parent.blocks:
            self._allocator.incref(int(block))
        self._seqs[child_id] = parent.copy()

    def free(self, seq_id):
        """Drop a sequence; blocks nobody else uses become free (or evictable, when cached)."""
        seq = self._get(seq_id)
        del self._seqs[seq_id]
        if seq.swapped is None:
            self._release(seq)

    def swap_out(self, seq_id):
        """Copy the sequence's K/V (all layers) to host numpy arrays and release its blocks."""
        seq = self._on_device(seq_id, "swap out")
        ids = seq.blocks.astype(np.int64)
        seq.swapped = (self._gather_host(self._key_bits, ids),
                       self._gather_host(self._value_bits, ids))
        self._release(seq)

    def swap_in(self, seq_id):
        """Bring a swapped-out sequence back into fresh blocks (bit-exact). Atomic: raises
        OutOfBlocksError, and the sequence stays swapped out, when blocks do not suffice."""
        seq = self._get(seq_id)
        if seq.swapped is None:
            raise ValueError(f"seq_id: sequence {seq_id!r} is not swapped out")
        needed = seq.num_blocks
        if needed > self._allocator.num_available:
            raise OutOfBlocksError(f"swap_in({seq_id!r}) needs {needed} blocks, "
                                   f"{self._allocator.num_available} are free")
        ids = [self._allocator.allocate() for _ in range(needed)]
        host_keys, host_values = seq.swapped
        self._scatter(self._key_bits, ids, host_keys)
        self._scatter(self._value_bits, ids, host_values)
        for i, block in enumerate(ids):
            self._allocator.fill[block] = min(self.block_size,
                                              seq.num_tokens - i * self.block_size)
        seq.table = np.asarray(ids, dtype=np.int32)
        seq.swapped = None

    # --- writing and reading ---------------------------------------------------------------

    def write(self, layer: int, slots, key, value):
        """Store K/V rows [num_tokens, num_kv_heads, head_size] of layer `layer` at `slots`.

        Negative slots are padding and skipped. Host (numpy) slots are checked: each must be a
        reserved token of a block owned by exactly one sequence. Device slots are not read back
        (no synchronisation); the kernel skips any past the cache.
        """
        layer = self._check_layer(layer)
        key_view, value_view = arrays.host_view(key), arrays.host_view(value)
        slots_view = arrays.host_view(slots)
        num_tokens = self._check_rows(key_view, value_view, slots_view)
        if not arrays.is_device_array(slots):
            self._check_slots(np.asarray(slots))
        if num_tokens == 0:
            return
        if self.backend == "gpu":
            self._write_gpu(layer, slots, key, value, num_tokens)
        else:
            host_slots = arrays.to_host(slots).astype(np.int64)
            keep = host_slots >= 0
            blocks, offsets = np.divmod(host_slots[keep], self.block_size)
            key, value = arrays.to_host(key)[keep], arrays.to_host(value)[keep]
            if self._fp8:  # rows [tokens, heads, head_size]: one scale per head
                key = quantize_fp8(key, self._fp8, self.k_scale[:, None])
                value = quantize_fp8(value, self._fp8, self.v_scale[:, None])
            self._keys[layer][blocks, :, offsets] = key
            self._values[layer][blocks, :, offsets] = value

    def tables(self, seq_ids: Sequence, *, max_blocks: int | None = None):
        """(block_tables int32 [num_seqs, width], seq_lens int32 [num_seqs]) on the cache's device.

        width = max_blocks if given (a fixed width keeps shapes steady, e.g. for graph
        capture), else the longest table (at least 1); padding columns hold -1. The arrays are
        views of buffers reused by the next call: one host fill and one upload, no allocation
        once the buffers are large enough.
        """
        seqs = [self._on_device(seq_id, "read the tables of") for seq_id in seq_ids]
        n = len(seqs)
        longest = max((s.num_blocks for s in seqs), default=0)
        if max_blocks is None:
            width = max(longest, 1)
        elif max_blocks < max(longest, 1):
            raise ValueError(f"max_blocks: {max_blocks} is less than the longest table "
                             f"({longest} blocks)")
        else:
            width = int(max_blocks)
        host = self._table_buffers.host_buffer(n + n * width)
        host[:n] = [s.num_tokens for s in seqs]
        table = host[n:n + n * width].reshape(n, width)
        table.fill(-1)
        for row, seq in enumerate(seqs):
            table[row, :seq.num_blocks] = seq.blocks
        flat = self._table_buffers.publish(n + n * width)
        return flat[n:].reshape(n, width), flat[:n]

    def decode(self, layer: int, query, seq_ids: Sequence, *, new_tokens=None,
               **decode_kwargs):
        """`cupa.decode` of the sequences' newest tokens against this layer's cache.

        query [len(seq_ids), num_heads, head_size]: one new token per sequence; or, with
        new_tokens (an int for every sequence, or one count per sequence, 1 to 16 each), the
        sum(new_tokens) rows of multi-token decode, sequence by sequence: each sequence's last
        new_tokens tokens (already extended and written) attend causally to its cache.
        decode_kwargs go to `cupa.decode` (scale, alibi_slopes, sliding_window, out, return_lse,
        partition_size, stream, ...; query_start_loc may be passed instead of new_tokens). An
        fp8 cache passes its kv_format, k_scale and v_scale itself.
        """
        layer = self._check_layer(layer)
        seq_ids = list(seq_ids)
        if new_tokens is not None:
            if decode_kwargs.get("query_start_loc") is not None:
                raise ValueError("new_tokens and query_start_loc: give one of them")
            counts = np.asarray(new_tokens, dtype=np.int64).reshape(-1)
            if counts.size == 1:
                counts = np.repeat(counts, len(seq_ids))
            if counts.size != len(seq_ids):
                raise ValueError(f"new_tokens: {counts.size} counts for {len(seq_ids)} seq_ids")
            # cupa.decode checks the counts (1 to 16) and that each sequence holds them.
            decode_kwargs["query_start_loc"] = np.concatenate(
                [[0], np.cumsum(counts)]).astype(np.int32)
        shape = tuple(arrays.host_view(query).shape)
        if decode_kwargs.get("query_start_loc") is None and (
                len(shape) != 3 or shape[0] != len(seq_ids)):
            raise ValueError(f"query: expected shape [len(seq_ids)={len(seq_ids)}, num_heads, "
                             f"head_size] (or pass new_tokens for several per sequence), got "
                             f"{shape}")
        owned = sorted({"kv_format", "k_scale", "v_scale"} & set(decode_kwargs))
        if owned:
            raise ValueError(f"{', '.join(owned)}: set by the cache (constructor arguments), "
                             f"not per decode call")
        if self._fp8:
            decode_kwargs.update(kv_format=self.kv_format, k_scale=self.k_scale,
                                 v_scale=self.v_scale)
        block_tables, seq_lens = self.tables(seq_ids)
        decode_kwargs.setdefault(
            "max_seq_len", max((self._seqs[s].num_tokens for s in seq_ids), default=0))
        return decode(query, self._keys[layer], self._values[layer], block_tables, seq_lens,
                       backend=self.backend, **decode_kwargs)

    # --- internals: lookups and checks -----------------------------------------------------

    def _check_layer(self, layer) -> int:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def _get(self, seq_id) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown sequence id {seq_id!r} (never extended, or already "
                           f"freed)") from None

    def _on_device(self, seq_id, action: str) -> _Sequence:
        seq = self._get(seq_id)
        if seq.swapped is not None:
            raise ValueError(f"cannot {action} sequence {seq_id!r}: it is swapped out "
                             f"(call swap_in({seq_id!r}) first)")
        return seq

    def _check_rows(self, key, value, slots) -> int:
        expected = ("num_tokens", self.num_kv_heads, self.head_size)
        for name, rows in (("key", key), ("value", value)):
            if rows.ndim != 3 or tuple(rows.shape[1:]) != expected[1:]:
                raise ValueError(f"{name}: expected shape [num_tokens, {self.num_kv_heads}, "
                                 f"{self.head_size}], got {tuple(rows.shape)}")
            if dtype_name(rows.dtype) != self.dtype:
                raise ValueError(f"{name}: dtype must be the cache's {self.dtype}, got "
                                 f"{dtype_name(rows.dtype)}")
        if tuple(value.shape) != tuple(key.shape):
            raise ValueError(f"value: shape {tuple(value.shape)} must equal key's "
                             f"{tuple(key.shape)}")
        if slots.ndim != 1 or slots.shape[0] != key.shape[0]:
            raise ValueError(f"slots: expected shape [{key.shape[0]}] (one per key row), got "
                             f"{tuple(slots.shape)}")
        if np.dtype(slots.dtype).kind not in "iu":
            raise ValueError(f"slots: must be an integer array, got {dtype_name(slots.dtype)}")
        return int(key.shape[0])

    def _check_slots(self, slots: np.ndarray):
        """Each non-negative slot: inside the cache, reserved, in a block no one else shares,
        and written once."""
        slots = slots.astype(np.int64)
        index = np.flatnonzero(slots >= 0)
        if index.size == 0:
            return
        used = slots[index]
        blocks, offsets = np.divmod(used, self.block_size)
        inside = blocks < self.num_blocks
        refcount = np.where(inside, self._allocator.refcount[np.minimum(blocks,
                                                                        self.num_blocks - 1)], 0)
        fill = np.where(inside, self._allocator.fill[np.minimum(blocks, self.num_blocks - 1)], 0)
        bad = ~inside | (refcount < 1) | (offsets >= fill) | (refcount > 1)
        if bad.any():
            i = int(np.argmax(bad))
            slot, block = int(used[i]), int(blocks[i])
            if not inside[i]:
                why = f"past the cache ({self.num_blocks} blocks x {self.block_size})"
            elif refcount[i] > 1:
                why = (f"block {block} is shared by {int(refcount[i])} sequences (write only "
                       f"slots returned by extend)")
            else:
                why = (f"not reserved: block {block} holds {int(fill[i])} reserved tokens "
                       f"(write at most the tokens extend reserved)")
            raise ValueError(f"slots[{int(index[i])}] = {slot}: {why}")
        unique, counts = np.unique(used, return_counts=True)
        if (counts > 1).any():
            slot = int(unique[np.argmax(counts > 1)])
            raise ValueError(f"slots: slot {slot} appears more than once")

    def _new_token_counts(self, seq_ids, num_new_tokens) -> list[int]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("seq_ids: each sequence may appear only once per call")
        for seq_id in seq_ids:
            if seq_id in self._seqs and self._seqs[seq_id].swapped is not None:
                self._on_device(seq_id, "extend")
        if isinstance(num_new_tokens, (int, np.integer)):
            counts = [int(num_new_tokens)] * len(seq_ids)
        else:
            counts = [int(n) for n in num_new_tokens]
            if len(counts) != len(seq_ids):
                raise ValueError(f"num_new_tokens: {len(counts)} counts for {len(seq_ids)} "
                                 f"seq_ids")
        if any(n < 0 for n in counts):
            raise ValueError(f"num_new_tokens: must be >= 0, got {counts}")
        return counts

    def _new_token_ids(self, seq_ids, counts, token_ids):
        if token_ids is None:
            return [None] * len(seq_ids)
        token_ids = [None if t is None else [int(x) for x in t] for t in token_ids]
        if len(token_ids) != len(seq_ids):
            raise ValueError(f"token_ids: {len(token_ids)} lists for {len(seq_ids)} seq_ids")
        for seq_id, n, tokens in zip(seq_ids, counts, token_ids):
            if tokens is not None and len(tokens) != n:
                raise ValueError(f"token_ids: sequence {seq_id!r} has {len(tokens)} token ids "
                                 f"for {n} new tokens")
        return token_ids

    # --- internals: extend -----------------------------------------------------------------

    def _plan_extend(self, seq_ids, counts, tokens) -> list[_ExtendPlan]:
        """Work out COW copies, prefix hits and fresh blocks without changing anything."""
        bs = self.block_size
        refcount_change: dict[int, int] = {}
        plans = []
        for seq_id, n, new_tokens in zip(seq_ids, counts, tokens):
            plan = _ExtendPlan(seq_id, n, new_tokens)
            plans.append(plan)
            seq = self._seqs.get(seq_id)
            length = seq.num_tokens if seq else 0
            have = seq.num_blocks if seq else 0
            if n == 0:
                continue
            if length % bs and seq is not None:
                last = int(seq.blocks[-1])
                users = int(self._allocator.refcount[last]) + refcount_change.get(last, 0)
                if users > 1:  # earlier sequences of this call may already have copied it
                    plan.cow = True
                    refcount_change[last] = refcount_change.get(last, 0) - 1
            chain = seq.pending if seq else []
            if self.enable_prefix_caching and new_tokens is not None and chain is not None:
                parent = seq.parent_hash if seq else ROOT_HASH
                plan.full_hashes = _full_block_hashes(parent, chain, new_tokens, bs)
                if length % bs == 0:
                    # Only blocks before the one holding the last new token may be reused.
                    for digest in plan.full_hashes[:(n - 1) // bs]:
                        block = self._allocator.lookup(digest)
                        if block is None:
                            break
                        plan.hits.append(block)
            plan.fresh = -(-(length + n) // bs) - have - len(plan.hits)
        return plans

    def _check_available(self, plans):
        revived = {b for p in plans for b in p.hits if self._allocator.is_evictable(b)}
        needed = sum(p.fresh + p.cow for p in plans) + len(revived)
        if needed > self._allocator.num_available:
            raise OutOfBlocksError(f"extend needs {needed} blocks, {self._allocator.num_available}"
                                   f" are free (nothing was changed)")

    def _commit_extend(self, plan: _ExtendPlan, copies: list) -> np.ndarray:
        bs = self.block_size
        seq = self._seqs.get(plan.seq_id)
        if seq is None:
            seq = self._seqs[plan.seq_id] = _Sequence(table=np.empty(4, dtype=np.int32))
        if plan.num_new == 0:
            return np.empty(0, dtype=np.int64)
        alloc = self._allocator
        if plan.cow:
            source = int(seq.blocks[-1])
            copy = alloc.allocate()
            alloc.fill[copy] = alloc.fill[source]
            alloc.decref(source)
            seq.table[seq.num_blocks - 1] = copy
            copies.append((source, copy))
        seq.append_blocks(plan.hits)
        seq.append_blocks([alloc.allocate() for _ in range(plan.fresh)])

        start, end = seq.num_tokens, seq.num_tokens + plan.num_new
        positions = np.arange(start, end, dtype=np.int64)
        block_index = positions // bs
        slots = seq.table[block_index].astype(np.int64) * bs + positions % bs
        cached = len(plan.hits) * bs
        slots[:cached] = -1  # reused tokens: their K/V is already there
        # Reserved tokens per touched block.
        touched = np.unique(block_index)
        fills = np.minimum(end - touched * bs, bs)
        alloc.fill[seq.table[touched]] = fills
        seq.num_tokens = end
        seq.cached_tokens += cached
        self._advance_hash_chain(seq, plan, first_block=start // bs)
        return slots

    def _advance_hash_chain(self, seq: _Sequence, plan: _ExtendPlan, first_block: int):
        """Index the blocks this extend filled and keep the partial block's token ids."""
        if not self.enable_prefix_caching:
            return
        if plan.tokens is None or seq.pending is None:
            seq.pending = None  # a token id is unknown: later blocks cannot be named
            return
        # `pending` starts at a block boundary, so blocks complete every block_size tokens.
        for i, digest in enumerate(plan.full_hashes):
            self._allocator.register(int(seq.table[first_block + i]), digest)
            seq.parent_hash = digest
        tokens = seq.pending + plan.tokens
        seq.pending = tokens[len(plan.full_hashes) * self.block_size:]

    def _release(self, seq: _Sequence):
        # Tail first, so that among a sequence's cached blocks the later ones (least likely to be
        # a shared prefix) are evicted first.
        for block in seq.blocks[::-1]:
            self._allocator.decref(int(block))

    # --- internals: block data -------------------------------------------------------------

    def _copy_blocks(self, sources, destinations):
        """Copy whole blocks (K and V, all layers)."""
        xp = arrays.cupy_module() if self.backend == "gpu" else np
        src = xp.asarray(np.asarray(sources, dtype=np.int64))
        dst = xp.asarray(np.asarray(destinations, dtype=np.int64))
        for bits in (self._key_bits, self._value_bits):
            bits[:, dst] = bits[:, src]

    def _gather_host(self, bits, ids: np.ndarray) -> np.ndarray:
        if self.backend == "gpu":
            gathered = bits[:, arrays.cupy_module().asarray(ids)].get()
        else:
            gathered = bits[:, ids]
        return gathered.view(self._storage_dtype)

    def _scatter(self, bits, ids, host: np.ndarray):
        host_bits = host.view(bits.dtype)
        if self.backend == "gpu":
            cupy = arrays.cupy_module()
            bits[:, cupy.asarray(np.asarray(ids, dtype=np.int64))] = cupy.asarray(host_bits)
        else:
            bits[:, np.asarray(ids, dtype=np.int64)] = host_bits

    def _write_gpu(self, layer, slots, key, value, num_tokens):
        cupy = arrays.cupy_module()
        slots = arrays.to_device(slots)
        if slots.dtype != np.int64:
            slots = slots.astype(np.int64)
        key, value = _aligned_rows(arrays.to_device(key)), _aligned_rows(arrays.to_device(value))
        if self._write_launch is None:  # prepared once per cache (the kernel is compiled here)
            from ..gpu.launch import CacheWriteLaunch
            self._write_launch = CacheWriteLaunch(
                self.dtype, self.kv_format, num_kv_heads=self.num_kv_heads,
                head_size=self.head_size, block_size=self.block_size,
                num_blocks=self.num_blocks, storage_itemsize=self._storage_dtype.itemsize,
                device_index=self._keys.device.id)
        item = key.itemsize
        strides = (key.strides[0] // item, key.strides[1] // item,
                   value.strides[0] // item, value.strides[1] // item)
        fp8_tail = ()
        if self._fp8:
            fp8_tail = (self._inv_scales[0].data.ptr, self._inv_scales[1].data.ptr,
                        self._fp8.kernel_id)
        layer_offset = layer * self._keys.strides[0]  # no per-call views of the layer
        pointers = (key.data.ptr, value.data.ptr, self._keys.data.ptr + layer_offset,
                    self._values.data.ptr + layer_offset, slots.data.ptr)
        self._write_launch(pointers, strides, num_tokens,
                           cupy.cuda.get_current_stream().ptr, fp8_tail)


def _aligned_rows(rows):
    """`rows` itself when every head row is contiguous and 16-byte aligned, else a copy."""
    ok = (rows.strides[2] == rows.itemsize and rows.data.ptr % 16 == 0
          and rows.strides[0] % 16 == 0 and rows.strides[1] % 16 == 0)
    if ok or rows.shape[0] == 0:
        return rows
    return arrays.cupy_module().ascontiguousarray(rows)


def _full_block_hashes(parent: bytes, pending: list, new_tokens: list, block_size: int) -> list:
    """Chained hashes of every block completed by appending `new_tokens` after `pending`."""
    tokens = pending + new_tokens
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes
