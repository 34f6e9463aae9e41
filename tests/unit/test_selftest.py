"""`python -m cupa selftest` and selftest.check_variant_once, on the CPU: the no-GPU exit, the case
matrix, the table and exit codes with fake runners, and the on-disk cache of variant checks."""

import argparse
import io
import json
import warnings
import subprocess
import sys

import numpy as np
import pytest

import cupa
from cupa import selftest
from cupa.arrays import gpu_available
from cupa.gpu import catalogue, dispatch
from cupa.gpu.device import info_from_properties
from cupa.gpu.planner import make_plan
from cupa.reference import paged_decode_reference
from cupa.validation import check_decode_args

from cases import REL_BOUND
from test_gpu_fp8_decode import FP8_REL_BOUND


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU message")
def test_selftest_without_gpu_says_so_and_exits_2():
    result = subprocess.run([sys.executable, "-m", "cupa", "selftest"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == selftest.NOTHING_TESTED_EXIT == 2
    assert "needs a GPU" in result.stderr and "no GPU" in result.stderr


def test_bounds_are_the_test_suites():
    assert selftest.REL_BOUND == REL_BOUND
    assert selftest.FP8_REL_BOUND == FP8_REL_BOUND


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "gfx942", "gfx1100"])
def test_cases_reach_every_variant_dispatch_can_pick(arch):
    cases = selftest.cases_for(arch)
    keys = [(c.variant, c.kv_format) for c in cases]
    assert len(keys) == len(set(keys))
    for c in cases:  # each case's problem reaches its variant, with the fewest rows that do;
        # a dense or wide case's variant is a form of the variant its problem reaches
        own = dispatch.decode_variant(c.dtype, c.head_size, c.rows, arch, c.kv_format)
        assert own == c.variant or c.variant in selftest.grid_forms(
            selftest.Case(c.dtype, c.head_size, c.rows, c.kv_format, own), arch)
        assert c.rows == 1 or dispatch.decode_variant(c.dtype, c.head_size, c.rows - 1, arch,
                                                      c.kv_format) != own
    variants = {c.variant for c in cases}
    if arch.startswith("gfx"):  # the matrix-core variants, and portable ones where they stop
        matrix = {v for v in catalogue.all_decode_variants()
                  if v.dtype in catalogue.MATRIX_DTYPES
                  and v.head_size in catalogue.MATRIX_HEAD_SIZES}
        reachable = {v for v in catalogue.all_variants(arch)
                     if isinstance(v, catalogue.DecodeMatrixVariant)
                     and (v.tiles == catalogue.matrix_tiles(32, v.head_size, arch)
                          or v.tiles == 1)}
        assert variants == (set(catalogue.all_decode_variants()) - matrix) | reachable
    else:  # every tensor-core variant dispatch picks by default (on sm_90 the deep form in
        # place of the 2-stage ring); the grid-size forms (sm_90) as forced cases
        assert {v for v in variants if isinstance(v, catalogue.DecodeMmaVariant)} == {
            v for v in catalogue.all_mma_variants()
            if (v.cache != catalogue.FP8_E4M3_NATIVE or arch != "sm_80")
            and (arch == "sm_90" or not (v.dense or v.wide))
            and v.deep == (arch == "sm_90" and (v.cache, v.head_size) in catalogue.DEEP_KINDS)}
    # Every dtype, cache kind (both fp8 formats), head size and row tile is in the matrix.
    assert {(c.dtype, c.kv_format) for c in cases} == {
        ("float32", None), *((d, f) for d in ("float16", "bfloat16")
                             for f in (None, "fp8_e4m3", "fp8_e4m3fnuz"))}
    assert {c.head_size for c in cases} == set(cupa.problem.SUPPORTED_HEAD_SIZES)


@pytest.mark.parametrize("arch, multiprocessors", [("sm_90", 132), ("sm_90", 8), ("sm_80", 108),
                                                    ("gfx942", 304), ("gfx1100", 48)])
