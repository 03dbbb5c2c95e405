"""The ``CopyEngine`` protocol: how the core asks a device to move K/V entries.

The core decides what moves; an engine moves it. Engines: ``InMemoryCopyEngine``
(core/sim/inmemory.py, tags instead of tensors, with test controls for late,
reordered and failed copies), and the torch CPU/CUDA engines of the device
layer (integration/).

A copy's life: ``submit`` -> PENDING. Then either
  * it finishes: DONE (every destination holds its source's value), or
  * it fails: FAILED (it will write nothing more; destinations hold garbage), or
  * ``order_before_compute`` makes every later compute step and every later
    copy wait for it (a GPU-side wait_event): ORDERED, and later DONE.
FAILED, DONE and ORDERED are *settled*: the copy can no longer race with
anything issued after this point, so the manager may commit (DONE/ORDERED),
abort (FAILED), and free the blocks it reads or writes.
"""

from __future__ import annotations

import enum
from itertools import chain
from typing import Protocol, Sequence

from .checks import is_int  # an int that is not a bool: a bool is an int to Python, never a slot to us
from .errors import (CopyStateError, DestinationError, MoveSourceMismatchError, TokenOutOfRangeError,
                     UnknownCopyHandleError)
from .token_table import Move


class CopyStatus(enum.Enum):
    PENDING = "pending"
    ORDERED = "ordered"  # not known complete, but all later work is ordered after it
    DONE = "done"
    FAILED = "failed"

    @property
    def settled(self) -> bool:
        return self is not CopyStatus.PENDING


CopyHandle = int


class CopyEngine(Protocol):
    def submit(self, moves: Sequence[Move], req_id: object = None) -> CopyHandle:
        """Start copying every move's K/V (all layers) from source to destination slot.

        Out-of-place: every source is read before any destination is written. ``req_id`` (the
        plan's request) is for error reports and quarantine only.

        A submit that raises started nothing and wrote nothing: a ``VTokenError`` for moves it
        refuses (``check_moves``), a ``RuntimeError`` (or ``MemoryError``) for a device that could
        not launch the copy. The manager then aborts that plan and keeps serving. A copy that fails
        after it started is reported FAILED by ``poll`` instead.
        """
        ...

    def poll(self, handle: CopyHandle) -> CopyStatus: ...

    def order_before_compute(self, handle: CopyHandle) -> CopyStatus:
        """Make later compute and copies wait for this copy, without blocking the host."""
        ...

    def wait(self, handle: CopyHandle) -> CopyStatus:
        """Block the host until the copy is DONE or FAILED (the force-sync ablation)."""
        ...

    def release(self, handle: CopyHandle) -> None:
        """Forget a settled handle."""
        ...

    def before_compute(self) -> None:
        """The pre-attention hook: the compute stream waits for every ORDERED copy (GPU-side wait_event).

        ``VTokenRuntime.begin_step`` calls it last, right before the forward, so a
        commit under EVENT ordering is safe whoever drives the runtime.
        """
        ...


