"""Every planted bug is caught by the fuzzer, and only with the bug planted (the fuzzer has teeth).

The budget is a number of batches of campaign seed 0, not seconds: a batch is a function of its seed alone
(``campaign.seed_only_generation``), so which batch catches a bug is the same on every machine and in every
process, and a slow or busy runner cannot fail these tests. The slowest bug, ``release_ignores_sharing``, needs
35 batches since issue #21's ``cache_block`` rule joined the draws (it had needed 8).
Shrinking is off here for speed; `vtoken fuzz --self-test` does the same with shrinking and a budget in seconds,
and reports time-to-catch.
"""

import pytest

from vtoken.fuzz.campaign import CampaignConfig, run_batch
from vtoken.fuzz.planted import BUGS, planted

BUDGET_BATCHES = 40  # of 25 examples x 100 steps: about 1 s each on CI's 2 cores


@pytest.mark.parametrize("name", sorted(BUGS))
def test_planted_bug_is_caught_within_budget(name, tmp_path):
    cfg = CampaignConfig(out_dir=str(tmp_path), use_database=False, shrink=False, examples=25, steps=100)
    index, found = 0, None
    with planted(name):
        while found is None and index < BUDGET_BATCHES:
            found = run_batch(cfg, index).failure
            index += 1
    assert found is not None, f"{name} not caught in {BUDGET_BATCHES} batches (campaign seed 0)"
    assert found.program and found.program[0] == "state = VTokenMachine()", found.program[:2]


def test_the_same_batches_are_clean_without_any_planted_bug(tmp_path):
    cfg = CampaignConfig(out_dir=str(tmp_path), use_database=False, shrink=False, examples=25, steps=100)
    for index in range(4):
        res = run_batch(cfg, index)
        assert res.failure is None, f"batch {index}: {res.failure and res.failure.error}"
        assert res.events["runs"] >= 25


def test_planted_bugs_restore_the_core_afterwards():
    from vtoken.core import block_pool, reclamation, token_table

    before = (block_pool.BlockPool.can_allocate, reclamation.ReclamationManager._commit,
              token_table.TokenTable.evict_token, reclamation.plan_densify)
    for name in BUGS:
        targets = list(BUGS[name].patches())
        originals = [obj.__dict__[attr] for obj, attr in targets]
        with planted(name):  # every bug really replaces what it names...
            assert all(obj.__dict__[attr] is not orig for (obj, attr), orig in zip(targets, originals)), name
        # ...and puts it back
        assert all(obj.__dict__[attr] is orig for (obj, attr), orig in zip(targets, originals)), name
    assert before == (block_pool.BlockPool.can_allocate, reclamation.ReclamationManager._commit,
                      token_table.TokenTable.evict_token, reclamation.plan_densify)
    assert len(BUGS) >= 12


def test_the_cadence_oracle_catches_a_runtime_that_asks_before_beta(tmp_path, monkeypatch):
    """The cadence oracle's other half (``cadence_waits_at_beta`` is the one that asks too late): a runtime that
    ignores ``evict_every`` and asks every request over its budget every step is caught as asking early."""
    from vtoken.core.runtime import VTokenRuntime

    def eager(self, req_ids):
        victims = {}
        for r in req_ids if self.policy is not None else ():
            chosen = self._select(r)
            if chosen:
                victims[r] = chosen
        return victims

    monkeypatch.setattr(VTokenRuntime, "_choose_victims", eager)
    cfg = CampaignConfig(out_dir=str(tmp_path), use_database=False, shrink=False, examples=25, steps=100)
    index, found = 0, None
    while found is None and index < BUDGET_BATCHES:
        found = run_batch(cfg, index).failure
        index += 1
    assert found is not None and "cadence" in found.error and "was asked for victims" in found.error, found
