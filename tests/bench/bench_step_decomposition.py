"""Where vtoken's per-step cost inside vLLM goes as context grows: steady steps against eviction bursts.

    python tests/bench/bench_step_decomposition.py [--contexts 128 512 1536] [--runs 2] [--requests 8] [--out FILE.json]

Q7's context axis reports vtoken's microseconds per request per step averaged over a whole generate. With a budget
of half the prompt, a request's first decode step evicts half its prompt at once (O(L) changes), and every later
step evicts about one token. The average mixes the two, so its growth with L says nothing about whether the
per-step machinery follows what changed. This bench steps the engine itself (8 requests by default, 32 generated
tokens, the byte-llama; the configurations of ``bench_context_step.py``, and StreamingLLM and Random on the fast
path and on the core's runtime), reads vtoken's scheduler and worker seconds and the tokens evicted after every step, and splits each
run into:

  * **steady**: the median over the decode steps that scheduled one token for every request and evicted at most one
    token per request and committed at most one relocation move per request (µs per request);
  * **burst**: the steps that evicted more, as µs per evicted token (their cost less one steady step each);
  * **reclaim**: the steps that evicted little but committed more than one relocation move per request (the
    reclamation working through what a burst left), as µs per moved token (less one steady step each);
  * **mean**: Q7's number (every step, prefill included), and its parts: the steady cost, and what the prefill,
    burst, reclaim and mixed steps (a prefill chunk or a finished request beside the decodes) cost beyond a steady
    step, spread over every step.

If steady barely grows with L while mean does, what grows is the bursts and the reclamation after them, whose costs
are per evicted and per moved token: O(changes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from vtoken.integration.bench.vllm_engine import engine_args, engine_environment, heldout_windows, start_llm

CONFIGS = {"random, densify": {"policy": "random", "budget": 0.5},
           "random, densify, core": {"policy": "random", "budget": 0.5, "fast_path": False},
           "random, gather, compact": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
           "random, gather, compact, core": {"policy": "random", "budget": 0.5, "read_path": "gather",
                                             "reclaim": "compact", "fast_path": False},
           "streaming, gather, compact": {"policy": "streaming_llm", "budget": 0.5, "read_path": "gather",
                                          "reclaim": "compact"},
           "streaming, gather, compact, core": {"policy": "streaming_llm", "budget": 0.5, "read_path": "gather",
                                                "reclaim": "compact", "fast_path": False},
           "h2o, densify": {"policy": "h2o", "budget": 0.5},
           "h2o, gather, compact": {"policy": "h2o", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
           # the fast path (issues #45, #46; Random's too) against the core's runtime on the same configuration
           "streaming, densify": {"policy": "streaming_llm", "budget": 0.5},
           "streaming, densify, core": {"policy": "streaming_llm", "budget": 0.5, "fast_path": False}}
NEW_TOKENS, BLOCK = 32, 32


def one_run(vtoken: dict, context: int, seed: int, requests: int = 8, new_tokens: int = NEW_TOKENS) -> dict:
    """One engine, one batch of ``requests`` prompts of ``context`` tokens, stepped to the end: per step vtoken's
    seconds (scheduler + worker) and the tokens it evicted, split as the module docstring says."""
    with engine_environment(1):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [p for p, _ in heldout_windows(requests, context, new_tokens, seed)]
        llm = start_llm(**engine_args(vtoken, context + new_tokens, requests, BLOCK))
        try:
            engine = llm.llm_engine
            conn = engine.engine_core.engine_core.scheduler.connector
            params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
            warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], warm, use_tqdm=False)  # untimed
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), params)
            steps, scheduled = [], {}
            build = conn.build_connector_meta

            def capture(so):  # what the step schedules: a steady step decodes one token for every request
                scheduled["tokens"], scheduled["requests"] = so.total_num_scheduled_tokens, len(so.num_scheduled_tokens)
                return build(so)
            conn.build_connector_meta = capture
            reclaim = conn.tokens.rt.reclaim_stats
            last = (conn.tokens.stats.seconds, conn.workers.seconds, conn.tokens.stats.evicted, reclaim.moves_committed)
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
                now = (conn.tokens.stats.seconds, conn.workers.seconds, conn.tokens.stats.evicted,
                       reclaim.moves_committed)
                steps.append({"vtoken_s": (now[0] - last[0]) + (now[1] - last[1]), "evicted": now[2] - last[2],
                              "moved": now[3] - last[3], "wall_s": wall,
                              "decode": scheduled.get("tokens") == scheduled.get("requests") == requests})
                last = now
        finally:
            llm.llm_engine.engine_core.shutdown()  # now: the next engine must not find this one's KV connector
            del llm
    return split(steps, requests)


def split(steps: list[dict], requests: int) -> dict:
    """The decomposition of one run's steps (docstring). A prefill step (before the first eviction) counts in the
    mean only. After it: a *burst* step evicts more than one token per request; a *reclaim* step evicts at most
    that but commits more than one relocation move per request (compaction or densify working through what a
    burst left); the rest are *steady*. ``parts`` splits the mean (µs per request per step, over every step)
    into what each kind of step cost beyond a steady step."""
    first = next((i for i, s in enumerate(steps) if s["evicted"]), len(steps))
    after = steps[first:]
    bursts = [s for s in after if s["evicted"] > requests]
    reclaims = [s for s in after if s["evicted"] <= requests and s["moved"] > requests]
    # NOTE: steady steps decode one token for every request (no prefill chunk, none finished): a mixed step's cost
    # is the prefill's sync, not the steady machinery's
    steady = [s["vtoken_s"] for s in after if s["evicted"] <= requests and s["moved"] <= requests and s["decode"]]
    steady_s = statistics.median(steady) if steady else float("nan")
    mixed = [s for s in after if s["evicted"] <= requests and s["moved"] <= requests and not s["decode"]]
    burst_tokens, moved = sum(s["evicted"] for s in bursts), sum(s["moved"] for s in reclaims)
    extra = lambda kind: sum(s["vtoken_s"] - steady_s for s in kind)  # noqa: E731
    per_request_step = 1e6 / len(steps) / requests
    return {"steps": len(steps), "steady_steps": len(steady), "burst_steps": len(bursts),
            "reclaim_steps": len(reclaims),
            "steady_us_per_request": 1e6 * steady_s / requests,
            "burst_us_per_evicted_token": 1e6 * extra(bursts) / burst_tokens if burst_tokens else None,
            "burst_evicted": burst_tokens,
            "reclaim_us_per_moved_token": 1e6 * extra(reclaims) / moved if moved else None,
            "reclaim_moved": moved, "moves_committed": sum(s["moved"] for s in steps),
            "mean_us_per_request": 1e6 * sum(s["vtoken_s"] for s in steps) / len(steps) / requests,
            "parts": {"steady": 1e6 * steady_s / requests,
                      "prefill": per_request_step * sum(s["vtoken_s"] - steady_s for s in steps[:first]),
                      "burst": per_request_step * extra(bursts), "reclaim": per_request_step * extra(reclaims),
                      "mixed": per_request_step * extra(mixed)},
            "step_ms": 1e3 * statistics.median(s["wall_s"] for s in after)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1536])
    ap.add_argument("--runs", type=int, default=2, help="seeds per cell (0, 1, ...)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--requests", type=int, default=8, help="requests per batch (the bench steps them together)")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                    help="generated per request: long prompts prefill in chunks, one request after another, so all "
                         "decode together (a steady step) only if each generates more than the others' prefill takes")
    ap.add_argument("--out", help="write every run as JSON here")
    a = ap.parse_args()
    if max(a.contexts) + a.new_tokens > 2048:
        # NOTE: past the byte-llama's 2,048 positions its outputs mean nothing; the costs are what this bench reads
        os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    out = {}
    for name in a.configs:
        for ctx in a.contexts:
            runs = [one_run(CONFIGS[name], ctx, seed, a.requests, a.new_tokens) for seed in range(a.runs)]
            out[f"{name} {ctx}"] = runs
            med = lambda k: statistics.median([r[k] for r in runs if r[k] is not None] or [float("nan")])  # noqa: E731
            parts = {k: statistics.median(r["parts"][k] for r in runs) for k in runs[0]["parts"]}
            print(f"{name:26s} {ctx:5d}: steady {med('steady_us_per_request'):7.1f} us/request/step, burst "
                  f"{med('burst_us_per_evicted_token'):6.2f} us/evicted token ({runs[0]['burst_evicted']} tokens in "
                  f"{runs[0]['burst_steps']} steps), reclaim {med('reclaim_us_per_moved_token'):6.2f} us/moved "
                  f"token ({runs[0]['reclaim_moved']} in {runs[0]['reclaim_steps']} steps; "
                  f"{runs[0]['moves_committed']} moves in all), mean {med('mean_us_per_request'):7.1f} = "
                  + " + ".join(f"{k} {v:.0f}" for k, v in parts.items()) + f", step {med('step_ms'):.1f} ms",
                  flush=True)
    for name in a.configs:
        lo, hi = out[f"{name} {min(a.contexts)}"], out[f"{name} {max(a.contexts)}"]
        g = {k: statistics.median(r[k] for r in hi) / statistics.median(r[k] for r in lo)
             for k in ("steady_us_per_request", "mean_us_per_request")}
        print(f"{name:26s} growth {min(a.contexts)} -> {max(a.contexts)}: steady x{g['steady_us_per_request']:.2f}, "
              f"mean x{g['mean_us_per_request']:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
