"""Q3 (seed §4, question 3): under a fixed block budget, how many requests can stay resident at once?

The paper's setup (``settings.Q3Setup``) divided by k: C identical requests (prompt 4,032 / k, output 12,288 / k
tokens, H2O keeping 50 %) at step 0 into round(5,427 / k) or round(11,519 / k) blocks. C is feasible when all C
are resident at once and finish without preemption; the largest feasible C is bisected between a feasible and an
infeasible C (both run), every tested point kept in ``runs`` (budget_blocks, system, seed, concurrency, feasible,
the run's measurements). ``summary`` per budget and system: the largest C, its fraction of the ideal
C = floor(budget / ideal blocks per request), and the footprint at it over the ideal packed one after eviction.
Compact keeps ``compact_headroom`` blocks free for evacuation. Request ids start at seed x 100,000 (the synthetic
heavy hitters hash the id, so each repeat makes different H2O decisions).
"""

from __future__ import annotations

import math
from pathlib import Path

from vtoken.core.block_pool import blocks_needed
from vtoken.core.sim.simulator import SimConfig
from vtoken.core.sim.workloads import fixed_workload

from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .settings import Q3Setup
from .stats import summarize
from .systems import COLORS, LABELS, SYSTEMS, configure

KEY = "q3"
TITLE = "Capacity frontier: largest feasible concurrency at a fixed block budget"
POLICY = "h2o"
NAMES = [LABELS[x] for x in SYSTEMS]
PAPER = {"usable_blocks": [5427, 11519], "blocks_per_full_request": 1020, "ideal_blocks_after_h2o": 512,
         "native_c": [5, 11], "naive_evict_c": [5, 11], "vtoken_c": [8, 22],
         "source": "paper §5.4 / Figs. 9-10: Llama-3.1-8B, LongBench, H2O, 12K-token outputs; native and "
                   "Naive-Evict infeasible beyond C=5 (C=11 at the larger budget), vtoken feasible to C=8 (C=22)"}


def request_blocks(setup: Q3Setup, block_size: int, budget: float) -> tuple[int, int]:
    """(blocks of a fully retained request, its ideal packed blocks after eviction) at its last step."""
    total = setup.prompt_len + setup.output_len - 1  # the last emitted token is never appended
    return blocks_needed(total, block_size), blocks_needed(math.ceil(budget * total), block_size)


def _point(ctx: BenchContext, system: str, budget_blocks: int, concurrency: int, seed: int) -> dict:
    s, setup = ctx.settings, ctx.settings.q3
    workload = fixed_workload(concurrency, setup.prompt_len, setup.output_len, first_id=seed * 100_000)
    headroom = setup.compact_headroom if system == "vtoken_compact" else 0
    base = SimConfig(num_blocks=budget_blocks, block_size=s.block_size, headroom=headroom, budget=s.budget,
                     theta_f=s.theta_f, max_running=concurrency, seed=seed, check_invariants=s.check_invariants)
    m = ctx.cache.run(configure(base, system, POLICY), workload, stop_at_preemption=True)
    feasible = m["preemptions"] == 0 and m["completed"] and m["peak_running"] == concurrency
    return {"budget_blocks": budget_blocks, "system": system, "seed": seed, "concurrency": concurrency,
            "feasible": feasible, **m}


