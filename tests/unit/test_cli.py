"""The command line works on a CPU-only machine."""

import subprocess
import sys

import pytest

from cupa.arrays import gpu_available


def run(*args):
    return subprocess.run([sys.executable, "-m", "cupa", *args], capture_output=True, text=True,
                          timeout=600)


def test_info():
    result = run("info")
    assert result.returncode == 0, result.stderr
    assert "cupa 0.1.0" in result.stdout
    assert "default backend:" in result.stdout
    assert "kernel variants:" in result.stdout
    assert "default kv_format:" in result.stdout
    if not gpu_available():
        assert "default kv_format: none detected" in result.stdout


@pytest.mark.parametrize("target, says", [
    ("sm_1", "'sm_1' is no compile target"), ("foo", "'foo' is no compile target"),
    ("sm_60", "sm_60 is older than NVRTC compiles")])
def test_compile_checks_targets_up_front(target, says):
    """Names no compiler takes are refused before anything compiles: one line, exit 2."""
    result = run("compile", "--targets", target)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --targets: ") and says in lines[0]
    assert "Traceback" not in result.stderr and "NVRTC" not in result.stdout


def test_compile_sm75_builds_the_portable_kernels_only():
    """sm_75 has no tensor-core variants (they need sm_80): the rest compiles."""
    from cupa.gpu import catalogue, offline
    names = {v.entry_names[0] for v in catalogue.all_variants("sm_75")}
    assert names and not any("mma" in name for name in names)
    if offline.nvrtc_missing():
        pytest.skip(f"NVRTC: {offline.nvrtc_missing()}")
    result = run("compile", "--targets", "sm_75", "--representative")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ptxas" not in result.stderr


def test_compile_says_once_what_a_missing_compiler_needs(monkeypatch, capsys):
    """Every variant of a target failing for one missing compiler: one line naming the cause
    and the install command, no column of FAIL."""
    from cupa import __main__ as cli
    from cupa.gpu import offline

    def no_compiler(batch, arch):
        raise offline.CompilerMissing("no clang that knows gfx942")
    monkeypatch.setattr(offline, "compile_offline", no_compiler)
    assert cli.main(["compile", "--targets", "gfx942", "--representative", "--jobs", "1"]) == 1
    out, err = capsys.readouterr()
    assert "FAIL" not in out
    lines = [line for line in err.splitlines() if "not compiled" in line]
    assert len(lines) == 1
    assert lines[0].startswith("gfx942: ") and "no clang that knows gfx942" in lines[0]
    assert "install: apt-get install clang-19" in lines[0]


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_says_why():
    result = run("bench")
    assert result.returncode == 2
    assert "needs a GPU" in result.stderr
