"""The decode-step fast path of PagedKVCache (`extend(ids, 1)` and `tables(ids)` on a kept
DecodeBatch) against the general path on random operation sequences.

Two caches get the same calls; in one the fast path is switched off, so every extend goes
through plan_extend / commit_extend. After every call both must hold the same state, down to
the allocator's free-list order, prefix-cache index and every sequence's hash chain, return the
same slots (or raise the same error), and `tables()` must equal the tables read sequence by
sequence. The operations mix decode steps of one id list (the steady state the fast path keeps)
with what invalidates it: new sequences (with salts), forks at and between block boundaries,
frees, swaps, multi-token extends, a reordered list, a pool that runs out and bad token ids.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa

BLOCK_SIZE = 8
ALPHABET = 3  # few token ids: prefixes repeat, so the prefix cache gets hits and duplicates
SALTS = [None, None, "tenant-a", b"tenant-b"]


def make_pair(prefix_caching: bool, num_blocks: int):
    caches = [cupa.PagedKVCache(1, num_blocks, BLOCK_SIZE, 1, 64, "float32", backend="numpy",
                                enable_prefix_caching=prefix_caching) for _ in range(2)]
    caches[1]._sequences.extend_by_one = lambda *args, **kwargs: None  # the general path only
    return caches


def state(cache: cupa.PagedKVCache):
    table = cache._sequences
    alloc = table.allocator
    records = {seq_id: (seq.num_tokens, seq.blocks.tolist(), seq.parent_hash,
                        None if seq.pending is None else list(seq.pending), seq.cached_tokens,
                        seq.swapped, seq.salt)
               for seq_id, seq in table._seqs.items()}
    return (records, alloc.refcount.tolist(), alloc.fill.tolist(), alloc.free_blocks(),
            alloc.evictable_blocks(), dict(alloc._block_of_hash))


def call_both(caches, method, *args, **kwargs):
    """The same call on both caches: (result of the fast one, or the error type and message)."""
    outcomes = []
    for cache in caches:
        try:
            outcomes.append(("ok", getattr(cache, method)(*args, **kwargs)))
        except (ValueError, TypeError, KeyError, MemoryError) as exc:
            outcomes.append(("error", type(exc), str(exc)))
    fast, slow = outcomes
    assert fast[0] == slow[0]
    if fast[0] == "error":
        assert fast[1:] == slow[1:]
    elif isinstance(fast[1], np.ndarray):  # extend's slots
        assert fast[1].dtype == slow[1].dtype == np.int64
        np.testing.assert_array_equal(fast[1], slow[1])
    assert state(caches[0]) == state(caches[1])
    return fast


def check_tables(cache: cupa.PagedKVCache, ids, max_blocks=None):
    tables, lens = cache.tables(ids, max_blocks=max_blocks)
    rows = [cache.block_table(s) for s in ids]
    width = max_blocks or max([len(r) for r in rows] + [1])
    want = np.full((len(ids), width), -1, np.int32)
    for i, row in enumerate(rows):
        want[i, :len(row)] = row
    assert tables.dtype == lens.dtype == np.int32
    np.testing.assert_array_equal(tables, want)
    np.testing.assert_array_equal(lens, [cache.seq_len(s) for s in ids])


def one_token_ids(rng, ids, form):
    tokens = rng.integers(0, ALPHABET, len(ids))
    if form == "array":
        return tokens.reshape(-1, 1)
    return [[int(t)] for t in tokens]


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_decode_steps_match_the_general_path(prefix_caching, seed):
    rng = np.random.default_rng(seed)
    caches = make_pair(prefix_caching, num_blocks=int(rng.integers(24, 64)))
    decoding: list = []   # the id list decode steps use, as an engine keeps it
    next_id = 0

    def on_device():
        return [s for s in caches[0].seq_ids if not caches[0].is_swapped(s)]

    for _ in range(400):
        op = rng.choice(["step"] * 12 + ["tables", "new", "fork", "free", "swap_out",
                                         "swap_in", "multi", "reorder", "bad"])
        if op == "step" and decoding:
            form = rng.choice(["none", "list", "array"])
            token_ids = None if form == "none" else one_token_ids(rng, decoding, form)
            outcome = call_both(caches, "extend", list(decoding), 1, token_ids=token_ids)
            if outcome[0] == "error" and outcome[1] is cupa.OutOfBlocksError:
                victim = decoding.pop(int(rng.integers(len(decoding))))
                call_both(caches, "free", victim)
            elif rng.random() < 0.7:
                for cache in caches:
                    check_tables(cache, decoding)
        elif op == "tables" and decoding:
            longest = max(len(caches[0].block_table(s)) for s in decoding)
            width = None if rng.random() < 0.5 else longest + int(rng.integers(0, 3))
            for cache in caches:
                check_tables(cache, decoding, width)
        elif op == "new":
            n = int(rng.integers(0, 3 * BLOCK_SIZE))
            prompt = [int(t) for t in rng.integers(0, ALPHABET, n)] if rng.random() < 0.8 \
                else None
            salt = SALTS[int(rng.integers(len(SALTS)))]
            outcome = call_both(caches, "extend", [next_id], n,
                                token_ids=None if prompt is None else [prompt], salts=[salt])
            if outcome[0] == "ok":
                decoding.append(next_id)
            next_id += 1
        elif op == "fork" and on_device():
            parent = on_device()[int(rng.integers(len(on_device())))]
            call_both(caches, "fork", parent, next_id)
            if rng.random() < 0.7:
                decoding.append(next_id)
            next_id += 1
        elif op == "free" and caches[0].seq_ids:
            victim = caches[0].seq_ids[int(rng.integers(len(caches[0].seq_ids)))]
            call_both(caches, "free", victim)
            if victim in decoding:
                decoding.remove(victim)
        elif op == "swap_out" and on_device():
            victim = on_device()[int(rng.integers(len(on_device())))]
            call_both(caches, "swap_out", victim)
            if victim in decoding:
                decoding.remove(victim)
        elif op == "swap_in":
            swapped = [s for s in caches[0].seq_ids if caches[0].is_swapped(s)]
            if swapped and call_both(caches, "swap_in", swapped[0])[0] == "ok":
                decoding.append(swapped[0])
        elif op == "multi" and decoding:
            ids = list(decoding[:int(rng.integers(1, len(decoding) + 1))])
            counts = [int(c) for c in rng.integers(0, BLOCK_SIZE + 3, len(ids))]
            token_ids = [[int(t) for t in rng.integers(0, ALPHABET, c)] for c in counts]
            call_both(caches, "extend", ids, counts, token_ids=token_ids)
        elif op == "reorder" and decoding:
            decoding = [decoding[i] for i in rng.permutation(len(decoding))]
        elif op == "bad" and decoding:
            bad = rng.choice(["float", "two", "count", "duplicate", "past-int64", "salt"])
            ids, kwargs = list(decoding), {}
            if bad == "float":
                kwargs["token_ids"] = [[1.5]] * len(ids)
            elif bad == "two":
                kwargs["token_ids"] = [[1, 2]] * len(ids)
            elif bad == "count":
                kwargs["token_ids"] = [[1]] * (len(ids) + 1)
            elif bad == "duplicate":
                ids = ids + ids[:1]
            elif bad == "past-int64":
                kwargs["token_ids"] = [[2**63]] * len(ids)
            else:
                kwargs["salts"] = ["another-tenant"] * len(ids)
            outcome = call_both(caches, "extend", ids, 1, **kwargs)
            assert outcome[0] == "error" or bad == "salt"
        for cache in caches:  # the records and the allocator agree with each other
            alloc = cache._sequences.allocator
            held = np.zeros_like(alloc.refcount)
            for seq_id in cache.seq_ids:
                if not cache.is_swapped(seq_id):
                    np.add.at(held, cache.block_table(seq_id), 1)
            np.testing.assert_array_equal(held, alloc.refcount)


def test_the_kept_batch_serves_repeated_steps_and_follows_changes():
    """A steady decode loop reuses one DecodeBatch; a fork (shared partial block: copy-on-write)
    or a free makes the next step build a new one, and the tables follow."""
    cache = cupa.PagedKVCache(1, 64, BLOCK_SIZE, 1, 64, "float32", backend="numpy")
    ids = ["a", "b", "c"]
    cache.extend(ids, [3, 8, 13])
    cache.extend(ids, 1)
    batch = cache._sequences._batch
    for _ in range(2 * BLOCK_SIZE):  # across block boundaries of every sequence
        cache.extend(ids, 1)
        check_tables(cache, ids)
        assert cache._sequences._batch is batch
    cache.fork("a", "a2")
    slots = cache.extend(ids + ["a2"], 1)
    assert cache._sequences._batch is not batch
    assert len(set(slots.tolist())) == 4  # the fork's shared partial block was copied
    check_tables(cache, ids + ["a2"])
    cache.free("b")
    cache.extend(["a", "c", "a2"], 1)
    check_tables(cache, ["a", "c", "a2"])


def test_steps_with_token_ids_keep_the_prefix_chain():
    """With prefix caching, decode steps that bring their token ids keep hashing: the blocks
    they complete are found by a later sequence with the same tokens."""
    cache = cupa.PagedKVCache(1, 64, BLOCK_SIZE, 1, 64, "float32", backend="numpy",
                              enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5]
    cache.extend(["a"], len(prompt), token_ids=[prompt])
    generated = [6, 7, 8, 9, 10, 11, 12, 13]
    for token in generated:
        cache.extend(["a"], 1, token_ids=[[token]])
    tokens = prompt + generated  # 13 tokens: the first block of 8 is complete and indexed
    cache.extend(["b"], len(tokens), token_ids=[tokens])
    assert cache.num_cached_tokens("b") == BLOCK_SIZE
    assert cache.block_table("b")[0] == cache.block_table("a")[0]


def test_a_step_that_evicts_the_block_another_sequence_completes():
    """Order matters where one sequence completes a block whose hash an evictable block holds
    and a later one of the same step evicts that block to open a new one: the general path
    indexes first (and finds the hash taken), then evicts. The fast path must agree."""
    prompt = list(range(2 * BLOCK_SIZE))
    caches = make_pair(prefix_caching=True, num_blocks=4)
    call_both(caches, "extend", ["old"], len(prompt), token_ids=[prompt])
    call_both(caches, "free", "old")  # both blocks evictable, the second the oldest
    call_both(caches, "extend", ["a"], len(prompt) - 1, token_ids=[prompt[:-1]])
    call_both(caches, "extend", ["b"], BLOCK_SIZE, token_ids=[[99] * BLOCK_SIZE])
    assert caches[0].num_free_blocks == 1 and caches[0].num_cached_blocks == 1
    # "a" completes its second block (the evictable one's hash), "b" evicts that block.
    call_both(caches, "extend", ["a", "b"], 1, token_ids=[[prompt[-1]], [99]])
    call_both(caches, "extend", ["a", "b"], 1, token_ids=[[5], [99]])
