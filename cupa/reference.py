"""The float64 numpy oracle for paged decode attention.

Written for clarity, one sequence and one head at a time, and sharing no code with the kernels or
with the GPU launch path: the tests trust this file, so it must stay obviously right.
"""

from __future__ import annotations

import numpy as np


def paged_decode_reference(query, key_cache, value_cache, block_tables, seq_lens, *,
                           query_start_loc=None, scale=None, alibi_slopes=None,
                           sliding_window=None, logits_soft_cap=None, sinks=None,
                           kv_layout="HND"):
    """Attention of each new token over its sequence's paged KV history, in float64.

    query          [num_tokens, num_heads, head_size]: one new token per sequence, or with
                   query_start_loc the tokens query_start_loc[s] .. query_start_loc[s + 1] - 1
                   of sequence s
    key_cache      [num_blocks, num_kv_heads, block_size, head_size] (already dequantised)
    value_cache    [num_blocks, num_kv_heads, block_size, head_size]
    kv_layout      "HND" (the shapes above) or "NHD": caches [num_blocks, block_size,
                   num_kv_heads, head_size]
    block_tables   [num_seqs, max_blocks_per_seq] int
    seq_lens       [num_seqs] int: tokens of each sequence, its new tokens included
    Token i of the q_len new tokens of a sequence of n tokens sits at position p = n - q_len + i
    and attends to positions j <= p (causal):
    sliding_window   W: only the last W of them (j > p - W)
    logits_soft_cap  c: each logit scale*q.k becomes c*tanh(scale*q.k / c) (before ALiBi)
    alibi_slopes     [num_heads]: adds slope * (j - p) to the logit of position j
    sinks            [num_heads]: one extra logit per head that joins the softmax denominator
                     only (it has no value row)
    Returns (out float64 [num_tokens, num_heads, head_size], lse float64 [num_tokens, num_heads]),
    where lse is the natural log of the softmax denominator (sink included).
    """
    query = np.asarray(query, dtype=np.float64)
    key_cache = np.asarray(key_cache)
    value_cache = np.asarray(value_cache)
    if kv_layout == "NHD":  # the same rows, viewed in the order the loop below reads
        key_cache, value_cache = key_cache.swapaxes(1, 2), value_cache.swapaxes(1, 2)
    elif kv_layout != "HND":
        raise ValueError(f"kv_layout: must be 'HND' or 'NHD', got {kv_layout!r}")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if scale is None:
        scale = head_size ** -0.5
    if query_start_loc is None:
        query_start_loc = np.arange(num_tokens + 1)

    out = np.zeros((num_tokens, num_heads, head_size), dtype=np.float64)
    lse = np.full((num_tokens, num_heads), -np.inf, dtype=np.float64)
    for s in range(len(query_start_loc) - 1):
        n = int(seq_lens[s])
        first_token, end_token = int(query_start_loc[s]), int(query_start_loc[s + 1])
        q_len = end_token - first_token
        for i, token in enumerate(range(first_token, end_token)):
            p = n - q_len + i
            first = 0 if sliding_window is None else max(0, p + 1 - int(sliding_window))
            positions = np.arange(first, p + 1)
            blocks = np.asarray(block_tables[s])[positions // block_size]
            offsets = positions % block_size
            for h in range(num_heads):
                kv_head = h // group
                keys = key_cache[blocks, kv_head, offsets].astype(np.float64)  # [n, head_size]
                values = value_cache[blocks, kv_head, offsets].astype(np.float64)
                logits = scale * (keys @ query[token, h])
                if logits_soft_cap is not None:
                    logits = logits_soft_cap * np.tanh(logits / logits_soft_cap)
                if alibi_slopes is not None:
                    logits = logits + float(alibi_slopes[h]) * (positions - p)
                # The sink is one more logit in the denominator, with no value row.
                extra = [] if sinks is None else [float(sinks[h])]
                every = np.concatenate([logits, extra])
                if every.size == 0:
                    continue
                peak = every.max()
                weights = np.exp(logits - peak)
                denominator = np.exp(every - peak).sum()
                out[token, h] = (weights @ values) / denominator
                lse[token, h] = peak + np.log(denominator)
    return out, lse
