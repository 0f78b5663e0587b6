"""Argument checks shared by every layer. Each raises ValueError naming the argument, what was
wrong with it, and what is allowed, e.g. "tp=3 does not divide num_heads=32; allowed: 1, 2, 4,
8, 16, 32"."""
from __future__ import annotations

from collections.abc import Iterable
import numbers


def choice(name: str, value, allowed: Iterable):
    """Return `value` if it is one of `allowed`, else raise ValueError listing what is allowed."""
    allowed = list(allowed)
    if value not in allowed:
        listed = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}={value!r} is not supported; allowed: {listed}")
    return value


def positive_int(name: str, value) -> int:
    """Return `value` as an int if it is a whole number >= 1, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, float) and value.is_integer() and value >= 1:
            return int(value)
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    if value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    return int(value)


def positive(name: str, value) -> float:
    """Return `value` as a float if it is a real number > 0, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"{name}={value!r} must be a number > 0")
    return float(value)


def non_negative(name: str, value) -> float:
    """Return `value` as a float if it is a real number >= 0, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise ValueError(f"{name}={value!r} must be a number >= 0")
    return float(value)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def divides(name: str, value: int, total_name: str, total: int) -> int:
    """Check that degree `value` divides `total` (e.g. tp divides num_heads)."""
    value = positive_int(name, value)
    if total % value:
        allowed = ", ".join(str(d) for d in divisors(total))
        raise ValueError(f"{name}={value} does not divide {total_name}={total}; allowed: {allowed}")
    return value
