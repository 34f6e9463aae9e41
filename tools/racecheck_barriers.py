"""Why the emulated wave64 barrier is an mbarrier (docs/amd_emulation.md, "Under
compute-sanitizer"): compute-sanitizer's racecheck on one kernel with each kind of wavefront
barrier. Needs cupy, an NVIDIA GPU (sm_80 or later) and compute-sanitizer.

    python3 tools/racecheck_barriers.py            # every kind under racecheck: errors each
    python3 tools/racecheck_barriers.py KIND [N]   # one run of the kernel (what racecheck runs)

A workgroup of 128 threads is two 64-thread wavefronts. Each of N rounds (40): wave 0 runs its
barrier (KIND), then writes; __syncthreads; wave 1 reads what wave 0 wrote; __syncthreads. The
__syncthreads order every access, so any hazard racecheck reports is a false one. Session 52
measured this logic (in a scratch script) before it became this tool; the tool itself has not
run on a device yet.
"""
import shutil
import subprocess
import sys

import numpy as np

BAR_SYNC = 'asm volatile("bar.sync %0, 64;" ::"r"(1 + wave) : "memory");'
KINDS = {  # name: (code wave 0 runs each round before its write, code both waves run after it)
    "none": ("", ""),
    "bar.sync": (BAR_SYNC, ""),
    "barrier.sync": ('asm volatile("barrier.sync %0, 64;" ::"r"(1 + wave) : "memory");', ""),
    "bar.sync-both-waves": ("", BAR_SYNC),
    # An exchange across the wavefront's two warps, ordered by the mbarrier alone.
    "mbarrier": ("x[wave][lane] = t + round; mbarrier_sync(&bars[wave]); "
                 "acc += x[wave][lane ^ 32]; mbarrier_sync(&bars[wave]);", ""),
}

SOURCE = r"""
__device__ unsigned int shared_address(void* p) {
    return (unsigned int)__cvta_generic_to_shared(p);
}
__device__ void mbarrier_sync(unsigned long long* bar) {
    unsigned long long phase;
    asm volatile("mbarrier.arrive.shared.b64 %0, [%1];"
                 : "=l"(phase) : "r"(shared_address(bar)) : "memory");
    unsigned int done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.test_wait.shared.b64 p, [%1], %2; "
                     "selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(shared_address(bar)), "l"(phase) : "memory");
    } while (!done);
}
extern "C" __global__ void rounds(unsigned int* out, int n) {
    __shared__ unsigned int s[64], x[2][64];
    __shared__ unsigned long long bars[2];
    const int t = threadIdx.x, wave = t / 64, lane = t % 64;
    if (lane == 0)
        asm volatile("mbarrier.init.shared.b64 [%0], 64;" ::"r"(shared_address(&bars[wave]))
                     : "memory");
    __syncthreads();
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


def run_kernel(kind: str, rounds: int) -> None:
    import cupy
    wave0, both = KINDS[kind]
    src = SOURCE.replace("WAVE0_BARRIER", wave0).replace("BOTH_BARRIER", both)
    kernel = cupy.RawKernel(src, "rounds")
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
