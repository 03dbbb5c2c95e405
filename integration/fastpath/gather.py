"""``FastGather``: the gather path's compaction and Naive-Evict release over a ``FastTable``, through the compiled
kernels of ``gather_kernels`` (issue #46, part 1).

The core's ``ReclamationManager`` stays the specification: its compact planner (``_plan_compact``: candidates, the
gate ``choose_ranked``, destinations from the pool, the fill ``compact_plan``), ``plan_release`` and the commit
(``_commit`` of a COMPACT or RELEASE plan) are each one kernel call here, and every answer is turned into the core's:
a ``Plan``, a ``NoPlan`` with its reason and detail, a commit, an abort (a stale plan: its destinations freed), or the
core's error with its message. ``tests/test_fastpath_gather.py`` drives both with the same random operations and
compares every answer and the whole state after each.

Also the manager's trigger (``should_reclaim``, with its burst tracking) and its round without packing
(``plan_round``: the order, ``max_plans_per_round``). Not yet here (part 2 of #46): the pressure round's pack (a
densify plan committed later, which needs densify's plan and commit as two kernels), copies through an engine, and a
runtime that calls these per step.
"""

from __future__ import annotations

from array import array
from collections import Counter

import numpy as np

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.compact import SourceChoice
from vtoken.core.errors import (BlockListTooShortError, BlockNotOwnedError, DestinationError, InvariantViolation,
                                PlanConflictError, TokenOutOfRangeError)
from vtoken.core.plan import NoPlan, NoPlanReason, Plan, PlanKind
from vtoken.core.reclamation import ReclaimConfig, ReclaimStats
from vtoken.core.token_table import Move

from . import gather_kernels as K
from .layout import M_LAYOUT_VERSION, M_NBLOCKS, M_NUM_LIVE, M_TOTAL_LEN, P_LIVE_SLOTS
from .moves import MoveArray
from .table import FastTable

COMMITTED, ABORTED = "committed", "aborted"


