"""cupa's decode kernels for AMD targets, run on the CPU (tests/helpers/decode_on_cpu.py): the
emulated AMD build of each target (gfx90a and gfx942 wave64 MFMA, gfx1100 and gfx1201 wave32
WMMA, and the portable kernel where the matrix cores do not serve) compiled by the host's C++
compiler and run with its threads as coroutines, planned and launched with cupa's own planner
and arguments, against the float64 reference.

This runs the AMD kernels' code paths in CI, where no GPU is; the GPU's own arithmetic, timing
and memory ordering are the emulated GPU suite's and `python -m cupa selftest`'s to show.
Problems are fresh random ones with NaN (or the largest fp8 codes) in every slot no sequence
owns, the outputs start as NaN, and lengths 0, 1, one block and several partitions are mixed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from cupa.gpu.catalogue import DecodeMatrixVariant, DecodeVariant

from cases import FP8_REL_BOUND, REL_BOUND, environ, make_case, quantized_case
from cuda_on_cpu import compiler_missing
from decode_on_cpu import (LENGTHS, check_fp8_case, check_fuzz_draws,
                           check_options_together, check_result, check_selftest_sample,
                           decode_on_cpu)

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason=compiler_missing() or "")

TARGETS = ("gfx90a", "gfx942", "gfx1100", "gfx1201")


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("partition_size", [None, 64])
def test_matrix_kernel_gqa8(rng, arch, dtype, partition_size):
    """GQA 8, head 128: the planner's plan (two partitions at 300 tokens, merged by the
    reduce) and 64-token partitions (five)."""
    case = make_case(rng, dtype=dtype, num_kv_heads=2, group=8, seq_lens=LENGTHS)
    result = decode_on_cpu(arch, *case.args(), **case.options(), partition_size=partition_size)
    assert isinstance(result.plan.variant, DecodeMatrixVariant)
    assert result.plan.reduce_launch
    check_result(result, case, REL_BOUND[dtype])


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("head_size, group", [(64, 4), (80, 8), (96, 8), (112, 4), (192, 8),
                                              (256, 8), (128, 1)])
def test_matrix_kernel_head_sizes_and_groups(rng, arch, head_size, group):
    """Every head size the matrix cores serve. 80 and 112 have an odd count of 16-column
    tiles: their V^T is padded to an even count, the columns past the row read as zeros."""
    case = make_case(rng, head_size=head_size, num_kv_heads=2, group=group, seq_lens=LENGTHS)
    result = decode_on_cpu(arch, *case.args(), **case.options())
    assert isinstance(result.plan.variant, DecodeMatrixVariant)
    check_result(result, case, REL_BOUND["float16"])


@pytest.mark.parametrize("arch", TARGETS)
def test_matrix_kernel_two_row_tiles(rng, arch):
    """Three new tokens of group 8 (24 query rows) and group 32 with one: more rows than one
    16-row tile."""
    for group, new_tokens in ((8, 3), (32, None)):
        case = make_case(rng, num_kv_heads=1, group=group, seq_lens=(5, 37, 300),
                         new_tokens=new_tokens)
        result = decode_on_cpu(arch, *case.args(), **case.options())
        assert isinstance(result.plan.variant, DecodeMatrixVariant)
        check_result(result, case, REL_BOUND["float16"])


# The loads in steps (decode_matrix.cu's MatrixPartition::STEPPED): RDNA3 one tile at 80 to 128
# and two at 64, RDNA4 one tile at 192 and two at 80 to 128; at 80 and 112 an odd count of K
# chunks ends with a step of one.
@pytest.mark.parametrize("arch, head_size, group, fmt", [
    ("gfx1100", 64, 32, None), ("gfx1100", 112, 8, "fp8_e4m3"), ("gfx1201", 80, 32, None),
    ("gfx1201", 96, 32, "fp8_e4m3"), ("gfx1201", 128, 32, None),
    ("gfx1201", 192, 8, "fp8_e4m3fnuz")])
def test_matrix_kernel_loads_in_steps(rng, arch, head_size, group, fmt):
    """Tokens with nothing to read load the cache's start there and drop it: the poisoned
    slots, the garbage block ids past each sequence and the empty sequence must not show."""
    if fmt is not None:
        check_fp8_case(rng, arch, fmt, head_size, group, DecodeMatrixVariant)
        return
    case = make_case(rng, head_size=head_size, num_kv_heads=2, group=group, seq_lens=LENGTHS)
    result = decode_on_cpu(arch, *case.args(), **case.options())
    assert result.plan.variant == DecodeMatrixVariant("float16", head_size, 2)
    check_result(result, case, REL_BOUND["float16"])


# Two wavefronts a tile, each with half the head's columns (decode_matrix.cu's
# MatrixPartition::SPLIT): RDNA3 one tile at 192 and 256 and two at 96 and 128, RDNA4 one at
# 256 and two at 192. At 96 a half is 3 chunks of 16 columns, padded to 4 for V. In 64-token
# partitions each of the two pairs runs two tiles; in the planner's, a short sequence leaves
# the second pair passes with nothing to read, which must still meet the first pair at every
# barrier.
@pytest.mark.parametrize("arch, head_size, group", [
    ("gfx1100", 192, 8), ("gfx1100", 256, 4), ("gfx1100", 96, 32), ("gfx1100", 128, 32),
    ("gfx1201", 256, 8), ("gfx1201", 192, 32)])
@pytest.mark.parametrize("partition_size", [None, 64])
def test_matrix_kernel_wavefront_pairs(rng, arch, head_size, group, partition_size):
    case = make_case(rng, head_size=head_size, num_kv_heads=2, group=group, seq_lens=LENGTHS)
    result = decode_on_cpu(arch, *case.args(), **case.options(), partition_size=partition_size)
    assert result.plan.variant == DecodeMatrixVariant("float16", head_size, 2 if group > 16 else 1)
    check_result(result, case, REL_BOUND["float16"])


@pytest.mark.parametrize("arch, fmt", [("gfx1100", "fp8_e4m3"), ("gfx1201", "fp8_e4m3")])
def test_matrix_kernel_wavefront_pairs_fp8(rng, arch, fmt):
    """Head 256 over fp8 caches (gfx1201's widened by v_cvt_pk_f32_fp8), a pair a tile."""
    check_fp8_case(rng, arch, fmt, 256, 8, DecodeMatrixVariant)


@pytest.mark.parametrize("arch", ["gfx1100", "gfx1201"])
def test_matrix_kernel_wavefront_pairs_options(rng, arch):
    """A sliding window, ALiBi, a soft cap and sinks at head 256: both wavefronts of a pair
    must mask, cap and weigh each logit alike, as each applies them to the S^T they share."""
    case = make_case(rng, head_size=256, num_kv_heads=2, group=4, seq_lens=(1, 37, 300),
                     alibi=True, sliding_window=70, logits_soft_cap=20.0, sinks=True)
    result = decode_on_cpu(arch, *case.args(), **case.options(), partition_size=64)
    assert result.plan.variant == DecodeMatrixVariant("float16", 256, 1)
    check_result(result, case, REL_BOUND["float16"])


@pytest.mark.parametrize("arch", TARGETS)
def test_matrix_kernel_running_max_moves(rng, arch):
    """Logits that keep growing along the sequence: ALiBi slopes of 0.05 to 1.5 a token add
    0.8 to 24 to the logits of each next 16-token tile, so the lazy running max (CDNA, RDNA4)
    moves in the middle of the partitions, every tile on the steep heads and now and then on
    the gentle ones; a negative slope's max stays at the first tile."""
    case = make_case(rng, num_kv_heads=1, group=8, seq_lens=(37, 300, 1000), alibi=True)
    case = replace(case, alibi_slopes=np.array([1.5, 0.5, 0.2, 0.1, 0.05, 0.0, -0.05, -0.5],
                                               dtype=np.float32))
    for partition_size in (None, 512):
        result = decode_on_cpu(arch, *case.args(), **case.options(),
                               partition_size=partition_size)
        assert isinstance(result.plan.variant, DecodeMatrixVariant)
        check_result(result, case, REL_BOUND["float16"])


@pytest.mark.parametrize("arch", TARGETS)
def test_matrix_kernel_options(rng, arch):
    check_options_together(rng, arch, DecodeMatrixVariant)


# The fp8 formats each target reads: e4m3fnuz by gfx942's own conversion, OCP e4m3 by gfx1201's;
# the others widen in software. Heads 80 and 96 read V in pairs of codes (2-byte loads).
FP8_CASES = [("gfx90a", "fp8_e4m3", 128), ("gfx942", "fp8_e4m3fnuz", 128),
             ("gfx942", "fp8_e4m3", 64), ("gfx1100", "fp8_e4m3fnuz", 256),
             ("gfx1201", "fp8_e4m3", 128), ("gfx942", "fp8_e4m3fnuz", 96),
             ("gfx1100", "fp8_e4m3", 80), ("gfx1201", "fp8_e4m3", 112),
             ("gfx90a", "fp8_e4m3fnuz", 192)]


@pytest.mark.parametrize("arch, fmt, head_size", FP8_CASES)
def test_matrix_kernel_fp8_cache(rng, arch, fmt, head_size):
    check_fp8_case(rng, arch, fmt, head_size, 8, DecodeMatrixVariant)


@pytest.mark.parametrize("arch, dtype, head_size, kernel", [
    ("gfx90a", "float32", 128, "auto"), ("gfx1201", "float32", 80, "auto"),
    ("gfx942", "float16", 96, "portable"), ("gfx1100", "bfloat16", 192, "portable")])
def test_portable_kernel_on_amd_wavefronts(rng, arch, dtype, head_size, kernel):
    """What the matrix cores do not serve (float32 queries), or CUPA_KERNEL=portable, runs
    the portable kernel, at the target's wavefront size (64 or 32)."""
    case = make_case(rng, dtype=dtype, head_size=head_size, num_kv_heads=2, group=4,
                     seq_lens=LENGTHS)
    with environ(CUPA_KERNEL=kernel):
        result = decode_on_cpu(arch, *case.args(), **case.options())
    assert isinstance(result.plan.variant, DecodeVariant)
    check_result(result, case, REL_BOUND[dtype])


# The portable kernel's PV steps (decode.cu's PvLayout::BATCH tokens a step, v57): 3 token
# lanes at head 80 in float32 (a step's tokens straddle the tile's end), 32 lanes at head 64
# with an fp8 cache at GQA 1 (a step reaches past the 128-token tile), 2 lanes at head 128
# GQA 8; partitions of 64 and 200 tokens end steps part-way, and make_case's poison (NaN in
# block 0 and in every slot no sequence owns, ids outside the cache) is what a step's spare
# loads meet.
@pytest.mark.parametrize("arch, dtype, head_size, group, fmt", [
    ("gfx942", "float32", 80, 4, None), ("gfx1100", "float16", 64, 1, "fp8_e4m3"),
    ("gfx1201", "float16", 128, 8, None), ("gfx90a", "bfloat16", 112, 2, "fp8_e4m3fnuz")])
@pytest.mark.parametrize("partition_size", [64, 200])
def test_portable_kernel_pv_steps(rng, arch, dtype, head_size, group, fmt, partition_size):
    case = make_case(rng, dtype=dtype, head_size=head_size, num_kv_heads=2, group=group,
                     seq_lens=(0, 1, 5, 130, 333))
    caches, options = (case.key_cache, case.value_cache), {}
    reference_caches = None
    if fmt:
        caches, reference_caches, (k_scale, v_scale) = quantized_case(case, fmt, rng)
        options = dict(kv_format=fmt, k_scale=k_scale, v_scale=v_scale)
    with environ(CUPA_KERNEL="portable"):
        result = decode_on_cpu(arch, case.query, *caches, case.block_tables, case.seq_lens,
                               **case.options(), **options, partition_size=partition_size)
    assert isinstance(result.plan.variant, DecodeVariant)
    bound = FP8_REL_BOUND if fmt else REL_BOUND[dtype]
    check_result(result, case, bound, reference_caches=reference_caches)


FUZZ_DRAWS = 24  # about half a minute, the builds included


def test_fuzz_on_amd_targets():
    """The GPU fuzz's random configurations (tests/helpers/fuzz_draws.py: dtypes, fp8 formats,
    head sizes, GQA ratios, block sizes 8 to 32, features, new tokens, lengths at block and
    partition edges, partition sizes, the portable kernel forced now and then) at a random AMD
    target each. A fresh seed a run, printed; CUPA_FUZZ_SEED=<seed> replays one."""
    check_fuzz_draws(TARGETS, FUZZ_DRAWS)


SELFTEST_SAMPLE = 12  # cases a target a run (CUPA_SELFTEST_CPU_CASES=all: every one, ~80 s each)


@pytest.mark.parametrize("arch", TARGETS)
def test_selftest_cases(arch):
    """`python -m cupa selftest`'s cases for the target (what a ROCm device checks on each
    variant's first use), a random sample a run (decode_on_cpu.check_selftest_sample)."""
    check_selftest_sample(arch, SELFTEST_SAMPLE)
