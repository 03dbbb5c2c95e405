"""BlockPool: ref-counted FIFO allocation, the evacuation headroom, and atomic rejection of bad calls."""

import pytest

from vtoken.core.block_pool import BlockPool, Purpose, blocks_needed
from vtoken.core.errors import (
    BlockOutOfRangeError,
    ConfigError,
    DoubleFreeError,
    HeadroomReservedError,
    InvariantViolation,
    PoolExhaustedError,
)

ADM = Purpose.ADMISSION
EVAC = Purpose.EVACUATION


def refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


def assert_rejected(pool: BlockPool, exc: type, match: str, fn, *args) -> None:
    """The call raises exactly ``exc`` (not a sibling or parent), names the culprit, and changes nothing."""
    before = pool.snapshot()
    with pytest.raises(exc, match=match) as info:
        fn(*args)
    assert type(info.value) is exc
    assert pool.snapshot() == before
    pool.check()


# ---- configuration ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_blocks, block_size, headroom, match",
    [
        (0, 4, 0, "num_blocks must be an int >= 1, got 0"),
        (-3, 4, 0, "num_blocks must be an int >= 1, got -3"),
        (8, 0, 0, "block_size must be an int >= 1, got 0"),
        (8, -1, 0, "block_size must be an int >= 1, got -1"),
        (8, 4, -1, r"headroom must be an int in \[0, 7\] \(num_blocks=8\), got -1"),
        (8, 4, 8, r"headroom must be an int in \[0, 7\] \(num_blocks=8\), got 8"),
        (8, 4, 9, r"headroom must be an int in \[0, 7\] \(num_blocks=8\), got 9"),
        (8.0, 4, 0, "num_blocks must be an int >= 1, got 8.0"),
        (True, 4, 0, "num_blocks must be an int >= 1, got True"),
    ],
)
def test_bad_config_is_rejected_with_config_error(num_blocks, block_size, headroom, match):
    with pytest.raises(ConfigError, match=match) as info:
        BlockPool(num_blocks, block_size, headroom)
    assert type(info.value) is ConfigError


def test_largest_headroom_is_one_below_pool_size():
    pool = BlockPool(8, 4, headroom=7)
    assert pool.headroom == 7
    assert pool.allocate(1, EVAC) == [0]


def test_new_pool_has_every_block_free_in_id_order():
    pool = BlockPool(5, 4, headroom=1)
    assert (pool.num_blocks, pool.block_size, pool.headroom) == (5, 4, 1)
    assert pool.num_free == 5
    assert pool.num_allocated == 0
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    assert refs(pool) == [0, 0, 0, 0, 0]
    assert pool.snapshot() == ((0, 0, 0, 0, 0), (0, 1, 2, 3, 4), ())
    pool.check()


# ---- allocate ----------------------------------------------------------------------------


def test_allocate_hands_out_blocks_in_queue_order_with_ref_count_one():
    pool = BlockPool(6, 4)
    assert pool.allocate(2, ADM) == [0, 1]
    assert pool.allocate(3, EVAC) == [2, 3, 4]
    assert refs(pool) == [1, 1, 1, 1, 1, 0]
    assert pool.num_free == 1
    assert pool.num_allocated == 5
    assert pool.free_block_ids() == [5]
    assert pool.is_allocated(4) is True
    assert pool.is_allocated(5) is False
    pool.check()


def test_allocate_zero_returns_nothing_and_changes_nothing():
    pool = BlockPool(4, 4, headroom=1)
    pool.allocate(1, ADM)
    before = pool.snapshot()
    assert pool.allocate(0, ADM) == []
    assert pool.allocate(0, EVAC) == []
    assert pool.snapshot() == before


def test_freed_blocks_rejoin_the_queue_tail_in_release_order():
    pool = BlockPool(6, 4)
    pool.allocate(4, ADM)
    pool.free([2, 0])
    assert pool.free_block_ids() == [4, 5, 2, 0]
    assert refs(pool) == [0, 1, 0, 1, 0, 0]
    assert pool.allocate(3, ADM) == [4, 5, 2]
    assert pool.free_block_ids() == [0]
    pool.check()


