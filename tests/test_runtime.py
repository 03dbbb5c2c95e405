"""VTokenRuntime: Algorithm 1 through begin_step / end_step on tiny pools with concrete slots."""

from __future__ import annotations

import pytest

from vtoken.core.block_pool import BlockPool
from vtoken.core.errors import (
    BlockNotOwnedError,
    ConfigError,
    DuplicateRequestError,
    PoolExhaustedError,
    UnknownRequestError,
    VTokenError,
)
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.reference.invariants import check_all
from vtoken.core.plan import PlanKind
from vtoken.core.policies import H2O, StreamingLLM
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig
from vtoken.core.runtime import AdmissionClosedError, ReadChanges, ReadPath, VTokenRuntime
from vtoken.core.token_table import Move

DENSIFY_EVENT = ReclaimConfig(planner=PlanKind.DENSIFY, ordering=Ordering.EVENT)


def tag(req, t: int) -> int:
    return {"a": 1000, "b": 2000}[req] + t + 1


class Scripted:
    """Evicts exactly the scripted (request, step) victims and records every view it is shown."""

    def __init__(self, victims=None, name="scripted", delegate=None):
        self.victims = victims or {}
        self.name = name
        self.delegate = delegate
        self.views = []

    def select_victims(self, view):
        self.views.append(view)
        if (view.req_id, view.step) in self.victims:
            return list(self.victims[(view.req_id, view.step)])
        return self.delegate.select_victims(view) if self.delegate else []


def make(num_blocks=8, block_size=4, headroom=1, policy=None, budget=0.5, reclaim=None,
         read_path=ReadPath.GATHER, auto_complete=True):
    pool = BlockPool(num_blocks, block_size, headroom)
    engine = InMemoryCopyEngine(TagStore(num_blocks, block_size), auto_complete=auto_complete)
    return VTokenRuntime(pool, engine, policy, budget, reclaim, read_path), engine


def forward(rt, engine, inputs, tags=tag):
    """The fake model: wait on ordered copies, write new tokens' tags, read every slot back."""
    engine.before_compute()
    for r, req in inputs.requests.items():
        for t, slot in zip(req.new_tokens, req.write_slots):
            engine.store.write(slot, tags(r, t))
        got = [engine.store.read(s) for s in req.read_slots]
        assert got == [tags(r, t) for t in req.read_tokens], f"request {r}: read the wrong K/V"


def dense_positions(rt, r) -> list[int]:
    S, blocks = rt.pool.block_size, rt.table.block_ids(r)
    return [blocks[p // S] * S + p % S for p in range(rt.table.num_live(r))]


# ---- Algorithm 1, gather read path ------------------------------------------------------------------
def test_algorithm_1_on_the_gather_path():
    rt, engine = make(policy=StreamingLLM(sinks=2))
    rt.admit("a")
    inp = rt.begin_step({"a": 6})
    assert inp.iteration == 0
    req = inp.requests["a"]
    assert req.new_tokens == range(0, 6)
    assert req.write_slots == [0, 1, 2, 3, 4, 5]
    assert req.read_slots == [0, 1, 2, 3, 4, 5] and req.read_tokens == [0, 1, 2, 3, 4, 5]
    assert rt.table.block_ids("a") == [0, 1] and rt.pool.num_free == 6
    forward(rt, engine, inp)
    weights = [0.3, 0.2, 0.1, 0.1, 0.1, 0.2]
    # budget ceil(0.5 * 6) = 3: sinks 0, 1 and a window of 1 (token 5) stay
    assert rt.end_step({"a": weights}) == {"a": [2, 3, 4]}
    assert rt.iteration == 1
    assert [rt.scores.accumulated("a", t) for t in range(6)] == pytest.approx(weights, rel=1e-6)
    assert rt.table.live_token_ids("a") == [0, 1, 5]
    assert rt.table.block_ids("a") == [0, 1]  # eviction frees nothing by itself
    check_all(rt, tag)

    inp = rt.begin_step({"a": 1})
    req = inp.requests["a"]
    assert req.new_tokens == range(6, 7) and req.write_slots == [6]
    # Eq. 2: the gather path reads exactly the live slots, in logical order
    assert req.read_slots == [0, 1, 5, 6] == rt.table.attention_slots("a")
    assert req.read_tokens == [0, 1, 5, 6] == rt.table.live_token_ids("a")
    forward(rt, engine, inp)
    assert rt.end_step() == {}  # 4 live, budget ceil(3.5) = 4

    inp = rt.begin_step({"a": 2})
    req = inp.requests["a"]
    assert req.write_slots == [7, 8] and rt.table.block_ids("a") == [0, 1, 2]
    assert req.read_slots == [0, 1, 5, 6, 7, 8]
    forward(rt, engine, inp)
    assert rt.end_step() == {"a": [5]}  # 6 live, budget 5: sinks 0, 1, window 3 (6, 7, 8)
    check_all(rt, tag)


def test_requests_without_appends_still_get_read_slots():
    rt, engine = make()
    rt.admit("a")
    rt.admit("b")
    forward(rt, engine, rt.begin_step({"a": 3, "b": 2}))
    rt.end_step()
    inp = rt.begin_step({"a": 1})
    assert inp.requests["b"].new_tokens == range(2, 2) and inp.requests["b"].write_slots == []
    assert inp.requests["b"].read_slots == [4, 5]
    assert inp.requests["a"].read_slots == [0, 1, 2, 3]


def test_end_step_without_begin_step_is_rejected():
    rt, _ = make()
    with pytest.raises(VTokenError, match="end_step without begin_step"):
        rt.end_step()
    rt.admit("a")
    rt.begin_step({"a": 1})
    rt.end_step()
    with pytest.raises(VTokenError, match="end_step without begin_step"):
        rt.end_step()
    assert rt.iteration == 1


def test_no_policy_never_evicts():
    rt, engine = make(policy=None, budget=0.1)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 9}))
    assert rt.end_step() == {}
    assert rt.table.num_live("a") == 9


