// fp8 e4m3 codes <-> float, in software: integer bit arithmetic, so every target (NVIDIA, CDNA,
// RDNA, with or without fp8 hardware) gives the same codes as the host (cupa/fp8.py), NaN and
// saturation included. The cache write that uses it is memory-bound, so a hardware conversion
// (cvt.rn.satfinite.e4m3x2.f32 on sm_89+) would not make it faster.
//
// Formats, by the kernel_id the host passes (cupa.fp8.FP8_FORMATS):
//   0  fp8_e4m3      OCP e4m3fn: bias 7, max 448 = code 0x7e, NaN 0x7f / 0xff, has -0
//   1  fp8_e4m3fnuz  AMD MI300:  bias 8, max 240 = code 0x7f, NaN 0x80 only, no -0
// Neither has infinities. Only bits_to_float / float_to_bits and the integer typedefs are taken
// from common.cuh.
#pragma once
#include "common.cuh"

#define CUPA_FP8_E4M3 0
#define CUPA_FP8_E4M3FNUZ 1

CUPA_FN bool fp8_float_is_nan(float x) { return (float_to_bits(x) & 0x7fffffffu) > 0x7f800000u; }

// The NaN code of a NaN of sign `sign` (0 or 1): e4m3fn keeps the sign, e4m3fnuz has one NaN.
CUPA_FN u8 fp8_nan_code(u32 sign, int kernel_id) {
    return kernel_id == CUPA_FP8_E4M3FNUZ ? (u8)0x80u : (u8)((sign << 7) | 0x7fu);
}

// The code of x (already divided by the scale): round to nearest even; |x| >= max, infinities
// included, gives +-max; NaN gives the NaN code of its sign; values that round to 0 give +0
// (and -0 in e4m3fn for negative x).
CUPA_FN u8 fp8_encode(float x, int kernel_id) {
    const bool fnuz = kernel_id == CUPA_FP8_E4M3FNUZ;
    const u32 u = float_to_bits(x);
    const u32 sign = u >> 31;
    const u32 a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return fp8_nan_code(sign, kernel_id);
    u32 mag;
    if (a >= (fnuz ? 0x43700000u : 0x43e00000u)) {  // float bits of 240 / 448
        mag = fnuz ? 0x7fu : 0x7eu;
    } else {
        const int e = (int)(a >> 23) - 127 + (fnuz ? 8 : 7);  // the value's fp8 exponent field
        const u32 m = (a & 0x7fffffu) | 0x800000u;            // significand with its leading 1
        // code = base + (m >> shift), rounded: normals have shift 20 and base (e - 1) * 8, since
        // m >> 20 is 8 plus the 3 mantissa bits; subnormals (e <= 0) count units of the smallest
        // subnormal, m >> (21 - e). Shifts of 25 and more (float32 zeros and subnormals too)
        // leave 0: m < 2^24 is below half a unit.
        int shift = 21 - e;
        shift = shift < 20 ? 20 : (shift > 25 ? 25 : shift);
        const u32 base = e > 1 ? (u32)(e - 1) << 3 : 0u;
        u32 q = m >> shift;
        const u32 rest = m & ((1u << shift) - 1u);
        const u32 half = 1u << (shift - 1);
        if (rest > half || (rest == half && (q & 1u))) q += 1u;  // a carry moves into the exponent
        mag = base + q;  // <= max: every |x| < max rounds to at most max
    }
    if (fnuz && mag == 0u) return 0;  // e4m3fnuz has no -0 (0x80 is its NaN)
    return (u8)((sign << 7) | mag);
}

// The exact value of a code; NaN codes give the NaN the host gives (sign kept in e4m3fn,
// negative in e4m3fnuz, as ml_dtypes).
CUPA_FN float fp8_decode(u8 code, int kernel_id) {
    const bool fnuz = kernel_id == CUPA_FP8_E4M3FNUZ;
    const u32 c = code;
    const u32 sign = (c & 0x80u) << 24;
    const u32 mag = c & 0x7fu;
    if (fnuz ? c == 0x80u : mag == 0x7fu) return bits_to_float(fnuz ? 0xffc00000u : sign | 0x7fc00000u);
    const u32 bias = fnuz ? 8u : 7u;
    const u32 e = mag >> 3, m = mag & 7u;
    if (e == 0u) {
        // m units of 2^(-bias - 2): a small integer times a power of two, exact in float32 and
        // normal (so no flush-to-zero mode touches it).
        const float unit = bits_to_float((127u - bias - 2u) << 23);
        return bits_to_float(sign | float_to_bits((float)m * unit));
    }
    return bits_to_float(sign | ((e - bias + 127u) << 23) | (m << 20));
}
