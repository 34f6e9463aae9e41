"""The scripts of tools/ as modules, for the tests that check them without running them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def tool_module(name: str):
    """tools/<name>.py, imported (and registered in sys.modules: a tool's dataclasses look their
    module up there)."""
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
