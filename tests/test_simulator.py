"""The simulator: the paper's Figure 1 phenomenon, determinism, delayed copies and preemption."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from vtoken.core.errors import ConfigError
from vtoken.core.sim.simulator import (
    SimConfig,
    Simulator,
    compare_modes,
    content_tag,
    run,
    synthetic_workload,
)

SEED = 0
WORKLOAD = dict(prompt=(16, 64), output=(48, 128))


def workload(n=8, seed=SEED):
    return synthetic_workload(n, seed=seed, **WORKLOAD)


@pytest.fixture(scope="module")
def figure1():
    """Random eviction at a 50% budget, 16-token blocks, no preemption (a roomy pool)."""
    cfg = SimConfig(num_blocks=512, block_size=16, headroom=8, policy="random", budget=0.5, seed=SEED,
                    check_invariants=True)
    return compare_modes(cfg, workload(12))


def test_without_reclamation_most_blocks_are_at_most_half_used(figure1):
    off = figure1["off"]
    assert off.finished == 12 and off.preemptions == 0, f"seed {SEED}"
    # the paper's Naive-Evict: no plan, no copy; only the blocks Random left wholly dead go back (rare: none here)
    assert off.reclaim == {"plans_committed": 0, "plans_aborted": 0, "moves_committed": 0, "blocks_released": 0,
                           "releases_committed": 0}
    assert off.mean_low_util_share > 0.5, f"seed {SEED}: {off.mean_low_util_share}"
    assert off.mean_waste_ratio > 0.45, f"seed {SEED}: {off.mean_waste_ratio}"
    ratio = off.mean_retained_blocks / off.mean_ideal_blocks
    assert ratio > 1.6, f"seed {SEED}: retained/ideal {ratio}"
    assert off.mean_allocated_blocks == pytest.approx(off.mean_retained_blocks)  # no sharing, no headroom use


def test_compact_returns_the_half_empty_blocks(figure1):
    off, compact = figure1["off"], figure1["compact"]
    assert compact.finished == 12 and compact.preemptions == 0, f"seed {SEED}"
    assert compact.reclaim["plans_committed"] > 0 and compact.reclaim["blocks_released"] > 0
    assert compact.mean_waste_ratio < off.mean_waste_ratio - 0.15, f"seed {SEED}"
    assert compact.mean_low_util_share < off.mean_low_util_share / 2, f"seed {SEED}"
    assert compact.mean_retained_blocks < 0.75 * off.mean_retained_blocks, f"seed {SEED}"
    assert compact.mean_retained_blocks / compact.mean_ideal_blocks < 1.3, f"seed {SEED}"
    # the same eviction decisions: the ideal footprint is the policy's, not the reclaimer's
    assert compact.mean_ideal_blocks == pytest.approx(off.mean_ideal_blocks)
    assert compact.steps == off.steps


def test_densify_keeps_retained_at_the_ideal_footprint(figure1):
    off, compact, dense = figure1["off"], figure1["compact"], figure1["densify"]
    assert dense.finished == 12, f"seed {SEED}"
    ratio = dense.mean_retained_blocks / dense.mean_ideal_blocks
    assert 1.0 <= ratio < 1.05, f"seed {SEED}: retained/ideal {ratio}"
    assert dense.mean_retained_blocks < compact.mean_retained_blocks < off.mean_retained_blocks
    assert dense.mean_waste_ratio < compact.mean_waste_ratio
    assert dense.mean_ideal_blocks == pytest.approx(off.mean_ideal_blocks)


def test_every_mode_checked_every_invariant_every_step(figure1):
    for mode, res in figure1.items():
        per_step = 8 if mode == "densify" else 7
        assert res.invariant_checks == per_step * res.steps > 0, mode


def test_native_full_retention_has_no_waste_beyond_the_last_block():
    res = run(SimConfig(num_blocks=512, policy=None, reclaim="off", seed=SEED), workload(4))
    assert res.finished == 4
    assert res.mean_retained_blocks == pytest.approx(res.mean_ideal_blocks)
    assert res.mean_low_util_share < 0.2  # only the partly filled last block of a request


# ---- determinism ------------------------------------------------------------------------------------
def as_tuple(res):
    return tuple(getattr(res, f.name) for f in fields(res))


@pytest.mark.parametrize("reclaim", ["off", "compact"])
def test_same_seed_same_result(reclaim):
    cfg = SimConfig(num_blocks=256, reclaim=reclaim, seed=7)
    a, b = run(cfg, workload(seed=7)), run(cfg, workload(seed=7))
    assert as_tuple(a) == as_tuple(b), "seed 7 did not reproduce"
    assert a == b


def test_different_seeds_differ():
    cfg = SimConfig(num_blocks=256, seed=0)
    a = run(cfg, workload(seed=0))
    b = run(replace(cfg, seed=1), workload(seed=0))  # same requests, different eviction draws
    c = run(cfg, workload(seed=1))  # different requests
    assert a.reclaim["moves_committed"] != b.reclaim["moves_committed"], "seeds 0 and 1 evicted alike"
    assert a.sum_waste != b.sum_waste, "seeds 0 and 1"
    assert a.steps != c.steps or a.sum_ideal != c.sum_ideal, "workload seeds 0 and 1"
    assert synthetic_workload(3, seed=0) != synthetic_workload(3, seed=1)
    assert synthetic_workload(3, seed=4) == synthetic_workload(3, seed=4)


# ---- copies in flight, preemption ---------------------------------------------------------------------
@pytest.mark.parametrize("reclaim, read_path, ordering", [
    ("compact", "gather", "poll"),
    ("compact", "gather", "event"),
    ("densify", "dense", "event"),
])
def test_delayed_copies_with_every_invariant_checked_finish_every_request(reclaim, read_path, ordering):
    seed = 2
    cfg = SimConfig(num_blocks=256, copy_delay=3, reclaim=reclaim, read_path=read_path, ordering=ordering,
                    seed=seed, check_invariants=True)
    res = run(cfg, workload(seed=seed))
    assert res.finished == 8, f"seed {seed}"
    assert res.invariant_checks > 0
    assert res.reclaim["plans_committed"] > 0, f"seed {seed}"


def test_delayed_copies_keep_plans_in_flight_across_steps():
    seed = 2
    cfg = SimConfig(num_blocks=256, copy_delay=3, seed=seed)
    sim = Simulator(cfg, workload(seed=seed))
    spans = []
    step = 0
    while (sim.pending or sim.waiting or sim.running) and step < 10_000:
        sim.step(step)
        spans.append(len(sim.rt.manager.pending_copies()))
        step += 1
    assert max(spans) >= 2 and sum(1 for n in spans if n) > 10, f"seed {seed}: copies never stayed in flight"
    assert sim.result.finished == 8


@pytest.mark.parametrize("reclaim, read_path, ordering", [
    ("off", "gather", "poll"),
    ("compact", "gather", "poll"),
    ("densify", "dense", "event"),
])
def test_preemption_under_a_tight_pool_still_finishes_every_request(reclaim, read_path, ordering):
    seed = 0
    cfg = SimConfig(num_blocks=24, headroom=2, reclaim=reclaim, read_path=read_path, ordering=ordering,
                    seed=seed, check_invariants=True)
    res = run(cfg, workload(seed=seed))
    assert res.preemptions > 0, f"seed {seed}: the pool was not tight"
    assert res.finished == 8, f"seed {seed}"
    assert res.invariant_checks > 0


def test_preemption_with_delayed_copies_still_finishes():
    seed = 0
    cfg = SimConfig(num_blocks=24, headroom=2, copy_delay=2, seed=seed, check_invariants=True)
    res = run(cfg, workload(seed=seed))
    assert res.preemptions > 0 and res.finished == 8, f"seed {seed}"


def test_content_tags_are_unique_and_never_empty():
    tags = {content_tag(r, t) for r in range(5) for t in range(2000)}
    assert len(tags) == 10_000 and 0 not in tags


@pytest.mark.parametrize("kwargs, match", [
    ({"reclaim": "sometimes"}, "reclaim must be one of"),
    ({"copy_delay": -1}, "copy_delay must be >= 0"),
    ({"max_running": 0}, "max_running >= 1"),
])
def test_sim_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SimConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"budget_schedule": ((0, 1.0), (0, 0.5))}, "budget_schedule must be .* increasing order"),
    ({"budget_schedule": ((-1, 1.0),)}, "budget_schedule must be"),
    ({"budget_schedule": ((0, 1.0), (5,))}, "budget_schedule must be"),
    ({"budget_schedule": ((0, 1.0), (5, 1.5))}, r"budget_schedule at step 5: budget must be a ratio in \(0, 1\]"),
    ({"budget_schedule": ((0, 1.0), (True, 0.5))}, "budget_schedule must be"),
    ({"burst_df": 0.0}, "burst_df must be None"),
])
def test_sim_config_schedule_and_trigger_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cfg = SimConfig(**kwargs)
        Simulator(cfg, workload(1))  # burst_df is checked where the ReclaimConfig is built


def burst_run(burst_df, copy_delay=0, steps=90):
    """6 requests decoding from step 0; the budget drops from 1.0 to 0.4 at step 21 and is back at 60."""
    w = synthetic_workload(6, seed=SEED, prompt=(32, 64), output=(120, 120), arrival_gap=0)
    cfg = SimConfig(num_blocks=256, block_size=16, headroom=8, policy="random", budget=1.0, check_every=32,
                    burst_df=burst_df, copy_delay=copy_delay, seed=SEED, check_invariants=True,
                    budget_schedule=((0, 1.0), (21, 0.4), (60, 1.0)))
    assert [cfg.budget_at(i) for i in (0, 20, 21, 59, 60, 1000)] == [1.0, 1.0, 0.4, 0.4, 1.0, 1.0]
    sim = Simulator(cfg, w)
    rounds = []
    for step in range(steps):
        before = sim.rt.manager.stats.rounds
        sim.step(step)
        if sim.rt.manager.stats.rounds > before:
            rounds.append(step)
    return rounds, sim


@pytest.mark.parametrize("copy_delay", [0, 2])
def test_budget_schedule_burst_fixed_waits_for_the_cadence_adaptive_reacts_at_once(copy_delay):
    fixed, sim_fixed = burst_run(None, copy_delay)
    adaptive, sim_adaptive = burst_run(0.1, copy_delay)
    assert sim_fixed.rt.budget == sim_adaptive.rt.budget == 1.0  # the schedule's last entry
    assert fixed[0] == 32  # the burst at 21 waits for the K = 32 cadence
    assert adaptive[0] == 21 and sim_adaptive.rt.manager.stats.bursts == 1
    assert sim_fixed.result.invariant_checks > 0 and sim_adaptive.result.invariant_checks > 0  # all held
    assert sim_fixed.result.sum_ideal == sim_adaptive.result.sum_ideal  # the same evictions either way