def test_every_case_plans_its_variant_on_the_selftest_problem(arch, multiprocessors, switch):
    # What run_on_gpu plans, on the CPU: the case's forced size rule (the 16-row kernel, the
    # dense and wide forms) overrides a user's switches, which are back after it.
    switch("CUPA_WIDE", "never")
    switch("CUPA_DENSE", "never")
    switch("CUPA_ROW_CHUNKS", "always")
    cases = selftest.cases_for(arch)
    forms = {"sm_90": {None, "16-row", "dense", "wide"}, "sm_80": {None, "16-row"}}
    assert {c.form for c in cases} == forms.get(arch, {None})
    for case in cases:
        problem = selftest.make_problem(case, np.random.default_rng(0))
        args = [problem[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                     "seq_lens")]
        pages = selftest.nhd_pages(args[1], args[2])
        for partition_size, kv_layout in selftest.RUNS:
            if kv_layout == "NHD":
                args[1:3] = pages[:, 0], pages[:, 1]
            shape = check_decode_args(*args, kv_format=problem["options"].get("kv_format"),
                                      kv_layout=kv_layout)
            assert (shape.kv_strides is None) == (kv_layout == "HND")
            with dispatch.switches_set(dispatch.FORM_SWITCHES.get(case.form, {})):
                plan = make_plan(shape, multiprocessors, arch=arch,
                                 partition_size=partition_size,
                                 max_seq_len=max(selftest.SEQ_LENS))
            assert plan.variant == case.variant, case
            assert partition_size is None or plan.max_partitions > 1  # the merge runs too
    switches = dispatch.switches()
    assert (switches.wide, switches.dense, switches.row_chunks) == ("never", "never", "always")


def numpy_runner(case, rng):
    """The selftest's own problem through cupa's numpy backend: a real computation on the CPU."""
    problem = selftest.make_problem(case, rng)
    key_ref, value_ref = problem["reference_caches"]
    args = [problem[k] for k in ("query", "key_cache", "value_cache", "block_tables",
                                 "seq_lens")]
    ref, _ = paged_decode_reference(problem["query"], key_ref, value_ref,
                                    problem["block_tables"], problem["seq_lens"])
    out = cupa.decode(*args, **problem["options"], backend="numpy")
    return selftest.Outcome(errors={"1 partition": selftest._rel_error(out, ref)})


def some_cases():
    """A float32, a float16 and an fp8 case (small head sizes: quick on the CPU)."""
    cases = selftest.cases_for("gfx942")
    return [next(c for c in cases if c.dtype == "float32" and c.rows == 2),
            next(c for c in cases if c.dtype == "float16" and c.kv_format is None),
            next(c for c in cases if c.kv_format == "fp8_e4m3fnuz")]


def test_table_and_exit_code_when_every_case_passes(capsys):
    cases = some_cases()
    assert selftest.run_cases(cases, numpy_runner) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["kernel", "dtype", "kv", "head", "rows"]
    for case in cases:
        row = next(line for line in lines if line.startswith(case.kernel + " "))
        assert row.split()[1:5] == [case.dtype, case.kv_format or "-", str(case.head_size),
                                    str(case.rows)]
        assert row.endswith("ok")
    assert lines[-1] == f"{len(cases)}/{len(cases)} cases within bounds"


def test_a_mismatch_a_nan_and_an_exception_each_fail_their_row(capsys):
    cases = some_cases()
    bad, nan, broken = cases

    def runner(case, rng):
        if case is broken:
            raise RuntimeError("hipModuleLaunchKernel failed\nmore lines")
        if case is nan:
            return selftest.Outcome(errors={"1 partition": 0.0, "3 partitions": float("nan")})
        return selftest.Outcome(errors={"1 partition": 2 * case.bound})

    assert selftest.run_cases(cases, runner) == 1
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("cupa_")]
    assert len(rows) == 3 and all("MISMATCH" in row for row in rows)
    assert "RuntimeError: hipModuleLaunchKernel failed" in rows[2]
    assert lines[-1] == "0/3 cases within bounds"


@pytest.fixture
def gfx942_device(monkeypatch):
    """main() as on a gfx942 device, its cases run by cupa's numpy backend."""
    info = info_from_properties(0, GFX942, rocm=True)
    monkeypatch.setattr(selftest, "no_gpu_reason", lambda: None)
    monkeypatch.setattr("cupa.gpu.device.device_info", lambda: info)
    monkeypatch.setattr(selftest, "run_on_gpu", numpy_runner)


