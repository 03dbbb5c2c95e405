"""``vtoken demo``: one built-in workload, three reclamation modes, the paper's memory metrics.

The same requests and the same eviction decisions (policy and seed) run with
no reclamation (Naive-Evict), ``compact`` (gather read path) and ``densify``
(dense read path); every invariant is checked after every step.
"""

from __future__ import annotations

import argparse
import json

from ..cli import check_int, check_number
from ..policies import POLICIES
from .simulator import SimConfig, compare_modes, synthetic_workload

#: Largest --block-size: the demo's pool has 4,096 blocks; vLLM's block sizes are 16..256.
MAX_BLOCK_SIZE = 1024


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="compare no reclamation, compact and densify on a built-in workload")
    p.add_argument("--policy", choices=sorted(POLICIES), default="random")
    p.add_argument("--budget", type=float, default=0.5, help="fraction of tokens kept (default 0.5)")
    p.add_argument("--requests", type=int, default=48, help="requests in the workload, >= 1 (default 48)")
    p.add_argument("--block-size", type=int, default=16, help=f"tokens per block, 1..{MAX_BLOCK_SIZE} (default 16)")
    p.add_argument("--seed", type=int, default=0, help="workload and policy seed, >= 0 (default 0)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=run)


def check_args(args: argparse.Namespace) -> None:
    """Each option in range, or ``ConfigError`` naming it (the CLI prints it as one line, exit 2)."""
    check_number("--budget", args.budget, 0.0, 1.0, what="a ratio (the fraction of tokens kept)")
    check_int("--requests", args.requests, 1)
    check_int("--block-size", args.block_size, 1, MAX_BLOCK_SIZE)
    check_int("--seed", args.seed, 0)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    workload = synthetic_workload(args.requests, args.seed)
    cfg = SimConfig(num_blocks=4096, block_size=args.block_size, headroom=16, policy=args.policy,
                    budget=args.budget, seed=args.seed, check_invariants=True)
    results = compare_modes(cfg, workload)
    rows = {
        mode: {
            "waste_ratio_F": round(r.mean_waste_ratio, 4),
            "blocks_le_50pct": round(r.mean_low_util_share, 4),
            "retained_blocks": round(r.mean_retained_blocks, 1),
            "ideal_blocks": round(r.mean_ideal_blocks, 1),
            "plans_committed": r.reclaim["plans_committed"],
            "invariant_checks": r.invariant_checks,
        }
        for mode, r in results.items()
    }
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"vtoken demo: {args.requests} requests, policy {args.policy}, budget {args.budget}, "
          f"block size {args.block_size}, seed {args.seed} (means over decode steps)")
    head = f"{'reclaim':<10}{'F':>8}{'<=50%':>8}{'retained':>10}{'ideal':>8}{'x ideal':>9}{'plans':>8}"
    print(head)
    print("-" * len(head))
    for mode, row in rows.items():
        ratio = row["retained_blocks"] / row["ideal_blocks"] if row["ideal_blocks"] else 0.0
        print(f"{mode:<10}{row['waste_ratio_F']:>8.3f}{row['blocks_le_50pct']:>8.1%}{row['retained_blocks']:>10.1f}"
              f"{row['ideal_blocks']:>8.1f}{ratio:>9.2f}{row['plans_committed']:>8}")
    checks = sum(r["invariant_checks"] for r in rows.values())
    print(f"all invariants held: {checks} checks")
    return 0
