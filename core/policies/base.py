"""What an eviction policy sees and returns. Policies never see blocks (seed §3.1)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence


@dataclass(frozen=True)
class RequestView:
    """A read-only view of one request for one eviction decision.

    Attributes:
        req_id: the request.
        live: live logical token ids, ascending (a token's logical position is its id).
        total_len: tokens synced so far (live and evicted).
        budget: how many live tokens the request may keep.
        accumulated: token id -> accumulated attention (H2O).
        persistence: token id -> persistence of importance (Scissorhands).
        seed: the run's seed, for randomized policies.
        step: the engine's iteration.
        protected: tokens the runtime forbids evicting (e.g. shared-prefix tokens on the dense path).
    """

    req_id: object
    live: Sequence[int]
    total_len: int
    budget: int
    accumulated: Callable[[int], float] = lambda t: 0.0
    persistence: Callable[[int], float] = lambda t: 0.0
    seed: int = 0
    step: int = 0
    protected: frozenset[int] = field(default_factory=frozenset)

    @property
    def excess(self) -> int:
        """How many tokens must go to meet the budget."""
        return max(0, len(self.live) - self.budget)

    def candidates(self, keep_recent: int) -> list[int]:
        """Live tokens that may be evicted: all but the newest ``keep_recent`` and the protected."""
        older = self.live[: max(0, len(self.live) - keep_recent)]
        return [t for t in older if t not in self.protected]


class EvictionPolicy(Protocol):
    name: str

    def select_victims(self, view: RequestView) -> list[int]:
        """Token ids to evict now: live, unprotected, distinct; at most ``view.excess``."""
        ...
