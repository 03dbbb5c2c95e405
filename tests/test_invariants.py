"""Planted bugs: every executable invariant checker catches the violation it exists for.

Each test builds a healthy system, proves ``check_all`` passes on it, plants one bug
behind the core's back, and asserts that the specific checker raises an
``InvariantViolation`` with the expected ``.invariant`` and a message naming the
request, block or slot at fault.

The scene is the one of test_reclamation.py: pool of 6 blocks x 4 slots, headroom 2;
request "a" holds 14 tokens in blocks [0, 1, 2, 3], tokens 1-6, 10, 11 evicted, so
live tokens are 0 (slot 0), 7 (slot 7), 8, 9 (slots 8, 9), 12, 13 (slots 12, 13).
A compact plan moves 0, 7, 8, 9 into fresh block 4.
"""

from __future__ import annotations

import pytest

from vtoken.core.reference import invariants as inv
from vtoken.core.block_pool import BlockPool, Purpose, blocks_needed
from vtoken.core.errors import InvariantViolation
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.reference.invariants import check_all
from vtoken.core.plan import PlanKind
from vtoken.core.reclamation import PlanState, ReclaimConfig, ReclamationManager
from vtoken.core.sim.simulator import SimConfig, run, synthetic_workload
from vtoken.core.token_table import Move, TokenTable

EVICT = [1, 2, 3, 4, 5, 6, 10, 11]


def tag(req, t: int) -> int:
    return {"a": 1000, "b": 2000}[req] + t + 1


class System:
    def __init__(self, num_blocks=6, block_size=4, headroom=2, config=None):
        self.pool = BlockPool(num_blocks, block_size, headroom)
        self.table = TokenTable(num_blocks, block_size)
        self.store = TagStore(num_blocks, block_size)
        self.engine = InMemoryCopyEngine(self.store, auto_complete=False)
        self.manager = ReclamationManager(self.pool, self.table, self.engine, config or ReclaimConfig())

    def append(self, req, n: int) -> None:
        if req not in self.table:
            self.table.add_request(req)
        grow = blocks_needed(self.table.write_pos(req) + n, self.pool.block_size) - len(self.table.block_ids(req))
        blocks = self.pool.allocate(max(0, grow), Purpose.ADMISSION)
        start = self.table.total_len(req)
        for t, s in zip(range(start, start + n), self.table.sync_new_tokens(req, blocks, start + n)):
            self.store.write(s, tag(req, t))


def healthy(evict=True, **cfg) -> System:
    s = System(config=ReclaimConfig(**cfg))
    s.append("a", 14)
    if evict:
        for t in EVICT:
            s.table.evict_token("a", t)
    assert check_all(s, tag) == 7
    return s


def in_flight(**cfg):
    """Healthy, with a compact (or densify) plan launched and its copy still PENDING."""
    s = healthy(**cfg)
    rec = s.manager.plan_request("a")
    s.manager.launch()
    assert rec.state is PlanState.COPYING and s.engine.pending() == [rec.handle]
    assert check_all(s, tag) == 7
    return s, rec


def violation(checker, *args) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as err:
        checker(*args)
    return err.value


# ---- I1 token conservation -------------------------------------------------------------------
def test_i1_catches_an_overwritten_tag():
    s = healthy()
    s.store.write(8, 4242)  # token 8's K/V clobbered
    v = violation(inv.check_i1_token_conservation, s, tag)
    assert v.invariant == "I1"
    assert str(v) == ("I1: request 'a' token 8 at slot 8 (block 2, offset 0) reads content 4242, "
                      f"expected {tag('a', 8)}")
    with pytest.raises(InvariantViolation, match="I1"):
        check_all(s, tag)


def test_i1_catches_a_committed_move_whose_destination_lost_its_data():
    s, rec = in_flight()
    # after commit the table points at block 4; wipe it as a lost or misdirected copy would
    s.engine.complete(rec.handle)
    s.manager.settle()
    for x in (16, 17, 18, 19):
        s.store.write(x, 0)
    v = violation(inv.check_i1_token_conservation, s, tag)
    assert v.invariant == "I1" and "token 0 at slot 16 (block 4, offset 0) reads content 0" in str(v)


