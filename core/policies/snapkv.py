"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation", arXiv:2404.14469): at
the end of the prefill, keep the prompt tokens that the prompt's last ``window`` queries (its observation window)
attend to most, their votes pooled over ``kernel`` neighbouring tokens, plus the window itself.

As kvpress's ``SnapKVPress`` implements it: the votes are the window's softmax rows averaged over its queries and
heads, then ``avg_pool1d`` (stride 1, zero padding ``kernel // 2``, the padding counted). Whoever computes the
attention computes the votes once, at the step the prompt completes (the ``observed`` statistic: ``pool_votes`` is
the pooling's reference). During decode the generated tokens have no vote, so they leave first, oldest first, past
the newest ``window``: SnapKV's prompt selection plus a recent window."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar, Sequence

from ..checks import check_int, is_int
from ..errors import ConfigError
from .base import Ranking, RequestView, check_policy_params


@dataclass(frozen=True)
class SnapKV:
    window: int = 16  # the observation window (the prompt's last queries), kept as the recent window too
    kernel: int = 5  # votes averaged over this many neighbours (odd: the pooled list keeps its length)
    name: str = "snapkv"
    statistics: ClassVar[tuple[str, ...]] = ("observed",)

    def __post_init__(self) -> None:
        check_policy_params(self)
        # each refusal states the true bound (check_policy_params' counts say ">= 0")
        check_int("SnapKV window", self.window, 1, error=ConfigError)
        if not is_int(self.kernel) or self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"SnapKV kernel must be an odd int >= 1, got {self.kernel!r}")

    def ranking(self, view: RequestView) -> Ranking:
        return Ranking(view.excess, self.window, ("observed",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        rank = self.ranking(view)
        # the least observed first, older first among equals (generated tokens: 0, so the oldest of them)
        return heapq.nsmallest(rank.count, view.candidates(keep_recent=rank.keep_recent), key=view.observed)


def pool_votes(votes: Sequence[float], kernel: int) -> list[float]:
    """``avg_pool1d(votes, kernel, stride=1, padding=kernel // 2)`` with the zero padding counted: each vote becomes
    the mean of the ``kernel`` votes centred on it."""
    h, n = kernel // 2, len(votes)
    return [sum(votes[max(0, i - h):min(n, i + h + 1)]) / kernel for i in range(n)]
