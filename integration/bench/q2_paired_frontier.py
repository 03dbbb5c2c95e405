"""Q2 (seed §4, question 2): does vtoken improve the paired eviction frontier under identical decisions?

Per workload, policy and seed, compact and densify are paired with Naive-Evict (same requests, same decisions):
``utilisation`` (1 - F), ``utilisation_gain_pp`` / ``_rel`` (the paper's "+21.9 %" may be either),
``retained_blocks_per_request`` and ``retained_reduction`` (1 - vtoken / Naive-Evict; paper: 27.2-72.3 %).
Identical decisions are checked: the ideal packed footprint ceil(live / S) must be equal in every pair.
"""

from __future__ import annotations

from pathlib import Path

from .measure import policy_grid
from .q1_trapped_capacity import policy_panels
from .render import fmt_spread, markdown, pct
from .runner import BenchContext
from .stats import nest, pick, summaries

KEY = "q2"
TITLE = "Paired frontier: utilisation and retained blocks per request, vtoken vs Naive-Evict (same decisions)"
PAPER = {"utilisation_gain": {"llama-3.1-8b": 0.2188, "mistral-7b": 0.2167},
         "retained_reduction": [0.272, 0.723],
         "source": "paper §5.3 / Fig. 7: +21.88 % (Llama) and +21.67 % (Mistral) average memory utilisation, "
                   "27.2-72.3 % fewer retained blocks per request than Naive-Evict"}
VTOKEN = ("vtoken_compact", "vtoken_densify")
ABSOLUTE = ("utilisation", "retained_blocks_per_request")
GAINS = ("utilisation_gain_pp", "utilisation_gain_rel", "retained_reduction")
HEADER = ("workload", "policy", "util. Naive-Evict", "util. compact", "util. densify", "Δutil compact (pp)",
          "retained/req Naive-Evict", "compact", "densify", "reduction compact", "reduction densify")


def _pairs(runs: list[dict], workload: str, policy: str) -> list[dict]:
    naive = pick(runs, workload=workload, policy=policy, system="naive_evict")
    out = []
    for system in VTOKEN:
        for n, v in zip(naive, pick(runs, workload=workload, policy=policy, system=system)):
            assert n["seed"] == v["seed"]
            if abs(n["ideal_blocks_per_request"] - v["ideal_blocks_per_request"]) > 1e-9:
                raise AssertionError(f"{workload} {policy} seed {n['seed']}: {system} kept different tokens than "
                                     f"Naive-Evict (ideal {v['ideal_blocks_per_request']} vs "
                                     f"{n['ideal_blocks_per_request']}): eviction decisions differ")
            out.append({"workload": workload, "policy": policy, "system": system, "seed": n["seed"],
                        "utilisation_gain_pp": 100 * (v["utilisation"] - n["utilisation"]),
                        "utilisation_gain_rel": v["utilisation"] / n["utilisation"] - 1,
                        "retained_reduction": 1 - v["retained_blocks_per_request"]
                        / n["retained_blocks_per_request"]})
    return out


def run(ctx: BenchContext) -> dict:
    runs = policy_grid(ctx, "q2 paired frontier")
    s = ctx.settings
    pairs = [p for spec in s.workloads for policy in s.policies for p in _pairs(runs, spec.name, policy)]

    def cell(rs: list[dict]) -> dict:  # one (workload, policy, system): absolute values, and gains over Naive-Evict
        gains = pick(pairs, **{k: rs[0][k] for k in ("workload", "policy", "system")})
        return {**summaries(rs, ABSOLUTE), **(summaries(gains, GAINS) if gains else {})}

    by_workload = nest(runs, ["workload"], lambda rs: {
        "native": summaries(pick(rs, system="native"), ABSOLUTE),
        **nest([r for r in rs if r["system"] != "native"], ["policy", "system"], cell)})
    ranges = {}
    for system in VTOKEN:
        for m in GAINS:
            med = [w[p][system][m]["median"] for w in by_workload.values() for p in w if p != "native"]
            ranges[f"{system}.{m}"] = [min(med), max(med)]
    return {"question": KEY, "title": TITLE, "paper": PAPER, "runs": runs + pairs,
            "summary": {"by_workload": by_workload, "median_ranges": ranges, "identical_decisions_checked": True},
            "notes": [
                "runs holds the simulator runs (shared with Q1) followed by one paired record per "
                "(workload, policy, vtoken system, seed).",
                "Naive-Evict never frees a block in the simulator (a block stays while any token in it lives), "
                "so its retained blocks equal Native's; the gains are relative to that footprint.",
            ]}


def table(report: dict) -> list[str]:
    rows = [[wname, policy, *(pct(x[s]["utilisation"]) for s in ("naive_evict", *VTOKEN)),
             fmt_spread(x["vtoken_compact"]["utilisation_gain_pp"], "{:+.1f}"),
             *(fmt_spread(x[s]["retained_blocks_per_request"], "{:.1f}") for s in ("naive_evict", *VTOKEN)),
             *(pct(x[s]["retained_reduction"]) for s in VTOKEN)]
            for wname, w in report["summary"]["by_workload"].items() for policy, x in w.items() if policy != "native"]
    r = report["summary"]["median_ranges"]
    c, d = ({m: r[f"{x}.{m}"] for m in GAINS} for x in VTOKEN)
    return markdown(HEADER, rows) + [
        f"\nMedians across workloads and policies — compact: utilisation "
        f"{c['utilisation_gain_pp'][0]:+.1f} to {c['utilisation_gain_pp'][1]:+.1f} pp "
        f"({c['utilisation_gain_rel'][0]:+.1%} to {c['utilisation_gain_rel'][1]:+.1%}), "
        f"retained −{c['retained_reduction'][0]:.1%} to −{c['retained_reduction'][1]:.1%}; "
        f"densify: utilisation {d['utilisation_gain_pp'][0]:+.1f} to {d['utilisation_gain_pp'][1]:+.1f} pp, retained "
        f"−{d['retained_reduction'][0]:.1%} to −{d['retained_reduction'][1]:.1%}. "
        f"Paper: +21.9 % utilisation, −27.2 % to −72.3 % retained blocks."]


def plot(report: dict, path: Path) -> None:
    policy_panels(report, path, (("utilisation", "memory utilisation (%)", 100),
                                 ("retained_blocks_per_request", "retained blocks / request", 1)),
                  "Q2 paired frontier: same eviction decisions (median, min–max over seeds)")
