"""AMD's MFMA/WMMA layout tables (tests/data/amd_matrix/, from AMD's Matrix Instruction
Calculator), the numpy reference emulator built on them, and the emulation header's index
formulas tied to them entry by entry. CPU only; the header's emulated instructions themselves
run in tests/gpu/test_gpu_amd_emulation.py."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import amd_layouts as L
from amd_emulation_probe import HEADER, WRAPPERS, layout_of_table
from tool_module import tool_module

TABLES = L.table_names()


def generator_tables():
    """The (arch, instruction) list tools/amd_matrix_tables.py produces."""
    return tool_module("amd_matrix_tables").TABLES


def copies(layout, matrix):
    """How many locations hold each element: RDNA3's WMMA reads A and B replicated in both
    half-waves; everything else holds each element once."""
    return 2 if layout.family == "rdna3" and matrix in "AB" else 1


# ---------------------------------------------------------------------------------------------
# The tables themselves

def test_every_generated_table_is_committed():
    expected = {f"{prefix}_{instruction}" for prefix, _a, _w, instruction in generator_tables()}
    assert expected == set(TABLES)


@pytest.mark.parametrize("name", TABLES)
def test_table_records_its_commands(name):
    layout = L.load(name)
    text = (L.DATA_DIR / f"{name}.txt").read_text()
    assert text.startswith("# AMD Matrix Instruction Calculator Version ")
    assert len(layout.commands) == 9  # -d, then -R and -M of A, B, C, D
    for command in layout.commands:
        assert f"-a {layout.arch} -i {layout.instruction}" in command
    assert layout.instruction in name


@pytest.mark.parametrize("name", TABLES)
def test_wavefront_size(name):
    layout = L.load(name)
    assert layout.wave == (64 if layout.family.startswith("cdna") else 32)
    for m in L.MATRICES:
        assert {lane for lane, _r, _b in layout.what[m]} == set(range(layout.wave))


@pytest.mark.parametrize("matrix", L.MATRICES)
@pytest.mark.parametrize("name", TABLES)
def test_every_element_appears_once(name, matrix):
    """Every element of the matrix is listed, each in its expected number of locations, no
    location holds two elements, and the registers are packed full."""
    layout = L.load(name)
    blocks, rows, cols = layout.shape(matrix)
    where = layout.where[matrix]
    assert set(where) == set(itertools.product(range(blocks), range(rows), range(cols)))
    bits = layout.bits(matrix)
    locations = [loc for locs in where.values() for loc in locs]
    assert all(len(locs) == copies(layout, matrix) for locs in where.values())
    assert len(set(locations)) == len(locations)
    full = set(itertools.product(range(layout.wave), range(layout.regs[matrix]),
                                 range(0, 32, bits)))
    assert set(locations) == full


@pytest.mark.parametrize("matrix", L.MATRICES)
@pytest.mark.parametrize("name", TABLES)
def test_register_and_matrix_layouts_agree(name, matrix):
    """-R (element -> registers) and -M (registers -> element) are inverse tables."""
    layout = L.load(name)
    inverse = {loc: element for element, locs in layout.where[matrix].items() for loc in locs}
    assert inverse == layout.what[matrix]


@pytest.mark.parametrize("name", TABLES)
def test_c_and_d_share_a_layout(name):
    layout = L.load(name)
    assert layout.where["C"] == layout.where["D"]
    assert layout.types["C"] == layout.types["D"] == "f32"


def test_cdna2_and_cdna3_layouts_agree():
    """The same instructions under their two generations' names place operands identically,
    which is why one wrapper (and one header layout) serves both."""
    for _wrapper, (_layout, tables) in WRAPPERS.items():
        if "gfx90a" in tables and "gfx942" in tables:
            old, new = L.load(tables["gfx90a"]), L.load(tables["gfx942"])
            assert old.where == new.where and old.types == new.types


def test_rdna3_and_rdna4_layouts_differ():
    for kind in ("f16", "bf16"):
        rdna3 = L.load(f"rdna3_v_wmma_f32_16x16x16_{kind}")
        rdna4 = L.load(f"rdna4_v_wmma_f32_16x16x16_{kind}")
        assert rdna3.where["A"] != rdna4.where["A"] and rdna3.where["D"] != rdna4.where["D"]


# ---------------------------------------------------------------------------------------------
# Element codes

def test_fp8_decoding():
    ocp, fnuz = L.FP8_VALUES["fp8_ocp"], L.FP8_VALUES["fp8_fnuz"]
    assert ocp[0x7e] == 448 and ocp[0x01] == 2.0 ** -9 and np.isnan(ocp[0x7f]) \
        and np.isnan(ocp[0xff]) and ocp[0x80] == 0
    assert fnuz[0x7f] == 240 and fnuz[0x01] == 2.0 ** -10 and np.isnan(fnuz[0x80]) \
        and np.isfinite(fnuz[0xff]) and fnuz[0xff] == -240
    assert np.isnan(ocp).sum() == 2 and np.isnan(fnuz).sum() == 1


@pytest.mark.parametrize("kind", ["f16", "bf16", "f32", "fp8_ocp", "fp8_fnuz"])
def test_random_codes_are_finite(rng, kind):
    assert np.isfinite(L.decode(L.random_codes(rng, (1000,), kind), kind)).all()


# ---------------------------------------------------------------------------------------------
# The numpy reference emulator

@pytest.mark.parametrize("name", TABLES)
def test_pack_and_unpack_are_inverse(rng, name):
    layout = L.load(name)
    for m in L.MATRICES:
        codes = L.random_codes(rng, layout.shape(m), layout.types[m if m != "D" else "C"])
        back, poisoned = L.unpack(layout, m, L.pack(layout, m, codes))
        assert np.array_equal(back, codes) and not poisoned.any()


@pytest.mark.parametrize("name, seed", [("cdna2_v_mfma_f32_16x16x16f16", 1290463552)])
def test_reference_emulator_matches_matmul_with_a_flushed_input(name, seed):
    """A CI run's seed whose A holds a subnormal f16 (5.6e-5) on gfx90a: the check below failed
    on it while its float64 product kept that input."""
    test_reference_emulator_matches_matmul(np.random.default_rng(seed), name)


@pytest.mark.parametrize("name", TABLES)
def test_reference_emulator_matches_matmul(rng, name):
    """Registers in, registers out by the tables; D against a float64 A @ B + C per block,
    within float32 accumulation error.

    On a target that flushes subnormal inputs (gfx90a), the float64 product takes them flushed
    too: random f16 data holds one now and then (1 seed in 400 for the 16x16x16 f16 table), and
    its products are then missing from D by design. test_reference_emulator_subnormals_by_target
    checks the flushing itself."""
    layout = L.load(name)
    codes, regs = L.random_operands(layout, rng)
    d_regs = L.reference_mma(layout, regs["A"], regs["B"], regs["C"])
    d, _ = L.unpack(layout, "D", d_regs)
    d = L.decode(d, "f32").astype(np.float64)
    a, b, c = (L.decode(codes[m], layout.types[m]) for m in "ABC")
    if L.flushes_subnormals(layout):
        a, b = L.flush(a, layout.types["A"]), L.flush(b, layout.types["B"])
        c = L.flush(c, "f32")
    a, b, c = (x.astype(np.float64) for x in (a, b, c))
    exact = a @ b + c
    bound = 4 * layout.K * 2.0 ** -24 * (np.abs(a) @ np.abs(b) + np.abs(c)) + 1e-30
    assert np.all(np.abs(d - exact) <= bound)
    # A wrong layout would not come close: check that this data tells layouts apart.
    assert not np.allclose(exact, a @ b[:, ::-1, :] + c)


def test_reference_emulator_poisons_unreplicated_operands(rng):
    """RDNA3: a copy that differs from its twin makes the D row (A) or column (B) it feeds NaN,
    and nothing else."""
    for name in ("rdna3_v_wmma_f32_16x16x16_f16", "rdna3_v_wmma_f32_16x16x16_bf16"):
        layout = L.load(name)
        _codes, regs = L.random_operands(layout, rng)
        a, b = regs["A"].copy(), regs["B"].copy()
        a[16 + 3, 2] ^= 0x00010000  # copy 1 of A[3][5]
        b[16 + 7, 0] ^= 0x00000001  # copy 1 of B[0][7]
        d, _ = L.unpack(layout, "D", L.reference_mma(layout, a, b, regs["C"]))
        nan = np.isnan(L.decode(d, "f32"))[0]
        expected = np.zeros((16, 16), bool)
        expected[3, :] = True
        expected[:, 7] = True
        assert np.array_equal(nan, expected)


# ---------------------------------------------------------------------------------------------
# The header's formulas against the tables

_STRUCT = re.compile(r"^struct (AmdLayout\w+) \{\n(.*?)^\};", re.MULTILINE | re.DOTALL)
_CONSTS = re.compile(r"static constexpr int ([^;]+);")
_FUNCTION = re.compile(r"CUPA_AMD_LAYOUT (\w+)\(([^)]*)\) \{\s*return ([^;]+);\s*\}")
FUNCTIONS = {"ab_lane", "ab_reg", "ab_slot", "d_block", "d_row", "d_col"}


def header_layouts() -> dict:
    """{struct: (constants, {function: python callable})} read out of amd_emulation.cuh. Each
    formula is one C expression of + - * / % on non-negative ints, where C's / is Python's //."""
    layouts = {}
    for name, body in _STRUCT.findall(HEADER.read_text()):
        consts = {}
        for group in _CONSTS.findall(body):
            for item in group.split(","):
                key, value = (s.strip() for s in item.split("="))
                consts[key] = int(value)
        functions = {}
        for fname, params, expr in _FUNCTION.findall(body):
            names = [p.split()[-1] for p in params.split(",")]
            assert re.fullmatch(r"[\w\s+\-*/%()]+", expr), expr
            assert set(re.findall(r"[A-Za-z_]\w*", expr)) <= set(names), expr
            code = compile(expr.replace("/", "//"), f"{name}::{fname}", "eval")
            functions[fname] = (lambda code, names: lambda *args: eval(
                code, {"__builtins__": {}}, dict(zip(names, args))))(code, names)
        layouts[name] = (consts, functions)
    return layouts


