"""TokenTable: the logical -> physical token map, its three mutations, layout rewrites and views.

Every rejected call must raise its specific error, name the culprit, and leave
``TokenTable.state()`` exactly as it was.
"""

import re

import pytest

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.errors import (
    BlockListTooShortError,
    BlockNotOwnedError,
    BlockOutOfRangeError,
    ConfigError,
    DestinationError,
    DuplicateRequestError,
    MoveSourceMismatchError,
    TokenAlreadyEvictedError,
    TokenOutOfRangeError,
    UnknownRequestError,
)
from vtoken.core.reference.views import check_views
from vtoken.core.token_table import NO_SLOT, Move, TokenTable

S = 4  # block size used throughout


def table_with(blocks=(0, 1), total_len=6, num_blocks=8, req="A") -> TokenTable:
    """One request ``req`` holding ``total_len`` tokens written sequentially over ``blocks``."""
    t = TokenTable(num_blocks, S)
    t.add_request(req)
    t.sync_new_tokens(req, list(blocks), total_len)
    return t


def assert_rejected(table: TokenTable, exc: type, match: str, fn, *args) -> None:
    """The call raises exactly ``exc``, its message matches ``match``, and the table is unchanged."""
    before = table.state()
    with pytest.raises(exc, match=match) as info:
        fn(*args)
    assert type(info.value) is exc
    assert table.state() == before


