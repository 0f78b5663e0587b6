"""Helpers the exercise checks share: tolerances, the first step that went wrong, the worst
ranks, and collective kinds as a learner reads them.
"""
from __future__ import annotations


RTOL, ATOL = 1e-4, 1e-7       # float32, sums in another order on 4 ranks


def first_bad(values: list) -> int | None:
    """The first step whose relative difference is None (not measured) or above RTOL."""
    return next((i for i, d in enumerate(values) if d is None or d > RTOL), None)


def worst_ranks(results: list, key: str) -> list:
    """Per step, the largest value over ranks (None where a rank has None)."""
    steps = min(len(r[key]) for r in results)
    values = [[r[key][s] for r in results] for s in range(steps)]
    return [None if None in v else max(v) for v in values]


def kinds_text(by_kind: dict) -> str:
    return ", ".join(f"{c} {k} ({b:,} B)" for k, (c, b) in by_kind.items()) or "no collectives"
