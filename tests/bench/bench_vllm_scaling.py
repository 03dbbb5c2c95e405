"""How vtoken's per-step cost grows with the number of running requests, and what the gather read path's attention
costs next to vLLM's stock CPU kernel, with more configurations than ``vtoken bench vllm --questions q7`` (whose
measurement this runs: ``q7_vllm_bookkeeping.measure_concurrency``, in-process engines, pinned to one core; the
byte-llama on held-out prompts).

    python tests/bench/bench_vllm_scaling.py [--concurrency 16 32 64 128 256] [--tokens 48]

Table 1, per configuration and concurrency C (C requests, max_num_seqs = C): engine step time, and the time
spent in vtoken per step on the scheduler side (table sync, victim choice, planning) and on the worker side
(copies, slot mapping, read plans), with its share of the step.
Table 2: attention time per step (all layers, measured around the attention impl's forward) for the stock
kernel (dense read path) and vtoken's gather impl reading the same tokens, and their ratio.
"""

from __future__ import annotations

import argparse
import os

from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
from vtoken.integration.bench.vllm_engine import heldout_windows, one_core

CONFIGS = {
    "indirection only": {"policy": "none"},
    "random 0.5, densify": {"policy": "random", "budget": 0.5},
    "h2o 0.5, densify (score pass)": {"policy": "h2o", "budget": 0.5},
    "random 0.5, gather, compact": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
}
KERNELS = {"stock kernel (dense)": {"policy": "none"}, "gather impl": {"policy": "none", "read_path": "gather"}}


def measure(cfg: dict, c: int, tokens: int) -> dict:
    [m] = measure_concurrency(cfg, [[p for p, _ in heldout_windows(c, 32, tokens, 0)]], tokens, 32)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kernel-concurrency", type=int, nargs="+", default=[16, 64, 256])
    a = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    with one_core() as pinning:
        print(f"vtoken time per engine step, C requests x {a.tokens} generated tokens (prompts 32 bytes); "
              f"pinned: {pinning}")
        print(f"  {'configuration':<32} {'C':>4} {'step ms':>8} {'sched ms':>9} {'worker ms':>10} {'vtoken %':>9}")
        for name, cfg in CONFIGS.items():
            for c in a.concurrency:
                m = measure(cfg, c, a.tokens)
                print(f"  {name:<32} {c:>4} {m['step_ms']:8.2f} {m['scheduler_ms']:9.3f} {m['worker_ms']:10.3f} "
                      f"{100 * m['share']:8.1f}%", flush=True)
        print("attention time per engine step (all layers), same tokens read")
        print(f"  {'C':>4} {'stock ms':>9} {'gather ms':>10} {'gather/stock':>13}")
        for c in a.kernel_concurrency:
            stock = measure(KERNELS["stock kernel (dense)"], c, a.tokens)["attention_ms"]
            gather = measure(KERNELS["gather impl"], c, a.tokens)["attention_ms"]
            print(f"  {c:>4} {stock:9.2f} {gather:10.2f} {gather / stock:12.1f}x", flush=True)


if __name__ == "__main__":
    main()
