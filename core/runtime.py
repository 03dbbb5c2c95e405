"""The shared driver: Algorithm 1 (seed §3.5), once, for every policy.

One decode iteration is split where a serving engine's forward sits:

    begin_step(appends)      settle copies (commit / abort)         Stage 4 tail
                             allocate + SyncNewTokens                line 1
                             BuildSlotMapping (write + read slots)   line 4
                             engine.before_compute()                 pre-attention wait
    -- the engine's forward: writes new K/V, attention reads --      line 6
    end_step(attention)      record scores, SelectVictims            line 2
                             EvictToken                              line 3
                             plan + launch copies (after forward)    line 5

Victims are chosen once this step's attention is known, and their slots leave
the next step's slot mapping; reclamation plans from the state after the
forward, so every token it moves has been written. Only ``select_victims``
differs between policies.

Read paths:
  gather - attention reads exactly the live slots (Eq. 2); any reclaim mode.
  dense  - attention reads positions [0, n_live) through the block list, as
           vLLM's stock kernels do; requires ``densify`` with EVENT or
           FORCE_SYNC ordering, so the layout is dense before the next read.
"""

from __future__ import annotations

import enum
import math
from array import array
from dataclasses import dataclass
from typing import Mapping, Sequence

from .block_pool import BlockAllocator, Purpose, blocks_needed
from .checks import as_list, check_enum, check_int, check_mapping, check_request_id, check_weights, is_int, is_known_key
from .copy_engine import CopyEngine, CopyHandle, CopyStatus
from .errors import (
    AdmissionClosedError,
    BlockNotOwnedError,
    ConfigError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantViolation,
    PlanConflictError,
    PolicyError,
    PoolExhaustedError,
    StepOrderError,
    UnknownRequestError,
)
from .plan import Plan, PlanKind
from .policies import POLICIES, make_policy
from .policies.base import EvictionPolicy, RequestView
from .reclamation import Ordering, PlanState, ReclaimConfig, ReclaimStats, ReclamationManager
from .scores import TokenScores
from .token_table import NO_SLOT, TokenTable

_ALLOCATOR_METHODS = ("can_allocate", "allocate", "free", "share", "ref_count", "is_cached")
_ENGINE_METHODS = ("submit", "poll", "order_before_compute", "wait", "release", "before_compute")


