"""``MoveArray`` (integration/fastpath/moves.py): the fast path's packed moves read as the tuple of ``Move`` they
stand for, wherever one is expected."""

from __future__ import annotations

import pickle
from array import array

import pytest

from vtoken.core.errors import InvalidArgumentError
from vtoken.core.plan import Plan, PlanKind
from vtoken.core.token_table import Move
from vtoken.integration.device.copy_engine import packed
from vtoken.integration.fastpath.moves import MoveArray


def test_a_move_array_reads_as_the_tuple_of_moves_it_packs():
    """Iteration, indexing, slicing, ``len``, ``==`` either way round (so plans holding either compare equal),
    ``hash`` and pickling; the device layer's ``packed`` returns its own array and packs a tuple alike. A malformed
    array is refused by name."""
    moves = (Move(4, 1, 2, 0, 3), Move(9, 2, 0, 1, 1))
    a = MoveArray(array("q", [4, 1, 2, 0, 3, 9, 2, 0, 1, 1]))
    assert (list(a), len(a), a[0], a[-1], a[1:]) == (list(moves), 2, moves[0], moves[1], moves[1:])
    assert a == moves and moves == a and a != moves[:1] and hash(a) == hash(moves)
    assert pickle.loads(pickle.dumps(a)) == a and repr(a) == repr(moves)
    assert packed(a) is a.fields and packed(moves) == a.fields
    plan = Plan(PlanKind.DENSIFY, "r", (0, 4), a, (7,), (), 2)
    assert plan == Plan(PlanKind.DENSIFY, "r", (0, 4), moves, (7,), (), 2) and len({plan, plan}) == 1
    with pytest.raises(IndexError):
        a[2]
    for bad in (array("q", [1, 2, 3]), array("i", [0] * 5), [0] * 5):
        with pytest.raises(InvalidArgumentError, match="a MoveArray packs an array"):
            MoveArray(bad)
