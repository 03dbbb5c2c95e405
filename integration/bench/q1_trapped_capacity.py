"""Q1 (seed §4, question 1): does token-level eviction leave capacity trapped in partially-live blocks?

Measured per workload (chat, long context) and policy (H2O, Scissorhands,
StreamingLLM, Random), mean over decode steps, median and spread over seeds:

    blocks_le_50pct  share of allocated blocks whose live slots are <= 50 % of the block
    waste_ratio_F    1 - live slots / (allocated blocks x S)  (the paper's Eq. 1)
    dead_blocks_share  share of retained blocks with no live token at all: part of the <= 50 % share
                     that a Naive-Evict freeing wholly dead blocks would not have (the review's wording,
                     "retains a block as long as it holds any live token", allows that reading)

Naive-Evict is the paper's measurement (56-67 % of blocks <= 50 % utilised);
Native shows the baseline waste of partly filled tail blocks; vtoken compact
and densify show how much of the trapped capacity reclamation returns.
"""

from __future__ import annotations

from pathlib import Path

from .measure import policy_grid
from .plots import policy_panels
from .runner import BenchContext
from .stats import fmt_spread, nest, pick, summaries
from .systems import EVICTING

KEY = "q1"
TITLE = "Trapped capacity: share of blocks <= 50 % utilised and waste ratio F, per policy and workload"
PAPER = {"blocks_le_50pct_naive_evict": [0.56, 0.67],
         "source": "paper §5.2 / Fig. 1: 56-67 % of allocated blocks at <= 50 % utilisation after token eviction"}
METRICS = ("blocks_le_50pct", "waste_ratio_F", "dead_blocks_share")


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
    lines = ["| workload | policy | ≤ 50 % Naive-Evict | of which wholly dead | ≤ 50 % compact | ≤ 50 % densify "
             "| F Naive-Evict | F compact | F densify |", "|---|---|---|---|---|---|---|---|---|"]
    for wname, w in report["summary"]["by_workload"].items():
        nat = w["native"]
        lines.append(f"| {wname} | (native, no eviction) | {fmt_spread(nat['blocks_le_50pct'], '{:.1f}', 100)} % "
                     f"| | | | {fmt_spread(nat['waste_ratio_F'])} | | |")
        for policy, systems in w.items():
            if policy == "native":
                continue
            share = " | ".join(f"{fmt_spread(systems[x]['blocks_le_50pct'], '{:.1f}', 100)} %" for x in EVICTING)
            dead = f"{fmt_spread(systems['naive_evict']['dead_blocks_share'], '{:.1f}', 100)} %"
            share = share.replace(" | ", f" | {dead} | ", 1)
            f = " | ".join(fmt_spread(systems[x]["waste_ratio_F"]) for x in EVICTING)
            lines.append(f"| {wname} | {policy} | {share} | {f} |")
    lo, hi = report["summary"]["naive_evict_blocks_le_50pct_median_range"]
    lines.append(f"\nNaive-Evict blocks ≤ 50 % (medians): {lo:.1%}–{hi:.1%}; paper: 56–67 %.")
    return lines


def plot(report: dict, path: Path) -> None:
    policy_panels(report, path, (("blocks_le_50pct", "blocks ≤ 50 % utilised (%)", 100),
                                 ("waste_ratio_F", "waste ratio F", 1)),
                  "Q1 trapped capacity (median, min–max over seeds)", band=(56, 67, "paper, Naive-Evict: 56–67 %"))
