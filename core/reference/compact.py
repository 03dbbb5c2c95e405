"""The reference compact planner: Stage 3 on a full ``RequestSnapshot``, what the runtime's maintained path must equal.

The runtime plans compaction from the token table's maintained per-block counts and token map
(``ReclamationManager._plan_compact``: ``TokenTable.compact_candidates``, ``live_in_blocks``), through the gate and
the fill of core/compact.py (``choose_ranked``, ``compact_plan``). This is the same planner written as pure
functions of a snapshot, O(L): what the z3 planner proofs (spec/planner_model.py) and CrossHair's contracts are
about, and what V3 compares every maintained plan with (``ReclamationManager.verify_fast_paths``, on in the fuzzer
and the checked simulator). It shares the gate and the fill with the runtime, so the two differ only in how they
find the candidates and their tokens.
"""

from __future__ import annotations

from typing import Sequence

from ..checks import check_int, is_int
from ..compact import SourceChoice, choose_ranked, compact_plan
from ..errors import DestinationError
from ..plan import NoPlan, Plan
from ..token_table import RequestSnapshot
from . import contracts  # noqa: F401  (the docstring contracts call it)


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
