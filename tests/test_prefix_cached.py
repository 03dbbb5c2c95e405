"""Prefix-cached blocks stay where they are (issue #21, item 4): a block a later request may map through a prefix cache
(``BlockAllocator.is_cached``; vLLM: it carries a block hash) is no source of a lazy compaction. Packed away, it
would leave the prefix held twice: this request's packed copy and a later hit's (on real vLLM, staggered arrivals
sharing a prompt: tests/test_vllm_prefix_stagger.py). Under the engine's pressure capacity comes first and compaction
takes it. Naive-Evict's release of a wholly dead cached block and densify are unchanged: neither leaves a second
copy held."""

from __future__ import annotations

import pytest

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.errors import BlockOutOfRangeError, DoubleFreeError, InvariantViolation
from vtoken.core.plan import NoPlanReason, PlanKind
from vtoken.core.reclamation import ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore

from test_naive_evict import step, tag
from test_reclamation import Scripted

S = 4


def test_the_pool_marks_an_allocated_block_until_it_is_freed():
    pool = BlockPool(4, S)
    [b] = pool.allocate(1, Purpose.ADMISSION)
    assert not pool.is_cached(b)
    pool.cache(b)
    pool.share(b)
    pool.free([b])
    assert pool.is_cached(b)  # one holder left: still mapped
    pool.free([b])
    assert not pool.is_cached(b) and pool.snapshot()[2] == ()
    pool.check()


def test_the_pool_refuses_to_cache_a_free_or_unknown_block_and_changes_nothing():
    pool = BlockPool(4, S)
    before = pool.snapshot()
    with pytest.raises(DoubleFreeError, match="cannot cache block 2: it is free"):
        pool.cache(2)
    with pytest.raises(BlockOutOfRangeError, match="block 4 outside the pool"):
        pool.cache(4)
    with pytest.raises(BlockOutOfRangeError):
        pool.is_cached(-1)
    assert pool.snapshot() == before


def test_the_pool_check_names_a_free_block_still_marked():
    pool = BlockPool(4, S)
    pool._cached.add(3)  # a free that forgot the mark
    with pytest.raises(InvariantViolation, match="P1.*block 3 is free but still marked prefix-cached"):
        pool.check()


def runtime(victims, reclaim=None):
    pool = BlockPool(16, S, headroom=2)
    engine = InMemoryCopyEngine(TagStore(16, S))
    return VTokenRuntime(pool, engine, Scripted(victims), 1, reclaim or ReclaimConfig(theta_f=0.0),
                         ReadPath.GATHER), engine


def test_compact_packs_around_a_cached_block():
    """Blocks 0, 1 and 2 each lose two of four tokens. Without a cache compact packs the two emptiest, blocks 0 and 1,
    into one; with block 0 cached it packs blocks 1 and 2 instead, and block 0 stays in place, listed."""
    def plan(cached):
        rt, engine = runtime({("a", 0): [0, 1, 4, 5, 8, 9]}, ReclaimConfig(theta_f=0.0, max_sources=2))
        rt.admit("a")
        inputs = rt.begin_step({"a": 16})
        if cached:
            rt.pool.cache(rt.block_ids("a")[0])
        engine.before_compute()
        for t, slot in zip(inputs.requests["a"].new_tokens, inputs.requests["a"].write_slots):
            engine.store.write(slot, tag("a", t))
        rt.end_step()
        blocks = rt.block_ids("a")
        p = rt.manager.in_flight("a").plan
        return [blocks.index(b) for b in p.src_blocks], rt, engine, blocks

    assert plan(False)[0] == [0, 1]
    srcs, rt, engine, blocks = plan(True)
    assert srcs == [1, 2]
    step(rt, engine, {"a": 1})  # the commit
    assert rt.block_ids("a")[0] == blocks[0] and rt.reclaim_stats.plans_committed == 1


@pytest.mark.parametrize("pressure", [0, 1])
def test_lazy_compact_makes_no_plan_when_only_cached_blocks_qualify_and_pressure_packs_them(pressure):
    rt, engine = runtime({("a", 0): [0, 1, 4, 5]})
    rt.admit("a")
    rt.set_pressure(pressure)
    inputs = rt.begin_step({"a": 16})
    for b in rt.block_ids("a")[:2]:
        rt.pool.cache(b)
    engine.before_compute()
    for t, slot in zip(inputs.requests["a"].new_tokens, inputs.requests["a"].write_slots):
        engine.store.write(slot, tag("a", t))
    rt.end_step()
    if pressure:  # blocks 0 and 1, two live tokens each, into one block
        plan = rt.manager.in_flight("a").plan
        assert plan.kind is PlanKind.COMPACT and list(plan.src_blocks) == rt.block_ids("a")[:2]
        return
    assert rt.manager.in_flight("a") is None
    assert rt.reclaim_stats.no_plan[NoPlanReason.NO_CANDIDATES] == 1


def test_naive_evict_still_releases_a_wholly_dead_cached_block():
    """A release leaves no second copy held: the block goes back to the pool (vLLM keeps its hash while it waits in
    the free queue, so a later hit can still find it)."""
    rt, engine = runtime({("a", 0): [0, 1, 2, 3]})
    rt.admit("a")
    inputs = rt.begin_step({"a": 8})
    first = rt.block_ids("a")[0]
    rt.pool.cache(first)
    engine.before_compute()
    for t, slot in zip(inputs.requests["a"].new_tokens, inputs.requests["a"].write_slots):
        engine.store.write(slot, tag("a", t))
    rt.end_step()
    assert rt.manager.in_flight("a").plan.kind is PlanKind.RELEASE
    step(rt, engine, {"a": 1})
    assert first not in rt.block_ids("a") and rt.pool.ref_count(first) == 0 and not rt.pool.is_cached(first)
