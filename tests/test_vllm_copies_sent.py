"""I3 inside vLLM: when a step's reads are built, no committed plan's copy is still unsent.

The scheduler commits a plan in ``after_step`` (EVENT ordering: the copy is ORDERED as soon as it is in the
outbox), one step before the workers run its copy at the top of the next step. ``check_copies_sent``, which
``SchedulerTokens.on_schedule`` runs after it built the read lists, is the online check that the copy really
travels in that step's orders. Here it runs on the real core and the scheduler's real ``WorkerCopyEngine``
(no vLLM engine is needed): after the orders took the outbox (``on_schedule``'s order), and with the outbox
still holding the copy (reads that would take destinations no worker wrote).
"""

import pytest

pytest.importorskip("vllm")

from vtoken.core.block_pool import BlockPool  # noqa: E402
from vtoken.core.errors import InvariantViolation  # noqa: E402
from vtoken.core.plan import PlanKind  # noqa: E402
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig  # noqa: E402
from vtoken.core.runtime import ReadPath, VTokenRuntime  # noqa: E402
from vtoken.integration.vllm.scheduler_tokens import check_copies_sent  # noqa: E402
from vtoken.integration.vllm.worker_copies import WorkerCopyEngine  # noqa: E402


def planned_and_launched():
    engine = WorkerCopyEngine()
    rt = VTokenRuntime(BlockPool(8, 4, 1), engine, None, 1.0,
                       ReclaimConfig(planner=PlanKind.COMPACT, theta_f=0.0, ordering=Ordering.EVENT), ReadPath.GATHER)
    rt.admit("a")
    rt.begin_step({"a": 12})
    rt.end_step({})
    for t in (0, 1, 2, 4, 5, 6):
        rt.table.evict_token("a", t)
    rec = rt.manager.plan_request("a")
    rt.manager.launch()  # in after_step: the copy waits in the outbox for the next step's orders
    assert rec.state is PlanState.COPYING and [h for h, _, _ in engine.unsent()] == [rec.handle]
    return rt, engine, rec


def test_reads_built_after_the_orders_took_the_outbox_pass():
    rt, engine, rec = planned_and_launched()
    handle = rec.handle  # released at commit
    check_copies_sent(rt, engine)  # in flight and unsent: fine
    rt.manager.settle()  # after_step: EVENT commits the ORDERED copy at once
    sent = engine.take_outbox()  # on_schedule: the orders take the outbox before the read lists are built
    assert rec.state is PlanState.COMMITTED and [h for h, _, _ in sent] == [handle]
    check_copies_sent(rt, engine)


def test_reads_built_while_a_committed_copy_is_unsent_are_an_i3_violation():
    rt, engine, rec = planned_and_launched()
    handle = rec.handle
    rt.manager.settle()  # committed, and the copy is still in the outbox when the reads are built
    with pytest.raises(InvariantViolation, match=rf"I3: request 'a': its plan left flight \(committed or aborted\) "
                                                 rf"while its copy {handle} has not been sent to the workers"):
        check_copies_sent(rt, engine)


def test_submit_ordered_is_submit_order_and_release_of_each_copy_in_one_pass():
    """The fast path's call: each copy goes to the outbox in order, ORDERED and released, and stays registered until
    the workers report it, exactly as ``submit``, ``order_before_compute`` and ``release`` leave it."""
    from vtoken.core.copy_engine import CopyStatus
    from vtoken.core.token_table import Move
    from vtoken.integration.fastpath.moves import MoveArray

    one, loop = WorkerCopyEngine(), WorkerCopyEngine()
    packed = MoveArray(__import__("array").array("q", [3, 1, 0, 2, 1]))
    copies = [((Move(0, 1, 0, 2, 0),), "a"), (packed, "b"), ([(5, 0, 1, 0, 0)], "c")]
    assert one.submit_ordered(copies) == [CopyStatus.ORDERED] * 3
    for moves, r in copies:
        h = loop.submit(moves, req_id=r)
        assert loop.order_before_compute(h) is CopyStatus.ORDERED
        loop.release(h)
    assert one.unsent() == loop.unsent() == [(1, "a", (Move(0, 1, 0, 2, 0),)), (2, "b", packed),
                                             (3, "c", (Move(5, 0, 1, 0, 0),))]
    assert one.unsent()[1][2] is packed  # the packed moves travel as they are
    assert one.pending() == loop.pending() == [1, 2, 3]
    for engine in (one, loop):
        engine.take_outbox()
        engine.report(2, ok=False)
        assert engine.pending() == [1, 3] and engine.request_of(1) == "a"


