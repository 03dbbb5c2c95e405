"""``vtoken fuzz --target vllm``: random request mixes through real vLLM with every oracle on."""

import argparse
import json

import pytest

pytest.importorskip("vllm")

from vtoken.fuzz.vllm_campaign import episode_seed, main  # noqa: E402
from vtoken.integration.vllm.fuzz_episode import Episode  # noqa: E402
from vtoken.integration.vllm.worker_tokens import WorkerTokens  # noqa: E402


def args(out, **kw) -> argparse.Namespace:
    base = dict(time=60.0, runs=3, seed=1, out=str(out), keep_going=False, replay=None, self_test=False, bug=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_episodes_are_a_function_of_their_seed():
    assert Episode.draw(42) == Episode.draw(42)
    assert Episode.draw(42) != Episode.draw(43)
    drawn = [Episode.draw(episode_seed(1, i)).vtoken for i in range(40)]
    assert {v["policy"] for v in drawn} == {"none", "streaming_llm", "random", "h2o", "scissorhands"}
    assert {(v["read_path"], v["reclaim"]) for v in drawn} == {("dense", "densify"), ("gather", "compact"),
                                                               ("gather", "off"), ("gather", "densify")}


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
    assert "I3" in f["error"] or "blocks" in f["error"]
    assert f["replay"] == f"vtoken fuzz --target vllm --replay {f['episode_seed']}"
    assert f["episode"] == Episode.draw(f["episode_seed"]).describe()
    assert main(args(tmp_path / "replay", replay=f["episode_seed"])) == 1
    monkeypatch.undo()
    assert main(args(tmp_path / "fixed", replay=f["episode_seed"])) == 0
