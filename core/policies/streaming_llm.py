"""StreamingLLM: keep the first few tokens (attention sinks) and a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from .base import RequestView, check_policy_params


@dataclass(frozen=True)
class StreamingLLM:
    sinks: int = 4
    name: str = "streaming_llm"

    def __post_init__(self) -> None:
        check_policy_params(self, counts=("sinks",))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        sinks = set(view.live[: min(self.sinks, view.budget - 1)])  # the budget keeps >= 1 recent token
        window = view.budget - len(sinks)
        middle = (t for t in view.candidates(keep_recent=window) if t not in sinks)
        return list(islice(middle, view.excess))  # the oldest non-sink tokens leave first: O(sinks + excess)