def check_moves(moves: object, num_blocks: int, block_size: int, req_id: object = None) -> tuple[Move, ...]:
    """Validate one copy's moves against a device of ``num_blocks`` blocks of ``block_size`` slots.

    What every engine refuses before it touches anything: a move that is not a 5-tuple, a field that is not
    an int (a float would be rounded into some other slot, a bool read as slot 0 or 1), a source or
    destination outside the device, two moves writing one slot. Raises MoveSourceMismatchError (shape, or a
    bad source), DestinationError (a bad destination, or one written twice) or TokenOutOfRangeError (the
    token id), naming the move and the request. Returns the moves as a tuple of ``Move``.

    One pass of C-speed checks over the flattened fields (a submit of thousands of moves must not cost the
    host milliseconds); only a batch that fails them is walked move by move, to name the culprit.
    """
    try:
        batch = tuple(m if type(m) is Move else Move(*m) for m in moves)  # type: ignore[union-attr]
    except TypeError:
        raise MoveSourceMismatchError(
            f"request {req_id!r}: malformed moves {moves!r}; expected an iterable of "
            f"(token_id, src_block, src_offset, dst_block, dst_offset)") from None
    if not batch:
        return batch
    flat = list(chain.from_iterable(batch))
    if set(map(type, flat)) == {int}:  # exact ints: no bool, no float, no int subclass
        tok, sb, so, db, do = (flat[i::5] for i in range(5))
        if (min(tok) >= 0 and min(sb) >= 0 and max(sb) < num_blocks and min(so) >= 0 and max(so) < block_size
                and min(db) >= 0 and max(db) < num_blocks and min(do) >= 0 and max(do) < block_size
                and len(set(zip(db, do))) == len(batch)):
            return batch
    _name_the_bad_move(batch, num_blocks, block_size, req_id)  # raises, naming the first bad move...
    return batch  # ...unless the fast checks failed only on an int subclass other than bool (an IntEnum)


def _name_the_bad_move(batch: tuple[Move, ...], num_blocks: int, block_size: int, req_id: object) -> None:
    written: set[int] = set()
    for m in batch:
        if not is_int(m.token_id) or m.token_id < 0:
            raise TokenOutOfRangeError(f"request {req_id!r}: move {m} has token id {m.token_id!r}; "
                                       f"expected an int >= 0")
        if not (is_int(m.src_block) and is_int(m.src_offset) and 0 <= m.src_block < num_blocks
                and 0 <= m.src_offset < block_size):
            raise MoveSourceMismatchError(f"request {req_id!r}: move {m} reads a slot outside the KV cache "
                                          f"({num_blocks} blocks of {block_size}, int fields)")
        if not (is_int(m.dst_block) and is_int(m.dst_offset) and 0 <= m.dst_block < num_blocks
                and 0 <= m.dst_offset < block_size):
            raise DestinationError(f"request {req_id!r}: move {m} writes a slot outside the KV cache "
                                   f"({num_blocks} blocks of {block_size}, int fields)")
        dst = m.dst_block * block_size + m.dst_offset
        if dst in written:
            raise DestinationError(f"request {req_id!r}: two moves of one copy write the same slot {dst} "
                                   f"(block {m.dst_block}, offset {m.dst_offset})")
        written.add(dst)


class CopyRegistry:
    """The handle bookkeeping every engine shares: copies by handle, ORDERED marking, release.

    A copy record has ``moves``, ``status`` and ``released``. An ORDERED copy released by the manager
    (its plan committed) is kept, marked ``released``, until the engine sees it complete.
    """

    def __init__(self) -> None:
        self._copies: dict[CopyHandle, object] = {}
        self._next = 1

    def _add(self, copy) -> CopyHandle:
        h, self._next = self._next, self._next + 1
        self._copies[h] = copy
        return h

    def _get(self, handle: CopyHandle):
        try:
            return self._copies[handle]
        except (KeyError, TypeError):  # TypeError: an unhashable "handle"
            raise UnknownCopyHandleError(f"unknown copy handle {handle!r}") from None

    def order_before_compute(self, handle: CopyHandle) -> CopyStatus:
        c = self._get(handle)
        if c.status is CopyStatus.PENDING:
            c.status = CopyStatus.ORDERED
        return c.status

    def release(self, handle: CopyHandle) -> None:
        c = self._get(handle)
        if not c.status.settled:
            raise CopyStateError(f"copy {handle} is still pending; only settled copies can be released")
        if c.status is CopyStatus.ORDERED:
            c.released = True  # it still runs before the next compute; forgotten once it completes
        else:
            del self._copies[handle]

    def pending(self) -> list[CopyHandle]:
        """Handles that may still write, in submission order."""
        return [h for h, c in self._copies.items() if c.status in (CopyStatus.PENDING, CopyStatus.ORDERED)]

    def moves_of(self, handle: CopyHandle) -> tuple[Move, ...]:
        return self._get(handle).moves
