"""Read lists between the scheduler and the workers (``integration/fastpath/reads.py``): the step's flat record of
changes, and the workers' table it patches, by the compiled kernel and by its numpy reference, which must answer
alike: the same lists, the same refusals with the same messages, nothing changed by a refusal.

The fast machine (``vtoken fuzz --target fast``, tests/test_fastpath_runtime.py) drives both tables with every
step's record of a shadowed runtime; these tests reach each refusal by hand."""

from __future__ import annotations

import numpy as np
import pytest

from vtoken.core.errors import InvariantViolation
from vtoken.core.runtime import ReadChanges
from vtoken.integration.fastpath import available
from vtoken.integration.fastpath.reads import CHECK, PAD, PATCH, REPLACE, ReadTable, StepReads

pytestmark = pytest.mark.skipif(not available(), reason="the compiled kernels need numba")


def record(*rows, check=False) -> StepReads:
    """``rows``: (request, ReadChanges, whole list (ids, slots) or None)."""
    return StepReads.of_changes([r for r, _, _ in rows], [c for _, c, _ in rows], [w for _, _, w in rows], check)


def both() -> tuple[ReadTable, ReadTable]:
    return ReadTable(compiled=True, rows=2, width=4), ReadTable(compiled=False, rows=2, width=4)


def snapshot(t: ReadTable) -> tuple:
    return (dict(t.row_of), t.slots.tolist(), t.ids.tolist(), t.start.tolist(), t.length.tolist(), t.version.tolist())


def test_a_record_reads_back_the_changes_it_was_made_of():
    a = ReadChanges(3, 2, False, evicted=(4, 1), joined=(9,), joined_slots=(17,), moved=(2,), moved_slots=(30,))
    b = ReadChanges(1, -1, True)
    reads = record(("a", a, None), ("b", b, ([0, 5], [8, 9])))
    assert reads.changes(0) == a and reads.changes(1) == b
    assert reads.whole.tolist() == [PATCH, REPLACE]
    assert reads.whole_list(0) is None and reads.whole_list(1) == ([0, 5], [8, 9])
    assert reads == record(("a", a, None), ("b", b, ([0, 5], [8, 9])))
    other = record(("a", a, None), ("b", b, ([0, 5], [8, 10])))
    assert reads != other and reads.first_difference(other) == "request 'b' whole list: ([0, 5], [8, 9]) against " \
                                                               "([0, 5], [8, 10])"
    assert record(("a", a, ([0, 2], [1, 30])), check=True).whole.tolist() == [CHECK]


def test_the_tables_padding_is_the_id_attention_never_attends():
    from vtoken.integration.device.gather_attention import PAD as ATTENTION_PAD
    assert PAD == ATTENTION_PAD


def test_both_tables_patch_grow_and_batch_alike():
    """A first list, then evictions (first, middle, last), a move and appends past the width: both tables grow
    (rows and width) and hold the same lists; a batch pads with PAD ids and slot 0."""
    tables = both()
    ids, slots = list(range(6)), [10 + t for t in range(6)]
    steps = [record(("a", ReadChanges(0, -1, True), (ids, slots)), ("b", ReadChanges(0, -1, True), ([2], [50])),
                    ("c", ReadChanges(0, -1, True), ([], []))),
             record(("a", ReadChanges(1, 0, False, evicted=(5, 0, 3), joined=(6, 7, 8, 9, 10), joined_slots=(1, 2, 3, 4, 5),
                                      moved=(2,), moved_slots=(40,)), None),
                    ("c", ReadChanges(0, 0, False, joined=(0,), joined_slots=(7,)), None))]
    for table in tables:
        removed = [table.apply(r).tolist() for r in steps]
        assert removed == [[], [0, 3, 5]]
        assert [x.tolist() for x in table.lists("a")] == [[11, 40, 14, 1, 2, 3, 4, 5], [1, 2, 4, 6, 7, 8, 9, 10]]
        assert table.ids.shape[0] >= 3 and table.ids.shape[1] >= 8
        slots_b, ids_b = table.batch(["b", "a", "c"])
        assert ids_b.tolist()[0] == [2] + [PAD] * 7 and slots_b.tolist()[0] == [50] + [0] * 7
        assert ids_b.tolist()[2] == [0] + [PAD] * 7
    assert snapshot(tables[0]) == snapshot(tables[1])
    for table in tables:
        table.forget("a")
        assert "a" not in table and table.ids[:, 4:].tolist() == [[PAD] * (table.ids.shape[1] - 4)] * table.ids.shape[0]


