"""Decode attention without a paged kernel: the benchmark's baseline (Engine(attention='naive'))."""

from __future__ import annotations

import math

import numpy as np

import cupa


def naive_decode_attention(xp, q, key_cache, value_cache, block_tables, seq_lens, max_len, scale,
                           kv_format=None, k_scale=None, v_scale=None):
    """Gather every sequence's blocks into dense [seqs, kv_heads, max_len, d] arrays, then
    matmul, masked softmax, matmul (float32). q [seqs, heads, d] -> [seqs, heads, d] float32.
    With an fp8 kv_format the caches hold codes, dequantised with k_scale / v_scale
    (float32 [kv_heads]) after the gather."""
    num_seqs, heads, dim = q.shape
    kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    # Unused table entries are -1; clamp them to a real block (its rows are masked out below).
    blocks = xp.maximum(block_tables[:, :math.ceil(max_len / block_size)], 0)

    def gather(cache, kv_scale):  # [seqs, nb, KV, bs, d] -> [seqs, KV, nb * bs, d]
        dense = cache[blocks].transpose(0, 2, 1, 3, 4).reshape(num_seqs, kv_heads, -1, dim)
        if kv_format:
            return cupa.dequantize_fp8(dense, kv_format, kv_scale[:, None, None])
        return dense.astype(np.float32)

    keys, values = gather(key_cache, k_scale), gather(value_cache, v_scale)
    qg = q.astype(np.float32).reshape(num_seqs, kv_heads, group, dim)
    scores = (qg @ keys.transpose(0, 1, 3, 2)) * np.float32(scale)    # [seqs, KV, group, L]
    valid = xp.arange(keys.shape[2])[None, :] < seq_lens[:, None]
    scores = xp.where(valid[:, None, None, :], scores, np.float32(-np.inf))
    scores = xp.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    return (probs @ values).reshape(num_seqs, heads, dim)
