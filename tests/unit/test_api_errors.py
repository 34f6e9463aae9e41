"""Every argument error of `cupa.decode`, `cupa.plan_decode` and `DecodePlan.run` on the numpy
backend (CPU): the exception type and the start of its message, one test per validation error.

docs/bad_inputs_api.md lists every case by the ids used here.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupa

from cases import make_case

SEQ_LENS = (5, 40)


@pytest.fixture
def case(rng):
    """float16, head_size 64, block_size 16, 2 KV heads, 4 query heads, two sequences (5 and
    40 tokens) in a 5-block cache; table columns past each sequence's blocks hold a poisoned
    block, then garbage."""
    return make_case(rng, dtype="float16", head_size=64, block_size=16, num_kv_heads=2,
                     group=2, seq_lens=SEQ_LENS, num_blocks=5)


ARRAYS = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")


def arguments(case, changes: dict):
    """(the five arrays, keywords) of a decode call on `case` with `changes` applied."""
    args = dict(zip(ARRAYS, case.args()))
    args.update({k: v for k, v in changes.items() if k in ARRAYS})
    kwargs = {k: v for k, v in changes.items() if k not in ARRAYS}
    kwargs.setdefault("backend", "numpy")
    return [args[name] for name in ARRAYS], kwargs


def strided(array, axis=-1):
    """The values of `array` in a view that is not C-contiguous (every second element of a
    twice as long axis)."""
    shape = list(array.shape)
    shape[axis] *= 2
    wide = np.zeros(shape, array.dtype)
    index = [slice(None)] * array.ndim
    index[axis] = slice(None, None, 2)
    view = wide[tuple(index)]
    view[...] = array
    return view


def padded_rows(array, pad):
    """The values of `array` in rows `pad` elements longer than head_size (a view)."""
    wide = np.zeros(array.shape[:-1] + (array.shape[-1] + pad,), array.dtype)
    wide[..., :array.shape[-1]] = array
    return wide[..., :array.shape[-1]]


def with_stride(array, axis, stride):
    """A view of `array` with `stride` bytes on `axis` (never read: the strides are refused
    first)."""
    strides = list(array.strides)
    strides[axis] = stride
    return np.lib.stride_tricks.as_strided(array, strides=strides, writeable=False)


def huge_block_stride(array):
    return with_stride(array, 0, 2**32)


def huge_token_stride(array):
    return with_stride(array, 2, 2**24 * array.itemsize)


def fp8_cache(case):
    codes = np.zeros(case.key_cache.shape, np.uint8)
    return dict(key_cache=codes, value_cache=codes.copy(), kv_format="fp8_e4m3")


# id -> (changes of the call as a function of the case, exception, message start)
DECODE_CASES = {
    # Non-arrays: validation.check_is_array.
    "query-none": (lambda c: dict(query=None), TypeError, "query: expected an array"),
    "key-cache-str": (lambda c: dict(key_cache="cache"), TypeError,
                      "key_cache: expected an array"),
    "value-cache-dict": (lambda c: dict(value_cache={}), TypeError,
                         "value_cache: expected an array"),
    "block-tables-none": (lambda c: dict(block_tables=None), TypeError,
                          "block_tables: expected an array"),
    "seq-lens-object": (lambda c: dict(seq_lens=object()), TypeError,
                        "seq_lens: expected an array"),
    # query
    "query-ndim": (lambda c: dict(query=c.query[0]), ValueError,
                   "query: expected shape [num_tokens, num_heads, head_size], got (4, 64)"),
    "query-dtype": (lambda c: dict(query=c.query.astype(np.float64)), TypeError,
                    "query: dtype must be one of ('float16', 'bfloat16', 'float32'), got float64"),
    "query-list": (lambda c: dict(query=c.query.tolist()), TypeError,
                   "query: dtype must be one of"),
    "query-head-size": (lambda c: dict(query=np.zeros((2, 4, 48), np.float16)), ValueError,
                        "query: head_size must be one of (64, 80, 96, 112, 128, 192, 256), "
                        "got 48"),
    "query-contiguity": (lambda c: dict(query=strided(c.query)), ValueError,
                         "query: must be C-contiguous"),
    # caches
    "key-cache-ndim": (lambda c: dict(key_cache=c.key_cache[0], value_cache=c.value_cache[0]),
                       ValueError, "key_cache: expected shape [num_blocks, num_kv_heads, "
                       "block_size, head_size]"),
    "value-cache-shape": (lambda c: dict(value_cache=c.value_cache[:, :1].copy()), ValueError,
                          "value_cache: expected shape (5, 2, 16, 64) (same as key_cache)"),
    "key-cache-dtype": (lambda c: dict(key_cache=c.key_cache.astype(np.float32)), TypeError,
                        "key_cache: dtype must match query (float16), got float32"),
    "value-cache-dtype": (lambda c: dict(value_cache=c.value_cache.astype(np.float32)),
                          TypeError, "value_cache: dtype must match query (float16)"),
    "key-cache-contiguity": (lambda c: dict(key_cache=np.asfortranarray(c.key_cache),
                                            value_cache=np.asfortranarray(c.value_cache)),
                             ValueError, "key_cache / value_cache (kv_layout='HND'): each row of "
                             "head_size elements must be contiguous"),
    "value-cache-strides": (lambda c: dict(value_cache=strided(c.value_cache, axis=0)),
                            ValueError, "value_cache: strides must equal key_cache's "
                            "(4096, 2048, 128, 2) (bytes)"),
    "key-cache-stride-alignment": (lambda c: dict(key_cache=padded_rows(c.key_cache, 4),
                                                  value_cache=padded_rows(c.value_cache, 4)),
                                   ValueError, "key_cache / value_cache (kv_layout='HND'): the "
                                   "token stride must be a positive multiple of 16 bytes, got "
                                   "136"),
    "key-cache-reversed": (lambda c: dict(key_cache=c.key_cache[::-1], value_cache=c.value_cache[::-1]),
                           ValueError, "key_cache / value_cache (kv_layout='HND'): the block "
                           "stride must be a positive multiple of 16 bytes, got -4096"),
    "key-cache-block-stride-4gib": (lambda c: dict(key_cache=huge_block_stride(c.key_cache),
                                                   value_cache=huge_block_stride(c.value_cache)),
                                    ValueError, "key_cache / value_cache (kv_layout='HND'): the "
                                    "block stride must be below 2^32 bytes, got 4294967296"),
    "key-cache-token-stride-16m": (lambda c: dict(key_cache=huge_token_stride(c.key_cache),
                                                   value_cache=huge_token_stride(c.value_cache)),
                                    ValueError, "key_cache / value_cache (kv_layout='HND'): the "
                                    "token stride must be below 2^24 elements, got 16777216"),
    "kv-layout-unknown": (lambda c: dict(kv_layout="nhd"), ValueError,
                          "kv_layout: must be one of ('HND', 'NHD') or None, got 'nhd'"),
    "key-cache-ndim-nhd": (lambda c: dict(key_cache=c.key_cache[0], value_cache=c.value_cache[0],
                                          kv_layout="NHD"),
                           ValueError, "key_cache: expected shape [num_blocks, block_size, "
                           "num_kv_heads, head_size] (kv_layout='NHD')"),
    "hnd-caches-as-nhd": (lambda c: dict(kv_layout="NHD"), ValueError,
                          "num_heads (4, query dim 1) must be a multiple of num_kv_heads (16, "
                          "key_cache dim 2)"),
    "key-cache-head-size": (lambda c: dict(key_cache=c.key_cache[..., :32].copy(),
                                           value_cache=c.value_cache[..., :32].copy()),
                            ValueError, "key_cache: head_size (last dim) must equal query's 64, "
                            "got 32"),
    "block-size-12": (lambda c: dict(key_cache=c.key_cache[:, :, :12].copy(),
                                     value_cache=c.value_cache[:, :, :12].copy()),
                      ValueError, "key_cache: block_size (dim 2) must be one of (1, 2, 4, 8, 16, 32), "
                      "got 12"),
    "gqa-not-dividing": (lambda c: dict(query=np.zeros((2, 3, 64), np.float16)), ValueError,
                         "num_heads (3, query dim 1) must be a multiple of num_kv_heads (2, "
                         "key_cache dim 1)"),
    "no-blocks": (lambda c: dict(key_cache=c.key_cache[:0], value_cache=c.value_cache[:0]),
                  ValueError, "key_cache: needs at least one block"),
    # block_tables, seq_lens: metadata
    "block-tables-ndim": (lambda c: dict(block_tables=c.block_tables[0]), ValueError,
                          "block_tables: expected shape [2, max_blocks_per_seq], got (5,)"),
    "block-tables-rows": (lambda c: dict(block_tables=c.block_tables[:1]), ValueError,
                          "block_tables: expected shape [2, max_blocks_per_seq], got (1, 5)"),
    "block-tables-dtype": (lambda c: dict(block_tables=c.block_tables.astype(np.int64)),
                           TypeError, "block_tables: dtype must be int32, got int64"),
    "block-tables-no-columns": (lambda c: dict(block_tables=c.block_tables[:, :0].copy()),
                                ValueError, "block_tables: needs at least one column"),
    "block-tables-contiguity": (lambda c: dict(block_tables=strided(c.block_tables)),
                                ValueError, "block_tables: must be C-contiguous"),
    "seq-lens-shape": (lambda c: dict(seq_lens=c.seq_lens[:1]), ValueError,
                       "seq_lens: expected shape [2], got (1,)"),
    "seq-lens-dtype": (lambda c: dict(seq_lens=c.seq_lens.astype(np.int64)), TypeError,
                       "seq_lens: dtype must be int32, got int64"),
    "seq-lens-contiguity": (lambda c: dict(seq_lens=strided(c.seq_lens)), ValueError,
                            "seq_lens: must be C-contiguous"),
    # block_tables, seq_lens: contents (host tables are read)
    "seq-lens-negative": (lambda c: dict(seq_lens=np.array([5, -1], np.int32)), ValueError,
                          "seq_lens[1]: must be >= 0, got -1"),
    "seq-lens-over-capacity": (lambda c: dict(seq_lens=np.array([5, 81], np.int32)),
                               ValueError, "seq_lens[1] = 81 exceeds the block table's "
                               "capacity 80 (= 5 blocks x block_size 16)"),
    "block-id-past-cache": (lambda c: dict(block_tables=with_entry(c.block_tables, 1, 2, 5)),
                            ValueError, "block_tables[1, 2] = 5 is not a block of the cache "
                            "(0 <= id < 5) but is used by seq_lens[1] = 40"),
    "block-id-negative": (lambda c: dict(block_tables=with_entry(c.block_tables, 0, 0, -1)),
                          ValueError, "block_tables[0, 0] = -1 is not a block of the cache"),
    # query_start_loc
    "query-start-loc-ndim": (lambda c: dict(query_start_loc=np.array([[0, 1, 2]], np.int32)),
                             ValueError, "query_start_loc: expected shape [num_seqs + 1], "
                             "got (1, 3)"),
    "query-start-loc-empty": (lambda c: dict(query_start_loc=np.zeros(0, np.int32)),
                              ValueError, "query_start_loc: expected shape [num_seqs + 1]"),
    "query-start-loc-dtype": (lambda c: dict(query_start_loc=np.array([0, 1, 2], np.int64)),
                              TypeError, "query_start_loc: dtype must be int32, got int64"),
    "query-start-loc-contiguity": (lambda c: dict(query_start_loc=strided(
        np.array([0, 1, 2], np.int32))), ValueError, "query_start_loc: must be C-contiguous"),
    "query-start-loc-seqs": (lambda c: dict(query_start_loc=np.array([0, 2], np.int32)),
                             ValueError, "block_tables: expected shape [1, max_blocks_per_seq]"),
    "query-start-loc-start": (lambda c: dict(query_start_loc=np.array([1, 1, 2], np.int32)),
                              ValueError, "query_start_loc: must start at 0 and end at the "
                              "query's rows (2), got 1 ... 2"),
    "query-start-loc-end": (lambda c: dict(query_start_loc=np.array([0, 1, 1], np.int32)),
                            ValueError, "query_start_loc: must start at 0 and end at the "
                            "query's rows (2), got 0 ... 1"),
    "query-start-loc-zero-tokens": (lambda c: dict(query_start_loc=np.array([0, 0, 2],
                                                                            np.int32)),
                                    ValueError, "query_start_loc: sequence 0 has 0 new tokens"),
    "query-start-loc-17-tokens": (lambda c: dict(
        query=np.zeros((18, 4, 64), np.float16), seq_lens=np.array([40, 40], np.int32),
        query_start_loc=np.array([0, 17, 18], np.int32)),
        ValueError, "query_start_loc: sequence 0 has 17 new tokens"),
    "seq-shorter-than-new-tokens": (lambda c: dict(
        query=np.zeros((7, 4, 64), np.float16), query_start_loc=np.array([0, 6, 7], np.int32)),
        ValueError, "seq_lens[0] = 5 is less than the sequence's 6 new tokens"),
    "max-query-len-0": (lambda c: dict(max_query_len=0), ValueError,
                        "max_query_len: must be an int from 1 to 16, got 0"),
    "max-query-len-17": (lambda c: dict(max_query_len=17), ValueError,
                         "max_query_len: must be an int from 1 to 16, got 17"),
    "max-query-len-float": (lambda c: dict(max_query_len=2.5), ValueError,
                            "max_query_len: must be an int from 1 to 16, got 2.5"),
    # scalars
    "scale-nan": (lambda c: dict(scale=float("nan")), ValueError, "scale: must be finite"),
    "scale-inf": (lambda c: dict(scale=float("inf")), ValueError, "scale: must be finite"),
    "sliding-window-0": (lambda c: dict(sliding_window=0), ValueError,
                         "sliding_window: must be a positive int (tokens) or None, got 0"),
    "sliding-window-float": (lambda c: dict(sliding_window=2.5), ValueError,
                             "sliding_window: must be a positive int"),
    "sliding-window-bool": (lambda c: dict(sliding_window=True), ValueError,
                            "sliding_window: must be a positive int"),
    "soft-cap-0": (lambda c: dict(logits_soft_cap=0.0), ValueError,
                   "logits_soft_cap: must be a positive finite float or None, got 0.0"),
    "soft-cap-inf": (lambda c: dict(logits_soft_cap=float("inf")), ValueError,
                     "logits_soft_cap: must be a positive finite float"),
    "backend": (lambda c: dict(backend="tpu"), ValueError,
                "backend: must be one of ('gpu', 'numpy') or None, got 'tpu'"),
    # per-head arrays, out
    "alibi-shape": (lambda c: dict(alibi_slopes=np.ones(3, np.float32)), ValueError,
                    "alibi_slopes: expected shape [4], got (3,)"),
    "alibi-dtype": (lambda c: dict(alibi_slopes=np.ones(4, np.float64)), TypeError,
                    "alibi_slopes: dtype must be float32, got float64"),
    "sinks-shape": (lambda c: dict(sinks=np.ones((4, 1), np.float32)), ValueError,
                    "sinks: expected shape [4], got (4, 1)"),
    "sinks-dtype": (lambda c: dict(sinks=np.ones(4, np.float16)), TypeError,
                    "sinks: dtype must be float32, got float16"),
    "out-shape": (lambda c: dict(out=np.empty((2, 4, 80), np.float16)), ValueError,
                  "out: expected shape (2, 4, 64), got (2, 4, 80)"),
    "out-dtype": (lambda c: dict(out=np.empty((2, 4, 64), np.float32)), TypeError,
                  "out: dtype must match query (float16), got float32"),
    "out-contiguity": (lambda c: dict(out=strided(np.empty((2, 4, 64), np.float16))),
                       ValueError, "out: must be C-contiguous"),
    # fp8
    "kv-format-unknown": (lambda c: dict(kv_format="int8"), ValueError,
                          "kv_format: must be None or one of 'fp8_e4m3', 'fp8_e4m3fnuz', "
                          "got 'int8'"),
    "k-scale-without-fp8": (lambda c: dict(k_scale=0.5), ValueError,
                            "k_scale / v_scale: only meaningful with an fp8 kv_format"),
    "fp8-cache-not-uint8": (lambda c: dict(kv_format="fp8_e4m3"), TypeError,
                            "key_cache: dtype must be uint8 (fp8 codes, kv_format='fp8_e4m3')"),
    "fp8-float32-query": (lambda c: dict(query=c.query.astype(np.float32), **fp8_cache(c)),
                          TypeError, "kv_format='fp8_e4m3': an fp8 cache needs a query of "
                          "dtype float16 or bfloat16, got float32"),
    "fp8-k-scale-zero": (lambda c: dict(k_scale=0.0, **fp8_cache(c)), ValueError,
                         "k_scale: scales must be positive and finite"),
    "fp8-v-scale-nan": (lambda c: dict(v_scale=np.array([1.0, np.nan], np.float32),
                                       **fp8_cache(c)),
                        ValueError, "v_scale: scales must be positive and finite"),
    "fp8-k-scale-shape": (lambda c: dict(k_scale=np.ones(3, np.float32), **fp8_cache(c)),
                          ValueError, "k_scale: expected one scale or shape [num_kv_heads=2]"),
}

# Errors the lead's change made clear (each entry's last item says what changed where).
LEAD_CASES = {
    "query-start-loc-str": (lambda c: dict(query_start_loc="0,1,2"), TypeError,
                            "query_start_loc: expected an array",
                            "cupa/api.py _plan: call check_is_array on query_start_loc, "
                            "alibi_slopes, sinks and out when they are not None (today a "
                            "string gives ValueError 'expected shape [num_seqs + 1], got ()')"),
    "alibi-str": (lambda c: dict(alibi_slopes="slopes"), TypeError,
                  "alibi_slopes: expected an array",
                  "cupa/api.py _plan: check_is_array('alibi_slopes', ...) when not None (today "
                  "ValueError 'expected shape [4], got ()')"),
    "out-str": (lambda c: dict(out="buffer"), TypeError, "out: expected an array",
                "cupa/api.py _plan: check_is_array('out', ...) when not None (today "
                "AttributeError: 'str' object has no attribute 'shape')"),
    "scale-str": (lambda c: dict(scale="big"), ValueError, "scale: must be",
                  "cupa/validation.py check_decode_args: wrap float(scale) so the message "
                  "names scale (today 'could not convert string to float')"),
    "soft-cap-str": (lambda c: dict(logits_soft_cap="big"), ValueError,
                     "logits_soft_cap: must be",
                     "cupa/validation.py check_decode_args: wrap float(logits_soft_cap) so the "
                     "message names it (today 'could not convert string to float')"),
    "sliding-window-str": (lambda c: dict(sliding_window="wide"), ValueError,
                           "sliding_window: must be",
                           "cupa/validation.py check_decode_args: wrap int(sliding_window) so "
                           "the message names it (today 'invalid literal for int()')"),
    "partition-size-negative": (lambda c: dict(partition_size=-3), ValueError,
                                "partition_size: must be",
                                "cupa/api.py _plan (or DecodePlan): check partition_size on "
                                "every backend; the numpy backend ignores it, so -3 passes "
                                "there and fails only on the GPU (gpu/planner.py)"),
}


def with_entry(table, row, col, value):
    table = table.copy()
    table[row, col] = value
    return table


def check(call, error, start):
    with pytest.raises(Exception) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert str(info.value).startswith(start), str(info.value)


ALL_CASES = [pytest.param(k, *v, id=k) for k, v in DECODE_CASES.items()] + [
    pytest.param(k, *v[:3], id=k) for k, v in LEAD_CASES.items()]


@pytest.mark.parametrize("name, change, error, start", ALL_CASES)
def test_decode_errors(case, name, change, error, start):
    arrays, kwargs = arguments(case, change(case))
    check(lambda: cupa.decode(*arrays, **kwargs), error, start)


# plan_decode validates like decode (shared front half); out is not one of its arguments.
PLAN_CASES = [p for p in ALL_CASES if not p.values[0].startswith("out-")]


@pytest.mark.parametrize("name, change, error, start", PLAN_CASES)
def test_plan_decode_errors(case, name, change, error, start):
    arrays, kwargs = arguments(case, change(case))
    check(lambda: cupa.plan_decode(*arrays, **kwargs), error, start)


def test_valid_case_decodes(case):
    """The unchanged case is valid, so each error above comes from its one change."""
    out = cupa.decode(*case.args(), backend="numpy")
    assert out.shape == (2, 4, 64) and np.isfinite(out.astype(np.float32)).all()
    plan = cupa.plan_decode(*case.args(), backend="numpy")
    np.testing.assert_array_equal(plan.run(*case.args()), out)


@pytest.mark.skipif(cupa.arrays.gpu_available(), reason="a GPU is usable here")
def test_gpu_backend_without_gpu(case):
    check(lambda: cupa.decode(*case.args(), backend="gpu"), RuntimeError,
          "backend='gpu' but no GPU is usable")


# --- DecodePlan.run ------------------------------------------------------------------------------

def grown(case, extra_seqs=1):
    """The case's arrays with one more sequence: shapes the plan did not see."""
    q, k, v, tables, lens = case.args()
    return (np.concatenate([q, q[:extra_seqs]]), k, v,
            np.concatenate([tables, tables[:extra_seqs]]),
            np.concatenate([lens, lens[:extra_seqs]]))


