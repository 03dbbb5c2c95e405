"""The fast path against the core's token table, side by side: one dense-path decode step for many requests.

    python tests/bench/bench_fastpath_kernels.py [--requests 64] [--contexts 128 1536 16384] [--block-size 16]

One step, per request: sync one token (a new block when the cursor reaches a block's end), StreamingLLM's victims
(4 sinks, budget half the tokens: one victim every other step), evict them, densify (the moved token goes from the
cursor's end into the hole; the emptied tail block is released). Three implementations of the same step:

  core     per request, as ``VTokenRuntime`` runs it: ``TokenTable.sync_new_tokens``, ``StreamingLLM.select_victims``
           on the rank view, ``evict_tokens``, densify's O(evicted) plan (``plan_densify_tail``) and its commit
           (``apply_moves``, ``splice``)
  table    ``FastTable``'s batched calls, one per phase: Python lists in, lists out
  kernels  the four batch kernels alone (``sync_batch``, ``streaming_victims_batch``, ``evict_batch``,
           ``densify_batch``) on arrays built before the clock starts
  fused    two kernel calls: ``sync_batch`` and ``evict_densify_batch`` (choice, eviction and densify in
           one): what the four cost in numba's dispatch (about a microsecond a call, whatever the batch)

After the timed steps the fast table's state must equal the core's (``TokenTable.state()``). Also the burst: the
first eviction after the prompt (half of it at once: choice, eviction, densify), microseconds per evicted token.
Only the token tables are timed: not vLLM, not the workers, not the policy's scores. One pinned core; the median
of ``--rounds`` rounds of ``--steps`` steps. Prints a table and a JSON line (docs/results.md, "The fast path").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import numpy as np

from vtoken.core.densify import DensifyTail, plan_densify_tail
from vtoken.core.policies import RequestView, StreamingLLM
from vtoken.core.token_table import TokenTable
from vtoken.integration.fastpath import kernels as K
from vtoken.integration.fastpath.layout import M_NBLOCKS, M_TOTAL_LEN, M_WRITE_POS
from vtoken.integration.fastpath.table import FastTable

SINKS, RATIO = 4, 0.5
POLICY = StreamingLLM(sinks=SINKS)
NO_STATES = np.zeros(1, np.uint64)  # StreamingLLM draws nothing (Random's per-row draw states)


def budget(total_len: int) -> int:
    return max(1, math.ceil(RATIO * total_len))  # VTokenRuntime.token_budget for a fraction


class Pool:
    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]


# ---- the core, per request ---------------------------------------------------------------------------------
def core_evict_densify(t: TokenTable, pool: Pool, r: int, S: int) -> int:
    view = RequestView(r, t.live_tokens(r), t.total_len(r), budget(t.total_len(r)))
    victims = POLICY.select_victims(view)
    if not victims:
        return 0
    evicted = t.evict_tokens(r, victims)
    n, pos = t.num_live(r), t.write_pos(r)  # ReclamationManager._densify_tail's plan (no shared block here)
    movers = [(tok, t.block_at(r, p // S) * S + p % S) for p in range(n, pos) if (tok := t.token_at(r, p)) != -1]
    holes = tuple((p, t.block_at(r, p // S)) for p in sorted(evicted) if p < n)
    src = tuple(t.block_at(r, i) for i in range(-(-n // S), -(-pos // S)))
    cursor = t.block_at(r, n // S) if n % S and n // S < t.num_blocks_of(r) else None
    plan = plan_densify_tail(DensifyTail(r, (t.layout_version(r), t.total_len(r)), S, n, pos, holes, tuple(movers),
                                         src, cursor, frozenset()))
    if plan:
        t.apply_moves(r, plan.moves)
        t.splice(r, -(-n // S), len(plan.src_blocks), (), n)
        pool.free += plan.src_blocks
    return len(victims)


def core_step(t: TokenTable, pool: Pool, R: int, S: int) -> float:
    new = [pool.take(1) if t.write_pos(r) == t.num_blocks_of(r) * S else [] for r in range(R)]
    t0 = time.perf_counter()
    for r in range(R):
        t.sync_new_tokens(r, new[r], t.total_len(r) + 1)
        core_evict_densify(t, pool, r, S)
    return time.perf_counter() - t0


# ---- the fast table's batched calls --------------------------------------------------------------------------
def table_evict_densify(ft: FastTable, pool: Pool, R: int) -> int:
    victims = ft.streaming_victims_many([(r, budget(ft.total_len(r))) for r in range(R)], SINKS)
    items = [(r, v) for r, v in enumerate(victims) if v]
    positions = ft.evict_many(items)
    plans = ft.densify_many([(r, p) for (r, _), p in zip(items, positions)])
    pool.free += [b for p in plans if p for b in p.src_blocks]
    return sum(len(v) for v in victims)


def table_step(ft: FastTable, pool: Pool, R: int, S: int) -> float:
    meta = ft.layout.meta
    new = [pool.take(1) if meta[r, M_WRITE_POS] == meta[r, M_NBLOCKS] * S else [] for r in range(R)]
    syncs = [(r, new[r], int(meta[r, M_TOTAL_LEN]) + 1) for r in range(R)]
    t0 = time.perf_counter()
    ft.sync_many(syncs)
    table_evict_densify(ft, pool, R)
    return time.perf_counter() - t0


# ---- the kernels alone ---------------------------------------------------------------------------------------
class KernelStep:
    def __init__(self, ft: FastTable, R: int) -> None:
        self.ft, self.R, self.L = ft, R, ft._L
        self.rows = np.arange(R, dtype=np.int64)
        self.one_each = np.arange(R + 1, dtype=np.int64)
        self.slots, self.victims, self.positions = (np.empty(R + 1, np.int64) for _ in range(3))
        self.vstart, self.ms, self.rs = (np.zeros(R + 1, np.int64) for _ in range(3))
        self.moves, self.released = np.empty((R + 1, 3), np.int64), np.empty(R + 1, np.int64)
        self.status = np.zeros(R, np.int64)

    def __call__(self, pool: Pool, S: int, fused: bool = False) -> float:
        meta, R = self.ft.layout.meta, self.R
        need = meta[:R, M_WRITE_POS] == meta[:R, M_NBLOCKS] * S
        bstart = np.zeros(R + 1, np.int64)
        bstart[1:] = np.cumsum(need)
        blocks = np.asarray(pool.take(int(need.sum())), np.int64)
        totals = meta[:R, M_TOTAL_LEN] + 1
        budgets = np.maximum(1, np.ceil(RATIO * totals)).astype(np.int64)
        t0 = time.perf_counter()
        ok = K.sync_batch(*self.L, self.rows, totals, bstart, blocks, self.one_each, self.slots, True)[0] == K.OK
        if fused:
            ok &= K.evict_densify_batch(*self.L, self.rows, K.STREAMING, SINKS, budgets, NO_STATES, self.vstart,
                                        self.victims, self.positions, self.moves, self.ms, self.released, self.rs,
                                        self.status)[0] == K.OK
        else:
            K.streaming_victims_batch(*self.L, self.rows, SINKS, budgets, self.vstart, self.victims)
            ok &= K.evict_batch(*self.L, self.rows, self.vstart, self.victims, self.positions)[0] == K.OK
            ok &= K.densify_batch(*self.L, self.rows, self.vstart, self.positions, self.moves, self.ms,
                                  self.released, self.rs, self.status)[0] == K.OK
        seconds = time.perf_counter() - t0
        assert ok
        pool.free += self.released[:self.rs[R]].tolist()
        return seconds


# ---- one context -----------------------------------------------------------------------------------------------
def prefill(table, pool: Pool, R: int, ctx: int, S: int) -> float:
    """Every request syncs its prompt; then the burst (half the prompt evicted, densified), us per evicted token."""
    for r in range(R):
        table.add_request(r)
        table.sync_new_tokens(r, pool.take(-(-ctx // S)), ctx)
    t0 = time.perf_counter()
    if isinstance(table, TokenTable):
        evicted = sum(core_evict_densify(table, pool, r, S) for r in range(R))
    else:
        evicted = table_evict_densify(table, pool, R)
    return 1e6 * (time.perf_counter() - t0) / evicted


def kernel_burst(ft: FastTable, pool: Pool, R: int, ctx: int, S: int) -> float:
    """``prefill``'s burst through ``evict_densify_batch`` (StreamingLLM) alone: us per evicted token."""
    for r in range(R):
        ft.add_request(r)
        ft.sync_new_tokens(r, pool.take(-(-ctx // S)), ctx)
    n = R * ctx
    rows, budgets = np.arange(R, dtype=np.int64), np.full(R, budget(ctx), np.int64)
    vstart, ms, rs = (np.zeros(R + 1, np.int64) for _ in range(3))
    victims, positions, released = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
    moves, status = np.empty((n, 3), np.int64), np.zeros(R, np.int64)
    t0 = time.perf_counter()
    code = K.evict_densify_batch(*ft._L, rows, K.STREAMING, SINKS, budgets, NO_STATES, vstart, victims, positions,
                                 moves, ms, released, rs, status)[0]
    seconds = time.perf_counter() - t0
    assert code == K.OK
    pool.free += released[:rs[R]].tolist()
    return 1e6 * seconds / vstart[R]


def run(kind: str, R: int, ctx: int, S: int, rounds: int, steps: int) -> tuple[float, float, object]:
    per_request = -(-(ctx + rounds * steps + 2 * S) // S) + 2
    pool = Pool(R * per_request)
    table = TokenTable(len(pool.free), S) if kind == "core" else FastTable(len(pool.free), S, R,
                                                                           ctx + rounds * steps + 8)
    burst = kernel_burst(table, pool, R, ctx, S) if kind in ("kernels", "fused") else prefill(table, pool, R, ctx, S)
    k = KernelStep(table, R) if kind in ("kernels", "fused") else None
    step = {"core": lambda: core_step(table, pool, R, S), "table": lambda: table_step(table, pool, R, S),
            "kernels": lambda: k(pool, S), "fused": lambda: k(pool, S, fused=True)}[kind]
    per = [1e6 * sum(step() for _ in range(steps)) / (steps * R) for _ in range(rounds)]
    return statistics.median(per), burst, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1536, 16384])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args()
    try:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    except (AttributeError, OSError) as e:  # the numbers are then noisier: say so, and go on
        print(f"not pinned to one core ({e}): timings carry the scheduler's noise", file=sys.stderr)
    from vtoken.integration.fastpath import unavailable
    if unavailable() is not None:
        sys.exit(f"bench_fastpath_kernels: {unavailable()}")
    out = {}
    kinds = ("core", "table", "kernels", "fused")
    print(f"{'context':>8} " + " ".join(f"{k:>8}" for k in kinds) + f" {'core/fused':>10}  burst: "
          + " ".join(f"{k:>8}" for k in kinds) + "   (us per request-step; burst: us per evicted token)")
    for ctx in a.contexts:
        cells = {k: run(k, a.requests, ctx, a.block_size, a.rounds, a.steps) for k in kinds}
        for k in kinds[1:]:
            assert cells[k][2].state() == cells["core"][2].state(), f"context {ctx}: {k}'s table and the core's differ"
        out[ctx] = {**{f"{k}_us": cells[k][0] for k in kinds}, **{f"burst_{k}_us_per_token": cells[k][1] for k in kinds}}
        print(f"{ctx:>8} " + " ".join(f"{cells[k][0]:>8.3f}" for k in kinds)
              + f" {cells['core'][0] / cells['fused'][0]:>10.0f}         " + " ".join(f"{cells[k][1]:>8.4f}" for k in kinds))
    lo, hi = min(a.contexts), max(a.contexts)
    growth = {f"{k}_us": out[hi][f"{k}_us"] / out[lo][f"{k}_us"] for k in kinds}
    print(f"growth {lo} -> {hi}: " + ", ".join(f"{k} x{v:.2f}" for k, v in growth.items()))
    print(json.dumps({"requests": a.requests, "block_size": a.block_size, "rounds": a.rounds, "steps": a.steps,
                      "by_context": out, "growth": growth}))


if __name__ == "__main__":
    main()
