"""The device tools' --shapes (tools/decode_problem.py batch_shapes), which needs no GPU."""

from __future__ import annotations

import pytest

from tool_module import tool_module


def test_shapes_parse_in_order_whatever_the_case_of_the_x():
    assert tool_module("decode_problem").batch_shapes("1x4096,128X1024,16x16384") == [
        (1, 4096), (128, 1024), (16, 16384)]


@pytest.mark.parametrize("text", ["128", "1x4096x2", "ax4096"])
def test_a_shape_that_is_not_batch_x_length_is_refused(text):
    with pytest.raises(ValueError):
        tool_module("decode_problem").batch_shapes(text)
