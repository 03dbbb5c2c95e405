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


def test_packed_copies_read_as_the_pairs_they_pack_and_sent_copies_as_the_outbox_triples():
    """A step's copies in one record read as the (moves, request) list they stand for (iteration, indexing from
    either end, slicing, ``==`` with that list, pickling), and once sent as (handle, request, moves); a malformed
    record is refused by name."""
    from vtoken.integration.fastpath.moves import PackedCopies, SentCopies

    pairs = [((Move(4, 1, 2, 0, 3),), "a"), ((Move(9, 2, 0, 1, 1), Move(5, 2, 1, 1, 2)), "b")]
    c = PackedCopies(["a", "b"], array("q", [0, 1, 3]), array("q", [4, 1, 2, 0, 3, 9, 2, 0, 1, 1, 5, 2, 1, 1, 2]))
    assert list(c) == pairs and c == pairs and len(c) == 2 and c[-1] == pairs[1] and c[0:1] == pairs[:1]
    assert c[1][0].__class__ is MoveArray and pickle.loads(pickle.dumps(c)) == c
    with pytest.raises(IndexError):
        c[2]
    sent = SentCopies(range(7, 9), c)
    assert list(sent) == [(7, "a", pairs[0][0]), (8, "b", pairs[1][0])] and sent[1] == (8, "b", pairs[1][0])
    assert sent.copy_of(8) == ("b", pairs[1][0]) and pickle.loads(pickle.dumps(sent)).handles == range(7, 9)
    for args, named in (((["a"], array("q", [0, 2, 3]), array("q", [0] * 15)), "one more than the requests"),
                        ((["a", "b"], array("q", [0, 2, 1]), array("q", [0] * 5)), "ascending starts"),
                        ((["a"], array("q", [0, 1]), array("q", [0] * 6)), "a fifth of the fields"),
                        ((("a",), array("q", [0, 1]), array("q", [0] * 5)), "1 requests"),
                        ((["a"], [0, 1], array("q", [0] * 5)), "array('q') each")):
        with pytest.raises(InvalidArgumentError, match="PackedCopies") as e:
            PackedCopies(*args)
        assert named in str(e.value)
    with pytest.raises(InvalidArgumentError, match="a range of handles, one per copy"):
        SentCopies(range(3), c)
