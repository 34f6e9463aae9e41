"""What a ROCm node collects, selects, compiles, runs and skips, checked here with a simulated ROCm
device: the platform predicate (cupa.platform.is_rocm) overridden and cupa.gpu.device's device
info made from HIP device properties of an MI300X (gfx942, wave64) and an RX 7900 XTX (gfx1100,
wave32), as hipGetDeviceProperties reports them through cupy.

Kernels cannot run here; what is checked is every decision the suite and cupa take from the
platform and the device: device info, compile options, kernel choice and plans, compile targets,
the offline-compile skips, and which GPU tests a ROCm node would skip (a child pytest under
CUPA_SIMULATE_ROCM=1 reports every skip condition; see selection_probe.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cupa import platform
from cupa.gpu import catalogue, device, dispatch, offline
from cupa.gpu.occupancy import resident_workgroups
from cupa.gpu.planner import make_plan
from cupa.problem import (FP8_QUERY_DTYPES, SUPPORTED_DTYPES, SUPPORTED_HEAD_SIZES,
                          DecodeShape)

ROOT = Path(__file__).resolve().parents[2]

# hipDeviceProp_t fields cupa reads, as cupy returns them on ROCm 7.
DEVICES = {
    "gfx942": {"name": b"AMD Instinct MI300X", "gcnArchName": b"gfx942:sramecc+:xnack-",
               "warpSize": 64, "multiProcessorCount": 304, "sharedMemPerBlock": 65536,
               "sharedMemPerMultiprocessor": 65536, "regsPerMultiprocessor": 131072,
               "major": 9, "minor": 4},
    "gfx1100": {"name": b"AMD Radeon RX 7900 XTX", "gcnArchName": b"gfx1100",
                "warpSize": 32, "multiProcessorCount": 48, "sharedMemPerBlock": 65536,
                "sharedMemPerMultiprocessor": 65536, "regsPerMultiprocessor": 131072,
                "major": 11, "minor": 0},
}
# Modules that hold `device_info` by name (imported from cupa.gpu.device).
DEVICE_INFO_USERS = ("cupa.gpu.device", "cupa.gpu.compiler", "cupa.gpu.launch",
                     "cupa.decode_plan")


@pytest.fixture(params=list(DEVICES))
def rocm_device(request, monkeypatch):
    """A simulated ROCm node with one device of the parameter's kind."""
    import importlib
    monkeypatch.setattr(platform, "_override", True)
    info = device.info_from_properties(0, DEVICES[request.param], rocm=platform.is_rocm())
    for name in DEVICE_INFO_USERS:
        monkeypatch.setattr(importlib.import_module(name), "device_info",
                            lambda index=None: info)
    return info


def test_the_predicate_follows_the_override_and_the_environment(monkeypatch):
    monkeypatch.setattr(platform, "_override", None)
    monkeypatch.setenv(platform.SIMULATE_ENV, "1")
    assert platform.is_rocm() is True
    monkeypatch.setenv(platform.SIMULATE_ENV, "0")
    assert platform.is_rocm() is False
    with platform.simulate_rocm():
        assert platform.is_rocm() is True
    assert platform.is_rocm() is False
    monkeypatch.delenv(platform.SIMULATE_ENV)
    assert platform.is_rocm() == platform._cupy_is_hip()


def test_device_info_from_hip_properties(rocm_device):
    arch = rocm_device.target.arch
    warp = DEVICES[arch]["warpSize"]
    assert rocm_device.name == DEVICES[arch]["name"].decode()
    assert rocm_device.target.is_hip and rocm_device.target.warp is None  # the name rule holds
    assert rocm_device.warp_size == rocm_device.target.warp_size == warp
    options = rocm_device.target.runtime_options()
    assert f"-DCUPA_WARP={warp}" in options and "-DCUPA_HIP=1" in options
    assert ("-mwavefrontsize64" if warp == 64 else "-mno-wavefrontsize64") in options
    assert catalogue.THREADS % warp == 0


def test_a_device_warp_size_off_the_name_rule_compiles_for_it_or_is_refused():
    rdna_wave64 = dict(DEVICES["gfx1100"], warpSize=64)
    info = device.info_from_properties(0, rdna_wave64, rocm=True)
    assert info.target.warp_size == 64
    options = info.target.runtime_options()
    assert "-mwavefrontsize64" in options and "-DCUPA_WARP=64" in options
    assert "-mno-wavefrontsize64" not in options
    with pytest.raises(ValueError, match="gfx942 runs wavefronts of 64 only, not 32"):
        device.info_from_properties(0, dict(DEVICES["gfx942"], warpSize=32), rocm=True)


