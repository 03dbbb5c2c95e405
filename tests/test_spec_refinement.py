"""Refinement (issue #16): every real transition of the core is a transition of the z3 state model.

spec/refinement.py drives the real core and checks each call's abstract transition against
spec/state_model.py's transition relation; these tests show it passes on the core, flags each planted core
bug that touches a modelled transition, and that the model's batched transitions have teeth.
"""

import dataclasses
import multiprocessing
import re

import pytest
import z3
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule, run_state_machine_as_test

from vtoken.core.block_pool import Purpose
from vtoken.core.errors import InvariantViolation, UnknownRequestError
from vtoken.core.plan import PlanKind
from vtoken.core.reclamation import Ordering
from vtoken.core.runtime import ReadPath
from vtoken.fuzz.planted import BUGS, planted
from vtoken.spec import refinement as R
from vtoken.spec import state_model as M
from vtoken.spec.obligations import COUNTEREXAMPLE, run

# scenarios: no policy (the program evicts), a trigger that never fires (the program plans), S = 2
COMPACT = R.Setup(ReadPath.GATHER, PlanKind.COMPACT, Ordering.POLL, num_blocks=16, block_size=2, headroom=1,
                  policy=None, theta_f=0.99)
DENSIFY = R.Setup(ReadPath.GATHER, PlanKind.DENSIFY, Ordering.POLL, num_blocks=16, block_size=2, headroom=0,
                  policy=None, theta_f=0.99)
UNBOUNDED = dataclasses.replace(COMPACT, headroom=0)  # no headroom: no bound on a plan's destinations
TIGHT_COMPACT = dataclasses.replace(COMPACT, num_blocks=5, headroom=0)  # a freed block is the next one handed out
TIGHT_DENSIFY = dataclasses.replace(DENSIFY, num_blocks=4)


def _sparse(d: R.RefinementDriver, prompt: int, evict: list[int]) -> int:
    """Admit a request, prefill it, evict the given tokens; returns its id."""
    r = d.admit(prompt)
    d.step()
    for t in evict:
        d.evict(r, d.rt.table.live_token_ids(r).index(t))
    return r


def compact_plan_in_flight(d: R.RefinementDriver) -> int:
    """Request 0 lists blocks [0, 1, 2, 3], tokens 0 and 2 evicted: a compact plan packs blocks 0 and 1 into
    block 4 and its copy is launched, still pending."""
    r = _sparse(d, 8, [0, 2])
    d.plan(r)
    d.launch()
    return r


def s_append_block(d):  # blocks 0 (one live token), 1 (full), 2 (the append block, emptied)
    d.plan(_sparse(d, 5, [0, 4]))


def s_fill_off_by_one(d):  # four half-full blocks: their 4 live tokens fill 2 destinations exactly
    d.plan(_sparse(d, 10, [0, 2, 4, 6]))


def s_free_sources(d):  # a densify copy pending when its request leaves (blocks [0, 1, 2] of 4; the copy
    a = _sparse(d, 6, [1])  # reads block 2 and writes block 0); the next request is handed block 0
    d.plan(a)
    d.launch()
    d.leave(a, preempt=False)
    d.admit(4)
    d.step()
    d.copy_event("complete", 0)


def s_double_free(d):
    d.leave(compact_plan_in_flight(d), preempt=True)


def s_free_destination(d):  # the departed request's destination (block 4 of 5) goes to the next request,
    d.leave(compact_plan_in_flight(d), preempt=False)  # then the copy lands
    d.admit(6)
    d.step()
    d.copy_event("complete", 0)


def s_resurrect(d):  # a moving token is evicted while its copy runs
    r = compact_plan_in_flight(d)
    d.evict(r, 0)  # token 1, moving from block 0
    d.copy_event("complete", 0)
    d.settle()


def s_forget_live_count(d):
    _sparse(d, 4, [0])


def s_relocate_shared(d):  # request 1 shares block 0 of request 0, which then evicts a token in it
    a = d.admit(6)
    d.step()
    d.admit_sharing(a, 1, 2)
    d.step()
    for t in (0, 2):
        d.evict(a, d.rt.table.live_token_ids(a).index(t))
    d.plan(a)


