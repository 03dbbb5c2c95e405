"""What lazy compaction's rule for prefix-cached blocks costs and saves (issue #21, item 4), on real vLLM.

Four requests, one added every few engine steps, prefix caching on, the tiny Llama, gather path at a 0.5 budget.
Per scenario and policy: Naive-Evict, compact as it is (a block vLLM hashed stays in place outside a pressure
round), and compact with hashed blocks back among its sources (the rule before issue #21). Prints block-steps
(blocks held after each engine step, summed), the peak, and each request's prefix-cached prompt tokens.

    python tests/bench/bench_prefix_stagger.py        (about 5 minutes on 2 cores)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: vllm_harness
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import vllm_harness as H  # noqa: E402

SCENARIOS = {
    "A: 256-token shared head + 8, 40 generated, every 10 steps": dict(prefix=256, suffix=8, max_tokens=40, every=10),
    "B: 140-token shared head + 20, 120 generated, every 24 steps": dict(prefix=140, suffix=20, max_tokens=120,
                                                                         every=24),
    "C: as B, prompts sharing nothing": dict(prefix=140, suffix=20, max_tokens=120, every=24, shared=False),
}


def packs_hashed_blocks(tokens):
    m = tokens.rt.manager
    m._movable = m._private


def main() -> None:
    print("| scenario | policy | Naive-Evict | compact, hashed blocks packed (before) | compact (now) | hits |")
    print("|---|---|---|---|---|---|")
    for name, kw in SCENARIOS.items():
        for policy in ("h2o", "streaming_llm"):
            cfg = {"policy": policy, "budget": 0.5, "read_path": "gather", "seed": 3}
            runs = [H.staggered({**cfg, "reclaim": "off"}, **kw),
                    H.staggered({**cfg, "reclaim": "compact"}, before_start=packs_hashed_blocks, **kw),
                    H.staggered({**cfg, "reclaim": "compact"}, **kw)]
            ids = [{r: out[0] for r, out in res["outputs"].items()} for res in runs]
            assert ids[0] == ids[1] == ids[2], "same evictions, same tokens"
            hits = sorted({tuple(res["outputs"][str(i)][1] for i in range(4)) for res in runs})
            cells = [f"{res['block_steps']:,} / {res['peak']}" for res in runs]
            print(f"| {name} | {policy} | {' | '.join(cells)} | {hits} |", flush=True)


if __name__ == "__main__":
    main()
