// Portable shims shared by every cupa kernel.
//
// One source must compile under NVRTC (CUDA), hipRTC (ROCm) and offline clang -x hip, none of
// which may rely on standard headers here: hipRTC ships none, and NVRTC's differ between CUDA
// versions. So: our own integer typedefs, 16-bit floats kept as raw bits, and every intrinsic that
// differs between the two vendors wrapped once, below.
//
// The host injects:
//   CUPA_WARP     threads per warp/wavefront (32 on NVIDIA and RDNA, 64 on CDNA). warpSize is
//                 not a compile-time constant on ROCm 7, so we never use it.
//   CUPA_HIP      1 when compiling for AMD, 0 for NVIDIA.
//   CUPA_THREADS  threads per workgroup of the decode kernels: 128, or 256 in the tensor-core
//                 kernels' wide forms (defined at the top of a variant's module source).
//   CUPA_EMULATE_AMD, CUPA_EMULATE_GFX  (optional) the emulated AMD build: see amd_emulation.cuh.
//   CUPA_CPU      (optional, tests only) a build for the host CPU by its C++ compiler, whose
//                 threads run as coroutines (tests/helpers/cuda_on_cpu.py, which supplies the
//                 CUDA names this needs and the barriers of amd_emulation.cuh). Arithmetic takes
//                 the HIP branches below (host C++ has _Float16 and the bit casts); the warp
//                 operations the NVIDIA or emulated ones.
#pragma once

#ifndef CUPA_WARP
#error "CUPA_WARP must be defined by the host (32 on NVIDIA and RDNA, 64 on CDNA)"
#endif
#ifndef CUPA_HIP
#error "CUPA_HIP must be defined by the host (1 for AMD targets, 0 for NVIDIA)"
#endif
#ifndef CUPA_THREADS
#error "CUPA_THREADS must be defined by the host"
#endif
#ifndef CUPA_CPU
#define CUPA_CPU 0
#endif
#if CUPA_CPU && CUPA_HIP
#error "CUPA_CPU builds the NVIDIA or emulated AMD source for the host: it needs CUPA_HIP=0"
#endif
// The emulated AMD build (tests only): an AMD target's wavefront and matrix instructions run on
// NVIDIA, all of it inside amd_emulation.cuh; the kernels below do not know.
#include "amd_emulation.cuh"
#if !CUPA_HIP && !CUPA_EMULATE_AMD && CUPA_WARP != 32
#error "NVIDIA warps are 32 threads: CUPA_WARP=64 on NVIDIA needs the emulated AMD build"
#endif

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef long long i64;
typedef unsigned long long u64;

#define CUPA_FN __device__ inline __attribute__((always_inline))

// Raw storage types. The kernels never do arithmetic in 16 bits: values are widened to float on
// load and narrowed on store, so these are plain bit containers that both compilers accept.
struct cupa_f16 { u16 bits; };
struct cupa_bf16 { u16 bits; };
// One fp8 e4m3 code (OCP e4m3fn or AMD e4m3fnuz: the two differ only in exponent bias and NaN
// codes, and the decode kernels read both the same way; see Elem<cupa_fp8>).
struct cupa_fp8 { u8 bits; };
// An OCP e4m3fn code for kernels that convert it with the hardware (NVIDIA sm_89+: one cvt per
// pair, exact values; the tensor-core kernels only).
struct cupa_fp8_e4m3 { u8 bits; };
// An fp8 code in the format an AMD target's v_cvt_pk_f32_fp8 reads (e4m3fnuz on gfx94x, OCP
// e4m3 on gfx12), converted by that instruction (exact values; the matrix-core kernel only).
struct cupa_fp8_amd { u8 bits; };

// 16 bytes, the widest load a thread issues on both vendors; and 8.
struct alignas(16) cupa_u32x4 { u32 x, y, z, w; };
struct alignas(8) cupa_u32x2 { u32 x, y; };

CUPA_FN float bits_to_float(u32 u) {
#if CUPA_HIP || CUPA_CPU
    return __builtin_bit_cast(float, u);
#else
    return __uint_as_float(u);
#endif
}

CUPA_FN u32 float_to_bits(float f) {
#if CUPA_HIP || CUPA_CPU
    return __builtin_bit_cast(u32, f);
#else
    return __float_as_uint(f);
#endif
}

CUPA_FN float neg_inf() { return bits_to_float(0xff800000u); }

