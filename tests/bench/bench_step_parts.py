"""Where a steady step's host time goes inside vLLM, by part: the scheduler's and the workers' vtoken calls, timed.

    python tests/bench/bench_step_parts.py [--context 1536] [--requests 64] [--core] [--gather] [--policy P]
    VTOKEN_TREE=/path/to/another/checkout python tests/bench/bench_step_parts.py    # the same, on that tree's code

``bench_step_decomposition.py`` splits whole steps into steady, burst and reclaim; this one opens a steady step up.
One engine (the byte-llama, ``--policy`` (Random) at 0.5, dense + densify or with ``--gather`` gather + compact, fast
path unless ``--core``), ``--requests`` prompts of
``--context`` tokens and 48 generated, one pinned core; after the first decode step's burst every step with all
requests running is timed, and each part below is wrapped in a timer (``perf_counter`` around the call: about
0.1 µs a call, so the parts read a little high). Prints vtoken's scheduler and worker µs per request-step as the
connector counts them, then each part's. Parts nest (``after_step`` holds ``evict_and_reclaim``).

To compare two commits, run it alternately on both trees in one session (``git worktree add /tmp/base COMMIT``,
then ``VTOKEN_TREE=/tmp/base``): this machine's speed moves by a third between hours. ``VTOKEN_TREE`` points the
editable install's ``vtoken`` packages at the other checkout for this process only.
"""
from __future__ import annotations

import argparse
import collections
import os
import time

if os.environ.get("VTOKEN_TREE"):  # before anything imports vtoken
    import __editable___vtoken_0_1_0_finder as finder
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name, path in finder.MAPPING.items():
        finder.MAPPING[name] = path.replace(here, os.environ["VTOKEN_TREE"])

PARTS = {  # module: {class: [methods]}
    "vtoken.integration.vllm.connector": {"VTokenConnector": ["get_kv_connector_stats"]},
    "vtoken.integration.vllm.scheduler_tokens": {"SchedulerTokens": ["on_schedule", "after_step", "_committed",
                                                                      "on_reports"]},
    "vtoken.integration.vllm.worker_copies": {"ShardReports": ["settle"]},
    "vtoken.integration.fastpath.runtime": {"FastRuntime": ["sync_many", "evict_and_reclaim", "_commit", "bridge",
                                                            "gaps"]},
    "vtoken.integration.fastpath.gather_runtime": {"GatherRuntime": ["evict_and_reclaim", "read_step",
                                                                      "_launch_and_commit", "_release_dead"]},
    "vtoken.integration.fastpath.gather": {"FastGather": ["plan_round", "round", "movable", "commit",
                                                          "commit_counted"]},
    "vtoken.integration.fastpath.table": {"FastTable": ["evict_gather_step"]},
    "vtoken.integration.vllm.worker_tokens": {"WorkerTokens": ["apply", "_map_through_table", "_patch_reads",
                                                               "_read_plan"]},
    "vtoken.integration.device.copy_engine": {"TorchCopyEngine": ["run_batch", "submit_batch", "_launch_wave",
                                                                  "_launch"]},
    "vtoken.integration.fastpath.relocate": {"HostMover": ["__call__"]},
}


def instrument(seconds: collections.Counter, timing: list[bool]) -> None:
    import importlib

    for module, classes in PARTS.items():
        mod = importlib.import_module(module)
        for cls_name, methods in classes.items():
            cls = getattr(mod, cls_name)
            for name in methods:
                if not hasattr(cls, name):  # an older tree (``VTOKEN_TREE``) may lack it
                    continue
                wrapped, label = getattr(cls, name), f"{cls_name}.{name}"

                def timed(*a, _f=wrapped, _label=label, **k):
                    if not timing[0]:
                        return _f(*a, **k)
                    t = time.perf_counter()
                    try:
                        return _f(*a, **k)
                    finally:
                        seconds[_label] += time.perf_counter() - t
                setattr(cls, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--core", action="store_true", help="the core's runtime (fast_path: false)")
    ap.add_argument("--gather", action="store_true", help="the gather path, compact (read_path: gather)")
    ap.add_argument("--policy", default="random", choices=["random", "streaming_llm"])
    args = ap.parse_args()
    seconds, timing = collections.Counter(), [False]
    instrument(seconds, timing)
    from vtoken.integration.bench.vllm_engine import engine_args, engine_environment, heldout_windows, one_core, \
        start_llm

    R, new = args.requests, 48
    cfg = {"policy": args.policy, "budget": 0.5, **({"fast_path": False} if args.core else {}),
           **({"read_path": "gather", "reclaim": "compact"} if args.gather else {})}
    with engine_environment(1), one_core():
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [p for p, _ in heldout_windows(R, args.context, new, 0)]
        llm = start_llm(**engine_args(cfg, args.context + new, R, 32))
        try:
            engine = llm.llm_engine
            core = engine.engine_core.engine_core
            conn, scheduler = core.scheduler.connector, core.scheduler
            params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
            warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], warm, use_tqdm=False)  # untimed
            for i, p in enumerate(prompts):
                engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), params)
            burst = False
            while True:  # prefill and the first decode step's burst, untimed
                before = conn.tokens.stats.evicted
                engine.step()
                evicted = conn.tokens.stats.evicted - before
                burst = burst or evicted > R
                if burst and evicted <= R:
                    break
            request_steps = steps = 0
            s0, w0 = conn.tokens.stats.seconds, conn.workers.seconds
            while engine.has_unfinished_requests() and len(scheduler.running) == R:
                timing[0] = True
                engine.step()
                timing[0] = False
                steps, request_steps = steps + 1, request_steps + R
            s1, w1 = conn.tokens.stats.seconds, conn.workers.seconds
        finally:
            llm.llm_engine.engine_core.shutdown()
    import vtoken.integration.fastpath as fp
    print(f"tree {os.path.dirname(os.path.dirname(os.path.dirname(fp.__file__)))}; {conn.tokens.runtime_note}")
    print(f"{steps} steady steps x {R} requests, {args.context}-token prompts: scheduler "
          f"{(s1 - s0) / request_steps * 1e6:.2f} us per request-step, workers {(w1 - w0) / request_steps * 1e6:.2f}")
    for label, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {label:34s} {s / request_steps * 1e6:7.2f}")


if __name__ == "__main__":
    main()