def test_header_layouts_are_complete():
    layouts = header_layouts()
    assert set(layouts) == {layout for layout, _tables in WRAPPERS.values()}
    # No formula escapes the reader (the macro's own #define is the one other mention).
    text = HEADER.read_text()
    assert text.count("CUPA_AMD_LAYOUT ") - 1 == sum(len(f) for _c, f in layouts.values())
    for name, (consts, functions) in layouts.items():
        assert set(functions) == FUNCTIONS, name
        assert set(consts) == {"WAVE", "BLOCKS", "M", "N", "K", "AB_REGS", "D_REGS", "BITS",
                               "COPIES"}, name
    # Every wrapper's layout and table: the header says which layout each wrapper uses.
    for wrapper, (layout, _tables) in WRAPPERS.items():
        if f"CUPA_AMD_WMMA16({wrapper}, " in text:  # the 16-bit WMMA wrappers' macro
            assert f"CUPA_AMD_WMMA16({wrapper}, {layout}, " in text, wrapper
            continue
        body = text[text.index(f"amd_f32x4 {wrapper}(") if f"amd_f32x4 {wrapper}(" in text
                    else text.index(f"amd_f32x8 {wrapper}("):]
        body = body[:body.index("\n}\n")]
        assert f"CUPA_AMD_EMULATED_MMA({layout}," in body, wrapper


