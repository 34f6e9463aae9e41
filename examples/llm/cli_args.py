"""Command-line plumbing shared by generate.py and bench_generate.py: range-checked argument
types and a parser whose errors are one line.

A user's mistake (a bad flag, a missing file, a broken checkpoint) ends the program with one line
on stderr, `error: ...`, and exit status 2 (argparse's own status for usage errors), never a
traceback. Bugs of the program itself still raise.
"""

from __future__ import annotations

import argparse
import math
import sys
import warnings

EXIT_USAGE = 2


def report(error) -> int:
    """Print `error: <message>` on stderr and return the exit status for a user's mistake."""
    print(f"error: {error}", file=sys.stderr)
    return EXIT_USAGE


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse, except that an error is the single line `error: <message>` (argparse prints
    the usage text first; --help still shows it)."""

    def error(self, message):
        sys.exit(report(message))


def one_line_warnings() -> None:
    """Show warnings as `warning: <message>`, one line each, instead of Python's two-line
    `file:line: Category: message` plus the source line (for the CLIs' __main__ only)."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning: {message}", file=sys.stderr if file is None else file)
    warnings.showwarning = show


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # float() also takes 'nan' and 'inf'
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int):
    """An argument type: an integer >= low."""
    def parse(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1] (top-p: 0 would keep no token)."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1, at least one."""
    values = [positive_int(part) for part in text.replace(" ", "").split(",") if part]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values
