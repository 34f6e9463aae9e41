"""fp8 formats on the CPU: cupa.fp8's conversions bit for bit against ml_dtypes (plus the
saturation ml_dtypes does not do), scales, argument checks, the arch table, and the device
functions of cupa/kernels/fp8.cuh compiled for the host."""

from __future__ import annotations

import os
import warnings

import ml_dtypes
import numpy as np
import pytest

import cupa
from cupa import fp8
from cupa.fp8 import FP8_FORMATS, dequantize_fp8, quantize_fp8

import fp8_probe

FORMATS = list(FP8_FORMATS)
IN_CI = bool(os.environ.get("CI"))


def oracle(x, name, scale=None):
    """ml_dtypes' codes of x (* float32(1 / scale)), saturated first: ml_dtypes itself turns
    overflow and infinities into NaN (e4m3fn) or NaN (e4m3fnuz)."""
    fmt = FP8_FORMATS[name]
    x = np.asarray(x, np.float32)
    if scale is not None:
        with np.errstate(all="ignore"):
            x = np.where(np.isnan(x), x, x * (np.float32(1) / np.asarray(scale, np.float32)))
    with np.errstate(invalid="ignore"):
        x = np.where(np.isnan(x), x, np.clip(x, -fmt.max_finite, fmt.max_finite))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return x.astype(np.float32).astype(getattr(ml_dtypes, fmt.ml_dtypes_name)).view(np.uint8)


def code_values(name):
    """Every code's value per ml_dtypes (float32 [256])."""
    ml_type = getattr(ml_dtypes, FP8_FORMATS[name].ml_dtypes_name)
    return np.arange(256, dtype=np.uint8).view(ml_type).astype(np.float32)


def special_values(name):
    """Every finite value, the exact ties between neighbours and the floats on either side of
    them, the range ends, infinities, zeros, NaNs of both signs and several payloads."""
    fmt = FP8_FORMATS[name]
    values = code_values(name)
    finite = np.unique(values[np.isfinite(values)].astype(np.float64))
    ties = ((finite[1:] + finite[:-1]) / 2).astype(np.float32)  # exact in float32
    up, down = np.float32(np.inf), np.float32(-np.inf)
    smallest = np.float32(2.0 ** (-2 - fmt.exponent_bias))
    m = np.float32(fmt.max_finite)
    extra = np.array([0.0, -0.0, np.inf, -np.inf, m, -m, m * 1.0625, m * 1.07, m * 2, 1e30, -1e30,
                      np.finfo(np.float32).max, -np.finfo(np.float32).max,
                      smallest, smallest / 2, -smallest / 2, smallest / 4, smallest * 0.51,
                      smallest * 1.5, smallest * 2.5, -smallest * 2.5,
                      np.finfo(np.float32).tiny, -np.finfo(np.float32).tiny, 1e-45, -1e-45],
                     np.float32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF,
                     0x7FA00000], np.uint32).view(np.float32)
    return np.concatenate([finite.astype(np.float32), ties, np.nextafter(ties, up),
                           np.nextafter(ties, down), extra, nans])


