"""Array kinds: numpy on the host, cupy on the device, and foreign device arrays taken zero-copy.

cupy is imported lazily so that `import cupa` works on machines without cupy or without a GPU.
"""

from __future__ import annotations

import functools
import sys

import numpy as np


@functools.lru_cache(maxsize=None)
def cupy_module():
    """The cupy module, or None when cupy is not installed (or fails to import)."""
    try:
        import cupy
    except Exception:  # ImportError, or a broken CUDA/ROCm install raising at import
        return None
    return cupy


@functools.lru_cache(maxsize=None)
def cupy_ndarray():
    """cupy.ndarray, or a type no object has when cupy is missing (for `type(x) is ...`)."""
    cupy = cupy_module()
    return cupy.ndarray if cupy is not None else type("NoCupyArray", (), {})


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when cupy imports and sees at least one device."""
    cupy = cupy_module()
    if cupy is None:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_device_array(x) -> bool:
    """cupy arrays and anything exposing the CUDA array interface (torch, numba, jax...)."""
    if x is None or isinstance(x, np.ndarray):
        return False
    cupy = cupy_module()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return True
    return hasattr(x, "__cuda_array_interface__") or (
        hasattr(x, "__dlpack_device__") and _dlpack_on_gpu(x))


def _dlpack_on_gpu(x) -> bool:
    try:
        device_type, _ = x.__dlpack_device__()
    except Exception:
        return False
    return int(device_type) in (2, 10)  # kDLCUDA, kDLROCM


def to_device(x):
    """A cupy view of a device array (zero-copy) or an upload of a host array."""
    if x is None:
        return None
    cupy = cupy_module()
    if isinstance(x, cupy.ndarray):
        return x
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    if hasattr(x, "__dlpack_device__") and _dlpack_on_gpu(x):
        return cupy.from_dlpack(x)
    return cupy.asarray(np.asarray(x))


def to_host(x):
    """A numpy array of any input (device arrays are downloaded)."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return x
    if is_device_array(x):
        return to_device(x).get()
    return np.asarray(x)


# Where a library's DLPack importer lives, by the top-level module of its array type (JAX's
# arrays are jaxlib types; everything else is asked for `<library>.from_dlpack`).
DLPACK_IMPORTERS = {"jaxlib": ("jax.dlpack", "from_dlpack"), "jax": ("jax.dlpack", "from_dlpack")}


def _dlpack_importer(template):
    root = type(template).__module__.split(".")[0]
    module_name, function = DLPACK_IMPORTERS.get(root, (root, "from_dlpack"))
    module = sys.modules.get(module_name)
    if module is None and module_name in (v[0] for v in DLPACK_IMPORTERS.values()):
        import importlib
        module = importlib.import_module(module_name)
    return getattr(module, function, None)


def like(template, result):
    """Return `result` (numpy or cupy) as the same kind of array as `template`.

    numpy in -> numpy out; cupy in -> cupy out; another library's device tensor -> that library's
    tensor through DLPack when it offers an importer (torch.from_dlpack, jax.dlpack.from_dlpack),
    else the cupy array.
    """
    cupy = cupy_module()
    if isinstance(template, np.ndarray) or not is_device_array(template):
        return result.get() if cupy is not None and isinstance(result, cupy.ndarray) else result
    if isinstance(template, cupy.ndarray):
        return result if isinstance(result, cupy.ndarray) else cupy.asarray(result)
    device_result = result if isinstance(result, cupy.ndarray) else cupy.asarray(result)
    from_dlpack = _dlpack_importer(template)
    return from_dlpack(device_result) if from_dlpack is not None else device_result


def host_view(x):
    """An array whose shape, dtype and flags can be checked without copying device data:
    numpy stays numpy, device arrays become zero-copy cupy views, anything else goes through
    np.asarray."""
    if isinstance(x, np.ndarray) or x is None:
        return x
    if is_device_array(x):
        return to_device(x)
    return np.asarray(x)
