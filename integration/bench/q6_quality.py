"""Q6 (seed §4, question 6, generation quality) on real vLLM: does vtoken's relocation change what the model
generates, and what does each eviction policy cost against the full cache?

The byte-level Llama, greedy, fp32, ``ignore_eos``; per seed ``prompts`` held-out windows of ``prompt_len`` bytes,
``max_tokens`` generated. Systems (``systems.vtoken_config``, vtoken on in every engine): the full cache
(reference), Naive-Evict, compact and densify at each policy and budget, strict verify with quarantine.

Per (system, policy, budget, seed) (``runs``): identical_to_naive (compact, bit for bit), same_tokens_as_naive
(densify), agreement_prefix, agreement_overall, first_divergence, rouge_l_f1 (vs the full cache), mean_logprob
(of its own bytes), text_match (vs the held-out continuation), vtoken's ``COUNTERS``, prompts.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from .render import Panel, do, figure, fmt_spread, markdown
from .runner import BenchContext
from .stats import pick, summaries, totals
from .systems import COLORS, LABELS, VLLM_EVICTING, vtoken_config
from .vllm_engine import heldout_windows, run_engine

KEY = "q6"
TITLE = "Quality on real vLLM (byte-llama, greedy): vtoken vs Naive-Evict, each policy vs the full cache"
PAPER = {"rouge_l_f1_diff_vs_naive_evict": -0.0016, "pairs_within_0.01": 0.931, "median_length_ratio": 0.99,
         "pairs": 144, "relocation_checks": "every relocation event held (hash of retained ids + K/V)",
         "source": "paper §4.6: 144 paired generations (Llama-3.1-8B, ShareGPT, deterministic decoding), "
                   "mean ROUGE-L F1 difference vToken - Naive-Evict -0.0016, 93.1 % of pairs within 0.01"}
EVICTING = VLLM_EVICTING
SYSTEMS = ("full",) + EVICTING
Q6_LABELS = {**LABELS, "full": "Full cache"}
Q6_COLORS = {**COLORS, "full": COLORS["native"]}
POLICY_COLORS = {"streaming_llm": "#2ca02c", "random": "#9467bd", "h2o": "#d62728", "scissorhands": "#1f77b4",
                 "tova": "#ff7f0e", "knorm": "#8c564b", "snapkv": "#e377c2"}
QUALITY = ("agreement_prefix", "agreement_overall", "first_divergence", "rouge_l_f1", "mean_logprob", "text_match")
COUNTERS = ("relocations", "verified", "mismatches", "quarantined", "copies_done", "copies_failed", "tokens_evicted",
            "tokens_moved", "plans_committed", "blocks_released", "attention_rows", "write_slots_audited")


# ---- metrics ------------------------------------------------------------------------------------
def first_divergence(a: list[int], ref: list[int]) -> int:
    """The first position where ``a`` differs from ``ref`` (a missing byte differs); len(ref) if none."""
    for i, t in enumerate(ref):
        if i >= len(a) or a[i] != t:
            return i
    return len(ref)


def rouge_l_f1(cand: list[int], ref: list[int]) -> float:
    """ROUGE-L F1 on byte sequences: LCS-based precision and recall (1.0 for equal sequences)."""
    if not cand or not ref:
        return 1.0 if cand == ref else 0.0
    prev = [0] * (len(ref) + 1)
    for x in cand:
        cur = [0]
        for j, y in enumerate(ref):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(cand), lcs / len(ref)
    return 2 * p * r / (p + r)


def _text(ids: list[int]) -> str:
    return bytes(ids).decode("latin-1")


def measure(outputs: list, reference: list, truths: list[list[int]], max_tokens: int) -> tuple[dict, list[dict]]:
    """Quality of one run's outputs against the full cache's (``reference``, same prompts in order)."""
    per = []
    for (ids, lps, finish), (ref_ids, _, _), truth in zip(outputs, reference, truths):
        fd = first_divergence(ids, ref_ids)
        per.append({"output": _text(ids), "finish_reason": finish, "first_divergence": fd,
                    "agreement_overall": sum(a == b for a, b in zip(ids, ref_ids)) / max_tokens,
                    "rouge_l_f1": rouge_l_f1(ids, ref_ids),
                    "mean_logprob": statistics.fmean(lps) if lps else float("nan"),
                    "text_match": sum(a == b for a, b in zip(ids, truth)) / max_tokens})
    agg = {"agreement_prefix": statistics.fmean(p["first_divergence"] for p in per) / max_tokens,
           "agreement_overall": statistics.fmean(p["agreement_overall"] for p in per),
           "first_divergence": statistics.median(p["first_divergence"] for p in per),
           "rouge_l_f1": statistics.fmean(p["rouge_l_f1"] for p in per),
           "mean_logprob": statistics.fmean(lp for ids, lps, _ in outputs for lp in lps),
           "text_match": statistics.fmean(p["text_match"] for p in per),
           "all_finished_by_length": all(o[2] == "length" and len(o[0]) == max_tokens for o in outputs)}
    return agg, per


def compare(outputs: list, ref: list, name: str) -> dict:
    """Against ``ref`` (same prompts, in order): requests with equal token ids, with equal ids and logprobs (bit
    for bit), and the largest |logprob difference| where the ids are equal; fields named after ``name``."""
    same = [a[0] == b[0] for a, b in zip(outputs, ref, strict=True)]
    diffs = [abs(x - y) for eq, a, b in zip(same, outputs, ref) if eq for x, y in zip(a[1], b[1])]
    return {f"same_tokens_as_{name}": sum(same),
            f"identical_to_{name}": sum(eq and a[1] == b[1] for eq, a, b in zip(same, outputs, ref)),
            f"max_abs_logprob_diff_vs_{name}": max(diffs, default=0.0)}


# ---- the run ------------------------------------------------------------------------------------
def _engines(s) -> list[tuple[str, str | None, float | None, list[int]]]:
    """(system, policy, budget, seeds) per engine. Only Random's victims depend on vtoken's seed, so it gets
    one engine per seed; every other system serves all seeds' prompts from one engine, one generate each."""
    out = [("full", None, None, s.seeds)]
    for budget in s.budgets:
        for policy in s.policies:
            for system in EVICTING:
                groups = [[x] for x in s.seeds] if policy == "random" else [s.seeds]
                out += [(system, policy, budget, g) for g in groups]
    return out


