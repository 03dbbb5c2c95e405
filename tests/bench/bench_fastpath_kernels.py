"""The fast path's kernels against the core's token table, side by side: one dense-path step for many requests.

    python tests/bench/bench_fastpath_kernels.py [--requests 64] [--contexts 128 1536 16384] [--block-size 16]

What one decode step costs the token tables, per request, on the dense path with densify and StreamingLLM-like
victims (4 sinks, the oldest other token goes; budget 0.5): every request syncs one token (a new block when its
cursor crosses one), loses one victim, and is densified (one move, from the cursor's end into the hole). Three
implementations of the same step, each checked equal to the core's state once the timed steps are done:

  core     ``TokenTable`` per request: ``sync_new_tokens``, ``evict_tokens``, densify's O(evicted) plan
           (``plan_densify_tail``, as ``ReclamationManager`` makes it) and its commit (``apply_moves``, ``splice``)
  table    ``FastTable``'s batched calls (``sync_many``, ``evict_many``, ``densify_many``): Python lists in and out
  kernels  the three batch kernels alone, on inputs prepared before the timed region

Also the burst: the first eviction after a prompt (half of it at once), microseconds per evicted token, and the
growth of the steady step from the shortest to the longest context. One pinned core, median of 5 rounds of 50 steps.
Prints a table and a JSON line (docs/results.md, "The fast path's kernels").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from vtoken.core.densify import DensifyTail, plan_densify_tail
from vtoken.core.token_table import TokenTable
from vtoken.integration.fastpath import kernels as K
from vtoken.integration.fastpath.table import FastTable

SINKS = 4


class Workload:
    """The step's inputs for R requests at a context: which blocks each sync takes, and each step's victims."""

    def __init__(self, R: int, context: int, S: int, steps: int) -> None:
        self.R, self.context, self.S, self.steps = R, context, S, steps
        per = -(-(context + steps + S) // S) + 2
        self.num_blocks = R * per
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.next_victim = [SINKS] * R  # StreamingLLM: the oldest non-sink live token

    def take(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]


def prefill(table, w: Workload, batched: bool) -> float:
    """Each request syncs its prompt, then the burst: half of it evicted, densified. Returns us per evicted token."""
    S, R = w.S, w.R
    syncs = [(r, w.take(-(-w.context // S)), w.context) for r in range(R)]
    for r, _, _ in syncs:
        table.add_request(r)
    if batched:
        table.sync_many(syncs)
    else:
        for r, blocks, total in syncs:
            table.sync_new_tokens(r, blocks, total)
    burst = [(r, list(range(SINKS, SINKS + w.context // 2))) for r in range(R)]
    t0 = time.perf_counter()
    released = evict_and_densify(table, burst, batched, S)
    seconds = time.perf_counter() - t0
    for r in range(R):
        w.next_victim[r] = SINKS + w.context // 2
    w.free += released
    return 1e6 * seconds / sum(len(v) for _, v in burst)


def evict_and_densify(table, victims, batched: bool, S: int) -> list[int]:
    if batched:
        positions = table.evict_many(victims)
        plans = table.densify_many([(r, p) for (r, _), p in zip(victims, positions)])
        return [b for p in plans if p for b in p.src_blocks]
    released = []
    for r, ids in victims:
        positions = table.evict_tokens(r, ids)
        plan = core_densify_tail(table, r, positions, S)
        if plan:
            n = plan.dense_write_pos
            table.apply_moves(r, plan.moves)
            table.splice(r, -(-n // S), len(plan.src_blocks), (), n)
            released += plan.src_blocks
    return released


def core_densify_tail(t: TokenTable, r, evicted: list[int], S: int):
    """``ReclamationManager._densify_tail``'s plan (no shared block here): O(evicted)."""
    n, pos = t.num_live(r), t.write_pos(r)
    assert pos - n == len(evicted) and t.append_run_start(r) <= n
    movers = [(tok, t.block_at(r, p // S) * S + p % S) for p in range(n, pos) if (tok := t.token_at(r, p)) != -1]
    holes = tuple((p, t.block_at(r, p // S)) for p in sorted(evicted) if p < n)
    src = tuple(t.block_at(r, i) for i in range(-(-n // S), -(-pos // S)))
    cursor = t.block_at(r, n // S) if n % S and n // S < t.num_blocks_of(r) else None
    return plan_densify_tail(DensifyTail(r, (t.layout_version(r), t.total_len(r)), S, n, pos, holes, tuple(movers),
                                         src, cursor, frozenset()))


def step_inputs(table, w: Workload) -> tuple[list, list]:
    """One step's syncs (a new block where the cursor reaches a block's end) and victims."""
    syncs, victims = [], []
    for r in range(w.R):
        pos = table.write_pos(r)
        syncs.append((r, w.take(1) if pos % w.S == 0 and pos // w.S == table_blocks(table, r) else [],
                      table.total_len(r) + 1))
        victims.append((r, [w.next_victim[r]]))
        w.next_victim[r] += 1
    return syncs, victims


def table_blocks(table, r) -> int:
    return table.num_blocks_of(r) if isinstance(table, TokenTable) else len(table.block_ids(r))


def steady(make, w: Workload, batched: bool, rounds: int, steps: int) -> tuple[float, object]:
    """Median over rounds of us per request-step (sync + evict + densify), and the table at the end."""
    table = make(w)
    prefill(table, w, batched)
    per = []
    for _ in range(rounds):
        t_total = 0.0
        for _ in range(steps):
            syncs, victims = step_inputs(table, w)
            t0 = time.perf_counter()
            if batched:
                table.sync_many(syncs)
            else:
                for r, blocks, total in syncs:
                    table.sync_new_tokens(r, blocks, total)
            w.free += evict_and_densify(table, victims, batched, w.S)
            t_total += time.perf_counter() - t0
        per.append(1e6 * t_total / (steps * w.R))
    return statistics.median(per), table


def kernels_alone(w: Workload, rounds: int, steps: int) -> float:
    """The three batch kernels, timed alone: each step's input arrays are built from the table before the clock
    starts. Median over rounds of us per request-step."""
    table = FastTable(w.num_blocks, w.S, w.R, w.context + rounds * steps + 8)
    prefill(table, w, True)
    L, R = table._L, w.R
    rows, starts, out = np.arange(R, dtype=np.int64), np.arange(R + 1, dtype=np.int64), np.empty(R, np.int64)
    moves, released = np.empty((R + 1, 3), np.int64), np.empty(R + 1, np.int64)
    ms, rs, status = np.zeros(R + 1, np.int64), np.zeros(R + 1, np.int64), np.zeros(R, np.int64)
    per = []
    for _ in range(rounds):
        t_total = 0.0
        for _ in range(steps):
            syncs, victims = step_inputs(table, w)
            totals = np.array([t for _, _, t in syncs], np.int64)
            bstarts = np.zeros(R + 1, np.int64)
            bstarts[1:] = np.cumsum([len(b) for _, b, _ in syncs])
            blocks = np.array([b for _, bs, _ in syncs for b in bs], np.int64)
            ids = np.array([v[0] for _, v in victims], np.int64)
            t0 = time.perf_counter()
            code = (K.sync_batch(*L, rows, totals, bstarts, blocks, starts, out)[0],
                    K.evict_batch(*L, rows, starts, ids, out)[0],
                    K.densify_batch(*L, rows, starts, out, moves, ms, released, rs, status)[0])
            t_total += time.perf_counter() - t0
            assert code == (K.OK, K.OK, K.OK), code
            w.free += released[:rs[R]].tolist()
        per.append(1e6 * t_total / (steps * R))
    return statistics.median(per)


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
    except (AttributeError, OSError):
        pass
    from vtoken.integration.fastpath import unavailable
    assert unavailable() is None, unavailable()
    steps_max = a.rounds * a.steps + 8
    out = {}
    print(f"{'context':>8} {'core us':>9} {'table us':>9} {'kernels us':>11} {'core/table':>11} {'core/kernels':>13}"
          f" {'burst core':>11} {'burst table':>12}")
    for ctx in a.contexts:
        w = Workload(a.requests, ctx, a.block_size, steps_max)
        burst_core = prefill(TokenTable(w.num_blocks, w.S), w, False)
        w = Workload(a.requests, ctx, a.block_size, steps_max)
        burst_fast = prefill(FastTable(w.num_blocks, w.S, a.requests, ctx + steps_max), w, True)
        wc = Workload(a.requests, ctx, a.block_size, steps_max)
        core_us, core_t = steady(lambda w: TokenTable(w.num_blocks, w.S), wc, False, a.rounds, a.steps)
        wf = Workload(a.requests, ctx, a.block_size, steps_max)
        table_us, fast_t = steady(lambda w: FastTable(w.num_blocks, w.S, w.R, ctx + steps_max), wf, True, a.rounds,
                                  a.steps)
        assert fast_t.state() == core_t.state(), "the fast table and the core's differ after the same steps"
        kern_us = kernels_alone(Workload(a.requests, ctx, a.block_size, 2 * steps_max), a.rounds, a.steps)
        out[ctx] = {"core_us": core_us, "table_us": table_us, "kernels_us": kern_us,
                    "burst_core_us_per_token": burst_core, "burst_table_us_per_token": burst_fast}
        print(f"{ctx:>8} {core_us:>9.2f} {table_us:>9.2f} {kern_us:>11.3f} {core_us / table_us:>11.1f} "
              f"{core_us / kern_us:>13.0f} {burst_core:>11.3f} {burst_fast:>12.4f}")
    lo, hi = min(a.contexts), max(a.contexts)
    growth = {k: out[hi][k] / out[lo][k] for k in ("core_us", "table_us", "kernels_us")}
    print(f"growth {lo} -> {hi}: " + ", ".join(f"{k} x{v:.2f}" for k, v in growth.items()))
    print(json.dumps({"requests": a.requests, "block_size": a.block_size, "by_context": out, "growth": growth}))


if __name__ == "__main__":
    main()
