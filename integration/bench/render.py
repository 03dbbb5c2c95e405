"""What a report looks like: one function renders a markdown table (``markdown``), one a PNG of panels
(``figure``). A question declares its columns and rows, and its panels (``Panel``: the series, and the Axes
calls around them as data), from the report alone, so a JSON can be re-rendered."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vtoken.core.errors import ConfigError

from .systems import COLORS, LABELS


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a specific error naming the missing extra."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("vtoken bench writes PNG plots with matplotlib: install the extra, "
                          "pip install -e '.[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# ---- tables ------------------------------------------------------------------------------------------
def fmt_spread(s: dict, fmt: str = "{:.3f}", scale: float = 1.0) -> str:
    """'median (min-max)' of a summary."""
    m, lo, hi = (fmt.format(s[k] * scale) for k in ("median", "min", "max"))
    return m if lo == hi else f"{m} ({lo}–{hi})"


def pct(s: dict) -> str:
    """A share's summary in percent."""
    return f"{fmt_spread(s, '{:.1f}', 100)} %"


def row(cells: Iterable[object]) -> str:
    return "|" + "|".join(f" {c} " if c != "" else " " for c in cells) + "|"


def markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table: the header, its rule, a line per row of cells."""
    return [row(header), "|---" * len(header) + "|"] + [row(r) for r in rows]


# ---- plots -------------------------------------------------------------------------------------------
def do(method, *args, **kw) -> tuple:
    """One Axes call as data: ``do("axhline", 1.0, color="k")`` is ``ax.axhline(1.0, color="k")``; a function
    instead of a name is called with the axes first (a call that reads the axes)."""
    return method, args, kw


@dataclass(frozen=True)
class Panel:
    """One axes: with ``groups``, a bar per (group, series); with ``xs``, a line per series; both at the median
    with the min-max spread (error bars, a band). Then ``steps`` (``do``), in order: lines, titles, a legend."""

    series: dict = None  # key -> one summary per group (bars) or per x (lines)
    ylabel: str = ""
    groups: Sequence[str] | None = None
    scale: float = 1.0
    colors: dict = None  # default: the systems' colours and labels
    labels: dict = None
    steps: Sequence[tuple] = ()
    xs: Sequence[float] = ()


def grouped_bars(ax, p: Panel) -> None:
    n = len(p.series)
    width = 0.8 / max(1, n)
    for i, (key, summaries) in enumerate(p.series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(p.groups))]
        med = [s["median"] * p.scale for s in summaries]
        err = [[(s["median"] - s["min"]) * p.scale for s in summaries],
               [(s["max"] - s["median"]) * p.scale for s in summaries]]
        ax.bar(xs, med, width, yerr=err, capsize=2, color=(p.colors or COLORS).get(key),
               label=(p.labels or LABELS).get(key, key))
    ax.set_xticks(range(len(p.groups)))
    ax.set_xticklabels(p.groups, fontsize=8)
    ax.set_ylabel(p.ylabel)
    ax.grid(axis="y", alpha=0.3)


def lines_with_spread(ax, p: Panel) -> None:
    for key, summaries in (p.series or {}).items():
        color = (p.colors or COLORS)[key]
        ax.plot(p.xs, [s["median"] * p.scale for s in summaries], marker="o", color=color,
                label=(p.labels or LABELS).get(key, key), ms=4)
        ax.fill_between(p.xs, [s["min"] * p.scale for s in summaries], [s["max"] * p.scale for s in summaries],
                        color=color, alpha=0.2, lw=0)
    if p.ylabel:
        ax.set_ylabel(p.ylabel)


def figure(path: Path, panels: Sequence[Sequence[Panel]], title: str = "", figsize=(12, 4.5), **subplots) -> None:
    """Rows of panels into one PNG at ``path``, under ``title``."""
    plt = pyplot()
    fig, axes = plt.subplots(len(panels), max(map(len, panels)), figsize=figsize, squeeze=False, **subplots)
    for axes_row, panel_row in zip(axes, panels):
        for ax in axes_row[len(panel_row):]:
            ax.set_visible(False)  # a shorter row
        for ax, p in zip(axes_row, panel_row):
            (grouped_bars if p.groups is not None else lines_with_spread)(ax, p)
            for method, args, kw in p.steps:
                method(ax, *args, **kw) if callable(method) else getattr(ax, method)(*args, **kw)
    if title:
        fig.suptitle(title)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def scaling(xlabel: str, first: bool) -> tuple:
    """Growth curves' axes: log2 x (a size that doubles), a grid; the first panel also a log y (a straight line is
    a power law) and the legend."""
    steps = (do("set_xscale", "log", base=2), do("set_xlabel", xlabel), do("grid", alpha=0.3, which="both"))
    return steps + ((do("set_yscale", "log"), do("legend", fontsize=7)) if first else ())