# ---- the dense read path ------------------------------------------------------------------------------
@pytest.mark.parametrize("reclaim, match", [
    (None, "needs reclaim planner 'densify'"),
    (ReclaimConfig(), "needs reclaim planner 'densify'"),
    (ReclaimConfig(planner=PlanKind.DENSIFY), "needs ordering 'event' or 'force_sync', not 'poll'"),
])
def test_dense_path_requires_densify_with_event_or_force_sync(reclaim, match):
    with pytest.raises(ConfigError, match=match):
        make(policy=H2O(), reclaim=reclaim, read_path=ReadPath.DENSE)


def test_dense_path_without_a_policy_needs_no_reclamation():
    rt, _ = make(policy=None, reclaim=None, read_path=ReadPath.DENSE)
    assert rt.read_path is ReadPath.DENSE


@pytest.mark.parametrize("kwargs, match", [
    ({"budget": 0.0}, r"budget must be a ratio in \(0, 1\]"),
    ({"budget": 1.5}, r"budget must be a ratio in \(0, 1\]"),
    ({"read_path": "sparse"}, r"read_path must be one of \['gather', 'dense'\] \(a ReadPath or its value\), got 'sparse'"),
    ({"read_path": "GATHER"}, "read_path must be one of"),
])
def test_runtime_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        make(**kwargs)


def test_read_path_accepts_the_string_value_of_its_enum():
    rt, _ = make(policy=None, reclaim=None, read_path="dense")
    assert rt.read_path is ReadPath.DENSE
    rt, _ = make(read_path="gather")
    assert rt.read_path is ReadPath.GATHER


