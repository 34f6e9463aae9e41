"""Compiling every kernel variant offline, for targets with no GPU present (CI, `cupa compile`).

The same source and the same defines as at run time: NVRTC through cupy's bindings for sm_XX, and
clang (-x hip --cuda-device-only) for gfxXXXX, which runs the whole AMDGPU back end down to ISA.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from ..arrays import cupy_module
from . import catalogue
from .device import Target

DEFAULT_TARGETS = ("sm_80", "sm_90", "gfx90a", "gfx942", "gfx1100", "gfx1201")


class CompilerMissing(RuntimeError):
    pass


def hip_compiler() -> str | None:
    """The clang able to compile HIP device code: $CUPA_HIP_CLANG, clang-19, then clang."""
    for candidate in (os.environ.get("CUPA_HIP_CLANG"), "clang-19", "clang"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def hip_include_dir() -> str | None:
    """Directory holding hip/hip_runtime.h (Debian's libamdhip64-dev, or a ROCm install)."""
    for root in (os.environ.get("CUPA_HIP_INCLUDE"), "/usr/include", "/opt/rocm/include"):
        if root and os.path.exists(os.path.join(root, "hip", "hip_runtime.h")):
            return root
    return None


def _compile_nvrtc(source: str, name: str, target: Target) -> int:
    cupy = cupy_module()
    if cupy is None:
        raise CompilerMissing("cupy is not installed (needed for NVRTC)")
    from cupy.cuda import nvrtc
    try:
        program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    except Exception as exc:  # libnvrtc missing
        raise CompilerMissing(f"NVRTC unavailable: {exc}") from exc
    options = list(target.defines()) + ["--std=c++17", f"--gpu-architecture={target.arch}"]
    try:
        nvrtc.compileProgram(program, options)
    except nvrtc.NVRTCError as exc:
        log = nvrtc.getProgramLog(program)
        raise RuntimeError(f"NVRTC failed for {name} on {target.arch}:\n{log}") from exc
    size = len(nvrtc.getCUBIN(program))
    nvrtc.destroyProgram(program)
    return size


def _clang_resource_dir(clang: str) -> str:
    result = subprocess.run([clang, "-print-resource-dir"], capture_output=True, text=True)
    return result.stdout.strip()


def _compile_clang_hip(source: str, name: str, target: Target) -> int:
    clang = hip_compiler()
    include = hip_include_dir()
    if clang is None:
        raise CompilerMissing("no clang found for HIP (apt-get install clang-19)")
    if include is None:
        raise CompilerMissing("hip/hip_runtime.h not found (apt-get install libamdhip64-dev)")
    with tempfile.TemporaryDirectory(prefix="cupa-hip-") as tmp:
        src = os.path.join(tmp, f"{name}.hip")
        asm = os.path.join(tmp, f"{name}.s")
        with open(src, "w") as f:
            f.write(source)
        # hipRTC provides the HIP device API implicitly; offline we include the packaged HIP
        # headers instead. Debian's include clang's CUDA wrappers as <include/cuda_wrappers/...>,
        # hence the resource directory on the system include path. -S runs the whole AMDGPU back
        # end (register allocation, ISA) without needing device libraries to link.
        cmd = [clang, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc",
               "-isystem", _clang_resource_dir(clang),
               *([] if include == "/usr/include" else ["-isystem", include]),
               "-include", "hip/hip_runtime.h", "-D__HIP_PLATFORM_AMD__=1",
               f"--offload-arch={target.arch}", "-std=c++17", "-O3", "-S",
               *target.defines(), src, "-o", asm]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"clang failed for {name} on {target.arch}:\n{result.stderr}")
        return os.path.getsize(asm)


def compile_offline(variant_group, arch: str) -> int:
    """Compile one variant, or a list of variants of one source file as one translation unit,
    for `arch` without a GPU; returns the size of what was produced. Batching is how CI checks
    every variant quickly: each compiler start parses the headers (HIP's are large) once per
    batch instead of once per variant, and the kernels compiled are the same."""
    group = variant_group if isinstance(variant_group, (list, tuple)) else [variant_group]
    target = Target(arch)
    source = catalogue.batch_source(group)
    name = group[0].entry_names[0] + (f"_and_{len(group) - 1}_more" if len(group) > 1 else "")
    if target.is_hip:
        return _compile_clang_hip(source, name, target)
    return _compile_nvrtc(source, name, target)
