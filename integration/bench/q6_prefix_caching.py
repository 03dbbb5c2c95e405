"""Q6 (seed §4, question 6, the prefix-caching half) on real vLLM: does vtoken stay correct with vLLM's prefix
caching on, and how does it treat the blocks that requests share?

Per seed ``q6_prefix_groups`` held-out prefixes (``q6_prefix_len``), each followed by ``q6_prefix_requests``
private ``q6_suffix_len``-byte suffixes; each group's first request runs first, then the others (prefix-cache
hits). The full cache and, per policy of ``q6_prefix_policies``, Naive-Evict, compact and densify (strict verify,
quarantine), each with caching on and off on the same requests.

Per (system, policy, caching, seed) (``runs``): cached_tokens, hit_requests, hits_per_later_request,
prompt_tokens, computed_prompt_tokens, identical_to_naive / same_tokens_as_naive, identical_to_off /
same_tokens_as_off, max_abs_logprob_diff_vs_*, vtoken's counters (``q6_quality.COUNTERS``), uncached and
no_plan_<reason> (``shared_block_counters``), prompts. ``summary``: medians and spreads, the comparisons' totals.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from vtoken.core.plan import NoPlanReason

from .q6_quality import COUNTERS, EVICTING, Q6_LABELS, _text, compare, vtoken_config
from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .stats import pick, summaries, totals
from .vllm_engine import heldout_windows, run_engine

KEY = "q6_prefix"
TITLE = "Prefix caching on real vLLM (byte-llama, greedy): hits, identity and strict verify over shared prefixes"
PAPER = {"retained_blocks_reduction_vs_naive_evict_with_prefix_caching": [0.286, 0.422],
         "prefix_hit_rate": "the same for vToken and Naive-Evict",
         "shared_prefix_candidates": "all skipped at sharing degree >= 2; every consistency check passed",
         "source": "paper §5.7 (seed §4.6): 8K-token shared prefix + 8K private suffix at sharing degrees 1, 2, 4, "
                   "8; shared-prefix blocks excluded from relocation, gains from private-suffix reclamation only"}
NO_PLAN = tuple(f"no_plan_{r.name.lower()}" for r in NoPlanReason)
SHARED = ("uncached",) + NO_PLAN
PER_SEED = ("hits_per_later_request", "hit_rate", "computed_prompt_tokens", "tokens_evicted", "relocations",
            "same_share_as_off", "wall_s")
HITS = ("cached_tokens", "prompt_tokens", "requests", "first_requests", "hit_requests", "first_hit_requests",
        "later_hit_requests")
CACHING = ("on", "off")
CACHING_COLORS = {"on": "#2ca02c", "off": "#7f7f7f"}
CACHING_LABELS = {"on": "prefix caching on", "off": "prefix caching off"}
HEADER = ("policy", "system", "prefix cache", "hit tokens / later request", "prompt tokens computed / seed",
          "tokens evicted / seed", "relocations, all seeds (verified / mismatches / quarantined)", "hashes dropped",
          "no plan: no candidates / shared", "same bytes as caching off")


def shared_block_counters(llm) -> dict:
    """(``run_engine(counters=...)``) What vtoken's scheduler exposes about shared and prefix-cached blocks:
    blocks whose prefix-cache hash was dropped because densify wrote into them (``uncached``), and reclamation
    plans not made, per reason: compact never takes a shared block as a source (so ``no_candidates`` when only
    shared ones qualify), densify refuses a plan that would touch one (``shared_block``)."""
    tokens = llm.llm_engine.engine_core.engine_core.scheduler.connector.tokens
    no_plan = tokens.rt.reclaim_stats.no_plan
    return {"uncached": tokens.stats.uncached, **{k: no_plan[r] for k, r in zip(NO_PLAN, NoPlanReason)}}


def workload(s, seed: int) -> list[list[list[int]]]:
    """One seed's groups: ``q6_prefix_groups`` lists of ``q6_prefix_requests`` prompts, each the group's shared
    prefix (``q6_prefix_len`` spread over the groups) followed by its own ``q6_suffix_len`` held-out bytes."""
    lo, hi = s.q6_prefix_len
    n, k, suffix = s.q6_prefix_groups, s.q6_prefix_requests, s.q6_suffix_len
    groups = []
    for g, (head, tail) in enumerate(heldout_windows(n, hi, k * suffix, seed)):
        row, cut = head + tail, lo + (hi - lo) * g // max(1, n - 1)
        groups.append([row[:cut] + row[cut + i * suffix:cut + (i + 1) * suffix] for i in range(k)])
    return groups


def submission(groups: list[list[list[int]]]) -> tuple[list[tuple[int, int]], list[list[list[int]]]]:
    """(group, member) of each request in submission order, and the two prompt sets: every group's first request,
    then the rest (which find their group's prefix cached)."""
    order = [(g, 0) for g in range(len(groups))] + [(g, i) for g, grp in enumerate(groups) for i in range(1, len(grp))]
    return order, [[groups[g][i] for g, i in order[:len(groups)]], [groups[g][i] for g, i in order[len(groups):]]]


# ---- the run ------------------------------------------------------------------------------------
def configs(s) -> list[tuple[str, str | None]]:
    return [("full", None)] + [(x, p) for p in s.q6_prefix_policies for x in EVICTING]


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    evidence = str(ctx.out_dir / "q6_prefix-vtoken-evidence")
    work = {seed: submission(workload(s, seed)) for seed in s.seeds}
    prompt_sets = [ps for seed in s.seeds for ps in work[seed][1]]
    engines = [(x, p, c) for x, p in configs(s) for c in CACHING]
    progress = ctx.progress("q6 vllm prefix caching", len(engines) * len(prompt_sets))
    raw: dict[tuple, dict] = {}
    for system, policy, caching in engines:
        budget = s.q6_prefix_budget if policy else None
        cfg = vtoken_config(system, policy, budget, s.seed, s.score_layers, evidence)
        note = f"{system} {policy or ''} caching {caching}"
        res = run_engine(cfg, prompt_sets, s.q6_prefix_max_tokens, s.block_size, s.threads,
                         on_done=lambda i, note=note: progress.advance(note), prefix_caching=caching == "on",
                         counters=shared_block_counters)
        for k, seed in enumerate(s.seeds):
            first, rest = res["sets"][2 * k:2 * k + 2]
            raw[(system, policy, caching, seed)] = {
                "outputs": first["outputs"] + rest["outputs"], "cached": first["cached_tokens"] + rest["cached_tokens"],
                "counters": {c: first["counters"][c] + rest["counters"][c] for c in first["counters"]},
                "wall_s": first["wall_s"] + rest["wall_s"], "vtoken": cfg, "engine_start_s": res["start_s"]}
    progress.close()

    runs = []
    for (system, policy, caching, seed), one in raw.items():
        order, (firsts, rest) = work[seed]
        prompts = firsts + rest
        cached, n_first = one["cached"], len(firsts)
        prompt_tokens = sum(len(p) for p in prompts)
        rec = {"system": system, "policy": policy or "none", "budget": s.q6_prefix_budget if policy else 1.0,
               "caching": caching, "seed": seed, "vtoken": one["vtoken"],
               "engine_start_s": round(one["engine_start_s"], 3), "wall_s": round(one["wall_s"], 3),
               "requests": len(prompts), "first_requests": n_first, "prompt_tokens": prompt_tokens,
               "cached_tokens": sum(cached), "computed_prompt_tokens": prompt_tokens - sum(cached),
               "hit_rate": sum(cached) / prompt_tokens, "hit_requests": sum(c > 0 for c in cached),
               "first_hit_requests": sum(c > 0 for c in cached[:n_first]),
               "later_hit_requests": sum(c > 0 for c in cached[n_first:]),
               "hits_per_later_request": statistics.fmean(cached[n_first:]),
               "all_finished_by_length": all(o[2] == "length" and len(o[0]) == s.q6_prefix_max_tokens
                                             for o in one["outputs"]),
               **one["counters"]}
        if system in ("vtoken_compact", "vtoken_densify"):
            rec |= compare(one["outputs"], raw[("naive_evict", policy, caching, seed)]["outputs"], "naive")
        if caching == "on":
            rec |= compare(one["outputs"], raw[(system, policy, "off", seed)]["outputs"], "off")
            rec["same_share_as_off"] = rec["same_tokens_as_off"] / len(prompts)
        rec["prompts"] = [{"group": g, "member": i, "prompt_len": len(p), "cached_tokens": c, "output": _text(o[0])}
                          for (g, i), p, c, o in zip(order, prompts, one["cached"], one["outputs"])]
        runs.append(rec)
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summarize_runs(runs, s),
            "notes": NOTES}


