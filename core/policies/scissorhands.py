"""Scissorhands: tokens important in the recent history stay important; keep a recent window."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from .base import Ranking, RequestView, check_policy_params


@dataclass(frozen=True)
class Scissorhands:
    recent_fraction: float = 0.25
    name: str = "scissorhands"
    statistics: ClassVar[tuple[str, ...]] = ("persistence", "accumulated")

    def __post_init__(self) -> None:
        check_policy_params(self, fractions=("recent_fraction",))

    def ranking(self, view: RequestView) -> Ranking:
        return Ranking(view.excess, max(1, int(view.budget * self.recent_fraction)), ("persistence", "accumulated"))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        rank = self.ranking(view)
        # least persistent first, then least attended, then oldest (a heap of the excess, no full sort; the
        # keys are zipped in C, not built by a Python function per candidate)
        c = view.candidates(keep_recent=rank.keep_recent)
        ranked = zip(map(view.persistence, c), map(view.accumulated, c), c)
        return [t for _, _, t in heapq.nsmallest(rank.count, ranked)]
