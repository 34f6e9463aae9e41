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


def test_compile_reports_bad_target():
    result = run("compile", "--targets", "sm_1")
    assert result.returncode != 0
    assert "FAIL" in result.stdout


@pytest.mark.skipif(gpu_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_says_why():
    result = run("bench")
    assert result.returncode == 2
    assert "needs a GPU" in result.stderr
