"""Pressure-driven compaction (issue #21, item 1): while the engine says it is short of blocks
(``VTokenRuntime.set_pressure``), every step's end runs a compaction round on the gather path whatever F and θ_F
say; without pressure reclamation stays lazy. The plans obey the same rules either way: the headroom bound too."""

from __future__ import annotations

import pytest

from vtoken.core.block_pool import BlockPool
from vtoken.core.errors import InvalidArgumentError
from vtoken.core.reference.invariants import check_all
from vtoken.core.reclamation import ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.sim.simulator import SimConfig, Simulator, compare_modes, synthetic_workload
from vtoken.core.sim.workloads import fixed_workload

from test_reclamation import Scripted

S = 4


def tag(req, t: int) -> int:
    return 1000 * (req + 1) + t + 1


def lazy_runtime(headroom=2):
    """Request 0: 16 tokens, then half of four blocks evicted (two tokens each): F = 0.5, far below a θ_F the
    trigger would act on (0.9)."""
    pool = BlockPool(16, S, headroom)
    engine = InMemoryCopyEngine(TagStore(16, S))
    rt = VTokenRuntime(pool, engine, Scripted({(0, 0): [1, 2, 5, 6, 9, 10, 13, 14]}), 1,
                       ReclaimConfig(theta_f=0.9), ReadPath.GATHER)
    rt.admit(0)
    return rt, engine


def step(rt, engine, appends):
    inputs = rt.begin_step(appends)
    engine.before_compute()
    for r, req in inputs.requests.items():
        for t, slot in zip(req.new_tokens, req.write_slots):
            engine.store.write(slot, tag(r, t))
        assert [engine.store.read(s) for s in req.read_slots] == [tag(r, t) for t in req.read_tokens]
    rt.end_step()
    check_all(rt, tag)


def test_without_pressure_a_high_theta_f_keeps_compaction_lazy():
    rt, engine = lazy_runtime()
    step(rt, engine, {0: 16})
    step(rt, engine, {0: 1})
    st = rt.reclaim_stats
    assert (st.rounds, st.plans_made, st.pressure_rounds) == (0, 0, 0) and len(rt.block_ids(0)) == 5


def test_under_pressure_every_step_runs_a_round_whatever_theta_f_says():
    rt, engine = lazy_runtime()
    step(rt, engine, {0: 16})
    rt.set_pressure(3)
    step(rt, engine, {0: 1})  # end: F 0.47 < 0.9, but a round runs and packs blocks 0-3's eight tokens into two
    st = rt.reclaim_stats
    assert (st.rounds, st.pressure_rounds, st.plans_made) == (1, 1, 1)
    plan = rt.manager.in_flight(0).plan
    assert len(plan.src_blocks) == 4 and len(plan.dst_blocks) == 2 == rt.pool.headroom  # within the headroom
    step(rt, engine, {0: 1})  # its commit: four blocks leave, two join
    assert st.plans_committed == 1 and len(rt.block_ids(0)) == 5 - 4 + 2
    rt.set_pressure(0)
    rounds = st.rounds
    step(rt, engine, {0: 1})
    assert st.rounds == rounds  # lazy again


@pytest.mark.parametrize("bad", [-1, 2.0, True, None, "3"])
def test_bad_pressure_is_refused_and_changes_nothing(bad):
    rt, engine = lazy_runtime()
    step(rt, engine, {0: 16})
    rt.set_pressure(2)
    before = rt.table.state()
    with pytest.raises(InvalidArgumentError, match="blocks_short must be an int >= 0"):
        rt.set_pressure(bad)
    assert rt.pressure == 2 and rt.table.state() == before


