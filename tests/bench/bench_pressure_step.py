"""The core's gather step under permanent pressure, at growing live tokens (issue #21's review: O(L) packs).

    python tests/bench/bench_pressure_step.py LABEL

16 requests, StreamingLLM at a budget of L live tokens, 16-token blocks, lazy compact on the gather path; the
engine reports itself short of blocks every step (``set_pressure(1)``), so every pressure round packs every
request (``plan_pack``: densify in place) after its one eviction. Median of 12 steps, microseconds per request.
Also counts the packs planned from the step's evictions (``_densify_tail``, O(evicted)) and all packs tried that
way. To compare two commits, run it alternately in both trees (as ``bench_context_step.py``)."""
import json
import statistics
import sys
import time

from vtoken.core import reclamation
from vtoken.core.block_pool import BlockPool
from vtoken.core.policies import make_policy
from vtoken.core.reclamation import ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore

R, S, STEPS = 16, 16, 12
calls = {"tried": 0, "from_evictions": 0}
_tail = getattr(reclamation.ReclamationManager, "_densify_tail")


def _counted(self, r, positions):
    calls["tried"] += 1
    out = _tail(self, r, positions)
    calls["from_evictions"] += out is not None
    return out


reclamation.ReclamationManager._densify_tail = _counted


def step_us(live: int) -> float:
    blocks = R * (live // S + 8) + 64
    rt = VTokenRuntime(BlockPool(blocks, S, headroom=8), InMemoryCopyEngine(TagStore(blocks, S)),
                       policy=make_policy("streaming_llm"), budget=live, reclaim=ReclaimConfig(),
                       read_path=ReadPath.GATHER)
    for r in range(R):
        rt.admit(r)
    rt.begin_step({r: live for r in range(R)})
    rt.end_step()
    ts = []
    for i in range(4 + STEPS):  # 4 untimed: past the first, O(L), packs
        t0 = time.perf_counter()
        rt.begin_step({r: 1 for r in range(R)})
        rt.set_pressure(1)
        rt.end_step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[4:]) / R * 1e6


if __name__ == "__main__":
    out = {live: round(step_us(live), 1) for live in (256, 2048, 8192)}
    print(sys.argv[1] if len(sys.argv) > 1 else "this tree", json.dumps(out), json.dumps(calls))
