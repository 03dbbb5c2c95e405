"""The fuzzer's functional and progress oracles (fuzz/oracles.py), and the one-stream device model.

The oracles' teeth against the real core are the planted bugs of ``vtoken fuzz --self-test``
(tests/test_fuzz_planted.py runs every one); here each reference is pinned to concrete values, and
each oracle is shown to accept the unmodified core's answers and to refuse a wrong one.
"""

from __future__ import annotations

import pytest

from vtoken.core.block_pool import BlockPool
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.plan import PlanKind
from vtoken.core.policies import H2O, RandomPolicy, Scissorhands, StreamingLLM
from vtoken.core.policies.base import RequestView
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.scores import TokenScores
from vtoken.core.token_table import Move
from vtoken.fuzz.oracles import OracleViolation, Oracles, ScoreShadow, TriggerReference, check_policy_choice


def view(live, budget, acc=None, per=None, protected=frozenset()):
    acc, per = acc or {}, per or {}
    return RequestView(req_id=0, live=list(live), total_len=max(live, default=-1) + 1, budget=budget,
                       accumulated=lambda t: acc.get(t, 0.0), persistence=lambda t: per.get(t, 0.0),
                       protected=frozenset(protected))


# ---- policy references --------------------------------------------------------------------------
def test_streaming_llm_reference_is_the_oldest_middle_tokens():
    v = view(range(10), budget=6)  # sinks 0-3, window 8-9, excess 4: the middle 4-7 goes
    check_policy_choice(StreamingLLM(), v, [4, 5, 6, 7])
    with pytest.raises(OracleViolation, match=r"policy: streaming_llm \(sinks 4, window 2\).*evicted \[3, 4, 5, 6\]"
                       r".*the rule evicts \[4, 5, 6, 7\]"):
        check_policy_choice(StreamingLLM(), v, [3, 4, 5, 6])  # a sink went


def test_streaming_llm_reference_with_a_budget_below_the_sinks_keeps_one_recent_token():
    v = view(range(5), budget=2)  # sinks min(4, 1) = 1: keep token 0 and token 4
    check_policy_choice(StreamingLLM(), v, [1, 2, 3])
    with pytest.raises(OracleViolation):
        check_policy_choice(StreamingLLM(), v, [0, 1, 2])


def test_h2o_reference_allows_any_tie_and_refuses_a_heavier_victim():
    acc = {0: 0.5, 1: 0.1, 2: 0.1, 3: 0.9, 4: 0.0, 5: 0.0}
    v = view(range(6), budget=4, acc=acc)  # window 2 (tokens 4, 5); evictable 0-3; excess 2
    check_policy_choice(H2O(), v, [1, 2])
    with pytest.raises(OracleViolation, match=r"evicted 0 \(score \(0.5,\)\) but kept 1"):
        check_policy_choice(H2O(), v, [0, 2])
    tie = view(range(6), budget=5, acc={0: 0.2, 1: 0.2, 2: 0.2, 3: 0.2})  # any one of 0-2 (window: 3 newest)
    for victim in (0, 1, 2):
        check_policy_choice(H2O(), tie, [victim])
    with pytest.raises(OracleViolation, match="are not 1 of the evictable"):
        check_policy_choice(H2O(), tie, [4])  # in the recent window


def test_scissorhands_reference_ranks_persistence_then_attention():
    per = {0: 2.0, 1: 1.0, 2: 1.0, 3: 1.0, 4: 3.0, 5: 3.0, 6: 3.0}
    v = view(range(8), budget=6, per=per, acc={1: 0.3, 2: 0.1, 3: 0.2})
    check_policy_choice(Scissorhands(), v, [2, 3])  # window 1 (token 7); persistence 1.0: 1, 2, 3; least attended 2, 3
    with pytest.raises(OracleViolation, match=r"evicted 1 \(score \(1.0, 0.3"):
        check_policy_choice(Scissorhands(), v, [1, 2])
    with pytest.raises(OracleViolation, match=r"evicted 0 \(score \(2.0"):
        check_policy_choice(Scissorhands(), v, [0, 2])


def test_random_reference_is_any_evictable_set_of_the_right_size():
    v = view(range(6), budget=3, protected={2})
    check_policy_choice(RandomPolicy(), v, [0, 3, 4])
    with pytest.raises(OracleViolation):
        check_policy_choice(RandomPolicy(), v, [0, 2, 3])  # protected
    with pytest.raises(OracleViolation):
        check_policy_choice(RandomPolicy(), v, [0, 3, 5])  # the newest token is the next query's key
    with pytest.raises(OracleViolation, match="within its budget"):
        check_policy_choice(RandomPolicy(), view(range(3), 3), [0])


