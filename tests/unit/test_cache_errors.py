"""Every bad input of PagedKVCache (numpy backend), merge_states and the fp8 converters: the
exception type, the start of its message, and, for the cache, that nothing changed.

The cache of `populated` holds sequences in every state a call can meet: shared blocks (a fork
with a shared partial block), a swapped-out sequence, an empty one, freed prefix-cached blocks
(evictable) and a salted one. Each refused call is checked against a snapshot of free, evictable
and in-use blocks, reference and fill counts, sequence ids, lengths, block tables, swap states,
cached-token counts and the K/V arrays of every layer.

docs/bad_inputs_api.md lists these cases; its "test" column names the ids used here.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa
from cupa.fp8 import dequantize_fp8, quantize_fp8

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE = 2, 12, 8, 2, 64
PROMPT = list(range(100, 116))


def rows(n, dtype=np.float32, heads=KV_HEADS, head_size=HEAD_SIZE, seed=0):
    return np.random.default_rng(seed).standard_normal((n, heads, head_size)).astype(dtype)


def append(cache, seq_id, n, **kw):
    slots = cache.extend([seq_id], n, **kw)
    for layer in range(LAYERS):
        cache.write(layer, slots, rows(n, seed=layer), rows(n, seed=layer + 7))
    return slots


@pytest.fixture
def populated():
    """(cache, slots of "solo"), with:
    "a"    13 tokens, salt "t1"; its partial second block is shared with "b" (a fork)
    "b"    fork of "a"
    "solo" 5 tokens in a block of its own (writable slots)
    "c"    9 tokens, swapped out
    "e"    0 tokens
    and the 2 full blocks of a freed sequence kept as evictable prefix-cache blocks."""
    cache = cupa.PagedKVCache(LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, "float32",
                              backend="numpy", enable_prefix_caching=True)
    append(cache, "a", 13, token_ids=[PROMPT[:13]], salts=["t1"])
    cache.fork("a", "b")
    solo = append(cache, "solo", 5)
    append(cache, "c", 9)
    cache.swap_out("c")
    cache.extend(["e"], 0)
    append(cache, "gone", 17, token_ids=[list(range(17))])
    cache.free("gone")
    assert cache.num_cached_blocks == 2
    return cache, solo


def snapshot(cache):
    alloc = cache._allocator
    seqs = {}
    for s in cache.seq_ids:
        swapped = cache.is_swapped(s)
        seqs[s] = (cache.seq_len(s), swapped, cache.num_cached_tokens(s),
                   None if swapped else cache.block_table(s).tolist())
    return dict(seqs=seqs, free=alloc.free_blocks(), evictable=alloc.evictable_blocks(),
                refcount=alloc.refcount.tolist(), fill=alloc.fill.tolist(),
                num_free=cache.num_free_blocks, num_cached=cache.num_cached_blocks,
                keys=[cache.key_cache(layer).copy() for layer in range(LAYERS)],
                values=[cache.value_cache(layer).copy() for layer in range(LAYERS)])


def assert_same(before, after):
    for key in before:
        if key in ("keys", "values"):
            for a, b in zip(before[key], after[key]):
                np.testing.assert_array_equal(a, b)
        else:
            assert before[key] == after[key], key


def message(info) -> str:
    # str(KeyError) quotes its argument; the message is the first argument for every type.
    return str(info.value.args[0])


def refused(cache, call, error, start):
    """`call` raises `error` whose message starts with `start`, and the cache is unchanged."""
    before = snapshot(cache)
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert message(info).startswith(start), message(info)
    assert_same(before, snapshot(cache))
    return message(info)


def query(n=2, dtype=np.float32, heads=4, head_size=HEAD_SIZE):
    return np.zeros((n, heads, head_size), dtype)


# --- extend -------------------------------------------------------------------------------------

EXTEND_CASES = {
    "extend-unhashable-id": (lambda c: c.extend([["x"]], 1), TypeError,
                             "seq_ids[0]: sequence ids must be hashable"),
    "extend-duplicate-id": (lambda c: c.extend(["solo", "solo"], 1), ValueError,
                            "seq_ids[1]: sequence 'solo' appears more than once"),
    "extend-seq-ids-str": (lambda c: c.extend("solo", 1), TypeError,
                           "seq_ids: expected a list of sequence ids, got str"),
    "extend-negative-count": (lambda c: c.extend(["solo", "new"], [1, -1]), ValueError,
                              "num_new_tokens: must be >= 0"),
    "extend-count-list-length": (lambda c: c.extend(["solo", "new"], [1]), ValueError,
                                 "num_new_tokens: 1 counts for 2 seq_ids"),
    "extend-count-float": (lambda c: c.extend(["solo"], [1.5]), TypeError,
                           "num_new_tokens: counts must be integers"),
    "extend-count-str": (lambda c: c.extend(["solo"], "3"), TypeError,
                         "num_new_tokens: expected an int or one int per seq_id"),
    "extend-token-ids-lists": (lambda c: c.extend(["solo", "new"], 1, token_ids=[[1]]),
                               ValueError, "token_ids: 1 lists for 2 seq_ids"),
    "extend-token-ids-length": (lambda c: c.extend(["new"], 2, token_ids=[[1]]), ValueError,
                                "token_ids: sequence 'new' has 1 token ids for 2 new tokens"),
    "extend-token-ids-float": (lambda c: c.extend(["new"], 2, token_ids=[[1.0, 2.0]]),
                               TypeError, "token_ids: sequence 'new' needs a flat list of int"),
    "extend-token-ids-nested": (lambda c: c.extend(["new"], 2, token_ids=[[[1, 2]]]),
                                TypeError, "token_ids: sequence 'new' needs a flat list of int"),
    "extend-token-ids-int": (lambda c: c.extend(["new"], 1, token_ids=5), TypeError,
                             "token_ids: expected one list of ints per seq_id"),
    "extend-swapped": (lambda c: c.extend(["solo", "c"], 1), ValueError,
                       "cannot extend sequence 'c': it is swapped out"),
    "extend-out-of-blocks": (lambda c: c.extend(["solo", "new"], [1, 10 * BLOCK_SIZE]),
                             cupa.OutOfBlocksError, "extend needs"),
    "extend-salts-length": (lambda c: c.extend(["new", "new2"], 1, salts=["t1"]), ValueError,
                            "salts: 1 salts for 2 seq_ids"),
    "extend-salts-str": (lambda c: c.extend(["new"], 1, salts="t1"), TypeError,
                         "salts: expected a list with one salt"),
    "extend-salt-type": (lambda c: c.extend(["new"], 1, salts=[7]), TypeError,
                         "salts[0]: a salt must be bytes, str or None, got int"),
    "extend-salt-empty": (lambda c: c.extend(["new"], 1, salts=[b""]), ValueError,
                          "salts[0]: empty salt"),
    "extend-salt-changed": (lambda c: c.extend(["solo", "a"], 1, salts=[None, "t2"]),
                            ValueError, "salts[1]: sequence 'a' was created with salt b't1'"),
    "extend-salt-of-fork": (lambda c: c.extend(["b"], 1, salts=[b"t2"]), ValueError,
                            "salts[0]: sequence 'b' was created with salt b't1'"),
    "extend-salt-on-unsalted": (lambda c: c.extend(["solo"], 1, salts=["t1"]), ValueError,
                                "salts[0]: sequence 'solo' was created with salt None"),
}


@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_extend_errors_change_nothing(populated, case):
    cache, _ = populated
    call, error, start = EXTEND_CASES[case]
    refused(cache, lambda: call(cache), error, start)
    assert "new" not in cache and "new2" not in cache


def test_out_of_blocks_is_a_memory_error_and_exact(populated):
    cache, _ = populated
    free = cache.num_free_blocks
    msg = refused(cache, lambda: cache.extend(["new"], (free + 1) * BLOCK_SIZE),
                  cupa.OutOfBlocksError, "extend needs")
    assert f"{free + 1} blocks, {free} are free" in msg
    assert issubclass(cupa.OutOfBlocksError, MemoryError)
    cache.extend(["new"], free * BLOCK_SIZE)  # exactly the free blocks (evictable ones too)
    assert cache.num_free_blocks == 0 and cache.num_cached_blocks == 0


def test_salt_repeated_or_none_is_fine(populated):
    cache, _ = populated
    cache.extend(["a", "b"], 1, salts=[b"t1", None])  # str "t1" was the salt: same bytes
    assert cache.seq_len("a") == 14 and cache.seq_len("b") == 14


# --- write --------------------------------------------------------------------------------------

def shared_slots(cache):
    """Slots of "a"'s tokens in the partial block it shares with "b"."""
    block = int(cache.block_table("a")[1])
    return np.arange(block * BLOCK_SIZE, block * BLOCK_SIZE + 5, dtype=np.int64)


