"""The eviction cadence's trade-off inside vLLM: host cost against memory, as one JSON line per configuration.

    python tests/bench/bench_evict_every.py [CONTEXT ...]

Q7's in-process measurement (``q7_vllm_bookkeeping.measure_concurrency``: 8 requests, budget 0.5, 96 generated
tokens, held-out prompts of CONTEXT tokens, default 512 and 1,536) for ``evict_every`` beta in 1, 4, 16, 64, on
Random + densify and H2O + densify (dense path) and H2O + compact (gather path), 3 seeds each. Per beta: vtoken's
microseconds per request per step (median over seeds, scheduler + worker timers), copies and token moves, and the
blocks held per request per decode step against the ideal ceil(live / S) of beta = 1 (sampled after every
``after_step``, outside vtoken's timers). Results: docs/results.md, "Host cost per request and step".
"""
import json, statistics, sys

from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
from vtoken.integration.bench.vllm_engine import heldout_windows
from vtoken.integration.vllm.scheduler_tokens import SchedulerTokens

HELD = [0, 0]  # blocks held summed over requests and steps, request-steps
real_after_step = SchedulerTokens.after_step


def after_step(self, attention=None):
    out = real_after_step(self, attention)
    retained, _ = self.retained_vs_ideal()
    HELD[0] += retained
    HELD[1] += len(self.rt.running())
    return out


SchedulerTokens.after_step = after_step
CFG = {"random, densify": {"policy": "random", "budget": 0.5},
       "h2o, densify": {"policy": "h2o", "budget": 0.5},
       "h2o, gather, compact": {"policy": "h2o", "budget": 0.5, "read_path": "gather", "reclaim": "compact"}}
contexts = [int(c) for c in sys.argv[1:]] or [512, 1536]
for ctx in contexts:
    sets = [[p for p, _ in heldout_windows(8, ctx, 96, seed)] for seed in (0, 1, 2)]
    for name, cfg in CFG.items():
        row = {}
        for beta in (1, 4, 16, 64):
            HELD[:] = [0, 0]
            ms = measure_concurrency({**cfg, "evict_every": beta}, sets, 96, 32)
            row[beta] = {"us_per_request": round(statistics.median(m["us_per_request"] for m in ms), 1),
                         "share": round(statistics.median(m["share"] for m in ms), 4),
                         "copies": sum(m["relocations"] for m in ms), "moves": sum(m["tokens_moved"] for m in ms),
                         "blocks_per_request": round(HELD[0] / max(HELD[1], 1), 3)}
        print(json.dumps({"context": ctx, "config": name, "by_beta": row}), flush=True)
