"""One simulator run, measured (``RUN_FIELDS``): the paper's memory metrics as means over the steps with a running
request, per-request means, the peak allocation, dead blocks in block lists, an optional stop at the first
preemption (Q3). ``RunCache`` simulates a shared (config, workload) once (Q1 and Q2 share every run).
``policy_grid``: Q1's and Q2's runs, every workload x seed x (native, each policy under each evicting system), in a
pool that holds every request at full length, so no run preempts and all make the same eviction decisions.
"""

from __future__ import annotations

import time
from typing import Sequence

from vtoken.core.block_pool import blocks_needed
from vtoken.core.sim.simulator import RequestSpec, SimConfig, Simulator

from .systems import EVICTING, configure

MAX_STEPS = 1_000_000
RUN_FIELDS = ("steps", "completed", "finished", "preemptions", "peak_running", "waste_ratio_F", "utilisation",
              "blocks_le_50pct", "dead_blocks_share", "retained_blocks_per_request", "ideal_blocks_per_request",
              "retained_slots_per_request", "allocated_blocks", "peak_allocated_blocks", "ideal_blocks_at_peak",
              "plans_committed", "plans_aborted", "moves_committed", "blocks_released", "releases_committed",
              "pressure_rounds", "packs_made", "invariant_checks", "wall_s")


def pool_for(workload: Sequence[RequestSpec], block_size: int, headroom: int) -> int:
    """Blocks for every request of ``workload`` at full length at once, plus the headroom: no run preempts."""
    return sum(blocks_needed(r.prompt_len + r.output_len, block_size) for r in workload) + headroom + 1


def measure_run(cfg: SimConfig, workload: Sequence[RequestSpec], stop_at_preemption: bool = False,
                max_steps: int = MAX_STEPS) -> dict:
    """Run ``workload`` under ``cfg``; returns the JSON-ready measurements (``RUN_FIELDS``)."""
    assert workload, "a run needs at least one request"
    started = time.perf_counter()
    sim = Simulator(cfg, list(workload))
    rt, pool, S = sim.rt, sim.rt.pool, cfg.block_size
    running_samples = 0
    sum_dead_share = 0.0
    peak_allocated = peak_ideal = 0
    step = 0
    while (sim.pending or sim.waiting or sim.running) and step < max_steps:
        sim.step(step)
        step += 1
        if sim.running:
            running_samples += len(sim.running)
            listed, dead = rt.dead_listed_blocks()
            sum_dead_share += dead / listed if listed else 0.0
        allocated = pool.num_blocks - pool.num_free
        if allocated > peak_allocated:
            peak_allocated = allocated
            peak_ideal = rt.retained_vs_ideal()[1]
        if stop_at_preemption and sim.result.preemptions:
            break
    res = sim.result
    stats = rt.reclaim_stats
    per_request = (lambda total: total / running_samples) if running_samples else (lambda total: 0.0)
    return {
        "steps": step,
        "completed": not (sim.pending or sim.waiting or sim.running),
        "finished": res.finished,
        "preemptions": res.preemptions,
        "peak_running": res.peak_running,
        "waste_ratio_F": res.mean_waste_ratio,
        "utilisation": 1.0 - res.mean_waste_ratio if res.samples else 0.0,
        "blocks_le_50pct": res.mean_low_util_share,
        "dead_blocks_share": sum_dead_share / res.samples if res.samples else 0.0,
        "retained_blocks_per_request": per_request(res.sum_retained),
        "ideal_blocks_per_request": per_request(res.sum_ideal),
        "retained_slots_per_request": per_request(res.sum_retained) * S,
        "allocated_blocks": res.mean_allocated_blocks,
        "peak_allocated_blocks": peak_allocated,
        "ideal_blocks_at_peak": peak_ideal,
        "plans_committed": stats.plans_committed,
        "plans_aborted": sum(stats.plans_aborted.values()),
        "moves_committed": stats.moves_committed,
        "blocks_released": stats.blocks_released,
        "releases_committed": stats.releases_committed,
        "pressure_rounds": stats.pressure_rounds,
        "packs_made": stats.packs_made,
        "invariant_checks": res.invariant_checks,
        "wall_s": time.perf_counter() - started,
    }


class RunCache:
    """Measured runs by (config, workload); ``hits`` counts runs served from the cache."""

    def __init__(self) -> None:
        self._runs: dict[tuple, dict] = {}
        self.hits = 0

    def run(self, cfg: SimConfig, workload: Sequence[RequestSpec], stop_at_preemption: bool = False) -> dict:
        key = (cfg, tuple(workload), stop_at_preemption)
        if key in self._runs:
            self.hits += 1
        else:
            self._runs[key] = measure_run(cfg, workload, stop_at_preemption)
        return dict(self._runs[key])

    def __len__(self) -> int:
        return len(self._runs)


NO_POLICY = "none"


def base_config(s, workload_size: int, num_blocks: int, seed: int, **over) -> SimConfig:
    cfg = dict(num_blocks=num_blocks, block_size=s.block_size, headroom=s.headroom, budget=s.budget,
               theta_f=s.theta_f, max_running=workload_size, seed=seed, check_invariants=s.check_invariants)
    cfg.update(over)
    return SimConfig(**cfg)


def run_point(ctx, spec, seed: int, system: str, policy: str | None, **over) -> dict:
    """One measured run of ``spec`` (built with ``seed``) under ``system``; ``over`` overrides SimConfig fields."""
    s = ctx.settings
    workload = spec.build(seed)
    block_size = over.get("block_size", s.block_size)
    base = base_config(s, len(workload), pool_for(workload, block_size, s.headroom), seed, **over)
    m = ctx.cache.run(configure(base, system, policy), workload)
    if m["preemptions"] or not m["completed"]:
        raise AssertionError(f"{spec.name} seed {seed} {system}/{policy}: {m['preemptions']} preemptions, "
                             f"completed={m['completed']}; the pool was sized to rule both out")
    return {"workload": spec.name, "policy": policy or NO_POLICY, "system": system, "seed": seed, **m}


def policy_grid(ctx, label: str) -> list[dict]:
    """Every run of the grid, as flat records (workload, policy, system, seed, measurements)."""
    s = ctx.settings
    points = [(spec, seed, system, policy) for spec in s.workloads for seed in s.seeds
              for system, policy in [("native", None)] + [(x, p) for p in s.policies for x in EVICTING]]
    return ctx.sweep(label, points, lambda *p: run_point(ctx, *p),
                     lambda spec, seed, system, policy: f"{spec.name} seed {seed} {policy or ''} {system}")
