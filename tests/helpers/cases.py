"""Random decode problems for the tests: paged caches with NaN in every slot no sequence uses."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import ml_dtypes
import numpy as np

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# ||out - ref|| / ||ref|| bounds per dtype (the output is rounded to the dtype at the end).
REL_BOUND = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


@dataclass
class Case:
    query: np.ndarray
    key_cache: np.ndarray
    value_cache: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    alibi_slopes: np.ndarray | None
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    sinks: np.ndarray | None = None
    query_start_loc: np.ndarray | None = None  # multi-token decode

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens)

    def options(self, to_array=lambda a: a):
        """The keyword options of this case, for `cupa.decode` and the reference alike;
        `to_array` moves the per-head arrays (e.g. to the GPU)."""
        per_head = {"alibi_slopes": self.alibi_slopes, "sinks": self.sinks,
                    "query_start_loc": self.query_start_loc}
        return dict(scale=self.scale, sliding_window=self.sliding_window,
                    logits_soft_cap=self.logits_soft_cap,
                    **{k: None if v is None else to_array(v) for k, v in per_head.items()})


def make_case(rng, *, dtype="float16", head_size=128, block_size=16, num_kv_heads=2, group=1,
              seq_lens=(1, 17, 300), alibi=False, num_blocks=None, spare_columns=2,
              shared_blocks=True, sliding_window=None, logits_soft_cap=None,
              sinks=False, new_tokens=None) -> Case:
    """A fresh random problem.

    new_tokens: None (one query token per sequence), or the new tokens of each sequence (an int
    for all, or one per sequence) for multi-token decode with query_start_loc; sequences shorter
    than their new tokens are lengthened.

    Block tables draw ids with replacement when `shared_blocks` (blocks repeat within and across
    sequences, as after fork or prefix sharing); columns past each sequence's last block hold
    garbage ids (negative or past the cache) that must never be read.
    """
    np_dtype = DTYPES[dtype]
    seq_lens = np.asarray(seq_lens, dtype=np.int32)
    num_seqs = len(seq_lens)
    query_start_loc = None
    num_tokens = num_seqs
    if new_tokens is not None:
        q_lens = np.broadcast_to(np.asarray(new_tokens, dtype=np.int32), (num_seqs,))
        seq_lens = np.maximum(seq_lens, q_lens)
        query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        num_tokens = int(query_start_loc[-1])
    blocks_needed = -(-seq_lens // block_size)
    max_blocks = int(blocks_needed.max(initial=0)) + spare_columns
    if num_blocks is None:
        num_blocks = max(int(blocks_needed.sum()) // (2 if shared_blocks else 1), 1) + 3
    num_heads = num_kv_heads * group

    key_cache = np.full((num_blocks, num_kv_heads, block_size, head_size), np.nan, np.float32)
    value_cache = np.full_like(key_cache, np.nan)
    block_tables = rng.integers(num_blocks, 2**30, size=(num_seqs, max_blocks), dtype=np.int32)
    block_tables[:, ::2] *= -1
    free = rng.permutation(num_blocks)
    cursor = 0
    for s, n in enumerate(seq_lens):
        nb = int(blocks_needed[s])
        if shared_blocks:
            ids = rng.integers(0, num_blocks, size=nb)
        else:
            ids, cursor = free[cursor:cursor + nb], cursor + nb
        block_tables[s, :nb] = ids
        positions = np.arange(int(n))
        blocks, offsets = ids[positions // block_size], positions % block_size
        rows = (int(n), num_kv_heads, head_size)
        key_cache[blocks, :, offsets] = rng.standard_normal(rows, dtype=np.float32)
        value_cache[blocks, :, offsets] = rng.standard_normal(rows, dtype=np.float32)
    query = 2.0 * rng.standard_normal((num_tokens, num_heads, head_size))
    slopes = None
    if alibi:
        slopes = (2.0 ** (-8.0 * (np.arange(num_heads) + 1) / num_heads)).astype(np.float32)
    sink_logits = rng.normal(1.0, 2.0, size=num_heads).astype(np.float32) if sinks else None
    return Case(query=query.astype(np_dtype), key_cache=key_cache.astype(np_dtype),
                value_cache=value_cache.astype(np_dtype), block_tables=block_tables,
                seq_lens=seq_lens, alibi_slopes=slopes, scale=float(head_size ** -0.5),
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                sinks=sink_logits, query_start_loc=query_start_loc)


def rel_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


@contextlib.contextmanager
def environ(**values):
    """Environment variables set for the block and restored after it; the dispatch switches
    (CUPA_KERNEL, CUPA_MERGE, CUPA_CHAINED_REDUCE) are read again on entry and on exit."""
    from cupa.gpu import dispatch
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    dispatch.reload_switches()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        dispatch.reload_switches()
