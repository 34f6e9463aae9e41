"""The one platform predicate: does this process run on ROCm (cupy built for HIP) or not.

Every ROCm/CUDA branch in cupa and in its tests asks `is_rocm()`, so a CPU-only machine can
simulate a ROCm node by overriding this one answer (`simulate_rocm`, or CUPA_SIMULATE_ROCM=1 for
a child process) and check what such a node would select, compile, run and skip.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil

from .arrays import cupy_module

# CUPA_SIMULATE_ROCM=1 / =0 forces the answer (for subprocesses of the simulated-ROCm tests);
# unset or empty: ask cupy.
SIMULATE_ENV = "CUPA_SIMULATE_ROCM"

_override: bool | None = None


@functools.lru_cache(maxsize=1)
def _cupy_is_hip() -> bool:
    cupy = cupy_module()
    if cupy is None:
        return False
    try:
        return bool(cupy.cuda.runtime.is_hip)
    except Exception:  # a cupy whose runtime module does not load
        return False


def is_rocm() -> bool:
    """True when cupy is the ROCm build (hipRTC compiles, HIP launches), or a simulation says
    so; False for CUDA builds and without cupy."""
    if _override is not None:
        return _override
    forced = os.environ.get(SIMULATE_ENV, "")
    if forced:
        return forced not in ("0", "false", "no")
    return _cupy_is_hip()


@contextlib.contextmanager
def simulate_rocm(value: bool = True):
    """Make `is_rocm()` answer `value` inside the block (tests)."""
    global _override
    saved = _override
    _override = bool(value)
    try:
        yield
    finally:
        _override = saved


HIPCC_HINT = ("cupy-rocm runs `hipcc -x hip -E -v` to find the HIP headers for every hipRTC "
              "compile; put ROCm's bin directory on PATH (export PATH=/opt/rocm/bin:$PATH)")


def hipcc_missing() -> str | None:
    """On ROCm, why cupy cannot compile kernels here (no hipcc on PATH), else None."""
    if not is_rocm() or shutil.which("hipcc"):
        return None
    found = [p for p in ("/opt/rocm/bin/hipcc",) if os.path.exists(p)]
    return "hipcc is not on PATH" + (f" (there is {found[0]})" if found else "") + \
        f": {HIPCC_HINT}"


def require_hipcc() -> None:
    """Raise RuntimeError with hipcc_missing()'s explanation; for the run-time compile path,
    whose failure through cupy would otherwise be a bare subprocess error."""
    why = hipcc_missing()
    if why:
        raise RuntimeError(why)
