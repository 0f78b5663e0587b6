"""Units a learner may write after a number, and conversion between those of one kind.

Why a table: "80 GB" and "74.5 GiB" are the same memory, "400 Gb/s" and "50 GB/s" the same
link, and a learner who answers in other units than the question's is right if the quantity is
right. Each unit maps to (kind, factor to the kind's base unit): bytes, bytes/s, seconds, FLOP,
FLOP/s. Units outside the table (GPUs, buckets, %) are only matched literally.
"""
from __future__ import annotations

_BYTES = {"B": 1, "byte": 1, "bytes": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "PB": 1e15, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
_RATE = {f"{k}/s": v for k, v in _BYTES.items() if k not in ("byte", "bytes")}
_RATE.update({"bit/s": 1 / 8, "b/s": 1 / 8, "Kb/s": 1e3 / 8, "Mb/s": 1e6 / 8, "Gb/s": 1e9 / 8,
              "Tb/s": 1e12 / 8, "Mbps": 1e6 / 8, "Gbps": 1e9 / 8, "Tbps": 1e12 / 8})
_TIME = {"s": 1, "sec": 1, "second": 1, "seconds": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6,
         "μs": 1e-6, "ns": 1e-9, "min": 60, "minute": 60, "minutes": 60, "h": 3600,
         "hour": 3600, "hours": 3600, "day": 86400, "days": 86400}
_FLOP = {"FLOP": 1, "FLOPs": 1, "GFLOP": 1e9, "TFLOP": 1e12, "PFLOP": 1e15, "EFLOP": 1e18,
         "ZFLOP": 1e21}
_FLOPS = {"FLOP/s": 1, "GFLOP/s": 1e9, "TFLOP/s": 1e12, "PFLOP/s": 1e15, "EFLOP/s": 1e18,
          "TFLOPS": 1e12, "PFLOPS": 1e15, "GFLOPS": 1e9, "EFLOPS": 1e18}

UNITS: dict[str, tuple[str, float]] = {}
for _kind, _table in (("bytes", _BYTES), ("bytes/s", _RATE), ("seconds", _TIME),
                      ("FLOP", _FLOP), ("FLOP/s", _FLOPS)):
    UNITS.update({name: (_kind, float(f)) for name, f in _table.items()})


def _clean(unit: str) -> str:
    return " ".join(unit.split()).replace(" /", "/").replace("/ ", "/")


def lookup(unit: str):
    """(kind, factor) of a unit, matched exactly, then case-insensitively when that is
    unambiguous ("gb" is GB; "gb/s" could be GB/s or Gb/s, so it is not matched); None if
    unknown."""
    unit = _clean(unit)
    if unit in UNITS:
        return UNITS[unit]
    found = {UNITS[u] for u in UNITS if u.lower() == unit.lower()}
    return found.pop() if len(found) == 1 else None


def same_unit(a: str, b: str) -> bool:
    """True if two unit spellings name the same unit: the same entry of the table ("gb" and
    "GB"; never "Gb/s" and "GB/s"), or, for units outside it, equal ignoring case and spaces."""
    ka, kb = lookup(a), lookup(b)
    if ka is not None or kb is not None:
        return ka is not None and ka == kb
    return _clean(a).lower() == _clean(b).lower()


def convert(value: float, unit: str, to: str) -> float:
    """`value` in `unit` expressed in `to`; ValueError if either is unknown or the kinds differ
    (bytes cannot become seconds)."""
    if same_unit(unit, to):
        return value
    src, dst = lookup(unit), lookup(to)
    if src is None:
        raise ValueError(f"unit {unit!r} is not understood; answer in {to}")
    if dst is None or src[0] != dst[0]:
        raise ValueError(f"unit {unit!r} does not convert to {to}; answer in {to}")
    return value * src[1] / dst[1]