def test_allocate_past_the_pool_raises_pool_exhausted_not_headroom():
    pool = BlockPool(4, 4)
    pool.allocate(3, EVAC)
    assert_rejected(pool, PoolExhaustedError, "evacuation needs 2 blocks, 1 free", pool.allocate, 2, EVAC)


def test_admission_larger_than_the_free_queue_is_plain_exhaustion():
    pool = BlockPool(4, 4, headroom=1)
    pool.allocate(2, ADM)
    assert_rejected(pool, PoolExhaustedError, "admission needs 3 blocks, 2 free", pool.allocate, 3, ADM)


def test_admission_into_the_headroom_raises_headroom_reserved():
    pool = BlockPool(8, 4, headroom=2)
    assert pool.allocate(6, ADM) == [0, 1, 2, 3, 4, 5]
    assert_rejected(
        pool,
        HeadroomReservedError,
        "admission of 1 blocks would leave 1 free, below the evacuation headroom of 2",
        pool.allocate, 1, ADM,
    )


def test_headroom_reserved_is_a_pool_exhausted_error():
    pool = BlockPool(4, 4, headroom=1)
    pool.allocate(3, ADM)
    with pytest.raises(PoolExhaustedError) as info:
        pool.allocate(1, ADM)
    assert isinstance(info.value, HeadroomReservedError)
    assert issubclass(HeadroomReservedError, PoolExhaustedError)


def test_evacuation_may_take_the_headroom_admission_may_not():
    pool = BlockPool(8, 4, headroom=2)
    pool.allocate(6, ADM)
    assert pool.can_allocate(1, ADM) is False
    assert pool.can_allocate(2, EVAC) is True
    assert pool.allocate(2, EVAC) == [6, 7]
    assert pool.num_free == 0
    pool.check()


@pytest.mark.parametrize("purpose", [ADM, EVAC])
def test_negative_allocation_is_rejected(purpose):
    pool = BlockPool(4, 4, headroom=1)
    assert_rejected(pool, PoolExhaustedError, r"negative number of blocks \(-1\)", pool.allocate, -1, purpose)


def test_can_allocate_marks_the_exact_admission_and_evacuation_limits():
    pool = BlockPool(8, 4, headroom=3)
    pool.allocate(2, ADM)  # 6 free, 3 of them reserved
    assert [pool.can_allocate(n, ADM) for n in (-1, 0, 3, 4)] == [False, True, True, False]
    assert [pool.can_allocate(n, EVAC) for n in (-1, 0, 6, 7)] == [False, True, True, False]


# ---- share -------------------------------------------------------------------------------


def test_share_adds_one_reference():
    pool = BlockPool(4, 4)
    pool.allocate(2, ADM)
    pool.share(1)
    pool.share(1)
    assert refs(pool) == [1, 3, 0, 0]
    assert pool.num_free == 2
    pool.check()


def test_sharing_a_free_block_is_a_double_free_error():
    pool = BlockPool(4, 4)
    pool.allocate(1, ADM)
    assert_rejected(pool, DoubleFreeError, "cannot share block 2: it is free", pool.share, 2)


@pytest.mark.parametrize("block", [-1, 4, 100, "1", 1.0, None])
def test_sharing_a_block_outside_the_pool_is_rejected(block):
    pool = BlockPool(4, 4)
    pool.allocate(2, ADM)
    assert_rejected(pool, BlockOutOfRangeError, rf"block {block!r} outside the pool \[0, 4\)", pool.share, block)


# ---- free --------------------------------------------------------------------------------


def test_freeing_a_shared_block_drops_one_reference_and_keeps_it_allocated():
    pool = BlockPool(4, 4)
    pool.allocate(2, ADM)
    pool.share(0)
    pool.free([0])
    assert refs(pool) == [1, 1, 0, 0]
    assert pool.free_block_ids() == [2, 3]
    pool.free([0])
    assert refs(pool) == [0, 1, 0, 0]
    assert pool.free_block_ids() == [2, 3, 0]
    pool.check()