def live_positions(table: TokenTable, req) -> list[int]:
    """Positions (index in the block list * S + offset) of the live tokens, in logical order."""
    index = {b: i for i, b in enumerate(table.block_ids(req))}
    return [index[s // S] * S + s % S for s in table.attention_slots(req)]


# ---- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (-1, 4), (8, 0), (8, -2)])
def test_non_positive_sizes_are_a_config_error(num_blocks, block_size):
    with pytest.raises(ConfigError, match=f"got {num_blocks}, {block_size}") as info:
        TokenTable(num_blocks, block_size)
    assert type(info.value) is ConfigError


def test_more_slots_than_a_c_int_holds_is_a_config_error():
    with pytest.raises(ConfigError, match="65536 blocks x 32768 slots exceeds 2147483647 slots"):
        TokenTable(2**16, 2**15)


# ---- registration --------------------------------------------------------------------------


def test_add_request_registers_an_empty_request():
    t = TokenTable(8, S)
    t.add_request("A")
    t.add_request(7)
    assert t.request_ids() == ["A", 7]
    assert "A" in t and 7 in t and "B" not in t
    assert (t.num_live("A"), t.total_len("A"), t.write_pos("A"), t.layout_version("A")) == (0, 0, 0, 0)
    assert t.block_ids("A") == []
    assert t.attention_slots("A") == []


def test_registering_a_request_twice_is_rejected():
    t = table_with()
    assert_rejected(t, DuplicateRequestError, "request 'A' is already registered", t.add_request, "A")


UNKNOWN_CALLS = {
    "sync_new_tokens": lambda t, r: t.sync_new_tokens(r, [5], 1),
    "evict_token": lambda t, r: t.evict_token(r, 0),
    "apply_moves": lambda t, r: t.apply_moves(r, []),
    "set_layout": lambda t, r: t.set_layout(r, [0, 1], 6),
    "remove_request": lambda t, r: t.remove_request(r),
    "num_live": lambda t, r: t.num_live(r),
    "total_len": lambda t, r: t.total_len(r),
    "write_pos": lambda t, r: t.write_pos(r),
    "layout_version": lambda t, r: t.layout_version(r),
    "block_ids": lambda t, r: t.block_ids(r),
    "is_live": lambda t, r: t.is_live(r, 0),
    "slot_of": lambda t, r: t.slot_of(r, 0),
    "live_token_ids": lambda t, r: t.live_token_ids(r),
    "attention_slots": lambda t, r: t.attention_slots(r),
    "write_slots": lambda t, r: t.write_slots(r),
    "block_live_counts": lambda t, r: t.block_live_counts(r),
    "snapshot": lambda t, r: t.snapshot(r),
}


@pytest.mark.parametrize("op", sorted(UNKNOWN_CALLS))
def test_every_operation_rejects_an_unknown_request(op):
    t = table_with()
    assert_rejected(t, UnknownRequestError, "unknown request 'B'", UNKNOWN_CALLS[op], t, "B")


def test_an_unhashable_request_id_is_unknown():
    t = table_with()
    assert_rejected(t, UnknownRequestError, r"unknown request \['A'\]", t.evict_token, ["A"], 0)


def test_remove_request_returns_its_blocks_and_releases_its_slots():
    t = table_with(blocks=(3, 1), total_len=6)
    t.evict_token("A", 0)
    assert t.remove_request("A") == [3, 1]
    assert "A" not in t
    assert t.request_ids() == []
    assert t.occupancy.live_slots == 0
    assert [t.occupancy.block_live(b) for b in range(8)] == [0] * 8
    assert_rejected(t, UnknownRequestError, "unknown request 'A'", t.remove_request, "A")


def test_a_removed_request_id_can_be_registered_again_from_scratch():
    t = table_with()
    t.remove_request("A")
    t.add_request("A")
    assert t.total_len("A") == 0
    assert t.sync_new_tokens("A", [2], 1) == [8]


# ---- sync_new_tokens -----------------------------------------------------------------------


def test_sync_writes_consecutive_positions_across_the_block_list():
    t = TokenTable(8, S)
    t.add_request("A")
    assert t.sync_new_tokens("A", [3, 1], 6) == [12, 13, 14, 15, 4, 5]
    assert t.block_ids("A") == [3, 1]
    assert (t.total_len("A"), t.num_live("A"), t.write_pos("A")) == (6, 6, 6)
    assert t.attention_slots("A") == [12, 13, 14, 15, 4, 5]
    assert t.live_token_ids("A") == [0, 1, 2, 3, 4, 5]
    assert t.block_live_counts("A") == {3: 4, 1: 2}
    assert [t.occupancy.block_live(b) for b in range(8)] == [0, 2, 0, 4, 0, 0, 0, 0]
    assert t.occupancy.live_slots == 6
    assert [t.occupancy.holders(s) for s in (4, 5, 6, 12)] == [1, 1, 0, 1]


def test_later_syncs_continue_at_the_append_cursor():
    t = table_with(blocks=(3, 1), total_len=6)
    assert t.sync_new_tokens("A", [], 8) == [6, 7]
    assert t.sync_new_tokens("A", [5], 9) == [20]
    assert t.block_ids("A") == [3, 1, 5]
    assert t.write_pos("A") == 9
    assert t.slot_of("A", 8) == 20


def test_sync_appends_after_holes_instead_of_filling_them():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 1)
    assert t.sync_new_tokens("A", [], 7) == [6]
    assert t.slot_of("A", 1) == NO_SLOT
    assert t.num_live("A") == 6


def test_sync_may_add_blocks_ahead_of_any_tokens():
    t = table_with(blocks=(0,), total_len=2)
    assert t.sync_new_tokens("A", [6], 2) == []
    assert t.block_ids("A") == [0, 6]
    assert t.block_live_counts("A") == {0: 2, 6: 0}
    assert t.write_pos("A") == 2


def test_write_slots_are_the_latest_syncs_slots_with_evictions_marked():
    t = table_with(blocks=(0, 1), total_len=3)
    t.sync_new_tokens("A", [], 6)
    assert t.write_slots("A") == [3, 4, 5]
    t.evict_token("A", 4)
    assert t.write_slots("A") == [3, NO_SLOT, 5]


def test_total_len_shrinking_is_rejected():
    t = table_with(total_len=6)
    assert_rejected(
        t, TokenOutOfRangeError, "request 'A': total_len 5 is below the synced length 6",
        t.sync_new_tokens, "A", [], 5,
    )


@pytest.mark.parametrize("total_len", [7.0, "7", None])
def test_a_non_integer_total_len_is_rejected(total_len):
    t = table_with(total_len=6)
    assert_rejected(t, TokenOutOfRangeError, rf"total_len {total_len!r}", t.sync_new_tokens, "A", [2], total_len)


@pytest.mark.parametrize("block", [-1, 8, 100, "2", 2.0])
def test_sync_rejects_a_block_outside_the_pool(block):
    t = table_with(total_len=6)
    assert_rejected(
        t, BlockOutOfRangeError, rf"block {block!r} outside the pool \[0, 8\)",
        t.sync_new_tokens, "A", [2, block], 7,
    )


def test_sync_rejects_a_block_already_in_the_list():
    t = table_with(blocks=(0, 1), total_len=6)
    assert_rejected(
        t, BlockNotOwnedError, "request 'A': block 1 is already in its block list",
        t.sync_new_tokens, "A", [2, 1], 10,
    )


def test_sync_rejects_the_same_new_block_twice():
    t = table_with(blocks=(0, 1), total_len=6)
    assert_rejected(
        t, BlockNotOwnedError, "request 'A': block 2 is already in its block list",
        t.sync_new_tokens, "A", [2, 2], 10,
    )


def test_sync_rejects_a_block_list_too_short_for_total_len():
    t = table_with(blocks=(0, 1), total_len=6)
    assert_rejected(
        t, BlockListTooShortError, "request 'A': 7 new tokens from position 6 need 13 slots, its 3 blocks hold 12",
        t.sync_new_tokens, "A", [2], 13,
    )


def test_sync_fills_its_blocks_exactly_to_capacity():
    t = table_with(blocks=(0, 1), total_len=6)
    assert t.sync_new_tokens("A", [2], 12) == [6, 7, 8, 9, 10, 11]
    assert t.write_pos("A") == 12


# ---- evict_token ---------------------------------------------------------------------------


def test_evict_marks_the_token_dead_and_moves_nothing():
    t = table_with(blocks=(3, 1), total_len=6)
    t.evict_token("A", 4)
    assert t.slot_of("A", 4) == NO_SLOT
    assert t.is_live("A", 4) is False and t.is_live("A", 5) is True
    assert t.num_live("A") == 5
    assert t.total_len("A") == 6
    assert t.write_pos("A") == 6
    assert t.block_ids("A") == [3, 1]
    assert t.attention_slots("A") == [12, 13, 14, 15, 5]
    assert t.live_token_ids("A") == [0, 1, 2, 3, 5]
    assert t.block_live_counts("A") == {3: 4, 1: 1}
    assert t.occupancy.holders(4) == 0
    assert t.occupancy.block_live(1) == 1
    assert t.occupancy.live_slots == 5
    assert t.layout_version("A") == 0


def test_evicting_every_token_of_a_block_leaves_the_block_listed_but_empty():
    t = table_with(blocks=(0, 1), total_len=6)
    for tok in (4, 5):
        t.evict_token("A", tok)
    assert t.block_ids("A") == [0, 1]
    assert t.block_live_counts("A") == {0: 4, 1: 0}
    assert t.occupancy.block_live(1) == 0


def test_double_eviction_is_rejected():
    t = table_with()
    t.evict_token("A", 2)
    assert_rejected(t, TokenAlreadyEvictedError, "request 'A': token 2 is already evicted", t.evict_token, "A", 2)


def test_evict_tokens_returns_the_positions_they_held_and_equals_evicting_them_one_by_one():
    """Blocks listed out of pool order (3, 1, 5) so a position is not a slot; tokens in any order."""
    batch, one_by_one = table_with(blocks=(3, 1, 5), total_len=11), table_with(blocks=(3, 1, 5), total_len=11)
    victims = [9, 0, 5, 4, 10]
    assert batch.evict_tokens("A", victims) == [9, 0, 5, 4, 10]  # positions, not slots (9 sits at slot 21)
    for tok in victims:
        one_by_one.evict_token("A", tok)
    assert batch.state() == one_by_one.state()
    assert batch.live_token_ids("A") == [1, 2, 3, 6, 7, 8]
    assert batch.block_live_counts("A") == {3: 3, 1: 2, 5: 1}
    assert batch.take_changes("A").evicted == one_by_one.take_changes("A").evicted
    check_views(batch, "A")


def test_evict_tokens_in_a_shared_block_clears_only_the_evicting_requests_mask(fig3):
    t, _ = fig3
    assert t.evict_tokens("A", [5, 1, 2]) == [5, 1, 2]
    assert t.block_mask("A", 0) == 0b1001 and t.block_mask("B", 0) == 0b1111
    assert [t.occupancy.holders(s) for s in range(4)] == [2, 1, 1, 2]  # B still holds 1 and 2
    assert t.num_live("A") == 3 and t.live_token_ids("A") == [0, 3, 4]
    check_views(t, "A")


def test_evict_tokens_is_all_or_none():
    t = table_with(total_len=6)
    t.evict_token("A", 2)
    assert_rejected(t, TokenAlreadyEvictedError, "request 'A': token 2 is already evicted",
                    t.evict_tokens, "A", [0, 1, 2])
    assert_rejected(t, TokenAlreadyEvictedError, "request 'A': token 1 is named twice",
                    t.evict_tokens, "A", [1, 3, 1])
    assert_rejected(t, TokenOutOfRangeError, r"request 'A': token 6 outside its synced tokens \[0, 6\)",
                    t.evict_tokens, "A", [0, 6])
    assert t.evict_tokens("A", []) == [] and t.num_live("A") == 5


def test_slots_of_is_slot_of_each_token_read_in_one_call():
    t = table_with(blocks=(3, 1), total_len=6)
    t.evict_token("A", 4)
    assert t.slots_of("A", [5, 0, 4, 0]) == [5, 12, NO_SLOT, 12]
    assert t.slots_of("A", []) == []
    for bad in ([0, 6], [-1], [0, 1.0], [True], ["1"]):
        assert_rejected(t, TokenOutOfRangeError, "outside its synced tokens", t.slots_of, "A", bad)
    assert_rejected(t, TokenOutOfRangeError, "must be a sequence", t.slots_of, "A", 3)


@pytest.mark.parametrize("token", [-1, 6, 99, 1.0, "1", None])
def test_evicting_a_token_outside_the_synced_range_is_rejected(token):
    t = table_with(total_len=6)
    assert_rejected(
        t, TokenOutOfRangeError, rf"request 'A': token {token!r} outside its synced tokens \[0, 6\)",
        t.evict_token, "A", token,
    )


@pytest.mark.parametrize("query", ["slot_of", "is_live"])
@pytest.mark.parametrize("token", [-1, 6, 2.0])
def test_token_queries_reject_tokens_outside_the_synced_range(query, token):
    t = table_with(total_len=6)
    with pytest.raises(TokenOutOfRangeError, match=rf"token {token!r} outside"):
        getattr(t, query)("A", token)


# ---- apply_moves ---------------------------------------------------------------------------


def test_a_move_relocates_a_live_token_into_a_hole():
    t = table_with(blocks=(0, 1), total_len=6)  # slots 0..5
    t.evict_token("A", 1)
    t.apply_moves("A", [Move(5, 1, 1, 0, 1)])
    assert t.slot_of("A", 5) == 1
    assert t.attention_slots("A") == [0, 2, 3, 4, 1]
    assert t.block_live_counts("A") == {0: 4, 1: 1}
    assert [t.occupancy.holders(s) for s in (1, 5)] == [1, 0]
    assert [t.occupancy.block_live(b) for b in (0, 1)] == [4, 1]
    assert t.occupancy.live_slots == 5
    assert t.num_live("A") == 5
    assert t.write_pos("A") == 6
    assert t.layout_version("A") == 1


def test_moves_accept_plain_tuples():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    t.apply_moves("A", [(4, 1, 0, 0, 0)])
    assert t.slot_of("A", 4) == 0


def test_a_batch_may_move_a_token_into_a_slot_another_move_vacates():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 1)
    # token 0 leaves slot 0 for the hole at 1, token 5 takes slot 0 in the same batch
    t.apply_moves("A", [Move(0, 0, 0, 0, 1), Move(5, 1, 1, 0, 0)])
    assert t.slot_of("A", 0) == 1
    assert t.slot_of("A", 5) == 0
    assert t.attention_slots("A") == [1, 2, 3, 4, 0]
    assert [t.occupancy.holders(s) for s in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert t.block_live_counts("A") == {0: 4, 1: 1}


def test_a_batch_may_swap_two_tokens():
    t = table_with(blocks=(0,), total_len=2)
    t.apply_moves("A", [Move(0, 0, 0, 0, 1), Move(1, 0, 1, 0, 0)])
    assert t.attention_slots("A") == [1, 0]
    assert t.occupancy.live_slots == 2


def test_a_stale_move_source_is_rejected():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, MoveSourceMismatchError,
        r"request 'A': move of token 5 names source \(1, 0\) but the table has slot 5 = \(1, 1\)",
        t.apply_moves, "A", [Move(5, 1, 0, 0, 0)],
    )


