"""AMD's MFMA/WMMA operand layouts as AMD's Matrix Instruction Calculator prints them, parsed,
and a numpy reference emulator of each instruction built on nothing but those tables.

The tables (tests/data/amd_matrix/, made by tools/amd_matrix_tables.py) are the independent
statement of where each matrix element lives; the emulation header
(cupa/kernels/amd_emulation.cuh) restates them as index formulas. The tests tie the two: the
formulas against every table entry (CPU), and the header's emulated instructions against
`reference_mma` below (GPU).

Terms: a matrix element is (block, row, col) in the matrix's own indexing, A[i][k], B[k][j],
C/D[i][j]; a location is (lane, register, low bit) within one wavefront's VGPRs.
"""

from __future__ import annotations

import csv
import functools
import pathlib
import re
from dataclasses import dataclass, field

import numpy as np

DATA_DIR = pathlib.Path(__file__).resolve().parents[1] / "data" / "amd_matrix"
MATRICES = "ABCD"

_COMMAND = re.compile(r"^# \$ python3 matrix_calculator\.py (.*)$")
_REG_ENTRY = re.compile(r"^v(\d+)\{(\d+)\}(?:\.\[(\d+):(\d+)\])?$")
_REG_COLUMN = re.compile(r"^v(\d+)(?:\.\[(\d+):(\d+)\])?$")
_ELEMENT = re.compile(r"^([ABCD])\[(\d+)\]\[(\d+)\](?:\.B(\d+))?$")

# The calculator's names for the element types (its -d "Register data types").
ELEMENT_TYPES = {
    "FP16 (IEEE binary16 floating point)": "f16",
    "BF16 (Brain floating point)": "bf16",
    "FP8 (AMD 4-bit exponent, 3-bit mantissa floating point)": "fp8_fnuz",
    "FP8 (OCP 4-bit exponent, 3-bit mantissa floating point)": "fp8_ocp",
    "FP32 (IEEE binary32 floating point)": "f32",
}
TYPE_BITS = {"f16": 16, "bf16": 16, "fp8_fnuz": 8, "fp8_ocp": 8, "f32": 32}


@dataclass
class Layout:
    name: str                 # file stem, e.g. cdna3_v_mfma_f32_16x16x16_f16
    family: str               # cdna2, cdna3, rdna3, rdna4
    arch: str                 # the -a value, e.g. gfx942
    instruction: str          # as the calculator spells it
    wave: int                 # lanes of the wavefront the tables describe
    M: int
    N: int
    K: int
    blocks: int
    types: dict = field(default_factory=dict)   # matrix -> element type name
    regs: dict = field(default_factory=dict)    # matrix -> VGPRs per lane
    # matrix -> {(block, row, col): [(lane, reg, lo_bit), ...]} from the register layout (-R);
    # more than one location where the instruction reads a replicated copy (RDNA3 A/B).
    where: dict = field(default_factory=dict)
    # matrix -> {(lane, reg, lo_bit): (block, row, col)} from the matrix layout (-M).
    what: dict = field(default_factory=dict)
    commands: list = field(default_factory=list)

    def shape(self, matrix: str) -> tuple[int, int, int]:
        return {"A": (self.blocks, self.M, self.K), "B": (self.blocks, self.K, self.N),
                "C": (self.blocks, self.M, self.N), "D": (self.blocks, self.M, self.N)}[matrix]

    def bits(self, matrix: str) -> int:
        return TYPE_BITS[self.types[matrix]]


def table_names() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.txt"))


def _sections(text: str) -> list[tuple[list[str], list[str]]]:
    """[(command arguments, output lines)] in file order."""
    sections, current = [], None
    for line in text.splitlines():
        match = _COMMAND.match(line)
        if match:
            current = (match.group(1).split(), [])
            sections.append(current)
        elif line.startswith("#") or current is None:
            continue
        else:
            current[1].append(line)
    return sections


def _parse_register_layout(lines: list[str], matrix: str) -> dict:
    """-R --csv: one grid per block, rows and columns in the matrix's own indexing; each cell
    lists the locations holding that element, space separated."""
    where, block, columns = {}, 0, None
    for row in csv.reader(lines[2:]):  # the first two lines name architecture and instruction
        if not row:
            continue
        if row[0].startswith("Block "):
            block = int(row[0].split()[1])
        elif row[0].startswith(f"{matrix}["):
            columns = [int(c) for c in row[1:]]
        else:
            r = int(row[0])
            for c, cell in zip(columns, row[1:]):
                locations = []
                for entry in cell.split():
                    m = _REG_ENTRY.match(entry)
                    if not m:
                        raise ValueError(f"unparsed register entry {entry!r}")
                    reg, lane, _hi, lo = m.groups()
                    locations.append((int(lane), int(reg), int(lo or 0)))
                key = (block, r, c)
                if key in where:
                    raise ValueError(f"{matrix}{key} listed twice")
                where[key] = locations
    return where