@pytest.mark.parametrize("ordering", [Ordering.EVENT, Ordering.FORCE_SYNC])
def test_dense_path_reads_positions_zero_to_n_live_after_evictions(ordering):
    rt, engine = make(policy=StreamingLLM(sinks=2), reclaim=ReclaimConfig(planner=PlanKind.DENSIFY, ordering=ordering),
                      read_path=ReadPath.DENSE, auto_complete=False)
    rt.admit("a")
    inp = rt.begin_step({"a": 6})
    assert inp.requests["a"].read_slots == [0, 1, 2, 3, 4, 5]
    forward(rt, engine, inp)
    assert rt.end_step() == {"a": [2, 3, 4]}
    rec = rt.manager.in_flight("a")
    assert rec.state is PlanState.COPYING
    assert rec.plan.moves == (Move(5, 1, 1, 0, 2),) and rec.plan.src_blocks == (1,)
    check_all(rt, tag, dense=True)

    inp = rt.begin_step({"a": 1})  # commits the densify plan, then appends token 6 at position 3
    assert rec.state is PlanState.COMMITTED
    assert rt.table.block_ids("a") == [0] and rt.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 1]
    req = inp.requests["a"]
    assert req.write_slots == [3]
    assert req.read_slots == [0, 1, 2, 3] == dense_positions(rt, "a")
    assert req.read_tokens == [0, 1, 5, 6]
    forward(rt, engine, inp)  # the ordered copy lands before the read: token 5's tag is at slot 2
    assert engine.store.read(2) == tag("a", 5)
    assert rt.end_step() == {}
    assert rt.manager.in_flight("a") is None  # already dense: nothing planned
    check_all(rt, tag, dense=True)

    inp = rt.begin_step({"a": 2})
    assert rt.table.block_ids("a") == [0, 2]
    assert inp.requests["a"].read_slots == [0, 1, 2, 3, 8, 9]
    forward(rt, engine, inp)
    assert rt.end_step() == {"a": [5]}  # 6 live, budget 5: token 5 (slot 2) leaves a hole
    assert rt.manager.in_flight("a").plan.moves == (Move(8, 2, 1, 0, 2),)

    inp = rt.begin_step({"a": 1})
    req = inp.requests["a"]
    assert req.read_slots == [0, 1, 2, 3, 8, 9] == dense_positions(rt, "a")
    assert req.read_tokens == [0, 1, 8, 6, 7, 9]  # position order, not logical order
    forward(rt, engine, inp)
    rt.end_step()
    check_all(rt, tag, dense=True)


# ---- bad policies, full pools, backpressure ------------------------------------------------------------
@pytest.mark.parametrize("victims, what", [
    ([99], "bad: [99]"),  # out of range
    ([1, 1], "bad: []"),  # duplicate
    ([2], "bad: [2]"),  # already evicted at step 0
    ([0, 1, 3], "excess allowed 2"),  # more than the excess
    ([-1], "bad: [-1]"),
])
def test_policy_returning_invalid_victims_is_named_and_nothing_is_evicted(victims, what):
    policy = Scripted({("a", 0): [2], ("a", 1): victims}, name="bad-policy")
    rt, engine = make(num_blocks=4, headroom=0, policy=policy, budget=0.5)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 5}))
    assert rt.end_step() == {"a": [2]}
    forward(rt, engine, rt.begin_step({"a": 1}))  # 5 live of 6, budget ceil(0.5 * 6) = 3: excess 2
    state = rt.table.state()
    with pytest.raises(VTokenError) as err:
        rt.end_step()
    msg = str(err.value)
    assert msg.startswith("policy 'bad-policy' returned invalid victims for request 'a'"), msg
    assert what in msg
    assert rt.table.state() == state
    assert rt.iteration == 1
    policy.victims[("a", 1)] = [0]  # the policy is fixed: the same step can be ended again
    assert rt.end_step() == {"a": [0]} and rt.iteration == 2


def test_attention_row_of_the_wrong_length_is_rejected_and_changes_nothing():
    policy = Scripted({("a", 0): [1]})
    rt, engine = make(num_blocks=4, headroom=0, policy=policy, budget=0.5)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 5}))
    state = rt.table.state()
    with pytest.raises(VTokenError, match=r"request 'a': attention row of 3 weights for 5 read tokens"):
        rt.end_step({"a": [0.2, 0.3, 0.5]})
    assert rt.table.state() == state and rt.scores.accumulated("a", 0) == 0.0 and rt.iteration == 0
    assert rt.end_step({"a": [0.2] * 5}) == {"a": [1]}
    assert rt.scores.accumulated("a", 0) == pytest.approx(0.2)


def test_victims_are_chosen_with_this_steps_row_already_recorded():
    """Algorithm 1 line 2 reads the scores of the decode before it: end_step records the step's row first."""
    policy = Scripted()
    rt, engine = make(num_blocks=4, headroom=0, policy=policy, budget=1.0)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 2}))
    seen = []
    policy.delegate = type("Peek", (), {"select_victims": lambda self, v: seen.append(v.accumulated(0)) or []})()
    rt.end_step({"a": [0.9, 0.1]})
    assert seen == [pytest.approx(0.9)]  # the first selection (right after prefill) already sees the prefill's row
    forward(rt, engine, rt.begin_step({"a": 1}))
    rt.end_step({"a": [0.5, 0.25, 0.25]})
    assert seen == [pytest.approx(0.9), pytest.approx(1.4)]
    assert rt.scores.accumulated("a", 0) == pytest.approx(1.4)


