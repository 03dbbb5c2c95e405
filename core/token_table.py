"""The token table: logical token -> physical (block, offset), per request.

This is the paper's central structure (seed §3.2). Eviction policies talk to
it in logical token ids; it owns the mapping to physical slots
(``slot = block_id * block_size + offset``, Eq. 2) and keeps per-block live
counts so the reclamation backend never scans to find waste.

Storage is compact on purpose (≤ 12 bytes of metadata per token, see
tests/bench/bench_table_memory.py): one ``array('i')`` of slots per request, where a
dead token holds ``NO_SLOT``; a pool-wide ``SlotOccupancy``, whose occupied
slots of a block one request lists alone are that request's live offsets in it;
and, per request, a bitmask of its live offsets only for each block it shares
with another request (a prefix block), where the pool cannot tell holders apart.

Physical *position* p of a request means ``blocks[p // S] * S + p % S``: the
request's block list read as one long row, as vLLM's block table is. New tokens
are written sequentially at the append cursor ``write_pos``; relocation moves
tokens only to positions before it.

Invariants this module maintains (docs/spec.md):
  I2  a live token has exactly one slot; no slot is claimed twice by one
      request; a dead token claims nothing;
  T1  ``num_live`` equals the number of live tokens, and each block's mask
      (``block_mask``: the shared map's, or the pool's occupancy of a private
      block) has exactly the offsets of this request's live tokens in it; the
      shared map has an entry for exactly the listed blocks others list too;
  T2  no claimed slot lies at or after the append cursor.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

# NOTE: ``contracts`` in the docstring contracts is core/reference/contracts.py: spec/crosshair_check.py binds it
# here for CrossHair; the runtime never imports an oracle (core/reference/__init__.py)
from .checks import as_list, check_request_id, is_int, is_known_key
from .errors import (
    BlockListTooShortError,
    BlockNotOwnedError,
    BlockOutOfRangeError,
    ConfigError,
    DestinationError,
    DuplicateRequestError,
    InvariantViolation,
    MoveSourceMismatchError,
    TokenAlreadyEvictedError,
    TokenOutOfRangeError,
    UnknownRequestError,
    VTokenError,
)
from .live_index import NO_SLOT, LiveIndex, LiveTokens
from .occupancy import SlotOccupancy
_BYTE_ORDER = "little" if array("i", [1]).tobytes()[0] == 1 else "big"  # the arrays' (the machine's)


def _find_word(raw: bytes, value: int, start: int, end: int | None = None) -> int:
    """The first index i >= start (below ``end``) of a 4-byte array's raw bytes whose word is ``value``, or -1:
    a C search (``bytes.find``), skipping matches that straddle two words."""
    pattern = value.to_bytes(4, _BYTE_ORDER, signed=value < 0)
    at, stop = 4 * start, len(raw) if end is None else 4 * end
    while (at := raw.find(pattern, at, stop)) >= 0:
        if at % 4 == 0:
            return at // 4
        at += 1
    return -1
def _find_item(raw: bytes, value: int, start: int, size: int) -> int:
    """``_find_word`` for an unsigned array of ``size``-byte items: with one-byte items a plain ``bytes.find``."""
    if size == 1:
        return raw.find(value.to_bytes(1, _BYTE_ORDER), start)
    pattern, at = value.to_bytes(size, _BYTE_ORDER), size * start
    while (at := raw.find(pattern, at)) >= 0:
        if at % size == 0:
            return at // size
        at += 1
    return -1


def _find_all(raw: bytes, value: int, size: int):
    """Every index of ``value`` in ``raw`` (``_find_item``'s items), ascending."""
    i = _find_item(raw, value, 0, size)
    while i >= 0:
        yield i
        i = _find_item(raw, value, i + 1, size)


def _count_code(block_size: int) -> str:
    """The smallest unsigned array type that holds a block's live count (0 .. block_size)."""
    return "B" if block_size < 256 else "H" if block_size < 65536 else "I"


_MAX_SLOTS = 2**31 - 1  # slots are stored as C ints
CHANGE_LOG_LIMIT = 4096  # evictions (and moves) ``take_changes`` lists one by one; beyond, it says "rebuilt"


class Move(NamedTuple):
    """One token relocation, exactly the paper's tuple."""

    token_id: int
    src_block: int
    src_offset: int
    dst_block: int
    dst_offset: int


def _as_move(req_id: object, m: object) -> Move:
    """Shape only; each field's type and range is checked where it is used."""
    try:
        if isinstance(m, (str, bytes, dict)):
            raise TypeError
        return Move(*m)  # type: ignore[misc]
    except TypeError:
        raise MoveSourceMismatchError(
            f"request {req_id!r}: malformed move {m!r}; expected "
            f"(token_id, src_block, src_offset, dst_block, dst_offset)"
        ) from None


class Changes(NamedTuple):
    """``take_changes``' answer: how a request's read list changed between two takes."""

    version: int  # the layout version now
    since: int  # the layout version at the previous take (-1: none)
    rebuilt: bool
    evicted: tuple[int, ...]
    joined_from: int
    moved: tuple[int, ...]
    moved_slots: tuple[int, ...]


class RequestTokens:
    """One request's entries. Mutated only through ``TokenTable``, which validates first."""

    __slots__ = ("slots", "blocks", "counts", "shared", "index_stale", "write_pos", "num_live", "emptied", "layout_version", "last_sync_start", "live",
                 "evicted", "moved", "taken_version", "taken_len", "run_pos", "run_token")

    def __init__(self, count_code: str) -> None:
        self.slots = array("i")  # logical token id -> slot, NO_SLOT when dead
        self.blocks = array("i")  # block list; position p lives in blocks[p // S] (4 B a block, not a list's 36)
        # parallel to ``blocks``: each block's live tokens of this request, so compact's candidates are found by
        # a C search of these bytes (``compact_candidates``), not a Python scan of the block list. One byte a
        # block when S < 256 (``_count_code``): the search is then a memchr
        self.counts = array(count_code)
        # True once a splice or a removal shifted blocks without recording their new indices: the pool-wide block
        # index is then a hint for this request's blocks, checked on every read (``_index_listed``, ``_in_list``)
        self.index_stale = False
        # NOTE: a block listed by this request alone (private) has no mask here: its live offsets are the
        # pool's occupied slots of it (``SlotOccupancy.occupied_mask``), since only its one holder can hold a
        # slot of it. A block several requests list (a shared prefix block) keeps each holder's mask here, and
        # exactly those blocks have an entry (``_materialise`` / ``_reindex`` keep it so).
        self.shared: dict[int, int] = {}  # shared block -> bitmask of the offsets this request holds live
        self.write_pos = 0  # the append cursor (a position)
        self.num_live = 0
        self.emptied = 0  # blocks whose live count an eviction brought to 0, over the request's life
        self.layout_version = 0  # bumped by every relocation or block-list rewrite: a structural change
        self.last_sync_start = 0  # first token id of the latest sync_new_tokens
        self.live = LiveIndex()  # live ids by rank (maintained by sync_new_tokens and evict_tokens)
        # the change log ``take_changes`` hands out: ids evicted and ids moved since the last take (None: more than
        # the log keeps, read the whole list), and the layout version at that take
        self.evicted: array | None = array("i")  # 4 B an entry: a request nobody takes from keeps <= 16 KiB
        self.moved: array | None = array("i")  # NOTE: apply_moves is the only mutation that changes a live slot
        self.taken_version = -1  # never taken: the first take is a full list
        self.taken_len = 0  # the synced length at the last take
        # the append run: since the last layout change, position run_pos + i holds token run_token + i (if it
        # is live); appends extend it, a move or a block-list rewrite starts a new, empty one at the cursor
        self.run_pos = 0
        self.run_token = 0

    @property
    def total_len(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class RequestSnapshot:
    """A consistent, immutable copy of one request's layout, the only input of the planners (I4)."""

    req_id: object
    block_size: int
    blocks: tuple[int, ...]
    masks: tuple[int, ...]  # parallel to ``blocks``
    slots: bytes  # the slot array's raw bytes; decoded lazily by ``live_slots``
    write_pos: int
    num_live: int
    total_len: int
    layout_version: int
    shared_blocks: frozenset[int]  # blocks with ref count > 1 at snapshot time

    def live_slots(self) -> list[tuple[int, int]]:
        """(token_id, slot) for every live token, in logical order."""
        slots = array("i")
        slots.frombytes(self.slots)
        return [(t, s) for t, s in enumerate(slots) if s != NO_SLOT]

    def live_count(self, index: int) -> int:
        return self.masks[index].bit_count()

    @property
    def version(self) -> tuple[int, int]:
        return (self.layout_version, self.total_len)


class TokenTable:
    """All requests' token tables, plus the pool-wide slot occupancy they share.

    The three mutations are the paper's: ``sync_new_tokens``, ``evict_token``,
    ``apply_moves``. Block-list rewrites (``set_layout``) and request
    registration are used only by the runtime and the reclamation manager.
    Every mutation validates everything before changing anything.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if not (is_int(num_blocks) and is_int(block_size)) or num_blocks <= 0 or block_size <= 0:
            raise ConfigError(f"num_blocks and block_size must be positive ints, got {num_blocks!r}, {block_size!r}")
        if num_blocks * block_size > _MAX_SLOTS:
            raise ConfigError(f"{num_blocks} blocks x {block_size} slots exceeds {_MAX_SLOTS} slots")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._count_code = _count_code(block_size)
        self.occupancy = SlotOccupancy(num_blocks, block_size)
        self._requests: dict[object, RequestTokens] = {}
        # per block, how many requests' block lists hold it (more than one only for shared prefix blocks);
        # 2 bytes per block, pool-wide: who they are is found by a scan, only when the count is not 0
        self._listed = array("H", bytes(2 * num_blocks))
        # per block listed by exactly one request, its index in that request's list (4 bytes per block):
        # a slot's position in O(1); for a shared block the holder's list is searched (``position_of``)
        self._index_of = array("i", bytes(4 * num_blocks))
        # per slot of a block listed by one request, the token of that request it holds (4 bytes per slot; stale
        # where no live token is): a compaction source's tokens without a scan of the slot array. A shared
        # block's entries are not kept; they are rebuilt when it is private again (``_reindex``)
        self._token_at = array("i", bytes(4 * num_blocks * block_size))

    # ---- registration ------------------------------------------------------------
    def add_request(self, req_id: object) -> None:
        """Register an empty request. Its id must be hashable, and neither None nor a bool."""
        check_request_id(req_id)
        if req_id in self._requests:
            raise DuplicateRequestError(f"request {req_id!r} is already registered")
        self._requests[req_id] = RequestTokens(self._count_code)
        assert self._requests[req_id].total_len == 0

    def remove_request(self, req_id: object) -> list[int]:
        """Forget a request (finish or preemption); returns its block list for the caller to free."""
        r = self._get(req_id)
        for s in r.slots:
            if s != NO_SLOT:
                self.occupancy.release(s)
        for b in r.blocks:
            assert self._listed[b] >= 1, f"block {b} of request {req_id!r} is not counted as listed"
            self._listed[b] -= 1
        del self._requests[req_id]
        for b in r.blocks:
            self._reindex(b)
        assert req_id not in self._requests
        return list(r.blocks)

    def __contains__(self, req_id: object) -> bool:
        return is_known_key(self._requests, req_id)

    def owners(self, block_id: int) -> list[object]:
        """The requests whose block lists hold ``block_id`` (several only for a shared prefix block)."""
        self._check_block(block_id)
        return self._holders_of(block_id) if self._listed[block_id] else []

    def request_ids(self) -> list[object]:
        return list(self._requests)

    # ---- the three mutations ------------------------------------------------------
    def sync_new_tokens(self, req_id: object, block_ids: Sequence[int], total_len: int) -> list[int]:
        """Register tokens up to ``total_len`` and append ``block_ids`` to the block list.

        New tokens get consecutive logical ids and consecutive positions from the
        append cursor. Returns their write slots.

        A block another request already holds may be appended only as a shared prefix block: full in
        every request that holds it (its cursor lies past the block, so it is never written again) and
        filled by this sync. Whether the pool's reference count covers the extra holder is the
        allocator's to say; ``VTokenRuntime.sync`` checks that too.

        pre: req_id in self
        raises: TokenOutOfRangeError, BlockOutOfRangeError, BlockNotOwnedError, BlockListTooShortError
        post: contracts.sync_wrote_fresh_slots(__old__.self, self, req_id, total_len, __return__)
        post: contracts.sync_appended_live_tokens(__old__.self, self, req_id, total_len, __return__)
        """
        r, new_ids, n_new = self._check_sync(req_id, block_ids, total_len)
        S = self.block_size
        live_before, pos_before, listed_before = r.num_live, r.write_pos, len(r.blocks)
        assert n_new >= 0 and pos_before + n_new <= (listed_before + len(new_ids)) * S  # T2: room for every token
        # -- validated; mutate --
        for b in new_ids:
            if not self._listed[b]:  # NOTE: a shared block keeps its first holder's index (unused while shared)
                self._index_of[b] = len(r.blocks)
            else:
                self._materialise(b)
                r.shared[b] = 0
            r.blocks.append(b)
            r.counts.append(0)
            self._listed[b] += 1
        r.live.append(r.total_len, n_new)
        r.last_sync_start = r.total_len
        out: list[int] = []
        p, end = r.write_pos, r.write_pos + n_new
        while p < end:  # a block's run of new positions at a time: slices, not a Python step per token
            k, o = divmod(p, S)
            n = min(S - o, end - p)
            b = r.blocks[k]
            first, token = b * S + o, len(r.slots)
            r.counts[k] += n
            if b in r.shared:
                r.shared[b] |= ((1 << n) - 1) << o
            else:
                token_at = self._token_at
                for i in range(n):  # NOTE: a loop, not a slice: CrossHair cannot assign its symbolic arrays
                    token_at[first + i] = token + i
            if n == 1:  # a decode step's one append: claim is cheaper than a run's slices
                self.occupancy.claim(first)
            else:
                self.occupancy.claim_run(first, n)
            r.slots.extend(range(first, first + n))
            out.extend(range(first, first + n))
            p += n
        r.write_pos += n_new
        r.num_live += n_new
        assert r.total_len == total_len and len(r.blocks) == listed_before + len(new_ids)
        assert r.write_pos == pos_before + n_new and r.num_live == live_before + n_new == len(out) + live_before
        return out

    def check_sync(self, req_id: object, block_ids: Sequence[int], total_len: int) -> list[int]:
        """Everything ``sync_new_tokens`` checks, changing nothing; returns the new blocks as a list."""
        return self._check_sync(req_id, block_ids, total_len)[1]

    def _check_sync(self, req_id: object, block_ids: Sequence[int], total_len: int
                    ) -> tuple[RequestTokens, list[int], int]:
        r = self._get(req_id)
        S = self.block_size
        if total_len.__class__ is not int and not is_int(total_len) or total_len < r.total_len:
            raise TokenOutOfRangeError(
                f"request {req_id!r}: total_len {total_len!r} is below the synced length {r.total_len}"
                if is_int(total_len) else f"request {req_id!r}: total_len {total_len!r} is not an int"
            )
        new_ids = as_list("request {!r}: new blocks", block_ids, BlockOutOfRangeError, req_id)
        seen: set[int] = set()
        for b in new_ids:
            self._check_block(b)
            if b in seen or self._in_list(r, b):
                raise BlockNotOwnedError(f"request {req_id!r}: block {b} is already in its block list")
            seen.add(b)
        n_new = total_len - r.total_len
        capacity = (len(r.blocks) + len(new_ids)) * S
        if r.write_pos + n_new > capacity:
            raise BlockListTooShortError(
                f"request {req_id!r}: {n_new} new tokens from position {r.write_pos} need "
                f"{r.write_pos + n_new} slots, its {len(r.blocks) + len(new_ids)} blocks hold {capacity}"
            )
        end = r.write_pos + n_new
        for i, b in enumerate(new_ids):
            if self._listed[b]:
                self._check_shareable(req_id, b, self._holders_of(b), (len(r.blocks) + i) * S, end)
        return r, new_ids, n_new

    def _check_shareable(self, req_id: object, b: int, others: list[object], start: int, end: int) -> None:
        """Block ``b``, held by ``others``, may join ``req_id``'s list at position ``start`` (its cursor
        moving to ``end``) only as a full prefix block: written by no one ever again."""
        S = self.block_size
        if len(others) >= 0xFFFF:
            raise BlockNotOwnedError(f"request {req_id!r}: block {b} is already shared by {len(others)} requests")
        for o in others:
            ro = self._requests[o]
            i = ro.blocks.index(b)
            if (i + 1) * S > ro.write_pos:
                raise BlockNotOwnedError(
                    f"request {req_id!r}: block {b} belongs to request {o!r}, whose append cursor "
                    f"(position {ro.write_pos}) has not passed it; only a full block can be shared"
                )
        if start + S > end:
            raise BlockNotOwnedError(
                f"request {req_id!r}: block {b} belongs to request {others[0]!r}; a shared block must be "
                f"filled by the sync that adds it (positions [{start}, {start + S}), tokens end at {end})"
            )

    def evict_token(self, req_id: object, token_id: int) -> None:
        """Mark a token dead. Metadata only: nothing moves, nothing is freed.

        pre: req_id in self
        pre: token_id in self.live_token_ids(req_id)
        raises: TokenOutOfRangeError, TokenAlreadyEvictedError
        post: contracts.evict_killed_one_token(__old__.self, self, req_id, token_id)  # T1
        post: contracts.evict_moved_nothing(__old__.self, self, req_id, token_id)  # metadata only
        """
        self.evict_tokens(req_id, (token_id,))

    def evict_tokens(self, req_id: object, token_ids: Sequence[int]) -> list[int]:
        """Mark several tokens dead, all or none: ``evict_token`` for each in turn, validated once (a policy's
        victims of one step). Returns the position each held (index in the block list x S + offset), in the
        order given: where densify's holes are, read before the slots are forgotten.

        pre: req_id in self
        raises: TokenOutOfRangeError, TokenAlreadyEvictedError
        post: contracts.evict_killed_the_tokens(__old__.self, self, req_id, __old__.token_ids)  # T1
        post: contracts.evict_moved_nothing(__old__.self, self, req_id, __old__.token_ids)  # metadata only
        post: contracts.evicted_where_they_were(__old__.self, req_id, __old__.token_ids, __return__)
        """
        r = self._get(req_id)
        ids = as_list("request {!r}: tokens to evict", token_ids, TokenOutOfRangeError, req_id)
        slots = self._live_slots_of(req_id, r, ids, TokenAlreadyEvictedError, "is named twice in one eviction")
        # NOTE: everything is validated; nothing below raises, so a refused call changed nothing
        S, shared, counts, live, occupancy = self.block_size, r.shared, r.counts, r.live, self.occupancy
        positions = []
        for t, slot in zip(ids, slots):
            b, o = divmod(slot, S)
            i = self._index_listed(r, b)  # O(1) for a private block; a shared one is near the front
            if b in shared:
                assert shared[b] >> o & 1, f"live token {t} of {req_id!r} at slot {slot}, unmarked in block {b}"
                shared[b] &= ~(1 << o)
            counts[i] -= 1
            if not counts[i]:
                r.emptied += 1
            occupancy.release(slot)
            r.slots[t] = NO_SLOT
            live.remove(t)
            positions.append(i * S + o)
            assert not shared[b] >> o & 1 if b in shared else not occupancy.holders(slot)
        r.num_live -= len(ids)
        if r.evicted is not None:
            r.evicted.extend(ids)
            if len(r.evicted) > CHANGE_LOG_LIMIT:
                r.evicted = None  # nobody is reading the log: bounded, the next take says "rebuilt"
        assert r.num_live >= 0
        return positions

    def apply_moves(self, req_id: object, moves: Iterable[Move]) -> None:
        """Atomically relocate live tokens whose K/V has been copied (I2).

        All sources are vacated and all destinations claimed together, so a
        batch may move a token into a slot another move of the batch vacates.
        A destination must be in the request's block list, before the append
        cursor, and unclaimed by any request once the batch's sources are vacated.

        pre: req_id in self
        raises: TokenOutOfRangeError, TokenAlreadyEvictedError, MoveSourceMismatchError, DestinationError, BlockNotOwnedError
        post: contracts.moves_kept_liveness_and_layout(__old__.self, self, req_id, moves)
        post: contracts.live_slots_distinct_before_the_cursor(self, req_id)  # I2, T2
        """
        r = self._get(req_id)
        S = self.block_size
        batch = [_as_move(req_id, m) for m in as_list("request {!r}: moves", moves, MoveSourceMismatchError, req_id)]
        if not batch:
            return  # nothing moves, so the layout (and any plan's snapshot of it) stays valid
        ids = [m.token_id for m in batch]
        sources = self._live_slots_of(req_id, r, ids, MoveSourceMismatchError, "moved twice in one batch")
        for m, slot in zip(batch, sources):
            if m.src_block.__class__ is not int or m.src_offset.__class__ is not int \
                    or m.src_block * S + m.src_offset != slot or not 0 <= m.src_offset < S:
                raise MoveSourceMismatchError(
                    f"request {req_id!r}: move of token {m.token_id} names source "
                    f"({m.src_block}, {m.src_offset}) but the table has slot {slot} "
                    f"= ({slot // S}, {slot % S})"
                )
        vacated = set(sources)
        claimed: set[int] = set()
        index: dict[int, int | None] = {}  # block -> its index in r's list (None: not listed), once per block
        for m in batch:
            b = m.dst_block
            if not (is_int(b) and 0 <= b < self.num_blocks and is_int(m.dst_offset) and 0 <= m.dst_offset < S):
                raise DestinationError(
                    f"request {req_id!r}: token {m.token_id} destination ({b}, {m.dst_offset}) "
                    f"is outside the pool ({self.num_blocks} blocks of {S})"
                )
            i = index[b] if b in index else index.setdefault(b, self._index_in(r, b))
            if i is None:
                raise BlockNotOwnedError(
                    f"request {req_id!r}: token {m.token_id} destination block {b} is not in its block list"
                )
            dst = b * S + m.dst_offset
            if i * S + m.dst_offset >= r.write_pos:
                raise DestinationError(
                    f"request {req_id!r}: token {m.token_id} destination slot {dst} is at or after "
                    f"the append cursor (position {r.write_pos}); appends would overwrite it"
                )
            if dst in claimed:
                raise DestinationError(f"request {req_id!r}: slot {dst} is the destination of two moves")
            claimed.add(dst)
        dsts = [m.dst_block * S + m.dst_offset for m in batch]
        for m, dst, h in zip(batch, dsts, self.occupancy.holders_of(dsts)):
            if h - (dst in vacated):
                raise DestinationError(
                    f"request {req_id!r}: token {m.token_id} destination slot {dst} "
                    f"({m.dst_block}, {m.dst_offset}) is occupied by a live token"
                )
        assert len(vacated) == len(claimed) == len(batch)
        # a source another request still holds (a shared prefix slot) stays live: each such move adds a slot
        live_slots_after = self.occupancy.live_slots + sum(1 for h in self.occupancy.holders_of(sources) if h > 1)
        # -- validated; mutate atomically --
        shared, counts, occupancy = r.shared, r.counts, self.occupancy
        for slot in sources:
            b = slot // S
            if b in shared:
                shared[b] &= ~(1 << (slot % S))
            i = index[b] if b in index else index.setdefault(b, self._index_listed(r, b))
            counts[i] -= 1
            occupancy.release(slot)
        for m, dst in zip(batch, dsts):
            b = m.dst_block
            counts[index[b]] += 1
            if b in shared:
                shared[b] |= 1 << m.dst_offset
            else:
                self._token_at[dst] = m.token_id
            occupancy.claim(dst)
            r.slots[m.token_id] = dst
        if r.moved is not None:
            r.moved.extend(ids)
            if len(r.moved) > CHANGE_LOG_LIMIT:
                r.moved = None  # bounded, as the eviction log: the next take says "rebuilt"
        r.layout_version += 1
        r.run_pos, r.run_token = r.write_pos, r.total_len
        assert self.occupancy.live_slots == live_slots_after, "a batch of moves miscounted the pool's live slots"

    # ---- block-list rewrites (reclamation only) -------------------------------------
    def set_layout(self, req_id: object, blocks: Sequence[int], write_pos: int) -> None:
        """Replace the block list and append cursor (attach destinations, drop emptied sources).

        Every block holding a live token of the request must stay; no live token
        may end up at or after the new cursor (T2). A block joining the list must
        not be in another request's list (sharing happens only through ``sync_new_tokens``).
        """
        r = self._get(req_id)
        S = self.block_size
        new = as_list("request {!r}: new block list", blocks, BlockOutOfRangeError, req_id)
        for b in new:
            self._check_block(b)
        if len(set(new)) != len(new):
            raise BlockNotOwnedError(f"request {req_id!r}: new block list {new} repeats a block")
        for b in new:
            if self._listed[b] and not self._in_list(r, b):
                raise BlockNotOwnedError(
                    f"request {req_id!r}: block {b} belongs to request {self._holders_of(b)[0]!r} and cannot join "
                    f"its block list"
                )
        if not is_int(write_pos) or not 0 <= write_pos <= len(new) * S:
            raise BlockListTooShortError(
                f"request {req_id!r}: cursor {write_pos!r} outside its {len(new)} blocks of {S}"
            )
        keep = set(new)
        for b in r.blocks:
            if b not in keep and (n := self._live_in(r, b)):
                raise BlockNotOwnedError(
                    f"request {req_id!r}: block {b} still holds {n} live token(s) "
                    f"and cannot leave its block list"
                )
        for i in range(write_pos // S, len(new)):  # blocks before the cursor's have no offset at or after it
            b = new[i]
            if self._mask(r, b) >> (write_pos - i * S if i * S < write_pos else 0):
                raise DestinationError(
                    f"request {req_id!r}: block {b} holds live tokens at or after cursor {write_pos}"
                )
        # -- validated; mutate --
        counts = array(self._count_code, (self._live_in(r, b) for b in new))  # a joining block: 0 (it is listed nowhere)
        live_before = sum(self._live_in(r, b) for b in r.blocks)
        keep_old = set(r.blocks)
        dropped = [b for b in r.blocks if b not in keep]
        for b in dropped:
            self._listed[b] -= 1
        for b in new:
            if b not in keep_old:
                self._listed[b] += 1
        for b in dropped:
            r.shared.pop(b, None)
        r.blocks = array("i", new)
        r.counts = counts
        for i, b in enumerate(new):
            self._index_of[b] = i
        r.index_stale = False
        for b in dropped:
            self._reindex(b)  # a shared block this request gave up now belongs to one request
        r.write_pos = write_pos
        r.layout_version += 1
        r.run_pos, r.run_token = r.write_pos, r.total_len
        assert sum(self._live_in(r, b) for b in r.blocks) == live_before == r.num_live  # no live token left
        assert r.write_pos <= len(r.blocks) * S

    def splice(self, req_id: object, at: int, remove: int, insert: Sequence[int], write_pos: int) -> None:
        """Replace blocks [at, at + remove) of the request's list with ``insert`` and set the cursor: a
        densify commit's rewrite (the emptied tail leaves), under ``set_layout``'s rules, in O(removed +
        inserted + blocks from the new cursor's on) where ``set_layout`` is O(blocks)."""
        r = self._get(req_id)
        new = self.check_splice(req_id, at, remove, insert, write_pos, lambda b: self._mask(r, b))
        # -- validated; mutate --
        removed = r.blocks[at:at + remove]
        for b in removed:
            self._listed[b] -= 1
            r.shared.pop(b, None)
        for b in new:
            self._listed[b] += 1  # unlisted before (checked): private
        r.blocks[at:at + remove] = array("i", new)
        r.counts[at:at + remove] = array(self._count_code, bytes(r.counts.itemsize * len(new)))  # unlisted before (checked): empty, private
        self._reindex_from(r, at, at + len(new))
        # NOTE: the blocks after the splice moved by len(new) - remove; their indices are fixed when read
        r.index_stale |= len(new) != remove and at + len(new) < len(r.blocks)
        for b in removed:
            self._reindex(b)
        r.write_pos = write_pos
        r.layout_version += 1
        r.run_pos, r.run_token = r.write_pos, r.total_len
        assert r.write_pos <= len(r.blocks) * self.block_size

    def remove_blocks(self, req_id: object, indices: Sequence[int], write_pos: int) -> None:
        """Drop the blocks at ``indices`` (ascending) of the request's list and set the cursor: a compact
        commit's emptied sources, under ``set_layout``'s rules, in O(removed + blocks from the new cursor's on)
        plus a C copy of the list; the shifted blocks' indices are fixed when next read (``index_stale``)."""
        r = self._get(req_id)
        at = self.check_remove_blocks(req_id, indices, write_pos, lambda b: self._mask(r, b))
        # -- validated; mutate --
        blocks, counts, prev = array("i"), array(self._count_code), 0
        for i in at:
            blocks += r.blocks[prev:i]
            counts += r.counts[prev:i]
            b = r.blocks[i]
            self._listed[b] -= 1
            r.shared.pop(b, None)
            prev = i + 1
        removed = [r.blocks[i] for i in at]
        r.blocks = blocks + r.blocks[prev:]
        r.counts = counts + r.counts[prev:]
        r.index_stale |= bool(at) and at[0] < len(r.blocks)  # NOTE: the blocks after moved; fixed when read
        for b in removed:
            self._reindex(b)
        r.write_pos = write_pos
        r.layout_version += 1
        r.run_pos, r.run_token = r.write_pos, r.total_len
        assert len(r.blocks) == len(r.counts) and r.write_pos <= len(r.blocks) * self.block_size

    def check_remove_blocks(self, req_id: object, indices: Sequence[int], write_pos: int, mask_of,
                            fail=None) -> list[int]:
        """Everything ``remove_blocks`` checks, changing nothing, with ``mask_of(block)`` each listed block's live
        offsets (a commit's precondition passes the masks its moves leave). Returns ``indices`` as a list."""
        r, S = self._get(req_id), self.block_size

        def refuse(error: type, message: str) -> None:
            if fail is not None:
                fail(message)
            raise error(f"request {req_id!r}: {message}")

        at = as_list("request {!r}: block indices to remove", indices, BlockListTooShortError, req_id)
        n = len(r.blocks)
        if not all(is_int(i) for i in at) or any(not 0 <= i < n for i in at) or at != sorted(set(at)):
            refuse(BlockListTooShortError, f"block indices {at} are not ascending, distinct indices of its {n} blocks")
        for i in at:
            if mask_of(r.blocks[i]):
                gone = set(at)
                refuse(BlockNotOwnedError, f"block {r.blocks[i]} holds live tokens but would leave block list "
                                           f"{[b for j, b in enumerate(r.blocks) if j not in gone]}")
        length = n - len(at)
        if not is_int(write_pos) or not 0 <= write_pos <= length * S:
            refuse(BlockListTooShortError, f"cursor {write_pos!r} outside its {length} blocks")
        for k in range(write_pos // S, length):  # no live token at or after the new cursor (T2)
            j = k
            for i in at:  # k's index before the removal
                j += i <= j
            b = r.blocks[j]
            if mask_of(b) >> max(0, write_pos - k * S):
                refuse(DestinationError, f"block {b} would hold live tokens at or after cursor {write_pos}")
        return at

    def check_splice(self, req_id: object, at: int, remove: int, insert: Sequence[int], write_pos: int,
                     mask_of, fail=None) -> list[int]:
        """Everything ``splice`` checks, changing nothing, with ``mask_of(block)`` giving each listed block's
        live offsets (a commit's precondition passes the masks its moves will leave, and its own ``fail``,
        which raises). Returns ``insert`` as a list. O(removed + inserted + blocks from the cursor's on)."""
        r, S = self._get(req_id), self.block_size
        n = len(r.blocks)

        def refuse(error: type, message: str) -> None:
            if fail is not None:
                fail(message)
            raise error(f"request {req_id!r}: {message}")

        new = as_list("request {!r}: blocks to insert", insert, BlockOutOfRangeError, req_id)
        if not (is_int(at) and is_int(remove) and 0 <= at and 0 <= remove and at + remove <= n):
            refuse(BlockListTooShortError, f"splice of blocks [{at!r}, +{remove!r}) outside its {n} blocks")
        for b in new:
            self._check_block(b)
            if self._listed[b] or new.count(b) > 1:
                refuse(BlockNotOwnedError, f"block {b} cannot join its block list (listed, or named twice)")
        for b in r.blocks[at:at + remove]:
            if mask_of(b):
                refuse(BlockNotOwnedError, f"block {b} holds live tokens but would leave block list "
                                           f"{list(r.blocks[:at]) + new + list(r.blocks[at + remove:])}")
        length = n - remove + len(new)
        if not is_int(write_pos) or not 0 <= write_pos <= length * S:
            refuse(BlockListTooShortError, f"cursor {write_pos!r} outside its {length} blocks")
        for i in range(write_pos // S, length):  # no live token at or after the new cursor (T2)
            b = r.blocks[i] if i < at else new[i - at] if i < at + len(new) else r.blocks[i - len(new) + remove]
            if b not in new and mask_of(b) >> max(0, write_pos - i * S):
                refuse(DestinationError, f"block {b} would hold live tokens at or after cursor {write_pos}")
        return new

    # ---- views ----------------------------------------------------------------------
    def num_live(self, req_id: object) -> int:
        return self._get(req_id).num_live

    def total_len(self, req_id: object) -> int:
        return self._get(req_id).total_len

    def write_pos(self, req_id: object) -> int:
        return self._get(req_id).write_pos

    def layout_version(self, req_id: object) -> int:
        return self._get(req_id).layout_version

    def block_ids(self, req_id: object) -> list[int]:
        return list(self._get(req_id).blocks)

    def is_live(self, req_id: object, token_id: int) -> bool:
        r = self._get(req_id)
        self._check_token(req_id, r, token_id)
        return r.slots[token_id] != NO_SLOT

    def slot_of(self, req_id: object, token_id: int) -> int:
        """The token's slot, or NO_SLOT if it was evicted."""
        r = self._get(req_id)
        self._check_token(req_id, r, token_id)
        return r.slots[token_id]

    def slots_of(self, req_id: object, token_ids: Sequence[int]) -> list[int]:
        """``slot_of`` of each token, in order (NO_SLOT for an evicted one), validated once: a plan's or a
        policy's tokens read in one call, not one call each."""
        r = self._get(req_id)
        return self._slots_of(req_id, r, as_list("request {!r}: token ids", token_ids, TokenOutOfRangeError, req_id))

    def _live_slots_of(self, req_id: object, r: RequestTokens, ids: list, twice: type[VTokenError],
                       named_twice: str) -> list[int]:
        """``_slots_of`` of distinct live tokens (a batch to evict or to move), or the refusal: an evicted one
        (TokenAlreadyEvictedError), or one named twice (``twice``, "token t ``named_twice``")."""
        slots = self._slots_of(req_id, r, ids)
        if NO_SLOT in slots:
            raise TokenAlreadyEvictedError(f"request {req_id!r}: token {ids[slots.index(NO_SLOT)]} is already evicted")
        if len(slots) > 1 and len(set(slots)) != len(slots):  # live tokens have distinct slots (I2): a token twice
            raise twice(f"request {req_id!r}: token {next(t for k, t in enumerate(ids) if t in ids[:k])} {named_twice}")
        return slots

    def _slots_of(self, req_id: object, r: RequestTokens, ids: list) -> list[int]:
        """``slots_of`` of a list already taken, for ``r`` already looked up."""
        slots = r.slots
        if len(ids) == 1:  # a decode step's one victim: no generator, no min/max
            t = ids[0]
            if t.__class__ is not int or not 0 <= t < r.total_len:
                self._check_token(req_id, r, t)  # raises unless an int subclass in range
            return [slots[t]]
        if ids and (not all(t.__class__ is int for t in ids) or min(ids) < 0 or max(ids) >= r.total_len):
            for t in ids:
                self._check_token(req_id, r, t)  # raises for the first bad one (an int subclass passes here)
        return [slots[t] for t in ids]

    def num_blocks_of(self, req_id: object) -> int:
        """Blocks in the request's block list (O(1); ``block_ids`` copies them)."""
        return len(self._get(req_id).blocks)

    def block_at(self, req_id: object, index: int) -> int:
        """Block ``index`` of the request's list (an IndexError outside it)."""
        return self._get(req_id).blocks[index]

    def position_of(self, req_id: object, token_id: int) -> int:
        """The live token's position (index in the block list x S + offset): O(1) in a private block."""
        r = self._get(req_id)
        b, o = divmod(self._live_slot(req_id, r, token_id), self.block_size)
        return self._index_in(r, b) * self.block_size + o

    def token_at(self, req_id: object, pos: int) -> int | None:
        """The live token at position ``pos`` when ``pos`` lies in the append run (appended since the last
        layout change, at or after ``run_pos``); NO_SLOT if that token was evicted; None for an earlier
        position (unknown without a scan)."""
        r = self._get(req_id)
        if not r.run_pos <= pos < r.write_pos:
            return None
        t = r.run_token + pos - r.run_pos
        return t if r.slots[t] != NO_SLOT else NO_SLOT

    def append_run_start(self, req_id: object) -> int:
        return self._get(req_id).run_pos

    def live_tokens(self, req_id: object) -> LiveTokens:
        """The live logical ids, ascending, as a rank-indexed view (``live_index.LiveTokens``): O(1) to make,
        O(log L) per rank. What the policies see. Valid until the request's table next changes."""
        r = self._get(req_id)
        return LiveTokens(r.live, r.slots, 0, r.num_live)

    def read_lists(self, req_id: object) -> tuple[list[int], list[int]]:
        """(live ids, their slots), both in logical order: the full read lists on demand, from the live index
        (O(live + CHUNK per chunk read); dead runs are jumped, not scanned). ``live_token_ids`` and
        ``attention_slots`` are the scans V1 checks the index against."""
        r = self._get(req_id)
        tokens = list(LiveTokens(r.live, r.slots, 0, r.num_live))
        slots = r.slots
        return tokens, [slots[t] for t in tokens]

    def take_changes(self, req_id: object) -> Changes:
        """What changed in the request's read list (live ids and their slots, logical order) since the previous
        take, O(evicted + moved).

        ``rebuilt``: this is the request's first take, or more tokens were evicted or moved than the log keeps:
        read the whole list again. Otherwise, from the previous take's list: the tokens named in ``evicted`` left
        it, the tokens in ``moved`` (still live, ascending) are now at ``moved_slots``, and the tokens from
        ``joined_from`` (the synced length at the previous take) on that are still live joined it at the end.
        NOTE: only ``apply_moves`` changes a live token's slot; the block-list rewrites (``set_layout``,
        ``splice``, ``remove_blocks``) bump the layout version but move no live token, so they need no entry."""
        r = self._get(req_id)
        rebuilt = r.evicted is None or r.moved is None or r.taken_version == -1
        joined_from, since = r.taken_len, r.taken_version
        evicted = moved = moved_slots = ()
        if not rebuilt:
            evicted = tuple(t for t in r.evicted if t < joined_from)
            if r.moved:
                slots = r.slots
                moved = tuple(sorted({t for t in r.moved if t < joined_from and slots[t] != NO_SLOT}))
                moved_slots = tuple(slots[t] for t in moved)
        r.evicted, r.moved, r.taken_version, r.taken_len = array("i"), array("i"), r.layout_version, r.total_len
        return Changes(r.layout_version, since, rebuilt, evicted, joined_from, moved, moved_slots)

    def live_token_ids(self, req_id: object) -> list[int]:
        """Live logical token ids, ascending: a scan of the slot array (the reference the live index is
        checked against, and the full list on demand)."""
        return [t for t, s in enumerate(self._get(req_id).slots) if s != NO_SLOT]

    def live_slots(self, req_id: object) -> list[tuple[int, int]]:
        """(token_id, slot) of every live token, in logical order (one pass; for checkers)."""
        return [(t, s) for t, s in enumerate(self._get(req_id).slots) if s != NO_SLOT]

    def attention_slots(self, req_id: object) -> list[int]:
        """Eq. 2: the slots of live tokens, in logical order. What the gather read path reads."""
        return [s for s in self._get(req_id).slots if s != NO_SLOT]

    def write_slots(self, req_id: object, since: int | None = None) -> list[int]:
        """Slots of the tokens added by the latest sync, or of tokens ``since`` on (NO_SLOT for any evicted)."""
        r = self._get(req_id)
        return r.slots[r.last_sync_start if since is None else since:].tolist()

    def shared_blocks(self, req_id: object) -> list[int]:
        """The blocks of the request's list that other requests list too (shared prefix blocks): O(shared)."""
        return list(self._get(req_id).shared)

    def block_mask(self, req_id: object, block_id: int) -> int:
        """The bitmask of this request's live offsets in one block of its list (0 for a block not in it)."""
        r = self._get(req_id)
        ok = (block_id.__class__ is int or is_int(block_id)) and 0 <= block_id < self.num_blocks
        return self._mask(r, block_id) if ok else 0

    def block_masks(self, req_id: object) -> dict[int, int]:
        """The per-block bitmasks of this request's live offsets (what ``set_layout`` validates), O(blocks x S)."""
        r = self._get(req_id)
        return {b: self._mask(r, b) for b in r.blocks}

    def block_live_counts(self, req_id: object) -> dict[int, int]:
        """Live tokens of this request per block of its block list (incrementally maintained)."""
        r = self._get(req_id)
        return {b: self._live_in(r, b) for b in r.blocks}

    def blocks_emptied(self, req_id: object) -> int:
        """How many times an eviction left one of the request's blocks with no live token of it, over its life
        (monotone): unchanged across an ``evict_tokens`` call, that call made no block dead. O(1)."""
        return self._get(req_id).emptied

    def dead_blocks(self, req_id: object, private, among: Iterable[int] | None = None) -> list[int]:
        """The blocks of the request's list that hold none of its live tokens, lie wholly before the cursor's block
        (written, and never written again) and are ``private(block)``, in list order: what the paper's Naive-Evict
        releases. ``among``: only the list indices named (where a step's evictions were, O(len(among))); else a C
        search of the maintained per-block counts, O(blocks) bytes."""
        r, S = self._get(req_id), self.block_size
        end = min(r.write_pos // S, len(r.blocks))
        found = sorted(i for i in set(among) if 0 <= i < end and not r.counts[i]) if among is not None \
            else _find_all(r.counts[:end].tobytes(), 0, r.counts.itemsize)
        return [r.blocks[i] for i in found if private(r.blocks[i])]

    def compact_candidates(self, req_id: object, max_sources: int, private) -> list[tuple[int, int]]:
        """``reference.compact.eligible_sources``' first ``max_sources`` as (index, live count), found in the
        maintained per-block counts: the blocks wholly before the cursor's, not full, ``private(block)``, lowest
        count first, then lowest index. At most S + max_sources C searches of the counts' bytes, and a private()
        call per block found; the reference is the scan of a snapshot (V3 compares the plans)."""
        r, S = self._get(req_id), self.block_size
        end = min(r.write_pos // S, len(r.blocks))
        raw, out, size = r.counts[:end].tobytes(), [], r.counts.itemsize
        for c in range(S):
            for i in _find_all(raw, c, size):
                if private(r.blocks[i]):
                    out.append((i, c))
                    if len(out) == max_sources:
                        return out
        return out

    def live_in_blocks(self, req_id: object, blocks: Sequence[int]) -> list[tuple[int, int]]:
        """(token_id, slot) of the request's live tokens in ``blocks`` (blocks of its list), in logical order:
        through the pool-wide token map, O(len(blocks) x S), each entry checked against the slot array (a shared
        block's, which the map does not keep, by a C search of the slot array)."""
        r, S = self._get(req_id), self.block_size
        out, raw = [], None
        for b in blocks:
            if self._index_in(r, b) is None:
                raise InvariantViolation("V1", f"request {req_id!r}: block {b} is not in its list")
            mask = self._mask(r, b)
            for o in range(S):
                if mask >> o & 1:
                    if b in r.shared:  # not in the token map (no planner moves a shared block's tokens): search
                        raw = r.slots.tobytes() if raw is None else raw
                        t = _find_word(raw, b * S + o, 0)
                    else:
                        t = self._token_at[b * S + o]
                    if not 0 <= t < len(r.slots) or r.slots[t] != b * S + o:
                        raise InvariantViolation("V1", f"request {req_id!r}: the token map says token {t} holds slot "
                                                 f"{b * S + o}, the slot array disagrees")
                    out.append((t, b * S + o))
        out.sort()
        return out

    def snapshot(self, req_id: object, shared_blocks: Iterable[int] = ()) -> RequestSnapshot:
        r = self._get(req_id)
        shared = frozenset(b for b in as_list("shared blocks", shared_blocks, BlockOutOfRangeError)
                           if is_int(b) and 0 <= b < self.num_blocks and self._in_list(r, b))
        return RequestSnapshot(
            req_id=req_id,
            block_size=self.block_size,
            blocks=tuple(r.blocks),
            masks=tuple(self._mask(r, b) for b in r.blocks),
            slots=r.slots.tobytes(),
            write_pos=r.write_pos,
            num_live=r.num_live,
            total_len=r.total_len,
            layout_version=r.layout_version,
            shared_blocks=shared,
        )

    def state(self) -> tuple:
        """Every field of every request, for tests proving a rejected call changed nothing."""
        return (
            tuple(
                (k, r.slots.tobytes(), tuple(r.blocks), tuple(sorted(r.shared.items())), r.write_pos,
                 r.num_live, r.layout_version, r.last_sync_start)
                for k, r in self._requests.items()
            ),
            self.occupancy.state(),
        )

    # ---- helpers --------------------------------------------------------------------
    def _get(self, req_id: object) -> RequestTokens:
        try:
            if req_id.__class__ is bool:  # True == 1: it would find request 1
                raise KeyError(req_id)
            return self._requests[req_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request {req_id!r}") from None

    def _index_in(self, r: RequestTokens, b: int) -> int | None:
        """Block ``b``'s index in ``r``'s list (None if it is not listed there): O(1) for a private block."""
        if not ((b.__class__ is int or is_int(b)) and 0 <= b < self.num_blocks and self._in_list(r, b)):
            return None
        return self._index_listed(r, b)

    def _index_listed(self, r: RequestTokens, b: int) -> int:
        """The index of block ``b``, which is in ``r``'s list: O(1) when private and its recorded index is right
        (checked); else one C search of the list's bytes, which records it. A shared (prefix) block's is searched
        for from the front, where prefix blocks are."""
        if b in r.shared:
            return r.blocks.index(b)
        i = self._index_of[b]
        try:
            if r.blocks[i] == b:
                return i
        except IndexError:  # a hint past the list's end: stale
            pass
        i = _find_word(r.blocks.tobytes(), b, 0)
        assert i >= 0, f"block {b} is not in the list it was read from"
        self._index_of[b] = i
        return i

    def index_in_list(self, req_id: object, block_id: int) -> int | None:
        return self._index_in(self._get(req_id), block_id)

    def _reindex(self, b: int) -> None:
        """Block ``b`` may just have become listed by one request: record its index in that request's list."""
        if self._listed[b] == 1:
            [holder] = self._holders_of(b)
            r = self._requests[holder]
            self._index_of[b] = r.blocks.index(b)
            # private again: its mask is the pool's occupancy of it (the others held nothing in it any more:
            # they left with their slots released, or dropped it empty)
            mask = r.shared.pop(b)
            assert mask == self.occupancy.occupied_mask(b), f"block {b}: {holder!r}'s mask is not its occupancy"
            self._rebuild_token_map(r, b, mask)

    def _reindex_from(self, r: RequestTokens, start: int, stop: int) -> None:
        """Record the index of ``r``'s blocks [start, stop) (their indices moved): one C-driven pass."""
        deque(map(self._index_of.__setitem__, r.blocks[start:stop], range(start, stop)), maxlen=0)

    def _materialise(self, b: int) -> None:
        """Block ``b`` is about to be listed by one more request: if it was private, its holder's mask moves
        from the pool's occupancy into the holder's ``shared`` map (it can no longer be read off the pool)."""
        if self._listed[b] == 1:
            [holder] = self._holders_of(b)
            h = self._requests[holder]
            h.shared[b] = self.occupancy.occupied_mask(b)

    def _rebuild_token_map(self, r: RequestTokens, b: int, mask: int) -> None:
        """The token map of block ``b``, private to ``r`` again: each live offset's token found by a C search of
        r's slot array (O(S) searches of O(L) bytes, once per shared block's return to one holder)."""
        raw, S = r.slots.tobytes(), self.block_size
        for o in range(S):
            if mask >> o & 1:
                t = _find_word(raw, b * S + o, 0)
                assert t >= 0 and r.slots[t] == b * S + o, f"block {b}: no live token at slot {b * S + o}"
                self._token_at[b * S + o] = t

    def _in_list(self, r: RequestTokens, b: int) -> bool:
        """Whether block ``b`` (an int in the pool) is in ``r``'s list: O(1), or one C search of r's list when r's
        recorded indices may be stale and the recorded one is wrong."""
        if b in r.shared:
            return True
        if self._listed[b] != 1:
            return False
        try:
            if r.blocks[self._index_of[b]] == b:
                return True
        except IndexError:  # a hint past the list's end: stale
            pass
        if not r.index_stale:
            return False
        i = _find_word(r.blocks.tobytes(), b, 0)
        if i >= 0:
            self._index_of[b] = i
        return i >= 0

    def _mask(self, r: RequestTokens, b: int) -> int:
        """The offsets of block ``b`` (an int in the pool) that ``r`` holds live tokens in: 0 unless listed."""
        if b in r.shared:
            return r.shared[b]
        return self.occupancy.occupied_mask(b) if self._in_list(r, b) else 0

    def _live_in(self, r: RequestTokens, b: int) -> int:
        """How many of ``r``'s live tokens block ``b`` holds: O(1)."""
        if b in r.shared:
            return r.shared[b].bit_count()
        return self.occupancy.block_live(b) if self._in_list(r, b) else 0

    def _holders_of(self, b: int) -> list[object]:
        """The requests listing block ``b``: a scan of the requests (only for a block that is listed)."""
        return [k for k, r in self._requests.items() if self._in_list(r, b)]

    def _check_block(self, b: int) -> None:
        if b.__class__ is not int and not is_int(b) or not 0 <= b < self.num_blocks:
            raise BlockOutOfRangeError(f"block {b!r} outside the pool [0, {self.num_blocks})")

    @staticmethod
    def _check_token(req_id: object, r: RequestTokens, token_id: int) -> None:
        if token_id.__class__ is not int and not is_int(token_id) or not 0 <= token_id < r.total_len:
            raise TokenOutOfRangeError(
                f"request {req_id!r}: token {token_id!r} outside its synced tokens [0, {r.total_len})"
            )

    def _live_slot(self, req_id: object, r: RequestTokens, token_id: int) -> int:
        self._check_token(req_id, r, token_id)
        slot = r.slots[token_id]
        if slot == NO_SLOT:
            raise TokenAlreadyEvictedError(f"request {req_id!r}: token {token_id} is already evicted")
        return slot
