"""Compiling kernel variants offline, for targets with no GPU present (CI, `cupa compile`).

The same source and options as at run time (Target.runtime_options), plus what cupy and the
run-time compilers add on their own, so that what is checked here is what a GPU would build:

- sm_XX: NVRTC through cupy's bindings, with the options cupy's NVRTC path adds (-ftz=true,
  --device-as-default-execution-space).
- gfxXXXX: clang -x hip --cuda-device-only, down to a linked HSA code object: the option cupy's
  hipRTC path adds (-fcuda-flush-denormals-to-zero), the device libraries linked in (ocml, ockl
  and the oclc control libraries, as comgr links them for hipRTC) and ld.lld's --no-undefined,
  so a device-library function that does not exist fails here as it would on the GPU. The code
  object's metadata then must say the wavefront size the kernels were written for (CUPA_WARP),
  and with CUPA_CHECK_SPILLS=1 (CI) that no kernel spills past SPILLS_ALLOWED.

What still differs from a ROCm 7 node (no AMD GPU or ROCm install was available): the HIP
headers (by default Debian's HIP 5.2, included whole, where hipRTC uses ROCm 7's as its built-in
hiprtc_runtime.h with __HIPCC_RTC__; CUPA_HIPRTC_HEADERS makes and uses such a header from a HIP
+ clr source tree instead), the device libraries (Debian's ROCm 5.2 bitcode, with
oclc_isa_version files made here for the targets it predates) and the compiler (upstream clang,
not ROCm's LLVM behind comgr).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from .. import platform
from ..arrays import cupy_module
from . import catalogue
from .device import Target

NVIDIA_TARGETS = ("sm_80", "sm_90")
# CDNA2, CDNA3 (MI300), CDNA4 (MI350/MI355X), RDNA3, RDNA4.
HIP_TARGETS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201")
ALL_TARGETS = NVIDIA_TARGETS + HIP_TARGETS

# What cupy adds to every compile on its own (cupy/cuda/compiler.py: _compile_with_cache_cuda
# and _compile_using_nvrtc_no_warning for NVRTC; _compile_with_cache_hip for hipRTC, whose own
# defaults, -O3 and the target's default wavefront size, Target.runtime_options states again).
CUPY_NVRTC_OPTIONS = ("-ftz=true", "--device-as-default-execution-space")
CUPY_HIPRTC_OPTIONS = ("-fcuda-flush-denormals-to-zero",)
# Code object v5: ROCm's default, and the newest ABI Debian's (ROCm 5.2) device libraries
# implement (clang 22 would default to v6 and look for oclc_abi_version_600.bc).
CODE_OBJECT_VERSION = 5

# Where to look, in order. The first clang that knows a target compiles it (clang-19 does not
# know gfx950; clang-22 does).
CLANG_CANDIDATES = ("clang-19", "clang-20", "clang-21", "clang-22", "clang")
ROCM_ROOTS = ("/opt/rocm",)
DEVICE_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode",)
DEVICE_LIB_GLOBS = ("{rocm}/amdgcn/bitcode", "{rocm}/lib/llvm/lib/clang/*/lib/amdgcn/bitcode",
                    "{rocm}/llvm/lib/clang/*/lib/amdgcn/bitcode")
INSTALL_HINT = ("apt-get install clang-19 lld-19 clang-22 lld-22 libamdhip64-dev "
                "rocm-device-libs")


class CompilerMissing(RuntimeError):
    pass


# The oldest NVIDIA target NVRTC 13 compiles; the AMD families cupa knows the wavefront of.
MIN_NVIDIA_SM = 75
_TARGET_NAME = re.compile(r"sm_(\d{2,3})a?|gfx(9|1[0-2])[0-9a-f]{2}")
NVRTC_HINT = "pip install 'cupa[nvrtc]' (cupy-cuda13x and nvidia-cuda-nvrtc)"


def check_targets(targets) -> list[str]:
    """The targets, checked before anything compiles: each names an NVIDIA arch from
    sm_{MIN_NVIDIA_SM} on or an AMD CDNA / RDNA processor. Raises ValueError naming the first
    that is neither."""
    if not targets:
        raise ValueError("--targets: no target named")
    for target in targets:
        match = _TARGET_NAME.fullmatch(target)
        if match is None:
            raise ValueError(f"--targets: {target!r} is no compile target; give sm_NN (NVIDIA, "
                             f"sm_{MIN_NVIDIA_SM} and newer) or gfxNNN (AMD, e.g. "
                             f"{', '.join(HIP_TARGETS)}), or 'all'")
        if match.group(1) is not None and int(match.group(1)) < MIN_NVIDIA_SM:
            raise ValueError(f"--targets: {target} is older than NVRTC compiles (sm_"
                             f"{MIN_NVIDIA_SM} and newer)")
    return list(targets)


def missing_compiler_hint(target: str) -> str:
    """What to install for `target`'s offline compiler (or where to compile it)."""
    if target.startswith("gfx"):
        return INSTALL_HINT
    if platform.is_rocm():  # cupy-rocm's nvrtc module is hipRTC: no NVRTC to install here
        return "nothing here: compile sm_XX targets where cupy is built for CUDA"
    return NVRTC_HINT