def test_one_batch_may_drop_every_reference_of_a_shared_block():
    pool = BlockPool(4, 4)
    pool.allocate(1, ADM)
    pool.share(0)
    pool.free([0, 0])
    assert refs(pool) == [0, 0, 0, 0]
    assert pool.free_block_ids() == [1, 2, 3, 0]


def test_free_accepts_any_iterable():
    pool = BlockPool(4, 4)
    pool.allocate(3, ADM)
    pool.free(b for b in (2, 1))
    assert pool.free_block_ids() == [3, 2, 1]


def test_freeing_a_free_block_is_rejected():
    pool = BlockPool(4, 4)
    pool.allocate(2, ADM)
    assert_rejected(pool, DoubleFreeError, r"block 3 freed 1 time\(s\) but holds 0 reference", pool.free, [3])


def test_double_free_within_one_batch_is_rejected():
    pool = BlockPool(4, 4)
    pool.allocate(2, ADM)
    assert_rejected(pool, DoubleFreeError, r"block 1 freed 2 time\(s\) but holds 1 reference", pool.free, [1, 1])


def test_freeing_a_block_more_times_than_it_is_shared_is_rejected():
    pool = BlockPool(4, 4)
    pool.allocate(1, ADM)
    pool.share(0)
    assert_rejected(pool, DoubleFreeError, r"block 0 freed 3 time\(s\) but holds 2 reference", pool.free, [0, 0, 0])


def test_a_bad_id_late_in_a_batch_frees_none_of_the_earlier_ones():
    pool = BlockPool(4, 4)
    pool.allocate(3, ADM)
    assert_rejected(pool, DoubleFreeError, "block 3 freed", pool.free, [0, 1, 3])
    assert refs(pool) == [1, 1, 1, 0]


@pytest.mark.parametrize("block", [-1, 4, 99, "0", 1.5])
def test_freeing_a_block_outside_the_pool_is_rejected(block):
    pool = BlockPool(4, 4)
    pool.allocate(2, ADM)
    assert_rejected(pool, BlockOutOfRangeError, rf"block {block!r} outside the pool", pool.free, [0, block])


def test_freeing_an_empty_batch_changes_nothing():
    pool = BlockPool(4, 4)
    pool.allocate(2, ADM)
    before = pool.snapshot()
    pool.free([])
    assert pool.snapshot() == before


# ---- queries and checks ------------------------------------------------------------------


@pytest.mark.parametrize("block", [-1, 4, "2"])
def test_ref_count_of_a_block_outside_the_pool_is_rejected(block):
    pool = BlockPool(4, 4)
    with pytest.raises(BlockOutOfRangeError, match=rf"block {block!r} outside"):
        pool.ref_count(block)
    with pytest.raises(BlockOutOfRangeError, match=rf"block {block!r} outside"):
        pool.is_allocated(block)


def test_free_block_ids_is_a_copy():
    pool = BlockPool(3, 4)
    ids = pool.free_block_ids()
    ids.clear()
    assert pool.free_block_ids() == [0, 1, 2]


def test_check_names_a_free_block_with_a_reference():
    pool = BlockPool(3, 4)
    pool._ref[1] = 1  # corrupt: block 1 is in the free queue with ref count 1
    with pytest.raises(InvariantViolation, match="P1: block 1 is free but has ref count 1"):
        pool.check()


def test_check_names_an_unreferenced_block_missing_from_the_queue():
    pool = BlockPool(3, 4)
    pool._free.remove(2)
    with pytest.raises(InvariantViolation, match="P1: block 2 has ref count 0 but is not in the free queue"):
        pool.check()


def test_check_names_a_block_queued_twice():
    pool = BlockPool(3, 4)
    pool._free.append(0)
    with pytest.raises(InvariantViolation, match="P1: block 0 is in the free queue twice"):
        pool.check()


@pytest.mark.parametrize(
    "num_tokens, block_size, expected",
    [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (8, 4, 2), (9, 4, 3), (7, 1, 7), (16, 16, 1)],
)
def test_blocks_needed_is_the_ceiling(num_tokens, block_size, expected):
    assert blocks_needed(num_tokens, block_size) == expected
