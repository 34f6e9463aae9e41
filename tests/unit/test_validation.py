"""Argument errors name the argument and the expected vs actual value; nothing crashes."""

import numpy as np
import pytest

import cupa

from cases import make_case


@pytest.fixture
def case(rng):
    return make_case(rng, dtype="float16", head_size=64, block_size=16,
                     num_kv_heads=2, group=2, seq_lens=(5, 40))


def call(case, **changes):
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens)
    extra = {k: changes.pop(k) for k in list(changes) if k not in args}
    args.update(changes)
    extra.setdefault("backend", "numpy")
    return cupa.decode(args.pop("query"), args.pop("key_cache"), args.pop("value_cache"),
                       args.pop("block_tables"), args.pop("seq_lens"), **extra)


@pytest.mark.parametrize("change, error, words", [
    (lambda c: dict(query=c.query[0]), ValueError, "query: expected shape"),
    (lambda c: dict(query=c.query.astype(np.float64)), TypeError, "query: dtype"),
    (lambda c: dict(query=c.query[:, :, :48].copy()), ValueError, "head_size"),
    (lambda c: dict(key_cache=c.key_cache.astype(np.float32)), TypeError, "key_cache: dtype"),
    (lambda c: dict(value_cache=c.value_cache[:, :1].copy()), ValueError, "value_cache"),
    (lambda c: dict(key_cache=c.key_cache[..., ::2], value_cache=c.value_cache[..., ::2]),
     ValueError, "key_cache"),
    (lambda c: dict(key_cache=np.asfortranarray(c.key_cache)), ValueError,
     "value_cache: strides must equal key_cache's"),
    (lambda c: dict(query=np.concatenate([c.query, c.query[:, :1]], axis=1)), ValueError,
     "multiple of num_kv_heads"),
    (lambda c: dict(block_tables=c.block_tables.astype(np.int64)), TypeError,
     "block_tables: dtype must be int32"),
    (lambda c: dict(block_tables=c.block_tables[:1]), ValueError, "block_tables: expected"),
    (lambda c: dict(seq_lens=c.seq_lens.astype(np.int64)), TypeError, "seq_lens: dtype"),
    (lambda c: dict(seq_lens=np.array([5, -1], np.int32)), ValueError, "seq_lens[1]: must be >= 0"),
    (lambda c: dict(seq_lens=np.array([5, 10**6], np.int32)), ValueError, "exceeds the block"),
    (lambda c: dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
    (lambda c: dict(alibi_slopes=np.ones(4, np.float64)), TypeError, "alibi_slopes: dtype"),
    (lambda c: dict(out=np.empty((2, 4, 64), np.float32)), TypeError, "out: dtype"),
    (lambda c: dict(scale=float("nan")), ValueError, "scale"),
    (lambda c: dict(backend="tpu"), ValueError, "backend"),
])
def test_bad_arguments(case, change, error, words):
    with pytest.raises(error) as info:
        call(case, **change(case))
    assert words in str(info.value)


def test_bad_block_size(case):
    k = np.ascontiguousarray(case.key_cache.reshape(-1, 2, 4, 4, 64)[:, :, :, 0])
    with pytest.raises(ValueError, match="block_size"):
        call(case, key_cache=k, value_cache=k)


def test_used_block_id_outside_cache(case):
    tables = case.block_tables.copy()
    tables[1, 2] = case.key_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\]"):
        call(case, block_tables=tables)


def test_unused_garbage_ids_are_fine(case):
    tables = case.block_tables.copy()
    tables[0, 1:] = -7  # sequence 0 has 5 tokens: one block
    out = call(case, block_tables=tables)
    assert np.isfinite(out).all()
