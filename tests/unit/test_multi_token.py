"""Multi-token decode (query_start_loc) and `cupa.plan_decode` on the numpy backend, and the
reference's causal masking against an independent dense computation."""

import numpy as np
import pytest

import cupa
from cupa.reference import paged_decode_reference

from cases import REL_BOUND, make_case, rel_error
from test_reference import dense_attention

NEW_TOKENS = {"one_each": 1, "four_each": 4, "mixed": (1, 16, 3, 7, 2)}
FEATURES = {
    "plain": {},
    "all": dict(sliding_window=9, logits_soft_cap=4.0, sinks=True, alibi=True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("new_tokens", list(NEW_TOKENS))
def test_reference_matches_dense(rng, new_tokens, feature):
    case = make_case(rng, dtype="float32", head_size=64, block_size=8, group=3,
                     seq_lens=(1, 16, 20, 40, 133), new_tokens=NEW_TOKENS[new_tokens],
                     **FEATURES[feature])
    out, lse = paged_decode_reference(*case.args(), **case.options())
    ref_out, ref_lse = dense_attention(case)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


def test_new_tokens_equal_one_call_per_prefix(rng):
    """Token i of q_len new tokens is the plain decode of the sequence cut after it."""
    case = make_case(rng, dtype="float32", head_size=64, block_size=16, group=2,
                     seq_lens=(50, 7), new_tokens=(5, 7))
    out = cupa.decode(*case.args(), query_start_loc=case.query_start_loc, backend="numpy")
    for s in range(2):
        first, last = case.query_start_loc[s], case.query_start_loc[s + 1]
        for i, token in enumerate(range(first, last)):
            length = case.seq_lens[s] - (last - first) + i + 1
            single = cupa.decode(case.query[token:token + 1], case.key_cache, case.value_cache,
                                 case.block_tables[s:s + 1], np.array([length], np.int32),
                                 backend="numpy")
            np.testing.assert_allclose(out[token], single[0], rtol=1e-6, atol=1e-7)


def test_numpy_backend_all_features(rng):
    case = make_case(rng, dtype="bfloat16", head_size=96, group=4, seq_lens=(3, 300, 40),
                     new_tokens=(3, 16, 1), sliding_window=30, logits_soft_cap=8.0, sinks=True,
                     alibi=True)
    out, lse = cupa.decode(*case.args(), **case.options(), return_lse=True, backend="numpy")
    ref, ref_lse = dense_attention(case)  # not cupa.reference: the numpy backend is that
    assert out.shape == case.query.shape and lse.shape == case.query.shape[:2]
    assert rel_error(out, ref) <= REL_BOUND["bfloat16"]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


@pytest.mark.parametrize("loc, words", [
    ([0, 2, 4], "must start at 0 and end at the query's rows \\(5\\)"),
    ([1, 3, 5], "must start at 0"),
    ([0, 0, 5], "sequence 0 has 0 new tokens"),
    ([0, 6, 5], "sequence 1 has -1 new tokens"),
])
def test_bad_query_start_loc(rng, loc, words):
    case = make_case(rng, dtype="float16", head_size=64, seq_lens=(30, 30), new_tokens=(2, 3))
    with pytest.raises(ValueError, match=words):
        cupa.decode(*case.args(), query_start_loc=np.array(loc, np.int32), backend="numpy")


def test_query_start_loc_shape_and_type_errors(rng):
    case = make_case(rng, dtype="float16", head_size=64, seq_lens=(30, 30), new_tokens=(2, 3))
    with pytest.raises(TypeError, match="query_start_loc: dtype must be int32"):
        cupa.decode(*case.args(), query_start_loc=case.query_start_loc.astype(np.int64),
                    backend="numpy")
    with pytest.raises(ValueError, match="block_tables: expected shape \\[3,"):
        cupa.decode(*case.args(), query_start_loc=np.array([0, 1, 2, 5], np.int32),
                    backend="numpy")
    short = case.seq_lens.copy()
    short[1] = 2
    with pytest.raises(ValueError, match="seq_lens\\[1\\] = 2 is less than"):
        cupa.decode(case.query, case.key_cache, case.value_cache, case.block_tables, short,
                    query_start_loc=case.query_start_loc, backend="numpy")
    with pytest.raises(ValueError, match="max_query_len"):
        cupa.decode(*case.args(), query_start_loc=case.query_start_loc, max_query_len=17,
                    backend="numpy")


def test_more_than_sixteen_new_tokens_is_refused(rng):
    case = make_case(rng, dtype="float16", head_size=64, seq_lens=(40,), new_tokens=17)
    with pytest.raises(ValueError, match="each needs 1 to 16"):
        cupa.decode(*case.args(), query_start_loc=case.query_start_loc, backend="numpy")


def test_plan_runs_again_with_new_contents(rng):
    case = make_case(rng, dtype="float16", head_size=64, group=2, seq_lens=(40, 9),
                     new_tokens=(2, 1), sinks=True)
    plan = cupa.plan_decode(*case.args(), query_start_loc=case.query_start_loc,
                            sinks=case.sinks, return_lse=True, backend="numpy")
    for _ in range(2):
        case.query[...] = rng.standard_normal(case.query.shape)
        case.sinks[...] = rng.standard_normal(case.sinks.shape)
        out, lse = plan.run(*case.args(), query_start_loc=case.query_start_loc,
                            sinks=case.sinks)
        ref, ref_lse = dense_attention(case)
        assert rel_error(out, ref) <= REL_BOUND["float16"]
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_plan_refuses_other_shapes(rng):
    case = make_case(rng, dtype="float16", head_size=64, group=2, seq_lens=(40, 9))
    plan = cupa.plan_decode(*case.args(), backend="numpy")
    other = make_case(rng, dtype="float16", head_size=64, group=2, seq_lens=(40, 9, 3))
    with pytest.raises(ValueError, match="do not match the plan.*num_seqs: planned 2, got 3"):
        plan.run(*other.args())
    with pytest.raises(ValueError, match="alibi"):
        plan.run(*case.args(), alibi_slopes=np.ones(4, np.float32))