def _parse_matrix_layout(lines: list[str], matrix: str) -> dict:
    """-M --csv: a row per lane, a column per (register, bits), each cell one element."""
    rows = list(csv.reader(lines[2:]))
    columns = []
    for heading in rows[0][1:]:
        m = _REG_COLUMN.match(heading)
        if not m:
            raise ValueError(f"unparsed column {heading!r}")
        columns.append((int(m.group(1)), int(m.group(3) or 0)))
    what = {}
    for row in rows[1:]:
        if not row:
            continue
        lane = int(row[0])
        for (reg, lo), cell in zip(columns, row[1:]):
            m = _ELEMENT.match(cell.strip())
            if not m or m.group(1) != matrix:
                raise ValueError(f"unparsed element {cell!r}")
            what[(lane, reg, lo)] = (int(m.group(4) or 0), int(m.group(2)), int(m.group(3)))
    return what


def _parse_details(lines: list[str]) -> dict:
    details = {"blocks": 1}
    for line in lines:
        key, _, value = line.strip().partition(": ")
        if key in ("M", "N", "K", "blocks"):
            details[key] = int(value)
        elif key in ("Src0", "Src1", "Src2", "Vdst"):
            details["type_" + "ABCD"["Src0 Src1 Src2 Vdst".split().index(key)]] = \
                ELEMENT_TYPES[value]
    return details


@functools.lru_cache(maxsize=None)
def load(name: str) -> Layout:
    text = (DATA_DIR / f"{name}.txt").read_text()
    details, where, what, commands = None, {}, {}, []
    for args, lines in _sections(text):
        commands.append("python3 matrix_calculator.py " + " ".join(args))
        if "-d" in args:
            details = _parse_details(lines)
            arch, instruction = args[args.index("-a") + 1], args[args.index("-i") + 1]
            wave = int(args[args.index("-w") + 1]) if "-w" in args else 64
            continue
        matrix = next(m for m in MATRICES if f"-{m}" in args)
        if "-R" in args:
            where[matrix] = _parse_register_layout(lines, matrix)
        else:
            what[matrix] = _parse_matrix_layout(lines, matrix)
    if details is None:
        raise ValueError(f"{name}: no -d section")
    layout = Layout(name=name, family=name.split("_")[0], arch=arch, instruction=instruction,
                    wave=wave, M=details["M"], N=details["N"], K=details["K"],
                    blocks=details["blocks"], where=where, what=what, commands=commands)
    for m in MATRICES:
        layout.types[m] = details["type_" + m]
        layout.regs[m] = 1 + max(reg for _lane, reg, _lo in what[m])
    return layout


# ---------------------------------------------------------------------------------------------
# Element codes <-> float32 values