def test_replaying_an_applied_move_is_rejected_as_stale():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    t.evict_token("A", 1)
    t.apply_moves("A", [Move(5, 1, 1, 0, 0)])
    assert_rejected(t, MoveSourceMismatchError, "move of token 5 names source", t.apply_moves, "A", [Move(5, 1, 1, 0, 1)])


def test_moving_one_token_twice_in_a_batch_is_rejected():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    t.evict_token("A", 1)
    assert_rejected(
        t, MoveSourceMismatchError, "request 'A': token 5 moved twice in one batch",
        t.apply_moves, "A", [Move(5, 1, 1, 0, 0), Move(5, 1, 1, 0, 1)],
    )


def test_moving_a_dead_token_is_rejected():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 5)
    t.evict_token("A", 0)
    assert_rejected(
        t, TokenAlreadyEvictedError, "request 'A': token 5 is already evicted",
        t.apply_moves, "A", [Move(5, 1, 1, 0, 0)],
    )


@pytest.mark.parametrize("token", [-1, 6, 99, 1.0, "1"])
def test_moving_a_token_outside_the_synced_range_is_rejected(token):
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, TokenOutOfRangeError, rf"token {token!r} outside its synced tokens",
        t.apply_moves, "A", [Move(token, 1, 1, 0, 0)],
    )


