"""V6 at the runtime level (issues #45, #46): ``FastRuntime`` is the core's ``VTokenRuntime`` on the dense path, and
``GatherRuntime`` on the gather path, step by step.

The machine is ``vtoken fuzz --target fast``'s (``fuzz/fast_target.py``): it plays the engine vLLM is (a pool,
requests admitted empty, prefix-cache hits across steps and within one, a step's syncs in one call, eviction and
densify for the decoding requests, departures) on a ``ShadowedRuntime``, the core's runtime beside the fast one on a
replay of the same pool, compared after every call; after every rule the fast tables' views are recounted. Calls
the core refuses must be refused alike and change nothing. Each planted bug of ``FAST_BUGS`` (in the kernels'
answers and in the runtime) must be caught.

Replay a failure: the seed Hypothesis prints (``@reproduce_failure``), or rerun this file: the ``ci`` profile is
derandomized.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

pytest.importorskip("numba")

from vtoken.core.block_pool import BlockPool, Purpose  # noqa: E402
from vtoken.core.copy_engine import CopyStatus  # noqa: E402
from vtoken.core.errors import ConfigError, InvalidArgumentError, InvariantViolation  # noqa: E402
from vtoken.core import token_table  # noqa: E402
from vtoken.core.plan import PlanKind  # noqa: E402
from vtoken.core.policies import RandomPolicy, StreamingLLM  # noqa: E402
from vtoken.core.reclamation import Ordering, ReclaimConfig  # noqa: E402
from vtoken.core.runtime import ReadPath  # noqa: E402
from vtoken.core.token_table import Move  # noqa: E402
from vtoken.fuzz.fast_target import FAST_BUGS, FastMachine  # noqa: E402
from vtoken.fuzz.planted import planted  # noqa: E402
from vtoken.integration.fastpath import runtime as fast_runtime  # noqa: E402
from vtoken.integration.fastpath.gather_runtime import GatherRuntime  # noqa: E402
from vtoken.integration.fastpath.shadow import ShadowedRuntime, ShadowEngine  # noqa: E402

S = 4


def test_the_fast_runtime_equals_the_core_on_every_call():
    run_state_machine_as_test(FastMachine, settings=settings(max_examples=60, stateful_step_count=40,
                                                             suppress_health_check=list(HealthCheck)))


def test_a_due_request_whose_tokens_are_all_protected_plans_nothing_on_either_side():
    """Found by the machine: a request over its budget whose tokens all lie in shared blocks (or in the recent
    window) loses no victim; the kernel then reports it already dense, which the core never plans at all, so neither
    side counts a NoPlan."""
    pool = BlockPool(8, S)
    rt = ShadowedRuntime(pool, ShadowEngine(), StreamingLLM(sinks=0), 0.5, 4, 32)
    rt.admit("holder")
    [head] = pool.allocate(1, Purpose.ADMISSION)
    rt.sync_many([("holder", [head], S)])
    pool.share(head)
    rt.admit("hit")
    [tail] = pool.allocate(1, Purpose.ADMISSION)
    rt.sync_many([("hit", [head, tail], S + 1)])
    assert rt.evict_and_reclaim(["hit"]) == {} and len(rt.take_commits()) == 0
    assert not rt.reclaim_stats.no_plan and not rt.core.reclaim_stats.no_plan


def test_rows_for_a_policy_that_reads_none_are_refused_alike_and_change_nothing():
    """The core records attention rows for any policy; the fast path's policies read none, so it refuses them (a
    wiring bug in the caller): a divergence the shadow reports, never a silent drop."""
    rt = ShadowedRuntime(BlockPool(8, S), ShadowEngine(), StreamingLLM(), 0.5, 2, 16)
    rt.admit("a")
    with pytest.raises(InvariantViolation, match="V6.*error"):
        rt.evict_and_reclaim(["a"], attention={"a": ([], [])})


def test_the_fast_path_refuses_a_policy_outside_its_domain():
    from vtoken.core.policies import H2O
    with pytest.raises(ConfigError, match="StreamingLLM and Random only, not H2O"):
        fast_runtime.FastRuntime(BlockPool(8, S), ShadowEngine(), H2O(), 0.5, 2, 16)


def test_the_fast_path_refuses_an_engine_without_submit_ordered():
    from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
    with pytest.raises(ConfigError, match="one submit_ordered call, which InMemoryCopyEngine does not offer"):
        fast_runtime.FastRuntime(BlockPool(8, S), InMemoryCopyEngine(TagStore(8, S)), StreamingLLM(), 0.5, 2, 16)


# ---- the gather path (issue #46) ------------------------------------------------------------------------------------
def _gather_shadow(pool: BlockPool, policy, budget, config: ReclaimConfig | None) -> ShadowedRuntime:
    return ShadowedRuntime(pool, ShadowEngine(), policy, budget, 4, 64, seed=3, read_path=ReadPath.GATHER,
                           config=config)


def test_the_gather_runtime_refuses_a_planner_or_ordering_outside_its_domain():
    for config in (ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT), ReclaimConfig(ordering=Ordering.POLL)):
        with pytest.raises(ConfigError, match="compacts with EVENT ordering, or reclaims nothing"):
            GatherRuntime(BlockPool(8, S), ShadowEngine(), None, 0.5, 2, 16, config)


def test_a_compaction_takes_the_blocks_the_core_allocated_and_commits_in_the_step_that_plans_it():
    """Random at half the tokens leaves every block part full; with theta_f 0 each step's round compacts. The core
    allocates the destinations from the real pool, the fast path is handed the same ones (the shadow compares the
    plans, frees and states), and after the step they are the request's: nothing is in flight, nothing leaks."""
    pool = BlockPool(32, S)
    rt = _gather_shadow(pool, RandomPolicy(keep_recent=0), 0.5, ReclaimConfig(theta_f=0.0, ordering=Ordering.EVENT))
    rt.admit("a")
    rt.sync_many([("a", pool.allocate(6, Purpose.ADMISSION), 24)])
    compacts = []
    for _ in range(4):
        need = -(-(rt.write_pos("a") + 1) // S) - rt.num_blocks_of("a")
        rt.sync_many([("a", pool.allocate(need, Purpose.ADMISSION) if need > 0 else [], rt.total_len("a") + 1)])
        rt.evict_and_reclaim(["a"])
        compacts += [p for p in rt.take_commits().all_plans() if p.kind is PlanKind.COMPACT]
    assert compacts, "no compaction in four steps of Random at half the tokens"
    listed = rt.block_ids("a")
    assert all(b in listed for b in compacts[-1].dst_blocks)
    assert not set(compacts[-1].src_blocks) & set(listed)
    assert pool.num_allocated == len(listed) and rt.plans_outstanding() == 0
    assert rt.reclaim_stats.plans_committed == rt.core.reclaim_stats.plans_committed == len(compacts)


def test_the_fast_path_asking_for_blocks_the_core_did_not_allocate_is_a_divergence():
    rt = _gather_shadow(BlockPool(8, S), None, 0.5, ReclaimConfig(ordering=Ordering.EVENT))
    with pytest.raises(InvariantViolation, match=r"V6: the fast path allocated 2 block\(s\) where the core allocated "
                                                 r"none"):
        rt._pool.allocate(2, Purpose.EVACUATION)


def test_read_changes_past_the_change_logs_bound_say_rebuilt_on_both_sides(monkeypatch):
    """The core's table drops a request's change log past ``CHANGE_LOG_LIMIT`` entries and says "rebuilt"; the fast
    path's log is bounded alike (the shadow compares the answers), and below the bound it lists the evictions."""
    monkeypatch.setattr(token_table, "CHANGE_LOG_LIMIT", 2)
    pool = BlockPool(16, S)
    rt = _gather_shadow(pool, StreamingLLM(sinks=0), 4, None)
    rt.admit("a")
    rt.sync_many([("a", pool.allocate(2, Purpose.ADMISSION), 7)])
    assert rt.read_changes("a").rebuilt  # the first take
    rt.evict_and_reclaim(["a"])  # 3 evicted: past the bound
    assert rt.read_changes("a").rebuilt
    rt.sync_many([("a", [], 8)])
    rt.evict_and_reclaim(["a"])  # 1 evicted, 1 joined
    c = rt.read_changes("a")
    assert (c.rebuilt, c.evicted, c.joined) == (False, (3,), (7,))
    rt.sync_many([("a", pool.allocate(1, Purpose.ADMISSION), 10)])
    rt.evict_and_reclaim(["a"])  # 2 evicted: at the bound, still listed (the read kernels' mutation run)
    c = rt.read_changes("a")
    assert (c.rebuilt, c.evicted, c.joined) == (False, (4, 5), (8, 9))


def test_the_shadow_engines_submit_ordered_is_its_three_calls_and_refuses_what_is_no_pair():
    engine = ShadowEngine()
    moves = (Move(0, 1, 0, 2, 0),)
    assert engine.submit_ordered([(moves, "a"), ((), "b")]) == [CopyStatus.ORDERED] * 2
    assert engine.submit_ordered([]) == []
    assert engine.submitted == [("a", moves), ("b", ())]
    for bad, named in (("ab", "'ab'"), ([(moves, "a"), (moves,)], "got ((Move("), ([[moves, "a"]], "got [(Move(")):
        with pytest.raises(InvalidArgumentError, match=re.escape(named)):
            engine.submit_ordered(bad)
    assert engine.submitted == [("a", moves), ("b", ())]  # a refused call submitted nothing


# ---- planted bugs: the shadow (or the views' recount) must catch each -------------------------------------------
@pytest.mark.parametrize("bug", sorted(FAST_BUGS))
def test_a_planted_fast_path_bug_is_caught(bug):
    """V6 for the scheduler's side; the workers' patch of their read lists, which no shadow runs, is caught by its
    own check against the table's lists (V2)."""
    with planted(bug), pytest.raises(InvariantViolation, match="V2" if "patch" in bug else "V6"):
        run_state_machine_as_test(FastMachine, settings=settings(max_examples=300, stateful_step_count=100,
                                                                 suppress_health_check=list(HealthCheck),
                                                                 phases=(Phase.generate,)))  # found, not shrunk


def test_a_step_handed_out_of_admission_order_commits_in_admission_order():
    """vLLM's running order need not be the admission order: two requests, both due and both densifying every step,
    handed over as [1, 0]. The plans commit (and their copies go out) in admission order, 0 then 1, as the core's
    settle commits them; the shadow compares every call. Kills ``step_record``'s sort mutants (mutation run:
    fuzz/mutation_kernels.json), which no caller in admission order reached."""
    pool = BlockPool(48, S)
    names: dict = {}
    rt = ShadowedRuntime(pool, ShadowEngine(), StreamingLLM(sinks=1), 6, 6, 64, evict_every=1, names=names)
    for r in (0, 1):
        names[r] = f"arrival-{r}"
        rt.admit(r)
        rt.sync_many([(r, pool.allocate(3, Purpose.ADMISSION), 10)])
    for step in range(3):
        items = []
        for r in (1, 0):
            need = max(0, -(-(rt.write_pos(r) + 1) // S) - rt.num_blocks_of(r))
            items.append((r, pool.allocate(need, Purpose.ADMISSION) if need else [], rt.total_len(r) + 1))
        rt.sync_many(items)
        victims = rt.evict_and_reclaim([1, 0])
        assert sorted(victims) == [0, 1] and all(victims.values())
        assert [p.req_id for p in rt.take_commits().all_plans()] == [0, 1], step


def test_step_commits_count_what_the_scheduler_counts_and_list_only_the_plans_that_change_a_block_list():
    """``StepCommits.of_plans`` (the core's answer to ``take_commits``): a compact plan's destinations its request
    keeps are not released blocks; ``touched`` names the plans after which vLLM's block list must be mirrored (any
    plan but a densify that released nothing), or every plan when prefix caching drops their hashes."""
    from vtoken.core.plan import Plan, PlanKind
    from vtoken.integration.fastpath.commits import StepCommits

    still = Plan(PlanKind.DENSIFY, "a", (1, 9), (Move(7, 1, 3, 1, 1),), (), (), 8)
    cut = Plan(PlanKind.DENSIFY, "b", (2, 9), (Move(5, 2, 2, 2, 0),), (4, 6), (), 3)
    packed_ = Plan(PlanKind.COMPACT, "c", (1, 12), (Move(0, 3, 0, 8, 0), Move(1, 5, 2, 8, 1)), (3, 5), (8,))
    dropped = Plan(PlanKind.RELEASE, "d", (4, 20), (), (9,))
    # only a plan with destinations keeps any: the counts given for the others are not read
    c = StepCommits.of_plans([still, cut, packed_, dropped], kept=[7, 7, 1, 7])
    assert (c.plans, c.releases, c.densified, c.moves, c.blocks_released) == (3, 1, 2, 4, 2 + 2 - 1 + 1)
    assert c.touched(everything=False) == [cut, packed_, dropped]
    assert c.touched(everything=True) == c.all_plans() == [still, cut, packed_, dropped] and len(c) == 4
