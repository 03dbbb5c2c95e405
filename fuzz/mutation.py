"""The mutation campaign (issue #16): mutmut's mutants of the safety modules, and which the fuzzer alone kills.

    python -m vtoken.fuzz.mutation prepare --work DIR        # scratch tree + every mutant, nothing run
    python -m vtoken.fuzz.mutation sample --work DIR --seed 16 --n 150  # -> fuzz/mutation_sample.json
    python -m vtoken.fuzz.mutation fuzz --sample fuzz/mutation_sample.json --seconds 60 --work DIR2
    python -m vtoken.fuzz.mutation tally --work DIR          # the full `mutmut run`'s counts, per module

Why a scratch tree: mutmut imports the code it mutates from ``mutants/src/<package>``, and cannot follow
our ``package-dir`` mapping (vtoken.core -> core/). ``prepare`` copies core/ and fuzz/ to
``DIR/src/vtoken/``, the killing tests to ``DIR/tests/`` and writes a ``[tool.mutmut]`` section, so
``cd DIR && mutmut run --max-children 1`` runs the full campaign there (resumable: rerunning continues).

Why our own diffs: ``prepare`` asks mutmut's generator (``mutate_file_contents``, the code ``mutmut run``
uses, so the names are the same) for every mutant and splices each mutated function back into its
file. The sample then stores a whole-file unified diff per mutant, so ``fuzz`` applies it to a fresh
copy of the tree and runs ``vtoken fuzz`` on the plain mutated code: no mutmut, no trampolines (which
would slow the fuzzer), reproducible from the committed sample alone. Each campaign gets ``--seconds``
of CPU time on one core (see ``fuzz_one``).

Equivalence is a human verdict (``EQUIVALENT`` below, each with its reason); those mutants are still
fuzzed, so a wrong verdict shows up as a kill, but they are left out of the kill rate. ``DEFENSIVE`` is a
second verdict, kept apart because it is weaker: the mutant weakens a check that fires only when another
part of the core is wrong (an executed precondition on a planner's output, say). A unit test that calls
the internal API with a bad argument kills it; a fuzzer driving a correct core through the public API
cannot. Those count in the kill rate; the summary also gives the rate without them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from difflib import unified_diff
from pathlib import Path

MUTMUT_VERSION = "3.8.1"
#: The modules that decide safety (docs/spec.md), mutated by the campaign.
SAFETY_MODULES = ("block_pool", "occupancy", "token_table", "plan", "compact", "densify", "reclamation",
                  "runtime")
#: mutmut's killers: the unit tests of the core, the misuse corpus, the regression programs and the tests
#: written for the survivors of earlier runs (test_mutation_survivors, test_core_edges_*). Not the state-machine, simulator or planted-bug tests: they
#: are fuzz campaigns and simulations (the fuzzer is measured apart, by ``fuzz``), and at tens of seconds
#: each they made every surviving mutant cost minutes; without them the whole suite here runs in ~5 s.
KILLER_TESTS = ("test_block_pool.py", "test_occupancy.py", "test_token_table.py", "test_planners.py",
                "test_reclamation.py", "test_runtime.py", "test_invariants.py", "test_policies.py",
                "test_misuse.py", "test_misuse_reclaim.py", "test_regressions_vllm.py",
                "test_mutation_survivors.py", "test_core_edges_tables.py", "test_core_edges_reclamation.py",
                "test_core_edges_runtime.py")
TEST_HELPERS = ("conftest.py", "misuse_snapshot.py")
#: mutmut's trampolines change the source the policy-size test counts lines of.
DESELECTED = ("tests/test_policies.py::test_each_policy_is_under_fifty_lines_of_logic",)
REPO = Path(__file__).resolve().parent.parent

#: mutant name -> why no test can tell it from the original (a human verdict; see the module docstring).
EQUIVALENT: dict[str, str] = {
    "vtoken.core.runtime.xǁVTokenRuntimeǁblocks_to_grow__mutmut_7":
        "`n_new < 0` -> `n_new < 1` only sends n_new == 0 into the slow path, whose check_int(..., 0) accepts "
        "0 and falls through to the same return",
    "vtoken.core.runtime.xǁVTokenRuntimeǁbegin_step__mutmut_39":
        "`free_before = None` makes begin_step recompute each request's growth after settling even when "
        "settling changed nothing; blocks_to_grow reads only the state, which is unchanged, so the need is "
        "the same",
    "vtoken.core.densify.x_plan_densify__mutmut_45":
        "`n % S` -> `n / S` differs only for n a positive multiple of S, where it adds blocks[n // S] to the "
        "blocks checked for sharing: that block is already in src_blocks (blocks[keep:written]), or n equals "
        "write_pos, no live token lies at or above it, and the plan returned ALREADY_DENSE before this line",
}

#: mutant name -> which check it weakens and why only a bug elsewhere in the core could reach it. The
#: machine's ``checker_has_teeth`` rule plants such bugs in copies of the state, so the fuzzer can kill these.
DEFENSIVE: dict[str, str] = {
    "vtoken.core.densify.x_plan_densify__mutmut_19":
        "only the message of an internal assertion changes, and only a snapshot whose num_live is wrong can "
        "fail it (tests/test_core_edges_tables.py hands it one): of the n positions below n_live, the holes "
        "number the live tokens at or above n",
    "vtoken.core.reclamation.xǁReclamationManagerǁ_check_moves__mutmut_43":
        "launch's executed precondition on a planner's moves (`and` -> `or` on the destination offset "
        "check): the planners only emit int offsets in [0, S)",
    "vtoken.core.reclamation.xǁReclamationManagerǁ_check_moves__mutmut_34":
        "the invariant name (\"I4\" -> None) of launch's precondition on a planner's moves, which fires only "
        "on a planner bug",
    "vtoken.core.reclamation.xǁReclamationManagerǁ_check_moves__mutmut_64":
        "the invariant name (\"I4\" -> \"i4\") of launch's precondition, two moves sharing a destination: "
        "fires only on a planner bug",
    "vtoken.core.reclamation.xǁReclamationManagerǁplan_request__mutmut_39":
        "the invariant name (\"I4\" -> None) raised when the compact planner does not use exactly the "
        "reserved destinations: fires only on a planner bug",
    "vtoken.core.block_pool.xǁBlockPoolǁcheck__mutmut_3":
        "the invariant name (\"P1\" -> None) of the pool's own checker (a block twice in the free queue): "
        "fires only on a pool bug",
    "vtoken.core.block_pool.xǁBlockPoolǁcheck__mutmut_25":
        "the invariant name of the pool's checker dropped (a ref-0 block missing from the free queue): "
        "fires only on a pool bug",
    "vtoken.core.occupancy.xǁSlotOccupancyǁcheck_against__mutmut_8":
        "the message of the I2 checker (a slot's holder count against the token tables) dropped: fires "
        "only on an occupancy bug",
    "vtoken.core.runtime.xǁVTokenRuntimeǁbegin_step__mutmut_57":
        "the invariant name (\"P3\" -> \"XXP3XX\") raised when the growth forecast was wrong: fires only "
        "on a forecast bug",
    "vtoken.core.reclamation.xǁReclamationManagerǁ_check_moves__mutmut_48":
        "the invariant name (\"I4\" -> None) of launch's precondition, a move writing outside its plan's "
        "blocks: fires only on a planner bug",
    "vtoken.core.occupancy.xǁSlotOccupancyǁcheck_against__mutmut_60":
        "the message of the I2 checker (a block with live slots the tables do not give it) dropped: fires "
        "only on an occupancy bug",
    "vtoken.core.reclamation.xǁReclamationManagerǁ_commit__mutmut_89":
        "the message of _commit's online postcondition (the ordered live token ids changed) dropped: fires "
        "only on a relocation bug",
    "vtoken.core.occupancy.xǁSlotOccupancyǁ__init____mutmut_6":
        "SlotOccupancy's own num_blocks check disabled: it is built only by TokenTable, which has already "
        "refused a bad num_blocks with ConfigError",
    "vtoken.core.occupancy.xǁSlotOccupancyǁ__init____mutmut_4":
        "SlotOccupancy's own num_blocks check raises the wrong error (error=None): it is built only by "
        "TokenTable, which has already refused a bad num_blocks with ConfigError",
    "vtoken.core.occupancy.xǁSlotOccupancyǁ__init____mutmut_7":
        "SlotOccupancy's own num_blocks check loses its lower bound: it is built only by TokenTable, which "
        "has already refused num_blocks <= 0 with ConfigError",
}


class MutationError(Exception):
    """A bad argument or a mutant that does not apply: printed as one line, exit 2."""


# ---- the scratch tree ------------------------------------------------------------------------------------
def _copy_package(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"), dirs_exist_ok=True)


def build_package_tree(source: Path, root: Path) -> Path:
    """``root/vtoken/{core,fuzz}`` from ``source``'s working tree; returns ``root``.

    NOTE: ``vtoken/__init__.py`` makes the copy a regular package, so with ``root`` first on sys.path
    ``vtoken.core`` is imported from here and not through the editable install's finder (which still
    serves ``vtoken.spec`` and ``vtoken.integration`` from the repository: neither is mutated)."""
    pkg = root / "vtoken"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    for sub in ("core", "fuzz"):
        _copy_package(source / sub, pkg / sub)
    return root


def mutmut_config() -> str:
    """The ``pyproject.toml`` of the scratch tree: mutmut's section and pytest's options."""
    only = ", ".join(f'"src/vtoken/core/{m}.py"' for m in SAFETY_MODULES)
    selection = [f"tests/{t}" for t in KILLER_TESTS] + [a for d in DESELECTED for a in ("--deselect", d)]
    return (
        "[tool.mutmut]\n"
        'source_paths = ["src"]\n'
        f"only_mutate = [{only}]\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(selection)}\n"
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]\n\n'
        "[tool.pytest.ini_options]\n"
        'addopts = "-ra --strict-markers"\n'
        'filterwarnings = ["ignore:Failed to initialize NumPy"]\n'
    )


def build_mutmut_tree(source: Path, work: Path) -> None:
    build_package_tree(source, work / "src")
    (work / "tests").mkdir(parents=True, exist_ok=True)
    for name in KILLER_TESTS + TEST_HELPERS:
        shutil.copy2(source / "tests" / name, work / "tests" / name)
    (work / "pyproject.toml").write_text(mutmut_config())


# ---- mutants as whole-file diffs --------------------------------------------------------------------------
@dataclass(frozen=True)
class Mutant:
    name: str  # mutmut's name, e.g. vtoken.core.block_pool.xǁBlockPoolǁfree__mutmut_3
    file: str  # repository path, e.g. core/block_pool.py
    diff: str  # unified diff of the whole file, a/ and b/ prefixes


def file_diff(path: str, before: str, after: str) -> str:
    return "".join(unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                fromfile=f"a/{path}", tofile=f"b/{path}"))


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_hunks(diff: str) -> list[tuple[int, list[str], list[str]]]:
    """The hunks of a unified diff: (0-based start in the old file, old lines, new lines)."""
    hunks: list[tuple[int, list[str], list[str]]] = []
    for line in diff.splitlines(keepends=True):
        m = _HUNK.match(line)
        if m:
            # NOTE: "-n,0" (nothing removed) means after line n, so its 0-based start is n, not n - 1
            hunks.append((int(m.group(1)) - (0 if m.group(2) == "0" else 1), [], []))
        elif hunks and line[:1] in (" ", "-", "+"):
            _, old, new = hunks[-1]
            if line[0] != "+":
                old.append(line[1:])
            if line[0] != "-":
                new.append(line[1:])
    if not hunks:
        raise MutationError("not a unified diff: no @@ hunk header")
    return hunks


def apply_diff(source: str, diff: str) -> str:
    """``source`` with the unified ``diff`` applied.

    Every context and removed line must match exactly. A hunk not found at its line number is looked for
    further on, nearest first (like ``patch``'s offset), so a diff survives edits elsewhere in the file;
    one found nowhere raises ``MutationError``."""
    old = source.splitlines(keepends=True)
    out: list[str] = []
    pos = 0  # index into old of the first line not yet copied
    for start, before, after in parse_hunks(diff):
        at = _locate(old, before, max(start, pos), pos)
        if at is None:
            changed = next((ln for ln in before if ln not in after), before[0] if before else "")
            raise MutationError(f"diff does not apply: the lines of its hunk at line {start + 1} "
                                f"(around {changed.strip()!r}) are not in the file")
        out.extend(old[pos:at])
        out.extend(after)
        pos = at + len(before)
    return "".join(out + old[pos:])


def _locate(old: list[str], block: list[str], hint: int, first: int) -> int | None:
    """Where ``block`` occurs in ``old`` at or after ``first``, the occurrence nearest ``hint``."""
    hits = [i for i in range(first, len(old) - len(block) + 1) if old[i:i + len(block)] == block]
    return min(hits, key=lambda i: abs(i - hint)) if hits else None


def _find_function(module, qualified: str):
    """The FunctionDef ``name`` or ``Class.name`` at the top level of a libcst module, else None.

    NOTE: by class as well as name: mutmut's own ``apply`` matches the bare name, which picks the wrong
    method when two classes of one file define it."""
    import libcst as cst

    cls_name, _, fn_name = qualified.rpartition(".")
    for node in module.body:
        if not cls_name and isinstance(node, cst.FunctionDef) and node.name.value == fn_name:
            return node
        if cls_name and isinstance(node, cst.ClassDef) and node.name.value == cls_name:
            for item in node.body.body:
                if isinstance(item, cst.FunctionDef) and item.name.value == fn_name:
                    return item
    return None


def _import_mutmut():
    try:
        import mutmut
        from mutmut.mutation.file_mutation import mutate_file_contents
    except ModuleNotFoundError as e:
        raise MutationError(f"mutmut is not installed ({e}): pip install 'vtoken[mutation]'") from None
    if mutmut.__version__ != MUTMUT_VERSION:
        raise MutationError(f"mutmut {mutmut.__version__} is installed, the campaign is pinned to {MUTMUT_VERSION}")
    return mutate_file_contents


def generate_mutants(work: Path) -> list[Mutant]:
    """Every mutant mutmut makes of the safety modules in ``work``'s tree, in mutmut's order."""
    _import_mutmut()
    from mutmut.configuration import reset_config

    cwd = os.getcwd()
    os.chdir(work)  # mutmut reads its configuration from ./pyproject.toml; names come from paths under src/
    reset_config()
    try:
        return [m for module in SAFETY_MODULES
                for m in mutants_of_file(Path("src/vtoken/core") / f"{module}.py", f"core/{module}.py")]
    finally:
        os.chdir(cwd)
        reset_config()


def mutants_of_file(rel: Path, repo_path: str) -> list[Mutant]:
    """mutmut's mutants of the file ``rel`` (relative to the current directory, under ``src/``), each as a
    whole-file diff against ``repo_path``: the mutated function spliced back in place of the original."""
    import libcst as cst

    mutate_file_contents = _import_mutmut()
    from mutmut.utils.format_utils import get_mutant_name, orig_function_and_class_names_from_key

    source = rel.read_text()
    original = cst.parse_module(source)
    mutated_file = mutate_file_contents(str(rel), source)
    generated = cst.parse_module(mutated_file.code)
    mutants = []
    for key in mutated_file.mutant_names:
        name = get_mutant_name(rel, key)
        fn, cls = orig_function_and_class_names_from_key(name)
        target = _find_function(original, f"{cls}.{fn}" if cls else fn)
        mutated = _find_function(generated, f"{cls}.{key}" if cls else key)
        if target is None or mutated is None:
            raise MutationError(f"{name}: cannot find the function in the source or in mutmut's output")
        new = original.deep_replace(target, mutated.with_changes(name=cst.Name(fn))).code
        mutants.append(Mutant(name, repo_path, file_diff(repo_path, source, new)))
    return mutants


def source_digests(source: Path) -> dict[str, str]:
    return {f"core/{m}.py": hashlib.sha256((source / "core" / f"{m}.py").read_bytes()).hexdigest()
            for m in SAFETY_MODULES}


# ---- prepare / sample ---------------------------------------------------------------------------------
def prepare(source: Path, work: Path) -> list[Mutant]:
    build_mutmut_tree(source, work)
    mutants = generate_mutants(work)
    (work / "mutants.json").write_text(json.dumps(
        {"mutmut_version": MUTMUT_VERSION, "modules": list(SAFETY_MODULES), "sources": source_digests(source),
         "mutants": [asdict(m) for m in mutants]}, indent=1, ensure_ascii=False) + "\n")
    return mutants


def draw_sample(names: list[str], seed: int, n: int) -> list[str]:
    """``n`` of ``names`` drawn without replacement; a pure function of (the set of names, seed, n)."""
    if not 1 <= n <= len(names):
        raise MutationError(f"--n must be between 1 and {len(names)} (the number of mutants), got {n}")
    return random.Random(seed).sample(sorted(names), n)


def write_sample(all_mutants: dict, seed: int, n: int, out: Path) -> dict:
    by_name = {m["name"]: m for m in all_mutants["mutants"]}
    chosen = draw_sample(list(by_name), seed, n)
    sample = {"seed": seed, "n": n, "population": len(by_name), "mutmut_version": all_mutants["mutmut_version"],
              "modules": all_mutants["modules"], "sources": all_mutants["sources"],
              "drawn_by": f"python -m vtoken.fuzz.mutation prepare --work DIR; "
                          f"... sample --work DIR --seed {seed} --n {n}",
              "mutants": [by_name[c] for c in chosen]}
    out.write_text(json.dumps(sample, indent=1, ensure_ascii=False) + "\n")
    return sample


# ---- fuzz ----------------------------------------------------------------------------------------------------
@dataclass
class FuzzResult:
    name: str
    file: str
    status: str  # killed / survived / timeout / error (vtoken fuzz crashed outside the state machine)
    cpu_s: float = 0.0  # CPU seconds the campaign used (its budget): start-up, search and shrinking
    wall_s: float = 0.0  # the whole process, start-up included (the machine is shared)
    elapsed_s: float | None = None  # the campaign's own (wall-clock) elapsed time, when it ended by itself
    error: str = ""
    replay: str = ""
    pytest_file: str = ""  # the shrunk program, as vtoken fuzz printed it
    equivalent: str = ""  # the human verdicts' reasons, if any (EQUIVALENT, DEFENSIVE)
    defensive: str = ""


def mutated_tree(source: Path, mutant: dict, root: Path) -> Path:
    if root.exists():
        shutil.rmtree(root)
    build_package_tree(source, root)
    target = root / "vtoken" / mutant["file"]
    target.write_text(apply_diff(target.read_text(), mutant["diff"]))
    return root


def fuzz_one(source: Path, mutant: dict, seconds: float, work: Path) -> FuzzResult:
    """The fuzzer alone against one mutant: ``vtoken fuzz --workers 1 --seed 0`` on a tree with just this
    mutant, in its own process group, stopped once that group has used ``seconds`` of CPU time.

    NOTE: the budget is CPU time (read from /proc, so Linux only), not wall time. On a shared machine a
    wall-clock budget gives each campaign whatever share of a core it gets: a third of one, under the
    load this campaign first ran in. Shrinking counts against the budget. ``--time`` is only a backstop."""
    root = mutated_tree(source, mutant, work / "runs" / _safe(mutant["name"]))
    out = root / "fuzz-out"
    cmd = [sys.executable, "-m", "vtoken.core.cli", "fuzz", "--time", f"{WALL_BACKSTOP * seconds:g}",
           "--workers", "1", "--seed", "0", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    res = FuzzResult(mutant["name"], mutant["file"], "error")
    cpu0, start, used = _children_cpu(), time.monotonic(), 0.0
    with open(root / "fuzz.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                used = max(used, _group_cpu(proc.pid))
                if used >= seconds:
                    res.status = "survived"
                    break
                if time.monotonic() - start > WALL_BACKSTOP * seconds + 120:
                    res.status, res.error = "timeout", f"{used:.0f} CPU-s in {time.monotonic() - start:.0f} s"
                    break
                time.sleep(0.2)
        finally:  # its own session: nothing of it outlives this call, even when the campaign is stopped
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    res.wall_s = round(time.monotonic() - start, 2)
    # an exited campaign's workers were reaped by it, so rusage has all of it; a killed one's only in /proc
    res.cpu_s = round(max(used, _children_cpu() - cpu0), 2)
    if res.status != "error":
        return res
    report = _read_report(out / "report.json")
    if proc.returncode == 0 and report is not None:
        res.status, res.elapsed_s = "survived", report["timing"]["elapsed_s"]  # the wall-clock backstop ran out
    elif proc.returncode == 1 and report and report["failures"]:
        f = report["failures"][0]
        res.status, res.elapsed_s, res.error = "killed", report["timing"]["elapsed_s"], f["error"]
        res.replay = f"PYTHONPATH={root} {f['replay']}"  # the mutated tree first on the path
        res.pytest_file = Path(f["pytest_file"]).read_text()
    else:
        tail = (root / "fuzz.log").read_text().strip().splitlines()[-3:]
        res.error = f"exit {proc.returncode}: " + " | ".join(tail)[-600:]
    return res


#: ``vtoken fuzz --time`` is this many times the CPU budget: it only stops a campaign starved of CPU.
WALL_BACKSTOP = 10
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _group_cpu(pgid: int) -> float:
    """CPU seconds of the live processes of process group ``pgid``, with the children they reaped."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == pgid:
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / _TICK


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)


