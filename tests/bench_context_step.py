"""Per-request step cost at growing live tokens, in the core and inside vLLM, as one JSON line.

    python tests/bench_context_step.py LABEL [vllm]

Core: ``bench_core_step``'s measurement (16 requests, StreamingLLM at its budget, 16-token blocks, median of
12 steps) at 256, 2,048 and 8,192 live tokens, gather/compact and dense/densify. With ``vllm``: Q7's in-process
measurement (``q7_vllm_bookkeeping.measure_concurrency``: 8 requests, Random at 0.5, 32 generated tokens),
vtoken's microseconds per request per step at prompts of 128, 512 and 1,536 tokens. To compare two commits, run
it alternately in both trees in one session (docs/results.md, "Context-length check, issues #17/#18").
"""
import json, statistics, sys, time
which = sys.argv[1] if len(sys.argv) > 1 else "this tree"
out = {}
# ---- core: bench_core_step's measurement, at three contexts
from vtoken.core import BlockPool, ReclaimConfig, VTokenRuntime
try:
    from vtoken.core.sim import InMemoryCopyEngine, TagStore
except ImportError:
    from vtoken.core import InMemoryCopyEngine, TagStore
from vtoken.core.plan import PlanKind
from vtoken.core.policies.streaming_llm import StreamingLLM
from vtoken.core.reclamation import Ordering
from vtoken.core.runtime import ReadPath
R, S, STEPS = 16, 16, 12
def core(live, dense):
    blocks = R * (live // S + 8) + 64
    pool = BlockPool(blocks, S, headroom=8)
    rc = ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT) if dense else ReclaimConfig()
    rt = VTokenRuntime(pool, InMemoryCopyEngine(TagStore(blocks, S)), policy=StreamingLLM(), budget=live, reclaim=rc,
                       read_path=ReadPath.DENSE if dense else ReadPath.GATHER)
    for r in range(R): rt.admit(r)
    rt.begin_step({r: live for r in range(R)}); rt.end_step()
    ts = []
    for _ in range(STEPS):
        t0 = time.perf_counter(); rt.begin_step({r: 1 for r in range(R)}); rt.end_step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / R * 1e6
for dense in (False, True):
    for live in (256, 2048, 8192):
        out[f"core {'dense/densify' if dense else 'gather/compact'} {live}"] = core(live, dense)
# ---- vLLM: Q7's in-process measurement, 8 requests, 32 tokens, prompts of growing length
if len(sys.argv) > 2:
    from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
    from vtoken.integration.bench.vllm_engine import heldout_windows
    CFG = {"random, densify": {"policy": "random", "budget": 0.5},
           "random, gather, compact": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"}}
    for name, cfg in CFG.items():
        for ctx in (128, 512, 1536):
            [m] = measure_concurrency(cfg, [[p for p, _ in heldout_windows(8, ctx, 32, 0)]], 32, 32)
            out[f"vllm {name} {ctx}"] = m["us_per_request"]
print(which, json.dumps(out))
