"""The reclamation manager: the paper's Stages 1, 2 and 4 as an explicit state machine.

Stage 1 (eligibility): the global waste ratio F (Eq. 1) is an O(1) read of
pool-wide occupancy; a round runs every ``check_every`` iterations when
F > theta_F and free blocks are at or below the low watermark.

The adaptive trigger (``burst_df``, off by default) keeps that lazy cadence on
quiet steps and reacts to an eviction burst at once. It reads F on every
iteration (O(1), as the K = 1 trigger does) and remembers the previous
iteration's reading (re-read after each plan: the destinations a plan reserves
count as waste until it commits, and are no burst). A *burst* is F rising by
at least ``burst_df`` within one iteration: steady eviction moves F by a
fraction of a token per request per step, a burst by the evicted share of
every request at once. A burst starts
*burst mode*, in which a round runs on every iteration, whatever the K
cadence, while F > theta_F; burst mode ends once F <= theta_F, or when a round
makes no plan and none is in flight (compaction has nothing left to gain).
theta_F and the low watermark gate burst rounds exactly as they gate cadence
rounds. A slow rise of F is left to the cadence. Either way the trigger only
decides *when* ``plan_round`` runs; every plan is made, launched, committed or
aborted by the same code whenever it runs, so I1-I7 hold whatever the trigger
decides (the fuzzer draws both triggers; docs/spec.md).
Stage 2 (headroom): destinations come from the evacuation headroom, and the
headroom bounds them: with ``pool.headroom`` H > 0, the destination blocks
held by all plans whose copies are outstanding (in flight or orphaned) never
exceed H, however many other blocks are free; H = 0 means no reserve and no
bound, so compaction may take any free block (``destination_budget``). While
a plan is in flight and the headroom is borrowed, admission is closed
(backpressure).
Stage 3 (planning) is ``compact.py`` / ``densify.py``.
Stage 4 (copy): plans are launched after the step's forward on a
``CopyEngine`` and committed once the copy is settled.

Plan lifecycle:  PLANNED -> COPYING -> COMMITTED | ABORTED, and PLANNED ->
ABORTED when the engine refuses to launch the copy (``launch``). A plan is
COPYING only once its copy is submitted (it has a handle) or it has nothing to
copy. At most one plan per request is in flight (I4). Blocks a pending copy reads
(sources) or writes (destinations) are never returned to the pool until the
copy is settled (I5, I6), even when the request finishes or is preempted
meanwhile.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping

from .block_pool import BlockAllocator, Purpose
from .compact import choose_ranked, compact_plan
from .checks import as_list, check_enum, check_int, check_mapping, is_int, is_known_key
from .copy_engine import CopyEngine, CopyHandle, CopyStatus
from .densify import DensifyTail, plan_densify, plan_densify_tail
from .errors import (
    BlockNotOwnedError,
    BlockOutOfRangeError,
    ConfigError,
    DoubleFreeError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantViolation,
    PlanConflictError,
    RequestStillRegisteredError,
    UnknownRequestError,
    VTokenError,
)
from .occupancy import waste_ratio
from .plan import NoPlan, NoPlanReason, Plan, PlanKind
from .relocate import plan_relocation
from .token_table import NO_SLOT, TokenTable


LAUNCH_FAILED = "copy launch failed"  # stats.plans_aborted key of plans whose submit raised
# what a submit that did not start its copy raises (the CopyEngine contract: it wrote nothing); CUDA errors,
# torch.cuda.OutOfMemoryError included, are RuntimeErrors
LAUNCH_ERRORS = (VTokenError, RuntimeError, MemoryError)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Ordering(enum.Enum):
    """How a committed relocation is kept ahead of the attention that reads it (I3)."""

    POLL = "poll"  # commit only when the engine reports DONE
    EVENT = "event"  # order later compute after the copy (GPU wait_event), commit at once
    FORCE_SYNC = "force_sync"  # the host waits for every copy (the paper's ablation)


class PlanState(enum.Enum):
    PLANNED = "planned"
    COPYING = "copying"
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class ReclaimConfig:
    planner: PlanKind = PlanKind.COMPACT
    theta_f: float = 0.25  # trigger when the waste ratio F exceeds this
    low_watermark: int | None = None  # and free blocks <= this (None: any number)
    check_every: int = 1  # K: rounds run on every K-th iteration
    max_sources: int = 8  # B: source blocks per compact plan
    max_plans_per_round: int = 16
    ordering: Ordering = Ordering.POLL
    burst_df: float | None = None  # adaptive trigger: a rise of F by this within one iteration (None: off)

    def __post_init__(self) -> None:
        """Every field is checked for its type as well as its range (a bool is no int here, a str no number);
        the message starts with the field's name."""
        # a member or its value ("compact"), stored as the member (frozen: through object.__setattr__)
        object.__setattr__(self, "planner", check_enum(
            "planner", self.planner, PlanKind, allowed=tuple(k for k in PlanKind if k is not PlanKind.RELEASE),
            hint=" (release is no planner: it runs on the gather path whatever the planner)"))
        object.__setattr__(self, "ordering", check_enum("ordering", self.ordering, Ordering))
        if not _is_number(self.theta_f) or not 0.0 <= self.theta_f < 1.0:  # NaN fails the range
            raise ConfigError(f"theta_f must be a number in [0, 1), got {self.theta_f!r}")
        if self.low_watermark is not None and (not is_int(self.low_watermark) or self.low_watermark < 0):
            raise ConfigError(f"low_watermark must be None or an int >= 0 (free blocks), got {self.low_watermark!r}")
        for name in ("check_every", "max_sources", "max_plans_per_round"):
            check_int(name, getattr(self, name), 1, error=ConfigError)
        if self.burst_df is not None and (isinstance(self.burst_df, bool) or not isinstance(self.burst_df, (int, float))
                                          or not 0.0 < self.burst_df <= 1.0):
            raise ConfigError(f"burst_df must be None (adaptive trigger off) or a number in (0, 1], "
                              f"got {self.burst_df!r}")


@dataclass
class PlanRecord:
    plan: Plan
    state: PlanState = PlanState.PLANNED
    handle: CopyHandle | None = None
    held: tuple[int, ...] = ()  # blocks of a departed request kept until the copy settles
    abort_reason: str = ""
    abort_detail: str = ""  # the error, when the engine refused the launch ("RuntimeError: ...")


@dataclass
class ReclaimStats:
    rounds: int = 0
    plans_made: int = 0
    plans_committed: int = 0
    plans_aborted: Counter = field(default_factory=Counter)
    no_plan: Counter = field(default_factory=Counter)
    moves_committed: int = 0
    moves_dropped: int = 0  # tokens evicted while their move was in flight
    blocks_released: int = 0  # net blocks returned by committed plans, releases included
    releases_made: int = 0  # RELEASE plans (wholly dead blocks, no copy): not in plans_made / plans_committed
    releases_committed: int = 0
    bursts: int = 0  # bursts the adaptive trigger detected
    burst_rounds: int = 0  # rounds it ran off the K cadence
    pressure_rounds: int = 0  # rounds run under the engine's pressure that the trigger would not have run
    packs_made: int = 0  # densify plans a pressure round made on the gather path (``plan_pack``; in plans_made too)


