"""``vtoken bench render``: the tables a markdown page shows from committed JSON reports, rendered again by each
question's own ``table`` function, so the page cannot drift from its reports.

A rendered table sits between two marker lines; the first names the JSON, relative to the repository root:

    <!-- table: docs/results/quick/sim/q1.json -->
    (the lines the question's table(report) returns)
    <!-- end table -->

``vtoken bench render --docs docs/results.md`` (run from the repository root; ``make results-doc``) rewrites every
marked block from its JSON; ``--check`` writes nothing and exits 1 naming each block that differs, as
``tests/test_results_doc.py`` does. Text outside the markers is not touched.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import fields
from pathlib import Path

from vtoken.core.errors import ConfigError

START = "<!-- table: "
BLOCK = re.compile(r"^<!-- table: (?P<path>\S+) -->\n(?P<body>.*?)^<!-- end table -->$", re.M | re.S)


def question_for(report: dict):
    """The module whose ``table`` renders ``report``: its question key in the half whose settings it recorded (the
    simulator's and the vLLM half both have a q7): the half whose settings fields it shares most."""
    from . import cli, settings
    halves = ((settings.SimSettings, lambda: cli.QUESTIONS), (settings.VllmSettings, lambda: cli.VLLM_QUESTIONS),
              (settings.DeviceSettings, cli.device_questions))
    recorded = set(report.get("settings", ()))
    _, questions = max(halves, key=lambda h: len(recorded & {f.name for f in fields(h[0])}))
    module = questions().get(report.get("question"))
    if module is None:
        raise ConfigError(f"a report of question {report.get('question')!r} has no table function")
    return module


def render(path: Path) -> str:
    """What the JSON report at ``path`` renders to: its question's table, one string."""
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"a marked table names {str(path)!r}, which does not exist") from None
    return "\n".join(question_for(report).table(report)).strip("\n")


def marked(text: str) -> list[re.Match]:
    """The page's marked blocks; a start marker without its end marker is refused."""
    blocks = list(BLOCK.finditer(text))
    starts = sum(line.startswith(START) for line in text.splitlines())
    if starts != len(blocks):
        raise ConfigError(f"{starts} '{START}...' marker(s) but {len(blocks)} closed by '<!-- end table -->'")
    return blocks


def stale(text: str, root: Path) -> list[str]:
    """The JSON paths of the marked blocks whose text is not what their JSON renders to (blank lines around the
    table aside)."""
    return [m["path"] for m in marked(text) if m["body"].strip("\n") != render(root / m["path"])]


def rewrite(text: str, root: Path) -> str:
    """``text`` with every marked block rendered again from its JSON."""
    marked(text)
    # no blank line after the start marker (an HTML comment of one line ends there); one before the end marker,
    # which ends the table (a line after a table's rows would be a row)
    return BLOCK.sub(lambda m: f"{START}{m['path']} -->\n{render(root / m['path'])}\n\n<!-- end table -->", text)


def run(a: argparse.Namespace) -> int:
    page = Path(a.docs)
    text = page.read_text()
    if a.check:
        bad = stale(text, Path("."))
        for path in bad:
            print(f"vtoken bench render: {page}: the table marked {path} is not what that JSON renders to "
                  f"(vtoken bench render --docs {page})", file=sys.stderr)
        return 1 if bad else 0
    new = rewrite(text, Path("."))
    if new != text:
        page.write_text(new)
    print(f"{page}: {len(marked(text))} marked table(s) rendered from their JSON, "
          f"{'rewritten' if new != text else 'unchanged'}")
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("render", help="render the tables a page marks again from their JSON reports",
                             description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default="docs/results.md", help="the markdown page (default docs/results.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each table that differs")
    p.set_defaults(run=run)
