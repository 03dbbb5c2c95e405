"""The campaign runner: deterministic reports, failure artefacts that replay, a working CLI."""

import contextlib
import copy
import json
import subprocess
import sys
from dataclasses import replace

import pytest
from hypothesis.internal.conjecture import providers

from vtoken.fuzz import campaign

from vtoken.core.cli import main as vtoken_main
from vtoken.fuzz.campaign import CampaignConfig, batch_seed, replay, run_batch, run_campaign
from vtoken.fuzz.planted import planted


def _report(path):
    data = json.loads((path / "report.json").read_text())
    timing = data.pop("timing")
    return data, timing


def test_same_seed_gives_a_byte_identical_report_minus_timings(tmp_path):
    cfg = CampaignConfig(runs=50, seed=7, workers=2, steps=40, examples=10)
    a = run_campaign(replace(cfg, out_dir=str(tmp_path / "a")), progress=None)
    run_campaign(replace(cfg, out_dir=str(tmp_path / "b"), workers=1), progress=None)
    (ra, ta), (rb, tb) = _report(tmp_path / "a"), _report(tmp_path / "b")
    assert ra == rb and json.dumps(ra, sort_keys=True) == json.dumps(rb, sort_keys=True)
    assert ta["workers"] == 2 and tb["workers"] == 1
    assert a.batches == 5 and a.runs >= 50 and a.steps > 0 and a.invariant_checks > a.steps
    assert a.failures == [] and ra["events"]["steps"] > 0
    c = run_campaign(replace(cfg, seed=8, out_dir=str(tmp_path / "c")), progress=None)
    assert c.events != a.events, "different seeds explored identically"


def test_a_batch_depends_on_its_seed_alone_not_on_what_the_process_imported(tmp_path, monkeypatch):
    """Hypothesis draws literals from the pool of every local module imported so far; the campaign pins that pool,
    so a batch runs the same programs whatever the process had imported. Without the pin, the same two pools give
    two different batches (the check has teeth). Hypothesis's pool is restored afterwards."""
    cfg = CampaignConfig(out_dir=str(tmp_path), use_database=False, shrink=False, examples=10, steps=40)
    empty = copy.deepcopy(providers._local_constants)
    for values in vars(empty).values():
        values.clear()
    small = copy.deepcopy(empty)
    small.integers.update(range(0, 65))

    def batch(pool, pinned):
        monkeypatch.setattr(providers, "_get_local_constants", lambda: pool)  # the process's pool (conftest pins it)
        providers.CONSTANTS_CACHE.cache.clear()
        with monkeypatch.context() as m:
            if not pinned:
                m.setattr(campaign, "seed_only_generation", contextlib.nullcontext)
            return run_batch(cfg, 3).events

    assert batch(empty, pinned=True) == batch(small, pinned=True)
    assert batch(empty, pinned=False) != batch(small, pinned=False), "the process's pool did not reach Hypothesis"
    providers.CONSTANTS_CACHE.cache.clear()


def test_batch_seeds_are_stable_and_distinct():
    assert batch_seed(0, 0) == batch_seed(0, 0)
    assert len({batch_seed(s, i) for s in range(3) for i in range(50)}) == 150


def test_a_failure_is_saved_as_a_runnable_pytest_file_and_replays_from_its_seed(tmp_path):
    cfg = CampaignConfig(time_budget=60, seed=0, steps=60, examples=20, out_dir=str(tmp_path),
                         bug="forget_live_count_decrement", use_database=False)
    report = run_campaign(cfg, progress=None)
    assert len(report.failures) == 1
    f = report.failures[0]
    # NOTE: a private block's live count is the pool's (token_table's T1 note), so the occupancy check names it
    assert f["error"].startswith("InvariantViolation: I2: block 0 records ")
    assert f["replay"] == (f"vtoken fuzz --replay {f['batch_seed']} --steps 60 --examples 20 "
                           f"--bug forget_live_count_decrement")
    program = f["program"]
    assert program[0] == "state = VTokenMachine()" and program[1].startswith("state.setup(")
    rules = [line for line in program[2:] if not line.endswith(("_hold()", "_agrees()", "teardown()"))]
    assert len(rules) <= 3, program  # shrunk: an admit, a step and an eviction at most (after the setup)
    text = (tmp_path / "failures" / f"test_failure_{f['batch_seed']}.py").read_text()
    assert "with planted('forget_live_count_decrement'):" in text
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f["pytest_file"]],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 1 and "I2: block 0 records " in run.stdout, run.stdout[-2000:]
    # the shrunk program passes on the unmodified core
    from vtoken.fuzz.machine import VTokenMachine

    exec("\n".join(program), {"VTokenMachine": VTokenMachine})
    # and the batch seed alone reproduces the same failure
    again = replay(cfg, f["batch_seed"])
    assert again.failure is not None and again.failure.program == program


def test_replay_of_a_clean_seed_reports_no_failure(tmp_path):
    res = replay(CampaignConfig(out_dir=str(tmp_path), steps=30, examples=5), batch_seed(0, 0))
    assert res.failure is None and res.events["runs"] >= 5


def test_cli_runs_a_short_campaign_and_writes_the_report(tmp_path, capsys):
    rc = vtoken_main(["fuzz", "--runs", "20", "--examples", "10", "--steps", "30", "--out", str(tmp_path),
                      "--planner", "compact", "--policy", "random"])
    out = capsys.readouterr()
    assert rc == 0, out
    assert "clean: " in out.out and "invariant checks" in out.out
    data, _ = _report(tmp_path)
    assert data["config"]["planners"] == ["compact"] and data["config"]["policies"] == ["random"]
    assert data["runs"] >= 20


def test_cli_exits_non_zero_on_a_planted_bug_and_prints_the_program(tmp_path, capsys):
    rc = vtoken_main(["fuzz", "--replay", str(batch_seed(0, 0)), "--steps", "60", "--examples", "25",
                      "--bug", "occupancy_leak_on_remove", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "InvariantViolation: I2: slot" in out and "def test_replay():" in out and "saved: " in out


@pytest.mark.parametrize("args, message", [
    (["--workers", "0"], "--workers must be >= 1"),
    (["--runs", "0"], "--runs must be >= 1"),
    (["--bug", "occupancy_leak_on_remove"], "--bug is for --self-test or --replay"),
])
def test_cli_rejects_bad_options(args, message, capsys, tmp_path):
    assert vtoken_main(["fuzz", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_self_test_reports_a_caught_bug(tmp_path, capsys):
    rc = vtoken_main(["fuzz", "--self-test", "--bug", "non_strict_decrease", "--time-per-bug", "60",
                      "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = json.loads((tmp_path / "self-test.json").read_text())
    assert [r["bug"] for r in rows] == ["non_strict_decrease"]
    assert rows[0]["caught"] and rows[0]["program_passes_without_bug"]
    assert "1/1 planted bugs caught" in out


def test_planted_context_is_exclusive_per_process():
    with planted("non_strict_decrease") as bug:
        assert bug.name == "non_strict_decrease"
