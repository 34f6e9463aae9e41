"""`python -m cupa selftest`'s own GPU runner on this GPU: every case of its matrix (each variant
the planner can launch here, the 16-row kernel and on sm_90 the dense and wide forms forced past
their size rules) against the float64 oracle, and the command's table and exit code. Under
CUPA_EMULATE the matrix is the emulated AMD target's. Skips without a GPU."""

from __future__ import annotations

import argparse
import dataclasses
import io

import numpy as np
import pytest

from cupa import selftest
from cupa.arrays import gpu_available
from cupa.gpu import dispatch

pytestmark = pytest.mark.skipif(not gpu_available(), reason="needs cupy and a GPU")


def device_cases() -> list:
    """The selftest's cases for this GPU (none without one: the module is skipped)."""
    if not gpu_available():
        return []
    from cupa.gpu.device import device_info
    return selftest.cases_for(device_info().target.arch)


CASES = device_cases()


def case_id(case) -> str:
    return f"{case.kernel}-{case.kv_format or 'same'}-rows{case.rows}"


@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_each_selftest_case_is_within_its_bound(case, rng):
    outcome = selftest.run_on_gpu(case, rng)
    assert outcome.failure is None, outcome.failure
    assert len(outcome.errors) == 2  # the planner's partitions and the forced short ones
    assert selftest.passed(case, outcome), (outcome.errors, case.bound)


def test_the_command_runs_its_cases_and_exits_0():
    # The grid-size forms where this GPU has them (switches forced for the case only), else the
    # first case's kernel: one command run end to end, table and exit code.
    forms = [c for c in CASES if c.form]
    chosen = forms[0] if forms else CASES[0]
    before = dataclasses.astuple(dispatch.switches())
    out = io.StringIO()
    assert selftest.main(argparse.Namespace(kernel=chosen.kernel), out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("cupa selftest on device ")
    rows = [line for line in lines if line.startswith(chosen.kernel)]
    assert rows and all(line.split()[-1] == "ok" for line in rows)
    assert lines[-1] == f"{len(rows)}/{len(rows)} cases within bounds"
    assert dataclasses.astuple(dispatch.switches()) == before  # the form's switches restored
