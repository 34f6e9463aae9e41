"""Compiling kernel variants at run time through cupy.RawModule (NVRTC on CUDA, hipRTC on ROCm).

One RawModule per (device, variant, options), compiled on first use and kept for the process;
cupy's own disk cache (keyed on source + options) makes later processes skip the compiler. The
offline compile for CI is `cupa.gpu.offline`.
"""

from __future__ import annotations

import threading

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
                module = cupy.RawModule(code=catalogue.module_source(variant), options=options)
                compiled = {name: module.get_function(name) for name in variant.entry_names}
                _allow_dynamic_shared(compiled, getattr(variant, "shared_bytes", 0))
                _modules[key] = compiled
    return compiled


# Above this, a kernel must opt in to more dynamic shared memory (CUDA; the tensor-core kernels
# that use it exist only for NVIDIA: HIP's setter fails, and its LDS is 64 KB anyway).
DEFAULT_DYNAMIC_SHARED = 48 * 1024


def _allow_dynamic_shared(compiled: dict, nbytes: int) -> None:
    if nbytes > DEFAULT_DYNAMIC_SHARED:
        for kernel in compiled.values():
            kernel.max_dynamic_shared_size_bytes = nbytes