NOTES = [
    ("Per seed, each group's first request runs alone (with the other groups' first requests), then the rest: "
     "they find the group's prefix in vLLM's prefix cache. hits_per_later_request is the mean of their "
     "num_cached_tokens; vLLM caches whole 32-token blocks, so a 96-128-byte prefix gives 96 or 128."),
    ("Naive-Evict and vtoken compact read through the gather path, which reads each request's live slots: a "
     "request may evict tokens of a block it shares, the others still read them. Compact never takes a shared "
     "block as a source (its plans find no candidates then), so with caching on it relocates only private blocks."),
    ("vtoken densify reads through vLLM's stock kernel, which reads every slot below the cursor: tokens in a block "
     "other requests share are protected from eviction (they cannot become holes), and a block densify writes "
     "into loses its prefix-cache hash (uncached). So with caching on densify evicts fewer tokens of a request "
     "that shares its prefix than with caching off, and can generate other bytes: same_tokens_as_off counts it. "
     "A first request's prompt blocks that densify rewrote are not hit later; a sibling computing the prefix in "
     "the same step is."),
    ("Every system serves all seeds from one engine per caching mode (both engines see the same requests in the "
     "same order, so Random's victims, seeded by vtoken's seed and arrival order, are the same with caching on and "
     "off); counters are per generate call, summed over a seed's two calls. fp32, block size 32, a pool that "
     "holds every request at full length (no preemption)."),
]


