"""The paper's Naive-Evict (issue #21, item 2): on the gather path a block that holds no live token of its request,
and that no other request shares, leaves the request's list and goes back to the pool (a RELEASE plan: no copy),
whatever the reclaimer; one with a live token, the cursor's block and a shared block stay."""

from __future__ import annotations

import pytest

from vtoken.core.block_pool import BlockPool
from vtoken.core.errors import ConfigError, PlanConflictError, UnknownRequestError
from vtoken.core.reference.invariants import check_all
from vtoken.core.plan import NoPlan, NoPlanReason, PlanKind
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.sim.simulator import SimConfig, compare_modes, synthetic_workload

from test_reclamation import Scripted

S = 4


def tag(req, t: int) -> int:
    return {"a": 1000, "b": 2000}[req] + t + 1


def make(victims, reclaim=None, read_path=ReadPath.GATHER, auto_complete=True, num_blocks=16):
    pool = BlockPool(num_blocks, S, headroom=1)
    engine = InMemoryCopyEngine(TagStore(num_blocks, S), auto_complete=auto_complete)
    return VTokenRuntime(pool, engine, Scripted(victims), 1, reclaim, read_path), engine


def step(rt, engine, appends, tags=tag):
    """One step: begin (commits what settled), write and read every slot through the fake model, end."""
    inputs = rt.begin_step(appends)
    engine.before_compute()
    for r, req in inputs.requests.items():
        for t, slot in zip(req.new_tokens, req.write_slots):
            engine.store.write(slot, tags(r, t))
        assert [engine.store.read(s) for s in req.read_slots] == [tags(r, t) for t in req.read_tokens], r
    rt.end_step()
    check_all(rt, tags)


def test_a_wholly_dead_block_leaves_the_list_and_the_pool_at_the_next_settle():
    rt, engine = make({("a", 0): [4, 5, 6, 7]})  # block 1 of "a" (tokens 4-7) wholly dead after the prefill
    rt.admit("a")
    step(rt, engine, {"a": 12})
    dead = rt.block_ids("a")[1]
    rec = rt.manager.in_flight("a")
    assert rec is not None and rec.plan.kind is PlanKind.RELEASE and rec.plan.src_blocks == (dead,)
    assert rec.plan.moves == () and rec.plan.dst_blocks == () and rec.state is PlanState.COPYING
    slots = {t: rt.slot_of("a", t) for t in (0, 1, 2, 3, 8, 9, 10, 11)}
    free, pos = rt.pool.num_free, rt.table.write_pos("a")
    step(rt, engine, {"a": 1})  # settle commits the release before the step's slots are built
    assert dead not in rt.block_ids("a") and rt.pool.ref_count(dead) == 0
    assert rt.pool.num_free == free  # the released block back, a fresh one taken for token 12
    assert rt.table.write_pos("a") == pos - S + 1  # the cursor shifted back by one whole block, then one append
    assert {t: rt.slot_of("a", t) for t in slots} == slots  # nothing moved: no copy
    st = rt.reclaim_stats
    assert (st.releases_made, st.releases_committed, st.blocks_released) == (1, 1, 1)
    assert (st.plans_made, st.plans_committed, st.moves_committed) == (0, 0, 0)


def test_a_block_with_one_live_token_stays():
    rt, engine = make({("a", 0): [4, 5, 6]})
    rt.admit("a")
    step(rt, engine, {"a": 12})
    assert rt.manager.in_flight("a") is None
    step(rt, engine, {"a": 1})
    assert len(rt.block_ids("a")) == 4 and rt.reclaim_stats.releases_made == 0


def test_the_cursor_block_stays_though_every_token_written_to_it_is_dead():
    rt, engine = make({("a", 0): [4, 5]})  # tokens 4, 5: all of block 1 written so far; appends still go there
    rt.admit("a")
    step(rt, engine, {"a": 6})
    assert rt.manager.in_flight("a") is None
    assert rt.manager.plan_release("a") == NoPlan(NoPlanReason.NO_CANDIDATES,
                                                  "request 'a': no wholly dead private block")
    step(rt, engine, {"a": 1})
    assert len(rt.block_ids("a")) == 2 and rt.table.write_pos("a") == 7


def test_a_shared_block_stays_while_another_request_holds_it():
    def tags(r, t):  # the shared prefix's K/V is one copy, the same for both
        return t + 1 if t < S else tag(r, t)

    rt, engine = make({("b", 1): [0, 1, 2, 3]})  # "b" evicts every token of the block it shares with "a"
    rt.admit("a")
    step(rt, engine, {"a": 9}, tags)
    shared = rt.block_ids("a")[0]
    rt.admit("b", share_prefix_of="a", shared_blocks=1)
    step(rt, engine, {"a": 1, "b": 5}, tags)
    assert rt.block_ids("b")[0] == shared and rt.pool.ref_count(shared) == 2
    assert [t for t in range(4) if rt.table.is_live("b", t)] == []
    assert rt.manager.in_flight("b") is None and rt.reclaim_stats.releases_made == 0
    step(rt, engine, {"a": 1, "b": 1}, tags)
    assert shared in rt.block_ids("b") and shared in rt.block_ids("a")


