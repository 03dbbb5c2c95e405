"""Scissorhands: tokens important in the recent history stay important; keep a recent window."""

from __future__ import annotations

from dataclasses import dataclass

from .base import RequestView, check_policy_params


@dataclass(frozen=True)
class Scissorhands:
    recent_fraction: float = 0.25
    name: str = "scissorhands"

    def __post_init__(self) -> None:
        check_policy_params(self, fractions=("recent_fraction",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        recent = max(1, int(view.budget * self.recent_fraction))
        pool = view.candidates(keep_recent=recent)
        # least persistent first, then least attended, then oldest
        pool.sort(key=lambda t: (view.persistence(t), view.accumulated(t), t))
        return pool[: view.excess]
