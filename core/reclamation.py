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
Stage 2 (headroom): destinations come from the evacuation headroom; while a
plan is in flight and the headroom is borrowed, admission is closed
(backpressure).
Stage 3 (planning) is ``compact.py`` / ``densify.py``.
Stage 4 (copy): plans are launched after the step's forward on a
``CopyEngine`` and committed once the copy is settled.

Plan lifecycle:  PLANNED -> COPYING -> COMMITTED | ABORTED.
At most one plan per request is in flight (I4). Blocks a pending copy reads
(sources) or writes (destinations) are never returned to the pool until the
copy is settled (I5, I6), even when the request finishes or is preempted
meanwhile.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

from .block_pool import BlockAllocator, Purpose
from .compact import choose_sources, plan_compaction
from .copy_engine import CopyEngine, CopyHandle, CopyStatus
from .densify import plan_densify
from .errors import ConfigError, InvariantViolation, PlanConflictError
from .plan import NoPlan, Plan, PlanKind
from .token_table import TokenTable


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
        if not isinstance(self.planner, PlanKind):
            raise ConfigError(f"planner must be one of {[k.value for k in PlanKind]}, got {self.planner!r}")
        if not isinstance(self.ordering, Ordering):
            raise ConfigError(f"ordering must be one of {[o.value for o in Ordering]}, got {self.ordering!r}")
        if not 0.0 <= self.theta_f < 1.0:
            raise ConfigError(f"theta_f must be in [0, 1), got {self.theta_f}")
        if self.low_watermark is not None and self.low_watermark < 0:
            raise ConfigError(f"low_watermark must be >= 0 or None, got {self.low_watermark}")
        for name in ("check_every", "max_sources", "max_plans_per_round"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
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


@dataclass
class ReclaimStats:
    rounds: int = 0
    plans_made: int = 0
    plans_committed: int = 0
    plans_aborted: Counter = field(default_factory=Counter)
    no_plan: Counter = field(default_factory=Counter)
    moves_committed: int = 0
    moves_dropped: int = 0  # tokens evicted while their move was in flight
    blocks_released: int = 0  # net blocks returned by committed plans
    bursts: int = 0  # bursts the adaptive trigger detected
    burst_rounds: int = 0  # rounds it ran off the K cadence


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
        self.burst = False  # adaptive trigger: in burst mode (rounds on every iteration while F > theta_F)
        self._f_prev: float | None = None  # adaptive trigger: F read at the previous call of should_reclaim

    # ---- Stage 1: eligibility -------------------------------------------------------
    def waste_ratio(self) -> float:
        """F of Eq. 1 over all allocated blocks (destinations in flight count as waste)."""
        allocated = self.pool.num_blocks - self.pool.num_free
        if allocated == 0:
            return 0.0
        return 1.0 - self.table.occupancy.live_slots / (allocated * self.pool.block_size)

    def should_reclaim(self, iteration: int) -> bool:
        """Whether a round runs now. Call once per iteration (the runtime does, after evicting).

        Fixed trigger: every K-th iteration, when F > theta_F and free blocks <= the low watermark.
        With ``burst_df`` it also tracks bursts (module docstring), so it must see every iteration.
        """
        c = self.config
        assert isinstance(iteration, int) and iteration >= 0, f"iteration must be an int >= 0, got {iteration!r}"
        if c.burst_df is None:
            if iteration % c.check_every:
                return False
            if c.low_watermark is not None and self.pool.num_free > c.low_watermark:
                return False
            return self.waste_ratio() > c.theta_f
        f = self.waste_ratio()
        assert 0.0 <= f <= 1.0, f"waste ratio {f} out of [0, 1]"
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
        """False while reclamation has borrowed the headroom and has not given it back."""
        return not self.inflight or self.pool.num_free >= self.pool.headroom

    # ---- Stage 3: planning -------------------------------------------------------------
    def plan_round(self, req_ids: list[object]) -> list[PlanRecord]:
        """Plan for the most wasteful requests first; returns the new PLANNED records."""
        self.stats.rounds += 1
        S = self.pool.block_size

        def excess(r: object) -> int:
            return len(self.table.block_ids(r)) - -(-self.table.num_live(r) // S)

        made = []
        for r in sorted((r for r in req_ids if r not in self.inflight), key=lambda r: -excess(r)):
            if len(made) >= self.config.max_plans_per_round or excess(r) <= 0:
                break
            rec = self.plan_request(r)
            if isinstance(rec, PlanRecord):
                made.append(rec)
        if self.burst and not made and not self.inflight:
            self.burst = False  # nothing left to gain: back to the cadence
        assert len(made) <= self.config.max_plans_per_round
        return made

    def plan_request(self, req_id: object) -> PlanRecord | NoPlan:
        """Plan one request now with the configured planner (the dense path calls this every step)."""
        if req_id in self.inflight:
            raise PlanConflictError(f"request {req_id!r} already has a plan in flight (I4)")
        snap = self.table.snapshot(req_id, self._shared_blocks(req_id))
        if self.config.planner is PlanKind.DENSIFY:
            plan = plan_densify(snap)
        else:
            budget = self.pool.num_free  # evacuation may use the headroom
            choice = choose_sources(snap, self.config.max_sources, budget)
            if not choice:
                plan = choice
            else:
                dsts = self.pool.allocate(choice.num_dst, Purpose.EVACUATION)
                plan = plan_compaction(snap, dsts, self.config.max_sources)
                assert plan and plan.dst_blocks == tuple(dsts), "planner must use exactly the reserved blocks"
        if not plan:
            self.stats.no_plan[plan.reason] += 1
            return plan
        rec = PlanRecord(plan)
        self.inflight[req_id] = rec
        self.stats.plans_made += 1
        if self._f_prev is not None:
            self._f_prev = self.waste_ratio()  # destinations in flight count as waste; a plan's own are no burst
        return rec

    # ---- Stage 4: copy, commit, abort ------------------------------------------------------
    def launch(self) -> None:
        """Submit every PLANNED copy. Call after the step's forward has been issued."""
        for rec in list(self.inflight.values()):
            if rec.state is not PlanState.PLANNED:
                continue
            rec.state = PlanState.COPYING
            if not rec.plan.moves:
                continue  # nothing to copy: settled by definition
            rec.handle = self.engine.submit(rec.plan.moves, req_id=rec.plan.req_id)
            if self.config.ordering is Ordering.EVENT:
                self.engine.order_before_compute(rec.handle)
            elif self.config.ordering is Ordering.FORCE_SYNC:
                self.engine.wait(rec.handle)

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
        return done

    def on_request_removed(self, req_id: object, blocks: list[int]) -> None:
        """The request finished or was preempted and left the table; ``blocks`` were its list.

        Frees what no copy can touch now; what a pending copy reads or writes is
        held until that copy settles.
        """
        rec = self.inflight.pop(req_id, None)
        if rec is None:
            self.pool.free(blocks)
            return
        settled = rec.state is PlanState.PLANNED or self._status(rec).settled
        rec.state = PlanState.ABORTED
        rec.abort_reason = "request left while its plan was in flight"
        self.stats.plans_aborted[rec.abort_reason] += 1
        if settled:
            self._release_handle(rec)
            self.pool.free(list(blocks) + list(rec.plan.dst_blocks))
            return
        touched = set(rec.plan.src_blocks) | {b for m in rec.plan.moves for b in (m.src_block, m.dst_block)}
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
    def _commit(self, rec: PlanRecord) -> None:
        plan, t, S = rec.plan, self.table, self.pool.block_size
        req = plan.req_id
        stale = t.layout_version(req) != plan.version[0] or (
            plan.kind is PlanKind.DENSIFY and t.total_len(req) != plan.version[1]
        )
        if stale:
            self._abort(rec, "layout changed since the snapshot (I4)")
            return
        moves = [m for m in plan.moves if t.is_live(req, m.token_id)]  # evicted in flight: stay dead
        self.stats.moves_dropped += len(plan.moves) - len(moves)
        receiving = {m.dst_block for m in moves}
        dsts = tuple(b for b in plan.dst_blocks if b in receiving)
        unused = [b for b in plan.dst_blocks if b not in receiving]
        blocks, write_pos = t.block_ids(req), t.write_pos(req)
        live_before = t.live_token_ids(req)
        final_blocks, final_pos = plan.final_layout(blocks, write_pos, S, dsts)
        if dsts:  # attach the destinations before the cursor, then move into them
            at = final_blocks.index(dsts[0])
            t.set_layout(req, blocks[:at] + list(dsts) + blocks[at:], write_pos + len(dsts) * S)
        t.apply_moves(req, moves)
        t.set_layout(req, final_blocks, final_pos)
        if t.live_token_ids(req) != live_before:  # online I1/I2 postcondition: a relocation moves, never edits
            raise InvariantViolation("I2", f"request {req!r}: committing plan changed its ordered live token ids")
        self._release_handle(rec)
        self.pool.free(list(plan.src_blocks) + unused)
        rec.state = PlanState.COMMITTED
        del self.inflight[req]
        self.stats.plans_committed += 1
        self.stats.moves_committed += len(moves)
        self.stats.blocks_released += len(plan.src_blocks) - len(dsts)

    def _abort(self, rec: PlanRecord, reason: str) -> None:
        assert self._status(rec).settled, "a destination is freed only when no copy can write it (I6)"
        self._release_handle(rec)
        self.pool.free(rec.plan.dst_blocks)
        rec.state = PlanState.ABORTED
        rec.abort_reason = reason
        del self.inflight[rec.plan.req_id]
        self.stats.plans_aborted[reason] += 1

    def _status(self, rec: PlanRecord) -> CopyStatus:
        if rec.handle is None:
            return CopyStatus.PENDING if rec.state is PlanState.PLANNED else CopyStatus.DONE
        return self.engine.poll(rec.handle)

    def _release_handle(self, rec: PlanRecord) -> None:
        if rec.handle is not None:
            self.engine.release(rec.handle)
            rec.handle = None

    def _shared_blocks(self, req_id: object) -> list[int]:
        return [b for b in self.table.block_ids(req_id) if self.pool.ref_count(b) > 1]

