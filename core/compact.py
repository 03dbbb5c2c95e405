"""The ``compact`` planner: the paper's Stage 3 lazy block packing.

Pick up to B low-utilization source blocks, and plan only if their T_live live
tokens fit into ceil(T_live / S) fresh destination blocks, strictly fewer than
the sources. Destinations are filled one after another, tokens in logical
order. The runtime's part, pure functions: the gate (``choose_ranked``) and the
fill (``compact_plan``) of the manager's maintained path. The reference planner,
the same gate and fill on a full snapshot, is core/reference/compact.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import InvariantViolation
from .plan import NoPlan, NoPlanReason, Plan, PlanKind
from .token_table import Move


@dataclass(frozen=True)
class SourceChoice:
    src_blocks: tuple[int, ...]  # in block-list order
    num_live: int  # T_live
    num_dst: int  # ceil(T_live / S)


def choose_ranked(req_id: object, ranked: list[tuple[int, int]], block_at, block_size: int,
                  dst_budget: int) -> SourceChoice | NoPlan:
    """``choose_sources`` (core/reference/compact.py) from its candidates: ``ranked`` is (index, live count) of the
    first eligible sources, lowest count first (``eligible_sources`` on a snapshot, or
    ``TokenTable.compact_candidates``), and ``block_at(index)`` the block at an index. The one implementation of
    the gate, for both."""
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
    moves = tuple(Move(t, s // S, s % S, dsts[i // S], i % S) for i, (t, s) in enumerate(tokens))
    return Plan(PlanKind.COMPACT, req_id, version, moves, choice.src_blocks, dsts)
