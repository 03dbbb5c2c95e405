"""fuzz/mutation.py, the mutation campaign's script: its pure parts (sampling, diffs) and the committed sample.

The campaign itself (mutmut over the safety modules, the fuzzer against each sampled mutant) takes hours
and is not run here; docs/fuzzing.md records it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vtoken.fuzz.mutation import (
    DEFENSIVE,
    EQUIVALENT,
    SAFETY_MODULES,
    FuzzResult,
    MutationError,
    apply_diff,
    draw_sample,
    file_diff,
    main,
    mutants_of_file,
    summarize,
)

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "fuzz" / "mutation_sample.json"

BEFORE = "def fill(x):\n    y = x\n    return y + 1\n\n\ndef other():\n    return 0\n"
AFTER = "def fill(x):\n    y = x\n    return y - 1\n\n\ndef other():\n    return 0\n"


# ---- sampling ------------------------------------------------------------------------------------------
NAMES = [f"vtoken.core.m.x_f__mutmut_{i}" for i in range(1, 41)]


def test_the_sample_is_a_pure_function_of_seed_and_n():
    assert draw_sample(NAMES, 7, 5) == draw_sample(list(reversed(NAMES)), 7, 5)  # the order given is irrelevant
    assert draw_sample(NAMES, 7, 5) == ["vtoken.core.m.x_f__mutmut_28", "vtoken.core.m.x_f__mutmut_18",
                                        "vtoken.core.m.x_f__mutmut_32", "vtoken.core.m.x_f__mutmut_12",
                                        "vtoken.core.m.x_f__mutmut_13"]
    assert draw_sample(NAMES, 8, 5) != draw_sample(NAMES, 7, 5)
    assert len(set(draw_sample(NAMES, 7, 40))) == 40  # without replacement


@pytest.mark.parametrize("n", [0, 41, -1])
def test_a_sample_larger_than_the_population_or_empty_is_refused(n):
    with pytest.raises(MutationError, match=f"between 1 and 40 .*got {n}"):
        draw_sample(NAMES, 0, n)


# ---- diffs ------------------------------------------------------------------------------------------------
def test_a_diff_applies_back_to_exactly_the_mutated_file():
    diff = file_diff("core/m.py", BEFORE, AFTER)
    assert diff.splitlines()[:3] == ["--- a/core/m.py", "+++ b/core/m.py", "@@ -1,6 +1,6 @@"]
    assert apply_diff(BEFORE, diff) == AFTER


def test_a_diff_still_applies_after_an_edit_elsewhere_in_the_file():
    big_before = BEFORE + "".join(f"\n\ndef g{i}():\n    return {i}\n" for i in range(6))
    diff = file_diff("core/m.py", big_before, big_before.replace("return 4\n", "return 40\n"))
    edited = "import os\n\n" + big_before  # two lines earlier: the hunk is found at its offset
    assert apply_diff(edited, diff) == "import os\n\n" + big_before.replace("return 4\n", "return 40\n")


def test_a_diff_whose_lines_are_gone_is_refused_naming_them():
    diff = file_diff("core/m.py", BEFORE, AFTER)
    with pytest.raises(MutationError, match=r"hunk at line 1 .*'return y \+ 1'"):
        apply_diff(BEFORE.replace("return y + 1", "return y + 2"), diff)


def test_text_without_a_hunk_is_not_a_diff():
    with pytest.raises(MutationError, match="no @@ hunk header"):
        apply_diff(BEFORE, "--- a/x\n+++ b/x\n")


# ---- mutants from mutmut's generator, on a tiny file ------------------------------------------------------
TINY = ("def fill(x):\n    return x + 1\n\n\n"
        "class A:\n    def size(self):\n        return 0\n\n\n"
        "class B:\n    def size(self):\n        return 2\n")


def test_each_mutant_is_one_change_spliced_into_its_own_function(tmp_path, monkeypatch):
    pytest.importorskip("mutmut")
    from mutmut.configuration import reset_config

    (tmp_path / "pyproject.toml").write_text('[tool.mutmut]\nsource_paths = ["src"]\n')
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "tiny.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    reset_config()
    try:
        mutants = {m.name: m for m in mutants_of_file(Path("src/pkg/tiny.py"), "pkg/tiny.py")}
    finally:
        reset_config()
    changed = {name: [ln for ln in m.diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
               for name, m in mutants.items()}
    assert changed["pkg.tiny.x_fill__mutmut_1"] == ["-    return x + 1", "+    return x - 1"]
    assert changed["pkg.tiny.x_fill__mutmut_2"] == ["-    return x + 1", "+    return x + 2"]
    assert changed["pkg.tiny.xǁAǁsize__mutmut_1"] == ["-        return 0", "+        return 1"]
    # B's mutant changes B.size, not the first method of that name (mutmut's own `apply` picks A's)
    assert changed["pkg.tiny.xǁBǁsize__mutmut_1"] == ["-        return 2", "+        return 3"]
    assert apply_diff(TINY, mutants["pkg.tiny.xǁBǁsize__mutmut_1"].diff) == TINY.replace("return 2", "return 3")


# ---- the kill rate --------------------------------------------------------------------------------------------
def test_the_kill_rate_leaves_out_equivalent_mutants_and_counts_timeouts_as_not_killed():
    rs = [FuzzResult("a", "f", "killed", elapsed_s=3.0), FuzzResult("b", "f", "killed", elapsed_s=75.0),
          FuzzResult("c", "f", "survived"), FuzzResult("d", "f", "timeout"),
          FuzzResult("e", "f", "survived", equivalent="x // 1 == x for an int x")]
    s = summarize(rs)
    assert (s["non_equivalent"], s["killed"], s["survived"], s["timeout"], s["equivalent"]) == (4, 2, 1, 1, 1)
    assert s["kill_rate"] == 0.5
    assert s["contradicted_verdicts"] == []
    rs[4].status = "killed"  # the fuzzer kills a mutant judged equivalent: the verdict is wrong
    assert summarize(rs)["contradicted_verdicts"] == ["e"]


def test_defensive_mutants_count_in_the_kill_rate_and_the_summary_also_gives_it_without_them():
    rs = [FuzzResult("a", "f", "killed", elapsed_s=3.0), FuzzResult("b", "f", "survived"),
          FuzzResult("c", "f", "survived", defensive="a check on the planner's own output")]
    s = summarize(rs)
    assert (s["non_equivalent"], s["defensive"]) == (3, 1)
    assert (s["kill_rate"], s["kill_rate_without_defensive"]) == (0.3333, 0.5)


# ---- the committed sample ----------------------------------------------------------------------------------
def test_every_mutant_of_the_committed_sample_applies_to_the_core_it_was_drawn_from():
    """The sample is of one version of core/ (``sources``: each module's sha256). Modules still at that version
    must take every diff; a module changed since is not a failure (the next campaign redraws the sample), so
    later work on core/ is not held to this sample."""
    import hashlib
    sample = json.loads(SAMPLE.read_text())
    assert sample["mutmut_version"] == "3.8.1" and tuple(sample["modules"]) == SAFETY_MODULES
    names = [m["name"] for m in sample["mutants"]]
    assert len(names) == sample["n"] >= 130 and len(set(names)) == len(names)
    current = {f: hashlib.sha256((REPO / f).read_bytes()).hexdigest() for f in sample["sources"]}
    for m in sample["mutants"]:
        if current[m["file"]] != sample["sources"][m["file"]]:
            continue  # drawn from an older version of this module
        source = (REPO / m["file"]).read_text()
        assert apply_diff(source, m["diff"]) != source, m["name"]


def test_every_verdict_names_a_sampled_mutant_once_and_gives_a_reason():
    names = {m["name"] for m in json.loads(SAMPLE.read_text())["mutants"]}
    for name, reason in {**EQUIVALENT, **DEFENSIVE}.items():
        assert name in names and len(reason) > 20, name
    assert not set(EQUIVALENT) & set(DEFENSIVE)


def test_command_line_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["sample", "--work", str(tmp_path), "--seed", "0", "--n", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "mutants.json does not exist: run `prepare" in err
    assert main(["fuzz", "--sample", str(SAMPLE), "--seconds", "0"]) == 2
    assert "--seconds must be positive, got 0" in capsys.readouterr().err


# ---- one mutant, end to end (the real fuzzer on a mutated copy of the tree) ---------------------------------
def _sampled(name: str) -> dict:
    return next(m for m in json.loads(SAMPLE.read_text())["mutants"] if m["name"] == name)


def test_a_killed_mutant_comes_back_with_its_error_and_a_shrunk_replay(tmp_path):
    from vtoken.fuzz.mutation import fuzz_one

    # begin_step returns None instead of the step's inputs: the first step of any program fails
    r = fuzz_one(REPO, _sampled("vtoken.core.runtime.xǁVTokenRuntimeǁbegin_step__mutmut_110"), 20, tmp_path)
    assert r.status == "killed" and r.cpu_s < 20
    assert r.error == "AttributeError: 'NoneType' object has no attribute 'requests'"
    assert r.replay.startswith(f"PYTHONPATH={tmp_path / 'runs'}") and " vtoken fuzz --replay " in r.replay
    # a step of some kind (which one the shrinker ends on depends on the machine's draws)
    assert "def test_replay():" in r.pytest_file and re.search(r"state\.step\w*\(", r.pytest_file)


def test_a_surviving_mutant_is_stopped_at_its_cpu_budget(tmp_path):
    from vtoken.fuzz.mutation import fuzz_one

    # equivalent: the need is recomputed after settling even when nothing settled (same state, same need)
    r = fuzz_one(REPO, _sampled("vtoken.core.runtime.xǁVTokenRuntimeǁbegin_step__mutmut_39"), 3, tmp_path)
    assert r.status == "survived" and 3 <= r.cpu_s < 4.5 and not r.replay
