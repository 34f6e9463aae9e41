"""tools/phase_stamps.py's timeline of the multiprocessors, which needs no GPU: the share of a
grid's span in which each multiprocessor had no, one or more workgroups streaming."""

from __future__ import annotations

import numpy as np
import pytest

from tool_module import tool_module


def test_each_multiprocessors_idle_time_is_split_before_between_and_after_its_streams():
    shares = tool_module("phase_stamps").streaming_shares
    # Multiprocessor 0: idle [0, 1), one [1, 3), two [3, 5), one [5, 6), idle [6, 7) between,
    # one [7, 8), idle [8, 10) after. Multiprocessor 1: one stream over the whole span.
    sms = np.array([0, 0, 0, 1])
    streams = np.array([[1.0, 5.0], [3.0, 6.0], [7.0, 8.0], [0.0, 10.0]])
    got = shares(sms, streams, 0.0, 10.0)
    want = {"none before": 1 / 20, "none between": 1 / 20, "none after": 2 / 20,
            "one": (2 + 1 + 1 + 10) / 20, "more": 2 / 20}
    assert got == pytest.approx(want)
    assert sum(got.values()) == pytest.approx(1.0)
