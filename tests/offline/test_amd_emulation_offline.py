"""cupa/kernels/amd_emulation.cuh compiles, with no GPU: emulated (NVRTC, sm_90) for each AMD
target at its wavefront size, inert on plain NVIDIA builds, and, compiled for the real AMD
targets by clang -x hip, its wrappers emit exactly the instructions whose tables the emulation
follows. In CI (CI set) a missing compiler fails instead of skipping."""

from __future__ import annotations

import re

import pytest

from cupa.gpu import catalogue, offline
from cupa.gpu.catalogue import expanded_source
from cupa.gpu.compiler import emulation_scratch_bytes
from cupa.gpu.device import Target

import amd_layouts as L
from amd_emulation_probe import (HEADER, TARGETS, THREADS, emulated_options, hip_clang,
                                 hip_compile, nvrtc_compile, nvrtc_missing, source,
                                 wrappers_of)
from offline_compile import entry_bodies, need_compiler
from tool_module import tool_module


@pytest.fixture
def nvrtc():
    need_compiler(nvrtc_missing())


def header_text():
    return HEADER.read_text().replace("#pragma once", "")


def nvidia_options(warp=32):
    return ["-DCUPA_HIP=0", f"-DCUPA_WARP={warp}", f"-DCUPA_THREADS={THREADS}", "--std=c++17"]


@pytest.mark.parametrize("gfx", sorted(TARGETS))
def test_emulated_build_compiles(nvrtc, gfx):
    """Every wrapper of the target and the wavefront operations, through NVRTC and ptxas."""
    ptx = nvrtc_compile(source(gfx), emulated_options(gfx))
    for wrapper in wrappers_of(gfx):
        assert f"probe_{wrapper}" in ptx
    if TARGETS[gfx][0] == 64:
        # wave64: an mbarrier per wavefront, set up in each kernel before its first arrival;
        # no named barriers (racecheck misreads them: docs/amd_emulation.md, "Under
        # compute-sanitizer")
        for name, body in entry_bodies(ptx).items():
            init, arrive = body.find("mbarrier.init"), body.find("mbarrier.arrive")
            assert 0 <= init < arrive and "mbarrier.test_wait" in body, name
        assert not re.search(r"bar(rier)?\.sync\s+%?\w+, \d+;", ptx)
    else:
        assert "bar.sync" not in ptx and "barrier.sync" not in ptx


@pytest.mark.parametrize("variant", [
    catalogue.DecodeVariant("float16", 128, 8),
    catalogue.DecodeMatrixVariant("bfloat16", 128, 2),
    catalogue.DecodeMatrixVariant("float16", 64, 1, catalogue.FP8_AMD_NATIVE),
], ids=lambda v: v.partition_name)
def test_wave64_decode_kernels_set_up_their_barriers(nvrtc, variant):
    """Emulated gfx942, as cupa compiles it: each phase-1 kernel initialises its wavefronts'
    mbarriers (begin_partition's begin_workgroup) before any wavefront exchange."""
    options = [*Target("gfx942", emulated=True).runtime_options(), *offline.CUPY_NVRTC_OPTIONS]
    body = entry_bodies(nvrtc_compile(catalogue.module_source(variant), options))[
        variant.partition_name]
    init, arrive = body.find("mbarrier.init"), body.find("mbarrier.arrive")
    assert 0 <= init < arrive, "an exchange before the barriers are set up"


@pytest.mark.parametrize("kind", sorted(tool_module("racecheck_barriers").KINDS))
def test_racecheck_barrier_tool_builds(nvrtc, kind):
    """tools/racecheck_barriers.py (the evidence for the mbarrier above) builds every kind in
    the emulated wave64 build, and only its mbarrier kind exchanges (through the emulation)."""
    tool = tool_module("racecheck_barriers")
    ptx = nvrtc_compile(tool.source(kind), list(tool.OPTIONS))
    assert ("mbarrier.arrive" in ptx) == (kind == "mbarrier")
    named = re.search(r"\bbar\.sync\s+%r\d+, 64;", ptx) is not None
    assert named == kind.startswith("bar.sync")


@pytest.mark.parametrize("emulate", [None, "0x942", "0x1100"])
def test_common_carries_the_header(nvrtc, emulate):
    """common.cuh includes the header: emulated or on plain NVIDIA, its warp helpers build (and
    route through the emulation when emulating)."""
    parts = [expanded_source("common.cuh")]
    kernel = """
extern "C" __global__ void k(float* x) {
    begin_workgroup();
    float v = x[threadIdx.x];
#if CUPA_EMULATE_AMD
    v = emu_wave_sum(v) + warp_sum(v);
#else
    v = warp_sum(v);
#endif
    x[threadIdx.x] = v;
}
"""
    if emulate:
        warp = 64 if emulate == "0x942" else 32
        options = ["-DCUPA_EMULATE_AMD=1", f"-DCUPA_EMULATE_GFX={emulate}"] + nvidia_options(warp)
    else:
        options = nvidia_options()
    nvrtc_compile("\n".join(parts) + kernel, options)


