"""The campaign runner behind ``vtoken fuzz``: parallel seeded batches, progress, reports, replays.

A campaign is a sequence of *batches*. Batch i runs the state machine for up
to ``examples`` Hypothesis examples of up to ``steps`` rules each, seeded with
``batch_seed(seed, i)``, so a batch replays exactly from its seed alone
(``vtoken fuzz --replay SEED``), whichever worker ran it. Workers take batches
i = w, w + W, ... until the time budget or ``--runs`` is spent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import queue
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.internal.conjecture import providers
from hypothesis.reporting import with_reporter
from hypothesis.stateful import get_state_machine_test

from .machine import EVENTS, VTokenMachine
from .profiles import profiles_for

REPORT_VERSION = 1


@dataclass(frozen=True)
class CampaignConfig:
    time_budget: float = 60.0
    runs: int | None = None  # stop after this many examples instead of at the time budget
    seed: int = 0
    workers: int = 1
    steps: int = 100
    examples: int = 25  # examples per batch
    planners: tuple[str, ...] = ()  # compact / densify / off; empty: all
    policies: tuple[str, ...] = ()  # h2o / streaming_llm / scissorhands / random / none; empty: all
    out_dir: str = "fuzz-out"
    keep_going: bool = False
    use_database: bool = True
    shrink: bool = True  # shrink a failure to a minimal program (tests turn it off for speed)
    bug: str | None = None  # a planted bug (self-test only)
    target: str = "core"  # "core": in-memory copies; "tensors": the torch device layer on real K/V

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {sorted(TARGETS)}, got {self.target!r}")


@dataclass
class Failure:
    batch_seed: int
    error: str
    program: list[str]
    traceback: str
    pytest_file: str = ""
    replay: str = ""


@dataclass
class BatchResult:
    index: int
    events: dict
    failure: Failure | None = None


def batch_seed(seed: int, index: int) -> int:
    return int(hashlib.sha256(f"vtoken-fuzz:{seed}:{index}".encode()).hexdigest()[:12], 16)


TARGETS = {"core": "VTokenMachine", "tensors": "TensorMachine", "fast": "FastMachine"}


def machine_class(cfg: CampaignConfig) -> type:
    """VTokenMachine restricted to the configured planners and policies (same name, so programs replay)."""
    attrs = {}
    if cfg.target == "fast":  # its own engine and domain: --planner and --policy do not apply (cli refuses them)
        from .fast_target import FastMachine
        return type("VTokenMachine", (FastMachine,), {})
    if cfg.target == "tensors":
        from .machine import TensorMachine
        return type("VTokenMachine", (TensorMachine,), {**attrs, **_restrict(cfg)})
    attrs.update(_restrict(cfg))
    if not attrs:
        return VTokenMachine
    return type("VTokenMachine", (VTokenMachine,), attrs)


def _restrict(cfg: CampaignConfig) -> dict:
    attrs = {}
    if cfg.planners:
        attrs["profiles"] = profiles_for(list(cfg.planners))
    if cfg.policies:
        attrs["policies"] = tuple(cfg.policies)
    return attrs


_PROGRAM_LINE = re.compile(r"^(\w+ = )?state(\.\w+\(.*\)| = VTokenMachine\(\))$")


@contextlib.contextmanager
def seed_only_generation():
    """While a batch runs, what Hypothesis generates is a function of the batch's seed alone.

    NOTE: Hypothesis (>= 6.131; pinned 6.155.2) also draws integers, floats and strings from the literals of every
    *local* module the process has imported so far (``providers._get_local_constants``). A batch's examples then
    depend on what ran before it in the process: a pytest session that collected the whole suite draws other
    programs from the same seed than ``vtoken fuzz --replay`` in a fresh process, so a failure found by a long
    campaign might not replay, and a planted bug caught in 3 batches in one process went 17 uncaught in CI's. The
    pool is pinned empty here (Hypothesis's own built-in constants stay): it was the better of the two
    deterministic choices measured (docs/fuzzing.md, "Determinism")."""
    if not callable(getattr(providers, "_get_local_constants", None)) or not hasattr(providers, "CONSTANTS_CACHE"):
        raise RuntimeError("vtoken fuzz: this Hypothesis has no local-constants pool to pin (written for "
                           "hypothesis==6.155.2, the version pyproject.toml pins)")
    original, local = providers._get_local_constants, providers._local_constants
    empty = local.__class__(**{kind: values.__class__(key=values.key) if getattr(values, "key", None)
                                else values.__class__() for kind, values in vars(local).items()})
    providers.CONSTANTS_CACHE.cache.clear()  # permitted values cached from the process's pool
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()


def run_batch(cfg: CampaignConfig, index: int, seed_override: int | None = None) -> BatchResult:
    """One seeded Hypothesis run of the state machine. Never raises for a found bug: returns it."""
    s = batch_seed(cfg.seed, index) if seed_override is None else seed_override
    db = DirectoryBasedExampleDatabase(str(Path(cfg.out_dir) / "hypothesis-db")) if cfg.use_database else None
    test = get_state_machine_test(
        machine_class(cfg),
        settings=settings(
            # parent: Hypothesis's defaults, not whatever profile is loaded, so a batch is a function of its seed
            # alone (the tests' "ci" profile derandomizes: every batch would replay the same examples)
            parent=settings.get_profile("default"),
            max_examples=cfg.examples, stateful_step_count=cfg.steps, deadline=None, database=db,
            suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
            phases=[Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if cfg.shrink else []),
        ),
    )
    test = hypothesis_seed(s)(test)
    EVENTS.clear()
    lines: list[str] = []
    failure = None
    with with_reporter(lambda text: lines.extend(str(text).splitlines())), seed_only_generation():
        try:
            test()
        except Exception as e:  # a falsified invariant or a crash: both are findings
            reported = lines + [str(n) for n in getattr(e, "__notes__", [])]  # Hypothesis >= 6.100 uses notes
            program = [ln.strip() for ln in reported if _PROGRAM_LINE.match(ln.strip())]
            failure = Failure(s, f"{type(e).__name__}: {e}".splitlines()[0][:500], program,
                              "".join(traceback.format_exception(e))[-4000:])
    return BatchResult(index, dict(EVENTS), failure)


# ---- failure artefacts ------------------------------------------------------------------------------
def replay_command(cfg: CampaignConfig, s: int) -> str:
    parts = ["vtoken", "fuzz", "--replay", str(s), "--steps", str(cfg.steps), "--examples", str(cfg.examples)]
    if cfg.planners:
        parts += ["--planner", *cfg.planners]
    if cfg.policies:
        parts += ["--policy", *cfg.policies]
    if cfg.bug:
        parts += ["--bug", cfg.bug]
    if cfg.target != "core":
        parts += ["--target", cfg.target]
    return " ".join(parts)


def pytest_file(f: Failure, cfg: CampaignConfig) -> str:
    """A ready-to-run pytest file: the shrunk program, with the invariant checks Hypothesis ran."""
    indent = "        " if cfg.bug else "    "
    body = "\n".join(indent + ln for ln in f.program)
    header = (
        f'"""Found by vtoken fuzz (batch seed {f.batch_seed}): {f.error}\n\n'
        f"Replay the whole batch: {f.replay}\n"
        f"Run this file: pytest {Path(cfg.out_dir) / 'failures' / f'test_failure_{f.batch_seed}.py'}\n\"\"\"\n\n"
        + machine_import(cfg.target)
    )
    if cfg.bug:
        return (header + "from vtoken.fuzz.planted import planted\n\n\n"
                f"def test_replay():\n    # found with the planted bug {cfg.bug!r}; without it this program passes\n"
                f"    with planted({cfg.bug!r}):\n{body}\n")
    return header + "\n\ndef test_replay():\n" + body + "\n"


