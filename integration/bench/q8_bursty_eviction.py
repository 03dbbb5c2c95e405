"""Q8 (seed §4, question 8): bursty eviction. How far does reclamation lag a burst with a fixed theta_F, and how
much faster does the adaptive trigger (``ReclaimConfig.burst_df``) react?

N chat-like requests at step 0 decode to the timeline's end (the pool holds them all); the budget schedule
(``burst_schedule``) is 1.0, then ``cycles`` x (a burst of ``burst`` steps at ``low``, ``quiet`` steps at 1.0),
each burst a seeded 0-31 steps late. H2O, compact, copies done at once. Systems (``configs``): naive_evict,
fixed theta_F x K, adaptive theta_F x K (K > 1; adaptive K = 1 would decide as fixed K = 1).

Per run: lags (per burst, iterations until F <= theta_F, F read where Stage 1 reads it; a burst that never gets
there counts its window and ``censored``), lag_mean, peak_allocated_blocks, allocated_first_32,
trapped_block_iterations (retained - ideal blocks over burst steps), rounds / rounds_quiet / rounds_burst,
fruitless_rounds, plans_made, plans_committed, moves_committed, bursts_detected, burst_rounds,
max_quiet_rise_F (largest one-step rise of F off a burst's start: burst_df must exceed it), trace (per step around
the first burst: F, allocated, retained, ideal).
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vtoken.core.sim.simulator import RequestSpec, SimConfig, Simulator
from vtoken.core.sim.workloads import CHAT_PROMPT, burst_schedule, burst_windows

from .measure import pool_for
from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .stats import pick, summaries

KEY = "q8"
TITLE = "Bursty eviction: reclamation lag, peak blocks and rounds, fixed theta_F x K vs the adaptive trigger"
PAPER = {"reported": "none: the paper's trigger is a fixed theta_F checked every K iterations; the review asks how "
                     "far reclamation lags a burst of eviction after a quiet stretch (seed §4, question 8)"}
POLICY = "h2o"
PRE = 16  # trace steps before the first burst


@dataclass(frozen=True)
class Q8Setup:
    num_requests: int
    first_quiet: int
    burst: int
    quiet: int
    cycles: int
    low: float = 0.4  # budget during a burst: every request evicts 60 % of its tokens at once
    jitter: int = 32
    prompt_scale: float = 1.0
    theta_fs: tuple[float, ...] = (0.25, 0.5)
    check_everys: tuple[int, ...] = (1, 8, 32)
    adaptive_check_everys: tuple[int, ...] = (8, 32)
    burst_df: float = 0.1

    @property
    def steps(self) -> int:
        return self.first_quiet + self.cycles * (self.burst + self.quiet) + self.jitter


QUICK = Q8Setup(num_requests=8, first_quiet=48, burst=128, quiet=48, cycles=2)
FULL = Q8Setup(num_requests=16, first_quiet=96, burst=128, quiet=96, cycles=3)


def setup_for(ctx: BenchContext) -> Q8Setup:
    return QUICK if ctx.settings.quick else FULL


def configs(setup: Q8Setup) -> list[dict]:
    """Every system of the question: name, trigger, theta_F, K, burst_df (a label and the SimConfig overrides)."""
    out = [{"name": "naive_evict", "trigger": "none", "theta_f": None, "check_every": None, "burst_df": None}]
    for theta in setup.theta_fs:
        out += [{"name": f"fixed/{theta}/{k}", "trigger": "fixed", "theta_f": theta, "check_every": k,
                 "burst_df": None} for k in setup.check_everys]
        out += [{"name": f"adaptive/{theta}/{k}", "trigger": "adaptive", "theta_f": theta, "check_every": k,
                 "burst_df": setup.burst_df} for k in setup.adaptive_check_everys]
    return out


def workload(setup: Q8Setup, seed: int) -> list[RequestSpec]:
    """The fixed population: seeded chat-like prompts, all at step 0, every one decoding to the timeline's end."""
    rng = random.Random(f"q8:{seed}")
    return [RequestSpec(i, 0, min(1024, max(16, CHAT_PROMPT.draw(rng, setup.prompt_scale))), setup.steps)
            for i in range(setup.num_requests)]


