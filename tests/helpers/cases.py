"""Random decode problems for the tests: paged caches with poison (NaN, or the largest fp8 codes)
in every slot no sequence uses, placed where reading one slot too many reaches it."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from cupa.fp8 import FP8_FORMATS

DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
# ||out - ref|| / ||ref|| bounds per dtype (the output is rounded to the dtype at the end).
REL_BOUND = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
# The same for an fp8 cache, against the reference on the dequantised cache.
FP8_REL_BOUND = 1e-2


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
    slot_owner: np.ndarray | None = None  # int32 [num_blocks, block_size]: see make_case

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


# Where the slots of a case's cache belong (Case.slot_owner): a token of some sequence, or no
# sequence's table reaches them at all; a poisoned slot that sequence s can reach by reading one
# slot too many (its last block's slots past its length, the block in the column past its last
# block) holds s itself.
DATA, UNREACHED = -2, -1


def make_case(rng, *, dtype="float16", head_size=128, block_size=16, num_kv_heads=2, group=1,
              seq_lens=(1, 17, 300), alibi=False, num_blocks=None, spare_columns=2,
              shared_blocks=True, sliding_window=None, logits_soft_cap=None,
              sinks=False, new_tokens=None) -> Case:
    """A fresh random problem.

    new_tokens: None (one query token per sequence), or the new tokens of each sequence (an int
    for all, or one per sequence) for multi-token decode with query_start_loc; sequences shorter
    than their new tokens are lengthened.

    Poison (NaN) in every slot that holds no token, so that reading one slot too many shows:
    - each sequence's last block, when its length leaves slots of it unused (the tail), is its
      own: no other table entry names it, so its tail slots stay poisoned;
    - the column just past each sequence's last block names a block of its own that holds no
      token (where the table has that column): the slot after a block-aligned end is poisoned
      too, not only a garbage id the kernel must skip;
    - full blocks are drawn with replacement from a pool of about half the blocks needed when
      `shared_blocks` (blocks repeat within and across sequences, as after fork or prefix
      sharing), else each is used once;
    - the remaining columns hold garbage ids (negative or past the cache) that must never be
      read, and at least 3 blocks are unreached when num_blocks is not given, block 0 among
      them (the AMD matrix kernel's loads for a token with nothing to read go there).
    `slot_owner` records which slots are which (DATA, UNREACHED or the sequence).
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
    full = seq_lens // block_size
    has_tail = seq_lens % block_size > 0
    blocks_needed = full + has_tail
    max_blocks = int(blocks_needed.max(initial=0)) + spare_columns
    has_next = blocks_needed < max_blocks
    num_full, num_tails, num_next = int(full.sum()), int(has_tail.sum()), int(has_next.sum())
    pool_size = (max(num_full // 2, 1) if shared_blocks else num_full) if num_full else 0
    if num_blocks is None:
        num_blocks = pool_size + num_tails + num_next + 3
    elif shared_blocks and num_full:  # a given cache size: leave room for the poisoned blocks
        pool_size = min(pool_size, max(num_blocks - num_tails - num_next - 3, 1))
    if num_tails + pool_size > num_blocks:
        raise ValueError(f"num_blocks={num_blocks} cannot hold {num_tails} unshared last blocks "
                         f"and {pool_size} full blocks")
    num_heads = num_kv_heads * group

    key_cache = np.full((num_blocks, num_kv_heads, block_size, head_size), np.nan, np.float32)
    value_cache = np.full_like(key_cache, np.nan)
    slot_owner = np.full((num_blocks, block_size), UNREACHED, np.int32)
    block_tables = rng.integers(num_blocks, 2**30, size=(num_seqs, max_blocks), dtype=np.int32)
    block_tables[:, ::2] *= -1
    # Block 0 last: a block no sequence owns wherever one is left, so the cache's first row, which
    # the AMD matrix kernel reads for a token with nothing to read and then drops, is poison.
    order = rng.permutation(num_blocks)
    order = np.concatenate([order[order != 0], order[order == 0]])
    tails = iter(order[:num_tails])
    pool = order[num_tails:num_tails + pool_size]
    spare = iter(order[num_tails + pool_size:])  # fewer than num_next only for a given size
    cursor = 0
    for s, n in enumerate(seq_lens):
        if shared_blocks:
            ids = pool[rng.integers(0, len(pool), size=int(full[s]))] if full[s] else pool[:0]
        else:
            ids, cursor = pool[cursor:cursor + int(full[s])], cursor + int(full[s])
        if has_tail[s]:
            tail = next(tails)
            ids = np.append(ids, tail)
            slot_owner[tail, int(n) % block_size:] = s
        nb = len(ids)
        block_tables[s, :nb] = ids
        if has_next[s]:
            following = next(spare, None)
            if following is not None:
                block_tables[s, nb] = following
                slot_owner[following] = s
        positions = np.arange(int(n))
        blocks, offsets = ids[positions // block_size], positions % block_size
        slot_owner[blocks, offsets] = DATA
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
                sinks=sink_logits, query_start_loc=query_start_loc, slot_owner=slot_owner)


def poison_fp8(case, key_codes, value_codes, fmt):
    """fp8 caches of `case` with the largest-magnitude finite code of `fmt` (e4m3fn 0x7e/0xfe =
    +-448, e4m3fnuz 0x7f/0xff = +-240) in every slot that holds no token; returns new arrays.

    NaN codes are no poison for fp8: the software widening reads them as finite numbers. The
    largest codes are, times the scale: a value row far from any output (a value of one slot
    read too many moves the output by a lot), and a key row whose signs follow the sum of the
    query rows of the one sequence that can reach the slot (its tail, the block past its last
    one), so that its logit is far above every other one and the slot, once read, dominates the
    softmax. Slots no table reaches get alternating signs."""
    code = FP8_FORMATS[fmt].max_code
    owner = case.slot_owner
    keys, values = np.array(key_codes, np.uint8), np.array(value_codes, np.uint8)
    num_kv_heads, head_size = keys.shape[1], keys.shape[3]
    blocks, offsets = np.nonzero(owner != DATA)
    values[blocks, :, offsets] = code
    keys[blocks, :, offsets] = code | (0x80 * (np.arange(head_size) % 2)).astype(np.uint8)
    query = np.asarray(case.query, np.float64)
    group = query.shape[1] // num_kv_heads
    starts = (case.query_start_loc if case.query_start_loc is not None
              else np.arange(len(case.seq_lens) + 1))
    for s in range(len(case.seq_lens)):
        blocks, offsets = np.nonzero(owner == s)
        if not len(blocks):
            continue
        rows = query[starts[s]:starts[s + 1]].reshape(-1, num_kv_heads, group, head_size)
        negative = rows.sum(axis=(0, 2)) < 0  # [num_kv_heads, head_size]
        keys[blocks, :, offsets] = (code | (0x80 * negative)).astype(np.uint8)
    return keys, values


def quantized_case(case, fmt, rng, per_head=True):
    """The case's caches as fp8 codes with random scales, poisoned (poison_fp8), and the
    dequantised caches the reference reads: (codes, dequantised, scales). N(0, 1) data, so scales
    of 1/60 to 1/30 use the codes' range without saturating (e4m3fnuz's largest is 240);
    per_head: one scale per KV head (float32 arrays), else one float each for K and V."""
    import cupa
    num_kv_heads = case.key_cache.shape[1]
    size = num_kv_heads if per_head else ()
    k_scale = np.asarray(rng.uniform(1 / 60, 1 / 30, size), dtype=np.float32)
    v_scale = np.asarray(rng.uniform(1 / 60, 1 / 30, size), dtype=np.float32)
    shaped = (lambda s: s.reshape(1, -1, 1, 1)) if per_head else (lambda s: s)
    codes = poison_fp8(case, *(cupa.quantize_fp8(cache.astype(np.float32), fmt, shaped(scale))
                               for cache, scale in ((case.key_cache, k_scale),
                                                    (case.value_cache, v_scale))), fmt)
    dequantized = [cupa.dequantize_fp8(c, fmt, shaped(scale))
                   for c, scale in zip(codes, (k_scale, v_scale))]
    scales = (k_scale, v_scale) if per_head else (float(k_scale), float(v_scale))
    return codes, dequantized, scales


def kv_views(key_cache, value_cache, kv_layout="HND", *, interleaved=False, row_pad=0,
             poison=np.nan):
    """A case's caches ("HND", contiguous) as views in `kv_layout`'s dimension order, which
    cupa reads in place: `interleaved` keeps each block's K and V in one allocation
    [num_blocks, 2, ...] (FlashInfer's paged KV, vLLM's FlashInfer backend), `row_pad` spaces
    the rows head_size + row_pad elements apart. Every element between the views' own holds
    `poison` (give an fp8 code for uint8 caches), so a row read at a wrong stride shows."""
    if kv_layout == "NHD":
        key_cache, value_cache = key_cache.swapaxes(1, 2), value_cache.swapaxes(1, 2)
    head_size = key_cache.shape[3]
    shape = key_cache.shape[:3] + (head_size + row_pad,)
    if interleaved:
        base = np.full((shape[0], 2) + shape[1:], poison, key_cache.dtype)
        halves = base[:, 0], base[:, 1]
    else:
        halves = tuple(np.full(shape, poison, key_cache.dtype) for _ in range(2))
    views = tuple(half[..., :head_size] for half in halves)
    views[0][...] = key_cache
    views[1][...] = value_cache
    return views


def rel_error(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


def environ(**values):
    """Environment variables set for the block and restored after it; the dispatch switches
    (cupa.gpu.dispatch's CUPA_* variables) are read again on entry and on exit."""
    from cupa.gpu import dispatch
    return dispatch.switches_set(values)
