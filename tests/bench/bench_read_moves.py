"""A commit's moves as read-list changes, not full lists (issue #20): vtoken's µs per request per step inside
vLLM for the configurations that send read lists and commit plans, as one JSON line.

    python tests/bench/bench_read_moves.py LABEL

Q7's in-process measurement (``q7_vllm_bookkeeping.measure_concurrency``: 8 requests, budget 0.5, 32 generated
tokens) at prompts of 512 and 1,536 tokens. Run it alternately in two trees in one session to compare commits
(`git show 67c0072:docs/results.md`, "Hot path II, part 2").
"""
import json
import sys

from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
from vtoken.integration.bench.vllm_engine import heldout_windows

CFG = {"h2o, densify": {"policy": "h2o", "budget": 0.5},
       "random, gather, compact": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"}}
out = {}
for name, cfg in CFG.items():
    for ctx in (512, 1536):
        [m] = measure_concurrency(cfg, [[p for p, _ in heldout_windows(8, ctx, 32, 0)]], 32, 32)
        out[f"{name} {ctx}"] = round(m["us_per_request"], 1)
print(json.dumps({"tree": sys.argv[1] if len(sys.argv) > 1 else "this tree", **out}))
