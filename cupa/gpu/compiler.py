"""Compiling kernel variants at run time through cupy.RawModule (NVRTC on CUDA, hipRTC on ROCm).

One RawModule per (device, variant, options), compiled on first use and kept for the process;
cupy's own disk cache (keyed on source + options) makes later processes skip the compiler. The
offline compile for CI is `cupa.gpu.offline`.
"""

from __future__ import annotations

import threading

from .. import platform
from ..arrays import cupy_module
from . import catalogue
from .device import device_info

_modules: dict = {}
_lock = threading.Lock()


def kernels(variant, device_index: int | None = None) -> dict:
    """{entry name: cupy RawKernel} of a variant compiled for a device (once per process).

    `variant` is any object with `source_file`, `entry_names` and `instantiations()` (see
    cupa.gpu.catalogue).
    """
    info = device_info(device_index)
    options = info.target.runtime_options()
    key = (info.index, variant, options)
    compiled = _modules.get(key)
    if compiled is None:
        with _lock:
            compiled = _modules.get(key)
            if compiled is None:
                cupy = cupy_module()
                if info.hip_runtime:  # cupy-rocm runs hipcc to find headers: say so clearly
                    platform.require_hipcc()
                module = cupy.RawModule(code=catalogue.module_source(variant), options=options)
                compiled = {name: module.get_function(name) for name in variant.entry_names}
                _allow_dynamic_shared(compiled, getattr(variant, "shared_bytes", 0))
                if info.target.emulated:
                    _check_amd_lds(compiled, getattr(variant, "shared_bytes", 0), info.target)
                _modules[key] = compiled
    return compiled


# Above this, a kernel must opt in to more dynamic shared memory (CUDA; the tensor-core kernels
# that use it exist only for NVIDIA: HIP's setter fails, and its LDS is 64 KB anyway).
DEFAULT_DYNAMIC_SHARED = 48 * 1024


def _allow_dynamic_shared(compiled: dict, nbytes: int) -> None:
    if nbytes > DEFAULT_DYNAMIC_SHARED:
        for kernel in compiled.values():
            kernel.max_dynamic_shared_size_bytes = nbytes


def emulation_scratch_bytes(warp_size: int) -> int:
    """Shared memory the emulated AMD build adds to a kernel that exchanges across a wavefront
    (CUPA_EMU_SCRATCH_BYTES in kernels/amd_emulation.cuh): the AMD target never has it."""
    words = 4 * 64 if warp_size == 64 else 16 * 32
    barrier = 8  # a wavefront's mbarrier
    return catalogue.THREADS // warp_size * (words * 4 + barrier)


def _check_amd_lds(compiled: dict, dynamic_bytes: int, target) -> None:
    """An emulated AMD kernel must fit the target's 64 KB of LDS, as it would there."""
    from .device import AMD_LDS_BYTES
    allowed = AMD_LDS_BYTES + emulation_scratch_bytes(target.warp_size)
    for name, kernel in compiled.items():
        used = int(kernel.shared_size_bytes) + dynamic_bytes
        if used > allowed:
            raise RuntimeError(f"{name} needs {used} bytes of shared memory; {target.arch} gives "
                               f"a workgroup {AMD_LDS_BYTES} of LDS")
