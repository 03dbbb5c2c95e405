"""The ``compact`` planner: the paper's Stage 3 lazy block packing.

Pick up to B low-utilization source blocks, and plan only if their T_live live
tokens fit into ceil(T_live / S) fresh destination blocks, strictly fewer than
the sources. Destinations are filled one after another, tokens in logical
order. Pure functions of a snapshot, so z3 and CrossHair can reason about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# NOTE: ``contracts`` in the docstring contracts is core/reference/contracts.py: spec/crosshair_check.py binds it
# here for CrossHair; the runtime never imports an oracle (core/reference/__init__.py)
from .checks import check_int, is_int
from .errors import DestinationError, InvariantViolation
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
    them), not in ``snap.shared_blocks``, and not full. The manager lists there
    every block another request holds (ref count > 1) or may map through a
    prefix cache (``BlockAllocator.is_cached``).

    post: contracts.eligible_in_ascending_live_count(snap, __return__)
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
    post: not __return__ or contracts.sources_private_before_the_cursor(snap, __return__, max_sources)
    post: not __return__ or contracts.strict_decrease_within_budget(snap, __return__, dst_budget)
    raises: InvalidArgumentError
    """
    # raised, not asserted: an assert is an empty message and vanishes under python -O
    check_int("max_sources", max_sources, 1, hint=f" (source blocks per plan of request {snap.req_id!r})")
    check_int("dst_budget", dst_budget, 0, hint=f" (destination blocks for request {snap.req_id!r})")
    ranked = [(i, snap.live_count(i)) for i in eligible_sources(snap)[:max_sources]]
    return choose_ranked(snap.req_id, ranked, snap.blocks.__getitem__, snap.block_size, dst_budget)


def choose_ranked(req_id: object, ranked: list[tuple[int, int]], block_at, block_size: int,
                  dst_budget: int) -> SourceChoice | NoPlan:
    """``choose_sources`` from its candidates: ``ranked`` is (index, live count) of the first eligible sources,
    lowest count first (``eligible_sources`` on a snapshot, or ``TokenTable.compact_candidates``), and
    ``block_at(index)`` the block at an index. The one implementation of the gate, for both."""
    S = block_size
    chosen = list(ranked)
    if not chosen:
        return NoPlan(NoPlanReason.NO_CANDIDATES, f"request {req_id!r}")
    live = sum(n for _, n in chosen)
    # shrink the candidate set (fullest first) until its destinations fit the budget
    while chosen and -(-live // S) > dst_budget:
        live -= chosen.pop()[1]
    if not chosen:
        return NoPlan(NoPlanReason.NOT_ENOUGH_HEADROOM, f"request {req_id!r}: budget {dst_budget}")
    num_dst = -(-live // S)
    if num_dst >= len(chosen):
        return NoPlan(
            NoPlanReason.NO_STRICT_DECREASE,
            f"request {req_id!r}: {live} live tokens in {len(chosen)} blocks need {num_dst}",
        )
    return SourceChoice(tuple(block_at(i) for i in sorted(i for i, _ in chosen)), live, num_dst)


def plan_compaction(snap: RequestSnapshot, dst_blocks: Sequence[int], max_sources: int) -> Plan | NoPlan:
    """A compact plan using a prefix of ``dst_blocks`` (fresh blocks the caller reserved).

    pre: max_sources >= 1
    pre: all(b not in snap.blocks and b not in dst_blocks[:i] for i, b in enumerate(dst_blocks))  # distinct, fresh
    post: not __return__ or contracts.compact_fills_in_logical_order(snap, __return__)
    raises: DestinationError, InvalidArgumentError
    """
    for i, b in enumerate(dst_blocks):  # the precondition, raised: the caller's mistake, not a broken I4
        if not is_int(b) or b < 0 or b in dst_blocks[:i] or b in snap.blocks:
            raise DestinationError(f"request {snap.req_id!r}: destination block {b!r} is not a fresh block id "
                                   f"(an int >= 0, listed once, not in its block list {list(snap.blocks)})")
    choice = choose_sources(snap, max_sources, len(dst_blocks))
    if not choice:
        return choice
    S = snap.block_size
    sources = set(choice.src_blocks)
    tokens = [(t, s) for t, s in snap.live_slots() if s // S in sources]
    return compact_plan(snap.req_id, snap.version, S, choice, tokens, dst_blocks)


def compact_plan(req_id: object, version: tuple[int, int], block_size: int, choice: SourceChoice,
                 tokens: list[tuple[int, int]], dst_blocks: Sequence[int]) -> Plan:
    """The plan for ``choice``: its live ``tokens`` (token, slot), in logical order, fill the first
    ``choice.num_dst`` of ``dst_blocks`` one after another. The one implementation of the fill, for
    ``plan_compaction`` (tokens from a snapshot) and the manager's maintained path (``TokenTable.live_in_blocks``)."""
    S = block_size
    dsts = tuple(dst_blocks[: choice.num_dst])
    if len(tokens) != choice.num_live:
        raise InvariantViolation("I4", f"request {req_id!r}: compact would move {len(tokens)} of "
                                       f"{choice.num_live} live tokens into {dsts}, which must be fresh blocks")
    moves = tuple(
        Move(t, s // S, s % S, dsts[i // S], i % S) for i, (t, s) in enumerate(tokens)
    )
    return Plan(PlanKind.COMPACT, req_id, version, moves, choice.src_blocks, dsts)