def s_share_mask(d):  # request 1 shares block 0 of request 0
    a = d.admit(6)
    d.step()
    d.admit_sharing(a, 1, 2)


def s_two_plans(d):
    r = _sparse(d, 8, [0, 2])
    d.plan(r)
    d.plan_again(r)


def s_densify_hole(d):  # two holes below n_live, two tokens above it
    d.plan(_sparse(d, 6, [0, 1]))


def s_densify_tail(d):  # blocks 1 and 2 empty once tokens 4, 5 fill the holes at positions 0, 1
    d.plan(_sparse(d, 6, [0, 1, 2, 3]))


def s_half_applied(d):  # a batch moving a token twice must be refused whole
    d.refused_moves(_sparse(d, 4, [0]), 0)


def s_commit_pending(d):
    compact_plan_in_flight(d)
    d.settle()


def s_refused_launch(d):  # the engine refuses the copy's launch; the next settle looks at the plan
    d.plan(_sparse(d, 8, [0, 2]))
    d.engine.fail_next_submit()
    d.launch()
    d.settle()


def s_occupancy_leak(d):
    d.leave(_sparse(d, 4, []), preempt=False)


def s_cursor_shift(d):
    d.plan(_sparse(d, 8, [0, 2]))


def s_relocate(d):  # blocks [0, 1, 2], cursor 5: block 0 relocates to block 3 while a step appends (into block 2)
    r = d.admit(5)
    d.step()
    d.relocate(r, 0)
    d.launch()
    d.step()
    d.copy_event("complete", 0)
    d.settle()


#: each planted core bug that touches a modelled transition: its scenario, and the call the check names.
#: Two kinds of flag: a transition the model does not allow (or a state with no abstraction, or a refused
#: call that changed the state), and a plan whose commit no model path allows ("plan_request").
MODELLED = {
    "compact_fill_off_by_one": (UNBOUNDED, s_fill_off_by_one,
                               "plan_request(0) made a compact plan whose commit no model path"),
    "eligible_includes_append_block": (COMPACT, s_append_block,
                                      "plan_request(0) made a compact plan whose commit no model path"),
    "free_sources_before_copy": (TIGHT_DENSIFY, s_free_sources,
                                "complete(copy 1): no model transition allows it; tried T9 (unsat)"),
    "double_free_after_preemption": (COMPACT, s_double_free,
                                    "preempt(0): no model transition allows it; tried T7 (unsat)"),
    "free_destination_of_pending_copy": (TIGHT_COMPACT, s_free_destination,
                                        "complete(copy 1): no model transition allows it; tried T9"),
    "resurrect_evicted_mid_copy": (COMPACT, s_resurrect,
                                  "_commit(compact plan of request 0: 2 moves, sources [0, 1], destinations [4]): no"),
    "forget_live_count_decrement": (COMPACT, s_forget_live_count,
                                   "TokenTable.evict_token(0, 0) left a state with no abstraction: request 0 block 0"),
    "relocate_shared_block": (COMPACT, s_relocate_shared,
                             "plan_request(0) made a compact plan whose commit no model path"),
    "share_forgets_the_holders_mask": (COMPACT, s_share_mask, "left a state with no abstraction: request 0 block 0: mask 0b0 recorded"),
    "two_plans_per_request": (COMPACT, s_two_plans,
                             "plan_request(0) (a plan is in flight: must be refused): no model transition"),
    "densify_leaves_a_hole": (DENSIFY, s_densify_hole,
                             "plan_request(0) made a densify plan whose commit no model path"),
    "densify_keeps_a_tail_block": (DENSIFY, s_densify_tail,
                                  "plan_request(0) made a densify plan whose commit no model path"),
    "apply_moves_half_applied": (COMPACT, s_half_applied,
                                "raised MoveSourceMismatchError but changed the state"),
    "occupancy_leak_on_remove": (COMPACT, s_occupancy_leak,
                                "VTokenRuntime.finish(0) left a state with no abstraction: slot 0 (block 0"),
    "cursor_shift_forgets_destinations": (COMPACT, s_cursor_shift,
                                         "plan_request(0) made a compact plan whose commit no model path"),
}

