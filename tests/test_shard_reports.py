"""Tensor parallelism's bookkeeping without an engine (issue #22): how every rank's copy reports settle into one
status per copy (``ShardReports``), and how two ranks' worker metadata fold into one (``VTokenWorkerMeta.aggregate``,
which vLLM's ``KVOutputAggregator`` calls in rank order)."""

import pytest

pytest.importorskip("vllm")

from vtoken.core.errors import InvariantViolation, VTokenError  # noqa: E402
from vtoken.integration.vllm.connector import VTokenWorkerMeta  # noqa: E402
from vtoken.integration.vllm.worker_copies import ShardReports  # noqa: E402


def test_one_rank_passes_reports_through():
    s = ShardReports(1)
    assert s.settle([3, 1], [2]) == ([3, 1], [2])
    assert s.waiting() == {}


def test_a_copy_is_done_once_every_rank_reported_it():
    s = ShardReports(2)
    assert s.settle([5, 5, 6], []) == ([5], [])  # 6: only one rank so far
    assert s.waiting() == {6: 1}
    assert s.settle([6], []) == ([6], [])
    assert s.waiting() == {}


def test_a_copy_one_rank_failed_is_failed_once_whatever_the_others_saw():
    s = ShardReports(2)
    assert s.settle([7], [7]) == ([], [7])  # rank 0 done, rank 1 failed: failed
    assert s.settle([], [8, 8]) == ([], [8])  # both failed: reported once
    s.settle([9], [])
    assert s.settle([], [9]) == ([], [9]) and s.waiting() == {}  # a later failure drops the partial count


def test_more_done_reports_than_ranks_are_refused():
    s = ShardReports(2)
    with pytest.raises(VTokenError, match="copy 4 reported done by 3 ranks; there are 2"):
        s.settle([4, 4, 4], [])
    with pytest.raises(VTokenError, match="ranks must be an int >= 1, got 0"):
        ShardReports(0)


def meta(rank, done=(), failed=(), verified=0, victims=None):
    m = VTokenWorkerMeta(list(done), list(failed), verified, 0, 0, 0.1 * (rank + 1), dict(victims or {}))
    m.verified_by_rank = {rank: verified} if verified else {}
    return m


def test_two_ranks_fold_into_one_report():
    both = meta(0, [1, 2], verified=2, victims={"a": [3, 4]}).aggregate(meta(1, [1, 2], [], 2, {"a": [3, 4]}))
    assert both.done == [1, 2, 1, 2] and both.verified == 4 and both.verified_by_rank == {0: 2, 1: 2}
    assert both.victims == {"a": [3, 4]} and both.seconds == pytest.approx(0.2)  # the slower rank's time
    assert ShardReports(2).settle(both.done, both.failed) == ([1, 2], [])


def test_ranks_that_ranked_different_victims_are_an_invariant_violation():
    """Each rank ranks victims from the all-reduced rows, so they agree; a rank that ranked from its own heads
    only (the all-reduce skipped) would disagree, and the fold refuses it (TP1)."""
    with pytest.raises(InvariantViolation, match="TP1: request 'a': two ranks ranked different victims"):
        meta(0, victims={"a": [3, 4]}).aggregate(meta(1, victims={"a": [3, 5]}))