def random_floats(rng, n):
    """Random float32 bit patterns (every magnitude, NaNs included) and values spread
    log-uniformly over and around the fp8 range."""
    bits = rng.integers(0, 2**32, n // 2, dtype=np.uint64).astype(np.uint32).view(np.float32)
    spread = (np.exp2(rng.uniform(-16, 12, n - n // 2)) *
              rng.choice([-1.0, 1.0], n - n // 2)).astype(np.float32)
    return np.concatenate([bits, spread])


def bits32(x):
    return np.asarray(x, np.float32).view(np.uint32)


# --- conversions --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FORMATS)
def test_decode_every_code_matches_ml_dtypes(name):
    want = code_values(name)
    got = dequantize_fp8(np.arange(256, dtype=np.uint8), name)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    # Bit for bit, NaNs too (-0 in e4m3fn; the NaN payloads ml_dtypes produces).
    np.testing.assert_array_equal(bits32(got), bits32(want))
    assert np.isnan(got).sum() == (2 if name == "fp8_e4m3" else 1)


@pytest.mark.parametrize("name", FORMATS)
def test_encode_special_values_match_ml_dtypes(name):
    x = special_values(name)
    np.testing.assert_array_equal(quantize_fp8(x, name), oracle(x, name))


@pytest.mark.parametrize("name", FORMATS)
def test_encode_random_floats_match_ml_dtypes(rng, name):
    x = random_floats(rng, 1_000_000)
    got, want = quantize_fp8(x, name), oracle(x, name)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, [(hex(bits32(x)[i]), hex(got[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("name", FORMATS)
def test_every_code_round_trips(name):
    codes = np.arange(256, dtype=np.uint8)
    values = dequantize_fp8(codes, name)
    keep = ~np.isnan(values)
    np.testing.assert_array_equal(quantize_fp8(values[keep], name), codes[keep])


def test_saturation_zeros_and_nans_explicitly():
    e4m3 = [(448, 0x7E), (460, 0x7E), (464, 0x7E), (470, 0x7E), (1e9, 0x7E), (np.inf, 0x7E),
            (-np.inf, 0xFE), (-500, 0xFE), (416, 0x7D), (432, 0x7E), (0.0, 0x00), (-0.0, 0x80),
            (-1e-9, 0x80), (2.0**-10, 0x00), (-(2.0**-10), 0x80), (2.0**-9, 0x01),
            (3 * 2.0**-10, 0x02), (5 * 2.0**-10, 0x02), (2.0**-6, 0x08), (1.0, 0x38),
            (np.nan, 0x7F), (-np.nan, 0xFF)]
    fnuz = [(240, 0x7F), (247, 0x7F), (248, 0x7F), (1e9, 0x7F), (np.inf, 0x7F), (-np.inf, 0xFF),
            (0.0, 0x00), (-0.0, 0x00), (-1e-9, 0x00), (2.0**-11, 0x00), (-(2.0**-11), 0x00),
            (2.0**-10, 0x01), (-(2.0**-10), 0x81), (1.0, 0x40), (np.nan, 0x80), (-np.nan, 0x80)]
    for name, table in (("fp8_e4m3", e4m3), ("fp8_e4m3fnuz", fnuz)):
        x = np.array([v for v, _ in table], np.float32)
        np.testing.assert_array_equal(quantize_fp8(x, name), [c for _, c in table],
                                      err_msg=name)


@pytest.mark.parametrize("name", FORMATS)
def test_input_dtypes_and_negative_nan(rng, name):
    x = (rng.standard_normal(4096) * 50).astype(np.float32)
    x[:3] = [np.nan, -np.nan, -np.inf]
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float64):
        narrowed = x.astype(dtype)
        np.testing.assert_array_equal(quantize_fp8(narrowed, name),
                                      oracle(narrowed.astype(np.float32), name), err_msg=str(dtype))
    half = x.astype(np.float16)
    assert quantize_fp8(half[1:2], name)[0] == (0xFF if name == "fp8_e4m3" else 0x80)
    with pytest.raises(ValueError, match="x"):
        quantize_fp8(np.arange(4), name)
    with pytest.raises(ValueError, match="codes"):
        dequantize_fp8(np.arange(4, dtype=np.int32), name)


@pytest.mark.parametrize("name", FORMATS)
def test_scales_per_tensor_and_per_head(rng, name):
    tokens, heads, dim = 33, 4, 64
    rows = (rng.standard_normal((tokens, heads, dim)) * np.exp(rng.uniform(-3, 6))).astype(
        np.float32)
    # A power of two: exactly x / scale. Any other scale: x * float32(1 / scale).
    for scale in (0.5, 4.0, float(rng.uniform(0.01, 10))):
        codes = quantize_fp8(rows, name, scale)
        np.testing.assert_array_equal(codes, oracle(rows, name, scale))
        np.testing.assert_array_equal(dequantize_fp8(codes, name, scale),
                                      code_values(name)[codes] * np.float32(scale))
    np.testing.assert_array_equal(quantize_fp8(rows, name, 4.0), oracle(rows / 4, name))
    # Per-head scales around each head's own range (factors 0.5-2: a little saturation at most),
    # so that most values are neither saturated nor below the subnormals.
    per_head = (np.abs(rows).max(axis=(0, 2)) / FP8_FORMATS[name].max_finite
                * rng.uniform(0.5, 2, heads)).astype(np.float32)
    codes = quantize_fp8(rows, name, per_head[:, None])
    assert codes.shape == rows.shape and codes.dtype == np.uint8
    for h in range(heads):
        np.testing.assert_array_equal(codes[:, h], quantize_fp8(rows[:, h], name, per_head[h]))
    back = dequantize_fp8(codes, name, per_head[:, None])
    assert back.dtype == np.float32
    # Round trip: within half a step (2^-4 relative) where nothing saturates or underflows.
    limit = FP8_FORMATS[name].max_finite * per_head[:, None]
    tiny = 2.0 ** (1 - FP8_FORMATS[name].exponent_bias) * per_head[:, None]
    inside = (np.abs(rows) < limit) & (np.abs(rows) >= tiny)
    assert inside.mean() > 0.5
    assert (np.abs(back - rows)[inside] <= np.abs(rows)[inside] * 2.0**-4).all()


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf, 1e-40, [1.0, 0.0]])
def test_conversion_scale_checks(bad):
    with pytest.raises(ValueError, match="scale"):
        quantize_fp8(np.ones(2, np.float32), "fp8_e4m3", bad)
    with pytest.raises(ValueError, match="scale"):
        dequantize_fp8(np.ones(2, np.uint8), "fp8_e4m3fnuz", bad)


# --- names, scales, arch table ------------------------------------------------------------------

def test_formats_agree_with_ml_dtypes():
    for name, fmt in FP8_FORMATS.items():
        info = ml_dtypes.finfo(getattr(ml_dtypes, fmt.ml_dtypes_name))
        assert float(info.max) == fmt.max_finite
        assert 1 - int(info.minexp) == fmt.exponent_bias
        assert fmt.name == name
        assert code_values(name)[fmt.max_code] == fmt.max_finite
    assert [FP8_FORMATS[n].kernel_id for n in ("fp8_e4m3", "fp8_e4m3fnuz")] == [0, 1]


def test_check_kv_format():
    assert fp8.check_kv_format(None) is None
    for name, fmt in FP8_FORMATS.items():
        assert fp8.check_kv_format(name) is fmt
        assert fp8.check_kv_format(fmt) is fmt
    for bad in ("fp8", "float16", "FP8_E4M3", "e4m3fn", 1):
        with pytest.raises(ValueError, match="kv_format") as info:
            fp8.check_kv_format(bad)
        assert "fp8_e4m3'" in str(info.value) and "fp8_e4m3fnuz" in str(info.value)
    with pytest.raises(ValueError, match="fmt"):
        quantize_fp8(np.ones(2, np.float32), None)


def test_kv_scales(rng):
    np.testing.assert_array_equal(fp8.kv_scales(None, 3, "k_scale"), np.ones(3, np.float32))
    s = fp8.kv_scales(0.25, 3, "k_scale")
    assert s.dtype == np.float32 and s.tolist() == [0.25] * 3
    assert fp8.kv_scales(np.float64(2), 2, "k_scale").tolist() == [2.0, 2.0]
    per_head = rng.uniform(0.1, 3, 4)
    got = fp8.kv_scales(per_head, 4, "v_scale")
    np.testing.assert_array_equal(got, per_head.astype(np.float32))
    source = per_head.astype(np.float32)
    got = fp8.kv_scales(source, 4, "v_scale")
    source[0] = 99
    assert got[0] != 99  # a copy
    for bad, match in [(0.0, "positive"), (-1.0, "positive"), (np.nan, "positive"),
                       (np.inf, "positive"), (1e-40, "positive"), (1e39, "positive"),
                       ([1.0, -2.0, 1.0, 1.0], "positive"), (np.ones(3), "shape"),
                       (np.ones((4, 1)), "shape"), ("a", "number"), (True, "number")]:
        with pytest.raises(ValueError, match=match) as info:
            fp8.kv_scales(bad, 4, "v_scale")
        assert "v_scale" in str(info.value)


def test_default_kv_format():
    table = {"gfx942": "fp8_e4m3fnuz", "gfx940": "fp8_e4m3fnuz", "gfx941": "fp8_e4m3fnuz",
             "gfx942:sramecc+:xnack-": "fp8_e4m3fnuz", "gfx950": "fp8_e4m3",
             "gfx1200": "fp8_e4m3", "gfx1201": "fp8_e4m3", "sm_89": "fp8_e4m3",
             "sm_90": "fp8_e4m3", "sm_90a": "fp8_e4m3", "sm_100": "fp8_e4m3",
             "sm_120": "fp8_e4m3", "sm_80": None, "sm_86": None, "sm_75": None,
             "gfx90a": None, "gfx908": None, "gfx1100": None, "gfx1030": None, "": None}
    for arch, want in table.items():
        assert fp8.default_kv_format(arch) == want, arch


def test_exported():
    assert cupa.quantize_fp8 is quantize_fp8 and cupa.dequantize_fp8 is dequantize_fp8
    assert {"quantize_fp8", "dequantize_fp8"} <= set(cupa.__all__)


# --- the device functions, compiled for the host ------------------------------------------------

@pytest.fixture(scope="module")
def host_probe(tmp_path_factory):
    if fp8_probe.host_compiler() is None:
        if IN_CI:
            pytest.fail("no clang to build fp8.cuh for the host")
        pytest.skip("no clang to build fp8.cuh for the host")
    return fp8_probe.build_host_probe(str(tmp_path_factory.mktemp("fp8")))


@pytest.mark.parametrize("name", FORMATS)
def test_fp8_cuh_matches_host_and_ml_dtypes(host_probe, rng, name):
    kernel_id = FP8_FORMATS[name].kernel_id
    decoded = fp8_probe.host_run(host_probe, "decode", np.arange(256, dtype=np.uint8), kernel_id)
    np.testing.assert_array_equal(bits32(decoded), bits32(code_values(name)))
    x = np.concatenate([special_values(name), random_floats(rng, 1_000_000)])
    codes = fp8_probe.host_run(host_probe, "encode", x, kernel_id)
    np.testing.assert_array_equal(codes, quantize_fp8(x, name))
    np.testing.assert_array_equal(codes, oracle(x, name))


@pytest.mark.parametrize("arch", ["sm_89", "gfx942"])
def test_gpu_probe_compiles_offline(arch):
    from test_compile_offline import missing_compilers, require_compilers
    from cupa.gpu.offline import compile_offline
    require_compilers(missing_compilers())
    assert compile_offline(fp8_probe.Fp8ProbeVariant(), arch) > 0