def check_budget(budget: object) -> None:
    """A ``ConfigError`` naming the value unless ``budget`` is a ratio in (0, 1] (float) or a count >= 1 (int)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) \
            or (isinstance(budget, float) and not 0.0 < budget <= 1.0) or (isinstance(budget, int) and budget < 1):
        raise ConfigError(f"budget must be a ratio in (0, 1] (a float) or a token count >= 1 (an int), got {budget!r}")


def _check_protocol(what: str, obj: object, methods: tuple[str, ...], attrs: tuple[str, ...] = ()) -> None:
    missing = [m + "()" for m in methods if not callable(getattr(obj, m, None))]
    missing += [a for a in attrs if not hasattr(obj, a)]
    if missing:
        raise ConfigError(f"{what} must implement the {what} protocol; {obj!r:.80} lacks {', '.join(missing)}")


def _as_policy(policy: object) -> EvictionPolicy | None:
    """None, an ``EvictionPolicy`` instance, or the name of a registered policy (built with its defaults)."""
    if policy is None or isinstance(policy, str):
        return None if policy is None else make_policy(policy)
    if isinstance(policy, type) or not callable(getattr(policy, "select_victims", None)) \
            or not isinstance(getattr(policy, "name", None), str):
        hint = f" (pass an instance: {policy.__name__}())" if isinstance(policy, type) else ""
        raise ConfigError(f"policy must be None, an EvictionPolicy (select_victims(view) and a name) or one of "
                          f"{sorted(POLICIES)}, got {policy!r}{hint}")
    return policy  # type: ignore[return-value]


def _touched(plan: Plan) -> set[int]:
    """Every block a plan reads, writes or gives up."""
    return set(plan.src_blocks) | set(plan.dst_blocks) | {b for m in plan.moves for b in (m.src_block, m.dst_block)}


class ReadPath(enum.Enum):
    GATHER = "gather"
    DENSE = "dense"


@dataclass(frozen=True)
class ReadChanges:
    """How a request's read list (its live slots and their token ids, in logical order) changed since the
    previous ``read_changes``: unless ``rebuilt`` (the first call, or more evictions or moves than the table's
    log keeps: read the whole list), the tokens in ``evicted`` left it, the tokens in ``moved`` (ascending) are
    now at ``moved_slots``, and ``joined`` (at ``joined_slots``) joined it at the end, in order. ``version``:
    the request's layout version now; ``since``: at the previous call (a consumer's copy must be at it)."""

    version: int
    since: int
    rebuilt: bool
    evicted: tuple[int, ...] = ()
    joined: tuple[int, ...] = ()
    joined_slots: tuple[int, ...] = ()
    moved: tuple[int, ...] = ()
    moved_slots: tuple[int, ...] = ()


class StepRequest:
    """One request's inputs for one forward: what changed since its previous step, and its full read list
    on demand.

    ``new_tokens``/``write_slots`` are this step's appends (NO_SLOT: skip the write). The read list (what
    attention reads, in read order, and the logical token at each read slot) changed since the request's
    previous step by exactly this, unless ``rebuilt`` (its first step, more evictions or moves than the
    table's log keeps, or on the dense path any layout change, which reorders its position-ordered list:
    re-read the whole list): the tokens in ``evicted`` left it, the tokens in ``moved``
    (a relocation committed; ascending) are now at ``moved_slots``, and the tokens of ``joined`` whose
    ``joined_slots`` entry is not NO_SLOT joined it at the end, in order (``joined`` is ``new_tokens`` unless
    the engine also synced between steps). ``version`` is the request's layout version, which changes exactly
    when its layout does; ``since`` is the version at its previous step.

    ``read_slots`` and ``read_tokens`` are computed on first use (O(L)) from the table, and only while the
    request's table is as ``begin_step`` left it (``StepOrderError`` after it changed, e.g. after
    ``end_step`` evicted): a consumer that reads during the forward gets exactly what the step reads."""

    __slots__ = ("req_id", "new_tokens", "write_slots", "version", "since", "rebuilt", "evicted", "moved",
                 "moved_slots", "joined", "joined_slots", "_rt", "_stamp", "_read")

    def __init__(self, rt: VTokenRuntime, req_id: object, new_tokens: range, write_slots: list[int]) -> None:
        self.req_id, self.new_tokens, self.write_slots = req_id, new_tokens, write_slots
        c = rt.table.take_changes(req_id)
        # NOTE: the dense path reads in position order (a dense prefix), which a move or a block-list rewrite
        # reorders: any layout change is rebuilt there. The gather path reads in logical order, which they keep
        reorders = c.version != c.since and rt.read_path is ReadPath.DENSE
        self.version, self.since, self.rebuilt, self.evicted = c.version, c.since, c.rebuilt or reorders, c.evicted
        self.moved, self.moved_slots = ((), ()) if reorders else (c.moved, c.moved_slots)
        self.joined = range(c.joined_from, rt.table.total_len(req_id))
        self.joined_slots = write_slots if self.joined == new_tokens else rt.table.write_slots(req_id, c.joined_from)
        self._rt, self._stamp = rt, rt._stamp(req_id)
        self._read: tuple[list[int], list[int]] | None = None

    @property
    def read_slots(self) -> list[int]:
        return self._read_lists()[0]

    @property
    def read_tokens(self) -> list[int]:
        return self._read_lists()[1]

    def _read_lists(self, keep: bool = True) -> tuple[list[int], list[int]]:
        """Computed once and kept (``keep``; ``end_step`` does not keep what it computes, so a rejected
        ``end_step`` leaves the step as it found it)."""
        if self._read is not None:
            return self._read
        if self.req_id not in self._rt.table or self._rt._stamp(self.req_id) != self._stamp:
            raise StepOrderError(f"request {self.req_id!r}: its read list was not read during its step and "
                                 f"the table has changed since; read read_slots/read_tokens before end_step")
        lists = self._rt._read_slots(self.req_id)
        if keep:
            self._read = lists
        return lists

    def __repr__(self) -> str:
        return (f"StepRequest({self.req_id!r}, new_tokens={self.new_tokens}, write_slots={self.write_slots[:8]}, "
                f"version={self.version}, rebuilt={self.rebuilt}, evicted={self.evicted[:8]}, moved={self.moved[:8]})")


@dataclass(frozen=True)
class StepInputs:
    iteration: int
    requests: dict[object, StepRequest]


class VTokenRuntime:
    """The vToken substrate for one pool: token tables, scores, policy, reclamation.

    Args:
        pool: the block allocator.
        engine: the copy engine.
        policy: the eviction policy (None: never evict, i.e. native full retention), or a registered
            policy's name ("h2o", ...), built with its defaults.
        budget: live tokens a request may keep: a ratio of its tokens in (0, 1] (float) or a count (int).
        reclaim: the reclamation configuration (None: Naive-Evict, no reclamation).
        read_path: how attention reads KV: a ``ReadPath`` or its value ("gather", "dense").
        seed: passed to randomized policies.
        ordering: with ``reclaim`` None, how the copies of other plans (the drill's ``relocate_block``) are
            ordered; a reclaim configuration brings its own (``ConfigError`` if both are given).
        evict_every: the eviction cadence beta >= 1: a request over its budget by fewer than beta tokens waits;
            at beta or more it evicts down to the budget. Each request is then at most beta - 1 tokens over its
            budget after a step (as far as its policy can evict), and its plans and copies come every ~beta
            steps, beta tokens at a time. 1:
            evict every step (victims and plans exactly as without the setting).
    """

    def __init__(self, pool: BlockAllocator, engine: CopyEngine, policy: EvictionPolicy | None = None,
                 budget: float | int = 1.0, reclaim: ReclaimConfig | None = None,
                 read_path: ReadPath = ReadPath.GATHER, seed: int = 0, score_window: int = 32,
                 ordering: Ordering | None = None, evict_every: int = 1) -> None:
        _check_protocol("pool", pool, _ALLOCATOR_METHODS, ("num_blocks", "block_size", "headroom", "num_free"))
        _check_protocol("engine", engine, _ENGINE_METHODS)
        policy = _as_policy(policy)
        check_budget(budget)
        if reclaim is not None and not isinstance(reclaim, ReclaimConfig):
            raise ConfigError(f"reclaim must be None (no reclamation) or a ReclaimConfig, got {reclaim!r}")
        read_path = check_enum("read_path", read_path, ReadPath)
        check_int("seed", seed, error=ConfigError)
        check_int("evict_every", evict_every, 1, error=ConfigError)
        if ordering is not None:
            ordering = check_enum("ordering", ordering, Ordering)
            if reclaim is not None:
                raise ConfigError("ordering: give it in the ReclaimConfig when reclamation is on")
        if read_path is ReadPath.DENSE and policy is not None:
            if reclaim is None or reclaim.planner is not PlanKind.DENSIFY:
                raise ConfigError("read_path 'dense' needs reclaim planner 'densify': stock kernels cannot skip holes")
            if reclaim.ordering is Ordering.POLL:
                raise ConfigError("read_path 'dense' needs ordering 'event' or 'force_sync', not 'poll'")
        self.pool = pool
        self.engine = engine
        self.policy = policy
        self.budget = budget
        self.evict_every = evict_every
        self.read_path = read_path
        self.seed = seed
        self.table = TokenTable(pool.num_blocks, pool.block_size)
        self.scores = TokenScores(score_window, getattr(policy, "statistics", ()))
        self.reclaim = reclaim
        self.manager = ReclamationManager(pool, self.table, engine,
                                          reclaim or ReclaimConfig(ordering=ordering or Ordering.POLL))
        self.iteration = 0
        self._last: StepInputs | None = None
        self._victim_positions: dict[object, list[int]] = {}  # this step's victims' positions (dense path)
        self._release_deferred: dict[object, None] = {}  # gather path: requests whose dead blocks wait for their plan
        self.pressure = 0  # blocks the engine is short of (``set_pressure``): rounds run whatever θ_F says

    def set_budget(self, budget: float) -> None:
        """Change the eviction budget from the next victim selection on (checked as at construction; a bad
        value raises ``ConfigError`` and changes nothing). Lowering it makes every request evict its new
        excess at once: an eviction burst."""
        check_budget(budget)
        self.budget = budget

    def set_pressure(self, blocks_short: int) -> None:
        """Tell the runtime how many blocks the engine is short of: for a waiting request's admission or the
        next step's growth, beyond what the pool can give without preempting (0: none). While it is > 0, each
        step's end runs a packing round on the gather path whatever F and θ_F say (the seed's Stage 2 puts
        reclamation first when blocks run short): compaction first, and densify, in place, for a request compaction
        cannot shrink or whose cursor lies past holes (``ReclamationManager.plan_round(pack=True)``); at 0
        reclamation is lazy, θ_F-gated, as before. Every plan obeys the same rules either way (I4, the headroom
        bound on destinations), so this changes when rounds run and which planner packs, never what a plan may
        do. ``InvalidArgumentError`` (nothing changes) for anything but an int >= 0."""
        check_int("blocks_short", blocks_short, 0)
        self.pressure = blocks_short

    # ---- requests -----------------------------------------------------------------
    def can_admit(self, prompt_len: int) -> bool:
        check_int("prompt_len", prompt_len, 0)
        return self.manager.admission_open() and self.pool.can_allocate(
            blocks_needed(prompt_len, self.pool.block_size), Purpose.ADMISSION
        )

    def admit(self, req_id: object, share_prefix_of: object = None, shared_blocks: int = 0) -> None:
        """Register a request; its prompt arrives as the appends of the next ``begin_step``.

        With ``share_prefix_of``, the first ``shared_blocks`` blocks of that
        request are shared (prefix-cache hit): their tokens are registered as
        already computed. Only blocks whose S tokens are all live in their
        original slots, entirely before the source's append cursor (never written
        again), and untouched by a relocation plan of the source still in flight
        can be shared (``PlanConflictError`` otherwise).
        """
        check_request_id(req_id)
        if req_id in self.table:
            raise DuplicateRequestError(f"request {req_id!r} is already admitted")
        prefix: list[int] = []
        if share_prefix_of is not None:
            prefix = self._shareable_prefix(share_prefix_of, shared_blocks)
        elif not (is_int(shared_blocks) and shared_blocks == 0):
            raise InvalidArgumentError(f"request {req_id!r}: shared_blocks={shared_blocks!r} without share_prefix_of")
        if not self.manager.admission_open():
            raise AdmissionClosedError(f"admission of {req_id!r} waits for in-flight reclamation")
        # -- validated; mutate --
        self.table.add_request(req_id)
        self.scores.add_request(req_id)
        for b in prefix:
            self.pool.share(b)
        if prefix:
            self.table.sync_new_tokens(req_id, prefix, len(prefix) * self.pool.block_size)
            self.scores.extend(req_id, len(prefix) * self.pool.block_size)
            self.scores.copy_keys(req_id, share_prefix_of, len(prefix) * self.pool.block_size)  # the same keys
        assert self.table.total_len(req_id) == self.table.write_pos(req_id) == len(prefix) * self.pool.block_size

    def finish(self, req_id: object) -> None:
        self._remove(req_id)

    def preempt(self, req_id: object) -> int:
        """Drop the request's KV for recomputation; returns its length (to re-prefill)."""
        n = self.table.total_len(req_id)
        self._remove(req_id)
        return n

    def waste_ratio(self) -> float:
        """F, Eq. 1, over the whole pool (``occupancy.waste_ratio``); what the reclamation trigger reads."""
        return self.manager.waste_ratio()

    def running(self) -> list[object]:
        return self.table.request_ids()

    # ---- read-only queries: what an engine that allocates itself reads back (the vLLM plugin, the bench) ----
    # NOTE: nothing outside the runtime mutates its table or manager; these only read. Each raises
    # UnknownRequestError for a request the runtime does not track (``TokenTable._get``).
    def __contains__(self, req_id: object) -> bool:
        return req_id in self.table

    def total_len(self, req_id: object) -> int:
        return self.table.total_len(req_id)

    def write_pos(self, req_id: object) -> int:
        return self.table.write_pos(req_id)

    def gap(self, req_id: object) -> int:
        """Logical minus physical length: how far eviction and densify moved the append cursor back."""
        return self.table.total_len(req_id) - self.table.write_pos(req_id)

    def num_live(self, req_id: object) -> int:
        return self.table.num_live(req_id)

    def block_ids(self, req_id: object) -> list[int]:
        return self.table.block_ids(req_id)

    def shared_blocks(self, req_id: object) -> list[int]:
        """The request's blocks that other requests list too (``TokenTable.shared_blocks``)."""
        return self.table.shared_blocks(req_id)

    def num_blocks_of(self, req_id: object) -> int:
        return self.table.num_blocks_of(req_id)

    def block_at(self, req_id: object, index: int) -> int:
        return self.table.block_at(req_id, index)

    def live_token_ids(self, req_id: object) -> list[int]:
        return self.table.live_token_ids(req_id)

    def attention_slots(self, req_id: object) -> list[int]:
        return self.table.attention_slots(req_id)

    def read_lists(self, req_id: object) -> tuple[list[int], list[int]]:
        """(live token ids, their slots) in logical order, from the live index: O(live)."""
        return self.table.read_lists(req_id)

    def read_changes(self, req_id: object) -> ReadChanges:
        """How the request's read list changed since the previous call, for an engine that syncs itself and
        keeps its own copy of the list (vLLM's workers). ``begin_step`` takes the same changes for its
        ``StepRequest``: an engine uses one or the other, never both (each take empties the change log).
        O(evicted + moved + joined)."""
        c = self.table.take_changes(req_id)
        if c.rebuilt:
            return ReadChanges(c.version, c.since, True)
        slots = self.table.write_slots(req_id, c.joined_from)  # NO_SLOT for a joined token already evicted
        joined = [(t, s) for t, s in enumerate(slots, c.joined_from) if s != NO_SLOT]
        return ReadChanges(c.version, c.since, False, c.evicted, tuple(t for t, _ in joined),
                           tuple(s for _, s in joined), c.moved, c.moved_slots)

    def slot_of(self, req_id: object, token_id: int) -> int:
        return self.table.slot_of(req_id, token_id)

    def block_live_counts(self, req_id: object) -> dict[int, int]:
        return self.table.block_live_counts(req_id)

    def retained_vs_ideal(self) -> tuple[int, int]:
        """Blocks the requests hold, and the ideal: ceil(live / S) summed over them."""
        ids, S = self.table.request_ids(), self.pool.block_size
        return sum(len(self.table.block_ids(r)) for r in ids), sum(blocks_needed(self.table.num_live(r), S) for r in ids)

    def dead_listed_blocks(self) -> tuple[int, int]:
        """(blocks in the requests' lists, those of them holding no live token)."""
        blocks = [b for r in self.table.request_ids() for b in self.table.block_ids(r)]
        return len(blocks), sum(1 for b in blocks if not self.table.occupancy.block_live(b))

    @property
    def reclaim_stats(self) -> ReclaimStats:
        """The reclamation manager's counters (read them; the manager writes them)."""
        return self.manager.stats

    def copies_in_flight(self) -> set[CopyHandle]:
        """Handles of the copies of plans still in flight (I3: a copy not yet run belongs to one of them)."""
        return {rec.handle for rec in self.manager.inflight.values() if rec.handle is not None}

    def plans_outstanding(self) -> int:
        """Plans in flight plus orphans whose copy has not settled (0: every plan has settled)."""
        return len(self.manager.inflight) + len(self.manager.orphans)

    def relocate_block(self, req_id: object, index: int) -> object:
        """The relocation drill: plan moving block ``index`` of the request's list to a fresh block and launch
        its copy (``ReclamationManager.plan_relocation``); it commits when settled, like any plan. Returns
        the plan's record, or the ``NoPlan`` saying why none was made.

        NOTE: on the dense path only between steps (``StepOrderError`` while one is open): a plan in flight at
        ``end_step`` keeps densify from following that step's evictions (one plan per request), so the next
        read would find holes (I7). Between steps the next ``begin_step`` commits it (EVENT, FORCE_SYNC)."""
        if self.read_path is ReadPath.DENSE and self._last is not None:
            raise StepOrderError(f"request {req_id!r}: relocate_block on the dense path while step "
                                 f"{self._last.iteration} is open; call it between end_step and begin_step")
        rec = self.manager.plan_relocation(req_id, index)
        if rec:
            self.manager.launch()
        return rec

    def settle(self) -> list:
        """Commit or abort every plan whose copy has settled (``ReclamationManager.settle``), for engines
        that step themselves; ``begin_step`` does this for the simulator. Returns the settled records.

        NOTE: inside an open step, a commit changes the layout the step's read lists come from; they are
        computed first (``StepRequest``), so the step keeps reading what it read."""
        if self._last is not None:
            for r in self.manager.inflight:
                if is_known_key(self._last.requests, r) and r in self.table:
                    self._last.requests[r]._read_lists()
        return self.manager.settle()

    # ---- Algorithm 1 -------------------------------------------------------------------
    def blocks_to_grow(self, req_id: object, n_new: int) -> int:
        S = self.pool.block_size
        pos = self.table.write_pos(req_id)
        if n_new.__class__ is not int or n_new < 0:
            check_int(f"request {req_id!r}: n_new", n_new, 0)
        return max(0, blocks_needed(pos + n_new, S) - self.table.num_blocks_of(req_id))

    def begin_step(self, appends: Mapping[object, int]) -> StepInputs:
        """Settle copies, sync this step's new tokens, and build every running request's slots.

        Everything is checked before anything changes, settling included: one step open at a time
        (``StepOrderError``), known requests, int counts >= 0, and room in the pool for every
        append once settled copies have committed (forecast without committing them, so a step
        that does not fit raises ``PoolExhaustedError`` and leaves even the plans as they were).
        """
        if self._last is not None:
            raise StepOrderError(f"begin_step while step {self._last.iteration} is open; call end_step first")
        check_mapping("appends", appends)
        need = {}
        for r, n in appends.items():
            if r not in self.table:
                raise UnknownRequestError(f"unknown request {r!r}")
            if n.__class__ is not int and not is_int(n) or n < 0:
                raise InvalidArgumentError(f"request {r!r}: cannot append {n!r} tokens")
            need[r] = self.blocks_to_grow(r, n)
        total, free = sum(need.values()), self.pool.num_free
        if not self.pool.can_allocate(total, Purpose.ADMISSION):
            total, free = self._room_after_settle(appends)  # what settling would free, forecast without settling
            if total and total > free - self.pool.headroom:
                raise PoolExhaustedError(
                    f"step {self.iteration}: appends of request(s) {[r for r, k in need.items() if k][:8]} need "
                    f"{total} blocks, {free} free with {self.pool.headroom} reserved; preempt a request first"
                )
        # -- validated; mutate --
        free_before = self.pool.num_free
        if self.manager.settle() or self.pool.num_free != free_before:  # commits change layouts, so growth
            need = {r: self.blocks_to_grow(r, n) for r, n in appends.items()}
        if not self.pool.can_allocate(sum(need.values()), Purpose.ADMISSION):  # the forecast was wrong: a bug
            raise InvariantViolation("P3", f"step {self.iteration}: appends need {sum(need.values())} blocks after "
                                     f"settling, {self.pool.num_free} free; the forecast said they fit")
        written = {}  # request -> its appends' write slots, as the sync returned them
        for r, n in appends.items():
            end = self.table.total_len(r) + n
            written[r] = self.table.sync_new_tokens(r, self.pool.allocate(need[r], Purpose.ADMISSION), end)
            self.scores.extend(r, end)
        reqs = {}
        for r in self.table.request_ids():  # O(1) per request beyond its appends and evictions
            write = written.get(r, [])
            end = self.table.total_len(r)
            new = range(end - len(write), end)
            if self.read_path is ReadPath.DENSE and not self._is_dense(r):
                self._read_slots(r)  # raises I7, naming the slot (the cursor past n_live may still read densely)
            reqs[r] = StepRequest(self, r, new, write)
        self._last = StepInputs(self.iteration, reqs)
        self.engine.before_compute()  # pre-attention hook: the forward waits on ordered copies (I3)
        return self._last

    def end_step(self, attention: Mapping[object, Sequence[float]] | None = None,
                 key_norms: Mapping[object, Sequence[float]] | None = None,
                 observed: Mapping[object, Sequence[float]] | None = None) -> dict[object, list[int]]:
        """Record this step's attention, select victims and evict, plan and launch reclamation.

        ``attention``: request -> the newest query's weights over the tokens it read (``StepRequest.read_tokens``);
        ``key_norms``: request -> the key norms of the tokens it wrote this step (``new_tokens``), for a policy
        that reads them (Knorm); ``observed``: request -> its observation window's pooled votes over the tokens it
        read, at the step its prompt completed (SnapKV). Other policies ignore the last two, checked all the same.

        This step's rows are recorded before victims are chosen, so the
        policy sees every attention row computed so far (Algorithm 1 line 2
        reads the scores of the decode that preceded it). In particular a
        request's first eviction, right after its prefill and usually its
        largest, ranks tokens by the prefill's row rather than by zeros.
        Everything is validated first: a bad attention row or a policy
        returning invalid victims raises and changes nothing, the recorded
        rows included (the step can be ended again). A row may name a request
        that finished during the step (it is dropped), never one that was not
        in it. Returns each request's victims.
        """
        if self._last is None:
            raise StepOrderError("end_step without begin_step")
        step = self._last
        rows = self._step_rows(step, attention)
        keys = self._step_keys(step, key_norms)
        votes = self._step_rows(step, observed, "observation")
        victims = self._record_and_choose(self.table.request_ids(), rows, keys, votes)
        # -- validated; mutate --
        self._evict_and_reclaim(victims)
        self._last = None
        return victims

    def _step_rows(self, step: StepInputs, attention: Mapping[object, Sequence[float]] | None,
                   kind: str = "attention row") -> dict[object, tuple[list[int], array]]:
        """``end_step``'s rows (or observations: ``kind``), validated: request -> (the tokens it read, their weights).
        O(row)."""
        if attention is not None:
            check_mapping("attention" if kind == "attention row" else "observed", attention)
        rows = {}
        for r, weights in (attention or {}).items():
            if not is_known_key(step.requests, r):
                if r in self.table:
                    raise InvalidArgumentError(f"request {r!r}: {kind} for a request admitted after "
                                               f"begin_step; it read nothing in step {step.iteration}")
                raise UnknownRequestError(f"request {r!r}: {kind} for a request that was not in "
                                          f"step {step.iteration}")
            req = step.requests[r]
            if r not in self.table or self.table.total_len(r) < req.new_tokens.stop:
                continue  # finished during the step (and perhaps admitted again: not the request that read)
            row = check_weights(f"request {r!r}: {kind}", weights)
            read_tokens = req._read_lists(keep=False)[1]
            if len(row) != len(read_tokens):
                raise InvalidArgumentError(
                    f"request {r!r}: {kind} of {len(row)} weights for {len(read_tokens)} read tokens"
                )
            rows[r] = (read_tokens, row)
        return rows

    def _step_keys(self, step: StepInputs, key_norms: Mapping[object, Sequence[float]] | None
                   ) -> dict[object, tuple[list[int], array]]:
        """``end_step``'s key norms, validated: request -> (the tokens it wrote, their norms). O(new tokens)."""
        if key_norms is None:
            return {}
        check_mapping("key_norms", key_norms)
        keys = {}
        for r, norms in key_norms.items():
            if not is_known_key(step.requests, r):
                raise UnknownRequestError(f"request {r!r}: key norms for a request that was not in "
                                          f"step {step.iteration}")
            new = step.requests[r].new_tokens
            if r not in self.table or self.table.total_len(r) < new.stop:
                continue  # finished during the step, as for rows
            keys[r] = (list(new), check_weights(f"request {r!r}: key norms", norms, len(new)))
        return keys

    # ---- for engines that allocate and schedule themselves (vLLM) -----------------------
    def sync(self, req_id: object, new_blocks: Sequence[int], total_len: int) -> list[int]:
        """Algorithm 1 line 1 with blocks the engine allocated: register tokens up to ``total_len``
        (appending ``new_blocks`` to the block list); returns their write slots.

        Besides what ``TokenTable.sync_new_tokens`` checks, each new block must be allocated in the
        pool (``BlockNotOwnedError`` for a free one), not reserved by a relocation plan, and, if other
        requests hold it (a shared prefix block), referenced in the pool once per holder; it must not be
        touched by a holder's plan in flight (``PlanConflictError``)."""
        new = self.table.check_sync(req_id, new_blocks, total_len)
        self._check_pool_blocks(req_id, new)
        # -- validated; mutate --
        slots = self.table.sync_new_tokens(req_id, new, total_len)
        self.scores.extend(req_id, self.table.total_len(req_id))
        return slots

    def evict_and_reclaim(self, req_ids: Sequence[object],
                          attention: Mapping[object, tuple[Sequence[int], Sequence[float]]] | None = None,
                          key_norms: Mapping[object, tuple[Sequence[int], Sequence[float]]] | None = None,
                          observed: Mapping[object, tuple[Sequence[int], Sequence[float]]] | None = None
                          ) -> dict[object, list[int]]:
        """Algorithm 1 lines 2, 3 and 5 for ``req_ids`` after a forward: record this step's attention rows
        (request -> (token ids read, weights)), key norms (request -> (token ids, norms)) and observation-window
        votes (request -> (token ids, votes)), select victims (from every row so far, this step's included), evict,
        plan and launch reclamation. Validated first: a bad row or an invalid policy answer raises and changes
        nothing."""
        ids = as_list("req_ids", req_ids)
        for what, given in (("attention", attention), ("key_norms", key_norms), ("observed", observed)):
            if given is not None:
                check_mapping(what, given)
        unknown = [r for r in ids + list(attention or {}) + list(key_norms or {}) + list(observed or {})
                   if r not in self.table]
        if unknown:
            raise UnknownRequestError(f"unknown request(s) {unknown[:5]}")
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"req_ids name a request twice: {ids[:8]}")
        s = self.scores
        rows, keys, votes = (self._pairs(what, given, check, unit) for what, given, check, unit in (
            ("attention", attention, s.check_row, "weights"), ("key_norms", key_norms, s.check_keys, "norms"),
            ("observed", observed, s.check_observed, "votes")))
        victims = self._record_and_choose(ids, rows, keys, votes)
        self._evict_and_reclaim(victims)
        return victims

    @staticmethod
    def _pairs(what: str, given: Mapping | None, check, unit: str) -> dict[object, tuple[list[int], array]]:
        """``evict_and_reclaim``'s request -> (token ids, values) mapping ``what``, each pair validated by ``check``."""
        out = {}
        for r, pair in (given or {}).items():
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise InvalidArgumentError(f"request {r!r}: {what} must map a request to (token ids, {unit}), "
                                           f"got {pair!r:.80}")
            out[r] = check(r, *pair)
        return out

    def detach(self, req_id: object) -> list[int]:
        """Forget a request whose blocks the engine frees itself (finish, abort, preemption).

        Returns its block list. Only when no plan of it is in flight: a pending copy would still
        touch those blocks (I5, I6), and only this runtime could hold them back.
        """
        if req_id not in self.table:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        if self.manager.in_flight(req_id) is not None:
            raise PlanConflictError(f"request {req_id!r} has a plan in flight; its blocks cannot be handed back yet")
        blocks = self.table.remove_request(req_id)
        self.scores.remove_request(req_id)
        assert req_id not in self.table and self.manager.in_flight(req_id) is None
        return blocks

    # ---- helpers ----------------------------------------------------------------------
    def _record_and_choose(self, req_ids: Sequence[object],
                           rows: Mapping[object, tuple[Sequence[int], Sequence[float]]],
                           keys: Mapping[object, tuple[Sequence[int], Sequence[float]]] = {},
                           votes: Mapping[object, tuple[Sequence[int], Sequence[float]]] = {}) -> dict[object, list[int]]:
        """Record validated rows, key norms and votes, then choose victims; if choosing raises, all are taken back."""
        s = self.scores
        saved = [(r, ids, s._save(r, ids)) for r, (ids, _) in (*rows.items(), *keys.items(), *votes.items())]
        for r, (ids, weights) in rows.items():
            s._apply(r, ids, weights)
        for r, (ids, norms) in keys.items():
            s._apply_keys(r, ids, norms)
        for r, (ids, values) in votes.items():
            s._apply_observed(r, ids, values)
        try:
            return self._choose_victims(req_ids)
        except BaseException:
            for r, ids, before in saved:
                s._restore(r, ids, before)
            raise

    def token_budget(self, total_len: int) -> int:
        """Live tokens a request of ``total_len`` tokens may keep."""
        if total_len.__class__ is not int or total_len < 0:
            check_int("total_len", total_len, 0)
        if isinstance(self.budget, int):
            return self.budget
        return max(1, math.ceil(self.budget * total_len))

    def _choose_victims(self, req_ids: Sequence[object]) -> dict[object, list[int]]:
        victims: dict[object, list[int]] = {}
        if self.policy is not None:
            for r in req_ids:
                # NOTE: the cadence: fewer than beta tokens over the budget wait (the policy is not asked, so the
                # O(L) choice of a score policy runs once per eviction, not once per step); beta = 1 skips nothing
                if 0 < self._excess(r) < self.evict_every:
                    continue
                chosen = self._select(r)
                if chosen:
                    victims[r] = chosen
        return victims

    def _evict_and_reclaim(self, victims: Mapping[object, list[int]]) -> None:
        dense = self.read_path is ReadPath.DENSE and self.reclaim is not None
        # on the dense path, where each victim was: densify then plans only the holes this step made
        t, positions, emptied = self.table, {}, set()
        for r, chosen in victims.items():
            before = t.blocks_emptied(r)
            positions[r] = t.evict_tokens(r, chosen)
            if t.blocks_emptied(r) != before:
                emptied.add(r)
        # ... and under pressure on the gather path, where a pressure round packs (densifies) requests
        self._victim_positions = positions if dense or self.pressure else {}
        self._reclaim()
        if self.read_path is ReadPath.GATHER:
            self._release_dead(positions, emptied)
        self.manager.launch()
        self.iteration += 1

    def _release_dead(self, positions: Mapping[object, list[int]], emptied: set) -> None:
        """The paper's Naive-Evict, on the gather path whatever the reclaimer: a block that holds no live token
        of its request, shared with no other, leaves the request's list and goes back to the pool (a RELEASE
        plan: no copy, committed with the step's other plans). Looked for where this step's evictions were,
        O(evicted), and only in the requests whose evictions emptied a block (``emptied``: most steps, none);
        a request whose plan in flight kept it from releasing is searched whole at the end of each later step
        until it can (``_release_deferred``, ordered: plans are made in a reproducible order).

        NOTE: the dense path needs none of this: densify leaves no hole below n_live, so no dead block."""
        S, deferred = self.pool.block_size, self._release_deferred
        self._release_deferred = {}
        for r in [*positions, *(r for r in deferred if r not in positions)]:
            if r not in self.table:
                continue  # left since (finished, preempted): its blocks went with it
            among = None if r in deferred else [p // S for p in positions[r]]
            if among is not None and r not in emptied:
                # fast path: no count reached 0, so no block among these is dead; V3 asks the search itself
                if self.manager.verify_fast_paths and (dead := self.table.dead_blocks(r, lambda b: True, among)):
                    raise InvariantViolation("V3", f"request {r!r}: evictions emptied blocks {dead} but the "
                                             f"table counted none")
                continue
            if r in self.manager.inflight:
                self._release_deferred[r] = None
                continue
            self.manager.plan_release(r, among)

    def eviction_due(self, req_id: object) -> bool:
        """Whether the next ``evict_and_reclaim`` naming ``req_id`` asks the policy for victims it must find (an
        excess past the cadence), as the request stands now (``policy_view`` is then what the policy sees). O(1)."""
        if req_id not in self.table:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        return self.policy is not None and self._excess(req_id) >= self.evict_every

    def policy_view(self, req_id: object) -> RequestView:
        """The view the policy decides ``req_id``'s victims from, as the request stands now: O(1) (the live
        tokens are a rank view), plus, on the dense path, the live tokens of the blocks it shares (O(shared x S))."""
        if req_id not in self.table:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        return self._view(req_id)

    def _excess(self, r: object) -> int:
        return self.table.num_live(r) - self.token_budget(self.table.total_len(r))

    def _view(self, r: object) -> RequestView:
        total = self.table.total_len(r)
        s = self.scores
        accumulated, persistence = s.readers(r)  # unchecked: policies sort by them
        latest, key_norm, observed = s.optional_readers(r)
        return RequestView(
            req_id=r, live=self.table.live_tokens(r),  # a rank view: O(1), not a list
            total_len=total, budget=self.token_budget(total), accumulated=accumulated, persistence=persistence,
            latest=latest, key_norm=key_norm, observed=observed,
            seed=self.seed, step=self.iteration, protected=self._protected(r),
        )

    def _select(self, r: object) -> list[int]:
        view = self._view(r)
        try:
            victims = list(self.policy.select_victims(view))
        except InvariantViolation:
            raise
        except Exception as e:  # a policy's bug, whatever it raised: nothing was evicted
            raise PolicyError(f"policy {self.policy.name!r} failed on request {r!r}: "
                              f"{type(e).__name__}: {e}") from e
        bad = [t for t in victims if t.__class__ is not int and not is_int(t) or t in view.protected
               or not 0 <= t < view.total_len]
        if not bad:  # ids in range: their liveness in one read
            bad = [t for t, slot in zip(victims, self.table.slots_of(r, victims)) if slot == NO_SLOT]
        if bad or len(set(victims)) != len(victims) or len(victims) > view.excess:
            raise PolicyError(
                f"policy {self.policy.name!r} returned invalid victims for request {r!r}: "
                f"{victims[:8]} (bad: {bad[:8]}, excess allowed {view.excess})"
            )
        return victims

    def _protected(self, r: object) -> frozenset[int]:
        """On the dense path, tokens in shared blocks stay: densify cannot fill holes there. O(1) when the request
        shares no block, else O(shared blocks x S): the table keeps which of its blocks others list too.

        NOTE: "shared" is the table's listing, not the pool's reference count: a block is shared when another
        request lists it (``admit(share_prefix_of=)`` shares a block in both at once; vLLM touches a prefix hit
        before vtoken syncs it into the table). Checked: the fuzzer's ``protected`` oracle recomputes the set
        from the pool's counts on every policy call, and vLLM's strict verify (B1) that every block vLLM counts
        twice is one the table lists twice."""
        if self.read_path is not ReadPath.DENSE:
            return frozenset()
        shared = self.table.shared_blocks(r)
        if not shared:
            return frozenset()
        return frozenset(t for t, _ in self.table.live_in_blocks(r, shared))

    def _reclaim(self) -> None:
        evicted_positions, self._victim_positions = self._victim_positions, {}
        if self.reclaim is None:
            return
        if self.read_path is ReadPath.DENSE:
            for r in self.table.request_ids():
                if r not in self.manager.inflight and not self._is_dense(r):
                    self.manager.plan_request(r, evicted_positions.get(r) if is_known_key(evicted_positions, r)
                                              else None)
        else:
            due = self.manager.should_reclaim(self.iteration)  # first: the adaptive trigger reads F every iteration
            if due or self.pressure:
                self.manager.stats.pressure_rounds += not due
                self.manager.plan_round(self.table.request_ids(), pack=bool(self.pressure),
                                        evicted_positions=evicted_positions)

    def _is_dense(self, r: object) -> bool:
        """Live tokens fill [0, n_live) (I7): they lie at distinct positions before the cursor (T2), so
        a cursor at n_live says so in O(1)."""
        return self.table.write_pos(r) == self.table.num_live(r)

    def _stamp(self, r: object) -> tuple[int, int, int]:
        """Changes whenever the request's table does: syncs grow total_len, moves and rewrites the layout
        version, and with neither an eviction lowers num_live."""
        t = self.table
        return t.layout_version(r), t.total_len(r), t.num_live(r)

    def _read_slots(self, r: object) -> tuple[list[int], list[int]]:
        tokens, slots = self.table.read_lists(r)
        if self.read_path is ReadPath.GATHER:
            return slots, tokens
        # dense: the stock kernel reads positions [0, n_live) through the block list (I7)
        S = self.pool.block_size
        blocks = self.table.block_ids(r)
        owner = dict(zip(slots, tokens))
        dense = [blocks[p // S] * S + p % S for p in range(len(tokens))]
        missing = [s for s in dense if s not in owner]
        if missing:
            raise InvariantViolation(
                "I7", f"request {r!r}: dense read of [0, {len(tokens)}) hits slot {missing[0]} "
                f"(block {missing[0] // S}, offset {missing[0] % S}) with no live token"
            )
        return dense, [owner[s] for s in dense]

    def _shareable_prefix(self, other: object, k: int) -> list[int]:
        S = self.pool.block_size
        blocks = self.table.block_ids(other)
        if not is_int(k):
            raise InvalidArgumentError(f"shared_blocks must be an int (a number of blocks), got {k!r}")
        # the cursor past the prefix: no block of it is ever written again (not even the append block)
        if not 0 < k <= len(blocks) or k * S > self.table.write_pos(other):
            raise BlockNotOwnedError(f"request {other!r} has no {k!r} full blocks to share")
        rec = self.manager.in_flight(other)
        if rec is not None:
            touched = _touched(rec.plan)
            hit = [b for b in blocks[:k] if b in touched]
            dense_pos = rec.plan.dense_write_pos
            if hit or (dense_pos is not None and dense_pos < k * S):
                where = f"block {hit[0]}" if hit else f"the cursor (moving it to position {dense_pos})"
                raise PlanConflictError(
                    f"request {other!r}: its {rec.plan.kind.value} plan in flight touches {where} of the "
                    f"prefix blocks {blocks[:k]}; share them once the plan has settled"
                )
        for i, b in enumerate(blocks[:k]):
            for o in range(S):
                t = i * S + o
                if self.table.slot_of(other, t) != b * S + o:  # t < k*S <= cursor <= total_len
                    raise BlockNotOwnedError(
                        f"request {other!r}: block {b} no longer holds logical tokens "
                        f"[{i * S}, {(i + 1) * S}) in place; it cannot be shared"
                    )
        for b in blocks[:k]:
            if self.pool.ref_count(b) < 1:
                raise BlockNotOwnedError(f"request {other!r}: block {b} is free in the pool; it cannot be shared")
        return blocks[:k]

    def _room_after_settle(self, appends: Mapping[object, int]) -> tuple[int, int]:
        """(blocks ``appends`` will need, blocks free) once ``manager.settle()`` has run, without running it.

        Mirrors what settling does (ReclamationManager.settle): a settled copy of a stale or failed plan
        gives back its destinations; a committed plan gives back its sources and the destinations no
        live token moves into, and takes the layout ``Plan.final_layout`` gives; a settled orphan gives
        back what it held. A freed block counts only if this is its last reference (a lower bound).
        """
        t, pool, S = self.table, self.pool, self.pool.block_size
        free = pool.num_free
        layouts: dict[object, tuple[list[int], int]] = {}
        for r, rec in self.manager.inflight.items():
            if rec.state is not PlanState.COPYING:
                continue
            status = self._copy_status(rec)
            if status is CopyStatus.PENDING:
                continue
            plan = rec.plan
            if status is CopyStatus.FAILED or self.manager.is_stale(plan):
                gone = list(plan.dst_blocks)
            else:
                dsts = plan.kept_destinations(lambda m: t.is_live(r, m.token_id))
                gone = list(plan.src_blocks) + [b for b in plan.dst_blocks if b not in dsts]
                layouts[r] = plan.final_layout(t.block_ids(r), t.write_pos(r), S, dsts)
            free += sum(1 for b in gone if pool.ref_count(b) == 1)
        for rec in self.manager.orphans:
            if self._copy_status(rec).settled:
                free += sum(1 for b in rec.held if pool.ref_count(b) == 1)
        need = 0
        for r, n in appends.items():
            if r in layouts:
                blocks, pos = layouts[r]
                need += max(0, blocks_needed(pos + n, S) - len(blocks))
            else:
                need += self.blocks_to_grow(r, n)
        return need, free

    def _copy_status(self, rec) -> CopyStatus:
        if rec.handle is None:
            return CopyStatus.PENDING if rec.state is PlanState.PLANNED else CopyStatus.DONE
        return self.engine.poll(rec.handle)

    def _check_pool_blocks(self, req_id: object, new: list[int]) -> None:
        """What only the pool and the manager know about blocks ``sync`` is given (see ``sync``)."""
        if not new:
            return
        held: dict[int, object] | None = None
        for b in new:
            ref = self.pool.ref_count(b)
            if ref < 1:
                raise BlockNotOwnedError(f"request {req_id!r}: block {b} is free in the pool; sync only blocks "
                                         f"allocated for the request")
            owners = self.table.owners(b)
            if owners:
                if ref < len(owners) + 1:
                    raise BlockNotOwnedError(
                        f"request {req_id!r}: block {b} belongs to request {owners[0]!r} and the pool counts "
                        f"{ref} reference(s) for {len(owners) + 1} holders; a block is in two block lists only "
                        f"when it is shared in the pool"
                    )
                for o in owners:
                    rec = self.manager.in_flight(o)
                    if rec is not None and b in _touched(rec.plan):
                        raise PlanConflictError(f"request {req_id!r}: block {b} of request {o!r} is touched by "
                                                f"its plan in flight; it cannot be shared until the plan settles")
                continue
            if held is None:
                held = self._plan_held()
            if b in held:
                raise BlockNotOwnedError(f"request {req_id!r}: block {b} is reserved by the relocation plan of "
                                         f"request {held[b]!r}")

    def _plan_held(self) -> dict[int, object]:
        """Blocks plans hold outside any block list: destinations in flight, blocks kept for pending copies."""
        held: dict[int, object] = {}
        for r, rec in self.manager.inflight.items():
            for b in rec.plan.dst_blocks:
                held[b] = r
        for rec in self.manager.orphans:
            for b in rec.held:
                held[b] = rec.plan.req_id
        return held

    def _remove(self, req_id: object) -> None:
        shared = self.table.shared_blocks(req_id) if self.read_path is ReadPath.GATHER else []
        blocks = self.table.remove_request(req_id)
        self.scores.remove_request(req_id)
        self.manager.on_request_removed(req_id, blocks)
        # NOTE: a block the leaver shared may now be one holder's alone, and hold none of its live tokens: a dead
        # block that was not private when it died. Naive-Evict's release searches those holders whole at the end
        # of the next step (``_release_dead``); with no other trigger they would keep it until they leave
        for b in shared:
            for holder in self.table.owners(b):
                self._release_deferred[holder] = None
        assert req_id not in self.table and self.manager.in_flight(req_id) is None


__all__ = ["ReadChanges", "ReadPath", "StepInputs", "StepRequest", "VTokenRuntime", "AdmissionClosedError", "NO_SLOT", "check_budget"]