def test_submit_ordered_refuses_what_is_no_list_of_pairs_and_changes_nothing():
    from vtoken.core.errors import InvalidArgumentError
    from vtoken.core.token_table import Move

    engine = WorkerCopyEngine()
    moves = (Move(0, 1, 0, 2, 0),)
    for bad, named in (("ab", "copies must be a sequence, got 'ab'"), ({"a": moves}, "got {'a'"),
                       ([(moves, "a"), ("a",)], "each is a (moves, request) tuple, got ('a',)"),
                       ([(moves, "a", 1)], "got ((Move(")):
        with pytest.raises(InvalidArgumentError) as e:
            engine.submit_ordered(bad)
        assert named in str(e.value)
    assert engine.unsent() == [] and engine.pending() == []


def test_a_steps_done_reports_settle_as_one_report_each_and_a_bad_one_is_named():
    """``report_done`` (the scheduler's loop over a step's reports) leaves what ``report(h, ok=True)`` of each leaves;
    a handle reported twice, or unknown, raises ``report``'s error, the reports before it counted."""
    from vtoken.core.copy_engine import CopyStatus
    from vtoken.core.errors import UnknownCopyHandleError, VTokenError
    from vtoken.core.token_table import Move

    one, loop = WorkerCopyEngine(), WorkerCopyEngine()
    for engine in (one, loop):
        engine.submit_ordered([((Move(0, 1, 0, 2, 0),), "a"), ((Move(0, 3, 0, 4, 0),), "b")])
        h = engine.submit((Move(0, 5, 0, 6, 0),), req_id="c")  # PENDING, not released: kept once DONE
        engine.take_outbox()
    one.report_done([1, 2, 3])
    for h in (1, 2, 3):
        loop.report(h, ok=True)
    assert one.pending() == loop.pending() == [] and one._copies.keys() == loop._copies.keys() == {h}
    assert one.poll(h) is CopyStatus.DONE
    with pytest.raises(VTokenError, match="copy 3 reported twice"):
        one.report_done([3])
    one.submit_ordered([((Move(0, 1, 0, 2, 0),), "d")])
    with pytest.raises(UnknownCopyHandleError, match="unknown copy handle 9"):
        one.report_done([4, 9])
    assert one.pending() == []  # 4 was reported before 9 was refused


def test_a_packed_step_is_one_outbox_record_whose_copies_answer_as_submitted_ones():
    """``submit_ordered`` of a ``PackedCopies`` (the fast path's step) registers consecutive handles to one record
    and sends it whole (``take_outbox`` gives the ``SentCopies``); every handle answers ``poll``, ``request_of``,
    ``moves_of``, ``pending``, ``report``, ``report_done`` and ``drop_request`` as the same copies submitted one by
    one do."""
    from array import array

    from vtoken.core.copy_engine import CopyStatus
    from vtoken.core.errors import UnknownCopyHandleError
    from vtoken.integration.fastpath.moves import PackedCopies, SentCopies

    def packed():
        return PackedCopies(["a", "b", "c"], array("q", [0, 1, 2, 4]),
                            array("q", [0, 1, 0, 2, 0, 3, 3, 0, 4, 0, 4, 5, 0, 6, 0, 6, 5, 1, 6, 1]))

    one, loop = WorkerCopyEngine(), WorkerCopyEngine()
    assert one.submit_ordered(packed()) == loop.submit_ordered(list(packed())) == [CopyStatus.ORDERED] * 3
    assert one.submit_ordered(PackedCopies([], array("q", [0]), array("q"))) == []
    assert one.unsent() == loop.unsent() and len(one._outbox) == 1
    assert one.pending() == loop.pending() == [1, 2, 3]
    for h in (1, 2, 3):
        assert (one.poll(h), one.request_of(h), one.moves_of(h)) == (loop.poll(h), loop.request_of(h), loop.moves_of(h))
    sent = one.take_outbox()
    assert sent.__class__ is SentCopies and sent.handles == range(1, 4) and list(sent) == loop.take_outbox()
    for engine in (one, loop):
        engine.report(2, ok=False)
        engine.report_done([1])
        assert engine.pending() == [3] and engine.request_of(3) == "c"
        for report in (lambda: engine.report_done([1]), lambda: engine.report(2, ok=True)):
            with pytest.raises(UnknownCopyHandleError, match="unknown copy handle"):  # released: gone once reported
                report()
    # a request that leaves before its step is sent: its copy is taken out of the record, the others stay
    for engine, copies in ((one, packed()), (loop, list(packed()))):
        engine.submit_ordered(copies)
        assert engine.drop_request("b") == 1 and engine.drop_request("zz") == 0
        assert [(h, r) for h, r, _ in engine.take_outbox()] == [(4, "a"), (6, "c")]
        assert engine.pending() == [3, 4, 6]
