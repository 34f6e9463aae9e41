"""`cupa.PagedKVCache`: paged K/V storage for every layer, plus the sequences that use it.

Storage is two arrays (K and V) of shape [num_layers, num_blocks, num_kv_heads, block_size,
head_size] on the cache's device (cupy) or host (numpy), of `dtype` or, with an fp8 `kv_format`,
of uint8 fp8 codes with per-KV-head scales (cupa.fp8). A block id names the same block in every
layer, so one block table serves all layers and block copies (copy-on-write, swap) move all layers
at once.

This module owns the data: the K/V arrays, writes, block copies, the host copies of swapped-out
sequences, the buffers behind `tables()` and the call into `cupa.decode`. Which blocks each
sequence holds, and when blocks are shared, copied or reused, is decided by
`cupa.cache.sequences.SequenceTable` (free list, reference counts and prefix hashes are in
`cupa.cache.blocks`).

Every public method validates all of its arguments before changing anything, so an error leaves
the cache exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .. import arrays
from ..api import decode, resolve_backend
from ..fp8 import check_kv_format, kv_scales, quantize_fp8
from ..problem import (MAX_QUERY_LEN, STORAGE_DTYPES, SUPPORTED_BLOCK_SIZES,
                       SUPPORTED_HEAD_SIZES)
from ..validation import check_is_array, dtype_name
from .blocks import OutOfBlocksError
from .sequences import DecodeBatch, SequenceRecord, SequenceTable

# Same-size unsigned integers: block copies move raw bits, which is exact for every dtype and
# needs no bfloat16 support from the array library's copy kernels.
BIT_DTYPES = {2: np.uint16, 4: np.uint32, 1: np.uint8}

# Block tables are int32 (cupa.decode's block_tables): block ids must fit.
MAX_NUM_BLOCKS = 2**31 - 1

__all__ = ["PagedKVCache", "OutOfBlocksError"]


class _TableBuffers:
    """Persistent host + device int32 buffers behind `tables()`: [seq_lens | block tables].

    Reused across calls and grown only when too small, so a steady decode loop allocates
    nothing. The host side is pinned when cupy allows it, making the one upload per call
    asynchronous. Two host buffers take turns, each guarded by an event against being refilled
    before its upload has read it: a call waits for the upload of the call before last, not for
    the last one, which a host running ahead of the GPU would wait for on every call. What a
    call costs on the host is one upload and one event record: the events, the buffers'
    addresses and the views handed out for a (rows, width) are kept. The numpy backend's
    tables are views of its one host buffer.
    """

    GPU_HOST_BUFFERS = 2

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.device = None
        count = self.GPU_HOST_BUFFERS if on_gpu else 1
        self._hosts = [np.empty(0, dtype=np.int32) for _ in range(count)]
        self._host_ptrs = [0] * count
        self._uploads_done = [None] * count  # an event per host buffer, once it has uploaded
        self._turn = 0  # the host buffer of the latest host_buffer()
        self._views: dict = {}  # (rows, width) -> (tables, lens) views of `device`

    def host_buffer(self, size: int) -> np.ndarray:
        """The next host buffer, at least `size` entries, once its previous upload has read it."""
        turn = self._turn = (self._turn + 1) % len(self._hosts)
        if self._uploads_done[turn] is not None:
            self._uploads_done[turn].synchronize()
        if size > len(self._hosts[turn]):
            capacity = max(size, 2 * len(self._hosts[turn]), 256)
            self._hosts[turn] = self._new_host(capacity)
            self._host_ptrs[turn] = self._hosts[turn].ctypes.data
        held = 0 if self.device is None else len(self.device)
        if self.on_gpu and size > held:
            capacity = max(size, 2 * held, 256)
            self.device = arrays.cupy_module().empty(capacity, dtype=np.int32)
            self._views.clear()
        return self._hosts[turn]

    def _new_host(self, capacity: int) -> np.ndarray:
        if self.on_gpu:
            try:
                import cupyx
                return cupyx.empty_pinned((capacity,), dtype=np.int32)
            except Exception:  # pinned memory is an optimisation only
                pass
        return np.empty(capacity, dtype=np.int32)

    def publish(self, rows: int, width: int):
        """(tables [rows, width], lens [rows]) of the latest host buffer's first entries, [lens |
        tables] (uploaded on the GPU)."""
        size = rows + rows * width
        turn = self._turn
        if not self.on_gpu:
            host = self._hosts[turn]
            return host[rows:size].reshape(rows, width), host[:rows]
        cupy = arrays.cupy_module()
        stream = cupy.cuda.get_current_stream()
        self.device.data.copy_from_host_async(self._host_ptrs[turn], size * 4, stream)
        done = self._uploads_done[turn]
        if done is None:
            done = self._uploads_done[turn] = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        views = self._views.get((rows, width))
        if views is None:
            views = self._views[(rows, width)] = (
                self.device[rows:size].reshape(rows, width), self.device[:rows])
        return views


class PagedKVCache:
    """Paged K/V cache of a whole model, with sequence bookkeeping. See docs/cache.md.

    num_layers, num_blocks, block_size, num_kv_heads, head_size: the storage shape; every layer
        has its own [num_blocks, num_kv_heads, block_size, head_size] K and V arrays.
        head_size must be one of cupa.problem.SUPPORTED_HEAD_SIZES and block_size one of
        SUPPORTED_BLOCK_SIZES: the shapes `decode` serves.
    dtype: 'float16', 'bfloat16' or 'float32': the K/V rows written and the queries
        (numpy storage of bfloat16 is ml_dtypes.bfloat16).
    backend: 'gpu', 'numpy' or None (GPU when one is usable).
    enable_prefix_caching: name full blocks by a chained hash of their token ids (and the
        sequence's salt, see `extend`), reuse them for later sequences with the same prefix, and
        keep freed ones until their space is needed.
    kv_format: None (store K/V as `dtype`), 'fp8_e4m3' (OCP e4m3fn) or 'fp8_e4m3fnuz' (AMD
        MI300). With fp8 the K/V arrays hold uint8 codes (half of float16's memory): `write`
        stores the code of x / scale of each element (round to nearest even, saturating; see
        cupa.fp8) and `decode` reads code value * scale. head_size must be a multiple of 16.
        cupa.fp8.default_kv_format(arch) names the format with hardware support on a GPU.
        `decode` of an fp8 cache takes the query dtypes cupa.decode's fp8 kernels serve
        (float16, bfloat16), whatever the dtype of the rows written (float32 rows are
        quantised like the others).
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
        if num_blocks > MAX_NUM_BLOCKS:
            raise ValueError(f"num_blocks: block tables are int32, so at most {MAX_NUM_BLOCKS}, "
                             f"got {num_blocks}")
        # decode serves only these shapes: refuse now rather than at the first decode.
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(f"head_size: must be one of {SUPPORTED_HEAD_SIZES} (what decode "
                             f"serves), got {head_size}")
        if block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size: must be one of {SUPPORTED_BLOCK_SIZES} (what decode "
                             f"serves), got {block_size}")
        self.dtype = _storage_dtype_name(dtype)
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
        self._sequences = SequenceTable(self.num_blocks, self.block_size,
                                        self.enable_prefix_caching)
        # The pool's allocator, owned by the sequence table; named here for inspection (tests).
        self._allocator = self._sequences.allocator
        self._host_copies: dict = {}  # seq_id -> (host keys, host values) while swapped out
        self._table_buffers = _TableBuffers(self.backend == "gpu")
        self._write_launch = None
        self._repeat_write: _RepeatWrite | None = None  # the latest GPU write's layout

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
        return self._sequences.num_available_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Freed blocks kept for prefix reuse (counted in num_free_blocks)."""
        return self._sequences.num_evictable_blocks

    # --- sequences -------------------------------------------------------------------------

    @property
    def seq_ids(self) -> list:
        return self._sequences.ids

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._sequences

    def seq_len(self, seq_id) -> int:
        return self._sequences.get(seq_id).num_tokens

    def block_table(self, seq_id) -> np.ndarray:
        """The sequence's block ids, in order (a host copy)."""
        return self._sequences.on_device(seq_id, "read the block table of").blocks.copy()

    def is_swapped(self, seq_id) -> bool:
        return self._sequences.get(seq_id).swapped

    def num_cached_tokens(self, seq_id) -> int:
        """Tokens of this sequence taken from the prefix cache (their K/V needed no prefill)."""
        return self._sequences.get(seq_id).cached_tokens

    def extend(self, seq_ids: Sequence, num_new_tokens, *, token_ids=None,
               salts=None) -> np.ndarray:
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

        salts: optional, one salt per sequence (bytes, str as UTF-8, or None), e.g. a tenant id.
        It is folded into the root of the sequence's prefix-hash chain, so blocks are shared
        only between sequences of equal salts (no salt is a salt of its own). It takes effect
        when the sequence is created (its first extend, or fork from a salted parent); later
        calls may repeat it or pass None, a different salt is a ValueError.

        Atomic: raises OutOfBlocksError (a MemoryError) and changes nothing when the blocks do
        not suffice.
        """
        seq_ids = _seq_id_list(seq_ids)
        if salts is None and type(num_new_tokens) is int and num_new_tokens == 1:
            # A decode step: the common case, kept cheap.
            slots = self._sequences.extend_by_one(seq_ids, token_ids)
            if slots is not None:
                return slots
        plan = self._sequences.plan_extend(seq_ids, num_new_tokens, token_ids, salts)
        slots, copies = self._sequences.commit_extend(plan)
        if copies:
            self._copy_blocks([s for s, _ in copies], [d for _, d in copies])
        return slots

    def fork(self, parent_id, child_id):
        """A new sequence `child_id` sharing all of the parent's blocks (copy-on-write)."""
        self._sequences.fork(parent_id, child_id)

    def free(self, seq_id):
        """Drop a sequence; blocks nobody else uses become free (or evictable, when cached)."""
        self._sequences.free(seq_id)
        self._host_copies.pop(seq_id, None)

    def swap_out(self, seq_id):
        """Copy the sequence's K/V (all layers) to host numpy arrays and release its blocks."""
        ids = self._sequences.on_device(seq_id, "swap out").blocks.astype(np.int64)
        host = (self._gather_host(self._key_bits, ids), self._gather_host(self._value_bits, ids))
        self._sequences.swap_out(seq_id)
        self._host_copies[seq_id] = host

    def swap_in(self, seq_id):
        """Bring a swapped-out sequence back into fresh blocks (bit-exact). Atomic: raises
        OutOfBlocksError, and the sequence stays swapped out, when blocks do not suffice."""
        ids = self._sequences.swap_in(seq_id)
        host_keys, host_values = self._host_copies.pop(seq_id)
        self._scatter(self._key_bits, ids, host_keys)
        self._scatter(self._value_bits, ids, host_values)

    # --- writing and reading ---------------------------------------------------------------

    def write(self, layer: int, slots, key, value):
        """Store K/V rows [num_tokens, num_kv_heads, head_size] of layer `layer` at `slots`.

        Negative slots are padding and skipped. Host (numpy) slots are checked: each must be a
        reserved token of a block owned by exactly one sequence. Device slots are not read back
        (no synchronisation); the kernel skips any past the cache.
        """
        repeat = self._repeat_write
        if repeat is not None and type(layer) is int and 0 <= layer < self.num_layers \
                and repeat.layout == _write_layout(repeat.array_type, slots, key, value):
            # cupy arrays laid out as in the previous GPU write: they pass the same checks and
            # take the same launch; only the pointers are new (and the rows' alignment).
            key_ptr, value_ptr = key.data.ptr, value.data.ptr
            if not (key_ptr | value_ptr) % 16:
                offset = layer * repeat.layer_bytes
                repeat.launch((key_ptr, value_ptr, repeat.keys_ptr + offset,
                               repeat.values_ptr + offset, slots.data.ptr),
                              repeat.current_stream().ptr)
                return
        layer = self._check_layer(layer)
        for name, x in (("slots", slots), ("key", key), ("value", value)):
            check_is_array(name, x)
        key_view, value_view = arrays.host_view(key), arrays.host_view(value)
        slots_view = arrays.host_view(slots)
        num_tokens = self._check_rows(key_view, value_view, slots_view)
        if not arrays.is_device_array(slots):
            self._sequences.check_writable_slots(np.asarray(slots))
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
        batch = self._sequences.decode_batch(_seq_id_list(seq_ids), "read the tables of")
        return self._publish_tables(batch, max_blocks)

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
        check_is_array("query", query)
        seq_ids = _seq_id_list(seq_ids)
        owned = sorted({"kv_format", "k_scale", "v_scale"} & set(decode_kwargs))
        if owned:
            raise ValueError(f"{', '.join(owned)}: set by the cache (constructor arguments), "
                             f"not per decode call")
        seqs = [self._sequences.on_device(seq_id, "decode") for seq_id in seq_ids]
        rows = len(seq_ids)
        if new_tokens is not None:
            if decode_kwargs.get("query_start_loc") is not None:
                raise ValueError("new_tokens and query_start_loc: give one of them")
            counts = self._new_token_counts(new_tokens, seq_ids, seqs)
            decode_kwargs["query_start_loc"] = np.concatenate(
                [[0], np.cumsum(counts)]).astype(np.int32)
            rows = int(counts.sum())
        query_view = arrays.host_view(query)
        if decode_kwargs.get("query_start_loc") is None or new_tokens is not None:
            self._check_query(query_view, rows, new_tokens is not None)
        block_tables, seq_lens = self._publish_tables(
            self._sequences.decode_batch(seq_ids, "decode"), None)
        if self._fp8:
            decode_kwargs.update(kv_format=self.kv_format, k_scale=self.k_scale,
                                 v_scale=self.v_scale)
        decode_kwargs.setdefault("max_seq_len", max((s.num_tokens for s in seqs), default=0))
        return decode(query, self._keys[layer], self._values[layer], block_tables, seq_lens,
                       backend=self.backend, **decode_kwargs)

    # --- internals: checks -----------------------------------------------------------------

    def _check_layer(self, layer) -> int:
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool) \
                or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer: must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

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

    def _check_query(self, query, rows: int, multi_token: bool):
        """Shape (and, for a plain cache, dtype) of a decode query, named in the cache's terms
        before cupa.decode would name them in terms of key_cache."""
        shape = tuple(query.shape)
        if len(shape) != 3 or shape[0] != rows or shape[2] != self.head_size \
                or shape[1] < 1 or shape[1] % self.num_kv_heads:
            first = "sum(new_tokens)" if multi_token else "len(seq_ids)"
            hint = "" if multi_token else " (or pass new_tokens for several per sequence)"
            raise ValueError(f"query: expected shape [{first}={rows}, num_heads (a multiple of "
                             f"num_kv_heads={self.num_kv_heads}), head_size={self.head_size}]"
                             f"{hint}, got {shape}")
        if self._fp8 is None and dtype_name(query.dtype) != self.dtype:
            raise ValueError(f"query: dtype must be the cache's {self.dtype}, got "
                             f"{dtype_name(query.dtype)}")

    @staticmethod
    def _new_token_counts(new_tokens, seq_ids, seqs: list[SequenceRecord]) -> np.ndarray:
        """new_tokens as one count per sequence, each 1..MAX_QUERY_LEN and at most the tokens
        the sequence holds."""
        counts = np.asarray(new_tokens)
        if counts.dtype.kind not in "iu" or counts.ndim > 1:
            raise ValueError(f"new_tokens: expected an int or one int per seq_id, got "
                             f"{new_tokens!r}")
        counts = counts.astype(np.int64).reshape(-1)
        if counts.size == 1:
            counts = np.repeat(counts, len(seq_ids))
        if counts.size != len(seq_ids):
            raise ValueError(f"new_tokens: {counts.size} counts for {len(seq_ids)} seq_ids")
        for i, (seq_id, seq, n) in enumerate(zip(seq_ids, seqs, counts.tolist())):
            if not 1 <= n <= MAX_QUERY_LEN:
                raise ValueError(f"new_tokens[{i}]: each sequence decodes 1 to {MAX_QUERY_LEN} "
                                 f"new tokens, got {n}")
            if n > seq.num_tokens:
                raise ValueError(f"new_tokens[{i}]: {n} new tokens but sequence {seq_id!r} "
                                 f"holds {seq.num_tokens} (extend and write them first)")
        return counts

    # --- internals: tables -----------------------------------------------------------------

    def _publish_tables(self, batch: DecodeBatch, max_blocks):
        """The batch's [seq_lens | tables] copied into the table buffers in one go (padded to
        max_blocks columns when given) and published."""
        n, width = len(batch.records), batch.width  # width = max(longest table, 1)
        if max_blocks is not None:
            if not isinstance(max_blocks, (int, np.integer)) or isinstance(max_blocks, bool):
                raise ValueError(f"max_blocks: must be an int or None, got {max_blocks!r}")
            if max_blocks < width:
                longest = max((s.num_blocks for s in batch.records), default=0)
                raise ValueError(f"max_blocks: {max_blocks} is less than the longest table "
                                 f"({longest} blocks)")
            width = int(max_blocks)
        host = self._table_buffers.host_buffer(n + n * width)
        if width == batch.width:
            host[:len(batch.packed)] = batch.packed
        else:
            host[:n] = batch.lens
            table = host[n:n + n * width].reshape(n, width)
            table[:, batch.width:] = -1
            table[:, :batch.width] = batch.table
        return self._table_buffers.publish(n, width)

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
        device_slots = arrays.to_device(slots)
        if device_slots.dtype != np.int64 or not device_slots.flags.c_contiguous:
            # The kernel reads int64 slots one after another.
            device_slots = cupy.ascontiguousarray(device_slots, dtype=np.int64)
        rows = _aligned_rows(arrays.to_device(key)), _aligned_rows(arrays.to_device(value))
        if self._write_launch is None:  # prepared once per cache (the kernel is compiled here)
            from ..gpu.launch import CacheWriteLaunch
            self._write_launch = CacheWriteLaunch(
                self.dtype, self.kv_format, num_kv_heads=self.num_kv_heads,
                head_size=self.head_size, block_size=self.block_size,
                num_blocks=self.num_blocks, storage_itemsize=self._storage_dtype.itemsize,
                device_index=self._keys.device.id)
        item = rows[0].itemsize
        strides = (rows[0].strides[0] // item, rows[0].strides[1] // item,
                   rows[1].strides[0] // item, rows[1].strides[1] // item)
        fp8_tail = ()
        if self._fp8:
            fp8_tail = (self._inv_scales[0].data.ptr, self._inv_scales[1].data.ptr,
                        self._fp8.kernel_id)
        launch = self._write_launch.prepared(strides, num_tokens, fp8_tail)
        layer_bytes = self._keys.strides[0]  # no per-call views of the layer
        repeat = _RepeatWrite(_write_layout(cupy.ndarray, slots, key, value), cupy.ndarray,
                              launch, self._keys.data.ptr, self._values.data.ptr, layer_bytes,
                              cupy.cuda.get_current_stream)
        offset = layer * layer_bytes
        launch((rows[0].data.ptr, rows[1].data.ptr, repeat.keys_ptr + offset,
                repeat.values_ptr + offset, device_slots.data.ptr),
               repeat.current_stream().ptr)
        # Kept only where the caller's own arrays were used as they are: another write of that
        # layout then needs neither a conversion nor a copy.
        if repeat.layout is not None and device_slots is slots and rows[0] is key \
                and rows[1] is value:
            self._repeat_write = repeat


@dataclass(frozen=True)
class _RepeatWrite:
    """What a GPU write of one layout of arrays checked and prepared, for the next write of the
    same layout (a decode step writes each layer's rows alike): the launch and the addresses of
    the storage. `layout` is `_write_layout` of the arrays written."""

    layout: tuple
    array_type: type          # cupy.ndarray
    launch: object            # cupa.gpu.driver.PreparedLaunch
    keys_ptr: int
    values_ptr: int
    layer_bytes: int
    current_stream: object    # cupy.cuda.get_current_stream


def _write_layout(array_type, slots, key, value) -> tuple | None:
    """Everything `write`'s checks and launch read of its arrays besides their pointers: shape,
    strides and dtype of each; None unless all three are of `array_type` itself."""
    if type(key) is not array_type or type(value) is not array_type \
            or type(slots) is not array_type:
        return None
    return (key.shape, key.strides, key.dtype, value.shape, value.strides, value.dtype,
            slots.shape, slots.strides, slots.dtype)


def _aligned_rows(rows):
    """`rows` itself when every head row is contiguous and 16-byte aligned, else a copy."""
    ok = (rows.strides[2] == rows.itemsize and rows.data.ptr % 16 == 0
          and rows.strides[0] % 16 == 0 and rows.strides[1] % 16 == 0)
    if ok or rows.shape[0] == 0:
        return rows
    return arrays.cupy_module().ascontiguousarray(rows)


def _storage_dtype_name(dtype) -> str:
    """The cache dtype's name, checked against STORAGE_DTYPES."""
    try:
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    except TypeError:  # not a dtype at all
        name = None
    if name not in STORAGE_DTYPES:
        raise ValueError(f"dtype: must be one of {tuple(STORAGE_DTYPES)}, got {dtype!r}")
    return name


def _seq_id_list(seq_ids) -> list:
    """seq_ids as a list. A lone str or bytes is refused: iterating it would make one sequence
    per character."""
    if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__iter__"):
        raise TypeError(f"seq_ids: expected a list of sequence ids, got "
                        f"{type(seq_ids).__name__} {seq_ids!r}")
    return list(seq_ids)