def test_h2o_first_eviction_after_prefill_keeps_the_prefills_heavy_hitter():
    """The prompt cut to the budget at once: H2O keeps what the prefill's row attended to, not the oldest."""
    rt, engine = make(num_blocks=4, headroom=0, policy=H2O(), budget=0.5)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 8}))
    row = [0.01] * 8
    row[1] = 0.93  # token 1, among the oldest, is the heavy hitter
    victims = rt.end_step({"a": row})["a"]
    assert len(victims) == 4 and 1 not in victims
    assert rt.table.is_live("a", 1)


def test_invalid_victims_take_back_the_rows_recorded_for_the_choice():
    policy = Scripted({("a", 0): [99]}, name="bad-policy")
    rt, engine = make(num_blocks=4, headroom=0, policy=policy, budget=0.5)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 5}))
    with pytest.raises(VTokenError, match="returned invalid victims"):
        rt.end_step({"a": [0.2] * 5})
    assert [rt.scores.accumulated("a", t) for t in range(5)] == [0.0] * 5
    assert [rt.scores.persistence("a", t) for t in range(5)] == [0.0] * 5
    policy.victims[("a", 0)] = [1]
    assert rt.end_step({"a": [0.2] * 5}) == {"a": [1]}
    assert rt.scores.accumulated("a", 0) == pytest.approx(0.2)  # recorded once, not twice


def test_begin_step_that_does_not_fit_raises_and_changes_nothing():
    rt, engine = make(num_blocks=4, headroom=1, policy=None)
    rt.admit("a")
    rt.admit("b")
    forward(rt, engine, rt.begin_step({"a": 4, "b": 4}))  # one full block each, 2 free, 1 reserved
    rt.end_step()
    before = (rt.table.state(), rt.pool.snapshot(), rt.iteration)
    with pytest.raises(PoolExhaustedError) as err:
        rt.begin_step({"a": 1, "b": 1})  # each fits alone, together they would take the headroom
    assert str(err.value) == ("step 1: appends of request(s) ['a', 'b'] need 2 blocks, 2 free with 1 reserved; "
                              "preempt a request first")
    assert (rt.table.state(), rt.pool.snapshot(), rt.iteration) == before
    with pytest.raises(VTokenError, match="end_step without begin_step"):
        rt.end_step()
    inp = rt.begin_step({"a": 1})  # one of them fits
    assert inp.requests["a"].write_slots == [8]


@pytest.mark.parametrize("appends, exc, match", [
    ({"zz": 1}, UnknownRequestError, "unknown request 'zz'"),
    ({"a": -1}, VTokenError, "request 'a': cannot append -1 tokens"),
    ({"a": 1.5}, VTokenError, "request 'a': cannot append 1.5 tokens"),
])
def test_begin_step_rejects_bad_appends_and_changes_nothing(appends, exc, match):
    rt, _ = make()
    rt.admit("a")
    before = (rt.table.state(), rt.pool.snapshot())
    with pytest.raises(exc, match=match):
        rt.begin_step(appends)
    assert (rt.table.state(), rt.pool.snapshot()) == before


EVICT = [1, 2, 3, 4, 5, 6, 10, 11]


def borrowed_headroom():
    """6 blocks x 4, headroom 2; a compact plan of request "a" is in flight and holds the headroom."""
    rt, engine = make(num_blocks=6, headroom=2, policy=Scripted({("a", 0): EVICT}), budget=0.4,
                      reclaim=ReclaimConfig(), auto_complete=False)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 14}))
    assert rt.end_step() == {"a": EVICT}
    rec = rt.manager.in_flight("a")
    assert rec.state is PlanState.COPYING and rec.plan.dst_blocks == (4,)
    assert rt.pool.num_free == 1
    return rt, engine, rec