@pytest.mark.parametrize(
    "dst_block, dst_offset",
    [(8, 0), (-1, 0), (100, 3), (0, -1), (0, S), (0, 7), (1.0, 0), (0, "1"), (None, 0)],
)
def test_a_destination_outside_the_pool_is_rejected(dst_block, dst_offset):
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, DestinationError,
        rf"request 'A': token 5 destination \({dst_block}, {dst_offset}\) is outside the pool \(8 blocks of 4\)",
        t.apply_moves, "A", [Move(5, 1, 1, dst_block, dst_offset)],
    )


@pytest.mark.parametrize("move", [(5, 1, 1, 0), (5, 1, 1, 0, 0, 0), 5, None])
def test_a_move_of_the_wrong_shape_is_rejected(move):
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, MoveSourceMismatchError, "request 'A': malformed move " + re.escape(repr(move)),
        t.apply_moves, "A", [Move(4, 1, 0, 0, 0), move],
    )


@pytest.mark.parametrize("src", [(None, 1), ("1", 1), (1, "1")])
def test_a_non_integer_move_source_is_rejected_as_stale(src):
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, MoveSourceMismatchError, r"move of token 5 names source .* but the table has slot 5 = \(1, 1\)",
        t.apply_moves, "A", [Move(5, *src, 0, 0)],
    )


