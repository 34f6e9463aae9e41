"""compute-sanitizer over every kernel family (tools/sanitizer_probe.py): 0 errors and 0 race
hazards under each tool. Skips without a GPU or without compute-sanitizer (NVIDIA only).

Under CUPA_EMULATE (tools/device_run.sh emulated-sanitizer) the probe runs the emulated AMD
builds: at EMULATED_TARGETS with CUPA_KERNEL=auto (the probe runs the portable kernel itself),
under the tools that see what the emulation adds (wavefront exchanges through shared memory,
wave64's mbarriers): memcheck, racecheck and synccheck."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cupa.arrays import gpu_available

PROBE = Path(__file__).resolve().parents[2] / "tools" / "sanitizer_probe.py"
SANITIZER = shutil.which("compute-sanitizer")
pytestmark = [pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU"),
              pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer is not on PATH")]
TOOLS = {"memcheck": [], "racecheck": ["--racecheck-report", "all"], "initcheck": [],
         "synccheck": []}
EMULATED_TARGETS = ("gfx942", "gfx1100", "gfx1201")  # wave64 MFMA, wave32 WMMA of RDNA3, RDNA4
EMULATED_TOOLS = ("memcheck", "racecheck", "synccheck")


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_kernel_family_is_clean(tool):
    emulated = os.environ.get("CUPA_EMULATE")
    if emulated and (emulated not in EMULATED_TARGETS or tool not in EMULATED_TOOLS
                     or os.environ.get("CUPA_KERNEL", "auto") != "auto"):
        pytest.skip(f"emulated runs: {EMULATED_TOOLS} at {EMULATED_TARGETS}, matrix-core pairs")
    command = [SANITIZER, "--tool", tool, *TOOLS[tool], "--print-limit", "20", sys.executable,
               str(PROBE)]
    # -lineinfo lets a report name kernel source lines.
    env = dict(os.environ, CUPA_EXTRA_OPTIONS="-lineinfo")
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    report = result.stdout + result.stderr
    assert "probe done" in report, report[-4000:]
    # Where the reports point: kernel source lines (the module's expanded source) and kernels.
    places = sorted(set(re.findall(r"(cupa_\w+)\(.*?\.cu:(\d+)", report)))[:20]
    if tool == "racecheck":
        summary = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                            r"(\d+) warnings?\)", report)
        assert summary is not None, report[-4000:]
        assert summary.groups()[1:] == ("0", "0"), f"{summary.group(0)} at {places}"
    else:
        summary = re.search(r"ERROR SUMMARY: (\d+) error", report)
        assert summary is not None, report[-4000:]
        assert int(summary.group(1)) == 0, f"{summary.group(0)} at {places}\n{report[-6000:]}"
