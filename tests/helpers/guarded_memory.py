"""Arrays with no-access memory around them, for the CPU runs of the kernels under the
sanitizers (tests/helpers/sanitized_run.py): a kernel that reads or writes outside an array it
was given faults at once, instead of reading a neighbour's bytes or corrupting them unseen.

Each array gets its own mapping: GUARD_BYTES of no-access memory, the array's pages, GUARD_BYTES
more. The array lies flush against one guard: "end" puts its last byte before the upper guard
(any read past the end faults), "start" its first byte after the lower one (any read before
the start faults). Inputs are made read-only once filled, so a store into one faults too.

The guards are address space only (PROT_NONE, MAP_NORESERVE): a quarter GiB each side costs no
memory, and reaches a block id a few tens of thousands of blocks outside a small cache. A wild
address further away is not in any guard; on a 64-bit machine it is almost always unmapped and
faults as well.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

GUARD_BYTES = 1 << 28
# Where an "end" array starts when its size is not a multiple of this: the kernels' widest
# loads are 16 bytes, so an array must start 16-byte aligned, and a read of up to 15 bytes past
# such an array's end lands in its own pages, not the guard.
ALIGNMENT = 16
PLACEMENTS = ("end", "start")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_PROT_NONE = 0  # Linux; the mmap module names only PROT_READ, PROT_WRITE and PROT_EXEC


def _check(result: int, call: str):
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{call} failed")


class GuardedArena:
    """Owns the guarded mappings of one run; `place` copies an array into one. Use as a
    context manager (the mappings are unmapped at exit, so no array placed may outlive it)."""

    def __init__(self, placement: str = "end"):
        if placement not in PLACEMENTS:
            raise ValueError(f"placement: one of {PLACEMENTS}, got {placement!r}")
        self.placement = placement
        self.regions: list[tuple[str, int, int]] = []  # (name, first byte, byte count)
        self._mappings: list[tuple[int, int]] = []

    def place(self, name: str, array: np.ndarray | None, *, writable: bool = False):
        """A copy of `array` in its own guarded mapping; None stays None. A view with positive
        strides keeps them, the bytes between its elements poisoned (0xff: NaN in float16 and
        bfloat16, -NaN in float32); anything else is copied in C order."""
        if array is None:
            return None
        if array.size == 0 or min(array.strides, default=1) <= 0:
            array = np.ascontiguousarray(array)
        extent = (sum((d - 1) * s for d, s in zip(array.shape, array.strides)) + array.itemsize
                  if array.size else 0)
        page = mmap.PAGESIZE
        nbytes = max(extent, 1)
        data_bytes = -(-nbytes // page) * page
        total = 2 * GUARD_BYTES + data_bytes
        base = _libc.mmap(None, total, _PROT_NONE,
                          mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {total} bytes failed")
        self._mappings.append((base, total))
        data = base + GUARD_BYTES
        _check(_libc.mprotect(data, data_bytes, mmap.PROT_READ | mmap.PROT_WRITE), "mprotect")
        start = data
        if self.placement == "end":
            start = (data + data_bytes - nbytes) // ALIGNMENT * ALIGNMENT
        buffer = (ctypes.c_char * nbytes).from_address(start)
        ctypes.memset(start, 0xFF, nbytes)
        placed = np.ndarray(array.shape, array.dtype, buffer, strides=array.strides)
        placed[...] = array
        if not writable:
            _check(_libc.mprotect(data, data_bytes, mmap.PROT_READ), "mprotect")
        self.regions.append((name, start, nbytes))
        return placed

    def close(self):
        for base, total in self._mappings:
            _libc.munmap(base, total)
        self._mappings.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def describe_address(regions, address: int) -> str:
    """Where `address` lies relative to the arrays of `regions` (an arena's (name, first byte,
    byte count) list): for a fault report."""
    name, start, nbytes = min(regions, key=lambda r: min(abs(address - r[1]),
                                                         abs(address - r[1] - r[2])))
    if address < start:
        return f"{start - address} bytes before {name} ({nbytes} bytes)"
    if address >= start + nbytes:
        return f"{address - start - nbytes} bytes past the end of {name} ({nbytes} bytes)"
    return f"inside {name}, byte {address - start} of {nbytes}"