def run(ctx: BenchContext) -> dict:
    s = ctx.settings
    evidence = str(ctx.out_dir / "q6-vtoken-evidence")
    windows = {seed: heldout_windows(s.prompts, s.prompt_len, s.max_tokens, seed) for seed in s.seeds}
    engines = _engines(s)
    progress = ctx.progress("q6 vllm quality", sum(len(g) for *_, g in engines))
    raw: dict[tuple, dict] = {}
    for system, policy, budget, group in engines:
        cfg = vtoken_config(system, policy, budget, group[0], s.score_layers, evidence)
        note = f"{system} {policy or ''} {budget or ''}".strip()
        res = run_engine(cfg, [[p for p, _ in windows[seed]] for seed in group], s.max_tokens, s.block_size,
                         s.threads, on_done=lambda i, note=note: progress.advance(note))
        for seed, one in zip(group, res["sets"]):
            raw[(system, policy, budget, seed)] = dict(one, vtoken=cfg, engine_start_s=res["start_s"],
                                                       engine_seeds=group)
    progress.close()

    runs = []
    for (system, policy, budget, seed), one in raw.items():
        ref = raw[("full", None, None, seed)]["outputs"]
        truths = [t for _, t in windows[seed]]
        agg, per = measure(one["outputs"], ref, truths, s.max_tokens)
        rec = {"system": system, "policy": policy or "none", "budget": budget or 1.0, "seed": seed,
               "vtoken": one["vtoken"], "engine_seeds": one["engine_seeds"],
               "engine_start_s": round(one["engine_start_s"], 3), "wall_s": round(one["wall_s"], 3),
               **agg, **one["counters"]}
        if system == "full":
            for p, (prompt, truth) in zip(per, windows[seed]):
                p.update(prompt=_text(prompt), truth=_text(truth))
        if system in ("vtoken_compact", "vtoken_densify"):
            rec |= compare(one["outputs"], raw[("naive_evict", policy, budget, seed)]["outputs"], "naive")
        rec["prompts"] = per
        runs.append(rec)
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs, "summary": summarize_runs(runs, s),
            "notes": NOTES}


