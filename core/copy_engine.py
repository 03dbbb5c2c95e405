"""The ``CopyEngine`` protocol: how the core asks a device to move K/V entries.

The core decides what moves; an engine moves it. Engines: ``InMemoryCopyEngine``
(core/inmemory.py, tags instead of tensors, with test controls for late,
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
from typing import Protocol, Sequence

from .errors import VTokenError
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
        except KeyError:
            raise VTokenError(f"unknown copy handle {handle!r}") from None

    def order_before_compute(self, handle: CopyHandle) -> CopyStatus:
        c = self._get(handle)
        if c.status is CopyStatus.PENDING:
            c.status = CopyStatus.ORDERED
        return c.status

    def release(self, handle: CopyHandle) -> None:
        c = self._get(handle)
        if not c.status.settled:
            raise VTokenError(f"copy {handle} is still pending; only settled copies can be released")
        if c.status is CopyStatus.ORDERED:
            c.released = True  # it still runs before the next compute; forgotten once it completes
        else:
            del self._copies[handle]

    def pending(self) -> list[CopyHandle]:
        """Handles that may still write, in submission order."""
        return [h for h, c in self._copies.items() if c.status in (CopyStatus.PENDING, CopyStatus.ORDERED)]

    def moves_of(self, handle: CopyHandle) -> tuple[Move, ...]:
        return self._get(handle).moves
