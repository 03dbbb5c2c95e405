"""Edges of core/runtime.py that the full mutmut run's survivors showed no unit test pinned.

mutmut 3.8.1 ran every mutant of core/'s safety modules against the unit tests; 83 mutants of
core/runtime.py survived. Twelve are equivalent (no input tells them from the original: e.g. a bound moved from
``< 0`` to ``<= 0`` where check_int accepts the 0 it now also checks, or a forecast layout that attaches more
destinations, each adding one block and S cursor positions, so the growth it forecasts is the same); every
other one fails a test below. What they pin:

  * the constructor's checks: an int budget of exactly 1, the protocol checks' whole messages (the missing
    methods and attributes, joined by ", "), a policy object without a str name, the seed's message, the
    dense read path's two configuration messages, and the defaults (seed 0, a score window of 32);
  * the public helpers ``blocks_to_grow`` and ``token_budget``: what they refuse (a bool, a negative
    count) with the argument's name and bound in the message, and a ratio budget's floor of one token;
  * ``begin_step``: appends of 0 and of an int subclass are legal, the exhaustion message names at most 8
    requests, growth is recomputed after a densify commit that frees no block, the forecast counts a
    settled copy listed after a pending one, and a forecast the engine betrays ends in ``P3``;
  * ``end_step``: its messages, and a row of a request that finished during the step drops only that row;
  * the view a policy sees (its seed, its persistence reader, the name ``RenamedRequests`` gives it), victims of an
    int subclass, and the invalid-victims message's cut at 8;
  * the dense path: a request that is already dense is not planned; a dense read that hits a hole is ``I7``
    with the slot, block and offset of the first hole.

Scenes are built with ``make`` / ``forward`` / ``Scripted`` of tests/test_runtime.py and ``refused`` of
tests/test_mutation_survivors.py (exact error class, whole message, nothing changed).
"""

from __future__ import annotations

from collections import Counter

import pytest

from test_mutation_survivors import exhausted, refused
from test_runtime import EVICT, DENSIFY_EVENT, Scripted, forward, make
from vtoken.core.block_pool import BlockPool
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.errors import (
    ConfigError,
    InvalidArgumentError,
    InvariantViolation,
    PolicyError,
    PoolExhaustedError,
    StepOrderError,
)
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.plan import PlanKind
from vtoken.core.policies import POLICIES, RenamedRequests
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime, check_budget


class Count(int):
    """An int subclass (as an IntEnum member or a framework's integer type is): a legal count and token id."""


# =====================================================================================================
# Construction
# =====================================================================================================
def test_an_int_budget_of_one_token_is_legal():
    assert check_budget(1) is None
    rt, _ = make(budget=1)
    assert rt.budget == 1 and rt.token_budget(50) == 1
    with pytest.raises(ConfigError, match=r"got 0$"):
        check_budget(0)


class HalfPool:
    """The allocator's methods and two of its four attributes."""

    num_blocks, block_size = 4, 4

    def can_allocate(self, n, purpose): return True
    def allocate(self, n, purpose): return []
    def free(self, blocks): pass
    def share(self, b): pass
    def ref_count(self, b): return 0
    def is_cached(self, b): return False

    def __repr__(self):
        return "<HalfPool>"


class HalfEngine:
    """Two of the copy engine's six methods."""

    def submit(self, moves, req_id=None): return 0
    def poll(self, handle): return CopyStatus.DONE

    def __repr__(self):
        return "<HalfEngine>"


def test_a_pool_without_the_protocols_attributes_is_refused_naming_them():
    engine = InMemoryCopyEngine(TagStore(4, 4))
    with pytest.raises(ConfigError) as err:
        VTokenRuntime(HalfPool(), engine)
    assert str(err.value) == "pool must implement the pool protocol; <HalfPool> lacks headroom, num_free"


def test_an_engine_without_the_protocols_methods_is_refused_naming_them():
    with pytest.raises(ConfigError) as err:
        VTokenRuntime(BlockPool(4, 4, 1), HalfEngine())
    assert str(err.value) == ("engine must implement the engine protocol; <HalfEngine> lacks order_before_compute(), "
                              "wait(), release(), before_compute()")


class Nameless:
    """Has select_victims but its name is not a str."""

    name = 5

    def select_victims(self, view):
        return []

    def __repr__(self):
        return "<Nameless>"


