"""The reclamation manager: plan lifecycle PLANNED -> COPYING -> COMMITTED | ABORTED, with concrete layouts.

The standard scene (``wasteful()``): a pool of 6 blocks of 4 slots with a headroom of 2.
Request "a" holds 14 tokens in blocks [0, 1, 2, 3] (slots 0..13, cursor 14), then
tokens 1-6, 10 and 11 are evicted, leaving live tokens 0 | 7 | 8 9 | 12 13:

    block 0: [0 . . .]   block 1: [. . . 7]   block 2: [8 9 . .]   block 3: [12 13 | cursor]

The compact planner packs blocks 0, 1, 2 (4 live tokens) into one fresh block (4),
taken from the headroom; after commit the request holds [4, 3] with cursor 6.
"""

from __future__ import annotations


import pytest

from vtoken.core.block_pool import BlockPool, Purpose, blocks_needed
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.errors import (ConfigError, DestinationError, InvariantViolation, PlanConflictError,
                                 PoolExhaustedError, VTokenError)
from vtoken.core.sim.inmemory import EMPTY_TAG, InMemoryCopyEngine, TagStore
from vtoken.core.reference.invariants import check_all
from vtoken.core.plan import NoPlan, NoPlanReason, PlanKind
from vtoken.core.reclamation import (
    LAUNCH_FAILED,
    Ordering,
    PlanRecord,
    PlanState,
    ReclaimConfig,
    ReclamationManager,
)
from vtoken.core.policies import make_policy
from vtoken.core.runtime import VTokenRuntime
from vtoken.core.token_table import NO_SLOT, Move, TokenTable

REQ_BASE = {"a": 1000, "b": 2000}
EVICT = [1, 2, 3, 4, 5, 6, 10, 11]
LIVE = [0, 7, 8, 9, 12, 13]
COMPACT_MOVES = (Move(0, 0, 0, 4, 0), Move(7, 1, 3, 4, 1), Move(8, 2, 0, 4, 2), Move(9, 2, 1, 4, 3))
STALE = "layout changed since the snapshot (I4)"
LEFT = "request left while its plan was in flight"


def tag(req, t: int) -> int:
    return REQ_BASE[req] + t + 1


class System:
    """Pool, table, tag store, engine and manager wired by hand (what the runtime does, minus policy)."""

    def __init__(self, num_blocks=6, block_size=4, headroom=2, config=None, auto_complete=False):
        self.pool = BlockPool(num_blocks, block_size, headroom)
        self.table = TokenTable(num_blocks, block_size)
        self.store = TagStore(num_blocks, block_size)
        self.engine = InMemoryCopyEngine(self.store, auto_complete=auto_complete)
        self.manager = ReclamationManager(self.pool, self.table, self.engine, config or ReclaimConfig())

    def append(self, req, n: int) -> list[int]:
        """Grow a request by n tokens (admission allocation) and write their content tags."""
        if req not in self.table:
            self.table.add_request(req)
        S = self.pool.block_size
        grow = blocks_needed(self.table.write_pos(req) + n, S) - len(self.table.block_ids(req))
        blocks = self.pool.allocate(max(0, grow), Purpose.ADMISSION)
        start = self.table.total_len(req)
        slots = self.table.sync_new_tokens(req, blocks, start + n)
        for t, s in zip(range(start, start + n), slots):
            self.store.write(s, tag(req, t))
        return slots

    def remove(self, req) -> None:
        blocks = self.table.remove_request(req)
        self.manager.on_request_removed(req, blocks)

    def check(self) -> int:
        return check_all(self, tag)


def wasteful(**cfg) -> System:
    sys_kwargs = {k: cfg.pop(k) for k in ("num_blocks", "headroom") if k in cfg}
    s = System(config=ReclaimConfig(**cfg), **sys_kwargs)
    assert s.append("a", 14) == list(range(14))
    for t in EVICT:
        s.table.evict_token("a", t)
    assert s.table.live_token_ids("a") == LIVE
    assert s.table.block_ids("a") == [0, 1, 2, 3]
    return s


def launched(**cfg) -> tuple[System, PlanRecord]:
    s = wasteful(**cfg)
    rec = s.manager.plan_request("a")
    s.manager.launch()
    return s, rec


# ---- Stage 3: a plan is made -------------------------------------------------------------
def test_plan_is_planned_and_its_destination_comes_from_the_headroom():
    s = wasteful()
    assert s.pool.free_block_ids() == [4, 5]
    # the two free blocks are the headroom: admission may not take one, evacuation may
    assert not s.pool.can_allocate(1, Purpose.ADMISSION)
    assert s.pool.can_allocate(1, Purpose.EVACUATION)
    rec = s.manager.plan_request("a")
    assert isinstance(rec, PlanRecord)
    assert rec.state is PlanState.PLANNED and rec.handle is None and rec.held == ()
    p = rec.plan
    assert p.kind is PlanKind.COMPACT and p.req_id == "a"
    assert p.version == (0, 14)
    assert p.src_blocks == (0, 1, 2)
    assert p.dst_blocks == (4,)
    assert p.moves == COMPACT_MOVES
    assert p.blocks_saved == 2
    assert s.pool.free_block_ids() == [5]  # below the headroom of 2: borrowed
    assert s.pool.ref_count(4) == 1
    # while it is borrowed, growth that needs no block still goes ahead; growth that needs one waits
    assert s.pool.can_allocate(0, Purpose.ADMISSION) and s.pool.allocate(0, Purpose.ADMISSION) == []
    assert not s.pool.can_allocate(1, Purpose.ADMISSION)
    assert s.manager.in_flight("a") is rec
    assert s.manager.stats.plans_made == 1
    assert not s.manager.admission_open()
    # planning changes no layout and submits nothing
    assert s.table.block_ids("a") == [0, 1, 2, 3] and s.table.write_pos("a") == 14
    assert s.table.attention_slots("a") == LIVE
    assert s.engine.events["submitted"] == 0
    assert s.check() == 7


