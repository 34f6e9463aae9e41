"""Every kernel variant compiles for every target, with no GPU: NVRTC for sm_80/sm_90 and
clang -x hip for gfx90a/gfx942/gfx1100/gfx1201; and the tensor-core kernels' ring layout as
cupa.variants states it is the one the source computes. In CI (CI set) a missing compiler
fails."""

import os

import pytest

from cupa.gpu import catalogue
from cupa.problem import SUPPORTED_BLOCK_SIZES
from cupa.__main__ import compile_all
from cupa.gpu.offline import DEFAULT_TARGETS, hip_compiler, hip_include_dir

IN_CI = bool(os.environ.get("CI"))


def nvrtc_missing():
    """Why NVRTC cannot run here, or None."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as exc:
        return f"NVRTC ({exc}); pip install 'cupa[nvrtc]'"
    return None


def missing_compilers():
    """What of NVRTC and clang + HIP headers is missing here (empty when both run)."""
    hip = (None if hip_compiler() and hip_include_dir()
           else "clang + HIP headers; apt-get install clang-19 libamdhip64-dev")
    return [m for m in (nvrtc_missing(), hip) if m]


def require_compilers(missing):
    """Skip when compilers are missing (None entries: present), except in CI, where their
    absence fails."""
    missing = [m for m in missing if m]
    if missing:
        message = "offline compilers missing: " + "; ".join(missing)
        if IN_CI:
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def results():
    require_compilers(missing_compilers())
    return compile_all(DEFAULT_TARGETS)


@pytest.mark.parametrize("target", DEFAULT_TARGETS)
def test_every_variant_compiles(results, target):
    failed = {v.entry_names[0]: detail for (v, t), (ok, detail) in results.items()
              if t == target and not ok}
    compiled = sum(1 for (v, t) in results if t == target)
    assert compiled == len(catalogue.all_variants(target)) > 0
    assert not failed, f"{len(failed)} variants failed on {target}:\n" + "\n".join(
        f"{name}: {detail[:2000]}" for name, detail in list(failed.items())[:3])


def test_ring_layout_of_the_python_mirror_matches_the_kernels():
    """catalogue.DecodeMmaVariant states each tensor-core kernel's dynamic shared memory and steps
    per warp (the planner and the launch use them), variants the largest cluster and validation
    the block sizes a cache may have; the kernel source states them again (KvRing, mma_shared_bytes). The compiler checks
    that both say the same, for every variant."""
    require_compilers([nvrtc_missing()])
    from cupa.gpu.offline import Target, _compile_nvrtc
    mma = catalogue.all_mma_variants()
    checks = []
    for v in mma:
        cache = catalogue._cache_type(v.dtype, v.cache)
        checks += [f"static_assert(cupa::mma_shared_bytes<{cache}, {v.head_size}, {v.heads}>() "
                   f"== {v.shared_bytes}, \"{v.partition_name}: shared bytes\");",
                   f"static_assert(cupa::KvRing<{cache}, {v.head_size}>::WARP_STEPS == "
                   f"{v.warp_steps}, \"{v.partition_name}: steps per warp\");",
                   f"static_assert(cupa::KvRing<{cache}, {v.head_size}>::MAX_BLOCK_SIZE >= "
                   f"{max(SUPPORTED_BLOCK_SIZES)}, \"{v.partition_name}: block sizes\");"]
    checks.append(f"static_assert(cupa::MAX_CLUSTER == {catalogue.MAX_CLUSTER}, \"cluster size\");")
    source = catalogue.batch_source(mma[:1]) + "\n".join(checks) + "\n"
    assert _compile_nvrtc(source, "ring_layout", Target("sm_90")) > 0
