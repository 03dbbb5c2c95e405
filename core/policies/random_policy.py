"""Random: uniform victims, seeded per (seed, request, step). The worst case for block reclamation."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import RequestView


@dataclass(frozen=True)
class RandomPolicy:
    keep_recent: int = 1  # the newest token is the next query's own key
    name: str = "random"

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        rng = random.Random(f"{view.seed}:{view.req_id}:{view.step}")
        pool = view.candidates(keep_recent=self.keep_recent)
        return sorted(rng.sample(pool, min(view.excess, len(pool))))
