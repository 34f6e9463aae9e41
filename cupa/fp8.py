"""fp8 KV-cache formats: names, per-head scales, and exact host (numpy) / device (cupy) conversion.

Two 8-bit e4m3 formats (1 sign, 4 exponent, 3 mantissa bits) differ in bias and special codes:

| name            | hardware               | bias | max finite | NaN codes   | -0  | inf |
|-----------------|------------------------|------|------------|-------------|-----|-----|
| `fp8_e4m3`      | OCP e4m3fn: NVIDIA sm_89+, AMD gfx950 / gfx12 | 7 | 448 | 0x7f, 0xff | yes | no |
| `fp8_e4m3fnuz`  | AMD MI300 (gfx940-942) | 8    | 240        | 0x80 only   | no  | no  |

Scale convention (the same on the host, in `cupa/kernels/fp8.cuh` and in the cache write kernel):
a value x is stored as the code of x * (1 / scale), with 1 / scale rounded to float32 once and the
product rounded to float32 (so x / scale exactly when scale is a power of two), rounded to nearest
even, and saturated: every finite value beyond the largest code and ±inf give ±max. NaN stays NaN
(`fp8_e4m3`: 0x7f or 0xff with the input's sign; `fp8_e4m3fnuz`: 0x80). Values that round to zero
give 0x00 (and 0x80, i.e. -0, for negative ones in `fp8_e4m3`; `fp8_e4m3fnuz` has no -0).
Reading back is code value * scale. Apart from saturation (ml_dtypes gives NaN for overflow and
±inf in e4m3fn), codes equal ml_dtypes' float8_e4m3fn / float8_e4m3fnuz conversions bit for bit;
ml_dtypes is the tests' oracle only, never used here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .arrays import cupy_module, is_device_array, to_device, to_host


@dataclass(frozen=True)
class Fp8Format:
    name: str
    kernel_id: int        # what the kernels receive to select the format (i32 argument)
    exponent_bias: int
    max_finite: float
    ml_dtypes_name: str   # the matching ml_dtypes type, for tests and interchange

    @property
    def max_code(self) -> int:
        """Code of +max_finite (e4m3fn: 0x7e, as 0x7f is NaN; e4m3fnuz: 0x7f)."""
        return 0x7F if self.fnuz else 0x7E

    @property
    def fnuz(self) -> bool:
        return self.kernel_id == 1


FP8_FORMATS = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", 0, 7, 448.0, "float8_e4m3fn"),
    "fp8_e4m3fnuz": Fp8Format("fp8_e4m3fnuz", 1, 8, 240.0, "float8_e4m3fnuz"),
}

# Scales must be normal float32 numbers so that their float32 reciprocal is finite.
_SCALE_MIN = float(np.finfo(np.float32).tiny)


def check_kv_format(kv_format, name: str = "kv_format") -> Fp8Format | None:
    """The Fp8Format of a kv_format name, or None for None (the cache holds the query dtype).
    Errors name the argument as `name`."""
    if kv_format is None:
        return None
    if isinstance(kv_format, Fp8Format):
        return kv_format
    if isinstance(kv_format, str) and kv_format in FP8_FORMATS:
        return FP8_FORMATS[kv_format]
    raise ValueError(f"{name}: must be None or one of {', '.join(map(repr, FP8_FORMATS))}, "
                     f"got {kv_format!r}")


def default_kv_format(arch: str) -> str | None:
    """The fp8 format with fast hardware conversion on `arch` ('sm_90', 'gfx942', ...), or None.

    'fp8_e4m3fnuz' on MI300 (gfx940/941/942); 'fp8_e4m3' on NVIDIA sm_89+ (Ada, Hopper,
    Blackwell), MI350 (gfx950) and RDNA4 (gfx12xx); None elsewhere. None is only advice: fp8
    caches work on every target, as cupa converts in software (bit arithmetic), which costs
    some speed where the hardware has no fp8 conversions.
    """
    arch = str(arch).split(":")[0].strip().lower()
    if arch in ("gfx940", "gfx941", "gfx942"):
        return "fp8_e4m3fnuz"
    if arch == "gfx950" or re.fullmatch(r"gfx12[0-9a-f]{2}", arch):
        return "fp8_e4m3"
    sm = re.fullmatch(r"sm_(\d+)[a-z]?", arch)
    if sm and int(sm.group(1)) >= 89:
        return "fp8_e4m3"
    return None


def _check_scale_values(values: np.ndarray, name: str):
    bad = ~(np.isfinite(values) & (values >= _SCALE_MIN))
    if bad.any():
        raise ValueError(f"{name}: scales must be positive and finite (normal float32, >= "
                         f"{_SCALE_MIN:.3g}), got {values[bad].flat[0]!r}")


def kv_scales(scale, num_kv_heads: int, name: str) -> np.ndarray:
    """Per-KV-head scales as a float32 numpy array [num_kv_heads].

    scale: None (all ones), one number for every head, or an array of shape [num_kv_heads]
    (numpy, or cupy: copied to the host, which synchronises with the device). Every scale must
    be positive and finite; errors are ValueErrors naming `name`.
    """
    if scale is None:
        return np.ones(num_kv_heads, np.float32)
    if isinstance(scale, bool):
        raise ValueError(f"{name}: must be a number or a float32 array, got {scale!r}")
    if is_device_array(scale):
        scale = to_host(scale)  # a device-to-host copy: synchronises
    try:
        with np.errstate(over="ignore"):  # too large for float32: inf, refused below
            values = np.asarray(scale, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: must be a number or a float32 array, got {scale!r}") from exc
    if values.ndim == 0:
        values = np.full(num_kv_heads, values, np.float32)
    elif values.shape != (num_kv_heads,):
        raise ValueError(f"{name}: expected one scale or shape [num_kv_heads={num_kv_heads}], got "
                         f"shape {values.shape}")
    _check_scale_values(values, name)
    return values.copy()


# --- conversion --------------------------------------------------------------------------------

def _with_xp(x):
    """(array module, x as its array): cupy for device arrays (zero-copy), else numpy."""
    if is_device_array(x):
        return cupy_module(), to_device(x)
    return np, np.asarray(x)


def _sign_bits(x, xp):
    """The sign bit (0/1, uint32) of each element of a float array, read from its raw bits: a
    widening conversion may drop the sign of a NaN, ours must not."""
    unsigned = {2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize]
    return (x.view(unsigned) >> (8 * x.dtype.itemsize - 1)).astype(xp.uint32)


def _scale_array(scale, xp, reciprocal=False):
    """scale (or float32(1 / scale)) as a float32 array of xp's kind. Host scales are checked;
    device ones are not read back."""
    if xp is not np and is_device_array(scale):
        values = to_device(scale).astype(np.float32)
        return 1 / values if reciprocal else values
    try:
        with np.errstate(over="ignore"):  # too large for float32: inf, refused below
            values = np.asarray(scale, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"scale: must be a number or a float array, got {scale!r}") from exc
    _check_scale_values(values, "scale")
    return xp.asarray(np.float32(1) / values if reciprocal else values)


def _check_broadcast(values_shape, scale, name: str):
    """ValueError naming `scale` when it cannot broadcast against the values."""
    try:
        scale_shape = to_device(scale).shape if is_device_array(scale) else np.shape(scale)
    except ValueError:  # ragged: _scale_array names it
        return
    try:
        np.broadcast_shapes(tuple(values_shape), tuple(scale_shape))
    except ValueError:
        raise ValueError(f"scale: shape {tuple(scale_shape)} does not broadcast against {name} "
                         f"(shape {tuple(values_shape)}); per-head scales of rows [tokens, "
                         f"heads, head_size] are [heads, 1]") from None


def _encode(y, sign, fmt: Fp8Format, xp):
    """Codes of float32 y (NaN handled by the caller): round to nearest even, saturating."""
    a = y.view(xp.uint32).astype(xp.int64) & 0x7FFFFFFF
    e = (a >> 23) - 127 + fmt.exponent_bias        # exponent field the value would have in fp8
    m = (a & 0x7FFFFF) | 0x800000                   # significand with its leading 1
    # Code = m >> shift (+ base): normals have shift 20 and base (e - 1) * 8, as m >> 20 is 8
    # plus the 3 mantissa bits; subnormals count units of the smallest one, m >> (21 - e).
    # Shifts past 25 (and float32 zeros / subnormals) round to 0 anyway: m < 2^24 is < half.
    shift = xp.clip(21 - e, 20, 25)
    base = xp.maximum(e - 1, 0) << 3
    q = m >> shift
    rest = m & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    q = q + ((rest > half) | ((rest == half) & ((q & 1) == 1)))  # a carry moves into the exponent
    max_bits = int(np.float32(fmt.max_finite).view(np.uint32))
    mag = xp.where(a >= max_bits, fmt.max_code, base + q)   # |y| >= max (inf too): saturate
    code = (sign.astype(xp.int64) << 7) | mag
    if fmt.fnuz:
        code = xp.where(mag == 0, 0, code)  # no negative zero: 0x80 is NaN
    return code.astype(xp.uint8)


def quantize_fp8(x, fmt, scale=1.0):
    """fp8 codes (uint8, shape of x broadcast with scale) of x / scale; see the module docstring.

    x: float array (numpy or cupy; converted to float32 first); fmt: a kv_format name or
    Fp8Format; scale: a number or an array broadcastable against x (e.g. [num_kv_heads, 1] for
    rows [tokens, num_kv_heads, head_size]), positive and finite. cupy in -> cupy out, computed
    with cupy element-wise operations.
    """
    fmt = check_kv_format(fmt, "fmt")
    if fmt is None:
        raise ValueError("fmt: an fp8 format is required, got None")
    xp, x = _with_xp(x)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise ValueError(f"x: must be a float array, got {x.dtype}")
    _check_broadcast(x.shape, scale, "x")
    sign = _sign_bits(x, xp)
    inv = _scale_array(scale, xp, reciprocal=True)
    with np.errstate(all="ignore"):  # signalling NaNs and overflow to inf are expected here
        x32 = x.astype(np.float32)
        nan = xp.isnan(x32)
        # A NaN keeps its own sign (x * inv can return a canonical NaN on some hardware).
        y = xp.where(nan, x32, x32 * inv).astype(np.float32)
    sign = xp.broadcast_to(sign, y.shape)
    code = _encode(y, sign, fmt, xp)
    nan_code = xp.uint8(0x80) if fmt.fnuz else ((sign << 7) | 0x7F).astype(xp.uint8)
    return xp.where(xp.broadcast_to(nan, y.shape), nan_code, code).astype(xp.uint8)


def decode_table(fmt) -> np.ndarray:
    """float32 [256]: the exact value of every code (NaN codes: the NaN ml_dtypes gives)."""
    fmt = check_kv_format(fmt)
    codes = np.arange(256)
    e, m = (codes >> 3) & 0xF, codes & 7
    # Subnormal codes hold m units of 2^(1 - bias - 3); normal ones (1 + m / 8) * 2^(e - bias).
    value = np.where(e == 0, m * 2.0 ** (-2 - fmt.exponent_bias),
                     (1 + m / 8) * 2.0 ** (e - fmt.exponent_bias))
    value = np.where(codes & 0x80, -value, value).astype(np.float32)
    if fmt.fnuz:
        value[0x80] = np.uint32(0xFFC00000).view(np.float32)
    else:
        value[0x7F] = np.uint32(0x7FC00000).view(np.float32)
        value[0xFF] = np.uint32(0xFFC00000).view(np.float32)
    return value


def dequantize_fp8(codes, fmt, scale=1.0):
    """float32 values of fp8 codes times scale (exact before the multiplication); NaN codes give
    NaN. codes: uint8 array, numpy or cupy (cupy in -> cupy out); scale broadcasts as in
    quantize_fp8."""
    fmt = check_kv_format(fmt, "fmt")
    if fmt is None:
        raise ValueError("fmt: an fp8 format is required, got None")
    xp, codes = _with_xp(codes)
    if codes.dtype != np.uint8:
        raise ValueError(f"codes: must be a uint8 array, got {codes.dtype}")
    _check_broadcast(codes.shape, scale, "codes")
    values = xp.asarray(decode_table(fmt))[codes]
    if isinstance(scale, (int, float)) and scale == 1:
        return values
    return (values * _scale_array(scale, xp)).astype(np.float32)