def test_launch_copies_and_settle_commits_only_when_done():
    s, rec = launched()
    assert rec.state is PlanState.COPYING
    h = rec.handle
    assert h is not None and s.engine.poll(h) is CopyStatus.PENDING
    assert s.engine.moves_of(h) == COMPACT_MOVES
    assert s.manager.pending_copies() == [rec]
    assert s.manager.settle() == []  # still pending: nothing changes
    assert rec.state is PlanState.COPYING
    assert s.table.attention_slots("a") == LIVE and s.table.block_ids("a") == [0, 1, 2, 3]
    assert s.pool.free_block_ids() == [5]
    s.check()

    s.engine.complete(h)
    assert [s.store.read(x) for x in (16, 17, 18, 19)] == [tag("a", t) for t in (0, 7, 8, 9)]
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.COMMITTED
    assert s.table.block_ids("a") == [4, 3]
    assert s.table.write_pos("a") == 6
    assert s.table.attention_slots("a") == [16, 17, 18, 19, 12, 13]
    assert s.table.live_token_ids("a") == LIVE
    assert s.table.block_live_counts("a") == {4: 4, 3: 2}
    assert s.pool.free_block_ids() == [5, 0, 1, 2]  # sources back to the pool, in order
    assert [s.pool.ref_count(b) for b in range(6)] == [0, 0, 0, 1, 1, 0]
    st = s.manager.stats
    assert (st.plans_made, st.plans_committed, st.moves_committed, st.moves_dropped, st.blocks_released) == (
        1, 1, 4, 0, 2)
    assert sum(st.plans_aborted.values()) == 0
    assert s.manager.in_flight("a") is None and s.manager.pending_copies() == []
    assert s.manager.admission_open()
    with pytest.raises(VTokenError, match="unknown copy handle"):
        s.engine.poll(h)  # the handle was released at commit
    s.check()
    # appends continue right after the packed prefix, in the kept cursor block
    assert s.append("a", 1) == [14]
    assert s.table.block_ids("a") == [4, 3]
    s.check()


def test_event_ordering_commits_while_ordered_and_data_lands_before_compute():
    s, rec = launched(ordering=Ordering.EVENT)
    h = rec.handle
    assert s.engine.poll(h) is CopyStatus.ORDERED
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.COMMITTED
    assert s.table.attention_slots("a") == [16, 17, 18, 19, 12, 13]
    assert s.pool.free_block_ids() == [5, 0, 1, 2]
    # the copy has not run yet: destinations are still empty on the device
    assert [s.store.read(x) for x in (16, 17, 18, 19)] == [EMPTY_TAG] * 4
    assert s.engine.pending() == [h]
    s.check()  # I1 sees the ordered copy as the next forward would
    s.engine.before_compute()
    assert [s.store.read(x) for x in (16, 17, 18, 19)] == [tag("a", t) for t in (0, 7, 8, 9)]
    assert s.engine.pending() == []
    assert s.engine.events["completed"] == 1
    s.check()


def test_force_sync_waits_for_the_copy_at_launch():
    s, rec = launched(ordering=Ordering.FORCE_SYNC)
    assert s.engine.events["waited"] == 1
    assert s.engine.poll(rec.handle) is CopyStatus.DONE
    assert [s.store.read(x) for x in (16, 17, 18, 19)] == [tag("a", t) for t in (0, 7, 8, 9)]
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.COMMITTED
    assert s.table.attention_slots("a") == [16, 17, 18, 19, 12, 13]
    s.check()


@pytest.mark.parametrize("written", [0, 2])
def test_failed_copy_aborts_and_keeps_the_old_locations(written):
    s, rec = launched()
    h = rec.handle
    assert s.manager.settle() == []
    assert 4 not in s.pool.free_block_ids() and s.pool.ref_count(4) == 1
    s.engine.fail(h, written=written)
    assert s.engine.poll(h) is CopyStatus.FAILED
    expect = [tag("a", t) for t in (0, 7)][:written] + [EMPTY_TAG] * (4 - written)
    assert [s.store.read(x) for x in (16, 17, 18, 19)] == expect
    # the engine has settled, the manager has not yet: the destination is still held
    assert s.pool.free_block_ids() == [5]
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.ABORTED and rec.abort_reason == "copy failed"
    assert s.manager.stats.plans_aborted == {"copy failed": 1}
    assert s.manager.stats.plans_committed == 0
    assert s.table.block_ids("a") == [0, 1, 2, 3]
    assert s.table.write_pos("a") == 14
    assert s.table.attention_slots("a") == LIVE
    assert s.pool.free_block_ids() == [5, 4]
    assert s.manager.in_flight("a") is None and s.manager.admission_open()
    s.check()
    # a new plan may be made after the abort; it takes the next free block
    again = s.manager.plan_request("a")
    assert again.plan.dst_blocks == (5,) and again.plan.src_blocks == (0, 1, 2)


# ---- requests that leave while their copy runs ----------------------------------------------
class Scripted:
    """Evicts exactly the scripted (request, step) victims."""

    name = "scripted"

    def __init__(self, victims):
        self.victims = victims

    def select_victims(self, view):
        return list(self.victims.get((view.req_id, view.step), []))


def runtime_mid_copy() -> tuple[VTokenRuntime, InMemoryCopyEngine, PlanRecord]:
    """The standard scene driven through the runtime: its end_step plans and launches the copy."""
    pool = BlockPool(6, 4, 2)
    engine = InMemoryCopyEngine(TagStore(6, 4), auto_complete=False)
    rt = VTokenRuntime(pool, engine, Scripted({("a", 0): EVICT}), budget=0.4, reclaim=ReclaimConfig())
    rt.admit("a")
    rt.begin_step({"a": 14})
    assert rt.end_step() == {"a": EVICT}
    rec = rt.manager.in_flight("a")
    assert rec is not None and rec.state is PlanState.COPYING
    assert rec.plan.moves == COMPACT_MOVES and rec.plan.dst_blocks == (4,)
    assert engine.poll(rec.handle) is CopyStatus.PENDING
    return rt, engine, rec


