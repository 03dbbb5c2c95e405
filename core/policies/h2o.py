"""H2O: keep the heavy hitters (highest accumulated attention) and a recent window."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .base import RequestView, check_policy_params


@dataclass(frozen=True)
class H2O:
    recent_fraction: float = 0.5  # share of the budget kept as the recent window (H2O's default split)
    name: str = "h2o"

    def __post_init__(self) -> None:
        check_policy_params(self, fractions=("recent_fraction",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        recent = max(1, int(view.budget * self.recent_fraction))
        # lowest accumulated attention first, older first among equals: the candidates ascend and nsmallest is
        # stable (a heap of the excess, no full sort; one candidate, the usual decode step: one C min)
        return heapq.nsmallest(view.excess, view.candidates(keep_recent=recent), key=view.accumulated)
