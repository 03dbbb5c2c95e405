"""vtoken's overhead inside vLLM against plain vLLM, with more configurations than ``vtoken bench vllm --questions q4``
(whose measurement this runs: ``q4_overhead.run_interleaved``, one engine process per configuration, interleaved
rounds, pinned to one core; the byte-llama on held-out prompts).

    python tests/bench/bench_vllm_overhead.py [--rounds 5] [--tokens 64] [--requests 8] [--only on drill ...]

Prints, per configuration, the median decode throughput (tokens/s) over rounds and its ratio to plain vLLM's,
and the p50/p95 per-step latency (decode steps of all rounds pooled) and the p95's ratio to plain vLLM's.
"""

from __future__ import annotations

import argparse
import os
import statistics

from vtoken.integration.bench.q4_overhead import percentile, run_interleaved
from vtoken.integration.bench.vllm_engine import heldout_windows, one_core

CONFIGS = {  # key: (description, vtoken settings or None for plain vLLM)
    "plain": ("plain vLLM", None),
    "on": ("vtoken on, no eviction", {"strict_verify": "off"}),
    "sllm-densify": ("streaming_llm 0.5, densify", {"policy": "streaming_llm", "budget": 0.5}),
    "sllm-strict": ("streaming_llm 0.5, densify, strict", {"policy": "streaming_llm", "budget": 0.5,
                                                          "strict_verify": "strict"}),
    "random-densify": ("random 0.5, densify", {"policy": "random", "budget": 0.5}),
    "h2o-densify": ("h2o 0.5, densify (score pass)", {"policy": "h2o", "budget": 0.5}),
    "random-compact": ("random 0.5, gather, compact", {"policy": "random", "budget": 0.5, "read_path": "gather",
                                                      "reclaim": "compact"}),
    "random-off": ("random 0.5, gather, off", {"policy": "random", "budget": 0.5, "read_path": "gather",
                                              "reclaim": "off"}),
    "h2o-compact": ("h2o 0.5, gather, compact", {"policy": "h2o", "budget": 0.5, "read_path": "gather",
                                                "reclaim": "compact"}),
    "drill": ("drill every 4, strict verify", {"drill_every": 4, "strict_verify": "strict"}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                    help="configurations to run (plain vLLM always runs); fewer engines, less interference")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    keys = ["plain"] + [k for k in a.only if k != "plain"]
    rounds = [[p for p, _ in heldout_windows(a.requests, 64, a.tokens, seed)] for seed in range(a.rounds)]
    with one_core() as pinning:
        res = run_interleaved({CONFIGS[k][0]: CONFIGS[k][1] for k in keys}, rounds, a.tokens, 32)
    times = {name: [r["wall_s"] for r in x["runs"]] for name, x in res.items()}
    steps = {name: [g for r in x["runs"] for g in r["gaps_s"]] for name, x in res.items()}
    base, base_p95 = statistics.median(times["plain vLLM"]), percentile(steps["plain vLLM"], 95)
    print(f"{a.requests} requests x {a.tokens} tokens, {a.rounds} interleaved rounds (median); pinned: {pinning}")
    print(f"  {'configuration':<36} {'tok/s':>8} {'x plain':>8}  {'step p50':>9} {'step p95':>9} {'p95 x plain':>12}")
    for name, ts in times.items():
        m, p95 = statistics.median(ts), percentile(steps[name], 95)
        print(f"  {name:<36} {a.requests * a.tokens / m:8.1f} {base / m:8.3f}  "
              f"{1e3 * percentile(steps[name], 50):7.2f}ms {1e3 * p95:7.2f}ms {p95 / base_p95:12.3f}   "
              f"(spread {min(ts):.2f}-{max(ts):.2f} s)")


if __name__ == "__main__":
    main()
