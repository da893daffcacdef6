"""What counts as a number where users, JSON files and numpy hand us one: one meaning everywhere a value is checked."""

from __future__ import annotations

import math
import numbers


def is_int(value: object) -> bool:
    """An integer as Python, JSON or numpy gives one; True and False are not."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_positive(value: object) -> bool:
    """A finite number above zero (not a bool, not a string)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf


def is_number(value: object) -> bool:
    """A real number, infinities included (not NaN, not a bool, not a string)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)
