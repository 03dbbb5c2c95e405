"""One test (or one parametrized test) for every group of non-equivalent mutmut survivors.

docs/fuzzing.md, "The full mutmut run", lists the mutants of the safety modules that the unit tests did
not kill, each group with the test that would kill it. The sections below follow that table's rows in
order; each test asserts exact values (error class, whole message, returned values, state unchanged after
a refusal), so a mutant that changes a branch, a bound, a count or a message fails it.

Scenes are built with the existing helpers: ``System`` / ``wasteful`` / ``launched`` of
tests/test_reclamation.py (a hand-wired pool, table, engine and manager) and ``make`` / ``forward`` /
``Scripted`` of tests/test_runtime.py (a runtime with a scripted policy). ``deep_state`` of
tests/misuse_snapshot.py proves that a refused call changed nothing.

Where a check is defensive (it fires only when another part of the core is wrong), the test hands it the
broken input by hand: a real plan made by the manager, replaced in its record by a corrupted copy
(``dataclasses.replace``) before the commit that checks it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from misuse_snapshot import deep_state, describe_diff
from test_reclamation import COMPACT_MOVES, STALE, System, launched, wasteful
from test_runtime import EVICT, Scripted, forward, make
from vtoken.core.block_pool import Purpose
from vtoken.core.compact import SourceChoice
from vtoken.core.reference.compact import choose_sources, plan_compaction
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.densify import plan_densify
from vtoken.core.errors import (
    BlockNotOwnedError,
    DestinationError,
    BlockOutOfRangeError,
    InvalidArgumentError,
    InvariantViolation,
    PlanConflictError,
    PoolExhaustedError,
    UnknownRequestError,
)
from vtoken.core.occupancy import SlotOccupancy
from vtoken.core.plan import NoPlan, NoPlanReason, Plan, PlanKind
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig
from vtoken.core.runtime import ReadPath
from vtoken.core.token_table import Move, TokenTable

DENSIFY = ReclaimConfig(planner=PlanKind.DENSIFY)
FAILED = "copy failed"


def refused(call, error, message, *state):
    """``call()`` raises exactly ``error`` with exactly ``message``, and nothing reachable from ``state`` changed."""
    before = deep_state(*state)
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert str(info.value) == message
    after = deep_state(*state)
    assert after == before, describe_diff(before, after)
    return info.value


# =====================================================================================================
# Row 1. _check_commit / _check_layout: commit's executed precondition.
#
# The scene is test_reclamation's ``wasteful`` one: 6 blocks of 4, "a" holds blocks [0, 1, 2, 3], cursor 14,
# live tokens 0 | 7 | 8 9 | 12 13; the compact plan moves 0, 7, 8, 9 into block 4 (COMPACT_MOVES). Its copy
# is launched and completed, then the record's plan is swapped for a corrupted copy; ``settle`` commits it,
# and the commit must refuse before changing anything. Staged layout (destination attached, moves not yet
# applied): [4, 0, 1, 2, 3], cursor 18. Final layout: [4, 3], cursor 6.
# =====================================================================================================
def corrupted_compact(**changes):
    s, rec = launched()
    s.engine.complete(rec.handle)
    rec.plan = dataclasses.replace(rec.plan, **changes)
    return s, rec


def densify_scene(evict=(1,)):
    """6 blocks of 4, a densify manager: "a" holds 5 tokens in [0, 1] (cursor 5), ``evict`` evicted."""
    s = System(config=DENSIFY)
    assert s.append("a", 5) == [0, 1, 2, 3, 4]
    for t in evict:
        s.table.evict_token("a", t)
    return s


def corrupted_densify(**changes):
    """Token 1 evicted: the real plan moves token 4 from (1, 0) into the hole (0, 1), releases block 1 and
    sets the cursor to 4; its copy is completed, then the plan is corrupted."""
    s = densify_scene()
    rec = s.manager.plan_request("a")
    assert rec.plan == Plan(PlanKind.DENSIFY, "a", (0, 5), (Move(4, 1, 0, 0, 1),), (1,), (), 4)
    s.manager.launch()
    s.engine.complete(rec.handle)
    rec.plan = dataclasses.replace(rec.plan, **changes)
    return s, rec


def break_msg(kind, defect):
    return f"I4: request 'a': committing its {kind} plan would break the table: {defect}; nothing was changed"


M7_WRONG_SRC = Move(7, 1, 2, 4, 1)  # token 7 lives at (1, 3)
M9_AT_CURSOR = Move(9, 2, 1, 3, 2)  # block 3 is staged at index 4: position 4 * 4 + 2 = 18, the staged cursor
M9_UNLISTED = Move(9, 2, 1, 5, 0)  # block 5 is neither listed nor a destination
M9_SAME_DST = Move(9, 2, 1, 4, 2)  # token 8 already writes (4, 2) = slot 18
M9_ONTO_12 = Move(9, 2, 1, 3, 0)  # slot 12 holds live token 12, which does not move
M7_OFFSET_PAST = Move(7, 0, 7, 4, 1)  # (0, 7) is slot 7, token 7's, but offset 7 lies outside a block of 4
M9_DST_OFFSET = Move(9, 2, 1, 4, 5)  # staged position 0 * 4 + 5 < 18, yet offset 5 lies outside block 4

COMMIT_DEFECTS = {
    "reads a slot its token does not hold": (
        dict(moves=(COMPACT_MOVES[0], M7_WRONG_SRC) + COMPACT_MOVES[2:]),
        f"move {M7_WRONG_SRC} reads a slot token 7 does not hold"),
    # regression (found by tests/test_fastpath_gather.py): slot numbers alone passed, and apply_moves refused the
    # offset after the splice, a commit stopped half-way
    "reads its token's slot through an offset outside its block": (
        dict(moves=(COMPACT_MOVES[0], M7_OFFSET_PAST) + COMPACT_MOVES[2:]),
        f"move {M7_OFFSET_PAST} reads a slot token 7 does not hold"),
    "writes through an offset outside its block": (
        dict(moves=COMPACT_MOVES[:3] + (M9_DST_OFFSET,)),
        f"move {M9_DST_OFFSET} writes outside the staged block list or at or after its cursor 18"),
    "writes at the staged cursor": (
        dict(moves=COMPACT_MOVES[:3] + (M9_AT_CURSOR,)),
        f"move {M9_AT_CURSOR} writes outside the staged block list or at or after its cursor 18"),
    "writes into a block outside the staged list": (
        dict(moves=COMPACT_MOVES[:3] + (M9_UNLISTED,)),
        f"move {M9_UNLISTED} writes outside the staged block list or at or after its cursor 18"),
    "claims a slot twice": (
        dict(moves=COMPACT_MOVES[:3] + (M9_SAME_DST,)),
        f"move {M9_SAME_DST} writes slot 18, which is claimed"),
    "writes a slot a live token keeps": (
        dict(moves=COMPACT_MOVES[:3] + (M9_ONTO_12,)),
        f"move {M9_ONTO_12} writes slot 12, which is claimed"),
    "moves a token twice": (
        dict(moves=(Move(0, 0, 0, 4, 0), Move(0, 0, 0, 4, 1)) + COMPACT_MOVES[2:]),
        "a token moves twice"),
    "staged list repeats a block": (  # the destination is the cursor block, already listed
        dict(dst_blocks=(3,), moves=(Move(0, 0, 0, 3, 2),)),
        "block list [3, 0, 1, 2, 3] repeats a block or names one outside the pool"),
    "staged list names a block past the pool": (  # block 6 == num_blocks
        dict(dst_blocks=(6,), moves=tuple(m._replace(dst_block=6) for m in COMPACT_MOVES)),
        "block list [6, 0, 1, 2, 3] repeats a block or names one outside the pool"),
    "drops a block with live tokens": (  # block 3 (tokens 12, 13) is given up too
        dict(src_blocks=(0, 1, 2, 3)),
        "block 3 holds live tokens but would leave block list [4]"),
    "moves the cursor below zero": (  # four sources, no destination: 14 - 4 * 4
        dict(src_blocks=(0, 1, 2, 3), dst_blocks=(), moves=()),
        "cursor -2 outside its 0 blocks"),
}


@pytest.mark.parametrize("defect", list(COMMIT_DEFECTS))
def test_commit_refuses_a_corrupted_compact_plan_and_changes_nothing(defect):
    changes, message = COMMIT_DEFECTS[defect]
    s, rec = corrupted_compact(**changes)
    err = refused(s.manager.settle, InvariantViolation, break_msg("compact", message), s.manager)
    assert err.invariant == "I4"
    assert rec.state is PlanState.COPYING and s.manager.inflight == {"a": rec}  # still in flight, not aborted


def test_commit_refuses_to_free_a_block_more_often_than_it_is_referenced():
    s, rec = launched()
    assert s.pool.allocate(1, Purpose.EVACUATION) == [5]  # block 5 now holds one reference
    s.engine.complete(rec.handle)
    # two unused "destinations" that are both block 5: commit would free it twice
    rec.plan = dataclasses.replace(rec.plan, dst_blocks=(4, 5, 5))
    err = refused(s.manager.settle, InvariantViolation,
                  break_msg("compact", "block 5 would be freed 2 time(s) with 1 reference(s)"), s.manager)
    assert err.invariant == "I4" and s.pool.ref_count(5) == 1 and s.manager.inflight == {"a": rec}


DENSIFY_DEFECTS = {
    # the move is dropped and block 1 kept: token 4 stays at position 4, the new cursor
    "leaves a live token at the new cursor": (
        dict(moves=(), src_blocks=()), "block 1 would hold live tokens at or after cursor 4"),
    "moves the cursor past its blocks": (dict(dense_write_pos=5), "cursor 5 outside its 1 blocks"),
    "gives a cursor that is not an int": (dict(dense_write_pos=4.0), "cursor 4.0 outside its 1 blocks"),
}


@pytest.mark.parametrize("defect", list(DENSIFY_DEFECTS))
def test_commit_refuses_a_corrupted_densify_plan_and_changes_nothing(defect):
    changes, message = DENSIFY_DEFECTS[defect]
    s, rec = corrupted_densify(**changes)
    err = refused(s.manager.settle, InvariantViolation, break_msg("densify", message), s.manager)
    assert err.invariant == "I4" and s.manager.inflight == {"a": rec}


def test_commit_refuses_while_the_copy_is_still_pending():
    # settle never commits a pending copy, so the check is reached only by calling the commit itself
    s, rec = launched()
    assert s.engine.poll(rec.handle) is CopyStatus.PENDING
    err = refused(lambda: s.manager._commit(rec), InvariantViolation,
                  f"I3: request 'a': commit while its copy {rec.handle} is still pending", s.manager)
    assert err.invariant == "I3"


def test_commit_accepts_a_move_into_a_slot_another_move_of_the_batch_vacates():
    # what apply_moves accepts, the precondition must accept: tokens 12 and 13 swap slots within block 3
    swap = (Move(12, 3, 0, 3, 1), Move(13, 3, 1, 3, 0))
    s, rec = corrupted_compact(moves=COMPACT_MOVES + swap)
    assert s.manager.settle() == [rec] and rec.state is PlanState.COMMITTED
    assert s.table.block_ids("a") == [4, 3] and s.table.write_pos("a") == 6
    assert [s.table.slot_of("a", t) for t in (0, 7, 8, 9, 12, 13)] == [16, 17, 18, 19, 13, 12]


@pytest.mark.parametrize("evict, blocks, cursor", [
    ([4], [0], 4),  # live tokens 0..3: the cursor lands on the end of the last kept block
    ([0, 1, 2, 3, 4], [], 0),  # nothing live: no block, cursor 0
])
def test_commit_accepts_the_boundary_cursors(evict, blocks, cursor):
    s = densify_scene(evict)
    rec = s.manager.plan_request("a")
    assert rec.plan.moves == () and rec.plan.dense_write_pos == cursor
    s.manager.launch()
    assert s.manager.settle() == [rec] and rec.state is PlanState.COMMITTED
    assert s.table.block_ids("a") == blocks and s.table.write_pos("a") == cursor


# =====================================================================================================
# Row 2. The compact planner's own assertions on the manager's arguments.
# =====================================================================================================
def test_choose_sources_refuses_its_arguments():
    snap = wasteful().table.snapshot("a")
    refused(lambda: choose_sources(snap, 0, 1), InvalidArgumentError,  # max_sources = 0, however large the budget
            "max_sources must be an int >= 1 (source blocks per plan of request 'a'), got 0", snap)
    refused(lambda: choose_sources(snap, 1, -1), InvalidArgumentError,  # a negative destination budget
            "dst_budget must be an int >= 0 (destination blocks for request 'a'), got -1", snap)
    # the smallest legal values are answered, not refused
    assert choose_sources(snap, 1, 0) == NoPlan(NoPlanReason.NOT_ENOUGH_HEADROOM, "request 'a': budget 0")
    assert choose_sources(snap, 1, 1) == NoPlan(NoPlanReason.NO_STRICT_DECREASE,
                                                "request 'a': 1 live tokens in 1 blocks need 1")
    assert choose_sources(snap, 8, 1) == SourceChoice((0, 1, 2), 4, 1)


@pytest.mark.parametrize("dst", [3, 0], ids=["listed but not a source", "a source"])
def test_plan_compaction_refuses_destinations_that_are_not_fresh(dst):
    snap = wasteful().table.snapshot("a")
    refused(lambda: plan_compaction(snap, [5, dst], 8), DestinationError,  # the caller's mistake, not a broken I4
            f"request 'a': destination block {dst} is not a fresh block id (an int >= 0, listed once, not in its "
            f"block list [0, 1, 2, 3])", snap)


def test_plan_compaction_refuses_max_sources_zero():
    snap = wasteful().table.snapshot("a")
    refused(lambda: plan_compaction(snap, [4], 0), InvalidArgumentError,
            "max_sources must be an int >= 1 (source blocks per plan of request 'a'), got 0", snap)
    assert plan_compaction(snap, [4], 8) == Plan(PlanKind.COMPACT, "a", (0, 14), COMPACT_MOVES, (0, 1, 2), (4,))


# =====================================================================================================
# Row 3. begin_step's forecast of what settling frees (_room_after_settle, _copy_status).
#
# Pools of 6 blocks of 4 with a headroom of 1, so that before settling at most free - 1 blocks can grow a
# request; every scene's growth does not fit before settling, so begin_step must forecast. Each test
# shows the largest growth that fits after settling is accepted and one token more is refused, with the
# forecast's numbers in the message and nothing changed.
# =====================================================================================================
def compact_in_flight(victims=None):
    """"a": 14 tokens in [0, 1, 2, 3], EVICT evicted; its compact plan (blocks 0, 1, 2 into 4) is copying,
    pending; block 5 is the only free block."""
    script = {("a", 0): EVICT}
    script.update(victims or {})
    rt, engine = make(num_blocks=6, headroom=1, policy=Scripted(script), budget=2, reclaim=ReclaimConfig(),
                      auto_complete=False)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 14}))
    assert rt.end_step() == {"a": EVICT}
    rec = rt.manager.in_flight("a")
    assert rec.state is PlanState.COPYING and rec.plan.src_blocks == (0, 1, 2) and rec.plan.dst_blocks == (4,)
    assert rt.pool.free_block_ids() == [5]
    return rt, engine, rec


def densify_in_flight(victims):
    """"a": 16 tokens in [0, 1, 2, 3], ``victims`` evicted at step 0; its densify plan is in flight."""
    rt, engine = make(num_blocks=6, headroom=1, policy=Scripted({("a", 0): victims}), budget=6, reclaim=DENSIFY,
                      auto_complete=False)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 16}))
    assert rt.end_step() == {"a": victims}
    rec = rt.manager.in_flight("a")
    assert rec.state is PlanState.COPYING and rec.plan.src_blocks == (2, 3) and rec.plan.dense_write_pos == 6
    assert rt.pool.free_block_ids() == [4, 5]
    return rt, engine, rec


def needs_forecast(rt, appends):
    """The growth does not fit before settling, so begin_step must forecast what settling frees."""
    need = sum(rt.blocks_to_grow(r, n) for r, n in appends.items())
    assert need and not rt.pool.can_allocate(need, Purpose.ADMISSION)
    return appends


def exhausted(step, reqs, need, free, reserved=1):
    return (f"step {step}: appends of request(s) {reqs} need {need} blocks, {free} free with {reserved} reserved; "
            f"preempt a request first")


def test_forecast_counts_a_settled_compaction_before_it_commits():
    rt, engine, rec = compact_in_flight()
    engine.complete(rec.handle)  # done, not committed: settling will give back blocks 0, 1, 2
    # after settling: [4, 3] with cursor 6, 4 free, 3 of them for admission: 6 + 14 = 20 fits, 21 does not
    refused(lambda: rt.begin_step({"a": 15}), PoolExhaustedError, exhausted(1, ["a"], 4, 4), rt)
    inp = rt.begin_step(needs_forecast(rt, {"a": 14}))
    assert rec.state is PlanState.COMMITTED
    assert rt.table.block_ids("a") == [4, 3, 5, 0, 1] and rt.table.write_pos("a") == 20
    assert inp.requests["a"].write_slots == [14, 15, 20, 21, 22, 23, 0, 1, 2, 3, 4, 5, 6, 7]
    assert rt.pool.free_block_ids() == [2]


def test_forecast_counts_nothing_for_a_pending_copy():
    rt, engine, rec = compact_in_flight()
    refused(lambda: rt.begin_step({"a": 5}), PoolExhaustedError, exhausted(1, ["a"], 1, 1), rt)
    assert rt.begin_step({"a": 2}) is not None  # fits the cursor block: no block, no forecast
    assert rec.state is PlanState.COPYING


def test_forecast_counts_a_destination_whose_tokens_were_evicted_in_flight():
    # step 1 evicts the four tokens the plan moves: block 4 receives nothing and goes back at commit
    rt, engine, rec = compact_in_flight({("a", 1): [0, 7, 8, 9]})
    forward(rt, engine, rt.begin_step({}))
    assert rt.end_step() == {"a": [0, 7, 8, 9]}
    engine.complete(rec.handle)
    # after settling: [3] with cursor 2, blocks 0, 1, 2, 4 and 5 free: 2 + 18 = 20 fits, 21 does not
    refused(lambda: rt.begin_step({"a": 19}), PoolExhaustedError, exhausted(2, ["a"], 5, 5), rt)
    rt.begin_step(needs_forecast(rt, {"a": 18}))
    assert rec.state is PlanState.COMMITTED and rt.manager.stats.moves_dropped == 4
    assert rt.table.block_ids("a") == [3, 5, 0, 1, 2] and rt.table.write_pos("a") == 20
    assert rt.pool.free_block_ids() == [4]


def test_forecast_counts_only_the_destinations_of_a_failed_copy():
    rt, engine, rec = compact_in_flight()
    engine.fail(rec.handle)
    # settling aborts: block 4 comes back, the layout stays: 14 + 6 = 20 fits in one more block, 21 does not
    refused(lambda: rt.begin_step({"a": 7}), PoolExhaustedError, exhausted(1, ["a"], 2, 2), rt)
    rt.begin_step(needs_forecast(rt, {"a": 6}))
    assert rec.state is PlanState.ABORTED and rec.abort_reason == FAILED
    assert rt.table.block_ids("a") == [0, 1, 2, 3, 5] and rt.table.write_pos("a") == 20
    assert rt.pool.free_block_ids() == [4]


def test_forecast_uses_the_layout_a_settled_densify_plan_commits():
    rt, engine, rec = densify_in_flight(list(range(1, 11)))  # live 0, 11..15: moved into positions 1..5
    engine.complete(rec.handle)
    # after settling: [0, 1] with cursor 6, blocks 2..5 free: 6 + 14 = 20 fits, 21 does not. Without the
    # new layout (cursor 16 in four blocks) 14 appends would need 4 blocks and be refused
    refused(lambda: rt.begin_step({"a": 15}), PoolExhaustedError, exhausted(1, ["a"], 4, 4), rt)
    rt.begin_step(needs_forecast(rt, {"a": 14}))
    assert rec.state is PlanState.COMMITTED
    assert rt.table.block_ids("a") == [0, 1, 4, 5, 2] and rt.table.write_pos("a") == 20


def test_forecast_adds_the_needs_of_every_request_in_the_step():
    rt, engine, rec = densify_in_flight(list(range(1, 11)))
    engine.complete(rec.handle)
    rt.admit("b")
    # after settling, 3 blocks for admission: "a" (cursor 6 in [0, 1]) grows by 2 within block 1, "b" takes
    # ceil(12 / 4) = 3 blocks; one token more for "b" needs a fourth. "b" comes first, "a" (whose layout the
    # forecast takes from its plan) last, so a forecast that kept only the last request's need is caught
    refused(lambda: rt.begin_step({"b": 13, "a": 2}), PoolExhaustedError, exhausted(1, ["b", "a"], 4, 4), rt)
    rt.begin_step(needs_forecast(rt, {"b": 12, "a": 2}))
    assert rec.state is PlanState.COMMITTED
    assert rt.table.block_ids("a") == [0, 1] and rt.table.write_pos("a") == 8
    assert rt.table.block_ids("b") == [4, 5, 2] and rt.pool.free_block_ids() == [3]


def test_forecast_counts_a_densify_plan_with_nothing_to_copy():
    # the evicted tokens are the tail: no move, so the plan is COPYING without a copy handle (settled)
    rt, engine, rec = densify_in_flight(list(range(6, 16)))
    assert rec.handle is None and rec.plan.moves == ()
    refused(lambda: rt.begin_step({"a": 15}), PoolExhaustedError, exhausted(1, ["a"], 4, 4), rt)
    rt.begin_step(needs_forecast(rt, {"a": 14}))
    assert rec.state is PlanState.COMMITTED
    assert rt.table.block_ids("a") == [0, 1, 4, 5, 2] and rt.table.write_pos("a") == 20


def test_forecast_frees_nothing_for_a_stale_densify_plan_and_its_abort_has_no_detail():
    rt, engine, rec = densify_in_flight(list(range(1, 11)))
    forward(rt, engine, rt.begin_step({"a": 1}))  # an append while the copy runs: the plan is stale
    assert rt.end_step() == {}
    engine.complete(rec.handle)
    assert rt.pool.free_block_ids() == [5]
    # settling aborts the stale plan and frees nothing: 17 + 3 = 20 fits the five blocks, one more does not
    refused(lambda: rt.begin_step({"a": 4}), PoolExhaustedError, exhausted(2, ["a"], 1, 1), rt)
    rt.begin_step({"a": 3})
    assert rec.state is PlanState.ABORTED and rec.abort_reason == STALE and rec.abort_detail == ""
    assert rt.manager.stats.plans_aborted == Counter({STALE: 1})
    assert rt.table.block_ids("a") == [0, 1, 2, 3, 4] and rt.table.write_pos("a") == 20


def test_forecast_counts_what_a_settled_orphan_holds():
    rt, engine, rec = compact_in_flight()
    rt.finish("a")  # mid-copy: blocks 0, 1, 2 and destination 4 are held until the copy settles
    assert rt.manager.orphans == [rec] and rec.held == (0, 1, 2, 4) and rt.pool.free_block_ids() == [5, 3]
    rt.admit("b")
    refused(lambda: rt.begin_step({"b": 5}), PoolExhaustedError, exhausted(1, ["b"], 2, 2), rt)  # still pending
    engine.complete(rec.handle)
    refused(lambda: rt.begin_step({"b": 21}), PoolExhaustedError, exhausted(1, ["b"], 6, 6), rt)
    rt.begin_step(needs_forecast(rt, {"b": 20}))
    assert rt.manager.orphans == []
    assert rt.table.block_ids("b") == [5, 3, 0, 1, 2] and rt.pool.free_block_ids() == [4]


# =====================================================================================================
# Row 4. The engine-allocates path (vLLM's): sync, evict_and_reclaim, detach.
# =====================================================================================================
WEIGHTS = [t / 16 for t in range(12)]  # exact in float32


def engine_allocates(victims=(), reclaim=DENSIFY, budget=7):
    """8 blocks of 4, headroom 1; the test allocates the blocks, as an engine does, and syncs 12 tokens."""
    rt, engine = make(policy=Scripted({("a", 0): list(victims)}), budget=budget, reclaim=reclaim,
                      auto_complete=False)
    rt.admit("a")
    blocks = rt.pool.allocate(3, Purpose.ADMISSION)
    assert blocks == [0, 1, 2]
    assert rt.sync("a", blocks, 12) == list(range(12))
    return rt, engine


def test_sync_then_evict_and_reclaim_returns_the_victims_and_evicts_them():
    rt, engine = engine_allocates(victims=[1, 8, 9, 10, 11])
    assert rt.evict_and_reclaim(["a"], {"a": (list(range(12)), WEIGHTS)}) == {"a": [1, 8, 9, 10, 11]}
    assert rt.table.live_token_ids("a") == [0, 2, 3, 4, 5, 6, 7]
    assert [rt.scores.accumulated("a", t) for t in range(12)] == WEIGHTS
    assert rt.iteration == 1
    # reclamation ran too: densify moves token 7 into the hole at position 1 and gives up block 2
    rec = rt.manager.in_flight("a")
    assert rec.state is PlanState.COPYING
    assert rec.plan == Plan(PlanKind.DENSIFY, "a", (0, 12), (Move(7, 1, 3, 0, 1),), (2,), (), 7)
    # a later sync appends the engine's next block and returns the new tokens' slots
    assert rt.pool.allocate(1, Purpose.ADMISSION) == [3]
    assert rt.sync("a", [3], 13) == [12] and rt.table.block_ids("a") == [0, 1, 2, 3]


def test_detach_returns_the_block_list_and_forgets_the_scores():
    rt, engine = engine_allocates(reclaim=None)
    rt.evict_and_reclaim(["a"], {"a": (list(range(12)), WEIGHTS)})
    assert rt.detach("a") == [0, 1, 2]
    assert "a" not in rt.table and "a" not in rt.scores
    assert [rt.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]  # the engine frees its blocks itself
    refused(lambda: rt.detach("a"), UnknownRequestError, "unknown request 'a'", rt)
    rt.admit("a")  # no scores of the old request are left to collide with
    assert rt.table.block_ids("a") == [] and rt.table.total_len("a") == 0


def test_detach_refuses_a_request_with_a_plan_in_flight():
    rt, engine = engine_allocates(victims=[1, 8, 9, 10, 11])
    rt.evict_and_reclaim(["a"])
    refused(lambda: rt.detach("a"), PlanConflictError,
            "request 'a' has a plan in flight; its blocks cannot be handed back yet", rt)


@pytest.mark.parametrize("args, error, message", [
    (("ab",), InvalidArgumentError, "req_ids must be a sequence, got 'ab'"),
    ((["a"], [([0], [1.0])]), InvalidArgumentError, "attention must be a mapping, got [([0], [1.0])]"),
    ((["a", "u1", "u2", "u3", "u4", "u5", "u6"],), UnknownRequestError,
     "unknown request(s) ['u1', 'u2', 'u3', 'u4', 'u5']"),
    ((["a"], {"zz": ([0], [1.0])}), UnknownRequestError, "unknown request(s) ['zz']"),
    ((["a"] * 9,), InvalidArgumentError, f"req_ids name a request twice: {['a'] * 8}"),
    ((["a"], {"a": 5}), InvalidArgumentError,
     "request 'a': attention must map a request to (token ids, weights), got 5"),
    ((["a"], {"a": ([0, 1], [0.5], [0.5])}), InvalidArgumentError,
     "request 'a': attention must map a request to (token ids, weights), got ([0, 1], [0.5], [0.5])"),
], ids=["lone str", "attention list", "six unknown", "unknown row", "nine times", "row not a pair", "row triple"])
def test_evict_and_reclaim_refuses_bad_arguments_naming_them(args, error, message):
    rt, engine = engine_allocates(victims=[1])
    refused(lambda: rt.evict_and_reclaim(*args), error, message, rt)


def test_sync_refuses_a_free_block():
    rt, engine = engine_allocates()
    refused(lambda: rt.sync("a", [7], 13), BlockNotOwnedError,
            "request 'a': block 7 is free in the pool; sync only blocks allocated for the request", rt)


def test_sync_refuses_a_free_block_listed_after_a_shared_one():
    rt, engine = engine_allocates()
    rt.admit("c")
    rt.pool.share(0)  # a prefix-cache hit on "a"'s full block 0: fine; block 7 after it is not
    refused(lambda: rt.sync("c", [0, 7], 8), BlockNotOwnedError,
            "request 'c': block 7 is free in the pool; sync only blocks allocated for the request", rt)
    assert rt.sync("c", [0], 4) == [0, 1, 2, 3] and rt.table.owners(0) == ["a", "c"]


def test_sync_refuses_a_block_of_another_request_the_pool_counts_once():
    rt, engine = engine_allocates()
    rt.admit("c")
    refused(lambda: rt.sync("c", [0], 4), BlockNotOwnedError,
            "request 'c': block 0 belongs to request 'a' and the pool counts 1 reference(s) for 2 holders; "
            "a block is in two block lists only when it is shared in the pool", rt)


def test_sync_refuses_the_destination_of_a_plan_in_flight_naming_its_request():
    rt, engine = make(num_blocks=8, headroom=1, policy=Scripted({("a", 0): EVICT}), budget=2,
                      reclaim=ReclaimConfig(), auto_complete=False)
    rt.admit("a")
    assert rt.sync("a", rt.pool.allocate(4, Purpose.ADMISSION), 14) == list(range(14))
    assert rt.evict_and_reclaim(["a"]) == {"a": EVICT}
    assert rt.manager.in_flight("a").plan.dst_blocks == (4,)
    rt.admit("c")
    refused(lambda: rt.sync("c", [4], 2), BlockNotOwnedError,
            "request 'c': block 4 is reserved by the relocation plan of request 'a'", rt)
    rt.finish("a")  # mid-copy: the orphaned plan holds 0, 1, 2 and 4 until its copy settles
    refused(lambda: rt.sync("c", [0], 2), BlockNotOwnedError,
            "request 'c': block 0 is reserved by the relocation plan of request 'a'", rt)


@pytest.mark.parametrize("block", [0, 1, 2], ids=["hole written", "mover read", "released"])
def test_sync_refuses_a_shared_block_a_densify_plan_in_flight_touches(block):
    # "a"'s plan moves token 7 out of block 1 into the hole in block 0, and gives up block 2 (all evicted)
    rt, engine = engine_allocates(victims=[1, 8, 9, 10, 11])
    rt.evict_and_reclaim(["a"])
    rt.admit("c")
    rt.pool.share(block)
    refused(lambda: rt.sync("c", [block], 4), PlanConflictError,
            f"request 'c': block {block} of request 'a' is touched by its plan in flight; it cannot be shared "
            f"until the plan settles", rt)


# =====================================================================================================
# Row 5. SlotOccupancy.block_live's argument check.
# =====================================================================================================
def occupancy():
    o = SlotOccupancy(4, 2)
    for slot in (0, 1, 7):  # block 0 holds 2 live slots, block 3 one
        o.claim(slot)
    return o


@pytest.mark.parametrize("block", [-1, 4, 1.0, True], ids=["negative", "num_blocks", "float", "bool"])
def test_block_live_refuses_a_block_outside_the_pool(block):
    o = occupancy()
    refused(lambda: o.block_live(block), BlockOutOfRangeError, f"block must be an int in [0, 3], got {block!r}", o)


def test_block_live_counts_the_first_and_the_last_block():
    o = occupancy()
    assert [o.block_live(b) for b in range(4)] == [2, 0, 0, 1]


# =====================================================================================================
# Row 6. can_admit's prompt_len check.
# =====================================================================================================
@pytest.mark.parametrize("prompt_len", [-1, 1.5, True])
def test_can_admit_refuses_a_bad_prompt_len(prompt_len):
    rt, _ = make()
    refused(lambda: rt.can_admit(prompt_len), InvalidArgumentError,
            f"prompt_len must be an int >= 0, got {prompt_len!r}", rt)


def test_can_admit_answers_for_an_empty_and_a_full_prompt():
    rt, _ = make()  # 8 blocks of 4, headroom 1: 7 blocks (28 tokens) for admission
    assert rt.can_admit(0) is True and rt.can_admit(28) is True and rt.can_admit(29) is False


# =====================================================================================================
# Row 7. should_reclaim with the adaptive trigger: the waste ratio's range, the burst rule, the burst count.
# =====================================================================================================
def burst_system():
    """6 blocks of 4; burst_df 0.5, theta_F 0.5: the waste ratios below are exact binary fractions."""
    return System(config=ReclaimConfig(theta_f=0.5, burst_df=0.5))


def test_a_waste_ratio_of_exactly_one_is_legal():
    s = burst_system()
    s.append("a", 4)
    for t in range(4):
        s.table.evict_token("a", t)  # a block allocated, no live slot: F = 1
    assert s.manager.waste_ratio() == 1.0
    assert s.manager.should_reclaim(0) is True and s.manager.stats.bursts == 0


def test_a_waste_ratio_below_zero_is_an_occupancy_bug():
    s = burst_system()
    s.table.add_request("a")
    s.table.sync_new_tokens("a", [0, 1], 8)  # the table claims two blocks, the pool allocated one of them
    s.pool.allocate(1, Purpose.ADMISSION)
    err = refused(lambda: s.manager.should_reclaim(0), InvariantViolation,
                  "I2: waste ratio -1.0 out of [0, 1]", s.manager)
    assert err.invariant == "I2"


def test_a_rise_to_exactly_theta_f_is_no_burst():
    s = burst_system()
    s.append("a", 4)
    assert s.manager.should_reclaim(0) is False  # F = 0
    s.table.evict_token("a", 0)
    s.table.evict_token("a", 1)  # F = 0.5: risen by burst_df, but not above theta_F
    assert s.manager.should_reclaim(1) is False
    assert s.manager.stats.bursts == 0 and s.manager.burst is False


def test_two_bursts_count_two():
    s = burst_system()
    s.append("a", 4)
    assert s.manager.should_reclaim(0) is False  # F = 0
    for t in (0, 1, 2):
        s.table.evict_token("a", t)  # F = 0.75
    assert s.manager.should_reclaim(1) is True and s.manager.burst is True and s.manager.stats.bursts == 1
    s.append("a", 4)  # F = 1 - 5/8 = 0.375: caught up, burst mode ends
    assert s.manager.should_reclaim(2) is False and s.manager.burst is False
    for t in (4, 5, 6, 7):
        s.table.evict_token("a", t)  # F = 0.875: up by 0.5 again
    assert s.manager.should_reclaim(3) is True and s.manager.burst is True
    assert s.manager.stats.bursts == 2


# =====================================================================================================
# Row 8. _abort: its detail's default, its count, and its two executed checks.
# =====================================================================================================
def test_a_stale_abort_has_no_detail():
    s = wasteful(planner=PlanKind.DENSIFY)
    rec = s.manager.plan_request("a")
    s.manager.launch()
    s.append("a", 1)  # the request grew while the copy ran: the densify plan is stale
    s.engine.complete(rec.handle)
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.ABORTED and rec.abort_reason == STALE and rec.abort_detail == ""


def test_two_aborts_for_one_reason_count_two():
    s, first = launched()
    s.engine.fail(first.handle)
    assert s.manager.settle() == [first]
    second = s.manager.plan_request("a")
    s.manager.launch()
    s.engine.fail(second.handle)
    assert s.manager.settle() == [second]
    assert s.manager.stats.plans_aborted == Counter({FAILED: 2})
    assert (first.abort_reason, first.abort_detail) == (second.abort_reason, second.abort_detail) == (FAILED, "")


def test_abort_refuses_while_the_copy_can_still_write_the_destinations():
    s, rec = launched()  # pending
    err = refused(lambda: s.manager._abort(rec, "test"), InvariantViolation,
                  "I6: request 'a': aborting its plan would free destinations (4,) while its copy can still "
                  "write them", s.manager)
    assert err.invariant == "I6"


def test_abort_reads_the_status_of_a_copying_plan_without_a_handle():
    # a COPYING record with moves always has a handle; one without is a bug the status read reports (I3)
    s, rec = launched()
    bad = dataclasses.replace(rec, handle=None)
    err = refused(lambda: s.manager._abort(bad, "test"), InvariantViolation,
                  "I3: request 'a': plan is COPYING 4 moves but has no copy handle", s.manager)
    assert err.invariant == "I3"


# =====================================================================================================
# Row 9. _shareable_prefix against the source's densify plan in flight, and a freed prefix block.
# =====================================================================================================
def densify_releasing_block_2():
    """8 blocks of 4: "a" holds 12 tokens in [0, 1, 2] and evicted 8..11; its densify plan (no move) gives up
    block 2 and sets the cursor to 8 = 2 * S. It is in flight until the next settle."""
    rt, engine = make(policy=Scripted({("a", 0): [8, 9, 10, 11]}), budget=8, reclaim=DENSIFY, auto_complete=False)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 12}))
    assert rt.end_step() == {"a": [8, 9, 10, 11]}
    rec = rt.manager.in_flight("a")
    assert rec.plan == Plan(PlanKind.DENSIFY, "a", (0, 12), (), (2,), (), 8)
    return rt, rec


def test_sharing_the_prefix_up_to_a_densify_plans_new_cursor_is_allowed():
    rt, rec = densify_releasing_block_2()
    rt.admit("b", share_prefix_of="a", shared_blocks=2)  # the cursor lands at exactly 2 * S
    assert rt.table.block_ids("b") == [0, 1] and [rt.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]


def test_sharing_is_refused_when_a_densify_plan_moves_the_cursor_into_the_prefix():
    # A planner-made densify plan that moves the cursor below k * S also touches a prefix block (the new
    # cursor's block, or a released one), which is refused first. So the cursor clause is defensive: the
    # plan in flight is given a cursor of 7 by hand, touching no prefix block
    rt, rec = densify_releasing_block_2()
    rec.plan = dataclasses.replace(rec.plan, dense_write_pos=7)
    refused(lambda: rt.admit("b", share_prefix_of="a", shared_blocks=2), PlanConflictError,
            "request 'a': its densify plan in flight touches the cursor (moving it to position 7) of the prefix "
            "blocks [0, 1]; share them once the plan has settled", rt)
    assert "b" not in rt.running()


def test_sharing_is_refused_naming_the_prefix_block_a_plan_in_flight_touches():
    # dense path: "a" evicted token 5; densify moves token 11 into the hole at (1, 1). Block 0 is untouched,
    # so the refusal must name block 1, the first prefix block the plan touches
    config = ReclaimConfig(planner=PlanKind.DENSIFY, ordering=Ordering.EVENT)
    rt, engine = make(policy=Scripted({("a", 0): [5]}), budget=11, reclaim=config, read_path=ReadPath.DENSE)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 12}))
    assert rt.end_step() == {"a": [5]}
    assert rt.manager.in_flight("a").plan.moves == (Move(11, 2, 3, 1, 1),)
    refused(lambda: rt.admit("b", share_prefix_of="a", shared_blocks=2), PlanConflictError,
            "request 'a': its densify plan in flight touches block 1 of the prefix blocks [0, 1]; share them "
            "once the plan has settled", rt)


def test_sharing_a_prefix_block_the_pool_has_freed_names_it():
    rt, engine = make()
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 8}))
    rt.end_step()
    rt.pool.free([1])  # the engine freed "a"'s block 1 behind the runtime's back
    refused(lambda: rt.admit("b", share_prefix_of="a", shared_blocks=2), BlockNotOwnedError,
            "request 'a': block 1 is free in the pool; it cannot be shared", rt)
    assert "b" not in rt.running()


# =====================================================================================================
# Row 10. plan_round's argument check.
# =====================================================================================================
@pytest.mark.parametrize("ids", ["ab", 5])
def test_plan_round_refuses_a_request_list_that_is_not_one(ids):
    s = wasteful()
    refused(lambda: s.manager.plan_round(ids), InvalidArgumentError,
            f"plan_round: request ids must be a sequence, got {ids!r}", s.manager)
    assert s.manager.stats.rounds == 0


# =====================================================================================================
# Row 11. TokenTable._check_shareable: the sharer limit and the refusal's positions.
# =====================================================================================================
def test_a_shared_block_must_be_filled_by_the_sync_that_adds_it():
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0, 1], 6)  # block 0 is full
    t.add_request("c")
    t.sync_new_tokens("c", [2], 4)  # c's own full block: block 0 would join at position 4
    refused(lambda: t.sync_new_tokens("c", [0], 7), BlockNotOwnedError,
            "request 'c': block 0 belongs to request 'a'; a shared block must be filled by the sync that adds it "
            "(positions [4, 8), tokens end at 7)", t)


def test_a_block_whose_owner_cursor_just_passed_it_is_shared_when_the_sync_just_fills_it():
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0], 4)  # a's cursor at 4 = the end of block 0
    t.add_request("c")
    assert t.sync_new_tokens("c", [0], 4) == [0, 1, 2, 3]  # the sync ends exactly at the block's end
    assert t.owners(0) == ["a", "c"]


def test_the_sharer_limit_is_65535():
    # The limit is a literal in _check_shareable (no module constant to lower), and reaching it through
    # sync_new_tokens costs O(n^2): every sync scans every holder. The rule is checked on its own, with the
    # holder list it is handed: 65,534 holders (one real request, repeated) pass, 65,535 are refused
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0], 4)
    assert t._check_shareable("c", 0, ["a"] * 0xFFFE, 0, 4) is None
    refused(lambda: t._check_shareable("c", 0, ["a"] * 0xFFFF, 0, 4), BlockNotOwnedError,
            "request 'c': block 0 is already shared by 65535 requests", t)


# =====================================================================================================
# Row 12. plan_densify refuses when the new cursor's block is shared.
# =====================================================================================================
def test_densify_refuses_to_put_the_cursor_in_a_shared_block():
    rt, engine = make(policy=Scripted({("b", 1): [3, 4, 5]}), budget=3, reclaim=DENSIFY)
    same = lambda r, t: t + 1  # noqa: E731 - one content for the shared prefix
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 8}), tags=same)
    rt.end_step()
    rt.admit("b", share_prefix_of="a", shared_blocks=1)  # b's block 0 is a's
    forward(rt, engine, rt.begin_step({"b": 2}), tags=same)
    assert rt.table.block_ids("b") == [0, 2]
    # b keeps tokens 0, 1, 2: densify would release block 2 and set b's cursor to position 3, in block 0,
    # where b's next append would overwrite a's token 3
    assert rt.end_step() == {"b": [3, 4, 5]}
    assert plan_densify(rt.table.snapshot("b", [0])) == NoPlan(NoPlanReason.SHARED_BLOCK, "request 'b': blocks [0]")
    assert rt.manager.in_flight("b") is None and rt.manager.stats.no_plan == Counter({NoPlanReason.SHARED_BLOCK: 1})
    inp = rt.begin_step({"b": 1})
    assert inp.requests["b"].write_slots == [10]  # position 6, in b's own block 2
    forward(rt, engine, inp, tags=same)  # a still reads its token 3 from slot 3
    assert rt.table.slot_of("a", 3) == 3


# =====================================================================================================
# Row 13. plan_round plans only requests with an excess block.
# =====================================================================================================
@pytest.mark.parametrize("planner", [PlanKind.COMPACT, PlanKind.DENSIFY])
def test_plan_round_skips_a_request_with_holes_but_no_excess_block(planner):
    s = System(config=ReclaimConfig(planner=planner))
    s.append("a", 8)
    s.table.evict_token("a", 1)
    s.table.evict_token("a", 2)  # 6 live tokens in 2 = ceil(6 / 4) blocks: nothing to gain
    assert s.manager.plan_round(["a"]) == []
    assert s.manager.inflight == {} and s.manager.stats.no_plan == Counter() and s.manager.stats.rounds == 1
