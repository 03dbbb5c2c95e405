"""A time-bounded CrossHair check of the core's PEP 316 contracts, and its proof obligation.

The contracts are ``pre:`` / ``post:`` / ``raises:`` lines in the docstrings of
core's public functions and methods (core stays standard-library only).
``run_crosshair`` runs

    python -m vtoken.spec.crosshair_check --crosshair check --analysis_kind=PEP316 \\
        --report_all --per_condition_timeout T --per_path_timeout P <targets>

in a subprocess; ``--crosshair`` makes this module behave as the ``crosshair``
command after two set-up steps that a bare ``python -m crosshair`` lacks:

* it registers ``spec/crosshair_states.py``'s creators, so a method's ``self``
  (and a planner's snapshot) is a *reachable* state rather than a fresh object;
* it binds ``contracts`` (core/reference/contracts.py) in each default target:
  the runtime's docstring contracts call its predicates, and the runtime never
  imports an oracle (core/reference/__init__.py), while CrossHair evaluates a
  condition in its function's module globals;
* it works around CrossHair 0.0.113 failing on setuptools' editable install of
  this project: ``vtoken`` is then a namespace package whose path is a finder
  hook, and CrossHair's option lookup (``codeconfig.collect_options``) calls
  ``importlib.resources.files`` on it, which raises ``NotADirectoryError``. The
  patch makes that call answer "no ``__init__.py``", as it would for a
  namespace package on disk.

CrossHair is a symbolic-execution bug finder, not a prover: "nothing found"
means no counterexample within the time bound, on the states it explored.
Run it directly with ``python -m vtoken.spec.crosshair_check``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .obligations import BOUNDED, COUNTEREXAMPLE, UNKNOWN, Obligation, Outcome

# Every module here holds contracts; CrossHair checks each contracted function and method in it:
#   block_pool   blocks_needed, BlockPool.can_allocate / allocate / share / free
#   token_table  TokenTable.sync_new_tokens / evict_token / evict_tokens / apply_moves
#   reference.compact  eligible_sources, choose_sources, plan_compaction (the reference compact planner)
#   densify      plan_densify
#   relocate     plan_relocation
#   plan         Plan.final_layout
DEFAULT_TARGETS: tuple[str, ...] = (
    "vtoken.core.block_pool",
    "vtoken.core.token_table",
    "vtoken.core.reference.compact",
    "vtoken.core.densify",
    "vtoken.core.relocate",
    "vtoken.core.plan",
)
# CPU seconds (CrossHair's timeouts count process CPU time). 25 postconditions x 1.5 s is ~38 s of
# CPU, 45-60 s of wall clock on a loaded 2-core machine; TOTAL_TIMEOUT (wall clock) kills the run
# beyond that, and the obligation then reports "unknown".
PER_CONDITION_TIMEOUT = 1.5
PER_PATH_TIMEOUT = 0.75
TOTAL_TIMEOUT = 100.0

NOT_FOUND = "no counterexample found within the time bound"

_LINE = re.compile(r"^(?P<path>.+?):(?P<line>\d+): (?P<kind>error|info|warning): (?P<msg>.*)$")


@dataclass(frozen=True)
class ConditionResult:
    """One line of CrossHair's output: a condition at ``path:line`` and what happened to it."""

    path: str
    line: int
    kind: str  # "error" (a counterexample or an unexpected exception) or "info" (report_all status)
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.message}"


@dataclass
class CrosshairReport:
    targets: list[str]
    command: list[str]
    per_condition_timeout: float
    per_path_timeout: float
    total_timeout: float
    returncode: int | None = None  # None: killed at total_timeout
    seconds: float = 0.0
    counterexamples: list[ConditionResult] = field(default_factory=list)  # the "error" lines
    checked: list[ConditionResult] = field(default_factory=list)  # every "info" line (report_all)
    stdout: str = ""
    stderr: str = ""

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    @property
    def crashed(self) -> bool:
        """The tool failed: killed, exit 2, or exit 1 (an uncaught traceback) with no counterexample line."""
        if self.timed_out:
            return True
        if self.returncode == 0:
            return False
        return not (self.returncode == 1 and self.counterexamples)

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and not self.counterexamples

    @property
    def confirmed(self) -> list[ConditionResult]:
        """Conditions CrossHair explored exhaustively (within the creators' bounds; not a proof)."""
        return [c for c in self.checked if c.message.startswith("Confirmed")]

    def summary(self) -> str:
        if self.timed_out:
            head = f"crosshair killed after {self.total_timeout:.0f} s"
        elif self.crashed:
            head = f"crosshair failed (exit {self.returncode})"
        elif self.counterexamples:
            head = f"{len(self.counterexamples)} counterexample(s)"
        else:
            head = NOT_FOUND
        n = len(self.checked) + len(self.counterexamples)
        return (f"{head}: {n} condition(s) in {len(self.targets)} target(s), {len(self.confirmed)} confirmed over all "
                f"explored paths, per-condition {self.per_condition_timeout} s CPU, {self.seconds:.1f} s wall")


