"""The ``densify`` planner, for attention kernels that read a dense prefix.

vLLM's stock kernels read keys at positions [0, seq_len) through the block
table. After eviction, densify moves the live tokens found at positions
>= n_live into the holes below n_live, so that live tokens occupy exactly
[0, n_live); the trailing blocks this empties are released and the append
cursor becomes n_live, so the appends that follow write the tail of the
block holding position n_live. Moves never chain: every destination is a
hole below n_live, every source a position at or above it. No shared block
is written: not as a destination, a source, a released block, nor as the
new cursor's block.
"""

from __future__ import annotations

from .plan import NoPlan, NoPlanReason, Plan, PlanKind
from .token_table import Move, RequestSnapshot


def plan_densify(snap: RequestSnapshot) -> Plan | NoPlan:
    """Moves that make the live tokens of ``snap`` fill positions [0, n_live), or why none are needed.

    post:
        # I7 after commit: moved tokens (from their current slot) and unmoved ones fill exactly [0, n_live)
        not __return__ or (all(dict(snap.live_slots())[m.token_id] == m.src_block * snap.block_size + m.src_offset for m in __return__.moves) and sorted([snap.blocks.index(s // snap.block_size) * snap.block_size + s % snap.block_size for t, s in snap.live_slots() if t not in {m.token_id for m in __return__.moves}] + [snap.blocks.index(m.dst_block) * snap.block_size + m.dst_offset for m in __return__.moves]) == list(range(snap.num_live)))
        # the cursor becomes n_live; released blocks lie wholly at or after it; no shared block is touched
        not __return__ or (__return__.dense_write_pos == snap.num_live and __return__.version == snap.version and all(snap.blocks.index(b) * snap.block_size >= snap.num_live for b in __return__.src_blocks) and not ({m.src_block for m in __return__.moves} | {m.dst_block for m in __return__.moves} | set(__return__.src_blocks) | ({snap.blocks[snap.num_live // snap.block_size]} if snap.num_live % snap.block_size else set())) & snap.shared_blocks)
    """
    S = snap.block_size
    n = snap.num_live
    index = {b: i for i, b in enumerate(snap.blocks)}
    occupied: set[int] = set()
    movers: list[tuple[int, int]] = []  # (token_id, slot), logical order
    for t, s in snap.live_slots():
        pos = index[s // S] * S + s % S
        occupied.add(pos)
        if pos >= n:
            movers.append((t, s))
    holes = [p for p in range(n) if p not in occupied]
    assert len(holes) == len(movers), "every live token above n_live has a hole below it"
    keep = -(-n // S)
    written = -(-snap.write_pos // S)
    src_blocks = tuple(snap.blocks[keep:written])
    if not movers and snap.write_pos == n:
        return NoPlan(NoPlanReason.ALREADY_DENSE, f"request {snap.req_id!r}")
    touched = {snap.blocks[p // S] for p in holes} | {s // S for _, s in movers} | set(src_blocks)
    if n % S and n // S < len(snap.blocks):
        # NOTE: the new cursor's block is written too: the next appends overwrite its tail [n, ...). A shared
        # block must never be written (another request reads it), so it is refused here like a destination.
        touched.add(snap.blocks[n // S])
    shared = sorted(touched & snap.shared_blocks)
    if shared:
        return NoPlan(NoPlanReason.SHARED_BLOCK, f"request {snap.req_id!r}: blocks {shared}")
    moves = tuple(
        Move(t, s // S, s % S, snap.blocks[p // S], p % S) for (t, s), p in zip(movers, holes)
    )
    return Plan(PlanKind.DENSIFY, snap.req_id, snap.version, moves, src_blocks, (), n)