def test_the_command_filters_by_kernel_name_and_says_how_many_cases(gfx942_device, capsys):
    wanted = some_cases()[2].kernel  # an fp8 case: one kernel name, both fp8 formats' rows
    assert selftest.main(argparse.Namespace(kernel=wanted)) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("cupa_")]
    assert rows and all(wanted in row.split()[0] and row.endswith("ok") for row in rows)
    assert lines[1].startswith(f"{len(rows)} cases; ")
    assert lines[-1] == f"{len(rows)}/{len(rows)} cases within bounds"


def test_a_kernel_filter_that_matches_nothing_exits_2_and_says_so(gfx942_device, capsys):
    assert selftest.main(argparse.Namespace(kernel="cupa_decode_mma8")) == 2  # NVIDIA's only
    captured = capsys.readouterr()
    assert "no kernel on gfx942 has 'cupa_decode_mma8' in its name" in captured.err
    assert "cases within bounds" not in captured.out


def test_one_mismatch_among_passes_exits_1(capsys):
    cases = some_cases()

    def runner(case, rng):
        error = 0.5 * case.bound if case is not cases[1] else 1.01 * case.bound
        return selftest.Outcome(errors={"1 partition": error, "3 partitions": error})

    assert selftest.run_cases(cases, runner) == 1
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cupa_")]
    assert ["MISMATCH" in row for row in rows] == [False, True, False]