@pytest.mark.parametrize("leave", ["finish", "preempt"])
@pytest.mark.parametrize("outcome", ["complete", "fail"])
def test_request_leaving_mid_copy_holds_the_copied_blocks_until_it_settles(leave, outcome):
    rt, engine, rec = runtime_mid_copy()
    pool = rt.pool
    if leave == "finish":
        rt.finish("a")
    else:
        assert rt.preempt("a") == 14
    assert "a" not in rt.running()
    # block 3 is untouched by the copy and goes back now; 0, 1, 2 (read) and 4 (written) are held
    assert pool.free_block_ids() == [5, 3]
    assert rec.state is PlanState.ABORTED and rec.abort_reason == LEFT
    assert rec.held == (0, 1, 2, 4)
    assert rt.manager.orphans == [rec] and rt.manager.in_flight("a") is None
    assert [pool.ref_count(b) for b in (0, 1, 2, 4)] == [1, 1, 1, 1]
    assert rt.manager.stats.plans_aborted == {LEFT: 1}
    assert rt.manager.pending_copies() == [rec]
    check_all(rt)
    # the allocator cannot hand out a held block: only 5 and 3 are available
    got = pool.allocate(2, Purpose.EVACUATION)
    assert got == [5, 3]
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1, Purpose.EVACUATION)
    pool.free(got)
    assert rt.manager.settle() == []  # still pending: still held
    assert pool.free_block_ids() == [5, 3]

    if outcome == "complete":
        engine.complete(rec.handle)
    else:
        engine.fail(rec.handle, written=1)
    rt.manager.settle()
    assert rt.manager.orphans == []
    assert pool.free_block_ids() == [5, 3, 0, 1, 2, 4]
    assert pool.num_free == 6 and all(pool.ref_count(b) == 0 for b in range(6))
    assert engine.pending() == []
    check_all(rt)


def test_request_leaving_after_its_copy_finished_frees_everything_at_once():
    s, rec = launched()
    s.engine.complete(rec.handle)  # done, but not yet committed by settle
    s.remove("a")
    assert s.manager.orphans == []
    assert rec.state is PlanState.ABORTED
    assert s.pool.free_block_ids() == [5, 0, 1, 2, 3, 4]
    with pytest.raises(VTokenError, match="unknown copy handle"):
        s.engine.poll(rec.handle)
    s.check()


def test_request_leaving_with_a_plan_not_yet_launched_frees_everything():
    s = wasteful()
    rec = s.manager.plan_request("a")
    s.remove("a")
    assert rec.state is PlanState.ABORTED and s.manager.orphans == []
    assert s.pool.free_block_ids() == [5, 0, 1, 2, 3, 4]
    s.manager.launch()
    assert s.engine.events["submitted"] == 0  # nothing left to launch
    s.check()


# ---- eviction and appends while a copy is in flight ---------------------------------------
def test_destination_whose_tokens_all_died_in_flight_goes_back_to_the_pool():
    s, rec = launched()
    assert rec.plan.dst_blocks == (4,) and {m.token_id for m in rec.plan.moves} == {0, 7, 8, 9}
    for t in (0, 7, 8, 9):
        s.table.evict_token("a", t)
    s.engine.complete(rec.handle)
    assert s.manager.settle() == [rec] and rec.state is PlanState.COMMITTED
    assert s.table.block_ids("a") == [3] and s.table.write_pos("a") == 2
    assert s.table.attention_slots("a") == [12, 13]
    assert sorted(s.pool.free_block_ids()) == [0, 1, 2, 4, 5]
    assert s.manager.stats.moves_dropped == 4 and s.manager.stats.blocks_released == 3
    s.check()


def test_token_evicted_mid_copy_stays_dead_and_its_destination_stays_unclaimed():
    s, rec = launched()
    s.table.evict_token("a", 8)
    s.engine.complete(rec.handle)
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.COMMITTED
    assert s.manager.stats.moves_dropped == 1
    assert s.manager.stats.moves_committed == 3
    assert not s.table.is_live("a", 8) and s.table.slot_of("a", 8) == NO_SLOT
    assert s.table.live_token_ids("a") == [0, 7, 9, 12, 13]
    assert s.table.attention_slots("a") == [16, 17, 19, 12, 13]
    assert s.table.occupancy.holders(18) == 0  # token 8's destination (4, 2)
    assert s.table.occupancy.block_live(4) == 3
    assert s.table.block_ids("a") == [4, 3] and s.table.write_pos("a") == 6
    assert s.table.num_live("a") == 5
    s.check()


def densify_scene() -> tuple[System, PlanRecord]:
    s = wasteful(planner=PlanKind.DENSIFY)
    rec = s.manager.plan_request("a")
    p = rec.plan
    assert p.kind is PlanKind.DENSIFY
    assert p.moves == (Move(7, 1, 3, 0, 1), Move(8, 2, 0, 0, 2), Move(9, 2, 1, 0, 3),
                       Move(12, 3, 0, 1, 0), Move(13, 3, 1, 1, 1))
    assert p.src_blocks == (2, 3) and p.dst_blocks == () and p.dense_write_pos == 6
    assert s.pool.free_block_ids() == [4, 5]  # densify allocates nothing
    s.manager.launch()
    return s, rec


def test_densify_commit_packs_live_tokens_into_the_prefix():
    s, rec = densify_scene()
    s.engine.complete(rec.handle)
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.COMMITTED
    assert s.table.block_ids("a") == [0, 1] and s.table.write_pos("a") == 6
    assert s.table.attention_slots("a") == [0, 1, 2, 3, 4, 5]
    assert s.pool.free_block_ids() == [4, 5, 2, 3]
    assert s.manager.stats.blocks_released == 2
    s.check()


