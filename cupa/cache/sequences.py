"""Sequence bookkeeping of the paged KV cache: which blocks each sequence holds, how `extend`,
`fork`, `free` and swapping change that, and the prefix-hash chain that names full blocks.

No K/V data lives here. `SequenceTable` answers "which slots do these new tokens get", "which
blocks must be copied first (copy-on-write)" and "which blocks can a write touch";
`cupa.cache.paged.PagedKVCache` moves the data accordingly.

Every method that changes something checks all of its arguments first, so an error leaves the
table (and its allocator) exactly as it was. `extend` is split in two for that reason:
`plan_extend` validates and works everything out without changing anything, `commit_extend`
applies the plan.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from .blocks import ROOT_HASH, BlockAllocator, OutOfBlocksError, block_hash

# blake2b personalisation of salted roots: keeps them apart from every block hash by
# construction, not only by the improbability of a collision.
SALT_PERSON = b"cupa-cache-salt"


def root_hash(salt: bytes | None) -> bytes:
    """Parent hash of a sequence's first block: the shared root without a salt, else a root of
    that salt alone, so sequences with different salts never name a block alike."""
    if salt is None:
        return ROOT_HASH
    return hashlib.blake2b(salt, digest_size=16, person=SALT_PERSON).digest()


def full_block_hashes(parent: bytes, pending: list, new_tokens: list, block_size: int) -> list:
    """Chained hashes of every block completed by appending `new_tokens` after `pending` (the
    token ids of the partial block that follows the block hashed as `parent`)."""
    tokens = pending + new_tokens
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


@dataclass
class SequenceRecord:
    """One sequence's view of the cache. Read its fields; change it only through the table."""

    table: np.ndarray             # int32 block ids; the first `num_blocks` entries are used
    num_blocks: int = 0
    num_tokens: int = 0           # reserved tokens (= seq_len)
    # Prefix-hash chain: hash of the last full block and the token ids of the partial block after
    # it. `pending` is None once a token id is unknown (extended without token_ids): from then on
    # the sequence's blocks cannot be named by content.
    parent_hash: bytes = ROOT_HASH
    pending: list | None = field(default_factory=list)
    cached_tokens: int = 0        # tokens that came from the prefix cache (needed no prefill)
    swapped: bool = False         # K/V held on the host by the cache; no blocks meanwhile
    salt: bytes | None = None     # tenant salt folded into parent_hash's root

    @property
    def blocks(self) -> np.ndarray:
        return self.table[:self.num_blocks]

    def append_blocks(self, ids):
        need = self.num_blocks + len(ids)
        self._reserve(need)
        self.table[self.num_blocks:need] = ids
        self.num_blocks = need

    def append_block(self, block: int):
        """append_blocks of one block, without building a sequence for it (decode steps)."""
        self._reserve(self.num_blocks + 1)
        self.table[self.num_blocks] = block
        self.num_blocks += 1

    def _reserve(self, need: int):
        if need > len(self.table):  # grow geometrically: appends stay O(1) amortised
            grown = np.empty(max(need, 2 * len(self.table), 4), dtype=np.int32)
            grown[:self.num_blocks] = self.blocks
            self.table = grown

    def copy(self) -> "SequenceRecord":
        return SequenceRecord(table=self.blocks.copy(), num_blocks=self.num_blocks,
                              num_tokens=self.num_tokens, parent_hash=self.parent_hash,
                              pending=None if self.pending is None else list(self.pending),
                              cached_tokens=self.cached_tokens, salt=self.salt)