NOTES = [
    "Agreement, first divergence and ROUGE-L are against the full cache's greedy output for the same prompt "
    "(vtoken on with policy none); text_match is against the held-out continuation and only gives context "
    "(a 0.85 M-parameter model continues source code plausibly, not verbatim).",
    "mean_logprob is the logprob of each system's own greedy bytes (its confidence), not a teacher-forced "
    "likelihood of a reference: an evicting system can be confidently wrong.",
    "Naive-Evict and vtoken compact run the same gather attention with the same scores, so their evictions "
    "are the same by construction and the comparison is exact (bit for bit). vtoken densify reads through "
    "vLLM's stock kernel and, for H2O/Scissorhands, scores on the dense score pass: rows equal to ~1e-7, "
    "so near-ties may rank differently and its tokens can differ from Naive-Evict's; same_tokens_as_naive "
    "counts it.",
    "Budget r keeps ceil(r x length) tokens after the prompt has been computed (prefill is never cut short); "
    "every decode step re-evicts down to it.",
    "Only Random depends on vtoken's seed: it gets one engine per seed; every other system serves all seeds' "
    "prompts from one engine, one generate call per seed (counters are per call). All engines run in one "
    "process with vtoken on, fp32, block size 32, prefix caching off, a pool that holds every request at "
    "full length (no preemption).",
]


def summarize_runs(runs: list[dict], s) -> dict:
    def metrics(rs: list[dict]) -> dict:
        out = summaries(rs, QUALITY)
        out.update(totals(rs, COUNTERS))
        return out

    def cell(rs: list[dict]) -> dict:  # one (budget, policy, evicting system); compact and densify vs Naive-Evict
        out = metrics(rs)
        if rs[0]["system"] != "naive_evict":
            out.update(totals(rs, ("identical_to_naive", "same_tokens_as_naive")),
                       max_abs_logprob_diff_vs_naive=max(r["max_abs_logprob_diff_vs_naive"] for r in rs))
        return out

    by_budget = {str(b): {p: {x: cell(pick(runs, system=x, policy=p, budget=b)) for x in EVICTING}
                          for p in s.policies} for b in s.budgets}
    compact = pick(runs, system="vtoken_compact")
    densify = pick(runs, system="vtoken_densify")
    evicting = [r for r in runs if r["system"] != "full"]
    return {
        "full": metrics(pick(runs, system="full")),
        "by_budget": by_budget,
        "identity": {"pairs": s.prompts * len(compact), "identical": sum(r["identical_to_naive"] for r in compact)},
        "densify_vs_naive": {"pairs": s.prompts * len(densify),
                             "same_tokens": sum(r["same_tokens_as_naive"] for r in densify),
                             "max_abs_logprob_diff": max((r["max_abs_logprob_diff_vs_naive"] for r in densify),
                                                         default=0.0)},
        "verify": {**totals(evicting, ("relocations", "verified", "mismatches", "quarantined", "write_slots_audited")),
                   "by_system": {x: totals(pick(runs, system=x), ("relocations", "verified", "mismatches"))
                                 for x in EVICTING}},
        "all_finished_by_length": all(r["all_finished_by_length"] for r in runs),
        "generations": len(runs) * s.prompts,
    }


# ---- output -------------------------------------------------------------------------------------
def table(report: dict) -> list[str]:
    sm = report["summary"]
    rows = [["1.0", "none", "Full cache", "1.000", "1.000", fmt_spread(sm["full"]["first_divergence"], "{:.0f}"),
             "1.000", fmt_spread(sm["full"]["mean_logprob"]), "–"]]
    rows += [[budget, policy, Q6_LABELS[system], fmt_spread(m["agreement_prefix"]), fmt_spread(m["agreement_overall"]),
              fmt_spread(m["first_divergence"], "{:.0f}"), fmt_spread(m["rouge_l_f1"]), fmt_spread(m["mean_logprob"]),
              f"{m['verified']:,} / {m['mismatches']}"]
             for budget, b in sm["by_budget"].items() for policy, x in b.items() for system, m in x.items()]
    i, d, v = sm["identity"], sm["densify_vs_naive"], sm["verify"]
    return markdown(("budget", "policy", "system", "agreement before 1st divergence", "agreement overall",
                     "1st divergence (byte)", "ROUGE-L F1 vs full", "mean logprob", "verified / mismatches"), rows) + [
        f"\nvtoken compact vs Naive-Evict: {i['identical']}/{i['pairs']} pairs bit-identical (token ids and "
        f"logprobs). vtoken densify vs Naive-Evict: {d['same_tokens']}/{d['pairs']} pairs with the same tokens "
        f"(max |Δlogprob| {d['max_abs_logprob_diff']:.1e} where equal). Strict verify: {v['verified']:,} of "
        f"{v['relocations']:,} relocations verified, {v['mismatches']} mismatches, {v['quarantined']} quarantined, "
        f"{v['write_slots_audited']:,} write slots audited. Full cache: text match with the held-out "
        f"continuation {fmt_spread(sm['full']['text_match'])}. Paper: ROUGE-L F1 vToken − Naive-Evict −0.0016."]