def test_under_pressure_a_request_compaction_cannot_shrink_is_densified_in_place():
    """Blocks 0 and 1 lose a token each: their six live tokens need two blocks (no strict decrease) and the request
    holds its ideal four, yet its cursor (16) lies past two holes. Lazy, nothing happens and the next append takes
    a fifth block; under pressure a densify plan moves tokens 14 and 15 into the holes and rewinds the cursor to
    14, so the next two appends land in blocks it holds."""
    def run(pressure):
        pool = BlockPool(16, S, 2)
        engine = InMemoryCopyEngine(TagStore(16, S))
        rt = VTokenRuntime(pool, engine, Scripted({(0, 0): [1, 5]}), 1, ReclaimConfig(theta_f=0.9), ReadPath.GATHER)
        rt.admit(0)
        rt.set_pressure(pressure)
        step(rt, engine, {0: 16})
        return rt, engine

    rt, engine = run(0)
    assert rt.manager.in_flight(0) is None and rt.reclaim_stats.no_plan == {}
    step(rt, engine, {0: 1})
    assert (rt.write_pos(0), len(rt.block_ids(0))) == (17, 5)

    rt, engine = run(1)
    plan = rt.manager.in_flight(0).plan
    assert plan.kind.value == "densify" and plan.dense_write_pos == 14 and plan.dst_blocks == ()
    assert [(m.token_id, m.dst_block * S + m.dst_offset) for m in plan.moves] == [
        (14, rt.block_ids(0)[0] * S + 1), (15, rt.block_ids(0)[1] * S + 1)]
    step(rt, engine, {0: 1})  # its commit at this step's start, then the append at position 14
    step(rt, engine, {0: 1})
    assert (rt.write_pos(0), rt.num_live(0), len(rt.block_ids(0))) == (16, 16, 4)
    assert rt.reclaim_stats.plans_committed == 1 and rt.reclaim_stats.moves_committed == 2


def _q3_small(c, pressure=True, pack=True):
    """Q3's small budget, seed 0 (85 blocks, H2O at 50 %, 63 + 192 tokens, all at once; the ideal is 10 requests)."""
    cfg = SimConfig(num_blocks=85, block_size=16, headroom=4, budget=0.5, theta_f=0.25, max_running=c, seed=0,
                    policy="h2o", reclaim="compact", read_path="gather", ordering="poll", check_invariants=True)
    sim = Simulator(cfg, fixed_workload(c, 63, 192, first_id=0))
    if not pressure:
        sim._blocks_short = lambda: 0
    if not pack:
        plan_round = sim.rt.manager.plan_round
        sim.rt.manager.plan_round = lambda req_ids, pack=False, evicted_positions=None: plan_round(req_ids)
    return sim, sim.run()


def test_under_pressure_compact_reaches_the_ideal_concurrency_at_a_fixed_budget():
    """Lazy, compact preempts at 8 requests. Under the simulator's pressure compaction alone serves 9 and preempts
    at 10: it never touches the append block, so every request stays up to one block above its ideal. Packing the
    requests it cannot shrink (densify, in place) serves the ideal 10, and 11 is one too many."""
    assert _q3_small(8, pressure=False)[1].preemptions == 1, "seed 0: the lazy trigger alone"
    assert _q3_small(10, pack=False)[1].preemptions == 1, "seed 0: compaction alone under pressure"
    sim, res = _q3_small(10)
    assert (res.finished, res.preemptions, res.peak_running) == (10, 0, 10), "seed 0"
    st = sim.rt.reclaim_stats
    assert st.pressure_rounds > 0 and st.plans_aborted == {}
    assert _q3_small(11)[1].preemptions == 1, "seed 0: past the ideal"


def test_a_roomy_pool_feels_no_pressure():
    cfg = SimConfig(num_blocks=512, block_size=16, headroom=8, policy="random", budget=0.5, seed=0)
    for mode, res in compare_modes(cfg, synthetic_workload(12, seed=0, prompt=(16, 64), output=(48, 128))).items():
        assert res.preemptions == 0, mode
    sim = Simulator(cfg, synthetic_workload(12, seed=0, prompt=(16, 64), output=(48, 128)))
    sim.run()
    assert sim.rt.reclaim_stats.pressure_rounds == 0 and sim.rt.pressure == 0
