"""tools/paged_floor.py's parts that need no GPU: the shift its floor kernel takes for the block
size, and the shared memory that sets its residency (its source compiling for every head size:
tests/offline/test_paged_floor_offline.py)."""

from __future__ import annotations

import pytest

from tool_module import tool_module


@pytest.mark.parametrize("value, shift", [(1, 0), (16, 4), (32, 5), (512, 9)])
def test_a_power_of_two_gives_its_shift(value, shift):
    assert tool_module("paged_floor").log2_exact(value, "block size") == shift


@pytest.mark.parametrize("value", [0, -16, 3, 24, 96])
def test_anything_else_is_refused_by_name(value):
    with pytest.raises(ValueError, match="block size: a power of two"):
        tool_module("paged_floor").log2_exact(value, "block size")


@pytest.mark.parametrize("per_sm", [1, 2])
def test_per_sm_workgroups_fit_a_multiprocessor_and_one_more_does_not(per_sm):
    tool = tool_module("paged_floor")
    kb = tool.shared_bytes(per_sm) // 1024 + 1  # with the workgroup's own kilobyte
    assert per_sm * kb <= tool.SM_SHARED_KB < (per_sm + 1) * kb
    assert tool.shared_bytes(per_sm) >= tool.RING_BYTES == 96 << 10


def test_a_residency_whose_share_cannot_hold_the_ring_is_refused():
    with pytest.raises(ValueError, match="per_sm: at most 2, got 3"):
        tool_module("paged_floor").shared_bytes(3)


@pytest.mark.parametrize("head_size, rows, stages", [
    (64, 16, 4), (80, 8, 4), (96, 8, 4), (112, 8, 3), (128, 8, 3), (256, 4, 2)])
def test_the_chunk_floor_takes_kvrings_rows_a_pass_and_stages(head_size, rows, stages):
    """Rows a pass and ring stages as KvRing computes them for a 16-bit row at its own width
    (cupa/kernels/mma/ring.cuh: 8 rows where a row's units do not divide the 128 threads; 4, 3
    or 2 stages as a 64-token chunk of K is up to 12 KB, under 32 KB or larger)."""
    assert tool_module("paged_floor").chunk_layout(head_size * 2 // 16) == (rows, stages)


def test_a_row_kvring_never_stages_is_refused():
    """Head 192's 24-unit rows: cupa stages them at 256, and 5 rows a pass would miss 4 of a
    64-token chunk's."""
    with pytest.raises(ValueError, match="no KvRing layout for rows of 24 units"):
        tool_module("paged_floor").chunk_layout(24)


def test_a_stand_in_is_two_whole_numbers():
    assert tool_module("paged_floor").stand_in("12,2000") == (12, 2000)


@pytest.mark.parametrize("text", ["12", "12,2000,3", "a,1", "1.5,2", "-1,0", "0,-5"])
def test_anything_else_is_refused_as_a_stand_in(text):
    with pytest.raises(ValueError, match="--stand-in"):
        tool_module("paged_floor").stand_in(text)