RUN_CASES = {
    "run-more-seqs": (lambda c, p: p.run(*grown(c)), ValueError,
                      "DecodePlan.run: the arguments do not match the plan (num_seqs: planned "
                      "2, got 3; num_tokens: planned 2, got 3)"),
    "run-dtype": (lambda c, p: p.run(c.query.astype(np.float32), c.key_cache.astype(np.float32),
                                     c.value_cache.astype(np.float32), *c.args()[3:]),
                  ValueError, "DecodePlan.run: the arguments do not match the plan (dtype: "
                  "planned 'float16', got 'float32')"),
    "run-wider-tables": (lambda c, p: p.run(*c.args()[:3], np.pad(c.block_tables, ((0, 0),
                                                                                   (0, 1))),
                                            c.seq_lens),
                         ValueError, "DecodePlan.run: the arguments do not match the plan "
                         "(max_blocks_per_seq: planned 5, got 6)"),
    "run-alibi-not-planned": (lambda c, p: p.run(*c.args(), alibi_slopes=np.ones(4, np.float32)),
                              ValueError, "DecodePlan.run: the arguments do not match the plan "
                              "(has_alibi: planned False, got True)"),
    "run-bad-array": (lambda c, p: p.run(*c.args()[:3], c.block_tables.astype(np.int64),
                                         c.seq_lens),
                      TypeError, "block_tables: dtype must be int32"),
    "run-seq-lens-over-capacity": (lambda c, p: p.run(*c.args()[:4],
                                                      np.array([5, 81], np.int32)),
                                   ValueError, "seq_lens[1] = 81 exceeds"),
}

