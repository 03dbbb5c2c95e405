"""Matplotlib (Agg backend, files only) helpers shared by the questions' plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vtoken.core.errors import ConfigError

from .systems import COLORS, EVICTING, LABELS


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


def save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)


def grouped_bars(ax, groups: Sequence[str], series: dict[str, Sequence[dict]], colors: dict[str, str],
                 labels: dict[str, str], ylabel: str, scale: float = 1.0) -> None:
    """One bar per (group, series) at the median, with a min-max error bar."""
    n = len(series)
    width = 0.8 / max(1, n)
    for i, (key, summaries) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        med = [s["median"] * scale for s in summaries]
        err = [[(s["median"] - s["min"]) * scale for s in summaries],
               [(s["max"] - s["median"]) * scale for s in summaries]]
        ax.bar(xs, med, width, yerr=err, capsize=2, color=colors.get(key), label=labels.get(key, key))
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def line_with_spread(ax, xs: Sequence[float], summaries: Sequence[dict], color: str, label: str,
                     scale: float = 1.0, marker: str = "o") -> None:
    """The median as a line, the min-max spread as a band."""
    ax.plot(xs, [s["median"] * scale for s in summaries], marker=marker, color=color, label=label, ms=4)
    ax.fill_between(xs, [s["min"] * scale for s in summaries], [s["max"] * scale for s in summaries],
                    color=color, alpha=0.2, lw=0)


def scaling_axes(axes, xlabel: str, ylabels: Sequence[str]) -> None:
    """Log2 x axes (a size that doubles) with a grid, for each of ``axes`` with its y label; the first also gets
    a log y axis and the legend (growth curves: a straight line is a power law)."""
    for ax, ylabel in zip(axes, ylabels):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)


def policy_panels(report: dict, path: Path, rows: Sequence[tuple[str, str, float]], title: str,
                  band: tuple[float, float, str] | None = None) -> None:
    """Q1 and Q2: a column per workload, a row per (metric, y label, scale): bars per policy and evicting system
    (median, min-max), Native's median dashed; ``band`` (lo, hi, label) shades the paper's range in the top row."""
    plt = pyplot()
    by_w = report["summary"]["by_workload"]
    fig, axes = plt.subplots(len(rows), len(by_w), figsize=(5.5 * len(by_w), 7), squeeze=False)
    for col, (wname, w) in enumerate(by_w.items()):
        policies = [p for p in w if p != "native"]
        for row, (metric, ylabel, scale) in enumerate(rows):
            ax = axes[row][col]
            grouped_bars(ax, policies, {x: [w[p][x][metric] for p in policies] for x in EVICTING}, COLORS, LABELS,
                         ylabel, scale)
            ax.axhline(w["native"][metric]["median"] * scale, color=COLORS["native"], ls="--", lw=1,
                       label="Native (no eviction)")
            if band and row == 0:
                ax.axhspan(band[0], band[1], color="k", alpha=0.08, label=band[2])
            ax.set_title(wname, fontsize=10)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    save(fig, path)