@pytest.mark.parametrize("name", TABLES)
def test_header_formulas_match_the_table(name):
    """For every element of A and B, the header's (lane, VGPR, slot) of each copy are the
    table's locations; for every VGPR of every lane of C and D, the header's element is the
    table's."""
    layout = L.load(name)
    consts, f = header_layouts()[layout_of_table()[name]]
    assert (consts["WAVE"], consts["BLOCKS"], consts["M"], consts["N"], consts["K"]) == \
        (layout.wave, layout.blocks, layout.M, layout.N, layout.K)
    assert consts["AB_REGS"] == layout.regs["A"] == layout.regs["B"]
    assert consts["D_REGS"] == layout.regs["D"]
    assert consts["BITS"] == layout.bits("A") == layout.bits("B")
    assert consts["COPIES"] == copies(layout, "A") == copies(layout, "B")
    bits = consts["BITS"]
    for matrix in "AB":
        for (block, r, c), locations in layout.where[matrix].items():
            row, k = (r, c) if matrix == "A" else (c, r)
            header = {(f["ab_lane"](block, row, k, copy), f["ab_reg"](block, row, k, copy),
                       f["ab_slot"](block, row, k, copy) * bits)
                      for copy in range(consts["COPIES"])}
            assert header == set(locations), (matrix, block, r, c)
    for matrix in "CD":
        for (lane, reg, lo), element in layout.what[matrix].items():
            assert lo == 0
            assert (f["d_block"](lane, reg), f["d_row"](lane, reg), f["d_col"](lane, reg)) \
                == element, (matrix, lane, reg)