def test_the_shipped_policies_satisfy_their_references_on_many_views():
    import random
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 30)
        live = sorted(rng.sample(range(40), n))
        acc = {t: rng.choice([0.0, 0.1, 0.25, 0.5]) for t in live}
        per = {t: rng.choice([0.0, 1.0, 1.5]) for t in live}
        prot = set(rng.sample(live, rng.randint(0, min(3, n))))
        v = view(live, rng.randint(1, n + 2), acc, per, prot)
        for p in (StreamingLLM(), StreamingLLM(sinks=1), H2O(), H2O(0.25), Scissorhands(), RandomPolicy()):
            check_policy_choice(p, v, p.select_victims(v))


# ---- scores -------------------------------------------------------------------------------------------
def test_score_shadow_matches_token_scores_bit_for_bit():
    core, shadow = TokenScores(), ScoreShadow(TokenScores().decay)
    core.add_request("r")
    core.extend("r", 5)
    rows = [([0, 1, 2], [0.2, 0.3, 0.5]), ([0, 1, 2, 3, 4], [0.1, 0.1, 0.1, 0.6, 0.1]), ([1, 4], [0.7, 0.3])]
    for ids, w in rows:
        core.record("r", ids, w)
        shadow.apply({"r": (ids, w)})
    acc, per = core.readers("r")
    v = RequestView("r", [0, 1, 2, 3, 4], 5, 5, acc, per)
    shadow.check_view("r", v)
    assert shadow.acc["r"][1] == acc(1) and shadow.acc["r"][1] != 0.3 + 0.1 + 0.7  # float32, like the core
    shadow.apply({"r": ([0], [1.0])})
    with pytest.raises(OracleViolation, match=r"request 'r' token 0: the policy sees"):
        shadow.check_view("r", v)
    shadow.undo()
    shadow.check_view("r", v)


# ---- trigger ------------------------------------------------------------------------------------------
def test_trigger_reference_fixed_and_adaptive():
    fixed = TriggerReference(ReclaimConfig(theta_f=0.25, low_watermark=2, check_every=2))
    assert [fixed.decide(i, 0.5, 2) for i in range(4)] == [True, False, True, False]
    assert fixed.decide(0, 0.5, 3) is False and fixed.decide(0, 0.25, 0) is False
    adaptive = TriggerReference(ReclaimConfig(theta_f=0.1, check_every=4, burst_df=0.2))
    assert adaptive.decide(1, 0.15, 0) is False  # off the cadence, no burst yet (no previous F)
    assert adaptive.decide(2, 0.40, 0) is True and adaptive.burst  # +0.25 in one iteration: burst
    assert adaptive.decide(3, 0.40, 0) is True  # burst mode: every iteration
    adaptive.round_done(made_any=False, in_flight=False)
    assert not adaptive.burst and adaptive.decide(5, 0.40, 0) is False


# ---- one runtime: Eq. 1, blocks, headroom, planner, quiescence -----------------------------------------
def runtime(planner=PlanKind.COMPACT, headroom=1, blocks=12, S=4, one_stream=True):
    pool = BlockPool(blocks, S, headroom)
    engine = InMemoryCopyEngine(TagStore(blocks, S), auto_complete=False, one_stream=one_stream)
    rt = VTokenRuntime(pool, engine, None, 1.0, ReclaimConfig(planner=planner, theta_f=0.0, ordering=Ordering.POLL),
                       ReadPath.GATHER, seed=0)
    return rt, engine, Oracles(rt, engine).attach()


def fill(rt, req, n):
    rt.admit(req)
    rt.begin_step({req: n})
    rt.end_step({})


def test_oracles_accept_a_compaction_cycle_and_a_whole_pool_after_it():
    rt, engine, o = runtime()
    fill(rt, "a", 12)  # 3 full blocks
    for t in (0, 1, 2, 4, 5, 6):
        rt.table.evict_token("a", t)
    o.check_state()
    assert o.waste_ratio() == pytest.approx(1 - 6 / 12)
    rec = rt.manager.plan_request("a")  # blocks 0 and 1 (one live token each) -> one destination
    assert rec and len(rec.plan.dst_blocks) == 1 and len(rec.plan.moves) == 2
    rt.manager.launch()
    o.check_state()
    engine.complete(rec.handle)
    rt.manager.settle()
    o.check_state()
    rt.finish("a")
    o.check_quiescent()


def test_eq1_oracle_refuses_another_denominator(monkeypatch):
    rt, _, o = runtime()
    fill(rt, "a", 5)  # 2 blocks allocated, 5 live: F = 1 - 5/8
    o.check_state()
    monkeypatch.setattr(type(rt.manager), "waste_ratio",
                        lambda m: 1 - m.table.occupancy.live_slots / (m.pool.num_blocks * m.pool.block_size))
    with pytest.raises(OracleViolation, match=r"eq1: waste_ratio\(\) is .*; Eq. 1 gives 0.375"):
        o.check_state()