def test_admission_is_closed_while_reclamation_borrows_the_headroom():
    rt, engine, rec = borrowed_headroom()
    assert not rt.can_admit(1)
    before = (rt.table.state(), rt.pool.snapshot())
    with pytest.raises(AdmissionClosedError, match="admission of 'b' waits for in-flight reclamation"):
        rt.admit("b")
    assert isinstance(AdmissionClosedError("x"), PoolExhaustedError)
    assert (rt.table.state(), rt.pool.snapshot()) == before and "b" not in rt.running()
    engine.complete(rec.handle)
    forward(rt, engine, rt.begin_step({}))  # settles: the plan commits, blocks 0, 1, 2 come back
    assert rec.state is PlanState.COMMITTED and rt.pool.num_free == 4
    assert rt.can_admit(4) and not rt.can_admit(9)
    rt.admit("b")
    assert rt.running() == ["a", "b"]


def test_decoding_continues_while_the_headroom_is_borrowed_if_no_block_is_needed():
    rt, engine, rec = borrowed_headroom()
    assert rt.blocks_to_grow("a", 2) == 0  # tokens 14, 15 fit in the cursor block
    inp = rt.begin_step({"a": 2})
    assert inp.requests["a"].write_slots == [14, 15]
    forward(rt, engine, inp)
    rt.end_step()
    with pytest.raises(PoolExhaustedError):
        rt.begin_step({"a": 1})  # this one needs a block, and only the borrowed headroom is free
    engine.complete(rec.handle)
    inp = rt.begin_step({"a": 1})  # the commit returns 2 blocks first
    assert rt.table.block_ids("a") == [4, 3, 5] and inp.requests["a"].write_slots == [20]
    check_all(rt)


# ---- prefix sharing --------------------------------------------------------------------------------------
def shared_prefix(read_path=ReadPath.GATHER, policy=None):
    reclaim = DENSIFY_EVENT if read_path is ReadPath.DENSE else None
    rt, engine = make(policy=policy or Scripted(), read_path=read_path, reclaim=reclaim, auto_complete=False)
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 10}), tags=lambda r, t: t + 1)
    assert rt.end_step() == {}
    return rt, engine


def test_prefix_sharing_shares_whole_blocks():
    rt, engine = shared_prefix()
    rt.admit("b", share_prefix_of="a", shared_blocks=2)
    assert [rt.pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 1]
    assert rt.table.block_ids("b") == [0, 1]
    assert rt.table.attention_slots("b") == list(range(8))
    inp = rt.begin_step({"b": 3})
    assert rt.table.block_ids("b") == [0, 1, 3]
    assert inp.requests["b"].new_tokens == range(8, 11)
    assert inp.requests["b"].write_slots == [12, 13, 14]
    assert inp.requests["b"].read_slots == list(range(8)) + [12, 13, 14]
    forward(rt, engine, inp, tags=lambda r, t: t + 1)  # same prefix, same content
    rt.end_step()
    check_all(rt)
    assert rt.preempt("a") == 10
    assert [rt.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 0]
    assert rt.pool.free_block_ids() == [4, 5, 6, 7, 2]
    check_all(rt)


@pytest.mark.parametrize("k, match", [
    (0, "request 'a' has no 0 full blocks to share"),
    (3, "request 'a' has no 3 full blocks to share"),  # block 2 holds only tokens 8, 9
    (4, "request 'a' has no 4 full blocks to share"),
])
def test_prefix_sharing_rejects_blocks_that_are_not_full(k, match):
    rt, _ = shared_prefix()
    before = (rt.table.state(), rt.pool.snapshot())
    with pytest.raises(BlockNotOwnedError, match=match):
        rt.admit("b", share_prefix_of="a", shared_blocks=k)
    assert (rt.table.state(), rt.pool.snapshot()) == before and "b" not in rt.running()


def test_prefix_sharing_rejects_blocks_whose_tokens_are_gone():
    rt, engine = make(policy=Scripted({("a", 0): [5]}))
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 10}))
    assert rt.end_step() == {"a": [5]}
    before = (rt.table.state(), rt.pool.snapshot())
    with pytest.raises(BlockNotOwnedError) as err:
        rt.admit("b", share_prefix_of="a", shared_blocks=2)
    assert str(err.value) == ("request 'a': block 1 no longer holds logical tokens [4, 8) in place; "
                              "it cannot be shared")
    assert (rt.table.state(), rt.pool.snapshot()) == before and "b" not in rt.running()
    rt.admit("b", share_prefix_of="a", shared_blocks=1)  # block 0 is intact
    assert rt.pool.ref_count(0) == 2 and rt.table.block_ids("b") == [0]


