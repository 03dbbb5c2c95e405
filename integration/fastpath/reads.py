"""Read lists between the scheduler and the workers: one step's changes of every scheduled request's list as one flat
record (``StepReads``), and the workers' copy of every list (``ReadTable``) that record patches.

On the gather path (and for the score policies) attention reads each request's live slots in logical order, its
read list. The scheduler's table changes it by evictions, a committed plan's moves and the tokens a step syncs; the
workers keep a copy and patch it by those changes (the paper's lookup cache, §3.2), resent whole only on a first
step or past the change log's bound (``VTokenRuntime.read_changes``). A step's changes travel as one record of flat
arrays, whichever runtime made it: the core's answers request by request (``take_step_reads``, the reference), or
the fast path's, taken for every request in one kernel call (``GatherRuntime.read_step``).

The workers' copy is a table of rows (one per request), patched for the whole step in one kernel call
(``read_kernels.patch_reads``) or, where numba cannot run, row by row in numpy (``_patch_numpy``, the kernel's
reference: tests/test_reads.py drives both with the same records). Attention reads a step's rows as one padded batch
(``ReadTable.batch``).

numpy only: ``integration/vllm`` imports this module whichever runtime runs; the kernel is imported where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import Sequence

import numpy as np

from vtoken.core.errors import InvariantViolation
from vtoken.core.runtime import ReadChanges

PATCH, REPLACE, CHECK = 0, 1, 2  # StepReads.whole: what a row's whole list, when sent, is for
# patch_reads' answers (read_kernels, and _patch_numpy): (code, the row's index in the record, the culprit)
OK, STALE, MOVED_MISSING, EVICTED_MISSING, EVICTED_TWICE, JOINED_ORDER, LIST_ORDER, NARROW = range(8)
PAD = np.iinfo(np.int64).max  # the id of padding in a batch (gather_attention.PAD: no query attends it)

def _segments(parts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(starts [n + 1], the parts concatenated) as int64 arrays."""
    starts = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=starts[1:])
    flat = np.fromiter((x for p in parts for x in p), np.int64, int(starts[-1]))
    return starts, flat


@dataclass(eq=False)
class StepReads:
    """The read-list changes of one step's requests (``req_ids``, in order), flat: request i's entries of each part
    lie in ``part[at[i]:at[i + 1]]``. Per request: ``version`` now and ``since`` (the copy must be at it), ``whole``:
    PATCH (the changes only), REPLACE (its whole list in ``lists``, the changes empty: a first step, or a log
    overflow) or CHECK (the changes, and the whole list the patched copy must equal: strict verify). The changes
    are ``VTokenRuntime.read_changes``': ``evicted`` leave, ``moved`` (ascending) take ``moved_slots``, ``joined``
    (ascending, at ``joined_slots``) are appended."""

    req_ids: list
    version: np.ndarray
    since: np.ndarray
    whole: np.ndarray  # int8
    evicted_at: np.ndarray
    evicted: np.ndarray
    moved_at: np.ndarray
    moved: np.ndarray
    moved_slots: np.ndarray
    joined_at: np.ndarray
    joined: np.ndarray
    joined_slots: np.ndarray
    lists_at: np.ndarray
    list_ids: np.ndarray
    list_slots: np.ndarray

    @classmethod
    def of_changes(cls, req_ids: Sequence[object], changes: Sequence[ReadChanges],
                   lists: Sequence[tuple[list[int], list[int]] | None], check: bool) -> "StepReads":
        """From each request's ``ReadChanges`` and its whole list (ids, slots), where one travels."""
        ev_at, ev = _segments([c.evicted for c in changes])
        mv_at, mv = _segments([c.moved for c in changes])
        _, mv_slots = _segments([c.moved_slots for c in changes])
        jn_at, jn = _segments([c.joined for c in changes])
        _, jn_slots = _segments([c.joined_slots for c in changes])
        ls_at, ls_ids = _segments([() if w is None else w[0] for w in lists])
        _, ls_slots = _segments([() if w is None else w[1] for w in lists])
        whole = np.array([REPLACE if c.rebuilt else CHECK if check else PATCH for c in changes], np.int8)
        return cls(list(req_ids), np.array([c.version for c in changes], np.int64),
                   np.array([c.since for c in changes], np.int64), whole, ev_at, ev, mv_at, mv, mv_slots, jn_at, jn,
                   jn_slots, ls_at, ls_ids, ls_slots)

    def __len__(self) -> int:
        return len(self.req_ids)

    def changes(self, i: int) -> ReadChanges:
        """Request i's changes, as ``VTokenRuntime.read_changes`` answers them."""
        if self.whole[i] == REPLACE:
            return ReadChanges(int(self.version[i]), int(self.since[i]), True)
        part = lambda a, at: tuple(a[at[i]:at[i + 1]].tolist())  # noqa: E731
        return ReadChanges(int(self.version[i]), int(self.since[i]), False, part(self.evicted, self.evicted_at),
                           part(self.joined, self.joined_at), part(self.joined_slots, self.joined_at),
                           part(self.moved, self.moved_at), part(self.moved_slots, self.moved_at))

    def whole_list(self, i: int) -> tuple[list[int], list[int]] | None:
        """Request i's whole list (ids, slots), where it travels."""
        if self.whole[i] == PATCH:
            return None
        a, b = self.lists_at[i], self.lists_at[i + 1]
        return self.list_ids[a:b].tolist(), self.list_slots[a:b].tolist()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepReads) and self.first_difference(other) is None

    __hash__ = None

    def first_difference(self, other: "StepReads") -> str | None:
        """Where two records first differ (a request and what), or None."""
        if list(self.req_ids) != list(other.req_ids):
            return f"requests {list(self.req_ids)[:8]} against {list(other.req_ids)[:8]}"
        for i, r in enumerate(self.req_ids):
            for name, a, b in (("changes", self.changes(i), other.changes(i)),
                               ("whole", int(self.whole[i]), int(other.whole[i])),
                               ("whole list", self.whole_list(i), other.whole_list(i))):
                if a != b:
                    return f"request {r!r} {name}: {a!r} against {b!r}"
        return None


