"""Token-table metadata per token at 1M tokens, measured with tracemalloc (not a test: a benchmark).

Run: make bench-table   (or: .venv/bin/python tests/bench/bench_table_memory.py [--tokens N])

Reports bytes per token for (a) the per-request tables (slots, block lists,
per-block bitmasks, request records) and (b) the pool-wide slot occupancy,
sized by the pool rather than the tokens. Target (issue #19, Hot path I): <= 12 B/token.
"""

from __future__ import annotations

import argparse
import gc
import random
import tracemalloc

from vtoken.core.block_pool import blocks_needed
from vtoken.core.token_table import TokenTable


def measure(tokens: int, requests: int, block_size: int, evict: float, seed: int) -> dict:
    per_req = tokens // requests
    num_blocks = requests * blocks_needed(per_req, block_size)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table = TokenTable(num_blocks, block_size)
    pool_wide = tracemalloc.get_traced_memory()[0] - base
    next_block = 0
    for r in range(requests):
        table.add_request(r)
        n_blocks = blocks_needed(per_req, block_size)
        # grow in decode-sized chunks, as a serving engine would
        done = 0
        while done < per_req:
            step = min(4096, per_req - done)
            need = blocks_needed(done + step, block_size) - len(table.block_ids(r))
            table.sync_new_tokens(r, list(range(next_block, next_block + need)), done + step)
            next_block += need
            done += step
        assert len(table.block_ids(r)) == n_blocks
    gc.collect()
    synced = tracemalloc.get_traced_memory()[0] - base - pool_wide
    rng = random.Random(seed)
    for r in range(requests):
        for t in rng.sample(range(per_req), int(evict * per_req)):
            table.evict_token(r, t)
    gc.collect()
    after_evict = tracemalloc.get_traced_memory()[0] - base - pool_wide
    tracemalloc.stop()
    n = per_req * requests
    return {
        "tokens": n, "requests": requests, "block_size": block_size,
        "per_request_bytes_per_token": synced / n,
        "after_eviction_bytes_per_token": after_evict / n,
        "pool_wide_bytes_per_slot": pool_wide / (num_blocks * block_size),
        "total_bytes_per_token": (max(synced, after_evict) + pool_wide) / n,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--evict", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    m = measure(a.tokens, a.requests, a.block_size, a.evict, a.seed)
    print(f"token table metadata, {m['tokens']:,} tokens in {m['requests']} requests, block size {m['block_size']}")
    print(f"  per-request tables       {m['per_request_bytes_per_token']:6.2f} B/token")
    print(f"  after evicting {a.evict:.0%}       {m['after_eviction_bytes_per_token']:6.2f} B/token")
    print(f"  pool-wide occupancy      {m['pool_wide_bytes_per_slot']:6.2f} B/slot")
    print(f"  total                    {m['total_bytes_per_token']:6.2f} B/token  (target <= 12)")


if __name__ == "__main__":
    main()
