"""How many workgroups of a compiled kernel a multiprocessor holds at once.

The planner avoids grids of just over one wave of resident workgroups (they run as two), so it
needs the residency of the variant it launches: the tensor-core kernels range from 2 (float16
head 128: a 98 KB shared-memory ring, or ~200 registers a thread in the 16-row kernel) to 5
(fp8 head 64) on an H200. Registers and static shared memory come from the compiled kernel; the
rest from the device's properties.
"""

from __future__ import annotations

import functools

# CUDA allocates registers per warp in units of 256 and reserves 1 KB of shared memory per
# workgroup (reservedSharedMemPerBlock); the per-multiprocessor limit on workgroups is 32.
REGISTER_UNIT = 256
MAX_WORKGROUPS = 32


def workgroups_per_sm(registers_per_thread: int, shared_bytes: int, threads: int, *,
                      registers_per_sm: int, shared_per_sm: int, reserved_shared: int,
                      warp_size: int = 32) -> int:
    """Resident workgroups per multiprocessor (at least 1) for a kernel using
    `registers_per_thread` and `shared_bytes` of shared memory per workgroup of `threads`."""
    warps = -(-threads // warp_size)
    per_warp = -(-registers_per_thread * warp_size // REGISTER_UNIT) * REGISTER_UNIT
    by_registers = registers_per_sm // max(per_warp * warps, 1)
    by_shared = shared_per_sm // max(shared_bytes + reserved_shared, 1)
    return max(1, min(by_registers, by_shared, MAX_WORKGROUPS))


@functools.lru_cache(maxsize=None)
def resident_workgroups(variant, info) -> int | None:
    """Residency of `variant`'s phase-1 kernel on the device of `info` (compiles it if needed;
    cached, since `cupa.decode` plans every call and the register count is a driver query);
    None for the portable kernels (no shared-memory ring; on AMD the rule it feeds was never
    measured) and where the runtime does not report shared memory per multiprocessor."""
    if not getattr(variant, "shared_bytes", 0) or info.shared_memory_per_sm <= 0:
        return None
    from . import compiler
    kernel = compiler.kernels(variant, info.index)[variant.partition_name]
    shared = variant.shared_bytes + int(kernel.shared_size_bytes)  # dynamic + static
    return workgroups_per_sm(int(kernel.num_regs), shared, variant.threads,
                             registers_per_sm=info.registers_per_sm,
                             shared_per_sm=info.shared_memory_per_sm,
                             reserved_shared=info.reserved_shared_per_block,
                             warp_size=info.warp_size)
