"""V1: the maintained views of the runtime against recounts from scratch.

The hot path reads structures it keeps up to date in O(what changed): the token table's live index
(live ids by rank), block index, append run, per-block live counts, pool-wide token map and masks, and
the pool-wide slot occupancy. Each checker here recomputes one of them from the table's slot arrays,
the reference, and raises ``InvariantViolation`` naming where they differ. They read the structures'
private fields (that is what they check) and change nothing. ``invariants.check_i2_unique_mapping``
runs them, so they run after every fuzzer rule and every checked simulator step.
"""

from __future__ import annotations

from array import array

from ..errors import InvariantViolation
from ..live_index import CHUNK, NO_SLOT, LiveIndex
from ..occupancy import SlotOccupancy
from ..token_table import TokenTable


def check_views(table: TokenTable, req_id: object) -> None:
    """The oracle of the maintained views (V1): the live index against a recount of the slot array, and
    ranked reads through it against ``live_token_ids``, the scan; the block index and the append run; and
    (T1) each block's mask against the offsets its live tokens give. Raises InvariantViolation; O(L)."""
    r, where = table._get(req_id), f"request {req_id!r}"
    check_live_index(r.live, r.slots, where)
    want = table.live_token_ids(req_id)
    view = table.live_tokens(req_id)
    if len(view) != len(want) or list(view) != want:
        raise InvariantViolation("V1", f"{where}: the live index reads {view!r}, the slot array {want[:8]}...")
    for k in {k for k in (len(want) // 3, len(want) // 2, len(want) - 2) if k >= 0 and want}:  # from inside chunks
        got = list(view[k:k + CHUNK + 1])
        if view[k] != want[k] or got != want[k:k + CHUNK + 1]:
            raise InvariantViolation("V1", f"{where}: from live rank {k} the live index reads {view[k]}, "
                                     f"{got[:8]}..., the slot array {want[k:k + 8]}...")
    S = table.block_size
    # NOTE: what the lookups rely on: unless a splice or removal marked the list stale, a private block's
    # recorded index is exact (``_in_list`` answers False on a miss without searching). Read, not repaired.
    for i, b in enumerate(r.blocks):
        if table._listed[b] == 1 and not r.index_stale and table._index_of[b] != i:
            raise InvariantViolation("V1", f"{where}: block {b} is at index {i} of its list, the index "
                                     f"records {table._index_of[b]}")
    if not 0 <= r.run_pos <= r.write_pos or r.run_token + r.write_pos - r.run_pos != r.total_len:
        raise InvariantViolation("V1", f"{where}: the append run from position {r.run_pos} (token "
                                 f"{r.run_token}) does not end at the cursor {r.write_pos} and token {r.total_len}")
    for p in range(r.run_pos, r.write_pos):
        t = r.run_token + p - r.run_pos
        if r.slots[t] not in (NO_SLOT, r.blocks[p // S] * S + p % S):
            raise InvariantViolation("V1", f"{where}: the append run puts token {t} at position {p}, the "
                                     f"table has it at slot {r.slots[t]}")
    if len(r.counts) != len(r.blocks) or any(r.counts[i] != table._live_in(r, b) for i, b in enumerate(r.blocks)):
        i = next((i for i, b in enumerate(r.blocks)
                  if i >= len(r.counts) or r.counts[i] != table._live_in(r, b)), len(r.blocks))
        raise InvariantViolation("V1", f"{where}: the per-block counts record "
                                 f"{r.counts[i] if i < len(r.counts) else None} live tokens at index {i}, its masks "
                                 f"{table._live_in(r, r.blocks[i]) if i < len(r.blocks) else None}")
    for t, s in enumerate(r.slots):
        if s != NO_SLOT and s // S not in r.shared and table._token_at[s] != t:
            raise InvariantViolation("V1", f"{where}: the token map has token {table._token_at[s]} at slot {s}, "
                                     f"the slot array token {t}")
    want_shared = {b for b in r.blocks if table._listed[b] > 1}
    if set(r.shared) != want_shared:
        raise InvariantViolation("T1", f"{where}: masks are kept for blocks {sorted(r.shared)}, its blocks "
                                 f"others list too are {sorted(want_shared)}")
    masks: dict[int, int] = {}
    for s in r.slots:
        if s != NO_SLOT:
            masks[s // S] = masks.get(s // S, 0) | 1 << s % S
    for b in r.blocks:
        if table._mask(r, b) != masks.get(b, 0):
            raise InvariantViolation("T1", f"{where} block {b}: mask {table._mask(r, b):#b} recorded, its live "
                                     f"tokens give {masks.get(b, 0):#b}")
    for k in range(0, len(want), max(1, len(want) // 64)):
        if view[k] != want[k] or list(view[k:k + 3]) != want[k:k + 3]:
            raise InvariantViolation("V1", f"{where}: live rank {k} reads token {view[k]}, the slot array "
                                     f"{want[k]}")


def check_live_index(index: LiveIndex, slots: array, where: str) -> None:
    """Recount the index's ``counts`` and ``tree`` from the slot array (the reference) and compare (V1)."""
    n = len(slots)
    want = [0] * -(-n // CHUNK)
    for t, s in enumerate(slots):
        if s != NO_SLOT:
            want[t // CHUNK] += 1
    if list(index.counts) != want:
        c = next((c for c, (a, b) in enumerate(zip(index.counts, want)) if a != b), min(len(want), len(index.counts)))
        got = index.counts[c] if c < len(index.counts) else None
        raise InvariantViolation("V1", f"{where}: live index chunk {c} (ids [{c * CHUNK}, {(c + 1) * CHUNK})) "
                                 f"counts {got} live tokens, the slot array {want[c] if c < len(want) else None} "
                                 f"({len(index.counts)} chunks for {n} tokens)")
    for i in range(1, len(index.tree)):
        if index.tree[i] != sum(want[i - (i & -i):i]):
            raise InvariantViolation("V1", f"{where}: live index tree node {i} sums {index.tree[i]}, its chunks "
                                     f"{sum(want[i - (i & -i):i]) }")


def check_occupancy(occupancy: SlotOccupancy, expected_holders: dict[int, int]) -> None:
    """``occupancy`` against holder counts recomputed from the request tables (I2, occupancy part).

    Every expected slot is compared; that all other slots hold 0 follows from
    counting zeros in C (``array.count``), so the cost is O(live slots).
    """
    S = occupancy.block_size
    per_block: dict[int, int] = {}
    for slot, want in expected_holders.items():
        h = occupancy._holders[slot]
        if h != want:
            raise InvariantViolation(
                "I2", f"slot {slot} (block {slot // S}, offset {slot % S}) has {h} holder(s) recorded, "
                f"{want} in the token tables"
            )
        per_block[slot // S] = per_block.get(slot // S, 0) + 1
    stray = len(occupancy._holders) - occupancy._holders.count(0) - len(expected_holders)
    if stray:
        slot = next(i for i, h in enumerate(occupancy._holders) if h and i not in expected_holders)
        raise InvariantViolation(
            "I2", f"slot {slot} (block {slot // S}, offset {slot % S}) has {occupancy._holders[slot]} holder(s) "
            f"recorded, 0 in the token tables"
        )
    for b, n in per_block.items():
        if occupancy._block_live[b] != n:
            raise InvariantViolation("I2", f"block {b} records {occupancy._block_live[b]} live slots, tables give {n}")
    if len(occupancy._block_live) - occupancy._block_live.count(0) != len(per_block):
        b = next(i for i, n in enumerate(occupancy._block_live) if n and i not in per_block)
        raise InvariantViolation("I2", f"block {b} records {occupancy._block_live[b]} live slots, tables give 0")
    if occupancy.live_slots != len(expected_holders):
        raise InvariantViolation("I2", f"live slot total {occupancy.live_slots} != {len(expected_holders)}")
