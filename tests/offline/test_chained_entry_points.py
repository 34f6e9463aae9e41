"""Every decode kernel launched in a programmatic chain on sm_90 waits for the kernel ahead before
it touches global memory, and allows its dependents only after that wait (start_in_chain in
decode_common.cuh; docs/perf-log.md v25 step 5, v26 step 5). Checked in the PTX NVRTC makes for
sm_90, the order in which the kernels' source issues them, since a phase 1 that read a previous
call's output before its wait, or let the next call in before its own, would race. The
tensor-core phase 1 allows its dependents at one of two places (start_phase1_in_chain,
allow_next_call: at its start, or after its chunks where the plan's next_at_start says so;
docs/perf-log.md v53 step 1).

The same PTX shows the tensor-core kernels' early block ids (early_ids in mma/ring.cuh,
docs/perf-log.md v28 step 6): their first copies from the block table are issued before the
sequence's length is loaded, so that the two round trips overlap.
"""

import re

import pytest
from amd_emulation_probe import nvrtc_compile
from offline_compile import entry_bodies, need_compiler

from cupa.gpu import catalogue, offline
from cupa.gpu.device import Target

# One variant of each phase-1 kernel family (its entry macro): portable, 8-column, 16-row and
# the 8-column kernel's dense form; each module also holds its dtype's reduce.
VARIANTS = [
    catalogue.DecodeVariant("float16", 128, 8),
    catalogue.DecodeMmaVariant("float16", 128, 8),
    catalogue.DecodeMmaVariant("bfloat16", 64, 16),
    catalogue.DecodeMmaVariant("float16", 64, 8, dense=True),
]
# A PTX line that touches global memory.
GLOBAL_ACCESS = re.compile(r"(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")


@pytest.fixture(scope="module")
def bodies():
    need_compiler(offline.nvrtc_missing())
    options = list(offline.nvrtc_options(Target("sm_90")))
    options.remove("--gpu-architecture=sm_90")  # nvrtc_compile adds it
    found = {}
    for variant in VARIANTS:
        found.update(entry_bodies(nvrtc_compile(catalogue.module_source(variant), options)))
    return found


def accesses_through(lines: list[str], params: set[str]) -> list[tuple[int, str]]:
    """The global accesses among PTX `lines` whose address derives from the kernel parameters
    `params` (a forward taint over registers, from their ld.param), with their line indices."""
    tainted, found = set(), []
    for i, line in enumerate(lines):
        fields = re.findall(r"%\w+|\[\w+\]", line)
        if line.startswith("ld.param") and any(f"[{p}]" in fields for p in params):
            tainted.add(fields[0])
        elif fields and any(f.strip("[]") in tainted for f in fields[1:]):
            if GLOBAL_ACCESS.match(line):
                found.append((i, line))
            tainted.add(fields[0])
    return found


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.partition_name)
def test_entry_points_wait_before_reading_and_allow_dependents_after(bodies, variant):
    for name in variant.entry_names:
        body = bodies[name]
        assert body.count("griddepcontrol.wait") == 1, f"{name}: not one wait a workgroup"
        allows = [m.start() for m in re.finditer("griddepcontrol.launch_dependents", body)]
        tensor_core_phase1 = (name == variant.partition_name
                              and isinstance(variant, catalogue.DecodeMmaVariant))
        assert len(allows) == (2 if tensor_core_phase1 else 1), name
        wait = body.find("griddepcontrol.wait")
        assert wait < allows[0], f"{name}: dependents allowed before the wait"
        if tensor_core_phase1:  # the later allowance follows the chunk loop's last product
            assert body.rfind("mma.sync") < allows[1] < body.rfind("st.global"), (
                f"{name}: the next call is not allowed between the chunks and the output")
        before = [line.strip() for line in body[:wait].splitlines()]
        accesses = [line for line in before if GLOBAL_ACCESS.match(line)]
        if name == variant.partition_name:
            assert not accesses, f"{name}: global accesses before its wait: {accesses}"
            continue
        # The reduce sets up first: it may read the lengths (seq_lens, query_start_loc), which
        # phase 1 never writes, but neither the partials nor the outputs before its wait.
        assert not [a for a in accesses if not a.startswith("ld.")], f"{name}: a store first"
        written = {f"{name}_param_{i}" for i in range(5)}  # out, lse and the three partials
        assert not accesses_through(before, written), f"{name}: reads phase 1's output early"
        assert accesses, f"{name}: the lengths are read in the wait's shadow (pattern stale?)"


def test_sm80_has_no_griddepcontrol():
    """Before sm_90 the instructions are compiled out (the launch path never chains there)."""
    need_compiler(offline.nvrtc_missing())
    options = list(offline.nvrtc_options(Target("sm_80")))
    options.remove("--gpu-architecture=sm_80")
    ptx = nvrtc_compile(catalogue.module_source(VARIANTS[1]), options, arch="sm_80")
    assert "griddepcontrol" not in ptx


# Kernel parameters (CUPA_PARTITION_PARAMS): block_tables is the 10th, seq_lens the 11th.
BLOCK_TABLES, SEQ_LENS = 9, 10


@pytest.mark.parametrize("variant", [v for v in VARIANTS
                                     if isinstance(v, catalogue.DecodeMmaVariant)],
                         ids=lambda v: v.partition_name)
def test_tensor_core_kernels_request_block_ids_before_the_length(bodies, variant):
    name = variant.partition_name
    lines = [line.strip() for line in bodies[name].splitlines()]
    ids = [i for i, line in accesses_through(lines, {f"{name}_param_{BLOCK_TABLES}"})
           if line.startswith("cp.async.ca.shared.global") and ", 4," in line]
    lengths = [i for i, line in accesses_through(lines, {f"{name}_param_{SEQ_LENS}"})
               if line.startswith("ld.global")]
    assert ids and lengths, f"{name}: no id copy or no length load found"
    assert ids[0] < lengths[0], f"{name}: the first block ids are requested after the length"
