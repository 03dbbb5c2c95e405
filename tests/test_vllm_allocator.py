"""The core's BlockAllocator contract, run against vLLM's real BlockPool through ``VllmBlockAllocator``
(and against the core's own BlockPool, so the two are held to the same behaviour)."""

import pytest

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.metrics import measure
from vtoken.core.errors import BlockOutOfRangeError, DoubleFreeError, HeadroomReservedError, PoolExhaustedError
from vtoken.core.reclamation import ReclaimConfig, ReclamationManager
from vtoken.core.plan import PlanKind
from vtoken.core.token_table import TokenTable
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore

pytest.importorskip("vllm")
from vllm.v1.core.block_pool import BlockPool as VllmPool  # noqa: E402

from vtoken.integration.vllm.allocator import VllmBlockAllocator  # noqa: E402

ADM, EVAC = Purpose.ADMISSION, Purpose.EVACUATION
N, S = 10, 4  # vLLM: 10 blocks, of which block 0 is the null block -> 9 usable


def vllm_alloc(headroom=2, caching=True):
    return VllmBlockAllocator(VllmPool(N, enable_caching=caching, hash_block_size=S), S, headroom)


@pytest.fixture(params=["core", "vllm"])
def alloc(request):
    return BlockPool(N - 1, S, 2) if request.param == "core" else vllm_alloc()


def rejected(a, exc, match, fn, *args):
    before = a.snapshot()
    with pytest.raises(exc, match=match) as info:
        fn(*args)
    assert type(info.value) is exc and a.snapshot() == before
    a.check()


def test_admission_leaves_the_headroom_evacuation_may_take_it(alloc):
    assert alloc.num_free == 9 and alloc.can_allocate(7, ADM) and not alloc.can_allocate(8, ADM)
    got = alloc.allocate(7, ADM)
    assert len(set(got)) == 7 and all(alloc.ref_count(b) == 1 for b in got)
    rejected(alloc, HeadroomReservedError, "below the evacuation headroom of 2", alloc.allocate, 1, ADM)
    more = alloc.allocate(2, EVAC)
    assert alloc.num_free == 0 and not set(more) & set(got)
    rejected(alloc, PoolExhaustedError, "evacuation needs 1 blocks, 0 free", alloc.allocate, 1, EVAC)
    alloc.check()


def test_share_and_free_count_references(alloc):
    [b] = alloc.allocate(1, ADM)
    alloc.share(b)
    assert alloc.ref_count(b) == 2
    alloc.free([b])
    assert alloc.ref_count(b) == 1 and alloc.num_free == 8
    rejected(alloc, DoubleFreeError, f"block {b} freed 2 time", alloc.free, [b, b])
    alloc.free([b])
    assert alloc.ref_count(b) == 0 and alloc.num_free == 9
    rejected(alloc, DoubleFreeError, f"cannot share block {b}: it is free", alloc.share, b)
    rejected(alloc, DoubleFreeError, "holds 0 reference", alloc.free, [b])
    alloc.check()


def test_a_batch_with_one_bad_id_frees_nothing(alloc):
    got = alloc.allocate(3, ADM)
    rejected(alloc, BlockOutOfRangeError, "outside the pool", alloc.free, got + [99])


def test_vllms_null_block_is_never_ours():
    a = vllm_alloc()
    assert 0 not in a.allocate(9, EVAC)
    rejected(a, BlockOutOfRangeError, "block 0 is vLLM's null block", a.free, [0])
    rejected(a, BlockOutOfRangeError, "null block", a.share, 0)


def test_the_check_catches_a_leak():
    a = vllm_alloc()
    [b] = a.allocate(1, ADM)
    a.pool.blocks[b].ref_cnt = 0  # a planted bug: the reference dropped without returning the block
    with pytest.raises(Exception, match="leaked"):
        a.check()


def test_the_reclamation_manager_runs_on_vllms_pool():
    """A compact plan takes its destination from vLLM's pool and gives the emptied sources back to it."""
    a = vllm_alloc(headroom=1)
    table = TokenTable(N, S)
    engine = InMemoryCopyEngine(TagStore(N, S))
    mgr = ReclamationManager(a, table, engine, ReclaimConfig(planner=PlanKind.COMPACT, theta_f=0.0))
    table.add_request("r")
    blocks = a.allocate(3, ADM)
    table.sync_new_tokens("r", blocks, 3 * S)
    for t in range(3 * S):
        if t % S:
            table.evict_token("r", t)
    free_before = a.num_free
    rec = mgr.plan_request("r")
    assert rec and len(rec.plan.src_blocks) == 3 and a.num_free == free_before - 1
    mgr.launch()
    [done] = mgr.settle()
    assert done.state.value == "committed" and a.num_free == free_before + 2
    assert table.block_ids("r") == list(rec.plan.dst_blocks) and all(a.ref_count(b) == 0 for b in blocks)
    a.check()