def targets_by_default() -> tuple[str, ...]:
    """The targets `cupa compile` checks without --targets: all of them, except NVIDIA's on a
    ROCm machine, whose cupy has hipRTC where NVRTC would be."""
    return HIP_TARGETS if platform.is_rocm() else ALL_TARGETS


def nvrtc_missing() -> str | None:
    """Why NVRTC cannot compile here, or None."""
    if platform.is_rocm():
        return "NVRTC: this cupy is the ROCm build (its nvrtc module is hipRTC)"
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as exc:
        return f"NVRTC ({exc}); pip install 'cupa[nvrtc]'"
    return None


# --- which variants: all, or a representative subset ------------------------------------------

FULL_COMPILE_ENV = "CUPA_FULL_COMPILE"  # =1: the test suite compiles every variant


def full_compile_requested() -> bool:
    return os.environ.get(FULL_COMPILE_ENV, "") not in ("", "0")


def _group_key(variant) -> tuple:
    """Variants that differ only in head size and row tile: one kernel family, query dtype and
    cache kind."""
    cache = getattr(variant, "cache", getattr(variant, "kv_format", None))
    return (type(variant).__name__, variant.dtype, cache)


def _representatives(group: list) -> list:
    """The fewest variants of one group that cover its smallest, median and largest head size
    and every row tile, starting from the heaviest (largest head size, then tile: the most
    registers, where a spill or an allocation limit shows first). Greedy, in catalogue order,
    so the choice is stable."""
    if not hasattr(group[0], "head_size"):
        return list(group)  # no compile-time shape (the cache write kernels): all of them
    heads = sorted({v.head_size for v in group})
    wanted = {("head", h) for h in (heads[0], heads[len(heads) // 2], heads[-1])}
    wanted |= {("tile", v.rows) for v in group}

    def covers(v):
        return {("head", v.head_size), ("tile", v.rows)} & wanted

    chosen = [max(group, key=lambda v: (v.head_size, v.rows))]
    missing = wanted - covers(chosen[0])
    while missing:
        best = max(group, key=lambda v: len(covers(v) & missing))
        chosen.append(best)
        missing -= covers(best)
    return chosen


def representative_variants(arch: str) -> list:
    """A subset of `arch`'s variants that every kind of compile problem should show in: every
    kernel family x query dtype x cache kind, each with its smallest, median and largest head
    size and every row tile at least once (see _representatives). About a fifth of the full
    set; `cupa compile` (CI's own step) builds them all."""
    groups: dict = {}
    for v in catalogue.all_variants(arch):
        groups.setdefault(_group_key(v), []).append(v)
    return [v for group in groups.values() for v in _representatives(group)]


def variant_batches(variants: list, size: int = 32) -> list[list]:
    """`variants` in batches of one source file, dtype and set of module defines (one compiler
    run each; catalogue.batch_source)."""
    groups: dict = {}
    for v in variants:
        key = (v.source_file, getattr(v, "dtype", ""), catalogue.module_defines(v))
        groups.setdefault(key, []).append(v)
    return [g[i:i + size] for g in groups.values() for i in range(0, len(g), size)]


# --- finding the HIP toolchain ------------------------------------------------------------------

def _rocm_roots() -> list[str]:
    roots = [os.environ.get("ROCM_PATH"), *ROCM_ROOTS]
    return [r for r in dict.fromkeys(roots) if r and os.path.isdir(r)]


def _clang_candidates() -> list[str]:
    """Existing clang executables, in preference order: $CUPA_HIP_CLANG, a ROCm install's,
    then Debian's versioned ones."""
    names = [os.environ.get("CUPA_HIP_CLANG")]
    names += [os.path.join(root, "llvm", "bin", "clang") for root in _rocm_roots()]
    names += list(CLANG_CANDIDATES)
    found = []
    for name in names:
        path = shutil.which(name) if name else None
        if path and path not in found:
            found.append(path)
    return found


@functools.lru_cache(maxsize=None)
def _supported_cpus(clang: str) -> frozenset:
    """The AMDGPU processors this clang knows."""
    result = subprocess.run([clang, "--target=amdgcn-amd-amdhsa", "-nogpulib",
                             "--print-supported-cpus"],
                            capture_output=True, text=True)
    return frozenset(re.findall(r"^\s*(gfx\w+)\s*$", result.stdout + result.stderr, re.M))


def hip_compiler(arch: str | None = None) -> str | None:
    """The clang that compiles HIP device code for `arch` (any gfx target when None): the first
    of $CUPA_HIP_CLANG, <ROCm>/llvm/bin/clang, clang-19 ... clang-22, clang that knows it."""
    for clang in _clang_candidates():
        cpus = _supported_cpus(clang)
        if (arch in cpus) if arch else bool(cpus):
            return clang
    return None


def _rocm_root_of(clang: str | None) -> str | None:
    """The ROCm install `clang` belongs to (its headers and device libraries go with it)."""
    if clang is None:
        return None
    real = os.path.realpath(clang)
    for root in _rocm_roots():
        if real.startswith(os.path.realpath(root) + os.sep):
            return root
    return None


def hip_include_dir(clang: str | None = None) -> str | None:
    """Directory holding hip/hip_runtime.h: $CUPA_HIP_INCLUDE, else that of the ROCm install
    `clang` comes from, else Debian's (libamdhip64-dev) or a ROCm install's."""
    own = _rocm_root_of(clang)
    roots = [os.environ.get("CUPA_HIP_INCLUDE"), own and os.path.join(own, "include"),
             "/usr/include", *(os.path.join(r, "include") for r in _rocm_roots())]
    for root in roots:
        if root and os.path.exists(os.path.join(root, "hip", "hip_runtime.h")):
            return root
    return None


def device_library_dir(clang: str | None = None) -> str | None:
    """Directory of the AMDGPU device libraries (ocml.bc, ockl.bc, oclc_*.bc):
    $CUPA_DEVICE_LIBS, else those of the ROCm install `clang` comes from, else Debian's
    (rocm-device-libs) or a ROCm install's."""
    own = _rocm_root_of(clang)
    roots = ([own] if own else []) + [r for r in _rocm_roots() if r != own]
    candidates = [os.environ.get("CUPA_DEVICE_LIBS")]
    if not own:
        candidates += list(DEVICE_LIB_DIRS)
    for root in roots:
        for pattern in DEVICE_LIB_GLOBS:
            candidates += sorted(glob.glob(pattern.format(rocm=root)), reverse=True)
    candidates += list(DEVICE_LIB_DIRS)
    for directory in candidates:
        if directory and os.path.exists(os.path.join(directory, "ocml.bc")):
            return directory
    return None


def _sibling_tool(clang: str, name: str) -> str | None:
    """An LLVM tool of the same release as `clang` (llvm-readelf next to it, or name-NN)."""
    real = os.path.realpath(clang)
    beside = os.path.join(os.path.dirname(real), name)
    if os.path.exists(beside):
        return beside
    major = _clang_major(clang)
    return shutil.which(f"{name}-{major}") or shutil.which(name)


@functools.lru_cache(maxsize=None)
def _clang_major(clang: str) -> int:
    result = subprocess.run([clang, "-dumpversion"], capture_output=True, text=True)
    return int(result.stdout.strip().split(".")[0] or 0)


@functools.lru_cache(maxsize=None)
def _clang_resource_dir(clang: str) -> str:
    result = subprocess.run([clang, "-print-resource-dir"], capture_output=True, text=True)
    return result.stdout.strip()


def isa_version(arch: str) -> int:
    """The __oclc_ISA_version a device library file states for `arch`: major * 1000 +
    minor * 100 + stepping, the last two characters being minor and stepping in hex
    (gfx90a -> 9010, gfx942 -> 9402, gfx1201 -> 12001)."""
    digits = arch[3:]
    return int(digits[:-2]) * 1000 + int(digits[-2], 16) * 100 + int(digits[-1], 16)


def _cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "cupa")


@functools.lru_cache(maxsize=None)
def _device_library_overlay(source_dir: str, clang: str) -> str:
    """A directory with every device library of `source_dir` plus oclc_isa_version files for
    the targets it lacks (Debian's ROCm 5.2 set predates gfx942, gfx950, gfx11 and gfx12). Such
    a file only defines one constant, the ISA version, which ockl/ocml read to pick code paths.

    Made once per (library directory, clang release: its bitcode is for that release and
    newer) under ~/.cache/cupa, atomically, as parallel compile workers may race to make it."""
    key = hashlib.sha1(f"{os.path.realpath(source_dir)} {_clang_major(clang)} "
                       f"{' '.join(HIP_TARGETS)}".encode()).hexdigest()[:12]
    overlay = os.path.join(_cache_root(), f"device-libs-{key}")
    if os.path.isdir(overlay):
        return overlay
    os.makedirs(_cache_root(), exist_ok=True)
    building = tempfile.mkdtemp(prefix="device-libs-", dir=_cache_root())
    for path in glob.glob(os.path.join(source_dir, "*.bc")):
        os.symlink(os.path.realpath(path), os.path.join(building, os.path.basename(path)))
    for arch in HIP_TARGETS:
        name = f"oclc_isa_version_{arch[3:]}.bc"
        if os.path.exists(os.path.join(building, name)):
            continue
        ir = os.path.join(building, name[:-3] + ".ll")
        with open(ir, "w") as f:
            f.write('target triple = "amdgcn-amd-amdhsa"\n'
                    f"@__oclc_ISA_version = linkonce_odr protected local_unnamed_addr "
                    f"addrspace(4) constant i32 {isa_version(arch)}, align 4\n")
        subprocess.run([clang, "--target=amdgcn-amd-amdhsa", "-nogpulib", "-c", "-emit-llvm",
                        "-x", "ir", ir, "-o", os.path.join(building, name)],
                       check=True, capture_output=True)
        os.remove(ir)
    try:
        os.rename(building, overlay)
    except OSError:  # another process made it first
        shutil.rmtree(building, ignore_errors=True)
    return overlay


@functools.lru_cache(maxsize=None)
def _defines_wavefront_macro(clang: str) -> bool:
    """Whether this clang still predefines __AMDGCN_WAVEFRONT_SIZE (removed in clang 20; the
    HIP 5.2 headers' warpSize reads it)."""
    result = subprocess.run([clang, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc",
                             "--offload-arch=gfx90a", "-dM", "-E", os.devnull],
                            capture_output=True, text=True)
    return "__AMDGCN_WAVEFRONT_SIZE" in result.stdout


@functools.lru_cache(maxsize=None)
def _links_hip_bitcode(clang: str, library_dir: str) -> bool:
    """Whether this clang links hip.bc itself (clang 19 does; later ones stopped, as ROCm 6
    headers no longer need it, but HIP 5.2's __syncthreads calls its
    __atomic_work_item_fence)."""
    result = subprocess.run([clang, "-x", "hip", "--cuda-device-only", "-nogpuinc",
                             f"--rocm-device-lib-path={library_dir}", "--offload-arch=gfx90a",
                             "-c", os.devnull, "-o", os.devnull, "-###"],
                            capture_output=True, text=True)
    return "hip.bc" in result.stderr


# --- hipRTC's built-in header, from a HIP source tree ------------------------------------------

# CUPA_HIPRTC_HEADERS=<dir>: an include root holding ROCm's HIP headers as hipRTC is built from
# them (ROCm/HIP's include/hip merged with ROCm/clr's hipamd/include/hip, and a hip_version.h).
# The offline compile then uses a hiprtc_runtime.h made from them the way clr's
# hipamd/src/hiprtc/CMakeLists.txt makes hipRTC's own (hip_runtime.h and hip_bfloat16.h
# preprocessed with __HIPCC_RTC__ through clang's HIP wrapper, the attribute macros, then the
# device-side headers appended whole), with -D__HIPCC_RTC__ -nogpuinc as hipRTC compiles.
RTC_HEADERS_ENV = "CUPA_HIPRTC_HEADERS"
RTC_APPENDED_HEADERS = (
    "hip_common.h", "amd_detail/device_library_decls.h", "amd_detail/hip_assert.h",
    "library_types.h", "driver_types.h", "surface_types.h", "amd_detail/amd_channel_descriptor.h",
    "texture_types.h", "amd_detail/ockl_image.h", "amd_detail/texture_fetch_functions.h",
    "amd_detail/texture_indirect_functions.h", "amd_detail/amd_surface_functions.h",
    "amd_detail/amd_hip_complex.h", "amd_detail/amd_hip_math_constants.h",
    "amd_detail/math_fwd.h", "amd_detail/amd_warp_functions.h",
    "amd_detail/amd_device_functions.h", "amd_detail/amd_warp_sync_functions.h",
    "amd_detail/hip_cooperative_groups_helper.h", "amd_detail/amd_hip_cooperative_groups.h",
    "amd_detail/amd_hip_unsafe_atomics.h", "amd_detail/amd_hip_atomic.h",
    "amd_detail/hip_fp16_math_fwd.h", "amd_detail/amd_hip_fp16.h",
    "amd_detail/amd_math_functions.h")
# What hipRTC defines between the preprocessed part and the appended headers: the CUDA-style
# attributes (no host_defines.h in RTC mode), launch bounds, include guards of the headers the
# preprocessed part already holds, and the two std types the appended headers use.
RTC_MACROS = """
#define __host__ __attribute__((host))
#define __device__ __attribute__((device))
#define __global__ __attribute__((global))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __align__(n) __attribute__((aligned(n)))
#if !defined(__has_feature) || !__has_feature(cuda_noinline_keyword)
#define __noinline__ __attribute__((noinline))
#endif
#define __forceinline__ inline __attribute__((always_inline))
#define __hip_img_chk__
#define __cupa_bounds1(threads) __attribute__((amdgpu_flat_work_group_size(1, threads)))
#define __cupa_bounds2(threads, blocks) \\
    __attribute__((amdgpu_flat_work_group_size(1, threads), amdgpu_waves_per_eu(blocks)))
#define __cupa_bounds_pick(_1, _2, chosen, ...) chosen
#define __launch_bounds__(...) \\
    __cupa_bounds_pick(__VA_ARGS__, __cupa_bounds2, __cupa_bounds1)(__VA_ARGS__)
#define HIP_INCLUDE_HIP_HIP_RUNTIME_H
#define _HIP_BFLOAT16_H_
#define HIP_INCLUDE_HIP_MATH_FUNCTIONS_H
#define HIP_INCLUDE_HIP_HIP_VECTOR_TYPES_H
typedef __PTRDIFF_TYPE__ ptrdiff_t;
typedef long clock_t;
namespace std { using ::ptrdiff_t; using ::clock_t; }
"""


def _hip_version(include_root: str) -> tuple[int, int]:
    path = os.path.join(include_root, "hip", "hip_version.h")
    try:
        text = open(path).read()
    except OSError:
        raise CompilerMissing(f"{RTC_HEADERS_ENV}: {path} missing (clr generates it when it is "
                              "built; write one defining HIP_VERSION_MAJOR/MINOR/PATCH)")
    found = dict(re.findall(r"#define\s+HIP_VERSION_(MAJOR|MINOR)\s+(\d+)", text))
    return int(found.get("MAJOR", 0)), int(found.get("MINOR", 0))


@functools.lru_cache(maxsize=None)
def hiprtc_header(include_root: str, clang: str) -> str:
    """hiprtc_runtime.h made from the HIP headers under `include_root` (see RTC_HEADERS_ENV),
    cached under ~/.cache/cupa by headers and clang release."""
    major, minor = _hip_version(include_root)
    listing = sorted(glob.glob(os.path.join(include_root, "hip", "**", "*.h*"), recursive=True))
    stamp = " ".join(f"{p}:{os.path.getmtime(p)}" for p in listing)
    key = hashlib.sha1(f"{stamp} {_clang_major(clang)}".encode()).hexdigest()[:12]
    path = os.path.join(_cache_root(), f"hiprtc_runtime-{key}.h")
    if os.path.exists(path):
        return path
    os.makedirs(_cache_root(), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cupa-rtc-") as tmp:
        top = os.path.join(tmp, "top.h")
        with open(top, "w") as f:  # what clr's generate_hiprtc_header writes
            f.write('#pragma push_macro("CHAR_BIT")\n#pragma push_macro("INT_MAX")\n'
                    "#define CHAR_BIT __CHAR_BIT__\n#define INT_MAX __INTMAX_MAX__\n"
                    '#include "hip/hip_runtime.h"\n#include "hip/hip_bfloat16.h"\n'
                    '#pragma pop_macro("CHAR_BIT")\n#pragma pop_macro("INT_MAX")\n')
        resource = os.path.join(_clang_resource_dir(clang), "include")
        result = subprocess.run(
            [clang, "-x", "hip", "--cuda-device-only", "-nogpulib", "-nogpuinc", "-std=c++17",
             "-O3", "-D__HIPCC_RTC__", f"-DHIP_VERSION_MAJOR={major}",
             f"-DHIP_VERSION_MINOR={minor}", "-isystem", os.path.join(resource, "cuda_wrappers"),
             "-isystem", include_root, "-include", "__clang_hip_runtime_wrapper.h",
             "-E", "-P", top], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"preprocessing the hipRTC header failed:\n{result.stderr}")
        parts = ["#pragma clang diagnostic push",
                 '#pragma clang diagnostic ignored "-Weverything"', result.stdout, RTC_MACROS]
        for name in dict.fromkeys(RTC_APPENDED_HEADERS):
            with open(os.path.join(include_root, "hip", name)) as f:
                parts.append(f.read())
        parts.append("#pragma clang diagnostic pop\n")
        staged = os.path.join(tmp, "hiprtc_runtime.h")
        with open(staged, "w") as f:
            f.write("\n".join(parts))
        shutil.move(staged, path + ".part")
        os.replace(path + ".part", path)
    return path


@dataclass(frozen=True)
class HipToolchain:
    clang: str
    include_dir: str
    device_libs: str   # the overlay directory
    readelf: str
    rtc_header: str | None = None  # hiprtc_runtime.h made from $CUPA_HIPRTC_HEADERS


def hip_toolchain(arch: str) -> HipToolchain:
    """Everything the offline HIP compile of `arch` needs, or CompilerMissing saying what to
    install."""
    clang = hip_compiler(arch)
    if clang is None:
        known = hip_compiler()
        raise CompilerMissing(f"no clang that knows {arch}" + (
            f" ({known} does not; gfx950 needs clang >= 20: apt-get install clang-22 lld-22)"
            if known else f" ({INSTALL_HINT})"))
    rtc_root = os.environ.get(RTC_HEADERS_ENV) or None
    include = rtc_root or hip_include_dir(clang)
    if include is None:
        raise CompilerMissing("hip/hip_runtime.h not found (apt-get install libamdhip64-dev)")
    libs = device_library_dir(clang)
    if libs is None:
        raise CompilerMissing("AMDGPU device libraries (ocml.bc) not found "
                              "(apt-get install rocm-device-libs)")
    readelf = _sibling_tool(clang, "llvm-readelf")
    if readelf is None:
        raise CompilerMissing(f"llvm-readelf of {clang}'s release not found")
    if not os.path.exists(os.path.join(os.path.dirname(os.path.realpath(clang)), "lld")) \
            and not shutil.which(f"ld.lld-{_clang_major(clang)}") and not shutil.which("ld.lld"):
        raise CompilerMissing(f"lld for {clang} not found (apt-get install "
                              f"lld-{_clang_major(clang)})")
    return HipToolchain(clang, include, _device_library_overlay(libs, clang), readelf,
                        hiprtc_header(rtc_root, clang) if rtc_root else None)


def hip_toolchain_missing(arch: str) -> str | None:
    """What the offline HIP compile of `arch` lacks here, or None."""
    try:
        hip_toolchain(arch)
    except CompilerMissing as exc:
        return str(exc)
    return None


def hip_command(tools: HipToolchain, target: Target, src: str, out: str) -> list[str]:
    """The clang command line that builds `src` into a linked code object `out` for `target`,
    with the options hipRTC would get at run time."""
    clang = tools.clang
    if tools.rtc_header:  # as hipRTC compiles: its built-in header, RTC mode
        headers = ["-nogpuinc", "-D__HIPCC_RTC__", "-include", tools.rtc_header]
    else:
        # hipRTC provides the HIP device API implicitly; offline the packaged headers are
        # included. Debian's include clang's CUDA wrappers as <include/cuda_wrappers/...>, hence
        # the resource directory on the system include path.
        headers = ["-nogpuinc", "-isystem", _clang_resource_dir(clang),
                   *([] if tools.include_dir == "/usr/include" else
                     ["-isystem", tools.include_dir]),
                   "-include", "hip/hip_runtime.h", "-D__HIP_PLATFORM_AMD__=1"]
    if not _defines_wavefront_macro(clang):
        headers.append(f"-D__AMDGCN_WAVEFRONT_SIZE={target.warp_size}")
    libraries = [f"--rocm-device-lib-path={tools.device_libs}"]
    if not tools.rtc_header and not _links_hip_bitcode(clang, tools.device_libs) and \
            os.path.exists(os.path.join(tools.device_libs, "hip.bc")):
        libraries += ["-Xclang", "-mlink-builtin-bitcode", "-Xclang",
                      os.path.join(tools.device_libs, "hip.bc")]
    # --no-gpu-bundle-output: the bare ELF code object (not an offload bundle), linked by lld
    # with --no-undefined, which clang passes for AMDGPU.
    return [clang, "-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output",
            f"--offload-arch={target.arch}", f"-mcode-object-version={CODE_OBJECT_VERSION}",
            *headers, *libraries, *target.runtime_options(), *CUPY_HIPRTC_OPTIONS,
            src, "-o", out]


@dataclass(frozen=True)
class KernelCode:
    """What a code object's AMDGPU metadata says of one kernel."""
    name: str
    wavefront_size: int
    scratch_bytes: int  # private memory a lane (.private_segment_fixed_size): spilled registers


_KERNEL_FIELD = {"name": re.compile(r"^\s+\.name:\s+(\S+)", re.M),
                 "wavefront_size": re.compile(r"^\s+\.wavefront_size:\s+(\d+)", re.M),
                 "scratch_bytes": re.compile(r"^\s+\.private_segment_fixed_size:\s+(\d+)", re.M)}


def parse_kernel_notes(notes: str) -> list[KernelCode]:
    """The kernels of `llvm-readelf --notes` output: the amdhsa.kernels list, one entry a
    kernel, each starting with a "  - " line, up to the next top-level key."""
    if "amdhsa.kernels:" not in notes:
        return []
    listing = notes.split("amdhsa.kernels:", 1)[1]
    end = re.search(r"^\S", listing, re.M)
    kernels = []
    for entry in re.split(r"\n  - ", listing[:end.start()] if end else listing)[1:]:
        found = {field: pattern.search(entry) for field, pattern in _KERNEL_FIELD.items()}
        if not all(found.values()):
            raise RuntimeError(f"AMDGPU metadata: a kernel entry without "
                               f"{[f for f, m in found.items() if not m]}:\n{entry[:400]}")
        kernels.append(KernelCode(found["name"].group(1), int(found["wavefront_size"].group(1)),
                                  int(found["scratch_bytes"].group(1))))
    return kernels


def code_object_kernels(tools: HipToolchain, code_object: str) -> list[KernelCode]:
    """Each kernel of a code object, from its AMDGPU metadata note."""
    result = subprocess.run([tools.readelf, "--notes", code_object], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llvm-readelf failed on {code_object}:\n{result.stderr}")
    return parse_kernel_notes(result.stdout)


def check_wavefront_size(sizes: list[int], target: Target, name: str) -> None:
    """Every kernel must run at the wavefront size the source was compiled for (CUPA_WARP):
    clang ignores a wave32 request on gfx9, for one, and the kernels' shuffles and row
    ownership would silently be wrong."""
    wrong = sorted(set(s for s in sizes if s != target.warp_size))
    if not sizes or wrong:
        raise RuntimeError(f"{name} on {target.arch}: kernels of wavefront size "
                           f"{wrong or 'none found'}, compiled with CUPA_WARP="
                           f"{target.warp_size}")


# CUPA_CHECK_SPILLS=1 (CI sets it): an AMD kernel that keeps more bytes a lane in scratch than
# SPILLS_ALLOWED says fails its compile. No AMD GPU runs here, so clang's register allocation is
# what shows a kernel's regression on AMD: a spill goes to memory, and the registers it stands
# for set the occupancy of the whole kernel (docs/perf-log.md v58: up to 512 VGPRs and 316
# bytes of spills in the portable kernel, found by hand). The allowances are clang-19's (and
# clang-22's for gfx950); another clang may allocate otherwise, hence not by default.
CHECK_SPILLS_ENV = "CUPA_CHECK_SPILLS"
# Where dispatch runs a kernel that spills: bytes a lane, by (target, kernel). RDNA3's one tile
# of bf16 over an fp8 cache at heads 112 and 256, and its two tiles at 96 (docs/performance.md,
# "Open leads": heads 80 to 192 on the matrix cores).
SPILLS_ALLOWED = {
    ("gfx1100", "cupa_decode_xmma1_bf16kv8_d112"): 12,
    ("gfx1100", "cupa_decode_xmma1_bf16kv8_d256"): 8,
    ("gfx1100", "cupa_decode_xmma2_f16_d96"): 12,
    ("gfx1100", "cupa_decode_xmma2_bf16_d96"): 8,
    ("gfx1100", "cupa_decode_xmma2_bf16kv8_d96"): 20,
}


def spill_check_requested() -> bool:
    return os.environ.get(CHECK_SPILLS_ENV, "") not in ("", "0")


def spill_allowances(group: list, arch: str) -> dict[str, int]:
    """Scratch bytes a lane allowed to each kernel of `group` on `arch`: SPILLS_ALLOWED's, else
    0. Not checked (absent): a matrix variant with more row tiles than dispatch ever gives that
    head size on `arch` (catalogue.ONE_TILE_HEAD_SIZES: compiled, never run; RDNA3's two tiles
    at 80, 112 and 192 spill 372-860 bytes)."""
    allowed = {}
    for variant in group:
        if isinstance(variant, catalogue.DecodeMatrixVariant) and variant.tiles > \
                catalogue.matrix_tiles(variant.rows, variant.head_size, arch):
            continue
        for name in variant.entry_names:
            allowed[name] = SPILLS_ALLOWED.get((arch, name), 0)
    return allowed


def check_spills(kernels: list[KernelCode], allowed: dict[str, int], arch: str) -> None:
    over = [f"{k.name}: {k.scratch_bytes} bytes a lane (allowed {allowed[k.name]})"
            for k in kernels if k.name in allowed and k.scratch_bytes > allowed[k.name]]
    if over:
        raise RuntimeError(f"registers spilled to scratch on {arch} ({CHECK_SPILLS_ENV}, "
                           f"offline.SPILLS_ALLOWED):\n  " + "\n  ".join(over))


def _compile_clang_hip(source: str, name: str, target: Target,
                       spills_allowed: dict[str, int] | None = None) -> int:
    tools = hip_toolchain(target.arch)
    with tempfile.TemporaryDirectory(prefix="cupa-hip-") as tmp:
        src = os.path.join(tmp, f"{name}.hip")
        out = os.path.join(tmp, f"{name}.hsaco")
        with open(src, "w") as f:
            f.write(source)
        result = subprocess.run(hip_command(tools, target, src, out), capture_output=True,
                                text=True)
        if result.returncode != 0:
            raise RuntimeError(f"clang failed for {name} on {target.arch}:\n{result.stderr}")
        kernels = code_object_kernels(tools, out)
        check_wavefront_size([k.wavefront_size for k in kernels], target, name)
        if spills_allowed is not None:
            check_spills(kernels, spills_allowed, target.arch)
        return os.path.getsize(out)


def assembly_for(variant, arch: str) -> str:
    """The AMDGPU assembly of one variant's module for gfx target `arch`: the same source and
    clang command as the offline compile (hip_command), stopped after code generation (-S)
    instead of linking a code object. For reading instruction counts (tools/amd_isa_counts.py);
    the device libraries are linked in as bitcode before code generation, so what they
    contribute is in the text."""
    target = Target(arch)
    if not target.is_hip:
        raise ValueError(f"assembly_for: {arch} is no AMD gfx target")
    tools = hip_toolchain(arch)
    name = variant.entry_names[0]
    with tempfile.TemporaryDirectory(prefix="cupa-hip-asm-") as tmp:
        src = os.path.join(tmp, f"{name}.hip")
        out = os.path.join(tmp, f"{name}.s")
        with open(src, "w") as f:
            f.write(catalogue.module_source(variant))
        command = hip_command(tools, target, src, out)
        command.insert(command.index(src), "-S")
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"clang -S failed for {name} on {arch}:\n{result.stderr}")
        with open(out) as f:
            return f.read()


def nvrtc_options(target: Target) -> list[str]:
    return [*target.runtime_options(), *CUPY_NVRTC_OPTIONS, f"--gpu-architecture={target.arch}"]


def _compile_nvrtc(source: str, name: str, target: Target) -> int:
    why = nvrtc_missing() if cupy_module() is not None else "cupy is not installed"
    if why:
        raise CompilerMissing(why)
    from cupy.cuda import nvrtc
    program = nvrtc.createProgram(source, f"{name}.cu", [], [])
    try:
        nvrtc.compileProgram(program, nvrtc_options(target))
        return len(nvrtc.getCUBIN(program))
    except nvrtc.NVRTCError as exc:
        log = nvrtc.getProgramLog(program)
        raise RuntimeError(f"NVRTC failed for {name} on {target.arch}:\n{log}") from exc
    finally:
        nvrtc.destroyProgram(program)


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
        allowed = spill_allowances(group, arch) if spill_check_requested() else None
        return _compile_clang_hip(source, name, target, allowed)
    return _compile_nvrtc(source, name, target)