RUN_LEAD_CASES = {
    "run-query-none": (lambda c, p: p.run(None, *c.args()[1:]), TypeError,
                       "query: expected an array",
                       "cupa/decode_plan.py DecodePlan.run: call validation.check_is_array on "
                       "the five arrays before convert_inputs, as api._plan does (today "
                       "AttributeError: 'NoneType' object has no attribute 'ndim')"),
}


@pytest.mark.parametrize("name, call, error, start", [
    pytest.param(k, *v, id=k) for k, v in RUN_CASES.items()] + [
    pytest.param(k, *v[:3], id=k) for k, v in RUN_LEAD_CASES.items()])
def test_run_errors(case, name, call, error, start):
    plan = cupa.plan_decode(*case.args(), backend="numpy")
    check(lambda: call(case, plan), error, start)


def test_run_more_new_tokens_than_planned(rng):
    """A plan made with at most 2 new tokens per sequence refuses a run with 4."""
    case = make_case(rng, dtype="float16", head_size=64, block_size=16, num_kv_heads=2,
                     group=2, seq_lens=(20, 20, 20), new_tokens=2)
    plan = cupa.plan_decode(*case.args(), query_start_loc=case.query_start_loc,
                            backend="numpy")
    assert plan.max_query_len == 2
    loc = np.array([0, 1, 2, 6], np.int32)  # the same 6 rows, the last sequence holding 4
    check(lambda: plan.run(*case.args(), query_start_loc=loc), ValueError,
          "query_start_loc: a sequence has 4 new tokens, more than the plan's max_query_len=2")
