"""In-memory devices: a KV store of content tags and a copy engine with test controls.

Real K/V tensors are replaced by one integer tag per slot. A model "writes" a
token by storing its tag; copies really move tags. If any layer of the core
loses, duplicates or misdirects a token, the tags read through a request's
attention slots stop matching its live tokens (I1), which is how the tests,
the simulator and the fuzzer catch it.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from ..copy_engine import CopyHandle, CopyRegistry, CopyStatus, check_moves
from ..checks import check_int
from ..errors import BlockOutOfRangeError, ConfigError, CopyStateError
from ..token_table import Move

EMPTY_TAG = 0  # a slot never written
_TAG_LIMIT = 1 << 63  # a tag is a signed 64-bit int (array('q'))


class TagStore:
    """One tag per physical slot of the pool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        check_int("num_blocks", num_blocks, 1, error=ConfigError)
        check_int("block_size", block_size, 1, error=ConfigError)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tags = array("q", bytes(8 * num_blocks * block_size))

    def write(self, slot: int, tag: int) -> None:
        """Refused as ``TensorTagStore.write`` refuses it: a slot outside the store (a negative one would index
        from the end), a bool or non-int slot, a tag beyond 64 bits."""
        if slot.__class__ is not int or not 0 <= slot < len(self.tags):
            self._refuse_slot(slot)
        if tag.__class__ is not int or not -_TAG_LIMIT <= tag < _TAG_LIMIT:
            check_int("tag", tag, -_TAG_LIMIT, _TAG_LIMIT - 1)
        self.tags[slot] = tag

    def read(self, slot: int) -> int:
        if slot.__class__ is not int or not 0 <= slot < len(self.tags):
            self._refuse_slot(slot)
        return self.tags[slot]

    def _refuse_slot(self, slot: object) -> None:
        check_int("slot", slot, 0, len(self.tags) - 1, error=BlockOutOfRangeError,
                  hint=f" ({self.num_blocks} blocks of {self.block_size})")

    def state(self) -> bytes:
        return self.tags.tobytes()


class _Copy:
    __slots__ = ("moves", "status", "released")

    def __init__(self, moves: tuple[Move, ...]) -> None:
        self.moves = moves
        self.status = CopyStatus.PENDING
        self.released = False


class InMemoryCopyEngine(CopyRegistry):
    """A copy engine over a ``TagStore``.

    With ``auto_complete`` (the default) a copy is DONE as soon as it is
    submitted. Without it, copies stay PENDING until the test or fuzzer calls
    ``complete`` or ``fail``; ordered copies complete at the next
    ``before_compute``, as a GPU stream waiting on an event would. ``fail_next_submit``
    makes the next ``submit`` raise, as a device whose copy launch fails would.

    ``one_stream`` (the default) is the real engine's device: every copy runs on one relocation
    stream (``integration/device/copy_engine.py``), so copies finish in the order they were submitted.
    Completing, failing or waiting for a copy first completes every earlier unsettled one, and an
    ordered copy that runs drains the stream up to it. ``one_stream=False`` lets unordered copies
    finish in any order (each behind only the earlier *ordered* ones): no engine vtoken ships
    does that, so it is only for tests that exercise the manager against an arbitrary device.
    """

    def __init__(self, store: TagStore, auto_complete: bool = True, one_stream: bool = True) -> None:
        super().__init__()
        self.store = store
        self.auto_complete = auto_complete
        self.one_stream = one_stream
        self.events = {"submitted": 0, "completed": 0, "failed": 0, "waited": 0, "refused": 0}
        self._refuse_next: Exception | None = None  # raised by the next submit (test control)

    # ---- CopyEngine --------------------------------------------------------------
    def submit(self, moves: Sequence[Move], req_id: object = None) -> CopyHandle:
        """Validated like every engine (``check_moves``); a refused submit registers and writes nothing."""
        batch = check_moves(moves, self.store.num_blocks, self.store.block_size, req_id)
        if self._refuse_next is not None:
            err, self._refuse_next = self._refuse_next, None
            self.events["refused"] += 1
            raise err
        h = self._add(_Copy(batch))
        self.events["submitted"] += 1
        if self.auto_complete:
            self._execute(h)
        return h

    def poll(self, handle: CopyHandle) -> CopyStatus:
        return self._get(handle).status

    def wait(self, handle: CopyHandle) -> CopyStatus:
        c = self._get(handle)
        self.events["waited"] += 1
        if c.status in (CopyStatus.PENDING, CopyStatus.ORDERED):
            self._execute(handle)
        return c.status

    def statuses(self) -> list[tuple[CopyHandle, CopyStatus, bool]]:
        """Every registered copy, its status and whether its owner released it, in submission order (the
        fuzzer's stream-order and handle-leak oracles). A released copy stays registered until it has run."""
        return [(h, c.status, c.released) for h, c in sorted(self._copies.items())]

    # ---- the simulated compute stream ---------------------------------------------
    def before_compute(self) -> None:
        """A compute step is about to read KV: ordered copies finish first (wait_event)."""
        for h in sorted(self._copies):
            if self._copies[h].status is CopyStatus.ORDERED:
                self._execute(h)

    # ---- test controls -------------------------------------------------------------
    def fail_next_submit(self, error: Exception | None = None) -> None:
        """Make the next ``submit`` raise ``error`` (default: a RuntimeError, as a failed CUDA launch raises)
        after validating its moves and before registering or writing anything."""
        self._refuse_next = error if error is not None else RuntimeError("copy launch failed (injected)")

    def complete(self, handle: CopyHandle) -> None:
        c = self._get(handle)
        if c.status not in (CopyStatus.PENDING, CopyStatus.ORDERED):
            raise CopyStateError(f"copy {handle} is {c.status.value}; only pending copies can complete")
        self._execute(handle)

    def fail(self, handle: CopyHandle, written: int = 0) -> None:
        """Fail a pending copy after it wrote its first ``written`` destinations."""
        c = self._get(handle)
        if c.status is not CopyStatus.PENDING:
            raise CopyStateError(f"copy {handle} is {c.status.value}; only an unordered pending copy can fail")
        if not isinstance(written, int) or isinstance(written, bool) or not 0 <= written <= len(c.moves):
            raise CopyStateError(f"copy {handle}: written={written!r}; expected an int in [0, {len(c.moves)}] "
                                 f"(the destinations it wrote before failing)")
        self._drain_before(handle)
        self._write(c.moves[:written])
        c.status = CopyStatus.FAILED
        self.events["failed"] += 1

    # ---- helpers ---------------------------------------------------------------------
    def _execute(self, handle: CopyHandle) -> None:
        self._drain_before(handle)
        c = self._copies[handle]
        self._write(c.moves)
        c.status = CopyStatus.DONE
        self.events["completed"] += 1
        if c.released:
            del self._copies[handle]

    def _drain_before(self, handle: CopyHandle) -> None:
        """Copies submitted before ``handle`` that must run first: on one stream every unsettled one (FIFO),
        otherwise the ordered ones (later work runs after the event it waits on)."""
        # NOTE: handles are issued in submission order (CopyRegistry._add), so h < handle means "earlier"
        waits = (CopyStatus.PENDING, CopyStatus.ORDERED) if self.one_stream else (CopyStatus.ORDERED,)
        for h in sorted(self._copies):
            if h < handle and self._copies[h].status in waits:
                self._execute(h)

    def _write(self, moves: Sequence[Move]) -> None:
        S = self.store.block_size
        values = [self.store.read(m.src_block * S + m.src_offset) for m in moves]  # read all first
        for m, v in zip(moves, values):
            self.store.write(m.dst_block * S + m.dst_offset, v)