#: planted core bugs whose modelled transition the core's own executable check refuses before anything
#: changes (an InvariantViolation): there is no transition for the refinement check to see
REFUSED_BY_THE_CORE = {
    "commit_pending_copy": (COMPACT, s_commit_pending, "I3: request 0: commit while its copy 1 is still pending"),
    "state_before_submit": (COMPACT, s_refused_launch, "I3: request 0: plan is COPYING 2 moves but has no copy handle"),
}

#: planted core bugs outside the state model, and why
OUT_OF_SCOPE = {
    "non_strict_decrease": "a compact plan freeing no more blocks than it takes is a legal, wasteful layout change "
                           "(T6, T4b, T5): strict decrease is a planner property (spec/planner_model.py)",
    "admission_consumes_headroom": "the state model has no headroom H: P3 is CrossHair's (contracts/core) and "
                                   "check_p3_headroom's",
    "no_pre_attention_wait": "the engine not ordering reads after copies is I3, the protocol model's; the "
                             "abstraction reads content as the next read sees it given that ordering",
    "streaming_sinks_off_by_one": "which live token a policy evicts is its own rule: T3 allows any",
    "h2o_window_one_short": "which live token a policy evicts is its own rule: T3 allows any",
    "latest_accumulates": "the statistics a policy ranks by are its own input, not state: T3 allows evicting any "
                          "live token; the fuzzer's policy oracle shadows each statistic from the rows",
    "shared_prefix_loses_key_norms": "the statistics a policy ranks by are its own input, not state: T3 allows "
                                     "evicting any live token; the fuzzer's policy oracle checks every key norm",
    "observation_lands_one_token_late": "the statistics a policy ranks by are its own input, not state: T3 allows "
                                        "evicting any live token; the fuzzer's policy oracle shadows the votes",
    "cadence_waits_at_beta": "when a policy is asked is the runtime's schedule, not a state change: T3 allows "
                             "evicting at any step or none; the fuzzer's cadence oracle checks evict_every",
    "waste_ratio_over_whole_pool": "the trigger is liveness: no transition has a precondition on F (spec §2)",
    "trigger_ignores_watermark": "the trigger is liveness: no transition has a precondition on the watermark",
    "failed_copy_never_aborts": "progress: a plan that never settles makes no transition; the state model is safety",
    "orphan_never_released": "progress: held blocks never freed make no transition; the state model is safety",
    "commit_keeps_copy_handle": "copy handles are the protocol model's (quiescence)",
    "copies_on_two_streams": "stream order is the protocol model's; each copy still writes only unread slots (T9)",
    "headroom_budget_ignores_held": "the state model has no headroom H (Stage 2's bound is the manager's)",
    "blocks_to_grow_one_early": "a block past the cursor is a legal list (PL; vLLM allocates ahead): T2b allows "
                                "it, the block arithmetic is the fuzzer's to check",
    "compact_underfills_destinations": "destinations left part empty are a legal layout (T6, T4b, T5): fill "
                                       "order is a planner property (spec/planner_model.py)",
    "live_index_misses_an_eviction": "the live index is a view of the slot arrays, which the abstraction reads; "
                                     "V1's oracle (check_views) and the fuzzer catch it",
    "delta_misses_a_move": "step deltas are what a consumer is told, not table state: V2's oracle "
                           "(ReadListMirror) and the fuzzer catch it",
    "delta_forgets_an_eviction": "step deltas are what a consumer is told, not table state: V2's oracle "
                                 "(ReadListMirror) and the fuzzer catch it",
    "index_misses_a_rewrite": "the pool-wide block index is a view of the block lists, which the abstraction "
                              "reads; V1's oracle (check_views) and the fuzzer catch it",
    "live_read_loses_its_offset": "a read of the live ids from a rank is a view of the slot arrays, which the "
                                  "abstraction reads directly; V1's check of reads from inside a chunk is the oracle",
    "token_map_misses_a_move": "the token map is a view of the slot arrays, which the abstraction reads; V1's "
                               "oracle (check_views), the planner's executed check (live_in_blocks) and the fuzzer "
                               "catch it",
    "shared_blocks_drops_the_last": "which tokens a policy must spare is the runtime's protection, not a state "
                                    "change: T3 allows evicting any live token; the fuzzer's protected oracle "
                                    "checks it against the pool's counts",
    "counts_miss_a_move": "the per-block counts are a view of the masks, which the abstraction reads; V1's oracle "
                          "(check_views), V3 (the compact fast path against choose_sources) and the fuzzer catch it",
    "densify_tail_misses_a_hole": "the fast path is checked against plan_densify (V3, the fuzzer's "
                                  "verify_fast_paths); the launch's executed check refuses two moves into one slot (I4)",
    "pressure_lifts_the_headroom_bound": "the state model has no headroom H (Stage 2's bound is the manager's); "
                                         "the fuzzer's headroom oracle checks it under pressure too",
    "compact_moves_a_cached_block": "the state model has no prefix cache: a hashed block is an ordinary private "
                                    "block to it, and packing it is a legal T4; that compaction leaves it in place "
                                    "is the manager's rule, which the fuzzer's planner oracle checks",
    "pressure_packs_only_excess_blocks": "which requests a round plans for is the manager's choice, not a state "
                                         "change (P1/P2 are enabled, never required); the fuzzer's round oracle "
                                         "holds a pressure round to its definition",
    "release_ignores_sharing": "a block one holder no longer reads may legally leave its list (T5 drops one "
                               "reference); that Naive-Evict's release spares shared blocks is the paper's "
                               "definition of the baseline, which the fuzzer's release oracle and I4's executed "
                               "check (no plan touches a shared block) hold it to",
    "eviction_counts_no_emptied_block": "which requests a step looks in for dead blocks is the runtime's fast "
                                        "path, not a state change (a release is enabled, never required); V3 "
                                        "(verify_fast_paths) and the fuzzer's release oracle catch the skipped release",
    "release_takes_the_append_block": "a release's commit is T4b (no move) then T5, which drops only a block before "
                                      "the cursor's: the plan is refused by I4's executed check (a source at or "
                                      "after the append block) and by the fuzzer's release oracle",
    "relocate_ignores_appends": "appends reach only the cursor's block, and a relocate of that block has no model "
                                "path (T5 drops blocks before the cursor's); the commit's executed check refuses the "
                                "stale commit (I4) and the fuzzer catches it (test_fuzz_planted.py)",
}


