"""Q9 (issue #17): the OpenAI-compatible server under load, vtoken off and on, on 127.0.0.1.

Per configuration one ``vtoken serve`` (``server.ServerProcess``) and ``q9_clients`` closed-loop streaming clients
(httpx) sending held-out prompts until ``q9_seconds`` pass: an untimed warm-up round, then a timed window per seed.
Configurations: plain (vtoken off), Naive-Evict, compact, densify at ``overhead_policy`` / ``overhead_budget``.

Per run (``runs``): system, seed, requests, tokens, wall_s, throughput_tok_s, requests_s, ttft_p50_ms /
ttft_p95_ms (send to first chunk), itl_p50_ms / itl_p95_ms (gaps between a request's chunks), tpot_p50_ms /
tpot_p95_ms (first to last chunk over the tokens after the first); a failed request fails the run. ``summary``:
per configuration the medians and spreads, throughput relative to plain, the server's ``SERVER_COUNTERS``.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .server import MODEL, ServerProcess
from .stats import percentile, pick, summaries, summarize
from .systems import COLORS, LABELS, system_config
from .vllm_engine import heldout_windows

KEY = "q9"
TITLE = "the OpenAI-compatible server under load: throughput, TTFT and inter-token latency, vtoken off and on"
PAPER = {"note": "the paper reports no served-load numbers; §4.4 puts the indirection's cost below 1 % of a step"}
SYSTEMS = ("plain", "naive_evict", "vtoken_compact", "vtoken_densify")
Q9_LABELS = {**LABELS, "plain": "vtoken off"}
Q9_COLORS = {**COLORS, "plain": COLORS["native"]}
METRICS = ("throughput_tok_s", "requests_s", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms",
           "tpot_p50_ms", "tpot_p95_ms")
LATENCIES = METRICS[2:]
SERVER_COUNTERS = ("vtoken_tokens_evicted_total", "vtoken_plans_committed_total", "vtoken_blocks_released_total",
                   "vtoken_tokens_moved_total", "num_preemptions_total")


async def _one_request(client, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: send time, chunk arrival times, completion tokens (from the usage chunk)."""
    body = {"model": MODEL, "prompt": [2, *prompt], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, stamps, usage = time.perf_counter(), [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            else:
                stamps.append(time.perf_counter())
    if usage is None or usage["completion_tokens"] != max_tokens or not stamps:
        return {"error": f"ended early: usage {usage}, {len(stamps)} chunks"}
    return {"sent": sent, "stamps": stamps, "tokens": usage["completion_tokens"]}


async def _window(base: str, prompts: list[list[int]], clients: int, seconds: float,
                  max_tokens: int) -> tuple[float, list[dict]]:
    """(when the window started, every request's timings)."""
    import httpx
    done: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=clients)) as client:
        start = time.perf_counter()

        async def closed_loop(i: int) -> None:
            k = i
            while True:  # at least one request each (seconds = 0: a warm-up round)
                done.append(await _one_request(client, prompts[k % len(prompts)], max_tokens))
                k += clients
                if time.perf_counter() - start >= seconds:
                    return
        await asyncio.gather(*(closed_loop(i) for i in range(clients)))
    return start, done


def window_metrics(start: float, done: list[dict]) -> dict:
    """The run's fields (module docstring) from the window's start and its requests' timings."""
    ok = [d for d in done if "error" not in d]
    errors = [d["error"] for d in done if "error" in d]
    assert ok, f"no request of the window succeeded: {errors[:3]}"
    wall = max(d["stamps"][-1] for d in ok) - start
    ttft = [1e3 * (d["stamps"][0] - d["sent"]) for d in ok]
    itl = [1e3 * (b - a) for d in ok for a, b in zip(d["stamps"], d["stamps"][1:])]
    tpot = [1e3 * (d["stamps"][-1] - d["stamps"][0]) / (d["tokens"] - 1) for d in ok if d["tokens"] > 1]
    tokens = sum(d["tokens"] for d in ok)
    out = {"requests": len(ok), "tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall,
           "requests_s": len(ok) / wall, "errors": errors}
    for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot)):
        out |= {f"{name}_p50_ms": percentile(xs, 50) if xs else 0.0, f"{name}_p95_ms": percentile(xs, 95) if xs else 0.0}
    return out


def measure_window(base: str, prompts: list[list[int]], clients: int, seconds: float, max_tokens: int) -> dict:
    """One timed window against the server at ``base``: the run's fields (module docstring)."""
    return window_metrics(*asyncio.run(_window(base, prompts, clients, seconds, max_tokens)))


