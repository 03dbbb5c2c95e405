"""Per-request core step cost at 256 to 32,768 live tokens, per policy and read path, as one JSON line.

    python tests/bench/bench_context_policies.py LABEL [compacting]

16 requests, each at its budget (an int budget: one eviction per decode step), 16-token blocks,
begin_step + end_step, median of 12 steps, no attention rows. Run it alternately in two trees to compare
commits (docs/results.md, "Host cost per request and step"). ``compacting``: each request is admitted with twice its budget and
theta_F is 0.1, so half of it is evicted at once and compact plans and commits in every timed step (Q10's
regime), on the gather path only.
"""
import json, statistics, sys, time
from vtoken.core import BlockPool, ReclaimConfig, VTokenRuntime
try:
    from vtoken.core.sim import InMemoryCopyEngine, TagStore
except ImportError:  # a tree from before issue #18's core/sim/
    from vtoken.core import InMemoryCopyEngine, TagStore
from vtoken.core.plan import PlanKind
from vtoken.core.policies import make_policy
from vtoken.core.reclamation import Ordering
from vtoken.core.runtime import ReadPath
R, S, STEPS = 16, 16, 12
def core(pol, live, dense, compacting=False):
    blocks = R * ((2 if compacting else 1) * live // S + 8) + 64
    pool = BlockPool(blocks, S, headroom=8)
    rc = ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT) if dense else \
        ReclaimConfig(theta_f=0.1, ordering=Ordering.POLL) if compacting else ReclaimConfig()
    rt = VTokenRuntime(pool, InMemoryCopyEngine(TagStore(blocks, S)), policy=make_policy(pol), budget=live, reclaim=rc,
                       read_path=ReadPath.DENSE if dense else ReadPath.GATHER)
    for r in range(R): rt.admit(r)
    rt.begin_step({r: (2 if compacting else 1) * live for r in range(R)}); rt.end_step()
    for _ in range(4 if compacting else 0):  # past the first plans after the burst
        rt.begin_step({r: 1 for r in range(R)}); rt.end_step()
    ts = []
    for _ in range(STEPS):
        t0 = time.perf_counter(); rt.begin_step({r: 1 for r in range(R)}); rt.end_step(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / R * 1e6
if __name__ == "__main__":
    out = {}
    compacting = sys.argv[2:] == ["compacting"]
    runs = (("streaming_llm", False), ("random", False)) if compacting else \
        (("streaming_llm", False), ("random", False), ("streaming_llm", True), ("h2o", False))
    for pol, dense in runs:
        for live in (256, 2048, 8192, 32768):
            key = f"{pol} {'dense/densify' if dense else 'gather/compact'}{' compacting' if compacting else ''} {live}"
            out[key] = round(core(pol, live, dense, compacting), 1)
    print(sys.argv[1], json.dumps(out))
