"""tools/amd_isa_counts.py: the counting rule on a hand-written loop (no compiler needed), and
structural facts of the decode kernels' main loops in real gfx942 assembly (clang -S through
cupa.gpu.offline.assembly_for). Without clang-19 the latter skip; in CI (CI set) they fail."""

from __future__ import annotations

import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from cupa.gpu.catalogue import FP8_CACHE, DecodeMatrixVariant, DecodeVariant
from offline_compile import need_compiler
from tool_module import tool_module

ROOT = Path(__file__).resolve().parents[2]


A = tool_module("amd_isa_counts")


# A loop as clang prints it: header BB0_1, a divergent `if` (execz), a uniform branch around a
# soft-cap division, a uniform branch around more vector work, an inner loop of 3 trips.
TOY = """\
toy:
\ts_mov_b32 s0, 0
.LBB0_1:                                ; =>This Loop Header: Depth=1
                                        ;     Child Loop BB0_6 Depth 2
\tglobal_load_dwordx4 v[0:3], v[4:5], off
\ts_and_saveexec_b64 s[2:3], vcc
\ts_cbranch_execz .LBB0_3
; %bb.2:                                ;   in Loop: Header=BB0_1 Depth=1
\tv_mfma_f32_16x16x16_f16 a[0:3], v[0:1], v[2:3], a[0:3]
.LBB0_3:                                ;   in Loop: Header=BB0_1 Depth=1
\ts_or_b64 exec, exec, s[2:3]
\ts_cbranch_vccnz .LBB0_5
; %bb.4:                                ;   in Loop: Header=BB0_1 Depth=1
\tv_div_scale_f32 v6, s[4:5], v7, v7, v8
\tv_exp_f32_e32 v6, v6
.LBB0_5:                                ;   in Loop: Header=BB0_1 Depth=1
\ts_cbranch_scc1 .LBB0_7
; %bb.5a:                               ;   in Loop: Header=BB0_1 Depth=1
\tv_add_f32_e32 v9, v9, v9
\tv_add_f32_e32 v9, v9, v9
.LBB0_7:                                ;   in Loop: Header=BB0_1 Depth=1
\tds_read_b128 v[0:3], v4
\ts_waitcnt vmcnt(0) lgkmcnt(0)
.LBB0_6:                                ;   Parent Loop BB0_1 Depth=1
                                        ; =>  This Inner Loop Header: Depth=2
\tv_fmac_f32_e32 v10, v11, v12
\ts_add_u32 s0, s0, 1
\ts_cbranch_scc0 .LBB0_6
; %bb.8:                                ;   in Loop: Header=BB0_1 Depth=1
\ts_cmp_lt_i32 s0, s1
\ts_cbranch_scc1 .LBB0_1
; %bb.9:
\ts_endpgm
.Lfunc_end0:
"""


def test_counting_rule_on_a_toy_loop():
    nest = A.LoopNest(A.parse_blocks(A.function_lines(TOY.replace("%bb.5a", "%bb.10"), "toy")))
    assert nest.main_loop() == "BB0_1"
    assert nest.children("BB0_1") == ["BB0_6"]
    path = []
    counts = A.iteration(nest, "BB0_1", {"BB0_6": 3}, 64, path)
    nodes = [n for n, _ in path]
    assert "BB0_2" in nodes          # execz: the masked code runs
    assert "BB0_4" not in nodes      # the soft-cap division is off the path
    assert "BB0_10" in nodes         # the uniform side with more vector work is taken
    assert counts["mfma"] == 1 and counts["trans"] == 0
    assert counts["valu"] == 2 + 3   # two adds, and the inner loop's fmac three times
    assert counts["salu"] == 1 + 1 + 3 + 1  # saveexec, s_or_b64, s_add_u32 x 3, s_cmp_lt_i32
    assert counts["vmem_load"] == 1 and counts["vmem_load_bytes"] == 16 * 64
    assert counts["lds"] == 1 and counts["lds_bytes"] == 16 * 64
    assert counts["vmcnt_waits"] == 1