def test_densify_plan_is_aborted_as_stale_when_tokens_were_appended():
    s, rec = densify_scene()
    assert s.append("a", 1) == [14]  # token 14 lands in block 3, which the plan would free
    s.engine.complete(rec.handle)
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.ABORTED and rec.abort_reason == STALE
    assert s.manager.stats.plans_aborted == {STALE: 1}
    assert s.manager.stats.plans_committed == 0
    assert s.table.block_ids("a") == [0, 1, 2, 3] and s.table.write_pos("a") == 15
    assert s.table.attention_slots("a") == [0, 7, 8, 9, 12, 13, 14]
    assert s.pool.free_block_ids() == [4, 5]
    s.check()


def test_compact_plan_survives_appends_in_the_cursor_block():
    s, rec = launched()
    assert s.append("a", 2) == [14, 15]
    s.engine.complete(rec.handle)
    assert s.manager.settle() == [rec]
    assert rec.state is PlanState.COMMITTED
    assert s.table.block_ids("a") == [4, 3]
    assert s.table.write_pos("a") == 8
    assert s.table.attention_slots("a") == [16, 17, 18, 19, 12, 13, 14, 15]
    assert s.pool.free_block_ids() == [5, 0, 1, 2]
    s.check()


# ---- I4: one plan per request --------------------------------------------------------------
def test_second_plan_for_a_request_is_a_conflict_and_changes_nothing():
    s, rec = launched()
    before = (s.pool.snapshot(), s.table.state(), s.manager.stats.plans_made)
    with pytest.raises(PlanConflictError, match="'a' already has a plan in flight"):
        s.manager.plan_request("a")
    assert (s.pool.snapshot(), s.table.state(), s.manager.stats.plans_made) == before
    assert s.manager.plan_round(["a"]) == []  # rounds skip requests with a plan in flight
    assert s.manager.stats.rounds == 1 and s.manager.in_flight("a") is rec
    s.engine.complete(rec.handle)
    s.manager.settle()
    # after commit the request may be planned again; block 4 is full, so there is nothing to do
    again = s.manager.plan_request("a")
    assert isinstance(again, NoPlan) and again.reason is NoPlanReason.NO_CANDIDATES
    assert s.manager.stats.no_plan[NoPlanReason.NO_CANDIDATES] == 1


def test_no_free_block_for_the_destination_gives_no_plan_and_allocates_nothing():
    s = System(num_blocks=4, headroom=0)
    s.append("a", 14)
    for t in EVICT:
        s.table.evict_token("a", t)
    assert s.pool.num_free == 0
    got = s.manager.plan_request("a")
    assert isinstance(got, NoPlan) and got.reason is NoPlanReason.NOT_ENOUGH_HEADROOM
    assert s.manager.inflight == {} and s.manager.stats.plans_made == 0
    assert s.manager.stats.no_plan == {NoPlanReason.NOT_ENOUGH_HEADROOM: 1}


def two_requests(max_plans_per_round: int) -> System:
    s = System(num_blocks=12, headroom=2, config=ReclaimConfig(max_plans_per_round=max_plans_per_round))
    s.append("a", 14)  # blocks 0-3
    s.append("b", 14)  # blocks 4-7
    for t in EVICT + [12]:
        s.table.evict_token("a", t)  # a: 5 live in 4 blocks -> excess 2
    for t in EVICT + [12, 13, 0]:
        s.table.evict_token("b", t)  # b: 3 live in 4 blocks -> excess 3
    return s


def test_plan_round_plans_the_most_wasteful_request_first():
    s = two_requests(max_plans_per_round=1)
    made = s.manager.plan_round(["a", "b"])
    assert [r.plan.req_id for r in made] == ["b"]
    assert made[0].plan.src_blocks == (4, 5, 6) and made[0].plan.dst_blocks == (8,)
    assert s.manager.stats.rounds == 1 and list(s.manager.inflight) == ["b"]
    s.check()


def test_plan_round_plans_every_wasteful_request_up_to_the_limit():
    s = two_requests(max_plans_per_round=16)
    made = s.manager.plan_round(["a", "b"])
    assert [(r.plan.req_id, r.plan.src_blocks, r.plan.dst_blocks) for r in made] == [
        ("b", (4, 5, 6), (8,)), ("a", (0, 1, 2), (9,))]
    assert s.manager.stats.plans_made == 2
    s.check()


# ---- Stage 1 and 2: trigger and backpressure ---------------------------------------------------
def test_waste_ratio_values():
    s = System()
    assert s.manager.waste_ratio() == 0.0  # nothing allocated
    s.append("a", 14)
    assert s.manager.waste_ratio() == 1 - 14 / 16 == 0.125
    for t in EVICT:
        s.table.evict_token("a", t)
    assert s.manager.waste_ratio() == 0.625  # 6 live slots in 4 blocks of 4
    s.manager.plan_request("a")  # the in-flight destination counts as allocated, empty
    assert s.manager.waste_ratio() == pytest.approx(1 - 6 / 20)


@pytest.mark.parametrize("theta_f, expect", [(0.0, True), (0.6, True), (0.62, True), (0.625, False), (0.9, False)])
def test_should_reclaim_compares_waste_ratio_strictly_with_theta(theta_f, expect):
    s = wasteful(theta_f=theta_f)  # F = 0.625
    assert s.manager.should_reclaim(0) is expect


def test_should_reclaim_runs_every_kth_iteration():
    s = wasteful(check_every=3)
    assert [s.manager.should_reclaim(i) for i in range(7)] == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("low_watermark, expect", [(None, True), (0, False), (1, False), (2, True), (5, True)])
def test_should_reclaim_waits_for_the_low_watermark(low_watermark, expect):
    s = wasteful(low_watermark=low_watermark)  # 2 free blocks
    assert s.pool.num_free == 2
    assert s.manager.should_reclaim(0) is expect


