"""cupa's NVIDIA tensor-core kernels (decode_mma.cu: the 8-column and 16-row kernels and their
dense, wide and deep forms) built for the CPU and run there (tests/helpers/decode_on_cpu.py):
the sm_80 and sm_90 builds, their mma.sync, ldmatrix, movmatrix, cp.async, prmt and e4m3
conversions carried out by the runner's shim, planned and launched with cupa's own planner and
arguments, against the float64 reference.

So CI checks the kernels NVIDIA GPUs run, in sessions that have no GPU. A cp.async copy lands
only at its thread's wait (poison until then), and a thread-block cluster's workgroups run
together, each with its own shared memory, for the cluster merge. What this cannot show: the
tensor cores' own rounding, the hardware's timing and memory ordering, and chained launches
(they run one after another here); the GPU suite shows those.
"""

from __future__ import annotations

import pytest

from cupa.gpu import dispatch
from cupa.gpu.catalogue import DecodeMmaVariant

from cases import REL_BOUND, environ, make_case
from cuda_on_cpu import compiler_missing
from decode_on_cpu import (LENGTHS, check_fp8_case, check_fuzz_draws,
                           check_options_together, check_result, check_selftest_sample,
                           decode_on_cpu)

pytestmark = pytest.mark.skipif(compiler_missing() is not None,
                                reason=compiler_missing() or "")

TARGETS = ("sm_80", "sm_90")


# (form, head size, group, new tokens): the form's switches (dispatch.FORM_SWITCHES) make the
# planner pick it on a problem this small; None is the planner's own choice.
FORMS = [(None, 128, 8, None), (None, 64, 4, None), (None, 80, 8, None), (None, 96, 2, None),
         (None, 112, 8, None), (None, 192, 8, None), (None, 256, 8, None), (None, 128, 1, None),
         ("16-row", 128, 16, None), ("16-row", 64, 8, 2), ("16-row", 112, 32, None),
         ("dense", 64, 8, None), ("dense", 128, 8, None), ("wide", 128, 8, None),
         (None, 128, 32, 3)]


@pytest.mark.parametrize("arch", TARGETS)
@pytest.mark.parametrize("form, head_size, group, new_tokens", FORMS)
def test_tensor_core_kernels(rng, arch, form, head_size, group, new_tokens):
    """Planned partitions and 64-token ones (several, merged by the reduce)."""
    dtype = "bfloat16" if head_size in (80, 192) else "float16"
    case = make_case(rng, dtype=dtype, head_size=head_size, num_kv_heads=2, group=group,
                     seq_lens=LENGTHS, new_tokens=new_tokens)
    for partition_size in (None, 64):
        with environ(**dispatch.FORM_SWITCHES.get(form, {})):
            result = decode_on_cpu(arch, *case.args(), **case.options(),
                                   partition_size=partition_size)
        assert isinstance(result.plan.variant, DecodeMmaVariant)
        check_result(result, case, REL_BOUND[dtype])


@pytest.mark.parametrize("head_size, group, new_tokens", [(128, 8, None), (64, 16, None),
                                                      (256, 4, 2)])
def test_cluster_merge(rng, head_size, group, new_tokens):
    """sm_90's merge within thread-block clusters (distributed shared memory): 64-token
    partitions make clusters of 15 workgroups, 128-token ones of 8."""
    case = make_case(rng, head_size=head_size, num_kv_heads=2, group=group,
                     seq_lens=(0, 1, 37, 300, 900), new_tokens=new_tokens)
    for partition_size in (64, 128):
        with environ(CUPA_MERGE="cluster"):
            result = decode_on_cpu("sm_90", *case.args(), **case.options(),
                                   partition_size=partition_size)
        assert result.plan.cluster_merge and result.plan.max_partitions > 1
        check_result(result, case, REL_BOUND["float16"])


@pytest.mark.parametrize("arch", TARGETS)
def test_tensor_core_kernels_options(rng, arch):
    check_options_together(rng, arch, DecodeMmaVariant)


# OCP e4m3 widens by the hardware conversion on sm_89+ (the shim's exact one here), e4m3fnuz and
# sm_80 by the kernels' software widening (prmt); heads 80 and 112 end mid column block.
@pytest.mark.parametrize("arch, fmt, head_size, group", [
    ("sm_90", "fp8_e4m3", 128, 8), ("sm_90", "fp8_e4m3fnuz", 128, 8),
    ("sm_80", "fp8_e4m3", 80, 8), ("sm_90", "fp8_e4m3", 112, 32),
    ("sm_90", "fp8_e4m3fnuz", 256, 16), ("sm_80", "fp8_e4m3fnuz", 64, 4)])
def test_tensor_core_kernels_fp8_cache(rng, arch, fmt, head_size, group):
    check_fp8_case(rng, arch, fmt, head_size, group, DecodeMmaVariant)


FUZZ_DRAWS = 16


def test_fuzz_on_nvidia_targets():
    """The GPU fuzz's random configurations (tests/helpers/fuzz_draws.py) at sm_80 or sm_90
    each, the portable kernel now and then. A fresh seed a run, printed;
    CUPA_FUZZ_SEED=<seed> replays one."""
    check_fuzz_draws(TARGETS, FUZZ_DRAWS)


SELFTEST_SAMPLE = 12  # cases a target a run (CUPA_SELFTEST_CPU_CASES=all: every one)


@pytest.mark.parametrize("arch", TARGETS)
def test_selftest_cases(arch):
    """`python -m cupa selftest`'s cases for the target (every variant dispatch can pick
    there), a random sample a run (decode_on_cpu.check_selftest_sample)."""
    check_selftest_sample(arch, SELFTEST_SAMPLE)