def test_a_loop_of_many_blocks():
    """A loop body of 3000 blocks (a kernel that spills has well over a thousand): the walk
    over it keeps its own stack, so Python's recursion limit does not stop the count."""
    lines = ["big:", "\ts_mov_b32 s0, 0",
             ".LBB0_1:                                ; =>This Loop Header: Depth=1"]
    for i in range(2, 3002):
        lines += ["\tv_add_f32_e32 v0, v0, v0", f"\ts_cbranch_execz .LBB0_{i}",
                  f".LBB0_{i}:                                ;   in Loop: Header=BB0_1 Depth=1"]
    lines += ["\ts_cbranch_scc1 .LBB0_1", "; %bb.3002:", "\ts_endpgm", ".Lfunc_end0:"]
    nest = A.LoopNest(A.parse_blocks(A.function_lines("\n".join(lines), "big")))
    assert nest.main_loop() == "BB0_1"
    assert A.iteration(nest, "BB0_1", {}, 64)["valu"] == 3000


# An inner loop rotated around a uniform test, as clang lays out the matrix kernel's S^T chunk
# loop in steps of 2 over an odd count of chunks: BB0_3 (the second load of a step) is annotated
# in the outer loop, yet the inner loop's latch BB0_5 goes back through it.
ROTATED = """\
rot:
\ts_mov_b32 s0, 0
.LBB0_1:                                ; =>This Loop Header: Depth=1
                                        ;     Child Loop BB0_4 Depth 2
\tglobal_load_b128 v[0:3], v[4:5], off
\ts_cbranch_scc1 .LBB0_4
.LBB0_3:                                ;   in Loop: Header=BB0_1 Depth=1
\tglobal_load_b128 v[6:9], v[4:5], off
.LBB0_4:                                ;   Parent Loop BB0_1 Depth=1
                                        ; =>  This Inner Loop Header: Depth=2
\ts_wait_loadcnt 0x0
\tv_wmma_f32_16x16x16_f16 v[10:17], v[0:3], v[0:3], v[10:17]
\ts_cbranch_scc0 .LBB0_6
; %bb.5:                                ;   in Loop: Header=BB0_4 Depth=2
\tglobal_load_b128 v[0:3], v[4:5], off
\ts_cbranch_scc0 .LBB0_3
\ts_branch .LBB0_4
.LBB0_6:                                ;   in Loop: Header=BB0_1 Depth=1
\tv_add_f32_e32 v9, v9, v9
\ts_cbranch_scc1 .LBB0_1
; %bb.7:
\ts_endpgm
.Lfunc_end0:
"""


def test_an_inner_loop_rotated_around_a_uniform_test():
    """A block the annotations leave in the outer loop, entered from the inner loop's latch
    and going only into the inner loop, counts in the inner loop's iteration."""
    nest = A.LoopNest(A.parse_blocks(A.function_lines(ROTATED, "rot")))
    assert nest.main_loop() == "BB0_1" and nest.children("BB0_1") == ["BB0_4"]
    assert nest.members("BB0_4") == ["BB0_3", "BB0_4", "BB0_5"]
    counts = A.iteration(nest, "BB0_1", {"BB0_4": 2}, 32)
    assert counts["wmma"] == 2 and counts["valu"] == 1
    assert counts["vmem_load"] == 1 + 2 * 2  # the pass's load, then two of each inner trip


def test_round_trips_follow_the_waits():
    """A pass's dependent chain: serial load-wait pairs count one each, loads waited for
    together once, a load issued a pass ahead of its wait (a prefetch) nothing; gfx9's
    vmcnt, gfx12's loadcnt and its combined form (load count in bits 13:8) alike."""
    load, wait = ("global_load_dwordx4", "v[0:3], v[4:5], off"), ("s_waitcnt", "vmcnt(0)")
    assert A.round_trips([load, wait] * 3) == 3
    assert A.round_trips([load] * 3 + [wait, ("v_mfma_f32_16x16x16_f16", "")]) == 1
    # the wait retires the load issued in the pass before, leaving this pass's one in flight
    assert A.round_trips([("s_waitcnt", "vmcnt(1)"), load]) == 0
    assert A.round_trips([("s_waitcnt", "lgkmcnt(0)"), load]) == 0  # no wait for loads
    assert A.vmem_wait_limit("s_wait_loadcnt", "0x2") == 2
    assert A.vmem_wait_limit("s_wait_loadcnt_dscnt", "0x107") == 1
    assert A.vmem_wait_limit("s_wait_dscnt", "0x0") is None