def take_step_reads(rt, req_ids: Sequence[object], check: bool) -> StepReads:
    """The reference: ``rt.read_changes`` of each request in order (any runtime with the core's ``read_changes`` and
    ``read_lists``), and its whole list where it is rebuilt, or everywhere under ``check``."""
    changes = [rt.read_changes(r) for r in req_ids]
    lists = [rt.read_lists(r) if c.rebuilt or check else None for r, c in zip(req_ids, changes)]
    return StepReads.of_changes(req_ids, changes, lists, check)


def list_start(start: int, n: int, first: int, last: int, evicted: int, joined: int, width: int) -> tuple[int, int]:
    """Where a row's list of ``n`` entries from column ``start`` lies once ``evicted`` of them leave (the first at
    position ``first``, the last at ``last``), and where it starts once ``joined`` are appended. The kept entries
    start at ``start`` plus ``evicted`` when fewer precede the last than follow the first (those before it move up),
    else at ``start`` (those after the first move down); the list moves to column 0 when the appends would pass
    ``width``. One rule for the kernel (``read_kernels``, compiled from this function) and its numpy reference."""
    kept = start + evicted if evicted and last < n - 1 - first else start
    return kept, 0 if kept + n - evicted + joined > width else kept


class ReadTable:
    """The workers' copy of every request's read list: row ``row_of[rid]`` holds ``length[row]`` live slots and their
    ids (ascending: logical order) from column ``start[row]``, every other column ``PAD`` ids and slot 0, at layout
    version ``version[row]``. Grows (rows and width, doubling) as requests and lists need; a row is freed by
    ``forget``. NOTE: an eviction closes its gap from the list's nearer end (``list_start``), so a list may start
    past column 0; it moves back to 0 when an append would pass the width.

    ``compiled``: patch with ``read_kernels.patch_reads`` (one call per step), else ``_patch_numpy`` row by row."""

    def __init__(self, compiled: bool, rows: int = 8, width: int = 64) -> None:
        self.compiled = compiled
        self.slots = np.zeros((rows, width), np.int64)
        self.ids = np.full((rows, width), PAD, np.int64)
        self.start = np.zeros(rows, np.int64)
        self.length = np.zeros(rows, np.int64)
        self.version = np.full(rows, -1, np.int64)
        self.row_of: dict[object, int] = {}
        self._free = list(range(rows - 1, -1, -1))

    def __contains__(self, rid: object) -> bool:
        return rid in self.row_of

    def forget(self, rid: object) -> None:
        row = self.row_of.pop(rid, None)
        if row is not None:
            a, b = self.start[row], self.start[row] + self.length[row]
            self.ids[row, a:b], self.slots[row, a:b] = PAD, 0
            self.start[row], self.length[row], self.version[row] = 0, 0, -1
            self._free.append(row)

    def lists(self, rid: object) -> tuple[np.ndarray, np.ndarray]:
        """(slots, ids) of the request's list: views into the table, valid until the next ``apply``."""
        row = self.row_of[rid]
        a, b = self.start[row], self.start[row] + self.length[row]
        return self.slots[row, a:b], self.ids[row, a:b]

    def batch(self, req_ids: Sequence[object]) -> tuple[np.ndarray, np.ndarray]:
        """The requests' lists as one batch: (slots, ids), int64 [R, N] copies, N the longest list, padded with slot
        0 and id ``PAD``."""
        rows = np.fromiter(map(self.row_of.__getitem__, req_ids), np.int64, len(req_ids))
        n = int(self.length[rows].max()) if len(rows) else 0
        if self.compiled:
            from .read_kernels import batch_rows
            slots, ids = np.empty((len(rows), n), np.int64), np.empty((len(rows), n), np.int64)
            batch_rows(self.slots, self.ids, self.start, self.length, rows, PAD, slots, ids)
            return slots, ids
        columns = self.start[rows, None] + np.arange(n)
        held = np.arange(n) < self.length[rows, None]
        columns[~held] = 0
        return (np.where(held, self.slots[rows[:, None], columns], 0),
                np.where(held, self.ids[rows[:, None], columns], PAD))

    def apply(self, reads: StepReads) -> np.ndarray:
        """Patch the rows of ``reads``' requests (a new request's must be REPLACE); checked first, nothing changed
        on a refusal (V2, naming the request and the token). Then each CHECK row must equal its whole list (V2).
        Returns, aligned with ``reads.evicted``, the position each evicted token held in its row before the patch
        (ascending per request): what the score policies' statistics drop with it."""
        req_ids, whole, row_of = reads.req_ids, reads.whole, self.row_of
        if len(set(req_ids)) != len(req_ids):
            raise InvariantViolation("V2", f"a step's read-list changes name a request twice: {list(req_ids)[:8]}")
        rows = np.fromiter(map(row_of.get, req_ids, repeat(-1)), np.int64, len(req_ids))
        new = np.flatnonzero(rows < 0).tolist()
        for i in new:  # NOTE: a steady step has none
            if whole[i] != REPLACE:
                raise InvariantViolation("V2", f"request {req_ids[i]!r}: a read-list change since layout version "
                                               f"{int(reads.since[i])}, the worker's copy is at None")
        for i in new:
            rows[i] = self._take_row(req_ids[i])
        removed = np.empty(len(reads.evicted), np.int64)
        patch = _patch_compiled if self.compiled else _patch_numpy
        code, i, culprit = patch(self, rows, reads, removed)
        if code == NARROW:
            self._widen(int(culprit))
            code, i, culprit = patch(self, rows, reads, removed)
        if code != OK:
            for k in new:
                self.forget(req_ids[k])
            raise InvariantViolation("V2", _refusal(code, reads.req_ids[i], int(culprit), reads, i))
        for i in (np.flatnonzero(whole == CHECK).tolist() if whole.any() else ()):
            slots, ids = self.lists(req_ids[i])
            want = reads.whole_list(i)
            if ids.tolist() != want[0] or slots.tolist() != want[1]:
                raise InvariantViolation("V2", f"request {req_ids[i]!r}: the worker's patched read list (ids "
                                               f"{ids[:8].tolist()}..., {len(ids)}) is not the table's (ids "
                                               f"{want[0][:8]}..., {len(want[0])})")
        return removed

    def _take_row(self, rid: object) -> int:
        if not self._free:
            n = len(self.length)
            self.slots = np.concatenate((self.slots, np.zeros_like(self.slots)))
            self.ids = np.concatenate((self.ids, np.full_like(self.ids, PAD)))
            self.start = np.concatenate((self.start, np.zeros(n, np.int64)))
            self.length = np.concatenate((self.length, np.zeros(n, np.int64)))
            self.version = np.concatenate((self.version, np.full(n, -1, np.int64)))
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self.row_of[rid] = self._free.pop()
        return row

    def _widen(self, need: int) -> None:
        width = self.ids.shape[1]
        while width < need:
            width *= 2
        rows, old = self.ids.shape[0], self.ids.shape[1]
        slots, ids = np.zeros((rows, width), np.int64), np.full((rows, width), PAD, np.int64)
        slots[:, :old], ids[:, :old] = self.slots, self.ids
        self.slots, self.ids = slots, ids


