"""Fuzzer throughput and invariant-check cost vs system size (a benchmark, not a test).

Run: make bench-fuzz   (or: .venv/bin/python tests/bench/bench_fuzz_throughput.py [--seconds 20])

Part 1: state-machine steps per second on one core, every invariant checked after every step, per
profile and for all profiles mixed (a one-worker `vtoken fuzz` campaign).
Part 2: cost of one full `check_all` against the cost of one simulator step, as the number of running
requests grows (both measured side by side in this run).
"""

from __future__ import annotations

import argparse
import tempfile
import time

from vtoken.core.reference.invariants import check_all
from vtoken.core.sim.simulator import SimConfig, Simulator, content_tag, synthetic_workload
from vtoken.fuzz.campaign import CampaignConfig, run_campaign
from vtoken.fuzz.profiles import PROFILES


def fuzz_throughput(seconds: float) -> list[tuple[str, float, int]]:
    rows = []
    for label, planners in [("all profiles", ())] + [(p, None) for p in PROFILES]:
        with tempfile.TemporaryDirectory() as out:
            cfg = CampaignConfig(time_budget=seconds, workers=1, out_dir=out, use_database=False, planners=planners or ())
            if planners is None:  # one profile: restrict through the machine's class attributes
                from vtoken.fuzz import campaign

                orig = campaign.machine_class
                campaign.machine_class = lambda c, p=label: type("VTokenMachine", (orig(c),), {"profiles": (p,)})
                try:
                    r = run_campaign(cfg, progress=None)
                finally:
                    campaign.machine_class = orig
            else:
                r = run_campaign(cfg, progress=None)
        rows.append((label, r.timing["steps_per_s"], r.invariant_checks))
    return rows


def check_cost(sizes: list[int]) -> list[tuple]:
    rows = []
    for n in sizes:
        wl = synthetic_workload(n, seed=0, arrival_gap=0, prompt=(64, 128), output=(400, 400))
        sim = Simulator(SimConfig(num_blocks=n * 40, max_running=n), wl)
        for s in range(60):
            sim.step(s)
        rt = sim.rt
        live = sum(rt.table.num_live(r) for r in rt.table.request_ids())
        reps = 5
        t0 = time.perf_counter()
        for s in range(60, 60 + reps):
            sim.step(s)
        step = (time.perf_counter() - t0) / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            check_all(rt, content_tag)
        check = (time.perf_counter() - t0) / reps
        rows.append((len(rt.table.request_ids()), live, rt.pool.num_blocks, step, check))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="per fuzz-throughput row")
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 30, 100, 300])
    a = ap.parse_args()
    print(f"fuzzer throughput, one core, every invariant after every step ({a.seconds:g} s per row)")
    print(f"  {'profile':<22}{'steps/s':>10}{'checks':>12}")
    for label, sps, checks in fuzz_throughput(a.seconds):
        print(f"  {label:<22}{sps:>10,.0f}{checks:>12,}")
    print("\ninvariant-check cost vs system size (simulator, random eviction at 50%, compact)")
    print(f"  {'requests':>8}{'live tokens':>12}{'blocks':>8}{'step ms':>9}{'check_all ms':>13}{'check/step':>11}{'us/token':>9}")
    for n, live, blocks, step, check in check_cost(a.sizes):
        print(f"  {n:>8}{live:>12,}{blocks:>8,}{step * 1e3:>9.1f}{check * 1e3:>13.1f}{check / step:>11.2f}"
              f"{check / live * 1e6:>9.2f}")


if __name__ == "__main__":
    main()