def test_should_reclaim_is_false_for_a_packed_pool():
    s = System()
    s.append("a", 14)  # F = 0.125 < theta_f 0.25
    assert not s.manager.should_reclaim(0)


def test_admission_reopens_when_the_borrowed_headroom_is_returned():
    s, rec = launched()
    assert not s.manager.admission_open()  # 1 free < headroom 2, plan in flight
    s.engine.complete(rec.handle)
    s.manager.settle()
    assert s.pool.num_free == 4 and s.manager.admission_open()


def test_admission_stays_open_while_a_plan_leaves_the_headroom_intact():
    s, rec = launched(num_blocks=8)  # 4 free before planning, 3 after: headroom 2 untouched
    assert s.manager.inflight and s.pool.num_free == 3
    assert s.manager.admission_open()


def test_admission_is_open_below_headroom_without_a_plan():
    # Backpressure is about borrowed headroom; with nothing in flight there is nothing to wait for.
    s = System()
    s.pool.allocate(5, Purpose.EVACUATION)
    assert s.pool.num_free == 1 < s.pool.headroom
    assert s.manager.admission_open()


# ---- the adaptive trigger (burst_df): liveness only -----------------------------------------------
def quiet(**cfg) -> System:
    """Request "a" with 14 tokens in blocks [0, 1, 2, 3], nothing evicted (F = 1 - 14/16 = 0.125), and
    iterations 0-2 of quiet: the trigger has read F before (a burst is a rise against the previous reading)."""
    s = System(config=ReclaimConfig(**cfg))
    s.append("a", 14)
    assert s.manager.waste_ratio() == 0.125
    assert [s.manager.should_reclaim(i) for i in range(3)] == [False] * 3
    return s


def burst(s: System) -> None:
    """Evict 8 of the 14 tokens at once: F 0.125 -> 0.625, a rise of 0.5 within one iteration."""
    for t in EVICT:
        s.table.evict_token("a", t)
    assert s.manager.waste_ratio() == 0.625


@pytest.mark.parametrize("burst_df, first_round", [(None, 8), (0.25, 3), (0.5, 3), (0.51, 8)])
def test_burst_at_iteration_3_with_k_8_fixed_reclaims_at_8_adaptive_at_3(burst_df, first_round):
    s = quiet(check_every=8, burst_df=burst_df)
    burst(s)
    decisions = [False] * 3 + [s.manager.should_reclaim(i) for i in range(3, 10)]
    assert decisions.index(True) == first_round
    adaptive = burst_df is not None and burst_df <= 0.5
    # nothing is planned here, so F stays above theta_F: burst mode asks for a round on every iteration
    assert decisions == ([False] * 3 + [True] * 7 if adaptive else [False] * 8 + [True, False])
    assert (s.manager.stats.bursts, s.manager.stats.burst_rounds) == ((1, 6) if adaptive else (0, 0))
    assert s.manager.stats.rounds == 0  # should_reclaim decides; plan_round does the work


def test_burst_mode_ends_once_a_round_brings_f_to_theta():
    s = quiet(check_every=8, burst_df=0.25)
    burst(s)
    assert s.manager.should_reclaim(3) and s.manager.burst
    (rec,) = s.manager.plan_round(["a"])
    s.manager.launch()
    s.engine.complete(rec.handle)
    s.manager.settle()
    assert s.table.block_ids("a") == [4, 3] and s.manager.waste_ratio() == 0.25  # 6 live in 2 blocks
    assert not s.manager.should_reclaim(4) and not s.manager.burst  # F <= theta_F: back to the cadence
    s.table.evict_token("a", 12)  # F 0.3125 > theta_F, a rise of 0.0625 < burst_df: no new burst
    assert [s.manager.should_reclaim(i) for i in (5, 6, 7, 8)] == [False, False, False, True]
    assert s.manager.stats.bursts == 1
    s.check()


def test_burst_mode_ends_when_a_round_makes_no_plan_and_none_is_in_flight():
    s = quiet(check_every=8, burst_df=0.1, theta_f=0.15)
    for t in (1, 5):  # blocks 0 and 1 keep 3 of 4: F 0.25, but 6 tokens need 2 blocks, no strict decrease
        s.table.evict_token("a", t)
    assert s.manager.should_reclaim(3) and s.manager.burst
    assert s.manager.plan_round(["a"]) == [] and not s.manager.inflight
    assert not s.manager.burst  # nothing left to gain
    assert [s.manager.should_reclaim(i) for i in range(4, 9)] == [False, False, False, False, True]
    assert s.manager.stats.no_plan[NoPlanReason.NO_STRICT_DECREASE] == 1


def test_burst_mode_survives_a_round_that_finds_every_request_in_flight():
    s = quiet(check_every=8, burst_df=0.25)
    burst(s)
    assert s.manager.should_reclaim(3)
    s.manager.plan_round(["a"])
    s.manager.launch()  # the copy stays pending
    assert s.manager.should_reclaim(4)  # F still > theta_F (the destination counts as waste)
    assert s.manager.plan_round(["a"]) == [] and s.manager.inflight
    assert s.manager.burst  # in flight: the burst is still being absorbed


def test_a_slow_rise_is_left_to_the_cadence():
    s = quiet(check_every=8, burst_df=0.1)
    decisions = []
    for i, t in enumerate(EVICT[:6]):  # one token per iteration: F rises by 1/16 = 0.0625 each time
        s.table.evict_token("a", t)
        decisions.append(s.manager.should_reclaim(i + 3))
    assert s.manager.waste_ratio() == 0.5 and s.manager.stats.bursts == 0
    assert decisions == [False] * 5 + [True]  # iteration 8, on the cadence