def test_rates_match_the_matrix_calculator_tables():
    """The model's matrix-instruction cycles are AMD's calculator figures kept in tests/data."""
    def cycles(name):
        text = (ROOT / "tests" / "data" / "amd_matrix" / name).read_text()
        return int(re.search(r"Execution cycles: (\d+)", text).group(1))
    assert A.MACHINES["MI300X"].matrix == cycles("cdna3_v_mfma_f32_16x16x16_f16.txt")
    assert A.MACHINES["RX 7900 XTX"].matrix == cycles("rdna3_v_wmma_f32_16x16x16_f16.txt")
    assert "Can co-execute with VALU: False" in (
        ROOT / "tests" / "data" / "amd_matrix" / "rdna3_v_wmma_f32_16x16x16_f16.txt").read_text()
    assert A.MACHINES["RX 7900 XTX"].matrix_on_valu and not A.MACHINES["MI300X"].matrix_on_valu


@pytest.fixture(scope="module")
def gfx942():
    need_compiler(None if shutil.which("clang-19")
                  else "clang-19 (apt-get install clang-19 lld-19)")
    need_compiler(A.offline.hip_toolchain_missing("gfx942"))
    return "gfx942"


def integral(counts):
    return all(float(counts[k]).is_integer() and counts[k] >= 0 for k in A.CLASSES)


def test_matrix_loop_on_gfx942(gfx942):
    variant = DecodeMatrixVariant("float16", 128, 1)
    r = A.count_loop("matrix-f16", variant, gfx942)
    c = r.per_pass
    # one 16-token tile a pass: head_size / 16 MFMAs for QK and as many for PV, one row tile
    assert r.tokens == 16 and c["mfma"] == 2 * variant.head_size // 16 == 16
    # every loop in the pass unrolled; no branch around a load
    assert c["wmma"] == 0 and r.trips == {}
    assert r.kv_bytes == 16 * 128 * 2 * 2 == 8192
    assert integral(c) and all(c[k] > 0 for k in ("valu", "trans", "vmem_load", "salu"))
    assert c["vmem_load_bytes"] >= r.kv_bytes  # the loads cover the tile's K and V
    assert r.summary["scratch_bytes"] == 0
    # the tile's loads go ahead together (the next tile's block ids with them): a pass waits
    # through one memory round trip (18 before v54, each K piece and block id in turn)
    assert r.round_trips == 1


@pytest.mark.parametrize("arch, dtype, cache", [("gfx90a", "bfloat16", None),
                                                ("gfx1201", "float16", None),
                                                ("gfx942", "float16", "fp8_amd"),
                                                ("gfx1201", "float16", "fp8")])
def test_matrix_loads_go_ahead(gfx942, arch, dtype, cache):
    """One memory round trip a pass wherever a tile's loads fit the registers (decode_matrix.cu's
    AHEAD_VGPRS: every CDNA variant, RDNA4 to head 128 at one tile), both caches, without
    spills."""
    need_compiler(A.offline.hip_toolchain_missing(arch))
    r = A.count_loop("matrix", DecodeMatrixVariant(dtype, 128, 1, cache), arch)
    assert r.round_trips == 1 and r.summary["scratch_bytes"] == 0 and r.trips == {}


