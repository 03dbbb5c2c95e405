"""The runs Q1 and Q2 share: every workload x seed x (native, and each policy under each evicting system).

Each request is admitted on arrival and the pool holds every request at full
length at once (``measure.pool_for``), so no run preempts: the systems see the
same requests at the same steps and, with the same policy and seed, make the
same eviction decisions. A run that preempted anyway fails loudly.
"""

from __future__ import annotations

from vtoken.core.sim.simulator import SimConfig

from .runner import BenchContext
from .measure import pool_for
from .settings import BenchSettings, WorkloadSpec
from .systems import EVICTING, configure

NO_POLICY = "none"


def base_config(s: BenchSettings, workload_size: int, num_blocks: int, seed: int, **over) -> SimConfig:
    cfg = dict(num_blocks=num_blocks, block_size=s.block_size, headroom=s.headroom, budget=s.budget,
               theta_f=s.theta_f, max_running=workload_size, seed=seed, check_invariants=s.check_invariants)
    cfg.update(over)
    return SimConfig(**cfg)


def run_point(ctx: BenchContext, spec: WorkloadSpec, seed: int, system: str, policy: str | None, **over) -> dict:
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


def grid_size(s: BenchSettings) -> int:
    return len(s.workloads) * s.repeats * (1 + len(EVICTING) * len(s.policies))


def policy_grid(ctx: BenchContext, label: str) -> list[dict]:
    """Every run of the grid, as flat records (workload, policy, system, seed, measurements)."""
    s = ctx.settings
    bar = ctx.progress(label, grid_size(s))
    runs = []
    for spec in s.workloads:
        for seed in s.seeds:
            runs.append(run_point(ctx, spec, seed, "native", None))
            bar.advance(f"{spec.name} seed {seed} native")
            for policy in s.policies:
                for system in EVICTING:
                    runs.append(run_point(ctx, spec, seed, system, policy))
                    bar.advance(f"{spec.name} seed {seed} {policy} {system}")
    bar.close()
    return runs


def select(runs: list[dict], **match) -> list[dict]:
    """The runs whose fields equal ``match``, in seed order."""
    return sorted((r for r in runs if all(r[k] == v for k, v in match.items())), key=lambda r: r["seed"])
