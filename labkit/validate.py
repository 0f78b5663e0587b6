"""Argument checks shared by every layer. Each raises ValueError naming the argument, its value,
what was wrong with it and what is allowed, e.g. "tp=3 does not divide num_heads=32; allowed: 1,
2, 4, 8, 16, 32" or "nbytes=inf must be a number >= 0 and <= 1e18".

Numbers must be finite (inf and nan are refused everywhere), and the cost models bound the
inputs that could otherwise be absurd (a 1e300-parameter model, an exabyte-sized message) with
the limits below: far beyond any real training run, low enough that every result they print
stays a number a person can read.
"""
from __future__ import annotations

from collections.abc import Iterable
import math
import numbers

MAX_PARAMS = 10**15      # parameters in a model (the largest dense models trained: ~4e11)
MAX_BYTES = 10**18       # bytes in a message, a buffer or a GPU (an exabyte)
MAX_SEQ_LEN = 10**8      # tokens in one sequence (the longest contexts: ~1e7)
MAX_BATCH = 10**8        # sequences in a batch, micro-batches in a step
MAX_RANKS = 10**7        # ranks in a parallel group or a world (the largest clusters: ~1e5 GPUs)
MAX_LAYERS = 10**5       # layers in a model, pipeline stages, virtual stages, FSDP units
MAX_WIDTH = 10**8        # hidden size, ffn size, vocabulary, heads, head_dim
MIN_BANDWIDTH = 1.0      # bytes/s on a link (a 1990s modem: ~5e3); slower, S / B overflows
MAX_LATENCY = 1e3        # seconds per message (a geostationary satellite hop: ~0.6)
MIN_SECONDS = 1e-30      # a measured duration (a clock tick: ~1e-9); shorter, S / t overflows
MAX_TOKENS_PER_SECOND = 10**15   # a training run's throughput (the largest: ~1e8)
MAX_ELEMENT_BYTES = 16   # bytes per stored value (fp64: 8, complex128: 16)


def show(x) -> str:
    """A number as the messages print it: 100,000 up to a million, then 1e7, 1e18, 2.5e12."""
    if isinstance(x, numbers.Integral) and abs(x) >= 10**300:
        digits = str(abs(x))             # float() would overflow
        return f"{'-' if x < 0 else ''}{digits[0]}.{digits[1:3]}e{len(digits) - 1}"
    if isinstance(x, numbers.Integral) and abs(x) >= 10**16:
        x = float(x)                     # 1e18, not 19 digits
    return f"{x:,g}".replace("e+0", "e").replace("e+", "e")


def describe(value, most: int = 40) -> str:
    """repr(value) as a message quotes it, shortened: a huge whole number as `show` writes it
    (pp=1.00e400, not 401 digits), a long text cut in the middle ('xxxx'...'xxxx' (5,000
    characters))."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and abs(value) >= 10**16:
        return show(value)
    text = repr(value)
    if len(text) <= most:
        return text
    if isinstance(value, str):
        return f"{value[:most // 2]!r}...{value[-8:]!r} ({len(value):,} characters)"
    return f"{text[:most]}... ({len(text):,} characters)"


def _finite(value) -> bool:
    if isinstance(value, numbers.Integral):
        return abs(value) < 10**308      # beyond, float(value) overflows
    return math.isfinite(value)


def choice(name: str, value, allowed: Iterable):
    """Return `value` if it is one of `allowed`, else raise ValueError listing what is allowed."""
    allowed = list(allowed)
    if value not in allowed:
        listed = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{name}={value!r} is not supported; allowed: {listed}")
    return value


def positive_int(name: str, value, at_most: int | None = None) -> int:
    """Return `value` as an int if it is a whole number from 1 to `at_most` (None: no upper
    bound), else raise ValueError. A float with a whole value (4.0) is accepted."""
    whole = (isinstance(value, numbers.Integral) and not isinstance(value, bool)) or (
        isinstance(value, float) and value.is_integer())
    if not whole or value < 1 or (at_most is not None and value > at_most):
        bound = "" if at_most is None else f" and <= {show(at_most)}"
        raise ValueError(f"{name}={describe(value)} must be a whole number >= 1{bound}")
    return int(value)


def _number(name, value, at_most, low, relation):
    ok = (isinstance(value, numbers.Real) and not isinstance(value, bool) and _finite(value)
          and (value > low if relation == ">" else value >= low)
          and (at_most is None or value <= at_most))
    if not ok:
        if at_most is not None:
            bound = f" and <= {show(at_most)}"
        elif isinstance(value, numbers.Real) and not _finite(value):
            bound = " and finite"
        else:
            bound = ""
        raise ValueError(f"{name}={describe(value)} must be a number {relation} {show(low)}"
                         f"{bound}")
    return float(value)


def positive(name: str, value, at_most: float | None = None) -> float:
    """Return `value` as a float if it is a finite real number > 0 (and <= `at_most` when given),
    else raise ValueError."""
    return _number(name, value, at_most, 0, ">")


def non_negative(name: str, value, at_most: float | None = None) -> float:
    """Return `value` as a float if it is a finite real number >= 0 (and <= `at_most` when
    given), else raise ValueError."""
    return _number(name, value, at_most, 0, ">=")


def at_least(name: str, value, low: float, at_most: float | None = None) -> float:
    """Return `value` as a float if it is a finite real number >= `low` (and <= `at_most` when
    given), else raise ValueError: for quantities with a smallest meaningful value (a message of
    one byte, a link of 1 MB/s), below which results overflow or stop meaning anything."""
    return _number(name, value, at_most, low, ">=")


def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (in O(sqrt n) steps: n may be a sequence length)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def divides(name: str, value: int, total_name: str, total: int) -> int:
    """Check that degree `value` divides `total` (e.g. tp divides num_heads)."""
    value = positive_int(name, value)
    if total % value:
        allowed = ", ".join(str(d) for d in divisors(total))
        raise ValueError(f"{name}={value} does not divide {total_name}={total}; allowed: {allowed}")
    return value
