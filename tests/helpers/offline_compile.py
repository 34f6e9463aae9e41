"""The suite's offline compile of the kernel variants, started as soon as the tests are collected.

The compile (the representative subset by default, every variant with CUPA_FULL_COMPILE=1) is
most of the suite's CPU time and runs in worker processes. tests/conftest.py starts it right
after collection and moves the tests that read its results to the end of the run, so that the
workers compile while the other tests run in the main process; `results()` waits for it (and
starts it first when nothing did, e.g. when only tests/offline runs).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from cupa.__main__ import start_compile
from cupa.gpu import offline

# The test whose items read results(): conftest moves them last and starts the compile for them.
RESULTS_TEST = ("test_compile_offline.py", "test_variants_compile")

_run = None


def need_compiler(missing: str | None) -> None:
    """Skip a test whose offline compiler is `missing` (None: present); in CI (CI set), where
    .ci/run installs every compiler, fail instead."""
    if missing:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"offline compiler missing: {missing}")


def missing_for(arch: str) -> str | None:
    """Why `arch` cannot be compiled offline here (None: it can)."""
    return (offline.hip_toolchain_missing(arch) if arch.startswith("gfx")
            else offline.nvrtc_missing())


def start() -> None:
    """Submit the compile of every target this machine has compilers for (once)."""
    global _run
    if _run is None:
        usable = [a for a in offline.ALL_TARGETS if not missing_for(a)]
        _run = start_compile(usable, representative=not offline.full_compile_requested())


def run_last_and_start(items: list) -> None:
    """Move the collected items of RESULTS_TEST to the end of `items` (in place) and, if there
    are any, start the compile now, so that it overlaps every test before them."""
    file_name, test_name = RESULTS_TEST
    reading = [item for item in items if Path(str(item.fspath)).name == file_name
               and getattr(item, "originalname", None) == test_name]
    if not reading:
        return
    chosen = set(map(id, reading))
    items[:] = [item for item in items if id(item) not in chosen] + reading
    start()


def results() -> dict:
    """{(variant, arch): (ok, detail)} of the compile, waiting for it to finish."""
    start()
    return _run.results()


def stop() -> None:
    """At the end of the session: drop what was never waited for (a run stopped early by -x or
    a deselection), so that the process does not stay to compile it."""
    if _run is not None:
        _run.cancel()


def entry_bodies(ptx: str) -> dict[str, str]:
    """PTX text of each .entry, by name (from its header to the next entry's)."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\w+)", ptx)]
    ends = [s for s, _ in starts[1:]] + [len(ptx)]
    return {name: ptx[start:end] for (start, name), end in zip(starts, ends)}
