"""What the current GPU is, and what a compile target needs: vendor, arch, warp size, options."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .. import platform
from ..arrays import cupy_module


@dataclass(frozen=True)
class Target:
    """A compile target: 'sm_90', 'gfx942', ... Its warp size and vendor follow from the name."""

    arch: str
    warp: int | None = None  # set when the device reports a warp size the name rule would miss
    # The emulated AMD build (tests and the bench, never users): this AMD target's semantics
    # compiled by NVRTC for the NVIDIA GPU present (kernels/amd_emulation.cuh,
    # docs/amd_emulation.md).
    emulated: bool = False

    def __post_init__(self):
        # CDNA (gfx9) has no wave32 mode: clang would ignore the request and build wave64
        # kernels for code written for 32 lanes.
        if self.is_hip and self.arch.startswith("gfx9") and self.warp_size != 64:
            raise ValueError(f"{self.arch} runs wavefronts of 64 only, not {self.warp_size}")

    @property
    def is_hip(self) -> bool:
        return self.arch.startswith("gfx")

    @property
    def warp_size(self) -> int:
        if self.warp is not None:
            return self.warp
        # CDNA (gfx9xx: MI100/MI200/MI300) runs wave64; RDNA (gfx10+) is compiled wave32, which is
        # hipRTC's default there. NVIDIA warps are 32.
        return 64 if self.arch.startswith("gfx9") else 32

    @property
    def compiles_with_hiprtc(self) -> bool:
        return self.is_hip and not self.emulated

    def defines(self) -> list[str]:
        # CUPA_THREADS is the variant's, defined in its source (catalogue.module_defines).
        defines = [f"-DCUPA_WARP={self.warp_size}", f"-DCUPA_HIP={int(self.compiles_with_hiprtc)}"]
        if self.emulated:
            defines += ["-DCUPA_EMULATE_AMD=1", f"-DCUPA_EMULATE_GFX=0x{self.arch[3:]}"]
        return defines

    def wavefront_option(self) -> str:
        """The HIP option that makes the compiler build kernels of this target's wavefront
        size (CUPA_WARP). Said explicitly, as hipRTC's default follows the processor, and a
        device may report a warp size other than its processor's default."""
        return "-mwavefrontsize64" if self.warp_size == 64 else "-mno-wavefrontsize64"

    def runtime_options(self) -> tuple[str, ...]:
        """Options for cupy.RawModule on this target (cupy adds the arch itself).

        CUPA_EXTRA_OPTIONS (space-separated) is appended: a knob for kernel development, such as
        trying -DCUPA_MMA_MIN_BLOCKS=3 without editing the source. Read when a variant is
        compiled (kernels are looked up once per plan).
        """
        extra = os.environ.get("CUPA_EXTRA_OPTIONS", "").split()
        if self.compiles_with_hiprtc:
            return tuple(self.defines() + ["-std=c++17", "-O3", self.wavefront_option()] + extra)
        return tuple(self.defines() + ["--std=c++17"] + extra)


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    target: Target
    warp_size: int  # as the device reports it
    multiprocessors: int
    shared_memory_per_block: int
    # For the planner's residency estimate (cupa.occupancy); 0 when the runtime does not say.
    shared_memory_per_sm: int = 0
    registers_per_sm: int = 65536
    reserved_shared_per_block: int = 0
    hip_runtime: bool = False  # the runtime (and so the launch driver) is HIP's


# Targets the emulated AMD build serves (CUPA_EMULATE=<arch>, on an NVIDIA GPU), and the LDS both
# AMD families give a workgroup (kernels/amd_emulation.cuh: CUPA_AMD_LDS_BYTES).
EMULATED_TARGETS = ("gfx90a", "gfx942", "gfx1100", "gfx1201")
AMD_LDS_BYTES = 64 * 1024


def emulated_target() -> str | None:
    """CUPA_EMULATE, checked: an AMD arch to emulate on the NVIDIA GPU present, or None."""
    arch = os.environ.get("CUPA_EMULATE") or None
    if arch is not None and arch not in EMULATED_TARGETS:
        raise ValueError(f"CUPA_EMULATE: one of {EMULATED_TARGETS}, got {arch!r}")
    return arch


def device_info(index: int | None = None) -> DeviceInfo:
    """Facts about a cupy device (the current one by default). Raises if no GPU is usable."""
    cupy = cupy_module()
    if cupy is None:
        raise RuntimeError("cupy is not installed: install cupa[cuda12], cupa[cuda13] or "
                           "cupa[rocm], or use backend='numpy'")
    return _device_info(cupy.cuda.Device().id if index is None else int(index))


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> DeviceInfo:
    cupy = cupy_module()
    return info_from_properties(index, cupy.cuda.runtime.getDeviceProperties(index),
                                rocm=platform.is_rocm())


def info_from_properties(index: int, props: dict, *, rocm: bool) -> DeviceInfo:
    """DeviceInfo from the runtime's device properties (cudaDeviceProp / hipDeviceProp_t as
    cupy returns them). Separate from the query so that simulated devices take the same path."""
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    if rocm:
        arch = props["gcnArchName"]
        arch = (arch.decode() if isinstance(arch, bytes) else str(arch)).split(":")[0]
    else:
        arch = f"sm_{props['major']}{props['minor']}"
    # The device's own warp size wins over the name rule; Target then compiles for it (on HIP
    # with the matching wavefront option) or refuses what the hardware cannot run.
    warp = int(props.get("warpSize", Target(arch).warp_size))
    target = Target(arch) if warp == Target(arch).warp_size else Target(arch, warp)
    emulate = emulated_target()
    if emulate is not None:
        if rocm:
            raise RuntimeError("CUPA_EMULATE emulates an AMD target on an NVIDIA GPU; this is "
                               "a ROCm device: unset it")
        target = Target(emulate, emulated=True)
        return DeviceInfo(index=index, name=f"{name} emulating {emulate}", target=target,
                          warp_size=target.warp_size,
                          multiprocessors=int(props["multiProcessorCount"]),
                          shared_memory_per_block=AMD_LDS_BYTES)
    return DeviceInfo(index=index, name=name, target=target, warp_size=warp,
                      multiprocessors=int(props["multiProcessorCount"]),
                      shared_memory_per_block=int(props.get("sharedMemPerBlock", 48 * 1024)),
                      shared_memory_per_sm=int(props.get("sharedMemPerMultiprocessor", 0)),
                      registers_per_sm=int(props.get("regsPerMultiprocessor", 65536)),
                      reserved_shared_per_block=int(props.get("reservedSharedMemPerBlock", 0)),
                      hip_runtime=rocm)