def machine_import(target: str) -> str:
    """The import line that names a target's machine ``VTokenMachine``, as its printed programs call it."""
    if target == "fast":
        return "from vtoken.fuzz.fast_target import FastMachine as VTokenMachine\n"
    if target == "tensors":
        return "from vtoken.fuzz.machine import TensorMachine as VTokenMachine\n"
    return "from vtoken.fuzz.machine import VTokenMachine\n"


def save_failure(f: Failure, cfg: CampaignConfig) -> None:
    out = Path(cfg.out_dir) / "failures"
    out.mkdir(parents=True, exist_ok=True)
    f.replay = replay_command(cfg, f.batch_seed)
    path = out / f"test_failure_{f.batch_seed}.py"
    path.write_text(pytest_file(f, cfg))
    (out / f"failure_{f.batch_seed}.txt").write_text(f"{f.error}\n\nreplay: {f.replay}\n\n{f.traceback}")
    f.pytest_file = str(path)


# ---- the campaign -----------------------------------------------------------------------------------------
def _worker(cfg: CampaignConfig, w: int, deadline: float, total_batches: int | None, results, stop) -> None:
    if cfg.bug:
        from .planted import planted

        ctx = planted(cfg.bug)
        ctx.__enter__()
    index = w
    while not stop.is_set() and time.time() < deadline and (total_batches is None or index < total_batches):
        res = run_batch(cfg, index)
        results.put(res)
        if res.failure and not cfg.keep_going:
            stop.set()
        index += cfg.workers
    results.put(None)


