"""The emulated AMD build on an NVIDIA GPU: every amd_* matrix wrapper of every emulated target
(cupa/kernels/amd_emulation.cuh, compiled by NVRTC with CUPA_EMULATE_AMD=1) against the numpy
reference emulator built on AMD's calculator tables (tests/helpers/amd_layouts.py), bit for bit, and
the wave64/wave32 shuffles, ballot and butterflies against numpy (the checks of
tests/helpers/amd_emulation_checks.py; tests/unit/test_amd_emulation_cpu.py runs them on the CPU).
Skips without a GPU, and on ROCm (the emulation is an NVIDIA build)."""

from __future__ import annotations

import pytest

from cupa.arrays import gpu_available

import amd_emulation_checks as checks
from amd_emulation_probe import TARGETS, emulated_options, source, wrappers_of

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")


@pytest.fixture(scope="module")
def machine():
    import cupy
    if cupy.cuda.runtime.is_hip:
        pytest.skip("the AMD emulation is an NVIDIA (NVRTC) build")
    modules = {}

    def kernel(gfx, name):
        if gfx not in modules:
            modules[gfx] = cupy.RawModule(code=source(gfx), options=tuple(emulated_options(gfx)))
        return modules[gfx].get_function(name)
    return checks.ProbeMachine(cupy, kernel)


@pytest.mark.parametrize("gfx, wrapper", checks.CASES)
def test_emulated_instruction_matches_the_tables(machine, rng, gfx, wrapper):
    checks.check_instruction_matches_tables(machine, rng, gfx, wrapper)


@pytest.mark.parametrize("gfx, wrapper", checks.CASES)
def test_emulated_instruction_decodes_every_code(machine, rng, gfx, wrapper):
    checks.check_decodes(machine, rng, gfx, wrapper, subnormal_f32=False)


@pytest.mark.parametrize("gfx, wrapper", checks.BF16_CASES)
def test_emulated_bf16_subnormal_inputs(machine, rng, gfx, wrapper):
    checks.check_decodes(machine, rng, gfx, wrapper, subnormal_f32=True)


@pytest.mark.parametrize("wrapper", sorted(wrappers_of("gfx1100")))
def test_rdna3_unreplicated_operands_poison(machine, rng, wrapper):
    checks.check_rdna3_unreplicated_operands_poison(machine, rng, wrapper)


@pytest.mark.parametrize("gfx", sorted(TARGETS))
def test_wavefront_operations(machine, rng, gfx):
    checks.check_wavefront_operations(machine, rng, gfx)