def measure(ctx: BenchContext, setup: Q8Setup, config: dict, seed: int) -> dict:
    """One run of ``config`` on seed ``seed``'s workload and schedule, traced step by step."""
    s = ctx.settings
    w = workload(setup, seed)
    schedule = burst_schedule(setup.cycles, setup.first_quiet, setup.burst, setup.quiet, setup.low,
                              jitter=setup.jitter, seed=seed)
    windows = burst_windows(schedule)
    theta = config["theta_f"]
    cfg = SimConfig(num_blocks=pool_for(w, s.block_size, s.headroom), block_size=s.block_size,
                    headroom=s.headroom, policy=POLICY, budget=1.0, budget_schedule=schedule,
                    reclaim="off" if config["trigger"] == "none" else "compact",
                    theta_f=theta if theta is not None else s.theta_f, check_every=config["check_every"] or 1,
                    burst_df=config["burst_df"], max_running=len(w), seed=seed,
                    check_invariants=s.check_invariants)
    started = time.perf_counter()
    sim = Simulator(cfg, w)
    rt = sim.rt
    pool = rt.pool
    f: list[float] = []  # F where Stage 1 reads it: after the step's eviction, before its round
    allocated, retained, ideal, rounds, plans = [], [], [], [], []
    reclaim = rt._reclaim

    def observed_reclaim() -> None:
        f.append(rt.waste_ratio())
        reclaim()

    rt._reclaim = observed_reclaim
    step = 0
    while sim.pending or sim.waiting or sim.running:
        sim.step(step)
        step += 1
        assert len(f) == step, "every step reads F once"
        allocated.append(pool.num_blocks - pool.num_free)
        held, needed = rt.retained_vs_ideal()
        retained.append(held)
        ideal.append(needed)
        rounds.append(rt.reclaim_stats.rounds)
        plans.append(rt.reclaim_stats.plans_made)
    if sim.result.preemptions or sim.result.finished != len(w):
        raise AssertionError(f"q8 seed {seed} {config['name']}: {sim.result.preemptions} preemptions, "
                             f"{sim.result.finished}/{len(w)} finished; the pool was sized to rule both out")
    assert all(e is not None and e <= step for _, e in windows), f"bursts {windows} outrun the run ({step} steps)"
    in_burst = [False] * step
    for a, e in windows:
        in_burst[a:e] = [True] * (e - a)
    new_rounds = [rounds[0]] + [b - a for a, b in itertools.pairwise(rounds)]
    new_plans = [plans[0]] + [b - a for a, b in itertools.pairwise(plans)]
    assert rt.plans_outstanding() == 0, "every plan settled by the end"
    lags, censored = [], 0
    for a, e in windows:
        lag = next((t - a for t in range(a, e) if theta is not None and f[t] <= theta), None)
        if lag is None:
            lag, censored = e - a, censored + 1
        lags.append(lag)
    starts = {a for a, _ in windows}
    rises = [f[t] - f[t - 1] for t in range(1, step) if t not in starts]
    a0, e0 = windows[0]
    lo = max(0, a0 - PRE)
    stats = rt.reclaim_stats
    return {
        "system": config["name"], "trigger": config["trigger"], "theta_f": theta, "check_every": config["check_every"],
        "burst_df": config["burst_df"], "seed": seed, "steps": step, "windows": windows,
        "lags": lags, "lag_mean": sum(lags) / len(lags), "censored": censored,
        "peak_allocated_blocks": max(max(allocated[a:e]) for a, e in windows),
        "allocated_first_32": sum(sum(allocated[a:a + 32]) / len(allocated[a:a + 32]) for a, _ in windows)
        / len(windows),
        "trapped_block_iterations": sum(retained[t] - ideal[t] for t in range(step) if in_burst[t]),
        "rounds": stats.rounds,
        "rounds_quiet": sum(n for t, n in enumerate(new_rounds) if not in_burst[t]),
        "rounds_burst": sum(n for t, n in enumerate(new_rounds) if in_burst[t]),
        "fruitless_rounds": sum(1 for r, p in zip(new_rounds, new_plans) if r and not p),
        "plans_made": stats.plans_made, "plans_committed": stats.plans_committed,
        "moves_committed": stats.moves_committed, "bursts_detected": stats.bursts, "burst_rounds": stats.burst_rounds,
        "max_quiet_rise_F": max(rises, default=0.0),
        "invariant_checks": sim.result.invariant_checks,
        "wall_s": time.perf_counter() - started,
        "trace": {"first_step": lo - a0, "F": [round(x, 4) for x in f[lo:e0]], "allocated": allocated[lo:e0],
                  "retained": retained[lo:e0], "ideal": ideal[lo:e0]},
    }