def test_a_destination_block_outside_the_block_list_is_rejected():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, BlockNotOwnedError, "request 'A': token 5 destination block 2 is not in its block list",
        t.apply_moves, "A", [Move(5, 1, 1, 2, 0)],
    )


def test_a_destination_held_by_the_same_requests_live_token_is_rejected():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, DestinationError, r"token 5 destination slot 2 \(0, 2\) is occupied by a live token",
        t.apply_moves, "A", [Move(5, 1, 1, 0, 2)],
    )


def test_a_destination_held_by_another_request_on_a_shared_block_is_rejected():
    t = TokenTable(8, S)
    t.add_request("A")
    t.sync_new_tokens("A", [0], 4)
    t.add_request("B")
    t.sync_new_tokens("B", [0, 1], 6)  # B reuses block 0 as a shared prefix
    t.evict_token("B", 2)  # B's slot 2 is a hole, but A still holds it
    assert t.occupancy.holders(2) == 1
    assert_rejected(
        t, DestinationError, r"request 'B': token 5 destination slot 2 \(0, 2\) is occupied by a live token",
        t.apply_moves, "B", [Move(5, 1, 1, 0, 2)],
    )


def test_two_moves_to_one_destination_are_rejected():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    assert_rejected(
        t, DestinationError, "request 'A': slot 0 is the destination of two moves",
        t.apply_moves, "A", [Move(4, 1, 0, 0, 0), Move(5, 1, 1, 0, 0)],
    )


@pytest.mark.parametrize("dst_offset", [2, 3])
def test_a_destination_at_or_after_the_append_cursor_is_rejected(dst_offset):
    t = table_with(blocks=(0, 1), total_len=6)  # cursor at position 6 = (1, 2)
    slot = 1 * S + dst_offset
    assert_rejected(
        t, DestinationError,
        rf"token 0 destination slot {slot} is at or after the append cursor \(position 6\)",
        t.apply_moves, "A", [Move(0, 0, 0, 1, dst_offset)],
    )


def test_a_destination_in_a_listed_block_past_the_cursor_is_rejected():
    t = table_with(blocks=(0, 1), total_len=6)
    t.sync_new_tokens("A", [2], 6)  # block 2 listed, nothing written there yet
    assert_rejected(
        t, DestinationError, "destination slot 8 is at or after the append cursor",
        t.apply_moves, "A", [Move(0, 0, 0, 2, 0)],
    )


def test_one_bad_move_rejects_the_whole_batch():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 0)
    t.evict_token("A", 1)
    assert_rejected(
        t, BlockNotOwnedError, "destination block 5",
        t.apply_moves, "A", [Move(4, 1, 0, 0, 0), Move(5, 1, 1, 5, 0)],
    )
    assert t.attention_slots("A") == [2, 3, 4, 5]


# ---- set_layout ----------------------------------------------------------------------------


def test_set_layout_inserts_a_block_before_the_cursor_and_shifts_it():
    t = table_with(blocks=(0, 1), total_len=6)
    t.set_layout("A", [0, 5, 1], 10)
    assert t.block_ids("A") == [0, 5, 1]
    assert t.write_pos("A") == 10
    assert t.block_live_counts("A") == {0: 4, 5: 0, 1: 2}
    assert t.attention_slots("A") == [0, 1, 2, 3, 4, 5]  # slots are physical; nothing moved
    assert t.layout_version("A") == 1
    assert t.sync_new_tokens("A", [], 7) == [6]  # appends continue in block 1 at offset 2


def test_set_layout_drops_an_emptied_block_and_pulls_the_cursor_back():
    t = table_with(blocks=(0, 1, 2), total_len=10)
    for tok in (4, 5, 6, 7):
        t.evict_token("A", tok)
    t.set_layout("A", [0, 2], 6)
    assert t.block_ids("A") == [0, 2]
    assert t.write_pos("A") == 6
    assert t.block_live_counts("A") == {0: 4, 2: 2}
    assert live_positions(t, "A") == [0, 1, 2, 3, 4, 5]
    assert t.sync_new_tokens("A", [], 11) == [10]


def test_set_layout_rejects_dropping_a_block_with_live_tokens():
    t = table_with(blocks=(0, 1, 2), total_len=10)
    t.evict_token("A", 4)
    assert_rejected(
        t, BlockNotOwnedError, r"request 'A': block 1 still holds 3 live token\(s\) and cannot leave",
        t.set_layout, "A", [0, 2], 6,
    )


def test_set_layout_rejects_a_repeated_block():
    t = table_with(blocks=(0, 1), total_len=6)
    assert_rejected(
        t, BlockNotOwnedError, r"request 'A': new block list \[0, 1, 0\] repeats a block",
        t.set_layout, "A", [0, 1, 0], 6,
    )


