"""Q5 (seed §4, question 5), simulator part: sensitivity to eviction ratio, theta_F and block size.

One factor at a time around H2O, eviction ratio 0.5, theta_F 0.25, block size 16 on chat: ``eviction_ratio``
0.3-0.7, ``theta_f`` 0.05-0.90 (compact only reads it), ``block_size`` 16-128. Per point, median and spread over
seeds: F, retained blocks and slots (blocks x S) per request, committed plans and token moves.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from .measure import run_point
from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .stats import nest, pick, summaries
from .systems import EVICTING, LABELS, SYSTEMS

KEY = "q5"
TITLE = "Sensitivity: eviction ratio, theta_F and block size vs F, retained blocks, plans and moves"
PAPER = {"eviction_ratio": [0.3, 0.7], "theta_f": [0.20, 0.25, 0.35], "block_size": [16, 32, 48],
         "source": "paper §5.6: retained KV capacity drops substantially as the eviction ratio grows; theta_F "
                   "has only mild effects; block size 16 is best, larger blocks trade away reclaimable capacity"}
METRICS = ("waste_ratio_F", "retained_blocks_per_request", "retained_slots_per_request", "plans_committed",
           "moves_committed", "pressure_rounds", "packs_made")


def _sweeps(ctx: BenchContext) -> dict[str, list[tuple[float, str, dict]]]:
    """sweep -> [(value, system, SimConfig overrides)]."""
    s = ctx.settings
    return {
        "eviction_ratio": [(r, x, {"budget": round(1 - r, 6)}) for r in s.q5_eviction_ratios for x in EVICTING],
        "theta_f": [(t, "vtoken_compact", {"theta_f": t}) for t in s.q5_theta_fs],
        "block_size": [(b, x, {"block_size": b}) for b in s.q5_block_sizes for x in SYSTEMS],
    }


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    spec = s.q5_workload
    sweeps = _sweeps(ctx)
    points = [(seed, sweep, *point) for seed in s.seeds
              for sweep, ps in [("reference", [(0, "native", {})])] + list(sweeps.items()) for point in ps]

    def measure(seed, sweep, value, system, over) -> dict:
        policy = None if system == "native" else s.q5_policy
        return {"sweep": sweep, "value": value, **run_point(ctx, spec, seed, system, policy, **over)}
    runs = ctx.sweep("q5 sensitivity", points, measure,
                     lambda seed, sweep, value, system, _: f"{sweep}={value} {system} seed {seed}")
    summary = {sweep: nest(pick(runs, sweep=sweep), ["system", "value"], lambda rs: summaries(rs, METRICS))
               for sweep in sweeps}
    summary["native_reference"] = summaries(pick(runs, sweep="reference"), METRICS)
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summary, "notes": [
        f"Workload: {spec.name}, {spec.num_requests} requests; policy {s.q5_policy}; other factors at their "
        f"defaults (eviction ratio {1 - s.budget:.1f}, theta_F {s.theta_f}, block size {s.block_size}).",
        "Only vtoken compact reads theta_F; Naive-Evict and densify are the eviction-ratio sweep's 0.5 point.",
    ]}


def table(report: dict) -> list[str]:
    sm = report["summary"]
    lines = []
    for sweep, label in (("eviction_ratio", "eviction ratio"), ("theta_f", "θ_F"), ("block_size", "block size")):
        systems = [x for x in SYSTEMS if x in sm[sweep]]
        vtoken = [x for x in systems if x.startswith("vtoken")]
        header = [label, *(f"F {LABELS[x]}" for x in systems), *(f"slots/req {LABELS[x]}" for x in systems),
                  *(f"plans / moves {LABELS[x]}" for x in vtoken)]
        rows = [[value, *(fmt_spread(sm[sweep][x][value]["waste_ratio_F"]) for x in systems),
                 *(fmt_spread(sm[sweep][x][value]["retained_slots_per_request"], "{:.0f}") for x in systems),
                 *(f"{fmt_spread(sm[sweep][x][value]['plans_committed'], '{:.0f}')} / "
                   f"{fmt_spread(sm[sweep][x][value]['moves_committed'], '{:.0f}')}" for x in vtoken)]
                for value in sm[sweep][systems[0]]]
        lines += [f"{label}:", ""] + markdown(header, rows) + [""]
    return lines


ROWS = (("waste_ratio_F", "waste ratio F", False), ("retained_slots_per_request", "retained slots / request", False),
        ("plans_committed", "plans committed", True), ("moves_committed", "token moves committed", True))
COLUMNS = (("eviction_ratio", "eviction ratio"), ("theta_f", "θ_F (compact)"), ("block_size", "block size"))


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]

    def panel(sweep: str, xlabel: str, metric: str, ylabel: str, log: bool) -> Panel:
        series = {x: [by_value[v][metric] for v in by_value] for x, by_value in sm[sweep].items()}
        if log:  # nothing to show on a log axis
            series = {x: ss for x, ss in series.items() if not all(s["median"] == 0 for s in ss)}
        steps = [do("set_yscale", "symlog")] if log else []
        steps += [do("set_xscale", "log", base=2)] if sweep == "block_size" else []
        return Panel(series, ylabel, xs=[float(v) for v in next(iter(sm[sweep].values()))],
                     steps=steps + [do("set_xlabel", xlabel), do("grid", alpha=0.3)])
    panels = [[panel(*c, *r) for c in COLUMNS] for r in ROWS]
    panels[0][0] = replace(panels[0][0], steps=(*panels[0][0].steps, do("legend", fontsize=7)))
    figure(path, panels, "Q5 sensitivity, H2O on chat (median, min–max over seeds)", figsize=(14, 12))
