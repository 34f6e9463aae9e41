"""The GPU suites' problems (tests/helpers/cases.py) can catch a wrong read: every slot a decode
could read by going one slot too far is poisoned and belongs to that one sequence, and that
poison breaks the suites' comparison.

A kernel that reads one slot past a sequence's end is simulated by the reference with that
sequence one token longer (the extra token is the poisoned slot, in the sequence's own last
block or in the block its table names next). With NaN poison (16-bit and float32 caches) the
result is not finite; with the largest fp8 codes (NaN codes are read as finite numbers by the
software widening) ||out - ref|| / ||ref|| exceeds the fp8 bound, for every sequence of every
draw.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupa.fp8 import FP8_FORMATS
from cupa.problem import SUPPORTED_HEAD_SIZES
from cupa.reference import paged_decode_reference

from cases import (DATA, FP8_REL_BOUND, REL_BOUND, UNREACHED, make_case, quantized_case,
                   rel_error)

DRAWS = 40
FORMATS = list(FP8_FORMATS)


def draw_case(rng, dtype):
    """A random problem like those of the GPU matrix (smaller, so the oracle stays quick):
    lengths around block boundaries, zero, one, block-aligned ones, a random one."""
    block_size = int(rng.choice([8, 16, 32]))
    lengths = [0, 1, block_size - 1, block_size, 2 * block_size, 3 * block_size + 1,
               int(rng.integers(1, 400))]
    new_tokens = None
    if rng.random() < 0.25:  # multi-token decode now and then
        new_tokens = tuple(int(x) for x in rng.integers(1, 5, len(lengths)))
    return make_case(rng, dtype=dtype, head_size=int(rng.choice(SUPPORTED_HEAD_SIZES)),
                     block_size=block_size, num_kv_heads=int(rng.choice([1, 2])),
                     group=int(rng.choice([1, 2, 4, 8])), seq_lens=lengths,
                     alibi=rng.random() < 0.3, sinks=rng.random() < 0.3,
                     shared_blocks=rng.random() < 0.7, new_tokens=new_tokens,
                     spare_columns=int(rng.integers(1, 3)))


def rows_of(case, s):
    starts = (case.query_start_loc if case.query_start_loc is not None
              else np.arange(len(case.seq_lens) + 1))
    return slice(int(starts[s]), int(starts[s + 1]))


def sequence_reference(case, key_cache, value_cache, s, length):
    """The reference output rows of sequence s alone, as if it had `length` tokens."""
    rows = rows_of(case, s)
    options = case.options()
    options["query_start_loc"] = None
    if case.query_start_loc is not None:
        options["query_start_loc"] = np.array([0, rows.stop - rows.start], np.int32)
    out, _ = paged_decode_reference(case.query[rows], key_cache, value_cache,
                                    case.block_tables[s:s + 1], np.array([length], np.int32),
                                    **options)
    return out


def over_read_errors(case, key_cache, value_cache):
    """||out' - ref|| / ||ref|| of each sequence's simulated one-slot over-read (out' the
    reference with that sequence one token longer), for each sequence whose table has room."""
    ref, _ = paged_decode_reference(case.query, key_cache, value_cache, case.block_tables,
                                    case.seq_lens, **case.options())
    capacity = case.block_tables.shape[1] * case.key_cache.shape[2]
    errors = {}
    for s, n in enumerate(case.seq_lens):
        if n >= capacity:
            continue
        wrong = ref.copy()
        wrong[rows_of(case, s)] = sequence_reference(case, key_cache, value_cache, s, int(n) + 1)
        errors[s] = rel_error(wrong, ref)
    return errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_slot_over_read_breaks_the_fp8_bound(rng, fmt):
    for draw in range(DRAWS):
        case = draw_case(rng, str(rng.choice(["float16", "bfloat16"])))
        (k8, v8), (k_ref, v_ref), _ = quantized_case(case, fmt, rng, per_head=bool(draw % 2))
        # The poison is the largest finite code, exactly where no token is.
        poisoned = case.slot_owner != DATA
        codes = {FP8_FORMATS[fmt].max_code, FP8_FORMATS[fmt].max_code | 0x80}
        assert set(np.unique(k8.transpose(0, 2, 1, 3)[poisoned])) <= codes
        assert set(np.unique(v8.transpose(0, 2, 1, 3)[poisoned])) <= codes
        assert np.isfinite(k_ref).all() and np.isfinite(v_ref).all()
        errors = over_read_errors(case, k_ref, v_ref)
        assert len(errors) == len(case.seq_lens)
        hidden = {s: e for s, e in errors.items() if not e > FP8_REL_BOUND}
        assert not hidden, f"draw {draw}: over-reads within the bound {FP8_REL_BOUND}: {hidden}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_one_slot_over_read_is_not_finite(rng, dtype):
    for draw in range(DRAWS // 4):
        case = draw_case(rng, dtype)
        errors = over_read_errors(case, case.key_cache, case.value_cache)
        assert len(errors) == len(case.seq_lens)
        # rel_error is NaN: `err <= REL_BOUND` fails, as does the suites' finite-output check.
        assert not any(e <= REL_BOUND[dtype] for e in errors.values()), f"draw {draw}: {errors}"


def test_every_tail_and_next_slot_is_poisoned_and_unshared(rng):
    """Each sequence's last block (when its length leaves slots unused) and the block its table
    names next are named by no other table entry and hold NaN past its length; shared full
    blocks still occur; data slots are finite."""
    shared_full_blocks = 0
    for draw in range(DRAWS):
        case = draw_case(rng, "float16")
        block_size = case.key_cache.shape[2]
        used = []  # (block id, sequence, column) of every entry a length or the next column uses
        for s, n in enumerate(case.seq_lens):
            n = int(n)
            nb = -(-n // block_size)
            used += [(int(b), s, c) for c, b in enumerate(case.block_tables[s, :nb])]
            if nb < case.block_tables.shape[1]:
                used.append((int(case.block_tables[s, nb]), s, nb))
        for s, n in enumerate(case.seq_lens):
            n = int(n)
            nb = -(-n // block_size)
            own = []
            if n % block_size:
                own.append((int(case.block_tables[s, nb - 1]), n % block_size))
            if nb < case.block_tables.shape[1]:
                own.append((int(case.block_tables[s, nb]), 0))
            for block, first in own:
                assert 0 <= block < case.key_cache.shape[0], (draw, s)
                entries = [u for u in used if u[0] == block]
                assert len(entries) == 1 and entries[0][1] == s, (draw, s, block, entries)
                assert (case.slot_owner[block, first:] == s).all()
                for cache in (case.key_cache, case.value_cache):
                    assert np.isnan(cache[block, :, first:].astype(np.float32)).all()
        data = case.slot_owner == DATA
        for cache in (case.key_cache, case.value_cache):
            by_slot = cache.astype(np.float32).transpose(0, 2, 1, 3)
            assert np.isfinite(by_slot[data]).all() and np.isnan(by_slot[~data]).all()
        full = [b for s, n in enumerate(case.seq_lens)
                for b in case.block_tables[s, :int(n) // block_size]]
        shared_full_blocks += len(full) - len(set(full))
        assert (case.slot_owner == UNREACHED).any()  # blocks no table reaches, poisoned too
    assert shared_full_blocks > 0


def test_block_aligned_end_reads_into_a_poisoned_block(rng):
    """A sequence ending on a block boundary: the next column names a poisoned block of its own,
    not only a garbage id."""
    case = make_case(rng, dtype="float32", head_size=64, block_size=16, seq_lens=(32, 16, 0))
    for s in range(3):
        nb = int(case.seq_lens[s]) // 16
        block = int(case.block_tables[s, nb])
        assert 0 <= block < case.key_cache.shape[0] and (case.slot_owner[block] == s).all()
        assert np.isnan(case.key_cache[block]).all()
