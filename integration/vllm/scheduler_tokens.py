"""``SchedulerTokens``: the core's ``VTokenRuntime`` driven by vLLM's scheduler (scheduler process).

vLLM allocates and schedules; vtoken keeps one token table per request in lockstep with vLLM's
block list for it (``req_to_blocks[r]``, positional). One step k, with the connector hooks that
drive it (``connector.py``):

  schedule k            vLLM allocates blocks for step k's tokens, sized by physical tokens
                        (``manager_hooks``: ``num_tokens - gap``).
  build_connector_meta  ``on_schedule``: admit new/resumed requests, sync step k's tokens into the
                        tables (Algorithm 1 line 1) at each request's cursor, run the relocation
                        drill, and hand the workers: copies planned after step k-1, block lists
                        those copies changed, each request's ``gap``, how its read list changed
                        (gather path, score policies: ``StepReads``), (score policies) the
                        victims to rank for each request due to evict (``Ranking``), and (strict
                        verify) the write slots the tables assigned, for the workers to audit.
  execute_model k       the workers copy (before ``_prepare_inputs``), rewrite block tables, and
                        map slots through the table: ``seq_len = live + new``, write slot of
                        logical position p = position p - gap; ``positions`` stay logical (RoPE).
  update_connector_output  ``after_step``: the workers' copy reports, then Algorithm 1 lines 2, 3
                        and 5 (choose victims, evict, plan ``densify``) for requests past their
                        prompt (a score policy's victims are the ones the workers ranked, checked
                        against the core's choice under strict verify: ``WorkerRanked``); plans
                        commit at once (``WorkerCopyEngine``: ORDERED) and the emptied tail blocks
                        go back to vLLM's pool before schedule k+1.

Bridge invariants (asserted every step): for every tracked request the table's block list is a
prefix of vLLM's ``req_to_blocks`` (equal after sync), and the table's length equals vLLM's
``num_computed_tokens`` before sync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from itertools import compress

from vtoken.core.block_pool import Purpose, blocks_needed, blocks_short
from vtoken.core.errors import InvariantViolation
from vtoken.core.plan import PlanKind
from vtoken.core.policies import POLICIES as CORE_POLICIES
from vtoken.core.policies.base import RankedPolicy, RenamedRequests, RequestView
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.token_table import Move

from ..device.copy_engine import packed
from ..fastpath.commits import StepCommits, kept_destinations
from ..fastpath.reads import StepReads, take_step_reads
from . import manager_hooks
from .allocator import VllmBlockAllocator
from .settings import SCORE_POLICIES, VTokenSettings
from .worker_copies import WorkerCopyEngine

READ_CHECK_EVERY = 16  # strict verify: each request's read list is sent whole for the workers to check this often
POLICIES = {"none": None, **CORE_POLICIES}
FAST_POLICIES = ("none", "streaming_llm", "random")  # the policies the fast path chooses victims for


def reclaim_config(settings: VTokenSettings) -> ReclaimConfig | None:
    """EVENT ordering: the workers run a step's copies before its forward (``worker_copies``)."""
    if settings.reclaim == "off":
        return None  # Naive-Evict: tokens are evicted, blocks are never compacted
    if settings.reclaim == "densify":
        return ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT)
    return ReclaimConfig(PlanKind.COMPACT, theta_f=settings.theta_f, max_sources=settings.max_sources,
                         ordering=Ordering.EVENT)

def fast_path_refusal(settings: VTokenSettings) -> str | None:
    """Why this configuration runs on the core's runtime rather than the fast path (``integration/fastpath``), or
    None when the fast path runs it. Its domain today (issues #45, #46): the dense read path, or the gather path
    with reclaim 'compact' or 'off' (Naive-Evict); the policy none, StreamingLLM or Random; no relocation drill;
    numba present with every kernel compiled. Tensor parallelism changes nothing here: one scheduler plans for every
    rank, and the ranks' copy reports are folded before the runtime hears of them (``ShardReports``)."""
    if not settings.fast_path:
        return "fast_path is off: the core's runtime (the reference) runs"
    if settings.read_path == "gather" and settings.reclaim == "densify":
        return "reclaim 'densify' on read_path 'gather' runs on the core's runtime (the fast path's gather path " \
               "compacts, or releases dead blocks with reclaim 'off')"
    if settings.policy not in FAST_POLICIES:
        return f"policy {settings.policy!r} runs on the core's runtime (the fast path covers {list(FAST_POLICIES)})"
    if settings.drill_every:
        return "the relocation drill runs on the core's runtime"
    from vtoken.integration.fastpath import unavailable
    return unavailable()


