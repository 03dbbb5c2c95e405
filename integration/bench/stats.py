"""Summaries of repeated measurements: median and spread (min-max), a log-log slope, and the selections and
groupings every question's summary is built from."""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence


def summarize(values: Sequence[float]) -> dict:
    """{"median", "min", "max", "n"} of the repeats (the seed reports none of these; we report all)."""
    assert values, "nothing to summarize"
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def percentile(xs: list[float], q: int) -> float:
    """The q-th percentile (1..99) of ``xs``, inclusive (never beyond the data)."""
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def pick(runs: list[dict], **match) -> list[dict]:
    """The runs whose fields equal ``match``, in their order."""
    return [r for r in runs if all(r[k] == v for k, v in match.items())]


def summaries(runs: list[dict], metrics: Sequence[str]) -> dict:
    """metric -> ``summarize`` of that field over ``runs``."""
    return {m: summarize([r[m] for r in runs]) for m in metrics}


def totals(runs: list[dict], counters: Sequence[str]) -> dict:
    """counter -> its sum over ``runs`` (0 where a run lacks it)."""
    return {c: sum(r.get(c, 0) for r in runs) for c in counters}


def nest(runs: list[dict], keys: Sequence[str], leaf: Callable[[list[dict]], object]) -> dict:
    """{str(value of keys[0]): {... leaf(the runs with those values)}}, values in the order the runs first show."""
    if not keys:
        return leaf(runs)
    groups: dict = {}
    for r in runs:
        groups.setdefault(r[keys[0]], []).append(r)
    return {str(k): nest(rs, keys[1:], leaf) for k, rs in groups.items()}


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


def fit_exponent(runs: list[dict], metric: str, sizes: list[int], seeds: list[int], by: str = "concurrency"):
    """The growth exponent b of ``metric`` ~ size^b (the size is field ``by``): per seed, the log-log least-squares
    slope over ``sizes`` (``loglog_slope``); median and spread over seeds. None when a value is not positive."""
    exps = []
    for seed in seeds:
        ys = [next(r[metric] for r in runs if r[by] == c and r["seed"] == seed) for c in sizes]
        if min(ys) <= 0:
            return None
        exps.append(loglog_slope(sizes, ys))
    return summarize(exps)

