"""``FastTable``: the core's ``TokenTable`` interface, errors and state over ``FastLayout`` and its kernels.

One method per core mutation this path needs (``sync_new_tokens``, ``evict_tokens``, densify's plan and commit as
one call, ``remove_request``), each a kernel call after the argument checks the core makes in Python (types: an
int is an int and never a bool). A kernel's refusal becomes the core's error class with the core's message, naming
the same culprit; an accepted call changes exactly what the core's would (``state()`` is the core's shape:
tests/test_fastpath_table.py compares them after every operation).

A request is a row; ``add_request`` takes the lowest free one. The layout's capacity (rows, tokens per request,
blocks per request) is a limit the core does not have: past it the call is refused with ``ConfigError`` naming the
limit, before anything changes.
"""

from __future__ import annotations

from array import array
from itertools import accumulate, chain
from operator import is_
from typing import Sequence

import numpy as np

from vtoken.core.checks import as_list, check_int, check_request_id, is_int
from vtoken.core.errors import (BlockListTooShortError, BlockNotOwnedError, BlockOutOfRangeError, ConfigError,
                                DuplicateRequestError, InvalidArgumentError, InvariantViolation, TokenAlreadyEvictedError,
                                TokenOutOfRangeError, UnknownRequestError)
from vtoken.core.live_index import NO_SLOT
from vtoken.core.plan import NoPlan, NoPlanReason, Plan, PlanKind
from vtoken.core.policies import RandomPolicy, StreamingLLM

from . import kernels as K
from .layout import (M_EMPTIED, M_IN_USE, M_LAST_SYNC_START, M_LAYOUT_VERSION, M_NBLOCKS, M_NUM_LIVE, M_TOTAL_LEN,
                     M_WRITE_POS, NO_POS, P_LIVE_SLOTS, Capacity, FastLayout)
from .moves import MoveArray


_INT, _LIST = frozenset((int,)), frozenset((list,))  # ``sync_many``'s usual items' classes


