"""The gather read path's attention against vLLM's stock CPU kernel at equal live tokens (issue #20, item 6), as
one JSON line.

    python tests/bench/bench_gather_attention.py LABEL [C ...]

Q7's in-process measurement (``q7_vllm_bookkeeping.measure_concurrency``, the byte-llama on held-out 32-token
prompts, 32 generated tokens, nothing evicted): attention milliseconds per engine step, all layers, timed around
the attention impl's forward, for the stock kernel (``policy: none``, dense) and vtoken's gather impl reading the
same tokens, at C running requests (default 64 and 256), and their ratio. Then, evicting (Random at budget 0.5,
8 requests, prompts of 512 and 1,536 tokens): the dense path (densify, the stock kernel over [0, n_live)) against
the gather path (compact, holes left in place), which hold equal live tokens: attention milliseconds and engine
step milliseconds per step, and the ratios. Run it alternately in two trees in one session to compare commits
(docs/results.md, "Host cost per request and step").
"""
import json
import sys

from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
from vtoken.integration.bench.vllm_engine import heldout_windows

KERNELS = {"stock": {"policy": "none"}, "gather": {"policy": "none", "read_path": "gather"}}
out = {}
for c in [int(x) for x in sys.argv[2:]] or [64, 256]:
    ms = {}
    for name, cfg in KERNELS.items():
        [m] = measure_concurrency(cfg, [[p for p, _ in heldout_windows(c, 32, 32, 0)]], 32, 32)
        ms[name] = round(m["attention_ms"], 2)
    out[f"C={c}"] = {**ms, "gather/stock": round(ms["gather"] / ms["stock"], 2)}
evicting = {}
for ctx in (512, 1536):
    cell = {}
    for name, cfg in {"dense": {"policy": "random", "budget": 0.5},
                      "gather": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"}}.items():
        [m] = measure_concurrency(cfg, [[p for p, _ in heldout_windows(8, ctx, 32, 0)]], 32, 32)
        cell[name] = {"attention_ms": round(m["attention_ms"], 2), "step_ms": round(m["step_ms"], 2)}
    cell["gather/dense attention"] = round(cell["gather"]["attention_ms"] / cell["dense"]["attention_ms"], 2)
    cell["gather/dense step"] = round(cell["gather"]["step_ms"] / cell["dense"]["step_ms"], 2)
    evicting[f"context {ctx}"] = cell
print(json.dumps({"tree": sys.argv[1] if len(sys.argv) > 1 else "this tree", "attention ms per step": out,
                  "evicting, C=8, Random 0.5": evicting}))