def test_the_low_watermark_gates_burst_rounds_too():
    s = quiet(check_every=8, burst_df=0.25, low_watermark=1)
    burst(s)
    assert s.pool.num_free == 2 and not s.manager.should_reclaim(3)
    assert s.manager.burst and s.manager.stats.bursts == 1 and s.manager.stats.burst_rounds == 0
    s.pool.allocate(1, Purpose.EVACUATION)  # free 1 <= watermark: the burst's round runs now, off cadence
    assert s.manager.should_reclaim(4) and s.manager.stats.burst_rounds == 1


def test_a_rise_that_leaves_f_at_or_below_theta_is_no_burst():
    s = quiet(check_every=8, burst_df=0.1, theta_f=0.5)
    for t in (1, 2, 5, 6):  # F 0.125 -> 0.375: a rise of 0.25, but F <= theta_F
        s.table.evict_token("a", t)
    assert not s.manager.should_reclaim(3) and not s.manager.burst and s.manager.stats.bursts == 0


def _runtime_burst(burst_df, check_every=8, burst_at=3, iterations=12):
    """Two requests decoding under Random eviction; the budget drops from 1.0 to 0.3 at ``burst_at``.
    Returns the iterations that ran a round, and the runtime (every invariant checked after every step)."""
    pool = BlockPool(64, 4, 2)
    store = TagStore(64, 4)
    rt = VTokenRuntime(pool, InMemoryCopyEngine(store, auto_complete=True), make_policy("random"), 1.0,
                       ReclaimConfig(check_every=check_every, burst_df=burst_df))
    base = {"a": 1000, "b": 2000}
    for r in base:
        rt.admit(r)
    rounds = []
    for it in range(iterations):
        if it == burst_at:
            rt.set_budget(0.3)
        step = rt.begin_step({r: 40 if it == 0 else 1 for r in base})
        for r, req in step.requests.items():
            for t, slot in zip(req.new_tokens, req.write_slots):
                store.write(slot, base[r] + t + 1)
        before = rt.manager.stats.rounds
        rt.end_step()
        if rt.manager.stats.rounds > before:
            rounds.append(it)
        check_all(rt, lambda r, t: base[r] + t + 1)
    return rounds, rt


def test_runtime_budget_drop_fixed_reclaims_on_the_cadence_adaptive_at_the_burst():
    fixed, rt_fixed = _runtime_burst(None)
    adaptive, rt_adaptive = _runtime_burst(0.2)
    assert fixed == [8]  # iterations 3-7 wait for the cadence with F > theta_F
    # at the burst, then every iteration until F <= theta_F. The headroom of 2 bounds each round's destinations
    # (destination_budget), so a round plans one request at a time while the other waits its turn: 4 rounds
    assert adaptive == [3, 4, 5, 6]
    assert rt_adaptive.manager.stats.no_plan == {NoPlanReason.NOT_ENOUGH_HEADROOM: 3}
    assert (rt_adaptive.manager.stats.bursts, rt_adaptive.manager.stats.burst_rounds) == (1, 4)
    assert rt_fixed.manager.stats.bursts == rt_fixed.manager.stats.burst_rounds == 0
    # the same evictions either way (policies never see blocks): the ideal footprint is equal
    S = 4
    ideal = [sum(blocks_needed(rt.table.num_live(r), S) for r in rt.table.request_ids()) for rt in (rt_fixed, rt_adaptive)]
    assert ideal[0] == ideal[1]


def test_set_budget_rejects_bad_values_and_changes_nothing():
    pool = BlockPool(8, 4, 1)
    rt = VTokenRuntime(pool, InMemoryCopyEngine(TagStore(8, 4)), make_policy("random"), 0.5, ReclaimConfig())
    for bad in (0.0, 1.5, 0, True, "0.5", None):
        with pytest.raises(ConfigError, match="budget must be"):
            rt.set_budget(bad)
        assert rt.budget == 0.5
    rt.set_budget(3)
    assert rt.budget == 3 and rt.token_budget(10) == 3


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, key", [
    ({"theta_f": 1.0}, "theta_f"),
    ({"theta_f": -0.1}, "theta_f"),
    ({"low_watermark": -1}, "low_watermark"),
    ({"check_every": 0}, "check_every"),
    ({"max_sources": 0}, "max_sources"),
    ({"max_plans_per_round": 0}, "max_plans_per_round"),
    ({"planner": "Compact"}, "planner"),  # a member or its exact value ("compact"), not another spelling
    ({"ordering": "EVENT"}, "ordering"),
    ({"burst_df": 0.0}, "burst_df"),
    ({"burst_df": -0.1}, "burst_df"),
    ({"burst_df": 1.5}, "burst_df"),
    ({"burst_df": True}, "burst_df"),
    ({"burst_df": "0.1"}, "burst_df"),
    # types, not just ranges: each used to raise TypeError or be accepted
    ({"max_sources": 2.5}, "max_sources"),
    ({"max_sources": True}, "max_sources"),
    ({"check_every": True}, "check_every"),
    ({"check_every": "2"}, "check_every"),
    ({"max_plans_per_round": 4.0}, "max_plans_per_round"),
    ({"theta_f": "0.3"}, "theta_f"),
    ({"theta_f": True}, "theta_f"),
    ({"theta_f": float("nan")}, "theta_f"),
    ({"low_watermark": 1.5}, "low_watermark"),
    ({"low_watermark": False}, "low_watermark"),
    ({"low_watermark": "4"}, "low_watermark"),
])
def test_reclaim_config_rejects_out_of_range_values_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        ReclaimConfig(**kwargs)
    assert str(err.value).startswith(key), str(err.value)


def test_reclaim_config_defaults_are_valid():
    c = ReclaimConfig()
    assert (c.planner, c.theta_f, c.low_watermark, c.check_every, c.max_sources, c.ordering, c.burst_df) == (
        PlanKind.COMPACT, 0.25, None, 1, 8, Ordering.POLL, None)  # burst_df None: the fixed trigger
    ReclaimConfig(theta_f=0.0, low_watermark=0, check_every=1, max_sources=1, max_plans_per_round=1)
    ReclaimConfig(burst_df=1.0)
    ReclaimConfig(burst_df=1)  # an int in range is a number too


