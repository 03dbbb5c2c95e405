"""V6 at the runtime level (issue #45): ``FastRuntime`` is the core's ``VTokenRuntime`` on the dense path, step by step.

A Hypothesis state machine plays the engine vLLM is: it allocates blocks from a pool, admits requests empty, gives
some of them a prefix-cache hit (full blocks of a running request, shared in the pool), syncs each step's tokens for
a batch of requests in one call, then evicts and reclaims for the decoding ones (StreamingLLM at a ratio or a count
budget, a cadence of 1 or 3) and frees what a leaving request held. Everything runs on a ``ShadowedRuntime``: the
core's runtime beside the fast one, on a replay of the same pool, compared after every call (answers, plans in order,
copies submitted, blocks freed, counters, the whole table state). Calls the core refuses (a free block, an unknown
or repeated request, rows for a policy that reads none) must be refused alike and change nothing.

Planted bugs in ``FastRuntime`` (plans out of admission order, a tail block not freed, the cadence off by one, a
copy not submitted) must each be caught by the shadow.

Replay a failure: the seed Hypothesis prints (``@reproduce_failure``), or rerun this file: the ``ci`` profile is
derandomized.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

pytest.importorskip("numba")

from vtoken.core.block_pool import BlockPool, Purpose  # noqa: E402
from vtoken.core.errors import (BlockNotOwnedError, ConfigError, DuplicateRequestError, InvalidArgumentError,  # noqa: E402
                                InvariantViolation, UnknownRequestError)
from vtoken.core.policies import StreamingLLM  # noqa: E402
from vtoken.integration.fastpath import runtime as fast_runtime  # noqa: E402
from vtoken.integration.fastpath.shadow import ShadowedRuntime, ShadowEngine  # noqa: E402

NUM_BLOCKS, S, ROWS, TOKENS = 48, 4, 6, 64


class Engine(RuleBasedStateMachine):
    """The engine's side: the pool, the requests' prompts and steps; the runtime's side is the shadow."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, S)
        self.next_id = 0
        self.prompt: dict[int, int] = {}  # request -> tokens it arrived with (decoding past them)

    @initialize(policy=st.sampled_from(["none", "streaming_llm"]), budget=st.sampled_from([0.5, 0.75, 6, 10]),
                sinks=st.integers(0, 5), evict_every=st.sampled_from([1, 3]))
    def build(self, policy, budget, sinks, evict_every):
        chosen = StreamingLLM(sinks=sinks) if policy == "streaming_llm" else None
        self.rt = ShadowedRuntime(self.pool, ShadowEngine(), chosen, budget, ROWS, TOKENS, evict_every=evict_every)
        event(f"policy {policy}, budget {budget}, cadence {evict_every}")

    # ---- helpers ---------------------------------------------------------------------------------
    def running(self) -> list:
        return self.rt.running()

    def blocks_for(self, r, n_new: int) -> list[int] | None:
        """The new blocks the engine allocates for ``n_new`` more tokens of ``r`` (None: the pool is short)."""
        pos, have = self.rt.write_pos(r), self.rt.num_blocks_of(r)
        need = max(0, -(-(pos + n_new) // S) - have)
        if not self.pool.can_allocate(need, Purpose.ADMISSION):
            return None
        return self.pool.allocate(need, Purpose.ADMISSION) if need else []

    # ---- the engine's steps ----------------------------------------------------------------------
    @precondition(lambda self: len(self.running()) < ROWS)
    @rule(prompt=st.integers(1, 20))
    def admit(self, prompt):
        r = self.next_id
        self.next_id += 1
        blocks = self.blocks_for_new(prompt)
        if blocks is None:
            return
        self.rt.admit(r)
        self.prompt[r] = prompt
        assert self.rt.sync_many([(r, blocks, prompt)]) == [[b * S + o for b in blocks for o in range(S)][:prompt]]

    def blocks_for_new(self, n: int) -> list[int] | None:
        need = -(-n // S)
        return self.pool.allocate(need, Purpose.ADMISSION) if self.pool.can_allocate(need, Purpose.ADMISSION) else None

    @precondition(lambda self: 0 < len(self.running()) < ROWS)
    @rule(data=st.data(), extra=st.integers(0, 9))
    def admit_with_a_prefix_hit(self, data, extra):
        """A prefix-cache hit: the first k full blocks of a running request (before its cursor), shared in the pool."""
        holder = data.draw(st.sampled_from(self.running()), label="holder")
        full = self.rt.write_pos(holder) // S
        if full == 0:
            return
        k = data.draw(st.integers(1, min(full, 4)), label="shared blocks")
        shared = self.rt.block_ids(holder)[:k]
        fresh = self.blocks_for_new(extra) if extra else []
        if fresh is None:
            return
        for b in shared:
            self.pool.share(b)
        r = self.next_id
        self.next_id += 1
        self.rt.admit(r)
        self.prompt[r] = k * S + extra
        self.rt.sync_many([(r, shared + fresh, k * S + extra)])
        event("prefix hit")

    @precondition(lambda self: len(self.running()) < ROWS - 1)
    @rule(blocks=st.integers(1, 3), extra=st.integers(0, 6))
    def admit_two_sharing_in_one_step(self, blocks, extra):
        """vLLM caches a block once its tokens are scheduled, so a later request of the same step can hit it: a and b
        arrive together, b's first blocks are the ones a's prompt fills in this very sync."""
        head = self.blocks_for_new(blocks * S)
        if head is None:
            return
        tail = self.blocks_for_new(extra) if extra else []
        if tail is None:
            self.pool.free(head)
            return
        for b in head:
            self.pool.share(b)
        a, b = self.next_id, self.next_id + 1
        self.next_id += 2
        for r in (a, b):
            self.rt.admit(r)
        self.prompt[a], self.prompt[b] = blocks * S, blocks * S + extra
        self.rt.sync_many([(a, head, blocks * S), (b, head + tail, blocks * S + extra)])
        assert self.rt.shared_blocks(b) == head
        event("a prefix hit within one step")

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def step(self, data):
        """One engine step: a batch of requests gets 1 token each (a prefill chunk sometimes), synced in one call;
        then the decoding ones evict and reclaim."""
        batch = data.draw(st.lists(st.sampled_from(self.running()), min_size=1, unique=True), label="batch")
        items = []
        for r in batch:
            n = data.draw(st.sampled_from([1, 1, 1, 2, 5]), label="tokens")
            if self.rt.total_len(r) + n > TOKENS:
                continue
            new = self.blocks_for(r, n)
            if new is None:
                continue
            items.append((r, new, self.rt.total_len(r) + n))
        self.rt.sync_many(items)
        decoding = [r for r in self.running() if r in {i[0] for i in items} and self.rt.total_len(r) >= self.prompt[r]]
        victims = self.rt.evict_and_reclaim(decoding)
        for rec in self.rt.settle():
            event(f"plan with {min(len(rec.plan.moves), 3)}+ moves, {len(rec.plan.src_blocks)} blocks released")
        if victims:
            event("evicted")

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def leave(self, data):
        """Finish or preemption: the runtime forgets the request, the engine frees its blocks."""
        r = data.draw(st.sampled_from(self.running()), label="leaver")
        blocks = self.rt.detach(r)
        self.pool.free(blocks)

    # ---- refused calls: the same error on both sides, nothing changed ---------------------------
    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def refused_a_free_block(self, data):
        r = data.draw(st.sampled_from(self.running()), label="request")
        free = self.pool.free_block_ids()
        if not free or self.rt.total_len(r) >= TOKENS:
            return
        with pytest.raises(BlockNotOwnedError, match="is free in the pool"):
            self.rt.sync_many([(r, [free[0]], self.rt.total_len(r) + 1)])

    @rule()
    def refused_an_unknown_request(self):
        with pytest.raises(UnknownRequestError):
            self.rt.evict_and_reclaim([10_000])
        with pytest.raises(UnknownRequestError):
            self.rt.sync_many([(10_000, [], 1)])

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def refused_twice(self, data):
        r = data.draw(st.sampled_from(self.running()), label="request")
        with pytest.raises(DuplicateRequestError):
            self.rt.admit(r)
        with pytest.raises(InvalidArgumentError, match="twice"):
            self.rt.evict_and_reclaim([r, r])

    @invariant()
    def the_pool_holds_what_the_tables_list(self):
        listed = {}
        for r in self.running():
            for b in self.rt.block_ids(r):
                listed[b] = listed.get(b, 0) + 1
        for b in range(NUM_BLOCKS):
            assert self.pool.ref_count(b) == listed.get(b, 0), b


def test_the_fast_runtime_equals_the_core_on_every_call():
    run_state_machine_as_test(Engine, settings=settings(max_examples=60, stateful_step_count=40,
                                                        suppress_health_check=list(HealthCheck)))


def test_rows_for_a_policy_that_reads_none_are_refused_alike_and_change_nothing():
    """The core records attention rows for any policy; the fast path's policies read none, so it refuses them (a
    wiring bug in the caller): a divergence the shadow reports, never a silent drop."""
    rt = ShadowedRuntime(BlockPool(8, S), ShadowEngine(), StreamingLLM(), 0.5, 2, 16)
    rt.admit("a")
    with pytest.raises(InvariantViolation, match="V6.*error"):
        rt.evict_and_reclaim(["a"], attention={"a": ([], [])})


def test_the_fast_path_refuses_a_policy_outside_its_domain():
    from vtoken.core.policies import H2O
    with pytest.raises(ConfigError, match="StreamingLLM only"):
        fast_runtime.FastRuntime(BlockPool(8, S), ShadowEngine(), H2O(), 0.5, 2, 16)


# ---- planted bugs: the shadow must catch each -------------------------------------------------------
def _plans_in_reverse(monkeypatch):
    real = fast_runtime.FastRuntime._commit
    monkeypatch.setattr(fast_runtime.FastRuntime, "_commit", lambda self, plans: real(self, plans[::-1]))


def _tail_not_freed(monkeypatch):
    real = fast_runtime.FastRuntime._commit

    class KeepsTail:
        def __init__(self, pool):
            self.pool = pool

        def __getattr__(self, name):
            return getattr(self.pool, name)

        def free(self, blocks):
            self.pool.free(list(blocks)[:-1])

    def commit(self, plans):
        pool, self.pool = self.pool, KeepsTail(self.pool)
        try:
            real(self, plans)
        finally:
            self.pool = pool
    monkeypatch.setattr(fast_runtime.FastRuntime, "_commit", commit)


def _cadence_off_by_one(monkeypatch):
    real = fast_runtime.FastRuntime._due
    monkeypatch.setattr(fast_runtime.FastRuntime, "_due", lambda self, ids: (
        setattr(self, "evict_every", self.evict_every + 1), real(self, ids),
        setattr(self, "evict_every", self.evict_every - 1))[1])


def _copy_not_submitted(monkeypatch):
    real = fast_runtime.FastRuntime._commit

    def commit(self, plans):
        submit = self.engine.submit
        self.engine.submit = lambda moves, req_id=None: submit(moves[1:], req_id=req_id)
        try:
            real(self, plans)
        finally:
            del self.engine.submit
    monkeypatch.setattr(fast_runtime.FastRuntime, "_commit", commit)


PLANTED = {"plans_in_reverse": _plans_in_reverse, "tail_not_freed": _tail_not_freed,
           "cadence_off_by_one": _cadence_off_by_one, "copy_not_submitted": _copy_not_submitted}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_runtime_bug_is_caught_by_the_shadow(monkeypatch, bug):
    PLANTED[bug](monkeypatch)
    with pytest.raises(InvariantViolation, match="V6"):
        run_state_machine_as_test(Engine, settings=settings(max_examples=200, stateful_step_count=40,
                                                            suppress_health_check=list(HealthCheck),
                                                            phases=(Phase.generate,)))  # found, not shrunk
