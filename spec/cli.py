"""``vtoken spec check``: run every proof obligation and print invariant / transition / result / seconds."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

from .obligations import PROVED, Result, run

#: Modules whose ``obligations()`` make up the spec, in report order.
MODULES = ["state_model", "protocol_model", "planner_model", "crosshair_check"]


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


def check(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    results: list[Result] = []
    print(f"vtoken spec v1\n  {'obligation':<34}{'invariant':<10}{'transition / model':<40}{'result':<16}{'seconds':>8}")
    for ob in all_obligations(a.only):
        if a.filter and a.filter not in ob.id:
            continue
        r = run(ob)
        results.append(r)
        print(f"  {ob.id:<33} {ob.invariant:<10}{ob.transition[:38]:<40}{r.outcome.status:<16}{r.seconds:>8.2f}",
              flush=True)
        if r.outcome.status != PROVED:
            print("    " + r.outcome.detail.replace("\n", "\n    "))
    bad = [r for r in results if r.outcome.status != PROVED]
    total = time.perf_counter() - t0
    print(f"\n{len(results) - len(bad)}/{len(results)} obligations proved in {total:.1f} s"
          + (f"; {len(bad)} not proved: {', '.join(r.obligation.id for r in bad)}" if bad else ""))
    if a.json:
        Path(a.json).write_text(json.dumps([
            {"id": r.obligation.id, "invariant": r.obligation.invariant, "transition": r.obligation.transition,
             "claim": r.obligation.claim, "status": r.outcome.status, "detail": r.outcome.detail,
             "seconds": round(r.seconds, 3)} for r in results], indent=2) + "\n")
    return 1 if bad or not results else 0


if __name__ == "__main__":
    sys.exit(check(argparse.Namespace(only=None, filter=None, json=None)))
