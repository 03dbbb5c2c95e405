"""Q10 (issue #19): the core's per-request step cost as the context grows, and as the requests do.

Two axes, for every policy on both planners (compact on the gather path, densify on the dense one): live tokens
per request (``q10_contexts``, ``q10_requests`` requests) and requests (``q10_request_counts``, at
``q10_request_live`` live tokens). Each request is admitted with a prompt of twice its budget (an int budget: the
live tokens it keeps), so the first step evicts half of it and each decode step after evicts one token: the
steady state. ``begin_step`` + ``end_step`` are timed per decode step (the collector paused); the fake model (which
writes tags and, for the score policies only, builds the attention row) is not, nor is the time inside the
in-memory copy engine. The score policies' rows, inherently O(L), are timed apart: their handling (``_step_rows``,
the check; ``TokenScores._save``, the copy a failed choice restores; ``TokenScores._apply``, the recording), and so
is the victim choice (``VTokenRuntime._select``: the view, the policy, the answer's check), which for a score
policy reads every candidate's score, each changed by the step's row.

Per point (``runs``): axis ("context" or "requests"), system ("<policy>/<planner>"), seed, requests, live,
us_per_request, record_ns_per_live_token (score policies; else 0), us_per_request_excl_record,
select_ns_per_live_token, us_per_request_excl_record_and_select, plans_committed. ``summary``: per axis, system and
size, the median and spread of each; per axis and system ``growth``, the largest size's median over the smallest's
excluding the recording, and ``growth_excl_record_and_select``, excluding the choice too.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from vtoken.core.block_pool import BlockPool, blocks_needed
from vtoken.core.plan import PlanKind
from vtoken.core.policies import make_policy
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.inmemory import TagStore
from vtoken.core.sim.simulator import attention_weights

from .q7_bookkeeping_cost import TimedCopyEngine, timed_step
from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .stats import nest, summaries

KEY = "q10"
TITLE = "Per-request step cost of the core as the context grows (and as requests do)"
PLANNERS = {"compact": ReadPath.GATHER, "densify": ReadPath.DENSE}
SCORED = ("h2o", "scissorhands")  # the policies that read attention rows
TIMED = ("us_per_request", "us_per_request_excl_record", "us_per_request_excl_record_and_select")
PAPER = {"reported": "the design (§3.2) asks for per-step work that follows what changed: the cache is appended to "
                     "on growth and rebuilt only on structural change; issue #19's target: <= 1.5x growth along both "
                     "axes for StreamingLLM and Random on both planners, and for H2O and Scissorhands once the O(L) "
                     "row recording is excluded"}


def measure_point(ctx: BenchContext, axis: str, policy: str, planner: str, n: int, live: int, seed: int) -> dict:
    s = ctx.settings
    S, steps = s.block_size, s.q10_warmup_steps + s.q10_timed_steps
    num_blocks = n * (blocks_needed(2 * live, S) + 2) + s.headroom + 8
    engine = TimedCopyEngine(TagStore(num_blocks, S))
    reclaim = ReclaimConfig(PlanKind(planner), theta_f=s.theta_f,
                            ordering=Ordering.EVENT if planner == "densify" else Ordering.POLL)
    rt = VTokenRuntime(BlockPool(num_blocks, S, s.headroom), engine, make_policy(policy), live, reclaim,
                       PLANNERS[planner], seed)
    recorded, chosen = [0], [0]  # ns handling the rows (check, save, record), and inside the victim choice

    def timed(f, into):
        def call(*args):
            t0 = time.perf_counter_ns()
            out = f(*args)
            into[0] += time.perf_counter_ns() - t0
            return out
        return call

    rt._select = timed(rt._select, chosen)
    if policy in SCORED:  # the others get no rows
        rt._step_rows = timed(rt._step_rows, recorded)
        rt.scores._save, rt.scores._apply = timed(rt.scores._save, recorded), timed(rt.scores._apply, recorded)
    ids = list(range(n))
    for r in ids:
        rt.admit(r)
    appends, times = {r: 2 * live for r in ids}, []
    gc.collect()
    def model(inputs) -> dict | None:
        return {r: attention_weights(r, req.read_tokens, rt.total_len(r)) for r, req in inputs.requests.items()} \
            if policy in SCORED else None

    for step in range(1 + steps):  # step 0: the prefill and its eviction burst (untimed)
        recorded[0] = chosen[0] = 0
        begin, end, spent = timed_step(rt, appends, model)
        if step > s.q10_warmup_steps:
            times.append((begin + end - spent, recorded[0], chosen[0]))
        appends = {r: 1 for r in ids}
    us = statistics.median(t for t, _, _ in times) / 1e3 / n
    record_ns = statistics.median(rec for _, rec, _ in times) / (n * live)
    select_us = statistics.median(sel for _, _, sel in times) / 1e3 / n
    return {"axis": axis, "system": f"{policy}/{planner}", "seed": seed, "requests": n, "live": live,
            "us_per_request": us, "record_ns_per_live_token": record_ns,
            "us_per_request_excl_record": us - record_ns * live / 1e3,
            "select_ns_per_live_token": select_us * 1e3 / live,
            "us_per_request_excl_record_and_select": us - record_ns * live / 1e3 - select_us,
            "plans_committed": rt.reclaim_stats.plans_committed}


def _systems(s) -> list[tuple[str, str]]:
    return [(p, planner) for planner in PLANNERS for p in s.policies]


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    points = [("context", p, planner, s.q10_requests, live, seed)
              for seed in s.seeds for live in s.q10_contexts for p, planner in _systems(s)]
    points += [("requests", p, planner, n, s.q10_request_live, seed)
               for seed in s.seeds for n in s.q10_request_counts for p, planner in _systems(s)]
    runs = ctx.sweep("q10 context cost", points, lambda *pt: measure_point(ctx, *pt),
                     lambda axis, p, planner, n, live, seed: f"{p}/{planner} N={n} L={live} seed {seed}")

    def by_axis(rs: list[dict]) -> dict:
        size = "live" if rs[0]["axis"] == "context" else "requests"
        by_size = nest(rs, [size], lambda x: summaries(x, TIMED + ("record_ns_per_live_token",
                                                                   "select_ns_per_live_token")))
        first, last = list(by_size.values())[0], list(by_size.values())[-1]
        growth = {k: last[k]["median"] / first[k]["median"] for k in TIMED}
        return {"by_size": by_size, "growth": growth["us_per_request_excl_record"],
                "growth_excl_record_and_select": growth["us_per_request_excl_record_and_select"]}

    summary = nest(runs, ["axis", "system"], by_axis)
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summary, "notes": [
        f"{s.q10_requests} requests at {list(s.q10_contexts)} live tokens each; {list(s.q10_request_counts)} "
        f"requests at {s.q10_request_live}; {s.q10_warmup_steps} warm-up and {s.q10_timed_steps} timed decode steps "
        f"per point; {s.block_size}-token blocks; theta_F {s.theta_f}.",
        "Attention rows are given to the score policies only (H2O, Scissorhands), as an engine gathers them only "
        "for a policy that reads them; their handling (check, save, record) is timed apart (record_ns_per_live_token), "
        "and so is the victim choice (select_ns_per_live_token).",
        "growth: the largest size's median over the smallest's, excluding the recording, in one run.",
    ]}


def table(report: dict) -> list[str]:
    out = []
    for axis, systems in report["summary"].items():
        sizes = list(next(iter(systems.values()))["by_size"])
        last = sizes[-1]
        rows = [[x, *(fmt_spread(v["by_size"][k]["us_per_request_excl_record"], "{:,.1f}") for k in sizes),
                 f"x{v['growth']:.2f}", f"x{v['growth_excl_record_and_select']:.2f}",
                 f"{v['by_size'][last]['record_ns_per_live_token']['median']:.1f}",
                 f"{v['by_size'][last]['select_ns_per_live_token']['median']:.1f}"]
                for x, v in systems.items()]
        what = "live tokens per request" if axis == "context" else "requests"
        out += [f"\nµs per request per step, recording excluded, by {what}:"] + markdown(
            ["system", *sizes, "growth", "growth without the choice", f"recording ns/live token at {last}",
             f"choice ns/live token at {last}"], rows)
    return out


def plot(report: dict, path: Path) -> None:
    panels = []
    for axis, systems in report["summary"].items():
        xs = [int(k) for k in next(iter(systems.values()))["by_size"]]
        series = {x: [v["us_per_request_excl_record"] for v in sv["by_size"].values()] for x, sv in systems.items()}
        colors = {x: f"C{i}" for i, x in enumerate(systems)}
        panels.append(Panel(series, "µs per request per step (recording excluded)", xs=xs, colors=colors,
                            labels={x: x for x in systems},
                            steps=(do("set_xscale", "log", base=2), do("set_yscale", "log"),
                                   do("set_xlabel", "live tokens per request" if axis == "context" else "requests"),
                                   do("grid", alpha=0.3, which="both"), do("legend", fontsize=6))))
    figure(path, [panels], "Q10 per-request core step cost (median, min–max over seeds)", figsize=(13, 5))