def frontier(ctx: BenchContext, system: str, budget_blocks: int, seed: int) -> tuple[int, list[dict]]:
    """The largest feasible concurrency and every point tested to find it."""
    full, ideal = request_blocks(ctx.settings.q3, ctx.settings.block_size, ctx.settings.budget)
    points: dict[int, dict] = {}

    def test(c: int) -> bool:
        if c not in points:
            points[c] = _point(ctx, system, budget_blocks, c, seed)
        return points[c]["feasible"]

    lo = max(1, budget_blocks // full)  # native's frontier: every system should reach it
    while lo > 1 and not test(lo):
        lo -= 1
    if not test(lo):
        return 0, list(points.values())
    hi = budget_blocks // ideal + 1  # beyond the ideal packed footprint: should fail
    while test(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    return lo, sorted(points.values(), key=lambda p: p["concurrency"])


def run(ctx: BenchContext) -> dict:
    s, setup = ctx.settings, ctx.settings.q3
    full, ideal = request_blocks(setup, s.block_size, s.budget)
    bar = ctx.progress("q3 capacity frontier", len(setup.budgets) * len(SYSTEMS) * s.repeats)
    runs, by_budget = [], {}
    for budget_blocks, paper_budget in zip(setup.budgets, setup.paper_budgets):
        b = by_budget[str(budget_blocks)] = {"paper_budget_blocks": paper_budget,
                                             "ideal_c": budget_blocks // ideal,
                                             "full_retention_c": budget_blocks // full}
        for system in SYSTEMS:
            cs, ratios = [], []
            for seed in s.seeds:
                c, points = frontier(ctx, system, budget_blocks, seed)
                runs += points
                cs.append(c)
                at = next((p for p in points if p["concurrency"] == c), None)
                if at is not None:
                    ratios.append(at["peak_allocated_blocks"] / (c * ideal))
                bar.advance(f"budget {budget_blocks} {system} seed {seed}: C={c}")
            b[system] = {"max_feasible_c": summarize(cs),
                         "fraction_of_ideal_c": summarize([c / b["ideal_c"] for c in cs]),
                         "footprint_over_ideal_at_frontier": summarize(ratios) if ratios else None}
    bar.close()
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": {
        "length_divisor": setup.length_divisor, "prompt_len": setup.prompt_len, "output_len": setup.output_len,
        "blocks_per_full_request": full, "ideal_blocks_per_request": ideal, "by_budget": by_budget},
        "notes": [
            f"Request length and block budgets are the paper's divided by k = {setup.length_divisor} "
            f"(prompt {setup.prompt_len}, output {setup.output_len} tokens; budgets {list(setup.budgets)} blocks), "
            f"keeping budget / blocks per fully retained request at the paper's 5.3 and 11.3: the pure-Python "
            f"simulator cannot serve 16K-token requests at C=22 quickly.",
            "The paper's 4,032-token prompt is inferred: 1,020 blocks x 16 tokens - 12,288 output tokens.",
            "Feasible = all C resident at once and finished with no preemption; the paper's criterion also "
            "includes its throughput measurements, which a simulator cannot give.",
        ]}


def table(report: dict) -> list[str]:
    sm, paper = report["summary"], report["paper"]
    frontier = [[f"{budget} ({b['paper_budget_blocks']:,})", b["ideal_c"],
                 *(fmt_spread(b[x]["max_feasible_c"], "{:.0f}") for x in SYSTEMS),
                 f"{paper['native_c'][i]} → {paper['vtoken_c'][i]}"]
                for i, (budget, b) in enumerate(sm["by_budget"].items())]
    footprint = [[budget, *(fmt_spread(b[x]["footprint_over_ideal_at_frontier"], "{:.2f}")
                            if b[x]["footprint_over_ideal_at_frontier"] else "–" for x in SYSTEMS)]
                 for budget, b in sm["by_budget"].items()]
    return ([f"Requests of {sm['prompt_len']} + {sm['output_len']} tokens (paper ÷ {sm['length_divisor']}): "
             f"{sm['blocks_per_full_request']} blocks fully retained, {sm['ideal_blocks_per_request']} ideal after "
             f"H2O at 50 % (paper: 1,020 and 512).", ""]
            + markdown(["budget (paper)", "ideal C", *NAMES, "paper native → vtoken"], frontier)
            + ["", "Footprint at each system's frontier: peak allocated blocks / (C × ideal packed blocks after "
               "eviction):", ""] + markdown(["budget", *NAMES], footprint))


def plot(report: dict, path: Path) -> None:
    sm, paper = report["summary"], report["paper"]
    budgets = list(sm["by_budget"])
    frontier = [step for i, b in enumerate(budgets) for step in (
        do("plot", [i - 0.4, i + 0.4], [sm["by_budget"][b]["ideal_c"]] * 2, "k:", lw=1,
           label="ideal packed" if i == 0 else None),
        do("plot", [i], [paper["vtoken_c"][i]], "k*", ms=10, label="paper vtoken" if i == 0 else None),
        do("plot", [i], [paper["native_c"][i]], "kx", ms=8, label="paper native" if i == 0 else None))]
    markers = {b: m for b, m in zip(budgets, "os^v")}
    demand = [do("scatter", p["concurrency"], p["peak_allocated_blocks"] / p["concurrency"],
                 color=COLORS[p["system"]], marker=markers[str(p["budget_blocks"])], s=16)
              for p in report["runs"] if p["feasible"]]
    demand += [do("axhline", sm["blocks_per_full_request"], color="k", ls="--", lw=1, label="fully retained request"),
               do("axhline", sm["ideal_blocks_per_request"], color="k", ls=":", lw=1,
                  label="ideal packed after eviction")]
    demand += [do("scatter", [], [], color=COLORS[x], label=LABELS[x], s=16) for x in SYSTEMS]
    figure(path, [[
        Panel({x: [sm["by_budget"][b][x]["max_feasible_c"] for b in budgets] for x in SYSTEMS},
              "largest feasible concurrency C",
              [f"{b} blocks\n(paper {sm['by_budget'][b]['paper_budget_blocks']:,})" for b in budgets],
              steps=frontier + [do("legend", fontsize=7),
                                do("set_title", "Q3 capacity frontier (median, min–max over seeds)", fontsize=10)]),
        Panel(steps=demand + [do("set_xlabel", "concurrency C (feasible points; marker: budget)"),
                              do("set_ylabel", "peak allocated blocks / C"), do("set_ylim", bottom=0),
                              do("set_title", "KV-block demand per request (cf. paper Fig. 10)", fontsize=10),
                              do("legend", fontsize=7)])]])