@pytest.mark.parametrize("block", [8, -1, "3"])
def test_set_layout_rejects_a_block_outside_the_pool(block):
    t = table_with(blocks=(0, 1), total_len=6)
    assert_rejected(
        t, BlockOutOfRangeError, rf"block {block!r} outside the pool", t.set_layout, "A", [0, 1, block], 6,
    )


@pytest.mark.parametrize("write_pos", [-1, 9, 6.0, None])
def test_set_layout_rejects_a_cursor_outside_the_blocks(write_pos):
    t = table_with(blocks=(0, 1), total_len=6)
    assert_rejected(
        t, BlockListTooShortError, rf"request 'A': cursor {write_pos!r} outside its 2 blocks of 4",
        t.set_layout, "A", [0, 1], write_pos,
    )


def test_set_layout_accepts_a_cursor_at_the_very_end():
    t = table_with(blocks=(0, 1), total_len=6)
    t.set_layout("A", [0, 1], 8)
    assert t.write_pos("A") == 8


def test_set_layout_rejects_a_cursor_before_a_live_token():
    t = table_with(blocks=(0, 1), total_len=6)
    assert_rejected(
        t, DestinationError, "request 'A': block 1 holds live tokens at or after cursor 5",
        t.set_layout, "A", [0, 1], 5,
    )


def test_set_layout_rejects_moving_a_live_block_behind_the_cursor():
    t = table_with(blocks=(0, 1), total_len=6)
    t.sync_new_tokens("A", [2], 6)
    assert_rejected(
        t, DestinationError, "block 1 holds live tokens at or after cursor 6",
        t.set_layout, "A", [0, 2, 1], 6,
    )


def test_set_layout_may_pull_the_cursor_back_over_dead_tail_tokens():
    t = table_with(blocks=(0, 1), total_len=6)
    t.evict_token("A", 5)
    t.set_layout("A", [0, 1], 5)
    assert t.write_pos("A") == 5
    assert t.sync_new_tokens("A", [], 7) == [5]  # the dead token's slot is reused for the next append


# ---- snapshot and state --------------------------------------------------------------------


def test_snapshot_copies_the_layout():
    t = table_with(blocks=(3, 1), total_len=6)
    t.evict_token("A", 1)
    t.evict_token("A", 4)
    snap = t.snapshot("A", shared_blocks=[3, 7])
    assert snap.req_id == "A"
    assert snap.block_size == S
    assert snap.blocks == (3, 1)
    assert snap.masks == (0b1101, 0b10)
    assert (snap.write_pos, snap.num_live, snap.total_len, snap.layout_version) == (6, 4, 6, 0)
    assert snap.shared_blocks == frozenset({3})  # 7 is not in A's block list
    assert snap.live_slots() == [(0, 12), (2, 14), (3, 15), (5, 5)]
    assert [snap.live_count(i) for i in (0, 1)] == [3, 1]
    assert snap.version == (0, 6)


def test_a_snapshot_does_not_follow_later_changes():
    t = table_with(blocks=(0, 1), total_len=6)
    snap = t.snapshot("A")
    t.evict_token("A", 0)
    t.sync_new_tokens("A", [2], 9)
    assert snap.live_slots() == [(i, i) for i in range(6)]
    assert snap.blocks == (0, 1)
    assert snap.version == (0, 6)
    assert t.snapshot("A").version == (0, 9)


def test_state_changes_with_every_successful_mutation():
    t = table_with(blocks=(0, 1), total_len=6)
    seen = [t.state()]
    t.evict_token("A", 0)
    seen.append(t.state())
    t.apply_moves("A", [Move(5, 1, 1, 0, 0)])
    seen.append(t.state())
    t.set_layout("A", [0, 1], 5)
    seen.append(t.state())
    t.sync_new_tokens("A", [], 7)
    seen.append(t.state())
    assert len(set(seen)) == 5


# ---- Figure 3: prefix sharing and per-request eviction ---------------------------------------

PROMPT_A = "The cat and the dog ran".split()  # tokens 0..5; "and" is token 2
PROMPT_B = "The cat and the bird flew".split()  # same first block, own continuation
AND = PROMPT_A.index("and")


@pytest.fixture
def fig3():
    """A and B share block 0 (S tokens of a common prefix); each has its own next block."""
    pool = BlockPool(8, S)
    t = TokenTable(8, S)
    t.add_request("A")
    a_blocks = pool.allocate(2, Purpose.ADMISSION)  # [0, 1]
    t.sync_new_tokens("A", a_blocks, len(PROMPT_A))
    t.add_request("B")
    pool.share(a_blocks[0])  # B reuses A's cached prefix block
    b_blocks = [a_blocks[0]] + pool.allocate(1, Purpose.ADMISSION)  # [0, 2]
    t.sync_new_tokens("B", b_blocks, len(PROMPT_B))
    return t, pool


