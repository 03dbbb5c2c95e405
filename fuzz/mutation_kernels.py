"""A mutation run over the fast path's numba kernels (issues #45, #46): mutmut's mutants of one kernel file
(``TARGETS``: ``integration/fastpath/{kernels,gather_kernels,read_kernels,relocate}.py``), each run against that file's
killer tests, then the fast fuzzer.

    python -m vtoken.fuzz.mutation_kernels prepare --file kernels --work /tmp/mutk      # every mutant -> mutants.json
    python -m vtoken.fuzz.mutation_kernels run --file kernels --seed 45 --n 60 --work /tmp/mutk    # -> its report
    python -m vtoken.fuzz.mutation_kernels judge --file kernels      # SURVIVORS' verdicts into the report, nothing run

Why not ``mutmut run``: its trampolines are Python code that numba cannot compile, and mutmut's generator skips
decorated functions (every ``@njit`` kernel). So, as ``fuzz/mutation.py`` does for the core, the mutants are
applied as plain whole-file diffs to a scratch copy of the tree: ``prepare`` hides the decorators from mutmut's
generator (``mutate_file_contents``, the code ``mutmut run`` uses, so the names are mutmut's), and splices each
mutated function back in place of the original, decorators and all.

Each mutant runs with ``NUMBA_DISABLE_JIT=1``: the kernels run as plain Python (numpy scalars and arrays), so no
mutant costs a compile. The killers, in that order, stopping at the first that kills:

1. ``pytest -x`` on the file's killer tests (``Target.killers``; a per-mutant timeout; a timeout counts apart, as
   killed by timeout), less ``DESELECTED`` (see there why);
2. for a survivor of pytest, ``vtoken fuzz --target fast --time SECONDS --workers 1 --seed 0``;
3. with ``--jit-check``, for a survivor of both, pytest again with the JIT on (a scratch numba cache): what plain
   Python accepts and numba refuses to compile, or what compiles to different arithmetic, is killed there;
4. or, cheaper, afterwards: ``compile-check`` compiles each survivor's kernels with the JIT on (``warm_up``, numba
   types every branch): a mutant numba refuses (``blocks[row, n / S]``: a float index) is killed by
   ``numba-compile``, as the killers with the JIT on would kill it.

One ``--work`` folder per file (its ``mutants.json`` is that file's). The scratch tree:
``WORK/runs/<mutant>/vtoken/{core,fuzz,integration}`` (``mutation.build_package_tree`` plus
integration/), its own ``tests/`` (the conftest with Hypothesis's shrinking off: ``NO_SHRINK``) and
``pyproject.toml``, run with ``PYTHONPATH`` set to it and it as the working
directory. ``vtoken/__init__.py`` makes the copy a regular package, so ``vtoken.integration.fastpath.kernels`` is
imported from the copy and not through the editable install's finder (the file's own module likewise); ``run``
checks that on the unmutated tree
first (and that the killers pass there) and stops if not.

Verdicts on the survivors are human (``SURVIVORS`` below, each with its reason): equivalent, defensive (a check
that fires only when another part is wrong; ``mutation.py``'s sense) or a test gap (and which test would kill it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .mutation import (MUTMUT_VERSION, REPO, Mutant, MutationError, _copy_package, _find_function,
                       _import_mutmut, _read_report, _safe, apply_diff, build_package_tree, draw_sample, file_diff)



@dataclass(frozen=True)
class Target:
    """One kernel file and the tests that run its kernels (pytest's killers, before the fuzzer), with the test
    modules they import (``helpers``, copied beside them)."""
    file: str
    killers: tuple[str, ...]
    helpers: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return Path(self.file).stem

    @property
    def module(self) -> str:
        return "vtoken." + self.file.removesuffix(".py").replace("/", ".")

    @property
    def mutmut_path(self) -> Path:
        """The path mutmut's generator is told (as if under src/, like mutation.py's scratch tree): it names the
        mutants ``<module>.x_<function>__mutmut_<k>``."""
        return Path("src/vtoken") / self.file

    @property
    def report(self) -> Path:
        return REPO / "fuzz" / f"mutation_{self.name}.json"


#: NOTE: the dense runtime's and the gather runtime's locksteps (test_fastpath_runtime.py) run every kernel file;
#: each file's own tests come first, as they fail fastest on its mutants.
TARGETS = {t.name: t for t in (
    Target("integration/fastpath/kernels.py", ("tests/test_fastpath_table.py", "tests/test_fastpath_runtime.py")),
    Target("integration/fastpath/gather_kernels.py",
           ("tests/test_fastpath_gather.py", "tests/test_fastpath_runtime.py")),
    Target("integration/fastpath/read_kernels.py", ("tests/test_reads.py", "tests/test_fastpath_runtime.py")),
    Target("integration/fastpath/relocate.py", ("tests/test_fastpath_relocate.py",), ("test_device_layer.py",)),
)}
TEST_HELPERS = ("conftest.py",)
#: test id -> why it is left out of the runs with the JIT off (the JIT check runs it)
DESELECTED = {
    "tests/test_fastpath_table.py::test_the_lockstep_holds_with_numbas_bounds_checks_on":
        "it reruns TestLockstep in a child with NUMBA_BOUNDSCHECK=1, a setting of compiled code only: with "
        "NUMBA_DISABLE_JIT=1 (inherited by the child) it is TestLockstep again, 7 s per mutant for nothing new "
        "(plain numpy checks every positive index anyway). It passes on the unmutated tree either way.",
}
#: appended to the scratch tree's conftest (the repository's is not changed): the loaded profile less Hypothesis's
#: shrink phase. The test machines' settings are made at import, after conftest, and inherit it. A failing example
#: fails the test either way; shrinking it took over 100 s of a killed mutant's run on this machine.
NO_SHRINK = """

