"""tools/ab_switch.py's parts that need no GPU: reading a side's switch assignments, setting
them where cupa's dispatch reads them (dispatch.set_switches), and the alternating order of the
timed rounds."""

from __future__ import annotations

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
