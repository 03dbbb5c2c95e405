"""``StepCommits``: the plans one step committed, as the scheduler's bookkeeping reads them: counts, and the few plans
it must see one by one.

After ``evict_and_reclaim`` vLLM's side of vtoken needs, of a step's committed plans, their counts (its statistics)
and only those plans that change the request's block list (a densify that released tail blocks; any compact, release
or relocate) or, with prefix caching on, write blocks vLLM may have hashed (every plan). At a steady dense step about
half the requests commit a densify and almost none releases a block; the fast path knows them as the kernel's arrays
(``table.EvictStep``) and makes a ``Plan`` only for a plan someone reads. The core's runtime answers with the same
shape from its ``PlanRecord``s (``of_plans``), so the scheduler reads one shape from either runtime.

Stdlib only: ``integration/vllm`` imports it whichever runtime runs.
"""

from __future__ import annotations

from typing import Callable, Sequence

from vtoken.core.plan import Plan, PlanKind


class StepCommits:
    """The committed plans of one step, in commit order. ``plans``: those that are not a RELEASE; ``releases``,
    ``densified`` (DENSIFY plans), ``moves`` and ``blocks_released`` (blocks the requests gave up for good: a
    destination a plan keeps is not counted) are totals. ``all_plans()`` makes every ``Plan``; ``touched(everything)``
    only those that change their request's block list, or all of them with ``everything``.

    ``plan_of(i)`` makes the i-th plan; ``relists[i]`` says whether it changes its request's block list."""

    __slots__ = ("plans", "releases", "densified", "moves", "blocks_released", "relists", "plan_of")

    def __init__(self, plans: int, releases: int, densified: int, moves: int, blocks_released: int,
                 relists: Sequence[bool], plan_of: Callable[[int], Plan]) -> None:
        assert plans + releases == len(relists), (plans, releases, len(relists))
        assert 0 <= densified <= plans and moves >= 0 and blocks_released >= 0
        self.plans, self.releases, self.densified = plans, releases, densified
        self.moves, self.blocks_released = moves, blocks_released
        self.relists, self.plan_of = relists, plan_of

    @classmethod
    def of_plans(cls, plans: Sequence[Plan], kept: Sequence[int]) -> StepCommits:
        """From committed plans (the core's, or the fast gather path's): ``kept[i]`` counts plan i's destinations
        its request lists after the commit (they are not released blocks)."""
        plans = list(plans)
        assert len(kept) == len(plans), (len(kept), len(plans))
        releases = sum(p.kind is PlanKind.RELEASE for p in plans)
        return cls(len(plans) - releases, releases, sum(p.kind is PlanKind.DENSIFY for p in plans),
                   sum(len(p.moves) for p in plans),
                   sum(len(p.src_blocks) - (d if p.dst_blocks else 0) for p, d in zip(plans, kept)),
                   [p.kind is not PlanKind.DENSIFY or bool(p.src_blocks) for p in plans], plans.__getitem__)

    def __len__(self) -> int:
        return len(self.relists)

    def all_plans(self) -> list[Plan]:
        return [self.plan_of(i) for i in range(len(self.relists))]

    def touched(self, everything: bool) -> list[Plan]:
        """The plans after which the request's block list must be mirrored (``relists``), or all with
        ``everything`` (prefix caching: every plan writes blocks whose hashes go), in commit order."""
        if everything:
            return self.all_plans()
        return [self.plan_of(i) for i, relist in enumerate(self.relists) if relist]


NO_COMMITS = StepCommits(0, 0, 0, 0, 0, (), lambda i: None)  # a step that committed nothing


def kept_destinations(table, plan: Plan) -> int:
    """How many of committed ``plan``'s destinations its request lists (``table.block_ids``) after the commit."""
    return len(set(plan.dst_blocks) & set(table.block_ids(plan.req_id))) if plan.dst_blocks else 0
