"""The system configurations the fuzzer explores: read path x planner x copy ordering."""

from __future__ import annotations

from dataclasses import dataclass

from vtoken.core.plan import PlanKind
from vtoken.core.reclamation import Ordering
from vtoken.core.runtime import ReadPath


@dataclass(frozen=True)
class Profile:
    name: str
    read_path: ReadPath
    planner: PlanKind | None  # None: no reclamation (Naive-Evict)
    ordering: Ordering


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile("gather-compact-poll", ReadPath.GATHER, PlanKind.COMPACT, Ordering.POLL),
        Profile("gather-compact-event", ReadPath.GATHER, PlanKind.COMPACT, Ordering.EVENT),
        Profile("gather-compact-sync", ReadPath.GATHER, PlanKind.COMPACT, Ordering.FORCE_SYNC),
        Profile("gather-densify-poll", ReadPath.GATHER, PlanKind.DENSIFY, Ordering.POLL),
        Profile("gather-off", ReadPath.GATHER, None, Ordering.POLL),
        Profile("dense-densify-event", ReadPath.DENSE, PlanKind.DENSIFY, Ordering.EVENT),
        Profile("dense-densify-sync", ReadPath.DENSE, PlanKind.DENSIFY, Ordering.FORCE_SYNC),
    ]
}


def profiles_for(planners: list[str] | None) -> tuple[str, ...]:
    """Profile names whose planner is in ``planners`` ('compact', 'densify', 'off'); all if None."""
    if not planners:
        return tuple(PROFILES)
    want = set(planners)
    return tuple(n for n, p in PROFILES.items() if (p.planner.value if p.planner else "off") in want)