class DecodeBatch:
    """One list of sequences in the form a decode step uses, kept between calls so that the
    step's `extend` (one token each) is a few numpy operations and `tables` one copy, not a
    Python loop over the sequences.

    It mirrors the sequences' records, which stay the truth (the one-token step updates both),
    and is valid while the table's change counter equals `version`: any other change (extend,
    fork, free, swap) makes the next call build a new one.

    packed: int32 [seq_lens (n) | block tables (n x width), -1 padded], laid out as `tables()`
    publishes it, width = the longest table (at least 1); `lens` and `table` are views of it.
    last_blocks: int64 [n], each sequence's last block (-1 for none); last_starts: their first
    slots (last_blocks x block_size). steps_in_blocks: one-token steps to come that need no new
    block (the least room left in a last block).
    one_token_steps: whether `SequenceTable.extend_by_one` may step these sequences (each once
    in the list, no partial last block shared: no copy-on-write); a step keeps it true.
    chained_rows: the rows whose prefix-hash chain is live (prefix caching, every token id
    known so far): a step must bring their token ids. Both are set by the SequenceTable.
    """

    def __init__(self, ids: list, records: list, version: int, block_size: int):
        n = len(records)
        self.ids, self.records, self.version = ids, records, version
        self.block_size = block_size
        counts = np.array([seq.num_blocks for seq in records], dtype=np.int64)
        self._set_packed(np.full(n + n * max(int(counts.max(initial=0)), 1), -1, np.int32), n)
        self.lens[:] = [seq.num_tokens for seq in records]
        if counts.any():  # row-major mask order is the order of the concatenated tables
            self.table[np.arange(self.width) < counts[:, None]] = np.concatenate(
                [seq.table[:seq.num_blocks] for seq in records])
        self.last_blocks = self.table[np.arange(n), np.maximum(counts - 1, 0)].astype(np.int64)
        self.last_starts = self.last_blocks * block_size
        self.steps_in_blocks = self.room_left(self.lens)
        self.one_token_steps = False
        self.chained_rows: list = []

    def room_left(self, lens: np.ndarray) -> int:
        """The least room (in tokens) of the last blocks of sequences of lengths `lens`: 0 when
        one is full or missing."""
        return int((-lens % self.block_size).min(initial=self.block_size))

    def add_blocks(self, rows: np.ndarray, blocks: np.ndarray):
        """New last blocks for `rows`, whose last blocks are full, before their next token."""
        columns = self.lens[rows] // self.block_size  # = blocks held
        width = int(columns.max()) + 1
        if width > self.width:
            self._widen(width)
        self.table[rows, columns] = blocks
        self.last_blocks[rows] = blocks
        self.last_starts[rows] = blocks * self.block_size
        self.steps_in_blocks = self.room_left(self.lens + 1)  # after the coming token

    def _set_packed(self, packed: np.ndarray, n: int):
        self.packed = packed
        self.width = (len(packed) - n) // n if n else 1
        self.lens = packed[:n]
        self.table = packed[n:].reshape(n, self.width)

    def _widen(self, width: int):
        n = len(self.records)
        wider = np.full(n + n * width, -1, np.int32)
        wider[:n] = self.lens
        wider[n:].reshape(n, width)[:, :self.width] = self.table
        self._set_packed(wider, n)


def same_ids(ids: list, other: list) -> bool:
    """Whether two id lists name the same sequences (list equality is dict-key equality for
    hashable ids); False for ids that cannot even be compared."""
    try:
        return ids == other
    except Exception:  # e.g. an array among the ids: never a valid batch
        return False


@dataclass
class SequenceExtend:
    """What `extend` will do to one sequence, worked out before anything changes."""

    seq_id: Hashable
    num_new: int
    tokens: list | None           # the new token ids, when given
    salt: bytes | None = None     # the salt of a new sequence
    cow: bool = False             # copy the shared partial last block first
    hits: list = field(default_factory=list)        # cached blocks to reuse, in order
    fresh: int = 0                # blocks to allocate
    full_hashes: list = field(default_factory=list)  # hash of every block this extend fills


@dataclass
class ExtendPlan:
    """A checked `extend` of several sequences; commit it before the table changes again."""

    sequences: list[SequenceExtend]
    version: int                  # the table's change counter when planned


