"""A layer's attention inside model.forward: store the new K/V in the paged cache, then attend.

Every step the engine runs (prefill, an eager decode step, a graph-captured decode step) does
the same two things per layer: write the step's new key / value rows to the cache, then compute
attention. Only the attention differs, so it is a callback here and the write lives in one place.
"""

from __future__ import annotations

import numpy as np


def paged_decode_formats(model, cache):
    """(K/V row dtype, query dtype, fp8 keyword arguments) of paged decode on `cache`."""
    kv_dtype = query_dtype = model.dtype
    fp8 = {}
    if cache.kv_format:  # uint8 codes: cupa.decode needs the format and scales
        fp8 = dict(kv_format=cache.kv_format, k_scale=cache.k_scale, v_scale=cache.v_scale)
        if query_dtype == np.float32:  # fp8 decode takes float16 / bfloat16 queries only
            query_dtype = np.dtype(np.float16)
    return kv_dtype, query_dtype, fp8


def write_then_attend(cache, slots, kv_dtype, attention):
    """The `attend(layer, q, k, v)` that model.forward calls.

    It writes the step's new K/V rows to `cache` at `slots` (one per row; -1 rows are skipped by
    cache.write, which also quantises when the cache is fp8), cast to `kv_dtype` (the cache's
    row dtype), and then returns attention(layer, q, k, v). The write comes first because decode
    attention reads the new token's own K/V back from the cache; prefill's attention uses the
    unquantised k and v it is given instead."""
    def attend(layer, q, k, v):
        # (A dtype comparison costs less host time than a cast that turns out to be none.)
        cache.write(layer, slots, k if k.dtype == kv_dtype else k.astype(kv_dtype),
                    v if v.dtype == kv_dtype else v.astype(kv_dtype))
        return attention(layer, q, k, v)
    return attend


def decode_query(xp, q, query_dtype):
    """q as paged decode takes it: `query_dtype` and C-contiguous (cupa checks both); q itself
    when it is already, as the fused split_qkv writes it (two attribute reads, not a call)."""
    if q.dtype == query_dtype and q.flags.c_contiguous:
        return q
    return xp.ascontiguousarray(q, dtype=query_dtype)


def layer_caches(cache) -> list:
    """(key cache, value cache) views of every layer of `cache`, made once: the storage is fixed
    for the cache's life, and a decode step would otherwise make two views per layer."""
    return [(cache.key_cache(layer), cache.value_cache(layer))
            for layer in range(cache.num_layers)]