WRITE_CASES = {
    "write-layer-range": (lambda c, s: c.write(LAYERS, s, rows(5), rows(5)), ValueError,
                          f"layer: must be an int in [0, {LAYERS})"),
    "write-layer-bool": (lambda c, s: c.write(True, s, rows(5), rows(5)), ValueError,
                         "layer: must be an int"),
    "write-key-none": (lambda c, s: c.write(0, s, None, rows(5)), TypeError,
                       "key: expected an array"),
    "write-slots-none": (lambda c, s: c.write(0, None, rows(5), rows(5)), TypeError,
                         "slots: expected an array"),
    "write-key-heads": (lambda c, s: c.write(0, s, rows(5, heads=1), rows(5, heads=1)),
                        ValueError, f"key: expected shape [num_tokens, {KV_HEADS}, {HEAD_SIZE}]"),
    "write-key-ndim": (lambda c, s: c.write(0, s, rows(5)[:, 0], rows(5)), ValueError,
                       "key: expected shape"),
    "write-value-head-size": (lambda c, s: c.write(0, s, rows(5), rows(5, head_size=80)),
                              ValueError, "value: expected shape"),
    "write-value-tokens": (lambda c, s: c.write(0, s, rows(5), rows(4)), ValueError,
                           "value: shape (4, 2, 64) must equal key's (5, 2, 64)"),
    "write-key-dtype": (lambda c, s: c.write(0, s, rows(5, np.float16), rows(5)), ValueError,
                        "key: dtype must be the cache's float32, got float16"),
    "write-value-dtype": (lambda c, s: c.write(0, s, rows(5), rows(5, np.float64)), ValueError,
                          "value: dtype must be the cache's float32, got float64"),
    "write-slots-count": (lambda c, s: c.write(0, s[:4], rows(5), rows(5)), ValueError,
                          "slots: expected shape [5] (one per key row), got (4,)"),
    "write-slots-ndim": (lambda c, s: c.write(0, s[None], rows(5), rows(5)), ValueError,
                         "slots: expected shape [5]"),
    "write-slots-float": (lambda c, s: c.write(0, s.astype(np.float64), rows(5), rows(5)),
                          ValueError, "slots: must be an integer array, got float64"),
    "write-slots-shared": (lambda c, s: c.write(0, shared_slots(c), rows(5), rows(5)),
                           ValueError, "slots[0] = "),
    "write-slot-unreserved": (lambda c, s: c.write(0, s + 1, rows(5), rows(5)), ValueError,
                              "slots[4] = "),
    "write-slot-free-block": (lambda c, s: c.write(0, s[:1] * 0 + int(
        c._allocator.free_blocks()[0]) * BLOCK_SIZE, rows(1), rows(1)), ValueError, "slots[0] = "),
    "write-slot-past-cache": (lambda c, s: c.write(0, np.array([BLOCKS * BLOCK_SIZE]), rows(1),
                                                   rows(1)), ValueError, "slots[0] = "),
    "write-slots-duplicate": (lambda c, s: c.write(0, np.repeat(s[:1], 2), rows(2), rows(2)),
                              ValueError, f"slots: slot {0} appears more than once"),
}