def test_planner_oracle_refuses_a_missed_compaction(monkeypatch):
    from vtoken.core import reclamation
    from vtoken.core.plan import NoPlan, NoPlanReason
    rt, _, o = runtime()
    fill(rt, "a", 12)
    for t in (0, 1, 2, 4, 5, 6):
        rt.table.evict_token("a", t)
    monkeypatch.setattr(reclamation, "choose_ranked", lambda r, ranked, at, S, d: NoPlan(NoPlanReason.NO_STRICT_DECREASE))
    with pytest.raises(OracleViolation, match=r"planner: compact made no plan for 'a' \(NO_STRICT_DECREASE\), yet its "
                                              r"2 emptiest eligible blocks fit in 1"):
        rt.manager.plan_request("a")


def test_progress_oracle_refuses_a_failed_copy_left_copying(monkeypatch):
    rt, engine, o = runtime()
    fill(rt, "a", 12)
    for t in (0, 1, 2, 4, 5, 6):
        rt.table.evict_token("a", t)
    rec = rt.manager.plan_request("a")
    rt.manager.launch()
    engine.fail(rec.handle, 1)
    monkeypatch.setattr(type(rt.manager), "_status", lambda m, r: CopyStatus.PENDING)  # settle sees nothing
    with pytest.raises(OracleViolation, match=r"progress: after settle the plan of 'a' is still COPYING a copy that "
                                              r"is failed: it should have aborted"):
        rt.manager.settle()


def test_quiescence_oracle_names_what_is_left():
    rt, engine, o = runtime()
    fill(rt, "a", 3)
    with pytest.raises(OracleViolation, match=r"quiescence: .*requests \['a'\] still in the table.*blocks \[0\] still "
                                              r"allocated \(11/12 free\)"):
        o.check_quiescent()


# ---- the one-stream device model ----------------------------------------------------------------------
def three_copies(one_stream):
    store = TagStore(4, 2)
    for slot in range(8):
        store.write(slot, 11 + slot)
    e = InMemoryCopyEngine(store, auto_complete=False, one_stream=one_stream)
    # a chain across copies: 1 writes slot 2, 2 reads slot 2 into slot 4, 3 reads slot 4 into slot 6
    hs = [e.submit([Move(0, 0, 0, 1, 0)]), e.submit([Move(0, 1, 0, 2, 0)]), e.submit([Move(0, 2, 0, 3, 0)])]
    return store, e, hs


def test_one_stream_completes_copies_in_submission_order():
    store, e, (h1, h2, h3) = three_copies(one_stream=True)
    e.complete(h3)
    assert [e.poll(h) for h in (h1, h2, h3)] == [CopyStatus.DONE] * 3
    assert [store.read(s) for s in (2, 4, 6)] == [11, 11, 11]
    store, e, (h1, h2, h3) = three_copies(one_stream=True)
    e.fail(h2, 0)
    assert [e.poll(h) for h in (h1, h2, h3)] == [CopyStatus.DONE, CopyStatus.FAILED, CopyStatus.PENDING]
    assert [h for h, _, _ in e.statuses()] == [h1, h2, h3]
    e.order_before_compute(h3)
    e.before_compute()
    assert store.read(6) == 15 and e.poll(h3) is CopyStatus.DONE  # h2 failed before writing: h3 copies slot 4's 15


def test_independent_streams_let_a_later_copy_finish_first():
    store, e, (h1, h2, h3) = three_copies(one_stream=False)
    e.complete(h3)
    assert [e.poll(h) for h in (h1, h2, h3)] == [CopyStatus.PENDING, CopyStatus.PENDING, CopyStatus.DONE]
    assert store.read(6) == 15  # it read slot 4 before h2 wrote 11 there


def test_stream_oracle_refuses_a_later_copy_that_ran_first():
    rt, engine, o = runtime(one_stream=True)
    a = engine.submit([Move(0, 0, 0, 1, 0)])
    b = engine.submit([Move(0, 2, 0, 3, 0)])
    engine._copies[b].status = CopyStatus.DONE  # what a two-stream device could do
    with pytest.raises(OracleViolation, match=f"stream: copy {b} is done while the earlier copy {a} has not run"):
        o._check_stream()


# ---- stats, plan_round order, admission, no-plan detail (issue #16's mutation survivors) -----------------
def compacted(rt, engine):
    """'a' holds 3 full blocks, then 6 evictions leave blocks 0 and 1 one live token each: one plan, 2 moves
    into 1 destination, committed."""
    fill(rt, "a", 12)
    for t in (0, 1, 2, 4, 5, 6):
        rt.table.evict_token("a", t)
    rec = rt.manager.plan_request("a")
    rt.manager.launch()
    engine.complete(rec.handle)
    rt.manager.settle()
    return rec


