"""How vtoken's per-step cost grows with the number of running requests, and what the gather read path's
attention costs next to vLLM's stock CPU kernel. In-process engines, all with vtoken on (vLLM's KV connector
is process-global, so plain vLLM is measured in bench_vllm_overhead.py instead).

    python tests/bench_vllm_scaling.py [--concurrency 16 32 64 128 256] [--tokens 48]

On a shared machine pin it to one core (``taskset -c 1 python ...``): a parallel op whose second thread is
descheduled waits a whole time slice, which swamps everything measured here.

Table 1, per configuration and concurrency C (C requests, max_num_seqs = C): engine step time, and the
time spent in vtoken per step on the scheduler side (table sync, victim choice, planning) and on the worker
side (copies, slot mapping, read plans), with its share of the step.
Table 2: attention time per step (all layers, measured around the attention impl's forward) for the stock
kernel (dense read path) and vtoken's gather impl reading the same tokens, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {
    "indirection only": {"policy": "none"},
    "random 0.5, densify": {"policy": "random", "budget": 0.5},
    "h2o 0.5, densify (score pass)": {"policy": "h2o", "budget": 0.5},
    "random 0.5, gather, compact": {"policy": "random", "budget": 0.5, "read_path": "gather", "reclaim": "compact"},
}
KERNELS = {"stock kernel (dense)": {"policy": "none"}, "gather impl": {"policy": "none", "read_path": "gather"}}


def time_attention(worker) -> str:
    """Wrap every attention impl's forward with a timer (worker process)."""
    import time as t
    runner = worker.model_runner
    TIMES.clear()
    TIMES.append(0.0)
    for _, mod in runner.model.named_modules():
        impl = getattr(mod, "impl", None)
        if impl is None or not hasattr(impl, "forward") or getattr(impl, "_timed", False):
            continue
        real = impl.forward

        def forward(*a, _real=real, **k):
            t0 = t.perf_counter()
            out = _real(*a, **k)
            TIMES[0] += t.perf_counter() - t0
            return out
        impl.forward, impl._timed = forward, True
    return "ok"


TIMES: list[float] = []


def read_worker(worker) -> tuple[float, float]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    return get_kv_transfer_group().worker.seconds, (TIMES[0] if TIMES else 0.0)


def measure(cfg: dict, c: int, tokens: int, kernel: bool = False) -> dict:
    import vllm_harness as H
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm = H.make_llm(cfg, False, max_num_seqs=c, max_model_len=512)
    try:
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + 3 * j) % 500 + 3 for j in range(32 + i % 17)])
                   for i in range(c)]
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up with the same batch shapes (kernels built per shape)
        if kernel:
            llm.collective_rpc(time_attention)
        tokens_state = H.scheduler_connector(llm).tokens
        s0, steps0 = tokens_state.stats.seconds, tokens_state.stats.steps
        w0, a0 = llm.collective_rpc(read_worker)[0]
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        w1, a1 = llm.collective_rpc(read_worker)[0]
        steps = tokens_state.stats.steps - steps0
        return {"step_ms": 1e3 * wall / steps, "sched_ms": 1e3 * (tokens_state.stats.seconds - s0) / steps,
                "worker_ms": 1e3 * (w1 - w0) / steps, "attn_ms": 1e3 * (a1 - a0) / steps, "steps": steps}
    finally:
        del llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kernel-concurrency", type=int, nargs="+", default=[16, 64, 256])
    a = ap.parse_args()
    print(f"vtoken time per engine step, C requests x {a.tokens} generated tokens (prompts 32-48 tokens)")
    print(f"  {'configuration':<32} {'C':>4} {'step ms':>8} {'sched ms':>9} {'worker ms':>10} {'vtoken %':>9}")
    for name, cfg in CONFIGS.items():
        for c in a.concurrency:
            m = measure(cfg, c, a.tokens)
            share = 100 * (m["sched_ms"] + m["worker_ms"]) / m["step_ms"]
            print(f"  {name:<32} {c:>4} {m['step_ms']:8.2f} {m['sched_ms']:9.3f} {m['worker_ms']:10.3f} "
                  f"{share:8.1f}%", flush=True)
    print("attention time per engine step (both layers), same tokens read")
    print(f"  {'C':>4} {'stock ms':>9} {'gather ms':>10} {'gather/stock':>13}")
    for c in a.kernel_concurrency:
        stock = measure(KERNELS["stock kernel (dense)"], c, a.tokens, kernel=True)["attn_ms"]
        gather = measure(KERNELS["gather impl"], c, a.tokens, kernel=True)["attn_ms"]
        print(f"  {c:>4} {stock:9.2f} {gather:10.2f} {gather / stock:12.1f}x", flush=True)


if __name__ == "__main__":
    main()