@dataclass
class CampaignReport:
    version: int
    config: dict
    batches: int = 0
    runs: int = 0
    steps: int = 0
    invariant_checks: int = 0
    events: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    timing: dict = field(default_factory=dict)  # the only fields that differ between identical runs


def run_campaign(cfg: CampaignConfig, progress=sys.stderr) -> CampaignReport:
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    total_batches = None if cfg.runs is None else -(-cfg.runs // cfg.examples)
    deadline = time.time() + (cfg.time_budget if cfg.runs is None else 10**9)
    ctx = mp.get_context("fork") if sys.platform.startswith("linux") else mp.get_context()
    results, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_worker, args=(cfg, w, deadline, total_batches, results, stop), daemon=True)
             for w in range(cfg.workers)]
    start = time.time()
    for p in procs:
        p.start()
    by_index: dict[int, BatchResult] = {}
    done, last = 0, 0.0
    while done < len(procs):
        try:
            res = results.get(timeout=0.5)
        except queue.Empty:
            res = False
        if res is None:
            done += 1
        elif res:
            by_index[res.index] = res
            if res.failure:
                save_failure(res.failure, cfg)
                if not cfg.keep_going:
                    stop.set()
        now = time.time()
        if progress and done < len(procs) and now - last >= (1.0 if progress.isatty() else 10.0):
            _progress(progress, now - start, by_index.values())
            last = now
    for p in procs:
        p.join(timeout=5)
    elapsed = time.time() - start
    ordered = [by_index[i] for i in sorted(by_index)]
    events: Counter = Counter()
    for r in ordered:
        events.update(r.events)
    report = CampaignReport(
        version=REPORT_VERSION,
        config={k: v for k, v in asdict(cfg).items() if k not in ("time_budget", "out_dir", "workers")},
        batches=len(ordered), runs=events["runs"], steps=events["machine_steps"],
        invariant_checks=events["invariant_checks"], events=dict(sorted(events.items())),
        failures=[asdict(r.failure) for r in ordered if r.failure],
        timing={"elapsed_s": round(elapsed, 2), "steps_per_s": round(events["machine_steps"] / max(elapsed, 1e-9), 1),
                "workers": cfg.workers, "time_budget_s": cfg.time_budget},
    )
    if progress:
        _progress(progress, elapsed, ordered, final=True)
    (Path(cfg.out_dir) / "report.json").write_text(json.dumps(asdict(report), indent=2, sort_keys=True) + "\n")
    return report


def _progress(out, elapsed: float, results, final: bool = False) -> None:
    ev: Counter = Counter()
    fails = 0
    for r in results:
        ev.update(r.events)
        fails += r.failure is not None
    line = (
        f"[{elapsed:6.1f}s] runs {ev['runs']:,}  steps {ev['machine_steps']:,} "
        f"({ev['machine_steps'] / max(elapsed, 1e-9):,.0f}/s)  failures {fails}  "
        f"plans {ev['plans_committed']:,} committed / {ev['plans_aborted']:,} aborted  "
        f"copies {ev['steps_with_copies_in_flight']:,} delayed / {ev['copies_failed']:,} failed  "
        f"preempted mid-copy {ev['preempted_mid_copy']:,}"
    )
    end = "\n" if final or not out.isatty() else ""
    out.write(("\r" if out.isatty() else "") + line + end)
    out.flush()


def replay(cfg: CampaignConfig, s: int) -> BatchResult:
    """Run the one batch with seed ``s`` without the example database: the same failure, shrunk the same."""
    if cfg.bug:
        from .planted import planted

        with planted(cfg.bug):
            return run_batch(CampaignConfig(**{**asdict(cfg), "use_database": False}), 0, seed_override=s)
    return run_batch(CampaignConfig(**{**asdict(cfg), "use_database": False}), 0, seed_override=s)