def test_rdna_in_wave64_compiles_to_wave64_kernels(tmp_path):
    """The options of a gfx1100 that reports 64-wide warps give kernels of wavefront 64."""
    if offline.hip_toolchain_missing("gfx1100"):
        pytest.skip(offline.hip_toolchain_missing("gfx1100"))
    info = device.info_from_properties(0, dict(DEVICES["gfx1100"], warpSize=64), rocm=True)
    tools = offline.hip_toolchain("gfx1100")
    src, out = tmp_path / "k.hip", tmp_path / "k.hsaco"
    src.write_text(catalogue.module_source(catalogue.CacheWriteVariant("float16")))
    result = subprocess.run(offline.hip_command(tools, info.target, str(src), str(out)),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert [k.wavefront_size for k in offline.code_object_kernels(tools, str(out))] == [64]


def shapes():
    """The decode problems of the GPU suite's matrices, by shape: dtypes x head sizes x GQA
    groups x new tokens x fp8 caches, with and without a window."""
    for dtype in SUPPORTED_DTYPES:
        for kv_format in (None, "fp8_e4m3", "fp8_e4m3fnuz"):
            if kv_format and dtype not in FP8_QUERY_DTYPES:
                continue
            for head_size in SUPPORTED_HEAD_SIZES:
                for group in (1, 2, 4, 8, 16):
                    for new_tokens, window in ((1, 0), (4, 0), (1, 300)):
                        yield new_tokens, DecodeShape(
                            num_seqs=4, num_tokens=4 * new_tokens, num_heads=2 * group,
                            num_kv_heads=2, head_size=head_size, num_blocks=512, block_size=16,
                            max_blocks_per_seq=128, dtype=dtype, scale=0.1, has_alibi=False,
                            sliding_window=window, multi_token=new_tokens > 1,
                            kv_format=kv_format)


@pytest.mark.parametrize("merge", ["auto", "cluster"])
def test_kernel_choice_and_plans(rocm_device, switch, merge):
    """Every problem plans the matrix-core kernel where it applies (fp16/bf16, head 64/128/256)
    and the portable one elsewhere (no NVIDIA tensor cores, clusters or chained reduce on AMD),
    a variant the offline compile checks for this target, with the planner's residency hook
    asking nothing of a compiler; its workgroup fits the device."""
    switch("CUPA_MERGE", merge)
    arch, info = rocm_device.target.arch, rocm_device
    compiled = set(catalogue.all_variants(arch))
    assert not dispatch.chains_reduce(arch)
    for new_tokens, shape in shapes():
        plan = make_plan(shape, info.multiprocessors, arch=arch, max_query_len=new_tokens,
                         max_seq_len=2048, residency=lambda v: resident_workgroups(v, info))
        v = plan.variant
        matrix = (shape.dtype in catalogue.MATRIX_DTYPES
                  and shape.head_size in catalogue.MATRIX_HEAD_SIZES)
        family = catalogue.DecodeMatrixVariant if matrix else catalogue.DecodeVariant
        assert isinstance(v, family) and v in compiled, (shape, v)
        assert not plan.cluster_merge
        assert v.shared_bytes <= info.shared_memory_per_block
        assert plan.head_chunks * v.rows >= shape.group * new_tokens


def test_the_gpu_suites_own_selection_helpers(rocm_device, rng):
    """Helpers the GPU tests branch on, run against the simulated device."""
    import test_gpu_decode
    from cases import make_case
    test_gpu_decode.test_tensor_core_kernel_is_chosen_where_it_applies()
    case = make_case(rng, dtype="float16", head_size=128, group=8)
    # the matrix-core kernel, and the portable one beside it
    assert test_gpu_decode.kernel_modes(case) == ("auto", "portable")
    case = make_case(rng, dtype="float32", head_size=128, group=8)
    assert test_gpu_decode.kernel_modes(case) == ("auto",)  # fp32: the portable kernel only


def test_compile_targets_and_offline_skips_on_rocm(monkeypatch):
    import test_compile_offline
    from cupa.__main__ import _default_targets
    monkeypatch.setattr(platform, "_override", True)
    assert offline.targets_by_default() == offline.HIP_TARGETS
    assert "ROCm build" in offline.nvrtc_missing()
    usable, notes = _default_targets()
    assert not [t for t in usable if t.startswith("sm_")]
    assert not [n for n in notes if n.startswith("sm_")]  # not even a note: not a default
    # The NVRTC-only tests skip on ROCm, in CI too (absent by design, not missing).
    monkeypatch.setattr(test_compile_offline, "IN_CI", True)
    with pytest.raises(pytest.skip.Exception, match="ROCm build"):
        test_compile_offline.require_compilers([test_compile_offline.nvrtc_missing()])
    with pytest.raises(pytest.skip.Exception):
        test_compile_offline.test_ring_layout_of_the_python_mirror_matches_the_kernels()
    monkeypatch.setattr(platform, "_override", False)
    with pytest.raises(pytest.fail.Exception, match="missing: why"):  # CUDA CI: absence fails
        test_compile_offline.require_compilers(["why"])


def test_cupa_compile_on_rocm_refuses_named_nvidia_targets_quickly():
    env = dict(os.environ, **{platform.SIMULATE_ENV: "1"})
    result = subprocess.run([sys.executable, "-m", "cupa", "compile", "--targets", "sm_90"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 1
    # One line for the whole target, saying why and where to compile it instead.
    lines = [line for line in result.stderr.splitlines() if line.startswith("sm_90: ")]
    assert len(lines) == 1 and "ROCm build" in lines[0] and "where cupy is built for CUDA" in \
        lines[0]
    assert "FAIL" not in result.stdout


def test_hipcc_on_path_is_required_and_explained(monkeypatch, tmp_path):
    monkeypatch.setattr(platform, "_override", True)
    monkeypatch.setenv("PATH", str(tmp_path))
    why = platform.hipcc_missing()
    assert "hipcc is not on PATH" in why and "/opt/rocm/bin" in why
    with pytest.raises(RuntimeError, match="hipcc"):
        platform.require_hipcc()
    hipcc = tmp_path / "hipcc"
    hipcc.write_text("#!/bin/sh\n")
    hipcc.chmod(0o755)
    assert platform.hipcc_missing() is None
    monkeypatch.setattr(platform, "_override", False)
    monkeypatch.setenv("PATH", "")
    assert platform.hipcc_missing() is None  # CUDA: no hipcc needed


def test_info_names_the_hipcc_requirement():
    env = dict(os.environ, **{platform.SIMULATE_ENV: "1"})
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + "/usr/bin:/bin"
    result = subprocess.run([sys.executable, "-m", "cupa", "info"], capture_output=True,
                            text=True, timeout=300, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "built for ROCm/HIP" in result.stdout
    if not any(os.path.exists(os.path.join(p, "hipcc")) for p in ("/usr/bin", "/bin")):
        assert "hipcc on PATH: NO" in result.stdout
    assert "sm_90" not in result.stdout.split("offline compile")[1]


GPU_TEST_FILES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "gpu").glob("test_*.py"))


def selection(tmp_path, rocm: bool) -> dict:
    """Every GPU test item's skip reasons and CUDA-only uses, collected by a child pytest that
    believes it runs on ROCm (or on CUDA)."""
    report = tmp_path / f"selection-{'rocm' if rocm else 'cuda'}.json"
    env = dict(os.environ, **{platform.SIMULATE_ENV: "1" if rocm else "0",
                              "CUPA_SELECTION_REPORT": str(report)})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *(str(ROOT / "tests" / d) for d in
                                                      ("helpers", "unit", "gpu", "offline")),
                                         env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                             "-p", "selection_probe", "-p", "no:cacheprovider", *GPU_TEST_FILES],
                            capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(report.read_text())


def test_gpu_tests_a_rocm_node_would_skip(tmp_path):
    """On ROCm exactly the tests that use a CUDA-only facility skip, each saying why; the same
    tests run on CUDA. A new test that uses one without a ROCm skip fails here."""
    on_rocm, on_cuda = selection(tmp_path, rocm=True), selection(tmp_path, rocm=False)
    assert on_rocm.keys() == on_cuda.keys() and len(on_rocm) > 100

    def rocm_skips(report, nodeid):
        return [r for r in report[nodeid]["skips"] if "CUDA-only" in r]

    cuda_only = {n for n, item in on_rocm.items() if item["uses"]}
    skipped = {n for n in on_rocm if rocm_skips(on_rocm, n)}
    assert cuda_only == skipped, {"unmarked": sorted(cuda_only - skipped),
                                  "skipped without a CUDA-only use": sorted(skipped - cuda_only)}
    assert not any(rocm_skips(on_cuda, n) for n in on_cuda)
    # The engine's graph tests skip; the graph GEMM runs on ROCm too (hipBLAS, llm/blas.py).
    graph_tests = {n for n in on_rocm if "test_gpu_examples.py::test_gpu_graph" in n}
    gemm_tests = {n for n in graph_tests if "graph_gemm" in n}
    assert gemm_tests and not gemm_tests & skipped
    assert graph_tests - gemm_tests and graph_tests - gemm_tests <= skipped
    assert len(skipped) >= 8  # the 8 engine graph tests
