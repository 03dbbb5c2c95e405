"""Run the selected questions and write each one's JSON and PNG into the output folder."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TextIO

from vtoken.core.errors import ConfigError

from .context import BenchContext
from .plots import pyplot
from .report import machine, write_report
from .settings import BenchSettings


def command_line(target: str, a: argparse.Namespace, options: tuple[str, ...]) -> str:
    """The canonical ``vtoken bench <target>`` command that reproduces this run (recorded in every JSON):
    ``--quick``, ``--out``, ``--questions``, then each of ``options`` that is set (a seed of 0 is the default)."""
    parts = ["vtoken", "bench", target] + (["--quick"] if a.quick else []) + ["--out", a.out]
    if a.questions:
        parts += ["--questions", *a.questions]
    for name in options:
        value = getattr(a, name)
        if value is None or value is False or (name == "seed" and value == 0):
            continue
        flag = "--" + name.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return " ".join(shlex.quote(x) for x in parts)


def add_run_options(p: argparse.ArgumentParser, out: str, registry: dict | None = None) -> None:
    """The options every ``vtoken bench`` target shares: --quick, --out, --questions (when it has a
    registry to choose from), --repeats and --seed."""
    from .settings import MIN_REPEATS
    p.add_argument("--quick", action="store_true", help="smaller scale, same questions (minutes on 2 cores)")
    p.add_argument("--out", default=out, help="output folder for <question>.json and .png")
    if registry is not None:
        p.add_argument("--questions", nargs="+", metavar="Q", help=f"subset of {list(registry)} (default: all)")
    else:
        p.set_defaults(questions=None)
    p.add_argument("--repeats", type=int, help=f"seeds per point (default and minimum {MIN_REPEATS})")
    p.add_argument("--seed", type=int, default=0, help="first seed; repeat i uses seed + i")


def run_half(target: str, a: argparse.Namespace, prepare, options: tuple[str, ...], install: str) -> int:
    """``vtoken bench <target>``: ``prepare()`` returns (settings, questions) or raises; a ``ConfigError`` or a
    missing dependency (``ImportError``: ``install`` names the extras) is printed and returns 2 before any
    work or output folder. Then every question runs into ``a.out``."""
    try:
        settings, questions = prepare()
        out_dir = prepare_out_dir(a.out)
    except ImportError:
        print(f"vtoken bench {target}: needs {install}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"vtoken bench {target}: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    run_questions(questions, settings, out_dir, command_line(target, a, options))
    print(f"\nvtoken bench {target}: {len(questions)} question(s) in {time.monotonic() - started:.0f} s; "
          f"JSON and PNG in {out_dir}/", file=sys.stderr)
    return 0


def prepare_out_dir(out: str | Path) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_questions(questions: list[ModuleType], settings: BenchSettings, out_dir: Path, command: str,
                  stream: TextIO | None = None, tables: TextIO | None = None) -> dict[str, dict]:
    """Run each question in order; returns key -> report. Tables (markdown) go to ``tables`` (default stdout)."""
    pyplot()  # fail before any work if matplotlib is missing
    ctx = BenchContext(settings, out_dir, command, stream or sys.stderr)
    tables = tables or sys.stdout
    reports = {}
    for q in questions:
        started = time.monotonic()
        report = q.run(ctx)
        report.update(command=command, settings=settings.describe(), machine=machine(),
                      duration_s=round(time.monotonic() - started, 2))
        write_report(out_dir / f"{q.KEY}.json", report)
        q.plot(report, out_dir / f"{q.KEY}.png")
        tables.write(f"\n## {q.KEY.upper()}: {q.TITLE} ({report['duration_s']:.0f} s)\n\n")
        tables.write("\n".join(q.table(report)) + "\n")
        tables.flush()
        reports[q.KEY] = report
    return reports