WRITE_WHY = {"write-slots-shared": "is shared by 2 sequences",
             "write-slot-unreserved": "not reserved", "write-slot-free-block": "not reserved",
             "write-slot-past-cache": "past the cache"}


@pytest.mark.parametrize("case", list(WRITE_CASES))
def test_write_errors_change_nothing(populated, case):
    cache, solo = populated
    call, error, start = WRITE_CASES[case]
    if case == "write-slots-duplicate":
        start = f"slots: slot {int(solo[0])} appears more than once"
    msg = refused(cache, lambda: call(cache, solo), error, start)
    assert WRITE_WHY.get(case, "") in msg


def test_good_write_after_refusals(populated):
    """The slots refused above are fine once valid: the checks are not over-eager."""
    cache, solo = populated
    cache.write(0, np.concatenate([solo, [-1]]), rows(6), rows(6))
    cache.free("b")  # "a" alone owns its partial block now
    cache.write(1, shared_slots(cache), rows(5), rows(5))


# --- tables, decode -----------------------------------------------------------------------------

TABLES_CASES = {
    "tables-max-blocks-small": (lambda c: c.tables(["a", "solo"], max_blocks=1), ValueError,
                                "max_blocks: 1 is less than the longest table (2 blocks)"),
    "tables-max-blocks-float": (lambda c: c.tables(["a"], max_blocks=2.0), ValueError,
                                "max_blocks: must be an int or None"),
    "tables-swapped": (lambda c: c.tables(["a", "c"]), ValueError,
                       "cannot read the tables of sequence 'c': it is swapped out"),
    "tables-unknown": (lambda c: c.tables(["a", "zz"]), KeyError, "unknown sequence id 'zz'"),
    "tables-seq-ids-str": (lambda c: c.tables("a"), TypeError, "seq_ids: expected a list"),
}