def _fp8_table(bias: int, ocp: bool) -> np.ndarray:
    """float32 value of each e4m3 code: 4 exponent bits with `bias`, 3 mantissa bits,
    subnormals at exponent 0. OCP e4m3fn: S.1111.111 is NaN, no infinities; AMD's e4m3fnuz
    (bias 8): only 0x80 (negative zero's code) is NaN."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e, m = (codes >> 3) & 15, codes & 7
    value = np.where(e == 0, m * 2.0 ** (1 - bias - 3), (8 + m) * 2.0 ** (e - bias - 3)) * sign
    nan = ((codes & 0x7f) == 0x7f) if ocp else (codes == 0x80)
    return np.where(nan, np.nan, value).astype(np.float32)


FP8_VALUES = {"fp8_ocp": _fp8_table(7, True), "fp8_fnuz": _fp8_table(8, False)}


def decode(codes: np.ndarray, kind: str) -> np.ndarray:
    """float32 values of element codes (unsigned integers holding the element's bits)."""
    codes = np.asarray(codes, dtype=np.uint32)
    if kind == "f16":
        return codes.astype(np.uint16).view(np.float16).astype(np.float32)
    if kind == "bf16":
        return (codes << 16).astype(np.uint32).view(np.float32)
    if kind == "f32":
        return codes.view(np.float32)
    return FP8_VALUES[kind][codes & 0xff]


def random_codes(rng, shape, kind: str) -> np.ndarray:
    """Random finite element codes of `kind`, moderate in size (sums stay far from overflow)."""
    if kind == "f16":
        return (rng.standard_normal(shape) * 2).astype(np.float16).view(np.uint16).astype(np.uint32)
    if kind == "bf16":
        return (rng.standard_normal(shape).astype(np.float32) * 2).view(np.uint32) >> 16
    if kind == "f32":
        return (rng.standard_normal(shape).astype(np.float32) * 4).view(np.uint32)
    finite = np.flatnonzero(np.isfinite(FP8_VALUES[kind]))
    return finite[rng.integers(0, len(finite), shape)].astype(np.uint32)


# ---------------------------------------------------------------------------------------------
# Registers <-> matrices by the tables

def pack(layout: Layout, matrix: str, codes: np.ndarray) -> np.ndarray:
    """Per-lane registers (wave x regs, uint32) holding `codes` (the matrix's element codes,
    shape layout.shape(matrix)) where the register layout puts them, every copy included."""
    regs = np.zeros((layout.wave, layout.regs[matrix]), dtype=np.uint32)
    mask = (1 << layout.bits(matrix)) - 1
    for (block, r, c), locations in layout.where[matrix].items():
        for lane, reg, lo in locations:
            regs[lane, reg] |= np.uint32((int(codes[block, r, c]) & mask) << lo)
    return regs


def unpack(layout: Layout, matrix: str, regs: np.ndarray):
    """(codes, poisoned): each element's code from the registers, and whether its copies
    disagree (its first copy's code is returned then)."""
    codes = np.zeros(layout.shape(matrix), dtype=np.uint32)
    poisoned = np.zeros(layout.shape(matrix), dtype=bool)
    mask = (1 << layout.bits(matrix)) - 1
    for (block, r, c), locations in layout.where[matrix].items():
        seen = {(int(regs[lane, reg]) >> lo) & mask for lane, reg, lo in locations}
        lane, reg, lo = locations[0]
        codes[block, r, c] = (int(regs[lane, reg]) >> lo) & mask
        poisoned[block, r, c] = len(seen) > 1
    return codes, poisoned


# The smallest normal magnitude of each input type, and of the float32 accumulator.
SMALLEST_NORMAL = {"f16": 2.0 ** -14, "bf16": 2.0 ** -126, "f32": 2.0 ** -126}


def flushes_subnormals(layout: Layout) -> bool:
    """gfx90a (CDNA2): AMD documents that its f16 and bf16 MFMAs flush subnormal inputs and
    outputs to zero (ROCm MIOpen docs, "MI200 matrix fused multiply-add (MFMA) behavior
    specifics"). No flushing is documented for the other targets: they keep subnormals."""
    return layout.family == "cdna2"


def flush(values: np.ndarray, kind: str) -> np.ndarray:
    """`values` with the subnormals of type `kind` replaced by zeros of the same sign."""
    values = np.asarray(values, np.float32)
    tiny = np.abs(values) < np.float32(SMALLEST_NORMAL[kind])
    return np.where(tiny, np.copysign(np.float32(0), values), values).astype(np.float32)


def reference_mma(layout: Layout, a_regs, b_regs, c_regs) -> np.ndarray:
    """D registers of one wavefront's D = A B + C, from its A, B, C registers, by the tables.

    Arithmetic is float32, accumulating k = 0, 1, ... onto C with one rounding per step. A
    product of two f16 or fp8 inputs is exact in float32 (of two bf16, unless it leaves
    float32's range), so this is what the header's fmaf loop computes, bit for bit; the
    hardware's accumulation order and rounding are not documented and not claimed.

    An element whose replicated copies disagree (RDNA3) makes every D element it feeds NaN:
    the hardware's choice of copy is unspecified, and the header poisons them the same way so
    a kernel that fails to replicate is caught.
    """
    a_codes, a_bad = unpack(layout, "A", a_regs)
    b_codes, b_bad = unpack(layout, "B", b_regs)
    c_codes, _ = unpack(layout, "C", c_regs)
    a = decode(a_codes, layout.types["A"])
    b = decode(b_codes, layout.types["B"])
    acc = decode(c_codes, layout.types["C"]).copy()
    flushing = flushes_subnormals(layout)
    if flushing:
        a, b, acc = flush(a, layout.types["A"]), flush(b, layout.types["B"]), flush(acc, "f32")
    with np.errstate(over="ignore", invalid="ignore"):
        for k in range(layout.K):
            acc = acc + a[:, :, k, None] * b[:, None, k, :]
            if flushing:
                acc = flush(acc, "f32")
    poison = a_bad.any(axis=2)[:, :, None] | b_bad.any(axis=1)[:, None, :]
    acc = np.where(poison, np.float32(np.nan), acc).astype(np.float32)
    return pack(layout, "D", acc.view(np.uint32))


def random_operands(layout: Layout, rng):
    """Random A, B, C element codes and the per-lane registers that hold them."""
    codes = {m: random_codes(rng, layout.shape(m), layout.types[m]) for m in "ABC"}
    regs = {m: pack(layout, m, codes[m]) for m in "ABC"}
    return codes, regs
