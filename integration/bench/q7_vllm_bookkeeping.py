"""Q7, vLLM half: vtoken's seconds per engine step inside real vLLM, scheduler side (``TokenStats.seconds``) and
worker side (``WorkerTokens.seconds``), as running requests C grow and as the context grows; configurations
``SYSTEMS`` (and on the context axis ``CONTEXT_SYSTEMS``: H2O + densify too) at ``overhead_policy`` /
``overhead_budget``, strict verify off, pinned to one core.

Per (configuration, C) one in-process engine (``max_num_seqs = C``), an untimed warm-up, one timed ``generate`` per
seed. Per run (``runs``): system, concurrency, seed, steps, wall_s, step_ms, scheduler_ms, worker_ms, vtoken_ms,
share (of the step), us_per_request, attention_ms, tokens_evicted, tokens_moved, relocations, mismatches.
``summary``: per configuration and C the median and spread, and the exponent b of metric ~ C^b for ``FITTED``.
The context axis (``context_runs``, the same fields plus context: the prompt's tokens; one engine per
configuration, C in ``q7_context_concurrency`` and context in ``q7_contexts``): ``summary["by_context"]``, per
configuration, C and context, the same summaries, and per configuration and C the growth of us_per_request from
the shortest to the longest context (medians); ``summary["gather_over_dense"]``: per C and context, compact's
(gather path) median step over densify's (dense path), the same live tokens at the same budget.
"""

from __future__ import annotations

from pathlib import Path

from .q7_bookkeeping_cost import PAPER
from .render import Panel, figure, fmt_spread, markdown, pct, scaling
from .runner import BenchContext
from .stats import fit_exponent, nest, pick, summaries, totals
from .systems import COLORS, LABELS, system_config
from .vllm_engine import heldout_windows, one_core, run_engine

KEY = "q7"
TITLE = "vtoken's bookkeeping per engine step on real vLLM as running requests grow (scheduler and worker side)"
SYSTEMS = ("on", "naive_evict", "vtoken_compact", "vtoken_densify")
Q7_LABELS = {**LABELS, "on": "vtoken on, nothing evicted"}
Q7_COLORS = {**COLORS, "on": COLORS["native"]}
METRICS = ("step_ms", "scheduler_ms", "worker_ms", "vtoken_ms", "share", "us_per_request", "attention_ms")
FITTED = ("scheduler_ms", "worker_ms", "vtoken_ms", "step_ms")
COUNTS = ("tokens_evicted", "tokens_moved", "relocations", "mismatches")
CONTEXT_SYSTEMS = SYSTEMS + ("h2o_densify",)
Q7_LABELS["h2o_densify"] = "H2O + densify"
Q7_COLORS["h2o_densify"] = "#9467bd"


def context_config(system: str, s, evidence: str) -> dict:
    """A context-axis configuration: ``system_config``'s, H2O with densify for "h2o_densify"."""
    if system == "h2o_densify":
        return system_config("vtoken_densify", "h2o", s.overhead_budget, s.seed, s.score_layers, evidence)
    return system_config(system, s.overhead_policy, s.overhead_budget, s.seed, s.score_layers, evidence)


def step_costs(counters: dict, wall_s: float, concurrency: int) -> dict:
    """Per-step costs of one timed ``generate`` from its counter deltas (``vllm_engine.run_engine``)."""
    steps = counters["vtoken_steps"]
    assert steps > 0, "a timed generate with no engine step"
    sched, worker = 1e3 * counters["scheduler_seconds"] / steps, 1e3 * counters["worker_seconds"] / steps
    step = 1e3 * wall_s / steps
    return {"steps": steps, "wall_s": wall_s, "step_ms": step, "scheduler_ms": sched, "worker_ms": worker,
            "vtoken_ms": sched + worker, "share": (sched + worker) / step, "us_per_request": 1e3 * (sched + worker)
            / concurrency, "attention_ms": 1e3 * counters.get("attention_seconds", 0.0) / steps}


