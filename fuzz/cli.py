"""``vtoken fuzz``: campaigns, replays of a failing batch, and the planted-bug self-test.

Registering the command imports only the core: Hypothesis (the campaign) is imported when the command
runs, torch only for ``--target tensors``, numba only for ``--target fast`` and vLLM only for ``--target vllm``.
Every option is checked before any work; a bad one is a ``ConfigError`` naming it, which ``vtoken`` prints as one
line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from vtoken.core.cli import check_int, check_number, check_out_dir
from vtoken.core.errors import ConfigError
from vtoken.core.policies import POLICIES

from .planted import BUGS

VLLM_BUGS = ("cursor_block_keeps_hash", "moved_into_block_keeps_hash", "worker_ignores_layouts",
             "worker_drops_read_evictions", "worker_ignores_read_moves", "worker_ranks_into_the_window",
             "gather_kernel_stops_a_key_early", "hash_at_list_index")  # vllm_episode.PLANTED
FAST_BUGS = ("fast_counts_miss_a_move", "fast_draw_of_another_state", "fast_dropped_move",
             "fast_gather_candidate_above_the_cutoff", "fast_gather_count_stale_after_a_move",
             "fast_gather_cursor_left_behind", "fast_gather_destination_is_a_source",
             "fast_gather_drops_the_last_token", "fast_gather_movers_out_of_order", "fast_gather_moves_not_logged",
             "fast_gather_pops_the_emptiest", "fast_gather_release_while_a_plan_is_in_flight",
             "fast_gather_releases_a_live_block", "fast_gather_ties_in_reverse", "fast_ideal_blocks_floored",
             "fast_live_bit_kept_on_eviction", "fast_plans_out_of_order", "fast_rank_off_by_one",
             "fast_reads_evictions_taken_twice", "fast_reads_patch_skips_the_last_eviction", "fast_shared_block_densified", "fast_slot_off_by_one", "fast_tail_block_kept")  # fast_target.FAST_BUGS (numba: not imported to parse the options)

if TYPE_CHECKING:
    from .campaign import CampaignConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fuzz", help="run the invariant fuzzer (Hypothesis state machines over the whole core)",
                       description="Fuzz the vtoken core: every invariant checked after every step.")
    p.add_argument("--time", type=float, default=60.0, help="time budget in seconds (default 60)")
    p.add_argument("--runs", type=int, help="stop after this many examples instead (deterministic report)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=1, help="parallel processes, each on its own batches")
    p.add_argument("--steps", type=int, default=100, help="rules per example (default 100)")
    p.add_argument("--examples", type=int, default=25, help="examples per batch (default 25)")
    p.add_argument("--planner", nargs="+", choices=["compact", "densify", "off"], default=[])
    p.add_argument("--policy", nargs="+", choices=sorted(POLICIES) + ["none"], default=[])
    p.add_argument("--target", choices=["core", "tensors", "fast", "vllm"], default="core",
                   help="core: in-memory copies with late/failed/reordered completion (default); tensors: the "
                        "torch device layer moving real K/V of several layers, dtypes and layouts, strict verify on; "
                        "fast: the compiled fast path against the core, every call (V6); "
                        "vllm: random request mixes through real vLLM on CPU (--replay takes an episode seed)")
    p.add_argument("--out", default="fuzz-out", help="output directory (reports, failures, example database)")
    p.add_argument("--keep-going", action="store_true", help="record failures and continue until the budget")
    p.add_argument("--replay", type=int, metavar="BATCH_SEED", help="rerun one batch from its seed")
    p.add_argument("--self-test", action="store_true", help="plant each known bug and check the fuzzer catches it")
    p.add_argument("--bug", nargs="+", choices=sorted(BUGS) + sorted(FAST_BUGS) + sorted(VLLM_BUGS),
                   help=f"planted bug(s) for --self-test or --replay (fast_*: --target fast; "
                        f"{', '.join(sorted(VLLM_BUGS))}: --target vllm)")
    p.add_argument("--time-per-bug", type=float, default=60.0, help="self-test budget per planted bug")
    p.add_argument("--tp", type=int, default=1, choices=[1, 2],
                   help="--target vllm: tensor-parallel ranks per engine (2: two workers, a core each; default 1)")
    p.add_argument("--fast-path", action="store_true",
                   help="--target vllm: every episode's settings moved into the fast path's domain (dense, densify, "
                        "StreamingLLM or none, no drill), so each runs the fast path shadowed by the core (V6)")
    p.set_defaults(run=main)


def _config(a: argparse.Namespace, **over) -> CampaignConfig:
    from .campaign import CampaignConfig

    cfg = CampaignConfig(time_budget=a.time, runs=a.runs, seed=a.seed, workers=a.workers, steps=a.steps,
                         examples=a.examples, planners=tuple(a.planner), policies=tuple(a.policy), out_dir=a.out,
                         keep_going=a.keep_going, target=a.target)
    return replace(cfg, **over)


def check_args(a: argparse.Namespace) -> None:
    """Every option in range (``ConfigError`` naming the first bad one); changes nothing, creates nothing."""
    for name in ("workers", "steps", "examples"):
        check_int(f"--{name}", getattr(a, name), 1)
    if a.runs is not None:
        check_int("--runs", a.runs, 1)
    check_number("--time", a.time, 0.0, what="a number of seconds")
    check_number("--time-per-bug", a.time_per_bug, 0.0, what="a number of seconds")
    check_int("--seed", a.seed, 0)
    if a.replay is not None:
        check_int("--replay", a.replay, 0)
    if a.self_test and a.replay is not None:
        raise ConfigError("--self-test and --replay exclude each other (--replay BATCH_SEED --bug NAME replays "
                          "one planted bug's batch)")
    if a.fast_path and a.target != "vllm":
        raise ConfigError("--fast-path is for --target vllm (--target fast runs the fast path without vLLM)")
    if a.tp != 1 and a.target != "vllm":
        raise ConfigError(f"--tp {a.tp} is for --target vllm (the core has no ranks)")
    if a.target == "fast" and (a.planner or a.policy):
        raise ConfigError("--planner and --policy restrict the core's machine; --target fast draws its own (densify, "
                          "StreamingLLM or nothing evicted)")
    if a.bug:
        home = {b: "vllm" for b in VLLM_BUGS} | {b: "fast" for b in FAST_BUGS}
        wrong = [b for b in a.bug if home.get(b, "core") != ("core" if a.target == "tensors" else a.target)]
        if wrong:
            where = {"vllm": "the vLLM plugin: use --target vllm", "fast": "the fast path: use --target fast"}
            raise ConfigError(f"--bug {wrong[0]} is planted in {where.get(home.get(wrong[0]), 'the core')}")
    check_out_dir("--out", a.out)


def main(a: argparse.Namespace) -> int:
    check_args(a)
    if a.target == "vllm":
        from .vllm_campaign import main as vllm_main
        return vllm_main(a)
    if a.bug and not a.self_test and a.replay is None:
        print("vtoken fuzz: --bug is for --self-test or --replay", file=sys.stderr)
        return 2
    if a.target == "tensors":
        import torch  # noqa: F401  -- before any worker starts: a missing torch is one line, not a finding
    if a.target == "fast":
        from vtoken.integration.fastpath import unavailable
        if unavailable():
            print(f"vtoken fuzz: --target fast cannot run here: {unavailable()}", file=sys.stderr)
            return 2
    from .campaign import run_campaign  # noqa: F401  -- Hypothesis: missing -> one line naming the extra

    if a.self_test:
        return self_test(a)
    if a.replay is not None:
        return _replay(a)
    cfg = _config(a)
    print(f"vtoken fuzz: seed {cfg.seed}, {cfg.workers} worker(s), "
          f"{f'{cfg.runs} runs' if cfg.runs else f'{cfg.time_budget:g} s'}, {cfg.steps} steps per run, "
          f"planners {list(cfg.planners) or 'all'}, policies {list(cfg.policies) or 'all'}, target {cfg.target}, "
          f"output {cfg.out_dir}/",
          file=sys.stderr)
    report = run_campaign(cfg)
    for f in report.failures:
        print(f"\n=== invariant violation (batch seed {f['batch_seed']}) ===\n{f['error']}\n")
        print(Path(f["pytest_file"]).read_text())
        print(f"replay:  {f['replay']}\n   or:  pytest {f['pytest_file']}")
    ev = report.events
    print(f"\n{'FAILED' if report.failures else 'clean'}: {report.runs:,} runs, {report.steps:,} steps "
          f"({report.timing['steps_per_s']:,.0f}/s), {report.invariant_checks:,} invariant checks, "
          f"{len(report.failures)} failure(s) in {report.timing['elapsed_s']:.1f} s")
    print(f"  Algorithm-1 steps {ev.get('steps', 0):,}, evictions {ev.get('evictions', 0):,}, "
          f"plans committed {ev.get('plans_committed', 0):,} / aborted {ev.get('plans_aborted', 0):,}, "
          f"copies failed {ev.get('copies_failed', 0):,}, preemptions {ev.get('preemptions', 0):,} "
          f"({ev.get('preempted_mid_copy', 0):,} mid-copy), rejected bad calls {ev.get('rejected_calls', 0):,}")
    print(f"  report: {Path(cfg.out_dir) / 'report.json'}")
    return 1 if report.failures else 0


def _replay(a: argparse.Namespace) -> int:
    from .campaign import pytest_file, replay, save_failure

    bug = a.bug[0] if a.bug else None
    cfg = _config(a, bug=bug)
    res = replay(cfg, a.replay)
    if res.failure is None:
        print(f"batch seed {a.replay}: no failure (runs {res.events.get('runs', 0)})")
        return 0
    save_failure(res.failure, cfg)
    print(f"batch seed {a.replay}: {res.failure.error}\n")
    print(pytest_file(res.failure, cfg))
    print(f"saved: {res.failure.pytest_file}")
    return 1


def self_test(a: argparse.Namespace) -> int:
    """Plant each bug alone; the fuzzer must find it within --time-per-bug seconds on one worker."""
    from .campaign import replay_command, run_campaign

    registry = BUGS
    if a.target == "fast":
        from .fast_target import FAST_BUGS as registry
    names = a.bug or sorted(registry)
    rows = []
    print(f"vtoken fuzz --self-test: {len(names)} planted bugs, {a.time_per_bug:g} s each, seed {a.seed}")
    for name in names:
        out = Path(a.out) / "self-test" / name
        cfg = _config(a, bug=name, workers=1, time_budget=a.time_per_bug, runs=None, keep_going=False,
                      out_dir=str(out), use_database=False)
        t0 = time.time()
        report = run_campaign(cfg, progress=None)
        took = time.time() - t0
        caught = bool(report.failures)
        f = report.failures[0] if caught else None
        clean = _passes_without_bug(f, a.target) if f else None
        rows.append({"bug": name, "description": registry[name].description, "caught": caught,
                     "seconds": round(took, 1), "runs": report.runs,
                     "error": f["error"] if f else "", "program_steps": len(f["program"]) if f else 0,
                     "program_passes_without_bug": clean,
                     "replay": replay_command(cfg, f["batch_seed"]) if f else ""})
        mark = "caught" if caught else "MISSED"
        print(f"  {name:36s} {mark:7s} {took:6.1f} s  {rows[-1]['program_steps']:3d}-line program  "
              f"{'' if not f else ('clean without the bug' if clean else 'FAILS WITHOUT THE BUG')}"
              f"\n      {rows[-1]['error'][:110]}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "self-test.json").write_text(json.dumps(rows, indent=2) + "\n")
    missed = [r["bug"] for r in rows if not r["caught"] or not r["program_passes_without_bug"]]
    print(f"\n{len(rows) - len(missed)}/{len(rows)} planted bugs caught with a program that passes without them"
          f"; slowest {max(r['seconds'] for r in rows):.1f} s. Report: {Path(a.out) / 'self-test.json'}")
    return 1 if missed else 0


def _passes_without_bug(f: dict, target: str = "core") -> bool:
    """The shrunk program must pass on the unmodified code: the fuzzer does not cry wolf."""
    from .campaign import machine_import

    namespace: dict = {}
    exec(machine_import(target), namespace)  # the program's namespace: its machine as ``VTokenMachine``
    try:
        exec("\n".join(f["program"]), namespace)
    except Exception:
        return False
    return True

