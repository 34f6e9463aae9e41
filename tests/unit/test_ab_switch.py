"""tools/ab_switch.py's parts that need no GPU: reading a side's switch assignments, setting
them where cupa's dispatch reads them (dispatch.set_switches), the alternating order of the
timed rounds, and which timing a round takes (flushed launches, or --eager calls back to back,
timed here with a stand-in for cupy's events)."""

from __future__ import annotations

import time
import types

import pytest

from tool_module import tool_module


def ab_switch():
    return tool_module("ab_switch")


def test_a_side_is_a_list_of_switch_assignments():
    parse = ab_switch().parse_side
    assert parse("CUPA_DENSE=never") == {"CUPA_DENSE": "never"}
    assert parse("CUPA_MERGE=cluster,CUPA_DENSE=") == {"CUPA_MERGE": "cluster", "CUPA_DENSE": None}
    # Compile options: the value keeps its own '=' and spaces.
    assert parse("CUPA_EXTRA_OPTIONS=-DA=1 -DB=2") == {"CUPA_EXTRA_OPTIONS": "-DA=1 -DB=2"}
    for bad in ("CUPA_DENSE", "DENSE=never", "CUPA_DENSE=never,", ""):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            parse(bad)


def test_applying_a_side_changes_what_dispatch_reads(monkeypatch):
    from cupa.gpu import dispatch
    # Both set through monkeypatch first, so that undo() also takes back what the tool sets.
    monkeypatch.setenv("CUPA_MERGE", "reduce")
    monkeypatch.setenv("CUPA_DENSE", "auto")
    try:
        dispatch.set_switches({"CUPA_DENSE": "never", "CUPA_MERGE": None})
        assert dispatch.switches().dense == "never" and dispatch.switches().merge == "auto"
        dispatch.set_switches({"CUPA_DENSE": "always"})
        assert dispatch.switches().dense == "always"
    finally:
        monkeypatch.undo()
        dispatch.reload_switches()


def test_rounds_alternate_which_side_goes_first():
    assert ab_switch().round_orders(4) == [(0, 1), (1, 0), (0, 1), (1, 0)]
    assert ab_switch().round_orders(1) == [(0, 1)]


def fake_cupy():
    """What the bench's timers ask of cupy, on the host clock: events, the current stream, and
    the flush buffer's allocation."""
    class Event:
        def record(self):
            self.at = time.perf_counter()

        def synchronize(self):
            pass

    stream = types.SimpleNamespace(synchronize=lambda: None)
    cuda = types.SimpleNamespace(
        Event=Event, get_current_stream=lambda: stream,
        get_elapsed_time=lambda start, stop: (stop.at - start.at) * 1e3)
    return types.SimpleNamespace(cuda=cuda, uint8="uint8", ones=lambda n, dtype: object())


def test_an_eager_round_times_calls_back_to_back():
    tool = ab_switch()
    calls = []
    args = types.SimpleNamespace(eager=True, calls=7, iters=50, flush="write")
    per_call = tool.make_measure(fake_cupy(), args)(lambda: calls.append(time.sleep(1e-3)))
    # The warm-up calls first, then the timed ones, nothing between them; the figure is the
    # loop's time over the timed calls.
    assert len(calls) == tool.EAGER_WARMUP + 7
    assert 1e3 <= per_call < 1e5


def test_a_flushed_round_is_the_bench_timer():
    from cupa.bench.harness import Timer
    args = types.SimpleNamespace(eager=False, calls=100, iters=9, flush="write")
    measure = ab_switch().make_measure(fake_cupy(), args)
    assert isinstance(measure.__self__, Timer) and measure.__func__ is Timer.median_us
    assert measure.__self__.iters == 9 and measure.__self__.flush_mode == "write"
