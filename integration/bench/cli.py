"""``vtoken bench``: the evaluation harness. ``vtoken bench sim`` answers the questions on the core simulator."""

from __future__ import annotations

import argparse
import sys
import time

from vtoken.core.errors import ConfigError

from .questions import QUESTIONS, select_questions
from .runner import command_line, prepare_out_dir, run_questions
from .settings import MIN_REPEATS, bench_settings
from .vllm_cli import register_vllm


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="the evaluation (issue #8): paper questions, JSON + PNG per question",
                       description="Evaluation harness. 'sim' runs on the deterministic core simulator.")
    bench_sub = p.add_subparsers(dest="bench_target", metavar="TARGET")
    sim = bench_sub.add_parser("sim", help="answer the questions on the core simulator",
                               description="Native, Naive-Evict, vtoken compact and vtoken densify side by side, "
                                           "identical eviction decisions, median and spread over seeds.")
    sim.add_argument("--quick", action="store_true", help="smaller scale, same questions (a few minutes on 2 cores)")
    sim.add_argument("--out", default="bench-out", help="output folder for <question>.json and .png")
    sim.add_argument("--questions", nargs="+", metavar="Q", help=f"subset of {list(QUESTIONS)} (default: all)")
    sim.add_argument("--repeats", type=int, help=f"seeds per point (default and minimum {MIN_REPEATS})")
    sim.add_argument("--seed", type=int, default=0, help="first seed; repeat i uses seed + i")
    sim.add_argument("--check-invariants", action="store_true",
                     help="check every invariant after every simulated step (slow)")
    sim.set_defaults(run=run_sim)
    register_vllm(bench_sub)
    p.set_defaults(run=lambda a: (p.print_help(), 2)[1])


def run_sim(a: argparse.Namespace) -> int:
    try:
        settings = bench_settings(a.quick, a.repeats, a.seed, a.check_invariants)
        questions = select_questions(a.questions)
        out_dir = prepare_out_dir(a.out)
    except ConfigError as e:
        print(f"vtoken bench sim: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    run_questions(questions, settings, out_dir, command_line("sim", a, ("repeats", "seed", "check_invariants")))
    print(f"\nvtoken bench sim: {len(questions)} question(s) in {time.monotonic() - started:.0f} s; "
          f"JSON and PNG in {out_dir}/", file=sys.stderr)
    return 0
