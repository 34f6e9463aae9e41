"""PagedKVCache on the numpy backend: decode through the cache against `cupa.decode` on the same
tokens laid out contiguously, copy-on-write, swap, prefix caching, tables() and every error."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cupa
from cupa.cache.blocks import OutOfBlocksError

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}


class History:
    """The K/V rows the test wrote for each sequence, per layer, kept apart from the cache."""

    def __init__(self, cache: cupa.PagedKVCache, rng):
        self.cache, self.rng = cache, rng
        self.rows: dict = {}  # seq_id -> list over layers of list of (k row, v row)

    def rows_for(self, n):
        shape = (n, self.cache.num_kv_heads, self.cache.head_size)
        k = self.rng.standard_normal(shape).astype(DTYPES[self.cache.dtype])
        v = self.rng.standard_normal(shape).astype(DTYPES[self.cache.dtype])
        return k, v

    def append(self, seq_ids, counts, token_ids=None, salts=None):
        """extend + write every layer; tokens served from the prefix cache copy the history of
        the sequence they came from (`source`)."""
        if isinstance(counts, int):
            counts = [counts] * len(seq_ids)
        slots = self.cache.extend(seq_ids, counts, token_ids=token_ids, salts=salts)
        for layer in range(self.cache.num_layers):
            k, v = self.rows_for(len(slots))
            self.cache.write(layer, slots, k, v)
            start = 0
            for seq_id, n in zip(seq_ids, counts):
                rows = self.rows.setdefault(seq_id, [[] for _ in range(self.cache.num_layers)])
                for i in range(start, start + n):
                    rows[layer].append((k[i], v[i]) if slots[i] >= 0 else None)
                start += n
        return slots

    def fill_cached(self, seq_id, source_id):
        """Rows reused from the prefix cache equal the source sequence's rows."""
        for layer, rows in enumerate(self.rows[seq_id]):
            for i, row in enumerate(rows):
                if row is None:
                    rows[i] = self.rows[source_id][layer][i]

    def fork(self, parent, child):
        self.cache.fork(parent, child)
        self.rows[child] = [list(rows) for rows in self.rows[parent]]

    def contiguous(self, layer, seq_ids):
        """A fresh cache array holding each sequence's rows in consecutive blocks."""
        bs, H, D = self.cache.block_size, self.cache.num_kv_heads, self.cache.head_size
        lens = [len(self.rows[s][layer]) for s in seq_ids]
        nblocks = [-(-n // bs) for n in lens]
        dtype = DTYPES[self.cache.dtype]
        keys = np.zeros((max(sum(nblocks), 1), H, bs, D), dtype)
        values = np.zeros_like(keys)
        tables = np.zeros((len(seq_ids), max(max(nblocks, default=1), 1)), np.int32)
        cursor = 0
        for r, s in enumerate(seq_ids):
            tables[r, :nblocks[r]] = np.arange(cursor, cursor + nblocks[r])
            for pos, (k, v) in enumerate(self.rows[s][layer]):
                keys[cursor + pos // bs, :, pos % bs] = k
                values[cursor + pos // bs, :, pos % bs] = v
            cursor += nblocks[r]
        return keys, values, tables, np.asarray(lens, np.int32)

    def check_decode(self, seq_ids, group=2, **kwargs):
        H, D = self.cache.num_kv_heads, self.cache.head_size
        query = self.rng.standard_normal((len(seq_ids), H * group, D)).astype(
            DTYPES[self.cache.dtype])
        for layer in range(self.cache.num_layers):
            got = self.cache.decode(layer, query, seq_ids, **kwargs)
            want = cupa.decode(query, *self.contiguous(layer, seq_ids), backend="numpy",
                               **kwargs)
            np.testing.assert_array_equal(np.asarray(got, np.float64),
                                          np.asarray(want, np.float64))


def make_cache(num_blocks=64, dtype="float32", block_size=8, prefix=False, layers=2):
    return cupa.PagedKVCache(layers, num_blocks, block_size, 2, 64, dtype, backend="numpy",
                             enable_prefix_caching=prefix)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_decode_matches_contiguous_layout(rng, dtype):
    cache = make_cache(dtype=dtype)
    history = History(cache, rng)
    history.append([0, 1, 2], [13, 1, 24])
    history.check_decode([0, 1, 2])
    for _ in range(10):  # decode loop: one token per step
        history.append([0, 1, 2], 1)
        history.check_decode([2, 0, 1])
    history.check_decode([1], alibi_slopes=np.linspace(0.1, 0.5, 4).astype(np.float32))
    out, lse = cache.decode(0, np.ones((1, 4, 64), DTYPES[dtype]), [1], return_lse=True)
    assert out.shape == (1, 4, 64) and lse.shape == (1, 4)


def test_multi_token_decode_through_the_cache(rng):
    cache = make_cache()
    history = History(cache, rng)
    history.append([0, 1], [20, 5])
    history.append([0, 1], [3, 4])  # draft tokens, extended and written like any others
    query = rng.standard_normal((7, 4, 64)).astype(np.float32)
    loc = np.array([0, 3, 7], np.int32)
    for layer in range(2):
        got = cache.decode(layer, query, [0, 1], new_tokens=[3, 4])
        want = cupa.decode(query, *history.contiguous(layer, [0, 1]), query_start_loc=loc,
                           backend="numpy")
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(cache.decode(layer, query, [0, 1], query_start_loc=loc),
                                      want)
    with pytest.raises(ValueError, match="new_tokens: 3 counts for 2 seq_ids"):
        cache.decode(0, query, [0, 1], new_tokens=[3, 2, 2])
    with pytest.raises(ValueError, match="give one of them"):
        cache.decode(0, query, [0, 1], new_tokens=3, query_start_loc=loc)
    with pytest.raises(ValueError, match="or pass new_tokens"):
        cache.decode(0, query, [0, 1])


def test_new_ids_start_empty_and_slots_follow_seq_ids(rng):
    cache = make_cache(block_size=8)
    slots = cache.extend(["a", "b"], [3, 10])
    assert cache.seq_len("a") == 3 and cache.seq_len("b") == 10
    ta, tb = cache.block_table("a"), cache.block_table("b")
    assert len(ta) == 1 and len(tb) == 2 and not set(ta) & set(tb)
    expected = [ta[0] * 8 + i for i in range(3)] + [tb[p // 8] * 8 + p % 8 for p in range(10)]
    np.testing.assert_array_equal(slots, expected)
    assert slots.dtype == np.int64
    cache.extend(["c"], 0)
    assert cache.seq_len("c") == 0 and len(cache.block_table("c")) == 0
    assert cache.num_free_blocks == 64 - 3


def test_write_stores_rows_and_skips_padding(rng):
    cache = make_cache(dtype="bfloat16")
    slots = cache.extend([7], 5)
    k = rng.standard_normal((6, 2, 64)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((6, 2, 64)).astype(ml_dtypes.bfloat16)
    padded = np.concatenate([slots[:2], [-1], slots[2:]])
    cache.write(1, padded, k, v)
    block = cache.block_table(7)[0]
    got_k = cache.key_cache(1)[block].transpose(1, 0, 2)[:5]
    keep = [0, 1, 3, 4, 5]
    np.testing.assert_array_equal(got_k.view(np.uint16), k[keep].view(np.uint16))
    np.testing.assert_array_equal(cache.value_cache(1)[block].transpose(1, 0, 2)[:5]
                                  .view(np.uint16), v[keep].view(np.uint16))
    assert not cache.key_cache(0).any()  # other layers untouched


def test_strided_rows_are_accepted(rng):
    cache = make_cache()
    slots = cache.extend([0], 4)
    qkv = rng.standard_normal((4, 3, 2, 64)).astype(np.float32)  # fused projection
    cache.write(0, slots, qkv[:, 1], qkv[:, 2])
    block = cache.block_table(0)[0]
    np.testing.assert_array_equal(cache.key_cache(0)[block, :, :4], qkv[:, 1].transpose(1, 0, 2))


def test_fork_copy_on_write_keeps_parent(rng):
    cache = make_cache(block_size=8)
    history = History(cache, rng)
    history.append([0], 13)  # second block is partial
    parent_table = cache.block_table(0).copy()
    parent_keys = cache.key_cache(0)[parent_table].copy()
    free_before = cache.num_free_blocks
    history.fork(0, 1)
    history.fork(0, 2)
    assert cache.num_free_blocks == free_before
    np.testing.assert_array_equal(cache.block_table(1), parent_table)

    history.append([1], 2)  # child writes into its own copy of the partial block
    assert cache.num_free_blocks == free_before - 1
    assert cache.block_table(1)[0] == parent_table[0]
    assert cache.block_table(1)[1] != parent_table[1]
    np.testing.assert_array_equal(cache.key_cache(0)[parent_table], parent_keys)
    np.testing.assert_array_equal(cache.key_cache(1)[parent_table], cache.key_cache(1)[
        parent_table])
    history.append([2, 0], [5, 1])  # the other child copies too, then the parent appends alone
    assert cache.block_table(0)[1] == parent_table[1]  # last owner: no copy
    assert cache.block_table(2)[1] != parent_table[1]
    history.check_decode([0, 1, 2])
    for layer in range(2):
        np.testing.assert_array_equal(cache.key_cache(layer)[parent_table[0]],
                                      history.contiguous(layer, [0])[0][0])
    # A full shared last block needs no copy: appends go to a new block.
    history.append([0], 2)  # parent now 16 tokens: both blocks full
    history.fork(0, 3)
    free = cache.num_free_blocks
    history.append([3], 1)
    assert cache.num_free_blocks == free - 1
    history.check_decode([0, 3])


def test_free_returns_blocks_after_last_owner(rng):
    cache = make_cache(num_blocks=8)
    history = History(cache, rng)
    history.append([0], 20)
    history.fork(0, 1)
    cache.free(0)
    assert cache.num_free_blocks == 5
    history.check_decode([1])
    cache.free(1)
    assert cache.num_free_blocks == 8


def test_swap_round_trip_is_bit_exact(rng):
    cache = make_cache(num_blocks=12, dtype="float16")
    history = History(cache, rng)
    history.append([0, 1], [30, 9])
    history.fork(1, 2)
    before = [cache.key_cache(l)[cache.block_table(0)].copy() for l in range(2)]
    cache.swap_out(0)
    assert cache.is_swapped(0) and cache.seq_len(0) == 30
    assert cache.num_free_blocks == 12 - 2
    cache.swap_out(2)  # shared blocks stay for sequence 1
    assert cache.num_free_blocks == 12 - 2
    history.append([1], 20)  # reuse the freed space meanwhile
    cache.swap_in(0)
    cache.swap_in(2)
    for layer in range(2):
        np.testing.assert_array_equal(
            cache.key_cache(layer)[cache.block_table(0)].view(np.uint16),
            before[layer].view(np.uint16))
    history.check_decode([0, 1, 2])
    history.append([0, 2], 3)
    history.check_decode([0, 1, 2])


def test_swapped_out_sequence_is_refused(rng):
    cache = make_cache()
    cache.extend([0], 5)
    cache.swap_out(0)
    q = np.zeros((1, 4, 64), np.float32)
    for call in (lambda: cache.extend([0], 1), lambda: cache.decode(0, q, [0]),
                 lambda: cache.tables([0]), lambda: cache.fork(0, 1),
                 lambda: cache.swap_out(0), lambda: cache.block_table(0)):
        with pytest.raises(ValueError, match="swapped out"):
            call()
    assert cache.seq_len(0) == 5
    cache.swap_in(0)
    with pytest.raises(ValueError, match="not swapped out"):
        cache.swap_in(0)
    cache.swap_out(0)
    cache.free(0)  # dropping a swapped-out sequence is fine
    assert cache.num_free_blocks == 64


def test_swap_in_without_room_changes_nothing(rng):
    cache = make_cache(num_blocks=4)
    cache.extend([0], 24)
    cache.swap_out(0)
    cache.extend([1], 16)
    with pytest.raises(OutOfBlocksError):
        cache.swap_in(0)
    assert cache.is_swapped(0) and cache.num_free_blocks == 2
    cache.free(1)
    cache.swap_in(0)


def test_extend_is_atomic(rng):
    cache = make_cache(num_blocks=6, block_size=8)
    history = History(cache, rng)
    history.append([0], 12)
    history.fork(0, 1)
    state = (cache.block_table(0).copy(), cache.block_table(1).copy(), cache.num_free_blocks)
    with pytest.raises(OutOfBlocksError) as info:
        cache.extend([0, 1, 2], [4, 4, 30])
    assert isinstance(info.value, MemoryError)
    assert (cache.block_table(0).tolist(), cache.block_table(1).tolist(),
            cache.num_free_blocks) == (state[0].tolist(), state[1].tolist(), state[2])
    assert 2 not in cache and cache.seq_len(0) == 12
    # Exactly enough: the first of the two owners copies the shared block, the second (now its
    # only owner) appends in place, and the new sequence takes the remaining 3 blocks.
    history.append([0, 1, 2], [4, 4, 24])
    assert cache.num_free_blocks == 0
    history.check_decode([0, 1, 2])


def test_prefix_caching_reuses_blocks(rng):
    cache = make_cache(num_blocks=16, block_size=8, prefix=True)
    history = History(cache, rng)
    prompt = list(rng.integers(0, 1000, 30))
    history.append(["a"], 30, token_ids=[prompt])
    assert cache.num_cached_tokens("a") == 0
    free = cache.num_free_blocks
    slots = history.append(["b"], 30, token_ids=[prompt])  # live sharing
    assert (slots[:24] == -1).all() and (slots[24:] >= 0).all()
    assert cache.num_cached_tokens("b") == 24
    assert cache.num_free_blocks == free - 1
    np.testing.assert_array_equal(cache.block_table("b")[:3], cache.block_table("a")[:3])
    history.fill_cached("b", "a")
    history.check_decode(["a", "b"])

    # Different tokens after a shared first block: one block reused, chain stops at the miss.
    other = prompt[:8] + [p + 1 for p in prompt[8:]]
    slots = history.append(["c"], 30, token_ids=[other])
    assert cache.num_cached_tokens("c") == 8
    history.fill_cached("c", "a")

    # The block holding the last new token is never reused: an exact 24-token prompt reuses 16.
    slots = history.append(["d"], 24, token_ids=[prompt[:24]])
    assert cache.num_cached_tokens("d") == 16
    history.fill_cached("d", "a")
    history.check_decode(["a", "b", "c", "d"])

    # Freed cached blocks are kept and come back for the same prefix.
    for s in ("a", "b", "c", "d"):
        cache.free(s)
    assert cache.num_free_blocks == 16 and cache.num_cached_blocks > 0
    kept = cache.num_cached_blocks
    saved = {layer: history.rows["a"][layer][:24] for layer in range(2)}
    slots = cache.extend(["e"], 25, token_ids=[prompt[:25]])
    assert cache.num_cached_tokens("e") == 24
    assert cache.num_cached_blocks == kept - 3
    for layer in range(2):
        k, v = history.rows_for(25)
        cache.write(layer, slots, k, v)
        history.rows.setdefault("e", [[], []])[layer] = saved[layer] + [(k[24], v[24])]
    history.check_decode(["e"])


def test_prefix_cache_evicts_least_recently_freed(rng):
    cache = make_cache(num_blocks=4, block_size=8, prefix=True)
    p1, p2 = list(range(100, 116)), list(range(200, 216))
    cache.extend(["x"], 9, token_ids=[p1[:9]])   # block of p1[:8] cached once full
    cache.extend(["y"], 9, token_ids=[p2[:9]])
    cache.free("x")
    cache.free("y")
    assert cache.num_cached_blocks == 2 and cache.num_free_blocks == 4
    cache.extend(["z"], 24)  # needs 3 blocks: 2 free ones, then evicts x's (freed first)
    assert cache.num_cached_blocks == 1 and cache.num_free_blocks == 1
    cache.free("z")
    cache.extend(["y2"], 9, token_ids=[p2[:9]])
    assert cache.num_cached_tokens("y2") == 8
    cache.extend(["x2"], 9, token_ids=[p1[:9]])
    assert cache.num_cached_tokens("x2") == 0


def test_prefix_chain_continues_across_extends(rng):
    cache = make_cache(num_blocks=16, block_size=8, prefix=True)
    tokens = list(range(40))
    cache.extend(["a"], 5, token_ids=[tokens[:5]])
    for t in tokens[5:20]:  # decode steps with their token ids
        cache.extend(["a"], 1, token_ids=[[t]])
    cache.extend(["b"], 17, token_ids=[tokens[:17]])
    assert cache.num_cached_tokens("b") == 16
    # Without token ids the chain breaks: later blocks of "c" are not indexed.
    cache.extend(["c"], 8, token_ids=[tokens[20:28]])
    cache.extend(["c"], 8)
    cache.extend(["c"], 8, token_ids=[tokens[:8]])
    cache.extend(["d"], 25, token_ids=[tokens[20:28] + tokens[:17]])
    assert cache.num_cached_tokens("d") == 8
    # Prefix caching off: token ids are accepted and ignored.
    plain = make_cache(prefix=False)
    plain.extend(["a"], 17, token_ids=[tokens[:17]])
    plain.extend(["b"], 17, token_ids=[tokens[:17]])
    assert plain.num_cached_tokens("b") == 0


def test_salts_keep_tenants_apart(rng):
    """Equal tokens under different salts share no block, equal salts share as before, and
    sequences without a salt hash exactly as without the feature."""
    from cupa.cache.blocks import ROOT_HASH, block_hash
    cache = make_cache(num_blocks=32, block_size=8, prefix=True)
    history = History(cache, rng)
    prompt = [int(t) for t in rng.integers(0, 1000, 30)]
    history.append(["a"], 30, token_ids=[prompt], salts=["tenant-1"])
    history.append(["b"], 30, token_ids=[prompt], salts=[b"tenant-2"])
    assert cache.num_cached_tokens("b") == 0
    assert not set(cache.block_table("a")) & set(cache.block_table("b"))
    history.append(["c"], 30, token_ids=[prompt], salts=[b"tenant-1"])  # str = its UTF-8
    assert cache.num_cached_tokens("c") == 24
    np.testing.assert_array_equal(cache.block_table("c")[:3], cache.block_table("a")[:3])
    history.fill_cached("c", "a")
    history.append(["d"], 30, token_ids=[prompt])  # no salt: shares with no salted sequence
    assert cache.num_cached_tokens("d") == 0
    assert not set(cache.block_table("d")) & (set(cache.block_table("a"))
                                              | set(cache.block_table("b")))
    history.append(["e"], 30, token_ids=[prompt], salts=[None])
    assert cache.num_cached_tokens("e") == 24
    history.fill_cached("e", "d")
    # Unsalted blocks keep today's names: the chain starts at the shared root.
    first = block_hash(ROOT_HASH, prompt[:8])
    assert cache._allocator.lookup(first) == cache.block_table("d")[0]
    assert cache._allocator.lookup(block_hash(first, prompt[8:16])) == cache.block_table("d")[1]
    history.check_decode(["a", "b", "c", "d", "e"])

    # Freed (evictable) blocks stay private to their salt too.
    for seq_id in ("a", "c", "d", "e"):
        cache.free(seq_id)
    cached = cache.num_cached_blocks
    history.append(["f"], 17, token_ids=[prompt[:17]], salts=["tenant-3"])
    assert cache.num_cached_tokens("f") == 0 and cache.num_cached_blocks == cached
    slots = cache.extend(["g"], 17, token_ids=[prompt[:17]], salts=["tenant-1"])
    assert cache.num_cached_tokens("g") == 16 and (slots[:16] == -1).all()
    # A fork keeps its parent's salt: its later blocks are the parent tenant's.
    history.fork("b", "b2")
    with pytest.raises(ValueError, match="salt"):
        cache.extend(["b2"], 1, salts=["tenant-1"])
    cache.extend(["b2"], 2, token_ids=[[1, 2]], salts=["tenant-2"])

    # Without prefix caching salts are checked and kept, and change nothing.
    plain = make_cache(prefix=False)
    plain.extend(["x"], 9, token_ids=[prompt[:9]], salts=["s"])
    with pytest.raises(ValueError, match="salt"):
        plain.extend(["x"], 1, salts=["t"])


def test_tables_reuse_buffers_and_pad(rng):
    cache = make_cache(block_size=8)
    cache.extend([0, 1, 2], [20, 0, 3])
    tables, lens = cache.tables([2, 0, 1])
    np.testing.assert_array_equal(lens, [3, 20, 0])
    assert tables.dtype == np.int32 and lens.dtype == np.int32 and tables.shape == (3, 3)
    assert tables.flags.c_contiguous
    np.testing.assert_array_equal(tables[1], cache.block_table(0))
    assert (tables[0, 1:] == -1).all() and (tables[2] == -1).all()
    cache.extend([0, 1, 2], 1)
    tables2, lens2 = cache.tables([2, 0, 1])
    assert np.shares_memory(tables2, tables) or np.shares_memory(lens2, tables)
    fixed, _ = cache.tables([0], max_blocks=10)
    assert fixed.shape == (1, 10)
    with pytest.raises(ValueError, match="max_blocks"):
        cache.tables([0], max_blocks=1)
    empty_tables, empty_lens = cache.tables([])
    assert empty_tables.shape[0] == 0 and empty_lens.shape == (0,)


def test_errors_name_the_problem(rng):
    cache = make_cache(num_blocks=8, block_size=8)
    slots = cache.extend([0], 5)
    rows = np.zeros((5, 2, 64), np.float32)
    for call, match in [
        (lambda: cache.free(99), "99"),
        (lambda: cache.seq_len("nope"), "nope"),
        (lambda: cache.tables([0, 42]), "42"),
        (lambda: cache.fork(42, 43), "42"),
        (lambda: cache.swap_out(42), "42"),
        (lambda: cache.swap_in(42), "42"),
        (lambda: cache.decode(0, np.zeros((1, 4, 64), np.float32), [42]), "42"),
        (lambda: cache.block_table([1]), r"\[1\]"),  # unhashable id
    ]:
        with pytest.raises(KeyError, match=match):
            call()
    cache.extend([1], 1)
    cache.free(1)
    with pytest.raises(KeyError, match="already freed"):
        cache.free(1)

    value_errors = [
        (lambda: cache.write(0, slots, rows[:, :1], rows[:, :1]), "key"),
        (lambda: cache.write(0, slots, rows, rows[:4]), "value"),
        (lambda: cache.write(0, slots[:4], rows, rows), "slots"),
        (lambda: cache.write(0, slots, rows.astype(np.float16), rows), "key: dtype"),
        (lambda: cache.write(0, slots.astype(np.float32), rows, rows), "slots"),
        (lambda: cache.write(2, slots, rows, rows), "layer"),
        (lambda: cache.write(0, slots + 1, rows, rows), "not reserved"),  # a 6th token
        (lambda: cache.write(0, np.array([slots[0]] * 5), rows, rows), "more than once"),
        (lambda: cache.write(0, slots + 8 * 64, rows, rows), "past the cache"),
        (lambda: cache.write(0, slots + 8, rows, rows), "not reserved"),  # a free block
        (lambda: cache.extend([0, 0], 1), "seq_ids"),
        (lambda: cache.extend([0, 1], [1]), "num_new_tokens"),
        (lambda: cache.extend([0], -1), "num_new_tokens"),
        (lambda: cache.extend([0], 2, token_ids=[[1]]), "token_ids"),
        (lambda: cache.fork(0, 0), "child_id"),
        (lambda: cache.decode(0, np.zeros((2, 4, 64), np.float32), [0]), "query"),
        (lambda: cache.key_cache(-1), "layer"),
    ]
    for call, match in value_errors:
        with pytest.raises(ValueError, match=match):
            call()
    # Writing into a block shared after fork would change the other sequence: refused.
    cache.fork(0, 5)
    with pytest.raises(ValueError, match="shared"):
        cache.write(0, slots, rows, rows)
    # The cache is still consistent and usable.
    assert cache.seq_len(0) == 5 and cache.num_free_blocks == 7
    cache.free(5)
    cache.write(0, slots, rows + 1, rows)
    assert (cache.key_cache(0)[cache.block_table(0)[0], :, :5] == 1).all()


def test_constructor_checks():
    with pytest.raises(ValueError, match="dtype"):
        cupa.PagedKVCache(1, 4, 8, 1, 64, "int8", backend="numpy")
    with pytest.raises(ValueError, match="num_blocks"):
        cupa.PagedKVCache(1, 0, 8, 1, 64, backend="numpy")
    with pytest.raises(ValueError, match="head_size"):
        cupa.PagedKVCache(1, 4, 8, 1, 3, backend="numpy")
    with pytest.raises(ValueError, match="kv_format"):  # fp8 caches: tests/unit/test_cache_fp8.py
        cupa.PagedKVCache(1, 4, 8, 1, 64, kv_format="int4", backend="numpy")
    with pytest.raises(ValueError, match="backend"):
        cupa.PagedKVCache(1, 4, 8, 1, 64, backend="tpu")
    cache = cupa.PagedKVCache(1, 4, 8, 1, 64, np.float16, backend="numpy")
    assert cache.dtype == "float16" and cache.key_cache(0).shape == (4, 1, 8, 64)
    if not cupa.arrays.gpu_available():
        assert cupa.PagedKVCache(1, 4, 8, 1, 64).backend == "numpy"


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_one_token_steps_match_the_general_extend(prefix_caching, rng):
    """extend(ids, 1) takes a fast path for decode steps; the same steps given as a list of
    counts (the general path) leave identical slots, tables and free blocks, across block
    boundaries, forks (a shared last block), new ids and a pool that runs out."""
    caches = [cupa.PagedKVCache(1, 40, 8, 2, 64, "float16", backend="numpy",
                                enable_prefix_caching=prefix_caching) for _ in range(2)]
    for cache in caches:
        cache.extend(["a", "b", "c"], [7, 8, 1], token_ids=[list(range(7)), list(range(8)), [5]])
        cache.fork("a", "f")
    ids = ["a", "b", "c", "f"]
    for step in range(40):
        if step == 20:
            ids.append("new")
        results = []
        for fast, cache in zip((True, False), caches):
            try:
                results.append(cache.extend(ids, 1 if fast else [1] * len(ids)))
            except cupa.OutOfBlocksError as exc:
                results.append(type(exc))
        if results[0] is cupa.OutOfBlocksError or results[1] is cupa.OutOfBlocksError:
            assert results[0] is results[1]
            victim = ids.pop(int(rng.integers(len(ids))))
            for cache in caches:
                cache.free(victim)
            continue
        np.testing.assert_array_equal(results[0], results[1])
        tables = [cache.tables(ids) for cache in caches]
        for got, want in zip(tables[0], tables[1]):
            np.testing.assert_array_equal(got, want)
        assert caches[0].num_free_blocks == caches[1].num_free_blocks