def test_every_planted_bug_is_classified():
    """A bug added to fuzz/planted.py must be put in MODELLED (with a scenario) or OUT_OF_SCOPE (with a reason)."""
    groups = [set(MODELLED), set(REFUSED_BY_THE_CORE), set(OUT_OF_SCOPE)]
    assert set.union(*groups) == set(BUGS)
    assert sum(map(len, groups)) == len(BUGS)


@pytest.mark.parametrize("bug", sorted(MODELLED))
def test_the_scenario_refines_the_model_without_the_bug(bug):
    setup, program, _ = MODELLED[bug]
    d = R.run_program(setup, program)
    assert sum(d.obs.checked.matched.values()) >= 2  # it did something the model had to allow (a sync at least)


@pytest.mark.parametrize("bug", sorted(MODELLED))
def test_a_planted_core_bug_is_flagged(bug):
    setup, program, names = MODELLED[bug]
    with planted(bug), pytest.raises(R.RefinementViolation) as err:
        R.run_program(setup, program)
    assert names in str(err.value), str(err.value)


@pytest.mark.parametrize("bug", sorted(REFUSED_BY_THE_CORE))
def test_a_bug_the_core_refuses_changes_no_abstract_state(bug):
    """The core's guard raises before any change; every unit up to it refined the model (else the check
    would have raised RefinementViolation first), and without the bug the scenario is clean."""
    setup, program, message = REFUSED_BY_THE_CORE[bug]
    R.run_program(setup, program)
    with planted(bug), pytest.raises(InvariantViolation, match=re.escape(message)) as err:
        R.run_program(setup, program)
    assert not isinstance(err.value, R.RefinementViolation)


