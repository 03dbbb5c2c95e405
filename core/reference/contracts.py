"""The core's CrossHair postconditions, as named predicates (spec/crosshair_check.py runs them).

CrossHair reads one condition per docstring line, and a property of several clauses does not read
well on one line. So the docstrings name the property (``post: not __return__ or
contracts.densify_fills_the_prefix(snap, __return__)``) and it is spelled out here, one clause per
line. Each predicate is pure and returns whether the property holds; ``old`` is CrossHair's
``__old__.self``, the object before the call. The executed checks the core runs on every call are
cheaper ``assert``s and ``InvariantViolation``s next to the code; these are what CrossHair proves
over every path it explores.
"""

from __future__ import annotations


def _position(snap, slot: int) -> int:
    """The logical position a slot of ``snap``'s blocks stands for."""
    S = snap.block_size
    return snap.blocks.index(slot // S) * S + slot % S


# ---- densify.py -------------------------------------------------------------------------------
def densify_fills_the_prefix(snap, plan) -> bool:
    """I7 after commit: every move reads its token's current slot, and the moved tokens (at their
    destinations) and the unmoved ones (where they are) fill exactly the positions [0, n_live)."""
    S, now = snap.block_size, dict(snap.live_slots())
    if any(now[m.token_id] != m.src_block * S + m.src_offset for m in plan.moves):
        return False
    moved = {m.token_id for m in plan.moves}
    stay = [_position(snap, s) for t, s in snap.live_slots() if t not in moved]
    land = [snap.blocks.index(m.dst_block) * S + m.dst_offset for m in plan.moves]
    return sorted(stay + land) == list(range(snap.num_live))


def densify_frees_only_the_tail(snap, plan) -> bool:
    """The cursor becomes n_live; the blocks released lie wholly at or after it; no shared block is read,
    written or released, nor is the new cursor's block (the next appends write its tail)."""
    S, n = snap.block_size, snap.num_live
    touched = {m.src_block for m in plan.moves} | {m.dst_block for m in plan.moves} | set(plan.src_blocks)
    if n % S:
        touched.add(snap.blocks[n // S])
    return (plan.dense_write_pos == n and plan.version == snap.version
            and all(snap.blocks.index(b) * S >= n for b in plan.src_blocks)
            and not touched & snap.shared_blocks)


# ---- compact.py -------------------------------------------------------------------------------
def eligible_in_ascending_live_count(snap, indices: list[int]) -> bool:
    """Exactly the eligible block indices (before the cursor's block, private, not full), each once,
    in ascending live count."""
    S = snap.block_size
    eligible = [i for i in range(min(len(snap.blocks), snap.write_pos // S))
                if snap.blocks[i] not in snap.shared_blocks and snap.live_count(i) < S]
    counts = [snap.live_count(i) for i in indices]
    return sorted(indices) == eligible and counts == sorted(counts)


def sources_private_before_the_cursor(snap, choice, max_sources: int) -> bool:
    """1..max_sources sources, in block-list order, none shared, none at or after the append block."""
    src = choice.src_blocks
    return (0 < len(src) <= max_sources and list(src) == [b for b in snap.blocks if b in src]
            and all(b not in snap.shared_blocks and snap.blocks.index(b) < snap.write_pos // snap.block_size
                    for b in src))


def strict_decrease_within_budget(snap, choice, dst_budget: int) -> bool:
    """The sources' T_live live tokens need ceil(T_live / S) destinations: fewer than the sources, and
    within the budget."""
    S = snap.block_size
    live = sum(snap.live_count(snap.blocks.index(b)) for b in choice.src_blocks)
    return (choice.num_live == live and live <= choice.num_dst * S < live + S
            and choice.num_dst < len(choice.src_blocks) and choice.num_dst <= dst_budget)


def compact_fills_in_logical_order(snap, plan) -> bool:
    """Every live token of the sources moves once, in logical order, to consecutive slots of the
    destinations; the plan frees more blocks than it takes."""
    S = snap.block_size
    tokens = [t for t, s in snap.live_slots() if s // S in plan.src_blocks]
    slots = [(plan.dst_blocks[i // S], i % S) for i in range(len(plan.moves))]
    return ([m.token_id for m in plan.moves] == tokens and [(m.dst_block, m.dst_offset) for m in plan.moves] == slots
            and plan.blocks_saved > 0)


# ---- plan.py: Plan.final_layout -----------------------------------------------------------------
def compact_sources_before_the_cursor(plan, blocks: list[int], write_pos: int, block_size: int) -> bool:
    """Distinct sources, each in the list before the cursor's block."""
    src = plan.src_blocks
    return len(src) > 0 and all(b in blocks and blocks.index(b) < write_pos // block_size and b not in src[:i]
                                for i, b in enumerate(src))


def the_sources_leave_and_the_destinations_join(plan, blocks: list[int], dsts, layout: list[int]) -> bool:
    """The sources leave, the destinations join (compact, relocate), every other block stays; nothing is
    listed twice."""
    joining = set() if plan.kind.value == "densify" else set(dsts)
    return len(set(layout)) == len(layout) and set(layout) == (set(blocks) - set(plan.src_blocks)) | joining


def the_cursor_after_commit(plan, blocks: list[int], write_pos: int, block_size: int, layout, cursor: int) -> bool:
    """Densify: the cursor is n_live. Relocate: the list keeps its length and the cursor stays. Compact: the
    cursor stays at the same offset of the same block (or past the list's end, if it was)."""
    kind = plan.kind.value
    if kind == "densify":
        return cursor == plan.dense_write_pos
    if kind == "relocate":
        return len(layout) == len(blocks) and cursor == write_pos
    S = block_size
    return cursor % S == write_pos % S and (write_pos // S == len(blocks) or layout[cursor // S] == blocks[write_pos // S])


# ---- token_table.py -------------------------------------------------------------------------------
def sync_wrote_fresh_slots(old, new, req_id, total_len: int, slots: list[int]) -> bool:
    """One fresh slot per new token, in the request's blocks, in order; they are the write slots."""
    n_new = total_len - old.total_len(req_id)
    return (len(slots) == n_new == len(set(slots)) and slots == new.write_slots(req_id)
            and all(s // new.block_size in new.block_ids(req_id) and new.occupancy.holders(s) >= 1 for s in slots))


def sync_appended_live_tokens(old, new, req_id, total_len: int, slots: list[int]) -> bool:
    """T1: the new tokens are live and counted; T2: the cursor moved past them."""
    start = old.total_len(req_id)
    return (new.num_live(req_id) == old.num_live(req_id) + len(slots) == len(new.live_token_ids(req_id))
            and new.write_pos(req_id) == old.write_pos(req_id) + len(slots)
            and all(new.is_live(req_id, t) for t in range(start, total_len)))


def evict_killed_one_token(old, new, req_id, token_id: int) -> bool:
    """The token is dead and no longer counted (T1)."""
    return (not new.is_live(req_id, token_id)
            and new.num_live(req_id) == old.num_live(req_id) - 1 == len(new.live_token_ids(req_id)))


def evict_killed_the_tokens(old, new, req_id, token_ids) -> bool:
    """The tokens are dead and no longer counted (T1)."""
    ids = set(token_ids)
    return (not any(new.is_live(req_id, t) for t in ids)
            and new.num_live(req_id) == old.num_live(req_id) - len(ids) == len(new.live_token_ids(req_id)))


def evict_moved_nothing(old, new, req_id, token_ids) -> bool:
    """Metadata only: every other token keeps its slot, the block list and cursor stay. ``token_ids``: the one
    evicted token, or the evicted tokens."""
    gone = {token_ids} if isinstance(token_ids, int) else set(token_ids)
    return (new.block_ids(req_id) == old.block_ids(req_id) and new.write_pos(req_id) == old.write_pos(req_id)
            and all(new.slot_of(req_id, t) == old.slot_of(req_id, t) for t in range(new.total_len(req_id))
                    if t not in gone))


def evicted_where_they_were(old, req_id, token_ids, positions) -> bool:
    """Each returned position is the one its token held before the call."""
    return list(positions) == [old.position_of(req_id, t) for t in token_ids]


def moves_kept_liveness_and_layout(old, new, req_id, moves) -> bool:
    """Liveness, counts, block list and cursor are unchanged; moved tokens sit where the moves say."""
    S = new.block_size
    return (new.live_token_ids(req_id) == old.live_token_ids(req_id) and new.num_live(req_id) == old.num_live(req_id)
            and new.block_ids(req_id) == old.block_ids(req_id) and new.write_pos(req_id) == old.write_pos(req_id)
            and all(new.slot_of(req_id, m[0]) == m[3] * S + m[4] for m in moves))


def live_slots_distinct_before_the_cursor(table, req_id) -> bool:
    """I2 and T2: live tokens hold distinct slots of the request's blocks, all before the cursor."""
    S, slots, blocks = table.block_size, table.attention_slots(req_id), table.block_ids(req_id)
    return (len(set(slots)) == table.num_live(req_id)
            and all(blocks.index(s // S) * S + s % S < table.write_pos(req_id) for s in slots))