def test_a_policy_whose_name_is_not_a_str_is_refused_without_a_hint():
    pool, engine = BlockPool(4, 4, 1), InMemoryCopyEngine(TagStore(4, 4))
    with pytest.raises(ConfigError) as err:
        VTokenRuntime(pool, engine, Nameless())
    assert str(err.value) == ("policy must be None, an EvictionPolicy (select_victims(view) and a name) or one of "
                              f"{sorted(POLICIES)}, got <Nameless>")


def test_the_seed_must_be_an_int_and_the_message_names_it():
    pool, engine = BlockPool(4, 4, 1), InMemoryCopyEngine(TagStore(4, 4))
    with pytest.raises(ConfigError) as err:
        VTokenRuntime(pool, engine, seed="7")
    assert str(err.value) == "seed must be an int, got '7'"


@pytest.mark.parametrize("reclaim, message", [
    (ReclaimConfig(), "read_path 'dense' needs reclaim planner 'densify': stock kernels cannot skip holes"),
    (ReclaimConfig(planner=PlanKind.DENSIFY), "read_path 'dense' needs ordering 'event' or 'force_sync', not 'poll'"),
])
def test_the_dense_paths_configuration_errors_whole(reclaim, message):
    with pytest.raises(ConfigError) as err:
        make(policy=Scripted(), reclaim=reclaim, read_path=ReadPath.DENSE)
    assert str(err.value) == message


def test_the_defaults_are_seed_0_and_a_score_window_of_32():
    rt = VTokenRuntime(BlockPool(4, 4, 1), InMemoryCopyEngine(TagStore(4, 4)))
    assert rt.seed == 0
    assert rt.scores.decay == 1.0 - 1.0 / 32  # 0.96875, exact


# =====================================================================================================
# blocks_to_grow, token_budget
# =====================================================================================================
@pytest.mark.parametrize("n_new", [True, -1, 1.0])
def test_blocks_to_grow_refuses_what_is_not_a_count(n_new):
    rt, _ = make()
    rt.admit("a")
    refused(lambda: rt.blocks_to_grow("a", n_new), InvalidArgumentError,
            f"request 'a': n_new must be an int >= 0, got {n_new!r}", rt)


@pytest.mark.parametrize("total_len", [-1, True])
def test_token_budget_refuses_what_is_not_a_length(total_len):
    rt, _ = make()
    refused(lambda: rt.token_budget(total_len), InvalidArgumentError,
            f"total_len must be an int >= 0, got {total_len!r}", rt)


@pytest.mark.parametrize("total_len, expect", [(0, 1), (1, 1), (2, 1), (3, 2)])
def test_a_ratio_budget_keeps_at_least_one_token(total_len, expect):
    rt, _ = make(budget=0.5)
    assert rt.token_budget(total_len) == expect


# =====================================================================================================
# begin_step
# =====================================================================================================
def test_begin_step_refuses_appends_that_are_not_a_mapping_naming_them():
    rt, _ = make()
    rt.admit("a")
    refused(lambda: rt.begin_step([("a", 1)]), InvalidArgumentError,
            "appends must be a mapping, got [('a', 1)]", rt)


def test_begin_step_accepts_an_append_of_zero_tokens():
    rt, engine = make()
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 3}))
    rt.end_step()
    req = rt.begin_step({"a": 0}).requests["a"]
    assert req.new_tokens == range(3, 3) and req.write_slots == []
    assert req.read_slots == [0, 1, 2] and req.read_tokens == [0, 1, 2]


def test_begin_step_accepts_an_append_count_of_an_int_subclass():
    rt, _ = make()
    rt.admit("a")
    req = rt.begin_step({"a": Count(3)}).requests["a"]
    assert req.new_tokens == range(0, 3) and req.write_slots == [0, 1, 2]
    assert rt.table.total_len("a") == 3


def test_the_exhaustion_message_names_at_most_eight_requests():
    rt, _ = make(num_blocks=9, headroom=1)
    ids = [f"r{i}" for i in range(9)]
    for r in ids:
        rt.admit(r)
    # nine new requests of one token need nine blocks; admission may take 9 - 1
    refused(lambda: rt.begin_step({r: 1 for r in ids}), PoolExhaustedError, exhausted(0, ids[:8], 9, 9), rt)


