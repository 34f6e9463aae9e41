"""Shared fixtures, and the rule that a GPU run never turns into silent skips."""

import os
from pathlib import Path

import numpy as np
import pytest


def pytest_sessionstart(session):
    """CUPA_REQUIRE_GPU=1 (the device runs set it): no usable GPU is an error with its cause,
    not a suite of skips."""
    if os.environ.get("CUPA_REQUIRE_GPU") != "1":
        return
    try:
        import cupy
        count = cupy.cuda.runtime.getDeviceCount()
        cause = None if count > 0 else "cupy sees no device"
    except Exception as exc:  # the cause is what a user needs to see
        cause = f"{type(exc).__name__}: {exc}"
    if cause is not None:
        pytest.exit(f"CUPA_REQUIRE_GPU=1 but no GPU is usable ({cause})", returncode=3)


@pytest.fixture
def rng(request):
    """A generator with a fresh seed per test (printed, and recorded in the report, so a failure
    can be replayed with np.random.default_rng(seed))."""
    seed = np.random.SeedSequence().entropy % 2**32
    request.node.user_properties.append(("seed", seed))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.fixture
def switch(monkeypatch):
    """switch(name, value) sets a CUPA_* environment switch for this test (value None unsets
    it); cupa's dispatch switches are read again now and after the test."""
    from cupa.gpu import dispatch

    def set_switch(name, value):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        dispatch.reload_switches()
    yield set_switch
    monkeypatch.undo()
    dispatch.reload_switches()


def pytest_sessionfinish(session):
    import offline_compile
    offline_compile.stop()


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the I-th of N interleaved slices of the collected tests "
                          "(tools/device_run.sh runs N processes in parallel)")


GPU_DIR = Path(__file__).resolve().parent / "gpu"


def pytest_collection_modifyitems(config, items):
    for item in items:  # the gpu marker by folder, so `-m gpu` selects the GPU suite
        if GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
    shard = config.getoption("--shard")
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"--shard {shard}: need 0 <= I < N")
        keep = [item for n, item in enumerate(items) if n % count == index]
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    compile_last(items)


def compile_last(items):
    """Start the offline compile in its worker processes now and run the tests that read it
    last, so that it overlaps the rest of the suite (tests/helpers/offline_compile.py)."""
    import offline_compile
    file_name, test_name = offline_compile.RESULTS_TEST
    reading = [item for item in items if Path(str(item.fspath)).name == file_name
               and getattr(item, "originalname", None) == test_name]
    if not reading:
        return
    items[:] = [item for item in items if item not in reading] + reading
    offline_compile.start()