def summarize_runs(runs: list[dict], s) -> dict:
    def metrics(rs: list[dict]) -> dict:
        out = totals(rs, COUNTERS + SHARED + HITS)
        out["per_seed"] = summaries(rs, [m for m in PER_SEED if m in rs[0]])
        for key, ref in (("vs_off", "off"), ("vs_naive", "naive")):
            if f"identical_to_{ref}" in rs[0]:
                out[key] = {"pairs": out["requests"], "same_tokens": sum(r[f"same_tokens_as_{ref}"] for r in rs),
                            "identical": sum(r[f"identical_to_{ref}"] for r in rs),
                            "max_abs_logprob_diff": max(r[f"max_abs_logprob_diff_vs_{ref}"] for r in rs)}
        return out

    def total(system: str, caching: str, key: str) -> dict:
        vs = [metrics(pick(runs, system=system, policy=p, caching=caching))[key] for p in s.q6_prefix_policies]
        return {"pairs": sum(v["pairs"] for v in vs), "same_tokens": sum(v["same_tokens"] for v in vs),
                "identical": sum(v["identical"] for v in vs),
                "max_abs_logprob_diff": max(v["max_abs_logprob_diff"] for v in vs)}

    by_policy = {p: {x: {c: metrics(pick(runs, system=x, policy=p, caching=c)) for c in CACHING} for x in EVICTING}
                 for p in s.q6_prefix_policies}
    full = {c: metrics(pick(runs, system="full", caching=c)) for c in CACHING}
    evicting = [r for r in runs if r["system"] != "full"]
    return {
        "full": full,
        "by_policy": by_policy,
        "hits": {c: totals(pick(runs, caching=c), HITS) for c in CACHING},
        "identity": {c: total("vtoken_compact", c, "vs_naive") for c in CACHING},
        "densify_vs_naive": {c: total("vtoken_densify", c, "vs_naive") for c in CACHING},
        "on_vs_off": {"full": full["on"]["vs_off"], **{x: total(x, "on", "vs_off") for x in EVICTING}},
        "verify": totals(evicting, ("relocations", "verified", "mismatches", "quarantined", "copies_failed",
                                    "write_slots_audited")),
        "all_finished_by_length": all(r["all_finished_by_length"] for r in runs),
        "generations": sum(r["requests"] for r in runs),
    }


# ---- output -------------------------------------------------------------------------------------
def _rows(sm: dict) -> list[tuple[str, str, dict]]:
    out = [("none", "full", sm["full"])]
    return out + [(p, x, m) for p, b in sm["by_policy"].items() for x, m in b.items()]


