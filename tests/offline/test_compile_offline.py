"""Kernel variants compile for every target with no GPU: NVRTC for sm_80/sm_90 and clang -x hip
(linked against the device libraries) for gfx90a/gfx942/gfx950/gfx1100/gfx1201; the HIP command
line carries what hipRTC would get and the code objects have the wavefront size the kernels were
written for; the tensor-core kernels' ring layout as the catalogue states it is the one the source
computes.

By default the representative subset of variants is compiled (offline.representative_variants);
CUPA_FULL_COMPILE=1 compiles every variant (CI runs that as its own step: `python -m cupa
compile`). In CI (CI set) a missing compiler fails; elsewhere it skips. On ROCm the sm_XX targets
skip (cupy's nvrtc module is hipRTC there).
"""

import os
import subprocess
import types

import offline_compile
import pytest
from amd_emulation_probe import nvrtc_compile
from offline_compile import missing_for

from cupa import platform
from cupa.__main__ import compile_all
from cupa.gpu import catalogue, offline
from cupa.gpu.device import Target
from cupa.problem import SUPPORTED_BLOCK_SIZES

IN_CI = bool(os.environ.get("CI"))


def nvrtc_missing():
    """Why NVRTC cannot run here, or None."""
    return offline.nvrtc_missing()


def hip_missing(arch="gfx942"):
    """What the offline HIP compile of `arch` lacks here, or None."""
    return offline.hip_toolchain_missing(arch)


def missing_compilers():
    """What of NVRTC and the HIP toolchain is missing here (empty when both run)."""
    return [m for m in (nvrtc_missing(), hip_missing()) if m]


def require_compilers(missing):
    """Skip when compilers are missing (None entries: present), except in CI, where their
    absence fails. NVRTC on a ROCm machine is not missing but absent by design: it skips."""
    missing = [m for m in missing if m]
    if missing:
        message = "offline compilers missing: " + "; ".join(missing)
        if IN_CI and not platform.is_rocm():
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def results():
    """Compile results of every target this machine has compilers for, from one parallel run
    started when the tests were collected (offline_compile)."""
    return offline_compile.results()


@pytest.mark.parametrize("target", offline.ALL_TARGETS)
def test_variants_compile(results, target):
    require_compilers([missing_for(target)])
    expected = (catalogue.all_variants(target) if offline.full_compile_requested()
                else offline.representative_variants(target))
    failed = {v.entry_names[0]: detail for (v, t), (ok, detail) in results.items()
              if t == target and not ok}
    compiled = sum(1 for (v, t) in results if t == target)
    assert compiled == len(expected) > 0
    assert not failed, f"{len(failed)} variants failed on {target}:\n" + "\n".join(
        f"{name}: {detail[:2000]}" for name, detail in list(failed.items())[:3])


def test_the_compile_starts_after_collection_and_its_tests_run_last(monkeypatch):
    """run_last_and_start moves the items that read the compile to the end, keeping every
    other item's order, and starts the compile only when such items were collected."""
    started = []
    monkeypatch.setattr(offline_compile, "start", lambda: started.append(True))
    file_name, test_name = offline_compile.RESULTS_TEST

    def item(path, name):
        return types.SimpleNamespace(fspath=path, originalname=name)

    reading = [item(f"tests/offline/{file_name}", test_name) for _ in range(2)]
    others = [item("tests/unit/test_a.py", "test_x"), item(f"tests/offline/{file_name}", "other"),
              item("tests/unit/test_b.py", test_name)]
    items = [others[0], reading[0], others[1], reading[1], others[2]]
    offline_compile.run_last_and_start(items)
    assert items == others + reading and started == [True]
    items = list(others)
    offline_compile.run_last_and_start(items)
    assert items == others and started == [True]