def test_the_runner_sees_seeded_problems():
    case = some_cases()[2]
    seen = []

    def runner(case, rng):
        seen.append(selftest.make_problem(case, rng))
        return selftest.Outcome(errors={"1 partition": 0.0})

    selftest.run_cases([case, case], runner, out=io.StringIO())
    a, b = seen
    np.testing.assert_array_equal(a["key_cache"], b["key_cache"])  # the same seed per case
    assert a["key_cache"].dtype == np.uint8 and a["options"]["kv_format"] == "fp8_e4m3fnuz"
    lens, tables = a["seq_lens"], a["block_tables"]
    used = np.concatenate([tables[s, :-(-n // selftest.BLOCK_SIZE)] for s, n in enumerate(lens)])
    assert len(set(used.tolist())) == len(used) and (used >= 0).all()


# --- check_variant_once ---------------------------------------------------------------------

GFX942 = {"name": "AMD Instinct MI300X", "gcnArchName": "gfx942:sramecc+:xnack-",
          "warpSize": 64, "multiProcessorCount": 304, "sharedMemPerBlock": 65536}


class CountingRunner:
    def __init__(self, error=0.0):
        self.calls, self.error = 0, error

    def __call__(self, case, rng):
        self.calls += 1
        return selftest.Outcome(errors={"1 partition": self.error})


@pytest.fixture
def fresh_checks(monkeypatch):
    monkeypatch.setattr(selftest, "_checked", {})


def test_check_variant_once_runs_once_per_device_driver_and_variant(tmp_path, fresh_checks,
                                                                     monkeypatch):
    info = info_from_properties(0, GFX942, rocm=True)
    variant = dispatch.decode_variant("float16", 128, 4, "gfx942")
    runner = CountingRunner()
    check = lambda **kw: selftest.check_variant_once(  # noqa: E731
        variant, info, runner=runner, cache_dir=str(tmp_path), **kw)
    assert check(driver=60443) is True and runner.calls == 1
    assert check(driver=60443) is True and runner.calls == 1  # this process remembers
    monkeypatch.setattr(selftest, "_checked", {})  # a new process: the file remembers
    assert check(driver=60443) is True and runner.calls == 1
    stored = json.loads((tmp_path / selftest.CHECKS_FILE).read_text())
    assert list(stored.values()) == [True]
    key = next(iter(stored))
    assert "AMD Instinct MI300X|gfx942|driver 60443|cupa_decode_xmma1_f16_d128|" in key
    assert check(driver=70000) is True and runner.calls == 2  # a new driver: checked again
    other = dispatch.decode_variant("float16", 128, 32, "gfx942")
    assert selftest.check_variant_once(other, info, runner=runner, cache_dir=str(tmp_path),
                                       driver=70000) and runner.calls == 3
    assert len(json.loads((tmp_path / selftest.CHECKS_FILE).read_text())) == 3


def test_a_failed_check_is_remembered_and_an_unreadable_file_means_check_again(tmp_path,
                                                                              fresh_checks,
                                                                              monkeypatch):
    info = info_from_properties(0, GFX942, rocm=True)
    variant = dispatch.decode_variant("bfloat16", 64, 1, "gfx942", "fp8_e4m3fnuz")
    failing = CountingRunner(error=1.0)
    assert selftest.check_variant_once(variant, info, runner=failing, cache_dir=str(tmp_path),
                                       driver=1) is False
    monkeypatch.setattr(selftest, "_checked", {})
    assert selftest.check_variant_once(variant, info, runner=failing, cache_dir=str(tmp_path),
                                       driver=1) is False and failing.calls == 1
    (tmp_path / selftest.CHECKS_FILE).write_text("{not json")
    monkeypatch.setattr(selftest, "_checked", {})
    passing = CountingRunner()
    assert selftest.check_variant_once(variant, info, runner=passing, cache_dir=str(tmp_path),
                                       driver=1) is True and passing.calls == 1


def test_a_variant_out_of_reach_or_a_raising_runner_does_not_pass(tmp_path, fresh_checks):
    info = info_from_properties(0, GFX942, rocm=True)
    mma = catalogue.DecodeMmaVariant("float16", 128, 8)  # no tensor-core kernels on AMD
    runner = CountingRunner()
    assert selftest.check_variant_once(mma, info, runner=runner, cache_dir=str(tmp_path),
                                       driver=1) is False and runner.calls == 0

    def raising(case, rng):
        raise RuntimeError("hipErrorNoBinaryForGpu")

    variant = dispatch.decode_variant("float32", 256, 8, "gfx942")
    assert selftest.check_variant_once(variant, info, runner=raising, cache_dir=str(tmp_path),
                                       driver=1) is False


def test_the_check_running_its_own_decode_does_not_check_again(tmp_path, fresh_checks):
    """check_variant_once's decode plans the variant under test: that planning is trusted
    instead of starting the check again (which would recurse without end)."""
    info = info_from_properties(0, GFX942, rocm=True)
    variant = dispatch.decode_variant("float16", 128, 8, "gfx942")
    inner = []

    def runner(case, rng):  # what run_on_gpu's plan_decode does through first_use_guard
        inner.append(selftest.check_variant_once(variant, info, cache_dir=str(tmp_path),
                                                 driver=1))
        return selftest.Outcome(errors={"1 partition": 0.0})

    assert selftest.check_variant_once(variant, info, runner=runner, cache_dir=str(tmp_path),
                                       driver=1) is True
    assert inner == [True] and not selftest._running


def test_first_use_guard_checks_matrix_variants_on_amd_only(monkeypatch, fresh_checks):
    asked = []

    def fake_check(variant, info):
        asked.append(variant)
        return False

    monkeypatch.setattr(selftest, "check_variant_once", fake_check)
    monkeypatch.setattr(selftest, "_warned", set())
    amd = info_from_properties(0, GFX942, rocm=True)
    matrix = dispatch.decode_variant("float16", 128, 8, "gfx942")
    assert isinstance(matrix, catalogue.DecodeMatrixVariant)
    guard = selftest.first_use_guard(amd)
    with pytest.warns(RuntimeWarning, match=f"{matrix.partition_name} gave wrong results.*"
                                            "portable kernel.*python -m cupa selftest"):
        assert guard(matrix) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once per process
        assert guard(matrix) is False
        assert guard(catalogue.DecodeVariant("float16", 128, 8)) is True  # portable: as is
    assert asked == [matrix, matrix]
    # NVIDIA, and the emulated AMD build (CUDA runtime), trust their kernels as they are.
    nvidia = info_from_properties(0, {"name": "NVIDIA H200", "major": 9, "minor": 0,
                                      "warpSize": 32, "multiProcessorCount": 132}, rocm=False)
    assert selftest.first_use_guard(nvidia)(matrix) is True and len(asked) == 2