def test_a_reserve_keeps_vllm_out_of_the_headroom_and_lets_evacuation_in():
    from vtoken.integration.vllm.manager_hooks import Reserve
    pool = VllmPool(N, enable_caching=True, hash_block_size=S)
    a = VllmBlockAllocator(pool, S, 2, Reserve(pool, 2))
    assert pool.get_num_free_blocks() == 7 and a.num_free == 9  # vLLM's scheduler sees 7; vtoken sees all 9
    pool.get_new_blocks(7)  # vLLM takes everything it can see
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        pool.get_new_blocks(1)  # and no more: the headroom is not vLLM's
    assert not a.can_allocate(1, ADM)
    got = a.allocate(2, EVAC)  # compaction destinations come out of the headroom
    assert len(got) == 2 and a.num_free == 0 and pool.get_num_free_blocks() == 0
    a.free(got)
    assert pool.get_num_free_blocks() == 0 and a.num_free == 2  # back in the headroom, still hidden from vLLM
    a.check()


@pytest.mark.parametrize("call", [
    lambda a: a.allocate(1.5, ADM), lambda a: a.allocate(True, EVAC), lambda a: a.allocate("1", ADM),
    lambda a: a.allocate(1, "ADMISSION"), lambda a: a.allocate(8, "Evacuation"), lambda a: a.can_allocate(1.0, ADM),
    lambda a: a.can_allocate(1, "EVACUATION"),  # a purpose is a member or its exact value ("evacuation")
], ids=["float", "bool", "str", "str-purpose", "str-purpose-headroom", "can-float", "can-str-purpose"])
def test_both_pools_refuse_a_count_or_purpose_of_the_wrong_type(alloc, call):
    """The core's BlockPool and the vLLM adapter raise the same class for the same misuse."""
    from vtoken.core.errors import InvalidArgumentError
    alloc.allocate(1, ADM)
    rejected(alloc, InvalidArgumentError, "must be", call, alloc)


@pytest.mark.parametrize("call", [
    lambda a: a.free([1.0]), lambda a: a.free([True]), lambda a: a.free("12"), lambda a: a.free(3),
    lambda a: a.free([[1]]), lambda a: a.share(1.0), lambda a: a.share("1"), lambda a: a.ref_count(True),
], ids=["float", "bool", "str", "int", "unhashable", "share-float", "share-str", "ref-bool"])
def test_both_pools_refuse_block_ids_of_the_wrong_type(alloc, call):
    alloc.allocate(2, ADM)
    rejected(alloc, BlockOutOfRangeError, "block", call, alloc)


def test_allocated_counts_the_blocks_requests_hold_never_vllms_null_block(alloc):
    """One definition of allocated (F's denominator) for both pools: vLLM's null block is neither free nor ours."""
    assert (alloc.num_free, alloc.num_allocated) == (9, 0)
    got = alloc.allocate(3, ADM)
    alloc.share(got[0])  # two references, still one block
    assert (alloc.num_free, alloc.num_allocated) == (6, 3)
    alloc.free(got)
    assert (alloc.num_free, alloc.num_allocated) == (8, 1)


def test_one_waste_ratio_for_the_trigger_the_metrics_and_vllm(alloc):
    """F: 5 live tokens in 2 blocks of 4 is 1 - 5/8 over either pool, from the trigger's O(1) read and (core pool)
    the metrics' recount. (The trigger once counted vLLM's null block as allocated, 1 - 5/12; the vLLM gauge,
    which now reads the trigger's F, did not.)"""
    table = TokenTable(N, S)
    mgr = ReclamationManager(alloc, table, InMemoryCopyEngine(TagStore(N, S)), ReclaimConfig())
    table.add_request("r")
    table.sync_new_tokens("r", alloc.allocate(2, ADM), 6)
    table.evict_token("r", 2)
    assert mgr.waste_ratio() == 1 - 5 / 8
    if isinstance(alloc, BlockPool):
        assert measure(alloc, table).waste_ratio == 1 - 5 / 8
