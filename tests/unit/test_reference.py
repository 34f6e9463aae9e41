"""The float64 reference against an independent dense computation (vectorised, GQA by repeat)."""

import numpy as np
import pytest

from cupa.reference import paged_decode_reference

from cases import make_case


def dense_attention(case):
    """Gather each sequence's K/V into dense arrays and do softmax(QK^T)V with masks, one einsum
    chain per new token. Positions the token may not see (after it, or before its window) are
    masked with -inf; the sink is an extra column."""
    q = case.query.astype(np.float64)
    num_tokens, num_heads, _ = q.shape
    num_kv_heads, block_size = case.key_cache.shape[1], case.key_cache.shape[2]
    loc = (np.arange(len(case.seq_lens) + 1) if case.query_start_loc is None
           else case.query_start_loc)
    out = np.zeros_like(q)
    lse = np.full((num_tokens, num_heads), -np.inf)
    for s, n in enumerate(case.seq_lens):
        pages = case.block_tables[s, : -(-n // block_size)]
        k = case.key_cache[pages].astype(np.float64)  # [nb, Hkv, bs, D]
        v = case.value_cache[pages].astype(np.float64)
        k = k.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, k.shape[-1])[:, :n]
        v = v.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, v.shape[-1])[:, :n]
        k = np.repeat(k, num_heads // num_kv_heads, axis=0)
        v = np.repeat(v, num_heads // num_kv_heads, axis=0)
        q_len = loc[s + 1] - loc[s]
        for i, token in enumerate(range(loc[s], loc[s + 1])):
            p = n - q_len + i  # this token's position
            with np.errstate(invalid="ignore"):  # masked garbage (NaN) columns are dropped below
                logits = np.einsum("hd,hnd->hn", q[token], k) * case.scale
            if case.logits_soft_cap is not None:
                logits = case.logits_soft_cap * np.tanh(logits / case.logits_soft_cap)
            if case.alibi_slopes is not None:
                logits += case.alibi_slopes[:, None].astype(np.float64) * (np.arange(n) - p)
            hidden = np.arange(n) > p
            if case.sliding_window is not None:
                hidden |= np.arange(n) <= p - case.sliding_window
            logits[:, hidden] = -np.inf
            values = v.copy()
            values[:, hidden] = 0.0
            sink = (np.full((num_heads, 1), -np.inf) if case.sinks is None
                    else case.sinks[:, None].astype(np.float64))
            columns = np.concatenate([logits, sink], axis=1)
            m = columns.max(axis=1, keepdims=True)
            if not np.isfinite(m).all():
                continue
            w = np.exp(columns - m)
            out[token] = np.einsum("hn,hnd->hd", w[:, :n], values) / w.sum(axis=1, keepdims=True)
            lse[token] = m[:, 0] + np.log(w.sum(axis=1))
    return out, lse


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_reference_matches_dense(rng, dtype, alibi, group):
    case = make_case(rng, dtype=dtype, head_size=64, block_size=8, num_kv_heads=2, group=group,
                     seq_lens=(0, 1, 9, 40, 133), alibi=alibi)
    out, lse = paged_decode_reference(*case.args(), scale=case.scale,
                                      alibi_slopes=case.alibi_slopes)
    ref_out, ref_lse = dense_attention(case)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
    assert np.isfinite(out).all(), "NaN planted in unused slots leaked into the reference"


def test_single_token_returns_its_value(rng):
    case = make_case(rng, dtype="float32", head_size=64, group=2, seq_lens=(1,))
    out, lse = paged_decode_reference(*case.args())
    block = case.block_tables[0, 0]
    expected = np.repeat(case.value_cache[block, :, 0], 2, axis=0)
    np.testing.assert_allclose(out[0], expected, rtol=1e-12)
    k = np.repeat(case.key_cache[block, :, 0], 2, axis=0).astype(np.float64)
    np.testing.assert_allclose(lse[0], (case.query[0] * k).sum(-1) * 64 ** -0.5, rtol=1e-12)
