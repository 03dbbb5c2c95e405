"""Planted bugs: realistic mistakes the fuzzer must catch (``vtoken fuzz --self-test``).

Each bug replaces one function or method of the core with a copy that has
the mistake, for the duration of a ``with planted(name):`` block. The
self-test runs each in its own process, so nothing leaks between bugs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

from vtoken.core import block_pool, compact, densify, live_index, reclamation, runtime, scores, token_table
from vtoken.core.sim import inmemory
from vtoken.core.block_pool import blocks_needed
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.policies.h2o import H2O
from vtoken.core.policies.streaming_llm import StreamingLLM
from vtoken.core.plan import Plan, PlanKind
from vtoken.core.reclamation import PlanState
from vtoken.core.reference import compact as reference_compact
from vtoken.core.token_table import NO_SLOT, Move


@dataclass(frozen=True)
class PlantedBug:
    name: str
    description: str
    patches: Callable[[], dict]  # (object, attribute) -> replacement, built lazily


def _compact_fill_off_by_one():
    def compact_plan(req_id, version, S, choice, tokens, dst_blocks):
        dsts = tuple(dst_blocks[: choice.num_dst])
        moves = tuple(  # enumerate from 1: the fill starts one slot late and overflows a full destination
            Move(t, s // S, s % S, dsts[min(i // S, len(dsts) - 1)], i % S if i // S < len(dsts) else 0)
            for i, (t, s) in enumerate(tokens, start=1)
        )
        return Plan(PlanKind.COMPACT, req_id, version, moves, choice.src_blocks, dsts)

    # NOTE: the fill is compact.compact_plan, for the manager's maintained path and the snapshot reference alike
    return {(reclamation, "compact_plan"): compact_plan, (compact, "compact_plan"): compact_plan,
            (reference_compact, "compact_plan"): compact_plan}


def _eligible_includes_append_block():
    def eligible_sources(snap):
        S = snap.block_size
        cursor_block = snap.write_pos // S
        idx = [i for i in range(min(cursor_block + 1, len(snap.blocks)))  # off by one: the append block too
               if snap.blocks[i] not in snap.shared_blocks and snap.live_count(i) < S]
        return sorted(idx, key=lambda i: (snap.live_count(i), i))

    def compact_candidates(self, req_id, max_sources, private):  # the maintained path, off by the same one
        r, S = self._get(req_id), self.block_size
        end = min(r.write_pos // S + 1, len(r.blocks))
        ranked = sorted((r.counts[i], i) for i in range(end) if r.counts[i] < S and private(r.blocks[i]))
        return [(i, c) for c, i in ranked[:max_sources]]

    return {(reference_compact, "eligible_sources"): eligible_sources,
            (token_table.TokenTable, "compact_candidates"): compact_candidates}


def _free_sources_before_copy():
    def on_request_removed(self, req_id, blocks):
        rec = self.inflight.pop(req_id, None)
        self.pool.free(blocks)  # frees the sources a pending copy still reads
        if rec is not None:
            rec.state = PlanState.ABORTED
            if rec.handle is not None and not self.engine.poll(rec.handle).settled:
                rec.held = rec.plan.dst_blocks
                self.orphans.append(rec)
            else:
                self._release_handle(rec)
                self.pool.free(rec.plan.dst_blocks)

    return {(reclamation.ReclamationManager, "on_request_removed"): on_request_removed}


def _double_free_after_preemption():
    original = reclamation.ReclamationManager.on_request_removed

    def on_request_removed(self, req_id, blocks):
        rec = self.inflight.get(req_id)
        original(self, req_id, blocks)
        if rec is not None and rec in self.orphans:  # "make sure" the sources go back... twice
            self.pool.free([b for b in rec.held if b in blocks])

    return {(reclamation.ReclamationManager, "on_request_removed"): on_request_removed}


def _free_destination_of_pending_copy():
    original = reclamation.ReclamationManager.on_request_removed

    def on_request_removed(self, req_id, blocks):
        rec = self.inflight.get(req_id)
        original(self, req_id, blocks)
        if rec is not None and rec in self.orphans and rec.plan.dst_blocks:
            self.pool.free(rec.plan.dst_blocks)  # the copy can still write them
            rec.held = tuple(b for b in rec.held if b not in rec.plan.dst_blocks)

    return {(reclamation.ReclamationManager, "on_request_removed"): on_request_removed}


def _resurrect_evicted_mid_copy():
    original = reclamation.ReclamationManager._commit

    def _commit(self, rec):
        plan, t, S = rec.plan, self.table, self.pool.block_size
        dead = [m for m in plan.moves if not t.is_live(plan.req_id, m.token_id)]
        original(self, rec)
        if rec.state is not PlanState.COMMITTED:
            return
        r = t._requests[plan.req_id]
        for m in dead:  # "its data was copied, so restore it"
            slot = m.dst_block * S + m.dst_offset
            if t.index_in_list(plan.req_id, m.dst_block) is not None and not t.occupancy.holders(slot):
                r.slots[m.token_id] = slot
                if m.dst_block in r.shared:
                    r.shared[m.dst_block] |= 1 << m.dst_offset
                t.occupancy.claim(slot)
                r.num_live += 1

    return {(reclamation.ReclamationManager, "_commit"): _commit}


def _forget_live_count_decrement():
    original = token_table.TokenTable.evict_tokens

    def evict_tokens(self, req_id, token_ids):
        slots = [self.slot_of(req_id, t) for t in token_ids]
        positions = original(self, req_id, token_ids)
        for slot in slots:  # NOTE: the block's live count keeps the token (for a private block it is the request's count, T1)
            self.occupancy._block_live[slot // self.block_size] += 1
        return positions

    return {(token_table.TokenTable, "evict_tokens"): evict_tokens}


def _relocate_shared_block():
    def snapshot(self, req_id, shared_blocks=()):
        return original(self, req_id, ())  # forgets which blocks are shared

    original = token_table.TokenTable.snapshot
    return {(token_table.TokenTable, "snapshot"): snapshot,
            (reclamation.ReclamationManager, "_private"): lambda self, b: True,  # the maintained path too
            (reclamation.ReclamationManager, "_movable"): lambda self, b: True}


def _two_plans_per_request():
    original = reclamation.ReclamationManager.plan_request

    def plan_request(self, req_id, evicted_positions=None, pack=False):
        held = self.inflight.pop(req_id, None)  # no I4 check: a second plan replaces the first
        try:
            return original(self, req_id, evicted_positions, pack)
        finally:
            if held is not None and req_id not in self.inflight:
                self.inflight[req_id] = held

    return {(reclamation.ReclamationManager, "plan_request"): plan_request}


def _non_strict_decrease():
    def choose_ranked(req_id, ranked, block_at, S, dst_budget):
        chosen = list(ranked)
        if not chosen:
            return compact.NoPlan(compact.NoPlanReason.NO_CANDIDATES)
        live = sum(n for _, n in chosen)
        while chosen and -(-live // S) > dst_budget:
            live -= chosen.pop()[1]
        if not chosen:
            return compact.NoPlan(compact.NoPlanReason.NOT_ENOUGH_HEADROOM)
        num_dst = -(-live // S)
        if num_dst > len(chosen):  # should be >=: equal counts free nothing
            return compact.NoPlan(compact.NoPlanReason.NO_STRICT_DECREASE)
        return compact.SourceChoice(tuple(block_at(i) for i in sorted(i for i, _ in chosen)), live, num_dst)

    return {(compact, "choose_ranked"): choose_ranked, (reclamation, "choose_ranked"): choose_ranked,
            (reference_compact, "choose_ranked"): choose_ranked}


def _admission_consumes_headroom():
    def can_allocate(self, n, purpose):
        return 0 <= n <= len(self._free)  # forgets the reserve for admission

    return {(block_pool.BlockPool, "can_allocate"): can_allocate}


def _densify_leaves_a_hole():
    original = densify.plan_densify

    def plan_densify(snap):
        plan = original(snap)
        if not plan or len(plan.moves) < 2:
            return plan
        return Plan(plan.kind, plan.req_id, plan.version, plan.moves[:-1], plan.src_blocks, (), plan.dense_write_pos)

    return {(reclamation, "plan_densify"): plan_densify}


def _apply_moves_half_applied():
    original = token_table.TokenTable.apply_moves

    def apply_moves(self, req_id, moves):
        batch = [Move(*m) for m in moves]
        if len(batch) > 1:  # applies the first move before validating the rest
            try:
                original(self, req_id, batch[:1])
            except Exception:
                pass
            return original(self, req_id, batch[1:])
        return original(self, req_id, batch)

    return {(token_table.TokenTable, "apply_moves"): apply_moves}


def _commit_pending_copy():
    original = reclamation.ReclamationManager._status

    def _status(self, rec):
        status = original(self, rec)
        return CopyStatus.DONE if status is CopyStatus.PENDING and rec.state is PlanState.COPYING else status

    return {(reclamation.ReclamationManager, "_status"): _status}


def _occupancy_leak_on_remove():
    def remove_request(self, req_id):
        r = self._get(req_id)
        del self._requests[req_id]  # forgets to release the request's slots
        return list(r.blocks)

    return {(token_table.TokenTable, "remove_request"): remove_request}


def _cursor_shift_forgets_destinations():
    def compact_cursor(self, write_pos, block_size, dst_blocks=None):
        return max(0, write_pos - len(self.src_blocks) * block_size)  # forgets + len(dsts) * S

    return {(Plan, "compact_cursor"): compact_cursor}


def _state_before_submit():
    def launch(self):
        for rec in list(self.inflight.values()):
            if rec.state is not PlanState.PLANNED:
                continue
            rec.state = PlanState.COPYING  # before submit: a refused launch leaves it COPYING with no handle
            if not rec.plan.moves:
                continue
            try:
                rec.handle = self.engine.submit(rec.plan.moves, req_id=rec.plan.req_id)
            except Exception:
                continue  # "keep serving": settle then reads the handle-less plan as DONE and commits it
            if self.config.ordering is reclamation.Ordering.EVENT:
                self.engine.order_before_compute(rec.handle)
            elif self.config.ordering is reclamation.Ordering.FORCE_SYNC:
                self.engine.wait(rec.handle)
        return []

    return {(reclamation.ReclamationManager, "launch"): launch}


def _no_pre_attention_wait():
    from vtoken.core.sim import inmemory

    def before_compute(self):
        pass  # the forward no longer waits for ordered copies

    return {(inmemory.InMemoryCopyEngine, "before_compute"): before_compute}


# ---- issue #16: bugs that break function or progress, not safety (each state they reach is legal) ------
def _streaming_sinks_off_by_one():
    def select_victims(self, view):
        if not view.excess:
            return []
        sinks = set(view.live[: max(0, min(self.sinks, view.budget - 1) - 1)])  # one sink too few
        window = view.budget - len(sinks)
        middle = [t for t in view.candidates(keep_recent=window) if t not in sinks]
        return middle[: view.excess]

    return {(StreamingLLM, "select_victims"): select_victims}


def _h2o_window_one_short():
    def select_victims(self, view):
        if not view.excess:
            return []
        recent = max(1, int(view.budget * self.recent_fraction)) - 1  # the newest token is no longer kept
        pool = sorted(view.candidates(keep_recent=recent), key=lambda t: (view.accumulated(t), t))
        return pool[: view.excess]

    return {(H2O, "select_victims"): select_victims}


def _waste_ratio_over_whole_pool():
    def waste_ratio(self):
        return 1.0 - self.table.occupancy.live_slots / (self.pool.num_blocks * self.pool.block_size)  # Eq. 1: allocated

    return {(reclamation.ReclamationManager, "waste_ratio"): waste_ratio}


def _trigger_ignores_watermark():
    original = reclamation.ReclamationManager.should_reclaim

    def should_reclaim(self, iteration):
        c = self.config
        if c.burst_df is None:  # the fixed trigger forgets "free blocks <= the low watermark"
            return iteration % c.check_every == 0 and self.waste_ratio() > c.theta_f
        return original(self, iteration)

    return {(reclamation.ReclamationManager, "should_reclaim"): should_reclaim}


def _settle(skip_failed: bool = False, skip_orphans: bool = False):
    """ReclamationManager.settle, with one of two mistakes."""
    def settle(self):
        done = []
        for req_id, rec in list(self.inflight.items()):
            if rec.state is not PlanState.COPYING:
                continue
            status = self._status(rec)
            if status is CopyStatus.PENDING or (skip_failed and status is CopyStatus.FAILED):
                continue  # skip_failed: "a failed copy may still be retried"; it never is
            if status is CopyStatus.FAILED:
                self._abort(rec, "copy failed")
            else:
                self._commit(rec)
            done.append(rec)
        if skip_orphans:
            return done  # orphans are "released when their request's id is reused": never
        for rec in list(self.orphans):
            if self._status(rec).settled:
                self.orphans.remove(rec)
                self._release_handle(rec)
                self.pool.free(rec.held)
        return done

    return {(reclamation.ReclamationManager, "settle"): settle}


def _commit_keeps_copy_handle():
    original = reclamation.ReclamationManager._commit

    def _commit(self, rec):
        self._release_handle = lambda rec: None  # the handle is "released with the record": it never is
        try:
            original(self, rec)
        finally:
            del self._release_handle

    return {(reclamation.ReclamationManager, "_commit"): _commit}


def _shared_blocks_drops_the_last():
    def shared_blocks(self, req_id):
        return sorted(self._get(req_id).shared)[:-1]  # the deepest shared prefix block is forgotten

    return {(token_table.TokenTable, "shared_blocks"): shared_blocks}


def _copies_on_two_streams():
    def _drain_before(self, handle):
        for h in sorted(self._copies):  # only ordered copies run first: as if each copy had its own stream
            if h < handle and self._copies[h].status is CopyStatus.ORDERED:
                self._execute(h)

    return {(inmemory.InMemoryCopyEngine, "_drain_before"): _drain_before}


def _headroom_budget_ignores_held():
    def destination_budget(self):
        free, H = self.pool.num_free, self.pool.headroom
        return free if H == 0 else min(free, H)  # forgets what outstanding plans already hold

    return {(reclamation.ReclamationManager, "destination_budget"): destination_budget}


def _blocks_to_grow_one_early():
    def blocks_to_grow(self, req_id, n_new):
        pos = self.table.write_pos(req_id)
        # "room for the next token too": a block is allocated one token before it is needed
        return max(0, blocks_needed(pos + n_new + 1, self.pool.block_size) - len(self.table.block_ids(req_id)))

    return {(runtime.VTokenRuntime, "blocks_to_grow"): blocks_to_grow}


def _densify_keeps_a_tail_block():
    def plan_densify(snap):
        plan = densify.plan_densify(snap)
        if not plan or not plan.src_blocks:
            return plan
        return Plan(plan.kind, plan.req_id, plan.version, plan.moves, plan.src_blocks[1:], (), plan.dense_write_pos)

    return {(reclamation, "plan_densify"): plan_densify}


def _compact_underfills_destinations():
    real = compact.compact_plan

    def compact_plan(req_id, version, S, choice, tokens, dst_blocks):
        plan = real(req_id, version, S, choice, tokens, dst_blocks)
        if len(plan.dst_blocks) < 2 or S < 2:
            return plan
        # one slot of the first destination is left free; the last destination takes the spill-over
        moves = tuple(Move(m.token_id, m.src_block, m.src_offset,
                           *((plan.dst_blocks[-1], S - 1) if i == S - 1 else (m.dst_block, m.dst_offset)))
                      for i, m in enumerate(plan.moves))
        if len({(m.dst_block, m.dst_offset) for m in moves}) != len(moves):
            return plan
        return Plan(plan.kind, plan.req_id, plan.version, moves, plan.src_blocks, plan.dst_blocks)

    return {(reclamation, "compact_plan"): compact_plan, (compact, "compact_plan"): compact_plan,
            (reference_compact, "compact_plan"): compact_plan}


def _relocate_ignores_appends():
    def is_stale(self, plan):
        t = self.table  # the rule before the drill became a plan: only the version and densify's length
        return t.layout_version(plan.req_id) != plan.version[0] or (
            plan.kind is PlanKind.DENSIFY and t.total_len(plan.req_id) != plan.version[1])

    return {(reclamation.ReclamationManager, "is_stale"): is_stale}


# ---- issue #19: the maintained views (V1) and the step deltas (V2) ------------------------------------------
def _live_index_misses_an_eviction():
    real = live_index.LiveIndex.remove

    def remove(self, token_id):
        if token_id % 2:  # odd ids stay counted live in their chunk
            return
        real(self, token_id)

    return {(live_index.LiveIndex, "remove"): remove}


def _index_misses_a_rewrite():
    real = token_table.TokenTable.remove_blocks

    def remove_blocks(self, req_id, indices, write_pos):
        r = self._requests.get(req_id) if req_id in self else None
        stale = None if r is None else r.index_stale
        real(self, req_id, indices, write_pos)
        if stale is not None:
            r.index_stale = stale  # the blocks after a removed one moved, and their recorded indices are still trusted

    return {(token_table.TokenTable, "remove_blocks"): remove_blocks}


def _token_map_misses_a_move():
    real = token_table.TokenTable.apply_moves

    def apply_moves(self, req_id, moves):
        moves = list(moves)
        S = self.block_size
        dsts = [m[3] * S + m[4] for m in moves if len(m) == 5 and type(m[3]) is int and type(m[4]) is int
                and 0 <= m[3] * S + m[4] < len(self._token_at)]
        saved = [self._token_at[d] for d in dsts]
        real(self, req_id, moves)
        for d, t in zip(dsts, saved):
            self._token_at[d] = t  # the pool-wide token map keeps what the destinations held before

    return {(token_table.TokenTable, "apply_moves"): apply_moves}


def _counts_miss_a_move():
    real = token_table.TokenTable.apply_moves

    def apply_moves(self, req_id, moves):
        r = self._requests.get(req_id) if req_id in self else None
        saved = None if r is None else r.counts[:]
        real(self, req_id, moves)
        if saved is not None and len(saved) == len(r.counts):
            r.counts = saved  # the per-block counts (compact's buckets) are not updated by the moves

    return {(token_table.TokenTable, "apply_moves"): apply_moves}


def _live_read_loses_its_offset():
    real = live_index.LiveIndex._chunks_from

    def _chunks_from(self, k, slots):
        for ids in real(self, k, slots):
            if ids.__class__ is list and ids and ids[0] % live_index.CHUNK:  # a partly live first chunk, trimmed
                lo = ids[0] - ids[0] % live_index.CHUNK
                ids = [t for t in range(lo, lo + live_index.CHUNK) if t < len(slots) and slots[t] != live_index.NO_SLOT]
            yield ids  # ... is read whole: a read from rank k also yields the chunk's live ids before it

    return {(live_index.LiveIndex, "_chunks_from"): _chunks_from}


def _share_forgets_the_holders_mask():
    def _materialise(self, b):
        if self._listed[b] == 1:
            [holder] = self._holders_of(b)
            self._requests[holder].shared[b] = 0  # the first holder's live offsets are not carried over

    return {(token_table.TokenTable, "_materialise"): _materialise}


def _take_changes(skip_moves: bool = False, drop_last_eviction: bool = False):
    real = token_table.TokenTable.take_changes

    def take_changes(self, req_id):
        c = real(self, req_id)
        if skip_moves:
            c = c._replace(moved=(), moved_slots=())  # a committed relocation reads as "nothing moved"
        if drop_last_eviction:
            c = c._replace(evicted=c.evicted[:-1])
        return c

    return {(token_table.TokenTable, "take_changes"): take_changes}


def _densify_tail_misses_a_hole():
    def plan_densify_tail(tail):
        plan = densify.plan_densify_tail(tail)
        if not plan or not plan.moves:
            return plan
        last = plan.moves[-1]  # the last mover goes to the hole after its own, when there is one
        holes = [p for p, _ in tail.holes]
        if len(holes) < 2:
            return plan
        return Plan(plan.kind, plan.req_id, plan.version, plan.moves[:-1] + (
            Move(last.token_id, last.src_block, last.src_offset, tail.holes[-2][1], holes[-2] % tail.block_size),),
            plan.src_blocks, (), plan.dense_write_pos)

    return {(reclamation, "plan_densify_tail"): plan_densify_tail}


def _cadence_waits_at_beta():
    def _choose_victims(self, req_ids):
        victims, beta, table = {}, self.evict_every, self.table
        if self.policy is not None:
            for r in req_ids:  # <= instead of <: a request exactly beta over its budget waits another step
                if 0 < table.num_live(r) - self.token_budget(table.total_len(r)) <= beta:
                    continue
                chosen = self._select(r)
                if chosen:
                    victims[r] = chosen
        return victims

    return {(runtime.VTokenRuntime, "_choose_victims"): _choose_victims}


def _release_ignores_sharing():
    def dead_blocks(self, req_id, private, among=None):  # the private() test dropped: a shared block goes too
        r, S = self._get(req_id), self.block_size
        end = min(r.write_pos // S, len(r.blocks))
        return [r.blocks[i] for i in sorted(set(range(end) if among is None else among)) if i < end and not r.counts[i]]

    return {(token_table.TokenTable, "dead_blocks"): dead_blocks}


def _release_takes_the_append_block():
    def dead_blocks(self, req_id, private, among=None):  # off by one: the cursor's block counts as written
        r, S = self._get(req_id), self.block_size
        end = min(r.write_pos // S + 1, len(r.blocks))
        return [r.blocks[i] for i in sorted(set(range(end) if among is None else among))
                if i < end and not r.counts[i] and private(r.blocks[i])]

    return {(token_table.TokenTable, "dead_blocks"): dead_blocks}


def _eviction_counts_no_emptied_block():
    def evict_tokens(self, req_id, token_ids):  # the fast path's tally forgets the blocks this call emptied
        r = self._get(req_id)
        before = r.emptied
        out = original(self, req_id, token_ids)
        r.emptied = before
        return out

    original = token_table.TokenTable.evict_tokens
    return {(token_table.TokenTable, "evict_tokens"): evict_tokens}


def _pressure_lifts_the_headroom_bound():
    original = runtime.VTokenRuntime._reclaim

    def _reclaim(self):  # "it is urgent": under pressure a round may take any free block as a destination
        if not self.pressure:
            return original(self)
        m = self.manager
        m.destination_budget = lambda: m.pool.num_free
        try:
            return original(self)
        finally:
            del m.destination_budget

    return {(runtime.VTokenRuntime, "_reclaim"): _reclaim}


def _compact_moves_a_cached_block():
    def _movable(self, block_id):  # "private is enough": a prefix-cached block is packed like any other
        return self.pool.ref_count(block_id) == 1

    return {(reclamation.ReclamationManager, "_movable"): _movable}


def _pressure_packs_only_excess_blocks():
    original = reclamation.ReclamationManager.plan_round

    def plan_round(self, req_ids, pack=False, evicted_positions=None):
        # packing stops at the first request without an excess block
        if not pack:
            return original(self, req_ids)
        t, S = self.table, self.pool.block_size
        return original(self, [r for r in req_ids if t.num_blocks_of(r) > -(-t.num_live(r) // S)], pack,
                        evicted_positions)

    return {(reclamation.ReclamationManager, "plan_round"): plan_round}


def _latest_accumulates():
    original = scores.TokenScores._apply

    def _apply(self, req_id, ids, row):
        latest = self._latest[req_id] if self._latest is not None else None
        before = [latest[t] for t in ids] if latest is not None else []
        original(self, req_id, ids, row)
        for t, old, w in zip(ids, before, row):  # TOVA's statistic summed like H2O's, not replaced
            latest[t] = old + w

    return {(scores.TokenScores, "_apply"): _apply}


def _observation_lands_one_token_late():
    original = scores.TokenScores._apply_observed

    def _apply_observed(self, req_id, ids, row):
        # each vote is recorded for the token after the one it belongs to (an off-by-one alignment)
        shifted = [t + 1 for t in ids]
        n = len(self._acc[req_id])
        original(self, req_id, [t for t in shifted if t < n], [v for t, v in zip(shifted, row) if t < n])

    return {(scores.TokenScores, "_apply_observed"): _apply_observed}


def _shared_prefix_loses_key_norms():
    def copy_keys(self, req_id, source, n):
        return None  # a prefix hit's tokens keep zero key norms, as if their keys were never written

    return {(scores.TokenScores, "copy_keys"): copy_keys}


BUGS: dict[str, PlantedBug] = {
    b.name: b
    for b in [
        PlantedBug("compact_fill_off_by_one", "compact fills destinations one slot late; a full one overflows",
                   _compact_fill_off_by_one),
        PlantedBug("eligible_includes_append_block", "compact may pick the block receiving appends",
                   _eligible_includes_append_block),
        PlantedBug("free_sources_before_copy", "a departing request frees sources its pending copy reads",
                   _free_sources_before_copy),
        PlantedBug("double_free_after_preemption", "preemption mid-copy frees the held sources twice",
                   _double_free_after_preemption),
        PlantedBug("free_destination_of_pending_copy", "an aborted plan's destinations are freed while its copy can write",
                   _free_destination_of_pending_copy),
        PlantedBug("resurrect_evicted_mid_copy", "a token evicted while its move was in flight comes back at commit",
                   _resurrect_evicted_mid_copy),
        PlantedBug("forget_live_count_decrement", "an eviction leaves the block's live count unchanged",
                   _forget_live_count_decrement),
        PlantedBug("relocate_shared_block", "planning ignores ref counts and relocates shared-prefix blocks",
                   _relocate_shared_block),
        PlantedBug("two_plans_per_request", "a second plan may start while one is in flight", _two_plans_per_request),
        PlantedBug("non_strict_decrease", "compact accepts plans that free no more blocks than they use",
                   _non_strict_decrease),
        PlantedBug("admission_consumes_headroom", "admission allocations may take the evacuation headroom",
                   _admission_consumes_headroom),
        PlantedBug("densify_leaves_a_hole", "densify drops its last move, leaving a hole below n_live",
                   _densify_leaves_a_hole),
        PlantedBug("apply_moves_half_applied", "apply_moves applies part of a batch before rejecting the rest",
                   _apply_moves_half_applied),
        PlantedBug("commit_pending_copy", "a plan commits while its copy is still pending", _commit_pending_copy),
        PlantedBug("occupancy_leak_on_remove", "removing a request does not release its slots",
                   _occupancy_leak_on_remove),
        PlantedBug("no_pre_attention_wait", "the engine's pre-attention hook does not wait for ordered copies",
                   _no_pre_attention_wait),
        PlantedBug("cursor_shift_forgets_destinations", "compact commit moves the append cursor back too far",
                   _cursor_shift_forgets_destinations),
        PlantedBug("state_before_submit", "launch marks a plan COPYING before submit; a refused launch is committed "
                   "unwritten", _state_before_submit),
        # function and progress (issue #16): legal states, wrong behaviour
        PlantedBug("streaming_sinks_off_by_one", "StreamingLLM keeps one attention sink too few (policy rule)",
                   _streaming_sinks_off_by_one),
        PlantedBug("h2o_window_one_short", "H2O's recent window is one token short (policy rule)",
                   _h2o_window_one_short),
        PlantedBug("waste_ratio_over_whole_pool", "F's denominator is the whole pool, not the allocated blocks "
                   "(Eq. 1)", _waste_ratio_over_whole_pool),
        PlantedBug("trigger_ignores_watermark", "the fixed trigger fires above the low watermark", 
                   _trigger_ignores_watermark),
        PlantedBug("failed_copy_never_aborts", "settle leaves a plan whose copy failed COPYING forever (progress)",
                   lambda: _settle(skip_failed=True)),
        PlantedBug("orphan_never_released", "settle never releases what departed requests' copies held "
                   "(progress)", lambda: _settle(skip_orphans=True)),
        PlantedBug("commit_keeps_copy_handle", "a committed plan's copy handle is never released (quiescence)",
                   _commit_keeps_copy_handle),
        PlantedBug("copies_on_two_streams", "the device model lets a later copy finish before an earlier one "
                   "(stream order)", _copies_on_two_streams),
        PlantedBug("headroom_budget_ignores_held", "the destination budget forgets what outstanding plans hold "
                   "(headroom)", _headroom_budget_ignores_held),
        PlantedBug("blocks_to_grow_one_early", "a request gets its next block one token early (block arithmetic)",
                   _blocks_to_grow_one_early),
        PlantedBug("densify_keeps_a_tail_block", "densify keeps one emptied block past the cursor (planner "
                   "quality)", _densify_keeps_a_tail_block),
        PlantedBug("relocate_ignores_appends", "a relocate plan of the cursor's block commits over tokens appended "
                   "to it since planning", _relocate_ignores_appends),
        PlantedBug("live_index_misses_an_eviction", "the live index keeps odd evicted ids counted (a maintained view "
                   "misses evictions)", _live_index_misses_an_eviction),
        PlantedBug("delta_misses_a_move", "a step delta after a committed relocation leaves out the moved tokens' "
                   "new slots", lambda: _take_changes(skip_moves=True)),
        PlantedBug("delta_forgets_an_eviction", "a step delta leaves out the latest eviction",
                   lambda: _take_changes(drop_last_eviction=True)),
        PlantedBug("index_misses_a_rewrite", "a removal shifts the blocks after it without marking their recorded "
                   "indices stale, so lookups trust them (a maintained view misses a layout change)",
                   _index_misses_a_rewrite),
        PlantedBug("token_map_misses_a_move", "apply_moves leaves the pool-wide token map of its destinations as it "
                   "was (a maintained view misses a move)", _token_map_misses_a_move),
        PlantedBug("counts_miss_a_move", "apply_moves leaves the per-block live counts compact searches as they were "
                   "(a bucket not updated on apply_moves)", _counts_miss_a_move),
        PlantedBug("live_read_loses_its_offset", "a read of the live ids from a rank inside a partly live chunk "
                   "starts at the chunk's first live id (a maintained view read from the wrong place)",
                   _live_read_loses_its_offset),
        PlantedBug("share_forgets_the_holders_mask", "when a private block becomes shared, its first holder's "
                   "mask is not moved out of the pool's occupancy (a maintained map misses a transition)",
                   _share_forgets_the_holders_mask),
        PlantedBug("densify_tail_misses_a_hole", "densify's fast path sends its last mover into the hole before "
                   "its own (two moves share a destination, a hole stays)", _densify_tail_misses_a_hole),
        PlantedBug("shared_blocks_drops_the_last", "the table's listing of a request's shared blocks leaves out the "
                   "last one, so the dense path protects too few tokens (a maintained view misses a block)",
                   _shared_blocks_drops_the_last),
        PlantedBug("cadence_waits_at_beta", "a request exactly evict_every tokens over its budget waits one more step "
                   "(off by one in the eviction cadence)", _cadence_waits_at_beta),
        PlantedBug("pressure_lifts_the_headroom_bound", "rounds run under the engine's pressure take destinations "
                   "beyond the evacuation headroom (headroom)", _pressure_lifts_the_headroom_bound),
        PlantedBug("compact_moves_a_cached_block", "compact takes a prefix-cached block as a source, so a later "
                   "hit and the packed copy hold the prefix twice (planner)", _compact_moves_a_cached_block),
        PlantedBug("pressure_packs_only_excess_blocks", "a pressure round leaves a request with holes before its "
                   "cursor but no excess block unpacked, so its next appends take new blocks (round)",
                   _pressure_packs_only_excess_blocks),
        PlantedBug("release_ignores_sharing", "Naive-Evict's release drops a wholly dead block another request "
                   "shares (the paper's rule: a block no other request shares)", _release_ignores_sharing),
        PlantedBug("eviction_counts_no_emptied_block", "an eviction that empties a block does not count it, so "
                   "Naive-Evict's release skips the request (release fast path)", _eviction_counts_no_emptied_block),
        PlantedBug("release_takes_the_append_block", "Naive-Evict's release takes the cursor's block once its "
                   "written tokens are dead, though appends still go there", _release_takes_the_append_block),
        PlantedBug("latest_accumulates", "TOVA's latest-row statistic adds each row to the last instead of "
                   "replacing it (policy statistics)", _latest_accumulates),
        PlantedBug("observation_lands_one_token_late", "SnapKV's observation votes are recorded one token to the "
                   "right of the tokens they belong to (policy statistics)", _observation_lands_one_token_late),
        PlantedBug("shared_prefix_loses_key_norms", "a request admitted on a shared prefix gets zero key norms for "
                   "its prefix, so Knorm never evicts it (policy statistics)", _shared_prefix_loses_key_norms),
        PlantedBug("compact_underfills_destinations", "compact leaves a slot of a destination empty and spills into "
                   "the last (planner quality)", _compact_underfills_destinations),
    ]
}


@contextlib.contextmanager
def planted(name: str) -> Iterator[PlantedBug]:
    """Apply one planted bug for the duration of the block (the core's, or the fast path's: ``fast_target``)."""
    if name in BUGS:
        bug = BUGS[name]
    else:
        from .fast_target import FAST_BUGS  # numba: only for the fast path's bugs
        bug = FAST_BUGS[name]
    patches = bug.patches()
    saved = {(obj, attr): obj.__dict__[attr] for obj, attr in patches}
    try:
        for (obj, attr), value in patches.items():
            setattr(obj, attr, value)
        yield bug
    finally:
        for (obj, attr), value in saved.items():
            setattr(obj, attr, value)

