"""Regression corpus: block-freeing bug classes vLLM itself shipped, as rule sequences on our core.

- vLLM #1556 ("ValueError: Double free!", fixed by vLLM PR #3347): a sequence sharing blocks dropped its
  reference to a shared block on one path, then freed its whole block table on finish: the shared block
  was freed twice. Here: a request shares another's prefix blocks, evicts every token in them, gets
  compacted, and both finish: every block must be freed exactly once and never while shared.
- vLLM #42571 (KV block double free with CPU offloading + sliding window): two release paths for the
  same block. Here: reclamation holds a plan's source blocks for its pending copy while the request is
  preempted (the request's path) and the copy then settles (the copy's path); every block is released
  once, by exactly one of them.

Each program runs every invariant after every rule and ends with an empty, consistent pool.
"""

import pytest

from vtoken.core.errors import DoubleFreeError, InvariantViolation
from vtoken.fuzz.machine import VTokenMachine
from vtoken.fuzz.planted import planted


def _run(program):
    state = VTokenMachine()
    program(state)
    state.teardown()
    return state


def _check(state):
    state.check_all_invariants()


def _shared_prefix_fully_evicted_then_compacted(state):
    state.setup(profile="gather-compact-poll", policy="none", block_size=2, num_blocks=12, headroom=1,
                budget=1.0, theta_f=0.0, check_every=1, max_sources=8, low_watermark=None)
    a = state.admit(prompt=4)
    state.steps(n=1)
    _check(state)
    b = state.admit_sharing_prefix(source=a, blocks=2, extra=1)
    assert [state.pool.ref_count(x) for x in state.table.block_ids(a)] == [2, 2]
    state.steps(n=1)
    _check(state)
    for _ in range(4):  # b evicts its whole shared prefix: tokens 0..3
        state.evict_now(req=b, index=0, moving=False)
        _check(state)
    state.plan_now(req=b)  # shared blocks are never sources: nothing to plan for b
    assert b not in state.manager.inflight
    for t in range(2):  # now a evicts one token per shared block and compacts: still shared, still skipped
        state.evict_now(req=a, index=1, moving=False)
    state.plan_now(req=a)
    assert a not in state.manager.inflight
    _check(state)
    state.leave(req=a, preempt=False)  # a's reference goes; b's remains
    _check(state)
    assert all(state.pool.ref_count(x) == 1 for x in state.table.block_ids(b))
    state.plan_now(req=b)  # the prefix blocks are private now, and empty of b's live tokens
    state.launch()
    state.settle()
    _check(state)
    state.leave(req=b, preempt=False)
    _check(state)
    assert state.pool.num_free == state.pool.num_blocks


def _preempted_while_its_plan_copies(state, profile="gather-compact-poll"):
    state.setup(profile=profile, policy="none", block_size=2, num_blocks=16, headroom=2, budget=1.0,
                theta_f=0.0, check_every=1, max_sources=8, low_watermark=None)
    a = state.admit(prompt=8)
    state.steps(n=1)
    for t in (0, 2, 4):  # blocks 0, 1, 2 become half empty
        state.evict_now(req=a, index=state._live(a).index(t), moving=False)
    _check(state)
    state.plan_now(req=a)
    rec = state.manager.inflight[a]
    assert rec.plan.src_blocks and len(rec.plan.dst_blocks) < len(rec.plan.src_blocks)
    state.launch()
    _check(state)
    state.leave(req=a, preempt=True)  # release path 1: the request's blocks, minus what the copy touches
    _check(state)
    held = set(state.manager.orphans[0].held) if state.manager.orphans else set()
    if profile == "gather-compact-poll":
        assert held >= set(rec.plan.src_blocks) | set(rec.plan.dst_blocks)
        state.complete_copy(index=0)
    state.settle()  # release path 2: what the copy held
    _check(state)
    assert state.manager.orphans == []
    assert state.pool.num_free == state.pool.num_blocks
    a2 = state.resume()  # recompute from scratch
    assert a2 == a
    state.steps(n=2)
    _check(state)
    state.leave(req=a, preempt=False)
    _check(state)
    assert state.pool.num_free == state.pool.num_blocks


def test_vllm_1556_shared_blocks_are_freed_once():
    _run(_shared_prefix_fully_evicted_then_compacted)


@pytest.mark.parametrize("profile", ["gather-compact-poll", "gather-compact-event"])
def test_vllm_42571_two_release_paths_free_each_block_once(profile):
    _run(lambda s: _preempted_while_its_plan_copies(s, profile))


def test_the_42571_program_catches_a_double_free_after_preemption():
    with planted("double_free_after_preemption"), pytest.raises((DoubleFreeError, InvariantViolation)):
        _run(_preempted_while_its_plan_copies)


def test_the_42571_program_catches_sources_freed_before_the_copy():
    with planted("free_sources_before_copy"), pytest.raises(InvariantViolation, match="I5"):
        _run(_preempted_while_its_plan_copies)


def test_the_1556_program_catches_relocation_of_a_shared_block():
    with planted("relocate_shared_block"), pytest.raises((AssertionError, InvariantViolation)):
        _run(_shared_prefix_fully_evicted_then_compacted)