def writable_blocks(rt: VTokenRuntime, req_id: str, block_size: int) -> list[int]:
    """The blocks of ``req_id`` that appends may still write: the append cursor's block and every one after it,
    O(those blocks). NOTE: vLLM hashes only full blocks it will never write again; none of these may carry a hash
    (B2)."""
    return [rt.block_at(req_id, i) for i in range(rt.write_pos(req_id) // block_size, rt.num_blocks_of(req_id))]


def check_copies_sent(rt: VTokenRuntime, engine: WorkerCopyEngine) -> None:
    """I3 inside vLLM, when a step's reads are built: every copy not yet handed to the workers belongs to a plan
    still in flight. A plan commits in the scheduler before its copy runs (``after_step`` launches and, under
    EVENT, commits at once: the table points at the destinations one step before the workers copy), so a read
    list built from the table while a committed plan's copy is still unsent would send the workers to read
    destinations no worker has written; an aborted plan's unsent copy would write blocks back in vLLM's pool
    (I6). O(unsent copies).

    NOTE: relied on by ``on_schedule``'s order: it takes the outbox (every copy ``after_step`` launched) into
    this step's orders *before* it builds the read lists, and the workers run those copies before they prepare
    the step's inputs. Between ``after_step`` and the next ``on_schedule`` unsent committed copies are normal;
    the check is only meaningful where ``on_schedule`` runs it."""
    in_flight = rt.copies_in_flight()
    for h, r, _ in engine.unsent():
        if h not in in_flight:
            raise InvariantViolation("I3", f"request {r!r}: its plan left flight (committed or aborted) while its "
                                           f"copy {h} has not been sent to the workers: this step would read its "
                                           f"destinations before any worker wrote them")


class CoreDriver(VTokenRuntime):
    """The core's runtime, with the calls ``SchedulerTokens`` makes once per step for all its requests (the fast
    path's ``FastRuntime`` makes each in one kernel call or one gather) as loops over the core's own: the reference.

    NOTE: ``sync_many`` stops at the first refusal, leaving the items before it synced, where the fast path syncs
    all or none; inside vLLM a refusal is a bug that stops the engine either way."""

    def sync_many(self, items) -> list[list[int]]:
        return [self.sync(r, new, total) for r, new, total in items]

    def bridge(self, req_ids) -> tuple[list[int], list[int], list[int]]:
        counts = [self.num_blocks_of(r) for r in req_ids]
        return ([self.total_len(r) for r in req_ids], counts,
                [self.block_at(r, n - 1) if n else -1 for r, n in zip(req_ids, counts)])

    def gaps(self, req_ids) -> list[int]:
        return [self.gap(r) for r in req_ids]

    def read_step(self, req_ids, check: bool) -> StepReads:
        return take_step_reads(self, req_ids, check)

    def take_commits(self) -> StepCommits:
        """``settle``'s committed plans as ``StepCommits`` (the fast path's answer; the drill reads ``settle``)."""
        plans = [rec.plan for rec in self.settle() if rec.state is PlanState.COMMITTED]
        return StepCommits.of_plans(plans, [kept_destinations(self, p) for p in plans])


@dataclass
class StepOrders:
    """What the workers do at the top of step k (travels in ``VTokenMeta``)."""

    copies: list[tuple[int, str, tuple[Move, ...]]] = field(default_factory=list)  # (handle, request, moves)
    layouts: dict[str, list[int]] = field(default_factory=dict)  # block list before this step's new blocks
    gaps: dict[str, int] = field(default_factory=dict)  # logical position - physical position (> 0 only)
    write_slots: dict[str, list[int]] = field(default_factory=dict)  # strict verify: the table's write slots
    reads: StepReads | None = None  # gather, scores: the scheduled requests' read-list changes
    # score policies: request -> (Ranking, its candidates' id bound, protected ids), for each request due to evict
    rank: dict[str, tuple] = field(default_factory=dict)
    rows: bool = False  # strict verify, score policies: the workers send their attention rows too
    forget: list[str] = field(default_factory=list)  # requests that left since the last orders: drop their copies


class WorkerRanked:
    """The runtime's policy when a score policy's scores live on the workers (H2O, Scissorhands inside vLLM).

    At ``on_schedule`` the scheduler sends each request due to evict the policy's ``Ranking`` (O(1) per request);
    after the forward the workers record the step's rows into their ``DeviceScores`` and rank, and their victims
    reach ``victims`` before the runtime asks. This policy answers with them (the runtime's checks of any policy's
    answer still apply: live, unprotected, distinct, within the excess). With ``check`` (strict verify) the rows
    travel as well, the core's ``TokenScores`` record them, and the reference policy must choose the same victims
    in the same order (V4): the core's pure-Python scores stay the oracle of the device's.

    NOTE: a ranking is fixed when it is sent, and only the protected tokens can change before the runtime asks:
    a request that shared the blocks may finish in the same step, and its blocks stop being shared before
    ``after_step``. Protection only shrinks then (nothing is admitted in between), so the workers' victims are still
    unprotected; the reference decides from the protected set the ranking was sent with (found by the vLLM fuzzer:
    a prefix-sharing request finishing in the step that evicts)."""

    def __init__(self, policy: RankedPolicy, names: dict, check: bool) -> None:
        self.ranked = policy
        self.reference = RenamedRequests(policy, names)
        self.check = check
        self.victims: dict[str, list[int]] = {}  # this step's, from the workers
        self.sent: dict[str, frozenset[int]] = {}  # this step's rankings' protected tokens

    @property
    def name(self) -> str:
        return self.ranked.name

    @property
    def statistics(self) -> tuple[str, ...]:
        """What the core's scores record: the reference's statistics under strict verify (the rows and key norms
        travel then), else nothing beyond the two every runtime keeps (no memory for statistics never fed)."""
        return self.ranked.statistics if self.check else ()

    def order(self, view: RequestView) -> tuple:
        """What the workers need to rank ``view``'s request: O(log L), plus the protected ids (dense path, shared
        blocks only)."""
        rank = self.ranked.ranking(view)
        self.sent[view.req_id] = view.protected
        return rank, rank.bound(view), tuple(sorted(view.protected))

    def select_victims(self, view: RequestView) -> list[int]:
        if not view.excess:
            return []
        got = self.victims.pop(view.req_id, None)
        if got is None:
            raise InvariantViolation("V4", f"request {view.req_id!r} is {view.excess} token(s) over its budget, but "
                                           f"the workers ranked no victims for it")
        sent = self.sent.get(view.req_id, view.protected)
        if not view.protected <= sent:
            raise InvariantViolation("V4", f"request {view.req_id!r}: tokens {sorted(view.protected - sent)[:8]} "
                                           f"became protected after its ranking was sent to the workers")
        if self.check:
            want = self.reference.select_victims(view if sent == view.protected else replace(view, protected=sent))
            if got != want:
                raise InvariantViolation("V4", f"request {view.req_id!r}: the workers' scores chose victims {got[:8]}, "
                                               f"the core's {want[:8]} ({self.name}, {len(view.live)} live tokens)")
        return got


@dataclass
class TokenStats:
    steps: int = 0
    evicted: int = 0  # tokens
    plans_committed: int = 0
    plans_aborted: int = 0
    moves: int = 0  # token moves sent to the workers
    blocks_released: int = 0  # blocks committed plans (densify, compact, release) returned to vLLM's pool
    releases: int = 0  # release plans committed (wholly dead blocks, no copy); not in plans_committed
    pressure_steps: int = 0  # steps that ended with vLLM short of blocks (``blocks_short`` > 0)
    packs: int = 0  # densify plans a pressure round committed on the gather path; in plans_committed too
    uncached: int = 0  # blocks whose prefix-cache hash was dropped because densify filled them
    drill_planned: int = 0  # relocate plans (the drill) committed; not in plans_committed, moves, blocks_released
    drill_skipped: int = 0  # shared or prefix-cached blocks the drill must not move, or no free block
    drill_moves: int = 0  # tokens the drill's plans moved
    drill_tail: int = 0  # drill plans that moved the request's last block (the one being written)
    drill_moved: dict = field(default_factory=dict)  # (request, index) -> times the drill moved that block
    copies_done: int = 0
    copies_failed: int = 0
    copies_dropped: int = 0  # planned for a request that left before the workers ran them
    attention_rows: int = 0  # per-request attention rows recorded for score-based policies
    seconds: float = 0.0  # scheduler-side time spent in vtoken


class SchedulerTokens:
    """``capacity``: (vLLM's max_num_seqs, max_model_len), what the fast path's arrays are sized for.
    ``runtime_note`` says which runtime runs and, for the core's, why."""

    def __init__(self, settings: VTokenSettings, kv_cache_manager, block_size: int,
                 capacity: tuple[int, int] = (256, 8192)) -> None:
        [self.manager] = kv_cache_manager.coordinator.single_type_managers  # compat: one KV cache group
        self.settings = settings
        self.block_size = block_size
        pool = kv_cache_manager.block_pool
        reserve = manager_hooks.Reserve(pool, settings.headroom) if settings.headroom else None
        self.allocator = VllmBlockAllocator(pool, block_size, settings.headroom, reserve)
        self.engine = WorkerCopyEngine()
        policy = POLICIES[settings.policy]
        self.read_path = ReadPath(settings.read_path)
        # the name a policy sees (and seeds with): the arrival order, not vLLM's random request ids
        self.policy_names: dict[str, int] = {}
        self.ranked = WorkerRanked(policy(), self.policy_names, settings.strict_verify == "strict") \
            if settings.policy in SCORE_POLICIES else None
        refusal = fast_path_refusal(settings)
        self.fast = refusal is None
        if self.fast:
            from vtoken.integration.fastpath.gather_runtime import GatherRuntime
            from vtoken.integration.fastpath.runtime import FastRuntime
            from vtoken.integration.fastpath.shadow import ShadowedRuntime
            args = (self.allocator, self.engine, policy() if policy else None, settings.budget, *capacity)
            kwargs = dict(evict_every=settings.evict_every, seed=settings.seed, names=self.policy_names)
            gather = self.read_path is ReadPath.GATHER
            if settings.strict_verify == "strict":
                # the core runs beside the fast path on a replay of the pool, compared every call (V6)
                cls = ShadowedRuntime
                self.rt = cls(*args, **kwargs, read_path=self.read_path, config=reclaim_config(settings))
            else:
                cls = GatherRuntime if gather else FastRuntime
                self.rt = cls(*args, reclaim_config(settings), **kwargs) if gather else cls(*args, **kwargs)
            mb = self.rt.table.layout.footprint()["total"] / 2**20
            self.runtime_note = (f"the fast path runs ({cls.__name__}: {capacity[0]} requests x {capacity[1]} tokens, "
                                 f"{mb:.1f} MiB of tables)")
        else:
            self.rt = CoreDriver(self.allocator, self.engine,
                                    self.ranked or (RenamedRequests(policy(), self.policy_names) if policy else None),
                                    settings.budget,
                                    reclaim_config(settings), self.read_path, seed=settings.seed,
                                    ordering=Ordering.EVENT if settings.reclaim == "off" else None,
                                    evict_every=settings.evict_every)
            self.runtime_note = f"the core's runtime runs: {refusal}"
        self.prompt_len: dict[str, int] = {}
        self._decoding: set[str] = set()  # requests whose table holds their whole prompt (after_step asks these)
        self._admitted = 0
        self.first_evicted: dict[str, int] = {}
        # NOTE: each tracked request's gap (> 0 only) as the last ``after_step`` left it, which is what vLLM's
        # allocation hooks read while it schedules the next step: only a commit changes a gap (``sync`` moves the
        # length and the cursor together; the drill's relocation keeps the cursor), and commits happen in
        # ``after_step``. A request admitted since has none. Strict verify's ``check`` compares it with the table's.
        self._gaps: dict[str, int] = {}
        self._layouts: dict[str, list[int]] = {}  # changed by commits since the last step's orders
        self._forgotten: list[str] = []  # requests forgotten since the last step's orders (the workers drop them)
        self._scheduled: set[str] = set()  # score policies: the requests of the step in flight
        self.stats = TokenStats()
        self.scheduler = None  # vLLM's Scheduler, bound by the connector (``bind_scheduler``): pressure reads it
        manager_hooks.install(self.manager, self)

    # ---- what the manager hooks ask ----------------------------------------------------------
    def gap(self, req_id: str) -> int:
        """O(1): vLLM's allocation hooks ask it twice per request and step (``_gaps``' NOTE)."""
        return self._gaps.get(req_id, 0)

    def intact_tokens(self, req_id: str) -> int | None:
        return self.first_evicted.get(req_id)

    def forget(self, req_id: str) -> None:
        """Finish, abort or preemption: vLLM frees the blocks; the table and policy state go."""
        if req_id not in self.rt:
            return
        self.rt.detach(req_id)
        self._decoding.discard(req_id)
        self._forgotten.append(req_id)
        self.stats.copies_dropped += self.engine.drop_request(req_id)
        self._layouts.pop(req_id, None)
        self.first_evicted.pop(req_id, None)
        self._gaps.pop(req_id, None)

    def finished(self, req_id: str) -> None:
        self.forget(req_id)
        self.prompt_len.pop(req_id, None)
        self.policy_names.pop(req_id, None)

    # ---- build_connector_meta ------------------------------------------------------------------
    def on_schedule(self, so, drill_round: int | None = None) -> StepOrders:
        t0 = time.perf_counter()
        rt, cached = self.rt, so.scheduled_cached_reqs
        if drill_round is not None:  # first: its copies and layouts travel in this step's orders
            self._drill(drill_round, [r for r in cached.req_ids if r not in cached.resumed_req_ids and r in rt
                                      and rt.total_len(r) > 0])
        orders = StepOrders(copies=self.engine.take_outbox(), layouts=self._layouts)
        self._layouts = {}
        req_to_blocks = self.manager.req_to_blocks
        reads = self.read_path is ReadPath.GATHER or self.settings.policy in SCORE_POLICIES
        check = self.settings.strict_verify == "strict" and self.stats.steps % READ_CHECK_EVERY == 0
        orders.forget, self._forgotten = self._forgotten, []
        ids, computed = [], []
        for nr in so.scheduled_new_reqs:
            n_prompt = len(nr.prompt_token_ids) if nr.prompt_token_ids is not None else len(nr.prompt_embeds)
            self.prompt_len[nr.req_id] = n_prompt
            self.policy_names[nr.req_id] = self._admitted
            self._admitted += 1
            rt.admit(nr.req_id)
            ids.append(nr.req_id)
            computed.append(nr.num_computed_tokens)
        for r in (cached.req_ids if cached.resumed_req_ids else ()):
            if r in cached.resumed_req_ids:
                if r in rt:
                    raise InvariantViolation("B1", f"resumed request {r!r} still has a token table")
                rt.admit(r)
        ids += cached.req_ids
        computed += cached.num_computed_tokens
        # NOTE: one pass per check over the step's requests (C-level where it can be); the first request that fails
        # either is named, with the check it fails
        totals, known, last = rt.bridge(ids)
        held = list(map(req_to_blocks.__getitem__, ids))
        lengths = list(map(len, held))
        tails = [h[k - 1].block_id if 0 < k <= n else -1 for h, n, k in zip(held, lengths, known)]
        if totals != computed or tails != last or any(map(int.__lt__, lengths, known)):
            for r, total, c, h, n, k, tail, want in zip(ids, totals, computed, held, lengths, known, tails, last):
                # new and resumed requests start empty: a prefix-cache hit arrives as computed tokens in held blocks
                if total != c and total:
                    raise InvariantViolation("B1", f"request {r!r}: vLLM computed {c} tokens, the token table has "
                                                   f"{total}")
                # NOTE: vLLM only appends to a running request's list between steps (after a commit ``_mirror`` makes
                # it the table's), so its last known block pins the prefix in O(1); strict verify's ``check``
                # compares the whole lists after every step
                if n < k or tail != want:
                    raise InvariantViolation("B1", f"request {r!r}: token table blocks {rt.block_ids(r)} are not a "
                                                   f"prefix of vLLM's {[b.block_id for b in h]}")
        ends = map(int.__add__, computed, map(so.num_scheduled_tokens.__getitem__, ids))
        items = [(r, [b.block_id for b in h[k:]] if n > k else [], end)
                 for r, h, n, k, end in zip(ids, held, lengths, known, ends)]
        synced = rt.sync_many(items)
        if not self._decoding.issuperset(ids):  # NOTE: at a steady step every scheduled request is decoding already
            prompt_len = self.prompt_len
            self._decoding.update(r for r, _, total in items if total >= prompt_len[r])
        gaps = self._gaps
        orders.gaps = {r: gaps[r] for r in ids if r in gaps}  # the requests with a gap
        if self.settings.strict_verify == "strict":
            # a prefix hit's tokens are not rewritten
            orders.write_slots = {r: slots[len(slots) - so.num_scheduled_tokens[r]:] for r, slots in zip(ids, synced)}
        if reads:
            orders.reads = rt.read_step(ids, check)
        if self.ranked is not None:
            self._rank_orders(orders, ids)
        if self.settings.strict_verify == "strict":
            check_copies_sent(rt, self.engine)
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - t0
        return orders

    def _rank_orders(self, orders: StepOrders, scheduled: list[str]) -> None:
        """Score policies: each scheduled request ``after_step`` will ask victims of (past its prompt and due by
        the cadence, as it stands after this step's sync; nothing but its protected tokens changes before
        ``after_step``: ``WorkerRanked``), with its ranking.

        NOTE: only this step's requests: a request vLLM did not schedule has no new row, and the workers' copy of
        its read list has not seen its last evictions (they travel with its next step's orders), so it is not
        asked either (``after_step``): its victims wait for its next step."""
        rt = self.rt
        self._scheduled = set(scheduled)
        for r in scheduled:
            if r in self._decoding and rt.eviction_due(r):  # its whole prompt is in (this step's sync)
                orders.rank[r] = self.ranked.order(rt.policy_view(r))
        orders.rows = self.ranked.check

    def _drill(self, round_no: int, req_ids: list[str]) -> None:
        """Relocation drill (test hook): move block ``round_no mod n`` of each request's n blocks to a fresh
        block, through a relocate plan (``VTokenRuntime.relocate_block``: the manager's checks and one-plan rule
        cover it), so every block moves over the rounds, the tail block (still being written) and blocks moved
        twice included. Shared and prefix-cached blocks never move, and nothing moves while vLLM's pool has no
        free block (the drill must not take what a request needs). Under EVENT the plan commits at once."""
        pool = self.allocator.pool
        for r in req_ids:
            blocks = self.rt.block_ids(r)
            i = round_no % len(blocks)
            b = pool.blocks[blocks[i]]
            if b.ref_cnt != 1 or manager_hooks.is_cached(pool, b) or not self.allocator.can_allocate(1, Purpose.EVACUATION) \
                    or not self.rt.relocate_block(r, i):
                self.stats.drill_skipped += 1
                continue
            self.stats.drill_tail += i == len(blocks) - 1
            self.stats.drill_moved[(r, i)] = self.stats.drill_moved.get((r, i), 0) + 1
        for rec in self.rt.settle():
            if rec.state is not PlanState.COMMITTED:
                raise InvariantViolation("I3", f"request {rec.plan.req_id!r}: its drill plan did not commit at once "
                                               f"under EVENT ordering ({rec.state.value}: {rec.abort_reason})")
            self.stats.drill_planned += 1
            self.stats.drill_moves += len(rec.plan.moves)
            self._committed(rec.plan, listed=len(self.rt.block_ids(rec.plan.req_id)))

    # ---- update_connector_output -----------------------------------------------------------
    def on_reports(self, done: list[int], failed: list[int]) -> list[str]:
        """The workers' copy results; returns the requests a failed copy corrupted (to be failed: the plan
        committed when the copy was ordered, so the request's KV is wrong from here on)."""
        self.engine.report_done(done)
        corrupted = []
        for h in failed:
            corrupted.append(self.engine.request_of(h))
            self.engine.report(h, ok=False)
        self.stats.copies_done += len(done)
        self.stats.copies_failed += len(failed)
        return corrupted

    def after_step(self, attention: dict | None = None, ranked: dict | None = None, scored: int = 0,
                   key_norms: dict | None = None, observed: dict | None = None) -> dict[str, list[int]]:
        """Evict and reclaim after a forward. Score policies: ``ranked``, the victims the workers ranked;
        ``scored``, the rows they recorded; ``attention`` and ``key_norms`` (strict verify), those rows and the
        key norms they took, for the core's reference scores. Requests that left meanwhile are dropped. Returns
        each request's victims."""
        t0 = time.perf_counter()
        rt = self.rt
        running = rt.running()
        # whose whole prompt is in (``on_schedule``); NOTE: ``_decoding`` only holds running requests (``forget``)
        decoding = running if len(self._decoding) == len(running) else [r for r in running if r in self._decoding]
        rows = {r: row for r, row in (attention or {}).items() if r in rt}
        keys = {r: norms for r, norms in (key_norms or {}).items() if r in rt}
        votes = {r: given for r, given in (observed or {}).items() if r in rt}
        if self.ranked is not None:
            decoding = [r for r in decoding if r in self._scheduled]  # what was ranked (``_rank_orders``)
            self.ranked.victims = dict(ranked or {})
        rt.set_pressure(self.blocks_short())
        self.stats.pressure_steps += rt.pressure > 0
        victims = rt.evict_and_reclaim(decoding, rows, keys, votes)
        if self.ranked is not None:
            self.ranked.victims, self.ranked.sent = {}, {}
        self.stats.attention_rows += scored
        if self.allocator.pool.enable_caching:  # NOTE: only vLLM's prefix caching asks (``intact_tokens``)
            first = self.first_evicted
            for r, chosen in victims.items():
                low = min(chosen)
                if low < first.get(r, low + 1):
                    first[r] = low
        self.stats.evicted += sum(map(len, victims.values()))
        commits = rt.take_commits()  # EVENT ordering: ORDERED copies commit at once
        self.stats.releases += commits.releases
        self.stats.plans_committed += commits.plans
        self.stats.packs += commits.densified if self.read_path is ReadPath.GATHER else 0
        self.stats.moves += commits.moves
        self.stats.blocks_released += commits.blocks_released
        # NOTE: a densify that released nothing leaves vLLM's block list as it is; with prefix caching every plan's
        # written blocks lose their hashes (``_drop_stale_hashes``)
        for plan in commits.touched(everything=self.allocator.pool.enable_caching):
            self._committed(plan)
        # every abort, whichever path made it (a refused launch, a failed copy, a request that left mid-copy)
        self.stats.plans_aborted = sum(rt.reclaim_stats.plans_aborted.values())
        gaps = rt.gaps(running)
        self._gaps = dict(compress(zip(running, gaps), gaps))
        self.stats.seconds += time.perf_counter() - t0
        return victims

    def blocks_short(self) -> int:
        """The engine's pressure (``block_pool.blocks_short``, the simulator's rule) as vLLM's scheduler stands after
        a step: its running requests, and when a request waits and a seat is free, the blocks its tokens need (a
        preempted one recomputes them all; prefix-cache hits are not counted off). 0 before the connector binds
        the scheduler."""
        s, a = self.scheduler, self.allocator
        if s is None:
            return 0
        waiting = blocks_needed(s.waiting.peek_request().num_tokens, self.block_size) \
            if s.waiting and len(s.running) < s.max_num_running_reqs else 0
        return blocks_short(len(s.running), waiting, a.num_free, a.headroom)

    def _drop_stale_hashes(self, r: str, plan) -> int:
        """B2 after a commit: no block the request may still write keeps a prefix-cache hash.

        vLLM hashes a block once it is full, as if it held logical tokens [i*S, (i+1)*S) forever. A commit breaks
        that in two places: a move's destination receives another token's K/V, and densify's new cursor
        (n_live) usually lies inside a block vLLM hashed when it filled, whose tail the next appends overwrite.
        Either block, left hashed, would be served to a later request whose prompt matches the chain, with
        another request's K/V in it (issue #15). So every destination and every block from the cursor's block
        on loses its hash before vLLM can schedule again. None of them may be shared: the planners never
        write a shared block (``plan_densify``: SHARED_BLOCK), and this is where that is relied on.

        NOTE: without prefix caching vLLM hashes no block and shares none (a block is shared only by a prefix hit),
        so there is nothing to drop or refuse: O(1) then (strict verify's ``check`` still asserts B2 every step)."""
        pool = self.allocator.pool
        if not pool.enable_caching:
            return 0
        written = set(packed(plan.moves)[3::5]) | set(writable_blocks(self.rt, r, self.block_size))  # destinations
        shared = sorted(b for b in written if pool.blocks[b].ref_cnt > 1)
        if shared:
            raise InvariantViolation("B2", f"request {r!r}: committed plan writes shared block(s) {shared}")
        return manager_hooks.uncache(pool, written)

    def uncache_request(self, r: str) -> int:
        """Quarantine: the request's K/V is unverified from the failed copy on, and so is everything computed from
        it (the step's new tokens, every layer above the first), possibly in blocks vLLM hashed this step. None of
        its private blocks may serve a prefix hit; shared ones it never wrote. Returns the hashes dropped."""
        pool = self.allocator.pool
        private = [b.block_id for b in self.manager.req_to_blocks.get(r, []) if not b.is_null and b.ref_cnt == 1]
        return manager_hooks.uncache(pool, private)

    def _committed(self, plan, listed: int | None = None) -> None:
        """After a commit: vLLM's block list for the request becomes the table's, and B2 holds again.
        ``listed``: how many blocks the table listed before the commit (default: all vLLM holds)."""
        if plan.kind is PlanKind.DENSIFY and listed is None:
            self._cut(plan.req_id, plan)
        else:
            self._mirror(plan.req_id, listed)
        self.stats.uncached += self._drop_stale_hashes(plan.req_id, plan)

    def _cut(self, r: str, plan) -> None:
        """``_mirror`` after a densify commit, O(released blocks). Densify moves tokens within the request's own
        blocks and releases the ones after those it keeps up to its cursor's block; when those are vLLM's last ones
        (nothing allocated past them) the table's list is vLLM's cut to its length (vLLM's held the table's before
        the commit, B1), which the released blocks in place and the last kept one confirm (strict verify's ``check``
        compares the whole lists after every step); otherwise ``_mirror`` rewrites the list. Nothing released,
        nothing changes for vLLM or the workers (the copy rewrites slots inside blocks they already map)."""
        if not plan.src_blocks:
            return
        held, rt = self.manager.req_to_blocks[r], self.rt
        n = rt.num_blocks_of(r)
        if len(held) != n + len(plan.src_blocks) \
                or any(held[i].block_id != b for i, b in enumerate(plan.src_blocks, n)):
            return self._mirror(r, None)
        if n and held[n - 1].block_id != rt.block_at(r, n - 1):
            raise InvariantViolation("B1", f"request {r!r}: after densify the token table lists {n} blocks ending "
                                           f"{rt.block_ids(r)[-1:]}, released {list(plan.src_blocks)}; vLLM holds "
                                           f"{[b.block_id for b in held]}")
        del held[n:]
        self._layouts[r] = rt.block_ids(r)

    def _mirror(self, r: str, listed: int | None) -> None:
        """Make vLLM's block list for ``r`` the table's, after a commit. The table's list before the commit is
        a prefix of vLLM's (B1): all of it after a step, all but this step's new blocks before sync (the drill,
        whose relocate plan keeps the list's length). That prefix is replaced: densify drops tail blocks,
        compact swaps in destinations, relocate one."""
        held = self.manager.req_to_blocks[r]
        blocks = self.rt.block_ids(r)
        pool = self.allocator.pool
        if not all(pool.blocks[b].ref_cnt >= 1 for b in blocks):
            raise InvariantViolation("B1", f"request {r!r}: table lists a free block")
        held[:len(held) if listed is None else listed] = [pool.blocks[b] for b in blocks]
        self._layouts[r] = list(blocks)

    # ---- observability ---------------------------------------------------------------------------
    def metrics(self, workers) -> dict:
        """Counters since the previous call (``metrics.COUNTERS``) and current gauges (``metrics.GAUGES``)."""
        s, w = self.stats, workers
        now = {"tokens_evicted": s.evicted, "plans_committed": s.plans_committed, "plans_aborted": s.plans_aborted,
               "releases": s.releases, "pressure_steps": s.pressure_steps, "packs": s.packs,
               "tokens_moved": s.moves, "blocks_released": s.blocks_released, "copies_verified": w.verified,
               "mismatches": w.mismatches, "quarantined": w.quarantined, "write_slots_audited": w.audited,
               "seconds": s.seconds, "worker_seconds": w.seconds}
        last, self._reported = getattr(self, "_reported", {}), now
        out = {k: v - last.get(k, 0) for k, v in now.items()}
        retained, ideal = self.retained_vs_ideal()
        out.update(waste_ratio=self.rt.waste_ratio(), retained_blocks=retained, ideal_blocks=ideal)
        return out

    def retained_vs_ideal(self) -> tuple[int, int]:
        """Blocks the tracked requests hold, and the ideal ceil(live / S) summed over them."""
        return self.rt.retained_vs_ideal()

    def check(self, pool: bool = True, requests=None) -> None:
        """Under strict verify, after every step: the bridge (vLLM's block lists are the tables', B1), the dense
        prefix (I7) and B2 (no block a request may still write is prefix-cached or shared), O(blocks held). With
        ``pool``, also P1 over vLLM's whole pool, O(pool size); with ``requests`` (the scheduler's
        ``requests``: id -> vLLM ``Request``), also B3 over every prefix-cached block a request holds."""
        t, blocks = self.rt, self.allocator.pool.blocks
        stale = {r: (g, t.gap(r) if r in t else "untracked") for r, g in self._gaps.items()
                 if r not in t or g != t.gap(r)}
        stale.update((r, (0, t.gap(r))) for r in t.running() if r not in self._gaps and t.gap(r))
        if stale:
            raise InvariantViolation("B1", f"the gaps vLLM's allocation hooks read, against the token tables': "
                                           f"{dict(list(stale.items())[:8])}")
        for r in t.running():
            held = [b.block_id for b in self.manager.req_to_blocks.get(r, [])]
            if held != t.block_ids(r):
                raise InvariantViolation("B1", f"request {r!r}: vLLM holds blocks {held}, its token table {t.block_ids(r)}")
            # the dense path protects the tokens of the blocks the table lists as shared (``_protected``'s NOTE):
            # every block vLLM counts twice must be one of them
            unlisted = sorted({b for b in held if blocks[b].ref_cnt > 1} - set(t.shared_blocks(r)))
            if unlisted:
                raise InvariantViolation("B1", f"request {r!r}: vLLM shares its blocks {unlisted}, which its token "
                                               f"table does not list as shared")
            if self.read_path is ReadPath.DENSE and t.write_pos(r) != t.num_live(r):
                raise InvariantViolation("I7", f"request {r!r}: {t.num_live(r)} live tokens but cursor {t.write_pos(r)}")
            for b in writable_blocks(t, r, self.block_size):
                if manager_hooks.is_cached(self.allocator.pool, blocks[b]) or blocks[b].ref_cnt > 1:
                    raise InvariantViolation("B2", f"request {r!r}: block {b} at or after its append cursor "
                                                   f"(position {t.write_pos(r)}) is "
                                                   f"{'shared' if blocks[b].ref_cnt > 1 else 'prefix-cached'}; "
                                                   f"the next appends would overwrite what another request reads")
            if requests is not None and r in requests:
                self.check_prefix_hashes(r, requests[r])
        if pool:
            self.allocator.check()

    def check_prefix_hashes(self, r: str, request) -> None:
        """B3: every prefix-cached block of ``r`` is what vLLM's hash chain claims. A block with the request's chain
        hash j means "holds the K/V of logical tokens [j*S, (j+1)*S) of this chain, each written at its own
        position", so: its hash is one of the request's own chain hashes (``request.block_hashes``), no two blocks
        carry the same one, and every live token of ``r`` in it is the logical token of its offset (a relocation
        never leaves a token of another position in a hashed block). Holes are fine: eviction leaves a dead
        token's K/V in place. O(S) per hashed block.

        NOTE: j is the chain index, not the block's index in the request's list: on the gather path a commit
        releases sparse source blocks, so a hashed block after them moves down the list (its content stays)."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        t, S, pool = self.rt, self.block_size, self.allocator.pool
        if pool.hash_block_size != S:
            return  # hashes at another granularity: not a configuration vtoken runs (compat)
        chain = {make_block_hash_with_group_id(h, 0): j for j, h in enumerate(request.block_hashes)}
        counts, seen = t.block_live_counts(r), {}
        for i, b in enumerate(t.block_ids(r)):
            blk = pool.blocks[b]
            if blk.block_hash is None:
                continue
            j = chain.get(blk.block_hash)
            if j is None:
                raise InvariantViolation("B3", f"request {r!r}: block {b} at index {i} carries a prefix-cache hash "
                                               f"that is not in the request's hash chain")
            if j in seen:
                raise InvariantViolation("B3", f"request {r!r}: blocks {seen[j]} and {b} both carry the request's "
                                               f"chain hash {j}")
            seen[j] = b
            live_here = counts[b]
            in_place = sum(t.slot_of(r, j * S + o) == b * S + o for o in range(S) if j * S + o < t.total_len(r))
            if in_place != live_here:
                raise InvariantViolation("B3", f"request {r!r}: prefix-cached block {b} (chain block {j}) holds "
                                               f"{live_here - in_place} live token(s) of other positions than "
                                               f"[{j * S}, {(j + 1) * S})")