# ---- exploration: Hypothesis drives the real core through every call ---------------------------------------
SETUPS = [
    R.Setup(ReadPath.GATHER, PlanKind.COMPACT, Ordering.POLL, num_blocks=14, block_size=2, headroom=1),
    R.Setup(ReadPath.GATHER, PlanKind.COMPACT, Ordering.EVENT, num_blocks=12, block_size=4, headroom=2,
            policy="random", max_sources=3),
    R.Setup(ReadPath.GATHER, PlanKind.COMPACT, Ordering.FORCE_SYNC, num_blocks=16, block_size=2, headroom=0,
            policy="scissorhands", budget=0.3),
    R.Setup(ReadPath.GATHER, PlanKind.DENSIFY, Ordering.POLL, num_blocks=12, block_size=2, headroom=0),
    R.Setup(ReadPath.DENSE, PlanKind.DENSIFY, Ordering.EVENT, num_blocks=12, block_size=2, headroom=0,
            policy="streaming_llm"),
    R.Setup(ReadPath.DENSE, PlanKind.DENSIFY, Ordering.FORCE_SYNC, num_blocks=10, block_size=4, headroom=0),
    R.Setup(ReadPath.GATHER, None, Ordering.POLL, num_blocks=10, block_size=2, headroom=0),
]


class RefinementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.d: R.RefinementDriver | None = None

    @initialize(setup=st.sampled_from(SETUPS), seed=st.integers(0, 3), prompts=st.lists(st.integers(1, 10),
                                                                                      min_size=1, max_size=3))
    def start(self, setup, seed, prompts):
        """A fresh core with a few requests admitted and prefilled: every rule has something to act on."""
        self.d = R.RefinementDriver(setup, seed)
        for n in prompts:
            self.d.admit(n)
        self.d.step()

    def _req(self, index):
        running = self.d.running()
        return running[index % len(running)] if running else None

    @rule(prompt=st.integers(1, 10))
    def admit(self, prompt):
        self.d.admit(prompt)

    @rule(index=st.integers(0, 7), blocks=st.integers(1, 2), extra=st.integers(1, 3))
    def admit_sharing(self, index, blocks, extra):
        r = self._req(index)
        if r is not None:
            self.d.admit_sharing(r, blocks, extra)

    @rule(n=st.integers(1, 3))
    def steps(self, n):
        for _ in range(n):
            if not self.d.step():
                return

    @rule(index=st.integers(0, 7), preempt=st.booleans())
    def leave(self, index, preempt):
        r = self._req(index)
        if r is not None:
            self.d.leave(r, preempt)

    @precondition(lambda self: self.d is not None and self.d.waiting)
    @rule()
    def resume(self):
        self.d.resume()

    @precondition(lambda self: self.d is not None and self.d.setup.read_path is ReadPath.GATHER)
    @rule(index=st.integers(0, 7), which=st.integers(0, 1 << 16))
    def evict(self, index, which):
        r = self._req(index)
        if r is not None:
            self.d.evict(r, which)

    @precondition(lambda self: self.d is not None and self.d.setup.planner is not None)
    @rule(index=st.integers(0, 7), again=st.booleans())
    def plan(self, index, again):
        r = self._req(index)
        if r is not None:
            (self.d.plan_again if again else self.d.plan)(r)

    @precondition(lambda self: self.d is not None)
    @rule(index=st.integers(0, 7))
    def pack(self, index):
        r = self._req(index)
        if r is not None:
            self.d.pack(r)

    @rule(index=st.integers(0, 7), block=st.integers(0, 7))
    def relocate(self, index, block):
        r = self._req(index)
        if r is not None and self.d.setup.read_path is ReadPath.GATHER:  # dense: only between steps (relocate_block)
            self.d.relocate(r, block)

    @rule()
    def launch(self):
        self.d.launch()

    @rule()
    def settle(self):
        self.d.settle()

    @rule(what=st.sampled_from(["complete", "fail", "order"]), index=st.integers(0, 7), written=st.integers(0, 7))
    def copy_event(self, what, index, written):
        self.d.copy_event(what, index, written)

    @rule(index=st.integers(0, 7), which=st.integers(0, 1 << 16))
    def refused_moves(self, index, which):
        r = self._req(index)
        if r is not None:
            self.d.refused_moves(r, which)


