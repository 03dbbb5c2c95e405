"""Random: uniform victims, drawn by a counter-based hash of (seed, request, request length, draw index). The worst
case for block reclamation.

The draw (docs/spec.md, "Random's draw"), k = min(excess, n) of the n candidates (ascending):

  key(r)    = the first 8 bytes (little-endian) of BLAKE2b-64 of str(r)
  h         = mix(mix(mix(seed mod 2**64) ^ key(r)) ^ total_len)
  u_j       = mix(h + (j + 1) * GOLDEN mod 2**64)           (SplitMix64's (j+1)-th output from state h)
  Floyd:    for j in n-k .. n-1: t = u_j mod (j + 1); take j if t was taken, else t

and the victims are the candidates at the taken indices. ``mix`` is SplitMix64's finaliser. Every quantity is a
64-bit word, so a compiled kernel draws the same victims (``integration/fastpath/kernels.py: random_victims``).

The request's length, not the engine's iteration, picks the draw: a request's victims then do not depend on
how other requests were scheduled, so they replay in any engine (vLLM's in-process and multiprocess engines
run different numbers of iterations for the same requests)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .base import RequestView, check_policy_params

MASK, GOLDEN = (1 << 64) - 1, 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    """SplitMix64's finaliser of a 64-bit word."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def request_state(seed: int, req_id: object) -> int:
    """mix(mix(seed) ^ key(req_id)): the part of a draw's state fixed for a request's life (a kernel keeps it per
    row)."""
    key = int.from_bytes(hashlib.blake2b(str(req_id).encode(), digest_size=8).digest(), "little")
    return mix(mix(seed & MASK) ^ key)


def draw_indices(state: int, total_len: int, n: int, k: int) -> list[int]:
    """k distinct indices of range(n) (0 <= k <= n), ascending: Floyd's algorithm over the draws of
    (``state``, ``total_len``)."""
    h, taken = mix(state ^ total_len), set()
    for j in range(n - k, n):
        t = mix((h + (j + 1) * GOLDEN) & MASK) % (j + 1)
        taken.add(j if t in taken else t)
    return sorted(taken)


@dataclass(frozen=True)
class RandomPolicy:
    keep_recent: int = 1  # the newest token is the next query's own key
    name: str = "random"

    def __post_init__(self) -> None:
        check_policy_params(self, counts=("keep_recent",))

    def select_victims(self, view: RequestView) -> list[int]:
        pool = view.candidates(keep_recent=self.keep_recent)
        state = request_state(view.seed, view.req_id)
        return [pool[i] for i in draw_indices(state, view.total_len, len(pool), min(view.excess, len(pool)))]