class SequenceTable:
    """The sequences of one block pool: their block tables, lengths and prefix-hash chains.

    num_blocks, block_size: the pool. enable_prefix_caching: name full blocks by the chained
    hash of their token ids (and salt) and reuse them for equal prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.allocator = BlockAllocator(num_blocks, block_size)
        self._seqs: dict[Hashable, SequenceRecord] = {}
        self._version = 0  # bumped by every change, so a stale ExtendPlan is caught
        self._batch: DecodeBatch | None = None  # the id list of the latest decode step

    # --- queries ---------------------------------------------------------------------------

    @property
    def ids(self) -> list:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._seqs
        except TypeError:  # unhashable: never a sequence id
            return False

    @property
    def num_available_blocks(self) -> int:
        return self.allocator.num_available

    @property
    def num_evictable_blocks(self) -> int:
        return self.allocator.num_evictable

    def get(self, seq_id) -> SequenceRecord:
        """The record of a sequence, swapped out or not; KeyError naming an unknown id."""
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"unknown sequence id {seq_id!r} (never extended, or already "
                           f"freed)") from None

    def on_device(self, seq_id, action: str) -> SequenceRecord:
        """The record of a sequence whose blocks are in the cache; ValueError if swapped out."""
        seq = self.get(seq_id)
        if seq.swapped:
            raise ValueError(f"cannot {action} sequence {seq_id!r}: it is swapped out "
                             f"(call swap_in({seq_id!r}) first)")
        return seq

    def check_writable_slots(self, slots: np.ndarray):
        """Each non-negative slot: inside the pool, reserved, in a block no one else shares,
        and written once. ValueError naming the first bad `slots[i]` otherwise."""
        slots = slots.astype(np.int64)
        index = np.flatnonzero(slots >= 0)
        if index.size == 0:
            return
        used = slots[index]
        num_blocks = self.allocator.num_blocks
        blocks, offsets = np.divmod(used, self.block_size)
        inside = blocks < num_blocks
        clipped = np.minimum(blocks, num_blocks - 1)  # index safely; outside ones are masked
        refcount = np.where(inside, self.allocator.refcount[clipped], 0)
        fill = np.where(inside, self.allocator.fill[clipped], 0)
        bad = ~inside | (refcount < 1) | (offsets >= fill) | (refcount > 1)
        if bad.any():
            i = int(np.argmax(bad))
            slot, block = int(used[i]), int(blocks[i])
            if not inside[i]:
                why = f"past the cache ({num_blocks} blocks x {self.block_size})"
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

    # --- extend ----------------------------------------------------------------------------

    def plan_extend(self, seq_ids: list, num_new_tokens, token_ids=None,
                    salts=None) -> ExtendPlan:
        """Check an `extend` and work out its copies, prefix hits and fresh blocks; changes
        nothing. Raises OutOfBlocksError when the pool cannot hold it."""
        check_seq_ids(seq_ids)
        counts = self._new_token_counts(seq_ids, num_new_tokens)
        tokens = self._new_token_ids(seq_ids, counts, token_ids)
        new_salts = self._new_salts(seq_ids, salts)
        plan = ExtendPlan(self._plan_sequences(seq_ids, counts, tokens, new_salts),
                          self._version)
        self._check_available(plan)
        return plan

    def commit_extend(self, plan: ExtendPlan) -> tuple[np.ndarray, list]:
        """Apply a plan of `plan_extend`: (flat int64 slots of every new token, in the plan's
        order, -1 for tokens reused from the prefix cache; [(source, copy) block pairs] whose
        data the caller must copy, all layers, for copy-on-write)."""
        if plan.version != self._version:
            raise AssertionError("ExtendPlan is stale: the table changed since plan_extend")
        # Revive every reused block before any allocation, so that no allocation evicts a block
        # another sequence of this call is about to reuse.
        for step in plan.sequences:
            for block in step.hits:
                self.allocator.incref(block)
        copies: list = []
        slots = [self._commit_sequence(step, copies) for step in plan.sequences]
        self._version += 1
        return (np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)), copies

    def extend_by_one(self, seq_ids: list, token_ids=None) -> np.ndarray | None:
        """One decode step's `extend`: one new token for each of `seq_ids`, all existing, on
        the device and with their last block their own; returns the flat slots, or None
        (nothing changed) where the step needs more than that: new or swapped sequences, a
        shared last block (copy-on-write), token ids other than one int per sequence, live
        prefix-hash chains without token ids (the general path ends them), or a pool too small
        (`plan_extend` then raises).

        Works on the DecodeBatch of `seq_ids`: for a list stepped before (the steady state of a
        decode loop) that is a handful of numpy operations whatever the number of sequences;
        only the sequences whose last block is full take a step each, to get a new block, and
        with prefix caching those with a live hash chain append their token (and hash the
        block it completes)."""
        batch = self._batch
        if batch is None or batch.version != self._version or not same_ids(seq_ids, batch.ids):
            if not seq_ids:
                return None
            try:
                records = [self._seqs[seq_id] for seq_id in seq_ids]
            except (KeyError, TypeError):  # a new (or unhashable) id: the general path says
                return None
            if any(seq.swapped for seq in records):
                return None
            batch = self._new_batch(list(seq_ids), records)
        if not batch.one_token_steps:
            return None
        tokens = None
        if token_ids is not None:
            tokens = one_token_each(token_ids, len(batch.records))
            if tokens is None:
                return None
        elif batch.chained_rows:
            return None
        offsets = batch.lens % self.block_size
        if batch.steps_in_blocks == 0:  # some last block is full (or missing): new blocks
            opening = (offsets == 0).nonzero()[0]
            if tokens is not None and batch.chained_rows \
                    and len(opening) > self.allocator.num_free:
                # Evicting a cached block while chains index theirs: the general path does
                # both sequence by sequence, and which hash stays indexed depends on that order.
                return None
            if not self._open_blocks(batch, opening):
                return None
        else:
            batch.steps_in_blocks -= 1
        self.allocator.fill[batch.last_blocks] = offsets + 1
        slots = batch.last_starts + offsets
        batch.lens += 1
        for seq in batch.records:
            seq.num_tokens += 1
        if tokens is not None:
            self._extend_chains(batch, tokens)
        self._version += 1
        batch.version = self._version
        return slots

    def decode_batch(self, seq_ids: list, action: str) -> DecodeBatch:
        """The DecodeBatch of `seq_ids` (ids may repeat), the kept one when nothing changed
        since; KeyError / ValueError (swapped out, naming `action`) as `on_device` says."""
        batch = self._batch
        if batch is not None and batch.version == self._version and same_ids(seq_ids,
                                                                             batch.ids):
            return batch
        records = [self.on_device(seq_id, action) for seq_id in seq_ids]
        return self._new_batch(list(seq_ids), records)

    def _new_batch(self, seq_ids: list, records: list) -> DecodeBatch:
        """A DecodeBatch of on-device records, kept as the latest one."""
        batch = DecodeBatch(seq_ids, records, self._version, self.block_size)
        batch.one_token_steps = self._can_step_one_token(batch)
        if self.enable_prefix_caching:
            batch.chained_rows = [row for row, seq in enumerate(records)
                                  if seq.pending is not None]
        self._batch = batch
        return batch

    def _can_step_one_token(self, batch: DecodeBatch) -> bool:
        """Each sequence once, and every partial last block owned by its sequence alone (else
        copy-on-write). One-token steps keep both true: they open only blocks of their own."""
        records = batch.records
        if len(set(map(id, records))) != len(records):
            return False
        partial = batch.lens % self.block_size != 0
        return not (self.allocator.refcount[batch.last_blocks[partial]] != 1).any()

    def _extend_chains(self, batch: DecodeBatch, tokens: list):
        """Append each live chain's new token (`_advance_hash_chain` of one token); a block it
        completes is hashed and indexed, as the general path does."""
        bs, records = self.block_size, batch.records
        for row in batch.chained_rows:
            seq = records[row]
            seq.pending.append(tokens[row])
            if len(seq.pending) == bs:  # `pending` starts at the block's first token
                digest = block_hash(seq.parent_hash, seq.pending)
                self.allocator.register(int(batch.last_blocks[row]), digest)
                seq.parent_hash, seq.pending = digest, []

    def _open_blocks(self, batch: DecodeBatch, rows: np.ndarray) -> bool:
        """A new block for each sequence of batch `rows` (their last block is full), or False
        (nothing changed) when the pool has too few."""
        if len(rows) > self.allocator.num_available:
            return False
        blocks = self.allocator.allocate_many(len(rows))
        batch.add_blocks(rows, blocks)
        records = batch.records
        for row, block in zip(rows.tolist(), blocks.tolist()):
            records[row].append_block(block)
        return True

    # --- fork, free, swap ------------------------------------------------------------------

    def fork(self, parent_id, child_id):
        """A new sequence `child_id` sharing all of the parent's blocks (and its salt)."""
        parent = self.on_device(parent_id, "fork")
        check_hashable(child_id, "child_id")
        if child_id in self._seqs:
            raise ValueError(f"child_id: sequence {child_id!r} already exists")
        for block in parent.blocks:
            self.allocator.incref(int(block))
        self._seqs[child_id] = parent.copy()
        self._version += 1

    def free(self, seq_id):
        """Drop a sequence; blocks nobody else uses become free (or evictable, when cached)."""
        seq = self.get(seq_id)
        del self._seqs[seq_id]
        if not seq.swapped:
            self._release(seq)
        self._version += 1

    def swap_out(self, seq_id):
        """Release the blocks of a sequence whose K/V the caller has copied to the host."""
        seq = self.on_device(seq_id, "swap out")
        self._release(seq)
        seq.swapped = True
        self._version += 1

    def check_swap_in(self, seq_id) -> SequenceRecord:
        """The record of a swapped-out sequence that fits back into the pool; else ValueError
        (not swapped out) or OutOfBlocksError. Changes nothing."""
        seq = self.get(seq_id)
        if not seq.swapped:
            raise ValueError(f"seq_id: sequence {seq_id!r} is not swapped out")
        if seq.num_blocks > self.allocator.num_available:
            raise OutOfBlocksError(f"swap_in({seq_id!r}) needs {seq.num_blocks} blocks, "
                                   f"{self.allocator.num_available} are free")
        return seq

    def swap_in(self, seq_id) -> list[int]:
        """Give a swapped-out sequence fresh blocks (checked as `check_swap_in`); returns their
        ids in table order, for the caller to fill."""
        seq = self.check_swap_in(seq_id)
        ids = [self.allocator.allocate() for _ in range(seq.num_blocks)]
        for i, block in enumerate(ids):
            self.allocator.fill[block] = min(self.block_size,
                                             seq.num_tokens - i * self.block_size)
        seq.table = np.asarray(ids, dtype=np.int32)
        seq.swapped = False
        self._version += 1
        return ids

    # --- internals: argument checks --------------------------------------------------------

    def _new_token_counts(self, seq_ids, num_new_tokens) -> list[int]:
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id)
            if seq is not None and seq.swapped:
                self.on_device(seq_id, "extend")
        if _is_integer(num_new_tokens):
            counts = [int(num_new_tokens)] * len(seq_ids)
        else:
            if isinstance(num_new_tokens, (str, bytes)) or not hasattr(num_new_tokens,
                                                                       "__len__"):
                raise TypeError(f"num_new_tokens: expected an int or one int per seq_id, got "
                                f"{type(num_new_tokens).__name__}")
            if len(num_new_tokens) != len(seq_ids):
                raise ValueError(f"num_new_tokens: {len(num_new_tokens)} counts for "
                                 f"{len(seq_ids)} seq_ids")
            if not all(_is_integer(n) for n in num_new_tokens):
                raise TypeError(f"num_new_tokens: counts must be integers, got "
                                f"{list(num_new_tokens)!r}")
            counts = [int(n) for n in num_new_tokens]
        if any(n < 0 for n in counts):
            raise ValueError(f"num_new_tokens: must be >= 0, got {counts}")
        return counts

    def _new_token_ids(self, seq_ids, counts, token_ids) -> list:
        if token_ids is None:
            return [None] * len(seq_ids)
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
            raise TypeError(f"token_ids: expected one list of ints per seq_id, got "
                            f"{type(token_ids).__name__}")
        if len(token_ids) != len(seq_ids):
            raise ValueError(f"token_ids: {len(token_ids)} lists for {len(seq_ids)} seq_ids")
        lists = []
        for seq_id, n, tokens in zip(seq_ids, counts, token_ids):
            if tokens is None:
                lists.append(None)
                continue
            ids = np.asarray(tokens)
            # An empty list arrives as float64; any other non-integer kind is a mistake.
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise TypeError(f"token_ids: sequence {seq_id!r} needs a flat list of int token "
                                f"ids, got shape {ids.shape} of {ids.dtype}")
            if len(ids) != n:
                raise ValueError(f"token_ids: sequence {seq_id!r} has {len(ids)} token ids "
                                 f"for {n} new tokens")
            if ids.dtype == np.uint64 and ids.size and int(ids.max()) >= 2**63:
                raise ValueError(f"token_ids: sequence {seq_id!r} has an id past int64")
            lists.append(ids.astype(np.int64).tolist())
        return lists

    def _new_salts(self, seq_ids, salts) -> list:
        """The salt of each sequence as bytes or None. A salt only takes effect when the
        sequence is created; a later call may repeat it or pass None, nothing else."""
        if salts is None:
            return [None] * len(seq_ids)
        if isinstance(salts, (str, bytes)) or not hasattr(salts, "__len__"):
            raise TypeError(f"salts: expected a list with one salt (bytes, str or None) per "
                            f"seq_id, got {type(salts).__name__}")
        if len(salts) != len(seq_ids):
            raise ValueError(f"salts: {len(salts)} salts for {len(seq_ids)} seq_ids")
        result = []
        for i, (seq_id, salt) in enumerate(zip(seq_ids, salts)):
            salt = normalise_salt(salt, f"salts[{i}]")
            seq = self._seqs.get(seq_id)
            if seq is not None and salt is not None and salt != seq.salt:
                raise ValueError(f"salts[{i}]: sequence {seq_id!r} was created with salt "
                                 f"{seq.salt!r}; a salt is fixed by a sequence's first extend, "
                                 f"got {salt!r}")
            result.append(salt)
        return result

    # --- internals: extend -----------------------------------------------------------------

    def _plan_sequences(self, seq_ids, counts, tokens, salts) -> list[SequenceExtend]:
        """Work out COW copies, prefix hits and fresh blocks without changing anything."""
        bs = self.block_size
        refcount_change: dict[int, int] = {}
        steps = []
        for seq_id, n, new_tokens, salt in zip(seq_ids, counts, tokens, salts):
            step = SequenceExtend(seq_id, n, new_tokens, salt)
            steps.append(step)
            seq = self._seqs.get(seq_id)
            length = seq.num_tokens if seq else 0
            have = seq.num_blocks if seq else 0
            if n == 0:
                continue
            if length % bs and seq is not None:
                last = int(seq.blocks[-1])
                users = int(self.allocator.refcount[last]) + refcount_change.get(last, 0)
                if users > 1:  # earlier sequences of this call may already have copied it
                    step.cow = True
                    refcount_change[last] = refcount_change.get(last, 0) - 1
            chain = seq.pending if seq else []
            if self.enable_prefix_caching and new_tokens is not None and chain is not None:
                parent = seq.parent_hash if seq else root_hash(salt)
                step.full_hashes = full_block_hashes(parent, chain, new_tokens, bs)
                if length % bs == 0:
                    # Only blocks before the one holding the last new token may be reused.
                    for digest in step.full_hashes[:(n - 1) // bs]:
                        block = self.allocator.lookup(digest)
                        if block is None:
                            break
                        step.hits.append(block)
            step.fresh = -(-(length + n) // bs) - have - len(step.hits)
        return steps

    def _check_available(self, plan: ExtendPlan):
        steps = plan.sequences
        revived = {b for s in steps for b in s.hits if self.allocator.is_evictable(b)}
        needed = sum(s.fresh + s.cow for s in steps) + len(revived)
        if needed > self.allocator.num_available:
            raise OutOfBlocksError(f"extend needs {needed} blocks, {self.allocator.num_available}"
                                   f" are free (nothing was changed)")

    def _commit_sequence(self, step: SequenceExtend, copies: list) -> np.ndarray:
        bs = self.block_size
        seq = self._seqs.get(step.seq_id)
        if seq is None:
            seq = self._seqs[step.seq_id] = SequenceRecord(
                table=np.empty(4, dtype=np.int32), parent_hash=root_hash(step.salt),
                salt=step.salt)
        if step.num_new == 0:
            return np.empty(0, dtype=np.int64)
        alloc = self.allocator
        if step.cow:
            source = int(seq.blocks[-1])
            copy = alloc.allocate()
            alloc.fill[copy] = alloc.fill[source]
            alloc.decref(source)
            seq.table[seq.num_blocks - 1] = copy
            copies.append((source, copy))
        seq.append_blocks(step.hits)
        seq.append_blocks([alloc.allocate() for _ in range(step.fresh)])

        start, end = seq.num_tokens, seq.num_tokens + step.num_new
        positions = np.arange(start, end, dtype=np.int64)
        block_index = positions // bs
        slots = seq.table[block_index].astype(np.int64) * bs + positions % bs
        cached = len(step.hits) * bs
        slots[:cached] = -1  # reused tokens: their K/V is already there
        # Reserved tokens per touched block.
        touched = np.unique(block_index)
        fills = np.minimum(end - touched * bs, bs)
        alloc.fill[seq.table[touched]] = fills
        seq.num_tokens = end
        seq.cached_tokens += cached
        self._advance_hash_chain(seq, step, first_block=start // bs)
        return slots

    def _advance_hash_chain(self, seq: SequenceRecord, step: SequenceExtend, first_block: int):
        """Index the blocks this extend filled and keep the partial block's token ids."""
        if not self.enable_prefix_caching:
            return
        if step.tokens is None or seq.pending is None:
            seq.pending = None  # a token id is unknown: later blocks cannot be named
            return
        # `pending` starts at a block boundary, so blocks complete every block_size tokens.
        for i, digest in enumerate(step.full_hashes):
            self.allocator.register(int(seq.table[first_block + i]), digest)
            seq.parent_hash = digest
        tokens = seq.pending + step.tokens
        seq.pending = tokens[len(step.full_hashes) * self.block_size:]

    def _release(self, seq: SequenceRecord):
        # Tail first, so that among a sequence's cached blocks the later ones (least likely to be
        # a shared prefix) are evicted first.
        for block in seq.blocks[::-1]:
            self.allocator.decref(int(block))


INT64_RANGE = (-2**63, 2**63 - 1)  # token ids are hashed as int64


def one_token_each(token_ids, count: int) -> list | None:
    """The token id of each of `count` sequences when `token_ids` is a decode step's (a list or
    tuple of `count` one-int lists or tuples, or an int array [count, 1]), as Python ints; None
    for anything else, which the general path checks and names. Checked with whole-list
    operations: a Python loop over the sequences would cost more than the rest of the step."""
    if isinstance(token_ids, np.ndarray):
        if token_ids.shape != (count, 1) or token_ids.dtype.kind not in "iu":
            return None
        tokens = token_ids[:, 0].tolist()
    else:
        if not isinstance(token_ids, (list, tuple)) or len(token_ids) != count \
                or not set(map(type, token_ids)) <= _TOKEN_LIST_TYPES:
            return None
        try:
            tokens = [token for (token,) in token_ids]
        except ValueError:  # a list of another length
            return None
        if not set(map(type, tokens)) <= _PLAIN_INT:
            if not all(map(_is_integer, tokens)):
                return None
            tokens = [int(token) for token in tokens]
    if tokens and (min(tokens) < INT64_RANGE[0] or max(tokens) > INT64_RANGE[1]):
        return None
    return tokens


_TOKEN_LIST_TYPES = {list, tuple}
_PLAIN_INT = {int}  # bool is a type of its own: not a token id


def _is_integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_hashable(seq_id, name: str):
    """TypeError for an id that cannot name a sequence: dict keys must be hashable."""
    try:
        hash(seq_id)
    except TypeError:
        raise TypeError(f"{name}: sequence ids must be hashable, got "
                        f"{type(seq_id).__name__} {seq_id!r}") from None


def check_seq_ids(seq_ids: list):
    """TypeError for unhashable ids, ValueError for an id given twice in one call."""
    try:
        unique = len(set(seq_ids)) == len(seq_ids)
    except TypeError:  # find the unhashable one to name it
        for i, seq_id in enumerate(seq_ids):
            check_hashable(seq_id, f"seq_ids[{i}]")
        raise
    if not unique:
        seen = set()
        for i, seq_id in enumerate(seq_ids):
            if seq_id in seen:
                raise ValueError(f"seq_ids[{i}]: sequence {seq_id!r} appears more than once; "
                                 f"each sequence may appear only once per call")
            seen.add(seq_id)


def normalise_salt(salt, name: str) -> bytes | None:
    """bytes of a salt (str as UTF-8, so "t1" and b"t1" are one salt), or None."""
    if salt is None:
        return None
    if isinstance(salt, str):
        salt = salt.encode("utf-8")
    elif isinstance(salt, (bytes, bytearray, memoryview)):
        salt = bytes(salt)
    else:
        raise TypeError(f"{name}: a salt must be bytes, str or None, got "
                        f"{type(salt).__name__}")
    if not salt:
        raise ValueError(f"{name}: empty salt; pass None for no salt")
    return salt
