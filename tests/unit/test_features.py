"""Sliding window, logit soft-capping, attention sinks and state merging on the numpy backend,
and the reference's handling of them against an independent dense computation."""

import numpy as np
import pytest

import cupa
from cupa.reference import paged_decode_reference

from cases import REL_BOUND, make_case, rel_error
from test_reference import dense_attention

FEATURES = {
    "window": dict(sliding_window=37),
    "softcap": dict(logits_soft_cap=2.5),
    "sinks": dict(sinks=True),
    "all": dict(sliding_window=100, logits_soft_cap=5.0, sinks=True, alibi=True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_reference_matches_dense(rng, dtype, feature):
    case = make_case(rng, dtype=dtype, head_size=64, block_size=8, group=3,
                     seq_lens=(0, 1, 20, 37, 38, 150), **FEATURES[feature])
    out, lse = paged_decode_reference(*case.args(), **case.options())
    ref_out, ref_lse = dense_attention(case)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("feature", list(FEATURES))
def test_numpy_backend(rng, feature):
    case = make_case(rng, dtype="bfloat16", head_size=96, group=2, seq_lens=(0, 5, 300),
                     **FEATURES[feature])
    out, lse = cupa.decode(*case.args(), **case.options(), return_lse=True, backend="numpy")
    ref, ref_lse = dense_attention(case)  # not cupa.reference: the numpy backend is that
    assert rel_error(out, ref) <= REL_BOUND["bfloat16"]
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


def test_window_ignores_everything_before_it(rng):
    case = make_case(rng, dtype="float32", head_size=64, seq_lens=(200,), sliding_window=50,
                     shared_blocks=False)
    # Put garbage (inf) in the first 150 tokens: the window must never read them.
    for t in range(150):
        block, offset = case.block_tables[0, t // 16], t % 16
        case.key_cache[block, :, offset] = np.inf
        case.value_cache[block, :, offset] = np.nan
    out = cupa.decode(*case.args(), **case.options(), backend="numpy")
    assert np.isfinite(out).all()


def test_sink_of_empty_sequence_is_its_lse(rng):
    case = make_case(rng, dtype="float16", head_size=64, group=2, seq_lens=(0, 3), sinks=True)
    out, lse = cupa.decode(*case.args(), **case.options(), return_lse=True, backend="numpy")
    assert (out[0] == 0).all()
    np.testing.assert_allclose(lse[0], case.sinks, rtol=1e-6)


@pytest.mark.parametrize("bad, words", [
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window=2.5), "sliding_window"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(logits_soft_cap=float("inf")), "logits_soft_cap"),
    (dict(sinks=np.zeros(3, np.float32)), "sinks: expected shape"),
    (dict(sinks=np.zeros(4, np.float64)), "sinks: dtype"),
])
def test_bad_feature_arguments(rng, bad, words):
    case = make_case(rng, dtype="float16", head_size=64, group=2, seq_lens=(5,))
    with pytest.raises((ValueError, TypeError), match=words):
        cupa.decode(*case.args(), backend="numpy", **bad)


def split_states(case, split):
    """Decode of sequence 0 over tokens [0, split) and [split, n) separately (block-aligned)."""
    block_size = case.key_cache.shape[2]
    n = int(case.seq_lens[0])
    assert split % block_size == 0
    first_tables = case.block_tables[:1].copy()
    second_tables = np.roll(case.block_tables[:1], -(split // block_size), axis=1)
    q, k, v = case.query[:1], case.key_cache, case.value_cache
    a = cupa.decode(q, k, v, first_tables, np.array([split], np.int32), return_lse=True,
                    backend="numpy")
    b = cupa.decode(q, k, v, second_tables, np.array([n - split], np.int32), return_lse=True,
                    backend="numpy")
    return a, b


def test_merge_two_halves_equals_whole(rng):
    case = make_case(rng, dtype="float32", head_size=64, block_size=16, group=4,
                     seq_lens=(300,), shared_blocks=False)
    (out_a, lse_a), (out_b, lse_b) = split_states(case, 128)
    out, lse = cupa.merge_states(out_a, lse_a, out_b, lse_b)
    whole, whole_lse = cupa.decode(case.query[:1], case.key_cache, case.value_cache,
                                   case.block_tables[:1], case.seq_lens[:1], return_lse=True,
                                   backend="numpy")
    assert rel_error(out, whole) <= 1e-6
    np.testing.assert_allclose(lse, whole_lse, rtol=1e-6, atol=1e-6)


def test_merge_n_with_empty_states(rng):
    out = rng.standard_normal((3, 4, 64)).astype(np.float32)
    lse = rng.standard_normal((3, 4)).astype(np.float32)
    empty_lse = np.full((3, 4), -np.inf, np.float32)
    merged, merged_lse = cupa.merge_states_n([out, np.zeros_like(out), out],
                                             [lse, empty_lse, lse])
    np.testing.assert_allclose(merged, out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(merged_lse, lse + np.log(2), rtol=1e-6, atol=1e-6)
    nothing, nothing_lse = cupa.merge_states(out, empty_lse, out, empty_lse)
    assert (nothing == 0).all() and np.isneginf(nothing_lse).all()


def test_merge_errors(rng):
    out = np.zeros((2, 4, 64), np.float16)
    lse = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="lses\\[1\\]"):
        cupa.merge_states(out, lse, out, lse[:1])
    with pytest.raises(TypeError, match="float32"):
        cupa.merge_states(out, lse, out, lse.astype(np.float64))
    with pytest.raises(ValueError, match="outs\\[1\\]"):
        cupa.merge_states(out, lse, out.astype(np.float32), lse)
