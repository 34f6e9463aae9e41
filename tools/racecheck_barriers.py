"""Why the emulated wave64 barrier is an mbarrier (docs/amd_emulation.md, "Under
compute-sanitizer"): compute-sanitizer's racecheck on one kernel with each kind of wavefront
barrier. Needs cupy, an NVIDIA GPU (sm_80 or later) and compute-sanitizer.

    python3 tools/racecheck_barriers.py            # every kind under racecheck: errors each
    python3 tools/racecheck_barriers.py KIND [N]   # one run of the kernel (what racecheck runs)

A workgroup of 128 threads is two 64-thread wavefronts. Each of N rounds (40): wave 0 runs its
barrier (KIND), then writes; __syncthreads; wave 1 reads what wave 0 wrote; __syncthreads. The
__syncthreads order every access, so any hazard racecheck reports is a false one. The mbarrier
kind runs the emulation's own wavefront exchange (kernels/amd_emulation.cuh). Session 52
measured this logic in a scratch script, its mbarrier written out by hand; the tool itself
has not run on a device yet.
"""
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

HEADER = Path(__file__).resolve().parent.parent / "cupa" / "kernels" / "amd_emulation.cuh"
# The emulated gfx942 build the header serves (wave64), as cupa compiles it.
OPTIONS = ("-DCUPA_EMULATE_AMD=1", "-DCUPA_HIP=0", "-DCUPA_WARP=64", "-DCUPA_THREADS=128",
           "-DCUPA_EMULATE_GFX=0x942", "--std=c++17")
BAR_SYNC = 'asm volatile("bar.sync %0, 64;" ::"r"(1 + wave) : "memory");'
KINDS = {  # name: (code wave 0 runs each round before its write, code both waves run after it)
    "none": ("", ""),
    "bar.sync": (BAR_SYNC, ""),
    "barrier.sync": ('asm volatile("barrier.sync %0, 64;" ::"r"(1 + wave) : "memory");', ""),
    "bar.sync-both-waves": ("", BAR_SYNC),
    # The emulation's own exchange across the wavefront's two warps (emu_wave_xor at mask 32:
    # scratch, mbarrier, read, mbarrier), what cupa's emulated wave64 kernels run.
    "mbarrier": ("acc += emu_wave_xor((unsigned int)(t + round), 32);", ""),
}

KERNEL = r"""
extern "C" __global__ void rounds(unsigned int* out, int n) {
    emu_begin_workgroup();
    __shared__ unsigned int s[64];
    const int t = threadIdx.x, wave = t / 64, lane = t % 64;
    unsigned int acc = 0;
    for (int round = 0; round < n; ++round) {
        if (wave == 0) {
            WAVE0_BARRIER
            s[lane] = t * 3 + round + acc;
        }
        BOTH_BARRIER
        __syncthreads();
        if (wave == 1) acc += s[lane];
        __syncthreads();
    }
    out[t] = acc;
}
"""


def source(kind: str) -> str:
    """The module of one kind: the emulation header, then the kernel."""
    wave0, both = KINDS[kind]
    kernel = KERNEL.replace("WAVE0_BARRIER", wave0).replace("BOTH_BARRIER", both)
    return HEADER.read_text().replace("#pragma once", "") + kernel


def run_kernel(kind: str, rounds: int) -> None:
    import cupy
    kernel = cupy.RawModule(code=source(kind), options=OPTIONS).get_function("rounds")
    out = cupy.zeros(128, cupy.uint32)
    kernel((8,), (128,), (out, np.int32(rounds)))
    cupy.cuda.Device().synchronize()
    print(f"{kind}: ran {rounds} rounds")


def racecheck_all() -> None:
    sanitizer = shutil.which("compute-sanitizer")
    if sanitizer is None:
        sys.exit("compute-sanitizer is not on PATH")
    for kind in KINDS:
        result = subprocess.run([sanitizer, "--tool", "racecheck", "--racecheck-report", "all",
                                 "--print-limit", "0", sys.executable, __file__, kind],
                                capture_output=True, text=True)
        summary = [line for line in result.stdout.splitlines() if "SUMMARY" in line]
        print(f"{kind:>20}: {summary[-1].strip('= ') if summary else result.stdout[-400:]}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_kernel(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
    else:
        racecheck_all()
