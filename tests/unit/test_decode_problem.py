"""tools/decode_problem.py without a GPU: the problems the device tools time, built here on numpy
through a stand-in for the few cupy calls they make. A ragged batch's problem is the bench's
batch with both of its length hints; a BxL one is uniform with the longest hint."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cupa.bench.ragged import RAGGED_BATCHES, ragged_batch

from tool_module import tool_module


def numpy_cupy():
    """The calls of cupy that the problem builders make, on numpy."""
    rng = np.random.default_rng(0)
    return types.SimpleNamespace(
        asarray=np.asarray, float32=np.float32,
        random=types.SimpleNamespace(
            standard_normal=lambda shape, dtype: rng.standard_normal(shape).astype(dtype)))


def problem_args(**overrides):
    values = dict(heads=8, kv_heads=2, head_size=64, dtype="float16", block_size=16,
                  query_len=1, kv_format=None)
    return types.SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize("name", list(RAGGED_BATCHES))
def test_a_ragged_problem_is_the_benchs_batch_with_both_hints(name):
    tool = tool_module("decode_problem")
    assert tool.RAGGED_BATCHES is RAGGED_BATCHES
    query, key, value, tables, lens, options = tool.ragged_problem(numpy_cupy(), name,
                                                                   problem_args())
    batch = ragged_batch(name, 16)
    assert np.array_equal(lens, batch.seq_lens) and np.array_equal(tables, batch.block_tables)
    assert options == dict(max_seq_len=batch.longest, total_seq_len=batch.total)
    assert query.shape == (batch.num_seqs, 8, 64) and query.dtype == np.float16
    assert key.shape == value.shape == (batch.num_blocks, 2, 16, 64)


def test_new_tokens_apply_to_ragged_and_uniform_problems_alike():
    tool = tool_module("decode_problem")
    args = problem_args(query_len=3)
    query, *_, lens, options = tool.ragged_problem(numpy_cupy(), "longtail64", args)
    assert query.shape[0] == 3 * len(lens)
    assert np.array_equal(options["query_start_loc"], np.arange(0, 3 * len(lens) + 1, 3))
    query, *_, lens, options = tool.decode_problem(numpy_cupy(), np.random.default_rng(1), 4,
                                                   100, args)
    assert query.shape[0] == 12 and options["max_seq_len"] == 100
    assert "total_seq_len" not in options and np.array_equal(lens, [100] * 4)
