"""vtoken's overhead inside vLLM: plain vs vtoken on (indirection only) vs eviction with densify (with and
without strict verify) vs the relocation drill with strict verify, interleaved in one run (the machines are
noisy).

    python tests/bench_vllm_overhead.py [--rounds 5] [--tokens 64]

Prints, per configuration, the median decode throughput (tokens/s) and its ratio to plain vLLM, and the
p50/p95 per-step latency (time between consecutive engine steps' outputs, decode steps of all rounds pooled)
and the p95's ratio to plain vLLM's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

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
    import vllm_harness as H
    from vllm import SamplingParams
    keys = ["plain"] + [k for k in a.only if k != "plain"]
    llms = {CONFIGS[k][0]: H.make_llm(CONFIGS[k][1], multiprocess=True) for k in keys}  # one engine process each
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0)
    prompts = H.prompts(a.requests)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    times = {name: [] for name in llms}
    steps = {name: [] for name in llms}
    for r in range(a.rounds):
        for name, llm in llms.items():
            wall, gaps = run_steps(llm, prompts, sp, f"r{r}")
            times[name].append(wall)
            steps[name] += gaps
    base = statistics.median(times["plain vLLM"])
    base_p95 = p95(steps["plain vLLM"])
    print(f"{a.requests} requests x {a.tokens} tokens, {a.rounds} interleaved rounds (median)")
    print(f"  {'configuration':<36} {'tok/s':>8} {'x plain':>8}  {'step p50':>9} {'step p95':>9} {'p95 x plain':>12}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:<36} {a.requests * a.tokens / m:8.1f} {base / m:8.3f}  {1e3 * statistics.median(steps[name]):7.2f}ms "
              f"{1e3 * p95(steps[name]):7.2f}ms {p95(steps[name]) / base_p95:12.3f}   (spread {min(ts):.2f}-{max(ts):.2f} s)")


def p95(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=20)[-1]


def run_steps(llm, prompts, sp, tag: str) -> tuple[float, list[float]]:
    """Run the prompts through the engine step by step: wall time, and the gaps between consecutive steps
    that returned output after every request has its first token (decode steps)."""
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, sp)
    t0 = last = time.perf_counter()
    gaps, started = [], set()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        if outs:
            if len(started) == len(prompts):
                gaps.append(now - last)
            started.update(o.request_id for o in outs)
            last = now
    return time.perf_counter() - t0, gaps


if __name__ == "__main__":
    main()
