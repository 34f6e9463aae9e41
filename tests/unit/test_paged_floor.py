"""tools/paged_floor.py's parts that need no GPU: the shifts its floor kernel takes for a block's
16-byte units, and the shared memory that sets its residency."""

from __future__ import annotations

import pytest

from tool_module import tool_module


@pytest.mark.parametrize("value, shift", [(1, 0), (16, 4), (256, 8), (512, 9)])
def test_a_power_of_two_gives_its_shift(value, shift):
    assert tool_module("paged_floor").log2_exact(value, "units") == shift


@pytest.mark.parametrize("value", [0, -16, 3, 24, 96])
def test_anything_else_is_refused_by_name(value):
    with pytest.raises(ValueError, match="units: a power of two"):
        tool_module("paged_floor").log2_exact(value, "units")


@pytest.mark.parametrize("per_sm", [1, 2])
def test_per_sm_workgroups_fit_a_multiprocessor_and_one_more_does_not(per_sm):
    tool = tool_module("paged_floor")
    kb = tool.shared_bytes(per_sm) // 1024 + 1  # with the workgroup's own kilobyte
    assert per_sm * kb <= tool.SM_SHARED_KB < (per_sm + 1) * kb
    assert tool.shared_bytes(per_sm) >= tool.RING_BYTES == 96 << 10


def test_a_residency_whose_share_cannot_hold_the_ring_is_refused():
    with pytest.raises(ValueError, match="per_sm: at most 2, got 3"):
        tool_module("paged_floor").shared_bytes(3)
