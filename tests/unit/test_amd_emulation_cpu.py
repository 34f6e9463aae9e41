"""The emulated AMD build's own pieces on the CPU: the tests of
tests/gpu/test_gpu_amd_emulation.py (tests/helpers/amd_emulation_checks.py: every amd_* matrix
wrapper of every emulated target against AMD's calculator tables, bit for bit, and the
wave64/wave32 shuffles, ballot and butterflies), with their probe kernels built by the host's C++
compiler with CUPA_CPU=1 (tests/helpers/cuda_on_cpu.py) instead of NVRTC. The kernels' fma is
the host's (std::fma, with gfx90a's flushes); the rest is the GPU build's source."""

from __future__ import annotations

import numpy as np
import pytest

import amd_emulation_checks as checks
from amd_emulation_probe import emulated_options, source
from cuda_on_cpu import compiler_missing, cpu_kernels
# The GPU module's tests, collected here too: pytest gives them this module's `machine`.
from test_gpu_amd_emulation import (  # noqa: F401
    test_emulated_bf16_subnormal_inputs, test_emulated_instruction_decodes_every_code,
    test_emulated_instruction_matches_the_tables, test_rdna3_unreplicated_operands_poison,
    test_wavefront_operations)

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason=compiler_missing() or "")


@pytest.fixture(scope="module")
def machine():
    def kernel(gfx, name):
        options = [o for o in emulated_options(gfx) if o.startswith("-D")] + ["-DCUPA_CPU=1"]
        return cpu_kernels(source(gfx), tuple(options))[name]
    return checks.ProbeMachine(np, kernel)
