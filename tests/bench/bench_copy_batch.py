"""vtoken's per-step cost with many running requests, where one copy batch per step matters, as one JSON line.

    python tests/bench/bench_copy_batch.py LABEL

Q7's in-process measurement (``q7_vllm_bookkeeping.measure_concurrency``): 64 requests, prompts of 128 held-out
tokens, 32 generated, Random and H2O at budget 0.5 with densify, 2 seeds. Per configuration: vtoken's
microseconds per request per step, then the worker's milliseconds per step, one per seed. To compare two
commits, run it alternately in both trees (`git show 67c0072:docs/results.md`, "Hot path II, part 1").
"""
import json, sys

from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
from vtoken.integration.bench.vllm_engine import heldout_windows

out = {}
for name, cfg in {"random, densify": {"policy": "random", "budget": 0.5},
                  "h2o, densify": {"policy": "h2o", "budget": 0.5}}.items():
    sets = [[p for p, _ in heldout_windows(64, 128, 32, seed)] for seed in (0, 1)]
    ms = measure_concurrency(cfg, sets, 32, 32)
    out[name] = [round(m["us_per_request"], 1) for m in ms] + [round(m["worker_ms"], 3) for m in ms]
print(sys.argv[1] if len(sys.argv) > 1 else "this tree", json.dumps(out))