# ---- added after mutation testing (docs/fuzzing.md) ---------------------------------------------------
def test_stats_accumulate_over_rounds_and_commits():
    s = two_requests(max_plans_per_round=16)
    s.manager.plan_round(["a", "b"])
    s.manager.launch()
    moving = [m.token_id for m in s.manager.inflight["b"].plan.moves]
    s.table.evict_token("b", moving[0])
    for h in s.engine.pending():
        s.engine.complete(h)
    done = s.manager.settle()
    assert [r.state for r in done] == [PlanState.COMMITTED] * 2
    assert all(r.handle is None for r in done)
    st = s.manager.stats
    assert (st.rounds, st.plans_made, st.plans_committed, st.moves_dropped) == (1, 2, 2, 1)
    s.manager.plan_round(["a", "b"])
    assert st.rounds == 2
    s.check()


def test_a_request_with_no_excess_blocks_is_not_even_tried():
    s = System(config=ReclaimConfig())
    s.append("a", 8)  # two full blocks, nothing evicted: excess 0
    assert s.manager.plan_round(["a"]) == []
    assert s.manager.stats.no_plan == {} and s.manager.stats.rounds == 1


def test_commit_checks_that_the_ordered_live_ids_survive(monkeypatch):
    """Planted bug: apply_moves that also kills a moved token. The commit's postcondition catches it."""
    from vtoken.core.errors import InvariantViolation
    s = wasteful(theta_f=0.0)
    rec = s.manager.plan_request("a")
    s.manager.launch()
    s.engine.complete(rec.handle)
    real = TokenTable.apply_moves

    def lossy(self, req, moves):
        moves = list(moves)
        real(self, req, moves)
        self.evict_token(req, moves[0].token_id)

    monkeypatch.setattr(TokenTable, "apply_moves", lossy)
    with pytest.raises(InvariantViolation, match="I2.*ordered live token ids"):
        s.manager.settle()


# ---- a copy launch the engine refuses (issue #15) --------------------------------------------------------
@pytest.mark.parametrize("ordering", list(Ordering))
def test_a_refused_launch_aborts_the_plan_and_never_commits_it(ordering):
    """submit raises: the plan is aborted at launch, its destination goes back, the table keeps the old
    locations, launch does not raise. Before, the plan was COPYING with no handle, read as DONE, and the next
    settle committed destination slots no copy had written."""
    s = wasteful(ordering=ordering)
    rec = s.manager.plan_request("a")
    table_before = s.table.state()
    s.engine.fail_next_submit()
    assert s.manager.launch() == [rec]
    assert (rec.state, rec.abort_reason, rec.handle) == (PlanState.ABORTED, LAUNCH_FAILED, None)
    assert rec.abort_detail == "RuntimeError: copy launch failed (injected)"
    assert s.manager.stats.plans_aborted == {LAUNCH_FAILED: 1} and s.manager.stats.plans_committed == 0
    assert s.manager.inflight == {} and s.pool.free_block_ids() == [5, 4]  # the destination is back
    assert s.engine.events["submitted"] == 0 and s.engine.events["refused"] == 1 and s.engine.pending() == []
    assert s.manager.settle() == [] and s.table.state() == table_before
    assert s.table.attention_slots("a") == LIVE and s.manager.admission_open()
    assert s.check() == 7
    again = s.manager.plan_request("a")  # the next launch goes ahead as usual
    assert s.manager.launch() == [] and again.state is PlanState.COPYING and again.plan.dst_blocks == (5,)


def test_a_refused_launch_does_not_stop_the_other_plans_of_the_round():
    s = two_requests(max_plans_per_round=16)
    b, a = s.manager.plan_round(["a", "b"])  # b is the more wasteful: planned, and submitted, first
    s.engine.fail_next_submit(DestinationError("device says no"))
    assert s.manager.launch() == [b]
    assert b.state is PlanState.ABORTED and b.abort_detail == "DestinationError: device says no"
    assert a.state is PlanState.COPYING and s.engine.pending() == [a.handle]
    assert s.pool.ref_count(b.plan.dst_blocks[0]) == 0 and s.pool.ref_count(a.plan.dst_blocks[0]) == 1
    s.engine.complete(a.handle)
    assert s.manager.settle() == [a] and a.state is PlanState.COMMITTED
    assert s.table.block_ids("b") == [4, 5, 6, 7]  # b kept its layout
    s.check()


def test_the_runtime_keeps_serving_the_old_locations_after_a_refused_launch():
    """Through the runtime: end_step's launch is refused; the next step reads every token where it was."""
    pool = BlockPool(6, 4, 2)
    engine = InMemoryCopyEngine(TagStore(6, 4), auto_complete=True)
    rt = VTokenRuntime(pool, engine, Scripted({("a", 0): EVICT}), budget=0.4, reclaim=ReclaimConfig())
    rt.admit("a")
    step = rt.begin_step({"a": 14})
    for t, slot in zip(step.requests["a"].new_tokens, step.requests["a"].write_slots):
        engine.store.write(slot, tag("a", t))
    engine.fail_next_submit()
    assert rt.end_step() == {"a": EVICT}  # planned, refused, aborted: no exception
    assert rt.manager.stats.plans_aborted == {LAUNCH_FAILED: 1}
    nxt = rt.begin_step({"a": 1})
    req = nxt.requests["a"]
    assert req.read_slots[:6] == LIVE and req.read_tokens == LIVE + [14]
    assert [engine.store.read(x) for x in req.read_slots[:6]] == [tag("a", t) for t in LIVE]
    check_all(rt)