def test_fig3_shared_prefix_block_is_held_by_both_requests(fig3):
    t, pool = fig3
    assert t.block_ids("A") == [0, 1] and t.block_ids("B") == [0, 2]
    assert [pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    assert t.attention_slots("A") == [0, 1, 2, 3, 4, 5]
    assert t.attention_slots("B") == [0, 1, 2, 3, 8, 9]
    assert [t.occupancy.holders(s) for s in range(4)] == [2, 2, 2, 2]
    assert t.occupancy.block_live(0) == 4
    assert t.occupancy.live_slots == 8  # 4 shared + 2 of A's + 2 of B's


def test_fig3_evicting_and_in_a_skips_its_slot_only_for_a(fig3):
    t, _ = fig3
    assert PROMPT_A[AND] == "and" and AND == 2
    t.evict_token("A", AND)
    assert t.attention_slots("A") == [0, 1, 3, 4, 5]
    assert t.attention_slots("B") == [0, 1, 2, 3, 8, 9]
    assert t.is_live("A", AND) is False and t.is_live("B", AND) is True


def test_fig3_the_shared_slot_stays_occupied_while_b_holds_it(fig3):
    t, _ = fig3
    t.evict_token("A", AND)
    assert t.occupancy.holders(2) == 1
    assert t.occupancy.block_live(0) == 4
    assert t.occupancy.live_slots == 8


def test_fig3_a_per_block_live_counts_drop_while_b_keeps_its_own(fig3):
    t, _ = fig3
    t.evict_token("A", AND)
    assert t.block_live_counts("A") == {0: 3, 1: 2}
    assert t.block_live_counts("B") == {0: 4, 2: 2}
    assert t.num_live("A") == 5 and t.num_live("B") == 6


def test_fig3_the_slot_frees_only_when_b_evicts_and_too(fig3):
    t, _ = fig3
    t.evict_token("A", AND)
    t.evict_token("B", AND)
    assert t.occupancy.holders(2) == 0
    assert t.occupancy.block_live(0) == 3
    assert t.occupancy.live_slots == 7


def test_fig3_a_may_not_refill_the_hole_b_still_reads(fig3):
    t, _ = fig3
    t.evict_token("A", AND)
    assert_rejected(
        t, DestinationError, r"request 'A': token 5 destination slot 2 \(0, 2\) is occupied",
        t.apply_moves, "A", [Move(5, 1, 1, 0, 2)],
    )


def test_fig3_removing_a_keeps_bs_shared_slots_occupied(fig3):
    t, pool = fig3
    t.evict_token("A", AND)
    pool.free(t.remove_request("A"))
    assert [pool.ref_count(b) for b in (0, 1, 2)] == [1, 0, 1]
    assert [t.occupancy.holders(s) for s in range(6)] == [1, 1, 1, 1, 0, 0]
    assert t.occupancy.block_live(0) == 4
    assert t.occupancy.block_live(1) == 0
    assert t.occupancy.live_slots == 6


def test_a_float_source_offset_is_a_mismatch_even_if_equal_in_value():
    t = TokenTable(4, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0, 1], 6)
    t.evict_token("a", 0)
    state = t.state()
    with pytest.raises(MoveSourceMismatchError, match=r"request 'a': move of token 1 names source \(0, 1.0\)"):
        t.apply_moves("a", [(1, 0, 1.0, 0, 0)])
    assert t.state() == state


def test_an_empty_batch_of_moves_changes_nothing_not_even_the_layout_version():
    t = TokenTable(4, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0], 3)
    state = t.state()
    t.apply_moves("a", [])
    assert t.state() == state and t.layout_version("a") == 0


# ---- added after mutation testing (docs/fuzzing.md) ---------------------------------------------------
def test_set_layout_rejects_a_live_token_at_offset_zero_of_a_block_after_the_cursor():
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0, 1], 5)  # tokens 0..3 in block 0, token 4 at (1, 0)
    for tok in range(4):
        t.evict_token("a", tok)
    state = t.state()
    with pytest.raises(DestinationError, match="request 'a': block 1 holds live tokens at or after cursor 4"):
        t.set_layout("a", [0, 1], 4)
    assert t.state() == state


def test_set_layout_accepts_a_new_empty_block_after_the_cursor():
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0], 3)
    t.set_layout("a", [0, 5], 3)
    assert t.block_ids("a") == [0, 5] and t.write_pos("a") == 3 and t.block_live_counts("a") == {0: 3, 5: 0}


def test_slot_of_names_the_request_in_its_error():
    t = TokenTable(8, 4)
    t.add_request("a")
    with pytest.raises(TokenOutOfRangeError, match=r"^request 'a': token 0 outside its synced tokens \[0, 0\)$"):
        t.slot_of("a", 0)