class FastGather:
    """``ReclamationManager``'s compact and release plans and their commit, for a ``FastTable`` (through its layout's
    arrays and ``gather_kernels``) and a pool of its own. Each kernel's answer becomes the core's: a ``Plan`` or a
    ``NoPlan`` with the core's reason and detail, a commit, an abort (a stale plan: every destination freed), or the
    core's error with its message. Plans in flight are kept by request, in the order made (the manager's)."""

    def __init__(self, fast: FastTable, pool: BlockPool, config: ReclaimConfig | None = None) -> None:
        self.fast, self.pool, self.S = fast, pool, fast.block_size
        self.config = config or ReclaimConfig()
        self.inflight: dict[object, Plan] = {}
        self.burst = False  # the adaptive trigger's state, as the manager's (``should_reclaim``)
        self._f_prev: float | None = None
        self.stats = ReclaimStats()  # rounds, bursts and burst rounds only, so far

    # -- the pool's per-block flags (``_movable``, ``_private``) and Stage 2's budget --
    def movable(self, pack: bool) -> np.ndarray:
        refs, _, cached = self.pool.snapshot()
        flags = np.asarray(refs, np.int64) == 1
        if not pack:
            flags[list(cached)] = False
        return flags.astype(np.uint8)

    def destination_budget(self) -> int:
        free, H = self.pool.num_free, self.pool.headroom
        if H == 0:
            return free
        return max(0, min(free, H - sum(len(p.dst_blocks) for p in self.inflight.values())))

    def waste_ratio(self) -> float:
        allocated = self.pool.num_allocated
        return 0.0 if not allocated else 1.0 - int(self.fast.layout.pool[P_LIVE_SLOTS]) / (allocated * self.S)

    # -- the trigger and the round --
    def should_reclaim(self, iteration: int) -> bool:
        """``ReclamationManager.should_reclaim``: every K-th iteration when F > theta_F (and free blocks at most the
        low watermark); with ``burst_df``, also every iteration of a burst (F rose by burst_df in one iteration)
        until F is back at theta_F. Call it once per iteration, as the manager's."""
        c = self.config
        if c.burst_df is None:
            if iteration % c.check_every:
                return False
            if c.low_watermark is not None and self.pool.num_free > c.low_watermark:
                return False
            return self.waste_ratio() > c.theta_f
        f = self.waste_ratio()
        if self._f_prev is not None and f - self._f_prev >= c.burst_df and f > c.theta_f and not self.burst:
            self.burst = True
            self.stats.bursts += 1
        self._f_prev = f
        if self.burst and f <= c.theta_f:
            self.burst = False
        if c.low_watermark is not None and self.pool.num_free > c.low_watermark:
            return False
        if f <= c.theta_f:
            return False
        on_cadence = iteration % c.check_every == 0
        if not on_cadence and self.burst:
            self.stats.burst_rounds += 1
        return on_cadence or self.burst

    def plan_round(self, req_ids: list) -> list[Plan]:
        """``ReclamationManager.plan_round`` without packing: the requests without a plan in flight, most excess
        blocks (over ceil(live / S)) first, ties in the given order, each planned by ``plan_compact`` at the
        config's ``max_sources``, at most ``max_plans_per_round`` plans; the first request with no excess ends the
        round (sorted: none after it has any). Returns the new plans. The excesses are read off the layout for all
        the requests at once."""
        self.stats.rounds += 1
        idle = [r for r in req_ids if r not in self.inflight]
        meta = self.fast.layout.meta[self.fast.rows_of(idle)] if idle else None
        made: list[Plan] = []
        if idle:
            excess = meta[:, M_NBLOCKS] - -(-meta[:, M_NUM_LIVE] // self.S)
            for k in np.argsort(-excess, kind="stable").tolist():  # NOTE: stable: ties keep the given order
                if len(made) >= self.config.max_plans_per_round or excess[k] <= 0:
                    break
                plan = self.plan_compact(idle[k], self.config.max_sources, False)
                if plan:
                    made.append(plan)
        if self.burst and not made and not self.inflight:
            self.burst = False  # nothing left to gain: back to the cadence
        return made

    # -- planning --
    def candidates(self, req_id, max_sources: int, pack: bool) -> list[tuple[int, int]]:
        row = self.fast._row(req_id)
        idx, cnt = np.empty(max_sources, np.int64), np.empty(max_sources, np.int64)
        code, n, _ = K.compact_candidates(*self.fast._L, row, max_sources, self.movable(pack), idx, cnt)
        assert code == K.OK
        return list(zip(idx[:n].tolist(), cnt[:n].tolist()))

    def choose(self, req_id, max_sources: int, pack: bool, budget: int) -> SourceChoice | NoPlan:
        """``choose_ranked`` of the request's candidates at ``budget`` destinations."""
        row = self.fast._row(req_id)
        idx, cnt = np.empty(max_sources, np.int64), np.empty(max_sources, np.int64)
        _, n, _ = K.compact_candidates(*self.fast._L, row, max_sources, self.movable(pack), idx, cnt)
        src = np.empty(max_sources, np.int64)
        code, a, b = K.compact_gate(idx, cnt, n, self.S, budget, src)
        if code == K.NO_CANDIDATES:
            return NoPlan(NoPlanReason.NO_CANDIDATES, f"request {req_id!r}")
        if code == K.NOT_ENOUGH_HEADROOM:
            return NoPlan(NoPlanReason.NOT_ENOUGH_HEADROOM, f"request {req_id!r}: budget {a}")
        if code == K.NO_STRICT_DECREASE:
            return NoPlan(NoPlanReason.NO_STRICT_DECREASE,
                          f"request {req_id!r}: {a} live tokens in {b} blocks need {-(-a // self.S)}")
        assert code == K.OK, code
        blocks = self.fast.layout.blocks[row]
        return SourceChoice(tuple(blocks[src[:a]].tolist()), b, -(-b // self.S))

    def fill(self, req_id, choice: SourceChoice, dst_blocks: list[int]) -> Plan:
        """``compact_plan`` of ``choice`` into ``dst_blocks``: the kernel's moves as a ``Plan``."""
        row, lay = self.fast._row(req_id), self.fast.layout
        listed = lay.blocks[row, :lay.meta[row, M_NBLOCKS]].tolist()
        sources = np.asarray([listed.index(b) for b in choice.src_blocks], np.int64)
        moves = np.empty((choice.num_live, 5), np.int64)
        code, m, b = K.compact_fill(*self.fast._L, row, sources, choice.num_live,
                                    np.asarray(dst_blocks[:choice.num_dst], np.int64), moves)
        if code == K.FILL_MISMATCH:
            raise InvariantViolation("I4", f"request {req_id!r}: compact would move {m} of {b} live tokens into "
                                           f"{tuple(dst_blocks[:choice.num_dst])}, which must be fresh blocks")
        assert code == K.PLANNED, code
        version = (int(lay.meta[row, M_LAYOUT_VERSION]), int(lay.meta[row, M_TOTAL_LEN]))
        return Plan(PlanKind.COMPACT, req_id, version, MoveArray(array("q", moves[:m].tobytes())), choice.src_blocks,
                    tuple(dst_blocks[:choice.num_dst]))

    def plan_compact(self, req_id, max_sources: int, pack: bool) -> Plan | NoPlan:
        """``ReclamationManager.plan_request`` with the compact planner."""
        self._check_plannable(req_id)
        choice = self.choose(req_id, max_sources, pack, self.destination_budget())
        if not choice:
            return choice
        dsts = self.pool.allocate(choice.num_dst, Purpose.EVACUATION)
        try:
            plan = self.fill(req_id, choice, dsts)
        except BaseException:
            self.pool.free(dsts)
            raise
        self.inflight[req_id] = plan
        if self._f_prev is not None:  # the manager's ``_record``: a plan's own destinations are no burst
            self._f_prev = self.waste_ratio()
        return plan

    def plan_release(self, req_id, among: list[int] | None = None) -> Plan | NoPlan:
        """``ReclamationManager.plan_release``: Naive-Evict's wholly dead private blocks."""
        self._check_plannable(req_id)
        row, lay = self.fast._row(req_id), self.fast.layout
        ids = np.asarray(among if among is not None else [], np.int64)
        out = np.empty(max(int(lay.meta[row, M_NBLOCKS]), 1), np.int64)
        code, n, _ = K.dead_blocks(*self.fast._L, row, self.movable(True), ids, among is not None, out)
        assert code == K.OK
        if not n:
            return NoPlan(NoPlanReason.NO_CANDIDATES, f"request {req_id!r}: no wholly dead private block")
        version = (int(lay.meta[row, M_LAYOUT_VERSION]), int(lay.meta[row, M_TOTAL_LEN]))
        plan = Plan(PlanKind.RELEASE, req_id, version, (), tuple(out[:n].tolist()))
        self.inflight[req_id] = plan
        return plan

    def _check_plannable(self, req_id) -> None:
        self.fast.num_live(req_id)
        if req_id in self.inflight:
            raise PlanConflictError(f"request {req_id!r} already has a plan in flight (I4)")

    # -- commit --
    def settle(self) -> list[tuple[object, str]]:
        """``launch`` then ``settle``: every plan in flight committed (its copy is done) or aborted, in order."""
        return [(r, self.commit(r)) for r in list(self.inflight)]

    def commit(self, req_id) -> str:
        """``ReclamationManager._commit`` of the request's plan in flight: COMMITTED, ABORTED (stale), or the core's
        error, nothing changed."""
        plan, row = self.inflight[req_id], self.fast._row(req_id)
        moves = np.asarray([tuple(m) for m in plan.moves], np.int64).reshape(-1, 5)
        src, dst = np.asarray(plan.src_blocks, np.int64), np.asarray(plan.dst_blocks, np.int64)
        out = np.empty(len(src) + len(dst), np.int64)
        args = (*self.fast._L, row, plan.version[0], src, dst, moves)
        code, a, b = K.commit_compact(*args, False, out)
        if code == K.STALE:
            self.pool.free(plan.dst_blocks)
            del self.inflight[req_id]
            return ABORTED
        if code != K.OK:
            self._refuse(code, a, b, req_id, row, plan)
        to_free = out[:a].tolist()
        for blk, k in Counter(to_free).items():
            if self.pool.ref_count(blk) < k:
                self._fail(req_id, f"block {blk} would be freed {k} time(s) with {self.pool.ref_count(blk)} "
                                   f"reference(s)")
        code, a, b = K.commit_compact(*args, True, out)
        assert code == K.OK, code
        self.pool.free(to_free)
        del self.inflight[req_id]
        return COMMITTED

    def on_request_removed(self, req_id, blocks: list[int]) -> None:
        """The manager's, for a copy already settled (the in-memory engine completes copies when submitted)."""
        plan = self.inflight.pop(req_id, None)
        self.pool.free(blocks + (list(plan.dst_blocks) if plan else []))

    def remove_blocks(self, req_id, indices: list[int], write_pos: int) -> list[int]:
        """``TokenTable.remove_blocks``, with its errors."""
        row = self.fast._row(req_id)
        out = np.empty(len(indices) + 1, np.int64)
        code, a, b = K.remove_blocks(*self.fast._L, row, np.asarray(indices, np.int64), write_pos, out)
        blocks = self.fast.block_ids(req_id)
        if code == K.OK:
            return out[:a].tolist()
        if code == K.BAD_INDICES:
            raise BlockListTooShortError(f"request {req_id!r}: block indices {list(indices)} are not ascending, "
                                         f"distinct indices of its {b} blocks")
        if code == K.SOURCE_LIVE:
            raise BlockNotOwnedError(f"request {req_id!r}: block {a} holds live tokens but would leave block list "
                                     f"{[x for j, x in enumerate(blocks) if j not in set(indices)]}")
        if code == K.CURSOR_OUTSIDE:
            raise BlockListTooShortError(f"request {req_id!r}: cursor {a!r} outside its {b} blocks")
        assert code == K.LIVE_AFTER_CURSOR, code
        raise DestinationError(f"request {req_id!r}: block {a} would hold live tokens at or after cursor {b}")

    # -- the core's refusals, with its messages --
    @staticmethod
    def _fail(req_id, message: str) -> None:
        raise InvariantViolation("I4", f"request {req_id!r}: committing its compact plan would break the table: "
                                       f"{message}; nothing was changed")

    def _refuse(self, code: int, a: int, b: int, req_id, row: int, plan: Plan) -> None:
        if code == K.TOKEN_OUT_OF_RANGE:
            raise TokenOutOfRangeError(f"request {req_id!r}: token {a!r} outside its synced tokens [0, {b})")
        moves = [Move(*map(int, m)) for m in plan.moves]
        blocks = self.fast.block_ids(req_id)
        live = set(self.fast.live_token_ids(req_id))
        landing = {m.token_id for m in moves if m.token_id in live}
        dsts = plan.kept_destinations(lambda m: m.token_id in landing)
        at = blocks.index(plan.src_blocks[0]) if plan.src_blocks and plan.src_blocks[0] in blocks else 0
        gone = set(plan.src_blocks)
        final = blocks[:at] + list(dsts) + [x for x in blocks[at:] if x not in gone]
        message = {
            K.SOURCES_NOT_IN_LIST: lambda: f"its sources {list(plan.src_blocks)} are not in its block list, in order",
            K.DST_NOT_FRESH: lambda: f"block list {blocks[:at] + list(dsts) + blocks[at:]} repeats a block or names "
                                     f"one outside the pool",
            K.DST_LISTED: lambda: f"block {a} cannot join its block list (listed, or named twice)",
            K.MOVE_SOURCE_MISMATCH: lambda: f"move {moves[a]} reads a slot token {moves[a].token_id} does not hold",
            K.MOVE_OUTSIDE: lambda: f"move {moves[a]} writes outside the staged block list or at or after its "
                                    f"cursor {b}",
            K.MOVE_CLAIMED: lambda: f"move {moves[a]} writes slot {b}, which is claimed",
            K.MOVED_TWICE: lambda: "a token moves twice",
            K.CURSOR_OUTSIDE: lambda: f"cursor {a!r} outside its {b} blocks",
            K.SOURCE_LIVE: lambda: f"block {a} holds live tokens but would leave block list {final}",
            K.LIVE_AFTER_CURSOR: lambda: f"block {a} would hold live tokens at or after cursor {b}",
        }.get(code)
        if message is None:
            raise InvariantViolation("V6", f"request {req_id!r}: a gather kernel answered code {code} ({a}, {b})")
        self._fail(req_id, message())


# ---- the lockstep ----------------------------------------------------------------------------------------------------