def test_prefix_sharing_from_an_unknown_request():
    rt, _ = shared_prefix()
    with pytest.raises(UnknownRequestError):
        rt.admit("b", share_prefix_of="nope", shared_blocks=1)
    assert "b" not in rt.running()


def test_dense_path_protects_tokens_in_shared_blocks():
    policy = Scripted({("a", 0): [], ("a", 1): []}, delegate=H2O())
    rt, engine = shared_prefix(read_path=ReadPath.DENSE, policy=policy)
    rt.admit("b", share_prefix_of="a", shared_blocks=2)
    policy.views.clear()
    inp = rt.begin_step({"b": 4})
    assert inp.requests["b"].read_slots == list(range(8)) + [12, 13, 14, 15]
    forward(rt, engine, inp, tags=lambda r, t: t + 1)
    # b: 12 tokens, budget 6, H2O window 3 -> candidates 0..8, but 0..7 sit in shared blocks
    assert rt.end_step() == {"b": [8]}
    views = {v.req_id: v for v in policy.views}
    assert views["b"].protected == frozenset(range(8))
    assert views["a"].protected == frozenset(range(8))  # a's blocks 0 and 1 are shared too
    plan = rt.manager.in_flight("b").plan
    assert plan.kind is PlanKind.DENSIFY and plan.moves == (Move(11, 3, 3, 3, 0),)
    inp = rt.begin_step({"b": 1})
    assert rt.table.slot_of("b", 11) == 12
    assert inp.requests["b"].read_slots == list(range(8)) + [12, 13, 14, 15] == dense_positions(rt, "b")
    forward(rt, engine, inp, tags=lambda r, t: t + 1)
    rt.end_step()
    check_all(rt, dense=True)


def test_dense_path_rejects_a_policy_that_evicts_a_shared_token():
    policy = Scripted({("b", 1): [0]}, name="greedy")
    rt, engine = shared_prefix(read_path=ReadPath.DENSE, policy=policy)
    rt.admit("b", share_prefix_of="a", shared_blocks=2)
    forward(rt, engine, rt.begin_step({"b": 4}), tags=lambda r, t: t + 1)
    with pytest.raises(VTokenError, match=r"policy 'greedy' returned invalid victims for request 'b': \[0\] \(bad: \[0\]"):
        rt.end_step()
    assert rt.table.is_live("b", 0)


def test_gather_path_does_not_protect_shared_tokens():
    policy = Scripted()
    rt, engine = shared_prefix(policy=policy)
    rt.admit("b", share_prefix_of="a", shared_blocks=2)
    forward(rt, engine, rt.begin_step({"b": 4}), tags=lambda r, t: t + 1)
    rt.end_step()
    assert {v.req_id: v.protected for v in policy.views if v.step == 1} == {"a": frozenset(), "b": frozenset()}


# ---- admission, finish, preemption -------------------------------------------------------------------------
def test_duplicate_admission_is_rejected():
    rt, _ = make()
    rt.admit("a")
    with pytest.raises(DuplicateRequestError, match="request 'a' is already admitted"):
        rt.admit("a")


def test_preempt_returns_the_length_and_frees_the_blocks():
    rt, engine = make(policy=StreamingLLM(sinks=2))
    rt.admit("a")
    forward(rt, engine, rt.begin_step({"a": 6}))
    rt.end_step()  # 3 of 6 evicted; the length to recompute is still 6
    forward(rt, engine, rt.begin_step({"a": 1}))
    rt.end_step()
    assert rt.preempt("a") == 7
    assert rt.running() == [] and "a" not in rt.table
    assert rt.pool.num_free == 8 and rt.pool.free_block_ids() == [2, 3, 4, 5, 6, 7, 0, 1]
    with pytest.raises(UnknownRequestError):
        rt.preempt("a")
    with pytest.raises(UnknownRequestError):
        rt.scores.accumulated("a", 0)
    rt.admit("a")  # re-admitted for recomputation from scratch
    inp = rt.begin_step({"a": 7})
    assert inp.requests["a"].write_slots == [8, 9, 10, 11, 12, 13, 14]


