"""What an eviction policy sees and returns. Policies never see blocks (seed §3.1)."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Protocol, Sequence

from ..checks import check_callable, check_int, check_number
from ..errors import ConfigError, InvalidArgumentError
from ..live_index import LiveTokens


@dataclass(frozen=True)
class RequestView:
    """A read-only view of one request for one eviction decision.

    Attributes:
        req_id: the request.
        live: live logical token ids, ascending (a token's logical position is its id). The runtime gives a
            ``LiveTokens``: ``len`` O(1), ``live[k]`` and slices O(log L), nothing copied; iterate over it
            (O(L)) only when every token matters (a score policy).
        total_len: tokens synced so far (live and evicted).
        budget: how many live tokens the request may keep.
        accumulated: token id -> accumulated attention (H2O).
        persistence: token id -> persistence of importance (Scissorhands).
        latest: token id -> its weight in the newest attention row (TOVA).
        key_norm: token id -> its key's L2 norm (Knorm).
        observed: token id -> the attention it got from the prompt's observation window, pooled (SnapKV).
        (Each reads 0.0 in a view built by hand; the runtime gives a policy the statistics it lists in its
        ``statistics``, and an error for one it reads without listing it: ``core/scores.py``.)
        seed: the run's seed, for randomized policies.
        step: the engine's iteration.
        protected: tokens the runtime forbids evicting (e.g. shared-prefix tokens on the dense path).

    Construction checks every field in O(1) (``InvalidArgumentError``): ``live`` is a sequence no
    longer than ``total_len``, ``budget`` an int >= 1, ``seed`` an int, ``step`` an int >= 0, the
    readers callable, ``protected`` a set. That ``live`` is ascending and distinct is the builder's
    promise (checking it would cost a pass over every live token per decision).
    """

    req_id: object
    live: Sequence[int]
    total_len: int
    budget: int
    accumulated: Callable[[int], float] = lambda t: 0.0
    persistence: Callable[[int], float] = lambda t: 0.0
    latest: Callable[[int], float] = lambda t: 0.0
    key_norm: Callable[[int], float] = lambda t: 0.0
    observed: Callable[[int], float] = lambda t: 0.0
    seed: int = 0
    step: int = 0
    protected: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if ((self.live.__class__ is LiveTokens or self.live.__class__ is list) and self.total_len.__class__ is int and self.budget.__class__ is int
                and self.seed.__class__ is int and self.step.__class__ is int
                and self.protected.__class__ is frozenset and len(self.live) <= self.total_len
                and self.budget >= 1 and self.step >= 0 and callable(self.accumulated) and callable(self.persistence)
                and callable(self.latest) and callable(self.key_norm) and callable(self.observed)):
            return  # what the runtime builds, per request per step: no ABC checks
        what = f"view of request {self.req_id!r}"
        if isinstance(self.live, (str, bytes)) or not isinstance(self.live, Sequence):
            raise InvalidArgumentError(f"{what}: live must be a sequence of token ids, got {self.live!r:.80}")
        check_int(f"{what}: total_len", self.total_len, len(self.live), hint=" (the number of live tokens)")
        check_int(f"{what}: budget", self.budget, 1)
        check_int(f"{what}: seed", self.seed)
        check_int(f"{what}: step", self.step, 0)
        check_callable(f"{what}: accumulated", self.accumulated, InvalidArgumentError)
        check_callable(f"{what}: persistence", self.persistence, InvalidArgumentError)
        check_callable(f"{what}: latest", self.latest, InvalidArgumentError)
        check_callable(f"{what}: key_norm", self.key_norm, InvalidArgumentError)
        check_callable(f"{what}: observed", self.observed, InvalidArgumentError)
        if not isinstance(self.protected, Set):
            raise InvalidArgumentError(f"{what}: protected must be a set of token ids, got {self.protected!r:.80}")

    @property
    def excess(self) -> int:
        """How many tokens must go to meet the budget."""
        return max(0, len(self.live) - self.budget)

    def candidates(self, keep_recent: int) -> Sequence[int]:
        """Live tokens that may be evicted, ascending: all but the newest ``keep_recent`` (>= 0) and the
        protected. Without protected tokens a slice of ``live`` (for ``LiveTokens``, a view: O(log L))."""
        if keep_recent.__class__ is not int or keep_recent < 0:
            check_int("keep_recent", keep_recent, 0)
        older = self.live[: max(0, len(self.live) - keep_recent)]
        return [t for t in older if t not in self.protected] if self.protected else older


class EvictionPolicy(Protocol):
    name: str
    # the optional statistics it reads (``core/scores.py``: "latest", "key_norm"), which the runtime records for it
    # alone; a policy without this attribute reads none of them
    statistics: tuple[str, ...]

    def select_victims(self, view: RequestView) -> list[int]:
        """Token ids to evict now: live, unprotected, distinct; at most ``view.excess``."""
        ...


class Ranking(NamedTuple):
    """A score policy's choice as data, for a ranker that holds the scores itself (vLLM's workers rank on the
    device: ``integration/device/scores.py``). The victims are the ``count`` smallest of
    ``view.candidates(keep_recent)``, ordered by the scores named in ``keys`` (``"persistence"``,
    ``"accumulated"``, ``"latest"``, ``"key_norm"``, ``"observed"``; the first most significant; a name after ``"-"`` orders
    largest first, for one key alone), then by token id, smallest first. The policy's own ``select_victims`` is the
    reference: it returns exactly these, in this order."""

    count: int
    keep_recent: int
    keys: tuple[str, ...]

    def bound(self, view: RequestView) -> int:
        """The candidates are the live ids below this, less ``view.protected``: O(log L) on a ``LiveTokens``."""
        n = len(view.live)
        if self.keep_recent == 0:
            return view.total_len
        return view.live[n - self.keep_recent] if n > self.keep_recent else 0


class RankedPolicy(EvictionPolicy, Protocol):
    def ranking(self, view: RequestView) -> Ranking:
        """What ``select_victims(view)`` chooses, as a ``Ranking`` (with ``view.excess`` > 0)."""
        ...


class RenamedRequests:
    """``policy``, deciding for requests under the names in ``names`` (a request without one keeps its id).

    For engines whose request ids are not reproducible (vLLM appends a random suffix to each): a seeded policy
    (Random) draws from its view's ``req_id``, so with a name such as the arrival order its victims repeat from
    run to run. Everything else in the view is the runtime's. ``names`` is the caller's, and it keeps it."""

    def __init__(self, policy: EvictionPolicy, names: dict | None = None) -> None:
        self.policy = policy
        self.names: dict = {} if names is None else names

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def statistics(self) -> tuple[str, ...]:
        return getattr(self.policy, "statistics", ())

    def select_victims(self, view: RequestView) -> list[int]:
        if view.req_id in self.names:
            view = replace(view, req_id=self.names[view.req_id])  # O(1): the view's checks are O(1)
        return self.policy.select_victims(view)


def check_policy_params(policy: object, fractions: Sequence[str] = (), counts: Sequence[str] = ()) -> None:
    """A ``ConfigError`` naming the policy, the parameter and its value unless every field named in
    ``fractions`` is a number in [0, 1], every one in ``counts`` an int >= 0, and ``name`` a non-empty str."""
    cls = type(policy).__name__
    for f in fractions:
        check_number(f"{cls} {f}", getattr(policy, f), 0.0, 1.0)
    for f in counts:
        check_int(f"{cls} {f}", getattr(policy, f), 0, error=ConfigError)
    name = getattr(policy, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{cls} name must be a non-empty string, got {name!r}")
