"""Every planted bug is caught by the fuzzer, and only with the bug planted (the fuzzer has teeth).

The budget is a number of batches of campaign seed 0, not seconds: a batch is a function of its seed alone
(``campaign.seed_only_generation``), so which batch catches a bug is the same on every machine and in every
process, and a slow or busy runner cannot fail these tests. The slowest bug, ``release_ignores_sharing``, needs
24 batches (``FIRST_CATCH`` below).
Shrinking is off here for speed; `vtoken fuzz --self-test` does the same with shrinking and a budget in seconds,
and reports time-to-catch.
"""

import warnings

import pytest

from vtoken.fuzz.campaign import CampaignConfig, run_batch
from vtoken.fuzz.planted import BUGS, planted

BUDGET_BATCHES = 40  # of 25 examples x 100 steps: about 1 s each on CI's 2 cores

# Since a batch is a function of its seed alone, "batch k catches the bug" proves "caught within k + 1 batches"
# without running the k batches before it: each test runs its bug's first catching batch, and scans from 0 only if
# that batch no longer catches it (a change to the machine's draw moves the catches; the test then warns with the
# new index). The assertions are the scan's. Regenerate: the loop in ``_first_catch`` over every bug.
FIRST_CATCH = {  # bug -> the first batch of campaign seed 0 that catches it (measured; see above)
    "admission_consumes_headroom": 0, "apply_moves_half_applied": 0, "blocks_to_grow_one_early": 0,
    "cadence_waits_at_beta": 0, "commit_keeps_copy_handle": 0, "commit_pending_copy": 0, "compact_fill_off_by_one": 2,
    "compact_moves_a_cached_block": 0, "compact_underfills_destinations": 5, "copies_on_two_streams": 21,
    "counts_miss_a_move": 0, "cursor_shift_forgets_destinations": 1, "delta_forgets_an_eviction": 0,
    "delta_misses_a_move": 0, "densify_keeps_a_tail_block": 0, "densify_leaves_a_hole": 0,
    "densify_tail_misses_a_hole": 0, "double_free_after_preemption": 0, "eligible_includes_append_block": 0,
    "eviction_counts_no_emptied_block": 0, "failed_copy_never_aborts": 0, "forget_live_count_decrement": 0,
    "free_destination_of_pending_copy": 0, "free_sources_before_copy": 0, "h2o_window_one_short": 1,
    "headroom_budget_ignores_held": 0, "index_misses_a_rewrite": 0, "latest_accumulates": 1,
    "live_index_misses_an_eviction": 0, "live_read_loses_its_offset": 0, "no_pre_attention_wait": 0,
    "non_strict_decrease": 0, "observation_lands_one_token_late": 0, "occupancy_leak_on_remove": 0,
    "orphan_never_released": 0, "pressure_lifts_the_headroom_bound": 6, "pressure_packs_only_excess_blocks": 1,
    "release_ignores_sharing": 23, "release_takes_the_append_block": 13, "relocate_ignores_appends": 14,
    "relocate_shared_block": 0, "resurrect_evicted_mid_copy": 5, "share_forgets_the_holders_mask": 1,
    "shared_blocks_drops_the_last": 9, "shared_prefix_loses_key_norms": 16, "state_before_submit": 7,
    "streaming_sinks_off_by_one": 0, "token_map_misses_a_move": 0, "trigger_ignores_watermark": 1,
    "two_plans_per_request": 0, "waste_ratio_over_whole_pool": 0,
}


def _first_catch(name: str, cfg: CampaignConfig):
    """(the batch that caught ``name`` within the budget, its failure), or (None, None)."""
    hint = FIRST_CATCH.get(name)
    if hint is not None and hint < BUDGET_BATCHES:
        found = run_batch(cfg, hint).failure
        if found is not None:
            return hint, found
    for index in range(BUDGET_BATCHES):
        found = run_batch(cfg, index).failure
        if found is not None:
            warnings.warn(f"planted bug {name}: first caught at batch {index}, FIRST_CATCH says {hint}: update it")
            return index, found
    return None, None


@pytest.mark.parametrize("name", sorted(BUGS))
def test_planted_bug_is_caught_within_budget(name, tmp_path):
    cfg = CampaignConfig(out_dir=str(tmp_path), use_database=False, shrink=False, examples=25, steps=100)
    with planted(name):
        index, found = _first_catch(name, cfg)
    assert found is not None, f"{name} not caught in {BUDGET_BATCHES} batches (campaign seed 0)"
    assert found.program and found.program[0] == "state = VTokenMachine()", found.program[:2]


def test_every_planted_bug_has_its_first_catch_recorded():
    assert sorted(FIRST_CATCH) == sorted(BUGS)
    assert all(0 <= k < BUDGET_BATCHES for k in FIRST_CATCH.values())


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
