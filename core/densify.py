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

from dataclasses import dataclass

# NOTE: ``contracts`` in the docstring contracts is core/reference/contracts.py: spec/crosshair_check.py binds it
# here for CrossHair; the runtime never imports an oracle (core/reference/__init__.py)
from .errors import InvariantViolation
from .plan import NoPlan, NoPlanReason, Plan, PlanKind
from .token_table import Move, RequestSnapshot


def plan_densify(snap: RequestSnapshot) -> Plan | NoPlan:
    """Moves that make the live tokens of ``snap`` fill positions [0, n_live), or why none are needed.

    post: not __return__ or contracts.densify_fills_the_prefix(snap, __return__)  # I7 after commit
    post: not __return__ or contracts.densify_frees_only_the_tail(snap, __return__)
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
    if len(holes) != len(movers):  # zip would drop movers: a live token would stay above n_live (I7)
        raise InvariantViolation("I7", f"request {snap.req_id!r}: {len(movers)} live tokens at or above n_live "
                                       f"{n}, {len(holes)} holes below it")
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
    moves = tuple(Move(t, s // S, s % S, snap.blocks[p // S], p % S) for (t, s), p in zip(movers, holes))
    return Plan(PlanKind.DENSIFY, snap.req_id, snap.version, moves, src_blocks, (), n)


@dataclass(frozen=True)
class DensifyTail:
    """What ``plan_densify_tail`` needs when one step's evictions are the only holes of a dense request,
    and the positions from n_live to the cursor lie in the append run (their tokens are known without a
    scan): O(evicted) data, where a ``RequestSnapshot`` is O(L)."""

    req_id: object
    version: tuple[int, int]
    block_size: int
    num_live: int  # n: the cursor after the commit
    write_pos: int
    holes: tuple[tuple[int, int], ...]  # (position, its block) of each evicted token below n, ascending
    movers: tuple[tuple[int, int], ...]  # (token, slot) of each live token at positions [n, write_pos), ascending
    src_blocks: tuple[int, ...]  # blocks [ceil(n / S), ceil(write_pos / S)) of the list
    cursor_block: int | None  # the block holding position n when n is inside a block (its tail is rewritten)
    shared_blocks: frozenset[int]  # of the blocks above, those with ref count > 1


def plan_densify_tail(tail: DensifyTail) -> Plan | NoPlan:
    """``plan_densify``'s answer for a request whose only holes are this step's evictions: the same moves
    (movers in logical order into holes in ascending position), the same released blocks and cursor, the
    same NoPlan reasons, in O(evicted). The reference is ``plan_densify`` on the full snapshot: with
    ``ReclamationManager.verify_fast_paths`` every plan made here is compared with it (V3)."""
    S, n = tail.block_size, tail.num_live
    if len(tail.holes) != len(tail.movers):
        raise InvariantViolation("I7", f"request {tail.req_id!r}: {len(tail.movers)} live tokens at or above n_live "
                                       f"{n}, {len(tail.holes)} holes below it")
    if not tail.movers and tail.write_pos == n:
        return NoPlan(NoPlanReason.ALREADY_DENSE, f"request {tail.req_id!r}")
    touched = {b for _, b in tail.holes} | {s // S for _, s in tail.movers} | set(tail.src_blocks)
    if tail.cursor_block is not None:
        touched.add(tail.cursor_block)  # NOTE: its tail [n, ...) is overwritten by the next appends
    shared = sorted(touched & tail.shared_blocks)
    if shared:
        return NoPlan(NoPlanReason.SHARED_BLOCK, f"request {tail.req_id!r}: blocks {shared}")
    moves = tuple(Move(t, s // S, s % S, b, p % S) for (t, s), (p, b) in zip(tail.movers, tail.holes))
    return Plan(PlanKind.DENSIFY, tail.req_id, tail.version, moves, tail.src_blocks, (), n)