def test_finish_frees_the_blocks():
    rt, engine = make()
    rt.admit("a")
    rt.admit("b")
    forward(rt, engine, rt.begin_step({"a": 5, "b": 2}))
    rt.end_step()
    rt.finish("a")
    assert rt.running() == ["b"]
    assert rt.pool.free_block_ids() == [3, 4, 5, 6, 7, 0, 1]
    with pytest.raises(UnknownRequestError):
        rt.finish("a")


# ---- issue #19: the step's deltas (V2) and the lazy read lists ---------------------------------------------------------
def test_a_step_names_what_changed_since_the_previous_one():
    rt, engine = make(policy=Scripted({("a", 0): [1, 2], ("a", 1): [0]}), budget=0.5)
    rt.admit("a")
    first = rt.begin_step({"a": 5}).requests["a"]
    assert (first.rebuilt, first.evicted, first.joined, first.version) == (True, (), range(0, 5), 0)
    assert rt.end_step() == {"a": [1, 2]}
    with pytest.raises(VTokenError, match="read_slots/read_tokens before end_step"):
        first.read_slots  # noqa: B018 - never read during its step, and the table has changed since
    second = rt.begin_step({"a": 1}).requests["a"]
    assert (second.rebuilt, second.evicted, second.joined, second.joined_slots) == (False, (1, 2), range(5, 6), [5])
    assert second.read_tokens == [0, 3, 4, 5] and second.read_slots == [0, 3, 4, 5]
    assert rt.end_step() == {"a": [0]}  # budget 3 of 6
    assert second.read_tokens == [0, 3, 4, 5]  # read during its step: kept


def test_a_committed_relocation_makes_the_next_delta_name_the_moved_tokens_at_a_new_version():
    rt, engine = make(num_blocks=8, block_size=4, headroom=0, budget=1.0)
    rt.admit("a")
    rt.begin_step({"a": 6})
    rt.end_step()
    rec = rt.relocate_block("a", 0)
    assert rec.plan.kind is PlanKind.RELOCATE
    req = rt.begin_step({"a": 1}).requests["a"]  # settles: the relocation commits, the layout version moves
    assert (req.rebuilt, req.evicted, req.since, req.version) == (False, (), 0, 3)
    assert (req.moved, req.moved_slots, req.joined, req.joined_slots) == ((0, 1, 2, 3), (8, 9, 10, 11), range(6, 7), [6])
    assert rt.block_ids("a") == [2, 1]  # block 0's tokens now live in block 2, each at its own offset
    assert req.read_tokens == list(range(7)) and req.read_slots == [8, 9, 10, 11, 4, 5, 6]
    rt.end_step()
    assert rt.read_changes("a") == ReadChanges(3, 3, False)  # nothing since the step took its changes


def test_densify_plans_a_steady_step_from_its_evictions_alone(monkeypatch):
    # the dense path's fast planner (plan_densify_tail): the reference planner is never needed, and every
    # step still reads a dense prefix holding the right K/V
    from vtoken.core import reclamation

    def reference(snap):
        raise AssertionError("plan_densify ran: the step's evictions should have been enough")

    rt, engine = make(num_blocks=16, block_size=4, policy=StreamingLLM(sinks=1), budget=6, reclaim=DENSIFY_EVENT,
                      read_path=ReadPath.DENSE)
    monkeypatch.setattr(reclamation, "plan_densify", reference)
    rt.admit("a")
    appends = {"a": 12}
    for _ in range(6):
        inputs = rt.begin_step(appends)
        forward(rt, engine, inputs)
        rt.end_step()
        check_all(rt, tag, dense=True)
        appends = {"a": 1}
    rt.settle()  # the last step's plan commits
    assert rt.reclaim_stats.plans_committed == 6 and rt.num_live("a") == rt.write_pos("a") == 6
    assert rt.live_token_ids("a") == [0, 12, 13, 14, 15, 16]  # the sink and the newest five
    assert rt.block_ids("a") == [0, 1]


# ---- the eviction cadence (evict_every) --------------------------------------------------------------
@pytest.mark.parametrize("beta", [0, -1, True, 1.5, "2", None])
def test_a_bad_eviction_cadence_is_a_config_error_naming_it(beta):
    pool = BlockPool(8, 4, 1)
    with pytest.raises(ConfigError, match=r"evict_every must be an int >= 1, got " + repr(beta).replace(".", r"\.")):
        VTokenRuntime(pool, InMemoryCopyEngine(TagStore(8, 4)), StreamingLLM(sinks=1), 4, evict_every=beta)