def plot(report: dict, path: Path) -> None:
    sm = report["summary"]
    budgets = list(sm["by_budget"])
    shown = "0.5" if "0.5" in budgets else budgets[0]
    b = sm["by_budget"][shown]
    policies = list(b)

    def agreement(metric: str, ylabel: str) -> Panel:
        return Panel({x: [b[p][x][metric] for p in policies] for x in EVICTING}, ylabel, policies, 100, Q6_COLORS,
                     Q6_LABELS, [do("axhline", 100, color=Q6_COLORS["full"], ls="--", lw=1, label="Full cache"),
                                 do("set_ylim", 0, 105), do("set_title", f"budget {shown}", fontsize=10)])
    xs = [float(x) for x in budgets]
    divergence = []
    for k, policy in enumerate(policies):
        for j, (system, marker, ls) in enumerate((("vtoken_compact", "o", "-"), ("vtoken_densify", "s", "--"))):
            ss = [sm["by_budget"][x][policy][system]["first_divergence"] for x in budgets]
            off = (k * 2 + j - len(policies) + 0.5) * 0.004  # side by side, so equal points stay visible
            divergence.append(do("errorbar", [x + off for x in xs], [v["median"] for v in ss],
                                 yerr=[[v["median"] - v["min"] for v in ss], [v["max"] - v["median"] for v in ss]],
                                 color=POLICY_COLORS.get(policy, "k"), marker=marker, ls=ls, ms=4, capsize=2,
                                 label=f"{policy} ({Q6_LABELS[system].split()[-1]})"))
    full = sm["full"]["first_divergence"]["median"]
    divergence += [do("set_xticks", xs), do("set_xlim", min(xs) - 0.1, max(xs) + 0.1),
                   do("set_xlabel", "budget (fraction of tokens kept)"),
                   do("set_ylabel", "first divergence from full cache (byte, median)"),
                   do("axhline", full, color=Q6_COLORS["full"], ls=":", lw=1, label="generated length (no divergence)"),
                   do("set_ylim", 0, full * 1.35), do("grid", alpha=0.3),
                   do("legend", fontsize=6, ncol=2, loc="upper left")]
    # quality against budget, one line per policy: Naive-Evict's ROUGE-L (compact's is the same, bit for bit)
    rouge = [do("errorbar", xs, [v["median"] for v in ss], yerr=[[v["median"] - v["min"] for v in ss],
                                                                  [v["max"] - v["median"] for v in ss]],
                color=POLICY_COLORS.get(policy, "k"), marker="o", ms=4, capsize=2, label=policy)
             for policy in policies
             for ss in [[sm["by_budget"][x][policy]["naive_evict"]["rouge_l_f1"] for x in budgets]]]
    rouge += [do("set_xticks", xs), do("set_xlim", min(xs) - 0.1, max(xs) + 0.1), do("set_ylim", 0, 1.05),
              do("set_xlabel", "budget (fraction of tokens kept)"),
              do("set_ylabel", "byte ROUGE-L F1 vs full cache (median)"),
              do("axhline", 1.0, color=Q6_COLORS["full"], ls=":", lw=1), do("grid", alpha=0.3),
              do("legend", fontsize=7, loc="lower right")]
    first = agreement("agreement_overall", "agreement with full cache (% of bytes)")
    i = sm["identity"]
    figure(path, [[replace(first, steps=(*first.steps, do("legend", fontsize=7, loc="lower right"))),
                   agreement("agreement_prefix", "bytes before 1st divergence (% of output)"),
                   Panel(steps=divergence), Panel(steps=rouge)]],
           f"Q6 quality on vLLM CPU, byte-llama greedy (median, min–max over seeds); compact ≡ Naive-Evict "
           f"in {i['identical']}/{i['pairs']} pairs, {sm['verify']['mismatches']} verify mismatches",
           figsize=(21, 4.5))