METRICS = ("lag_mean", "censored", "peak_allocated_blocks", "allocated_first_32", "trapped_block_iterations",
           "rounds", "rounds_quiet", "rounds_burst", "fruitless_rounds", "plans_made", "moves_committed",
           "bursts_detected", "burst_rounds", "max_quiet_rise_F")


def run(ctx: BenchContext) -> dict:
    s, setup = ctx.settings, setup_for(ctx)
    systems = configs(setup)
    runs = ctx.sweep("q8 bursty eviction", [(c, seed) for seed in s.seeds for c in systems],
                     lambda c, seed: measure(ctx, setup, c, seed), lambda c, seed: f"{c['name']} seed {seed}")
    by_system = {c["name"]: {**{k: c[k] for k in ("trigger", "theta_f", "check_every", "burst_df")},
                             **summaries(pick(runs, system=c["name"]), METRICS)} for c in systems}
    rises = [r["max_quiet_rise_F"] for r in runs]
    summary = {"setup": asdict(setup), "by_system": by_system, "max_quiet_rise_F": max(rises),
               "adaptive_vs_fixed_lag": {
                   f"{theta}/{k}": {"fixed": by_system[f"fixed/{theta}/{k}"]["lag_mean"]["median"],
                                    "adaptive": by_system[f"adaptive/{theta}/{k}"]["lag_mean"]["median"]}
                   for theta in setup.theta_fs for k in setup.adaptive_check_everys}}
    notes = [
        (f"{setup.num_requests} requests (chat-like prompts, all at step 0, {setup.steps} steps each); budget 1.0 "
         f"for {setup.first_quiet} steps, then {setup.cycles} x (burst of {setup.burst} steps at budget {setup.low}, "
         f"{setup.quiet} quiet steps at 1.0), each burst 0-{setup.jitter - 1} steps late (seeded); policy {POLICY}; "
         f"vtoken compact, gather path, copies done at once; adaptive burst_df {setup.burst_df}."),
        ("Lag: iterations from a burst's first step until F <= theta_F (F as Stage 1 reads it, after the step's "
         "eviction and before its round; a plan's commit lands at the next step, so reacting at once gives 1); "
         "mean over bursts."),
        ("Cost: on quiet steps F stays below theta_F, so no trigger runs a round there; the fixed trigger's K only "
         "skips O(1) reads of F, which the adaptive trigger makes on every iteration (as fixed K = 1 does). Rounds, "
         "fruitless rounds (rounds that made no plan) and plans are the work a trigger buys."),
        "Adaptive K = 1 is not run: every iteration is on the cadence, so it decides exactly as fixed K = 1.",
    ]
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summary, "notes": notes}


HEADER = ("trigger", "θ_F", "K", "lag (iterations)", "censored bursts", "peak allocated", "allocated, first 32",
          "trapped block·it", "rounds quiet / burst", "fruitless rounds", "plans made")


def table(report: dict) -> list[str]:
    sm = report["summary"]

    def n(x: dict, metric: str, fmt: str = "{:.0f}") -> str:
        return fmt_spread(x[metric], fmt)
    rows = [[*(("Naive-Evict", "–", "–", "never") if x["trigger"] == "none" else
               (x["trigger"], x["theta_f"], x["check_every"], n(x, "lag_mean", "{:.1f}"))),
             n(x, "censored"), n(x, "peak_allocated_blocks"), n(x, "allocated_first_32"),
             n(x, "trapped_block_iterations", "{:,.0f}"), f"{n(x, 'rounds_quiet')} / {n(x, 'rounds_burst')}",
             n(x, "fruitless_rounds"), n(x, "plans_made")] for x in sm["by_system"].values()]
    return markdown(HEADER, rows) + [f"\nLargest one-iteration rise of F outside a burst's first step, any run: "
                                     f"{sm['max_quiet_rise_F']:.3f} (adaptive burst_df: {sm['setup']['burst_df']})."]


