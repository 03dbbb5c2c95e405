"""Moves packed in ``array('q')``, five int64 per move (``Move``'s fields in order): a plan's (``MoveArray``) and a
step's copies (``PackedCopies``, and ``SentCopies`` once an engine gave them handles).

What the fast path's kernels hand out without making a ``Move`` per token. It reads as the tuple of ``Move`` it
stands for (iteration, indexing, ``len``, ``==`` with a tuple either way round, ``hash``), so the core, the shadow's
comparisons and every consumer of plans and copies take it unchanged; the hot ones (the scheduler's hash drops, the
copy channel, the workers' check and launch) read ``fields``, the array itself, and never make the ``Move``s
(``integration/device/copy_engine.packed``). Stdlib only: the device layer reads it by that one attribute.

A step's copies travel the same way: one ``PackedCopies`` from the fast path's commit to the scheduler's engine,
one ``SentCopies`` in the step's orders to the workers, whose wave split reads its two arrays. Both read as the
lists of tuples they stand for, so a consumer that iterates (the shadow, strict verify's checks, the core's
engines) is unchanged.
"""

from __future__ import annotations

from array import array
from typing import Sequence

from vtoken.core.checks import as_list
from vtoken.core.errors import InvalidArgumentError
from vtoken.core.token_table import Move


def copy_pairs(copies: object) -> list:
    """A step's copies for an engine's ``submit_ordered`` (the fast path's engines: the scheduler's
    ``WorkerCopyEngine``, the shadow's): a list of (moves, request) tuples, or an ``InvalidArgumentError`` naming the
    first item that is not one."""
    copies = as_list("copies", copies)
    for c in copies:
        if c.__class__ is not tuple or len(c) != 2:
            raise InvalidArgumentError(f"copies: each is a (moves, request) tuple, got {c!r}")
    return copies


class MoveArray(Sequence[Move]):
    __slots__ = ("fields",)

    def __init__(self, fields: array) -> None:
        if fields.__class__ is not array or fields.typecode != "q" or len(fields) % 5:
            raise InvalidArgumentError(f"a MoveArray packs an array('q') of five fields per move, got "
                                       f"{type(fields).__name__} {getattr(fields, 'typecode', '')!r} of "
                                       f"{len(fields) if hasattr(fields, '__len__') else '?'}")
        self.fields = fields

    def __len__(self) -> int:
        return len(self.fields) // 5

    def __iter__(self):
        f = iter(self.fields)
        return map(Move, f, f, f, f, f)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("move index out of range")
        i %= n
        return Move(*self.fields[5 * i:5 * i + 5])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MoveArray):
            return self.fields == other.fields
        if isinstance(other, tuple):
            return tuple(self) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __reduce__(self):
        return MoveArray, (self.fields,)


class PackedCopies(Sequence[tuple[MoveArray, object]]):
    """A step's copies in one record: copy k is request ``req_ids[k]``'s moves, ``Move``'s five fields per move in
    ``fields[5 * starts[k]:5 * starts[k + 1]]`` (``starts`` and ``fields`` one ``array('q')`` each). What the fast
    path hands its engine for a whole step (``submit_ordered``) without a Python object per copy. It reads as the
    list of (moves, request) pairs it stands for (each moves a ``MoveArray``), so every engine takes it; the hot
    ones (the scheduler's registration, the workers' wave split) read ``starts`` and ``fields``."""

    __slots__ = ("req_ids", "starts", "fields")

    def __init__(self, req_ids: list, starts: array, fields: array) -> None:
        if req_ids.__class__ is not list or starts.__class__ is not array or fields.__class__ is not array \
                or starts.typecode != "q" or fields.typecode != "q" or len(starts) != len(req_ids) + 1 \
                or starts[0] != 0 or len(fields) != 5 * starts[-1] or starts.tolist() != sorted(starts):
            raise InvalidArgumentError(f"PackedCopies: {len(req_ids) if hasattr(req_ids, '__len__') else '?'} "
                                       f"requests need ascending starts from 0, one more than the requests, ending at "
                                       f"a fifth of the fields (array('q') each)")
        self.req_ids, self.starts, self.fields = req_ids, starts, fields

    def __len__(self) -> int:
        return len(self.req_ids)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        n = len(self.req_ids)
        if not -n <= k < n:
            raise IndexError("copy index out of range")
        k %= n
        a, b = self.starts[k], self.starts[k + 1]
        return MoveArray(self.fields[5 * a:5 * b]), self.req_ids[k]

    def __iter__(self):
        f, s = self.fields, self.starts
        return (((MoveArray(f[5 * s[k]:5 * s[k + 1]])), r) for k, r in enumerate(self.req_ids))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedCopies):
            return (self.req_ids, self.starts, self.fields) == (other.req_ids, other.starts, other.fields)
        return list(self) == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PackedCopies({list(self)!r})"

    def __reduce__(self):
        return PackedCopies, (self.req_ids, self.starts, self.fields)


class SentCopies(Sequence[tuple[int, object, MoveArray]]):
    """``PackedCopies`` once an engine took them: copy k has handle ``handles[k]`` (consecutive handles, a ``range``).
    Reads as the list of (handle, request, moves) an engine's outbox holds; the workers read ``copies`` whole."""

    __slots__ = ("handles", "copies")

    def __init__(self, handles: range, copies: PackedCopies) -> None:
        if handles.__class__ is not range or copies.__class__ is not PackedCopies or len(handles) != len(copies):
            raise InvalidArgumentError(f"SentCopies: a range of handles, one per copy of a PackedCopies; got "
                                       f"{handles!r} for {type(copies).__name__}")
        self.handles, self.copies = handles, copies

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        moves, r = self.copies[k]
        return self.handles[k], r, moves

    def __iter__(self):
        return ((h, r, moves) for h, (moves, r) in zip(self.handles, self.copies))

    def copy_of(self, handle: int) -> tuple[object, MoveArray]:
        """(request, moves) of the copy with ``handle`` (one of ``handles``)."""
        moves, r = self.copies[handle - self.handles.start]
        return r, moves

    def __reduce__(self):
        return SentCopies, (self.handles, self.copies)