# ---- block ownership across requests (shared prefix blocks) ---------------------------------------------
def test_a_full_block_of_another_request_may_be_shared_when_the_sync_fills_it():
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0, 1], 6)  # block 0 is full, block 1 holds a's cursor
    t.add_request("b")
    assert t.sync_new_tokens("b", [0, 2], 5) == [0, 1, 2, 3, 8]
    assert t.owners(0) == ["a", "b"] and t.owners(1) == ["a"] and t.owners(3) == []
    t.set_layout("b", [0, 2, 3], 5)  # a fresh block joins, none leaves
    assert t.owners(3) == ["b"]
    t.remove_request("a")
    assert t.owners(0) == ["b"] and t.owners(1) == []


def test_a_block_still_being_written_cannot_be_shared():
    t = TokenTable(8, 4)
    t.add_request("a")
    t.sync_new_tokens("a", [0, 1], 6)
    t.add_request("b")
    before = t.state()
    with pytest.raises(BlockNotOwnedError, match=r"block 1 belongs to request 'a', whose append cursor"):
        t.sync_new_tokens("b", [0, 1], 8)
    assert t.state() == before


# ---- issue #19: the live index (V1) --------------------------------------------------------------------------------------
def test_the_live_index_reads_ranks_without_the_scan_and_its_oracle_has_teeth():
    from vtoken.core.errors import InvariantViolation
    from vtoken.core.live_index import CHUNK

    t = TokenTable(num_blocks=20, block_size=16)
    t.add_request("A")
    t.sync_new_tokens("A", list(range(10)), 150)  # three chunks: 64 + 64 + 22 ids
    for tok in [0, 1, 63, 64, 65, 100]:
        t.evict_token("A", tok)
    view = t.live_tokens("A")
    assert len(view) == 144 and view[0] == 2 and view[61] == 66 and view[-1] == 149
    assert view[60:63] == [62, 66, 67] and list(view[140:]) == [146, 147, 148, 149]
    assert list(view) == t.live_token_ids("A")
    check_views(t, "A")
    t._get("A").live.counts[1] += 1  # planted: chunk 1 counts one live token too many
    with pytest.raises(InvariantViolation, match=f"V1: request 'A': live index chunk 1 \\(ids \\[{CHUNK}, "):
        check_views(t, "A")


def test_take_changes_lists_evictions_and_moves_since_the_last_take():
    t = TokenTable(num_blocks=4, block_size=4)
    t.add_request("A")
    t.sync_new_tokens("A", [0, 1], 6)
    assert t.take_changes("A") == (0, -1, True, (), 0, (), ())  # the first take: a full list
    t.evict_token("A", 2)
    t.sync_new_tokens("A", [], 7)
    t.evict_token("A", 6)  # joined and left since the last take: not in evicted
    assert t.take_changes("A") == (0, 0, False, (2,), 6, (), ())
    t.apply_moves("A", [Move(5, 1, 1, 0, 2)])
    t.apply_moves("A", [Move(0, 0, 0, 1, 2), Move(5, 0, 2, 1, 1)])  # 5 moved twice: listed once, where it is now
    t.evict_token("A", 0)  # moved, then evicted: only in evicted
    t.sync_new_tokens("A", [], 8)
    t.apply_moves("A", [Move(7, 1, 3, 0, 0)])  # joined since the last take: it is in the joined tokens' slots
    assert t.take_changes("A") == (3, 0, False, (0,), 7, (5,), (5,))
    assert t.take_changes("A") == (3, 3, False, (), 8, (), ())
    assert t.write_slots("A", 7) == [0]


def test_take_changes_says_rebuilt_when_more_moves_than_its_log_keeps(monkeypatch):
    from vtoken.core import token_table
    monkeypatch.setattr(token_table, "CHANGE_LOG_LIMIT", 2)
    t = TokenTable(num_blocks=4, block_size=4)
    t.add_request("A")
    t.sync_new_tokens("A", [0, 1], 6)
    t.take_changes("A")
    t.evict_token("A", 1)
    t.apply_moves("A", [Move(2, 0, 2, 0, 1), Move(3, 0, 3, 0, 2), Move(4, 1, 0, 0, 3)])
    assert t.take_changes("A") == (1, 0, True, (), 6, (), ())


def test_a_splice_that_would_drop_a_live_token_is_refused_and_changes_nothing():
    t = TokenTable(num_blocks=4, block_size=4)
    t.add_request("A")
    t.sync_new_tokens("A", [0, 1], 6)
    before = t.state()
    with pytest.raises(BlockNotOwnedError, match=r"request 'A': block 1 holds live tokens but would leave block "
                                                 r"list \[0\]"):
        t.splice("A", 1, 1, (), 4)
    with pytest.raises(DestinationError, match="request 'A': block 1 would hold live tokens at or after cursor 5"):
        t.splice("A", 2, 0, (), 5)
    assert t.state() == before
    for tok in (4, 5):
        t.evict_token("A", tok)
    t.splice("A", 1, 1, (), 4)
    assert t.block_ids("A") == [0] and t.write_pos("A") == 4 and t.layout_version("A") == 1
    check_views(t, "A")
