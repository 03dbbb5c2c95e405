"""The one runner: any question, on any target, writes ``<question>.json`` and ``<question>.png`` the same way.

``run(ctx)`` returns the report's question, title, paper, runs, summary and notes; the runner adds the rest.
``<question>.json``: question (key), title, command (that reproduces it), settings (``settings.py``), paper (the
numbers compared with), notes (what differs from the paper, and why), machine, duration_s, runs (one object per
measurement: ``measure.RUN_FIELDS`` on the simulator, the question's docstring otherwise), summary (medians and
min-max spreads over repeats, as tabulated).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, TextIO

from .measure import RunCache
from .render import pyplot

REPORT_FIELDS = ("question", "title", "command", "settings", "paper", "notes", "machine", "duration_s", "runs",
                 "summary")


class Question(Protocol):
    KEY: str
    TITLE: str
    PAPER: dict
    run: Callable[[BenchContext], dict]
    table: Callable[[dict], list[str]]
    plot: Callable[[dict, Path], None]


class Progress:
    """A dependency-free progress bar on stderr: one line, redrawn in place on a terminal, a line per 10 %
    otherwise (so logs stay short)."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 28) -> None:
        assert total >= 0, f"progress total must be >= 0, got {total}"
        self.label, self.total, self.width = label, total, width
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def advance(self, note: str = "", n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        frac = self.done / self.total if self.total else 1.0
        if self._tty:
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} "
                              f"{time.monotonic() - self.started:6.1f}s {note[:40]:<40}")
            self.stream.flush()
        elif int(frac * 10) > self._last_decile:
            self._last_decile = int(frac * 10)
            self.stream.write(f"{self.label} {self.done}/{self.total} ({frac:.0%}) "
                              f"{time.monotonic() - self.started:.1f}s {note}\n")
            self.stream.flush()

    def close(self) -> float:
        """Finish the line; returns the elapsed seconds."""
        elapsed = time.monotonic() - self.started
        if self._tty:
            self.stream.write("\n")
        self.stream.write(f"{self.label} done in {elapsed:.1f}s\n")
        self.stream.flush()
        return elapsed


@dataclass
class BenchContext:
    """What a question gets to run with: the settings, the shared run cache, progress bars, the output folder."""

    settings: object
    out_dir: Path
    command: str = "vtoken bench sim"
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    cache: RunCache = field(default_factory=RunCache)

    def progress(self, label: str, total: int) -> Progress:
        return Progress(label, total, self.stream)

    def sweep(self, label: str, points: list[tuple], measure: Callable, note: Callable | None = None) -> list:
        """``measure(*point)`` for every point, in order, under one progress bar (``note(*point)`` per step)."""
        bar = self.progress(label, len(points))
        out = []
        for p in points:
            out.append(measure(*p))
            bar.advance(note(*p) if note else " ".join(map(str, p)))
        bar.close()
        return out


def machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0]}


def _clean(x: object) -> object:
    """JSON has no inf/nan: write them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_report(path: Path, report: dict) -> None:
    missing = [f for f in REPORT_FIELDS if f not in report]
    assert not missing, f"report for {report.get('question')!r} lacks fields {missing}"
    path.write_text(json.dumps(_clean(report), indent=1, sort_keys=False) + "\n")


def run_questions(questions: list[Question], settings, out_dir: Path, command: str,
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