def measure_concurrency(vtoken: dict, prompt_sets: list[list[list[int]]], max_tokens: int, block_size: int,
                        threads: int = 1, on_done=None) -> list[dict]:
    """One engine serving ``len(prompt_sets[0])`` running requests: per prompt set, its ``step_costs`` and vtoken's
    counters (after an untimed warm-up of the first set; attention impls timed). Also tests/bench/bench_vllm_scaling.py's."""
    res = run_engine(vtoken, prompt_sets, max_tokens, block_size, threads, on_done, warmup_tokens=min(8, max_tokens),
                     timed_attention=True)
    return [step_costs(one["counters"], one["wall_s"], len(ps)) | {k: one["counters"].get(k, 0) for k in COUNTS}
            for ps, one in zip(prompt_sets, res["sets"])]


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    evidence = str(ctx.out_dir / "q7-vtoken-evidence")
    sizes = list(s.q7_concurrency)
    progress = ctx.progress("q7 vllm bookkeeping", (len(SYSTEMS) * len(sizes) + len(CONTEXT_SYSTEMS)
                            * len(s.q7_contexts) * len(s.q7_context_concurrency)) * s.repeats)
    runs, context_runs = [], []
    with one_core(s.pin) as pinning:
        for c in sizes:
            sets = [[p for p, _ in heldout_windows(c, s.prompt_len, s.q7_max_tokens, seed)] for seed in s.seeds]
            for x in SYSTEMS:
                cfg = system_config(x, s.overhead_policy, s.overhead_budget, s.seed, s.score_layers, evidence)
                costs = measure_concurrency(cfg, sets, s.q7_max_tokens, s.block_size, s.threads,
                                            on_done=lambda i, note=f"C={c} {x}": progress.advance(note))
                runs += [{"system": x, "concurrency": c, "seed": seed, "vtoken": cfg, **one}
                         for seed, one in zip(s.seeds, costs)]
        for c in s.q7_context_concurrency:
            for n in s.q7_contexts:
                sets = [[p for p, _ in heldout_windows(c, n, s.q7_max_tokens, seed)] for seed in s.seeds]
                for x in CONTEXT_SYSTEMS:
                    cfg = context_config(x, s, evidence)
                    costs = measure_concurrency(cfg, sets, s.q7_max_tokens, s.block_size, s.threads,
                                                on_done=lambda i, note=f"C={c} context {n} {x}": progress.advance(note))
                    context_runs += [{"system": x, "concurrency": c, "context": n, "seed": seed, "vtoken": cfg, **one}
                                     for seed, one in zip(s.seeds, costs)]
    progress.close()
    systems = {x: {"by_concurrency": nest(pick(runs, system=x), ["concurrency"], lambda rs: summaries(rs, METRICS)),
                   "exponent": {m: fit_exponent(pick(runs, system=x), m, sizes, s.seeds) for m in FITTED},
                   **totals(pick(runs, system=x), COUNTS)} for x in SYSTEMS}
    summary = {"systems": systems, "pinning": pinning, "policy": s.overhead_policy, "budget": s.overhead_budget,
               **context_summary(context_runs, s.q7_contexts)}
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "context_runs": context_runs,
            "summary": summary, "notes": notes(s, pinning)}


def context_summary(runs: list[dict], contexts) -> dict:
    """``by_context`` (per configuration and C: per context the summaries, and the us_per_request growth) and
    ``gather_over_dense`` (per C and context: compact's median step over densify's)."""
    lo, hi = str(min(contexts)), str(max(contexts))
    by = {}
    for x in CONTEXT_SYSTEMS:
        per_c = nest(pick(runs, system=x), ["concurrency", "context"], lambda rs: summaries(rs, METRICS))
        by[x] = {c: {"by_context": cells, "growth": cells[hi]["us_per_request"]["median"]
                     / cells[lo]["us_per_request"]["median"]} for c, cells in per_c.items()}
    ratio = {c: {n: by["vtoken_compact"][c]["by_context"][n]["step_ms"]["median"]
                 / by["vtoken_densify"][c]["by_context"][n]["step_ms"]["median"] for n in cells["by_context"]}
             for c, cells in by["vtoken_densify"].items()}
    return {"by_context": by, "gather_over_dense": ratio}


def notes(s, pinning: dict | None) -> list[str]:
    return [
        (f"Pinned to core {pinning['core']} (of {pinning['affinity_before']})" if pinning else "Not pinned")
        + f", {s.threads} torch thread(s); engines in this process, one at a time.",
        (f"Policy {s.overhead_policy} at budget {s.overhead_budget}, strict verify off; prompts of {s.prompt_len} "
         f"held-out bytes, {s.q7_max_tokens} generated; every engine step of the timed call counts (prefill "
         "chunks included), step_ms = wall / steps."),
        ("Scheduler and worker seconds are vtoken's own timers (TokenStats.seconds, WorkerTokens.seconds); "
         "vLLM's connector calls and the per-step metadata around them are not in them (Q4 measures the whole)."),
        ("The exponent is fitted per seed over every C (log-log least squares, stats.loglog_slope); b = 1 is "
         "linear in running requests. attention_ms (time inside the attention impls) is context: the gather "
         "read path's plain-torch attention against vLLM's stock kernel."),
        (f"Running requests C: {list(s.q7_concurrency)}, every request of a call at once (max_num_seqs = C, a "
         "pool that holds them all at full length: no preemption)."),
        (f"Context axis: prompts of {list(s.q7_contexts)} tokens at C = {list(s.q7_context_concurrency)}, the same "
         "timers; growth is the median us_per_request at the longest context over the shortest's. Every "
         "configuration evicts at every step (evict_every 1)."),
    ]


