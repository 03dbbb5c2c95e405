"""The JSON every question writes, and its documented fields.

``<question>.json`` (one per question, in ``--out``):

    question    "q1" ... the question's key
    title       one line
    command     the command line that produced it
    settings    every parameter of the run (``BenchSettings``)
    paper       the paper's numbers this question is compared with
    notes       what differs from the paper's setup, and why
    machine     cpus, platform, python
    duration_s  wall time of this question
    runs        raw measurements, one object per run (identifying fields + measurements, ``RUN_FIELDS``
                for simulator runs; Q3 and Q7 add their own, listed in their module docstrings)
    summary     medians and spreads (min-max) over repeats, as tabulated
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path

REPORT_FIELDS = ("question", "title", "command", "settings", "paper", "notes", "machine", "duration_s", "runs",
                 "summary")

RUN_FIELDS = ("steps", "completed", "finished", "preemptions", "peak_running", "waste_ratio_F", "utilisation",
              "blocks_le_50pct", "dead_blocks_share", "retained_blocks_per_request", "ideal_blocks_per_request",
              "retained_slots_per_request", "allocated_blocks", "peak_allocated_blocks", "ideal_blocks_at_peak",
              "plans_committed", "plans_aborted", "moves_committed", "blocks_released", "invariant_checks", "wall_s")


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