def test_a_shared_block_that_died_is_released_once_its_other_holder_leaves():
    """"b" evicts every token of the block it shares with "a"; while "a" holds it, it stays. When "a" finishes the
    block is "b"'s alone and dead: the next step's end searches "b" and releases it (no eviction of "b" needed)."""
    def tags(r, t):
        return t + 1 if t < S else tag(r, t)

    rt, engine = make({("b", 1): [0, 1, 2, 3]})
    rt.admit("a")
    step(rt, engine, {"a": 9}, tags)
    shared = rt.block_ids("a")[0]
    rt.admit("b", share_prefix_of="a", shared_blocks=1)
    step(rt, engine, {"a": 1, "b": 5}, tags)
    rt.finish("a")
    assert rt.pool.ref_count(shared) == 1 and rt.block_ids("b")[0] == shared and list(rt._release_deferred) == ["b"]
    step(rt, engine, {"b": 1}, tags)  # no eviction this step: the deferred search finds the block
    rec = rt.manager.in_flight("b")
    assert rec is not None and rec.plan.kind is PlanKind.RELEASE and rec.plan.src_blocks == (shared,)
    step(rt, engine, {"b": 1}, tags)
    assert shared not in rt.block_ids("b") and rt.pool.ref_count(shared) == 0
    assert rt.reclaim_stats.blocks_released == 1


def test_a_plan_in_flight_defers_the_release_until_the_plan_has_settled():
    rt, engine = make({("a", 1): [8, 9, 10, 11]}, auto_complete=False)
    rt.admit("a")
    step(rt, engine, {"a": 13})
    drill = rt.relocate_block("a", 0)  # a relocation with its copy pending (POLL): the request's one plan
    assert drill and drill.handle is not None
    step(rt, engine, {"a": 1})  # block 2 dies while the drill is in flight: its release waits
    dead = rt.block_ids("a")[2]
    assert rt.manager.in_flight("a") is drill and list(rt._release_deferred) == ["a"]
    engine.complete(drill.handle)
    step(rt, engine, {"a": 1})  # the drill commits; this step's end searches "a" whole and plans the release
    rec = rt.manager.in_flight("a")
    assert drill.state is PlanState.COMMITTED and rec.plan.kind is PlanKind.RELEASE and rec.plan.src_blocks == (dead,)
    assert not rt._release_deferred
    step(rt, engine, {"a": 1})
    assert dead not in rt.block_ids("a") and rt.reclaim_stats.releases_committed == 1


def test_the_dense_path_has_no_dead_block_to_release():
    rt, engine = make({("a", 0): [4, 5, 6, 7]}, ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT),
                      ReadPath.DENSE)
    rt.admit("a")
    step(rt, engine, {"a": 12})
    step(rt, engine, {"a": 1})
    assert rt.reclaim_stats.releases_made == 0 and rt.reclaim_stats.plans_committed == 1
    assert len(rt.block_ids("a")) == 3  # densify emptied the tail block instead


def test_release_is_no_planner_and_bad_calls_change_nothing():
    with pytest.raises(ConfigError, match="planner must be one of .*got <PlanKind.RELEASE"):
        ReclaimConfig(planner=PlanKind.RELEASE)
    rt, engine = make({("a", 0): [4, 5, 6, 7]})
    rt.admit("a")
    step(rt, engine, {"a": 12})
    before = rt.table.state()
    with pytest.raises(UnknownRequestError):
        rt.manager.plan_release("nobody")
    with pytest.raises(PlanConflictError, match="'a' already has a plan in flight"):
        rt.manager.plan_release("a")
    assert rt.table.state() == before and rt.reclaim_stats.releases_made == 1


def test_naive_evict_in_the_simulator_releases_what_streaming_llm_leaves_wholly_dead():
    """StreamingLLM's sliding window leaves whole blocks dead (41-47 % of the blocks <= 50 % used, when
    Naive-Evict kept them): the paper's Naive-Evict gives them back, Random's scattered victims leave almost
    none, and compact still retains less than either."""
    wl = synthetic_workload(12, seed=0, prompt=(16, 64), output=(48, 128))
    out = {}
    for policy in ("streaming_llm", "random"):
        cfg = SimConfig(num_blocks=512, block_size=16, headroom=8, policy=policy, budget=0.5, seed=0,
                        check_invariants=True)
        out[policy] = {m: r for m, r in compare_modes(cfg, wl).items()}
    ratio = {p: {m: r.mean_retained_blocks / r.mean_ideal_blocks for m, r in res.items()} for p, res in out.items()}
    assert out["streaming_llm"]["off"].reclaim["releases_committed"] == 34, "seed 0"
    assert out["random"]["off"].reclaim["releases_committed"] == 0, "seed 0"
    assert ratio["streaming_llm"]["off"] == pytest.approx(1.391, abs=5e-3)
    assert ratio["random"]["off"] == pytest.approx(1.849, abs=5e-3)
    for p in out:
        assert ratio[p]["densify"] < ratio[p]["compact"] < ratio[p]["off"], p
        assert out[p]["off"].reclaim["plans_committed"] == out[p]["off"].reclaim["moves_committed"] == 0, p