# ---- vtoken.fuzz.mutation_kernels: no shrinking (a kill is a kill; the first failing example is enough) ----
from hypothesis import Phase as _Phase  # noqa: E402
settings.register_profile("mutation", settings.default, phases=(_Phase.explicit, _Phase.reuse, _Phase.generate))
settings.load_profile("mutation")
"""
#: why a file's plain functions are left out of its population, beyond warm_up
PLAIN_FUNCTIONS = {"kernels": "; _keep_vllms_kernel_scan_working is a patch of llvmlite's wrapper",
                   "relocate": "; host_mover picks the cache's layout; HostMover's methods are not mutated at all"}
PYTEST_ARGS = ("-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist")

#: mutant name -> (verdict, reason): the human classification of every survivor of the sample.
#: verdict: "equivalent" (no test can tell it), "defensive" (a check that fires only when another part is wrong),
#: "gap" (a real test gap: the reason names the test that would kill it).
#: Kept for every survivor of pytest and the fuzzer, whatever ``compile-check`` found after.
SURVIVORS: dict[str, tuple[str, str]] = {
    "vtoken.integration.fastpath.kernels.x_densify__mutmut_109": (
        "gap",
        "`blocks[row, n // S]` -> `blocks[row, n / S]` in densify's last SHARED_BLOCK refusal: the new cursor would "
        "land inside a block another request lists (the row evicted the tail of a shared block and every token "
        "after it, so nothing moves). A float index: numba does not compile it (killed by numba-compile) and numpy "
        "raises IndexError, so any run that reaches the line kills it; neither the lockstep nor the fuzzer reaches "
        "that branch. Test: requests a and b share a full prefix block; a evicts that block's last tokens and all "
        "its tokens after it; FastTable.densify(a) must answer NoPlan SHARED_BLOCK naming the block, as "
        "plan_densify does (and the next sync must not write into b's block). Since written: tests/test_fastpath_table.py::"
        "test_densify_refuses_to_write_a_shared_new_cursor_block_as_the_core_does (which also found the NoPlan's "
        "detail worded otherwise than the core's; fixed)."),
    "vtoken.integration.fastpath.kernels.x_densify__mutmut_43": (
        "defensive",
        "`... or pos_token[...] != NO_POS or j and dup` -> `... or pos_token[...] != NO_POS and j and dup`: the "
        "check of densify's hint (`evicted`, this step's evicted positions) that every position is dead and none "
        "repeats now passes a live position or a repeated dead one. Only a wrong hint reaches it: FastRuntime "
        "passes None, evict_densify_batch the positions its own eviction just freed (dead, distinct), and the "
        "lockstep each request's evicted positions since its last densify (dead, distinct). Killed by a unit test "
        "that hands FastTable.densify a hint of the right length with a live position (or a repeated hole) in it "
        "and expects the plan it makes without the hint. Since written: tests/test_fastpath_table.py::"
        "test_densify_plans_as_without_a_hint_when_the_evicted_positions_given_are_wrong."),
    "vtoken.integration.fastpath.kernels.x_evict_densify_batch__mutmut_130": (
        "equivalent",
        "`live_bits` -> `None` in evict_densify_batch's call of densify_batch: densify_batch only hands it on to "
        "densify, and densify never reads the live index (it moves tokens between positions; which ids are live "
        "does not change). compile-check: numba types the argument as none and compiles."),
    "vtoken.integration.fastpath.kernels.x_densify_batch__mutmut_62": (
        "equivalent",
        "`b if code == PLANNED else 0` -> `b if (code == PLANNED) or True else 0` for released_start: densify's "
        "other answers that reach the line are (ALREADY_DENSE, 0, 0) and (SHARED_BLOCK, block, 0), b = 0 in both "
        "(DENSE_MISMATCH returned before it)."),
    "vtoken.integration.fastpath.kernels.x_step_record__mutmut_39": (
        "gap",
        "`j -= 1` -> `j = 1` in step_record's insertion sort of the PLANNED rows by admission: when a row must "
        "move past an earlier one the loop never ends (j stays 1). Never reached: every caller under test hands "
        "the due rows in admission order (FastMachine.step evicts `self.running()`, the lockstep likewise), and "
        "the planted fast_plans_out_of_order reverses the commits after the kernel. vLLM's running order need not "
        "be admission order. Test: a FastRuntime (or FastMachine) step whose decoding requests come in another "
        "order than admission, with two or more of them planning: the kernel's commits must be in admission "
        "order, as the core's (the shadow compares); the mutant hangs (a pytest timeout kills it). Since written: "
        "tests/test_fastpath_runtime.py::test_a_step_handed_out_of_admission_order_commits_in_admission_order."),
    "vtoken.integration.fastpath.kernels.x_step_record__mutmut_36": (
        "gap",
        "`order[j] = order[j - 1]` -> `order[j] = None`: the same never-reached shift of the insertion sort as "
        "x_step_record__mutmut_39 (None into an int64 array: numba does not compile it, killed by numba-compile; "
        "numpy would raise TypeError). The same out-of-admission-order step kills it with the JIT off."),
    # ---- read_kernels.py (seed 46) ----
    "vtoken.integration.fastpath.read_kernels.x_patch_reads__mutmut_91": (
        "gap",
        "`while p >= 0 and ...` -> `while p > 0 and ...` in patch_reads' search for the newest id a row keeps: when "
        "the row loses every entry the search stops at position 0 and takes the evicted first id for a kept one, so "
        "a joined id older than it is refused (JOINED_ORDER) where the numpy reference, which orders joined ids "
        "after the kept ones only, accepts it. A real record never joins an id older than one it evicts (new "
        "tokens have the newest ids), so neither the locksteps nor the fuzzer reach it. Test: a row [1, 2, 4] "
        "evicts all three and joins (0, 3): both tables accept, the list is [0, 3]. Since written: "
        "tests/test_reads.py::test_a_row_that_loses_every_entry_orders_its_joined_ids_by_nothing_kept (fails on "
        "the mutant, checked)."),
    "vtoken.integration.fastpath.read_kernels.x_patch_reads__mutmut_68": (
        "equivalent",
        "`if b - a > 1:` -> `if b + a > 1:` before np.sort of a row's removed positions: it sorts rows with zero or "
        "one eviction too, which leaves them as they are. Only slower (an allocation per row): with the JIT off "
        "the killers took 256 s, past the first run's 150 s timeout."),
    "vtoken.integration.fastpath.read_kernels.x_log_append__mutmut_15": (
        "gap",
        "`have + add > limit` -> `have + add >= limit` in log_append: a change log of exactly CHANGE_LOG_LIMIT "
        "entries is dropped (the row says rebuilt) where the core's lists it (it drops past the bound). The test of "
        "the bound (limit 2) went from 1 entry to 3, never exactly 2. Test: the same test, then 2 evictions "
        "between takes: both sides list them. Since written: tests/test_fastpath_runtime.py::"
        "test_read_changes_past_the_change_logs_bound_say_rebuilt_on_both_sides (its last step; the shadow "
        "raises V6 on the mutant, checked)."),
    # ---- gather_kernels.py (seed 46) ----
    "vtoken.integration.fastpath.gather_kernels.x__check_compact_commit__mutmut_24": (
        "gap",
        "`0 <= b < NB and listed[b] > 0` -> `0 <= b <= NB and ...` in the check of a compact plan's sources: a "
        "source that is the first id past the pool reads `listed[NB]`, out of bounds (numpy raises IndexError; "
        "compiled without bounds checks it reads past the array). No test handed a commit a source outside the "
        "pool. Test: the example plan with a source NUM_BLOCKS (and one with -1): both sides refuse it, 'are not in "
        "its block list, in order'. Since written: tests/test_fastpath_gather.py::"
        "test_a_changed_compact_plan_commits_as_the_cores['a source past the pool'] (fails on the mutant with the "
        "JIT off, checked), and the lockstep's tamper src_outside_pool, which found that the core's own commit "
        "raised ValueError there under verify_fast_paths (Plan.final_layout ran before the checks; fixed)."),
    "vtoken.integration.fastpath.gather_kernels.x__check_compact_commit__mutmut_158": (
        "equivalent",
        "`listed[b] > 0` -> `listed[b] >= 0` before looking a move's destination up in the row's list: the count is "
        "a shortcut (a block no row lists is not in this row's list either); without it `_listed_by` searches and "
        "answers -1 alike. Only slower."),
    "vtoken.integration.fastpath.gather_kernels.x__check_compact_commit__mutmut_270": (
        "defensive",
        "`lo = max(0, final_pos - f * S)` -> `max(0, final_pos + f * S)` in the check that nothing live lies at or "
        "after the final cursor: the scan starts past the block, so it checks nothing. Only a table already broken "
        "reaches a refusal there: a move that writes at or after the staged cursor is refused before it "
        "(MOVE_OUTSIDE), and the sources' slots past the cursor are emptied by the commit. The core keeps the same "
        "check (its LIVE_AFTER_CURSOR), as an assertion of I1 over the final layout."),
    "vtoken.integration.fastpath.gather_kernels.x_commit_compact__mutmut_25": (
        "equivalent",
        "`np.zeros(nd, np.bool_)` -> `np.zeros(nd, )` for the kept-destination flags: float64 zeros, set to 1.0 "
        "and read as truth values alike. numba compiles it (compile-check)."),
    "vtoken.integration.fastpath.gather_kernels.x_commit_compact__mutmut_23": (
        "equivalent",
        "`np.zeros(nd, np.bool_)` -> `np.zeros(nd, None)`: float64 zeros, as x_commit_compact__mutmut_25."),
    # ---- relocate.py (seed 46) ----
    "vtoken.integration.fastpath.relocate.x_split_waves__mutmut_39": (
        "equivalent",
        "`return j, 0` -> `return j, 1` where split_waves declines a batch (a move outside the cache): the caller "
        "reads only the first value then (bad >= 0: the Python checks run) and never the wave count."),
    "vtoken.integration.fastpath.relocate.x_split_waves__mutmut_63": (
        "gap",
        "`wave + 1` -> `wave + 2` when a copy starts a new wave: a batch's stamps run past the len(copies) + 1 its "
        "caller adds to the stamp, so the next batch's first wave stamp equals a block's stamp from the last "
        "wave of this one, and a copy reading that block is split into a wave of its own where the reference "
        "(copy_engine.waves) keeps one wave. Only slower (an extra wave orders more, never less), but the answer "
        "differs from the reference it is tested against; the 300 random batches never chained enough waves. "
        "Test: three chained copies (three waves), then two independent copies, one reading the block the last "
        "wave wrote: one wave. Since written: tests/test_fastpath_relocate.py::"
        "test_a_batch_after_one_of_many_waves_splits_only_on_its_own_writes (fails on the mutant, checked)."),
}


# ---- mutants ----------------------------------------------------------------------------------------------
def mutants_of_kernels(target: Target, source: str) -> list[Mutant]:
    """mutmut's mutants of ``target``'s source, the decorators hidden from its generator, each as a whole-file diff
    against ``target.file`` (the mutated function spliced back with its decorators)."""
    import libcst as cst

    mutate_file_contents = _import_mutmut()
    from mutmut.utils.format_utils import get_mutant_name, orig_function_and_class_names_from_key

    original = cst.parse_module(source)
    undecorated = original.with_changes(body=[
        n.with_changes(decorators=[]) if isinstance(n, cst.FunctionDef) else n for n in original.body])
    mutated_file = mutate_file_contents(str(target.mutmut_path), undecorated.code)
    generated = cst.parse_module(mutated_file.code)
    mutants = []
    for key in mutated_file.mutant_names:
        name = get_mutant_name(target.mutmut_path, key)
        fn, cls = orig_function_and_class_names_from_key(name)
        if cls:  # a method (relocate.py's HostMover): plain Python around the kernels, not in any population
            continue
        kernel, mutated = _find_function(original, fn), _find_function(generated, key)
        if kernel is None or mutated is None:
            raise MutationError(f"{name}: cannot find the function in the source or in mutmut's output")
        new = original.deep_replace(kernel, mutated.with_changes(name=cst.Name(fn), decorators=kernel.decorators,
                                                                 leading_lines=kernel.leading_lines)).code
        diff = file_diff(target.file, source, new)
        if not diff or apply_diff(source, diff) != new:
            raise MutationError(f"{name}: its diff is empty or does not reproduce the mutated file")
        compile(new, target.file, "exec")
        mutants.append(Mutant(name, target.file, diff))
    return mutants


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def prepare(target: Target, source: Path, work: Path) -> dict:
    """Every mutant into ``WORK/mutants.json``. mutmut's generator reads its configuration from
    ./pyproject.toml (``source_paths``), so it runs in ``work`` with a section that names nothing else."""
    _import_mutmut()
    from mutmut.configuration import reset_config

    work.mkdir(parents=True, exist_ok=True)
    (work / "pyproject.toml").write_text('[tool.mutmut]\nsource_paths = ["src"]\n')
    cwd = os.getcwd()
    os.chdir(work)
    reset_config()
    try:
        mutants = mutants_of_kernels(target, (source / target.file).read_text())
    finally:
        os.chdir(cwd)
        reset_config()
    data = {"mutmut_version": MUTMUT_VERSION, "file": target.file, "sha256": digest(source / target.file),
            "mutants": [asdict(m) for m in mutants]}
    (work / "mutants.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data


def function_of(name: str) -> str:
    return name.rpartition(".")[2].partition("__mutmut_")[0].removeprefix("x_")


# ---- the scratch tree and the runs ------------------------------------------------------------------------
def build_tree(target: Target, source: Path, root: Path, mutant: dict | None) -> Path:
    """``root``: the package (core, fuzz, integration), the killers and pytest's options, the mutant applied."""
    if root.exists():
        shutil.rmtree(root)
    build_package_tree(source, root)
    _copy_package(source / "integration", root / "vtoken" / "integration")
    (root / "tests").mkdir()
    for t in target.killers:
        shutil.copy2(source / t, root / t)
    for h in TEST_HELPERS + target.helpers:
        shutil.copy2(source / "tests" / h, root / "tests" / h)
    shutil.copy2(source / "pyproject.toml", root / "pyproject.toml")  # pytest's options (addopts, filterwarnings)
    with open(root / "tests" / "conftest.py", "a") as f:
        f.write(NO_SHRINK)
    if mutant is not None:
        target = root / "vtoken" / mutant["file"]
        target.write_text(apply_diff(target.read_text(), mutant["diff"]))
    return root


