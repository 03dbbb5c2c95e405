"""Issue #46, part 1: the gather path's compaction kernels (``integration/fastpath/gather_kernels.py``) are the core's.

A Hypothesis state machine drives the same operations into the core (a ``TokenTable`` with a real
``ReclamationManager`` over a ``BlockPool`` and an in-memory copy engine, its V3 self-check on) and into a
``FastTable`` with ``FastGather`` below, a thin adapter that plans and commits through the kernels over the fast
table's layout with its own ``BlockPool``: syncs with fresh blocks, shared prefix blocks, prefix-cached blocks,
evictions (also while a plan is in flight), compact plans at random ``max_sources``, with and without packing, at
the pools' destination budget (random headroom) and, through the gate and the fill alone, at random budgets,
Naive-Evict's release plans, commits (the manager's launch and settle), tampered commits (a stale version, a
mismatched source, a source left live, ...), ``TokenTable.remove_blocks`` (refused or not) and removals; a compact
plan is tried when the trigger says so (both sides' ``should_reclaim`` at a random theta_F, cadence K and burst
threshold: the same answer, F, burst state and counts), and so is a round without packing (``plan_round``: the
requests in a drawn order, most excess first, at most ``max_plans_per_round``), and a pressure round that packs
(``plan_round(pack=True)``, on the trigger or forced as the runtime's pressure forces it, with evicted positions
taken from the real evictions since each request's last layout change, or none): most excess then most holes first,
compact with prefix-cached blocks, else a DENSIFY plan (``plan_pack``, also planned alone) left in flight across
syncs (stale: aborted), evictions (their moves dropped) and other plans, committed at a settle or tampered with
(a stale version or length, a moved cursor, a source list that is not the tail, ...). After every
operation: the same candidates, the same
gate answer (NoPlan reason and detail), the same plans (moves in order, sources, destinations), the same commit
outcome (committed, aborted, or the same error class and message), the same released blocks (both pools equal),
every request's state (``TokenTable.state()``'s shape), the fast table's recounted views (``check_views``) and the
manager's counts (``ReclaimStats``: plans made, packs, NoPlans by reason, commits, aborts by reason, moves committed
and dropped, blocks released, ...).
Then every refusal of a commit reached on purpose from one crafted plan (``COMPACT_CASES``, ``RELEASE_CASES``,
``DENSIFY_CASES``), and
one place where the core's commit stops half-way and the kernel does not (a move's offset outside its block:
``test_a_move_offset_outside_its_block_is_refused_before_anything_changes``). The planted-bug tests at the end patch
one kernel each (and one the round's tie order) and show the machine catches it: among them a pack that breaks
logical order, a densify commit that leaves the cursor where it was, and a stale densify plan committed.

Deterministic: the machine runs derandomized (Hypothesis' seed is fixed by the test's name).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

pytest.importorskip("numba")

from vtoken.core.block_pool import BlockPool, Purpose  # noqa: E402
from vtoken.core.compact import choose_ranked, compact_plan  # noqa: E402
from vtoken.core.errors import InvariantViolation, VTokenError  # noqa: E402
from vtoken.core.plan import Plan, PlanKind  # noqa: E402
from vtoken.core.reclamation import ReclaimConfig, ReclamationManager  # noqa: E402
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore  # noqa: E402
from vtoken.core.token_table import TokenTable  # noqa: E402
from vtoken.fuzz.fast_target import GATHER_KERNEL_BUGS, ROUND_BY_ROW  # noqa: E402
from vtoken.integration.fastpath import gather_kernels as G  # noqa: E402
from vtoken.integration.fastpath.gather import ABORTED, COMMITTED, FastGather  # noqa: E402
from vtoken.integration.fastpath.table import FastTable  # noqa: E402

NUM_BLOCKS, S, ROWS, TOKENS = 40, 4, 5, 48
STALE_REASON = "layout changed since the snapshot (I4)"


def outcome(call):
    """A call's answer, or its refusal as (class, message)."""
    try:
        return call()
    except (VTokenError, InvariantViolation) as e:
        return type(e), str(e)


def same_plan(got, want) -> None:
    if not want:
        assert not got and (got.reason, got.detail) == (want.reason, want.detail), (got, want)
    else:
        assert got == want and tuple(got.moves) == tuple(want.moves), (got, want)


THEN = ("settle", "settle", "tamper", "wait")
# NOTE: "stale" twice: a densify plan goes stale two ways (its layout version, or its length: an append)
TAMPERS = ("stale", "stale", "src_offset", "drop_move", "dup_dst", "dst_is_source", "reversed_sources",
           "token_out_of_range", "dst_of_another", "move_twice", "dst_past_cursor", "dst_in_own_block",
           "release_a_live_block", "cursor", "swap_dsts", "src_outside_pool")
TARGETS = ("any", "any", "plan", "pack")  # which request an append or an eviction goes to (``Lockstep.busy``)