def test_an_eviction_near_the_head_moves_the_head_and_an_append_past_the_width_moves_the_list_back():
    """StreamingLLM evicts just past its sinks: the entries before the evicted one move up and the list starts one
    column later (two evictions: two), not the whole tail down; evictions nearer the end still move the tail. An
    append that would pass the width moves the list back to column 0. Both tables place every list alike, and the
    lists, batches and removed positions are the same as without the placement."""
    tables = ReadTable(compiled=True, rows=2, width=8), ReadTable(compiled=False, rows=2, width=8)
    ids, slots = list(range(8)), [100 + t for t in range(8)]
    steps = [
        (record(("a", ReadChanges(0, -1, True), (ids, slots))), [], 0, ids),
        (record(("a", ReadChanges(1, 0, False, evicted=(1,)), None)), [1], 1, [0, 2, 3, 4, 5, 6, 7]),
        (record(("a", ReadChanges(2, 1, False, evicted=(3, 2), moved=(0,), moved_slots=(90,)), None)), [1, 2], 3,
         [0, 4, 5, 6, 7]),
        (record(("a", ReadChanges(3, 2, False, evicted=(6,)), None)), [3], 3, [0, 4, 5, 7]),  # nearer the end
        (record(("a", ReadChanges(4, 3, False, joined=(8,), joined_slots=(108,)), None)), [], 3, [0, 4, 5, 7, 8]),
        (record(("a", ReadChanges(5, 4, False, joined=(9,), joined_slots=(109,)), None)), [], 0,
         [0, 4, 5, 7, 8, 9]),  # column 3 + 6 would pass the width
    ]
    for table in tables:
        for k, (reads, removed, start, want) in enumerate(steps):
            assert table.apply(reads).tolist() == removed
            got_slots, got_ids = table.lists("a")
            assert table.start.tolist()[0] == start and got_ids.tolist() == want
            assert got_slots.tolist() == [90 if t == 0 and k >= 2 else 100 + t for t in want]  # 0 moved at step 2
            held = table.ids[0] != PAD
            assert held.sum() == len(want) and (table.slots[0][~held] == 0).all()  # the rest padding
        batch_slots, batch_ids = table.batch(["a"])
        assert batch_ids.tolist() == [[0, 4, 5, 7, 8, 9]] and batch_slots.tolist() == [[90, 104, 105, 107, 108, 109]]
        table.apply(record(("b", ReadChanges(0, -1, True), ([3], [33]))))
        table.apply(record(("a", ReadChanges(6, 5, False, evicted=(4,)), None)))
        assert table.start.tolist()[0] == 1
        batch_slots, batch_ids = table.batch(["b", "a"])
        assert batch_ids.tolist() == [[3] + [PAD] * 4, [0, 5, 7, 8, 9]]
        assert batch_slots.tolist() == [[33, 0, 0, 0, 0], [90, 105, 107, 108, 109]]
        table.forget("a")
        assert table.ids[0].tolist() == [PAD] * 8 and table.slots[0].tolist() == [0] * 8 and table.start[0] == 0
    assert snapshot(tables[0]) == snapshot(tables[1])


@pytest.mark.parametrize("bad, message", [
    (("a", ReadChanges(2, 1, False), None), "request 'a': a read-list change since layout version 1, the worker's "
                                           "copy is at 0"),
    (("a", ReadChanges(1, 0, False, moved=(7,), moved_slots=(3,)), None), "request 'a': moved token 7 is not in "
                                                                          "the worker's read list"),
    (("a", ReadChanges(1, 0, False, evicted=(1, 6)), None), "request 'a': evicted token 6 is not in the worker's "
                                                            "read list"),
    (("a", ReadChanges(1, 0, False, evicted=(2, 1, 2)), None), "request 'a': evicted token 2 is named twice"),
    (("a", ReadChanges(1, 0, False, joined=(3,), joined_slots=(9,)), None), "request 'a': joined token 3 is not "
                                                                            "newer than every token before it"),
    (("a", ReadChanges(1, 0, False, evicted=(4,), joined=(5, 5), joined_slots=(9, 10)), None),
     "request 'a': joined token 5 is not newer than every token before it"),
    (("a", ReadChanges(1, 0, True), ([0, 2, 2], [1, 2, 3])), "request 'a': its whole read list is not ascending at "
                                                              "token 2"),
    (("z", ReadChanges(1, 0, False), None), "request 'z': a read-list change since layout version 0, the worker's "
                                           "copy is at None"),
])
def test_a_refused_patch_names_the_request_and_token_and_changes_nothing(bad, message):
    """Each refusal, by both tables: V2 with the same message; a good request before the bad one in the same record
    is not patched, and a new request's row is given back."""
    for table in both():
        table.apply(record(("a", ReadChanges(0, -1, True), ([1, 2, 4], [5, 6, 7]))))
        before = snapshot(table)
        reads = record(("n", ReadChanges(0, -1, True), ([0], [1])), bad)
        with pytest.raises(InvariantViolation, match="V2: " + message.replace("(", r"\(").replace(")", r"\)") + "$"):
            table.apply(reads)
        assert snapshot(table) == before, table.compiled


def test_a_row_that_loses_every_entry_orders_its_joined_ids_by_nothing_kept():
    """Joined ids must be newer than the ids the row keeps; a row that keeps none takes any ascending ids (the
    search for its newest kept id runs down to position 0 and past it). Found by the read kernels' mutation run
    (fuzz/mutation_read_kernels.json): a search that stopped at position 0 took the evicted first id for a kept one.
    """
    for table in both():
        table.apply(record(("a", ReadChanges(0, -1, True), ([1, 2, 4], [5, 6, 7]))))
        assert table.apply(record(("a", ReadChanges(1, 0, False, evicted=(4, 1, 2), joined=(0, 3),
                                                    joined_slots=(8, 9)), None))).tolist() == [0, 1, 2]
        slots, ids = table.lists("a")
        assert ids.tolist() == [0, 3] and slots.tolist() == [8, 9]


def test_a_checked_list_that_differs_is_v2():
    for table in both():
        table.apply(record(("a", ReadChanges(0, -1, True), ([1, 2], [5, 6]))))
        with pytest.raises(InvariantViolation, match=r"V2: request 'a': the worker's patched read list \(ids \[1, 2, "
                                                     r"3\]\.\.\., 3\) is not the table's \(ids \[1, 2\]\.\.\., 2\)"):
            table.apply(record(("a", ReadChanges(1, 0, False, joined=(3,), joined_slots=(8,)), ([1, 2], [5, 6])),
                               check=True))
        with pytest.raises(InvariantViolation, match="name a request twice"):
            table.apply(record(("a", ReadChanges(2, 1, False), None), ("a", ReadChanges(2, 1, False), None)))