def test_growth_is_recomputed_after_a_densify_commit_that_frees_no_block():
    # 8 tokens in [0, 1], token 1 evicted: the densify plan moves token 7 into slot 1 and frees nothing, so
    # the pool's free count does not change when it commits; the cursor goes back to 7 and one append fits
    # block 1 (the need computed before settling, for cursor 8, was one block)
    rt, engine = make(policy=Scripted({("a", 0): [1]}), budget=7, reclaim=DENSIFY_EVENT, read_path=ReadPath.DENSE)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 8}))
    assert rt.end_step() == {"a": [1]}
    rec = rt.manager.in_flight("a")
    assert rec.plan.src_blocks == () and rec.plan.dense_write_pos == 7
    free = rt.pool.free_block_ids()
    req = rt.begin_step({"a": 1}).requests["a"]
    assert rec.state is PlanState.COMMITTED
    assert rt.table.block_ids("a") == [0, 1] and rt.table.write_pos("a") == 8
    assert req.write_slots == [7] and rt.pool.free_block_ids() == free


def two_compactions():
    """12 blocks of 4, headroom 2, an engine whose copies may finish in any order: "a" (blocks 0-3) and "b"
    (blocks 4-7) hold 14 tokens each, EVICT evicted; "a"'s plan (0, 1, 2 into 8) was made first, then
    "b"'s (4, 5, 6 into 9); both copies are pending; blocks 10 and 11 are free."""
    pool = BlockPool(12, 4, 2)
    engine = InMemoryCopyEngine(TagStore(12, 4), auto_complete=False, one_stream=False)
    rt = VTokenRuntime(pool, engine, Scripted({("a", 0): EVICT, ("b", 0): EVICT}), 2, ReclaimConfig())
    rt.admit("a")
    rt.admit("b")
    forward(rt, engine, rt.begin_step({"a": 14, "b": 14}))
    assert rt.end_step() == {"a": EVICT, "b": EVICT}
    a, b = rt.manager.in_flight("a"), rt.manager.in_flight("b")
    assert list(rt.manager.inflight) == ["a", "b"]
    assert a.plan.src_blocks == (0, 1, 2) and a.plan.dst_blocks == (8,)
    assert b.plan.src_blocks == (4, 5, 6) and b.plan.dst_blocks == (9,)
    assert a.state is b.state is PlanState.COPYING and pool.free_block_ids() == [10, 11]
    return rt, engine, a, b


def test_the_forecast_counts_a_settled_copy_listed_after_a_pending_one():
    rt, engine, a, b = two_compactions()
    engine.complete(b.handle)  # "a"'s copy stays pending
    # after settling: "b" is [9, 7] with cursor 6 and blocks 4, 5, 6 are free (5 free, 3 for admission):
    # 6 + 14 = 20 tokens in five blocks fits, one more token does not
    refused(lambda: rt.begin_step({"b": 15}), PoolExhaustedError, exhausted(1, ["b"], 4, 5, reserved=2), rt)
    rt.begin_step({"b": 14})
    assert b.state is PlanState.COMMITTED and a.state is PlanState.COPYING
    assert rt.table.block_ids("b") == [9, 7, 10, 11, 4] and rt.pool.free_block_ids() == [5, 6]


class BetrayingEngine(InMemoryCopyEngine):
    """Answers DONE to the next poll after ``betray()``, whatever the copy's real status: a broken engine."""

    lie = False

    def betray(self):
        self.lie = True

    def poll(self, handle):
        if self.lie:
            self.lie = False
            return CopyStatus.DONE
        return super().poll(handle)


def test_a_forecast_the_engine_betrays_is_P3():
    # "a": 14 tokens in [0, 1, 2, 3], EVICT evicted; its compact plan (0, 1, 2 into 4) is copying. The copy
    # fails, but the forecast's poll hears DONE: it counts blocks 0, 1, 2 as freed and lets 14 appends
    # through; settling then polls FAILED and aborts, freeing only block 4, so the growth does not fit
    pool = BlockPool(6, 4, 1)
    engine = BetrayingEngine(TagStore(6, 4), auto_complete=False)
    rt = VTokenRuntime(pool, engine, Scripted({("a", 0): EVICT}), 2, ReclaimConfig())
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 14}))
    assert rt.end_step() == {"a": EVICT}
    rec = rt.manager.in_flight("a")
    assert rec.plan.src_blocks == (0, 1, 2) and rec.plan.dst_blocks == (4,)
    engine.fail(rec.handle)
    engine.betray()
    with pytest.raises(InvariantViolation) as err:
        rt.begin_step({"a": 14})
    assert err.value.invariant == "P3"
    assert str(err.value) == "P3: step 1: appends need 3 blocks after settling, 2 free; the forecast said they fit"
    assert rec.state is PlanState.ABORTED and pool.free_block_ids() == [5, 4]


# =====================================================================================================
# end_step
# =====================================================================================================
def test_end_step_without_begin_step_has_exactly_this_message():
    rt, _ = make()
    refused(rt.end_step, StepOrderError, "end_step without begin_step", rt)


