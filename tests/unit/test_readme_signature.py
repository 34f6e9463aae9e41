"""README's signature block of `cupa.decode` lists exactly the function's parameters, in order
(it once lacked total_seq_len)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import cupa

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_parameters(name: str) -> list[str]:
    """The parameter names of the `cupa.<name>(...)` block in README's code blocks."""
    text = README.read_text()
    match = re.search(rf"^cupa\.{name}\((.*?)\)\n```", text, re.MULTILINE | re.DOTALL)
    assert match, f"README has no signature block of cupa.{name}"
    names = []
    for item in match.group(1).replace("\n", " ").split(","):
        item = item.strip()
        if item and item != "*":
            names.append(item.split("=")[0].strip())
    return names


def test_readme_lists_every_decode_parameter_in_order():
    assert readme_parameters("decode") == list(inspect.signature(cupa.decode).parameters)
