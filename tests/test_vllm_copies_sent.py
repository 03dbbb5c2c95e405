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
