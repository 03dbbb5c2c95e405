"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
arXiv:2406.11430): evict the tokens whose keys have the largest L2 norm; a low key norm goes with high attention.

As kvpress's ``KnormPress`` implements it: the score is minus the key's L2 norm (here averaged over heads and the
scored layers). It reads no attention at all: the ``key_norm`` statistic is computed where the key is written (the
simulator's model, vLLM's workers from the KV cache), which is what lets fused kernels serve it."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar

from .base import Ranking, RequestView, check_policy_params


@dataclass(frozen=True)
class Knorm:
    keep_recent: int = 1  # the newest token, as TOVA and Random keep it
    name: str = "knorm"
    statistics: ClassVar[tuple[str, ...]] = ("key_norm",)

    def __post_init__(self) -> None:
        check_policy_params(self, counts=("keep_recent",))

    def ranking(self, view: RequestView) -> Ranking:
        return Ranking(view.excess, self.keep_recent, ("-key_norm",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        rank = self.ranking(view)
        norm = view.key_norm
        # largest key norm first, older first among equals (nsmallest is stable; -x orders floats exactly)
        return heapq.nsmallest(rank.count, view.candidates(keep_recent=rank.keep_recent), key=lambda t: -norm(t))
