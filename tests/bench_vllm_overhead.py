"""vtoken's overhead inside vLLM: plain vs vtoken on (indirection only) vs eviction with densify (with and
without strict verify) vs the relocation drill with strict verify, interleaved in one run (the machines are
noisy).

    python tests/bench_vllm_overhead.py [--rounds 5] [--tokens 64]

Prints median decode throughput (tokens/s) per configuration and the ratio to plain vLLM.
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

CONFIGS = {
    "plain vLLM": None,
    "vtoken on, no eviction": {"strict_verify": "off"},
    "streaming_llm 0.5, densify": {"policy": "streaming_llm", "budget": 0.5},
    "streaming_llm 0.5, densify, strict": {"policy": "streaming_llm", "budget": 0.5, "strict_verify": "strict"},
    "random 0.5, densify": {"policy": "random", "budget": 0.5},
    "random 0.5, gather, compact": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
    "random 0.5, gather, off": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "off"},
    "h2o 0.5, gather, compact": {"policy": "h2o", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
    "drill every 4, strict verify": {"drill_every": 4, "strict_verify": "strict"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    a = ap.parse_args()
    import vllm_harness as H
    from vllm import SamplingParams
    llms = {name: H.make_llm(cfg, multiprocess=True) for name, cfg in CONFIGS.items()}  # one engine process each
    sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True, temperature=0)
    prompts = H.prompts(a.requests)
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    times = {name: [] for name in llms}
    for _ in range(a.rounds):
        for name, llm in llms.items():
            t = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["plain vLLM"])
    print(f"{a.requests} requests x {a.tokens} tokens, {a.rounds} interleaved rounds (median)")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:<36} {a.requests * a.tokens / m:8.1f} tok/s   {m:6.2f} s   x{base / m:5.3f} of plain "
              f"(spread {min(ts):.2f}-{max(ts):.2f} s)")


if __name__ == "__main__":
    main()
