"""Q1 (seed §4, question 1): does token-level eviction leave capacity trapped in partially-live blocks?

Per workload and policy, mean over decode steps, median and spread over seeds: ``blocks_le_50pct`` (share of
allocated blocks <= 50 % live), ``waste_ratio_F`` (1 - live slots / (allocated blocks x S), the paper's Eq. 1),
``dead_blocks_share`` (retained blocks with no live token: what a Naive-Evict freeing dead blocks would not keep).
Naive-Evict is the paper's measurement (56-67 %); Native the baseline; compact and densify what reclamation returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from .measure import policy_grid
from .render import Panel, do, figure, fmt_spread, markdown, pct
from .runner import BenchContext
from .stats import nest, pick, summaries
from .systems import COLORS, EVICTING

KEY = "q1"
TITLE = "Trapped capacity: share of blocks <= 50 % utilised and waste ratio F, per policy and workload"
PAPER = {"blocks_le_50pct_naive_evict": [0.56, 0.67],
         "source": "paper §5.2 / Fig. 1: 56-67 % of allocated blocks at <= 50 % utilisation after token eviction"}
METRICS = ("blocks_le_50pct", "waste_ratio_F", "dead_blocks_share")
HEADER = ("workload", "policy", "≤ 50 % Naive-Evict", "of which wholly dead", "≤ 50 % compact", "≤ 50 % densify",
          "F Naive-Evict", "F compact", "F densify")


def run(ctx: BenchContext) -> dict:
    runs = policy_grid(ctx, "q1 trapped capacity")
    by_workload = nest(runs, ["workload"], lambda rs: {
        "native": summaries(pick(rs, system="native"), METRICS),
        **nest([r for r in rs if r["system"] != "native"], ["policy", "system"], lambda x: summaries(x, METRICS))})
    naive = [v["naive_evict"]["blocks_le_50pct"]["median"] for w in by_workload.values()
             for k, v in w.items() if k != "native"]
    summary = {"by_workload": by_workload, "naive_evict_blocks_le_50pct_median_range": [min(naive), max(naive)]}
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summary, "notes": [
        "F and the <= 50 % share are means over every step with a running request (prefill steps included).",
        "The simulator's attention is synthetic (sinks, ~10 % hashed heavy hitters, a recency bump), so the "
        "policies' victims are placed as in the real policies' rules but not with real attention scores.",
    ]}


def table(report: dict) -> list[str]:
    rows = []
    for wname, w in report["summary"]["by_workload"].items():
        nat = w["native"]
        rows.append([wname, "(native, no eviction)", pct(nat["blocks_le_50pct"]), "", "", "",
                     fmt_spread(nat["waste_ratio_F"]), "", ""])
        rows += [[wname, policy, pct(x["naive_evict"]["blocks_le_50pct"]), pct(x["naive_evict"]["dead_blocks_share"]),
                  *(pct(x[s]["blocks_le_50pct"]) for s in EVICTING[1:]),
                  *(fmt_spread(x[s]["waste_ratio_F"]) for s in EVICTING)]
                 for policy, x in w.items() if policy != "native"]
    lo, hi = report["summary"]["naive_evict_blocks_le_50pct_median_range"]
    return markdown(HEADER, rows) + [f"\nNaive-Evict blocks ≤ 50 % (medians): {lo:.1%}–{hi:.1%}; paper: 56–67 %."]


def policy_panels(report: dict, path: Path, rows: Sequence[tuple[str, str, float]], title: str,
                  band: tuple[float, float, str] | None = None) -> None:
    """Q1 and Q2: a column per workload, a row per (metric, y label, scale): bars per policy and evicting system,
    Native's median dashed; ``band`` (lo, hi, label) shades the paper's range in the top row."""
    by_w = report["summary"]["by_workload"]

    def panel(w: dict, wname: str, metric: str, ylabel: str, scale: float, top: bool) -> Panel:
        policies = [p for p in w if p != "native"]
        steps = [do("axhline", w["native"][metric]["median"] * scale, color=COLORS["native"], ls="--", lw=1,
                    label="Native (no eviction)")]
        if band and top:
            steps.append(do("axhspan", band[0], band[1], color="k", alpha=0.08, label=band[2]))
        return Panel({x: [w[p][x][metric] for p in policies] for x in EVICTING}, ylabel, policies, scale=scale,
                     steps=steps + [do("set_title", wname, fontsize=10)])
    panels = [[panel(w, wname, *r, top=i == 0) for wname, w in by_w.items()] for i, r in enumerate(rows)]
    panels[0][0] = replace(panels[0][0], steps=(*panels[0][0].steps, do("legend", fontsize=7)))
    figure(path, panels, title, figsize=(5.5 * len(by_w), 7))


def plot(report: dict, path: Path) -> None:
    policy_panels(report, path, (("blocks_le_50pct", "blocks ≤ 50 % utilised (%)", 100),
                                 ("waste_ratio_F", "waste ratio F", 1)),
                  "Q1 trapped capacity (median, min–max over seeds)", band=(56, 67, "paper, Naive-Evict: 56–67 %"))