@pytest.mark.parametrize("case", list(TABLES_CASES))
def test_tables_errors_change_nothing(populated, case):
    cache, _ = populated
    call, error, start = TABLES_CASES[case]
    refused(cache, lambda: call(cache), error, start)


DECODE_CASES = {
    "decode-query-rows": (lambda c: c.decode(0, query(3), ["a", "solo"]), ValueError,
                          "query: expected shape [len(seq_ids)=2, num_heads"),
    "decode-query-head-size": (lambda c: c.decode(0, query(head_size=80), ["a", "solo"]),
                               ValueError, "query: expected shape [len(seq_ids)=2"),
    "decode-query-heads": (lambda c: c.decode(0, query(heads=3), ["a", "solo"]), ValueError,
                           "query: expected shape [len(seq_ids)=2"),
    "decode-query-dtype": (lambda c: c.decode(0, query(dtype=np.float16), ["a", "solo"]),
                           ValueError, "query: dtype must be the cache's float32, got float16"),
    "decode-query-none": (lambda c: c.decode(0, None, ["a"]), TypeError,
                          "query: expected an array"),
    "decode-layer-range": (lambda c: c.decode(-1, query(), ["a", "solo"]), ValueError,
                           "layer: must be an int in [0, 2)"),
    "decode-new-tokens-count": (lambda c: c.decode(0, query(3), ["a", "solo"],
                                                   new_tokens=[1, 1, 1]),
                                ValueError, "new_tokens: 3 counts for 2 seq_ids"),
    "decode-new-tokens-zero": (lambda c: c.decode(0, query(1), ["a", "solo"],
                                                  new_tokens=[1, 0]),
                               ValueError, "new_tokens[1]: each sequence decodes 1 to 16"),
    "decode-new-tokens-17": (lambda c: c.decode(0, query(17), ["a"], new_tokens=17),
                             ValueError, "new_tokens[0]: each sequence decodes 1 to 16"),
    "decode-new-tokens-long": (lambda c: c.decode(0, query(6), ["solo"], new_tokens=6),
                               ValueError, "new_tokens[0]: 6 new tokens but sequence 'solo' "
                               "holds 5"),
    "decode-new-tokens-float": (lambda c: c.decode(0, query(2), ["a"], new_tokens=2.0),
                                ValueError, "new_tokens: expected an int"),
    "decode-new-tokens-rows": (lambda c: c.decode(0, query(4), ["a", "solo"],
                                                  new_tokens=[2, 1]),
                               ValueError, "query: expected shape [sum(new_tokens)=3"),
    "decode-new-tokens-and-loc": (lambda c: c.decode(0, query(2), ["a", "solo"], new_tokens=1,
                                                     query_start_loc=np.array([0, 1, 2],
                                                                              np.int32)),
                                  ValueError, "new_tokens and query_start_loc: give one"),
    "decode-kv-format": (lambda c: c.decode(0, query(), ["a", "solo"], kv_format="fp8_e4m3"),
                         ValueError, "kv_format: set by the cache"),
    "decode-k-scale": (lambda c: c.decode(0, query(), ["a", "solo"], k_scale=1.0),
                       ValueError, "k_scale: set by the cache"),
    "decode-swapped": (lambda c: c.decode(0, query(), ["a", "c"]), ValueError,
                       "cannot decode sequence 'c': it is swapped out"),
    "decode-unknown": (lambda c: c.decode(0, query(), ["a", "zz"]), KeyError,
                       "unknown sequence id 'zz'"),
    "decode-bad-scale": (lambda c: c.decode(0, query(), ["a", "solo"], scale=float("nan")),
                         ValueError, "scale: must be finite"),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_errors_change_nothing(populated, case):
    cache, _ = populated
    call, error, start = DECODE_CASES[case]
    refused(cache, lambda: call(cache), error, start)


def test_good_decodes_after_refusals(populated):
    cache, _ = populated
    assert cache.decode(0, query(), ["a", "solo"]).shape == (2, 4, HEAD_SIZE)
    assert cache.decode(1, query(18), ["a", "solo"], new_tokens=[13, 5]).shape == (18, 4, 64)


# --- fork, free, swap, queries ------------------------------------------------------------------

SEQUENCE_CASES = {
    "fork-unknown-parent": (lambda c: c.fork("zz", "new"), KeyError, "unknown sequence id 'zz'"),
    "fork-existing-child": (lambda c: c.fork("a", "solo"), ValueError,
                            "child_id: sequence 'solo' already exists"),
    "fork-onto-itself": (lambda c: c.fork("a", "a"), ValueError,
                         "child_id: sequence 'a' already exists"),
    "fork-swapped-parent": (lambda c: c.fork("c", "new"), ValueError,
                            "cannot fork sequence 'c': it is swapped out"),
    "fork-unhashable-child": (lambda c: c.fork("a", {}), TypeError,
                              "child_id: sequence ids must be hashable"),
    "free-unknown": (lambda c: c.free("zz"), KeyError, "unknown sequence id 'zz' (never "
                     "extended, or already freed)"),
    "swap-out-unknown": (lambda c: c.swap_out("zz"), KeyError, "unknown sequence id 'zz'"),
    "swap-out-swapped": (lambda c: c.swap_out("c"), ValueError,
                         "cannot swap out sequence 'c': it is swapped out"),
    "swap-in-unknown": (lambda c: c.swap_in("zz"), KeyError, "unknown sequence id 'zz'"),
    "swap-in-not-swapped": (lambda c: c.swap_in("a"), ValueError,
                            "seq_id: sequence 'a' is not swapped out"),
    "block-table-swapped": (lambda c: c.block_table("c"), ValueError,
                            "cannot read the block table of sequence 'c'"),
    "seq-len-unknown": (lambda c: c.seq_len("zz"), KeyError, "unknown sequence id 'zz'"),
    "seq-len-unhashable": (lambda c: c.seq_len(["a"]), KeyError, "unknown sequence id ['a']"),
    "key-cache-layer": (lambda c: c.key_cache(LAYERS), ValueError, "layer: must be an int"),
}


@pytest.mark.parametrize("case", list(SEQUENCE_CASES))
def test_sequence_errors_change_nothing(populated, case):
    cache, _ = populated
    call, error, start = SEQUENCE_CASES[case]
    refused(cache, lambda: call(cache), error, start)


def test_double_free(populated):
    cache, _ = populated
    cache.free("e")
    refused(cache, lambda: cache.free("e"), KeyError, "unknown sequence id 'e'")
    cache.free("c")  # a swapped-out sequence frees too (its host copy goes with it)
    refused(cache, lambda: cache.swap_in("c"), KeyError, "unknown sequence id 'c'")


def test_swap_in_without_room(populated):
    cache, _ = populated
    cache.extend(["hog"], cache.num_free_blocks * BLOCK_SIZE)
    refused(cache, lambda: cache.swap_in("c"), cupa.OutOfBlocksError,
            "swap_in('c') needs 2 blocks, 0 are free")
    cache.free("hog")
    cache.swap_in("c")
    assert not cache.is_swapped("c") and cache.seq_len("c") == 9


# --- constructor --------------------------------------------------------------------------------

def make(**changes):
    args = dict(num_layers=1, num_blocks=4, block_size=8, num_kv_heads=2, head_size=64,
                dtype="float16", backend="numpy")
    args.update(changes)
    return cupa.PagedKVCache(**args)


CONSTRUCTOR_CASES = {
    "init-head-size-16": (dict(head_size=16), ValueError,
                          "head_size: must be one of (64, 80, 96, 112, 128, 192, 256)"),
    "init-head-size-48": (dict(head_size=48), ValueError, "head_size: must be one of"),
    "init-head-size-72-fp8": (dict(head_size=72, kv_format="fp8_e4m3"), ValueError,
                              "head_size: must be one of"),
    "init-block-size-12": (dict(block_size=12), ValueError,
                           "block_size: must be one of (1, 2, 4, 8, 16, 32)"),
    "init-block-size-64": (dict(block_size=64), ValueError, "block_size: must be one of"),
    "init-num-layers-0": (dict(num_layers=0), ValueError,
                          "num_layers: must be a positive integer, got 0"),
    "init-num-blocks-float": (dict(num_blocks=4.0), ValueError,
                              "num_blocks: must be a positive integer, got 4.0"),
    "init-num-kv-heads-bool": (dict(num_kv_heads=True), ValueError,
                               "num_kv_heads: must be a positive integer, got True"),
    "init-num-blocks-int32": (dict(num_blocks=2**31), ValueError,
                              "num_blocks: block tables are int32"),
    "init-dtype-int8": (dict(dtype="int8"), ValueError, "dtype: must be one of ('float16', "),
    "init-dtype-float64": (dict(dtype=np.float64), ValueError, "dtype: must be one of"),
    "init-dtype-not-a-dtype": (dict(dtype=5), ValueError, "dtype: must be one of"),
    "init-kv-format": (dict(kv_format="fp8"), ValueError,
                       "kv_format: must be None or one of 'fp8_e4m3', 'fp8_e4m3fnuz'"),
    "init-scale-without-fp8": (dict(k_scale=0.5), ValueError,
                               "k_scale, v_scale: only an fp8 kv_format has scales"),
    "init-fp8-scale-zero": (dict(kv_format="fp8_e4m3", k_scale=0.0), ValueError,
                            "k_scale: scales must be positive and finite"),
    "init-fp8-scale-nan": (dict(kv_format="fp8_e4m3", v_scale=[1.0, np.nan]), ValueError,
                           "v_scale: scales must be positive and finite"),
    "init-fp8-scale-shape": (dict(kv_format="fp8_e4m3", k_scale=np.ones(3, np.float32)),
                             ValueError, "k_scale: expected one scale or shape [num_kv_heads=2]"),
    "init-backend": (dict(backend="tpu"), ValueError, "backend: must be one of ('gpu', 'numpy')"),
}


@pytest.mark.parametrize("case", list(CONSTRUCTOR_CASES))
def test_constructor_errors(case):
    changes, error, start = CONSTRUCTOR_CASES[case]
    with pytest.raises(error) as info:
        make(**changes)
    assert type(info.value) is error
    assert message(info).startswith(start), message(info)


@pytest.mark.skipif(cupa.arrays.gpu_available(), reason="a GPU is usable here")
def test_constructor_gpu_backend_without_gpu():
    with pytest.raises(RuntimeError, match="^backend='gpu' but no GPU is usable"):
        make(backend="gpu")


def test_constructor_accepts_every_served_shape():
    from cupa.problem import SUPPORTED_BLOCK_SIZES, SUPPORTED_HEAD_SIZES
    for head_size in SUPPORTED_HEAD_SIZES:
        for block_size in SUPPORTED_BLOCK_SIZES:
            for fp8 in (None, "fp8_e4m3"):
                cache = make(head_size=head_size, block_size=block_size, kv_format=fp8)
                assert cache.key_cache(0).shape == (4, 2, block_size, head_size)


# --- merge_states -------------------------------------------------------------------------------

def state(dtype=np.float32, shape=(2, 4, 64)):
    return np.zeros(shape, dtype), np.zeros(shape[:-1], np.float32)


MERGE_CASES = {
    "merge-empty": (lambda: cupa.merge_states_n([], []), ValueError,
                    "outs and lses: need the same non-zero number of states, got 0 and 0"),
    "merge-count-mismatch": (lambda: cupa.merge_states_n([state()[0]] * 2, [state()[1]]),
                             ValueError, "outs and lses: need the same non-zero number of "
                             "states, got 2 and 1"),
    "merge-not-a-list": (lambda: cupa.merge_states_n(None, None), TypeError,
                         "outs: expected a list of arrays"),
    "merge-none-state": (lambda: cupa.merge_states_n([state()[0], None], [state()[1]] * 2),
                         TypeError, "outs[1]: expected an array"),
    "merge-out-shape": (lambda: cupa.merge_states(*state(), *state(shape=(2, 4, 128))),
                        ValueError, "outs[1]: expected shape (2, 4, 64) and dtype float32"),
    "merge-out-dtype": (lambda: cupa.merge_states(*state(), *state(np.float16)), ValueError,
                        "outs[1]: expected shape (2, 4, 64) and dtype float32"),
    "merge-out-int": (lambda: cupa.merge_states(*state(np.int32), *state(np.int32)), TypeError,
                      "outs[0]: expected a float16, bfloat16 or float32 array"),
    "merge-lse-shape": (lambda: cupa.merge_states(*state(), state()[0], state()[0][..., 0, :]),
                        ValueError, "lses[1]: expected shape (2, 4)"),
    "merge-lse-dtype": (lambda: cupa.merge_states(state()[0], state()[1].astype(np.float64),
                                                  *state()),
                        TypeError, "lses[0]: dtype must be float32, got float64"),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merge_errors(case):
    call, error, start = MERGE_CASES[case]
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert message(info).startswith(start), message(info)


# --- fp8 converters -----------------------------------------------------------------------------

X = np.ones((3, 2, 64), np.float32)
CODES = np.zeros((3, 2, 64), np.uint8)

FP8_CASES = {
    "quantize-format": (lambda: quantize_fp8(X, "e4m3"), ValueError,
                        "fmt: must be None or one of 'fp8_e4m3', 'fp8_e4m3fnuz', got 'e4m3'"),
    "quantize-format-none": (lambda: quantize_fp8(X, None), ValueError,
                             "fmt: an fp8 format is required"),
    "quantize-not-float": (lambda: quantize_fp8(X.astype(np.int32), "fp8_e4m3"), ValueError,
                           "x: must be a float array, got int32"),
    "quantize-scale-zero": (lambda: quantize_fp8(X, "fp8_e4m3", 0.0), ValueError,
                            "scale: scales must be positive and finite"),
    "quantize-scale-negative": (lambda: quantize_fp8(X, "fp8_e4m3", -2.0), ValueError,
                                "scale: scales must be positive and finite"),
    "quantize-scale-nan": (lambda: quantize_fp8(X, "fp8_e4m3", np.array([[1.0], [np.nan]])),
                           ValueError, "scale: scales must be positive and finite"),
    "quantize-scale-shape": (lambda: quantize_fp8(X, "fp8_e4m3", np.ones(3, np.float32)),
                             ValueError, "scale: shape (3,) does not broadcast against x"),
    "quantize-scale-str": (lambda: quantize_fp8(X, "fp8_e4m3", "big"), ValueError,
                           "scale: must be a number or a float array"),
    "dequantize-format": (lambda: dequantize_fp8(CODES, "fp8"), ValueError,
                          "fmt: must be None or one of"),
    "dequantize-not-uint8": (lambda: dequantize_fp8(CODES.astype(np.int8), "fp8_e4m3"),
                             ValueError, "codes: must be a uint8 array, got int8"),
    "dequantize-scale-zero": (lambda: dequantize_fp8(CODES, "fp8_e4m3", 0.0), ValueError,
                              "scale: scales must be positive and finite"),
    "dequantize-scale-inf": (lambda: dequantize_fp8(CODES, "fp8_e4m3fnuz", np.inf), ValueError,
                             "scale: scales must be positive and finite"),
    "dequantize-scale-shape": (lambda: dequantize_fp8(CODES, "fp8_e4m3", np.ones((2, 2))),
                               ValueError, "scale: shape (2, 2) does not broadcast against "
                               "codes"),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
def test_fp8_converter_errors(case):
    call, error, start = FP8_CASES[case]
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error
    assert message(info).startswith(start), message(info)


def test_fp8_per_head_scales_still_broadcast():
    per_head = np.array([[0.5], [2.0]], np.float32)  # [heads, 1] against [tokens, heads, dim]
    codes = quantize_fp8(X, "fp8_e4m3", per_head)
    np.testing.assert_array_equal(dequantize_fp8(codes, "fp8_e4m3", per_head), X)


# --- the documentation table --------------------------------------------------------------------

def test_bad_inputs_doc_names_existing_tests():
    """Every test the table of docs/bad_inputs_api.md names exists (with that case id), and
    every case here and in test_api_errors.py has a row."""
    import importlib
    import pathlib
    import re
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs"
    # The lead merges this section into docs/bad_inputs.md; read whichever holds it.
    sources = [p for p in (docs / "bad_inputs_api.md", docs / "bad_inputs.md") if p.exists()]
    text = next((p.read_text() for p in sources if "test_cache_errors.py::" in p.read_text()),
                None)
    if text is None:
        pytest.skip("no bad-inputs table in docs/")
    named = re.findall(r"`(test_\w+)\.py::(test_\w+)(?:\[([\w-]+)\])?`", text)
    assert len(named) >= 30
    for module_name, function_name, case_id in named:
        function = getattr(importlib.import_module(module_name), function_name)
        if case_id:
            ids = set()
            for mark in getattr(function, "pytestmark", []):
                if mark.name == "parametrize":
                    ids |= {getattr(v, "id", None) or v for v in mark.args[1]
                            if isinstance(getattr(v, "id", None) or v, str)}
            assert case_id in ids, f"{module_name}::{function_name}[{case_id}]"
    import test_api_errors
    documented = {case_id for _, _, case_id in named}
    tables = [EXTEND_CASES, WRITE_CASES, TABLES_CASES, DECODE_CASES, SEQUENCE_CASES,
              CONSTRUCTOR_CASES, MERGE_CASES, FP8_CASES, test_api_errors.DECODE_CASES,
              test_api_errors.LEAD_CASES, test_api_errors.RUN_CASES,
              test_api_errors.RUN_LEAD_CASES]
    missing = sorted(set().union(*tables) - documented)
    assert not missing, f"cases without a row in the table: {missing}"