def test_a_relocate_plan_refines_the_model_and_commits():
    """The drill's plan on a block before the cursor's: planned, copied while a step appends, committed; every
    unit a model transition, the commit the path T9, T6, T4b, T5."""
    d = R.run_program(COMPACT, s_relocate)
    assert d.rt.table.block_ids(0) == [3, 1, 2] and d.rt.reclaim_stats.plans_committed == 1
    assert any(k.startswith("plan: T9 T6 T4b T5") for k in d.obs.checked.matched), d.obs.checked.matched


def test_real_transitions_refine_the_model():
    """Hypothesis, derandomized: every unit of every run is a model transition (or a stutter), every plan's
    commit a model path, the initial state Init."""
    run_state_machine_as_test(RefinementMachine, settings=settings(
        max_examples=30, stateful_step_count=40, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))


# ---- the abstraction, on concrete values ---------------------------------------------------------------------
def test_the_abstraction_of_a_prefilled_request():
    d = R.RefinementDriver(COMPACT)
    r = d.admit(3)
    d.step()
    a = d.obs.now()
    assert a.requests == {r: R.RequestAbs(blocks=(0, 1), cursor=3, length=3, live=((0, 0, 0), (1, 0, 1), (2, 1, 0)))}
    assert a.ref[:3] == (1, 1, 0) and a.free[:3] == (False, False, True)
    assert a.C == ((0, 0, 1), (0, 1, 2), (1, 0, 3))  # the tags the driver gave tokens 0, 1, 2


def test_a_compact_plans_destination_is_abstractly_free_until_commit():
    d = R.RefinementDriver(COMPACT)
    r = compact_plan_in_flight(d)
    dst = d.rt.manager.inflight[r].plan.dst_blocks
    assert dst == (4,) and d.pool.ref_count(4) == 1
    a = d.obs.now()
    assert (a.ref[4], a.free[4]) == (0, True)  # held by the plan: the protocol model's, not the state model's
    d.copy_event("complete", 0)
    d.settle()
    a = d.obs.now()
    assert a.requests[r].blocks == (4, 2, 3) and (a.ref[4], a.free[4]) == (1, False) and a.ref[:2] == (0, 0)
    assert d.obs.checked.matched["T6 T4b T5^2"] == 1 and d.obs.checked.matched["plan: T9 T6 T4b T5^2"] == 1


def test_the_init_check_has_teeth():
    d = R.RefinementDriver(COMPACT)
    d.pool.allocate(1, Purpose.ADMISSION)  # a referenced block that no list holds: not the empty system
    d.obs.last = d.obs.now()
    with pytest.raises(R.RefinementViolation, match="Init"):
        d.obs.check_init()


def test_a_refused_call_that_changed_the_state_is_flagged():
    d = R.RefinementDriver(COMPACT)
    r = _sparse(d, 4, [])
    with pytest.raises(R.RefinementViolation, match="raised UnknownRequestError but changed the state"):
        with d.obs.unit("a call that evicts, then refuses"):
            d.rt.table.evict_token(r, 0)
            raise UnknownRequestError("refused")


def test_a_transition_outside_the_calls_path_is_flagged_with_the_components_it_changed():
    d = R.RefinementDriver(COMPACT)
    r = _sparse(d, 4, [])
    with pytest.raises(R.RefinementViolation) as err:
        with d.obs.unit("finish, as if it were an eviction", R.evictions):
            d.rt.finish(r)
    msg = str(err.value)
    assert "tried T3" in msg and "(unsat)" in msg and "block 0: ref 1 -> 0, free False -> True" in msg
    assert f"request {r}: removed" in msg