def test_representative_subset_covers_every_kind_of_variant():
    """Every family x dtype x cache kind, its smallest, median and largest head size and every
    row tile appear in the subset of each target; and it is a real subset."""
    for target in offline.ALL_TARGETS:
        every = catalogue.all_variants(target)
        subset = offline.representative_variants(target)
        assert set(subset) <= set(every) and len(subset) < len(every) / 3
        groups = {}
        for v in every:
            groups.setdefault(offline._group_key(v), []).append(v)
        for key, group in groups.items():
            chosen = [v for v in subset if offline._group_key(v) == key]
            assert chosen, (target, key)
            if not hasattr(group[0], "head_size"):
                continue
            heads = sorted({v.head_size for v in group})
            assert {heads[0], heads[len(heads) // 2], heads[-1]} <= {v.head_size for v in chosen}
            assert {v.rows for v in group} == {v.rows for v in chosen}
            assert max(group, key=lambda v: (v.head_size, v.rows)) in chosen
    assert any(isinstance(v, catalogue.DecodeMmaVariant)
               for v in offline.representative_variants("sm_90"))
    assert not any(isinstance(v, catalogue.DecodeMmaVariant)
                   for v in offline.representative_variants("gfx942"))


def test_isa_version_numbers():
    # The values ROCm's device libraries use (oclc_isa_version_90a.bc holds 9010, ..._1036.bc
    # 10306).
    assert [offline.isa_version(a) for a in ("gfx90a", "gfx942", "gfx950", "gfx1036",
                                              "gfx1100", "gfx1201")] == \
        [9010, 9402, 9500, 10306, 11000, 12001]


def test_wavefront_check_refuses_a_mismatch():
    offline.check_wavefront_size([64, 64], Target("gfx942"), "k")
    with pytest.raises(RuntimeError, match="wavefront size \\[64\\].*CUPA_WARP=32"):
        offline.check_wavefront_size([32, 64], Target("gfx1100"), "k")
    with pytest.raises(RuntimeError, match="none found"):
        offline.check_wavefront_size([], Target("gfx1100"), "k")


@pytest.mark.parametrize("arch,warp,flag", [("gfx942", 64, "-mwavefrontsize64"),
                                            ("gfx1100", 32, "-mno-wavefrontsize64")])
def test_hip_command_matches_hiprtc_and_the_code_object_its_wavefront(tmp_path, arch, warp,
                                                                      flag):
    """The offline command carries cupy's hipRTC option, the wavefront option of the target,
    the device libraries and CUPA_WARP; the linked code object's kernels run at that size."""
    require_compilers([hip_missing(arch)])
    tools = offline.hip_toolchain(arch)
    target = Target(arch)
    src, out = str(tmp_path / "k.hip"), str(tmp_path / "k.hsaco")
    command = offline.hip_command(tools, target, src, out)
    for option in ("-fcuda-flush-denormals-to-zero", flag, f"-DCUPA_WARP={warp}",
                   f"--offload-arch={arch}", "--no-gpu-bundle-output", "-O3",
                   f"--rocm-device-lib-path={tools.device_libs}"):
        assert option in command, option
    assert "-nogpulib" not in command and "-S" not in command
    assert os.path.exists(os.path.join(tools.device_libs, f"oclc_isa_version_{arch[3:]}.bc"))
    variant = catalogue.DecodeVariant("float16", 64, 1)
    with open(src, "w") as f:
        f.write(catalogue.module_source(variant))
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    sizes = [k.wavefront_size for k in offline.code_object_kernels(tools, out)]
    assert sizes == [warp] * len(variant.entry_names)


def test_a_kernel_that_spills_past_its_allowance_fails_to_compile():
    """CUPA_CHECK_SPILLS (CI): RDNA3's one tile of bf16 over an fp8 cache at head 112 keeps 12
    bytes a lane in scratch, what SPILLS_ALLOWED allows it and not a byte more."""
    require_compilers([hip_missing("gfx1100")])
    variant = catalogue.DecodeMatrixVariant("bfloat16", 112, 1, catalogue.FP8_CACHE)
    source, target = catalogue.module_source(variant), Target("gfx1100")
    allowed = offline.spill_allowances([variant], "gfx1100")
    assert allowed[variant.partition_name] == 12
    assert offline._compile_clang_hip(source, "spills", target, allowed) > 0
    with pytest.raises(RuntimeError, match=f"{variant.partition_name}: 12 bytes a lane "
                                           r"\(allowed 0\)"):
        offline._compile_clang_hip(source, "spills", target, dict(allowed, **{
            variant.partition_name: 0}))


def test_hip_link_fails_on_a_missing_device_function():
    """A call into the device libraries that they do not define fails the offline compile (as
    the code object load would on the GPU), where an unlinked -S compile would pass."""
    require_compilers([hip_missing("gfx942")])
    source = ('extern "C" __device__ float __ocml_no_such_function_f32(float);\n'
              'extern "C" __global__ void probe(float* x) {\n'
              '    x[threadIdx.x] = __ocml_no_such_function_f32(x[0]) + expf(x[1]);\n}\n')
    with pytest.raises(RuntimeError, match="undefined.*__ocml_no_such_function_f32"):
        offline._compile_clang_hip(source, "missing_function", Target("gfx942"))
    ok = source.replace("__ocml_no_such_function_f32(x[0]) + ", "")
    assert offline._compile_clang_hip(ok, "present_functions", Target("gfx942")) > 0


def test_ring_layout_of_the_python_mirror_matches_the_kernels():
    """catalogue.DecodeMmaVariant states each tensor-core kernel's dynamic shared memory, rows
    and steps per warp (the planner and the launch use them), the catalogue the largest cluster
    and the merge buffer's row stride, and validation the block sizes a cache may have; the
    kernel source states them again (KvRing, mma_shared_bytes, merge_row_floats, and for the
    16-row kernel Mma16Shape, whose query may follow the ring).
    NVRTC checks that both say the same, for every variant, each in a module of its own defines
    (catalogue.module_defines: the wide and deep forms' threads and ring stages; NVIDIA only:
    these kernels do not exist for HIP)."""
    require_compilers([nvrtc_missing()])
    modules: dict = {}
    for v in catalogue.all_mma_variants():
        modules.setdefault(catalogue.module_defines(v), []).append(v)
    assert len(modules) == 3  # the default forms', the wide forms' and the deep forms'
    for mma in modules.values():
        checks = []
        for v in mma:
            cache = catalogue._cache_type(v.dtype, v.cache)
            dense = v.ring_stages if v.dense else 0  # KvRing's DENSE_STAGES
            kernel_bytes = (f"cupa::Mma16Shape<{cache}, {v.head_size}>::BYTES" if v.heads == 16
                            else f"cupa::mma_shared_bytes<{cache}, {v.head_size}, 8, {dense}>()")
            if v.heads == 16:
                checks.append(f"static_assert(cupa::Mma16Shape<{cache}, {v.head_size}>::ROWS == "
                              f"{v.rows}, \"{v.partition_name}: rows\");")
            tile_rows = 8 if v.heads == 8 else 16
            checks.append(f"static_assert(cupa::merge_row_floats<{tile_rows}, {v.head_size}>() == "
                          f"{catalogue.merge_row_floats(tile_rows, v.head_size)}, "
                          f"\"{v.partition_name}: merge buffer rows\");")
            checks += [f"static_assert({kernel_bytes} == {v.shared_bytes}, "
                       f"\"{v.partition_name}: shared bytes\");",
                       f"static_assert(cupa::KvRing<{cache}, {v.head_size}, {dense}>::"
                       f"WARP_STEPS == {v.warp_steps}, \"{v.partition_name}: steps per warp\");",
                       f"static_assert(cupa::KvRing<{cache}, {v.head_size}>::MAX_BLOCK_SIZE >= "
                       f"{max(SUPPORTED_BLOCK_SIZES)}, \"{v.partition_name}: block sizes\");"]
            if v.ring_stages:  # the dense, wide or deep form's own
                checks.append(f"static_assert(cupa::KvRing<{cache}, {v.head_size}, {dense}>::"
                              f"STAGES == {v.ring_stages}, \"{v.partition_name}: stages\");")
        checks.append(f"static_assert(cupa::MAX_CLUSTER == {catalogue.MAX_CLUSTER}, "
                      "\"cluster size\");")
        source = catalogue.batch_source(mma[:1]) + "\n".join(checks) + "\n"
        assert offline._compile_nvrtc(source, "ring_layout", Target("sm_90")) > 0


def fake_hip_tree(root, version=(7, 0)):
    """The smallest include root CUPA_HIPRTC_HEADERS accepts: hip_runtime.h (what it defines
    depends on __HIPCC_RTC__), hip_bfloat16.h, hip_version.h and the appended headers."""
    hip = root / "hip"
    (hip / "amd_detail").mkdir(parents=True)
    (hip / "hip_version.h").write_text(f"#define HIP_VERSION_MAJOR {version[0]}\n"
                                       f"#define HIP_VERSION_MINOR {version[1]}\n")
    (hip / "hip_runtime.h").write_text(
        "#ifdef __HIPCC_RTC__\nint rtc_mode_seen;\n#endif\n"
        "int hip_version_seen[HIP_VERSION_MAJOR * 100 + HIP_VERSION_MINOR];\n")
    (hip / "hip_bfloat16.h").write_text("")
    for name in offline.RTC_APPENDED_HEADERS:
        (hip / name).write_text(f"// appended {name}\n")
    return root


def test_hiprtc_header_is_made_like_hiprtcs_own(tmp_path, monkeypatch):
    """With CUPA_HIPRTC_HEADERS the offline compile includes a hiprtc_runtime.h made from that
    tree (preprocessed in RTC mode, the macros, the device headers appended) and compiles in
    hipRTC's mode."""
    require_compilers([hip_missing("gfx942")])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = fake_hip_tree(tmp_path / "hip-tree")
    monkeypatch.setenv(offline.RTC_HEADERS_ENV, str(root))
    tools = offline.hip_toolchain("gfx942")
    text = open(tools.rtc_header).read()
    assert "int rtc_mode_seen;" in text and "hip_version_seen[7 * 100 + 0]" in text
    assert "#define __global__ __attribute__((global))" in text
    assert text.index("#define __global__") < text.index("// appended hip_common.h") \
        < text.index("// appended amd_detail/amd_math_functions.h")
    command = offline.hip_command(tools, Target("gfx942"), "k.hip", "k.hsaco")
    assert command[command.index("-include") + 1] == tools.rtc_header
    assert "-D__HIPCC_RTC__" in command and "hip/hip_runtime.h" not in command
    assert not any(part.endswith("hip.bc") for part in command)


def test_missing_hip_version_is_explained(tmp_path, monkeypatch):
    root = fake_hip_tree(tmp_path / "hip-tree")
    (root / "hip" / "hip_version.h").unlink()
    with pytest.raises(offline.CompilerMissing, match="hip_version.h"):
        offline._hip_version(str(root))


@pytest.mark.skipif(not os.environ.get(offline.RTC_HEADERS_ENV),
                    reason=f"{offline.RTC_HEADERS_ENV} not set (a ROCm HIP + clr header tree)")
def test_representative_variants_compile_with_the_hiprtc_header():
    require_compilers([hip_missing("gfx942")])
    results = compile_all(offline.HIP_TARGETS, progress=False, representative=True)
    failed = [(v.entry_names[0], t, d[:1500]) for (v, t), (ok, d) in results.items() if not ok]
    assert results and not failed, failed[:2]


def _ptx_of(variant, arch="sm_90"):
    options = [*Target(arch).runtime_options(), *offline.CUPY_NVRTC_OPTIONS]
    return nvrtc_compile(catalogue.batch_source([variant]), options, arch)


def test_phase_stamps_build_only_when_asked(monkeypatch):
    """tools/phase_stamps.py's build (-DCUPA_PHASE_STAMPS through CUPA_EXTRA_OPTIONS) gives both
    tensor-core kernels their stamp table and marks (a clock read per phase mark, the global
    timer at the start and end); the default build has neither (its one global-timer read
    is the first wave's stagger, ring.cuh)."""
    require_compilers([nvrtc_missing()])
    kernels = [v for v in catalogue.all_mma_variants()
               if v.tag == "f16" and v.head_size == 128]
    assert {v.heads for v in kernels} == {8, 16}
    for variant in kernels:
        monkeypatch.delenv("CUPA_EXTRA_OPTIONS", raising=False)
        plain = _ptx_of(variant)
        monkeypatch.setenv("CUPA_EXTRA_OPTIONS", "-DCUPA_PHASE_STAMPS")
        stamped = _ptx_of(variant)
        assert "cupa_phase_stamps" not in plain
        assert "cupa_phase_stamps" in stamped
        assert stamped.count("%globaltimer") > plain.count("%globaltimer")
        assert stamped.count("%clock64") >= 8 > plain.count("%clock64")