class FastTable:
    def __init__(self, num_blocks: int, block_size: int, rows: int, tokens: int) -> None:
        self.cap = Capacity(rows=rows, tokens=tokens, num_blocks=num_blocks, block_size=block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layout = FastLayout(self.cap)
        self._L = self.layout.arrays()
        self._rows: dict[object, int] = {}  # request -> row, in admission order (the core's dict order)
        self._free_rows = list(range(rows - 1, -1, -1))  # popped from the end: lowest row first
        # ``rows_of``'s last two answers, by the very id objects asked for: a step asks for vLLM's scheduled order and
        # for the admission order, twice each. NOTE: emptied whenever a row is taken or given back.
        self._recent: list[tuple[list, np.ndarray]] = []
        self._scratch = np.empty(max(tokens, self.cap.max_positions), np.int64)
        self._moves = np.empty((self.cap.max_positions, 3), np.int64)
        self._no_states = np.zeros(rows, np.uint64)  # StreamingLLM draws nothing
        self._step = _StepBuffers(rows)
        self._sync_out = np.empty(4 * rows + 1, np.int64)  # sync_step's record, grown to the largest step seen

    # ---- registration ------------------------------------------------------------------
    def add_request(self, req_id: object) -> None:
        check_request_id(req_id)
        if req_id in self._rows:
            raise DuplicateRequestError(f"request {req_id!r} is already registered")
        if not self._free_rows:
            raise ConfigError(f"request {req_id!r}: the fast path's {self.cap.rows} rows are all in use "
                              f"(its capacity is vLLM's max_num_seqs)")
        row = self._free_rows.pop()
        self._rows[req_id], self._recent = row, []
        self.layout.meta[row, M_IN_USE] = 1

    def remove_request(self, req_id: object) -> list[int]:
        row = self._row(req_id)
        code, nb, _ = K.clear_row(*self._L, row, self._scratch)
        assert code == K.OK
        del self._rows[req_id]
        self._recent = []
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)
        return self._scratch[:nb].tolist()

    def __contains__(self, req_id: object) -> bool:
        try:
            return req_id.__class__ is not bool and req_id in self._rows
        except TypeError:
            return False

    def request_ids(self) -> list[object]:
        return list(self._rows)

    # ---- mutations ---------------------------------------------------------------------
    def sync_new_tokens(self, req_id: object, block_ids: Sequence[int], total_len: int) -> list[int]:
        row = self._row(req_id)
        new = self._sync_args(req_id, self.layout.meta.item(row, M_TOTAL_LEN), block_ids, total_len)
        # NOTE: past the layout's tokens per row the kernel refuses after the core's checks; a total_len too large
        # for an int64 is clamped for it (nothing that large fits a row)
        code, a, b = K.sync(*self._L, row, np.asarray(new, np.int64), min(total_len, 2**62), self._scratch)
        if code != K.OK:
            self._raise(code, a, b, req_id, row, new, total_len)
        return self._scratch[:a].tolist()

    def evict_token(self, req_id: object, token_id: int) -> None:
        self.evict_tokens(req_id, (token_id,))

    def evict_tokens(self, req_id: object, token_ids: Sequence[int]) -> list[int]:
        row = self._row(req_id)
        ids = self._evict_args(req_id, row, token_ids)
        code, a, b = K.evict(*self._L, row, np.asarray(ids, np.int64), self._scratch)
        if code != K.OK:
            self._raise(code, a, b, req_id, row)
        return self._scratch[:len(ids)].tolist()

    def densify(self, req_id: object, evicted_positions: Sequence[int] | None = None) -> Plan | NoPlan:
        """``plan_densify`` on the request's layout and, when it plans, the plan's commit (the moves, the tail's
        release, the cursor at n_live), in one kernel call. Returns the plan (as the core's planner would make it,
        with the version it was planned at) or the NoPlan. ``evicted_positions``: where this step's evictions were
        (``evict_tokens``' answer), for the O(evicted) search of the holes."""
        row = self._row(req_id)
        meta = self.layout.meta
        version = (int(meta[row, M_LAYOUT_VERSION]), int(meta[row, M_TOTAL_LEN]))
        n = int(meta[row, M_NUM_LIVE])
        evicted = np.asarray(evicted_positions if evicted_positions is not None else (), np.int64)
        code, a, b = K.densify(*self._L, row, evicted, self._moves, self._scratch)
        if code == K.DENSE_MISMATCH:
            raise InvariantViolation("I7", f"request {req_id!r}: {a} live tokens at or above n_live {n}, {b} holes "
                                           f"below it")
        planned = code == K.PLANNED
        return self._plan(req_id, code, self._fields(self._moves[:a if planned else 0]),
                          self._scratch[:b if planned else 0], version, n)

    # ---- one call per phase for a step's requests ----------------------------------------
    def sync_many(self, items: Sequence[tuple[object, Sequence[int], int]], check_only: bool = False
                  ) -> list[list[int]]:
        """``sync_new_tokens`` for each (request, new blocks, total_len), in one kernel call, all or none: each item
        is checked against what the items before it left (the core's loop: a later request may share a block an
        earlier one filled in the same call), and a refusal (the core's error for the first bad item) undoes the
        items already synced, so every request is as it was. ``check_only``: the core's checks alone (not the
        layout's capacity), changing nothing; returns []."""
        ids, news, totals = [r for r, _, _ in items], [new for _, new, _ in items], [t for _, _, t in items]
        try:
            rows = self.rows_of(ids)
        except UnknownRequestError:
            for r, new, total in items:  # the core's order: an earlier item's bad arguments are refused first
                self._sync_args(r, self.layout.meta.item(self._row(r), M_TOTAL_LEN), new, total)
            raise
        # NOTE: a step's usual items (int lengths not below the synced ones, lists of new blocks in the pool, mostly
        # empty) are checked in one pass for all (the lengths by the kernel, before it changes anything); any other
        # item sends the step through the core's checks one by one, in its order
        # (C-level passes: ``set(map(type, ...))`` is every element's exact class, so a bool is not usual)
        usual = set(map(type, totals)) <= _INT and set(map(type, news)) <= _LIST and (not totals or max(totals) < 2**62)
        flat = list(chain.from_iterable(news)) if usual else []
        usual = usual and (not flat or set(map(type, flat)) <= _INT and min(flat) >= 0 and max(flat) < self.num_blocks)
        code = K.NOT_USUAL
        if usual:
            code, i, a, b = self._sync_step(rows, ids, totals, news, check_only, flat)
        if code == K.NOT_USUAL:
            news = [self._sync_args(r, before, new, total)
                    for (r, new, total), before in zip(items, self.layout.meta[rows, M_TOTAL_LEN].tolist())]
            totals = [min(total, 2**62) for total in totals]  # as sync_new_tokens: the kernel refuses past the layout's
            code, i, a, b = self._sync_step(rows, ids, totals, news, check_only)
        if code != K.OK and not (check_only and code in (K.OVER_TOKENS, K.OVER_BLOCKS)):
            r, new, total = items[i]
            holder_pos, rows = None, rows.tolist()
            if code == K.SHARED_UNFILLED_HOLDER and b in rows[:i]:  # the holder's cursor as its sync in this call left it
                j = rows.index(b)
                holder_pos = int(self.layout.meta[b, M_WRITE_POS]) + totals[j] - int(self.layout.meta[b, M_TOTAL_LEN])
            self._raise(code, a, b, r, rows[i], list(new), total, holder_pos)
        if check_only:
            return []
        n = len(items)
        record = self._sync_out[:b].tolist()  # slots' starts [n + 1] | slots
        slots = record[n + 1:]
        return list(map(slots.__getitem__, map(slice, record[:n], record[1:n + 1])))

    def _sync_step(self, rows: np.ndarray, ids: list, totals: list[int], news: list[list[int]], check_only: bool,
                   flat: list[int] | None = None) -> tuple[int, int, int, int]:
        """``K.sync_step`` of the items (checked: int lengths below 2**62, lists of int blocks in the pool; ``flat``:
        the new blocks concatenated, if the caller has them), into the kept record buffer, grown when the kernel
        asks for more."""
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"a request is named twice in one sync: {ids[:8]}")
        totals_, starts = np.array(totals, np.int64), np.array([0, *accumulate(map(len, news))], np.int64)
        blocks = np.array(list(chain.from_iterable(news)) if flat is None else flat, np.int64)
        while True:
            code, i, a, b = K.sync_step(*self._L, rows, totals_, starts, blocks, self.cap.tokens, self._sync_out,
                                        not check_only)
            if code != K.NEED_SPACE:
                return code, i, a, b
            self._sync_out = np.empty(2 * a, np.int64)

    def _evict_args(self, req_id: object, row: int, token_ids: object) -> list[int]:
        """``evict_tokens``' first check, made in Python in the core's order: every id an int in [0, total_len)
        (the kernel cannot take what is not an int64). Returns the ids as a list."""
        ids = as_list("request {!r}: tokens to evict", token_ids, TokenOutOfRangeError, req_id)
        total = int(self.layout.meta[row, M_TOTAL_LEN])
        for t in ids:
            if t.__class__ is not int and not is_int(t) or not 0 <= t < total:
                raise TokenOutOfRangeError(f"request {req_id!r}: token {t!r} outside its synced tokens [0, {total})")
        return ids

    def _sync_args(self, req_id: object, synced: int, block_ids: object, total_len: object) -> list[int]:
        """``sync_new_tokens``' checks made in Python, in the core's order (total_len an int not below the request's
        ``synced`` length, then every new block an int in the pool); returns the new blocks as a list. The kernel
        checks the rest."""
        if total_len.__class__ is not int and not is_int(total_len):
            raise TokenOutOfRangeError(f"request {req_id!r}: total_len {total_len!r} is not an int")
        if total_len < synced:
            raise TokenOutOfRangeError(f"request {req_id!r}: total_len {total_len!r} is below the synced length {synced}")
        new = as_list("request {!r}: new blocks", block_ids, BlockOutOfRangeError, req_id)
        # NOTE: most steps add no block to a request: the checks of its new blocks cost nothing then
        if new and (not all(b.__class__ is int or is_int(b) for b in new)
                    or any(not 0 <= b < self.num_blocks for b in new)):
            self._refuse_blocks(req_id, new)  # raises, naming the first bad block as the core does
        return new

    def evict_many(self, items: Sequence[tuple[object, Sequence[int]]]) -> list[list[int]]:
        """``evict_tokens`` for each (request, victims), in one kernel call, all or none."""
        rows, starts, ids = [], [0], []
        for r, victims in items:
            row = self._row(r)
            victims = self._evict_args(r, row, victims)
            rows.append(row)
            ids += victims
            starts.append(len(ids))
        if len(set(rows)) != len(rows):
            raise InvalidArgumentError(f"a request is named twice in one eviction: {[r for r, _ in items][:8]}")
        out = np.empty(max(len(ids), 1), np.int64)
        code, i, a, b = K.evict_batch(*self._L, np.asarray(rows, np.int64), np.asarray(starts, np.int64),
                                      np.asarray(ids, np.int64), out)
        if code != K.OK:
            self._raise(code, a, b, items[i][0], rows[i])
        return [out[starts[k]:starts[k + 1]].tolist() for k in range(len(items))]

    def densify_many(self, items: Sequence[tuple[object, Sequence[int] | None]]) -> list[Plan | NoPlan]:
        """``densify`` for each (request, its step's evicted positions or None), in order, in one kernel call."""
        rows, starts, evicted, before = [], [0], [], []
        meta = self.layout.meta
        for r, positions in items:
            row = self._row(r)
            rows.append(row)
            before.append((int(meta[row, M_LAYOUT_VERSION]), int(meta[row, M_TOTAL_LEN]), int(meta[row, M_NUM_LIVE])))
            evicted += list(positions or ())
            starts.append(len(evicted))
        n = len(rows)
        at = np.asarray(rows, np.int64)
        # NOTE: the kernels do not check their output arrays' bounds: each is sized for the worst case here (a row
        # moves at most its dead positions before the cursor, and releases at most its blocks)
        moves = np.empty((int((meta[at, M_WRITE_POS] - meta[at, M_NUM_LIVE]).sum()) + 1, 3), np.int64)
        released = np.empty(int(meta[at, M_NBLOCKS].sum()) + 1, np.int64)
        move_start, released_start, status = (np.zeros(n + 1, np.int64), np.zeros(n + 1, np.int64),
                                              np.zeros(max(n, 1), np.int64))
        code, i, a, b = K.densify_batch(*self._L, at, np.asarray(starts, np.int64), np.asarray(evicted, np.int64),
                                        moves, move_start, released, released_start, status)
        if code == K.DENSE_MISMATCH:
            raise InvariantViolation("I7", f"request {items[i][0]!r}: {a} live tokens at or above n_live, {b} holes "
                                           f"below it")
        codes, ms, rs = status.tolist(), move_start.tolist(), released_start.tolist()
        moves = self._fields(moves[:ms[-1]])
        return [self._plan(r, codes[k], moves[ms[k]:ms[k + 1]], released[rs[k]:rs[k + 1]], before[k][:2], before[k][2])
                for k, (r, _) in enumerate(items)]

    # ---- built-in victim choice ----------------------------------------------------------
    def streaming_victims(self, req_id: object, sinks: int, budget: int) -> list[int]:
        """``StreamingLLM(sinks).select_victims`` of the request at ``budget`` live tokens, on the dense path (the
        tokens of blocks another request lists are protected): ascending ids. Changes nothing."""
        return self.streaming_victims_many([(req_id, budget)], sinks)[0]

    def streaming_victims_many(self, items: Sequence[tuple[object, int]], sinks: int) -> list[list[int]]:
        """``streaming_victims`` for each (request, budget), in one kernel call."""
        check_int("sinks", sinks, 0)
        rows = []
        for r, budget in items:
            rows.append(self._row(r))
            check_int(f"request {r!r}: budget", budget, 1)
        at = np.asarray(rows, np.int64)
        meta = self.layout.meta
        out = np.empty(int(np.maximum(meta[at, M_NUM_LIVE] - np.asarray([b for _, b in items], np.int64), 0).sum()) + 1,
                       np.int64)
        starts = np.zeros(len(rows) + 1, np.int64)
        K.streaming_victims_batch(*self._L, at, sinks, np.asarray([b for _, b in items], np.int64), starts, out)
        return [out[starts[k]:starts[k + 1]].tolist() for k in range(len(rows))]

    def random_victims(self, req_id: object, keep_recent: int, budget: int, state: int) -> list[int]:
        """``RandomPolicy(keep_recent).select_victims`` of the request at ``budget`` live tokens, on the dense path,
        with ``state`` its ``random_policy.request_state``: ascending ids. Changes nothing."""
        check_int("keep_recent", keep_recent, 0)
        row = self._row(req_id)
        check_int(f"request {req_id!r}: budget", budget, 1)
        out = np.empty(max(int(self.layout.meta[row, M_NUM_LIVE]) - budget, 0) + 1, np.int64)
        _, k, _ = K.random_victims(*self._L, row, keep_recent, budget, np.uint64(state), out)
        return out[:k].tolist()

    def evict_densify_many(self, items: Sequence[tuple[object, int]], policy: StreamingLLM | RandomPolicy,
                           states: np.ndarray | None = None) -> list[tuple[list[int], Plan | NoPlan]]:
        """The dense path's eviction step for a built-in policy in one kernel call: for each (request, budget), in
        order, its victims (``streaming_victims``, or ``random_victims`` with ``states[row]`` the row's draw
        state), their eviction, and ``densify`` with their positions. Returns each request's (victims, plan or
        NoPlan)."""
        rows = [self._row(r) for r, _ in items]
        budgets = np.asarray([check_int(f"request {r!r}: budget", b, 1) for r, b in items], np.int64)
        if len(set(rows)) != len(rows):
            raise InvalidArgumentError(f"a request is named twice in one eviction: {[r for r, _ in items][:8]}")
        step = self.evict_densify_rows(np.asarray(rows, np.int64), budgets, policy, states, [r for r, _ in items])
        return [(step.victims_of(k), step.plan(k)) for k in range(len(items))]

    def evict_densify_rows(self, rows: np.ndarray, budgets: np.ndarray, policy: StreamingLLM | RandomPolicy,
                           states: np.ndarray | None, req_ids: list) -> "EvictStep":
        """``evict_densify_many`` for rows already checked (distinct rows in use, budgets >= 1, int64 arrays),
        answered as one record (``EvictStep``). ``req_ids``: each row's request, for the errors and the plans."""
        kind, param = self._policy_args(policy, states)
        meta, n, buf = self.layout.meta, len(rows), self._step
        buf.due[:n], buf.rows[:n], buf.budgets[:n] = np.arange(n), rows, budgets
        buf.at[:2 * n:2], buf.at[1:2 * n:2] = meta[rows, M_LAYOUT_VERSION], meta[rows, M_TOTAL_LEN]
        buf.sizes[:] = (int(np.maximum(meta[rows, M_NUM_LIVE] - budgets, 0).sum()) + 1,
                        int((meta[rows, M_WRITE_POS] - meta[rows, M_NUM_LIVE]
                             + np.maximum(meta[rows, M_NUM_LIVE] - budgets, 0)).sum()),
                        int(meta[rows, M_NBLOCKS].sum()) + 1)
        return self._evict_rows(n, kind, param, states, np.zeros(self.cap.rows, np.int64), req_ids)

    def evict_step(self, rows: np.ndarray, budget: float | int, evict_every: int, policy: StreamingLLM | RandomPolicy,
                   states: np.ndarray | None, admission: np.ndarray, req_ids: list) -> "EvictStep | None":
        """The runtime's eviction step for ``rows`` (``req_ids``' rows, distinct, in use): the rows due by the cadence
        (``K.due_rows``: at least ``evict_every`` live tokens over ``budget``), then ``evict_densify_many`` of them
        at their budgets, answered as one record whose plans are in admission order (``admission`` per row).
        None when no row is due."""
        kind, param = self._policy_args(policy, states)
        buf = self._step
        fixed, ratio = (budget, 0.0) if budget.__class__ is int else (0, budget)
        m = K.due_rows(self.layout.meta, rows, ratio, fixed, evict_every, buf.due, buf.rows, buf.budgets, buf.at,
                       buf.sizes)
        return self._evict_rows(m, kind, param, states, admission, req_ids) if m else None

    def evict_gather_step(self, rows: np.ndarray, budget: float | int, evict_every: int,
                          policy: StreamingLLM | RandomPolicy, states: np.ndarray | None, req_ids: list
                          ) -> tuple[dict[object, list[int]], dict[object, list[int]], dict, tuple]:
        """The gather path's eviction step for ``rows`` (``req_ids``' rows, distinct, in use): the rows due by the
        cadence (``K.due_rows``), their victims (nothing protected: the gather path reads any slot) and their
        eviction, in one kernel call (``K.evict_policy_batch``). Returns (victims, the positions they held, by
        request, for the requests that lost tokens, in ``req_ids``' order; the requests whose evictions emptied a
        block of their list, in that order (a dict's keys); the victims flat: (due rows, starts, victims), views valid until the next step)."""
        kind, param = self._policy_args(policy, states)
        buf, meta = self._step, self.layout.meta
        fixed, ratio = (budget, 0.0) if budget.__class__ is int else (0, budget)
        m = K.due_rows(meta, rows, ratio, fixed, evict_every, buf.due, buf.rows, buf.budgets, buf.at, buf.sizes)
        if not m:
            return {}, {}, set(), (buf.rows[:0], buf.vstart[:1], buf.victims[:0])
        buf.fit(int(buf.sizes[0]), 0, 0)
        due_rows, starts = buf.rows[:m], buf.vstart[:m + 1]
        emptied_before = meta[due_rows, M_EMPTIED]
        K.evict_policy_batch(*self._L, due_rows, kind, param, buf.budgets[:m],
                             self._no_states if states is None else states, False, starts, buf.victims, buf.positions)
        n = int(starts[m])
        at, victims, positions = starts.tolist(), buf.victims[:n].tolist(), buf.positions[:n].tolist()
        emptied = (meta[due_rows, M_EMPTIED] != emptied_before).tolist()
        lost, where, dead = {}, {}, {}
        for k, i in enumerate(buf.due[:m].tolist()):
            if at[k + 1] > at[k]:
                r = req_ids[i]
                lost[r], where[r] = victims[at[k]:at[k + 1]], positions[at[k]:at[k + 1]]
                if emptied[k]:
                    dead[r] = None
        return lost, where, dead, (due_rows, starts, buf.victims[:n])

    def _policy_args(self, policy, states) -> tuple[int, int]:
        if type(policy) is StreamingLLM:
            return K.STREAMING, check_int("sinks", policy.sinks, 0)
        if type(policy) is RandomPolicy and isinstance(states, np.ndarray) and states.dtype == np.uint64 \
                and states.shape == (self.cap.rows,):
            return K.RANDOM, check_int("keep_recent", policy.keep_recent, 0)
        raise InvalidArgumentError(f"the fast path chooses victims for StreamingLLM, or Random with a uint64 draw "
                                   f"state per row, not {policy!r}")

    def _evict_rows(self, m: int, kind: int, param: int, states, admission: np.ndarray, req_ids: list) -> "EvictStep":
        """``K.evict_densify_batch`` of the ``m`` rows the step buffers hold (rows, budgets, (version, total_len),
        their index in ``req_ids``; ``sizes``: the outputs' bounds), then ``K.step_record`` of its answer, read
        with one conversion."""
        buf = self._step
        buf.fit(*buf.sizes.tolist())
        v1, r1 = buf.vstart[:m + 1], buf.released_start[:m + 1]
        code, i, a, b = K.evict_densify_batch(*self._L, buf.rows[:m], kind, param, buf.budgets[:m],
                                              self._no_states if states is None else states, v1, buf.victims,
                                              buf.positions, buf.moves, buf.move_start[:m + 1], buf.released, r1,
                                              buf.status[:m])
        if code == K.DENSE_MISMATCH:
            raise InvariantViolation("I7", f"request {req_ids[buf.due.item(i)]!r}: {a} live tokens at or above n_live, "
                                           f"{b} holes below it")
        used = K.step_record(self.layout.meta, admission, buf.due, buf.rows, m, buf.at, buf.status, buf.vstart,
                             buf.victims, buf.moves, buf.move_start, buf.released, buf.released_start, self.block_size,
                             buf.out)
        assert used > 0, "step_record's record outgrew the bound fit() sized it for"
        # NOTE: the moves' fields, the record's tail and most of a burst's words, are copied as bytes, not as ints
        fields = used - 5 * buf.move_start.item(m)
        return EvictStep(req_ids, buf.out[:fields].tolist(), array("q", buf.out[fields:used].tobytes()),
                         self.shared_detail)

    # ---- views -------------------------------------------------------------------------
    def num_live(self, req_id: object) -> int:
        return self.layout.meta.item(self._row(req_id), M_NUM_LIVE)

    def total_len(self, req_id: object) -> int:
        return self.layout.meta.item(self._row(req_id), M_TOTAL_LEN)

    def write_pos(self, req_id: object) -> int:
        return self.layout.meta.item(self._row(req_id), M_WRITE_POS)

    def gap(self, req_id: object) -> int:
        """total_len - write_pos: how far the request's logical positions run ahead of its physical ones."""
        row, meta = self._row(req_id), self.layout.meta
        return meta.item(row, M_TOTAL_LEN) - meta.item(row, M_WRITE_POS)

    def bridge(self, req_ids: Sequence[object]) -> tuple[list[int], list[int], list[int]]:
        """Each request's (total_len, number of blocks, last block or -1), as three lists: one kernel pass for all."""
        rows = self.rows_of(req_ids)
        out = np.empty(3 * rows.shape[0], np.int64)
        K.bridge_rows(self.layout.meta, self.layout.blocks, rows, out)
        words = out.tolist()
        return words[0::3], words[1::3], words[2::3]

    def gaps(self, req_ids: Sequence[object]) -> list[int]:
        rows = self.rows_of(req_ids)
        out = np.empty(rows.shape[0], np.int64)
        K.gap_rows(self.layout.meta, rows, out)
        return out.tolist()

    def layout_version(self, req_id: object) -> int:
        return self.layout.meta.item(self._row(req_id), M_LAYOUT_VERSION)

    def num_blocks_of(self, req_id: object) -> int:
        return self.layout.meta.item(self._row(req_id), M_NBLOCKS)

    def retained_vs_ideal(self) -> tuple[int, int]:
        """Blocks the requests list, and ceil(live / S) summed over them: one kernel pass over the rows in use (vLLM
        asks every step, for its stats)."""
        return K.footprint(self.layout.meta, self.block_size)

    def block_at(self, req_id: object, index: int) -> int:
        """Block ``index`` of the request's list, O(1) (an IndexError outside it, as the core's list gives)."""
        row = self._row(req_id)
        n = self.layout.meta.item(row, M_NBLOCKS)
        if index.__class__ is not int or not -n <= index < n:
            return self.block_ids(req_id)[index]  # the list's own answer: an IndexError or a TypeError
        return self.layout.blocks.item(row, index % n)

    def shared_blocks(self, req_id: object) -> list[int]:
        """The blocks of the request's list that other requests list too, in list order."""
        listed = self.layout.listed
        return [b for b in self.block_ids(req_id) if listed[b] > 1]

    def owners(self, block_id: int) -> list[object]:
        """The requests whose block lists hold ``block_id``, in admission order (a scan: the error paths only)."""
        lay = self.layout
        return [k for k, row in self._rows.items() if block_id in lay.blocks[row, :lay.meta[row, M_NBLOCKS]]]

    def slot_of(self, req_id: object, token_id: int) -> int:
        """The token's slot, or NO_SLOT if it was evicted (``TokenOutOfRangeError`` outside its synced tokens)."""
        row = self._row(req_id)
        lay = self.layout
        total = int(lay.meta[row, M_TOTAL_LEN])
        if token_id.__class__ is not int and not is_int(token_id) or not 0 <= token_id < total:
            raise TokenOutOfRangeError(f"request {req_id!r}: token {token_id!r} outside its synced tokens [0, {total})")
        p = int(lay.tok_pos[row, token_id])
        return NO_SLOT if p == NO_POS else int(lay.blocks[row, p // self.block_size]) * self.block_size + p % self.block_size

    def live_token_ids(self, req_id: object) -> list[int]:
        row = self._row(req_id)
        return np.flatnonzero(self.layout.tok_pos[row, :self.layout.meta[row, M_TOTAL_LEN]] != NO_POS).tolist()

    def block_ids(self, req_id: object) -> list[int]:
        row = self._row(req_id)
        return self.layout.blocks[row, :self.layout.meta[row, M_NBLOCKS]].tolist()

    def slots(self, req_id: object) -> list[int]:
        """Every synced token's slot (NO_SLOT when evicted), in logical order: the core's slot array."""
        row = self._row(req_id)
        return self.token_slots(row, np.arange(self.layout.meta[row, M_TOTAL_LEN])).tolist()

    def token_slots(self, row: int, ids: np.ndarray) -> np.ndarray:
        """The slot of each of ``ids`` (tokens of layout row ``row``, below its synced length), NO_SLOT for an evicted
        one, in one vector pass."""
        lay, S = self.layout, self.block_size
        pos = lay.tok_pos[row, ids].astype(np.int64)
        live = pos != NO_POS
        out = np.full(pos.shape[0], NO_SLOT, np.int64)
        out[live] = lay.blocks[row, pos[live] // S].astype(np.int64) * S + pos[live] % S
        return out

    def read_lists(self, req_id: object) -> tuple[list[int], list[int]]:
        """(live token ids, their slots) in logical order: the gather path's read list."""
        row = self._row(req_id)
        ids = np.flatnonzero(self.layout.tok_pos[row, :self.layout.meta[row, M_TOTAL_LEN]] != NO_POS)
        return ids.tolist(), self.token_slots(row, ids).tolist()

    def shared_masks(self, req_id: object) -> dict[int, int]:
        """The core's ``shared`` map: for each block of the list another request lists too, the bitmask of this
        request's live offsets in it."""
        row = self._row(req_id)
        lay, S = self.layout, self.block_size
        out = {}
        for i, b in enumerate(self.block_ids(req_id)):
            if lay.listed[b] > 1:
                live = lay.pos_token[row, i * S:(i + 1) * S] != NO_POS
                out[b] = sum(1 << o for o in np.flatnonzero(live).tolist())
        return out

    def block_live_counts(self, req_id: object) -> dict[int, int]:
        row = self._row(req_id)
        nb = self.layout.meta[row, M_NBLOCKS]
        return dict(zip(self.layout.blocks[row, :nb].tolist(), self.layout.counts[row, :nb].tolist()))

    def state(self) -> tuple:
        """``TokenTable.state()``'s tuple: every request's fields, then the pool's occupancy."""
        lay = self.layout
        rows = tuple(
            (k, array("i", self.slots(k)).tobytes(), tuple(self.block_ids(k)), tuple(sorted(self.shared_masks(k).items())),
             self.write_pos(k), self.num_live(k), self.layout_version(k), int(lay.meta[row, M_LAST_SYNC_START]))
            for k, row in self._rows.items())
        occupancy = (lay.holders.tobytes(), lay.block_live.astype(np.uint32).tobytes(), int(lay.pool[P_LIVE_SLOTS]))
        return rows, occupancy

    def check_views(self) -> None:
        """Recount every maintained array from the rows' token -> position maps and block lists, O(rows x tokens +
        pool): the inverse map, the per-block live counts, the live bitset and its per-word and per-group counts,
        the listings, the slots' holders, each block's occupied slots and the pool's live slots. The first that
        differs raises ``InvariantViolation("V6")`` naming it (the oracle of the views, as ``check_live_index`` is
        the core's)."""
        lay, S = self.layout, self.block_size
        listed = np.zeros_like(lay.listed, dtype=np.int64)
        holders = np.zeros(lay.holders.shape[0], np.int64)
        for req_id, row in self._rows.items():
            total, nb = int(lay.meta[row, M_TOTAL_LEN]), int(lay.meta[row, M_NBLOCKS])
            pos = lay.tok_pos[row, :total].astype(np.int64)
            live = np.flatnonzero(pos != NO_POS)
            p = pos[live]
            back = np.full(lay.pos_token.shape[1], NO_POS, np.int64)
            back[p] = live
            W = lay.live_bits.shape[1]
            bits = np.zeros(W, np.uint64)
            np.bitwise_or.at(bits, live // 64, np.left_shift(np.uint64(1), (live % 64).astype(np.uint64)))
            words = np.bincount(live // 64, minlength=W)
            groups = np.add.reduceat(words, np.arange(0, W, 64)) if W else words
            for name, got, want in (
                    ("position -> token", lay.pos_token[row], back),
                    ("per-block live counts", lay.counts[row, :nb], np.bincount(p // S, minlength=nb)[:nb]),
                    ("live bitset", lay.live_bits[row], bits),
                    ("per-word live counts", lay.word_live[row], words),
                    ("per-group live counts", lay.group_live[row], groups),
                    ("live count", lay.meta[row, M_NUM_LIVE], live.shape[0])):
                if not np.array_equal(got, want):
                    raise InvariantViolation("V6", f"request {req_id!r}: the fast table's {name}: not what a recount gives")
            blocks = lay.blocks[row, :nb].astype(np.int64)
            np.add.at(listed, blocks, 1)
            np.add.at(holders, blocks[p // S] * S + p % S, 1)
        occupied = (holders > 0).reshape(-1, S)
        for name, got, want in (("listings", lay.listed, listed), ("slot holders", lay.holders, holders),
                                ("blocks' occupied slots", lay.block_live, occupied.sum(axis=1)),
                                ("pool's live slots", lay.pool[P_LIVE_SLOTS], int(occupied.sum()))):
            if not np.array_equal(got, want):
                raise InvariantViolation("V6", f"the fast table's {name}: not what a recount gives")

    # ---- helpers -----------------------------------------------------------------------
    def rows_of(self, req_ids: Sequence[object]) -> np.ndarray:
        """Each request's row, as an int64 array: one C-level pass over the index for a step's requests (``_row``'s
        error for the first unknown one), or a recent answer for a list of the same id objects (compared by identity,
        no id touched). NOTE: a bool is no request id (``_row``), though ``True`` finds the row of a request named 1
        in the index: any bool sends the call through ``_row``. NOTE: callers read the array, never write it."""
        if req_ids.__class__ is list:
            n = len(req_ids)
            for ids, rows in self._recent:
                if len(ids) == n and all(map(is_, ids, req_ids)):
                    return rows
        try:
            if bool not in set(map(type, req_ids)):
                rows = np.fromiter(map(self._rows.__getitem__, req_ids), np.int64, len(req_ids))
                if req_ids.__class__ is list:
                    self._recent = [(list(req_ids), rows), *self._recent[:1]]
                return rows
        except (KeyError, TypeError):
            pass
        return np.array([self._row(r) for r in req_ids], np.int64)

    def _row(self, req_id: object) -> int:
        try:
            if req_id.__class__ is bool:
                raise KeyError(req_id)
            return self._rows[req_id]
        except (KeyError, TypeError):
            raise UnknownRequestError(f"unknown request {req_id!r}") from None

    def _refuse_blocks(self, req_id: object, new: list) -> None:
        """The core's checks of new blocks, in its order, for a list holding a block that is not an int in the
        pool (the kernel takes only int64 block ids)."""
        listed = set(self.block_ids(req_id))
        seen: set[int] = set()
        for b in new:
            if b.__class__ is not int and not is_int(b) or not 0 <= b < self.num_blocks:
                raise BlockOutOfRangeError(f"block {b!r} outside the pool [0, {self.num_blocks})")
            if b in seen or b in listed:
                raise BlockNotOwnedError(f"request {req_id!r}: block {b} is already in its block list")
            seen.add(b)
        raise AssertionError("unreachable: a non-int block passed the checks")  # pragma: no cover

    def _fields(self, moves: np.ndarray) -> np.ndarray:
        """The kernels' (token, source slot, destination slot) rows as ``Move``'s five fields, int64, one row each
        (computed once for a batch's moves; each plan packs its own rows)."""
        S, out = self.block_size, np.empty((moves.shape[0], 5), np.int64)
        out[:, 0] = moves[:, 0]
        np.divmod(moves[:, 1], S, out[:, 1], out[:, 2])
        np.divmod(moves[:, 2], S, out[:, 3], out[:, 4])
        return out

    def _plan(self, req_id: object, status: int, moves: np.ndarray, released: np.ndarray, version: tuple[int, int],
              n_live: int) -> Plan | NoPlan:
        """A densify kernel's answer for one request as the core's planner gives it: the ``Plan``, its moves a
        ``MoveArray`` packed from ``moves`` (``_fields``' rows), or the ``NoPlan``."""
        return _plan(status, req_id, version, array("q", moves.tobytes()), released.tolist(), n_live,
                     self.shared_detail)

    def shared_detail(self, req_id: object) -> str:
        """``NoPlan(SHARED_BLOCK)``'s detail as the core's planner words it (``plan_densify``): every block another
        request lists that densifying this one would write (a hole, the new cursor's block), read (a mover's) or free
        (the tail), sorted. Read off the layout in Python, O(positions before the cursor): the kernel stops at the
        first such block, and the refusal is rare (a prefix shared with a request evicting inside it)."""
        row, S, lay = self._row(req_id), self.block_size, self.layout
        n, pos, nb = (int(lay.meta[row, c]) for c in (M_NUM_LIVE, M_WRITE_POS, M_NBLOCKS))
        blocks, at = lay.blocks[row, :nb].tolist(), lay.pos_token[row, :pos].tolist()
        touched = {blocks[p // S] for p in range(n) if at[p] == NO_POS}  # the holes'
        touched.update(blocks[p // S] for p in range(n, pos) if at[p] != NO_POS)  # the movers'
        touched.update(blocks[-(-n // S):-(-pos // S)])  # the tail's
        if n % S and n // S < nb:
            touched.add(blocks[n // S])
        return f"request {req_id!r}: blocks {sorted(b for b in touched if lay.listed[b] > 1)}"

    def _name(self, row: int) -> object:
        return next(k for k, r in self._rows.items() if r == row)

    def _raise(self, code: int, a: int, b: int, req_id: object, row: int, new=None, total_len: int = 0,
               holder_pos: int | None = None) -> None:
        meta, S = self.layout.meta, self.block_size
        if code == K.TOTAL_LEN_BELOW:
            raise TokenOutOfRangeError(f"request {req_id!r}: total_len {a} is below the synced length {b}")
        if code == K.BLOCK_OUT_OF_RANGE:
            raise BlockOutOfRangeError(f"block {a} outside the pool [0, {self.num_blocks})")
        if code == K.BLOCK_IN_LIST:
            raise BlockNotOwnedError(f"request {req_id!r}: block {a} is already in its block list")
        if code == K.LIST_TOO_SHORT:
            pos, listed, a = int(meta[row, M_WRITE_POS]), int(meta[row, M_NBLOCKS]) + b, total_len - int(meta[row, M_TOTAL_LEN])
            raise BlockListTooShortError(f"request {req_id!r}: {a} new tokens from position {pos} need {pos + a} "
                                         f"slots, its {listed} blocks hold {listed * S}")
        if code == K.SHARED_TOO_MANY:
            raise BlockNotOwnedError(f"request {req_id!r}: block {a} is already shared by {b} requests")
        if code == K.SHARED_UNFILLED_HOLDER:
            raise BlockNotOwnedError(f"request {req_id!r}: block {a} belongs to request {self._name(b)!r}, whose "
                                     f"append cursor (position "
                                     f"{int(meta[b, M_WRITE_POS]) if holder_pos is None else holder_pos}) has not "
                                     f"passed it; only "
                                     f"a full block can be shared")
        if code == K.SHARED_UNFILLED_HERE:
            start = (int(meta[row, M_NBLOCKS]) + new.index(a)) * S
            end = int(meta[row, M_WRITE_POS]) + total_len - int(meta[row, M_TOTAL_LEN])
            raise BlockNotOwnedError(f"request {req_id!r}: block {a} belongs to request {self._name(b)!r}; a shared "
                                     f"block must be filled by the sync that adds it (positions [{start}, "
                                     f"{start + S}), tokens end at {end})")
        if code == K.TOKEN_OUT_OF_RANGE:
            raise TokenOutOfRangeError(f"request {req_id!r}: token {a} outside its synced tokens [0, {b})")
        if code == K.ALREADY_EVICTED:
            raise TokenAlreadyEvictedError(f"request {req_id!r}: token {a} is already evicted")
        if code == K.NAMED_TWICE:
            raise TokenAlreadyEvictedError(f"request {req_id!r}: token {a} is named twice in one eviction")
        if code == K.OVER_TOKENS:
            raise ConfigError(f"request {req_id!r}: {total_len} tokens exceed the fast path's {b} per request (its capacity "
                              f"is vLLM's max_model_len)")
        if code == K.OVER_BLOCKS:
            raise ConfigError(f"request {req_id!r}: {a} blocks exceed the fast path's {b} per request")
        raise InvariantViolation("V6", f"request {req_id!r}: a fast path kernel answered code {code} ({a}, {b})")


class _StepBuffers:
    """The eviction step's kernel buffers, kept between steps: per row (due index, row, budget, (version, total_len),
    the starts and status), and the outputs, grown to the largest step seen (``fit``)."""

    def __init__(self, rows: int) -> None:
        self.due, self.rows, self.budgets = (np.empty(rows, np.int64) for _ in range(3))
        self.at, self.sizes = np.empty(2 * rows, np.int64), np.zeros(3, np.int64)
        self.vstart, self.move_start, self.released_start = (np.zeros(rows + 1, np.int64) for _ in range(3))
        self.status = np.zeros(rows, np.int64)
        self.victims = self.positions = self.released = self.out = np.empty(0, np.int64)
        self.moves = np.empty((0, 3), np.int64)

    def fit(self, victims: int, moves: int, released: int) -> None:
        """Outputs for up to ``victims`` victims, ``moves`` moves and ``released`` released blocks (and the record
        ``K.step_record`` makes of them, whose size those bound): grown, twice what is asked, when short."""
        record = K.HEAD + 17 * self.status.shape[0] + 1 + victims + released + 5 * moves
        if self.victims.shape[0] < victims:
            self.victims, self.positions = np.empty(2 * victims, np.int64), np.empty(2 * victims, np.int64)
        if self.moves.shape[0] < moves:
            self.moves = np.empty((2 * moves, 3), np.int64)
        if self.released.shape[0] < released:
            self.released = np.empty(2 * released, np.int64)
        if self.out.shape[0] < record:
            self.out = np.empty(2 * record, np.int64)


class EvictStep:
    """An eviction step's answer (``FastTable.evict_step``, ``evict_densify_rows``), read from ``K.step_record``'s
    record as one list (the moves' fields as one ``array('q')``): for the step's m due rows (k = 0..m-1, ``req_ids[due[k]]`` each) their status (``K.PLANNED``,
    ``ALREADY_DENSE``, ``SHARED_BLOCK``) and victims; the PLANNED rows as commits j = 0..commits-1 in admission
    order, each with its (version, total_len), cursor, moves and released blocks; the step's copies (the commits
    that move anything), packed in commit order (``copy_rows``, ``copy_starts``, ``fields``).

    NOTE: the record is a copy of the kernel's buffers (which the next step reuses): a ``Plan`` may be made from it
    at any later time, and only for a commit someone reads."""

    __slots__ = ("req_ids", "due", "status", "commit_of", "lost", "victims", "commits", "refused", "copy_rows",
                 "copy_starts", "fields", "moves", "released", "_rec", "_shared_detail")

    def __init__(self, req_ids: list, rec: list, fields: array, shared_detail) -> None:
        """``shared_detail(request)``: a SHARED_BLOCK refusal's detail (``FastTable.shared_detail``), read when a
        refused row's ``plan`` is asked for: the table has not changed that row since."""
        m, n_lost, n_commit, n_refused, n_copies, self.moves, self.released, n_victims = rec[:K.HEAD]
        w = K.HEAD
        self.status, self.commit_of = rec[w:w + m], rec[w + m:w + 2 * m]
        self.due = list(map(req_ids.__getitem__, rec[w + 2 * m:w + 3 * m]))
        self.req_ids = req_ids
        w += 3 * m
        self.lost, w = rec[w:w + 3 * n_lost], w + 3 * n_lost
        self.victims, w = rec[w:w + n_victims], w + n_victims
        self.commits, w = rec[w:w + 8 * n_commit], w + 8 * n_commit
        self.refused, w = rec[w:w + n_refused], w + n_refused + self.released
        self.copy_rows, w = rec[w:w + n_copies], w + n_copies
        self.copy_starts = rec[w:w + n_copies + 1]
        self.fields = fields
        self._rec = rec
        self._shared_detail = shared_detail

    def __len__(self) -> int:
        """Commits."""
        return len(self.commits) // 8

    def victims_by_request(self) -> dict[object, list[int]]:
        """Each due row's victims by its request, for the rows that lost a token (ascending ids, the core's order)."""
        lost = self.lost
        return dict(zip(map(self.due.__getitem__, lost[0::3]),
                        map(self.victims.__getitem__, map(slice, lost[1::3], lost[2::3]))))

    def victims_of(self, k: int) -> list[int]:
        lost = self.lost
        for i in range(0, len(lost), 3):
            if lost[i] == k:
                return self.victims[lost[i + 1]:lost[i + 2]]
        return []

    def committed_rows(self) -> list[int]:
        """The commits' rows (k), in commit order."""
        return self.commits[0::8]

    def relists(self) -> list[bool]:
        """Each commit: does it release blocks (change its request's block list)?"""
        return list(map(int.__lt__, self.commits[6::8], self.commits[7::8]))

    def released_by(self, j: int) -> list[int]:
        return self._rec[self.commits[8 * j + 6]:self.commits[8 * j + 7]]

    def fields_of(self, j: int) -> array:
        return self.fields[5 * self.commits[8 * j + 4]:5 * self.commits[8 * j + 5]]

    def plan_of(self, j: int) -> Plan:
        """Commit j's ``Plan``, as the core's planner gives it."""
        k, version, total, cursor = self.commits[8 * j:8 * j + 4]
        return _plan(K.PLANNED, self.due[k], (version, total), array("q", self.fields_of(j)), self.released_by(j),
                     cursor, self._shared_detail)

    def plan(self, k: int) -> Plan | NoPlan:
        """Due row k's plan or NoPlan as the core's planner gives it (``FastTable._plan``'s)."""
        j = self.commit_of[k]
        return self.plan_of(j) if j >= 0 else _plan(self.status[k], self.due[k], (0, 0), array("q"), [], 0,
                                                    self._shared_detail)


def _plan(status: int, req_id: object, version: tuple[int, int], moves: array, released: list[int],
          n_live: int, shared_detail) -> Plan | NoPlan:
    """A densify kernel's answer for one request as the core's planner gives it: the ``Plan`` (its moves a
    ``MoveArray`` over ``moves``, an ``array('q')`` of five fields per move), or the ``NoPlan`` (a SHARED_BLOCK
    refusal's detail from ``shared_detail(req_id)``: ``FastTable.shared_detail``)."""
    if status == K.PLANNED:
        return Plan(PlanKind.DENSIFY, req_id, version, MoveArray(moves), tuple(released), (), n_live)
    if status == K.ALREADY_DENSE:
        return NoPlan(NoPlanReason.ALREADY_DENSE, f"request {req_id!r}")
    assert status == K.SHARED_BLOCK, status
    return NoPlan(NoPlanReason.SHARED_BLOCK, shared_detail(req_id))