def test_plain_nvidia_build_has_no_wrappers(nvrtc):
    src = header_text() + """
#if CUPA_AMD_MFMA || CUPA_AMD_MFMA_FP8 || CUPA_AMD_WMMA_GFX11 || CUPA_AMD_WMMA_GFX12
#error "an NVIDIA build has no AMD matrix instructions"
#endif
static_assert(CUPA_EMU_SCRATCH_BYTES == 0, "no scratch");
"""
    nvrtc_compile(src, nvidia_options())


@pytest.mark.parametrize("gfx", sorted(TARGETS))
def test_scratch_and_lds_limit(nvrtc, gfx):
    scratch = emulation_scratch_bytes(TARGETS[gfx][0])
    ok = header_text() + f"""
static_assert(CUPA_EMU_SCRATCH_BYTES == {scratch}, "scratch bytes");
static_assert(AMD_LDS_BYTES == 65536, "64 KiB");
CUPA_ASSERT_AMD_LDS(65536);
"""
    nvrtc_compile(ok, emulated_options(gfx))
    with pytest.raises(RuntimeError, match="64 KiB"):
        nvrtc_compile(header_text() + "CUPA_ASSERT_AMD_LDS(65536 + 4);\n", emulated_options(gfx))


def test_lds_assert_is_a_no_op_on_nvidia(nvrtc):
    nvrtc_compile(header_text() + "CUPA_ASSERT_AMD_LDS(200 * 1024);\n", nvidia_options())


@pytest.mark.parametrize("options, message", [
    (["-DCUPA_EMULATE_AMD=1", "-DCUPA_EMULATE_GFX=0x942", "-DCUPA_HIP=0", "-DCUPA_WARP=32"],
     "CUPA_WARP does not match"),
    (["-DCUPA_EMULATE_AMD=1", "-DCUPA_EMULATE_GFX=0x1201", "-DCUPA_HIP=0", "-DCUPA_WARP=64"],
     "CUPA_WARP does not match"),
    (["-DCUPA_EMULATE_AMD=1", "-DCUPA_EMULATE_GFX=0x908", "-DCUPA_HIP=0", "-DCUPA_WARP=64"],
     "one of 0x90a"),
    (["-DCUPA_EMULATE_AMD=1", "-DCUPA_HIP=1", "-DCUPA_WARP=64"], "needs CUPA_HIP=0"),
])
def test_bad_configurations_are_refused(nvrtc, options, message):
    with pytest.raises(RuntimeError, match=message):
        nvrtc_compile(header_text(), options + [f"-DCUPA_THREADS={THREADS}", "--std=c++17"])


def test_default_emulated_targets(nvrtc):
    """Without CUPA_EMULATE_GFX, wave64 is gfx942 and wave32 gfx1100."""
    check = header_text() + """
#if CUPA_WARP == 64 && !(CUPA_AMD_MFMA && CUPA_AMD_MFMA_FP8 && !CUPA_AMD_WMMA_GFX11)
#error "wave64 default"
#endif
#if CUPA_WARP == 32 && !(CUPA_AMD_WMMA_GFX11 && !CUPA_AMD_WMMA_GFX12 && !CUPA_AMD_MFMA)
#error "wave32 default"
#endif
"""
    for warp in (64, 32):
        nvrtc_compile(check, ["-DCUPA_EMULATE_AMD=1"] + nvidia_options(warp))


@pytest.mark.parametrize("gfx", sorted(TARGETS))
def test_real_amd_build_emits_the_tabled_instructions(gfx):
    """Compiled for the real target, the wrappers are AMD's builtins, and the instructions in
    the assembly are exactly those of the tables the emulation follows (no more: a wrapper
    that does not exist on a target is not defined there)."""
    need_compiler(None if hip_clang()
                  else "clang + HIP headers (apt-get install clang-19 libamdhip64-dev)")
    asm = hip_compile(source(gfx, wave_ops=False), gfx)
    emitted = set(re.findall(r"\bv_(?:mfma|wmma|smfmac|swmmac)\w*", asm))
    assert emitted == {L.load(t).instruction for t in wrappers_of(gfx).values()}


@pytest.mark.parametrize("gfx", sorted(TARGETS))
def test_real_amd_build_with_common(gfx):
    need_compiler(None if hip_clang()
                  else "clang + HIP headers (apt-get install clang-19 libamdhip64-dev)")
    src = expanded_source("common.cuh") + """
extern "C" __global__ void k(float* x) { x[threadIdx.x] = warp_sum(x[threadIdx.x]); }
"""
    hip_compile(src, gfx)