def table(report: dict) -> list[str]:
    sm = report["summary"]
    rows = []
    for policy, system, m in _rows(sm):
        for c in CACHING:
            x = m[c]
            ps, off = x["per_seed"], x.get("vs_off")
            rows.append([policy, Q6_LABELS[system], c, fmt_spread(ps["hits_per_later_request"], "{:.1f}"),
                         fmt_spread(ps["computed_prompt_tokens"], "{:.0f}"), fmt_spread(ps["tokens_evicted"], "{:.0f}"),
                         f"{x['relocations']:,} ({x['verified']:,} / {x['mismatches']} / {x['quarantined']})",
                         x["uncached"], f"{x['no_plan_no_candidates']} / {x['no_plan_shared_block']}",
                         f"{off['same_tokens']}/{off['pairs']} ({off['identical']} bit-identical)" if off else "–"])
    i, d, v, on = sm["identity"], sm["densify_vs_naive"], sm["verify"], sm["hits"]["on"]
    firsts = on["first_requests"]
    on_off = ", ".join(f"{Q6_LABELS[x]} {c['same_tokens']}/{c['pairs']} ({c['identical']} bit-identical)"
                       for x, c in sm["on_vs_off"].items())
    return markdown(HEADER, rows) + ["\n" + " ".join([
        (f"Prefix-cache hits with caching on: {on['later_hit_requests']} of {on['requests'] - firsts} later requests, "
         f"{on['first_hit_requests']} of {firsts} first ones, {on['cached_tokens']:,} of {on['prompt_tokens']:,} "
         f"prompt tokens; caching off: {sm['hits']['off']['cached_tokens']} tokens."),
        (f"vtoken compact vs Naive-Evict, bit-identical pairs (token ids and logprobs): caching on "
         f"{i['on']['identical']}/{i['on']['pairs']}, off {i['off']['identical']}/{i['off']['pairs']}."),
        (f"vtoken densify vs Naive-Evict, pairs with the same bytes: caching on {d['on']['same_tokens']}/"
         f"{d['on']['pairs']}, off {d['off']['same_tokens']}/{d['off']['pairs']}."),
        f"Caching on vs off, same bytes: {on_off}.",
        (f"Strict verify over the evicting runs: {v['mismatches']} mismatches and {v['quarantined']} quarantined in "
         f"{v['relocations']:,} relocations ({v['verified']:,} verified); {v['write_slots_audited']:,} write slots "
         f"audited."),
        "Paper: shared-prefix blocks never relocated, the same hit rate for vToken and Naive-Evict."])]


PANELS = (("hits_per_later_request", "prefix-cache hit tokens per later request", 1),
          ("tokens_evicted", "tokens evicted per seed", 1),
          ("relocations", "relocations per seed (strict verify: each verified)", 1),
          ("same_share_as_off", "requests with the same bytes as caching off (%)", 100))


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]
    rows = _rows(sm)
    groups = [Q6_LABELS[x] if p == "none" else f"{p}\n{Q6_LABELS[x].removeprefix('vtoken ')}" for p, x, _ in rows]

    def panel(metric: str, ylabel: str, scale: float, *steps: tuple) -> Panel:
        shown = ("on",) if metric == "same_share_as_off" else CACHING
        return Panel({c: [m[c]["per_seed"][metric] for _, _, m in rows] for c in shown}, ylabel, groups, scale,
                     CACHING_COLORS, CACHING_LABELS, [do("tick_params", axis="x", labelsize=6), *steps])
    headroom = do(lambda ax: ax.set_ylim(0, ax.get_ylim()[1] * 1.25))  # for the legend
    panels = [panel(*PANELS[0], headroom, do("legend", fontsize=7, loc="upper right")), panel(*PANELS[1]),
              panel(*PANELS[2]), panel(*PANELS[3], do("set_ylim", 0, 105))]
    i, v = sm["identity"], sm["verify"]
    figure(path, [panels], f"Q6 prefix caching on vLLM CPU, byte-llama greedy (median, min–max over seeds); "
                           f"compact ≡ Naive-Evict in {i['on']['identical']}/{i['on']['pairs']} pairs with caching "
                           f"on, {v['mismatches']} verify mismatches in {v['verified']:,} relocations",
           figsize=(22, 4.8))
