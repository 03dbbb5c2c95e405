"""``vtoken fuzz --target fast`` (issue #45): the fast path against the core through the fuzzer's command line.

A short campaign is clean and counts what it did; ``--self-test`` catches planted fast-path bugs with a shrunk
program that passes without them; a failure replays from its batch seed and is saved as a pytest file that fails
with the bug. The machine and the bugs themselves are in ``fuzz/fast_target.py`` (tests/test_fastpath_runtime.py
runs every bug through the machine).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("numba")

from test_cli_errors import run_vtoken  # noqa: E402

from vtoken.fuzz import cli  # noqa: E402
from vtoken.fuzz.fast_target import FAST_BUGS  # noqa: E402


def test_the_command_line_knows_every_fast_bug():
    """The option list names the bugs without importing numba; it must be the registry's."""
    assert sorted(cli.FAST_BUGS) == sorted(FAST_BUGS)


def test_a_short_fast_campaign_is_clean_and_counts_what_it_did(tmp_path):
    r = run_vtoken(["fuzz", "--target", "fast", "--runs", "50", "--out", str(tmp_path)], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    ev = report["events"]
    assert report["runs"] >= 50 and report["failures"] == [] and report["config"]["target"] == "fast"
    assert ev["steps"] > 100 and ev["evictions"] > 100 and ev["plans_committed"] > 50
    assert ev["prefix_shares"] > 10 and ev["prefix_shares_within_a_step"] > 10 and ev["rejected_calls"] > 10
    assert report["invariant_checks"] > report["steps"] > 0


def test_the_self_test_catches_planted_fast_path_bugs_with_clean_programs(tmp_path):
    bugs = ["fast_slot_off_by_one", "fast_tail_block_kept", "fast_live_bit_kept_on_eviction"]
    r = run_vtoken(["fuzz", "--target", "fast", "--self-test", "--bug", *bugs, "--time-per-bug", "60", "--out",
                    str(tmp_path)], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    rows = json.loads((tmp_path / "self-test.json").read_text())
    assert [row["bug"] for row in rows] == bugs
    assert all(row["caught"] and row["program_passes_without_bug"] and "V6" in row["error"] for row in rows)


def test_a_failure_replays_from_its_seed_and_its_pytest_file_fails_with_the_bug(tmp_path):
    r = run_vtoken(["fuzz", "--target", "fast", "--self-test", "--bug", "fast_rank_off_by_one", "--out",
                    str(tmp_path)], cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    [row] = json.loads((tmp_path / "self-test.json").read_text())
    assert row["replay"].endswith("--bug fast_rank_off_by_one --target fast")
    replay = run_vtoken(row["replay"].split()[1:] + ["--out", str(tmp_path / "replay")], cwd=tmp_path, timeout=300)
    assert replay.returncode == 1 and "V6" in replay.stdout, replay.stdout[-2000:] + replay.stderr[-2000:]
    [saved] = (tmp_path / "replay" / "failures").glob("test_failure_*.py")
    assert "from vtoken.fuzz.fast_target import FastMachine as VTokenMachine" in saved.read_text()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(saved)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "V6" in run.stdout, run.stdout[-2000:]
