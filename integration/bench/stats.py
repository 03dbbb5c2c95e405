"""Summaries of repeated measurements: median and spread (min-max), and a log-log slope."""

from __future__ import annotations

import math
import statistics
from typing import Sequence


def summarize(values: Sequence[float]) -> dict:
    """{"median", "min", "max", "n"} of the repeats (the seed reports none of these; we report all)."""
    assert values, "nothing to summarize"
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def relative_change(new: float, old: float) -> float:
    """(new - old) / old; 0 when both are 0."""
    if old == 0:
        return 0.0 if new == 0 else math.inf
    return (new - old) / old


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) on log(x): the scaling exponent (1.0 = linear)."""
    assert len(xs) == len(ys) >= 2, "a slope needs at least two points"
    assert all(x > 0 for x in xs) and all(y > 0 for y in ys), "log-log fit needs positive values"
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    den = sum((a - mx) ** 2 for a in lx)
    assert den > 0, "a slope needs at least two distinct x values"
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den


def fmt_spread(s: dict, fmt: str = "{:.3f}", scale: float = 1.0) -> str:
    """'median (min-max)' for tables."""
    m, lo, hi = (fmt.format(s[k] * scale) for k in ("median", "min", "max"))
    return m if lo == hi else f"{m} ({lo}–{hi})"
