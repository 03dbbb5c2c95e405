"""Score policies on the workers' device-side scores (issue #20, item 4): vtoken's µs per request per step inside
vLLM for H2O and Scissorhands, scheduler and worker apart, at growing context, as one JSON line.

    python tests/bench/bench_device_scores.py LABEL

Q7's in-process measurement (``q7_vllm_bookkeeping.measure_concurrency``: 8 requests, budget 0.5, 32 generated
tokens) at prompts of 128, 512 and 1,536 tokens, strict verify off (under it the rows travel too and the core's
scores run as the reference). The worker's time includes, in this tree, ``take_scores`` (recording and ranking);
in a tree before it, ``take_attention`` (the rows' host copy), which that tree left untimed. Run it alternately in
two trees in one session to compare commits (`git show 67c0072:docs/results.md`, "Hot path II, part 3").
"""
import json
import sys
import time

from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
from vtoken.integration.bench.vllm_engine import heldout_windows
from vtoken.integration.vllm.worker_tokens import WorkerTokens

if hasattr(WorkerTokens, "take_attention"):  # a tree before device-side scores: its rows' host copy, timed too
    _take = WorkerTokens.take_attention

    def _timed(self):
        t0 = time.perf_counter()
        try:
            return _take(self)
        finally:
            self.seconds += time.perf_counter() - t0

    WorkerTokens.take_attention = _timed

CFG = {"h2o, densify": {"policy": "h2o", "budget": 0.5},
       "h2o, gather, compact": {"policy": "h2o", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
       "scissorhands, densify": {"policy": "scissorhands", "budget": 0.5}}
out = {}
for name, cfg in CFG.items():
    for ctx in (128, 512, 1536):
        [m] = measure_concurrency(cfg, [[p for p, _ in heldout_windows(8, ctx, 32, 0)]], 32, 32)
        out[f"{name} {ctx}"] = [round(m["us_per_request"], 1), round(1e3 * m["scheduler_ms"] / 8, 1),
                                round(1e3 * m["worker_ms"] / 8, 1)]
print(json.dumps({"tree": sys.argv[1] if len(sys.argv) > 1 else "this tree",
                  "fields": "us per request per step: [vtoken, scheduler, worker]", **out}))
