"""The whole-system state machine runs clean on the real core (quick profile; `vtoken fuzz` runs long)."""

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from vtoken.fuzz.campaign import CampaignConfig, machine_class
from vtoken.fuzz.machine import EVENTS, FuzzPolicy, VTokenMachine
from vtoken.fuzz.profiles import PROFILES, profiles_for
from vtoken.core.policies.base import RequestView

TestVTokenMachine = VTokenMachine.TestCase


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_runs_clean_and_exercises_reclamation(profile):
    EVENTS.clear()
    cls = type("VTokenMachine", (VTokenMachine,), {"profiles": (profile,)})
    run_state_machine_as_test(cls, settings=settings(max_examples=60, stateful_step_count=60))
    assert EVENTS["runs"] >= 60 and EVENTS["steps"] > 0 and EVENTS["invariant_checks"] > 0
    if profile == "gather-densify-poll":  # appends during a slow copy make densify plans stale: aborts
        assert EVENTS["plans_committed"] + EVENTS["plans_aborted"] > 0, f"{profile}: no plan reached an end"
    elif PROFILES[profile].planner is not None:
        assert EVENTS["plans_committed"] > 0, f"{profile}: no plan was ever committed"
    else:  # no reclamation: the only plans are the relocation drill's
        assert EVENTS["plans_committed"] <= EVENTS["relocations_planned"], dict(EVENTS)


def test_profiles_filter_by_planner():
    assert profiles_for(["off"]) == ("gather-off",)
    assert set(profiles_for(["densify"])) == {"gather-densify-poll", "dense-densify-event", "dense-densify-sync"}
    assert profiles_for([]) == tuple(PROFILES)


def test_restricted_machine_keeps_its_name_so_programs_replay():
    cls = machine_class(CampaignConfig(planners=("compact",), policies=("random",)))
    assert cls.__name__ == "VTokenMachine" and cls.policies == ("random",)
    assert set(cls.profiles) == {"gather-compact-poll", "gather-compact-event", "gather-compact-sync"}


def test_fuzz_policy_puts_queued_victims_first_and_respects_excess_and_protection():
    class Oldest:
        name = "oldest"

        def select_victims(self, view):
            return list(view.live[: view.excess])

    p = FuzzPolicy(Oldest(), queued={"r": [7, 7, 3, 99]})
    view = RequestView("r", live=list(range(10)), total_len=10, budget=7, protected=frozenset({3}))
    assert p.select_victims(view) == [7, 0, 1]  # 7 once; 3 protected; 99 not live; the base fills the rest
    assert p.queued == {}
    assert FuzzPolicy(None, queued={"r": [1, 2, 5, 6]}).select_victims(view) == [1, 2, 5]


# ---- the rules added for issue #16's mutation survivors: each check has teeth ---------------------------
def machine(profile="gather-compact-poll", policy="none", num_blocks=12, headroom=1):
    m = VTokenMachine()
    m.setup(profile=profile, policy=policy, block_size=4, num_blocks=num_blocks, headroom=headroom, budget=0.5,
            theta_f=0.0, check_every=1, max_sources=4, low_watermark=None, burst_df=None)
    return m


def test_a_refusal_whose_message_does_not_name_the_request_fails_the_machine(monkeypatch):
    from vtoken.core import errors as E
    from vtoken.core.token_table import TokenTable
    m = machine()
    req = m.admit(prompt=4)
    m.bad_call(req, "request:duplicate", 0)  # index 0: TokenTable.add_request, which names the request
    monkeypatch.setattr(TokenTable, "add_request",
                        lambda self, r: (_ for _ in ()).throw(E.DuplicateRequestError("already registered")))
    with pytest.raises(AssertionError, match=r"says 'already registered', which does not name \['request 0'\]"):
        m.bad_call(req, "request:duplicate", 0)


def test_a_checker_that_keeps_quiet_fails_checker_has_teeth(monkeypatch):
    from vtoken.core.block_pool import BlockPool
    m = machine()
    m.admit(prompt=4)
    m.checker_has_teeth("pool_twice", 0)
    monkeypatch.setattr(BlockPool, "check", lambda self: None)  # P1 never reported
    with pytest.raises(AssertionError, match="did not notice a planted defect; expected P1"):
        m.checker_has_teeth("pool_twice", 0)


def test_a_pessimistic_forecast_fails_the_forecast_oracle(monkeypatch):
    from vtoken.core.runtime import VTokenRuntime
    from vtoken.fuzz.oracles import OracleViolation
    m = machine()
    req = m.admit(prompt=12)
    m.steps(1)
    for _ in range(6):  # tokens 0-5: block 0 empty, block 1 half: a compaction to plan
        m.evict_now(req, 0, False)
    m.plan_now(req)
    m.launch()
    assert m.engine.pending()
    real = VTokenRuntime._room_after_settle
    monkeypatch.setattr(VTokenRuntime, "_room_after_settle", lambda rt, a: (real(rt, a)[0], rt.pool.num_free))
    with pytest.raises(OracleViolation, match=r"forecast: begin_step's forecast of settling is \(need \d+, free \d+\); "
                                              r"settling gave"):
        m.forecast_then_settle(0)


def test_engine_step_and_detach_drive_the_vllm_path():
    m = machine(policy="streaming_llm")
    req = m.admit(prompt=10)
    m.engine_step()  # sync 10 tokens, forward, evict_and_reclaim: budget 0.5 keeps 5
    m.check_all_invariants()
    assert m.table.total_len(req) == 10 and len(m.shadow[req]) == 5 and EVENTS["engine_steps"] >= 1
    m.engine_step()
    blocks = m.table.block_ids(req)
    if req in m.manager.inflight:
        m.settle()
    m.detach(req)
    assert req not in m.table and all(m.pool.ref_count(b) == 0 for b in blocks)
    m.check_all_invariants()
