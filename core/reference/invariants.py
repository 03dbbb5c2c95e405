"""Executable invariants, one checker per invariant (docs/spec.md is the reference).

Each checker takes the whole system (anything with ``pool``, ``table``,
``manager`` and ``engine`` attributes, e.g. ``VTokenRuntime``), recomputes what
it needs from first principles, and raises ``InvariantViolation`` naming the
request, token, block and slot at fault. They are slow on purpose (full
scans); call them from tests, the simulator and the fuzzer, not the hot path.

  I1  token conservation       live tokens read back their own content
  I2  unique mapping           one slot per live token, none shared within a
                               request, occupancy and ref counts consistent
  I3  pre-attention visibility no attention slot is written by an unordered copy
  I4  plan validity            in-flight plans match a consistent layout
  I5  source safety            blocks a pending copy reads stay allocated and held
  I6  destination safety       blocks a pending copy writes stay allocated and held
  I7  dense prefix             on the dense path, live tokens fill [0, n_live)
  P1-P3 pool                   see block_pool.py; P3: headroom is borrowed only by evacuation
  V1  maintained views         the token table's live index equals a recount of its slot arrays
                               (checked with I2, request by request: ``views.check_views``)
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from ..copy_engine import CopyStatus
from ..errors import InvariantViolation
from ..plan import PlanKind
from ..reclamation import PlanState
from .views import check_occupancy, check_views


def _where(S: int, slot: int) -> str:
    return f"slot {slot} (block {slot // S}, offset {slot % S})"


def _move_blocks(rec) -> tuple[set[int], set[int]]:
    """Blocks a plan's copy reads and writes."""
    reads = {m.src_block for m in rec.plan.moves}
    writes = {m.dst_block for m in rec.plan.moves} | set(rec.plan.dst_blocks)
    return reads, writes


def next_read_view(sys) -> Callable[[int], int]:
    """slot -> the tag the next attention read sees there: ordered copies applied in stream order."""
    store, S = sys.engine.store, sys.pool.block_size
    view: dict[int, int] = {}
    for h in sys.engine.pending():
        if sys.engine.poll(h) is CopyStatus.ORDERED:
            moves = sys.engine.moves_of(h)
            vals = [view.get(m.src_block * S + m.src_offset, store.read(m.src_block * S + m.src_offset)) for m in moves]
            for m, v in zip(moves, vals):
                view[m.dst_block * S + m.dst_offset] = v
    return lambda slot: view.get(slot, store.read(slot))


def check_i1_token_conservation(sys, expected_tag: Callable[[object, int], int]) -> None:
    """Every live token's slot holds its own content tag, as the next read would see it."""
    read, S = next_read_view(sys), sys.pool.block_size
    for r in sys.table.request_ids():
        for t, slot in sys.table.live_slots(r):
            got, want = read(slot), expected_tag(r, t)
            if got != want:
                raise InvariantViolation(
                    "I1", f"request {r!r} token {t} at {_where(S, slot)} reads content {got}, expected {want}"
                )


