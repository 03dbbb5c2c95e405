"""``FastGather``: the gather path's compaction and Naive-Evict release over a ``FastTable``, through the compiled
kernels of ``gather_kernels`` (issue #46, part 1).

The core's ``ReclamationManager`` stays the specification: its compact planner (``_plan_compact``: candidates, the
gate ``choose_ranked``, destinations from the pool, the fill ``compact_plan``), ``plan_release`` and the commit
(``_commit`` of a COMPACT or RELEASE plan) are each one kernel call here, and every answer is turned into the core's:
a ``Plan``, a ``NoPlan`` with its reason and detail, a commit, an abort (a stale plan: its destinations freed), or the
core's error with its message. ``tests/test_fastpath_gather.py`` drives both with the same random operations and
compares every answer and the whole state after each.

Also the manager's trigger (``should_reclaim``, with its burst tracking) and its round (``plan_round``: the order,
``max_plans_per_round``), with the pressure round's pack (``pack=True``: a request compact cannot shrink, or with
holes before its cursor and no excess block, is densified in place: ``plan_pack``, a DENSIFY plan made by
``densify_plan`` and committed later by ``commit_densify``, or aborted when the request appended since). The
manager's counts (``ReclaimStats``) are kept as its are. Not yet here: copies through an engine (a plan's copy is done
when it commits, as with the core's in-memory engine), and a runtime that calls these per step.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Mapping

import numpy as np

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.checks import as_list, check_mapping, is_known_key
from vtoken.core.compact import SourceChoice
from vtoken.core.errors import (BlockListTooShortError, BlockNotOwnedError, ConfigError, DestinationError,
                                DuplicateRequestError, InvalidArgumentError, InvariantViolation, PlanConflictError,
                                TokenOutOfRangeError, UnknownRequestError)
from vtoken.core.plan import NoPlan, NoPlanReason, Plan, PlanKind
from vtoken.core.reclamation import ReclaimConfig, ReclaimStats, ReclamationManager
from vtoken.core.token_table import Move

from . import gather_kernels as K
from .layout import M_LAYOUT_VERSION, M_NBLOCKS, M_NUM_LIVE, M_TOTAL_LEN, M_WRITE_POS, NO_POS, P_LIVE_SLOTS
from .moves import MoveArray
from .table import FastTable

COMMITTED, ABORTED = "committed", "aborted"
STALE_REASON = "layout changed since the snapshot (I4)"  # the manager's abort reasons (``stats.plans_aborted``)
LEFT_REASON = "request left while its plan was in flight"


class FastGather:
    """``ReclamationManager``'s compact, release and pack (densify) plans and their commit, for a ``FastTable``
    (through its layout's arrays and ``gather_kernels``) and a pool of its own. Each kernel's answer becomes the
    core's: a ``Plan`` or a ``NoPlan`` with the core's reason and detail, a commit, an abort (a stale plan: every
    destination freed), or the core's error with its message. Plans in flight are kept by request, in the order made
    (the manager's); ``stats`` counts what the manager's does (``pressure_rounds`` is the runtime's, left to it).
    The gather path's planner is compact: a config naming another is refused."""

    def __init__(self, fast: FastTable, pool: BlockPool, config: ReclaimConfig | None = None) -> None:
        self.fast, self.pool, self.S = fast, pool, fast.block_size
        self.config = config or ReclaimConfig()
        if self.config.planner is not PlanKind.COMPACT:
            raise ConfigError(f"FastGather plans for the gather path: its planner is compact, got "
                              f"{self.config.planner.value!r}")
        self.inflight: dict[object, Plan] = {}
        self.burst = False  # the adaptive trigger's state, as the manager's (``should_reclaim``)
        self._f_prev: float | None = None
        self.stats = ReclaimStats()
        self._flags = np.zeros(fast.num_blocks, np.uint8)  # ``movable``'s and ``shared``'s answers, per block id
        # a pool that shares and caches nothing: every block private (``_shares_nothing``), never written
        self._everywhere, self._nowhere = np.ones(fast.num_blocks, np.uint8), np.zeros(fast.num_blocks, np.uint8)
        self._order = np.empty(fast.cap.rows, np.int64)  # a compact round's order (``K.excess_order``)

    # -- the pool's per-block flags (``_movable``, ``_private``, ``_shared_blocks``) and Stage 2's budget --
    # NOTE: the kernels read a flag only for the blocks the row lists (its candidates, dead blocks, densify's tail),
    # so only those are asked of the pool, as the manager asks per candidate: in one pass where the pool offers
    # ``block_states`` (vLLM's allocator), else block by block
    # NOTE: one array, kept: each call sets the row's blocks only, and leaves other blocks' entries as an earlier call
    # left them, which no kernel reads for this row (no O(pool) fill per plan)
    def movable(self, row: int, pack: bool) -> np.ndarray:
        """Per block id of the row's list: may it be a compaction source (private; with ``pack`` a prefix-cached one
        too) or released once dead (``pack=True``: private).

        NOTE: set only for the blocks its readers read it for, those wholly before the cursor's block that are not
        full (``compact_candidates``' sources, ``dead_blocks``' dead ones): the pool is asked about a handful of
        blocks, not the whole list (a long request lists about a hundred). The flags of the others are stale."""
        if self._shares_nothing():
            return self._everywhere
        lay, flags = self.fast.layout, self._flags
        end = min(lay.meta.item(row, M_WRITE_POS) // self.S, lay.meta.item(row, M_NBLOCKS))
        listed = lay.blocks[row, :end][lay.counts[row, :end] < self.S].tolist()
        refs, cached = self._states(listed)
        flags[listed] = [ref == 1 and (pack or not c) for ref, c in zip(refs, cached)]
        return flags

    def shared(self, row: int) -> np.ndarray:
        """Per block id of the row's list: another reference (the pool's count > 1)."""
        if self._shares_nothing():
            return self._nowhere
        listed, flags = self._listed(row), self._flags
        flags[listed] = [ref > 1 for ref in self._states(listed)[0]]
        return flags

    def _shares_nothing(self) -> bool:
        """NOTE: a pool that says it shares and caches nothing (vLLM's without prefix caching:
        ``VllmBlockAllocator.shares_nothing``) is not asked about each block: every block a request lists is private
        and uncached there, the answer every round would give block by block."""
        return getattr(self.pool, "shares_nothing", False) is True

    def _states(self, listed: list[int]) -> tuple[list[int], list[bool]]:
        states = getattr(self.pool, "block_states", None)
        if states is not None:
            return states(listed)
        pool = self.pool
        return [pool.ref_count(b) for b in listed], [pool.is_cached(b) for b in listed]

    def _listed(self, row: int) -> list[int]:
        lay = self.fast.layout
        return lay.blocks[row, :lay.meta[row, M_NBLOCKS]].tolist()

    def destination_budget(self) -> int:
        free, H = self.pool.num_free, self.pool.headroom
        if H == 0:
            return free
        return max(0, min(free, H - sum(len(p.dst_blocks) for p in self.inflight.values())))

    def waste_ratio(self) -> float:
        allocated = self.pool.num_allocated
        return 0.0 if not allocated else 1.0 - int(self.fast.layout.pool[P_LIVE_SLOTS]) / (allocated * self.S)

    # -- the trigger and the round --
    # NOTE: the manager's own trigger, not a second one: scalar Python once per step, with nothing to gain from a
    # kernel, reading the attributes it reads there (config, pool, waste_ratio, burst, _f_prev, stats); the lockstep
    # still compares F, the answer and the burst state, which this class computes on its own
    should_reclaim = ReclamationManager.should_reclaim

    def plan_round(self, req_ids: list, pack: bool = False,
                   evicted_positions: Mapping[object, list[int]] | None = None) -> list[Plan]:
        """``ReclamationManager.plan_round``: the requests without a plan in flight, most excess blocks (over
        ceil(live / S)) first, then (``pack``) most holes before the cursor, ties in the given order; each with excess
        planned by ``plan_compact`` at the config's ``max_sources`` (``pack``: prefix-cached blocks too), and, packing,
        densified in place (``plan_pack``, with its ``evicted_positions`` if the mapping has it) when that made no
        plan or it had no excess; at most ``max_plans_per_round`` plans. The first request with no excess (packing:
        and no hole) ends the round (sorted: none after it has any). Returns the new plans. ``req_ids`` must be known
        requests, each once (else the manager's UnknownRequestError / DuplicateRequestError, nothing changed). The
        excesses and holes are read off the layout for all the requests at once."""
        req_ids = as_list("plan_round: request ids", req_ids, InvalidArgumentError)
        seen: set[object] = set()
        for r in req_ids:
            if r not in self.fast:
                raise UnknownRequestError(f"plan_round: unknown request {r!r}")
            if r in seen:
                raise DuplicateRequestError(f"plan_round: request {r!r} listed twice")
            seen.add(r)
        evicted_positions = {} if evicted_positions is None else check_mapping("evicted_positions", evicted_positions)
        return self.round(req_ids, pack, evicted_positions)

    def round(self, req_ids: list, pack: bool, evicted_positions: Mapping[object, list[int]]) -> list[Plan]:
        """``plan_round`` unchecked, for the runtime's own call: its every request in admission order, each once."""
        self.stats.rounds += 1
        idle = [r for r in req_ids if r not in self.inflight] if self.inflight else req_ids
        made: list[Plan] = []
        if idle:
            rows = self.fast.rows_of(idle)
            if not pack:  # every request with excess, gated in one pass (the loop below, batched)
                n = K.excess_order(self.fast.layout.meta, rows, self.S, self._order)
                order = self._order[:n]
                return self._compact_round([idle[k] for k in order.tolist()], rows[order] if n else rows[:0])
            meta = self.fast.layout.meta[rows]
            live = meta[:, M_NUM_LIVE]
            excess = meta[:, M_NBLOCKS] - -(-live // self.S)
            gap = meta[:, M_WRITE_POS] - live
            order = np.lexsort((-gap, -excess))  # NOTE: stable, as above
            for k in order.tolist():
                if len(made) >= self.config.max_plans_per_round:
                    break
                if excess[k] <= 0 and not gap[k] > 0:
                    break
                r = idle[k]
                plan = self.plan_compact(r, self.config.max_sources, pack) if excess[k] > 0 else None
                if pack and not plan:
                    plan = self.plan_pack(r, evicted_positions.get(r) if is_known_key(evicted_positions, r)
                                          else None)
                if plan:
                    made.append(plan)
        if self.burst and not made and not self.inflight:
            self.burst = False  # nothing left to gain: back to the cadence
        return made

    def _compact_round(self, req_ids: list, rows: np.ndarray) -> list[Plan]:
        """``plan_round``'s loop without packing, for ``req_ids`` (rows ``rows``) in their round order (all with
        excess): every request's candidates (``movable`` asked of the pool once for all) and gate, the budget
        shrinking by each plan's destinations, in two kernel calls; then each chosen request's destinations allocated
        and its moves filled in that order, as ``plan_compact`` one request at a time."""
        made: list[Plan] = []
        if req_ids:
            m, width = len(req_ids), self.config.max_sources
            movable = self._movable_rows(rows)
            idx, cnt, n = np.empty((m, width), np.int64), np.empty((m, width), np.int64), np.empty(m, np.int64)
            K.round_candidates(*self.fast._L, rows, width, movable, idx, cnt, n)
            src, out = np.empty((m, width), np.int64), np.empty((m, 3), np.int64)
            gated = K.round_gates(idx, cnt, n, self.S, self.destination_budget(), self.config.max_plans_per_round,
                                   src, out)
            codes = out[:gated, 0].tolist()
            for code, times in Counter(codes).items():  # the refused ones counted as ``_record`` counts a NoPlan
                if code != K.OK:
                    self.stats.no_plan[_REASONS[code]] += times
            for j in [j for j, code in enumerate(codes) if code == K.OK]:
                r, (_, a, b) = req_ids[j], out[j].tolist()
                blocks = self.fast.layout.blocks[rows[j]]
                made.append(self._planned(r, SourceChoice(tuple(blocks[src[j, :a]].tolist()), b, -(-b // self.S))))
        if self.burst and not made and not self.inflight:
            self.burst = False  # nothing left to gain: back to the cadence
        return made

    def _movable_rows(self, rows: np.ndarray) -> np.ndarray:
        """``movable(row, pack=False)`` of every row of ``rows``: the pool asked once, about all their blocks that
        the kernels read the flag for (``movable``'s NOTE)."""
        if self._shares_nothing():
            return self._everywhere
        lay, flags, S = self.fast.layout, self._flags, self.S
        ends = np.minimum(lay.meta[rows, M_WRITE_POS] // S, lay.meta[rows, M_NBLOCKS])
        width = int(ends.max())
        blocks = lay.blocks[rows, :width]
        listed = blocks[(np.arange(width) < ends[:, None]) & (lay.counts[rows, :width] < S)].tolist()
        refs, cached = self._states(listed)
        flags[listed] = [ref == 1 and not c for ref, c in zip(refs, cached)]
        return flags

    # -- planning --
    def candidates(self, req_id, max_sources: int, pack: bool) -> list[tuple[int, int]]:
        row = self.fast._row(req_id)
        idx, cnt = np.empty(max_sources, np.int64), np.empty(max_sources, np.int64)
        code, n, _ = K.compact_candidates(*self.fast._L, row, max_sources, self.movable(row, pack), idx, cnt)
        assert code == K.OK
        return list(zip(idx[:n].tolist(), cnt[:n].tolist()))

    def choose(self, req_id, max_sources: int, pack: bool, budget: int) -> SourceChoice | NoPlan:
        """``choose_ranked`` of the request's candidates at ``budget`` destinations."""
        row = self.fast._row(req_id)
        idx, cnt = np.empty(max_sources, np.int64), np.empty(max_sources, np.int64)
        _, n, _ = K.compact_candidates(*self.fast._L, row, max_sources, self.movable(row, pack), idx, cnt)
        src = np.empty(max_sources, np.int64)
        code, a, b = K.compact_gate(idx, cnt, n, self.S, budget, src)
        if code != K.OK:
            return _no_plan(req_id, code, int(a), int(b), self.S)
        blocks, b = self.fast.layout.blocks[row], int(b)
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
        return self._planned(req_id, choice) if choice else self._record(req_id, choice)

    def _planned(self, req_id, choice: SourceChoice) -> Plan:
        """The chosen sources' plan: its destinations allocated, its moves filled, recorded in flight."""
        dsts = self.pool.allocate(choice.num_dst, Purpose.EVACUATION)
        try:
            plan = self.fill(req_id, choice, dsts)
        except BaseException:
            self.pool.free(dsts)
            raise
        return self._record(req_id, plan)

    def plan_pack(self, req_id, evicted_positions: list[int] | None = None) -> Plan | NoPlan:
        """``ReclamationManager.plan_pack``: densify the request in place, whatever the configured planner (the
        pressure round's packing), recorded in flight and committed later (``commit``), or aborted if the request
        appends meanwhile. ``evicted_positions``: where this step's evictions were (the holes found among them when
        they are all of them). Counts ``stats.packs_made``."""
        self._check_plannable(req_id)
        plan = self.plan_densify(req_id, evicted_positions)
        self._record(req_id, plan)
        self.stats.packs_made += bool(plan)
        return plan

    def plan_densify(self, req_id, evicted_positions: list[int] | None = None) -> Plan | NoPlan:
        """``plan_densify`` of the request (the manager's ``_plan_densify``: the same plan whichever search finds the
        holes) as a ``Plan`` or the ``NoPlan``, through ``densify_plan``; records nothing."""
        row, lay = self.fast._row(req_id), self.fast.layout
        meta = lay.meta[row]
        n, pos, nb = int(meta[M_NUM_LIVE]), int(meta[M_WRITE_POS]), int(meta[M_NBLOCKS])
        evicted = np.asarray(list(evicted_positions) if evicted_positions is not None else [], np.int64)
        moves, released, shared = np.empty((pos - n, 5), np.int64), np.empty(nb + 1, np.int64), np.empty(nb + 1,
                                                                                                        np.int64)
        code, a, b = K.densify_plan(*self.fast._L, row, evicted, self.shared(row), moves, released, shared)
        if code == K.DENSE_MISMATCH:
            raise InvariantViolation("I7", f"request {req_id!r}: {a} live tokens at or above n_live {n}, {b} holes "
                                           f"below it")
        if code == K.ALREADY_DENSE:
            return NoPlan(NoPlanReason.ALREADY_DENSE, f"request {req_id!r}")
        if code == K.SHARED_BLOCK:
            return NoPlan(NoPlanReason.SHARED_BLOCK, f"request {req_id!r}: blocks {shared[:a].tolist()}")
        assert code == K.PLANNED, code
        version = (int(meta[M_LAYOUT_VERSION]), int(meta[M_TOTAL_LEN]))
        return Plan(PlanKind.DENSIFY, req_id, version, MoveArray(array("q", moves[:a].tobytes())),
                    tuple(released[:b].tolist()), (), n)

    def _record(self, req_id, plan: Plan | NoPlan) -> Plan | NoPlan:
        """The manager's ``_record``: a NoPlan counted by reason, a plan put in flight and counted."""
        if not plan:
            self.stats.no_plan[plan.reason] += 1
            return plan
        self.inflight[req_id] = plan
        if plan.kind is PlanKind.RELEASE:
            self.stats.releases_made += 1
            return plan
        self.stats.plans_made += 1
        if self._f_prev is not None:  # a plan's own destinations are no burst
            self._f_prev = self.waste_ratio()
        return plan

    def plan_release(self, req_id, among: list[int] | None = None) -> Plan | NoPlan:
        """``ReclamationManager.plan_release``: Naive-Evict's wholly dead private blocks."""
        self._check_plannable(req_id)
        row, lay = self.fast._row(req_id), self.fast.layout
        ids = np.asarray(among if among is not None else [], np.int64)
        out = np.empty(max(int(lay.meta[row, M_NBLOCKS]), 1), np.int64)
        code, n, _ = K.dead_blocks(*self.fast._L, row, self.movable(row, True), ids, among is not None, out)
        assert code == K.OK
        if not n:
            return NoPlan(NoPlanReason.NO_CANDIDATES, f"request {req_id!r}: no wholly dead private block")
        version = (int(lay.meta[row, M_LAYOUT_VERSION]), int(lay.meta[row, M_TOTAL_LEN]))
        return self._record(req_id, Plan(PlanKind.RELEASE, req_id, version, (), tuple(out[:n].tolist())))

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
        return self.commit_counted(req_id)[0]

    def commit_counted(self, req_id) -> tuple[str, int]:
        """``commit``, and how many of the plan's destinations its request lists after it (0 unless COMMITTED):
        the kernel's count, which ``StepCommits`` needs and would otherwise recount from the block list."""
        plan, row = self.inflight[req_id], self.fast._row(req_id)
        moves = _move_rows(plan.moves)
        if plan.kind is PlanKind.DENSIFY:
            return self._commit_densify(req_id, row, plan, moves), 0
        src, dst = np.asarray(plan.src_blocks, np.int64), np.asarray(plan.dst_blocks, np.int64)
        out = np.empty(len(src) + len(dst), np.int64)
        args = (*self.fast._L, row, plan.version[0], src, dst, moves)
        code, a, b = K.commit_compact(*args, False, out)
        if code == K.STALE:
            return self._abort(req_id, plan), 0
        if code != K.OK:
            self._refuse(code, a, b, req_id, row, plan)
        to_free = out[:a].tolist()
        for blk, k in Counter(to_free).items():
            if self.pool.ref_count(blk) < k:
                self._fail(req_id, f"block {blk} would be freed {k} time(s) with {self.pool.ref_count(blk)} "
                                   f"reference(s)")
        kept = self._kept(row, moves)
        code, a, d = K.commit_compact(*args, True, out)
        assert code == K.OK, code
        self.pool.free(to_free)
        del self.inflight[req_id]
        st = self.stats
        if plan.kind is PlanKind.RELEASE:
            st.releases_committed += 1
        else:
            st.plans_committed += 1
        st.moves_dropped += len(moves) - kept
        st.moves_committed += kept
        st.blocks_released += len(plan.src_blocks) - d
        return COMMITTED, d

    def _commit_densify(self, req_id, row: int, plan: Plan, moves: np.ndarray) -> str:
        """The manager's ``_commit`` of a DENSIFY plan (``_commit_densify``): aborted when stale (the layout changed,
        or the request appended), else the moves whose token died dropped, every check, then the commit."""
        src = np.asarray(plan.src_blocks, np.int64)
        cursor = plan.dense_write_pos
        out = np.empty(len(src) + 1, np.int64)
        args = (*self.fast._L, row, plan.version[0], plan.version[1], src, moves, cursor)
        code, a, b = K.commit_densify(*args, False, out)
        if code in (K.STALE, K.APPENDED):
            return self._abort(req_id, plan)
        if code != K.OK:
            self._refuse_densify(code, a, b, req_id, plan)
        for blk in plan.src_blocks:
            if self.pool.ref_count(blk) < 1:
                self._fail(req_id, f"block {blk} would be freed with {self.pool.ref_count(blk)} reference(s)",
                           "densify")
        code, kept, k = K.commit_densify(*args, True, out)
        assert code == K.OK, code
        self.pool.free(list(plan.src_blocks))
        del self.inflight[req_id]
        st = self.stats
        st.moves_dropped += len(moves) - kept
        st.plans_committed += 1
        st.moves_committed += kept
        st.blocks_released += k
        return COMMITTED

    def _kept(self, row: int, moves: np.ndarray) -> int:
        """How many of the moves' tokens are live (the rest are dropped at commit)."""
        if not len(moves):
            return 0
        return int((self.fast.layout.tok_pos[row, moves[:, 0]] != NO_POS).sum())

    def _abort(self, req_id, plan: Plan, reason: str = STALE_REASON) -> str:
        """The manager's ``_abort`` of a plan that launched nothing or whose copy is done: its destinations freed."""
        self.pool.free(plan.dst_blocks)
        del self.inflight[req_id]
        self.stats.plans_aborted[reason] += 1
        return ABORTED

    def on_request_removed(self, req_id, blocks: list[int]) -> None:
        """The manager's, for a copy already settled (the in-memory engine completes copies when submitted)."""
        plan = self.inflight.pop(req_id, None)
        if plan is not None:
            self.stats.plans_aborted[LEFT_REASON] += 1
        self.pool.free(blocks + (list(plan.dst_blocks) if plan else []))

    def remove_blocks(self, req_id, indices: list[int], write_pos: int) -> list[int]:
        """``TokenTable.remove_blocks``, with its errors."""
        row = self.fast._row(req_id)
        out = np.empty(len(indices) + 1, np.int64)
        code, a, b = K.remove_blocks(*self.fast._L, row, np.asarray(indices, np.int64), write_pos, out)
        blocks = self.fast.block_ids(req_id)
        if code == K.OK:
            return out[:a].tolist()
        a, b = int(a), int(b)  # NOTE: numpy scalars when the kernels run as plain Python (NUMBA_DISABLE_JIT)
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
    def _fail(req_id, message: str, kind: str = "compact") -> None:
        """The manager's commit checks' refusal (a release plan's reads "compact", as the manager's does)."""
        raise InvariantViolation("I4", f"request {req_id!r}: committing its {kind} plan would break the table: "
                                       f"{message}; nothing was changed")

    def _refuse_densify(self, code: int, a: int, b: int, req_id, plan: Plan) -> None:
        """``commit_densify``'s refusal as ``_check_densify_commit``'s (or ``slots_of``'s) error."""
        a, b = int(a), int(b)  # NOTE: numpy scalars when the kernels run as plain Python (NUMBA_DISABLE_JIT)
        if code == K.TOKEN_OUT_OF_RANGE:
            raise TokenOutOfRangeError(f"request {req_id!r}: token {a!r} outside its synced tokens [0, {b})")
        moves = [Move(*map(int, m)) for m in plan.moves]

        def without_sources() -> list[int]:  # the list once the tail [ceil(cursor / S), + sources) is spliced out
            blocks, at = self.fast.block_ids(req_id), -(-plan.dense_write_pos // self.S)
            return blocks[:at] + blocks[at + len(plan.src_blocks):]

        message = {
            K.MOVE_SOURCE_MISMATCH: lambda: f"move {moves[a]} reads a slot token {moves[a].token_id} does not hold",
            K.MOVE_OUTSIDE: lambda: f"move {moves[a]} writes outside the block list or at or after its cursor {b}",
            K.MOVE_CLAIMED: lambda: f"move {moves[a]} writes slot {b}, which is claimed",
            K.MOVED_TWICE: lambda: "a token moves twice",
            K.CURSOR_OUTSIDE: lambda: f"cursor {a!r} outside its {b} blocks",
            K.SOURCES_NOT_TAIL: lambda: f"its sources {list(plan.src_blocks)} are not blocks [{a}, {a + b}) of the "
                                        f"list",
            K.SOURCE_LIVE: lambda: f"block {a} holds live tokens but would leave block list {without_sources()}",
            K.LIVE_AFTER_CURSOR: lambda: f"block {a} would hold live tokens at or after cursor {b}",
        }.get(code)
        if message is None:
            raise InvariantViolation("V6", f"request {req_id!r}: a gather kernel answered code {code} ({a}, {b})")
        self._fail(req_id, message(), "densify")

    def _refuse(self, code: int, a: int, b: int, req_id, row: int, plan: Plan) -> None:
        a, b = int(a), int(b)  # NOTE: numpy scalars when the kernels run as plain Python (NUMBA_DISABLE_JIT)
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


def _move_rows(moves) -> np.ndarray:
    """A plan's moves as an int64 array of five fields per row: a ``MoveArray``'s own buffer (no copy), else built."""
    if isinstance(moves, MoveArray):
        return np.frombuffer(moves.fields, np.int64).reshape(-1, 5) if moves.fields else np.empty((0, 5), np.int64)
    return np.asarray([tuple(m) for m in moves], np.int64).reshape(-1, 5)


_REASONS = {K.NO_CANDIDATES: NoPlanReason.NO_CANDIDATES, K.NOT_ENOUGH_HEADROOM: NoPlanReason.NOT_ENOUGH_HEADROOM,
            K.NO_STRICT_DECREASE: NoPlanReason.NO_STRICT_DECREASE}


def _no_plan(req_id, code: int, a: int, b: int, S: int) -> NoPlan:
    """``compact_gate``'s refusal as the manager's ``NoPlan``."""
    if code == K.NO_CANDIDATES:
        return NoPlan(NoPlanReason.NO_CANDIDATES, f"request {req_id!r}")
    if code == K.NOT_ENOUGH_HEADROOM:
        return NoPlan(NoPlanReason.NOT_ENOUGH_HEADROOM, f"request {req_id!r}: budget {a}")
    assert code == K.NO_STRICT_DECREASE, code
    return NoPlan(NoPlanReason.NO_STRICT_DECREASE, f"request {req_id!r}: {a} live tokens in {b} blocks need {-(-a // S)}")
