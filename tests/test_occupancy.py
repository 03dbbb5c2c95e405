"""SlotOccupancy: O(1) claims and releases, and its checker (``reference.views.check_occupancy``), which names
the slot or block at fault.

Several of these were added after mutation testing (docs/fuzzing.md): mutants that changed the
checker's branches for stray holders, stray blocks and the live total survived the first suite.
"""

import pytest

from vtoken.core.errors import BlockOutOfRangeError, InvariantViolation
from vtoken.core.occupancy import SlotOccupancy, waste_ratio
from vtoken.core.reference.views import check_occupancy


def occ():
    o = SlotOccupancy(num_blocks=4, block_size=4)
    for slot in (0, 1, 5):
        o.claim(slot)
    o.claim(5)  # a shared slot: two holders
    return o


def test_claims_count_distinct_slots_per_block_and_in_total():
    o = occ()
    assert [o.holders(s) for s in (0, 1, 5, 6)] == [1, 1, 2, 0]
    assert [o.block_live(b) for b in range(4)] == [2, 1, 0, 0]
    assert o.live_slots == 3
    o.release(5)
    assert o.holders(5) == 1 and o.block_live(1) == 1 and o.live_slots == 3
    o.release(5)
    assert o.block_live(1) == 0 and o.live_slots == 2


def test_claim_run_is_claim_of_each_slot_of_the_run():
    o, each = occ(), occ()
    for first, n in ((8, 4), (4, 3), (2, 2), (1, 2), (12, 0)):  # free; 5 held; free; all held; empty
        o.claim_run(first, n)
        for slot in range(first, first + n):
            each.claim(slot)
        assert o.state() == each.state(), (first, n)
    assert [o.holders(s) for s in range(12)] == [1, 2, 2, 1, 1, 3, 1, 0, 1, 1, 1, 1]
    assert [o.block_live(b) for b in range(4)] == [4, 3, 4, 0] and o.live_slots == 11


@pytest.mark.parametrize("first, n", [(2, 3), (-1, 1), (14, 3), (16, 1), (0, -1), (0.0, 1), (True, 1)])
def test_claim_run_refuses_a_run_outside_one_block_and_changes_nothing(first, n):
    o = occ()
    before = o.state()
    with pytest.raises(BlockOutOfRangeError, match="not a run within one block"):
        o.claim_run(first, n)
    assert o.state() == before


def test_check_occupancy_accepts_the_matching_tables():
    check_occupancy(occ(), {0: 1, 1: 1, 5: 2})


@pytest.mark.parametrize("expected, message", [
    ({0: 1, 1: 1, 5: 1}, r"^I2: slot 5 \(block 1, offset 1\) has 2 holder\(s\) recorded, 1 in the token tables$"),
    ({0: 1, 5: 2}, r"^I2: slot 1 \(block 0, offset 1\) has 1 holder\(s\) recorded, 0 in the token tables$"),
    ({0: 1, 1: 1, 5: 2, 9: 1}, r"^I2: slot 9 \(block 2, offset 1\) has 0 holder\(s\) recorded, 1 in the token tables$"),
])
def test_check_occupancy_names_the_slot_that_differs(expected, message):
    with pytest.raises(InvariantViolation, match=message) as err:
        check_occupancy(occ(), expected)
    assert err.value.invariant == "I2"


def test_check_occupancy_names_a_block_whose_count_is_wrong():
    o = occ()
    o._block_live[0] += 1
    with pytest.raises(InvariantViolation, match=r"^I2: block 0 records 3 live slots, tables give 2$") as err:
        check_occupancy(o, {0: 1, 1: 1, 5: 2})
    assert err.value.invariant == "I2"


def test_check_occupancy_names_a_block_counted_live_with_no_claims():
    o = occ()
    o._block_live[3] = 1
    with pytest.raises(InvariantViolation, match=r"^I2: block 3 records 1 live slots, tables give 0$") as err:
        check_occupancy(o, {0: 1, 1: 1, 5: 2})
    assert err.value.invariant == "I2"


def test_check_occupancy_checks_the_live_total():
    o = occ()
    o.live_slots += 1
    with pytest.raises(InvariantViolation, match=r"^I2: live slot total 4 != 3$") as err:
        check_occupancy(o, {0: 1, 1: 1, 5: 2})
    assert err.value.invariant == "I2"


def test_waste_ratio_is_eq1_and_refuses_counts_out_of_range():
    assert waste_ratio(0, 0, 16) == 0.0  # nothing allocated: no waste
    assert waste_ratio(24, 2, 16) == 0.25 and waste_ratio(0, 3, 4) == 1.0 and waste_ratio(8, 2, 4) == 0.0
    for live, message in ((9, "I2: waste ratio -0.125 out of [0, 1]"), (-4, "I2: waste ratio 1.5 out of [0, 1]")):
        with pytest.raises(InvariantViolation) as e:
            waste_ratio(live, 2, 4)
        assert str(e.value) == message and e.value.invariant == "I2"


def test_holders_of_is_holders_of_each_slot_in_order():
    o = occ()
    assert o.holders_of([5, 0, 6, 1, 5]) == [o.holders(s) for s in (5, 0, 6, 1, 5)] == [2, 1, 0, 1, 2]
    assert o.holders_of([]) == []


@pytest.mark.parametrize("slots", [[0, 16], [-1, 0], [0, 1.0], [True], [0, "1"]])
def test_holders_of_refuses_a_slot_outside_the_pool_naming_it(slots):
    o = occ()
    before = o.state()
    with pytest.raises(BlockOutOfRangeError, match="slot"):
        o.holders_of(slots)
    assert o.state() == before
