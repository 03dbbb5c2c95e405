"""``WorkerCopyEngine``: the core's ``CopyEngine`` as seen from vLLM's scheduler process.

The scheduler plans; the copies run in the workers, at the top of the next ``execute_model``
(``VTokenConnector.handle_preemptions``), before that step's inputs are prepared and before its
forward. So a submitted copy is ORDERED the moment it is handed over: every later compute step is
issued after it (vLLM runs steps one at a time here; ``compat`` refuses async scheduling and
pipeline parallelism, which would break that). It becomes DONE or FAILED when the workers report
back through ``update_connector_output``.

``before_compute`` is a no-op for the same reason, and ``wait`` (the force-sync ablation) cannot
block on another process: it is refused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from vtoken.core.copy_engine import CopyHandle, CopyRegistry, CopyStatus
from vtoken.core.checks import as_list, check_int, is_int
from vtoken.core.errors import ConfigError, CopyStateError, InvalidArgumentError, VTokenError
from vtoken.core.token_table import Move
from vtoken.integration.fastpath.moves import MoveArray, PackedCopies, SentCopies, copy_pairs


@dataclass
class _Copy:
    moves: tuple[Move, ...]
    req_id: object
    status: CopyStatus = CopyStatus.PENDING
    released: bool = False


def _as_sent(moves: Sequence[Move]) -> Sequence[Move]:
    """A copy's moves as they travel to the workers: a ``MoveArray`` (the fast path's) packed as it is, anything else
    as a tuple of ``Move``."""
    if moves.__class__ is MoveArray or moves.__class__ is tuple and all(m.__class__ is Move for m in moves):
        return moves
    return tuple(Move(*m) for m in moves)


class WorkerCopyEngine(CopyRegistry):
    def __init__(self) -> None:
        super().__init__()
        self._outbox: list = []  # (handle, request, moves) per ``submit``, a ``SentCopies`` per packed step

    # ---- CopyEngine -----------------------------------------------------------------------
    def submit(self, moves: Sequence[Move], req_id: object = None) -> CopyHandle:
        moves = _as_sent(moves)
        copy = _Copy(moves, req_id)
        h = self._add(copy)
        self._outbox.append((h, req_id, copy.moves))
        return h

    def submit_ordered(self, copies: Sequence[tuple[Sequence[Move], object]] | PackedCopies) -> list[CopyStatus]:
        """``submit``, ``order_before_compute`` and ``release`` of each (moves, request), in order, in one pass: the
        copies of the plans the fast path commits at once. Each goes out ORDERED (the workers run it before the next
        compute step) and released, kept until its report. Returns each copy's status (ORDERED). A refused
        ``copies`` (``copy_pairs``) changes nothing.

        A ``PackedCopies`` (the fast path's step) is taken whole: consecutive handles, one outbox record
        (``SentCopies``), each handle registered to that record.

        NOTE: a handle registered to a ``SentCopies`` is ORDERED and released, as every copy of ``submit_ordered``
        is, until its report deletes it; ``_get`` gives its record, read from the batch."""
        if copies.__class__ is PackedCopies:
            n = len(copies)
            if not n:
                return []
            sent = SentCopies(range(self._next, self._next + n), copies)
            self._next += n
            self._copies.update(dict.fromkeys(sent.handles, sent))
            self._outbox.append(sent)
            return [CopyStatus.ORDERED] * n
        outbox, add, statuses = self._outbox, self._add, []
        for moves, req_id in copy_pairs(copies):
            moves = _as_sent(moves)
            outbox.append((add(_Copy(moves, req_id, CopyStatus.ORDERED, True)), req_id, moves))
            statuses.append(CopyStatus.ORDERED)
        return statuses

    def _get(self, handle: CopyHandle) -> _Copy:
        c = super()._get(handle)
        if c.__class__ is SentCopies:
            req_id, moves = c.copy_of(handle)
            return _Copy(moves, req_id, CopyStatus.ORDERED, True)
        return c

    def pending(self) -> list[CopyHandle]:
        return [h for h in self._copies if self._get(h).status in (CopyStatus.PENDING, CopyStatus.ORDERED)]

    def poll(self, handle: CopyHandle) -> CopyStatus:
        return self._get(handle).status

    def wait(self, handle: CopyHandle) -> CopyStatus:
        raise VTokenError("force-sync cannot wait on vLLM's workers from the scheduler; use EVENT ordering")

    def before_compute(self) -> None:
        return None  # the workers copy before they prepare the step's inputs

    # ---- the channel to the workers ------------------------------------------------------------
    def take_outbox(self) -> Sequence[tuple[CopyHandle, object, tuple[Move, ...]]]:
        """The copies to send with the next step's metadata, in submission order: (handle, request, moves) each.
        A step whose copies are one ``PackedCopies`` sends its ``SentCopies`` as it is."""
        out, self._outbox = self._outbox, []
        if len(out) == 1 and out[0].__class__ is SentCopies:
            return out[0]
        return _flat(out)

    def unsent(self) -> list[tuple[CopyHandle, object, tuple[Move, ...]]]:
        """The copies submitted since the last ``take_outbox``, in submission order (read-only)."""
        return _flat(self._outbox)

    def drop_request(self, req_id: object) -> int:
        """The request left before its copies were sent (finished, aborted, preempted): its blocks went
        back to vLLM, so they must not be written. Returns how many copies were dropped."""
        out = _flat(self._outbox)
        dropped = [c for c in out if c[1] == req_id]
        if not dropped:
            return 0
        self._outbox = [c for c in out if c[1] != req_id]
        for h, _, _ in dropped:
            self.report(h, ok=True)  # nothing will run; nothing can race
        return len(dropped)

    def request_of(self, handle: CopyHandle) -> object:
        return self._get(handle).req_id

    def report(self, handle: CopyHandle, ok: bool) -> None:
        """A worker finished (``ok``) or failed a copy."""
        c = self._get(handle)
        if c.status not in (CopyStatus.PENDING, CopyStatus.ORDERED):
            raise VTokenError(f"copy {handle} reported twice")
        c.status = CopyStatus.DONE if ok else CopyStatus.FAILED
        if c.released:
            del self._copies[handle]

    def report_done(self, handles: Sequence[CopyHandle]) -> None:
        """``report(h, ok=True)`` of each, in order (a step's reports: one loop, no call per copy)."""
        copies, running = self._copies, (CopyStatus.PENDING, CopyStatus.ORDERED)
        for h in handles:
            c = copies.get(h) if h.__class__ is int else None
            if c.__class__ is SentCopies:  # ORDERED and released (``submit_ordered``'s NOTE)
                del copies[h]
                continue
            if c is None or c.status not in running:
                self.report(h, ok=True)  # raises, naming the handle
            c.status = CopyStatus.DONE
            if c.released:
                del copies[h]


def _flat(outbox: list) -> list[tuple[CopyHandle, object, tuple[Move, ...]]]:
    """An outbox's records as (handle, request, moves) tuples: each ``SentCopies`` opened into its copies."""
    if not any(c.__class__ is SentCopies for c in outbox):
        return list(outbox)
    return [c for record in outbox for c in (record if record.__class__ is SentCopies else (record,))]


class ShardReports:
    """The workers' copy reports under tensor parallelism, where every rank runs every copy on its own shard of
    the KV heads and reports it: a copy is DONE once all ``ranks`` reported it done, FAILED as soon as one rank
    failed it (that rank's shard of the destination is not what the source held, so the request's K/V is wrong
    there, whatever the other ranks saw). With one rank this passes reports through unchanged.

    NOTE: every rank runs the copies a step's orders carry at the top of that step (the orders are broadcast,
    ``handle_preemptions``), so a copy's reports all arrive in that step's aggregated worker metadata; counting
    across steps is the defensive reading, and a copy reported more often than there are ranks is refused."""

    def __init__(self, ranks: int) -> None:
        check_int("ranks", ranks, 1, error=ConfigError)  # tensor-parallel ranks: a bool, float or str is no count
        self.ranks = ranks
        self._done: dict[int, int] = {}  # copy -> ranks that reported it done, until all have

    def settle(self, done: list[int], failed: list[int]) -> tuple[list[int], list[int]]:
        """This step's reports, every rank's (``done`` and ``failed`` name a copy once per reporting rank). Returns
        (the copies every rank has now reported done, the copies some rank failed), each copy once.

        All or nothing: every report is checked (an int handle; no copy done by more ranks than there are) before
        any is counted, so a refused call leaves the counts as they were."""
        done, failed = as_list("done", done), as_list("failed", failed)
        # NOTE: one rank and a usual step (distinct int handles, none failed) passes the reports through as they are
        if self.ranks == 1 and not failed and all(h.__class__ is int for h in done) and len(set(done)) == len(done):
            return done, []
        for what, handles in (("done", done), ("failed", failed)):
            for h in handles:
                if h.__class__ is not int and not is_int(h):
                    raise InvalidArgumentError(f"{what}: copy handle {h!r} is not an int")
        failed_now = list(dict.fromkeys(failed))
        bad = set(failed_now)
        counts = {}  # copy -> ranks that have reported it done, this step's reports included
        for h, k in Counter(done).items():
            if h in bad:
                continue
            n = self._done.get(h, 0) + k
            if n > self.ranks:
                raise CopyStateError(f"copy {h} reported done by {n} ranks; there are {self.ranks}")
            counts[h] = n
        # -- validated; count --
        done_now = []
        for h, n in counts.items():
            if n == self.ranks:
                done_now.append(h)
                self._done.pop(h, None)
            else:
                self._done[h] = n
        for h in bad:
            self._done.pop(h, None)
        return done_now, failed_now

    def waiting(self) -> dict[int, int]:
        """Copies some but not all ranks reported done: copy -> how many did (read-only)."""
        return dict(self._done)
