"""``vtoken spec check``: run every proof obligation and print invariant / transition / result / seconds.

z3 and CrossHair are imported when the check runs, not when ``vtoken`` registers the command; a missing
one, a ``--filter`` that matches nothing or a ``--json`` file that cannot be written is refused in one
line (exit 2) before any obligation runs. ``--json`` does not create folders: a path into a missing
folder is most likely a typo.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from vtoken.core.cli import check_out_file
from vtoken.core.errors import ConfigError

if TYPE_CHECKING:
    from .obligations import Result

#: Modules whose ``obligations()`` make up the spec, in report order.
MODULES = ["state_model", "protocol_model", "protocol_two_plans", "planner_model", "crosshair_check"]


def all_obligations(only: list[str] | None = None):
    for name in MODULES:
        if only and name not in only:
            continue
        yield from importlib.import_module(f"vtoken.spec.{name}").obligations()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("spec", help="machine-check the spec (z3 proofs, CrossHair contracts)")
    sp = p.add_subparsers(dest="spec_command", metavar="ACTION")
    c = sp.add_parser("check", help="run every obligation; exit non-zero unless all are proved")
    c.add_argument("--only", nargs="+", choices=MODULES, help="run only these model modules")
    c.add_argument("--filter", help="run only obligations whose id contains this text")
    c.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    c.set_defaults(run=check)
    p.set_defaults(run=lambda a: (p.print_help(), 2)[1])


def _needs(module: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"{what} needs {module}", name=module)  # one line naming the extra (core/cli.py)


def check(a: argparse.Namespace) -> int:
    if a.json is not None:
        check_out_file("--json", a.json)
    _needs("z3", "the z3 models")
    from .obligations import PROVED, run

    todo = [ob for ob in all_obligations(a.only) if not a.filter or a.filter in ob.id]
    if not todo:
        raise ConfigError(f"--filter {a.filter!r} matches no obligation"
                          + (f" of {a.only}" if a.only else "") + " (ids look like 'I2/T0', 'contracts/core')")
    if any(ob.id.startswith("contracts/") for ob in todo):
        _needs("crosshair", "the contracts check")
    t0 = time.perf_counter()
    results: list[Result] = []
    print(f"vtoken spec v1\n  {'obligation':<34}{'invariant':<10}{'transition / model':<40}{'result':<24}{'seconds':>8}")
    for ob in todo:
        r = run(ob)
        results.append(r)
        print(f"  {ob.id:<33} {ob.invariant:<10}{ob.transition[:38]:<40}{r.outcome.label:<24}{r.seconds:>8.2f}",
              flush=True)
        if not r.outcome.passed:
            print("    " + r.outcome.detail.replace("\n", "\n    "))
    bad = [r for r in results if not r.outcome.passed]
    proved = sum(r.outcome.status == PROVED for r in results)
    total = time.perf_counter() - t0
    print(f"\n{len(results) - len(bad)}/{len(results)} obligations hold in {total:.1f} s: {proved} proved for every "
          f"state, {len(results) - len(bad) - proved} bounded (each within the bound printed beside it)"
          + (f"; {len(bad)} failed: {', '.join(r.obligation.id + ' ' + r.outcome.label for r in bad)}" if bad else ""))
    if a.json:
        Path(a.json).write_text(json.dumps([
            {"id": r.obligation.id, "invariant": r.obligation.invariant, "transition": r.obligation.transition,
             "claim": r.obligation.claim, "status": r.outcome.status, "bound": r.outcome.bound,
             "detail": r.outcome.detail,
             "seconds": round(r.seconds, 3)} for r in results], indent=2) + "\n")
    return 1 if bad or not results else 0


if __name__ == "__main__":  # python -m vtoken.spec.cli [options]: same as vtoken spec check [options]
    from vtoken.core.cli import main

    sys.exit(main(["spec", "check", *sys.argv[1:]]))