# ---- the batched transitions' obligations have teeth ---------------------------------------------------------
def _builder(name, replace):
    def build(s, s2):
        params, trs = M._batched(s, s2)
        return params, {**trs, name: replace(s, s2, params)}
    return build


def _sync_anywhere(s, s2, p):
    """T2b whose new tokens may land in any slot of the list (the cursor's successor chain dropped)."""
    pre, post = M.tr_sync_batch(s, s2, *(p[k] for k in ("r", "k", "nbk", "isnew", "at", "L", "ni", "no", "wi2",
                                                         "wo2", "C2")))
    blocks, _, writes = pre.children()
    t, r, L, k = z3.Int("st"), p["r"], p["L"], p["k"]
    new = z3.And(s.len[r] <= t, t < s.len[r] + L)
    anywhere = z3.And(L >= 0, 0 <= p["wo2"], p["wo2"] < M.S, p["wi2"] <= s.nb[r] + k, z3.ForAll([t], z3.Implies(
        new, z3.And(0 <= p["no"][t], p["no"][t] < M.S, 0 <= p["ni"][t], p["ni"][t] < s.nb[r] + k))))
    return z3.And(blocks, anywhere, writes), post


def _move_uncopied(s, s2, p):
    """T4b without its copy having landed: the destination's content is not checked."""
    pre, post = M.tr_move_batch(s, s2, p["r"], p["mv"], p["di"], p["do"])
    r, mv, di, do, t = p["r"], p["mv"], p["di"], p["do"], z3.Int("mt")
    each = z3.ForAll([t], z3.Implies(mv[t], z3.And(
        0 <= t, t < s.len[r], s.live[r][t], 0 <= di[t], di[t] < s.nb[r], 0 <= do[t], do[t] < M.S,
        M.before_cursor(s, r, di[t], do[t]))))
    return z3.And(each, *pre.children()[1:]), post


def _share_without_ref(s, s2, p):
    pre, post = M.tr_share_prefix(s, s2, p["r"], p["q"], p["k"], p["L"])
    eqs = post.children()
    return pre, z3.And([s2.ref == s.ref if e.arg(0).eq(s2.ref) else e for e in eqs])


def _copy_anywhere(s, s2, p):
    return z3.BoolVal(True), M.tr_copy_lands(s, s2, p["C2"])[1]


def _rewind_into_shared(s, s2, p):
    pre, post = M.tr_densify_rewind(s, s2, p["r"], p["wi2"], p["wo2"])
    return z3.And(pre.children()[:-1]), post  # without: no released or new-cursor block is shared


#: (transition, invariant it breaks, the buggy builder)
MODEL_BUGS = [
    ("T2b sync_new_tokens, batched", "I2", _sync_anywhere),
    ("T4b apply_moves, one batch", "I1", _move_uncopied),
    ("T8b admit sharing k prefix blocks", "RC", _share_without_ref),
    ("T9 a copy writes unread slots", "I1", _copy_anywhere),
    ("T10 densify commit rewinds the cursor", "SH", _rewind_into_shared),
]


def _model_bug_outcome(index):
    transition, invariant, buggy = MODEL_BUGS[index]
    return run(M.batch_inductive_obligation(transition, invariant, build=_builder(transition, buggy))).outcome


@pytest.mark.parametrize("index", range(len(MODEL_BUGS)), ids=[f"{t.split()[0]}-{i}" for t, i, _ in MODEL_BUGS])
def test_a_planted_bug_in_a_batched_transition_yields_a_counterexample(index):
    """Each in a fresh interpreter, as tests/test_spec_state.py does (z3's search depends on its context)."""
    transition, invariant, _ = MODEL_BUGS[index]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_model_bug_outcome, (index,))
    assert out.status == COUNTEREXAMPLE, f"{transition} / {invariant}: {out.status} {out.detail[:300]}"
    assert f"after {transition} with" in out.detail and "request" in out.detail
