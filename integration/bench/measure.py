"""One simulator run, measured: the paper's memory metrics per step, plus what the runs need to be compared.

``measure_run`` drives ``Simulator.step`` itself (instead of ``Simulator.run``)
so it can (a) count running requests per sampled step, which turns the
simulator's pool-wide sums into per-request means, (b) track the peak number
of allocated blocks, (c) count blocks in a block list that hold no live token
at all (``dead_blocks_share``: Naive-Evict keeps them too; a Naive-Evict that
freed wholly dead blocks would differ by exactly these), and (d) stop at the
first preemption when only feasibility matters (Q3). Every metric is a mean over the steps that end with
at least one running request, exactly the steps ``Simulator`` samples.

``RunCache`` memoises runs by (config, workload): questions that share a
point (Q1 and Q2 share all runs; Q5's default point is Q2's H2O chat point)
simulate it once.
"""

from __future__ import annotations

import time
from typing import Sequence

from vtoken.core.block_pool import blocks_needed
from vtoken.core.sim.simulator import RequestSpec, SimConfig, Simulator

MAX_STEPS = 1_000_000
RUN_FIELDS = ("steps", "completed", "finished", "preemptions", "peak_running", "waste_ratio_F", "utilisation",
              "blocks_le_50pct", "dead_blocks_share", "retained_blocks_per_request", "ideal_blocks_per_request",
              "retained_slots_per_request", "allocated_blocks", "peak_allocated_blocks", "ideal_blocks_at_peak",
              "plans_committed", "plans_aborted", "moves_committed", "blocks_released", "invariant_checks", "wall_s")


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