# ---- output -------------------------------------------------------------------------------------
def table(report: dict) -> list[str]:
    sm = report["summary"]["systems"]
    per_step = [[c, Q7_LABELS[x], fmt_spread(m["step_ms"], "{:.2f}"), fmt_spread(m["scheduler_ms"], "{:.3f}"),
                 fmt_spread(m["worker_ms"], "{:.3f}"), pct(m["share"]), f"{m['us_per_request']['median']:.1f}",
                 f"{m['attention_ms']['median']:.2f}"]
                for c in sm[SYSTEMS[0]]["by_concurrency"] for x in SYSTEMS for m in [sm[x]["by_concurrency"][c]]]
    exponents = [[Q7_LABELS[x], *(fmt_spread(e[m], "{:.2f}") if e[m] else "–" for m in FITTED)]
                 for x in SYSTEMS for e in [sm[x]["exponent"]]]
    p = report["summary"]["pinning"]
    # a report from before the context axis (docs/results/quick/vllm/q7.json) has the concurrency axis only
    context = [""] + context_table(report) if "by_context" in report["summary"] else []
    return (markdown(("C", "configuration", "step (ms)", "vtoken scheduler (ms)", "vtoken worker (ms)",
                      "share of step", "µs per request", "attention (ms)"), per_step) + [""]
            + markdown(("growth exponent b (metric ~ C^b)", *FITTED), exponents)
            + [f"\nMedian (min–max) over seeds, one engine per (configuration, C). Policy "
               f"{report['summary']['policy']} at budget {report['summary']['budget']}; "
               + (f"pinned to core {p['core']}." if p else "not pinned.")
               + " Paper: no host-side compute cost reported; its overhead runs stop at C=48."]
            + context)


def context_table(report: dict) -> list[str]:
    by, ratio = report["summary"]["by_context"], report["summary"]["gather_over_dense"]
    rows = [[c, n, Q7_LABELS[x], fmt_spread(m["step_ms"], "{:.2f}"), fmt_spread(m["us_per_request"], "{:.1f}"),
             pct(m["share"]), f"×{by[x][c]['growth']:.2f}" if n == list(cells)[-1] else "",
             f"{ratio[c][n]:.2f}" if x == "vtoken_compact" else ""]
            for c in by[CONTEXT_SYSTEMS[0]] for n in by[CONTEXT_SYSTEMS[0]][c]["by_context"] for x in CONTEXT_SYSTEMS
            for cells in [by[x][c]["by_context"]] for m in [cells[n]]]
    return markdown(("C", "context", "configuration", "step (ms)", "vtoken µs per request", "share of step",
                     "growth (shortest → longest)", "gather step / dense step"), rows)


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]["systems"]
    cs = [int(c) for c in sm[SYSTEMS[0]]["by_concurrency"]]
    exponents = {x: sm[x]["exponent"]["vtoken_ms"] for x in SYSTEMS}
    labels = {x: f"{Q7_LABELS[x]} (b={b['median']:.2f})" if b else Q7_LABELS[x] for x, b in exponents.items()}
    series = {m: {x: [by[m] for by in sm[x]["by_concurrency"].values()] for x in SYSTEMS}
              for m in ("vtoken_ms", "share")}
    p = report["summary"]["pinning"]
    by = report["summary"]["by_context"]
    context_panels = [Panel({x: [m["us_per_request"] for m in by[x][c]["by_context"].values()]
                             for x in CONTEXT_SYSTEMS}, f"vtoken µs per request per step, C = {c}",
                            xs=[int(n) for n in by[CONTEXT_SYSTEMS[0]][c]["by_context"]], colors=Q7_COLORS,
                            labels=Q7_LABELS, steps=scaling("context (prompt tokens)", first=i == 0))
                      for i, c in enumerate(by[CONTEXT_SYSTEMS[0]])]
    concurrency_panels = [
        Panel(series["vtoken_ms"], "vtoken ms per engine step (scheduler + worker)", xs=cs, colors=Q7_COLORS,
              labels=labels, steps=scaling("running requests C", first=True)),
        Panel(series["share"], "vtoken share of the step (%)", xs=cs, scale=100, colors=Q7_COLORS, labels=Q7_LABELS,
              steps=scaling("running requests C", first=False))]
    figure(path, [context_panels, concurrency_panels],
           "Q7 vtoken bookkeeping per step on vLLM CPU, byte-llama (median, min–max over seeds; "
           + (f"pinned to core {p['core']})" if p else "not pinned)"), figsize=(12, 9))