def check_i2_unique_mapping(sys) -> None:
    pool, table, S = sys.pool, sys.table, sys.pool.block_size
    holders: Counter = Counter()
    refs: Counter = Counter()
    per_request: list[tuple[object, list[int], Counter]] = []
    for r in table.request_ids():
        blocks = table.block_ids(r)
        index = {b: i for i, b in enumerate(blocks)}
        if len(index) != len(blocks):
            raise InvariantViolation("I2", f"request {r!r} lists a block twice: {blocks}")
        refs.update(blocks)
        seen: dict[int, int] = {}
        counts: Counter = Counter()
        live = table.live_slots(r)
        cursor = table.write_pos(r)
        for t, slot in live:
            if slot // S not in index:
                raise InvariantViolation("I2", f"request {r!r} token {t} maps to {slot}, outside its blocks {blocks}")
            if slot in seen:
                raise InvariantViolation(
                    "I2", f"request {r!r}: tokens {seen[slot]} and {t} both claim {_where(S, slot)}"
                )
            if index[slot // S] * S + slot % S >= cursor:
                raise InvariantViolation(
                    "I2", f"request {r!r} token {t} at {_where(S, slot)} lies at or after the append cursor {cursor}"
                )
            seen[slot] = t
            counts[slot // S] += 1
            holders[slot] += 1
        if table.num_live(r) != len(live):
            raise InvariantViolation("I2", f"request {r!r}: num_live {table.num_live(r)} != {len(live)} live tokens")
        per_request.append((r, blocks, counts))
    # NOTE: the occupancy first: a private block's live count is read off it (token_table's T1 note)
    check_occupancy(table.occupancy, dict(holders))
    for r, blocks, counts in per_request:
        recorded = table.block_live_counts(r)
        for b in blocks:
            if recorded.get(b, 0) != counts[b]:
                raise InvariantViolation(
                    "I2", f"request {r!r} block {b}: live count {recorded.get(b, 0)} recorded, {counts[b]} found"
                )
        check_views(table, r)  # V1, once the table's own counts are known to be right
    recs = list(sys.manager.inflight.values())
    for rec in recs:
        if rec.state in (PlanState.PLANNED, PlanState.COPYING):
            refs.update(rec.plan.dst_blocks)
    for rec in sys.manager.orphans:
        refs.update(rec.held)
    pool.check()
    for b in range(pool.num_blocks):
        if pool.ref_count(b) != refs[b]:
            raise InvariantViolation(
                "I2", f"block {b} has ref count {pool.ref_count(b)} but {refs[b]} holder(s) "
                f"(request block lists, plan destinations, blocks held for pending copies)"
            )


def check_i3_visibility(sys) -> None:
    """No attention slot is the destination of a copy that is neither done nor ordered before compute."""
    S = sys.pool.block_size
    unsafe: dict[int, int] = {}
    for h in sys.engine.pending():
        if sys.engine.poll(h) is CopyStatus.PENDING:
            for m in sys.engine.moves_of(h):
                unsafe[m.dst_block * S + m.dst_offset] = h
    if not unsafe:
        return
    for r in sys.table.request_ids():
        for t, slot in sys.table.live_slots(r):
            if slot in unsafe:
                raise InvariantViolation(
                    "I3", f"request {r!r} token {t} is read at {_where(S, slot)}, which pending copy "
                    f"{unsafe[slot]} may still write"
                )


def check_i4_plan_validity(sys) -> None:
    pool, table, S = sys.pool, sys.table, sys.pool.block_size
    listed = {b for r in table.request_ids() for b in table.block_ids(r)}
    for req, rec in sys.manager.inflight.items():
        p = rec.plan
        if p.req_id != req or req not in table:
            raise InvariantViolation("I4", f"plan for {p.req_id!r} filed under {req!r} (present: {req in table})")
        if table.layout_version(req) != p.version[0]:
            raise InvariantViolation(
                "I4", f"request {req!r}: layout changed (version {table.layout_version(req)}) under its "
                f"in-flight plan (version {p.version[0]})"
            )
        blocks = table.block_ids(req)
        for b in p.src_blocks:
            if b not in blocks:
                raise InvariantViolation("I4", f"request {req!r}: plan source block {b} not in its block list")
        reads, writes = _move_blocks(rec)
        for b in set(p.src_blocks) | reads | writes:
            if pool.ref_count(b) > 1:
                raise InvariantViolation("I4", f"request {req!r}: plan touches shared block {b} (ref {pool.ref_count(b)})")
        dsts = [(m.dst_block, m.dst_offset) for m in p.moves]
        if len(set(dsts)) != len(dsts):
            raise InvariantViolation("I4", f"request {req!r}: two moves share a destination")
        if p.kind in (PlanKind.COMPACT, PlanKind.RELEASE):  # a release: a compact with no destination
            if len(p.dst_blocks) >= len(p.src_blocks):
                raise InvariantViolation(
                    "I4", f"request {req!r}: compact plan uses {len(p.dst_blocks)} blocks to free {len(p.src_blocks)}"
                )
            cursor_block = table.write_pos(req) // S
            for b in p.src_blocks:
                if blocks.index(b) >= cursor_block:
                    raise InvariantViolation("I4", f"request {req!r}: source block {b} is at or after the append block")
        if p.kind is PlanKind.RELOCATE:
            [src], [dst] = p.src_blocks, p.dst_blocks  # one block into one (unpacking raises for a malformed plan)
            if any((m.src_block, m.dst_block, m.dst_offset) != (src, dst, m.src_offset) for m in p.moves):
                raise InvariantViolation("I4", f"request {req!r}: relocate plan moves outside block {src} -> {dst} "
                                               f"or changes an offset")
        for b in p.dst_blocks:
            if b in listed:
                raise InvariantViolation("I4", f"request {req!r}: destination block {b} is in a block list before commit")
        for m in p.moves:
            if table.is_live(req, m.token_id) and table.slot_of(req, m.token_id) != m.src_block * S + m.src_offset:
                raise InvariantViolation(
                    "I4", f"request {req!r}: move of token {m.token_id} reads ({m.src_block}, {m.src_offset}) "
                    f"but the token lives at {_where(S, table.slot_of(req, m.token_id))}"
                )


def _pending_records(sys):
    return sys.manager.pending_copies()


def check_i5_source_safety(sys) -> None:
    for rec in _pending_records(sys):
        reads, _ = _move_blocks(rec)
        req = rec.plan.req_id
        owner = set(sys.table.block_ids(req)) if req in sys.table and rec.state is PlanState.COPYING else set(rec.held)
        for b in reads:
            if sys.pool.ref_count(b) == 0 or b not in owner:
                raise InvariantViolation(
                    "I5", f"block {b} is read by the pending copy of {req!r}'s plan but was released "
                    f"(ref {sys.pool.ref_count(b)}, held: {b in owner})"
                )


def check_i6_destination_safety(sys) -> None:
    table = sys.table
    for rec in _pending_records(sys):
        _, writes = _move_blocks(rec)
        req = rec.plan.req_id
        live_req = req in table and rec.state is PlanState.COPYING
        own = set(table.block_ids(req)) if live_req else set()
        for b in writes:
            held = b in rec.plan.dst_blocks and live_req or b in own or b in rec.held
            if sys.pool.ref_count(b) == 0 or not held:
                raise InvariantViolation(
                    "I6", f"block {b} may still be written by the pending copy of {req!r}'s plan but was "
                    f"released (ref {sys.pool.ref_count(b)})"
                )
        for other in table.request_ids():
            if other != req and set(table.block_ids(other)) & (writes - own):
                raise InvariantViolation("I6", f"request {other!r} holds a block the pending copy of {req!r} writes")


def check_i7_dense_prefix(sys) -> None:
    """Requests with no plan in flight keep live tokens exactly at positions [0, n_live)."""
    table, S = sys.table, sys.pool.block_size
    for r in table.request_ids():
        if r in sys.manager.inflight:
            continue
        blocks = table.block_ids(r)
        index = {b: i for i, b in enumerate(blocks)}
        positions = sorted(index[s // S] * S + s % S for s in table.attention_slots(r))
        if positions != list(range(len(positions))) or table.write_pos(r) != len(positions):
            hole = next((i for i, p in enumerate(positions) if p != i), len(positions))
            raise InvariantViolation(
                "I7", f"request {r!r}: {len(positions)} live tokens are not dense; first gap at position "
                f"{hole}, cursor {table.write_pos(r)}"
            )


def check_p3_headroom(sys) -> None:
    pool = sys.pool
    if pool.num_free < pool.headroom and not sys.manager.inflight and not sys.manager.orphans:
        raise InvariantViolation(
            "P3", f"{pool.num_free} free blocks, below the headroom {pool.headroom}, with no evacuation outstanding"
        )


def check_all(sys, expected_tag: Callable[[object, int], int] | None = None, dense: bool = False) -> int:
    """Run every checker; returns how many ran."""
    checks = [check_i2_unique_mapping, check_i3_visibility, check_i4_plan_validity,
              check_i5_source_safety, check_i6_destination_safety, check_p3_headroom]
    for c in checks:
        c(sys)
    n = len(checks)
    if expected_tag is not None:
        check_i1_token_conservation(sys, expected_tag)
        n += 1
    if dense:
        check_i7_dense_prefix(sys)
        n += 1
    return n
