"""`cupa.decode` on the numpy backend: same semantics as the GPU path, on any machine.

The numpy backend is `cupa.reference` itself, so it is checked against the tests' own dense
oracle (test_reference.dense_attention: K/V gathered per sequence, one softmax per token), not
against the reference."""

import ml_dtypes
import numpy as np
import pytest

import cupa

from cases import REL_BOUND, make_case, rel_error
from test_reference import dense_attention


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_numpy_backend_matches_the_dense_oracle(rng, dtype):
    case = make_case(rng, dtype=dtype, head_size=80, block_size=16, group=4,
                     seq_lens=(3, 0, 57, 300), alibi=True, sliding_window=40,
                     logits_soft_cap=20.0, sinks=True)
    out, lse = cupa.decode(*case.args(), **case.options(), return_lse=True, backend="numpy")
    ref, ref_lse = dense_attention(case)
    assert isinstance(out, np.ndarray) and out.dtype == case.query.dtype
    assert out.shape == case.query.shape
    assert rel_error(out, ref) <= REL_BOUND[dtype]
    assert lse.dtype == np.float32
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    assert (out[1] == 0).all()  # the empty sequence: a zero row, lse = its sink logit
    np.testing.assert_allclose(lse[1], case.sinks, rtol=1e-6)


def test_out_argument_is_filled_and_returned(rng):
    case = make_case(rng, dtype="float16", head_size=64, seq_lens=(5, 20))
    out = np.full(case.query.shape, np.nan, np.float16)
    result = cupa.decode(*case.args(), out=out, backend="numpy")
    assert result is out and np.isfinite(out).all()


def test_scale_is_applied(rng):
    case = make_case(rng, dtype="float32", head_size=64, seq_lens=(30,))
    _, lse_default = cupa.decode(*case.args(), return_lse=True, backend="numpy")
    _, lse_half = cupa.decode(*case.args(), scale=0.5 * 64 ** -0.5, return_lse=True,
                              backend="numpy")
    assert not np.allclose(lse_default, lse_half)


def test_default_backend_runs_without_gpu(rng):
    case = make_case(rng, dtype="bfloat16", head_size=128, seq_lens=(7,))
    out = cupa.decode(*case.args())
    assert out.dtype == ml_dtypes.bfloat16 and np.isfinite(out.astype(np.float32)).all()


def test_empty_batch(rng):
    case = make_case(rng, dtype="float16", head_size=64, seq_lens=(4,))
    q = case.query[:0]
    out = cupa.decode(q, case.key_cache, case.value_cache, case.block_tables[:0],
                      case.seq_lens[:0], backend="numpy")
    assert out.shape == (0,) + case.query.shape[1:]