def crosshair_command(targets: list[str], per_condition_timeout: float, per_path_timeout: float) -> list[str]:
    return [
        sys.executable, "-m", "vtoken.spec.crosshair_check", "--crosshair", "check",
        "--analysis_kind=PEP316", "--report_all",
        "--per_condition_timeout", str(per_condition_timeout),
        "--per_path_timeout", str(per_path_timeout),
        *targets,
    ]


def run_crosshair(
    targets: list[str] | None = None,
    per_condition_timeout: float = PER_CONDITION_TIMEOUT,
    per_path_timeout: float = PER_PATH_TIMEOUT,
    total_timeout: float = TOTAL_TIMEOUT,
    extra_paths: list[str] | None = None,
) -> CrosshairReport:
    """Run ``crosshair check`` on ``targets`` (modules, classes or functions; default: the core's contracts).

    ``extra_paths`` are prepended to the subprocess's PYTHONPATH (for targets outside the project).
    """
    targets = list(DEFAULT_TARGETS if targets is None else targets)
    cmd = crosshair_command(targets, per_condition_timeout, per_path_timeout)
    env = dict(os.environ)
    if extra_paths:
        env["PYTHONPATH"] = os.pathsep.join([*extra_paths, *filter(None, [env.get("PYTHONPATH")])])
    report = CrosshairReport(targets, cmd, per_condition_timeout, per_path_timeout, total_timeout)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=total_timeout, env=env, check=False)
    except subprocess.TimeoutExpired as e:
        report.seconds = time.perf_counter() - t0
        report.stdout = _text(e.stdout)
        report.stderr = _text(e.stderr)
        _parse(report)
        return report
    report.seconds = time.perf_counter() - t0
    report.returncode = proc.returncode
    report.stdout, report.stderr = proc.stdout, proc.stderr
    _parse(report)
    return report


def _text(b: bytes | str | None) -> str:
    if b is None:
        return ""
    return b if isinstance(b, str) else b.decode(errors="replace")


def _parse(report: CrosshairReport) -> None:
    for raw in report.stdout.splitlines():
        m = _LINE.match(raw.strip())
        if not m:
            continue
        c = ConditionResult(m["path"], int(m["line"]), m["kind"], m["msg"])
        (report.counterexamples if c.kind == "error" else report.checked).append(c)


# ---- the proof obligation --------------------------------------------------------------------------
def _check() -> Outcome:
    try:
        rep = run_crosshair()
    except OSError as e:  # the interpreter could not be started
        return Outcome(UNKNOWN, f"crosshair did not start: {e}")
    if rep.crashed:
        tail = (rep.stderr or rep.stdout).strip().splitlines()[-5:]
        return Outcome(UNKNOWN, rep.summary() + ("\n" + "\n".join(tail) if tail else ""))
    if rep.counterexamples:
        return Outcome(COUNTEREXAMPLE, "\n".join(str(c) for c in rep.counterexamples))
    # CrossHair explores paths until its per-condition budget runs out: a clean run is a bounded search, not a proof
    return Outcome(BOUNDED, f"{NOT_FOUND} ({rep.summary().split(': ', 1)[1]})",
                   bound=f"{PER_CONDITION_TIMEOUT:g} s CPU per condition")


def obligations() -> list[Obligation]:
    return [
        Obligation(
            id="contracts/core",
            invariant="contracts",
            transition="core public API",
            claim="CrossHair finds no counterexample to the PEP 316 contracts of blocks_needed, BlockPool, "
                  "TokenTable's mutations, the compact and densify planners and Plan.final_layout, on reachable "
                  "states within its time bound",
            check=_check,
        )
    ]


# ---- the ``crosshair`` entry point with this project's set-up ------------------------------------
def _patch_namespace_resources() -> None:
    """See the module docstring: ``importlib.resources.files(vtoken)`` on an editable install."""
    import importlib.resources

    files = importlib.resources.files

    class NoInit:  # the one use CrossHair makes of the answer: .joinpath("__init__.py").read_text()
        def joinpath(self, *parts):
            return self

        def read_text(self, *a, **kw):
            raise FileNotFoundError("namespace package: no __init__.py")

    def files_or_nothing(anchor=None):
        try:
            return files(anchor)
        except NotADirectoryError:  # a namespace package whose path is an import hook, not a folder
            return NoInit()

    importlib.resources.files = files_or_nothing


def _bind_contracts() -> None:
    """See the module docstring: ``contracts`` in the modules whose docstring contracts name it."""
    import importlib

    from vtoken.core.reference import contracts

    for name in DEFAULT_TARGETS:
        vars(importlib.import_module(name)).setdefault("contracts", contracts)


def _crosshair_main(argv: list[str]) -> None:
    _patch_namespace_resources()
    import crosshair.main  # imports (and resets) CrossHair's type registrations: register after it
    from vtoken.spec import crosshair_states

    crosshair_states.register()
    _bind_contracts()
    sys.argv = ["crosshair", *argv]
    crosshair.main.main()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--crosshair"]:
        _crosshair_main(argv[1:])
        return 0
    rep = run_crosshair(argv or None)
    for c in rep.counterexamples:
        print(c)
    print(" ".join(rep.command[3:]) if len(rep.command) > 3 else "")
    print(rep.summary())
    if rep.crashed:
        print(rep.stderr[-2000:], file=sys.stderr)
    return 0 if rep.clean else 1


if __name__ == "__main__":
    sys.exit(main())