# ---- I2 unique mapping -------------------------------------------------------------------------
def test_i2_catches_a_ref_count_bumped_by_share():
    s = healthy()
    s.pool.share(2)
    v = violation(inv.check_i2_unique_mapping, s)
    assert v.invariant == "I2"
    assert "block 2 has ref count 2 but 1 holder(s)" in str(v)


def test_i2_catches_two_tokens_on_one_slot():
    s = healthy()
    s.table._requests["a"].slots[9] = s.table.slot_of("a", 8)  # token 9 now claims token 8's slot
    v = violation(inv.check_i2_unique_mapping, s)
    assert v.invariant == "I2"
    assert str(v) == "I2: request 'a': tokens 8 and 9 both claim slot 8 (block 2, offset 0)"


def test_i2_catches_an_occupancy_count_out_of_step():
    s = healthy()
    s.table.occupancy.claim(5)  # a slot of evicted token 5 recorded as occupied again
    v = violation(inv.check_i2_unique_mapping, s)
    assert v.invariant == "I2"
    assert "slot 5 (block 1, offset 1) has 1 holder(s) recorded, 0 in the token tables" in str(v)


def test_i2_catches_a_block_listed_twice():
    s = healthy()
    s.table._requests["a"].blocks.append(0)
    v = violation(inv.check_i2_unique_mapping, s)
    assert v.invariant == "I2" and "request 'a' lists a block twice: [0, 1, 2, 3, 0]" in str(v)


# ---- I3 visibility -------------------------------------------------------------------------------
def test_i3_catches_an_attention_slot_written_by_a_pending_copy():
    s = healthy()
    h = s.engine.submit([Move(99, 5, 0, 1, 3)])  # a stray copy onto token 7's live slot
    v = violation(inv.check_i3_visibility, s)
    assert v.invariant == "I3"
    assert str(v) == (f"I3: request 'a' token 7 is read at slot 7 (block 1, offset 3), which pending copy {h} "
                      "may still write")


def test_i3_accepts_the_same_copy_once_ordered_before_compute():
    s = healthy()
    h = s.engine.submit([Move(99, 5, 0, 1, 3)])
    s.engine.order_before_compute(h)
    inv.check_i3_visibility(s)  # ordered: it lands before the read, so not an I3 bug (I1 would judge it)


# ---- I4 plan validity ------------------------------------------------------------------------------
def test_i4_catches_a_layout_change_under_an_in_flight_plan():
    s, _ = in_flight()
    s.table.set_layout("a", s.table.block_ids("a"), s.table.write_pos("a"))  # bumps the layout version
    v = violation(inv.check_i4_plan_validity, s)
    assert v.invariant == "I4"
    assert str(v) == "I4: request 'a': layout changed (version 1) under its in-flight plan (version 0)"


def test_i4_catches_a_plan_touching_a_shared_block():
    s, _ = in_flight()
    s.pool.share(1)  # source block 1 becomes a shared-prefix block after planning
    v = violation(inv.check_i4_plan_validity, s)
    assert v.invariant == "I4"
    assert str(v) == "I4: request 'a': plan touches shared block 1 (ref 2)"


def test_i4_catches_a_moved_token_that_is_not_where_the_plan_reads_it():
    s, _ = in_flight()
    s.table._requests["a"].slots[7] = 6  # the table now says token 7 lives at slot 6
    v = violation(inv.check_i4_plan_validity, s)
    assert v.invariant == "I4"
    assert "move of token 7 reads (1, 3) but the token lives at slot 6 (block 1, offset 2)" in str(v)


# ---- I5 source safety --------------------------------------------------------------------------------
def test_i5_catches_a_source_block_freed_under_a_pending_copy():
    s, _ = in_flight()
    s.pool.free([0])  # block 0 is read by the copy (token 0)
    v = violation(inv.check_i5_source_safety, s)
    assert v.invariant == "I5"
    assert str(v) == "I5: block 0 is read by the pending copy of 'a''s plan but was released (ref 0, held: True)"


