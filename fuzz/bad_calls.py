"""The calls the machine makes that must fail: invalid calls, and defects planted for the checkers.

``BadCalls`` is a mixin of ``VTokenMachine`` (fuzz/machine.py): its ``bad_call`` rule dispatches to a
``_bad_<group>`` method here, its ``checker_has_teeth`` rule to a ``_teeth_<kind>`` method. Each invalid
call must raise its specific error, change nothing (the machine's whole ``state()``) and say what is
wrong: its message names the argument, request or block at fault. Each planted defect is made in a
copy of the current state (or in the planner's answer) and the executed check that guards it must
raise ``InvariantViolation`` with its invariant's name and a message naming the defect.
"""

from __future__ import annotations

import copy
import enum
import re
from collections import Counter
from dataclasses import replace

from vtoken.core import errors as E
from vtoken.core import reclamation as reclamation_module
from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.occupancy import SlotOccupancy
from vtoken.core.plan import PlanKind
from vtoken.core.reclamation import PlanRecord, PlanState
from vtoken.core.reference.views import check_occupancy
from vtoken.core.token_table import Move

from .events import EVENTS

BAD_CALLS = tuple(
    f"{group}:{what}"
    for group, whats in [
        ("evict", ["dead", "out_of_range", "unknown", "twice", "live_then_dead", "not_a_sequence"]),
        ("move", ["stale", "occupied", "twice", "unlisted", "cursor", "malformed", "same_dst"]),
        ("pool", ["free", "over", "admit_headroom", "evacuate"]),
        ("request", ["range", "listed", "shrink", "short", "conflict", "duplicate"]),
        # issue #15: the wrong types and shapes, and calls out of order
        ("count", ["float", "bool", "str"]),  # a count or token id that is not an int
        ("id", ["unhashable", "bool"]),  # request ids
        ("block", ["foreign", "free_sync", "not_int", "held_sync"]),  # another request's block, a free one,
        # 1.0 / True, a destination a plan in flight holds
        ("purpose", ["str"]),  # "ADMISSION" (a name, not the value "admission") or None instead of Purpose.ADMISSION
        ("attention", ["nan", "inf", "negative", "unknown", "length"]),  # end_step's rows (inside a step)
        ("step", ["begin_twice", "end_first", "not_mapping"]),
    ]
    for what in whats
)

#: Issue #16 (the mutation campaign's survivors): arguments, entry points, configurations and policy answers
#: no other rule produces. A rule of their own (``bad_argument``), so that they do not thin out ``bad_call``.
BAD_ARGUMENTS = tuple(
    f"{group}:{what}"
    for group, whats in [
        ("arg", ["grow_count", "admit_len", "sync_blocks", "block_live", "holders", "int_subclass"]),
        ("remove", ["short"]),  # the engine removes a request and hands the manager a list missing a source
        ("config", ["pool", "occupancy"]),  # BlockPool / SlotOccupancy built with a bad argument
        ("policy", ["dead", "duplicate", "too_many", "raises"]),  # the policy's answer is invalid once
    ]
    for what in whats
)


def names_in(message: str, name: str) -> bool:
    """``name`` occurs in ``message`` as a whole word ("block_size" is not named by "XXblock_sizeXX")."""
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", message) is not None


#: Defects ``checker_has_teeth`` plants; the word before the first "_" picks the ``_teeth_`` method.
TEETH = ("pool_twice", "pool_lost", "slot_holders", "block_live", "idle_block_live", "move_source",
         "move_outside", "move_offset", "move_same_dst", "move_token", "planner_dsts", "forecast")


