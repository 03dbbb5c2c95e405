"""Every bad argument of every ``vtoken`` command: one line on stderr naming the option and the value, a
non-zero exit, no traceback, and no work done (issue #15). The real console script runs in a subprocess,
as a user would run it; the safety net of ``core/cli.py`` is also checked in-process."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vtoken.core.sim import demo
from vtoken.core.cli import check_int, check_number, check_out_dir, check_out_file, main as vtoken_main
from vtoken.core.errors import ConfigError, PoolExhaustedError

VTOKEN = Path(sys.executable).with_name("vtoken")


def run_vtoken(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("VTOKEN_TRACEBACK", None)
    return subprocess.run([str(VTOKEN), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def assert_one_line_refusal(r: subprocess.CompletedProcess, *names: str) -> str:
    assert r.returncode != 0, f"exit 0 for a bad argument: {r.stdout[-500:]} {r.stderr[-500:]}"
    assert "Traceback" not in r.stderr + r.stdout, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.stderr[-2000:]}"
    assert r.stderr.strip() == lines[0].strip() and lines[0].startswith("vtoken")
    for name in names:
        assert name in lines[0], f"{name!r} not named in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "a-file").write_text("not a folder\n")
    (d / "a-dir").mkdir()
    return d


FUZZ = [
    (["--time", "-5"], ["--time", "-5"]),
    (["--time", "0"], ["--time", "0"]),
    (["--time", "nan"], ["--time", "nan"]),
    (["--time", "inf"], ["--time", "inf"]),
    (["--time", "abc"], ["--time", "abc"]),
    (["--self-test", "--time-per-bug", "0"], ["--time-per-bug", "0"]),
    (["--self-test", "--time-per-bug", "-1"], ["--time-per-bug", "-1"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--replay", "-3"], ["--replay", "-3"]),
    (["--workers", "0"], ["--workers", "0"]),
    (["--steps", "0"], ["--steps", "0"]),
    (["--examples", "-2"], ["--examples", "-2"]),
    (["--runs", "0"], ["--runs", "0"]),
    (["--out", "{file}"], ["--out", "a-file", "not a directory"]),
    (["--out", "{file}/sub"], ["--out", "a-file", "not a directory"]),
    (["--planner", "pack"], ["--planner", "pack"]),
    (["--self-test", "--replay", "1"], ["--self-test", "--replay"]),
    (["--target", "vllm", "--policy", "h2o"], ["--policy", "--target vllm"]),
    (["--bug", "occupancy_leak_on_remove"], ["--bug"]),
    (["--tp", "2"], ["--tp 2", "--target vllm"]),
    (["--tp", "3"], ["--tp", "3"]),
    (["--target", "vllm", "--tp", "2", "--self-test"], ["--self-test", "--tp"]),
    (["--target", "fast", "--policy", "h2o"], ["--policy", "--target fast"]),
    (["--fast-path"], ["--fast-path", "--target vllm"]),
    (["--bug", "fast_slot_off_by_one", "--self-test"], ["--bug fast_slot_off_by_one", "--target fast"]),
    (["--target", "fast", "--bug", "cursor_block_keeps_hash", "--self-test"], ["--bug", "--target vllm"]),
    (["--target", "fast", "--bug", "occupancy_leak_on_remove", "--self-test"], ["--bug", "the core"]),
]

DEMO = [
    (["--budget", "0"], ["--budget", "0.0"]),
    (["--budget", "1.5"], ["--budget", "1.5"]),
    (["--budget", "-0.5"], ["--budget", "-0.5"]),
    (["--budget", "nan"], ["--budget", "nan"]),
    (["--budget", "half"], ["--budget", "half"]),
    (["--block-size", "0"], ["--block-size", "0"]),
    (["--block-size", "1.5"], ["--block-size", "1.5"]),
    (["--block-size", "100000"], ["--block-size", "100000"]),
    (["--requests", "0"], ["--requests", "0"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--policy", "lru"], ["--policy", "lru"]),
]

SPEC = [
    (["check", "--json", "{tmp}/missing-dir/x.json"], ["--json", "missing-dir", "does not exist"]),
    (["check", "--json", "{dir}"], ["--json", "a-dir", "is a directory"]),
    (["check", "--filter", "no-such-obligation"], ["--filter", "no-such-obligation"]),
    (["check", "--only", "no_model"], ["--only", "no_model"]),
]

BENCH = [
    (["sim", "--quick", "--out", "{file}"], ["--out", "a-file", "not a directory"]),
    (["sim", "--quick", "--out", "{file}/sub"], ["--out", "a-file", "not a directory"]),
    (["sim", "--quick", "--repeats", "0", "--out", "{tmp}/o"], ["repeats", "0"]),
    (["sim", "--quick", "--seed", "-1", "--out", "{tmp}/o"], ["seed", "-1"]),
    (["sim", "--quick", "--questions", "q99", "--out", "{tmp}/o"], ["q99"]),
    (["sim", "--repeats", "many"], ["--repeats", "many"]),
    (["vllm", "--quick", "--repeats", "0", "--out", "{tmp}/o"], ["repeats", "0"]),
    (["vllm", "--quick", "--threads", "0", "--out", "{tmp}/o"], ["threads", "0"]),
    (["vllm", "--quick", "--seed", "-1", "--out", "{tmp}/o"], ["seed", "-1"]),
    (["vllm", "--questions", "q1", "--out", "{tmp}/o"], ["q1"]),
    (["device", "--quick", "--repeats", "0", "--out", "{tmp}/o"], ["repeats", "0"]),
    (["all", "--quick", "--out", "{file}"], ["--out", "a-file", "not a directory"]),
    (["all", "--quick", "--repeats", "2", "--out", "{tmp}/o"], ["repeats", "2"]),
    (["all", "--quick", "--seed", "-1", "--out", "{tmp}/o"], ["seed", "-1"]),
]

CASES = ([("fuzz", a, n) for a, n in FUZZ] + [("demo", a, n) for a, n in DEMO] + [("spec", a, n) for a, n in SPEC]
         + [("bench", a, n) for a, n in BENCH] + [("nonsense", [], ["nonsense"])])


@pytest.mark.parametrize("command, args, names", CASES, ids=[f"{c}:{' '.join(a)}" for c, a, _ in CASES])
def test_a_bad_argument_is_one_line_and_a_non_zero_exit(command, args, names, files, tmp_path):
    subs = {"{file}": str(files / "a-file"), "{dir}": str(files / "a-dir"), "{tmp}": str(tmp_path)}

    def fill(s: str) -> str:
        for k, v in subs.items():
            s = s.replace(k, v)
        return s

    r = run_vtoken([command, *(fill(a) for a in args)], cwd=tmp_path)
    assert_one_line_refusal(r, *names)
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused command created files"
    assert (files / "a-file").read_text() == "not a folder\n"


def test_the_exit_code_is_2_and_argparse_errors_keep_one_line(tmp_path):
    r = run_vtoken(["fuzz", "--time", "-5"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "vtoken fuzz: --time must be a number of seconds > 0 (finite), got -5.0\n"
    r = run_vtoken(["demo", "--budget", "x"], cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("vtoken demo: error: argument --budget: invalid float value: 'x'")


def test_help_still_works(tmp_path):
    r = run_vtoken(["fuzz", "--help"], cwd=tmp_path)
    assert r.returncode == 0 and "--time-per-bug" in r.stdout and not r.stderr


# ---- the safety net (core/cli.py), in-process --------------------------------------------------------------
@pytest.mark.parametrize("error, code, line", [
    (ConfigError("--x must be 1, got 2"), 2, "vtoken demo: --x must be 1, got 2"),
    (PoolExhaustedError("admission needs 3 blocks,\n0 free"), 2, "vtoken demo: admission needs 3 blocks, 0 free"),
    (FileNotFoundError(2, "No such file or directory", "/nowhere/x"), 2,
     "vtoken demo: No such file or directory: '/nowhere/x'"),
    (PermissionError(13, "Permission denied", "/root/x"), 2, "vtoken demo: Permission denied: '/root/x'"),
    (ModuleNotFoundError("No module named 'torch'", name="torch"), 2,
     "vtoken demo: needs torch (not installed): pip install 'vtoken[torch]'"),
    (KeyboardInterrupt(), 130, "vtoken demo: interrupted"),
])
def test_the_safety_net_prints_one_line(monkeypatch, capsys, error, code, line):
    def fake_run(_a):
        raise error

    monkeypatch.delenv("VTOKEN_TRACEBACK", raising=False)
    monkeypatch.setattr(demo, "run", fake_run)
    if isinstance(error, ModuleNotFoundError):  # the safety net checks the module really is missing
        monkeypatch.setitem(sys.modules, "torch", None)
    assert vtoken_main(["demo"]) == code
    assert capsys.readouterr().err == line + "\n"


def test_a_bug_keeps_its_traceback(monkeypatch):
    def fake_run(_a):
        raise RuntimeError("a bug")

    monkeypatch.setattr(demo, "run", fake_run)
    with pytest.raises(RuntimeError, match="a bug"):
        vtoken_main(["demo"])


def test_a_missing_submodule_of_an_installed_package_is_a_bug(monkeypatch):
    def fake_run(_a):
        raise ModuleNotFoundError("No module named 'hypothesis.nope'", name="hypothesis.nope")

    monkeypatch.setattr(demo, "run", fake_run)
    with pytest.raises(ModuleNotFoundError):
        vtoken_main(["demo"])


def test_vtoken_traceback_keeps_the_traceback(monkeypatch):
    def fake_run(_a):
        raise ConfigError("bad")

    monkeypatch.setattr(demo, "run", fake_run)
    monkeypatch.setenv("VTOKEN_TRACEBACK", "1")
    with pytest.raises(ConfigError, match="bad"):
        vtoken_main(["demo"])


def test_main_returns_the_code_of_an_argparse_error(capsys):
    assert vtoken_main(["demo", "--block-size", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--block-size" in err and "'x'" in err


# ---- the shared checks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, message", [
    (lambda: check_int("--n", True, 0), "--n must be an integer, got True"),
    (lambda: check_int("--n", 1.0, 0), "--n must be an integer, got 1.0"),
    (lambda: check_int("--n", -1, 0), "--n must be >= 0, got -1"),
    (lambda: check_int("--n", 9, 1, 8), "--n must be in [1, 8], got 9"),
    (lambda: check_number("--t", float("nan"), 0.0), "--t must be a number > 0 (finite), got nan"),
    (lambda: check_number("--t", False, 0.0), "--t must be a number > 0 (finite), got False"),
    (lambda: check_number("--r", 0.0, 0.0, 1.0), "--r must be a number in (0, 1], got 0.0"),
])
def test_the_shared_checks_name_the_option_and_the_value(call, message):
    with pytest.raises(ConfigError) as e:
        call()
    assert str(e.value) == message


def test_out_checks_create_nothing(tmp_path):
    (tmp_path / "f").write_text("")
    assert check_out_dir("--out", tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert check_out_file("--json", tmp_path / "x.json") == tmp_path / "x.json"
    with pytest.raises(ConfigError, match="not a directory"):
        check_out_dir("--out", tmp_path / "f" / "x")
    with pytest.raises(ConfigError, match="does not exist"):
        check_out_file("--json", tmp_path / "new" / "x.json")
    with pytest.raises(ConfigError, match="must name a file"):
        check_out_file("--json", "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_every_command_registers_without_importing_heavy_dependencies():
    code = ("import sys; from vtoken.core.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'vllm', 'matplotlib', 'z3', 'crosshair', 'hypothesis', 'numpy') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_command_that_cannot_load_does_not_take_the_others_down(monkeypatch, capsys):
    import importlib.metadata as md

    import vtoken.core.cli as cli

    real = md.entry_points

    class Broken:
        name = "broken"

        def load(self):
            raise ModuleNotFoundError("No module named 'z3'", name="z3")

    monkeypatch.setitem(sys.modules, "z3", None)
    monkeypatch.setattr(cli, "entry_points", lambda group: [*real(group=group), Broken()])
    assert isinstance(cli.build_parser(), argparse.ArgumentParser)
    assert cli.main(["broken", "anything"]) == 2
    assert capsys.readouterr().err == "vtoken broken: needs z3 (not installed): pip install 'vtoken[spec]'\n"