def test_i5_catches_a_held_source_of_a_departed_request_released_early():
    s, rec = in_flight()
    s.manager.on_request_removed("a", s.table.remove_request("a"))
    assert rec.held == (0, 1, 2, 4)
    assert check_all(s, tag) == 7
    s.manager.orphans[0].held = (1, 2, 4)  # the manager "forgets" it holds block 0 ...
    s.pool.free([0])  # ... and gives it back while the copy still reads it
    v = violation(inv.check_i5_source_safety, s)
    assert v.invariant == "I5"
    assert "block 0 is read by the pending copy of 'a''s plan but was released (ref 0, held: False)" in str(v)


# ---- I6 destination safety ---------------------------------------------------------------------------
def test_i6_catches_a_destination_freed_under_a_pending_copy():
    s, _ = in_flight()
    s.pool.free([4])
    v = violation(inv.check_i6_destination_safety, s)
    assert v.invariant == "I6"
    assert str(v) == "I6: block 4 may still be written by the pending copy of 'a''s plan but was released (ref 0)"


def test_i6_catches_a_densify_destination_freed_under_a_pending_copy():
    s, rec = in_flight(planner=PlanKind.DENSIFY)
    assert {m.dst_block for m in rec.plan.moves} == {0, 1}
    s.pool.free([1])
    v = violation(inv.check_i6_destination_safety, s)
    assert v.invariant == "I6" and "block 1 may still be written" in str(v)


def test_i6_catches_a_destination_handed_to_another_request():
    s, _ = in_flight()
    s.table.add_request("b")
    s.pool.share(4)
    s.table.sync_new_tokens("b", [4], 1)  # another request now owns the block being written
    v = violation(inv.check_i6_destination_safety, s)
    assert v.invariant == "I6"
    assert str(v) == "I6: request 'b' holds a block the pending copy of 'a' writes"


# ---- I7 dense prefix -------------------------------------------------------------------------------------
def test_i7_catches_a_hole_in_a_dense_request():
    s = healthy(evict=False)
    assert check_all(s, tag, dense=True) == 8
    s.table.evict_token("a", 5)  # a hole at position 5, no densify plan in flight
    v = violation(inv.check_i7_dense_prefix, s)
    assert v.invariant == "I7"
    assert str(v) == "I7: request 'a': 13 live tokens are not dense; first gap at position 5, cursor 14"


def test_i7_catches_a_cursor_beyond_the_live_prefix():
    s = healthy(evict=False)
    s.table.evict_token("a", 13)  # the newest token: positions 0..12 are still dense, the cursor is not
    v = violation(inv.check_i7_dense_prefix, s)
    assert v.invariant == "I7" and "first gap at position 13, cursor 14" in str(v)


def test_i7_skips_requests_whose_densify_plan_is_in_flight():
    s, _ = in_flight(planner=PlanKind.DENSIFY)
    assert check_all(s, tag, dense=True) == 8


# ---- P3 headroom ------------------------------------------------------------------------------------------
def test_p3_catches_headroom_taken_with_no_evacuation_outstanding():
    s = healthy()
    assert s.pool.num_free == 2 == s.pool.headroom
    s.pool.allocate(1, Purpose.EVACUATION)  # taken from the headroom, but no plan holds it
    v = violation(inv.check_p3_headroom, s)
    assert v.invariant == "P3"
    assert str(v) == "P3: 1 free blocks, below the headroom 2, with no evacuation outstanding"


def test_p3_accepts_headroom_borrowed_by_an_in_flight_plan():
    s, _ = in_flight()
    assert s.pool.num_free == 1 < s.pool.headroom
    inv.check_p3_headroom(s)


# ---- a whole clean run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("reclaim, read_path, ordering, per_step", [
    ("compact", "gather", "poll", 7),  # six structural checkers + I1
    ("densify", "dense", "event", 8),  # ... + I7
])
def test_clean_simulator_run_checks_every_step_and_passes(reclaim, read_path, ordering, per_step):
    seed = 3
    cfg = SimConfig(num_blocks=192, seed=seed, reclaim=reclaim, read_path=read_path, ordering=ordering,
                    check_invariants=True)
    res = run(cfg, synthetic_workload(6, seed=seed, prompt=(16, 48), output=(32, 96)))
    assert res.finished == 6, f"seed {seed}"
    assert res.invariant_checks == per_step * res.steps > 0, f"seed {seed}"
    assert res.reclaim["plans_committed"] > 0, f"seed {seed}: reclamation never ran, the checks proved little"
