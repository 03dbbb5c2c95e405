"""``vtoken fuzz --target vllm``: random request mixes through real vLLM with every oracle on."""

import argparse
import json

import pytest

pytest.importorskip("vllm")

from vtoken.core.errors import InvariantViolation  # noqa: E402
from vtoken.fuzz.cli import VLLM_BUGS  # noqa: E402
from vtoken.fuzz.vllm_campaign import episode_seed, main  # noqa: E402
from vtoken.fuzz import vllm_episode as F  # noqa: E402
from vtoken.integration.vllm import scheduler_tokens  # noqa: E402
from vtoken.fuzz.vllm_episode import Episode, EpisodeResult, compare_outputs, planted  # noqa: E402
from vtoken.integration.vllm.worker_tokens import WorkerTokens  # noqa: E402


def args(out, **kw) -> argparse.Namespace:
    base = dict(time=60.0, runs=3, seed=1, out=str(out), keep_going=False, replay=None, self_test=False, bug=None,
                planner=[], policy=[], time_per_bug=60.0, fast_path=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_episodes_are_a_function_of_their_seed():
    assert Episode.draw(42) == Episode.draw(42)
    assert Episode.draw(42) != Episode.draw(43)
    drawn = [Episode.draw(episode_seed(1, i)).vtoken for i in range(40)]
    assert {v["policy"] for v in drawn} == {"none", "streaming_llm", "random", "h2o", "scissorhands", "tova", "knorm",
                                            "snapkv"}
    assert {(v["read_path"], v["reclaim"]) for v in drawn} == {("dense", "densify"), ("gather", "compact"),
                                                               ("gather", "off"), ("gather", "densify")}


def test_fast_path_episodes_are_the_same_draws_moved_into_its_domain():
    """``--fast-path``: every episode in the fast path's domain (so the scheduler runs it, shadowed by the core), and
    otherwise the draw of the same seed: the same requests, pool, budget and cadence."""
    from vtoken.integration.vllm.scheduler_tokens import fast_path_refusal
    from vtoken.integration.vllm.settings import VTokenSettings
    paths = set()
    for i in range(40):
        plain, fast = Episode.draw(episode_seed(1, i)), Episode.draw(episode_seed(1, i), fast=True)
        assert fast.fast and fast.prefix_caching and fast_path_refusal(VTokenSettings(**fast.vtoken)) is None
        paths.add((fast.vtoken["read_path"], fast.vtoken["reclaim"]))
        assert (fast.requests, fast.num_blocks) == (plain.requests, plain.num_blocks)
        assert {k: fast.vtoken[k] for k in ("budget", "evict_every", "seed")} == \
               {k: plain.vtoken[k] for k in ("budget", "evict_every", "seed")}
    assert paths == {("dense", "densify"), ("gather", "compact"), ("gather", "off")}  # issue #46: the gather path too


def test_a_short_campaign_through_vllm_is_clean(tmp_path):
    assert main(args(tmp_path)) == 0
    report = json.loads((tmp_path / "vllm" / "report.json").read_text())
    assert report["episodes"] == 3 and not report["failures"]
    assert report["copies_verified"] > 0 and report["mismatches"] == 0
    assert report["write_slots_audited"] > 0 and report["tokens_evicted"] > 0 and report["blocks_released"] > 0


def test_a_planted_bug_is_saved_with_a_replay_that_reproduces_it(tmp_path, monkeypatch, capsys):
    """Planted bug: the worker ignores the block lists densify shortened, so it writes where the table did not
    say. The campaign stops at the first episode that evicts, saves it, and the replay fails the same way."""
    monkeypatch.setattr(WorkerTokens, "_install_layout", lambda self, rid, blocks: None)
    assert main(args(tmp_path)) == 1
    [f] = [json.loads(p.read_text()) for p in (tmp_path / "vllm").glob("failure-*.json")]
    assert "I2" in f["error"] or "blocks" in f["error"]
    assert f["replay"] == f"vtoken fuzz --target vllm --replay {f['episode_seed']}"
    assert f["episode"] == Episode.draw(f["episode_seed"]).describe()
    assert main(args(tmp_path / "replay", replay=f["episode_seed"])) == 1
    monkeypatch.undo()
    assert main(args(tmp_path / "fixed", replay=f["episode_seed"])) == 0


# ---- the differential oracle (issue #15): prefix caching on vs off ------------------------------------------
def _result(outputs, **kw) -> EpisodeResult:
    return EpisodeResult(outputs=outputs, **kw)


def test_the_differential_oracle_compares_ids_and_logprobs_and_forgives_only_near_ties():
    same = {"0": ([5, 6, 7], [-0.5, -1.0, -0.25], [0.3, 0.2, 0.9])}
    assert compare_outputs(_result(same), _result(same)) == ([], 1)
    roundoff = {"0": ([5, 6, 7], [-0.5 + 4e-6, -1.0, -0.25], [0.3, 0.2, 0.9])}
    assert compare_outputs(_result(roundoff), _result(same)) == ([], 1)
    moved = {"0": ([5, 6, 7], [-0.5, -1.13, -0.25], [0.3, 0.2, 0.9])}
    [bad], n = compare_outputs(_result(moved), _result(same))
    assert n == 1 and bad.startswith("request 0 (0 prompt tokens from the cache): token 1 (6) has logprob -1.130000")
    tie = {"0": ([5, 9, 1], [-0.5, -1.0, -3.0], [0.3, 0.0004, 0.9])}
    other = {"0": ([5, 6, 7], [-0.5, -1.0004, -0.25], [0.3, 0.0004, 0.9])}
    assert compare_outputs(_result(tie), _result(other)) == ([], 1)  # a near tie: the texts may part there
    flipped = {"0": ([5, 9, 1], [-0.5, -1.0, -3.0], [0.3, 0.2, 0.9])}
    [bad], _ = compare_outputs(_result(flipped), _result(same))
    assert "token 1 is 9 with caching on, 6 off (no near tie" in bad
    # preempted (recomputed with other K/V) and protected (other victims by design) requests are not compared
    assert compare_outputs(_result(flipped, preempted={"0"}), _result(same)) == ([], 0)
    assert compare_outputs(_result(flipped), _result(same, protected={"0"})) == ([], 0)


def test_the_planted_bug_names_are_the_episode_modules():
    assert set(VLLM_BUGS) == set(F.PLANTED)


def _chain_episode() -> Episode:
    """Issue #15's schedule (tests/test_vllm_prefix_hash.py) as a fuzz episode: A and Z (a second copy of the chain,
    one token) together, B over A's prefix once A has finished."""
    text = F.corpus()[:200]
    reqs = [{"id": "0", "prompt": list(text[:120]), "max_tokens": 30, "arrive": 0, "abort": None, "skip_cache": False},
            {"id": "1", "prompt": list(text[:121]), "max_tokens": 1, "arrive": 0, "abort": None, "skip_cache": True},
            {"id": "2", "prompt": list(text[:110]), "max_tokens": 30, "arrive": 40, "abort": None, "skip_cache": False}]
    vt = {"policy": "streaming_llm", "budget": 0.75, "strict_verify": "strict", "seed": 0, "drill_every": 0,
          "read_path": "dense", "reclaim": "densify", "theta_f": 0.0, "headroom": 0}
    return Episode(0, vt, True, None, reqs)


def test_the_differential_oracle_alone_catches_a_stale_prefix_hash(monkeypatch):
    """The bug of issue #15 planted, and B2 and B3 (the checks that name it) switched off: comparing the outputs
    with prefix caching on and off still finds it. Without the bug the same episode is clean, all three
    compared."""
    ep = _chain_episode()
    assert F.run_episode(ep).compared == 3
    monkeypatch.setattr(scheduler_tokens, "writable_blocks", lambda rt, req_id, block_size: [])
    monkeypatch.setattr(scheduler_tokens.SchedulerTokens, "check_prefix_hashes", lambda self, r, request: None)
    with planted("cursor_block_keeps_hash"):
        with pytest.raises(AssertionError, match=r"prefix caching on and off generate differently: request 2 "
                                                 r"\(96 prompt tokens from the cache\)"):
            F.run_episode(ep)


def test_a_campaign_catches_the_stale_prefix_hash_with_every_oracle_on(tmp_path):
    """``cursor_block_keeps_hash`` planted: the first episode of campaign seed 8 fails on B2; unplanted it is
    clean (the self-test's claim, on one episode). (Seed 0's first episode caught it while the trigger counted
    vLLM's null block as allocated, which inflated F; with the one waste ratio it no longer densifies there.)"""
    with planted("cursor_block_keeps_hash"):
        assert main(args(tmp_path, runs=1, seed=8)) == 1
    [f] = [json.loads(p.read_text()) for p in (tmp_path / "vllm").glob("failure-*.json")]
    assert f["episode_seed"] == episode_seed(8, 0) and "B2" in f["error"] and "prefix-cached" in f["error"]
    assert main(args(tmp_path / "fixed", replay=f["episode_seed"])) == 0


def test_an_episode_reaches_hashed_blocks_that_compaction_moved_down_the_list():
    """The B3 false alarm tests/test_vllm_serve.py found (``hash_at_list_index``: B3 before the fix) fails
    episode 4 of campaign seed 0, a compact episode with a long first request evicted to half; the real B3
    passes the same episode. Before the draw biased compact episodes this way, 22 episodes (120 s) of the
    campaign never reached that state."""
    ep = Episode.draw(episode_seed(0, 4))
    assert ep.vtoken["reclaim"] == "compact" and ep.vtoken["budget"] == 0.5 and ep.prefix_caching
    with planted("hash_at_list_index"):
        with pytest.raises(InvariantViolation, match=r"B3: request '0-.*': block \d+ at index 1 carries a "
                                                     r"prefix-cache hash that is not the request's chain hash 1"):
            F.run_episode(ep)
    assert F.run_episode(ep).compared >= 1


# ---- the workers' read lists on deltas (issue #20) ------------------------------------------------------------
def _read_list_episode() -> Episode:
    """Gather path, compact at theta_F 0 with the relocation drill every other step, Random at 0.5, a 10-block pool
    (preemption), and requests over one text, three at once and two later (prefix hits): evictions, moves, rebuilt lists,
    preemption and cached prefixes in one run."""
    text = list(F.corpus()[:400])
    reqs = [{"id": str(i), "prompt": text[:64 + 24 * i], "max_tokens": 48, "arrive": arrive, "abort": None,
             "skip_cache": False} for i, arrive in enumerate((0, 0, 0, 6, 12))]
    vt = {"policy": "random", "budget": 0.5, "strict_verify": "strict", "seed": 1, "drill_every": 2,
          "read_path": "gather", "reclaim": "compact", "theta_f": 0.0, "headroom": 1}
    return Episode(0, vt, True, 10, reqs)


def test_the_workers_patched_read_lists_equal_the_tables_every_step():
    """Each step the scheduler sends the step's read-list changes (``StepReads``), and the worker patches its
    table; in fuzz episodes every step also carries the whole list, which the patched copy must equal (V2).
    Clean on a run with eviction, relocation, preemption and prefix hits; with the worker dropping the evictions
    of a change, or its moves (a dropped delta), the first check after one fails naming the request."""
    ep = _read_list_episode()
    res = F.run_episode(ep)
    assert res.stats["evicted"] > 0 and res.stats["plans_committed"] > 0 and res.stats["drill_planned"] > 0
    assert res.preempted and any(res.cached.values())
    with planted("worker_drops_read_evictions"):
        with pytest.raises(InvariantViolation, match=r"V2: request '[^']+': the worker's patched read list"):
            F.run_episode(ep)
    with planted("worker_ignores_read_moves"):  # a commit's moves arrive as changes too, never as a full list
        with pytest.raises(InvariantViolation, match=r"V2: request '[^']+': the worker's patched read list"):
            F.run_episode(ep)


# ---- score policies on the workers' device-side scores (issue #20) ----------------------------------------------
def _score_episode() -> Episode:
    """H2O on the dense path (densify: every commit resends the read lists whole), three requests at once and one
    later, strict verify (the workers' rows travel, and the core's scores choose as the reference)."""
    text = list(F.corpus()[:400])
    reqs = [{"id": str(i), "prompt": text[40 * i:40 * i + 48 + 16 * i], "max_tokens": 40, "arrive": arrive,
             "abort": None, "skip_cache": False} for i, arrive in enumerate((0, 0, 0, 5))]
    vt = {"policy": "h2o", "budget": 0.5, "strict_verify": "strict", "seed": 1, "read_path": "dense",
          "reclaim": "densify"}
    return Episode(0, vt, True, None, reqs)


def test_the_workers_device_scores_choose_the_cores_victims_every_step():
    """Each step the workers record the rows into their device-side scores and rank; under strict verify the
    core's ``TokenScores`` and H2O choose from the same rows, and the two must agree (V4). Clean on a run that
    evicts and commits every step; with the workers' ranking one token into the recent window (every victim
    still live and unprotected: only V4 can tell), the first step it matters fails naming the request."""
    ep = _score_episode()
    res = F.run_episode(ep)
    assert res.stats["evicted"] > 100 and res.stats["plans_committed"] > 20 and res.stats["attention_rows"] > 100
    with planted("worker_ranks_into_the_window"):
        with pytest.raises(InvariantViolation, match=r"V4: request '[^']+': the workers' scores chose victims"):
            F.run_episode(ep)


# ---- the gather path's attention kernel against its torch reference (issue #20, item 6) ------------------------------
def test_the_attention_kernel_agrees_with_the_torch_reference_every_step():
    """Under strict verify every attention the kernel computes (the gather path's, here with lazy compact moving
    tokens) is recomputed in torch and must agree within the fp32 bound (V5). Clean on a run that evicts and
    commits; with the kernel stopping one key early (nothing read out of bounds, weights still summing to one),
    the first step fails naming a request and a layer. Prefix caching off: with it on, lazy compact leaves the
    hashed prompt blocks, where Random's holes are, in place (issue #21) and would move nothing here."""
    text = list(F.corpus()[:400])
    reqs = [{"id": str(i), "prompt": text[40 * i:40 * i + 48 + 16 * i], "max_tokens": 40, "arrive": arrive,
             "abort": None, "skip_cache": False} for i, arrive in enumerate((0, 0, 0, 5))]
    vt = {"policy": "random", "budget": 0.5, "strict_verify": "strict", "seed": 2, "read_path": "gather",
          "reclaim": "compact", "theta_f": 0.1}
    ep = Episode(0, vt, False, None, reqs)
    res = F.run_episode(ep)
    assert res.stats["evicted"] > 100 and res.stats["plans_committed"] >= 5
    with planted("gather_kernel_stops_a_key_early"):
        with pytest.raises(InvariantViolation,
                           match=r"V5: request '[^']+', layer '[^']+': attention differs from the reference"):
            F.run_episode(ep)