def _patch_compiled(table: ReadTable, rows: np.ndarray, r: StepReads, removed: np.ndarray) -> tuple[int, int, int]:
    from .read_kernels import patch_reads
    return patch_reads(table.slots, table.ids, table.start, table.length, table.version, rows, r.version, r.since,
                       r.whole, r.evicted_at, r.evicted, r.moved_at, r.moved, r.moved_slots, r.joined_at, r.joined,
                       r.joined_slots, r.lists_at, r.list_ids, r.list_slots, PAD, removed,
                       np.empty(len(r.moved), np.int64))


def _patch_numpy(table: ReadTable, rows: np.ndarray, r: StepReads, removed: np.ndarray) -> tuple[int, int, int]:
    """``patch_reads``' reference, row by row in numpy: every row checked, then every row patched."""
    found, widest, wide_at = [], 0, 0
    for i, row in enumerate(rows.tolist()):
        if r.whole[i] == REPLACE:
            ids = r.list_ids[r.lists_at[i]:r.lists_at[i + 1]]
            bad = np.flatnonzero(np.diff(ids) <= 0)
            if len(bad):
                return LIST_ORDER, i, ids[bad[0] + 1]
            if len(ids) and ids[0] < 0:
                return LIST_ORDER, i, ids[0]
            if len(ids) > widest:
                widest, wide_at = len(ids), i
            found.append(None)
            continue
        if table.version[row] != r.since[i]:
            return STALE, i, table.version[row]
        ids = table.ids[row, table.start[row]:table.start[row] + table.length[row]]
        places = []
        for code, part in ((MOVED_MISSING, r.moved[r.moved_at[i]:r.moved_at[i + 1]]),
                           (EVICTED_MISSING, r.evicted[r.evicted_at[i]:r.evicted_at[i + 1]])):
            at = np.minimum(np.searchsorted(ids, part), max(len(ids) - 1, 0))
            missing = np.flatnonzero(ids[at] != part) if len(ids) else np.arange(len(part))
            if len(missing):
                return code, i, part[missing[0]]
            places.append(at)
        gone = np.sort(places[1])
        twice = np.flatnonzero(np.diff(gone) == 0)
        if len(twice):
            return EVICTED_TWICE, i, ids[gone[twice[0]]]
        kept = np.delete(ids, gone)
        joined = r.joined[r.joined_at[i]:r.joined_at[i + 1]]
        order = np.concatenate((kept[-1:] if len(kept) else np.array([-1], np.int64), joined))
        bad = np.flatnonzero(np.diff(order) <= 0)
        if len(bad):
            return JOINED_ORDER, i, order[bad[0] + 1]
        removed[r.evicted_at[i]:r.evicted_at[i + 1]] = gone
        if len(kept) + len(joined) > widest:
            widest, wide_at = len(kept) + len(joined), i
        found.append((places[0], gone))
    if widest > table.ids.shape[1]:
        return NARROW, wide_at, widest
    for i, (row, places) in enumerate(zip(rows.tolist(), found)):
        start, old = table.start[row], table.length[row]
        if places is None:
            at = 0
            ids = r.list_ids[r.lists_at[i]:r.lists_at[i + 1]]
            slots = r.list_slots[r.lists_at[i]:r.lists_at[i + 1]]
        else:
            gone = places[1]
            _, at = list_start(start, old, gone[0] if len(gone) else 0, gone[-1] if len(gone) else 0, len(gone),
                               r.joined_at[i + 1] - r.joined_at[i], table.ids.shape[1])
            slots = table.slots[row, start:start + old].copy()
            slots[places[0]] = r.moved_slots[r.moved_at[i]:r.moved_at[i + 1]]
            ids = np.delete(table.ids[row, start:start + old], gone)
            slots = np.delete(slots, gone)
            ids = np.concatenate((ids, r.joined[r.joined_at[i]:r.joined_at[i + 1]]))
            slots = np.concatenate((slots, r.joined_slots[r.joined_at[i]:r.joined_at[i + 1]]))
        n = len(ids)
        table.ids[row, start:start + old], table.slots[row, start:start + old] = PAD, 0
        table.ids[row, at:at + n], table.slots[row, at:at + n] = ids, slots
        table.start[row], table.length[row], table.version[row] = at, n, r.version[i]
    return OK, 0, 0


def _refusal(code: int, rid: object, culprit: int, reads: StepReads, i: int) -> str:
    if code == STALE:
        return (f"request {rid!r}: a read-list change since layout version {int(reads.since[i])}, the worker's copy "
                f"is at {culprit}")
    what = {MOVED_MISSING: f"moved token {culprit} is not in the worker's read list",
            EVICTED_MISSING: f"evicted token {culprit} is not in the worker's read list",
            EVICTED_TWICE: f"evicted token {culprit} is named twice",
            JOINED_ORDER: f"joined token {culprit} is not newer than every token before it",
            LIST_ORDER: f"its whole read list is not ascending at token {culprit}"}[code]
    return f"request {rid!r}: {what}"