def test_matrix_loads_on_rdna3(gfx942):
    """RDNA3 holds a token's whole K row a lane, so its three load forms (decode_matrix.cu's
    MatrixPartition) all show there:
    - head 64, one tile: the pass fits the registers and goes ahead, one round trip;
    - head 128 (and 80, an odd count of chunks, with an fp8 cache): in steps, S^T's chunk
      loop two chunks a pass (head_size / 32 passes), a few round trips, no spills;
    - two tiles at head 192 (which dispatch never picks there: one tile at 192): the guarded
      loads as before v54, the chunk loop unrolled by 2, each load its own round trip."""
    need_compiler(A.offline.hip_toolchain_missing("gfx1100"))
    small = A.count_loop("matrix", DecodeMatrixVariant("float16", 64, 1), "gfx1100")
    assert small.round_trips == 1 and small.summary["scratch_bytes"] == 0
    for variant in (DecodeMatrixVariant("float16", 128, 1),
                    DecodeMatrixVariant("float16", 80, 1, "fp8")):
        r = A.count_loop("matrix", variant, "gfx1100")
        assert list(r.trips.values()) == [variant.head_size / 32]
        assert r.round_trips <= 8 and r.summary["scratch_bytes"] == 0, variant
        assert r.summary["occupancy"] >= 6 and r.columns == variant.head_size
    guarded = A.count_loop("matrix", DecodeMatrixVariant("float16", 192, 2), "gfx1100")
    assert list(guarded.trips.values()) == [192 / 32] and guarded.round_trips > 50


def test_matrix_loads_in_steps_on_rdna4(gfx942):
    """RDNA4's variants past the register rule for loads ahead (two tiles at 80 to 128, one at
    192) go in steps: a few round trips a pass, no spills."""
    need_compiler(A.offline.hip_toolchain_missing("gfx1201"))
    for variant in (DecodeMatrixVariant("bfloat16", 96, 2), DecodeMatrixVariant("float16", 192, 1),
                    DecodeMatrixVariant("float16", 80, 2, "fp8_amd"),
                    DecodeMatrixVariant("float16", 128, 2, "fp8")):
        r = A.count_loop("matrix", variant, "gfx1201")
        assert r.round_trips <= 10 and r.summary["scratch_bytes"] == 0, variant


@pytest.mark.parametrize("arch, variant, scratch", [
    ("gfx1100", DecodeMatrixVariant("float16", 192, 1), 0),
    ("gfx1100", DecodeMatrixVariant("bfloat16", 256, 1), 0),
    ("gfx1100", DecodeMatrixVariant("float16", 256, 1, "fp8"), 0),
    ("gfx1100", DecodeMatrixVariant("float16", 96, 2), 12),
    ("gfx1100", DecodeMatrixVariant("float16", 128, 2), 0),
    ("gfx1201", DecodeMatrixVariant("float16", 256, 1, "fp8_amd"), 0),
    ("gfx1201", DecodeMatrixVariant("float16", 192, 2, "fp8_amd"), 0)])
def test_matrix_pairs_share_a_tile(gfx942, arch, variant, scratch):
    """Where even a whole head's held arrays pass the registers (decode_matrix.cu's SPLIT:
    RDNA3 one tile at 192 and 256 and two at 96 and 128, RDNA4 one at 256 and two at 192) two
    wavefronts share a tile: the loop has a barrier (the pair adds its halves of S^T), a pass
    reads half the head's columns, in steps or ahead, a few round trips (34-372 before v56)
    and no more than a few bytes of spill (28-800 a lane before at one tile; two tiles at 96
    spill 8-20 now)."""
    need_compiler(A.offline.hip_toolchain_missing(arch))
    r = A.count_loop("matrix", variant, arch)
    assert r.columns == variant.head_size // 2 and r.per_pass["barrier"] >= 1
    assert r.kv_bytes == 16 * variant.head_size // 2 * A.cache_bytes(variant) * 2
    assert r.round_trips <= 9 and r.summary["scratch_bytes"] <= scratch, variant
    whole = 16 * variant.head_size * A.cache_bytes(variant) * 2
    assert r.per_16_tokens()["vmem_load_bytes"] >= whole  # both halves of every row are read


@pytest.mark.parametrize("head_size", [80, 96, 112, 192])
def test_matrix_loop_at_the_other_head_sizes_on_gfx942(gfx942, head_size):
    """QK takes head_size / 16 MFMAs a pass, PV one per 16-row tile of O^T: as many, made even
    (80 and 112: 6 and 8 tiles, the last one's columns past the row zeros); no spills; every
    group of V loaded ahead with K, one round trip."""
    r = A.count_loop("matrix", DecodeMatrixVariant("float16", head_size, 1), gfx942)
    chunks = head_size // 16
    assert r.per_pass["mfma"] == chunks + (chunks + 1) // 2 * 2
    assert r.kv_bytes == 16 * head_size * 2 * 2 and r.summary["scratch_bytes"] == 0
    assert r.round_trips == 1
    assert integral(r.per_pass)


