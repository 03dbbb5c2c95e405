"""H2O: keep the heavy hitters (highest accumulated attention) and a recent window."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from .base import Ranking, RequestView, check_policy_params


@dataclass(frozen=True)
class H2O:
    recent_fraction: float = 0.5  # share of the budget kept as the recent window (H2O's default split)
    name: str = "h2o"
    statistics: ClassVar[tuple[str, ...]] = ("accumulated",)

    def __post_init__(self) -> None:
        check_policy_params(self, fractions=("recent_fraction",))

    def ranking(self, view: RequestView) -> Ranking:
        return Ranking(view.excess, max(1, int(view.budget * self.recent_fraction)), ("accumulated",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        rank = self.ranking(view)
        # lowest accumulated attention first, older first among equals: the candidates ascend and nsmallest is
        # stable (a heap of the excess, no full sort; one candidate, the usual decode step: one C min)
        return heapq.nsmallest(rank.count, view.candidates(keep_recent=rank.keep_recent), key=view.accumulated)