CUPA_FN float half_bits_to_float(u16 h) {
#if CUPA_HIP || CUPA_CPU
    return (float)__builtin_bit_cast(_Float16, h);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

CUPA_FN u16 float_to_half_bits(float f) {
#if CUPA_HIP || CUPA_CPU
    return __builtin_bit_cast(u16, (_Float16)f);
#else
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

CUPA_FN float bf16_bits_to_float(u32 b) { return bits_to_float(b << 16); }

// Round to nearest even; NaN stays a (quiet) NaN instead of rounding into infinity.
CUPA_FN u16 float_to_bf16_bits(float f) {
    u32 u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// 2^x and log2(x) in hardware: the kernels keep logits in the log2 domain (pre-multiplied by
// log2(e)) so the softmax needs one native instruction per element.
CUPA_FN float fast_exp2(float x) {
#if CUPA_HIP || CUPA_CPU
    return __builtin_exp2f(x);
#else
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

CUPA_FN float fast_log2(float x) {
#if CUPA_HIP || CUPA_CPU
    return __builtin_log2f(x);
#else
    float y;
    asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#endif
}

// a / b where a couple of ulp are fine (the soft-cap's tanh): NVIDIA's approximate division
// instead of the IEEE one's slow-path check.
CUPA_FN float fast_div(float a, float b) {
#if CUPA_HIP || CUPA_CPU
    return a / b;
#else
    return __fdividef(a, b);
#endif
}

CUPA_FN float warp_xor(float v, int lane_mask) {
#if CUPA_HIP
    return __shfl_xor(v, lane_mask, CUPA_WARP);
#elif CUPA_EMULATE_AMD
    return emu_wave_xor(v, lane_mask);
#else
    return __shfl_xor_sync(0xffffffffu, v, lane_mask, CUPA_WARP);
#endif
}

// Whether the predicate holds in some lane of the warp (wavefront): a uniform branch.
CUPA_FN bool warp_any(bool predicate) {
#if CUPA_HIP
    return __any(predicate);
#elif CUPA_EMULATE_AMD
    return emu_wave_any(predicate);
#else
    return __any_sync(0xffffffffu, predicate);
#endif
}

// The first call of every kernel that uses the warp helpers here, by every thread of the
// workgroup: the emulated AMD build sets up its wavefront barriers (a no-op everywhere else).
CUPA_FN void begin_workgroup() {
#if CUPA_EMULATE_AMD
    emu_begin_workgroup();
#endif
}

// Orders the shared-memory accesses of one warp's (wavefront's) lanes: what a lane wrote is
// seen by the others, and no lane's later write overtakes another lane's earlier read. The
// shuffles of warp_max / warp_sum make the lanes meet but are no memory barrier, which
// compute-sanitizer's racecheck reports as a hazard (and the CUDA memory model agrees).
CUPA_FN void warp_barrier() {
#if CUPA_HIP
    __builtin_amdgcn_wave_barrier();  // a wavefront runs in lockstep: keep the compiler's order
#elif CUPA_EMULATE_AMD
    cupa_emu::wave_sync();
#else
    __syncwarp();
#endif
}

// A fence for AMD's instruction scheduler: nothing it schedules crosses this point. Placed
// after loads meant to be in flight together, it keeps them there: the scheduler would
// otherwise sink each next to its first use, whenever that saves registers (on gfx942 the
// matrix kernel's K loads went one at a time, each waited for, docs/perf-log.md v54). No
// code of its own; nothing on NVIDIA or the CPU.
CUPA_FN void schedule_fence() {
#if CUPA_HIP
    __builtin_amdgcn_sched_barrier(0);
#endif
}

// No fmaxf: it is a library function on HIP, and logits are never NaN here.
CUPA_FN float max_f(float a, float b) { return a > b ? a : b; }

CUPA_FN float warp_max(float v) {
#pragma unroll
    for (int m = CUPA_WARP / 2; m > 0; m >>= 1) v = max_f(v, warp_xor(v, m));
    return v;
}

CUPA_FN float warp_sum(float v) {
#pragma unroll
    for (int m = CUPA_WARP / 2; m > 0; m >>= 1) v += warp_xor(v, m);
    return v;
}

// Element traits: how a storage type widens from a 16-byte vector and narrows back.
template <typename T> struct Elem;

template <> struct Elem<float> {
    static constexpr int VEC = 4;  // elements per 16 bytes
    CUPA_FN static void widen(const cupa_u32x4& r, float* f) {
        f[0] = bits_to_float(r.x); f[1] = bits_to_float(r.y);
        f[2] = bits_to_float(r.z); f[3] = bits_to_float(r.w);
    }
    CUPA_FN static cupa_u32x4 narrow(const float* f) {
        cupa_u32x4 r;
        r.x = float_to_bits(f[0]); r.y = float_to_bits(f[1]);
        r.z = float_to_bits(f[2]); r.w = float_to_bits(f[3]);
        return r;
    }
    CUPA_FN static float load(const float* p) { return *p; }
    CUPA_FN static void store(float* p, float v) { *p = v; }
};

template <> struct Elem<cupa_f16> {
    static constexpr int VEC = 8;
    CUPA_FN static void widen_word(u32 w, float* f) {
        f[0] = half_bits_to_float((u16)(w & 0xffffu));
        f[1] = half_bits_to_float((u16)(w >> 16));
    }
    CUPA_FN static void widen(const cupa_u32x4& r, float* f) {
        widen_word(r.x, f); widen_word(r.y, f + 2); widen_word(r.z, f + 4); widen_word(r.w, f + 6);
    }
    CUPA_FN static u32 narrow_word(float a, float b) {
        return (u32)float_to_half_bits(a) | ((u32)float_to_half_bits(b) << 16);
    }
    CUPA_FN static cupa_u32x4 narrow(const float* f) {
        cupa_u32x4 r;
        r.x = narrow_word(f[0], f[1]); r.y = narrow_word(f[2], f[3]);
        r.z = narrow_word(f[4], f[5]); r.w = narrow_word(f[6], f[7]);
        return r;
    }
    CUPA_FN static float load(const cupa_f16* p) { return half_bits_to_float(p->bits); }
    CUPA_FN static void store(cupa_f16* p, float v) { p->bits = float_to_half_bits(v); }
};

template <> struct Elem<cupa_bf16> {
    static constexpr int VEC = 8;
    CUPA_FN static void widen_word(u32 w, float* f) {
        f[0] = bits_to_float(w << 16);
        f[1] = bits_to_float(w & 0xffff0000u);
    }
    CUPA_FN static void widen(const cupa_u32x4& r, float* f) {
        widen_word(r.x, f); widen_word(r.y, f + 2); widen_word(r.z, f + 4); widen_word(r.w, f + 6);
    }
    CUPA_FN static u32 narrow_word(float a, float b) {
        return (u32)float_to_bf16_bits(a) | ((u32)float_to_bf16_bits(b) << 16);
    }
    CUPA_FN static cupa_u32x4 narrow(const float* f) {
        cupa_u32x4 r;
        r.x = narrow_word(f[0], f[1]); r.y = narrow_word(f[2], f[3]);
        r.z = narrow_word(f[4], f[5]); r.w = narrow_word(f[6], f[7]);
        return r;
    }
    CUPA_FN static float load(const cupa_bf16* p) { return bf16_bits_to_float(p->bits); }
    CUPA_FN static void store(cupa_bf16* p, float v) { p->bits = float_to_bf16_bits(v); }
};

// fp8 cache codes, read-only. A code's sign, 4 exponent and 3 mantissa bits moved into the
// matching fields of a float16 ((c & 0x7f) << 7 | (c & 0x80) << 8) give exactly the code's value
// times 2^(bias - 15) for every finite code of either format, subnormals included (a zero
// exponent field is subnormal in both). So decoding is two integer ops and the float16 widen;
// the host folds 2^(15 - bias) into the per-head scales. NaN codes come out finite: only a
// NaN-producing quantisation (a NaN input) writes them.
template <> struct Elem<cupa_fp8> {
    static constexpr int VEC = 16;
    CUPA_FN static u32 half_bits(u32 code) { return ((code & 0x7fu) << 7) | ((code & 0x80u) << 8); }
    CUPA_FN static void widen_word(u32 w, float* f) {
#pragma unroll
        for (int i = 0; i < 4; ++i) f[i] = half_bits_to_float((u16)half_bits((w >> (8 * i)) & 0xffu));
    }
    CUPA_FN static void widen(const cupa_u32x4& r, float* f) {
        widen_word(r.x, f); widen_word(r.y, f + 4); widen_word(r.z, f + 8); widen_word(r.w, f + 12);
    }
};

template <typename T>
CUPA_FN cupa_u32x4 load16(const T* p) {
    return *reinterpret_cast<const cupa_u32x4*>(p);
}

template <typename T>
CUPA_FN void store16(T* p, const cupa_u32x4& v) {
    *reinterpret_cast<cupa_u32x4*>(p) = v;
}
