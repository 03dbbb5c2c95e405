"""The compiled host mover (``integration/fastpath/relocate.py``) on vLLM's CPU layout, per moved token.

    python tests/bench/bench_host_mover.py [--sources 40] [--live 12] [--repeats 30]

The byte-llama's cache as vLLM's CPU backend lays it out (4 layers ``[blocks, 2 KV heads, 32 slots, 2 x 32]`` fp32,
K stored dim-major, V token-major; 3,272 blocks, what ``bench_step_parts.py`` allocates), and one compaction-like
wave: ``--live`` tokens of each of ``--sources`` sparse source blocks packed in order into fresh blocks. Prints the
minimum and median µs per moved token over ``--repeats`` waves. Inside vLLM the same kernel costs 19–21 µs per
request-step for Random + compact at 64 × 1,536 (docs/results.md, issue #46): this isolates it.
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from vtoken.integration.device.kv_cache import PagedKVCache
from vtoken.integration.device.kv_layout import cpu_plane
from vtoken.integration.fastpath.relocate import host_mover

BLOCKS, HEADS, S, HEAD = 3272, 2, 32, 32


def wave(rng: random.Random, sources: int, live: int) -> np.ndarray:
    """Rows (token, source block, offset, destination block, offset): sources' live tokens packed in order."""
    src = rng.sample(range(BLOCKS // 2), sources)
    first = rng.randrange(BLOCKS // 2, BLOCKS - sources * live // S - 1)
    moves = []
    for b in src:
        for o in sorted(rng.sample(range(S), live)):
            d = first * S + len(moves)
            moves.append((len(moves), b, o, d // S, d % S))
    return np.array(moves, np.int64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sources", type=int, default=40)
    ap.add_argument("--live", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache([cpu_plane(f"l{i}", torch.randn(BLOCKS, HEADS, S, 2 * HEAD, generator=gen)) for i in range(4)])
    mover = host_mover(cache)
    moves = wave(random.Random(0), args.sources, args.live)
    mover(moves)  # warm
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        mover(moves)
        times.append(time.perf_counter() - t0)
    times.sort()
    n = len(moves)
    print(f"{n} moves, {len(mover.groups)} groups of {mover.groups[0][1].shape[1]} elements: "
          f"{times[0] / n * 1e6:.3f} us per moved token (min), {times[len(times) // 2] / n * 1e6:.3f} (median)")


if __name__ == "__main__":
    main()