def test_header_wrapper_list_matches_the_tables():
    """Each committed table is followed by one wrapper, and each wrapper's tables exist."""
    followed = [t for _layout, tables in WRAPPERS.values() for t in tables.values()]
    assert sorted(followed) == TABLES


def test_lds_limit_constant():
    text = HEADER.read_text()
    assert re.search(r"^#define CUPA_AMD_LDS_BYTES 65536$", text, re.MULTILINE)


@pytest.mark.parametrize("name, flushed", [("cdna2_v_mfma_f32_16x16x16bf16_1k", True),
                                           ("cdna3_v_mfma_f32_16x16x16_bf16", False),
                                           ("cdna2_v_mfma_f32_16x16x16f16", True),
                                           ("rdna4_v_wmma_f32_16x16x16_f16", False)])
def test_reference_emulator_subnormals_by_target(name, flushed):
    """A subnormal input times 1 comes out as 0 where the target flushes (gfx90a, as AMD
    documents for MI200's f16/bf16 MFMAs) and as itself elsewhere."""
    layout = L.load(name)
    kind = layout.types["A"]
    tiny = {"bf16": 0x0001, "f16": 0x0001}[kind]  # the smallest positive subnormal code
    one = {"bf16": 0x3F80, "f16": 0x3C00}[kind]
    a = np.zeros(layout.shape("A"), np.uint32)
    a[0, 0, 0] = tiny
    b = np.zeros(layout.shape("B"), np.uint32)
    b[0, 0, 0] = one
    c = np.zeros(layout.shape("C"), np.uint32)
    d_regs = L.reference_mma(layout, L.pack(layout, "A", a), L.pack(layout, "B", b),
                             L.pack(layout, "C", c))
    d = L.decode(L.unpack(layout, "D", d_regs)[0], "f32")
    assert L.flushes_subnormals(layout) == flushed
    assert d[0, 0, 0] == (0.0 if flushed else L.decode(np.uint32(tiny), kind))
    assert (d[0, 0, 0] > 0) != flushed


@pytest.mark.parametrize("struct", ["AmdLayoutMfma16x16x16", "AmdLayoutWmmaGfx11",
                                    "AmdLayoutWmmaGfx12"])
def test_layout_facts_the_matrix_decode_kernel_relies_on(struct):
    """kernels/matrix/core.cuh's facts 1-3, from the header's formulas (which the tests above
    tie to AMD's tables): a lane holds operand row and accumulator column lane % 16; an operand
    element's k depends on the lane only through its k-group (lane / 16, modulo the copies),
    each (k-group, register, slot) holding one k; S^T's accumulator r is P^T's element r (in
    place) or 2r + half-wave (RDNA3, interleaved)."""
    consts, f = header_layouts()[struct]
    wave, copies, regs, acc = consts["WAVE"], consts["COPIES"], consts["AB_REGS"], consts["D_REGS"]
    kgroups, elems = wave // 16 // copies, 2 * regs
    assert kgroups * elems == 16
    slots = {}
    for row in range(16):
        for k in range(16):
            for copy in range(copies):
                lane = f["ab_lane"](0, row, k, copy)
                assert lane % 16 == row
                key = (lane // 16 % kgroups, f["ab_reg"](0, row, k, copy),
                       f["ab_slot"](0, row, k, copy))
                assert slots.setdefault(key, k) == k  # the same k for every row and copy
    assert len(slots) == 16
    for lane in range(wave):
        for r in range(acc):
            assert f["d_col"](lane, r) == lane % 16
    element = {(lane, r): f["d_row"](lane, r) - lane // 16 % kgroups * elems
               for lane in range(wave) for r in range(acc)}
    in_place = acc == elems and all(e == r for (_lane, r), e in element.items())
    interleaved = copies == 2 and 2 * acc == elems and all(
        e == 2 * r + lane // 16 for (lane, r), e in element.items())
    assert in_place != interleaved
    assert interleaved == (struct == "AmdLayoutWmmaGfx11")
