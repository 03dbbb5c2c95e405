"""Q7 (the review's open question): the CPU cost of vtoken's per-iteration bookkeeping as tracked requests grow.

N requests (16 ... 1,024) of ``q7_prompt_len`` tokens decode together in one runtime; per decode step
``begin_step`` and ``end_step`` are timed (``perf_counter_ns``, the collector paused), the fake model's work is
not, and the time inside the in-memory copy engine (the GPU copy stream's stand-in) is subtracted and reported
apart. Per point (``runs``): system, seed, requests, live_tokens_per_request, us_per_step, us_per_request, begin_us,
end_us, engine_us (medians), step_us (every timed step), plans_committed. ``summary``: per system and N the median
and spread, and the exponent b of us_per_step ~ N^b (log-log least squares per seed).
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from vtoken.core.block_pool import BlockPool, blocks_needed
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.reference.invariants import check_all
from vtoken.core.plan import PlanKind
from vtoken.core.policies import make_policy
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.simulator import SimConfig, attention_weights, content_tag

from .render import Panel, figure, fmt_spread, markdown, scaling
from .runner import BenchContext
from .stats import fit_exponent, nest, summaries
from .systems import COLORS, LABELS, SYSTEMS, configure

KEY = "q7"
TITLE = "CPU-side bookkeeping per scheduling iteration as tracked requests grow"
POLICY = "h2o"
TIMED = ("us_per_step", "us_per_request", "begin_us", "end_us", "engine_us")
PAPER = {"reported": "none: the paper quantifies the token table's bytes, not the host-side compute per "
                     "iteration; its tested concurrencies peak at C=48 (open question in the review, §7)"}


class TimedCopyEngine(InMemoryCopyEngine):
    """The in-memory copy engine, counting the nanoseconds spent inside it (the GPU copy stream's stand-in)."""

    def __init__(self, store: TagStore) -> None:
        super().__init__(store, auto_complete=True)
        self.spent_ns = 0


def _timed(name: str):
    real = getattr(InMemoryCopyEngine, name)

    def method(self, *args, **kw):
        t0 = time.perf_counter_ns()
        try:
            return real(self, *args, **kw)
        finally:
            self.spent_ns += time.perf_counter_ns() - t0
    return method


for _name in ("submit", "poll", "wait", "order_before_compute", "release", "before_compute"):  # the engine's API
    setattr(TimedCopyEngine, _name, _timed(_name))


def build_timed_runtime(cfg: SimConfig) -> VTokenRuntime:
    """``simulator.build_runtime`` with a ``TimedCopyEngine`` (copy_delay 0: copies complete on submit)."""
    pool = BlockPool(cfg.num_blocks, cfg.block_size, cfg.headroom)
    engine = TimedCopyEngine(TagStore(cfg.num_blocks, cfg.block_size))
    reclaim = None if cfg.reclaim == "off" else ReclaimConfig(
        planner=PlanKind(cfg.reclaim), theta_f=cfg.theta_f, low_watermark=cfg.low_watermark,
        check_every=cfg.check_every, max_sources=cfg.max_sources, ordering=Ordering(cfg.ordering))
    policy = make_policy(cfg.policy) if cfg.policy else None
    return VTokenRuntime(pool, engine, policy, cfg.budget, reclaim, ReadPath(cfg.read_path), cfg.seed)


def _model(rt, inputs) -> dict:
    """The fake model (untimed): write new tokens' tags, return synthetic attention rows."""
    store = rt.engine.store
    rows = {}
    for r, req in inputs.requests.items():
        for t, slot in zip(req.new_tokens, req.write_slots):
            if slot >= 0:
                store.write(slot, content_tag(r, t))
        rows[r] = attention_weights(r, req.read_tokens, rt.total_len(r))
    return rows


def timed_step(rt: VTokenRuntime, appends: dict, model) -> tuple[int, int, int]:
    """One ``begin_step`` + ``end_step`` with the collector paused, ``model(inputs)`` (-> the attention rows)
    between them untimed: (begin ns, end ns, ns inside the copy engine, a ``TimedCopyEngine``)."""
    rt.engine.spent_ns = 0
    gc.disable()
    t0 = time.perf_counter_ns()
    inputs = rt.begin_step(appends)
    t1 = time.perf_counter_ns()
    gc.enable()
    rows = model(inputs)
    gc.disable()
    t2 = time.perf_counter_ns()
    rt.end_step(rows)
    t3 = time.perf_counter_ns()
    gc.enable()
    return t1 - t0, t3 - t2, rt.engine.spent_ns


def measure_point(ctx: BenchContext, system: str, n: int, seed: int) -> dict:
    s = ctx.settings
    L, steps = s.q7_prompt_len, s.q7_warmup_steps + s.q7_timed_steps
    num_blocks = n * blocks_needed(L + steps + 1, s.block_size) + s.headroom + 1
    cfg = configure(SimConfig(num_blocks=num_blocks, block_size=s.block_size, headroom=s.headroom,
                              budget=s.budget, theta_f=s.theta_f, seed=seed), system, POLICY)
    rt = build_timed_runtime(cfg)
    engine = rt.engine
    ids = [seed * 100_000 + i for i in range(n)]
    for r in ids:
        rt.admit(r)
    appends = {r: L for r in ids}
    times = []
    gc.collect()
    for step in range(1 + steps):  # step 0: prefill (untimed)
        begin, end, spent = timed_step(rt, appends, lambda inputs: _model(rt, inputs))
        if step > s.q7_warmup_steps:
            times.append((begin / 1e3, end / 1e3, spent / 1e3))
        if s.check_invariants:
            check_all(rt, content_tag, dense=rt.read_path is ReadPath.DENSE and rt.policy is not None)
        appends = {r: 1 for r in ids}
    per_step = [b + e - g for b, e, g in times]
    us = statistics.median(per_step)
    return {"system": system, "seed": seed, "requests": n,
            "live_tokens_per_request": sum(rt.num_live(r) for r in ids) / n,
            "us_per_step": us, "us_per_request": us / n,
            "begin_us": statistics.median(t[0] for t in times), "end_us": statistics.median(t[1] for t in times),
            "engine_us": statistics.median(t[2] for t in times),
            "step_us": per_step, "plans_committed": rt.reclaim_stats.plans_committed}


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    points = [(system, n, seed) for seed in s.seeds for n in s.q7_sizes for system in SYSTEMS]
    runs = ctx.sweep("q7 bookkeeping cost", points, lambda x, n, seed: measure_point(ctx, x, n, seed),
                     lambda x, n, seed: f"N={n} {x} seed {seed}")
    summary = nest(runs, ["system"], lambda mine: {
        "by_requests": nest(mine, ["requests"], lambda rs: summaries(rs, TIMED)),
        "scaling_exponent": fit_exponent(mine, "us_per_step", s.q7_sizes, s.seeds, by="requests")})
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summary, "notes": [
        f"Prompts of {s.q7_prompt_len} tokens, {s.q7_warmup_steps} warm-up and {s.q7_timed_steps} timed decode "
        f"steps per point; policy {POLICY}, budget {s.budget}; pure-Python core (a production scheduler's "
        f"constant factors differ; the exponent is the portable part).",
        "The scaling exponent is fitted per seed; its median and spread are reported.",
        "us_per_step excludes time inside the in-memory copy engine (engine_us, reported apart): it stands in "
        "for the GPU's copy stream.",
    ]}


