"""How much of vtoken's per-step growth with the context is the one-off prompt eviction, as one JSON line.

    python tests/bench/bench_generation_length.py [BETA]

Q7's in-process measurement (``q7_vllm_bookkeeping.measure_concurrency``): 8 requests, Random and H2O at budget
0.5 with densify, ``evict_every`` BETA (default 1), 2 seeds, prompts of 128 and 1,536 held-out tokens, and 32
or 256 generated tokens (only 256 when BETA > 1). At the first decode step each request evicts half its prompt
and densify moves the live tokens into the holes. That is O(L) once per request, spread over the generated
tokens. vtoken's µs per request per step, the median over the seeds. Results: `git show 67c0072:docs/results.md`,
"Hot path II, part 1".
"""
import json, statistics, sys

from vtoken.integration.bench.q7_vllm_bookkeeping import measure_concurrency
from vtoken.integration.bench.vllm_engine import heldout_windows

beta = int(sys.argv[1]) if len(sys.argv) > 1 else 1
out = {}
for name, cfg in {"random, densify": {"policy": "random", "budget": 0.5},
                  "h2o, densify": {"policy": "h2o", "budget": 0.5}}.items():
    for tokens in (32, 256) if beta == 1 else (256,):
        for ctx in (128, 1536):
            sets = [[p for p, _ in heldout_windows(8, ctx, tokens, seed)] for seed in (0, 1)]
            ms = measure_concurrency({**cfg, "evict_every": beta}, sets, tokens, 32)
            out[f"{name} {tokens} tokens {ctx}"] = round(statistics.median(m["us_per_request"] for m in ms), 1)
print(f"evict_every {beta}", json.dumps(out))
