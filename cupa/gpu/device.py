"""What the current GPU is, and what a compile target needs: vendor, arch, warp size, options."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from .. import platform
from ..arrays import cupy_module
from . import catalogue


@dataclass(frozen=True)
class Target:
    """A compile target: 'sm_90', 'gfx942', ... Its warp size and vendor follow from the name."""

    arch: str
    warp: int | None = None  # set when the device reports a warp size the name rule would miss

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

    def defines(self) -> list[str]:
        return [f"-DCUPA_WARP={self.warp_size}", f"-DCUPA_HIP={int(self.is_hip)}",
                f"-DCUPA_THREADS={catalogue.THREADS}"]

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
        if self.is_hip:
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
    return DeviceInfo(index=index, name=name, target=target, warp_size=warp,
                      multiprocessors=int(props["multiProcessorCount"]),
                      shared_memory_per_block=int(props.get("sharedMemPerBlock", 48 * 1024)),
                      shared_memory_per_sm=int(props.get("sharedMemPerMultiprocessor", 0)),
                      registers_per_sm=int(props.get("regsPerMultiprocessor", 65536)),
                      reserved_shared_per_block=int(props.get("reservedSharedMemPerBlock", 0)))
