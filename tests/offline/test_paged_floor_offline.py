"""tools/paged_floor.py's floor kernels compile (NVRTC, sm_90) for the (block, KV head) regions
of every head size the tensor-core kernels serve, powers of two or not, and the unit -> block
arithmetic is a multiply by a constant, never a division: BLOCK_UNITS (and chunk_floor's row
layout) is compiled in, so the floor's copies cost no more integer work at head 96 than at head
128. Without NVRTC this skips; in CI (CI set) it fails."""

from __future__ import annotations

import re

import pytest

from amd_emulation_probe import nvrtc_compile
from cupa.gpu import offline
from offline_compile import need_compiler
from tool_module import tool_module


@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("block_size", [16, 32])
def test_the_floor_kernel_compiles_for_any_region_without_a_division(head_size, block_size):
    need_compiler(offline.nvrtc_missing())
    units = block_size * head_size * 2 // 16  # a 16-bit cache's 16-byte units of one region
    tool = tool_module("paged_floor")
    row_units = head_size * 2 // 16
    rows, stages = tool.chunk_layout(row_units)
    for spread, stand_in in ((0, []), (1, []), (0, ["-DSMEM_READS=12", "-DWORK_CYCLES=2000"])):
        ptx = nvrtc_compile(tool.FLOOR_SOURCE, [
            "-std=c++17", f"-DBLOCK_UNITS={units}", f"-DCHUNK={tool.CHUNK_TOKENS}",
            f"-DMAX_IDS={tool.CHUNK_MAX_IDS}", f"-DROW_UNITS={row_units}",
            f"-DROWS_PER_PASS={rows}", f"-DSTAGES={stages}", f"-DSPREAD={spread}"] + stand_in)
        assert ".entry paged_floor" in ptx and ".entry chunk_floor" in ptx
        assert not re.search(r"\b(div|rem)\.[su]", ptx), "an integer division in a floor kernel"
