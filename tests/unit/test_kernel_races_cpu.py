"""Races in the kernels, found on the CPU build (tests/helpers/decode_on_cpu.py): the same decode
run with its threads scheduled by index, reversed, in two random orders, and with the first
(or last) warp running ahead to each workgroup barrier (CUPA_CPU_SCHEDULE,
tests/helpers/cuda_on_cpu.py) must give bit-identical outputs and log-sum-exps.

Between two barriers the runner runs each thread's segment whole, one thread after another, in
the order of the schedule; a thread's own arithmetic does not depend on it. So a result that
changes with the order is a thread reading what another writes with no barrier between them (a
missing __syncthreads, warp or wavefront barrier, or cp.async wait), which on a GPU is a race.
Dropping the reduce's barrier before it merges its warps' rows fails this test (session 46).
compute-sanitizer's racecheck is the GPU's check (tests/gpu/test_gpu_sanitizer.py); this one
covers the AMD builds, the NVIDIA builds in CI, and every form on every run.
"""

from __future__ import annotations

import numpy as np
import pytest

from cases import environ, make_case
from cuda_on_cpu import compiler_missing
from decode_on_cpu import decode_on_cpu

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason=compiler_missing() or "")

SCHEDULES = ("", "reverse", "7", "12345", "ahead", "ahead-reverse")  # by index, reversed, two
# random seeds, a warp ahead
# (target, problem, kernel, merge): each target's matrix- or tensor-core kernel and the portable
# one, phase 1 and the reduce (64-token partitions), sm_90's cluster merge.
CASES = [
    ("gfx942", dict(head_size=128, group=8), "auto", "auto"),
    ("gfx942", dict(head_size=128, group=8), "portable", "auto"),
    ("gfx1100", dict(head_size=80, group=4, new_tokens=3), "auto", "auto"),
    ("gfx1100", dict(head_size=80, group=4, new_tokens=3), "portable", "auto"),
    ("gfx90a", dict(head_size=256, group=32), "auto", "auto"),
    ("gfx1201", dict(head_size=96, group=1, alibi=True, sliding_window=50, sinks=True), "auto",
     "auto"),
    # two wavefronts a tile, adding their halves of S^T through LDS every pass
    ("gfx1100", dict(head_size=256, group=8), "auto", "auto"),
    ("gfx1100", dict(head_size=96, group=32), "auto", "auto"),
    ("sm_90", dict(head_size=128, group=8), "auto", "auto"),
    ("sm_90", dict(head_size=128, group=8, logits_soft_cap=30.0), "auto", "cluster"),
    ("sm_90", dict(head_size=64, group=16), "auto", "auto"),
    ("sm_90", dict(head_size=64, group=16), "auto", "cluster"),
    ("sm_90", dict(head_size=64, group=16), "portable", "auto"),
    ("sm_80", dict(head_size=112, group=8, new_tokens=2), "auto", "auto"),
]


def bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32}[a.itemsize])


@pytest.mark.parametrize("arch, problem, kernel, merge", CASES)
def test_results_do_not_depend_on_the_thread_order(rng, arch, problem, kernel, merge):
    case = make_case(rng, num_kv_heads=2, seq_lens=(0, 1, 37, 300, 900), **problem)
    results = {}
    for schedule in SCHEDULES:
        with environ(CUPA_CPU_SCHEDULE=schedule, CUPA_KERNEL=kernel, CUPA_MERGE=merge):
            result = decode_on_cpu(arch, *case.args(), **case.options(), partition_size=64)
        results[schedule] = (bits(result.out), bits(result.lse))
    by_index = results[""]
    differ = [s for s, (out, lse) in results.items()
              if not (np.array_equal(out, by_index[0]) and np.array_equal(lse, by_index[1]))]
    assert not differ, f"{result.plan.variant}: results differ under schedules {differ}"
