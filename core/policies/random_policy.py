"""Random: uniform victims, seeded per (seed, request, request length). The worst case for block reclamation.

The request's length, not the engine's iteration, picks the draw: a request's victims then do not depend on
how other requests were scheduled, so they replay in any engine (vLLM's in-process and multiprocess engines
run different numbers of iterations for the same requests)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import RequestView, check_policy_params


@dataclass(frozen=True)
class RandomPolicy:
    keep_recent: int = 1  # the newest token is the next query's own key
    name: str = "random"

    def __post_init__(self) -> None:
        check_policy_params(self, counts=("keep_recent",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        rng = random.Random(f"{view.seed}:{view.req_id}:{view.total_len}")
        pool = view.candidates(keep_recent=self.keep_recent)
        return sorted(rng.sample(pool, min(view.excess, len(pool))))
