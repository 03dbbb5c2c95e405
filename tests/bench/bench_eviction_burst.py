"""The core's cost of an eviction burst, per evicted token, as context grows, as one JSON line.

    python tests/bench/bench_eviction_burst.py LABEL [--runs 3]

With a budget of half the prompt, a request's first decode step evicts half its prompt at once (O(L) changes:
``bench_step_decomposition.py`` measures the same burst inside vLLM). Here, in the core alone (8 requests, 16-token
blocks, the in-memory engine): prefill ``L`` tokens per request, then time the step that evicts L/2 per request
(the policy's choice, the table's evictions, the plans and their launch) and the next one (its settle commits
the plans), less two steady steps, as µs per evicted token; and the prefill's step, as µs per synced token;
medians over ``--runs``. Random scatters its victims
(densify's worst case: about half of them leave holes below n_live, so about half the survivors move);
StreamingLLM evicts one contiguous run. To compare two commits, run it alternately in both trees.
"""
import json, statistics, sys, time

from vtoken.core.block_pool import BlockPool
from vtoken.core.policies import make_policy
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.plan import PlanKind
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore

R, S = 8, 16


def burst(policy: str, context: int, dense: bool, seed: int) -> tuple[float, float]:
    """(µs per token of the prefill's sync, µs per evicted token of the burst)."""
    blocks = R * (context // S + 8) + 64
    pool = BlockPool(blocks, S, headroom=8)
    rc = ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT) if dense else ReclaimConfig()
    rt = VTokenRuntime(pool, InMemoryCopyEngine(TagStore(blocks, S)), policy=make_policy(policy), budget=0.5,
                       reclaim=rc, read_path=ReadPath.DENSE if dense else ReadPath.GATHER, seed=seed)
    for r in range(R):
        rt.admit(r)
    t0 = time.perf_counter()
    rt.begin_step({r: context for r in range(R)})  # the prefill: every request's prompt synced
    sync_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rt.end_step()  # the burst: L/2 victims per request, evicted, planned, launched
    rt.begin_step({r: 1 for r in range(R)})  # settle: the plans commit
    rt.end_step()
    burst_s = time.perf_counter() - t0
    evicted = sum(context - rt.num_live(r) for r in range(R))
    steady = []
    for _ in range(6):
        t0 = time.perf_counter()
        rt.begin_step({r: 1 for r in range(R)})
        rt.end_step()
        steady.append(time.perf_counter() - t0)
    return sync_s / (R * context) * 1e6, (burst_s - 2 * statistics.median(steady)) / evicted * 1e6


if __name__ == "__main__":
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 3
    out = {}
    for policy, dense in (("random", True), ("random", False), ("streaming_llm", True), ("streaming_llm", False)):
        for context in (256, 2048, 8192):
            key = f"{policy} {'dense/densify' if dense else 'gather/compact'} {context}"
            sync, evict = zip(*(burst(policy, context, dense, s) for s in range(runs)))
            out[f"burst {key}"] = round(statistics.median(evict), 2)
            if policy == "random":  # the prefill does not depend on the policy
                out[f"prefill {key}"] = round(statistics.median(sync), 2)
    print(sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "this tree", json.dumps(out))
