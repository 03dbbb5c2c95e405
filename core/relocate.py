"""The ``relocate`` planner: move one block's live tokens to a fresh block, at the same offsets.

It frees nothing (one source, one destination), so no reclaimer uses it: it is the relocation drill's
plan (``SchedulerTokens``, ``drill_every``), which exercises the copy path on live traffic without
evicting. Being a ``Plan`` it goes through the reclamation manager like compact and densify: the
one-plan-per-request rule (I4), the executed launch and commit checks and the lifecycle (I3, I5, I6)
cover it. The block may be the append cursor's: same offsets keep every position where it was.
"""

from __future__ import annotations

from .plan import NoPlan, NoPlanReason, Plan, PlanKind
from .token_table import Move, RequestSnapshot


def plan_relocation(snap: RequestSnapshot, index: int, dst_block: int) -> Plan | NoPlan:
    """A plan moving the live tokens of ``snap.blocks[index]`` into ``dst_block`` (fresh, reserved by the
    caller), each at its own offset; ``NoPlan`` (SHARED_BLOCK) if another request holds the block.

    pre: 0 <= index < len(snap.blocks) and dst_block not in snap.blocks
    post: not __return__ or __return__.src_blocks == (snap.blocks[index],) and __return__.dst_blocks == (dst_block,)
    post: not __return__ or [(m.token_id, m.src_offset) for m in __return__.moves] == [(t, s % snap.block_size) for t, s in snap.live_slots() if s // snap.block_size == snap.blocks[index]]
    post: not __return__ or all(m.dst_block == dst_block and m.dst_offset == m.src_offset for m in __return__.moves)
    """
    src, S = snap.blocks[index], snap.block_size
    if src in snap.shared_blocks:
        return NoPlan(NoPlanReason.SHARED_BLOCK, f"request {snap.req_id!r}: block {src}")
    moves = tuple(Move(t, src, s % S, dst_block, s % S) for t, s in snap.live_slots() if s // S == src)
    return Plan(PlanKind.RELOCATE, snap.req_id, snap.version, moves, (src,), (dst_block,))