def _env(root: Path, jit: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    if jit:
        env.pop("NUMBA_DISABLE_JIT", None)
        env["NUMBA_CACHE_DIR"] = str(root / "numba-cache")
    else:
        env["NUMBA_DISABLE_JIT"] = "1"
    return env


@dataclass
class Run:
    """One killer's run: exit status (None: stopped at the timeout), seconds, and what failed."""
    rc: int | None
    wall_s: float
    failure: str = ""


def _run_group(cmd: list[str], root: Path, env: dict, timeout: float, log: Path) -> Run:
    """``cmd`` in its own process group, all of it killed at ``timeout`` seconds."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            if proc.poll() is None or rc is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    return Run(rc, round(time.monotonic() - start, 1))


_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$", re.M)


def run_pytest(target: Target, root: Path, timeout: float, jit: bool = False) -> Run:
    cmd = [sys.executable, "-m", "pytest", *PYTEST_ARGS, *target.killers]
    if not jit:
        cmd += [a for d in DESELECTED if d.partition("::")[0] in target.killers for a in ("--deselect", d)]
    r = _run_group(cmd, root, _env(root, jit), timeout, root / ("pytest-jit.log" if jit else "pytest.log"))
    text = (root / ("pytest-jit.log" if jit else "pytest.log")).read_text(errors="replace")
    m = _FAILED.search(text)
    if m:
        r.failure = f"{m.group(2)}: {(m.group(3) or '').strip()}"[:400]
    elif r.rc not in (0, None):
        r.failure = " | ".join(text.strip().splitlines()[-3:])[-400:]
    return r


def run_fuzz(root: Path, seconds: float) -> Run:
    out = root / "fuzz-out"
    cmd = [sys.executable, "-m", "vtoken.core.cli", "fuzz", "--target", "fast", "--time", f"{seconds:g}",
           "--workers", "1", "--seed", "0", "--out", str(out)]
    r = _run_group(cmd, root, _env(root, False), seconds + 180, root / "fuzz.log")
    report = _read_report(out / "report.json")
    if r.rc == 1 and report and report.get("failures"):
        f = report["failures"][0]
        r.failure = f"{f.get('error', '')}"[:400]
    elif r.rc not in (0, None):
        r.failure = " | ".join((root / "fuzz.log").read_text(errors="replace").strip().splitlines()[-3:])[-400:]
    return r


@dataclass
class Result:
    name: str
    function: str
    njit: bool  # the mutated function is an @njit kernel (else a plain helper of the module)
    diff: str
    verdict: str  # killed / survived / timeout / error
    killer: str  # pytest / fuzz / pytest-jit / "" (survived); for a timeout, the killer that timed out
    detail: str = ""  # the first failing test, the fuzzer's error, or the timeout
    runs: dict = field(default_factory=dict)  # killer -> asdict(Run)
    classification: str = ""  # survivors: equivalent / defensive / gap
    reason: str = ""


def run_one(target: Target, source: Path, mutant: dict, work: Path, njit: set[str], pytest_timeout: float,
            fuzz_seconds: float, jit_check: bool, keep: bool) -> Result:
    root = build_tree(target, source, work / "runs" / _safe(mutant["name"]), mutant)
    fn = function_of(mutant["name"])
    res = Result(mutant["name"], fn, fn in njit, mutant["diff"], "survived", "")
    stages = [("pytest", lambda: run_pytest(target, root, pytest_timeout)),
              ("fuzz", lambda: run_fuzz(root, fuzz_seconds))]
    if jit_check:
        stages.append(("pytest-jit", lambda: run_pytest(target, root, 900, jit=True)))
    for killer, stage in stages:
        r = stage()
        res.runs[killer] = asdict(r)
        if r.rc is None:
            res.verdict, res.killer, res.detail = "timeout", killer, f"still running after {r.wall_s:g} s"
            break
        if r.rc == 0:
            continue
        if killer == "fuzz" and r.rc != 1:  # the campaign crashed outside the state machine
            res.verdict, res.killer, res.detail = "error", killer, r.failure
            break
        res.verdict, res.killer, res.detail = "killed", killer, r.failure
        break
    if res.verdict == "survived":
        res.classification, res.reason = SURVIVORS.get(res.name, ("", ""))
    elif res.name in SURVIVORS:
        raise MutationError(f"{res.name}: judged a survivor (SURVIVORS), but {res.killer} killed it now")
    if not keep and res.verdict in ("killed", "timeout"):
        shutil.rmtree(root, ignore_errors=True)
    return res


def compile_script(target: Target) -> str:
    """Compiles every kernel of the file (its ``warm_up`` calls each once; numba types a function's whole body,
    branches never taken included); exit 1 with the error's line if one does not compile. For every file but
    relocate.py (its kernels compile per dtype, at a worker's start) that is ``fastpath.unavailable()``'s answer: the
    fast path would not start."""
    return (f"import {target.module} as k\n"
            "try:\n"
            "    k.warm_up()\n"
            "except Exception as e:\n"
            "    print(f'{type(e).__name__}: {e}'.splitlines()[0])\n"
            "    raise SystemExit(1)\n"
            "print('compiled')\n")


def run_compile(target: Target, root: Path, timeout: float = 600) -> Run:
    """numba compiles every kernel of ``target`` in the tree (``compile_script``), in a fresh cache."""
    shutil.rmtree(root / "numba-cache", ignore_errors=True)
    r = _run_group([sys.executable, "-c", compile_script(target)], root, _env(root, True), timeout,
                   root / "compile.log")
    if r.rc not in (0, None):
        r.failure = " | ".join((root / "compile.log").read_text(errors="replace").strip().splitlines()[-2:])[-400:]
    return r


def compile_check(a) -> dict:
    """The survivors of ``--out`` (or ``--only`` these) compiled with the JIT on; one numba refuses is killed by
    ``numba-compile``: with the JIT on (as the fast path runs) the killers fail on it, and ``available()`` is False."""
    target, source, work = TARGETS[a.file], a.source.resolve(), a.work.resolve()
    report = json.loads(a.out.read_text())
    results = [Result(**r) for r in report["results"]]
    todo = [r for r in results if (r.name in a.only if a.only else r.verdict == "survived")]
    base = run_compile(target, build_tree(target, source, work / "runs" / "_unmutated", None))
    if base.rc != 0:
        raise MutationError(f"the unmutated tree's kernels do not compile: {base.failure}")
    for i, r in enumerate(todo, 1):
        root = build_tree(target, source, work / "runs" / _safe(r.name), {"file": target.file, "diff": r.diff})
        c = run_compile(target, root)
        r.runs["numba-compile"] = asdict(c)
        if c.rc is None:
            r.verdict, r.killer, r.detail = "timeout", "numba-compile", f"still compiling after {c.wall_s:g} s"
        elif c.rc != 0:
            r.verdict, r.killer, r.detail = "killed", "numba-compile", c.failure
        print(f"[{i}/{len(todo)}] {r.verdict:8} {c.wall_s:6.1f} s  {r.name}  {r.detail[:100]}", file=sys.stderr,
              flush=True)
    header = {k: v for k, v in report.items() if k not in ("finished", "wall_s", "summary", "results")}
    header["killers"]["numba-compile"] = ("the survivors of pytest and fuzz compiled with the JIT on: "
                                          f"python -c 'import {target.module} as k; k.warm_up()'")
    header["compile_check"] = {"unmutated_compile_s": base.wall_s, "checked": len(todo),
                               "command": "python -m vtoken.fuzz.mutation_kernels compile-check "
                                          f"--file {a.file} --work {a.work} --out {_shown(a.out)}"}
    judge(results)  # the verdicts on the survivors of pytest and the fuzzer, whatever the compile check found
    out = {**header, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "wall_s": round(report["wall_s"] + sum(r.runs.get("numba-compile", {}).get("wall_s", 0) for r in todo)
                           + base.wall_s, 1),
           "summary": summarize(results), "results": [asdict(r) for r in results]}
    a.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    return out


def judge(results: list[Result]) -> None:
    """The human verdicts (``SURVIVORS``) onto ``results``, by name."""
    for r in results:
        r.classification, r.reason = SURVIVORS.get(r.name, ("", ""))


def judge_report(a) -> dict:
    """``--out``'s results judged again from ``SURVIVORS`` (verdicts written after the run), nothing run; with
    ``--note``, the report's ``notes`` (how it was run, when that took more than its one command)."""
    report = json.loads(a.out.read_text())
    results = [Result(**r) for r in report["results"]]
    judge(results)
    out = {**report, **({"notes": a.note} if a.note else {}), "summary": summarize(results),
           "results": [asdict(r) for r in results]}
    a.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    return out


def check_baseline(target: Target, source: Path, work: Path, pytest_timeout: float) -> dict:
    """The unmutated scratch tree: its kernels are the ones imported, and the killers pass there without the JIT."""
    root = build_tree(target, source, work / "runs" / "_unmutated", None)
    probe = subprocess.run([sys.executable, "-c", f"import {target.module} as k, vtoken.core as c,"
                            " vtoken.fuzz as f; print(k.__file__); print(c.__file__); print(f.__file__)"],
                           cwd=root, env=_env(root, False), capture_output=True, text=True, timeout=120)
    files = probe.stdout.split()
    if probe.returncode != 0 or len(files) != 3 or not all(Path(f).is_relative_to(root) for f in files):
        raise MutationError(f"the scratch tree's package is not the one imported: {probe.stdout} {probe.stderr}")
    r = run_pytest(target, root, max(pytest_timeout, 600))
    if r.rc != 0:
        raise MutationError(f"the unmutated tree fails the killers with NUMBA_DISABLE_JIT=1 ({r.failure}); "
                            f"see {root / 'pytest.log'}")
    passed = re.search(r"(\d+) passed", (root / "pytest.log").read_text())
    return {"imported_from": files, "pytest_wall_s": r.wall_s, "passed": int(passed.group(1)) if passed else None}


def summarize(results: list[Result]) -> dict:
    def count(**kw) -> int:
        return sum(all(getattr(r, k) == v for k, v in kw.items()) for r in results)

    killed = count(verdict="killed")
    survived = [r for r in results if r.verdict == "survived"]
    return {
        "mutants": len(results),
        "killed_by_pytest": count(verdict="killed", killer="pytest"),
        "killed_by_fuzz": count(verdict="killed", killer="fuzz"),
        "killed_by_pytest_jit": count(verdict="killed", killer="pytest-jit"),
        "killed_by_numba_compile": count(verdict="killed", killer="numba-compile"),
        "timeout": count(verdict="timeout"), "error": count(verdict="error"), "survived": len(survived),
        "survived_pytest_and_fuzz": sum(r.runs.get("fuzz", {}).get("rc") == 0 for r in results),
        "survivors_equivalent": sum(r.classification == "equivalent" for r in survived),
        "survivors_defensive": sum(r.classification == "defensive" for r in survived),
        "survivors_gap": sum(r.classification == "gap" for r in survived),
        "survivors_unclassified": sum(not r.classification for r in survived),
        "judged": {c: sum(r.classification == c for r in results) for c in ("equivalent", "defensive", "gap")},
        "kill_rate": round(killed / len(results), 4) if results else None,
        "kill_rate_timeouts_as_kills": (round((killed + count(verdict="timeout")) / len(results), 4)
                                        if results else None),
    }


def write_report(path: Path, header: dict, results: list[Result]) -> dict:
    report = {**header, "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "wall_s": round(time.time() - header["_t0"], 1), "summary": summarize(results),
              "results": [asdict(r) for r in results]}
    report = {k: v for k, v in report.items() if not k.startswith("_")}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return report


def run(a) -> dict:
    target, source, work = TARGETS[a.file], a.source.resolve(), a.work.resolve()
    t0 = time.time()
    cached = work / "mutants.json"  # prepare takes minutes (a libcst splice per mutant): reused while current
    population = json.loads(cached.read_text()) if cached.exists() else None
    if population is None or population["file"] != target.file \
            or population["sha256"] != digest(source / target.file) or population["mutmut_version"] != MUTMUT_VERSION:
        population = prepare(target, source, work)
    import libcst as cst
    functions = [node for node in cst.parse_module((source / target.file).read_text()).body
                 if isinstance(node, cst.FunctionDef)]
    njit = {node.name.value for node in functions if node.decorators}
    plain = [node.name.value for node in functions if not node.decorators]
    by_name = {m["name"]: m for m in population["mutants"]
               if a.all_functions or function_of(m["name"]) in njit}
    n = min(a.n, len(by_name))
    chosen = draw_sample(list(by_name), a.seed, n)
    if a.only:
        missing = [x for x in a.only if x not in chosen]
        if missing:
            raise MutationError(f"--only names a mutant not in the sample: {missing[0]}")
    done: dict[str, Result] = {}
    if a.resume and a.out.exists():
        done = {r["name"]: Result(**r) for r in json.loads(a.out.read_text())["results"]
                if not (a.retry_timeouts and r["verdict"] == "timeout")}
    header = {
        "issue": 45 if target.name == "kernels" else 46, "file": target.file, "sha256": population["sha256"],
        "mutmut_version": MUTMUT_VERSION,
        "population": len(by_name), "mutants_of_the_file": len(population["mutants"]),
        "population_is": "every mutant of the file" if a.all_functions else
        f"the mutants of the @njit kernels; not of the file's plain functions ({', '.join(plain)}: warm_up only "
        f"calls each kernel once to compile it{PLAIN_FUNCTIONS.get(target.name, '')})",
        "seed": a.seed, "n": n,
        "command": f"python -m vtoken.fuzz.mutation_kernels run --file {a.file} --seed {a.seed} --n {a.n} "
                   f"--work {a.work} --out {_shown(a.out)} --pytest-timeout {a.pytest_timeout:g} "
                   f"--fuzz-seconds {a.fuzz_seconds:g}" + (" --resume" if a.resume else "")
                   + (" --retry-timeouts" if a.retry_timeouts else "")
                   + (" --jit-check" if a.jit_check else "") + (" --all-functions" if a.all_functions else ""),
        "env": "NUMBA_DISABLE_JIT=1 for pytest and the fuzzer (the kernels as plain Python); the JIT on for "
               "pytest-jit (--jit-check) and numba-compile (compile-check)",
        "killers": {"pytest": f"pytest {' '.join(PYTEST_ARGS)} {' '.join(target.killers)}, timeout "
                              f"{a.pytest_timeout:g} s",
                    "fuzz": f"vtoken fuzz --target fast --time {a.fuzz_seconds:g} --workers 1 --seed 0 "
                            f"(pytest's survivors only)",
                    **({"pytest-jit": "the same pytest, the JIT on, nothing deselected (survivors of both)"}
                       if a.jit_check else {})},
        "hypothesis": "the scratch conftest loads the ci profile less the shrink phase (NO_SHRINK)",
        "deselected": {d: why for d, why in DESELECTED.items() if d.partition("::")[0] in target.killers},
        "machine": f"{os.cpu_count()} cores, shared",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "_t0": t0,
    }
    header["baseline"] = check_baseline(target, source, work, a.pytest_timeout)
    print(f"baseline: {header['baseline']}", file=sys.stderr, flush=True)
    todo = [x for x in (a.only or chosen) if x not in done]
    for i, name in enumerate(todo, 1):
        r = done[name] = run_one(target, source, by_name[name], work, njit, a.pytest_timeout, a.fuzz_seconds,
                                 a.jit_check, a.keep)
        took = sum(v["wall_s"] for v in r.runs.values())
        print(f"[{i}/{len(todo)}] {r.verdict:8} {r.killer:10} {took:6.1f} s  {name}  {r.detail[:100]}",
              file=sys.stderr, flush=True)
        write_report(a.out, header, [done[x] for x in chosen if x in done])
    return write_report(a.out, header, [done[x] for x in chosen if x in done])


def _shown(path: Path) -> str:
    """``path`` as the command to repeat it would name it: relative to the repository when inside it."""
    path = Path(path)
    return str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else str(path)


# ---- command line -------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vtoken.fuzz.mutation_kernels", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("prepare", help="every mutant of the file as a diff, into WORK/mutants.json (nothing run)")
    pr.add_argument("--work", required=True, type=Path)
    pr.add_argument("--source", type=Path, default=REPO)
    ru = sub.add_parser("run", help="a seeded sample of the mutants against the killers, one scratch tree each")
    ru.add_argument("--seed", type=int, required=True)
    ru.add_argument("--n", type=int, required=True, help="mutants drawn (all of them if fewer)")
    ru.add_argument("--work", required=True, type=Path)
    ru.add_argument("--out", type=Path, default=None, help="the report (default: fuzz/mutation_<file>.json)")
    ru.add_argument("--source", type=Path, default=REPO, help="the tree to mutate (default: this checkout)")
    ru.add_argument("--pytest-timeout", type=float, default=300.0, help="seconds per mutant's pytest run")
    ru.add_argument("--fuzz-seconds", type=float, default=60.0, help="vtoken fuzz --time for pytest's survivors")
    ru.add_argument("--jit-check", action="store_true", help="pytest with the JIT on for the survivors of both")
    ru.add_argument("--resume", action="store_true", help="keep the results already in --out")
    ru.add_argument("--retry-timeouts", action="store_true",
                    help="with --resume, run the mutants that timed out again (a loaded machine, a longer timeout)")
    ru.add_argument("--only", nargs="+", default=[], metavar="NAME", help="just these mutants of the sample")
    ru.add_argument("--all-functions", action="store_true",
                    help="draw from every mutant of the file, the plain functions' too (default: the kernels')")
    ru.add_argument("--keep", action="store_true", help="keep the scratch trees of killed mutants too")
    cc = sub.add_parser("compile-check", help="compile the survivors in --out with the JIT on (numba-compile)")
    cc.add_argument("--work", required=True, type=Path)
    cc.add_argument("--out", type=Path, default=None, help="the report (default: fuzz/mutation_<file>.json)")
    cc.add_argument("--source", type=Path, default=REPO)
    cc.add_argument("--only", nargs="+", default=[], metavar="NAME",
                    help="these mutants of --out, whatever their verdict")
    ju = sub.add_parser("judge", help="apply SURVIVORS' verdicts to --out's results again (nothing run)")
    ju.add_argument("--out", type=Path, default=None, help="the report (default: fuzz/mutation_<file>.json)")
    ju.add_argument("--note", default="", help="the report's notes: how it was run, if not by its one command")
    for sp in (pr, ru, cc, ju):
        sp.add_argument("--file", choices=list(TARGETS), default="kernels",
                        help="which kernel file (integration/fastpath/FILE.py; default: kernels)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.cmd != "prepare" and a.out is None:
        a.out = TARGETS[a.file].report
    try:
        if a.cmd == "prepare":
            data = prepare(TARGETS[a.file], a.source.resolve(), a.work.resolve())
            for m in data["mutants"]:
                print(m["name"])
            print(f"{len(data['mutants'])} mutants of {data['file']}", file=sys.stderr)
            return 0
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the runs' process groups are killed
        report = {"run": run, "compile-check": compile_check, "judge": judge_report}[a.cmd](a)
        s = report["summary"]
        print(f"killed by pytest {s['killed_by_pytest']} / by fuzz {s['killed_by_fuzz']} / by pytest-jit "
              f"{s['killed_by_pytest_jit']} / by numba-compile {s['killed_by_numba_compile']} / timeout "
              f"{s['timeout']} / error {s['error']} / survived {s['survived']} "
              f"of {s['mutants']}; {report['wall_s']:.0f} s")
        return 0
    except (MutationError, OSError, ValueError) as e:
        print(f"vtoken.fuzz.mutation_kernels {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