class ReclamationManager:
    def __init__(self, pool: BlockAllocator, table: TokenTable, engine: CopyEngine,
                 config: ReclaimConfig | None = None) -> None:
        self.pool = pool
        self.table = table
        self.engine = engine
        self.config = config or ReclaimConfig()
        self.inflight: dict[object, PlanRecord] = {}  # req_id -> its one in-flight plan (I4)
        self.orphans: list[PlanRecord] = []  # plans whose request left while the copy ran
        self.stats = ReclaimStats()
        # NOTE: the fuzzer and the simulator switch this on: every plan a fast planner makes is compared with
        # its reference planner on the full snapshot (V3); off in serving, where it would cost O(L) per plan
        self.verify_fast_paths = False
        self.burst = False  # adaptive trigger: in burst mode (rounds on every iteration while F > theta_F)
        self._f_prev: float | None = None  # adaptive trigger: F read at the previous call of should_reclaim

    # ---- Stage 1: eligibility -------------------------------------------------------
    def waste_ratio(self) -> float:
        """F of Eq. 1 over all allocated blocks (destinations in flight count as waste); O(1)."""
        return waste_ratio(self.table.occupancy.live_slots, self.pool.num_allocated, self.pool.block_size)

    def should_reclaim(self, iteration: int) -> bool:
        """Whether a round runs now. Call once per iteration (the runtime does, after evicting).

        Fixed trigger: every K-th iteration, when F > theta_F and free blocks <= the low watermark.
        With ``burst_df`` it also tracks bursts (module docstring), so it must see every iteration.
        """
        c = self.config
        if not is_int(iteration) or iteration < 0:
            raise InvalidArgumentError(f"should_reclaim: iteration must be an int >= 0, got {iteration!r}")
        if c.burst_df is None:
            if iteration % c.check_every:
                return False
            if c.low_watermark is not None and self.pool.num_free > c.low_watermark:
                return False
            return self.waste_ratio() > c.theta_f
        f = self.waste_ratio()  # raises I2 if F leaves [0, 1] (occupancy.waste_ratio)
        if self._f_prev is not None and f - self._f_prev >= c.burst_df and f > c.theta_f and not self.burst:
            self.burst = True
            self.stats.bursts += 1
        self._f_prev = f
        if self.burst and f <= c.theta_f:
            self.burst = False  # caught up: back to the cadence
        if c.low_watermark is not None and self.pool.num_free > c.low_watermark:
            return False
        if f <= c.theta_f:
            return False
        on_cadence = iteration % c.check_every == 0
        if not on_cadence and self.burst:
            self.stats.burst_rounds += 1
        return on_cadence or self.burst

    # ---- Stage 2: headroom-aware admission ---------------------------------------------
    def admission_open(self) -> bool:
        """False while reclamation has borrowed the headroom and has not given it back (a RELEASE plan borrows
        nothing: it only gives blocks back)."""
        return self.pool.num_free >= self.pool.headroom or all(
            r.plan.kind is PlanKind.RELEASE for r in self.inflight.values())

    def destination_budget(self) -> int:
        """How many destination blocks a new compact plan may take now (Stage 2's bound).

        With a headroom H > 0 the evacuation headroom is a bound, not just a reserve: the destinations held
        by every plan whose copy is outstanding (in flight, or orphaned by a departed request until its copy
        settles) never exceed H, even when more blocks are free, so reclamation's claim on the pool stays
        as small as configured. With H = 0 there is no reserve and no bound: any free block may be a
        destination (what a pool without headroom, vLLM's default, has always done). Never more than free.

        post: 0 <= __return__ <= self.pool.num_free
        """
        free, H = self.pool.num_free, self.pool.headroom
        if H == 0:
            return free
        held = sum(len(r.plan.dst_blocks) for r in self.inflight.values()) + sum(
            len(r.plan.dst_blocks) for r in self.orphans)
        return max(0, min(free, H - held))

    # ---- Stage 3: planning -------------------------------------------------------------
    def plan_round(self, req_ids: list[object], pack: bool = False,
                   evicted_positions: Mapping[object, list[int]] | None = None) -> list[PlanRecord]:
        """Plan for the most wasteful requests first; returns the new PLANNED records.

        ``pack`` (the engine's pressure, ``VTokenRuntime.set_pressure``): capacity before thrift. A request that
        compact cannot shrink (no strict decrease within the destination budget), or whose cursor lies past holes
        while it holds no excess block, is densified instead: its live tokens fill [0, n_live) in place and its
        cursor rewinds to n_live, so it holds its ideal block count and its next appends land in blocks it
        already has. Compaction never touches the append block, so it alone leaves up to one block per request
        above the ideal (docs/results.md, Q3). Densify takes no destination, so the headroom does not bound it;
        it goes stale (and is aborted, having written only holes) if the request appends before it commits.

        ``evicted_positions`` (packing): where each request's tokens this step evicted were, so that a pack of a
        request already dense before them plans in O(evicted) (``plan_pack``).

        ``req_ids`` must be registered requests, each once (else UnknownRequestError / DuplicateRequestError,
        and nothing changes: not even the round count).
        """
        req_ids = self._check_request_list(req_ids)
        evicted_positions = {} if evicted_positions is None else check_mapping("evicted_positions", evicted_positions)
        self.stats.rounds += 1
        t, S = self.table, self.pool.block_size

        def excess(r: object) -> int:
            return t.num_blocks_of(r) - -(-t.num_live(r) // S)

        def gap(r: object) -> int:  # holes before the cursor
            return t.write_pos(r) - t.num_live(r)

        def order(r: object) -> tuple[int, int]:  # NOTE: without packing, ties keep the given order (stable sort)
            return -excess(r), -gap(r) if pack else 0

        made = []
        for r in sorted((r for r in req_ids if r not in self.inflight), key=order):
            if len(made) >= self.config.max_plans_per_round:
                break
            if excess(r) <= 0 and not (pack and gap(r) > 0):
                break  # NOTE: sorted, so every later request has no excess either (and, packing, no hole)
            rec = self.plan_request(r, pack=pack) if excess(r) > 0 else None
            if pack and not isinstance(rec, PlanRecord):
                rec = self.plan_pack(r, evicted_positions.get(r) if is_known_key(evicted_positions, r) else None)
            if isinstance(rec, PlanRecord):
                made.append(rec)
        if self.burst and not made and not self.inflight:
            self.burst = False  # nothing left to gain: back to the cadence
        return made

    def plan_request(self, req_id: object, evicted_positions: list[int] | None = None,
                     pack: bool = False) -> PlanRecord | NoPlan:
        """Plan one request now with the configured planner (the dense path calls this every step).

        Compact destinations are allocated now (EVACUATION), at most ``destination_budget()`` of them.
        ``evicted_positions`` (densify only): where the tokens this step evicted were; when they are the
        request's only holes, densify plans in O(evicted) (``_densify_tail``), the same plan either way.
        ``pack`` (a pressure round): compact may take prefix-cached blocks too (``_movable``).
        raises: UnknownRequestError, PlanConflictError (I4); either way nothing changes.
        """
        self._check_plannable(req_id)
        if self.config.planner is PlanKind.DENSIFY:
            return self._record(req_id, self._plan_densify(req_id, evicted_positions))
        return self._record(req_id, self._plan_compact(req_id, pack))

    def plan_pack(self, req_id: object, evicted_positions: list[int] | None = None) -> PlanRecord | NoPlan:
        """Plan densifying the request in place, whatever the configured planner: the pressure round's packing
        (``plan_round(pack=True)``). Its live tokens fill [0, n_live) and its cursor becomes n_live; no destination
        is taken. O(L), a full snapshot; but when ``evicted_positions`` (where this step's evictions were) are the
        request's only holes, as for a request packed at the step before, O(evicted) (``_densify_tail``, the same
        plan: V3 compares them under ``verify_fast_paths``).
        raises: UnknownRequestError, PlanConflictError (I4); either way nothing changes."""
        self._check_plannable(req_id)
        rec = self._record(req_id, self._plan_densify(req_id, evicted_positions))
        self.stats.packs_made += isinstance(rec, PlanRecord)
        return rec

    def plan_release(self, req_id: object, among: list[int] | None = None) -> PlanRecord | NoPlan:
        """Plan releasing the request's wholly dead private blocks (``TokenTable.dead_blocks``; ``among``: only
        these indices of its list): a RELEASE plan, with no move and no destination, launched and committed as
        a compact plan is (its sources leave the list, the cursor shifts by whole blocks). The paper's
        Naive-Evict: a block is kept while it holds a live token, no longer. NoPlan (NO_CANDIDATES, not counted
        in ``stats.no_plan``) when there is none.
        raises: UnknownRequestError, PlanConflictError (I4); either way nothing changes."""
        t = self.table
        self._check_plannable(req_id)
        dead = t.dead_blocks(req_id, self._private, among)
        if not dead:
            return NoPlan(NoPlanReason.NO_CANDIDATES, f"request {req_id!r}: no wholly dead private block")
        return self._record(req_id, Plan(PlanKind.RELEASE, req_id, (t.layout_version(req_id), t.total_len(req_id)),
                                         (), tuple(dead)))

    def _check_plannable(self, req_id: object) -> None:
        """A plan may be made for ``req_id`` now: it is known (first: an unknown or unhashable id is
        UnknownRequestError) and has no plan in flight (I4: PlanConflictError)."""
        self.table.num_live(req_id)
        if req_id in self.inflight:
            raise PlanConflictError(f"request {req_id!r} already has a plan in flight (I4)")

    def _plan_compact(self, req_id: object, pack: bool = False) -> Plan | NoPlan:
        """A compact plan from the maintained structures, O(S + B x S) for B = ``max_sources``: the candidates
        from the table's per-block counts (``compact_candidates``), their tokens from its token map
        (``live_in_blocks``), the gate and the fill of compact.py (``choose_ranked``, ``compact_plan``). The
        reference is ``choose_sources`` / ``plan_compaction`` (core/reference/compact.py) on the full snapshot: with
        ``verify_fast_paths`` every answer is compared with it (V3)."""
        t, S, k = self.table, self.pool.block_size, self.config.max_sources
        budget = self.destination_budget()
        movable = self._private if pack else self._movable
        choice = choose_ranked(req_id, t.compact_candidates(req_id, k, movable), lambda i: t.block_at(req_id, i),
                               S, budget)
        snap = reference = None
        if self.verify_fast_paths:  # NOTE: imported here: the runtime imports no oracle when it is imported, so
            from .reference import compact as reference  # serving never loads one (core/reference/__init__.py)
            snap = t.snapshot(req_id, [b for b in t.block_ids(req_id) if not movable(b)])
        if snap is not None and choice != (want := reference.choose_sources(snap, k, budget)):
            raise InvariantViolation("V3", f"request {req_id!r}: the compact fast path chose {choice!r}, the "
                                     f"reference choose_sources {want!r}")
        if not choice:
            return choice
        dsts = self.pool.allocate(choice.num_dst, Purpose.EVACUATION)
        try:
            plan = compact_plan(req_id, (t.layout_version(req_id), t.total_len(req_id)), S, choice,
                                t.live_in_blocks(req_id, choice.src_blocks), dsts)
            if not plan or plan.dst_blocks != tuple(dsts):
                raise InvariantViolation("I4", f"request {req_id!r}: the compact planner did not use exactly "
                                         f"the {len(dsts)} reserved destination blocks {dsts}: {plan!r}")
            if snap is not None and plan != (want := reference.plan_compaction(snap, dsts, k)):
                raise InvariantViolation("V3", f"request {req_id!r}: the compact fast path planned {plan!r}, the "
                                         f"reference plan_compaction {want!r}")
        except BaseException:
            self.pool.free(dsts)  # leak nothing, then stop: the planner broke its contract
            raise
        return plan

    def _private(self, block_id: int) -> bool:
        """May ``block_id`` be released once dead: no other reference (``_shared_blocks`` lists the others)."""
        return self.pool.ref_count(block_id) == 1

    def _movable(self, block_id: int) -> bool:
        """May ``block_id`` be a source of a lazy compaction: private, and no later request may map it through a
        prefix cache (``BlockAllocator.is_cached``). A pressure round (``pack``) takes cached blocks too
        (``_private``): capacity now comes before a hit that may never come.

        NOTE: a cached block compacted away leaves the prefix held twice once a later request hits it: this
        request's packed copy and the hit's original (issue #21: StreamingLLM, staggered arrivals sharing a
        prompt on vLLM: a peak of 13 blocks against Naive-Evict's 11); left in place, the hit shares it. The
        cost: with prefix caching on and no pressure, compaction leaves the prompt's hashed blocks unpacked
        (docs/results.md, "Q6 Prefix caching")."""
        return self.pool.ref_count(block_id) == 1 and not self.pool.is_cached(block_id)

    def _plan_densify(self, req_id: object, evicted_positions: list[int] | None) -> Plan | NoPlan:
        """Densify's plan: none for a dense request (cursor at n_live, O(1): ``plan_densify``'s ALREADY_DENSE, which
        a pressure round asks of every request with an excess block allocated ahead); from the step's evictions when
        they are the request's only holes (``_densify_tail``, O(evicted)); else from a full snapshot
        (``plan_densify``, O(L))."""
        if self.table.write_pos(req_id) == self.table.num_live(req_id):
            return NoPlan(NoPlanReason.ALREADY_DENSE, f"request {req_id!r}")
        plan = self._densify_tail(req_id, evicted_positions) if evicted_positions is not None else None
        return plan if plan is not None else plan_densify(self.table.snapshot(req_id, self._shared_blocks(req_id)))

    def _densify_tail(self, req_id: object, evicted_positions: list[int]) -> Plan | NoPlan | None:
        """``plan_densify_tail``'s plan, or None when the step's evictions are not the request's only holes or
        the positions from n_live to the cursor were not all appended since its last layout change.

        NOTE: the positions are a hint (the runtime passes its own step's evictions), trusted only when they are
        cursor - n_live distinct dead positions before the cursor, which makes them exactly the request's holes;
        otherwise (another step's positions, a repeat, a live one) the full search plans. Trusted blindly, a wrong
        hint planned moves onto live slots, and the copy overwrote live K/V before the commit could refuse."""
        t, S = self.table, self.pool.block_size
        n, pos = t.num_live(req_id), t.write_pos(req_id)
        block = t.block_at  # what is read of the block list: O(evicted) entries
        if pos - n != len(evicted_positions) or t.append_run_start(req_id) > n or not all(
                is_int(p) and 0 <= p < pos and not t.block_mask(req_id, block(req_id, p // S)) >> (p % S) & 1
                for p in evicted_positions) or len(set(evicted_positions)) != pos - n:
            return None
        movers = []
        for p in range(n, pos):
            tok = t.token_at(req_id, p)
            if tok != NO_SLOT:
                movers.append((tok, block(req_id, p // S) * S + p % S))
        holes = tuple((p, block(req_id, p // S)) for p in sorted(evicted_positions) if p < n)
        src = tuple(block(req_id, i) for i in range(-(-n // S), -(-pos // S)))
        cursor = block(req_id, n // S) if n % S and n // S < t.num_blocks_of(req_id) else None
        touched = {b for _, b in holes} | {s // S for _, s in movers} | set(src) | ({cursor} - {None})
        tail = DensifyTail(req_id, (t.layout_version(req_id), t.total_len(req_id)), S, n, pos, holes,
                           tuple(movers), src, cursor, frozenset(b for b in touched if self.pool.ref_count(b) > 1))
        plan = plan_densify_tail(tail)
        if self.verify_fast_paths:
            want = plan_densify(t.snapshot(req_id, self._shared_blocks(req_id)))
            if (plan.reason if not plan else plan) != (want.reason if not want else want):
                raise InvariantViolation("V3", f"request {req_id!r}: the densify fast path planned {plan!r}, the "
                                         f"reference plan_densify {want!r}")
        return plan

    def _record(self, req_id: object, plan: Plan | NoPlan) -> PlanRecord | NoPlan:
        if not plan:
            self.stats.no_plan[plan.reason] += 1
            return plan
        assert req_id not in self.inflight  # I4: one plan per request (checked by the callers first)
        rec = PlanRecord(plan)
        self.inflight[req_id] = rec
        if plan.kind is PlanKind.RELEASE:
            self.stats.releases_made += 1
            return rec  # no destination: F and the adaptive trigger's reading stay until it commits
        self.stats.plans_made += 1
        if self._f_prev is not None:
            self._f_prev = self.waste_ratio()  # destinations in flight count as waste; a plan's own are no burst
        return rec

    def plan_relocation(self, req_id: object, index: int) -> PlanRecord | NoPlan:
        """Plan moving block ``index`` of the request's list to one fresh block (``relocate.py``; the drill).

        NoPlan: SHARED_BLOCK for a shared block, NOT_ENOUGH_HEADROOM when ``destination_budget()`` is 0.
        raises (changing nothing): UnknownRequestError, PlanConflictError (I4), InvalidArgumentError for an
        index outside the list.
        """
        shared = self._shared_blocks(req_id)
        if req_id in self.inflight:
            raise PlanConflictError(f"request {req_id!r} already has a plan in flight (I4)")
        n = len(self.table.block_ids(req_id))
        if not is_int(index) or not 0 <= index < n:
            raise InvalidArgumentError(f"request {req_id!r}: block index {index!r} outside its {n} blocks")
        snap = self.table.snapshot(req_id, shared)
        if snap.blocks[index] in snap.shared_blocks:
            plan = NoPlan(NoPlanReason.SHARED_BLOCK, f"request {req_id!r}: block {snap.blocks[index]}")
        elif self.destination_budget() < 1:
            plan = NoPlan(NoPlanReason.NOT_ENOUGH_HEADROOM, f"request {req_id!r}: no free block to relocate into")
        else:
            [dst] = self.pool.allocate(1, Purpose.EVACUATION)
            plan = plan_relocation(snap, index, dst)
        return self._record(req_id, plan)

    # ---- Stage 4: copy, commit, abort ------------------------------------------------------
    def launch(self) -> list[PlanRecord]:
        """Submit every PLANNED copy. Call after the step's forward has been issued.

        A plan becomes COPYING only once the engine accepted its copy (or it has nothing to copy). When
        ``submit`` raises (a refused or failed launch: the CopyEngine contract is that a submit that raised
        wrote nothing), that plan is aborted at once and launch goes on with the others: its destinations go
        back to the pool, the table keeps the old locations, and ``stats.plans_aborted[LAUNCH_FAILED]``
        counts it, the error is in ``abort_detail``. Launch does not re-raise: a relocation is an
        optimisation, and losing one must not stop serving. On the dense read path, though, the request is
        left with holes below n_live, which the next read refuses (I7). Only ``LAUNCH_ERRORS`` are launch
        failures (an engine's ``VTokenError``, a device's ``RuntimeError`` or ``MemoryError``); anything else
        (an ``InvariantViolation``, a ``TypeError`` in engine code) is a bug and propagates, leaving the plan
        PLANNED with its destinations held, as if launch had not been called for it.

        Returns the plans aborted here (usually none).
        """
        refused = []
        for rec in list(self.inflight.values()):
            if rec.state is not PlanState.PLANNED:
                continue
            if not rec.plan.moves:
                rec.state = PlanState.COPYING  # nothing to copy: settled by definition
                continue
            self._check_moves(rec)  # a planner bug must not pass for a refused launch (the engine checks too)
            try:
                handle = self.engine.submit(rec.plan.moves, req_id=rec.plan.req_id)
            except LAUNCH_ERRORS as e:  # the engine refused the copy, or the device failed to start it
                self._abort(rec, LAUNCH_FAILED, f"{type(e).__name__}: {e}")
                refused.append(rec)
                continue
            rec.handle, rec.state = handle, PlanState.COPYING
            if self.config.ordering is Ordering.EVENT:
                self.engine.order_before_compute(rec.handle)
            elif self.config.ordering is Ordering.FORCE_SYNC:
                self.engine.wait(rec.handle)
        assert all(r.state is PlanState.COPYING for r in self.inflight.values())  # launched or aborted, each one
        return refused

    def settle(self) -> list[PlanRecord]:
        """Commit settled copies, abort failed ones, release what departed requests left.

        Call before the next step's slot mapping is built. Returns the records
        that reached COMMITTED or ABORTED.
        """
        done = []
        for req_id, rec in list(self.inflight.items()):
            if rec.state is not PlanState.COPYING:
                continue
            status = self._status(rec)
            if status is CopyStatus.PENDING:
                continue
            if status is CopyStatus.FAILED:
                self._abort(rec, "copy failed")
            else:
                self._commit(rec)
            done.append(rec)
        for rec in list(self.orphans):
            if self._status(rec).settled:
                self.orphans.remove(rec)
                self._release_handle(rec)
                self.pool.free(rec.held)
        assert all(r.state in (PlanState.COMMITTED, PlanState.ABORTED) and self.inflight.get(r.plan.req_id) is not r
                   for r in done)
        return done

    def on_request_removed(self, req_id: object, blocks: list[int]) -> None:
        """The request finished or was preempted and left the table; ``blocks`` were its list.

        Frees what no copy can touch now; what a pending copy reads or writes is
        held until that copy settles.

        raises (changing nothing): RequestStillRegisteredError if the request is still in the table;
        BlockOutOfRangeError, DoubleFreeError if ``blocks`` (with the plan's destinations) cannot all be
        freed; BlockNotOwnedError if a block the pending copy reads is not in ``blocks``.
        """
        if self._in_table(req_id):
            raise RequestStillRegisteredError(
                f"request {req_id!r} is still in the token table; remove it (TokenTable.remove_request) "
                f"before telling the manager it left")
        rec = self._record_of(req_id)
        blocks = self._check_block_list(req_id, blocks)
        self._check_freeable(blocks + (list(rec.plan.dst_blocks) if rec is not None else []))
        if rec is None:
            self.pool.free(blocks)
            return
        # a plan in flight reads blocks of the request's list until it commits: the list given must have
        # them, or a pending copy's sources could not be held (I5). Checked before the copy is polled
        missing = sorted(b for b in set(rec.plan.src_blocks) | {m.src_block for m in rec.plan.moves}
                         if b not in blocks)
        if missing:
            raise BlockNotOwnedError(
                f"request {req_id!r}: blocks {missing} are read by its plan in flight but are not in the "
                f"block list given ({blocks}); a pending copy's sources must be held until it settles (I5)")
        settled = rec.state is PlanState.PLANNED or self._status(rec).settled
        touched = set(rec.plan.src_blocks) | {b for m in rec.plan.moves for b in (m.src_block, m.dst_block)}
        del self.inflight[req_id]
        rec.state = PlanState.ABORTED
        rec.abort_reason = "request left while its plan was in flight"
        self.stats.plans_aborted[rec.abort_reason] += 1
        if settled:
            self._release_handle(rec)
            self.pool.free(blocks + list(rec.plan.dst_blocks))
            return
        self.pool.free([b for b in blocks if b not in touched])
        rec.held = tuple(b for b in blocks if b in touched) + rec.plan.dst_blocks
        self.orphans.append(rec)

    def in_flight(self, req_id: object) -> PlanRecord | None:
        return self.inflight.get(req_id)

    def pending_copies(self) -> list[PlanRecord]:
        """Records (in flight or orphaned) whose copy may still read or write."""
        recs = [r for r in self.inflight.values() if r.state is PlanState.COPYING] + self.orphans
        return [r for r in recs if not self._status(r).settled]

    # ---- helpers ---------------------------------------------------------------------------
    def is_stale(self, plan: Plan) -> bool:
        """Whether committing ``plan`` now would act on a layout it was not planned from (I4): the request's
        layout version moved (an eviction of a moving token does not: that move is dropped), or tokens were
        appended since planning into what the plan rewrites: densify's cursor, relocate's source block
        (the drill may move the cursor's block; an append there would be left behind). Compact's sources
        lie before the cursor block, so appends never reach them."""
        t, req = self.table, plan.req_id
        if t.layout_version(req) != plan.version[0]:
            return True
        if plan.kind is PlanKind.DENSIFY:
            return t.total_len(req) != plan.version[1]
        if plan.kind is PlanKind.RELOCATE and t.total_len(req) != plan.version[1]:
            [src] = plan.src_blocks
            staying = sum(1 for m in plan.moves if t.is_live(req, m.token_id))
            return bin(t.block_masks(req).get(src, 0)).count("1") != staying
        return False

    def _commit(self, rec: PlanRecord) -> None:
        plan, t, S = rec.plan, self.table, self.pool.block_size
        req = plan.req_id
        if self.is_stale(plan):
            self._abort(rec, "layout changed since the snapshot (I4)")
            return
        held = t.slots_of(req, [m.token_id for m in plan.moves])
        moves = [m for m, slot in zip(plan.moves, held) if slot != NO_SLOT]  # evicted in flight: stay dead
        if plan.kind is PlanKind.DENSIFY:
            self._commit_densify(rec, moves)
            return
        if plan.kind in (PlanKind.COMPACT, PlanKind.RELEASE):  # a release: a compact with nothing to move
            self._commit_compact(rec, moves)
            return
        landing = {m.token_id for m in moves}
        dsts = plan.kept_destinations(lambda m: m.token_id in landing)
        unused = [b for b in plan.dst_blocks if b not in dsts]
        blocks, write_pos = t.block_ids(req), t.write_pos(req)
        live_before = t.num_live(req)
        final_blocks, final_pos = plan.final_layout(blocks, write_pos, S, dsts)
        # attach the destinations before the cursor, move into them, then drop the sources: three table calls,
        # each all-or-nothing on its own, so all three are checked first and a commit never stops half-way
        if dsts:
            at = final_blocks.index(dsts[0])
            staged = (blocks[:at] + list(dsts) + blocks[at:], write_pos + len(dsts) * S)
        else:
            staged = (blocks, write_pos)
        self._check_commit(rec, moves, staged, (final_blocks, final_pos), list(plan.src_blocks) + unused)
        # -- checked; mutate --
        self.stats.moves_dropped += len(plan.moves) - len(moves)
        if dsts:
            t.set_layout(req, *staged)
        t.apply_moves(req, moves)
        t.set_layout(req, final_blocks, final_pos)
        # online I1/I2 postcondition, O(moves): a relocation moves tokens, never kills or revives one (the full
        # comparison of the ordered live ids is check_i2's and V1's, off the hot path)
        self._check_moved_as_planned(req, moves, live_before)
        self._release_handle(rec)
        self.pool.free(list(plan.src_blocks) + unused)
        rec.state = PlanState.COMMITTED
        del self.inflight[req]
        assert rec.handle is None and t.write_pos(req) <= len(t.block_ids(req)) * S
        self.stats.plans_committed += 1
        self.stats.moves_committed += len(moves)
        self.stats.blocks_released += len(plan.src_blocks) - len(dsts)

    def _check_moved_as_planned(self, req: object, moves: list, live_before: int) -> None:
        """Every commit's postcondition: no token died or revived, and each moved token sits at its destination."""
        t, S = self.table, self.pool.block_size
        if t.num_live(req) != live_before or t.slots_of(req, [m.token_id for m in moves]) != [
                m.dst_block * S + m.dst_offset for m in moves]:
            raise InvariantViolation("I2", f"request {req!r}: committing plan changed its ordered live token ids")

    def _commit_compact(self, rec: PlanRecord, moves: list) -> None:
        """A compact commit in O(moves + sources + destinations), plus the C copy and the index refresh of the
        block list: splice the kept destinations in before the first source, move the tokens, remove the emptied
        sources, and the cursor is ``Plan.compact_cursor``. The layout is ``Plan.final_layout``'s (with
        ``verify_fast_paths`` compared with it, V3). Not stale, so the sources are where they were planned."""
        plan, t, S = rec.plan, self.table, self.pool.block_size
        req = plan.req_id
        landing = {m.token_id for m in moves}
        dsts = plan.kept_destinations(lambda m: m.token_id in landing)
        unused = [b for b in plan.dst_blocks if b not in dsts]
        pos, live_before = t.write_pos(req), t.num_live(req)
        src_at = [t.index_in_list(req, b) for b in plan.src_blocks]
        final_pos = plan.compact_cursor(pos, S, dsts)
        self._check_compact_commit(rec, moves, src_at, dsts, final_pos, list(plan.src_blocks) + unused)
        # NOTE: after the checks: final_layout assumes the sources are in the list
        want = plan.final_layout(t.block_ids(req), pos, S, dsts) if self.verify_fast_paths else None
        # -- checked; mutate --
        self.stats.moves_dropped += len(plan.moves) - len(moves)
        if dsts:
            t.splice(req, src_at[0], 0, dsts, pos + len(dsts) * S)
        t.apply_moves(req, moves)
        t.remove_blocks(req, [i + len(dsts) for i in src_at], final_pos)
        # online I1/I2 postcondition, O(moves): a relocation moves tokens, never kills or revives one (the full
        # comparison of the ordered live ids is check_i2's and V1's, off the hot path)
        self._check_moved_as_planned(req, moves, live_before)
        if want is not None and (t.block_ids(req), t.write_pos(req)) != want:
            raise InvariantViolation("V3", f"request {req!r}: the compact commit left blocks {t.block_ids(req)} and "
                                     f"cursor {t.write_pos(req)}, Plan.final_layout says {want[0]} and {want[1]}")
        self._release_handle(rec)
        self.pool.free(list(plan.src_blocks) + unused)
        rec.state = PlanState.COMMITTED
        del self.inflight[req]
        assert rec.handle is None and t.write_pos(req) <= t.num_blocks_of(req) * S
        if plan.kind is PlanKind.RELEASE:
            self.stats.releases_committed += 1
        else:
            self.stats.plans_committed += 1
        self.stats.moves_committed += len(moves)
        self.stats.blocks_released += len(plan.src_blocks) - len(dsts)

    def _check_compact_commit(self, rec: PlanRecord, moves: list, src_at: list, dsts: tuple[int, ...],
                              final_pos: int, to_free: list[int]) -> None:
        """``_check_commit`` for a compact plan, O(moves + sources + destinations + blocks from the cursor's on):
        the copy settled; the destinations may join before the first source (``TokenTable.check_splice``); every
        move reads its token's slot and writes an unclaimed slot of the staged list below its cursor; the sources
        hold no live token once the moves are made, and none lies at or after the final cursor; the blocks to free
        are held. Raises InvariantViolation before anything changes."""
        t, S, plan = self.table, self.pool.block_size, rec.plan
        req = plan.req_id

        def fail(message: str) -> None:
            raise InvariantViolation("I4", f"request {req!r}: committing its compact plan would break the table: "
                                     f"{message}; nothing was changed")

        if rec.handle is not None and not self.engine.poll(rec.handle).settled:
            raise InvariantViolation("I3", f"request {req!r}: commit while its copy {rec.handle} is still pending")
        if None in src_at or src_at != sorted(set(src_at)):
            fail(f"its sources {list(plan.src_blocks)} are not in its block list, in order")
        at, pos, n = src_at[0], t.write_pos(req), t.num_blocks_of(req)
        staged_pos = pos + len(dsts) * S
        for b in dsts:  # NOTE: the message names the staged list (O(blocks)), on failure only
            if not (is_int(b) and 0 <= b < self.pool.num_blocks) or t.index_in_list(req, b) is not None \
                    or dsts.count(b) > 1:
                staged = t.block_ids(req)
                fail(f"block list {staged[:at] + list(dsts) + staged[at:]} repeats a block or names one outside the pool")
        if dsts:
            t.check_splice(req, at, 0, dsts, staged_pos, lambda b: t.block_mask(req, b), fail)
        where = {b: at + j for j, b in enumerate(dsts)}

        def staged_index(b: int) -> int | None:
            if b in where:
                return where[b]
            i = t.index_in_list(req, b)
            return None if i is None else i + (len(dsts) if i >= at else 0)

        after = self._check_commit_moves(req, moves, staged_index, staged_pos, "the staged block list",
                                         lambda b: t.block_mask(req, b), fail)

        def mask(b: int) -> int:
            return after[b] if b in after else t.block_mask(req, b)

        length = n + len(dsts) - len(src_at)

        def final_block(k: int) -> int:  # block k of the final list: blocks[:at] + dsts + the rest, sources gone
            if k < at:
                return t.block_at(req, k)
            if k < at + len(dsts):
                return dsts[k - at]
            j = k - len(dsts)
            for i in src_at:
                j += i <= j
            return t.block_at(req, j)

        if not is_int(final_pos) or not 0 <= final_pos <= length * S:
            fail(f"cursor {final_pos!r} outside its {length} blocks")
        for b in plan.src_blocks:
            if mask(b):
                fail(f"block {b} holds live tokens but would leave block list {[final_block(k) for k in range(length)]}")
        for k in range(final_pos // S, length):
            if mask(b := final_block(k)) >> max(0, final_pos - k * S):
                fail(f"block {b} would hold live tokens at or after cursor {final_pos}")
        for b, k in Counter(to_free).items():
            if self.pool.ref_count(b) < k:
                fail(f"block {b} would be freed {k} time(s) with {self.pool.ref_count(b)} reference(s)")

    def _commit_densify(self, rec: PlanRecord, moves: list) -> None:
        """A densify commit in O(moves + released blocks): move the movers into the holes, then splice the
        emptied tail [ceil(n / S), ceil(cursor / S)) out of the list and set the cursor to n (I7). Not stale,
        so the list is the one planned from and the tail is exactly the plan's sources."""
        plan, t, S = rec.plan, self.table, self.pool.block_size
        req, n = plan.req_id, plan.dense_write_pos
        live_before = t.num_live(req)
        at = self._check_densify_commit(rec, moves)
        # -- checked; mutate --
        self.stats.moves_dropped += len(plan.moves) - len(moves)
        t.apply_moves(req, moves)
        t.splice(req, at, len(plan.src_blocks), (), n)
        self._check_moved_as_planned(req, moves, live_before)
        self._release_handle(rec)
        self.pool.free(list(plan.src_blocks))
        rec.state = PlanState.COMMITTED
        del self.inflight[req]
        assert rec.handle is None and t.write_pos(req) == n <= t.num_blocks_of(req) * S
        self.stats.plans_committed += 1
        self.stats.moves_committed += len(moves)
        self.stats.blocks_released += len(plan.src_blocks)

    def _check_densify_commit(self, rec: PlanRecord, moves: list) -> int:
        """``_check_commit`` for a densify plan, O(moves + released blocks): the copy settled, every move reads
        its token's slot and writes an unclaimed slot of the list below the cursor, the tail holds no live
        token once the moves are made (``TokenTable.check_splice`` with the masks they leave), and the
        released blocks are held. Returns where the sources start in the list, ceil(n / S). Raises
        InvariantViolation before anything changes."""
        t, S, req, plan = self.table, self.pool.block_size, rec.plan.req_id, rec.plan

        def fail(message: str) -> None:
            raise InvariantViolation("I4", f"request {req!r}: committing its densify plan would break the table: "
                                     f"{message}; nothing was changed")

        if rec.handle is not None and not self.engine.poll(rec.handle).settled:
            raise InvariantViolation("I3", f"request {req!r}: commit while its copy {rec.handle} is still pending")
        after = self._check_commit_moves(req, moves, lambda b: t.index_in_list(req, b), t.write_pos(req),
                                         "the block list", lambda b: t.block_mask(req, b), fail)
        # the list with the tail spliced out, under ``TokenTable.check_splice``'s rules, read only where it changes
        mask_of = (lambda b: after[b] if b in after else t.block_mask(req, b))
        pos, length = plan.dense_write_pos, t.num_blocks_of(req) - len(plan.src_blocks)
        if not is_int(pos) or not 0 <= pos <= length * S:
            fail(f"cursor {pos!r} outside its {length} blocks")
        at = -(-pos // S)
        if any(t.block_at(req, at + i) != b for i, b in enumerate(plan.src_blocks)):
            fail(f"its sources {list(plan.src_blocks)} are not blocks [{at}, {at + len(plan.src_blocks)}) of the list")
        t.check_splice(req, at, len(plan.src_blocks), (), pos, mask_of, fail)  # the splice's own rules
        for b in plan.src_blocks:
            if self.pool.ref_count(b) < 1:
                fail(f"block {b} would be freed with {self.pool.ref_count(b)} reference(s)")
        return at

    def _check_moves(self, rec: PlanRecord) -> None:
        """Executed precondition of ``launch``: the plan's moves are a copy of its request's layout (I4).

        Each live token moves from the slot the table has for it, every destination is written once and lies
        in the plan's fresh blocks (compact) or the request's own (densify). Engines refuse bad moves too,
        but a refusal is aborted and served around; a bad plan is a bug and raises InvariantViolation.
        """
        plan, t, S = rec.plan, self.table, self.pool.block_size
        req = plan.req_id
        n, written = t.total_len(req), set()
        for m in plan.moves:
            if not (is_int(m.token_id) and 0 <= m.token_id < n):
                raise InvariantViolation("I4", f"request {req!r}: move {m} names a token outside [0, {n})")
        if plan.kind is PlanKind.DENSIFY:  # the request's own blocks, each looked up once
            index: dict[int, bool] = {}

            def listed(b: int) -> bool:
                return index[b] if b in index else index.setdefault(b, t.index_in_list(req, b) is not None)
        else:
            listed = set(plan.dst_blocks).__contains__
        for m, slot in zip(plan.moves, t.slots_of(req, [m.token_id for m in plan.moves])):
            if slot != NO_SLOT and slot != m.src_block * S + m.src_offset:  # evicted since planning: dropped at commit
                raise InvariantViolation("I4", f"request {req!r}: move {m} reads ({m.src_block}, {m.src_offset}) "
                                         f"but the token lives at slot {slot}")
            if not (is_int(m.dst_block) and listed(m.dst_block)) or not (is_int(m.dst_offset) and 0 <= m.dst_offset < S):
                where = "its block list" if plan.kind is PlanKind.DENSIFY else f"blocks {sorted(plan.dst_blocks)}"
                raise InvariantViolation("I4", f"request {req!r}: move {m} writes outside {where}")
            dst = m.dst_block * S + m.dst_offset
            if dst in written:
                raise InvariantViolation("I4", f"request {req!r}: two moves share a destination (slot {dst})")
            written.add(dst)

    def _check_commit(self, rec: PlanRecord, moves: list, staged: tuple[list[int], int],
                      final: tuple[list[int], int], to_free: list[int]) -> None:
        """Executed precondition of ``_commit``: every mutation it makes will succeed.

        Mirrors the rules of ``TokenTable.set_layout`` (staged layout), ``TokenTable.apply_moves`` (the moves,
        against the staged layout) and ``TokenTable.set_layout`` (final layout) on a copy of the request's
        per-block masks, O(blocks + moves), and checks the copy is settled and the blocks to free are held.
        All the caller's input was validated long before, so a commit that would be refused is a bug: it
        raises InvariantViolation before anything changes.
        """
        t, S, req = self.table, self.pool.block_size, rec.plan.req_id

        def fail(message: str) -> None:
            raise InvariantViolation("I4", f"request {req!r}: committing its {rec.plan.kind.value} plan would "
                                     f"break the table: {message}; nothing was changed")

        if rec.handle is not None and not self.engine.poll(rec.handle).settled:
            raise InvariantViolation("I3", f"request {req!r}: commit while its copy {rec.handle} is still pending")
        masks = t.block_masks(req)
        self._check_layout(staged, masks, fail)
        index = {b: i for i, b in enumerate(staged[0])}
        masks.update(self._check_commit_moves(req, moves, index.get, staged[1], "the staged block list",
                                              lambda b: masks.get(b, 0), fail))
        self._check_layout(final, masks, fail)
        for b, k in Counter(to_free).items():
            if self.pool.ref_count(b) < k:
                fail(f"block {b} would be freed {k} time(s) with {self.pool.ref_count(b)} reference(s)")

    def _check_commit_moves(self, req: object, moves: list, index_of, cursor: int, listed: str, mask_of,
                            fail) -> dict[int, int]:
        """The moves' part of a commit's precondition (``TokenTable.apply_moves``' rules): each reads the slot its
        token holds and writes an unclaimed slot of the list (``index_of(block)``: its index, None when not in
        it) before ``cursor``; no token moves twice. Returns the masks the moves leave on the blocks they
        touch (all sources vacated, then all claims), from ``mask_of(block)``. O(moves)."""
        t, S = self.table, self.pool.block_size
        sources = t.slots_of(req, [m.token_id for m in moves])
        vacated, claimed = set(sources), set()
        index: dict[int, int | None] = {}  # index_of once per block
        dsts = []
        for m, src in zip(moves, sources):
            # NOTE: offsets inside their block, not only the slot numbers they make: (b - 1, S + 3) is slot (b, 3),
            # and apply_moves would refuse it after the splice, a commit stopped half-way
            if src != m.src_block * S + m.src_offset or not 0 <= m.src_offset < S:
                fail(f"move {m} reads a slot token {m.token_id} does not hold")
            dst = m.dst_block * S + m.dst_offset
            b = m.dst_block
            i = (index[b] if b in index else index.setdefault(b, index_of(b))) if is_int(b) else None
            if i is None or i * S + m.dst_offset >= cursor or not 0 <= m.dst_offset < S:
                fail(f"move {m} writes outside {listed} or at or after its cursor {cursor}")
            if dst in claimed:
                fail(f"move {m} writes slot {dst}, which is claimed")
            claimed.add(dst)
            dsts.append(dst)
        for m, dst, h in zip(moves, dsts, t.occupancy.holders_of(dsts)):  # every dst in the list: in the pool
            if h - (dst in vacated):
                fail(f"move {m} writes slot {dst}, which is claimed")
        if len({m.token_id for m in moves}) != len(moves):
            fail("a token moves twice")
        after: dict[int, int] = {}
        for src in sources:  # NOTE: mask_of once per block (a private block's is read off the pool, O(S))
            b = src // S
            after[b] = (after[b] if b in after else mask_of(b)) & ~(1 << (src % S))
        for m in moves:
            b = m.dst_block
            after[b] = (after[b] if b in after else mask_of(b)) | (1 << m.dst_offset)
        return after

    def _check_layout(self, layout: tuple[list[int], int], masks: dict[int, int], fail) -> None:
        """``TokenTable.set_layout``'s rules for (block list, cursor), given each block's mask of live offsets."""
        blocks, pos = layout
        S = self.pool.block_size
        if len(set(blocks)) != len(blocks) or not all(is_int(b) and 0 <= b < self.pool.num_blocks for b in blocks):
            fail(f"block list {blocks} repeats a block or names one outside the pool")
        if not is_int(pos) or not 0 <= pos <= len(blocks) * S:
            fail(f"cursor {pos!r} outside its {len(blocks)} blocks")
        listed = set(blocks)
        for b, mask in masks.items():
            if mask and b not in listed:
                fail(f"block {b} holds live tokens but would leave block list {blocks}")
        for i, b in enumerate(blocks):
            if masks.get(b, 0) >> max(0, pos - i * S):
                fail(f"block {b} would hold live tokens at or after cursor {pos}")

    def _abort(self, rec: PlanRecord, reason: str, detail: str = "") -> None:
        unlaunched = rec.state is PlanState.PLANNED and rec.handle is None  # no copy was ever started
        if not unlaunched and not self._status(rec).settled:
            raise InvariantViolation("I6", f"request {rec.plan.req_id!r}: aborting its plan would free destinations "
                                     f"{rec.plan.dst_blocks} while its copy can still write them")
        self._release_handle(rec)
        self.pool.free(rec.plan.dst_blocks)
        rec.state = PlanState.ABORTED
        rec.abort_reason, rec.abort_detail = reason, detail
        del self.inflight[rec.plan.req_id]
        assert rec.handle is None and rec.plan.req_id not in self.inflight
        self.stats.plans_aborted[reason] += 1

    def _status(self, rec: PlanRecord) -> CopyStatus:
        """The copy's status; a plan with no handle has launched nothing (PLANNED, refused, or no moves)."""
        if rec.handle is None:
            if rec.state is PlanState.COPYING and rec.plan.moves:
                # a COPYING plan has a handle once it has moves: read as DONE, it would commit
                # destinations no copy wrote
                raise InvariantViolation("I3", f"request {rec.plan.req_id!r}: plan is COPYING {len(rec.plan.moves)} "
                                         f"moves but has no copy handle")
            return CopyStatus.PENDING if rec.state is PlanState.PLANNED else CopyStatus.DONE
        return self.engine.poll(rec.handle)

    def _release_handle(self, rec: PlanRecord) -> None:
        if rec.handle is not None:
            self.engine.release(rec.handle)
            rec.handle = None

    def _shared_blocks(self, req_id: object) -> list[int]:
        return [b for b in self.table.block_ids(req_id) if self.pool.ref_count(b) > 1]

    # ---- argument checks (they raise before anything changes) -----------------------------------
    def _in_table(self, req_id: object) -> bool:
        try:
            return req_id in self.table
        except TypeError:  # an unhashable id was never registered
            return False

    def _record_of(self, req_id: object) -> PlanRecord | None:
        return self.inflight[req_id] if is_known_key(self.inflight, req_id) else None

    def _check_request_list(self, req_ids: object) -> list[object]:
        ids = as_list("plan_round: request ids", req_ids, InvalidArgumentError)  # a lone str id is refused too
        seen: set[object] = set()
        for r in ids:
            if not self._in_table(r):
                raise UnknownRequestError(f"plan_round: unknown request {r!r}")
            if r in seen:
                raise DuplicateRequestError(f"plan_round: request {r!r} listed twice")
            seen.add(r)
        return ids

    def _check_block_list(self, req_id: object, blocks: object) -> list[int]:
        ids = as_list("request {!r}: blocks", blocks, BlockOutOfRangeError, req_id)  # as BlockPool.free refuses
        for b in ids:
            if not is_int(b) or not 0 <= b < self.pool.num_blocks:
                raise BlockOutOfRangeError(f"request {req_id!r}: block {b!r} outside the pool "
                                           f"[0, {self.pool.num_blocks})")
        return ids

    def _check_freeable(self, blocks: list[int]) -> None:
        for b, k in Counter(blocks).items():
            if self.pool.ref_count(b) < k:
                raise DoubleFreeError(f"block {b} would be freed {k} time(s) but holds "
                                      f"{self.pool.ref_count(b)} reference(s)")

