"""The compiled host mover (``integration/fastpath/relocate.py``) on vLLM's CPU layout, per moved token.

    python tests/bench/bench_host_mover.py [--sources 40] [--live 12] [--repeats 30]

The byte-llama's cache as vLLM's CPU backend lays it out (4 layers ``[blocks, 2 KV heads, 32 slots, 2 x 32]`` fp32,
K stored dim-major, V token-major; 3,272 blocks, 107 MB, what ``bench_step_parts.py`` allocates), and
compaction-like waves: ``--live`` tokens of each of ``--sources`` sparse source blocks packed in order into fresh
blocks. Two cases, alternated in one run: the same wave again and again (its lines stay in the caches), and a fresh
wave each time (other blocks: its lines come from memory, as inside vLLM, whose forward pass runs between two
steps' moves). Prints the minimum and median µs per moved token of each over ``--repeats`` waves.

NOTE: in this layout a token's K is one element in each of 32 cache lines per head (a line holds 16 slots of one
dimension), so a moved token touches about 272 distinct lines over 4 layers: the fresh case is bound by memory
latency, not by the kernel's arithmetic.
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
    rng = random.Random(0)
    same = wave(rng, args.sources, args.live)
    mover(same)  # warm: compiled, and its lines cached
    times: dict[str, list[float]] = {"the same wave (cached)": [], "a fresh wave (from memory)": []}
    for _ in range(args.repeats):
        for case, moves in zip(times, (same, wave(rng, args.sources, args.live))):
            t0 = time.perf_counter()
            mover(moves)
            times[case].append(time.perf_counter() - t0)
    n = len(same)
    print(f"{n} moves a wave, {len(mover.groups)} groups of {mover.groups[0][1].shape[1]} elements, "
          f"{args.repeats} waves each:")
    for case, ts in times.items():
        ts.sort()
        print(f"  {case:28s} {ts[0] / n * 1e6:.3f} us per moved token (min), {ts[len(ts) // 2] / n * 1e6:.3f} (median)")


if __name__ == "__main__":
    main()
