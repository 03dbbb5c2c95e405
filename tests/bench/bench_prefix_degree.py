"""The paper's prefix-caching figure, scaled down and measured per engine step on real vLLM (issue #21, item 5):
retained blocks against Naive-Evict with prefix caching on, at sharing degrees 1, 2, 4 and 8.

The paper: an 8K-token shared prefix and an 8K private suffix per request, compact retains 28.6–42.2 % fewer blocks
than Naive-Evict. Here: a 256-token shared head and a 256-token private suffix, 64 generated tokens, H2O at 0.5 on
the gather path, the tiny Llama, 32-token blocks; the d requests of a group arrive two engine steps apart (so each
later one hits the head vLLM cached from the first). Blocks held are read after every engine step and summed
(block-steps); the same schedule runs for every system, so block-steps compare retained blocks per request per step.
Systems: Naive-Evict; compact as it is (lazy rounds leave hashed blocks in place); compact with hashed blocks back
among its sources (the rule before issue #21).

    python tests/bench/bench_prefix_degree.py        (about 6 minutes on 2 cores)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: vllm_harness
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import vllm_harness as H  # noqa: E402
from bench_prefix_stagger import packs_hashed_blocks  # noqa: E402


def main() -> None:
    cfg = {"policy": "h2o", "budget": 0.5, "read_path": "gather", "seed": 3}
    print("| sharing degree | Naive-Evict | compact (now) | vs Naive-Evict | compact, hashed blocks packed | vs Naive-Evict |")
    print("|---|---|---|---|---|---|")
    for d in (1, 2, 4, 8):
        kw = dict(n=d, every=2, prefix=256, suffix=256, max_tokens=64, num_blocks=192)
        off = H.staggered({**cfg, "reclaim": "off"}, **kw)
        now = H.staggered({**cfg, "reclaim": "compact"}, **kw)
        before = H.staggered({**cfg, "reclaim": "compact"}, before_start=packs_hashed_blocks, **kw)
        ids = [{r: out[0] for r, out in res["outputs"].items()} for res in (off, now, before)]
        assert ids[0] == ids[1] == ids[2], "same evictions, same tokens"
        assert len(off["held"]) == len(now["held"]) == len(before["held"]), "same schedule"
        b = [res["block_steps"] for res in (off, now, before)]
        print(f"| {d} | {b[0]:,} | {b[1]:,} | {b[1] / b[0] - 1:+.1%} | {b[2]:,} | {b[2] / b[0] - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
