"""The example engine's fused kernels (examples/llm/fused.py) compile for NVIDIA and AMD targets
with no GPU (NVRTC; clang -x hip as hipRTC would), and define every kernel FusedOps looks up.
Skips where a compiler is missing, as tests/offline/test_compile_offline.py does."""

from __future__ import annotations

import pytest

from cupa.gpu import offline
from cupa.gpu.device import Target
from llm import fused

TARGETS = ("sm_80", "sm_90", "gfx942", "gfx1100")


@pytest.mark.parametrize("arch", TARGETS)
def test_fused_kernels_compile(arch):
    missing = offline.hip_toolchain_missing(arch) if arch.startswith("gfx") \
        else offline.nvrtc_missing()
    if missing:
        pytest.skip(missing)
    # The offline compilers of cupa's own kernels; they take any source.
    compile_source = offline._compile_clang_hip if arch.startswith("gfx") \
        else offline._compile_nvrtc
    assert compile_source(fused._SOURCE, "llm_fused", Target(arch)) > 0


def test_every_kernel_looked_up_is_defined():
    missing = offline.nvrtc_missing()
    if missing:
        pytest.skip(missing)
    from cupy.cuda import nvrtc
    program = nvrtc.createProgram(fused._SOURCE, "llm_fused.cu", [], [])
    try:
        nvrtc.compileProgram(program, ["--gpu-architecture=sm_90", "-ftz=true"])
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    for name in fused.KERNEL_NAMES:
        assert b"\0" + name.encode() + b"\0" in cubin, name
