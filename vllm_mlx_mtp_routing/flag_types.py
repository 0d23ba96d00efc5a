"""argparse types whose errors name the rule ("argument --x: must be an integer >= 1, got 'y'"),
never an internal function name."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value!r}") from None
        if number < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {number}")
        return number

    parse.__name__ = f"integer >= {low}"
    return parse


def seconds(value: str) -> float:
    """A duration > 0; 'inf' for no limit."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 or 'inf', got {value!r}") from None
    if math.isnan(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0 or 'inf', got {value!r}")
    return number


def non_negative(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value!r}")
    return number


def count_or_all(value: str) -> int | None:
    """An integer >= 1, or 'all' (None)."""
    if value.strip().lower() == "all":
        return None
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'all', got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'all', got {number}")
    return number
