"""Probe kernels for cupa/kernels/amd_emulation.cuh, and how to compile them.

One module per AMD target: each of the target's amd_* matrix wrappers in a kernel that loads
per-lane registers, applies the instruction `reps` times (D fed back as C, so consecutive calls
share the scratch) and stores D; in emulated builds also the wavefront shuffles. The same
source compiles emulated (NVRTC, sm_90; run by tests/gpu/test_gpu_amd_emulation.py), and real
(clang -x hip for the gfx target; tests/unit/test_amd_layouts.py checks it emits the instruction).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import tempfile

HEADER = pathlib.Path(__file__).resolve().parents[2] / "cupa" / "kernels" / "amd_emulation.cuh"
THREADS = 128  # CUPA_THREADS of the decode kernels

# gfx target -> (CUPA_WARP, CUPA_EMULATE_GFX, table family)
TARGETS = {
    "gfx90a": (64, "0x90a", "cdna2"),
    "gfx942": (64, "0x942", "cdna3"),
    "gfx1100": (32, "0x1100", "rdna3"),
    "gfx1201": (32, "0x1201", "rdna4"),
}

# wrapper -> (layout struct in the header, {gfx target: calculator table it follows}).
WRAPPERS = {
    "amd_mfma_f32_16x16x16_f16": ("AmdLayoutMfma16x16x16", {
        "gfx90a": "cdna2_v_mfma_f32_16x16x16f16", "gfx942": "cdna3_v_mfma_f32_16x16x16_f16"}),
    "amd_mfma_f32_16x16x16_bf16": ("AmdLayoutMfma16x16x16", {
        "gfx90a": "cdna2_v_mfma_f32_16x16x16bf16_1k",
        "gfx942": "cdna3_v_mfma_f32_16x16x16_bf16"}),
    "amd_mfma_f32_4x4x4_f16": ("AmdLayoutMfma4x4x4", {
        "gfx90a": "cdna2_v_mfma_f32_4x4x4f16", "gfx942": "cdna3_v_mfma_f32_4x4x4_16b_f16"}),
    "amd_mfma_f32_4x4x4_bf16": ("AmdLayoutMfma4x4x4", {
        "gfx90a": "cdna2_v_mfma_f32_4x4x4bf16_1k", "gfx942": "cdna3_v_mfma_f32_4x4x4_16b_bf16"}),
    "amd_mfma_f32_16x16x32_fp8_fp8": ("AmdLayoutMfma16x16x32Fp8", {
        "gfx942": "cdna3_v_mfma_f32_16x16x32_fp8_fp8"}),
    "amd_wmma_gfx11_f32_16x16x16_f16": ("AmdLayoutWmmaGfx11", {
        "gfx1100": "rdna3_v_wmma_f32_16x16x16_f16"}),
    "amd_wmma_gfx11_f32_16x16x16_bf16": ("AmdLayoutWmmaGfx11", {
        "gfx1100": "rdna3_v_wmma_f32_16x16x16_bf16"}),
    "amd_wmma_gfx12_f32_16x16x16_f16": ("AmdLayoutWmmaGfx12", {
        "gfx1201": "rdna4_v_wmma_f32_16x16x16_f16"}),
    "amd_wmma_gfx12_f32_16x16x16_bf16": ("AmdLayoutWmmaGfx12", {
        "gfx1201": "rdna4_v_wmma_f32_16x16x16_bf16"}),
    "amd_wmma_gfx12_f32_16x16x16_fp8_fp8": ("AmdLayoutWmmaGfx12Fp8", {
        "gfx1201": "rdna4_v_wmma_f32_16x16x16_fp8_fp8"}),
}


def wrappers_of(gfx: str) -> dict[str, str]:
    """{wrapper: table name} of the instructions target `gfx` has."""
    return {w: tables[gfx] for w, (_layout, tables) in WRAPPERS.items() if gfx in tables}


def layout_of_table() -> dict[str, str]:
    """{table name: header layout struct}."""
    return {t: layout for layout, tables in WRAPPERS.values() for t in tables.values()}


def _mma_kernel(wrapper: str, ab_regs: int, d_regs: int) -> str:
    return f"""
