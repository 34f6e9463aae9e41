"""The offline compile's spill check (cupa.gpu.offline: CUPA_CHECK_SPILLS, SPILLS_ALLOWED), on
the metadata text llvm-readelf prints; no compiler needed. tests/offline/test_compile_offline.py
runs it on a real code object."""

import pytest

from cupa.gpu import catalogue, offline

NOTES = """Displaying notes found in: .note
  Owner                Data size 	Description
  AMDGPU               0x00000e7e	NT_AMDGPU_METADATA (AMDGPU Metadata)
    AMDGPU Metadata:
        ---
amdhsa.kernels:
  - .agpr_count:     0
    .args:
      - .address_space:  global
        .offset:         0
        .size:           8
        .value_kind:     global_buffer
    .name:           cupa_decode_f16_d128_h8
    .private_segment_fixed_size: 0
    .sgpr_count:     40
    .vgpr_count:     84
    .wavefront_size: 64
  - .agpr_count:     0
    .name:           cupa_reduce_f16_d128
    .private_segment_fixed_size: 36
    .vgpr_count:     40
    .wavefront_size: 64
amdhsa.target:   amdgcn-amd-amdhsa--gfx942
amdhsa.version:
  - 1
  - 2
...
"""


def test_kernels_are_read_from_the_metadata_note():
    assert offline.parse_kernel_notes(NOTES) == [
        offline.KernelCode("cupa_decode_f16_d128_h8", 64, 0),
        offline.KernelCode("cupa_reduce_f16_d128", 64, 36)]
    assert offline.parse_kernel_notes("no metadata here") == []
    with pytest.raises(RuntimeError, match="without.*wavefront_size"):
        offline.parse_kernel_notes(NOTES.replace(".wavefront_size: 64\n  - ", "\n  - ", 1))


def test_a_spill_past_its_allowance_fails_and_names_the_kernel():
    kernels = offline.parse_kernel_notes(NOTES)
    offline.check_spills(kernels, {"cupa_decode_f16_d128_h8": 0, "cupa_reduce_f16_d128": 36},
                         "gfx942")
    offline.check_spills(kernels, {}, "gfx942")  # neither checked
    with pytest.raises(RuntimeError, match=r"gfx942.*\n  cupa_reduce_f16_d128: 36 bytes a lane "
                                           r"\(allowed 0\)"):
        offline.check_spills(kernels, {"cupa_reduce_f16_d128": 0}, "gfx942")


def test_allowances_follow_dispatch():
    """Every kernel of a batch is checked at 0 bytes but the known spills dispatch runs
    (SPILLS_ALLOWED), and a matrix variant with more row tiles than dispatch gives its head
    size on the target is not checked (compiled, never run)."""
    known = catalogue.DecodeMatrixVariant("bfloat16", 112, 1, catalogue.FP8_CACHE)
    never_run = catalogue.DecodeMatrixVariant("float16", 112, 2)  # RDNA3: one tile at 112
    portable = catalogue.DecodeVariant("float16", 128, 1, catalogue.FP8_CACHE)
    allowed = offline.spill_allowances([known, never_run, portable], "gfx1100")
    assert allowed[known.partition_name] == 12
    assert never_run.partition_name not in allowed
    assert allowed[portable.partition_name] == 0
    assert all(name in allowed for name in known.entry_names + portable.entry_names)
    on_cdna = offline.spill_allowances([known, never_run], "gfx942")
    assert on_cdna[known.partition_name] == 0 and on_cdna[never_run.partition_name] == 0
    for (arch, name) in offline.SPILLS_ALLOWED:  # each names a kernel of that target
        assert arch in offline.HIP_TARGETS
        assert any(name in v.entry_names for v in catalogue.all_variants(arch)), name


def test_the_check_is_asked_for_by_its_environment_variable(monkeypatch):
    monkeypatch.delenv(offline.CHECK_SPILLS_ENV, raising=False)
    assert not offline.spill_check_requested()
    monkeypatch.setenv(offline.CHECK_SPILLS_ENV, "0")
    assert not offline.spill_check_requested()
    monkeypatch.setenv(offline.CHECK_SPILLS_ENV, "1")
    assert offline.spill_check_requested()