def test_variants_at_another_head_size():
    at_96 = A.variants_at(96)
    assert at_96.keys() == A.DEFAULT_VARIANTS.keys() and A.variants_at(None) is A.DEFAULT_VARIANTS
    assert all(v.head_size == 96 and v == replace(A.DEFAULT_VARIANTS[name], head_size=96)
               for name, v in at_96.items())


def test_portable_loop_on_gfx942(gfx942):
    variant = DecodeVariant("float16", 128, 8)
    r = A.count_loop("portable-f16-gqa8", variant, gfx942)
    c = r.per_pass
    assert c["mfma"] == 0 and c["wmma"] == 0
    # a pass of one wavefront stands for its 64 tokens of the 128-token tile
    assert r.tokens == 64 and r.kv_bytes == 64 * 128 * 2 * 2 == 32768
    # the PV step loop runs TILE / (BATCH * LANES) = 128 / 16 times, the QK chunk loop 16 / 4
    assert sorted(r.trips.values()).count(8) == 1 and 4 in r.trips.values()
    # a PV step's 8 loads go together: 25 round trips a pass (81 when each waited; v57)
    assert r.round_trips <= 25
    assert integral(c) and all(c[k] > 0 for k in ("valu", "trans", "lds", "vmem_load", "salu"))
    assert c["vmem_load_bytes"] >= r.kv_bytes
    # at least the multiply-adds: per lane 4 a KV byte (8 rows, one each per 2-byte element of
    # K and of V), over 64 lanes, two to a packed instruction at best
    assert r.per_kv_byte()["valu"] >= 4 / 64 / 2


@pytest.mark.parametrize("arch, variant, vgprs, occupancy", [
    ("gfx942", DecodeVariant("float32", 64, 1, FP8_CACHE), 128, 3),
    ("gfx942", DecodeVariant("float16", 128, 1, FP8_CACHE), 128, 3),
    ("gfx1100", DecodeVariant("float16", 112, 1, FP8_CACHE), 128, 12),
    ("gfx1100", DecodeVariant("float32", 192, 2, FP8_CACHE), 128, 7),
    ("gfx1100", DecodeVariant("float16", 64, 2), 128, 12)])
def test_portable_lane_sums_in_steps(arch, variant, vgprs, occupancy):
    """The portable kernel adds its token lanes' sums a few lanes at a time (PvLayout::
    SUM_STEP): with 15 to 31 lanes of 16 or 32 floats (an fp8 cache, or 16 bits at GQA 2 and
    head 64) clang loaded them all at once, for 256-512 VGPRs, spills of up to 316 bytes a
    lane and one wavefront a SIMD on gfx942 (docs/perf-log.md v58)."""
    need_compiler(A.offline.hip_toolchain_missing(arch))
    s = A.kernel_summary(A.offline.assembly_for(variant, arch), variant.partition_name)
    assert s["vgprs"] <= vgprs and s["scratch_bytes"] == 0, (variant, s)
    assert s["occupancy"] >= occupancy, (variant, s)


def test_hardware_fp8_widening_on_gfx942(gfx942):
    """The e4m3fnuz cache on gfx942 widens with v_cvt_pk_f32_fp8, two codes an instruction:
    one per pair of K and V elements of a pass, and less VALU work than the software form."""
    hw = A.count_loop("hw", DecodeMatrixVariant("float16", 128, 1, "fp8_amd"), gfx942)
    sw = A.count_loop("sw", DecodeMatrixVariant("float16", 128, 1, "fp8"), gfx942)
    text = A.offline.assembly_for(DecodeMatrixVariant("float16", 128, 1, "fp8_amd"), gfx942)
    assert "v_cvt_pk_f32_fp8" in text
    assert hw.per_pass["valu"] < sw.per_pass["valu"]
    assert hw.kv_bytes == sw.kv_bytes == 16 * 128 * 2