def serve_load(vtoken: dict | None, log_path: Path, prompt_sets: list[list[list[int]]], clients: int,
               seconds: float, max_tokens: int, on_done=None) -> dict:
    """One server: a warm-up round, then one timed window per prompt set. Returns {"windows": [run fields],
    "counters": the SERVER_COUNTERS at the end}."""
    with ServerProcess(vtoken, log_path, request_timeout_s=120) as server:
        asyncio.run(_window(server.base, prompt_sets[0][:clients], clients, 0.0, max_tokens))  # warm-up
        windows = []
        for prompts in prompt_sets:
            windows.append(measure_window(server.base, prompts, clients, seconds, max_tokens))
            if windows[-1]["errors"]:
                raise RuntimeError(f"{len(windows[-1]['errors'])} failed request(s): {windows[-1]['errors'][:3]}; "
                                   f"server log {log_path}")
            if on_done:
                on_done()
        m = server.metrics()
        assert server.alive(), server.tail()
    return {"windows": windows, "counters": {k: m.get(f"vllm:{k}", 0.0) for k in SERVER_COUNTERS}}


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    evidence = str(ctx.out_dir / "q9-vtoken-evidence")
    # enough prompts that no client repeats one in a window (no prefix-cache hits between requests)
    n_prompts = s.q9_clients * max(8, int(4 * s.q9_seconds))
    sets = [[p for p, _ in heldout_windows(n_prompts, s.q9_prompt_len, 0, seed)] for seed in s.seeds]
    progress = ctx.progress("q9 serving load", len(SYSTEMS) * s.repeats)
    runs, counters = [], {}
    for x in SYSTEMS:
        cfg = system_config(x, s.overhead_policy, s.overhead_budget, s.seed, s.score_layers, evidence)
        res = serve_load(cfg, ctx.out_dir / f"q9-server-{x}.log", sets, s.q9_clients, s.q9_seconds,
                         s.q9_max_tokens, on_done=lambda note=x: progress.advance(note))
        runs += [{"system": x, "seed": seed, "vtoken": cfg, **{k: v for k, v in w.items() if k != "errors"}}
                 for seed, w in zip(s.seeds, res["windows"])]
        counters[x] = res["counters"]
    progress.close()
    base = summarize([r["throughput_tok_s"] for r in pick(runs, system="plain")])["median"]
    systems = {x: {**summaries(pick(runs, system=x), METRICS),
                   "throughput_vs_plain": summarize([r["throughput_tok_s"] / base for r in pick(runs, system=x)]),
                   "counters": counters[x]} for x in SYSTEMS}
    summary = {"systems": systems, "policy": s.overhead_policy, "budget": s.overhead_budget}
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summary, "notes": notes(s)}


def notes(s) -> list[str]:
    return [
        (f"{s.q9_clients} closed-loop streaming clients for {s.q9_seconds:g} s per window, one window per seed "
         f"({s.repeats}), after an untimed warm-up round; prompts of {s.q9_prompt_len} held-out bytes, "
         f"{s.q9_max_tokens} generated, ignore_eos; no prompt repeats within a window."),
        ("The server (API process, engine core, worker) and the clients share this machine's cores, unpinned; "
         "configurations run one after another, so machine noise between them is not cancelled (the spread is "
         "within a configuration)."),
        (f"Eviction: {s.overhead_policy} at budget {s.overhead_budget}; strict verify off. vLLM's default pool "
         "(VLLM_CPU_KVCACHE_SPACE=1 GiB) holds every request whole: no memory pressure, so this measures what "
         "vtoken costs, not the capacity it frees (Q3 and Q6 measure that)."),
        ("TTFT: send to the first streamed chunk; ITL: gaps between a request's chunks (a chunk carries every "
         "token since the previous one, so a server that falls behind sends fewer, fuller chunks); TPOT: per "
         "request, first to last chunk over the tokens after the first. Percentiles over every request (TTFT, "
         "TPOT) or gap (ITL) of the window, then median and spread over windows."),
    ]


# ---- output -------------------------------------------------------------------------------------
HEADER = ("configuration", "output tokens/s", "vs vtoken off", "requests/s", "TTFT p50 (ms)", "TTFT p95 (ms)",
          "ITL p50 (ms)", "ITL p95 (ms)", "TPOT p50 (ms)", "TPOT p95 (ms)", "evicted", "plans", "blocks released",
          "preemptions")


def table(report: dict) -> list[str]:
    sm = report["summary"]["systems"]
    rows = [[Q9_LABELS[x], fmt_spread(m["throughput_tok_s"], "{:.0f}"), fmt_spread(m["throughput_vs_plain"], "{:.2f}"),
             fmt_spread(m["requests_s"], "{:.2f}"), *(fmt_spread(m[k], "{:.1f}") for k in LATENCIES),
             *(f"{m['counters'][k]:.0f}" for k in SERVER_COUNTERS if k != "vtoken_tokens_moved_total")]
            for x in SYSTEMS for m in [sm[x]]]
    return markdown(HEADER, rows) + [f"\nMedian (min–max) over windows (seeds). Policy {report['summary']['policy']} "
                                     f"at budget {report['summary']['budget']}; counters over the whole server run "
                                     f"(warm-up included)."]


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]["systems"]
    figure(path, [[Panel({x: [sm[x]["throughput_tok_s"]] for x in SYSTEMS}, "tokens per second", ["output tokens/s"],
                         colors=Q9_COLORS, labels=Q9_LABELS),
                   Panel({x: [sm[x][k] for k in LATENCIES] for x in SYSTEMS}, "milliseconds",
                         ["TTFT p50", "TTFT p95", "ITL p50", "ITL p95", "TPOT p50", "TPOT p95"], colors=Q9_COLORS,
                         labels=Q9_LABELS, steps=[do("set_yscale", "log"), do("legend", fontsize=8)])]],
           "Q9 vtoken serve under load on vLLM CPU, byte-llama (median, min–max over windows)",
           gridspec_kw={"width_ratios": [1, 2]})
