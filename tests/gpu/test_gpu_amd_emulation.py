"""The emulated AMD build on an NVIDIA GPU: every amd_* matrix wrapper of every emulated target
(cupa/kernels/amd_emulation.cuh, compiled by NVRTC with CUPA_EMULATE_AMD=1) against the numpy
reference emulator built on AMD's calculator tables (tests/helpers/amd_layouts.py), bit for bit, and
the wave64/wave32 shuffles, ballot and butterflies against numpy. Skips without a GPU, and on
ROCm (the emulation is an NVIDIA build)."""

from __future__ import annotations

import numpy as np
import pytest

from cupa.arrays import gpu_available

import amd_layouts as L
from amd_emulation_probe import TARGETS, THREADS, emulated_options, source, wrappers_of

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")

GRID = 3  # workgroups a launch: several wavefronts per workgroup and several workgroups
CASES = [(gfx, wrapper) for gfx in sorted(TARGETS) for wrapper in wrappers_of(gfx)]
ONE = {"f16": 0x3c00, "bf16": 0x3f80, "fp8_fnuz": 0x40, "fp8_ocp": 0x38}


@pytest.fixture(scope="module")
def module():
    import cupy
    if cupy.cuda.runtime.is_hip:
        pytest.skip("the AMD emulation is an NVIDIA (NVRTC) build")
    modules = {}

    def get(gfx):
        if gfx not in modules:
            modules[gfx] = cupy.RawModule(code=source(gfx), options=tuple(emulated_options(gfx)))
        return modules[gfx]
    return get


def waves_per_launch(layout):
    return GRID * THREADS // layout.wave


def run_mma(module, gfx, wrapper, layout, a, b, c, reps=1):
    """D registers (waves x lanes x regs, uint32) of `reps` chained instructions (D -> C) on
    the device, from per-wavefront A, B, C registers of the same shape."""
    import cupy
    d = cupy.zeros((a.shape[0], layout.wave, layout.regs["D"]), dtype=cupy.float32)
    kernel = module(gfx).get_function(f"probe_{wrapper}")
    kernel((GRID,), (THREADS,), (cupy.asarray(a), cupy.asarray(b),
                                 cupy.asarray(np.ascontiguousarray(c).view(np.float32)), d,
                                 np.int32(reps)))
    return cupy.asnumpy(d).view(np.uint32)


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


@pytest.mark.parametrize("gfx, wrapper", CASES)
def test_emulated_instruction_matches_the_tables(module, rng, gfx, wrapper):
    """Random operands, different in every wavefront; once, and twice chained (the second
    call reuses the wavefront's scratch right after the first)."""
    layout = L.load(wrappers_of(gfx)[wrapper])
    a, b, c = random_registers(layout, rng, waves_per_launch(layout))
    for reps in (1, 2):
        expected = reference(layout, a, b, c, reps)
        assert np.isfinite(expected.view(np.float32)).all()
        assert_same_bits(run_mma(module, gfx, wrapper, layout, a, b, c, reps), expected)


def float32_subnormal(values: np.ndarray) -> np.ndarray:
    return (values != 0) & (np.abs(values) < np.finfo(np.float32).tiny)


BF16_CASES = [case for case in CASES if L.load(wrappers_of(case[0])[case[1]]).types["A"] == "bf16"]


@pytest.mark.parametrize("gfx, wrapper", CASES)
def test_emulated_instruction_decodes_every_code(module, rng, gfx, wrapper):
    """B = [I; 0] and C = 0 make D the decoded A: subnormals and extremes of the input type
    (every finite code, for fp8), bit-exact against the numpy decoding (gfx90a flushes
    subnormals). bf16 codes whose value is a float32 subnormal are the next test's."""
    check_decodes(module, rng, gfx, wrapper, subnormal_f32=False)


@pytest.mark.parametrize("gfx, wrapper", BF16_CASES)
def test_emulated_bf16_subnormal_inputs(module, rng, gfx, wrapper):
    """bf16 codes whose value is a float32 subnormal: kept where no flushing is documented,
    flushed to zero on gfx90a (amd_layouts.flushes_subnormals)."""
    check_decodes(module, rng, gfx, wrapper, subnormal_f32=True)


def check_decodes(module, rng, gfx, wrapper, subnormal_f32):
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
    got = run_mma(module, gfx, wrapper, layout, a, b, c)
    assert_same_bits(got, np.stack(expected))
    assert_same_bits(got, reference(layout, a, b, c))


@pytest.mark.parametrize("wrapper", sorted(wrappers_of("gfx1100")))
def test_rdna3_unreplicated_operands_poison(module, rng, wrapper):
    """RDNA3 reads A and B from both half-waves; where a kernel leaves the copies different,
    the emulation makes the D row (A) and column (B) they feed NaN, as the reference does."""
    layout = L.load(wrappers_of("gfx1100")[wrapper])
    a, b, c = random_registers(layout, rng, waves_per_launch(layout))
    a[1, 16 + 3, 2] ^= 0x00010000  # wave 1: copy 1 of A[3][5]
    b[2, 16 + 7, 0] ^= 0x00000001  # wave 2: copy 1 of B[0][7]
    expected = reference(layout, a, b, c)
    nan = np.isnan(expected.view(np.float32))
    assert nan[1].any() and nan[2].any() and not nan[0].any() and not nan[3:].any()
    assert_same_bits(run_mma(module, "gfx1100", wrapper, layout, a, b, c), expected)


@pytest.mark.parametrize("gfx", sorted(TARGETS))
def test_wavefront_operations(module, rng, gfx):
    """emu_wave_xor (every mask, then all of them chained), emu_wave_shfl (any source lane),
    emu_wave_ballot, emu_wave_sum / max, against numpy with HIP's semantics."""
    import cupy
    warp = TARGETS[gfx][0]
    total = GRID * THREADS
    lane = np.arange(total) % warp
    base = np.arange(total) - lane
    x = rng.standard_normal(total).astype(np.float32)
    masks = np.array(list(range(warp + 2)) + [2 * warp - 1, 3, 5, warp - 1], np.int32)
    src = rng.integers(-3 * warp, 3 * warp, total).astype(np.int32)
    out = {name: cupy.zeros(n, dtype) for name, n, dtype in [
        ("xor", len(masks) * total, cupy.float32), ("chain", total, cupy.float32),
        ("shfl", total, cupy.float32), ("ballot", total, cupy.uint64),
        ("sum", total, cupy.float32), ("max", total, cupy.float32)]}
    module(gfx).get_function("probe_wave_ops")(
        (GRID,), (THREADS,), (cupy.asarray(x), cupy.asarray(masks), np.int32(len(masks)),
                              cupy.asarray(src), out["xor"], out["chain"], out["shfl"],
                              out["ballot"], out["sum"], out["max"]))
    got = {name: cupy.asnumpy(v) for name, v in out.items()}

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
