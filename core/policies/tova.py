"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs", arXiv:2401.06104): at each step, evict the tokens
the newest query attends to least (its weights averaged over heads), with no accumulation over steps.

As kvpress's ``TOVAPress`` implements it: the score is the newest query's attention averaged over heads, and the
newest token is always kept (here ``keep_recent``). The runtime records the ``latest`` statistic for it alone."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from .base import Ranking, RequestView, check_policy_params


@dataclass(frozen=True)
class TOVA:
    keep_recent: int = 1  # the newest token: its own query has not attended to it from the next position yet
    name: str = "tova"
    statistics: ClassVar[tuple[str, ...]] = ("latest",)

    def __post_init__(self) -> None:
        check_policy_params(self, counts=("keep_recent",))

    def ranking(self, view: RequestView) -> Ranking:
        return Ranking(view.excess, self.keep_recent, ("latest",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        rank = self.ranking(view)
        # least attended by the newest query first, older first among equals (nsmallest is stable)
        return heapq.nsmallest(rank.count, view.candidates(keep_recent=rank.keep_recent), key=view.latest)
