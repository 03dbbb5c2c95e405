"""Edges of core/reclamation.py that the full mutmut run's survivors showed no unit test pinned.

mutmut 3.8.1 ran every mutant of the core's safety modules against the unit tests; 65 mutants of
core/reclamation.py survived. The tests below kill 61 of them; the other 4 are equivalent (settle's skip of a
PLANNED record, which only ever precedes other PLANNED ones; a mask default read only for a block that always
receives a move; ``_in_table``'s except branch, which TokenTable's ``__contains__`` never reaches; as_list's
default error class, the one passed). What the tests pin:

  * the adaptive trigger's start state and its re-read of F after a plan (a plan's own destinations are
    no burst), the waste ratio's upper bound, and admission's ``>=`` against the headroom;
  * plan_request's refusal of a compact plan that does not use the reserved destinations (it frees them);
  * launch and settle go on past a record they skip (a COPYING plan, a plan with nothing to copy, a copy
    still pending) and launch hands the engine the plan's request id;
  * on_request_removed: its argument refusals name the request and change nothing, a pending copy's
    sources and destinations are held exactly (densify: the request's own blocks), aborts are counted;
  * the stats of several commits accumulate;
  * launch's executed precondition (``_check_moves``) and commit's (``_check_commit`` / ``_check_layout``)
    refuse each corrupted plan with the exact invariant and message, before anything changes.

Scenes come from tests/test_reclamation.py (``System``, ``wasteful``, ``two_requests``) and
tests/test_mutation_survivors.py (``refused``, the densify scene, ``break_msg``). Defensive checks are handed
a real plan replaced by a corrupted copy (``dataclasses.replace``), as those files do.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from test_mutation_survivors import DENSIFY, break_msg, densify_scene, refused
from test_reclamation import COMPACT_MOVES, LEFT, System, two_requests, wasteful
from vtoken.core import reclamation
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.errors import (
    BlockNotOwnedError,
    BlockOutOfRangeError,
    DoubleFreeError,
    InvariantViolation,
)
from vtoken.core.sim.inmemory import InMemoryCopyEngine
from vtoken.core.plan import Plan, PlanKind
from vtoken.core.reclamation import LAUNCH_FAILED, PlanRecord, PlanState, ReclaimConfig
from vtoken.core.token_table import Move, TokenTable


# ---- Stage 1: the adaptive trigger ----------------------------------------------------------------------
# wasteful(): "a" holds 6 live tokens in 4 blocks of 4, so F = 1 - 6/16 = 0.625; its compact plan takes one
# destination block, after which F = 1 - 6/20 = 0.7 (destinations in flight count as waste).

def test_a_new_manager_is_not_in_burst_mode_and_keeps_the_cadence_off_it():
    s = wasteful(theta_f=0.5, burst_df=0.5, check_every=8)
    assert s.manager.burst is False
    # F > theta_F, but iteration 1 is off the K = 8 cadence and nothing rose: no round
    assert s.manager.should_reclaim(1) is False
    assert (s.manager.burst, s.manager.stats.bursts, s.manager.stats.burst_rounds) == (False, 0, 0)


def test_a_plans_own_destinations_are_no_burst():
    # the plan raises F by 0.075 >= burst_df; plan_request re-reads F, so the next call sees no rise
    s = wasteful(theta_f=0.5, burst_df=0.05, check_every=8)
    assert s.manager.should_reclaim(1) is False  # F = 0.625 is the first reading
    assert isinstance(s.manager.plan_request("a"), PlanRecord)
    assert s.manager.waste_ratio() == 0.7
    assert s.manager.should_reclaim(2) is False
    assert (s.manager.burst, s.manager.stats.bursts) == (False, 0)


def test_a_waste_ratio_above_one_is_an_occupancy_bug():
    # F > 1 needs a negative live-slot total: the occupancy's count is broken by hand (defensive check)
    s = System(config=ReclaimConfig(theta_f=0.5, burst_df=0.5))
    s.append("a", 4)  # one block allocated
    s.table.occupancy.live_slots = -4  # F = 1 - (-4) / 4 = 2.0
    err = refused(lambda: s.manager.should_reclaim(0), InvariantViolation,
                  "I2: waste ratio 2.0 out of [0, 1]", s.manager)
    assert err.invariant == "I2"


# ---- Stage 2: admission ---------------------------------------------------------------------------------
def test_admission_is_open_with_a_plan_in_flight_and_exactly_the_headroom_free():
    s = wasteful(num_blocks=7)  # headroom 2; "a" holds 4 blocks, 3 free
    s.manager.plan_request("a")  # takes 1: 2 free == headroom
    assert s.pool.num_free == s.pool.headroom == 2 and s.manager.inflight
    assert s.manager.admission_open() is True


# ---- Stage 3: a compact planner that breaks its contract -------------------------------------------------
def test_plan_request_refuses_a_compact_plan_that_ignores_its_reserved_destinations(monkeypatch):
    # The planner is handed block 4 and must use exactly it; a corrupted copy of its real plan names block 5.
    # plan_request frees the reserved block, then raises (defensive: only a planner bug gets here)
    real = reclamation.compact_plan
    made = []

    def wrong_dsts(*args):
        plan = dataclasses.replace(real(*args), dst_blocks=(5,))
        made.append(plan)
        return plan

    monkeypatch.setattr(reclamation, "compact_plan", wrong_dsts)
    s = wasteful()
    free_before = s.pool.num_free
    with pytest.raises(InvariantViolation) as info:
        s.manager.plan_request("a")
    assert type(info.value) is InvariantViolation and info.value.invariant == "I4"
    assert str(info.value) == (f"I4: request 'a': the compact planner did not use exactly the 1 reserved "
                               f"destination blocks [4]: {made[0]!r}")
    assert s.pool.num_free == free_before and s.pool.ref_count(4) == 0  # the reserved block went back
    assert s.manager.inflight == {} and s.manager.stats.plans_made == 0


# ---- Stage 4: launch and settle go on past the records they skip -----------------------------------------
def test_launch_goes_on_past_a_plan_already_copying():
    s = two_requests(max_plans_per_round=16)
    a = s.manager.plan_request("a")
    s.manager.launch()
    b = s.manager.plan_request("b")  # inflight: a (COPYING), then b (PLANNED)
    assert s.manager.launch() == []
    assert a.state is b.state is PlanState.COPYING and b.handle is not None
    assert s.engine.events["submitted"] == 2


def test_launch_goes_on_past_a_plan_with_nothing_to_copy():
    s = System(num_blocks=8, config=DENSIFY)
    s.append("a", 12)  # blocks [0, 1, 2]
    for t in (8, 9, 10, 11):
        s.table.evict_token("a", t)  # densify gives up block 2 and moves nothing
    s.append("b", 5)  # blocks [3, 4]
    s.table.evict_token("b", 1)  # densify moves token 4 into the hole
    a, b = s.manager.plan_request("a"), s.manager.plan_request("b")
    assert a.plan.moves == () and b.plan.moves == (Move(4, 4, 0, 3, 1),)
    assert s.manager.launch() == []
    assert a.state is b.state is PlanState.COPYING and a.handle is None and b.handle is not None
    assert s.engine.events["submitted"] == 1


def test_launch_hands_the_engine_the_plans_request_id():
    # The engine names the request in what it refuses (and quarantines by it). The plan's first move is
    # corrupted to read block 99: its token (1) was evicted, so launch's own check skips its source, and
    # the engine refuses the copy, which launch aborts
    s = wasteful()
    rec = s.manager.plan_request("a")
    bad = Move(1, 99, 0, 4, 0)
    rec.plan = dataclasses.replace(rec.plan, moves=(bad,) + COMPACT_MOVES[1:])
    assert s.manager.launch() == [rec]
    assert rec.state is PlanState.ABORTED and rec.abort_reason == LAUNCH_FAILED
    assert rec.abort_detail == (f"MoveSourceMismatchError: request 'a': move {bad} reads a slot outside the "
                                f"KV cache (6 blocks of 4, int fields)")


def test_settle_goes_on_past_a_copy_still_pending():
    s = two_requests(max_plans_per_round=16)
    # two streams: completing a's copy does not drain b's, submitted before it
    s.engine = s.manager.engine = InMemoryCopyEngine(s.store, auto_complete=False, one_stream=False)
    b, a = s.manager.plan_round(["a", "b"])  # inflight: b, then a
    s.manager.launch()
    s.engine.complete(a.handle)  # b's copy is still pending
    assert s.manager.settle() == [a]
    assert a.state is PlanState.COMMITTED and b.state is PlanState.COPYING
    assert s.manager.inflight == {"b": b}


def test_launch_accepts_a_plan_whose_token_was_evicted_since_planning():
    # the evicted token's move is dropped at commit; launch must not read its empty slot as a bad source
    s = wasteful()
    rec = s.manager.plan_request("a")
    s.table.evict_token("a", 7)
    assert s.manager.launch() == [] and rec.state is PlanState.COPYING
    s.engine.complete(rec.handle)
    assert s.manager.settle() == [rec] and rec.state is PlanState.COMMITTED
    assert s.manager.stats.moves_dropped == 1 and s.table.live_token_ids("a") == [0, 8, 9, 12, 13]


# ---- stats over several commits and aborts -----------------------------------------------------------------
def test_the_stats_of_two_commits_add_up():
    # "a": 4 moves from blocks (0, 1, 2) into one block; "b": 3 moves from (4, 5, 6) into one block
    s = two_requests(max_plans_per_round=16)
    b, a = s.manager.plan_round(["a", "b"])
    assert (len(a.plan.moves), len(a.plan.src_blocks), len(a.plan.dst_blocks)) == (4, 3, 1)
    assert (len(b.plan.moves), len(b.plan.src_blocks), len(b.plan.dst_blocks)) == (3, 3, 1)
    s.manager.launch()
    for h in s.engine.pending():
        s.engine.complete(h)
    assert s.manager.settle() == [b, a]
    assert (s.manager.stats.moves_committed, s.manager.stats.blocks_released) == (7, 4)


def test_two_requests_leaving_with_plans_in_flight_count_two_aborts():
    s = two_requests(max_plans_per_round=16)
    s.manager.plan_round(["a", "b"])
    s.remove("a")
    s.remove("b")
    assert s.manager.stats.plans_aborted == Counter({LEFT: 2})


# ---- on_request_removed: refusals and what a pending copy keeps ---------------------------------------------
def left_table(s, req="a"):
    """Take ``req`` out of the table (as the runtime does first) and return its block list."""
    return s.table.remove_request(req)


@pytest.mark.parametrize("blocks, message", [
    ([0, 1, 2, 6], "request 'a': block 6 outside the pool [0, 6)"),  # 6 == num_blocks
    ([0, 1, 2, 99], "request 'a': block 99 outside the pool [0, 6)"),
    (5, "request 'a': blocks must be a sequence, got 5"),
])
def test_on_request_removed_refuses_a_bad_block_list_naming_the_request(blocks, message):
    s = wasteful()
    assert left_table(s) == [0, 1, 2, 3]
    refused(lambda: s.manager.on_request_removed("a", blocks), BlockOutOfRangeError, message, s.manager)


def test_on_request_removed_refuses_a_list_that_also_names_the_plans_destination():
    # block 4 is the plan's destination, freed with the plan: listed by the caller too, it would be freed twice
    s = wasteful()
    rec = s.manager.plan_request("a")
    assert rec.plan.dst_blocks == (4,)
    assert left_table(s) == [0, 1, 2, 3]
    refused(lambda: s.manager.on_request_removed("a", [0, 1, 2, 3, 4]), DoubleFreeError,
            "block 4 would be freed 2 time(s) but holds 1 reference(s)", s.manager)
    assert s.manager.inflight == {"a": rec} and rec.state is PlanState.PLANNED


def test_on_request_removed_refuses_a_list_without_the_block_a_densify_plan_releases():
    # the densify plan moves nothing and gives up block 2; its src_blocks must still be in the list given
    s = System(config=DENSIFY)
    s.append("a", 12)
    for t in (8, 9, 10, 11):
        s.table.evict_token("a", t)
    rec = s.manager.plan_request("a")
    assert rec.plan == Plan(PlanKind.DENSIFY, "a", (0, 12), (), (2,), (), 8)
    assert left_table(s) == [0, 1, 2]
    refused(lambda: s.manager.on_request_removed("a", [0, 1]), BlockNotOwnedError,
            "request 'a': blocks [2] are read by its plan in flight but are not in the block list given "
            "([0, 1]); a pending copy's sources must be held until it settles (I5)", s.manager)


def test_a_pending_densify_copy_holds_the_block_it_writes_into():
    # token 4 moves from (1, 0) into the hole (0, 1): block 1 is read, block 0 written, both are the request's
    s = densify_scene()
    rec = s.manager.plan_request("a")
    assert rec.plan.moves == (Move(4, 1, 0, 0, 1),) and rec.plan.src_blocks == (1,)
    s.manager.launch()
    free_before = s.pool.num_free
    assert left_table(s) == [0, 1]
    s.manager.on_request_removed("a", [0, 1])
    assert rec.held == (0, 1) and s.manager.orphans == [rec]
    assert s.pool.num_free == free_before and s.pool.ref_count(0) == s.pool.ref_count(1) == 1
    s.engine.complete(rec.handle)
    s.manager.settle()
    assert s.manager.orphans == [] and s.pool.num_free == free_before + 2


# ---- a record's copy status -----------------------------------------------------------------------------------
def test_a_planned_record_without_a_handle_reads_as_pending():
    # every caller short-circuits on a PLANNED record, so only a direct read reaches this answer
    s = wasteful()
    rec = s.manager.plan_request("a")
    assert rec.state is PlanState.PLANNED and rec.handle is None
    assert s.manager._status(rec) is CopyStatus.PENDING


# ---- launch's executed precondition: _check_moves ---------------------------------------------------------------
# The real compact plan of wasteful() moves tokens 0, 7, 8, 9 into block 4 (COMPACT_MOVES); "a" has 14 tokens.
# Its PLANNED record's plan is replaced by a corrupted copy; launch must raise before it submits anything.
M9 = COMPACT_MOVES[3]
BAD_MOVES = {
    "a token id equal to the request's length": (
        Move(14, 2, 1, 4, 3), "move {m} names a token outside [0, 14)"),
    "a source the token does not live at": (
        Move(9, 2, 2, 4, 3), "move {m} reads (2, 2) but the token lives at slot 9"),
    "a destination block outside the plan's": (
        Move(9, 2, 1, 5, 3), "move {m} writes outside blocks [4]"),
    "a destination offset equal to the block size": (
        Move(9, 2, 1, 4, 4), "move {m} writes outside blocks [4]"),
    "a destination another move writes": (
        Move(9, 2, 1, 4, 2), "two moves share a destination (slot 18)"),
}


@pytest.mark.parametrize("defect", list(BAD_MOVES))
def test_launch_refuses_a_corrupted_move_before_submitting(defect):
    bad, message = BAD_MOVES[defect]
    s = wasteful()
    rec = s.manager.plan_request("a")
    assert rec.plan.moves == COMPACT_MOVES
    rec.plan = dataclasses.replace(rec.plan, moves=COMPACT_MOVES[:3] + (bad,))
    err = refused(s.manager.launch, InvariantViolation, f"I4: request 'a': {message.format(m=bad)}", s.manager)
    assert err.invariant == "I4"
    assert rec.state is PlanState.PLANNED and s.engine.events["submitted"] == 0


# ---- commit's executed precondition: the masks after the moves ----------------------------------------------------
@pytest.mark.parametrize("evict, move", [
    (1, Move(4, 1, 0, 0, 1)),  # live 0 . 2 3 | 4: the move fills offset 1, token 3 keeps offset 3
    (3, Move(4, 1, 0, 0, 3)),  # live 0 1 2 . | 4: only the moved token lands at offset 3
])
def test_commit_sees_the_moved_and_the_kept_tokens_of_a_densify_block(evict, move):
    # The real plan packs 4 live tokens into block 0 (cursor 4); its cursor is corrupted to 3, so block 0 would
    # hold a live token at the cursor: a kept one (evict 1) or the moved one (evict 3). Commit must see both
    s = densify_scene(evict=(evict,))
    rec = s.manager.plan_request("a")
    assert rec.plan == Plan(PlanKind.DENSIFY, "a", (0, 5), (move,), (1,), (), 4)
    s.manager.launch()
    s.engine.complete(rec.handle)
    rec.plan = dataclasses.replace(rec.plan, dense_write_pos=3)
    err = refused(s.manager.settle, InvariantViolation,
                  break_msg("densify", "block 0 would hold live tokens at or after cursor 3"), s.manager)
    assert err.invariant == "I4" and s.manager.inflight == {"a": rec}


def test_a_block_with_no_mask_entry_holds_no_live_token():
    # A compact destination has no mask entry until a move claims it. Staged at the cursor (what only a
    # corrupted plan stages), it holds nothing, so the layout rule must let it pass
    s = wasteful()
    masks = s.table.block_masks("a")
    assert 4 not in masks

    def fail(message):
        raise AssertionError(message)

    assert s.manager._check_layout(([0, 1, 2, 3, 4], 16), masks, fail) is None


# ---- commit's postcondition ------------------------------------------------------------------------------------------
def test_commit_names_I2_when_the_live_token_ids_change(monkeypatch):
    # Planted bug (defensive check): apply_moves also kills the first moved token, after every precondition held
    s = wasteful()
    rec = s.manager.plan_request("a")
    s.manager.launch()
    s.engine.complete(rec.handle)
    real = TokenTable.apply_moves

    def lossy(self, req, moves):
        moves = list(moves)
        real(self, req, moves)
        self.evict_token(req, moves[0].token_id)

    monkeypatch.setattr(TokenTable, "apply_moves", lossy)
    with pytest.raises(InvariantViolation) as info:
        s.manager.settle()
    assert info.value.invariant == "I2"
    assert str(info.value) == "I2: request 'a': committing plan changed its ordered live token ids"


@pytest.mark.parametrize("hint", [[3], [5], ["x"], [8], [1]],
                         ids=["a live position", "another live one", "not an int", "past the cursor", "the hole"])
def test_a_wrong_evicted_positions_hint_plans_as_the_full_search_and_overwrites_nothing(hint):
    """Regression (found by the fast path's lockstep, tests/test_fastpath_gather.py): a pack's evicted-positions
    hint of the right count but wrong (another step's, a live position) was trusted, so the plan moved token 7 onto
    token 3's live slot and the launched copy overwrote its K/V before the commit refused; the record stayed in
    flight. Now such a hint is checked in O(evicted) and the full search plans: token 7 into the real hole, 1."""
    s = System(num_blocks=8, headroom=0)
    assert s.append("a", 8) == list(range(8))
    s.table.evict_token("a", 1)
    rec = s.manager.plan_round(["a"], pack=True, evicted_positions={"a": hint})
    assert [r.plan.moves for r in rec] == [(Move(7, 1, 3, 0, 1),)]
    s.manager.launch()
    s.engine.complete(rec[0].handle)
    assert [r.state for r in s.manager.settle()] == [PlanState.COMMITTED]
    assert s.check() >= 0 and s.table.slot_of("a", 3) == 3 and s.table.slot_of("a", 7) == 1