def summarize(results: list[FuzzResult]) -> dict:
    """Counts and the kill rate over the mutants not judged equivalent (timeouts and errors count as not killed)."""
    judged = [r for r in results if not r.equivalent]
    killed = sum(r.status == "killed" for r in judged)
    reachable = [r for r in judged if not r.defensive]
    return {
        "mutants": len(results), "equivalent": len(results) - len(judged), "non_equivalent": len(judged),
        "killed": killed, "survived": sum(r.status == "survived" for r in judged),
        "timeout": sum(r.status == "timeout" for r in judged), "error": sum(r.status == "error" for r in judged),
        "kill_rate": round(killed / len(judged), 4) if judged else None,
        "defensive": len(judged) - len(reachable),
        "kill_rate_without_defensive": (round(sum(r.status == "killed" for r in reachable) / len(reachable), 4)
                                        if reachable else None),
        # a killed "defensive" mutant is no contradiction: checker_has_teeth plants the bugs that reach it
        "contradicted_verdicts": [r.name for r in results if r.equivalent and r.status == "killed"],
    }


def print_table(results: list[FuzzResult], summary: dict, out=sys.stdout) -> None:
    for r in results:
        tag = "equivalent" if r.equivalent else f"{r.status}{'*' if r.defensive else ''}"
        t = f"{r.cpu_s:6.1f} CPU-s"
        print(f"{tag:10} {t}  {r.name}  {r.error[:90]}", file=out)
    print(f"\nkilled {summary['killed']} / survived {summary['survived']} / timeout {summary['timeout']} / error "
          f"{summary['error']} of {summary['non_equivalent']} non-equivalent; {summary['equivalent']} equivalent; "
          f"kill rate {_pct(summary['kill_rate'])}; {summary['defensive']} defensive (*), without them "
          f"{_pct(summary['kill_rate_without_defensive'])}", file=out)
    if summary["contradicted_verdicts"]:
        print(f"WARNING: the fuzzer killed mutants judged equivalent: "
              f"{summary['contradicted_verdicts']}", file=out)


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1%}"