def table(report: dict) -> list[str]:
    sm = report["summary"]
    sizes = list(sm[SYSTEMS[0]]["by_requests"])
    rows = [[n, *(f"{fmt_spread(sm[x]['by_requests'][n]['us_per_step'], '{:,.0f}')} "
                  f"({sm[x]['by_requests'][n]['us_per_request']['median']:.1f})" for x in SYSTEMS)] for n in sizes]
    rows.append(["exponent b", *(fmt_spread(sm[x]["scaling_exponent"], "{:.2f}") for x in SYSTEMS)])
    engine = ", ".join(f"{LABELS[x]} {sm[x]['by_requests'][sizes[-1]]['engine_us']['median']:,.0f}"
                       for x in SYSTEMS)
    return (markdown(["tracked requests", *(f"{LABELS[x]} µs/step (µs/request)" for x in SYSTEMS)], rows)
            + [f"\nExcluded, time inside the in-memory copy engine per step at N={sizes[-1]} (µs): {engine}."])


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]
    ns = [int(n) for n in sm[SYSTEMS[0]]["by_requests"]]
    labels = {x: f"{LABELS[x]} (b={sm[x]['scaling_exponent']['median']:.2f})" for x in SYSTEMS}
    series = {m: {x: [by[m] for by in sm[x]["by_requests"].values()] for x in SYSTEMS}
              for m in ("us_per_step", "us_per_request")}
    figure(path, [[Panel(series["us_per_step"], "µs per scheduling iteration", xs=ns, labels=labels,
                         steps=scaling("tracked requests N", first=True)),
                   Panel(series["us_per_request"], "µs per tracked request per iteration", xs=ns,
                         steps=scaling("tracked requests N", first=False))]],
           "Q7 CPU bookkeeping cost of the runtime per step (median, min–max over seeds)")