def trace_steps(runs: list[dict], series: str, label: str, color: str, ls: str) -> list[tuple]:
    """One system's first-burst trace of ``series`` (F, or retained / ideal blocks): the median over seeds, and
    the min-max band."""
    runs = sorted(runs, key=lambda r: r["seed"])
    n = min(len(r["trace"]["F"]) for r in runs)
    xs = list(range(runs[0]["trace"]["first_step"], runs[0]["trace"]["first_step"] + n))
    if series == "F":
        ys = [[r["trace"]["F"][i] for r in runs] for i in range(n)]
    else:
        ys = [[r["trace"]["retained"][i] / max(1, r["trace"]["ideal"][i]) for r in runs] for i in range(n)]
    return [do("plot", xs, [sorted(v)[len(v) // 2] for v in ys], color=color, ls=ls, label=label, lw=1.4),
            do("fill_between", xs, [min(v) for v in ys], [max(v) for v in ys], color=color, alpha=0.12, lw=0)]


def bar_steps(sm: dict, names: list[str], metric: str, ylabel: str) -> list[tuple]:
    """Bars of ``metric`` per trigger (adaptive red), median and min-max; the rounds' bars name their plans."""
    med = [sm[n][metric]["median"] for n in names]
    err = [[m - sm[n][metric]["min"] for m, n in zip(med, names)],
           [sm[n][metric]["max"] - m for m, n in zip(med, names)]]
    steps = [do("bar", range(len(names)), med, yerr=err, capsize=2,
                color=["#d62728" if sm[n]["trigger"] == "adaptive" else "#7f7f7f" for n in names])]
    if metric == "rounds":
        steps += [do("annotate", f"{sm[n]['plans_made']['median']:.0f} plans", (i, 0), xytext=(0, 3),
                     textcoords="offset points", ha="center", fontsize=6, rotation=90, color="white")
                  for i, n in enumerate(names)]
    labels = [f"{sm[n]['trigger'][:5]} θ{sm[n]['theta_f']} K{sm[n]['check_every']}" for n in names]
    return steps + [do("set_xticks", range(len(names))),
                    do("set_xticklabels", labels, rotation=45, ha="right", fontsize=7),
                    do("set_ylabel", ylabel), do("grid", axis="y", alpha=0.3)]


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]["by_system"]
    setup = report["summary"]["setup"]
    theta = setup["theta_fs"][0]
    kmax = max(setup["adaptive_check_everys"])
    colors = {1: "#2ca02c", 8: "#9467bd", 32: "#8c564b"}
    shown = {"naive_evict": ("Naive-Evict", "#1f77b4", "-"),
             **{f"fixed/{theta}/{k}": (f"fixed K={k}", colors.get(k, "#7f7f7f"), "--")
                for k in setup["check_everys"]},
             f"adaptive/{theta}/{kmax}": (f"adaptive K={kmax}", "#d62728", "-")}

    def traces(series: str, ylabel: str, *extra: tuple) -> Panel:
        steps = [s for name, style in shown.items()
                 for s in trace_steps([r for r in report["runs"] if r["system"] == name], series, *style)]
        return Panel(steps=steps + [*extra, do("axvline", 0, color="k", lw=0.8),
                                    do("set_xlabel", "iterations since the first burst began"),
                                    do("set_ylabel", ylabel), do("grid", alpha=0.3)])
    names = [n for n, x in sm.items() if x["trigger"] != "none"]
    f = traces("F", "waste ratio F", do("axhline", theta, color="k", lw=0.8, ls=":", label=f"θ_F = {theta}"))
    f = Panel(steps=(*f.steps, do("legend", fontsize=7, loc="center right"),
                     do("set_title", f"first burst, θ_F = {theta} (median, min–max over seeds)", fontsize=9)))
    figure(path, [[f, traces("retained", "retained blocks / ideal ⌈live/S⌉")],
                  [Panel(steps=bar_steps(sm, names, "lag_mean", "lag: iterations until F ≤ θ_F (mean over bursts)")),
                   Panel(steps=bar_steps(sm, names, "rounds", "reclamation rounds (whole run)"))]],
           "Q8 bursty eviction: fixed θ_F × K vs the adaptive trigger (H2O, vtoken compact)", figsize=(13, 9))
