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


@pytest.hookimpl(tryfirst=True)  # before -m deselection reads the marker
def pytest_collection_modifyitems(config, items):
    for item in items:  # the gpu marker by folder, so `-m gpu` selects the GPU suite
        if GPU_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """After -k / -m deselection: this process's shard of what will run, and the offline
    compile started now in its worker processes, the tests reading it moved last."""
    items = session.items
    shard = session.config.getoption("--shard")
    if shard:
        index, count = (int(x) for x in shard.split("/"))
        if not 0 <= index < count:
            raise pytest.UsageError(f"--shard {shard}: need 0 <= I < N")
        keep = [item for n, item in enumerate(items) if n % count == index]
        session.config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    if not session.config.option.collectonly:
        import offline_compile
        offline_compile.run_last_and_start(items)