def test_stats_oracle_counts_a_committed_plan_and_refuses_a_wrong_counter():
    rt, engine, o = runtime()
    compacted(rt, engine)
    o.check_state()
    s = o.stats
    assert (s.plans_made, s.plans_committed, s.moves_committed, s.moves_dropped, s.blocks_released) == (1, 1, 2, 0, 1)
    rt.manager.stats.moves_committed = 5  # what "moves_committed = len(moves)" gives after a few plans
    with pytest.raises(OracleViolation, match=r"stats: manager.stats.moves_committed is 5; the calls made give 2"):
        o.check_state()


def test_stats_oracle_counts_no_plans_and_aborts_by_reason():
    from vtoken.core.plan import NoPlanReason
    rt, engine, o = runtime()
    fill(rt, "a", 12)
    assert not rt.manager.plan_request("a")  # nothing evicted: no candidates
    rt.table.evict_token("a", 0)
    rec = rt.manager.plan_request("a")
    assert not rec  # one block with a hole cannot shrink
    rt.finish("a")
    o.check_state()
    assert dict(o.stats.no_plan) == {NoPlanReason.NO_CANDIDATES: 1, NoPlanReason.NO_STRICT_DECREASE: 1}
    rt.manager.stats.no_plan[NoPlanReason.NO_CANDIDATES] -= 2  # "no_plan[reason] -= 1"
    with pytest.raises(OracleViolation, match=r"stats: manager.stats.no_plan is"):
        o.check_state()


def test_round_oracle_refuses_a_round_that_skips_the_most_wasteful_request(monkeypatch):
    rt, engine, o = runtime(blocks=16, headroom=0)
    fill(rt, "a", 12)
    fill(rt, "b", 12)
    for t in (0, 1, 2, 4, 5, 6):  # a: 2 excess blocks' worth of holes -> excess 1
        rt.table.evict_token("a", t)
    for t in (0, 1, 2, 4, 5, 6, 8, 9, 10):  # b: 3 live tokens in 3 blocks -> excess 2
        rt.table.evict_token("b", t)
    cls = type(rt.manager)

    def in_given_order(m, req_ids, pack=False, evicted_positions=None):  # plan_round without its sort: a (excess 1) before b (excess 2)
        m.stats.rounds += 1
        return [rec for r in req_ids if (rec := m.plan_request(r))]

    monkeypatch.setattr(cls, "plan_round", in_given_order)
    with pytest.raises(OracleViolation, match=r"round: plan_round tried \[\('a', 1\), \('b', 2\)\]"):
        rt.manager.plan_round(["a", "b"])


def test_round_oracle_accepts_the_real_round():
    rt, engine, o = runtime(blocks=16, headroom=0)
    fill(rt, "a", 12)
    fill(rt, "b", 12)
    for t in (0, 1, 2, 4, 5, 6):
        rt.table.evict_token("a", t)
    for t in (0, 1, 2, 4, 5, 6, 8, 9, 10):
        rt.table.evict_token("b", t)
    made = rt.manager.plan_round(["a", "b"])
    assert [rec.plan.req_id for rec in made] == ["b", "a"] and o.stats.rounds == 1


def test_admission_oracle_is_open_admission_and_ceil_blocks_outside_the_headroom():
    rt, engine, o = runtime(blocks=12, headroom=1, S=4)
    fill(rt, "a", 12)  # 3 blocks held: 9 free, 8 outside the headroom = 32 tokens
    for p in (0, 1, 32, 33):
        o.check_can_admit(p, rt.can_admit(p))
    assert rt.can_admit(32) and not rt.can_admit(33)
    with pytest.raises(OracleViolation, match=r"admission: can_admit\(33\) is True; 9 blocks free, headroom 1, "
                                              r"admission open and the prompt needs 9"):
        o.check_can_admit(33, True)


def test_no_plan_oracle_requires_the_detail_to_name_the_request(monkeypatch):
    from vtoken.core import reclamation
    from vtoken.core.plan import NoPlan, NoPlanReason
    rt, engine, o = runtime()
    fill(rt, "a", 12)  # nothing evicted: no candidates, so the planner oracle agrees there is no plan
    monkeypatch.setattr(reclamation, "choose_ranked", lambda r, ranked, at, S, d: NoPlan(NoPlanReason.NO_CANDIDATES))
    with pytest.raises(OracleViolation, match=r"no-plan: plan_request\('a'\) answered NO_CANDIDATES with detail ''"):
        rt.manager.plan_request("a")