def test_a_bug_in_the_engine_is_no_refused_launch_and_propagates():
    """Only an engine's VTokenError or a device's RuntimeError/MemoryError mean "not launched"; a TypeError in
    engine code is a bug: it propagates and the plan stays PLANNED, holding its destination (launch retries)."""
    s = wasteful()
    rec = s.manager.plan_request("a")
    s.engine.fail_next_submit(TypeError("'NoneType' object is not subscriptable"))
    with pytest.raises(TypeError, match="not subscriptable"):
        s.manager.launch()
    assert rec.state is PlanState.PLANNED and s.manager.in_flight("a") is rec and s.pool.ref_count(4) == 1
    assert s.manager.stats.plans_aborted == {}
    assert s.manager.launch() == [] and rec.state is PlanState.COPYING


def test_a_plan_whose_moves_collide_is_a_bug_not_a_refused_launch():
    """The engine would refuse two moves onto one slot too; launch checks its own plan first, so a planner bug
    raises InvariantViolation instead of being aborted and served around (the fuzzer must see it)."""
    s = wasteful()
    rec = s.manager.plan_request("a")
    bad = rec.plan.moves[:1] + (rec.plan.moves[1]._replace(dst_offset=0),) + rec.plan.moves[2:]
    object.__setattr__(rec.plan, "moves", bad)
    with pytest.raises(InvariantViolation, match="I4.*two moves share a destination"):
        s.manager.launch()
    assert rec.state is PlanState.PLANNED and s.engine.events["submitted"] == 0


def test_a_copying_plan_without_a_handle_is_never_read_as_done():
    s = wasteful()
    rec = s.manager.plan_request("a")
    rec.state = PlanState.COPYING  # what the old launch left behind when submit raised
    before = s.table.state()
    with pytest.raises(InvariantViolation, match="I3.*COPYING 4 moves but has no copy handle"):
        s.manager.settle()
    assert s.table.state() == before


# ---- a commit is all-or-nothing ------------------------------------------------------------------------------
def test_a_commit_the_table_would_refuse_changes_nothing(monkeypatch):
    """Planted bug: the compact cursor shift forgets the destinations. Commit's three table calls are checked
    before the first: the old commit attached the destination, then failed in the last set_layout."""
    from vtoken.core.plan import Plan
    s, rec = launched()
    s.engine.complete(rec.handle)
    def compact_cursor(self, write_pos, block_size, dst_blocks=None):
        return max(0, write_pos - len(self.src_blocks) * block_size)

    monkeypatch.setattr(Plan, "compact_cursor", compact_cursor)
    before = (s.pool.snapshot(), s.table.state(), s.manager.stats.moves_dropped)
    with pytest.raises(InvariantViolation, match="I4: request 'a'.*cursor 2.*nothing was changed"):
        s.manager.settle()
    assert (s.pool.snapshot(), s.table.state(), s.manager.stats.moves_dropped) == before
    assert s.manager.in_flight("a") is rec and rec.state is PlanState.COPYING


def test_a_commit_while_the_copy_is_pending_changes_nothing(monkeypatch):
    s, rec = launched()
    monkeypatch.setattr(ReclamationManager, "_status", lambda self, r: CopyStatus.DONE)  # the planted bug
    before = (s.pool.snapshot(), s.table.state())
    with pytest.raises(InvariantViolation, match="I3: request 'a': commit while its copy 1 is still pending"):
        s.manager.settle()
    assert (s.pool.snapshot(), s.table.state()) == before


# ---- Stage 2: the headroom bounds compaction's destinations ---------------------------------------------------
def sparse(headroom: int, num_blocks: int = 22, reqs=("a", "b")) -> System:
    """Each request: 33 tokens in 9 blocks of 4 (cursor in block 8), offsets 2 and 3 of blocks 0-7 evicted,
    so 16 live tokens sit in 8 half-full blocks: packing all 8 needs 4 destinations."""
    s = System(num_blocks=num_blocks, headroom=headroom)
    for r in reqs:
        s.append(r, 33)
        for t in range(32):
            if t % 4 >= 2:
                s.table.evict_token(r, t)
    return s


def test_a_compact_plan_takes_at_most_the_headroom_even_with_more_blocks_free():
    s = sparse(headroom=2)
    assert s.pool.num_free == 4 and s.manager.destination_budget() == 2
    rec = s.manager.plan_request("a")
    assert rec.plan.src_blocks == (0, 1, 2, 3) and rec.plan.dst_blocks == (18, 19)  # shrunk to fit 2
    assert s.pool.num_free == 2 and s.manager.destination_budget() == 0
    # all plans in flight together stay within the headroom: b waits although 2 blocks are free
    got = s.manager.plan_request("b")
    assert isinstance(got, NoPlan) and got.reason is NoPlanReason.NOT_ENOUGH_HEADROOM
    assert s.manager.stats.no_plan == {NoPlanReason.NOT_ENOUGH_HEADROOM: 1} and s.pool.num_free == 2
    s.manager.launch()
    s.engine.complete(rec.handle)
    s.manager.settle()
    assert s.manager.destination_budget() == 2
    assert s.manager.plan_request("b").plan.dst_blocks == (20, 21)
    s.check()


def test_an_orphaned_copy_still_counts_against_the_headroom():
    s = sparse(headroom=2)
    rec = s.manager.plan_request("a")
    s.manager.launch()
    s.remove("a")  # the copy is pending: its destinations are held
    assert s.manager.orphans == [rec] and s.manager.destination_budget() == 0
    assert s.manager.plan_request("b").reason is NoPlanReason.NOT_ENOUGH_HEADROOM
    s.engine.complete(rec.handle)
    s.manager.settle()
    assert s.manager.orphans == [] and s.manager.destination_budget() == 2


def test_headroom_zero_means_no_reserve_and_no_bound():
    s = sparse(headroom=0)
    assert s.pool.num_free == 4 and s.manager.destination_budget() == 4
    rec = s.manager.plan_request("a")
    assert rec.plan.src_blocks == tuple(range(8)) and rec.plan.dst_blocks == (18, 19, 20, 21)
    assert s.manager.destination_budget() == 0
