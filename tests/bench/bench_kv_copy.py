"""A batched token move (``PagedKVCache.gather`` + ``scatter``) in vLLM's CPU layout, through rows and through the
strided token views, side by side, as one JSON line.

    python tests/bench/bench_kv_copy.py LABEL [--tokens 6000] [--threads 1]

The byte-llama's shape (4 layers, 2 KV heads of 32, blocks of 32 slots, fp32: 2 KiB per token), 520 blocks; a
random permutation's first ``--tokens`` slots moved onto the next ``--tokens``. vLLM's CPU layout stores K
dim-major, so a row move (``Group.run`` = 1) indexes every element of a token; the token views index two per token
and segment. Median of 7 moves each; both paths must move the same bits (checked here too).
"""
import json, statistics, sys, time

import torch

from vtoken.integration.device.kv_cache import PagedKVCache
from vtoken.integration.device.kv_layout import cpu_plane

NB, H, S, D, LAYERS = 520, 2, 32, 32, 4


def cache(rows: bool) -> PagedKVCache:
    gen = torch.Generator().manual_seed(0)
    c = PagedKVCache([cpu_plane(f"l{i}", torch.randn(NB, H, S, 2 * D, generator=gen)) for i in range(LAYERS)])
    if rows:
        for g in c.groups:
            g._strided["tokens"] = None  # the reference path: rows of ``run`` elements
    return c


def time_moves(c: PagedKVCache, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, list]:
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        values = c.gather(src)
        c.scatter(dst, values)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), values


if __name__ == "__main__":
    tokens = int(sys.argv[sys.argv.index("--tokens") + 1]) if "--tokens" in sys.argv else 6000
    torch.set_num_threads(int(sys.argv[sys.argv.index("--threads") + 1]) if "--threads" in sys.argv else 1)
    perm = torch.randperm(NB * S, generator=torch.Generator().manual_seed(1))
    src, dst = perm[:tokens], perm[tokens:2 * tokens]
    rows_s, by_rows = time_moves(cache(True), src, dst)
    views_s, by_views = time_moves(cache(False), src, dst)
    assert all(torch.equal(a, b) for a, b in zip(by_rows, by_views)), "the two paths moved different bits"
    label = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "this tree"
    print(label, json.dumps({"tokens": tokens, "threads": torch.get_num_threads(),
                             "rows_ms": round(rows_s * 1e3, 2), "views_ms": round(views_s * 1e3, 2),
                             "rows_us_per_token": round(rows_s / tokens * 1e6, 3),
                             "views_us_per_token": round(views_s / tokens * 1e6, 3),
                             "rows_over_views": round(rows_s / views_s, 2)}))
