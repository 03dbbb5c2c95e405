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
    else:
        assert EVENTS["plans_committed"] == 0


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
