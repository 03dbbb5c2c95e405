"""Per-request step cost at growing live tokens, in the core and inside vLLM, as one JSON line.

    python tests/bench/bench_context_step.py LABEL [vllm]

Core: ``bench_core_step``'s measurement (16 requests, StreamingLLM at its budget, 16-token blocks, median of
12 steps) at 256, 2,048 and 8,192 live tokens, gather/compact and dense/densify. With ``vllm``: Q7's in-process
measurement (``q7_vllm_bookkeeping.measure_concurrency``: 8 requests, Random and H2O at 0.5, 32 generated tokens),
vtoken's microseconds per request per step at prompts of 128, 512 and 1,536 tokens. To compare two commits, run
it alternately in both trees in one session (docs/results.md, "Host cost per request and step").
"""
import json, statistics, sys, time
which = sys.argv[1] if len(sys.argv) > 1 else "this tree"
out = {}
# ---- core: bench_core_step's measurement, at three contexts (bench_context_policies.core, StreamingLLM)
from bench_context_policies import core
for dense in (False, True):
    for live in (256, 2048, 8192):
        out[f"core {'dense/densify' if dense else 'gather/compact'} {live}"] = core("streaming_llm", live, dense)
# ---- vLLM: Q7's in-process measurement, 8 requests, 32 tokens, prompts of growing length
if len(sys.argv) > 2:
    from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
    from vtoken.integration.bench.vllm_engine import heldout_windows
    CFG = {"random, densify": {"policy": "random", "budget": 0.5},
           "random, gather, compact": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
           "h2o, densify": {"policy": "h2o", "budget": 0.5},
           "h2o, gather, compact": {"policy": "h2o", "budget": 0.5, "read_path": "gather", "reclaim": "compact"}}
    for name, cfg in CFG.items():
        for ctx in (128, 512, 1536):
            [m] = measure_concurrency(cfg, [[p for p, _ in heldout_windows(8, ctx, 32, 0)]], 32, 32)
            out[f"vllm {name} {ctx}"] = m["us_per_request"]
print(which, json.dumps(out))
