"""Q4 (seed §4, question 4, overhead and overlap), vLLM half: what vtoken costs per step next to plain vLLM.

(a) indirection only: vtoken on, nothing evicted, vs plain vLLM; (b) reclamation: Naive-Evict, compact and densify
at ``overhead_policy`` / ``overhead_budget``, vs plain and vs Naive-Evict; (c) strict verify on vs off. Every
configuration's engine lives in a process of its own (``vllm_engine.EngineProcess``; vLLM's KV connector is
process-global), all pinned to one core; a round (one seed, one C) runs each once on the same prompts, in an order
rotated per round, and ratios are taken within a round.

Per run (``runs``): system, concurrency, seed, round, position, vtoken, wall_s, tok_s, decode_steps, p50_ms,
p95_ms (gaps between output steps once every request decodes), gaps_ms. ``summary``: per C the configurations'
medians and spreads and the within-round ratios of ``COMPARISONS``; per configuration vtoken's counters, engine
start seconds, the worker's threads and cores; the pinning.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .stats import nest, percentile, pick, summaries, summarize
from .systems import system_config
from .vllm_engine import EngineProcess, close_all, heldout_windows, one_core

KEY = "q4"
TITLE = "Overhead on real vLLM: indirection only, reclamation, strict verify; each side by side with plain vLLM"
PAPER = {"indirection_only": "throughput and p95 latency within 1.0 % of native vLLM at C=16 and C=48",
         "async_reclamation_vs_naive_evict": "better throughput and decode p95 than Naive-Evict at C=16 and C=48 "
                                             "(a stress test of the overlap, not the steady state)",
         "force_sync": "forcing a CPU wait per relocation copy exposes real blocking per relocation event",
         "concurrency": [16, 48],
         "source": "paper §5.5, Figure 11 (seed review §4.4): vLLM v0.18, Llama-3.1-8B / Mistral-7B, one H100"}
SYSTEMS = ("plain", "on", "naive_evict", "vtoken_compact", "vtoken_densify", "vtoken_compact_strict",
           "vtoken_densify_strict")
Q4_LABELS = {"plain": "plain vLLM", "on": "vtoken on, nothing evicted", "naive_evict": "Naive-Evict (gather, off)",
             "vtoken_compact": "vtoken compact (gather)", "vtoken_densify": "vtoken densify (dense)",
             "vtoken_compact_strict": "vtoken compact + strict verify",
             "vtoken_densify_strict": "vtoken densify + strict verify"}
SHORT = {"plain": "plain", "on": "on", "naive_evict": "Naive-Evict", "vtoken_compact": "compact",
         "vtoken_densify": "densify", "vtoken_compact_strict": "compact+strict",
         "vtoken_densify_strict": "densify+strict"}
COMPARISONS = (  # (part, system, reference): ratios within a round
    ("a", "on", "plain"),
    ("b", "naive_evict", "plain"), ("b", "vtoken_compact", "plain"), ("b", "vtoken_densify", "plain"),
    ("b", "vtoken_compact", "naive_evict"), ("b", "vtoken_densify", "naive_evict"),
    ("c", "vtoken_compact_strict", "vtoken_compact"), ("c", "vtoken_densify_strict", "vtoken_densify"),
    ("c", "vtoken_compact_strict", "plain"), ("c", "vtoken_densify_strict", "plain"),
)
METRICS = ("tok_s", "p50_ms", "p95_ms")
C_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


# ---- the measurement (also tests/bench/bench_vllm_overhead.py's) ---------------------------------------
def run_interleaved(configs: dict[str, dict | None], rounds: list[list[list[int]]], max_tokens: int,
                    block_size: int, threads: int = 1, on_event=None, warmup_tokens: int = 8) -> dict:
    """An ``EngineProcess`` per configuration (None: plain vLLM), all alive; after a warm-up of each round size,
    round i runs its prompts through every configuration in their order rotated by i. Per configuration:
    {"start_s", "torch_threads", "cores", "runs": [{"round", "position", "wall_s", "gaps_s"}], "counters" (over the
    timed rounds)}. ``on_event(note)`` after each start and run."""
    assert configs and rounds, "run_interleaved needs configurations and rounds"
    note = on_event or (lambda _: None)
    longest = max(len(p) for r in rounds for p in r) + max_tokens
    most = max(len(r) for r in rounds)
    res: dict[str, dict] = {}
    engines: dict[str, EngineProcess] = {}
    try:
        for k, cfg in configs.items():
            engines[k] = EngineProcess(cfg, longest, most, block_size, threads)
            res[k] = dict(engines[k].info, runs=[])
            note(f"start {k}")
        first_of_size = {len(r): r for r in reversed(rounds)}
        for e in engines.values():
            for size, r in first_of_size.items():
                e.run_steps(r, warmup_tokens, f"warm{size}")
        before = {k: e.counters() for k, e in engines.items()}
        keys = list(engines)
        for i, prompts in enumerate(rounds):
            order = keys[i % len(keys):] + keys[:i % len(keys)]
            for pos, k in enumerate(order):
                wall, gaps = engines[k].run_steps(prompts, max_tokens, f"r{i}")
                res[k]["runs"].append({"round": i, "position": pos, "wall_s": wall, "gaps_s": gaps})
                note(f"round {i} {k}")
        for k, e in engines.items():
            res[k]["counters"] = {c: v - before[k][c] for c, v in e.counters().items()}
    finally:
        close_all(list(engines.values()))
    return res


# ---- the question --------------------------------------------------------------------------------
def _rounds(s) -> list[tuple[int, int]]:
    """(seed, C) per round: every concurrency once per seed."""
    return [(seed, c) for seed in s.seeds for c in s.q4_concurrency]


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    evidence = str(ctx.out_dir / "q4-vtoken-evidence")
    configs = {x: system_config(x, s.overhead_policy, s.overhead_budget, s.seed, s.score_layers, evidence)
               for x in SYSTEMS}
    rounds = _rounds(s)
    prompts = [[p for p, _ in heldout_windows(c, s.prompt_len, s.q4_max_tokens, seed)] for seed, c in rounds]
    progress = ctx.progress("q4 vllm overhead", len(SYSTEMS) * (1 + len(rounds)))
    with one_core(s.pin) as pinning:
        res = run_interleaved(configs, prompts, s.q4_max_tokens, s.block_size, s.threads,
                              on_event=progress.advance)
    progress.close()
    runs = []
    for x in SYSTEMS:
        for one in res[x]["runs"]:
            seed, c = rounds[one["round"]]
            gaps = one["gaps_s"]
            runs.append({"system": x, "concurrency": c, "seed": seed, "round": one["round"],
                         "position": one["position"], "vtoken": configs[x], "wall_s": round(one["wall_s"], 4),
                         "tok_s": c * s.q4_max_tokens / one["wall_s"], "decode_steps": len(gaps),
                         "p50_ms": 1e3 * percentile(gaps, 50), "p95_ms": 1e3 * percentile(gaps, 95),
                         "gaps_ms": [round(1e3 * g, 4) for g in gaps]})
    engines = {x: {k: res[x][k] for k in ("start_s", "torch_threads", "cores", "counters")} for x in SYSTEMS}
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs,
            "summary": summarize_runs(runs, s, engines, pinning), "notes": notes(s, pinning)}


def ratios(runs: list[dict], system: str, reference: str) -> dict:
    """Within-round ratios of ``system`` to ``reference``: throughput, p50, p95 (median and spread)."""
    ref = {r["round"]: r for r in pick(runs, system=reference)}
    mine = [(r, ref[r["round"]]) for r in pick(runs, system=system)]
    return {name: summarize([a[m] / b[m] for a, b in mine])
            for name, m in (("throughput", "tok_s"), ("p50", "p50_ms"), ("p95", "p95_ms"))}


def summarize_runs(runs: list[dict], s, engines: dict, pinning: dict | None) -> dict:
    by_c = nest(runs, ["concurrency"], lambda rs: {
        "systems": {x: summaries(pick(rs, system=x), METRICS) for x in SYSTEMS},
        "ratios": [{"part": part, "system": x, "reference": ref, **ratios(rs, x, ref)}
                   for part, x, ref in COMPARISONS]})
    return {"by_concurrency": by_c, "engines": engines, "pinning": pinning, "policy": s.overhead_policy,
            "budget": s.overhead_budget, "rounds": len(_rounds(s))}


def notes(s, pinning: dict | None) -> list[str]:
    where = f"pinned to core {pinning['core']} (of {pinning['affinity_before']})" if pinning else "not pinned"
    pin = (f"The bench and every engine process ran {where}, {s.threads} torch thread(s) each; the threads and cores "
           "each engine's worker saw are in summary.engines.")
    return [
        pin,
        ("Each configuration's engine runs in a process of its own (plain vLLM cannot share a process with "
         "vtoken: vLLM's KV connector is process-global), in-process (engine core and worker in that process), "
         "driven step by step there; all are alive for the whole run and only one runs at a time. A round runs "
         "every configuration once on the same prompts, in an order rotated per round; ratios are within a round."),
        (f"Evicting configurations: {s.overhead_policy} at budget {s.overhead_budget} (re-evicted every decode step "
         f"after the prompt), vtoken seed {s.seed} per engine for the whole run. Naive-Evict and compact read "
         "through the gather attention impl (plain torch); densify reads through vLLM's stock CPU kernel, so "
         "densify vs Naive-Evict mixes reclamation cost with the read path's."),
        ("Force-sync vs async copy ordering is not measured here: vtoken inside vLLM refuses force-sync ordering by "
         "design (integration/vllm/worker_copies.py); that ablation is measured at the device layer."),
        ("Strict verify hashes every moved token's K/V in every layer at source and destination and audits every "
         "write slot; it is a staging setting, not a serving one."),
        ("A 0.85 M-parameter model on CPU: a step takes milliseconds, so a fixed per-step cost is a far larger "
         "share than on a production model's GPU step (the paper's setting)."),
    ]


# ---- output -------------------------------------------------------------------------------------
def table(report: dict) -> list[str]:
    sm = report["summary"]
    by_c = sm["by_concurrency"].items()
    ratios = [[c, r["part"], Q4_LABELS[r["system"]], SHORT[r["reference"]],
               *(fmt_spread(r[m]) for m in ("throughput", "p50", "p95"))] for c, b in by_c for r in b["ratios"]]
    medians = [[c, Q4_LABELS[x], fmt_spread(m["tok_s"], "{:,.0f}"), fmt_spread(m["p50_ms"], "{:.2f}"),
                fmt_spread(m["p95_ms"], "{:.2f}")] for c, b in by_c for x, m in b["systems"].items()]
    engines = []
    for x, e in sm["engines"].items():
        k = e["counters"]
        work = ([f"{k['tokens_evicted']:,}", f"{k['relocations']:,}", f"{k['verified']:,} / {k['mismatches']}",
                 f"{1e3 * (k['scheduler_seconds'] + k['worker_seconds']) / max(1, k['vtoken_steps']):.3f}"]
                if k else ["–"] * 4)
        engines.append([Q4_LABELS[x], f"{e['start_s']:.1f}", f"{e['torch_threads']} / {e['cores']}", *work])
    p = sm["pinning"]
    return (markdown(("C", "part", "configuration", "vs", "throughput ×", "step p50 ×", "step p95 ×"), ratios) + [""]
            + markdown(("C", "configuration", "tok/s", "step p50 (ms)", "step p95 (ms)"), medians) + [""]
            + markdown(("configuration", "engine start (s)", "worker threads / cores", "tokens evicted", "relocations",
                        "verified / mismatches", "vtoken ms per step (scheduler + worker)"), engines)
            + [f"\nMedian (min–max) over {sm['rounds'] // len(sm['by_concurrency'])} seeds; ratios within a round. "
               f"Policy {sm['policy']} at budget {sm['budget']}. "
               + (f"Pinned to core {p['core']}. " if p else "Not pinned. ")
               + "Counters are over all timed rounds (every C). Force-sync vs async ordering: refused inside vLLM by "
                 "design, measured at the device layer. Paper: indirection only within 1.0 % of native vLLM "
                 "(throughput and p95) at C=16 and 48."])


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]
    shown = [x for x in SYSTEMS if x != "plain"]
    cs = list(sm["by_concurrency"])

    def panel(metric: str, ylabel: str) -> Panel:
        series = {}
        for c in cs:
            by = {r["system"]: r for r in sm["by_concurrency"][c]["ratios"] if r["reference"] == "plain"}
            series[f"C={c}"] = [by[x][metric] for x in shown]
        return Panel(series, ylabel, [SHORT[x] for x in shown],
                     colors={f"C={c}": C_COLORS[i % len(C_COLORS)] for i, c in enumerate(cs)},
                     steps=[do("axhline", 1.0, color="k", lw=1, ls="--"),
                            do("tick_params", axis="x", labelrotation=15), do("legend", fontsize=7)])
    p = sm["pinning"]
    figure(path, [[panel("throughput", "throughput / plain vLLM (same round)"),
                   panel("p95", "decode step p95 / plain vLLM (same round)")]],
           f"Q4 overhead on vLLM CPU, byte-llama ({sm['policy']} {sm['budget']}; median, min–max over seeds; "
           + (f"pinned to core {p['core']})" if p else "not pinned)"), figsize=(14, 4.5))