extern "C" __global__ void __launch_bounds__(CUPA_THREADS) probe_{wrapper}(
        const unsigned int* a, const unsigned int* b, const float* c, float* d, int reps) {{
#if CUPA_EMULATE_AMD
    emu_begin_workgroup();
#endif
    const int t = blockIdx.x * CUPA_THREADS + threadIdx.x;
    amd_u32x{ab_regs} av, bv;
    amd_f32x{d_regs} cv;
    for (int r = 0; r < {ab_regs}; ++r) {{
        av.r[r] = a[t * {ab_regs} + r];
        bv.r[r] = b[t * {ab_regs} + r];
    }}
    for (int r = 0; r < {d_regs}; ++r) cv.r[r] = c[t * {d_regs} + r];
    for (int i = 0; i < reps; ++i) cv = {wrapper}(av, bv, cv);
    for (int r = 0; r < {d_regs}; ++r) d[t * {d_regs} + r] = cv.r[r];
}}
"""


WAVE_OPS_KERNEL = """
// x: one value per thread; masks: n_masks wave-uniform xor masks; src: a source lane per thread.
// Outputs per thread t: xor_out[m * total + t], and the results of the chained xors, the index
// shuffle, the ballot of x > 0, and the butterfly sum and max.
extern "C" __global__ void __launch_bounds__(CUPA_THREADS) probe_wave_ops(
        const float* x, const int* masks, int n_masks, const int* src, float* xor_out,
        float* chain_out, float* shfl_out, unsigned long long* ballot_out, float* sum_out,
        float* max_out) {
    emu_begin_workgroup();
    const int total = gridDim.x * CUPA_THREADS;
    const int t = blockIdx.x * CUPA_THREADS + threadIdx.x;
    const float v = x[t];
    float chained = v;
    for (int m = 0; m < n_masks; ++m) {
        xor_out[m * total + t] = emu_wave_xor(v, masks[m]);
        chained = emu_wave_xor(chained, masks[m]);
    }
    chain_out[t] = chained;
    shfl_out[t] = emu_wave_shfl(v, src[t]);
    ballot_out[t] = emu_wave_ballot(v > 0.0f);
    sum_out[t] = emu_wave_sum(v);
    max_out[t] = emu_wave_max(v);
}
"""


def source(gfx: str, wave_ops: bool = True) -> str:
    """The probe module for `gfx`: the header, then its kernels."""
    from amd_layouts import load
    parts = [HEADER.read_text().replace("#pragma once", "")]
    for wrapper, table in wrappers_of(gfx).items():
        layout = load(table)
        parts.append(_mma_kernel(wrapper, layout.regs["A"], layout.regs["D"]))
    if wave_ops:
        parts.append(WAVE_OPS_KERNEL)
    return "\n".join(parts)


def emulated_options(gfx: str) -> list[str]:
    warp, code, _family = TARGETS[gfx]
    return ["-DCUPA_EMULATE_AMD=1", "-DCUPA_HIP=0", f"-DCUPA_WARP={warp}",
            f"-DCUPA_THREADS={THREADS}", f"-DCUPA_EMULATE_GFX={code}", "--std=c++17"]


def nvrtc_missing() -> str | None:
    """Why NVRTC cannot run here, or None."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as exc:
        return f"NVRTC unavailable ({exc})"
    return None


def nvrtc_compile(src: str, options: list[str], arch: str = "sm_90") -> str:
    """PTX of `src`; raises RuntimeError with NVRTC's log on failure."""
    from cupy.cuda import nvrtc
    program = nvrtc.createProgram(src, "amd_emulation_probe.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(program, options + [f"--gpu-architecture={arch}"])
        except nvrtc.NVRTCError as exc:
            raise RuntimeError(nvrtc.getProgramLog(program)) from exc
        ptx = nvrtc.getPTX(program)
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(program)


def hip_clang() -> tuple[str, str] | None:
    """(clang, include root with hip/hip_runtime.h) for offline HIP compiles, or None."""
    clang = next((shutil.which(c) for c in (os.environ.get("CUPA_HIP_CLANG"), "clang-19",
                                            "clang") if c and shutil.which(c)), None)
    roots = (os.environ.get("CUPA_HIP_INCLUDE"), "/usr/include", "/opt/rocm/include")
    root = next((r for r in roots
                 if r and os.path.exists(os.path.join(r, "hip", "hip_runtime.h"))), None)
    return (clang, root) if clang and root else None


def hip_compile(src: str, gfx: str) -> str:
    """AMDGPU assembly of `src` compiled for real `gfx` (CUPA_HIP=1, no emulation), the way
    cupa's offline check compiles kernels (device only, no device libraries)."""
    clang, root = hip_clang()
    warp = TARGETS[gfx][0]
    resource = subprocess.run([clang, "-print-resource-dir"], capture_output=True,
                              text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="cupa-emu-") as tmp:
        path, asm = os.path.join(tmp, "probe.hip"), os.path.join(tmp, "probe.s")
        with open(path, "w") as f:
            f.write(src)
        cmd = [clang, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc",
               "-isystem", resource, *([] if root == "/usr/include" else ["-isystem", root]),
               "-include", "hip/hip_runtime.h", "-D__HIP_PLATFORM_AMD__=1",
               f"--offload-arch={gfx}", "-std=c++17", "-O3", "-S",
               f"-DCUPA_WARP={warp}", "-DCUPA_HIP=1", f"-DCUPA_THREADS={THREADS}",
               path, "-o", asm]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(result.stderr)
        return pathlib.Path(asm).read_text()
