"""The relocation planners: ``compact`` (pack sparse blocks into fewer fresh ones) and ``densify``
(fill holes below n_live), and ``Plan.final_layout``.

Snapshots come from a real TokenTable; plans are applied back through the table
the way the reclamation manager commits them, and the result is checked.
"""

import random


from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.compact import SourceChoice
from vtoken.core.densify import plan_densify
from vtoken.core.plan import NoPlan, NoPlanReason, Plan, PlanKind
from vtoken.core.reference.compact import choose_sources, eligible_sources, plan_compaction
from vtoken.core.reference.views import check_occupancy
from vtoken.core.token_table import Move, TokenTable

S = 4
FRESH = [20, 21, 22, 23]  # destination blocks no request holds, for pure planning tests


def build(total_len, evict=(), extra_blocks=0, num_blocks=32, block_size=S, shared_prefix=0):
    """Request "A" with ``total_len`` tokens on blocks 0, 1, ... (plus ``extra_blocks`` unwritten ones).

    With ``shared_prefix=k``, request "B" first writes k full blocks and A reuses
    them (pool.share) as its prefix, as a prefix cache would. Returns (table, pool).
    """
    pool = BlockPool(num_blocks, block_size)
    table = TokenTable(num_blocks, block_size)
    prefix = []
    if shared_prefix:
        table.add_request("B")
        prefix = pool.allocate(shared_prefix, Purpose.ADMISSION)
        table.sync_new_tokens("B", prefix, shared_prefix * block_size)
        for b in prefix:
            pool.share(b)
    table.add_request("A")
    n_blocks = -(-total_len // block_size) + extra_blocks
    blocks = prefix + pool.allocate(n_blocks - len(prefix), Purpose.ADMISSION)
    table.sync_new_tokens("A", blocks, total_len)
    for t in evict:
        table.evict_token("A", t)
    return table, pool


def snap_of(table, pool, req="A"):
    """The planners' input, with shared blocks taken from the pool's ref counts (as the manager does)."""
    return table.snapshot(req, shared_blocks=[b for b in table.block_ids(req) if pool.ref_count(b) > 1])


def commit(table, pool, plan):
    """Apply a plan through the table exactly as ReclamationManager._commit does, then free its sources."""
    req, bs = plan.req_id, table.block_size
    blocks, write_pos = table.block_ids(req), table.write_pos(req)
    final_blocks, final_pos = plan.final_layout(blocks, write_pos, bs)
    if plan.dst_blocks:  # compact: attach destinations before the cursor so moves may land there
        at = final_blocks.index(plan.dst_blocks[0])
        table.set_layout(req, blocks[:at] + list(plan.dst_blocks) + blocks[at:], write_pos + len(plan.dst_blocks) * bs)
    table.apply_moves(req, plan.moves)
    table.set_layout(req, final_blocks, final_pos)
    pool.free(plan.src_blocks)


def live_positions(table, req="A"):
    """Positions (block-list index * S + offset) of live tokens, in logical order."""
    bs = table.block_size
    index = {b: i for i, b in enumerate(table.block_ids(req))}
    return [index[s // bs] * bs + s % bs for s in table.attention_slots(req)]


def l1():
    """S=4, 18 tokens on blocks 0-4, cursor at 18 in block 4.

    live per block: 0: 4 (full) | 1: 1 (token 7) | 2: 3 (9, 10, 11) | 3: 2 (14, 15) | 4: cursor block
    """
    return build(18, evict=(4, 5, 6, 8, 12, 13))


# ---- compact: source selection ----------------------------------------------------------------


def test_eligible_sources_are_sorted_by_utilization():
    table, pool = l1()
    assert eligible_sources(snap_of(table, pool)) == [1, 3, 2]


def test_choose_sources_takes_the_lowest_utilization_blocks_up_to_max_sources():
    table, pool = l1()
    assert choose_sources(snap_of(table, pool), max_sources=2, dst_budget=8) == SourceChoice((1, 3), 3, 1)


def test_choose_sources_reports_blocks_in_block_list_order():
    table, pool = l1()
    assert choose_sources(snap_of(table, pool), max_sources=3, dst_budget=8) == SourceChoice((1, 2, 3), 6, 2)


def test_compact_packs_the_two_sparsest_blocks_into_one_destination():
    table, pool = l1()
    plan = plan_compaction(snap_of(table, pool), FRESH, max_sources=2)
    assert plan == Plan(
        kind=PlanKind.COMPACT,
        req_id="A",
        version=(0, 18),
        moves=(Move(7, 1, 3, 20, 0), Move(14, 3, 2, 20, 1), Move(15, 3, 3, 20, 2)),
        src_blocks=(1, 3),
        dst_blocks=(20,),
    )
    assert plan.blocks_saved == 1


def test_compact_fills_each_destination_completely_in_logical_order():
    table, pool = l1()
    plan = plan_compaction(snap_of(table, pool), FRESH, max_sources=3)
    assert plan.moves == (
        Move(7, 1, 3, 20, 0), Move(9, 2, 1, 20, 1), Move(10, 2, 2, 20, 2), Move(11, 2, 3, 20, 3),
        Move(14, 3, 2, 21, 0), Move(15, 3, 3, 21, 1),
    )
    assert plan.src_blocks == (1, 2, 3)
    assert plan.dst_blocks == (20, 21)
    assert plan.blocks_saved == 1


def test_compact_never_takes_more_than_max_sources():
    table, pool = build(30, evict=(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 16, 17, 18, 20, 21, 22))
    plan = plan_compaction(snap_of(table, pool), FRESH, max_sources=3)
    assert plan.src_blocks == (0, 1, 2)  # six blocks with one live token each; ties go to the lower index
    assert plan.dst_blocks == (20,)


def test_compact_never_takes_a_full_block():
    table, pool = l1()
    plan = plan_compaction(snap_of(table, pool), FRESH, max_sources=8)
    assert 0 not in plan.src_blocks
    assert table.block_live_counts("A")[0] == S


def test_compact_never_takes_the_block_holding_the_cursor_even_when_it_is_emptiest():
    # blocks 0: full | 1: 1 live | 2: 2 live | 3: cursor block, its only token evicted
    table, pool = build(13, evict=(4, 5, 6, 8, 9, 12))
    snap = snap_of(table, pool)
    assert eligible_sources(snap) == [1, 2]
    plan = plan_compaction(snap, FRESH, max_sources=8)
    assert plan.src_blocks == (1, 2)
    assert plan.moves == (Move(7, 1, 3, 20, 0), Move(10, 2, 2, 20, 1), Move(11, 2, 3, 20, 2))


def test_compact_never_takes_a_block_after_the_cursor():
    # cursor exactly at the end of block 2; block 3 is listed but unwritten (0 live)
    table, pool = build(12, evict=(4, 5, 6, 8, 9, 10), extra_blocks=1)
    snap = snap_of(table, pool)
    assert snap.blocks == (0, 1, 2, 3) and snap.write_pos == 12
    assert eligible_sources(snap) == [1, 2]
    assert plan_compaction(snap, FRESH, max_sources=8).src_blocks == (1, 2)


def test_compact_never_takes_a_shared_block():
    # live per block: 0: 1 (shared prefix) | 1: 2 | 2: 1 | 3: cursor block
    table, pool = build(14, evict=(0, 1, 2, 4, 5, 8, 9, 10), shared_prefix=1)
    snap = snap_of(table, pool)
    assert snap.shared_blocks == frozenset({0})
    assert eligible_sources(snap) == [2, 1]
    plan = plan_compaction(snap, FRESH, max_sources=8)
    assert plan.src_blocks == (1, 2)
    assert plan.moves == (Move(6, 1, 2, 20, 0), Move(7, 1, 3, 20, 1), Move(11, 2, 3, 20, 2))


def test_the_same_block_is_a_source_when_not_shared():
    table, pool = build(14, evict=(0, 1, 2, 4, 5, 8, 9, 10))
    assert eligible_sources(table.snapshot("A")) == [0, 2, 1]
    assert plan_compaction(table.snapshot("A"), FRESH, max_sources=8).src_blocks == (0, 1, 2)


# ---- compact: no plan ---------------------------------------------------------------------------


def test_compact_without_evictions_has_no_candidates():
    table, pool = build(10)
    result = plan_compaction(snap_of(table, pool), FRESH, max_sources=8)
    assert result == NoPlan(NoPlanReason.NO_CANDIDATES, "request 'A'")
    assert not result


def test_a_request_within_its_cursor_block_has_no_candidates():
    table, pool = build(3, evict=(0, 1))
    assert plan_compaction(snap_of(table, pool), FRESH, max_sources=8).reason is NoPlanReason.NO_CANDIDATES


def test_compact_without_a_strict_decrease_makes_no_plan():
    table, pool = build(10, evict=(0, 4))  # blocks 0 and 1 hold 3 live each: 6 tokens need 2 blocks
    result = plan_compaction(snap_of(table, pool), FRESH, max_sources=8)
    assert result == NoPlan(NoPlanReason.NO_STRICT_DECREASE, "request 'A': 6 live tokens in 2 blocks need 2")


def test_compact_with_no_destination_budget_reports_headroom():
    table, pool = l1()
    result = plan_compaction(snap_of(table, pool), [], max_sources=8)
    assert result == NoPlan(NoPlanReason.NOT_ENOUGH_HEADROOM, "request 'A': budget 0")


def test_a_small_budget_shrinks_the_candidate_set_fullest_first():
    table, pool = l1()
    snap = snap_of(table, pool)
    assert choose_sources(snap, max_sources=3, dst_budget=1) == SourceChoice((1, 3), 3, 1)
    plan = plan_compaction(snap, FRESH[:1], max_sources=3)
    assert plan.src_blocks == (1, 3)
    assert plan.dst_blocks == (20,)
    assert plan.moves == (Move(7, 1, 3, 20, 0), Move(14, 3, 2, 20, 1), Move(15, 3, 3, 20, 2))


def test_fully_dead_blocks_are_freed_with_zero_moves_and_no_destinations():
    table, pool = build(14, evict=range(4, 12))  # blocks 1 and 2 fully dead
    plan = plan_compaction(snap_of(table, pool), [], max_sources=8)
    assert plan == Plan(PlanKind.COMPACT, "A", (0, 14), (), (1, 2), ())
    assert plan.blocks_saved == 2


def test_a_zero_budget_keeps_only_the_fully_dead_sources():
    table, pool = build(14, evict=(4, 5, 6, 7, 8))  # block 1 dead, block 2 holds 3
    plan = plan_compaction(snap_of(table, pool), [], max_sources=8)
    assert plan.src_blocks == (1,)
    assert plan.moves == ()


# ---- Plan.final_layout ------------------------------------------------------------------------


def test_compact_final_layout_puts_destinations_where_the_first_source_was():
    table, pool = l1()
    plan = plan_compaction(snap_of(table, pool), FRESH, max_sources=3)
    assert plan.final_layout([0, 1, 2, 3, 4], 18, S) == ([0, 20, 21, 4], 14)


def test_compact_final_layout_keeps_blocks_appended_after_planning():
    table, pool = l1()
    plan = plan_compaction(snap_of(table, pool), FRESH, max_sources=2)
    assert plan.final_layout([0, 1, 2, 3, 4, 9], 22, S) == ([0, 20, 2, 4, 9], 18)


def test_compact_final_layout_without_destinations_drops_sources():
    table, pool = build(14, evict=range(4, 12))
    plan = plan_compaction(snap_of(table, pool), [], max_sources=8)
    assert plan.final_layout([0, 1, 2, 3], 14, S) == ([0, 3], 6)


def test_densify_final_layout_drops_sources_and_sets_the_cursor_to_n_live():
    plan = Plan(PlanKind.DENSIFY, "A", (0, 10), (), (2,), (), 8)
    assert plan.final_layout([0, 1, 2, 3], 10, S) == ([0, 1, 3], 8)


def test_plan_and_no_plan_truthiness():
    assert bool(Plan(PlanKind.COMPACT, "A", (0, 0), (), ())) is True
    assert bool(NoPlan(NoPlanReason.NO_CANDIDATES)) is False


# ---- compact: applied through the table -------------------------------------------------------


def test_an_applied_compact_plan_keeps_every_token_and_frees_its_sources():
    table, pool = l1()
    before = {t: table.slot_of("A", t) for t in table.live_token_ids("A")}
    dsts = pool.allocate(2, Purpose.EVACUATION)
    assert dsts == [5, 6]
    plan = plan_compaction(snap_of(table, pool), dsts, max_sources=3)
    commit(table, pool, plan)
    assert table.block_ids("A") == [0, 5, 6, 4]
    assert table.write_pos("A") == 14
    assert table.live_token_ids("A") == list(before)
    moved = {m.token_id: m.dst_block * S + m.dst_offset for m in plan.moves}
    assert {t: table.slot_of("A", t) for t in before} == {**before, **moved}
    assert live_positions(table) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13]
    assert table.block_live_counts("A") == {0: 4, 5: 4, 6: 2, 4: 2}
    assert pool.free_block_ids()[-3:] == [1, 2, 3]
    assert [pool.ref_count(b) for b in (1, 2, 3)] == [0, 0, 0]
    assert table.sync_new_tokens("A", [], 19) == [18]  # appends resume in block 4
    pool.check()


def test_a_compacted_request_cannot_be_packed_further():
    table, pool = l1()
    plan = plan_compaction(snap_of(table, pool), pool.allocate(2, Purpose.EVACUATION), max_sources=3)
    commit(table, pool, plan)
    assert plan_compaction(snap_of(table, pool), FRESH, max_sources=8).reason is NoPlanReason.NO_STRICT_DECREASE


# ---- densify ----------------------------------------------------------------------------------


def d1(**kw):
    """S=4, 10 tokens on blocks 0-2; tokens 1 and 5 evicted: n_live 8, tokens 8 and 9 lie above it."""
    return build(10, evict=(1, 5), **kw)


def test_densify_moves_tokens_above_n_live_into_the_holes_below_it():
    table, pool = d1()
    plan = plan_densify(snap_of(table, pool))
    assert plan == Plan(
        kind=PlanKind.DENSIFY,
        req_id="A",
        version=(0, 10),
        moves=(Move(8, 2, 0, 0, 1), Move(9, 2, 1, 1, 1)),
        src_blocks=(2,),
        dst_blocks=(),
        dense_write_pos=8,
    )


def test_an_applied_densify_plan_leaves_live_tokens_dense_and_releases_the_tail():
    table, pool = d1()
    plan = plan_densify(snap_of(table, pool))
    table.apply_moves("A", plan.moves)
    table.set_layout("A", *plan.final_layout(table.block_ids("A"), table.write_pos("A"), S))
    pool.free(plan.src_blocks)
    assert table.block_ids("A") == [0, 1]
    assert table.write_pos("A") == 8
    assert sorted(live_positions(table)) == list(range(8))
    assert table.live_token_ids("A") == [0, 2, 3, 4, 6, 7, 8, 9]
    assert table.attention_slots("A") == [0, 2, 3, 4, 6, 7, 1, 5]
    assert pool.free_block_ids()[-1] == 2 and pool.ref_count(2) == 0
    assert pool.allocate(1, Purpose.ADMISSION) == [3]
    assert table.sync_new_tokens("A", [3], 11) == [3 * S]  # the append lands at position 8
    pool.check()


def test_densify_moves_never_chain():
    table, pool = build(23, evict=(0, 2, 3, 7, 9, 12, 14, 15))  # n_live 15, holes spread over 4 blocks
    plan = plan_densify(snap_of(table, pool))
    srcs = {(m.src_block, m.src_offset) for m in plan.moves}
    dsts = {(m.dst_block, m.dst_offset) for m in plan.moves}
    assert len(plan.moves) == 7  # tokens 16..22 into holes 0, 2, 3, 7, 9, 12, 14
    assert not srcs & dsts
    assert len(dsts) == len(plan.moves)
    assert all(m.dst_block * S + m.dst_offset < 15 <= m.src_block * S + m.src_offset for m in plan.moves)


def test_a_request_without_evictions_is_already_dense():
    table, pool = build(10)
    assert plan_densify(snap_of(table, pool)) == NoPlan(NoPlanReason.ALREADY_DENSE, "request 'A'")


def test_a_densified_request_is_already_dense():
    table, pool = d1()
    commit(table, pool, plan_densify(snap_of(table, pool)))
    assert plan_densify(snap_of(table, pool)).reason is NoPlanReason.ALREADY_DENSE


def test_densify_refuses_to_fill_a_hole_in_a_shared_block():
    table, pool = build(10, evict=(1,), shared_prefix=1)  # hole at position 1, in shared block 0
    assert plan_densify(snap_of(table, pool)) == NoPlan(NoPlanReason.SHARED_BLOCK, "request 'A': blocks [0]")


def test_densify_refuses_to_move_out_of_or_free_a_shared_block():
    table, pool = d1()
    result = plan_densify(table.snapshot("A", shared_blocks=[2]))
    assert result == NoPlan(NoPlanReason.SHARED_BLOCK, "request 'A': blocks [2]")


def test_densify_ignores_a_shared_block_it_does_not_touch():
    table, pool = build(10, evict=(5,), shared_prefix=1)  # block 0 shared and full; hole in block 1
    plan = plan_densify(snap_of(table, pool))
    assert plan.moves == (Move(9, 2, 1, 1, 1),)
    assert plan.src_blocks == ()  # n_live 9 still needs all three blocks
    assert plan.dense_write_pos == 9


def test_densify_with_only_trailing_dead_tokens_makes_no_moves_and_resets_the_cursor():
    table, pool = build(10, evict=(8, 9))
    plan = plan_densify(snap_of(table, pool))
    assert plan == Plan(PlanKind.DENSIFY, "A", (0, 10), (), (2,), (), 8)
    commit(table, pool, plan)
    assert table.block_ids("A") == [0, 1]
    assert table.write_pos("A") == 8
    assert table.attention_slots("A") == list(range(8))


def test_densify_resets_the_cursor_inside_the_last_block_without_freeing_it():
    table, pool = build(7, evict=(6,))
    plan = plan_densify(snap_of(table, pool))
    assert plan == Plan(PlanKind.DENSIFY, "A", (0, 7), (), (), (), 6)
    commit(table, pool, plan)
    assert table.block_ids("A") == [0, 1]
    assert table.write_pos("A") == 6
    assert table.sync_new_tokens("A", [], 8) == [6]  # the dead token's slot is written again


def test_densify_keeps_listed_blocks_past_the_written_ones():
    table, pool = d1(extra_blocks=1)  # block 3 listed, never written
    plan = plan_densify(snap_of(table, pool))
    assert plan.src_blocks == (2,)
    commit(table, pool, plan)
    assert table.block_ids("A") == [0, 1, 3]
    assert table.write_pos("A") == 8


def test_densify_of_a_fully_evicted_request_releases_every_written_block():
    table, pool = build(6, evict=range(6))
    plan = plan_densify(snap_of(table, pool))
    assert plan == Plan(PlanKind.DENSIFY, "A", (0, 6), (), (0, 1), (), 0)
    commit(table, pool, plan)
    assert table.block_ids("A") == []
    assert table.write_pos("A") == 0
    assert pool.num_free == 32


# ---- randomized: both planners preserve every live token ---------------------------------------


def random_system(seed):
    """A random request (maybe with a shared prefix) after random evictions. Deterministic in ``seed``."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 8])
    n_blocks = rng.randint(1, 8)
    total = rng.randint((n_blocks - 1) * bs + 1, n_blocks * bs)
    shared = rng.choice([0, 0, 1, 2]) if n_blocks > 2 else 0
    extra = rng.choice([0, 0, 0, 1])
    p = rng.random()
    table, pool = build(total, extra_blocks=extra, num_blocks=40, block_size=bs, shared_prefix=shared)
    for t in range(total):
        if rng.random() < p:
            table.evict_token("A", t)
    return table, pool, rng.randint(1, 6)


def settle_and_check(table, pool, plan, seed):
    """Commit ``plan`` while tracking K/V content per slot; every live token must read itself afterwards."""
    bs = table.block_size
    content = {}
    for r in table.request_ids():
        for t in table.live_token_ids(r):
            content[table.slot_of(r, t)] = t  # B's prefix tokens carry the same ids as A's
    before = {t: table.slot_of("A", t) for t in table.live_token_ids("A")}
    b_state = [table.slot_of("B", t) for t in table.live_token_ids("B")] if "B" in table else []
    n_blocks_before = len(table.block_ids("A"))

    copied = [content[m.src_block * bs + m.src_offset] for m in plan.moves]  # the copy reads all sources first
    for m, v in zip(plan.moves, copied):
        content[m.dst_block * bs + m.dst_offset] = v
    commit(table, pool, plan)

    moved = {m.token_id: m.dst_block * bs + m.dst_offset for m in plan.moves}
    after = {t: table.slot_of("A", t) for t in table.live_token_ids("A")}
    assert after == {**before, **moved}, f"seed {seed}: token -> slot map inconsistent with the moves"
    assert all(content[s] == t for t, s in after.items()), f"seed {seed}: a live token reads another's K/V"
    if "B" in table:
        assert [table.slot_of("B", t) for t in table.live_token_ids("B")] == b_state, f"seed {seed}: B changed"
    assert len(table.block_ids("A")) == n_blocks_before - plan.blocks_saved, f"seed {seed}"
    assert not set(plan.src_blocks) & set(table.block_ids("A")), f"seed {seed}: a source stayed listed"
    pool.check()
    holders = {}
    for r in table.request_ids():
        for s in table.attention_slots(r):
            holders[s] = holders.get(s, 0) + 1
    check_occupancy(table.occupancy, holders)
    return n_blocks_before


SEEDS = range(200)


def test_random_compact_plans_preserve_tokens_and_strictly_shrink_the_block_list():
    made = 0
    for seed in SEEDS:
        table, pool, max_sources = random_system(seed)
        snap = snap_of(table, pool)
        choice = choose_sources(snap, max_sources, pool.num_free)
        if not choice:
            assert choice.reason in (NoPlanReason.NO_CANDIDATES, NoPlanReason.NO_STRICT_DECREASE), f"seed {seed}"
            continue
        dsts = pool.allocate(choice.num_dst, Purpose.EVACUATION)
        plan = plan_compaction(snap, dsts, max_sources)
        assert plan.dst_blocks == tuple(dsts), f"seed {seed}"
        assert len(plan.src_blocks) <= max_sources, f"seed {seed}"
        assert not set(plan.src_blocks) & snap.shared_blocks, f"seed {seed}: a shared block is a source"
        assert len(plan.dst_blocks) < len(plan.src_blocks), f"seed {seed}: no strict decrease"
        n_before = settle_and_check(table, pool, plan, seed)
        assert len(table.block_ids("A")) < n_before, f"seed {seed}: compact did not shrink the block list"
        made += 1
    assert made >= 50  # the generator must actually exercise the planner


def test_random_densify_plans_preserve_tokens_and_end_dense():
    made = 0
    for seed in SEEDS:
        table, pool, _ = random_system(seed)
        snap = snap_of(table, pool)
        plan = plan_densify(snap)
        if not plan:
            assert plan.reason in (NoPlanReason.ALREADY_DENSE, NoPlanReason.SHARED_BLOCK), f"seed {seed}"
            if plan.reason is NoPlanReason.ALREADY_DENSE:
                assert sorted(live_positions(table)) == list(range(snap.num_live)), f"seed {seed}"
            continue
        srcs = {(m.src_block, m.src_offset) for m in plan.moves}
        assert not srcs & {(m.dst_block, m.dst_offset) for m in plan.moves}, f"seed {seed}: moves chain"
        settle_and_check(table, pool, plan, seed)
        assert sorted(live_positions(table)) == list(range(snap.num_live)), f"seed {seed}: not dense"
        assert table.write_pos("A") == snap.num_live, f"seed {seed}"
        assert plan_densify(snap_of(table, pool)).reason is NoPlanReason.ALREADY_DENSE, f"seed {seed}"
        made += 1
    assert made >= 50


# ---- added after mutation testing: each closes a surviving mutant (docs/fuzzing.md) ----------------
def test_densify_refuses_a_shared_trailing_block_even_with_nothing_to_move():
    table, pool = build(12, evict=(8, 9, 10, 11))  # block 2 is dead and trailing
    pool.share(2)
    plan = plan_densify(snap_of(table, pool))
    assert isinstance(plan, NoPlan) and plan.reason is NoPlanReason.SHARED_BLOCK, plan


def test_densify_refuses_to_move_a_token_out_of_a_shared_block():
    table, pool = build(12, evict=(0, 1, 2))  # n_live 9: token 9 at position 9 (block 2) must move down
    pool.share(2)  # block 2 keeps positions 8..11: not a source, but holds a mover
    snap = snap_of(table, pool)
    assert 2 in snap.shared_blocks
    plan = plan_densify(snap)
    assert isinstance(plan, NoPlan) and plan.reason is NoPlanReason.SHARED_BLOCK, plan