class Lockstep(RuleBasedStateMachine):
    @initialize(data=st.data(), headroom=st.sampled_from([0, 1, 2, 5]), theta=st.sampled_from([0.0, 0.1, 0.3]),
                check_every=st.integers(1, 3), burst_df=st.sampled_from([None, 0.02, 0.1]),
                max_plans=st.integers(1, 3))
    def first(self, data, headroom, theta, check_every, burst_df, max_plans):
        self.core = TokenTable(NUM_BLOCKS, S)
        self.cpool = BlockPool(NUM_BLOCKS, S, headroom)
        config = ReclaimConfig(theta_f=theta, check_every=check_every, burst_df=burst_df,
                               max_plans_per_round=max_plans)
        self.mgr = ReclamationManager(self.cpool, self.core, InMemoryCopyEngine(TagStore(NUM_BLOCKS, S)), config)
        self.mgr.verify_fast_paths = True  # the core's own V3: its maintained path against its reference planner
        self.fast = FastTable(NUM_BLOCKS, S, ROWS, TOKENS)
        self.gather = FastGather(self.fast, BlockPool(NUM_BLOCKS, S, headroom), config)
        self.next_id = 0
        self.iteration = 0
        self.holes: dict = {}  # request -> (layout version, positions evicted since it became that version)
        for _ in range(data.draw(st.integers(1, 3), label="requests")):  # a few requests, holey: material to compact
            self.admit()
            r = self.next_id - 1
            total = data.draw(st.integers(0, TOKENS - S), label="tokens")
            new = self.allocate(-(-total // S))
            if new is None:
                continue
            assert self.fast.sync_new_tokens(r, new, total) == self.core.sync_new_tokens(r, new, total)
            if total:
                ids = data.draw(st.sets(st.integers(0, total - 1), max_size=total), label="evicted")
                positions = self.core.evict_tokens(r, sorted(ids))
                assert self.fast.evict_tokens(r, sorted(ids)) == positions
                self.evicted(r, positions)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def pick(self, data, among=None):
        ids = self.core.request_ids() if among is None else among
        return data.draw(st.sampled_from(sorted(ids)), label="request")

    def idle(self) -> list:
        return [r for r in self.core.request_ids() if r not in self.mgr.inflight]

    def evicted(self, r, positions: list[int]) -> None:
        """Remember where the request's evictions were since its last layout change: all of them still holes (only a
        move fills a hole, and a move changes the layout version)."""
        version = self.core.layout_version(r)
        before = self.holes.get(r)
        self.holes[r] = (version, (before[1] if before and before[0] == version else []) + list(positions))

    def evicted_positions(self, data, ids) -> dict:
        """The step's evicted positions for some of ``ids``: where their evictions since the last layout change were
        (every hole made since, so that a request dense before them plans in O(evicted)), or their last part."""
        out = {}
        for r in ids:
            version, positions = self.holes.get(r, (None, []))
            if version == self.core.layout_version(r) and data.draw(st.integers(0, 3), label="positions given"):
                out[r] = positions[-data.draw(st.integers(1, max(1, len(positions))), label="last"):] \
                    if positions and not data.draw(st.integers(0, 3), label="all") else list(positions)
        return out

    def allocate(self, n: int) -> list[int] | None:
        if not self.cpool.can_allocate(n, Purpose.ADMISSION):
            return None
        new = self.cpool.allocate(n, Purpose.ADMISSION)
        assert self.gather.pool.allocate(n, Purpose.ADMISSION) == new
        return new

    # ---- the table's operations ---------------------------------------------------------------------------------
    @precondition(lambda self: len(self.core.request_ids()) < ROWS)
    @rule()
    def admit(self):
        r = self.next_id
        self.next_id += 1
        self.core.add_request(r)
        self.fast.add_request(r)

    def busy(self, target: str, among=None) -> list | None:
        """The requests (of ``among``, default all) with a plan in flight (``goes_to`` "plan") or a pack in flight
        ("pack"), if there are any; else None (any request)."""
        ids = self.core.request_ids() if among is None else among
        busy = [r for r in ids if r in self.mgr.inflight and (
            target == "plan" or target == "pack" and self.mgr.inflight[r].plan.kind is PlanKind.DENSIFY)]
        return busy or None

    @rule(data=st.data(), n=st.integers(0, 3 * S), ahead=st.integers(0, 1), goes_to=st.sampled_from(TARGETS))
    def sync(self, data, n, ahead, goes_to):
        """Tokens appended (and blocks, ``ahead``: one more than they need); ``goes_to``: to a request with a plan (a
        pack) in flight if there is one (a pack goes stale)."""
        r = self.pick(data, self.busy(goes_to))
        if r in self.mgr.inflight and n:
            event(f"appended while a {self.mgr.inflight[r].plan.kind.value} plan is in flight")
        total = self.core.total_len(r) + n
        nb = self.core.num_blocks_of(r)
        need = max(-(-(self.core.write_pos(r) + n) // S) - nb, 0) + ahead
        if total > TOKENS or nb + need > -(-TOKENS // S) + 1:
            return
        new = self.allocate(need)
        if new is None:
            return
        assert self.fast.sync_new_tokens(r, new, total) == self.core.sync_new_tokens(r, new, total)

    @precondition(lambda self: len(self.core.request_ids()) < ROWS)
    @rule(data=st.data(), extra=st.integers(0, S + 1))
    def share_a_prefix(self, data, extra):
        """A new request whose first blocks are full blocks of another's list (a prefix-cache hit)."""
        holders = [h for h in self.core.request_ids() if self.core.write_pos(h) >= S]
        if not holders:
            return
        holder = self.pick(data, holders)
        k = data.draw(st.integers(1, min(3, self.core.write_pos(holder) // S)), label="shared blocks")
        rec = self.mgr.inflight.get(holder)
        if rec is not None and rec.plan.kind is PlanKind.DENSIFY and (
                rec.plan.dense_write_pos < k * S or set(self.core.block_ids(holder)[:k]) & (
                    set(rec.plan.src_blocks) | {b for m in rec.plan.moves for b in (m.src_block, m.dst_block)})):
            # NOTE: the runtime's admit refuses this share (PlanConflictError): the pack in flight writes a hole of a
            # prefix block, which the new request's tokens fill, and the commit is refused (an InvariantViolation)
            event("share refused: a pack in flight writes the prefix")
            return
        fresh = self.allocate(-(-extra // S))
        if fresh is None:
            return
        prefix = self.core.block_ids(holder)[:k]
        for b in prefix:
            self.cpool.share(b)
            self.gather.pool.share(b)
        r = self.next_id
        self.admit()
        blocks, total = prefix + fresh, k * S + extra
        want = outcome(lambda: self.core.sync_new_tokens(r, blocks, total))
        assert outcome(lambda: self.fast.sync_new_tokens(r, blocks, total)) == want
        if isinstance(want, tuple):  # refused (a holder's cursor went back over the block): the references go back
            self.cpool.free(blocks)
            self.gather.pool.free(blocks)
        event(f"shared a prefix{' (refused)' if isinstance(want, tuple) else ''}")

    @rule(data=st.data())
    def cache_a_block(self, data):
        """A block becomes prefix-cached: compaction leaves it in place unless it packs."""
        held = [b for b in range(NUM_BLOCKS) if self.cpool.ref_count(b)]
        if held:
            b = data.draw(st.sampled_from(held), label="cached")
            self.cpool.cache(b)
            self.gather.pool.cache(b)

    @rule(data=st.data(), goes_to=st.sampled_from(TARGETS))
    def evict(self, data, goes_to):
        """Some live tokens of a request die (``goes_to``: of one with a plan, or a pack, in flight if there is one)."""
        live = [r for r in self.core.request_ids() if self.core.num_live(r)]
        live = self.busy(goes_to, live) or live
        if not live:
            return
        r = self.pick(data, live)
        ids = data.draw(st.lists(st.sampled_from(self.core.live_token_ids(r)), min_size=1, max_size=3 * S,
                                 unique=True), label="victims")
        positions = self.core.evict_tokens(r, ids)
        assert self.fast.evict_tokens(r, ids) == positions
        self.evicted(r, positions)
        if r in self.mgr.inflight:
            event(f"evicted while a {self.mgr.inflight[r].plan.kind.value} plan is in flight")

    @precondition(lambda self: len(self.core.request_ids()) > 2)
    @rule(data=st.data())
    def remove(self, data):
        r = self.pick(data)
        blocks = self.core.remove_request(r)
        assert self.fast.remove_request(r) == blocks
        self.mgr.on_request_removed(r, blocks)
        self.gather.on_request_removed(r, blocks)

    # ---- compaction ---------------------------------------------------------------------------------------------
    @rule(data=st.data(), max_sources=st.integers(1, 6), pack=st.booleans(), then=st.sampled_from(THEN))
    def plan_compact(self, data, max_sources, pack, then):
        """The manager's compact plan (``plan_request``) at the pool's destination budget, when the trigger's waste
        ratio is over theta (both sides read the same F); ``then``: settled at once, a tampered commit, or left in
        flight."""
        if not self.trigger() or not self.idle():
            return
        r = self.pick(data, self.idle())
        movable = self.mgr._private if pack else self.mgr._movable
        assert self.gather.candidates(r, max_sources, pack) == self.core.compact_candidates(r, max_sources, movable)
        assert self.gather.destination_budget() == self.mgr.destination_budget()
        self.mgr.config = self.gather.config = dataclasses.replace(self.mgr.config, max_sources=max_sources)
        want = self.mgr.plan_request(r, pack=pack)
        got = self.gather.plan_compact(r, max_sources, pack)
        same_plan(got, want.plan if want else want)
        event(f"compact: {want.reason.name if not want else 'planned'}")
        if want:
            self.then(data, r, then)

    def trigger(self) -> bool:
        """The next iteration's trigger, both sides (their F, burst state and counts equal)."""
        assert self.gather.waste_ratio() == self.mgr.waste_ratio()
        self.iteration += 1
        due = self.mgr.should_reclaim(self.iteration)
        assert self.gather.should_reclaim(self.iteration) == due
        assert (self.gather.burst, self.gather.stats.bursts, self.gather.stats.burst_rounds) == \
            (self.mgr.burst, self.mgr.stats.bursts, self.mgr.stats.burst_rounds)
        return due

    @rule(data=st.data(), then=st.sampled_from(THEN))
    def plan_round(self, data, then):
        """A round without packing when the trigger says so: the requests in a drawn order, most excess first (ties
        in that order), at most ``max_plans_per_round`` plans; the same plans in the same order."""
        if not self.trigger():
            return
        ids = data.draw(st.permutations(self.core.request_ids()), label="order")
        want = [rec.plan for rec in self.mgr.plan_round(ids)]
        got = self.gather.plan_round(ids)
        assert len(got) == len(want) and self.gather.burst == self.mgr.burst
        for g, w in zip(got, want):
            same_plan(g, w)
        assert self.gather.stats.rounds == self.mgr.stats.rounds
        event(f"round: {len(want)} plan(s)")
        if want and then == "settle":
            self.settle()

    @rule(data=st.data(), forced=st.booleans(), then=st.sampled_from(THEN))
    def pack_round(self, data, forced, then):
        """The pressure round (``plan_round(pack=True)``): when the trigger says so, or forced as the runtime's
        pressure forces a round whatever F says (``pressure_rounds``, counted on both sides as the runtime counts
        it). Most excess, then most holes before the cursor first; compact with cached blocks too, else densify in
        place with the step's evicted positions; the same plans in the same order. ``then``: settled, one of its
        plans tampered with, or left in flight."""
        due = self.trigger()
        if not due and not forced:
            return
        self.mgr.stats.pressure_rounds += not due
        self.gather.stats.pressure_rounds += not due
        ids = data.draw(st.permutations(self.core.request_ids()), label="order")
        evicted = self.evicted_positions(data, ids)
        want = [rec.plan for rec in self.mgr.plan_round(ids, pack=True, evicted_positions=evicted)]
        got = self.gather.plan_round(ids, pack=True, evicted_positions=evicted)
        assert len(got) == len(want) and self.gather.burst == self.mgr.burst
        for g, w in zip(got, want):
            same_plan(g, w)
        packs = sum(p.kind is PlanKind.DENSIFY for p in want)
        event(f"pack round: {len(want)} plan(s), {packs} pack(s)")
        if want and then == "settle":
            self.settle()
        elif want and then == "tamper":
            r = data.draw(st.sampled_from([p.req_id for p in want]), label="tampered")
            self.tampered_commit(data, data.draw(st.sampled_from(TAMPERS), label="tamper"), r)

    @rule(data=st.data(), then=st.sampled_from(THEN))
    def plan_pack(self, data, then):
        """``plan_pack`` of one request (densify in place, recorded in flight), with the step's evicted positions or
        without: the same plan or NoPlan (reason and detail: ALREADY_DENSE, SHARED_BLOCK naming every shared block
        it would touch)."""
        if not self.idle():
            return
        r = self.pick(data, self.idle())
        positions = self.evicted_positions(data, [r]).get(r)
        c = self.core
        tail = positions is not None and len(positions) == c.write_pos(r) - c.num_live(r) \
            and c.append_run_start(r) <= c.num_live(r)  # the core plans from them alone (``_densify_tail``)
        want = self.mgr.plan_pack(r, positions)
        got = self.gather.plan_pack(r, positions)
        same_plan(got, want.plan if want else want)
        event(f"pack: {want.reason.name if not want else 'planned'}"
              f"{'' if positions is None else ' (the O(evicted) search)' if tail else ' (evicted positions given)'}")
        if want:
            self.then(data, r, then)

    def then(self, data, r, then: str) -> None:
        if then == "settle":
            self.settle()
        elif then == "tamper":
            self.tampered_commit(data, data.draw(st.sampled_from(TAMPERS), label="tamper"), r)

    @rule(data=st.data(), max_sources=st.integers(1, 6), pack=st.booleans(), budget=st.integers(0, 5))
    def gate_and_fill(self, data, max_sources, pack, budget):
        """The gate at a random destination budget, then the fill into free block ids; nothing changes."""
        r = self.pick(data)
        movable = self.mgr._private if pack else self.mgr._movable
        ranked = self.core.compact_candidates(r, max_sources, movable)
        assert self.gather.candidates(r, max_sources, pack) == ranked
        want = choose_ranked(r, ranked, lambda i: self.core.block_at(r, i), S, budget)
        got = self.gather.choose(r, max_sources, pack, budget)
        assert got == want
        event(f"gate: {want.reason.name if not want else 'chosen'}")
        free = self.cpool.free_block_ids()
        if want and len(free) >= want.num_dst:
            dsts = data.draw(st.permutations(free), label="destinations")[:want.num_dst]
            version = (self.core.layout_version(r), self.core.total_len(r))
            plan = compact_plan(r, version, S, want, self.core.live_in_blocks(r, want.src_blocks), dsts)
            same_plan(self.gather.fill(r, got, dsts), plan)

    @rule(data=st.data(), use_among=st.booleans(), then=st.sampled_from(THEN))
    def plan_release(self, data, use_among, then):
        """Naive-Evict: the wholly dead private blocks (``plan_release``), among some list indices or all."""
        if not self.idle():
            return
        r = self.pick(data, self.idle())
        n = self.core.num_blocks_of(r)
        among = data.draw(st.lists(st.integers(-1, n + 1), max_size=n + 2), label="among") if use_among else None
        want = self.mgr.plan_release(r, among)
        got = self.gather.plan_release(r, among)
        same_plan(got, want.plan if want else want)
        event(f"release: {'planned' if want else 'none'}")
        if want:
            self.then(data, r, then)

    @rule()
    def settle(self):
        """The manager's launch and settle: every plan in flight commits (its copy is done), in order."""
        self.mgr.launch()
        kinds = {r: rec.plan.kind.value for r, rec in self.mgr.inflight.items()}
        dropped = self.mgr.stats.moves_dropped
        want = outcome(lambda: [(rec.plan.req_id, rec.state.value) for rec in self.mgr.settle()])
        assert outcome(self.gather.settle) == want
        for r, state in want:
            event(f"settled a {kinds[r]} plan: {state}")
        if self.mgr.stats.moves_dropped > dropped:
            event("settled with moves dropped (tokens evicted in flight)")

    @rule(data=st.data(), kind=st.sampled_from(TAMPERS), goes_to=st.sampled_from(TARGETS))
    def tampered_commit(self, data, kind, r=None, goes_to="plan"):
        """A plan in flight (``goes_to`` "pack": a densify plan, if one is in flight) committed after one field was
        changed: the same commit, abort or refusal (class and message) on both sides; a refused plan is put back as
        it was."""
        ids = self.busy("pack" if goes_to == "pack" else "plan")
        if not ids:
            return
        r = self.pick(data, ids) if r is None else r
        rec = self.mgr.inflight[r]
        original, theirs = rec.plan, self.gather.inflight[r]
        bad = self.tamper(data, original, kind)
        if bad is None:
            return
        rec.plan, self.gather.inflight[r] = bad, bad
        want = outcome(lambda: self.mgr._commit(rec) or rec.state.value)
        got = outcome(lambda: self.gather.commit(r))
        assert got == want
        assert want != ABORTED or rec.abort_reason == STALE_REASON
        if r in self.mgr.inflight:
            rec.plan, self.gather.inflight[r] = original, theirs
        event(f"tampered {bad.kind.value} {kind}: {want if isinstance(want, str) else want[0].__name__}")

    def tamper(self, data, plan: Plan, kind: str) -> Plan | None:
        moves, r = list(plan.moves), plan.req_id
        blocks = self.core.block_ids(r)
        change = dataclasses.replace
        dense = plan.kind is PlanKind.DENSIFY
        if kind == "stale":
            step = data.draw(st.sampled_from([-1, 1]))
            if dense and data.draw(st.booleans(), label="appended"):  # densify is stale once the request appends
                return change(plan, version=(plan.version[0], plan.version[1] + step))
            return change(plan, version=(plan.version[0] + step, plan.version[1]))
        if kind == "cursor":  # densify's cursor after commit (= n_live when planned)
            if not dense:
                return None
            return change(plan, dense_write_pos=plan.dense_write_pos + data.draw(st.sampled_from([-S, -1, 1, S])))
        if kind == "release_a_live_block":
            live = [b for b in blocks if self.core.block_live_counts(r)[b] and b not in plan.src_blocks]
            if not live:
                return None
            src = sorted(plan.src_blocks + (data.draw(st.sampled_from(live)),), key=blocks.index)
            return change(plan, src_blocks=tuple(src))
        if kind == "src_outside_pool":  # the first id past the pool, or -1 (the gather kernels' mutation run)
            if not plan.src_blocks:
                return None
            j = data.draw(st.integers(0, len(plan.src_blocks) - 1), label="source")
            src = list(plan.src_blocks)
            src[j] = data.draw(st.sampled_from([NUM_BLOCKS, -1]), label="block")
            return change(plan, src_blocks=tuple(src))
        if kind == "reversed_sources":
            return change(plan, src_blocks=plan.src_blocks[::-1]) if len(plan.src_blocks) > 1 else None
        if not moves:
            return None
        j = data.draw(st.integers(0, len(moves) - 1), label="move")
        m = moves[j]
        if kind == "src_offset":
            moves[j] = m._replace(src_offset=(m.src_offset + data.draw(st.integers(1, S - 1))) % S)
        elif kind == "drop_move":
            del moves[j]
        elif kind == "dup_dst":
            if len(moves) < 2:
                return None
            k = data.draw(st.integers(0, len(moves) - 1).filter(lambda k: k != j), label="other")
            moves[k] = moves[k]._replace(dst_block=m.dst_block, dst_offset=m.dst_offset)
        elif kind == "dst_is_source" and dense:  # into a block it releases
            if not plan.src_blocks:
                return None
            moves[j] = m._replace(dst_block=data.draw(st.sampled_from(plan.src_blocks)),
                                  dst_offset=data.draw(st.integers(0, S - 1)))
        elif kind == "dst_is_source":
            src = data.draw(st.sampled_from(plan.src_blocks))
            moves = [x._replace(dst_block=src) if x.dst_block == m.dst_block else x for x in moves]
            return change(plan, moves=tuple(moves),
                          dst_blocks=tuple(src if b == m.dst_block else b for b in plan.dst_blocks))
        elif kind == "token_out_of_range":
            moves[j] = m._replace(token_id=data.draw(st.sampled_from([-1, self.core.total_len(r)])))
        elif kind == "dst_of_another":
            if not self.core.is_live(r, m.token_id):
                return None  # NOTE: unreceiving, it would be freed as unused: the core frees another's block then
            others = [b for o in self.core.request_ids() if o != r for b in self.core.block_ids(o) if b not in blocks]
            if not others:
                return None
            b = data.draw(st.sampled_from(others))
            moves = [x._replace(dst_block=b) if x.dst_block == m.dst_block else x for x in moves]
            return change(plan, moves=tuple(moves),
                          dst_blocks=tuple(b if d == m.dst_block else d for d in plan.dst_blocks))
        elif kind == "move_twice":
            moves.append(m._replace(dst_offset=(m.dst_offset + 1) % S))
        elif kind == "swap_dsts":  # the tokens land out of logical order: no check refuses it
            if len(moves) < 2:
                return None
            k = data.draw(st.integers(0, len(moves) - 1).filter(lambda k: k != j), label="other")
            a, b = moves[j], moves[k]
            moves[j] = a._replace(dst_block=b.dst_block, dst_offset=b.dst_offset)
            moves[k] = b._replace(dst_block=a.dst_block, dst_offset=a.dst_offset)
        elif kind == "dst_past_cursor":
            pos = self.core.write_pos(r)
            if pos // S >= len(blocks):
                return None
            moves[j] = m._replace(dst_block=blocks[pos // S], dst_offset=data.draw(st.integers(pos % S, S - 1)))
        elif kind == "dst_in_own_block":  # a hole of a block the request keeps: may be a valid commit
            holes = [(b, o) for i, b in enumerate(blocks[:self.core.write_pos(r) // S]) if b not in plan.src_blocks
                     for o in range(S) if not self.core.block_mask(r, b) >> o & 1]
            if not holes:
                return None
            b, o = data.draw(st.sampled_from(holes))
            moves[j] = m._replace(dst_block=b, dst_offset=o)
        return change(plan, moves=tuple(moves))

    @rule(data=st.data())
    def remove_blocks(self, data):
        """``TokenTable.remove_blocks`` of random indices at a random cursor (refused or not, as the core's)."""
        idle = self.idle()
        if not idle:
            return
        r = self.pick(data, idle)
        n, pos = self.core.num_blocks_of(r), self.core.write_pos(r)
        dead = [i for i, b in enumerate(self.core.block_ids(r)) if not self.core.block_mask(r, b)]
        indices = data.draw(st.one_of(st.lists(st.sampled_from(dead), unique=True).map(sorted) if dead else st.just([]),
                                      st.lists(st.integers(-1, n), max_size=3)), label="indices")
        write_pos = data.draw(st.sampled_from([pos - len(indices) * S, pos, pos - S, n * S + 1]), label="cursor")
        want = outcome(lambda: self.core.remove_blocks(r, indices, write_pos))
        got = outcome(lambda: self.gather.remove_blocks(r, indices, write_pos))
        if want is None:  # removed: the blocks go back to both pools
            removed = got
            assert isinstance(removed, list)
            self.cpool.free(removed)
            self.gather.pool.free(removed)
            event("removed blocks")
        else:
            assert got == want
            event(f"remove_blocks refused: {want[0].__name__}")

    # ---- after every operation --------------------------------------------------------------------------------
    @invariant()
    def same_state(self):
        if not hasattr(self, "core"):
            return
        assert self.fast.state() == self.core.state()
        for r in self.core.request_ids():
            assert self.fast.block_live_counts(r) == self.core.block_live_counts(r)
        assert self.gather.pool.snapshot() == self.cpool.snapshot()
        assert list(self.gather.inflight) == list(self.mgr.inflight)
        for r, rec in self.mgr.inflight.items():
            assert self.gather.inflight[r] == rec.plan
        assert self.gather.stats == self.mgr.stats, (self.gather.stats, self.mgr.stats)
        self.fast.check_views()


Lockstep.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None, derandomize=True,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestLockstep = Lockstep.TestCase


# ---- every refusal of a commit, reached on purpose: the same answer as the core's ------------------------------------
class Sides:
    """The core (a table, a pool and a manager) beside the fast table and ``FastGather`` with a pool of its own."""

    def __init__(self, headroom: int = 0) -> None:
        self.core, self.cpool = TokenTable(NUM_BLOCKS, S), BlockPool(NUM_BLOCKS, S, headroom)
        self.mgr = ReclamationManager(self.cpool, self.core, InMemoryCopyEngine(TagStore(NUM_BLOCKS, S)),
                                      ReclaimConfig(max_sources=8))
        self.mgr.verify_fast_paths = True
        self.fast = FastTable(NUM_BLOCKS, S, ROWS, TOKENS)
        self.gather = FastGather(self.fast, BlockPool(NUM_BLOCKS, S, headroom))

    def request(self, r, total: int, ahead: int = 0, evicted=()) -> list[int]:
        self.core.add_request(r)
        self.fast.add_request(r)
        n = -(-total // S) + ahead
        blocks = self.cpool.allocate(n, Purpose.ADMISSION)
        assert self.gather.pool.allocate(n, Purpose.ADMISSION) == blocks
        assert self.fast.sync_new_tokens(r, blocks, total) == self.core.sync_new_tokens(r, blocks, total)
        self.evict(r, evicted)
        return blocks

    def evict(self, r, ids) -> None:
        assert self.fast.evict_tokens(r, list(ids)) == self.core.evict_tokens(r, list(ids))

    def plan(self, r, release: bool = False) -> Plan:
        want = self.mgr.plan_release(r) if release else self.mgr.plan_request(r)
        got = self.gather.plan_release(r) if release else self.gather.plan_compact(r, 8, False)
        assert want and got == want.plan
        return want.plan

    def pack(self, r, evicted=None) -> Plan:
        want, got = self.mgr.plan_pack(r, evicted), self.gather.plan_pack(r, evicted)
        assert want and got == want.plan and tuple(got.moves) == tuple(want.plan.moves)
        return want.plan

    def commit(self, r, plan: Plan):
        """Both sides commit ``plan`` in place of the request's plan in flight; equal answers, equal states."""
        rec = self.mgr.inflight[r]
        rec.plan = self.gather.inflight[r] = plan
        want = outcome(lambda: self.mgr._commit(rec) or rec.state.value)
        got = outcome(lambda: self.gather.commit(r))
        assert got == want
        assert self.fast.state() == self.core.state() and self.gather.pool.snapshot() == self.cpool.snapshot()
        assert self.gather.stats == self.mgr.stats
        self.fast.check_views()
        return want


def _compact_case():
    """Request 0: 18 tokens in blocks [0, 4] and block 5 listed (4 and 5: cursor and ahead), blocks 0-2 one live token
    each (3, 7, 11); request 1 lists blocks 6-7. The plan moves 3, 7, 11 into block 8."""
    sides = Sides()
    sides.request(0, 18, ahead=1, evicted=[0, 1, 2, 4, 5, 6, 8, 9, 10])
    sides.request(1, 8)
    plan = sides.plan(0)
    assert plan.src_blocks == (0, 1, 2) and plan.dst_blocks == (8,) and [m.token_id for m in plan.moves] == [3, 7, 11]
    return sides, plan


def _moves(plan: Plan, j: int, **fields) -> tuple:
    moves = list(plan.moves)
    moves[j] = moves[j]._replace(**fields)
    return tuple(moves)


_change = dataclasses.replace
COMPACT_CASES = {  # a change of the plan -> what the core answers (a fragment of it) [, tokens evicted in flight]
    "as planned": (lambda p: p, COMMITTED),
    "stale": (lambda p: _change(p, version=(p.version[0] + 1, p.version[1])), ABORTED),
    "token out of range": (lambda p: _change(p, moves=_moves(p, 1, token_id=18)), "outside its synced tokens"),
    "sources out of order": (lambda p: _change(p, src_blocks=(1, 0, 2)), "are not in its block list, in order"),
    # the first id past the pool, and -1 (the gather kernels' mutation run: a bound check of ``listed``)
    "a source past the pool": (lambda p: _change(p, src_blocks=(0, 1, NUM_BLOCKS)), "are not in its block list"),
    "a source below the pool": (lambda p: _change(p, src_blocks=(-1, 1, 2)), "are not in its block list"),
    "a destination listed here": (lambda p: _change(p, moves=tuple(m._replace(dst_block=0) for m in p.moves),
                                                    dst_blocks=(0,)), "repeats a block or names one outside"),
    "a destination listed by another": (lambda p: dataclasses.replace(
        p, moves=tuple(m._replace(dst_block=6) for m in p.moves), dst_blocks=(6,)), "block 6 cannot join"),
    "a mismatched source": (lambda p: _change(p, moves=_moves(p, 0, src_offset=2)), "reads a slot token 3"),
    "past the staged cursor": (lambda p: _change(p, moves=_moves(p, 0, dst_block=4, dst_offset=2)),
                               "at or after its cursor 22"),
    "a slot written twice": (lambda p: _change(p, moves=_moves(p, 2, dst_offset=0)), "which is claimed"),
    "a live slot written": (lambda p: _change(p, moves=_moves(p, 0, dst_block=3, dst_offset=0)),
                            "writes slot 12, which is claimed"),
    "a token moved twice": (lambda p: _change(p, moves=p.moves + (p.moves[0]._replace(dst_offset=3),)),
                            "a token moves twice"),
    "a source left live": (lambda p: _change(p, moves=p.moves[:2]), "block 2 holds live tokens"),
    "a source written": (lambda p: _change(p, moves=_moves(p, 0, dst_block=0, dst_offset=0)),
                         "block 0 holds live tokens"),
    "into a hole of a kept block": (lambda p: _change(p, moves=_moves(p, 2, dst_block=3, dst_offset=1)),
                                    COMMITTED, [13]),
    "into the hole of a token evicted in flight": (lambda p: _change(p, moves=_moves(p, 0, dst_block=1,
                                                                                                 dst_offset=3)),
                                                   "block 1 holds live tokens", [7]),
}


def _commit_changed(sides, plan, change, expected, *evicted) -> None:
    """Commit request 0's plan in flight changed by ``change`` (after evicting ``evicted[0]`` while its copy ran, if
    given): the outcome is ``expected`` on both sides, or a refusal whose message holds it, which changed nothing."""
    if evicted:
        sides.evict(0, evicted[0])
    before = sides.fast.state()
    got = sides.commit(0, change(plan))
    if isinstance(got, tuple):
        assert expected in got[1], got
        assert sides.fast.state() == before
    else:
        assert got == expected, got


@pytest.mark.parametrize("case", sorted(COMPACT_CASES))
def test_a_changed_compact_plan_commits_as_the_cores(case):
    """Each of ``_check_compact_commit``'s refusals (and the abort of a stale plan) reached on purpose, from a
    compact plan in flight changed in one field: the fast side answers with the core's outcome, error class and
    message, and a refusal changes nothing on either side."""
    _commit_changed(*_compact_case(), *COMPACT_CASES[case])


def test_a_destination_freed_twice_is_refused_as_the_core_refuses_it():
    """Every token of the plan evicted in flight: no destination is kept, so a plan whose destination is its own
    source would free that block twice (the pool's references, checked after the kernel's checks)."""
    sides, plan = _compact_case()
    sides.evict(0, [3, 7, 11])
    bad = dataclasses.replace(plan, moves=tuple(m._replace(dst_block=0) for m in plan.moves), dst_blocks=(0,))
    got = sides.commit(0, bad)
    assert got[0] is InvariantViolation and "block 0 would be freed 2 time(s) with 1 reference(s)" in got[1]
    assert sides.commit(0, plan) == COMMITTED  # the plan as made: nothing moves, its destination goes back
    assert sides.core.block_ids(0) == [3, 4, 5] and sides.cpool.ref_count(8) == 0


def test_a_commit_after_appends_and_evictions_in_flight_is_the_cores():
    """Tokens appended (a new block) and one moving token evicted while the copy ran: the move is dropped, the
    cursor shifts by whole blocks from where the appends left it."""
    sides, plan = _compact_case()
    new = sides.cpool.allocate(1, Purpose.ADMISSION)
    assert sides.gather.pool.allocate(1, Purpose.ADMISSION) == new
    total = sides.core.total_len(0) + 6
    assert sides.fast.sync_new_tokens(0, new, total) == sides.core.sync_new_tokens(0, new, total)
    sides.evict(0, [7])
    assert sides.commit(0, plan) == COMMITTED
    assert sides.core.block_ids(0) == [8, 3, 4, 5, new[0]] and sides.core.write_pos(0) == 24 - 8


RELEASE_CASES = {
    "as planned": (lambda p: p, COMMITTED),
    "a live block released": (lambda p: _change(p, src_blocks=p.src_blocks + (1,)), "block 1 holds live"),
    "the cursor's block released": (lambda p: _change(p, src_blocks=p.src_blocks + (2,)),
                                     "would hold live tokens at or after cursor 2"),
    "the cursor's and the ahead block released": (lambda p: _change(p, src_blocks=(0, 2, 3)),
                                                  "cursor -2 outside its 1 blocks"),
}


@pytest.mark.parametrize("case", sorted(RELEASE_CASES))
def test_a_changed_release_plan_commits_as_the_cores(case):
    """Naive-Evict's plan (block 0 wholly dead, before the cursor's block 2) and changes of it: the same outcome."""
    sides = Sides()
    sides.request(0, 10, ahead=1, evicted=[0, 1, 2, 3, 8, 9])
    plan = sides.plan(0, release=True)
    assert plan.src_blocks == (0,)
    change, expected = RELEASE_CASES[case]
    got = sides.commit(0, change(plan))
    assert (expected in got[1]) if isinstance(got, tuple) else got == expected, got


def _densify_case():
    """Request 0: 14 tokens in blocks [0, 3] and block 4 ahead, tokens 1, 2, 5 evicted (n_live 11, cursor 14);
    request 1 lists blocks 5-6. The pack moves 11 (block 2, offset 3), 12 and 13 (block 3) into the holes 1, 2, 5 and
    releases block 3: its list becomes [0, 1, 2, 4], its cursor 11."""
    sides = Sides()
    sides.request(0, 14, ahead=1, evicted=[1, 2, 5])
    sides.request(1, 8)
    plan = sides.pack(0)
    assert plan.kind is PlanKind.DENSIFY and plan.src_blocks == (3,) and plan.dense_write_pos == 11
    assert [tuple(m) for m in plan.moves] == [(11, 2, 3, 0, 1), (12, 3, 0, 0, 2), (13, 3, 1, 1, 1)]
    return sides, plan


DENSIFY_CASES = {  # a change of the plan -> what the core answers (a fragment of it) [, tokens evicted in flight]
    "as planned": (lambda p: p, COMMITTED),
    "stale": (lambda p: _change(p, version=(p.version[0] + 1, p.version[1])), ABORTED),
    "appended": (lambda p: _change(p, version=(p.version[0], p.version[1] - 1)), ABORTED),
    "token out of range": (lambda p: _change(p, moves=_moves(p, 1, token_id=14)), "outside its synced tokens"),
    "a mismatched source": (lambda p: _change(p, moves=_moves(p, 0, src_offset=2)), "reads a slot token 11"),
    "into another's block": (lambda p: _change(p, moves=_moves(p, 0, dst_block=5)),
                             "writes outside the block list or at or after its cursor 14"),
    "past the cursor": (lambda p: _change(p, moves=_moves(p, 0, dst_block=3, dst_offset=2)), "its cursor 14"),
    "into the block ahead": (lambda p: _change(p, moves=_moves(p, 0, dst_block=4, dst_offset=0)), "its cursor 14"),
    "a slot written twice": (lambda p: _change(p, moves=_moves(p, 2, dst_block=0, dst_offset=1)),
                             "writes slot 1, which is claimed"),
    "a live slot written": (lambda p: _change(p, moves=_moves(p, 0, dst_offset=0)), "writes slot 0, which is claimed"),
    "a token moved twice": (lambda p: _change(p, moves=p.moves + (p.moves[0]._replace(dst_block=3, dst_offset=1),)),
                            "a token moves twice"),
    "a source left live": (lambda p: _change(p, moves=p.moves[::2]),
                           "block 3 holds live tokens but would leave block list [0, 1, 2, 4]"),
    "a source written": (lambda p: _change(p, moves=_moves(p, 0, dst_block=3, dst_offset=0)),
                         "block 3 holds live tokens but would leave"),
    "a token left at the cursor": (lambda p: _change(p, moves=p.moves[1:]),
                                   "block 2 would hold live tokens at or after cursor 11"),
    "the cursor one lower": (lambda p: _change(p, dense_write_pos=10),
                             "block 2 would hold live tokens at or after cursor 10"),
    "the cursor a block lower": (lambda p: _change(p, dense_write_pos=7),
                                 "its sources [3] are not blocks [2, 3) of the list"),
    "the cursor a block higher": (lambda p: _change(p, dense_write_pos=15),
                                  "its sources [3] are not blocks [4, 5) of the list"),
    "the cursor outside": (lambda p: _change(p, dense_write_pos=17), "cursor 17 outside its 4 blocks"),
    "a negative cursor": (lambda p: _change(p, dense_write_pos=-1), "cursor -1 outside its 4 blocks"),
    "sources not the tail": (lambda p: _change(p, src_blocks=(2,)), "its sources [2] are not blocks [3, 4)"),
    "the empty block ahead released too": (lambda p: _change(p, src_blocks=(3, 4)), COMMITTED),
    "a block past the tail released": (lambda p: _change(p, src_blocks=(4,)), "its sources [4] are not blocks [3, 4)"),
    "out of logical order": (lambda p: _change(p, moves=tuple(m._replace(dst_block=d.dst_block, dst_offset=d.dst_offset)
                                                              for m, d in zip(p.moves, p.moves[::-1]))), COMMITTED),
    "a mover evicted in flight": (lambda p: p, COMMITTED, [12]),
    "every mover evicted in flight": (lambda p: p, COMMITTED, [11, 12, 13]),
    "into the hole of a token evicted in flight": (lambda p: _change(p, moves=_moves(p, 2, dst_block=1, dst_offset=0)),
                                                   COMMITTED, [4]),
}


@pytest.mark.parametrize("case", sorted(DENSIFY_CASES))
def test_a_changed_densify_plan_commits_as_the_cores(case):
    """Each of ``_check_densify_commit``'s refusals (and the abort of a stale pack) reached on purpose, from the
    pressure round's densify plan in flight changed in one field: the fast side answers with the core's outcome,
    error class and message, and a refusal changes nothing on either side (the counts included)."""
    sides, plan = _densify_case()
    _commit_changed(sides, plan, *DENSIFY_CASES[case])
    if case == "as planned":
        assert sides.core.block_ids(0) == [0, 1, 2, 4] and sides.core.write_pos(0) == 11
        assert sides.cpool.ref_count(3) == 0 and sides.gather.stats.blocks_released == 1
    if case == "every mover evicted in flight":
        assert sides.gather.stats.moves_dropped == 3 and sides.core.write_pos(0) == 11


def test_a_pack_goes_stale_when_the_request_appends():
    """Tokens appended while the pack is in flight: the plan is stale (it would leave them past the cursor), aborted
    on both sides, nothing written; the pack after moves the new tokens too (13 live: no block to release)."""
    sides, plan = _densify_case()
    total = sides.core.total_len(0) + 2
    assert sides.fast.sync_new_tokens(0, [], total) == sides.core.sync_new_tokens(0, [], total)
    assert sides.commit(0, plan) == ABORTED
    assert sides.gather.stats.plans_aborted == {"layout changed since the snapshot (I4)": 1}
    again = sides.pack(0)
    assert again.version == (plan.version[0], 16) and again.src_blocks == () and again.dense_write_pos == 13
    assert [m.token_id for m in again.moves] == [13, 14, 15]
    assert sides.commit(0, again) == COMMITTED and sides.core.write_pos(0) == 13


def test_a_pack_whose_released_block_lost_its_reference_is_refused():
    """The tail block freed behind the table's back while the pack is in flight: the last check of
    ``_check_densify_commit`` (the pool's references, read between the kernel's check and its commit) refuses it,
    nothing changed."""
    sides, plan = _densify_case()
    sides.cpool.free([3])
    sides.gather.pool.free([3])
    before = sides.fast.state()
    got = sides.commit(0, plan)
    assert got[0] is InvariantViolation and "block 3 would be freed with 0 reference(s)" in got[1], got
    assert sides.fast.state() == before


def test_a_pack_with_the_steps_evicted_positions_is_the_full_search():
    """A request dense before this step's evictions: the pack reads its holes from the evicted positions
    (``_densify_tail``, O(evicted); the core's V3 compares it with the full search) and plans the same moves; a
    shared block it would touch is named in the NoPlan, as the core names it."""
    sides = Sides()
    sides.request(0, 13)
    positions = sides.core.evict_tokens(0, [2, 6])
    assert sides.fast.evict_tokens(0, [2, 6]) == positions == [2, 6]
    plan = sides.pack(0, positions)
    assert [tuple(m) for m in plan.moves] == [(11, 2, 3, 0, 2), (12, 3, 0, 1, 2)] and plan.src_blocks == (3,)
    assert sides.commit(0, plan) == COMMITTED
    sides.cpool.share(1)
    sides.gather.pool.share(1)
    positions = sides.core.evict_tokens(0, [5])
    assert sides.fast.evict_tokens(0, [5]) == positions
    want, got = sides.mgr.plan_pack(0, positions), sides.gather.plan_pack(0, positions)
    assert not want and (got.reason, got.detail) == (want.reason, want.detail) == (want.reason, "request 0: blocks [1]")


@pytest.mark.parametrize("field", ["src", "dst"])
def test_a_move_offset_outside_its_block_is_refused_before_anything_changes(field):
    """A move naming offset S + 3 of block b - 1 for slot (b, 3) (source), or offset 5 of a destination: both refuse
    it, the same message, nothing changed. Regression: the core's ``_check_commit_moves`` compared slot numbers
    only, so its commit spliced the destinations in and then ``apply_moves`` refused the offset, a commit stopped
    half-way (an InvariantViolation's promise, "nothing was changed", broken); found by this lockstep."""
    sides, plan = _compact_case()
    bad = dataclasses.replace(plan, moves=_moves(plan, 1, src_block=0, src_offset=7) if field == "src"
                              else _moves(plan, 1, dst_offset=5))
    rec = sides.mgr.inflight[0]
    rec.plan = sides.gather.inflight[0] = bad
    before = sides.fast.state()
    got = outcome(lambda: sides.gather.commit(0))
    assert got[0] is InvariantViolation and sides.fast.state() == before == sides.core.state()
    assert ("reads a slot token 7 does not hold" if field == "src" else "at or after its cursor 22") in got[1]
    want = outcome(lambda: sides.mgr._commit(rec))
    assert want == got and sides.core.state() == before


# ---- planted kernel bugs: the lockstep catches each (defined beside the fast fuzz target, whose --self-test plants
# them too) -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bug", sorted(GATHER_KERNEL_BUGS))
def test_a_planted_kernel_bug_is_caught(monkeypatch, bug):
    kernel, plant = GATHER_KERNEL_BUGS[bug]
    monkeypatch.setattr(G, kernel, plant(getattr(G, kernel)))
    if kernel in ROUND_BY_ROW:  # the round's batched kernel through the planted one
        monkeypatch.setattr(G, *ROUND_BY_ROW[kernel])
    with pytest.raises(AssertionError):
        # no shrinking: finding the bug is the claim, and the first failing example says where
        run_state_machine_as_test(Lockstep, settings=settings(max_examples=300, stateful_step_count=60, deadline=None,
                                                               derandomize=True, phases=(Phase.generate,),
                                                               suppress_health_check=list(HealthCheck)))


def test_a_round_that_breaks_ties_against_the_given_order_is_caught(monkeypatch):
    """Planted in the round (Python, not a kernel): requests of equal excess (packing: and equal holes) planned in
    reverse order, so with ``max_plans_per_round`` reached, one plan's destinations taking another's budget, or two
    plans made, the plans differ."""
    real = FastGather.plan_round
    monkeypatch.setattr(FastGather, "plan_round",
                        lambda self, req_ids, *args, **kwargs: real(self, list(req_ids)[::-1], *args, **kwargs))
    with pytest.raises(AssertionError):
        run_state_machine_as_test(Lockstep, settings=settings(max_examples=300, stateful_step_count=60, deadline=None,
                                                               derandomize=True, phases=(Phase.generate,),
                                                               suppress_health_check=list(HealthCheck)))
