"""The checks of the emulated AMD build's own pieces (cupa/kernels/amd_emulation.cuh), run by its
probe kernels (amd_emulation_probe.py) on either machine: the GPU (NVRTC, cupy arrays;
tests/gpu/test_gpu_amd_emulation.py) or the CPU (the host compiler with CUPA_CPU, numpy arrays;
tests/unit/test_amd_emulation_cpu.py). Every amd_* matrix wrapper of every emulated target
against the numpy reference built on AMD's calculator tables (amd_layouts.py), bit for bit, and
the wave64/wave32 shuffles, ballot and butterflies against numpy with HIP's semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

import amd_layouts as L
from amd_emulation_probe import TARGETS, THREADS, wrappers_of

GRID = 3  # workgroups a launch: several wavefronts per workgroup and several workgroups
CASES = [(gfx, wrapper) for gfx in sorted(TARGETS) for wrapper in wrappers_of(gfx)]
BF16_CASES = [case for case in CASES if L.load(wrappers_of(case[0])[case[1]]).types["A"] == "bf16"]
ONE = {"f16": 0x3c00, "bf16": 0x3f80, "fp8_fnuz": 0x40, "fp8_ocp": 0x38}


@dataclass
class ProbeMachine:
    """Where the probes run: xp makes and holds the arrays (cupy or numpy), kernel(gfx, name)
    gives a probe kernel called as kernel(grid, block, args)."""
    xp: object
    kernel: Callable

    def to_host(self, array) -> np.ndarray:
        return getattr(self.xp, "asnumpy", np.asarray)(array)


def waves_per_launch(layout):
    return GRID * THREADS // layout.wave


def run_mma(machine, gfx, wrapper, layout, a, b, c, reps=1):
    """D registers (waves x lanes x regs, uint32) of `reps` chained instructions (D -> C), from
    per-wavefront A, B, C registers of the same shape."""
    xp = machine.xp
    d = xp.zeros((a.shape[0], layout.wave, layout.regs["D"]), dtype=xp.float32)
    machine.kernel(gfx, f"probe_{wrapper}")(
        (GRID,), (THREADS,), (xp.asarray(a), xp.asarray(b),
                              xp.asarray(np.ascontiguousarray(c).view(np.float32)), d,
                              np.int32(reps)))
    return machine.to_host(d).view(np.uint32)


def reference(layout, a, b, c, reps=1):
    out = []
    for w in range(a.shape[0]):
        d = c[w]
        for _ in range(reps):
            d = L.reference_mma(layout, a[w], b[w], d)
        out.append(d)
    return np.stack(out)


def assert_same_bits(got, expected):
    """Bit-identical, except that any NaN matches any NaN (NVIDIA arithmetic makes its own
    canonical NaN where one is carried through an fma)."""
    got_nan = np.isnan(got.view(np.float32))
    expected_nan = np.isnan(expected.view(np.float32))
    assert np.array_equal(got_nan, expected_nan)
    mismatch = (got != expected) & ~got_nan
    pairs = ", ".join(f"{int(g):#010x}/{int(e):#010x}"
                      for g, e in zip(got[mismatch][:6], expected[mismatch][:6]))
    assert not mismatch.any(), f"{mismatch.sum()} of {mismatch.size} registers differ, first " \
        f"at (wave, lane, reg) {tuple(int(i[0]) for i in np.nonzero(mismatch))}; got/expected " \
        f"{pairs}"


def random_registers(layout, rng, waves):
    regs = [L.random_operands(layout, rng)[1] for _ in range(waves)]
    return tuple(np.stack([r[m] for r in regs]) for m in "ABC")


def check_instruction_matches_tables(machine, rng, gfx, wrapper):
    """Random operands, different in every wavefront; once, and twice chained (the second
    call reuses the wavefront's scratch right after the first)."""
    layout = L.load(wrappers_of(gfx)[wrapper])
    a, b, c = random_registers(layout, rng, waves_per_launch(layout))
    for reps in (1, 2):
        expected = reference(layout, a, b, c, reps)
        assert np.isfinite(expected.view(np.float32)).all()
        assert_same_bits(run_mma(machine, gfx, wrapper, layout, a, b, c, reps), expected)


def float32_subnormal(values: np.ndarray) -> np.ndarray:
    return (values != 0) & (np.abs(values) < np.finfo(np.float32).tiny)


def check_decodes(machine, rng, gfx, wrapper, subnormal_f32):
    """B = [I; 0] and C = 0 make D the decoded A: subnormals and extremes of the input type
    (every finite code, for fp8), bit-exact against the numpy decoding (gfx90a flushes
    subnormals). subnormal_f32: the bf16 codes whose value is a float32 subnormal (kept where
    no flushing is documented, flushed on gfx90a: amd_layouts.flushes_subnormals), else the
    others."""
    layout = L.load(wrappers_of(gfx)[wrapper])
    kind = layout.types["A"]
    space = np.arange(1 << layout.bits("A"), dtype=np.uint32)
    values = L.decode(space, kind)
    keep = np.isfinite(values)
    if kind == "bf16":
        keep &= float32_subnormal(values) == subnormal_f32
    finite = space[keep]
    waves = waves_per_launch(layout)
    n = layout.blocks * layout.M * layout.K
    a_regs, expected = [], []
    eye = np.zeros(layout.shape("B"), np.uint32)
    for j in range(min(layout.K, layout.N)):
        eye[:, j, j] = ONE[kind]
    for w in range(waves):
        codes = finite[rng.permutation(len(finite))[:n]] if len(finite) >= n else \
            finite[rng.integers(0, len(finite), n)]
        a_codes = codes.reshape(layout.shape("A"))
        a_regs.append(L.pack(layout, "A", a_codes))
        d = np.zeros(layout.shape("D"), np.float32)
        values = L.decode(a_codes[:, :, :layout.N], kind)
        if L.flushes_subnormals(layout):
            values = L.flush(values, kind)
        d[:, :, :layout.N] = values + np.float32(0)
        expected.append(L.pack(layout, "D", d.view(np.uint32)))
    a = np.stack(a_regs)
    b = np.stack([L.pack(layout, "B", eye)] * waves)
    c = np.zeros((waves, layout.wave, layout.regs["C"]), np.uint32)
    got = run_mma(machine, gfx, wrapper, layout, a, b, c)
    assert_same_bits(got, np.stack(expected))
    assert_same_bits(got, reference(layout, a, b, c))


def check_rdna3_unreplicated_operands_poison(machine, rng, wrapper):
    """RDNA3 reads A and B from both half-waves; where a kernel leaves the copies different,
    the emulation makes the D row (A) and column (B) they feed NaN, as the reference does."""
    layout = L.load(wrappers_of("gfx1100")[wrapper])
    a, b, c = random_registers(layout, rng, waves_per_launch(layout))
    a[1, 16 + 3, 2] ^= 0x00010000  # wave 1: copy 1 of A[3][5]
    b[2, 16 + 7, 0] ^= 0x00000001  # wave 2: copy 1 of B[0][7]
    expected = reference(layout, a, b, c)
    nan = np.isnan(expected.view(np.float32))
    assert nan[1].any() and nan[2].any() and not nan[0].any() and not nan[3:].any()
    assert_same_bits(run_mma(machine, "gfx1100", wrapper, layout, a, b, c), expected)


def check_wavefront_operations(machine, rng, gfx):
    """emu_wave_xor (every mask, then all of them chained), emu_wave_shfl (any source lane),
    emu_wave_ballot, emu_wave_sum / max, against numpy with HIP's semantics."""
    xp = machine.xp
    warp = TARGETS[gfx][0]
    total = GRID * THREADS
    lane = np.arange(total) % warp
    base = np.arange(total) - lane
    x = rng.standard_normal(total).astype(np.float32)
    masks = np.array(list(range(warp + 2)) + [2 * warp - 1, 3, 5, warp - 1], np.int32)
    src = rng.integers(-3 * warp, 3 * warp, total).astype(np.int32)
    out = {name: xp.zeros(n, dtype) for name, n, dtype in [
        ("xor", len(masks) * total, xp.float32), ("chain", total, xp.float32),
        ("shfl", total, xp.float32), ("ballot", total, xp.uint64),
        ("sum", total, xp.float32), ("max", total, xp.float32)]}
    machine.kernel(gfx, "probe_wave_ops")(
        (GRID,), (THREADS,), (xp.asarray(x), xp.asarray(masks), np.int32(len(masks)),
                              xp.asarray(src), out["xor"], out["chain"], out["shfl"],
                              out["ballot"], out["sum"], out["max"]))
    got = {name: machine.to_host(v) for name, v in out.items()}

    def partner(m):
        s = lane ^ m
        return base + np.where(s < warp, s, lane)  # outside the wavefront: the lane itself

    expected_xor = np.stack([x[partner(m)] for m in masks])
    assert np.array_equal(got["xor"].reshape(len(masks), total), expected_xor)
    chained = x.copy()
    for m in masks:
        chained = chained[partner(m)]
    assert np.array_equal(got["chain"], chained)
    assert np.array_equal(got["shfl"], x[base + (src & (warp - 1))])
    bits = ((x > 0).astype(np.uint64) << lane.astype(np.uint64)).reshape(-1, warp)
    ballot = np.repeat(np.bitwise_or.reduce(bits, axis=1), warp)
    assert np.array_equal(got["ballot"], ballot)
    total_sum, total_max = x.copy(), x.copy()
    m = warp // 2
    while m:
        total_sum = total_sum + total_sum[base + (lane ^ m)]
        total_max = np.maximum(total_max, total_max[base + (lane ^ m)])
        m //= 2
    assert np.array_equal(got["sum"], total_sum)  # same butterfly, same float32 order
    assert np.array_equal(got["max"], total_max)
