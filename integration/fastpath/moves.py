"""``MoveArray``: a plan's moves packed in one ``array('q')``, five int64 per move (``Move``'s fields in order).

What the fast path's kernels hand out without making a ``Move`` per token. It reads as the tuple of ``Move`` it
stands for (iteration, indexing, ``len``, ``==`` with a tuple either way round, ``hash``), so the core, the shadow's
comparisons and every consumer of plans and copies take it unchanged; the hot ones (the scheduler's hash drops, the
copy channel, the workers' check and launch) read ``fields``, the array itself, and never make the ``Move``s
(``integration/device/copy_engine.packed``). Stdlib only: the device layer reads it by that one attribute.
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
