"""vtoken's share of the engine step at tensor parallelism 1 and 2, on the same workload (issue #22).

    python tests/bench/bench_tp_share.py        (about 2 minutes on 2 cores)

8 requests of 512-token prompts (the tiny Llama, 32-token blocks), 32 generated tokens, greedy; one untimed
warm-up pass, then 5 timed passes on the same engine (other prompts each), summed. vtoken's time is the scheduler side's (``SchedulerTokens``:
eviction, planning, orders) plus the workers' (copies, verification, read lists, scores; the slowest rank each
step, ``VTokenWorkerMeta.aggregate``); its share is that over the pass's wall time. TP 2 runs two workers with a
core each; TP 1 one worker (the engine core on the other core). Systems: Random + densify (dense path, no
exchange between ranks) and H2O + gather + compact (the ranks all-reduce their attention rows every step)."""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: vllm_harness
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

import vllm_harness as H  # noqa: E402

PASSES = 5  # timed passes per engine, summed
SYSTEMS = {"random + densify": {"policy": "random", "budget": 0.5, "seed": 3},
           "h2o + gather + compact": {"policy": "h2o", "budget": 0.5, "read_path": "gather", "reclaim": "compact",
                                      "seed": 3}}


def prompts(n: int, length: int, seed: int):
    from vllm.inputs import TokensPrompt
    return [TokensPrompt(prompt_token_ids=[(31 * seed + 7 * i + 3 * j) % 500 + 3 for j in range(length)])
            for i in range(n)]


def measure(cfg: dict, tp: int) -> dict:
    from vllm import SamplingParams
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
    over = H.TP2 if tp == 2 else {}
    llm = H.make_llm(cfg, False, max_model_len=1024, **over)
    try:
        conn = H.scheduler_connector(llm)
        params = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0)
        llm.generate(prompts(8, 512, 0), params, use_tqdm=False)  # warm-up
        wall = sched = work = 0.0
        for seed in range(1, 1 + PASSES):
            s0, w0 = conn.tokens.stats.seconds, conn.workers.seconds
            t0 = time.perf_counter()
            llm.generate(prompts(8, 512, seed), params, use_tqdm=False)
            wall += time.perf_counter() - t0
            sched, work = sched + conn.tokens.stats.seconds - s0, work + conn.workers.seconds - w0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {"wall_s": round(wall, 3), "scheduler_s": round(sched, 4), "workers_s": round(work, 4),
            "share": round((sched + work) / wall, 4)}


def main() -> None:
    out = {}
    for name, cfg in SYSTEMS.items():
        for tp in (1, 2):
            out[f"{name}, TP {tp}"] = m = measure(cfg, tp)
            print(f"{name}, TP {tp}: {json.dumps(m)}", flush=True)
    print("| system | TP | wall (s) | vtoken, scheduler side (s) | vtoken, workers (s) | vtoken's share |")
    print("|---|---|---|---|---|---|")
    for key, m in out.items():
        name, tp = key.rsplit(", TP ", 1)
        print(f"| {name} | {tp} | {m['wall_s']:.2f} | {m['scheduler_s']:.3f} | {m['workers_s']:.3f} | "
              f"{m['share']:.1%} |")


if __name__ == "__main__":
    main()