def run_cadence(beta: int, steps: int = 9) -> tuple[list[dict], list[int], list[int]]:
    """One request, budget 4 tokens, StreamingLLM with one sink: prefill 4, then one token a step. Returns each
    step's victims, the excess at each time the policy was asked, and the live count each step read."""
    policy = Scripted(delegate=StreamingLLM(sinks=1))
    pool = BlockPool(8, 4, 1)
    rt = VTokenRuntime(pool, InMemoryCopyEngine(TagStore(8, 4)), policy, 4, evict_every=beta)
    rt.admit("a")
    victims, read = [], []
    for n in [4] + [1] * steps:
        inp = rt.begin_step({"a": n})
        read.append(len(inp.requests["a"].read_tokens))
        victims.append(rt.end_step())
    return victims, [v.excess for v in policy.views], read


def test_eviction_due_and_policy_view_say_before_the_step_ends_what_the_policy_will_be_asked():
    """What vLLM's scheduler relies on to send the workers a ranking before the forward (``WorkerRanked``)."""
    policy = Scripted(delegate=StreamingLLM(sinks=1))
    rt = VTokenRuntime(BlockPool(8, 4, 1), InMemoryCopyEngine(TagStore(8, 4)), policy, 4, evict_every=2)
    rt.admit("a")
    due, views = [], []
    for n in [4, 1, 1, 1]:
        rt.begin_step({"a": n})
        due.append(rt.eviction_due("a"))
        if due[-1]:
            v = rt.policy_view("a")  # its live tokens are a view of the table: read them now
            views.append((list(v.live), v.total_len, v.budget, v.excess, v.step, v.protected))
        victims = rt.end_step()
    assert due == [False, False, True, False]  # within budget; over by 1 < beta (waits); over by 2; evicted to 4
    assert views == [([0, 1, 2, 3, 4, 5], 6, 4, 2, 2, frozenset())]
    [asked] = [a for a in policy.views if a.excess]
    assert (asked.total_len, asked.budget, asked.excess, asked.step) == (6, 4, 2, 2)
    assert victims == {}  # the last step waits: over by 1
    no_policy = VTokenRuntime(BlockPool(8, 4, 1), InMemoryCopyEngine(TagStore(8, 4)), None, 2)
    no_policy.admit("a")
    no_policy.begin_step({"a": 8})
    assert no_policy.eviction_due("a") is False  # 6 over its budget, but nothing evicts


def test_a_cadence_of_beta_evicts_beta_tokens_at_once_down_to_the_budget():
    victims, asked, read = run_cadence(3)
    # over by 1 and 2: the request waits and the policy is not asked; at 3 the oldest non-sinks go at once
    assert victims == [{}, {}, {}, {"a": [1, 2, 3]}, {}, {}, {"a": [4, 5, 6]}, {}, {}, {"a": [7, 8, 9]}]
    assert asked == [0, 3, 3, 3]  # the prefill step (within budget), then each eviction
    assert read == [4, 5, 6, 7, 5, 6, 7, 5, 6, 7]  # never more than budget + beta
    # beta = 1: the same tokens leave, one a step, and every step asks the policy
    one, asked_one, read_one = run_cadence(1)
    assert [t for v in one for t in v.get("a", [])] == list(range(1, 10))
    assert asked_one == [0] + [1] * 9 and read_one == [4] + [5] * 9


def test_a_cadence_holds_more_blocks_and_plans_less_in_the_simulator():
    from vtoken.core.sim.simulator import SimConfig, Simulator, synthetic_workload
    res = {}
    for beta in (1, 16):
        cfg = SimConfig(num_blocks=512, policy="random", budget=0.5, reclaim="densify", read_path="dense",
                        ordering="event", evict_every=beta, check_invariants=True)
        res[beta] = Simulator(cfg, synthetic_workload(12, seed=5)).run()
    one, sixteen = res[1], res[16]
    assert one.finished == sixteen.finished == 12
    # every plan moves a step's victims' holes; 16 at a time means far fewer plans for the same tokens
    assert sixteen.reclaim["plans_committed"] * 4 < one.reclaim["plans_committed"]
    assert sixteen.sum_retained > one.sum_retained  # the trade-off: up to beta - 1 tokens held over budget
