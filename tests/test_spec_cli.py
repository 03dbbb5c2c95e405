"""``vtoken spec check`` and the pytest suite prove the same obligations, so ``make test`` runs them once.

Each model module's obligations are proved by one test of the suite (below: ``PROVED_BY``), which asserts each
one's outcome (proved, or bounded where docs/spec.md says so). ``vtoken spec check`` runs the same
``obligations()`` and prints them as a table for a reader; ``make test`` no longer runs it after pytest (it cost two
minutes and proved nothing new). These tests keep that true: a model module added to the spec without a test that
proves all of its obligations fails here, and the command itself is run end to end on a few obligations.
"""

import ast
import json
from pathlib import Path

import pytest

from vtoken.core.cli import main
from vtoken.spec.cli import MODULES, all_obligations

TESTS = Path(__file__).parent

# model module -> (test file, the test that runs every one of its ``obligations()`` and asserts each outcome)
PROVED_BY = {
    "state_model": ("test_spec_state.py", "test_every_state_obligation_is_proved"),
    "protocol_model": ("test_spec_protocol.py", "test_obligation_is_proved"),
    "protocol_two_plans": ("test_spec_protocol_two_plans.py", "test_obligation_holds"),
    "planner_model": ("test_spec_planners.py", "test_every_planner_obligation_is_proved_for_every_block_size"),
    "crosshair_check": ("test_spec_crosshair.py", "test_core_contracts_have_no_counterexample_within_the_bound"),
}


def test_every_model_module_of_the_spec_check_is_proved_by_a_test():
    assert list(PROVED_BY) == MODULES
    for module, (file, test) in PROVED_BY.items():
        tree = ast.parse((TESTS / file).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert test in names, f"{file} has no {test} (it proves {module}'s obligations)"


def test_the_tests_see_the_obligations_the_command_runs():
    """The ids the command runs are the ids the modules' ``obligations()`` give the tests (nothing filtered, no
    id twice), and as many as docs/spec.md counts."""
    ids = [ob.id for ob in all_obligations()]
    assert len(ids) == len(set(ids)) == 125
    assert sum(1 for ob in all_obligations(["crosshair_check"])) == 1


def test_spec_check_prints_each_obligation_and_writes_json(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["spec", "check", "--only", "state_model", "--filter", "/T3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [r["id"] for r in rows] == ["enabled/T3", "P1/T3", "PL/T3", "RC/T3", "I2/T3", "SH/T3", "I1/T3"]
    assert {r["status"] for r in rows} == {"proved"} and all(r["transition"] == "T3 evict_token" for r in rows)
    assert text.startswith("vtoken spec v1\n")
    assert "  I2/T3" in text and "7/7 obligations hold in" in text and "7 proved for every state, 0 bounded" in text


@pytest.mark.parametrize("status", ["counterexample", "unknown"])
def test_spec_check_exits_non_zero_and_names_a_failed_obligation(monkeypatch, capsys, status):
    from vtoken.spec import obligations as O
    real = O.run

    def fails_i2(ob):
        r = real(ob)
        return r if ob.id != "I2/T3" else O.Result(ob, O.Outcome(status, "planted: a counterexample"), r.seconds)

    monkeypatch.setattr(O, "run", fails_i2)
    assert main(["spec", "check", "--only", "state_model", "--filter", "/T3"]) == 1
    text = capsys.readouterr().out
    assert "6/7 obligations hold" in text and f"1 failed: I2/T3 {status}" in text
    assert "    planted: a counterexample" in text