def run_fuzz(sample: dict, source: Path, seconds: float, work: Path, report_path: Path, resume: bool,
             only: list[str]) -> dict:
    """Fuzz the sample's mutants (``only``: just those, in the order given) and write the report after each.

    With ``resume`` the results already in the report stay and are not rerun; the report then holds them
    and the new ones, in the sample's order."""
    by_name = {m["name"]: m for m in sample["mutants"]}
    missing = [n for n in only if n not in by_name]
    if missing:
        raise MutationError(f"--only names a mutant not in the sample: {missing[0]}")
    done: dict[str, FuzzResult] = {}
    if resume and report_path.exists():
        done = {r["name"]: FuzzResult(**r) for r in json.loads(report_path.read_text())["results"]}
    report = {"sample": {k: sample[k] for k in ("seed", "n", "mutmut_version", "modules", "sources")},
              "source_tree": str(source), "sources_now": source_digests(source), "seconds": seconds,
              "command": f"vtoken fuzz --workers 1 --seed 0, stopped at {seconds:g} CPU-s (a process group each)",
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    todo = [n for n in (only or by_name) if n not in done]
    for i, name in enumerate(todo, 1):
        r = done[name] = fuzz_one(source, by_name[name], seconds, work)
        print(f"[{i}/{len(todo)}] {r.status:8} {r.cpu_s:6.1f} CPU-s {r.wall_s:6.1f} s  {name}",
              file=sys.stderr, flush=True)
        _write_report(report_path, report, _in_sample_order(sample, done))
    return _write_report(report_path, report, _in_sample_order(sample, done))


def _in_sample_order(sample: dict, done: dict[str, FuzzResult]) -> list[FuzzResult]:
    results = [done[m["name"]] for m in sample["mutants"] if m["name"] in done]
    for r in results:  # the verdicts as they are now, whenever the mutant ran
        r.equivalent, r.defensive = EQUIVALENT.get(r.name, ""), DEFENSIVE.get(r.name, "")
    return results


def _write_report(path: Path, report: dict, results: list[FuzzResult]) -> dict:
    report = {**report, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "summary": summarize(results),
              "results": [asdict(r) for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return report


# ---- tally: the full mutmut run -------------------------------------------------------------------------
#: mutmut 3.8.1's exit codes (mutmut.__main__.status_by_exit_code), the ones a run produces.
MUTMUT_STATUS = {None: "not run", 0: "survived", 1: "killed", 3: "killed", -24: "timeout", 24: "timeout",
                 152: "timeout", 255: "timeout", 33: "no tests", 34: "skipped", 35: "suspicious", 36: "timeout",
                 37: "caught by type check", -11: "segfault", -9: "segfault"}


def tally(work: Path) -> dict[str, dict[str, int]]:
    """Per module, how many mutants of the full ``mutmut run`` in ``work`` ended how (from its .meta files)."""
    counts: dict[str, dict[str, int]] = {}
    for module in SAFETY_MODULES:
        meta = work / "mutants" / "src" / "vtoken" / "core" / f"{module}.py.meta"
        if not meta.exists():
            raise MutationError(f"{meta} does not exist: run `mutmut run` in {work} first")
        row: dict[str, int] = {}
        for code in json.loads(meta.read_text())["exit_code_by_key"].values():
            status = MUTMUT_STATUS.get(code, f"exit {code}")
            row[status] = row.get(status, 0) + 1
        counts[module] = row
    return counts


# ---- command line -------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vtoken.fuzz.mutation", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="scratch tree for mutmut, and every mutant as a diff (nothing run)")
    pr.add_argument("--work", required=True, type=Path)
    pr.add_argument("--source", type=Path, default=REPO, help="the tree to copy (default: this checkout)")
    sa = sub.add_parser("sample", help="a seeded random sample of the mutants prepare listed")
    sa.add_argument("--work", required=True, type=Path)
    sa.add_argument("--seed", type=int, required=True)
    sa.add_argument("--n", type=int, required=True)
    sa.add_argument("--out", type=Path, default=REPO / "fuzz" / "mutation_sample.json")
    fz = sub.add_parser("fuzz", help="the fuzzer alone against each sampled mutant, one process each")
    fz.add_argument("--sample", required=True, type=Path)
    fz.add_argument("--seconds", type=float, default=60.0, help="CPU seconds per mutant, shrinking included")
    fz.add_argument("--work", type=Path, default=Path("fuzz-out") / "mutation")
    fz.add_argument("--source", type=Path, default=REPO, help="the tree to mutate (default: this checkout)")
    fz.add_argument("--report", type=Path, help="default: WORK/report.json")
    fz.add_argument("--resume", action="store_true", help="keep the results already in the report")
    fz.add_argument("--only", nargs="+", default=[], metavar="NAME", help="just these mutants of the sample")
    ta = sub.add_parser("tally", help="counts of the full mutmut run in WORK, per module")
    ta.add_argument("--work", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    try:
        return _COMMANDS[a.cmd](a)
    except (MutationError, OSError, ValueError) as e:
        print(f"vtoken.fuzz.mutation {a.cmd}: {e}", file=sys.stderr)
        return 2


def _prepare(a) -> int:
    mutants = prepare(a.source.resolve(), a.work.resolve())
    for m in mutants:
        print(m.name)
    counts = {mod: sum(m.file == f"core/{mod}.py" for m in mutants) for mod in SAFETY_MODULES}
    print(f"{len(mutants)} mutants ({', '.join(f'{k} {v}' for k, v in counts.items())}); "
          f"run them all: cd {a.work} && mutmut run --max-children 1", file=sys.stderr)
    return 0


def _sample(a) -> int:
    path = a.work / "mutants.json"
    if not path.exists():
        raise MutationError(f"{path} does not exist: run `prepare --work {a.work}` first")
    sample = write_sample(json.loads(path.read_text()), a.seed, a.n, a.out)
    print(f"{len(sample['mutants'])} of {sample['population']} mutants (seed {a.seed}) -> {a.out}")
    return 0


def _fuzz(a) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so fuzz_one's cleanup runs on `kill`
    if a.seconds <= 0:
        raise MutationError(f"--seconds must be positive, got {a.seconds:g}")
    sample = json.loads(a.sample.read_text())
    report = run_fuzz(sample, a.source.resolve(), a.seconds, a.work.resolve(), a.report or a.work / "report.json",
                      a.resume, a.only)
    print_table([FuzzResult(**r) for r in report["results"]], report["summary"])
    return 0


def _tally(a) -> int:
    counts = tally(a.work)
    statuses = sorted({s for row in counts.values() for s in row})
    print("module        " + "".join(f"{s:>12}" for s in statuses) + "       total")
    for module, row in counts.items():
        print(f"{module:14}" + "".join(f"{row.get(s, 0):12}" for s in statuses) + f"{sum(row.values()):12}")
    total = {s: sum(row.get(s, 0) for row in counts.values()) for s in statuses}
    print(f"{'all':14}" + "".join(f"{total[s]:12}" for s in statuses) + f"{sum(total.values()):12}")
    return 0


_COMMANDS = {"prepare": _prepare, "sample": _sample, "fuzz": _fuzz, "tally": _tally}

if __name__ == "__main__":
    sys.exit(main())
