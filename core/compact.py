"""The ``compact`` planner: the paper's Stage 3 lazy block packing.

Pick up to B low-utilization source blocks, and plan only if their T_live live
tokens fit into ceil(T_live / S) fresh destination blocks, strictly fewer than
the sources. Destinations are filled one after another, tokens in logical
order. Pure functions of a snapshot, so z3 and CrossHair can reason about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .plan import NoPlan, NoPlanReason, Plan, PlanKind
from .token_table import Move, RequestSnapshot


@dataclass(frozen=True)
class SourceChoice:
    src_blocks: tuple[int, ...]  # in block-list order
    num_live: int  # T_live
    num_dst: int  # ceil(T_live / S)


def eligible_sources(snap: RequestSnapshot) -> list[int]:
    """Indices of blocks that may be compacted, lowest utilization first.

    Eligible: wholly before the append cursor's block (appends never land in
    them), not shared (ref count 1), and not full.

    post:
        # exactly the eligible indices, each once, in ascending live count
        sorted(__return__) == [i for i in range(min(len(snap.blocks), snap.write_pos // snap.block_size)) if snap.blocks[i] not in snap.shared_blocks and snap.live_count(i) < snap.block_size] and [snap.live_count(i) for i in __return__] == sorted(snap.live_count(i) for i in __return__)
    """
    S = snap.block_size
    cursor_block = snap.write_pos // S
    idx = [
        i for i in range(min(cursor_block, len(snap.blocks)))
        if snap.blocks[i] not in snap.shared_blocks and snap.live_count(i) < S
    ]
    return sorted(idx, key=lambda i: (snap.live_count(i), i))


def choose_sources(snap: RequestSnapshot, max_sources: int, dst_budget: int) -> SourceChoice | NoPlan:
    """Stage 3's admission gate: the sources to pack and how many destinations they need.

    pre: max_sources >= 1 and dst_budget >= 0
    post:
        # 1..max_sources sources, in block-list order, none shared, none at or after the append block
        not __return__ or (0 < len(__return__.src_blocks) <= max_sources and list(__return__.src_blocks) == [b for b in snap.blocks if b in __return__.src_blocks] and all(b not in snap.shared_blocks and snap.blocks.index(b) < snap.write_pos // snap.block_size for b in __return__.src_blocks))
        # strict decrease within budget: their T_live live tokens need ceil(T_live / S) destinations, fewer than the sources
        not __return__ or (__return__.num_live == sum(snap.live_count(snap.blocks.index(b)) for b in __return__.src_blocks) and __return__.num_live <= __return__.num_dst * snap.block_size < __return__.num_live + snap.block_size and __return__.num_dst < len(__return__.src_blocks) and __return__.num_dst <= dst_budget)
    """
    assert max_sources >= 1 and dst_budget >= 0
    S = snap.block_size
    chosen = eligible_sources(snap)[:max_sources]
    if not chosen:
        return NoPlan(NoPlanReason.NO_CANDIDATES, f"request {snap.req_id!r}")
    live = sum(snap.live_count(i) for i in chosen)
    # shrink the candidate set (fullest first) until its destinations fit the budget
    while chosen and -(-live // S) > dst_budget:
        live -= snap.live_count(chosen.pop())
    if not chosen:
        return NoPlan(NoPlanReason.NOT_ENOUGH_HEADROOM, f"request {snap.req_id!r}: budget {dst_budget}")
    num_dst = -(-live // S)
    if num_dst >= len(chosen):
        return NoPlan(
            NoPlanReason.NO_STRICT_DECREASE,
            f"request {snap.req_id!r}: {live} live tokens in {len(chosen)} blocks need {num_dst}",
        )
    return SourceChoice(tuple(snap.blocks[i] for i in sorted(chosen)), live, num_dst)


def plan_compaction(snap: RequestSnapshot, dst_blocks: Sequence[int], max_sources: int) -> Plan | NoPlan:
    """A compact plan using a prefix of ``dst_blocks`` (fresh blocks the caller reserved).

    pre: max_sources >= 1
    pre: all(b not in snap.blocks and b not in dst_blocks[:i] for i, b in enumerate(dst_blocks))  # distinct, fresh
    post:
        # every live token of the sources moves once, in logical order, to consecutive slots of the destinations
        not __return__ or ([m.token_id for m in __return__.moves] == [t for t, s in snap.live_slots() if s // snap.block_size in __return__.src_blocks] and [(m.dst_block, m.dst_offset) for m in __return__.moves] == [(__return__.dst_blocks[i // snap.block_size], i % snap.block_size) for i in range(len(__return__.moves))] and __return__.blocks_saved > 0)
    """
    choice = choose_sources(snap, max_sources, len(dst_blocks))
    if not choice:
        return choice
    S = snap.block_size
    sources = set(choice.src_blocks)
    tokens = [(t, s) for t, s in snap.live_slots() if s // S in sources]
    assert len(tokens) == choice.num_live
    dsts = tuple(dst_blocks[: choice.num_dst])
    assert not sources & set(dsts) and not set(dsts) & set(snap.blocks), "destinations must be fresh"
    moves = tuple(
        Move(t, s // S, s % S, dsts[i // S], i % S) for i, (t, s) in enumerate(tokens)
    )
    return Plan(PlanKind.COMPACT, snap.req_id, snap.version, moves, choice.src_blocks, dsts)