def test_end_step_refuses_attention_that_is_not_a_mapping_naming_it():
    rt, _ = make()
    rt.admit("a")
    rt.begin_step({"a": 2})
    refused(lambda: rt.end_step([[0.5, 0.5]]), InvalidArgumentError,
            "attention must be a mapping, got [[0.5, 0.5]]", rt)


def test_a_row_of_a_request_that_finished_during_the_step_drops_only_that_row():
    rt, _ = make()
    rt.admit("a")
    rt.admit("b")
    rt.begin_step({"a": 2, "b": 2})
    rt.finish("a")
    assert rt.end_step({"a": [1.0, 0.0], "b": [0.75, 0.25]}) == {}
    assert [rt.scores.accumulated("b", t) for t in (0, 1)] == [0.75, 0.25]


# =====================================================================================================
# What a policy sees and returns
# =====================================================================================================
def first_view(**kwargs):
    """One step of 4 tokens for "a" with the row [0.5, 0.25, 0.25, 0.0]; the view the policy saw."""
    policy = Scripted()
    pool, engine = BlockPool(8, 4, 1), InMemoryCopyEngine(TagStore(8, 4))
    rt = VTokenRuntime(pool, engine, policy, 0.5, **kwargs)
    rt.admit("a")
    return rt, policy


def test_the_view_carries_the_runtimes_seed():
    rt, policy = first_view(seed=7)
    rt.begin_step({"a": 4})
    rt.end_step()
    assert policy.views[0].seed == 7


def test_the_view_carries_the_persistence_of_this_steps_row():
    rt, policy = first_view()
    rt.begin_step({"a": 4})
    rt.end_step({"a": [0.5, 0.25, 0.25, 0.0]})  # mean 0.25: tokens 0, 1, 2 were important, token 3 was not
    view = policy.views[0]
    assert [view.persistence(t) for t in range(4)] == [1.0, 1.0, 1.0, 0.0]
    assert [view.accumulated(t) for t in range(4)] == [0.5, 0.25, 0.25, 0.0]


def test_the_view_names_the_request_as_policy_names_says():
    policy = Scripted()
    pool, engine = BlockPool(8, 4, 1), InMemoryCopyEngine(TagStore(8, 4))
    rt = VTokenRuntime(pool, engine, RenamedRequests(policy, {"a": "a-without-suffix"}), 0.5)
    rt.admit("a")
    rt.begin_step({"a": 4})
    rt.end_step()
    assert policy.views[0].req_id == "a-without-suffix"


def test_victims_of_an_int_subclass_are_evicted():
    policy = Scripted({("a", 0): [Count(1), Count(2)]})
    rt, engine = make(policy=policy, budget=0.5)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 4}))
    assert rt.end_step() == {"a": [1, 2]}
    assert rt.table.live_token_ids("a") == [0, 3]


def test_the_invalid_victims_message_shows_at_most_eight_of_each():
    victims = list(range(100, 109))  # nine tokens outside the request
    rt, engine = make(policy=Scripted({("a", 0): victims}), budget=1)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 12}))
    shown = list(range(100, 108))
    refused(rt.end_step, PolicyError,
            f"policy 'scripted' returned invalid victims for request 'a': {shown} (bad: {shown}, excess allowed 11)",
            rt.table, rt.pool, rt.manager)


# =====================================================================================================
# The dense read path
# =====================================================================================================
def test_a_request_that_is_already_dense_is_not_planned():
    rt, engine = make(policy=Scripted(), budget=1.0, reclaim=DENSIFY_EVENT, read_path=ReadPath.DENSE)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 6}))
    assert rt.end_step() == {}
    assert rt.manager.inflight == {} and rt.manager.stats.plans_made == 0
    assert rt.manager.stats.no_plan == Counter()


def test_a_dense_read_that_hits_a_hole_is_I7_naming_the_first_hole():
    # holes made behind the runtime's back (as a lost densify commit would leave them): tokens 3 and 4 of
    # 8 in [0, 1]; the dense read of positions [0, 6) hits slot 3 (block 0) first, slot 4 (block 1) next
    rt, engine = make(policy=None, reclaim=None, read_path=ReadPath.DENSE)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 8}))
    rt.end_step()
    rt.table.evict_token("a", 3)
    rt.table.evict_token("a", 4)
    with pytest.raises(InvariantViolation) as err:
        rt.begin_step({})
    assert err.value.invariant == "I7"
    assert str(err.value) == "I7: request 'a': dense read of [0, 6) hits slot 3 (block 0, offset 3) with no live token"
