"""Per-request cost of one steady-state decode step of the core (``begin_step`` + ``end_step``), in microseconds.

16 requests of L live tokens each, one new token per request per step, StreamingLLM evicting back to its budget
(L), 16-token blocks; the gather path with ``compact`` and the dense path with ``densify`` (EVENT ordering).
Median of 12 steps. To compare two commits, run it in both trees alternately, in one session (the machines are
noisy): ``python tests/bench/bench_core_step.py`` (`git show 67c0072:docs/results.md`, "Cost of the edge checks").
"""

import statistics
import time

from vtoken.core import BlockPool, ReclaimConfig, VTokenRuntime
from vtoken.core.sim import InMemoryCopyEngine, TagStore
from vtoken.core.plan import PlanKind
from vtoken.core.policies.streaming_llm import StreamingLLM
from vtoken.core.reclamation import Ordering
from vtoken.core.runtime import ReadPath

REQUESTS, BLOCK, STEPS = 16, 16, 12


def step_cost_us(live: int, dense: bool) -> float:
    blocks = REQUESTS * (live // BLOCK + 8) + 64
    pool = BlockPool(blocks, BLOCK, headroom=8)
    reclaim = ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT) if dense else ReclaimConfig()
    rt = VTokenRuntime(pool, InMemoryCopyEngine(TagStore(blocks, BLOCK)), policy=StreamingLLM(), budget=live,
                       reclaim=reclaim, read_path=ReadPath.DENSE if dense else ReadPath.GATHER)
    for r in range(REQUESTS):
        rt.admit(r)
    rt.begin_step({r: live for r in range(REQUESTS)})
    rt.end_step()
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        rt.begin_step({r: 1 for r in range(REQUESTS)})
        rt.end_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / REQUESTS * 1e6


if __name__ == "__main__":
    for dense in (False, True):
        row = {live: round(step_cost_us(live, dense)) for live in (256, 2048)}
        print(f"{'dense/densify ' if dense else 'gather/compact'}  " + "  ".join(f"{k} live: {v} us" for k, v in row.items()))