class BadCalls:
    """Invalid calls and planted defects over the machine's state (``self.rt``, ``self.pool``, ...)."""

    def _violation(self, invariant: str, names: tuple[str, ...], check, *args) -> None:
        before = self.state()
        try:
            check(*args)
        except E.InvariantViolation as e:
            message = str(e)
            assert e.invariant == invariant and all(n in message for n in names), \
                f"{getattr(check, '__name__', check)} raised {e.invariant!r}: {message!r}; expected {invariant} naming {names}"
        else:
            raise AssertionError(f"{getattr(check, '__name__', check)} did not notice a planted defect; expected {invariant}")
        assert self.state() == before, "checking a planted defect changed the state"
        EVENTS["checkers_with_teeth"] += 1

    def _teeth_pool(self, kind, index):
        pool = copy.deepcopy(self.pool)
        free = list(pool._free)
        if not free:
            return
        b = free[index % len(free)]
        if kind == "pool_twice":
            pool._free.append(b)
        else:
            pool._free.remove(b)
        self._violation("P1", (f"block {b}",), pool.check)

    def _expected_holders(self) -> Counter:
        return Counter(s for r in self.table.request_ids() for s in self.table.attention_slots(r))

    def _teeth_slot(self, kind, index):
        occ, want = copy.deepcopy(self.table.occupancy), self._expected_holders()
        if not want:
            return
        slot = sorted(want)[index % len(want)]
        occ._holders[slot] += 1
        self._violation("I2", (f"slot {slot}",), check_occupancy, occ, dict(want))

    def _teeth_block(self, kind, index):
        """A block's live count off by one: a block with live slots (``block_live``) or one without
        (``idle_block_live``, the checker's zero-count scan)."""
        occ, want = copy.deepcopy(self.table.occupancy), self._expected_holders()
        live = {s // self.S for s in want}
        blocks = sorted(set(range(self.pool.num_blocks)) - live if kind.startswith("idle") else live)
        if not blocks:
            return
        b = blocks[index % len(blocks)]
        occ._block_live[b] += 1
        self._violation("I2", (f"block {b}",), check_occupancy, occ, dict(want))

    _teeth_idle = _teeth_block

    def _teeth_move(self, kind, index):
        """Launch's precondition on a planner's moves (``_check_moves``), given a corrupted copy of a plan in
        flight whose layout is current."""
        t, S = self.table, self.S
        running = t.request_ids()
        if not self.manager.inflight and running and self.profile.planner is not None:
            self.plan_now(running[index % len(running)])  # a plan to corrupt a copy of (PLANNED until launch)
        recs = [rec for r, rec in self.manager.inflight.items()
                if rec.plan.moves and t.layout_version(r) == rec.plan.version[0]]
        if not recs:
            return
        rec = recs[index % len(recs)]
        req, moves = rec.plan.req_id, list(rec.plan.moves)
        self.manager._check_moves(PlanRecord(rec.plan))  # the real plan passes: what follows is the defect
        live = [i for i, m in enumerate(moves) if t.is_live(req, m.token_id)]  # an evicted mover is not read
        i = live[index % len(live)] if live else index % len(moves)
        m = moves[i]
        if kind == "move_source":
            if not live:
                return
            moves[i], phrase = m._replace(src_offset=(m.src_offset + 1) % S), "reads"
        elif kind == "move_outside":
            into = set(t.block_ids(req)) if rec.plan.kind is PlanKind.DENSIFY else set(rec.plan.dst_blocks)
            outside = [b for b in range(self.pool.num_blocks) if b not in into]
            if not outside:
                return
            moves[i], phrase = m._replace(dst_block=outside[index % len(outside)]), "writes outside"
        elif kind == "move_offset":
            moves[i], phrase = m._replace(dst_offset=S), "writes outside"
        elif kind == "move_same_dst":
            if len(moves) < 2:
                return
            j = (i + 1) % len(moves)
            moves[j], phrase = moves[j]._replace(dst_block=m.dst_block, dst_offset=m.dst_offset), "share a destination"
        else:
            moves[i], phrase = m._replace(token_id=t.total_len(req)), "names a token outside"
        bad = PlanRecord(replace(rec.plan, moves=tuple(moves)))
        self._violation("I4", (f"request {req!r}", phrase), self.manager._check_moves, bad)

    def _teeth_planner(self, kind, index):
        """A compact planner that breaks its contract (one reserved destination unused): plan_request must
        raise I4 naming the reserved blocks, give them back and keep nothing. Tried on each request without
        a plan in turn (from ``index``) until the planner is asked for a plan with destinations."""
        if self.profile.planner is not PlanKind.COMPACT:
            return
        candidates = [r for r in self.table.request_ids() if r not in self.manager.inflight]
        real = reclamation_module.compact_plan  # the fill both compact paths share
        called = []

        def broken(*args):
            plan = real(*args)
            if not plan or not plan.dst_blocks:  # a no-plan, or a plan releasing wholly dead blocks: kept as is
                return plan
            called.append(plan)
            return replace(plan, dst_blocks=plan.dst_blocks[:-1])

        def state():  # the refused plan's destinations go back to the pool, at the end of its free queue
            pool, rest = self.state()[0], self.state()[1:]
            return (pool[0], sorted(pool[1])) + rest

        for k in range(len(candidates)):
            r = candidates[(index + k) % len(candidates)]
            reclamation_module.compact_plan = broken
            try:
                before = state()
                try:
                    out = self.manager.plan_request(r)
                except E.InvariantViolation as e:
                    assert called and e.invariant == "I4" and "reserved destination" in str(e), \
                        f"a broken compact planner was reported as {e.invariant!r}: {e}"
                    assert state() == before, "a refused broken plan kept something"
                    EVENTS["checkers_with_teeth"] += 1
                    return
            finally:
                reclamation_module.compact_plan = real
            assert not called, f"plan_request accepted a compact plan leaving a reserved destination unused: {out!r}"
            if out:  # nothing to break (only wholly dead blocks): the plan stands, and the request is taken
                EVENTS["plans_made"] += 1
                return

    def _teeth_forecast(self, kind, index):
        """A forecast that says everything fits (``_room_after_settle`` returning room) when settling frees
        nothing and the appends do not fit: begin_step must stop with P3 before it allocates."""
        m, rt = self.manager, self.rt
        settleable = [rec for rec in m.inflight.values() if rec.state is PlanState.COPYING
                      and (rec.handle is None or self.engine.poll(rec.handle) is not CopyStatus.PENDING)]
        settleable += [rec for rec in m.orphans if self.engine.poll(rec.handle).settled]
        appends = {r: self.prefill.get(r, 1) for r in self.table.request_ids()}
        need = sum(rt.blocks_to_grow(r, n) for r, n in appends.items())
        if settleable or self.pool.can_allocate(need, Purpose.ADMISSION):
            return
        rt._room_after_settle = lambda appends: (0, self.pool.num_blocks + self.pool.headroom)
        try:
            self._violation("P3", ("the forecast said they fit",), rt.begin_step, appends)
        finally:
            del rt._room_after_settle

    def _bad_evict(self, req, kind, index):
        if kind == "unknown":
            return self._rejected(E.UnknownRequestError, self.table.evict_token, "no-such-request", 0)
        if not self._running(req):
            return
        if kind == "out_of_range":
            return self._rejected(E.TokenOutOfRangeError, self.table.evict_token, req, self.table.total_len(req) + index % 3)
        if kind == "not_a_sequence":
            return self._rejected(E.TokenOutOfRangeError, self.table.evict_tokens, req, index)
        live = self._live(req)
        if kind == "twice" and live:  # a batch naming a live token twice evicts none of the batch
            t = live[index % len(live)]
            return self._rejected(E.TokenAlreadyEvictedError, self.table.evict_tokens, req,
                                  [t] + [u for u in live[:2] if u != t] + [t])
        dead = [t for t in range(self.table.total_len(req)) if t not in self.shadow[req]]
        if dead and kind == "live_then_dead":  # the live ones before it stay live: all or none
            return self._rejected(E.TokenAlreadyEvictedError, self.table.evict_tokens, req,
                                  live[:3] + [dead[index % len(dead)]])
        if dead:
            self._rejected(E.TokenAlreadyEvictedError, self.table.evict_token, req, dead[index % len(dead)])

    def _bad_move(self, req, kind, index):
        if not self._running(req) or not self.shadow[req]:
            return
        S, t = self.S, self._live(req)[index % len(self.shadow[req])]
        slot = self.table.slot_of(req, t)
        blocks = self.table.block_ids(req)
        if kind == "stale":
            bad = [Move(t, slot // S, (slot % S + 1) % S if S > 1 else 0, slot // S, slot % S)]
            if bad[0].src_offset == slot % S:
                bad = [Move(t, (slot // S + 1) % self.pool.num_blocks, 0, slot // S, slot % S)]
            return self._rejected(E.MoveSourceMismatchError, self.table.apply_moves, req, bad)
        if kind == "occupied":
            others = [u for u in self.shadow[req] if u != t]
            if others:
                o = self.table.slot_of(req, others[index % len(others)])
                self._rejected(E.DestinationError, self.table.apply_moves, req, [Move(t, slot // S, slot % S, o // S, o % S)])
            return
        if kind == "twice":
            return self._rejected(E.MoveSourceMismatchError, self.table.apply_moves, req,
                                  [Move(t, slot // S, slot % S, slot // S, slot % S)] * 2)
        if kind == "same_dst":  # two tokens into one slot: the table and every engine refuse it
            others = [u for u in self.shadow[req] if u != t]
            if not others:
                return
            u = others[index % len(others)]
            su = self.table.slot_of(req, u)
            both = [Move(t, slot // S, slot % S, su // S, su % S), Move(u, su // S, su % S, su // S, su % S)]
            self._rejected(E.DestinationError, self.table.apply_moves, req, both)
            return self._rejected(E.DestinationError, self.engine.submit, both, req)
        if kind == "unlisted":
            outside = [b for b in range(self.pool.num_blocks) if b not in blocks]
            if outside:
                b = outside[index % len(outside)]
                self._rejected(E.BlockNotOwnedError, self.table.apply_moves, req, [Move(t, slot // S, slot % S, b, 0)])
            return
        if kind == "malformed":  # not a 5-tuple of ints: refused before anything moves
            src = (t, slot // S, slot % S)
            bad, exc = [
                ([src], E.MoveSourceMismatchError),  # 3 fields
                (["abcde"], E.MoveSourceMismatchError),  # a string is not a tuple
                ([dict(enumerate(src))], E.MoveSourceMismatchError),
                ([None], E.MoveSourceMismatchError),
                (5, E.MoveSourceMismatchError),  # not a sequence of moves
                ([Move(t, float(slot // S), slot % S, slot // S, slot % S)], E.MoveSourceMismatchError),
                ([Move(t, slot // S, slot % S, float(slot // S), slot % S)], E.DestinationError),
                ([Move(t, slot // S, slot % S, True, 0)], E.DestinationError),
            ][index % 8]
            return self._rejected(exc, self.table.apply_moves, req, bad)
        w = self.table.write_pos(req)
        if w < len(blocks) * S:  # a free slot at the cursor: appends would overwrite a token moved there
            self._rejected(E.DestinationError, self.table.apply_moves, req,
                           [Move(t, slot // S, slot % S, blocks[w // S], w % S)])

    def _bad_pool(self, req, kind, index):
        pool = self.pool
        if kind == "free":
            free = pool.free_block_ids()
            if free:
                self._rejected(E.DoubleFreeError, pool.free, [free[index % len(free)]])
        elif kind == "over":
            held = [b for b in range(pool.num_blocks) if pool.ref_count(b) > 0]
            if held:
                b = held[index % len(held)]
                self._rejected(E.DoubleFreeError, pool.free, [b] * (pool.ref_count(b) + 1))
        elif kind == "admit_headroom":
            n = pool.num_free - pool.headroom + 1
            if 0 < n <= pool.num_free:
                self._rejected(E.HeadroomReservedError, pool.allocate, n, Purpose.ADMISSION)
        else:
            self._rejected(E.PoolExhaustedError, pool.allocate, pool.num_free + 1, Purpose.EVACUATION)

    def _bad_request(self, req, kind, index):
        if not self._running(req):
            return
        t = self.table
        if kind == "range":
            self._rejected(E.BlockOutOfRangeError, t.sync_new_tokens, req, [self.pool.num_blocks], t.total_len(req))
        elif kind == "listed" and t.block_ids(req):
            self._rejected(E.BlockNotOwnedError, t.sync_new_tokens, req, [t.block_ids(req)[0]], t.total_len(req))
        elif kind == "shrink" and t.total_len(req):
            self._rejected(E.TokenOutOfRangeError, t.sync_new_tokens, req, [], t.total_len(req) - 1)
        elif kind == "short":
            room = len(t.block_ids(req)) * self.S - t.write_pos(req)
            self._rejected(E.BlockListTooShortError, t.sync_new_tokens, req, [], t.total_len(req) + room + 1)
        elif kind == "conflict" and req in self.manager.inflight:
            self._rejected(E.PlanConflictError, self.manager.plan_request, req)
        elif kind == "duplicate":  # through the runtime, or the table itself
            call = self.rt.admit if index % 2 else self.table.add_request
            self._rejected(E.DuplicateRequestError, call, req, names=(f"request {req!r}",))

    def _bad_count(self, req, kind, index):
        """A count or token id of the wrong type: never truncated, never compared as if it were an int."""
        value = {"float": 1.5, "bool": True, "str": "1"}[kind]
        site = index % 4
        if site == 0:
            return self._rejected(E.InvalidArgumentError, self.pool.allocate, value, Purpose.EVACUATION)
        if site == 1:
            return self._rejected(E.InvalidArgumentError, self.pool.can_allocate, value, Purpose.ADMISSION)
        if not self._running(req):
            return
        if site == 2:
            return self._rejected(E.InvalidArgumentError, self.rt.begin_step, {req: value})
        t = self.table
        if t.total_len(req):  # token 0 as 0.0 / True / "0", or the synced length as a float / str
            tok = {"float": 0.0, "bool": False, "str": "0"}[kind] if index % 8 < 4 else None
            if tok is not None:
                return self._rejected(E.TokenOutOfRangeError, t.evict_token, req, tok)
            length = {"float": float(t.total_len(req)), "bool": True, "str": str(t.total_len(req))}[kind]
            self._rejected(E.TokenOutOfRangeError, t.sync_new_tokens, req, [], length)

    def _bad_id(self, req, kind, index):
        bad = [req] if kind == "unhashable" else bool(index % 2)
        self._rejected(E.InvalidArgumentError, self.rt.admit, bad)

    def _bad_block(self, req, kind, index):
        if kind == "not_int":
            pool = self.pool
            held = [b for b in range(pool.num_blocks) if pool.ref_count(b) > 0]
            if not held:
                return
            b = held[index % len(held)]
            call, arg = [(pool.free, [float(b)]), (pool.free, [True]), (pool.free, str(b)), (pool.share, float(b)),
                         (pool.share, True), (pool.ref_count, str(b))][index % 6]
            return self._rejected(E.BlockOutOfRangeError, call, arg)
        if not self._running(req):
            return
        t = self.table
        if kind == "foreign":  # a block of another request, not a full prefix block this sync fills
            mine = set(t.block_ids(req))
            theirs = sorted({b for r in t.request_ids() if r != req for b in t.block_ids(r)} - mine)
            if theirs:
                b = theirs[index % len(theirs)]
                self._rejected(E.BlockNotOwnedError, t.sync_new_tokens, req, [b], t.total_len(req))
            return
        if kind == "held_sync":  # a destination a compact plan in flight holds, not yet in any block list
            if not self.manager.inflight and self.profile.planner is PlanKind.COMPACT:
                self.plan_now(req)  # destinations are held only between a plan and its commit: make one
                self.launch()
            held = [(b, r) for r, rec in self.manager.inflight.items() for b in rec.plan.dst_blocks
                    if not t.owners(b)]
            if held:
                b, owner = held[index % len(held)]
                self._rejected(E.BlockNotOwnedError, self.rt.sync, req, [b], t.total_len(req),
                               names=(f"block {b}", f"plan of request {owner!r}"))
            return
        free = self.pool.free_block_ids()  # free_sync: vLLM-style sync of a block the pool has not allocated
        if free:
            self._rejected(E.BlockNotOwnedError, self.rt.sync, req, [free[index % len(free)]], t.total_len(req))

    def _bad_purpose(self, req, kind, index):
        pool = self.pool
        n = max(1, pool.num_free - pool.headroom + 1)  # would dip into the headroom if taken for evacuation
        # a member or its exact value ("admission") is a purpose (checks.check_enum); its name, another spelling
        # or None is not
        name = ("ADMISSION", "Evacuation", "admit", None)[index % 4]
        call = pool.allocate if index % 8 < 4 else pool.can_allocate
        self._rejected(E.InvalidArgumentError, call, n, name)

    def _scores_state(self) -> tuple:
        sc = self.rt.scores
        return tuple((r, *map(tuple, sc._arrays(r))) for r in self.table.request_ids())

    def _bad_attention(self, req, kind, index):
        """One step whose end_step is first given a bad row: refused, nothing recorded or evicted; then the
        step ends with the good rows."""
        rt, real_end = self.rt, self.rt.end_step

        def end_step(weights, keys=None, observed=None):
            # an index of 1 mod 3 spoils the step's key norms, 2 mod 3 its observations (SnapKV's votes), else its
            # attention rows: all three are checked alike
            spoil = {1: "keys", 2: "observed"}.get(index % 3, "rows")
            inputs = {"rows": weights, "keys": keys, "observed": observed}
            if spoil != "rows" and not (inputs[spoil] and any(len(v) for v in inputs[spoil].values())):
                spoil = "rows"
            given = inputs[spoil]
            rows = {r: list(w) for r, w in given.items() if len(w)}
            if kind == "unknown":
                bad, exc = {**given, "no-such-request": [1.0]}, E.UnknownRequestError
            elif rows:
                r = sorted(rows)[index % len(rows)]
                row = rows[r]
                if kind == "length":
                    row = row + [0.0]
                else:
                    row[index % len(row)] = {"nan": float("nan"), "inf": float("inf"), "negative": -0.25}[kind]
                bad, exc = {**given, r: row}, E.InvalidArgumentError
            else:
                return real_end(weights, keys, observed)
            before = self._scores_state()
            self._rejected(exc, real_end, *({**inputs, spoil: bad}.values()))
            assert self._scores_state() == before, f"a rejected {spoil} input ({kind}) changed the scores"
            return real_end(weights, keys, observed)

        rt.end_step = end_step
        try:
            self.step()
        finally:
            del rt.end_step

    def _bad_step(self, req, kind, index):
        rt = self.rt
        if kind == "end_first":
            return self._rejected(E.StepOrderError, rt.end_step, {})
        if kind == "not_mapping":  # appends as a list of pairs, or of ids
            bad = [(r, 1) for r in self.table.request_ids()] if index % 2 else self.table.request_ids()
            return self._rejected(E.InvalidArgumentError, rt.begin_step, bad, names=("appends",))
        real_begin = rt.begin_step

        def begin_step(appends):
            out = real_begin(appends)
            self._rejected(E.StepOrderError, real_begin, appends)  # a second begin while the step is open
            return out

        rt.begin_step = begin_step
        try:
            self.step()
        finally:
            del rt.begin_step

    def _bad_arg(self, req, kind, index):
        """Arguments of the queries and checks no other rule passes wrongly."""
        pool, occ, rt = self.pool, self.table.occupancy, self.rt
        if kind == "admit_len":
            value = (-1, 1.5, True, "3")[index % 4]
            return self._rejected(E.InvalidArgumentError, rt.can_admit, value, names=("prompt_len",))
        if kind == "block_live":
            value = (pool.num_blocks, -1, 1.0, True)[index % 4]
            return self._rejected(E.BlockOutOfRangeError, occ.block_live, value, names=("block",))
        if kind == "holders":
            value = (pool.num_blocks * self.S, -1, 1.0, None)[index % 4]
            return self._rejected(E.BlockOutOfRangeError, occ.holders, value, names=("slot",))
        if kind == "int_subclass":  # an IntEnum member is an int: accepted like the int it equals
            b = index % pool.num_blocks
            member = enum.IntEnum("BlockId", {"b": b}).b
            assert pool.ref_count(member) == pool.ref_count(b), "an int subclass block id read another count"
            return
        if not self._running(req):
            return
        if kind == "grow_count":
            value = (-1, 1.5, True, "1")[index % 4]
            return self._rejected(E.InvalidArgumentError, rt.blocks_to_grow, req, value, names=("n_new",))
        value = (5, "ab", None, {0: 1})[index % 4]  # sync_blocks: a block list that is not a sequence
        self._rejected(E.BlockOutOfRangeError, self.table.sync_new_tokens, req, value, self.table.total_len(req),
                       names=("new blocks",))

    def _bad_remove(self, req, kind, index):
        """The engine removes a request whose plan is in flight (vLLM's order: out of the table first) and
        hands the manager a block list missing a block the pending copy reads: refused, naming the block;
        then the right list."""
        if self._running(req) and req not in self.manager.inflight and self.profile.planner is not None:
            self.plan_now(req)  # a plan whose copy reads the request's blocks (PLANNED: launched or not, it reads)
        rec = self.manager.inflight.get(req) if self._running(req) else None
        if rec is None:
            return
        blocks = self.table.block_ids(req)
        read = sorted((set(rec.plan.src_blocks) | {m.src_block for m in rec.plan.moves}) & set(blocks))
        if not read:
            return
        mid_copy = self._in_flight_copy(req)
        self.table.remove_request(req)
        self.rt.scores.remove_request(req)
        b = read[index % len(read)]
        self._rejected(E.BlockNotOwnedError, self.manager.on_request_removed, req, [x for x in blocks if x != b],
                       names=(f"request {req!r}", f"blocks [{b}]"))
        self.manager.on_request_removed(req, blocks)
        for d in (self.content, self.shadow, self.prefill):
            d.pop(req, None)
        EVENTS["finished_mid_copy"] += mid_copy

    def _bad_config(self, req, kind, index):
        """A pool or occupancy built with a bad argument: ConfigError naming it (headroom: and num_blocks)."""
        n_args = 3 if kind == "pool" else 2
        which, pick = index % n_args, index // n_args % 6  # low digits pick the argument: small indices reach all
        args = [8, 4, 1] if kind == "pool" else [8, 4]
        names = ("num_blocks", "block_size", "headroom")[which]
        args[which] = ((-1, 8, 1.5, True, "1", None) if names == "headroom" else (0, -1, 1.5, True, "4", None))[pick]
        ctor = BlockPool if kind == "pool" else SlotOccupancy
        try:
            ctor(*args)
        except E.ConfigError as e:
            want = (names, "num_blocks=8") if names == "headroom" else (names,)
            assert all(names_in(str(e), w) for w in want), \
                f"{ctor.__name__}{tuple(args)} says {str(e)!r}, not naming {want}"
        else:
            raise AssertionError(f"{ctor.__name__}{tuple(args)} was accepted; expected ConfigError")
        EVENTS["rejected_calls"] += 1

    def _bad_policy(self, req, kind, index):
        """One step whose policy answers invalidly once (a dead or duplicate victim, one too many, or it
        raises): end_step raises PolicyError and changes nothing, scores included; then ends normally."""
        rt, real_end, policy = self.rt, self.rt.end_step, self.policy

        def end_step(weights, keys=None, observed=None):
            policy.misbehave, policy.misbehaved = kind, None
            before = (self.state(), self._scores_state())
            try:
                out = real_end(weights, keys, observed)
            except E.PolicyError:
                assert policy.misbehaved == kind, "end_step raised PolicyError for a valid answer"
                assert (self.state(), self._scores_state()) == before, \
                    f"a refused policy answer ({kind}) changed the state or the scores"
                EVENTS["rejected_calls"] += 1
                return real_end(weights, keys, observed)
            finally:
                policy.misbehave = None
            assert policy.misbehaved is None, f"end_step accepted the policy's invalid answer ({kind})"
            return out

        rt.end_step = end_step
        try:
            self.step()
        finally:
            del rt.end_step
