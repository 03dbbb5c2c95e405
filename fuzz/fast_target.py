"""``vtoken fuzz --target fast``: the fast path (``integration/fastpath``) against the core, step by step (V6).

``FastMachine`` plays the engine vLLM is: it allocates blocks from a pool, admits requests empty, gives some a
prefix-cache hit (full blocks of a running request, or blocks an earlier request of the same step fills), marks
full blocks prefix-cached, syncs a step's tokens for a batch of requests in one call, evicts and reclaims for the
decoding ones (StreamingLLM or Random, at a ratio or a count budget, a cadence of 1 or 3, or nothing evicted) under
the pressure the engine reports, and frees what a leaving request held. On the dense path the runtime densifies; on
the gather path (issue #46) it compacts (at a drawn theta_f, sources per plan, plans per round and headroom: the
pressure round's pack included) or only releases wholly dead blocks (Naive-Evict), and each scheduled request's
read-list change is taken every step and patched into a copy of its read list, as vLLM's workers keep one. The runtime
is a ``ShadowedRuntime``: the core's ``VTokenRuntime`` beside the fast one on a replay of the same pool, compared
after every call (answers, plans in order, copies submitted, blocks freed and allocated, counters, read-list changes,
the whole table state). After every rule the fast tables' maintained views are recounted (``FastTable.check_views``),
the pool must hold exactly what the tables list, and each patched read list must be the table's. Calls the core
refuses must be refused alike and change nothing.

``FAST_BUGS``: planted bugs in the kernels' answers and in the runtime, each caught by ``--self-test``.

Rules take plain integers, so a failing program printed by Hypothesis replays as it is. numba is imported only
by this target.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vtoken.core import errors as E
from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.plan import PlanKind
from vtoken.core.policies import RandomPolicy, StreamingLLM
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadPath
from vtoken.integration.fastpath import gather_kernels as GK
from vtoken.integration.fastpath import gather_runtime
from vtoken.integration.fastpath import kernels as K
from vtoken.integration.fastpath import read_kernels as RK
from vtoken.integration.fastpath import runtime as fast_runtime
from vtoken.integration.fastpath.layout import (M_LAYOUT_VERSION, M_NBLOCKS, M_NUM_LIVE, M_RUN_POS, M_TOTAL_LEN,
                                               M_WRITE_POS)
from vtoken.integration.fastpath.reads import PAD, REPLACE, ReadTable
from vtoken.integration.fastpath.shadow import ShadowedRuntime, ShadowEngine
from vtoken.integration.fastpath.table import FastTable

from .events import EVENTS
from .planted import PlantedBug

NUM_BLOCKS, S, ROWS, TOKENS = 48, 4, 6, 64


class FastMachine(RuleBasedStateMachine):
    """The engine's side: the pool, the requests' prompts and steps; the runtime's side is the shadow."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, S)
        self.rt: ShadowedRuntime | None = None
        self.next_id = 0
        self.prompt: dict[int, int] = {}  # request -> tokens it arrived with (decoding past them)
        # gather: the workers' copy of the read lists, patched by the compiled kernel and by its numpy reference
        self.reads = (ReadTable(compiled=True), ReadTable(compiled=False))
        self._compared = 0  # the shadow's compared calls counted so far

    @initialize(policy=st.sampled_from(["none", "streaming_llm", "random", "random"]), budget=st.sampled_from([0.5, 0.75, 6, 10]),
                param=st.integers(0, 5), evict_every=st.sampled_from([1, 3]), seed=st.sampled_from([0, 11, -1]),
                path=st.sampled_from(["dense", "dense", "gather", "gather", "naive_evict"]),
                theta_f=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.9]), max_sources=st.sampled_from([1, 2, 4, 8, 8]),
                headroom=st.sampled_from([0, 1, 1, 2, 6]), check_every=st.sampled_from([1, 1, 3]),
                burst_df=st.sampled_from([None, None, 0.05]), max_plans=st.sampled_from([16, 16, 1]))
    def build(self, policy, budget, param, evict_every, seed, path, theta_f, max_sources, headroom, check_every,
              burst_df, max_plans):
        """``param``: StreamingLLM's sinks, or Random's newest tokens kept (Random draws by each request's name,
        given at admission as vLLM's plugin gives its arrival order). ``path``: the dense path, the gather path
        compacting (the ``ReclaimConfig`` of the rest), or the gather path releasing dead blocks only. ``max_plans``
        per round: at 1 a round's order (ties included) decides which request is compacted."""
        chosen = StreamingLLM(sinks=param) if policy == "streaming_llm" else \
            RandomPolicy(keep_recent=param) if policy == "random" else None
        self.names: dict = {}
        self.path = path
        config = None
        if path == "gather":
            self.pool = BlockPool(NUM_BLOCKS, S, headroom=headroom)
            config = ReclaimConfig(PlanKind.COMPACT, theta_f=theta_f, max_sources=max_sources, check_every=check_every,
                                   burst_df=burst_df, ordering=Ordering.EVENT, max_plans_per_round=max_plans)
        self.rt = ShadowedRuntime(self.pool, ShadowEngine(), chosen, budget, ROWS, TOKENS, evict_every=evict_every,
                                  seed=seed, names=self.names,
                                  read_path=ReadPath.DENSE if path == "dense" else ReadPath.GATHER, config=config)
        EVENTS["runs"] += 1
        EVENTS[f"runs_{path}"] += 1

    # ---- helpers ---------------------------------------------------------------------------------
    def running(self) -> list:
        return self.rt.running() if self.rt is not None else []

    def pick(self, index: int):
        ids = self.running()
        return ids[index % len(ids)]

    def fresh(self, n_tokens: int) -> list[int] | None:
        """Blocks for a new request's ``n_tokens`` (None: the pool is short)."""
        need = -(-n_tokens // S)
        return self.pool.allocate(need, Purpose.ADMISSION) if self.pool.can_allocate(need, Purpose.ADMISSION) else None

    def grow(self, r, n_new: int) -> list[int] | None:
        """The new blocks the engine allocates for ``n_new`` more tokens of ``r`` (None: the pool is short)."""
        need = max(0, -(-(self.rt.write_pos(r) + n_new) // S) - self.rt.num_blocks_of(r))
        if not self.pool.can_allocate(need, Purpose.ADMISSION):
            return None
        return self.pool.allocate(need, Purpose.ADMISSION) if need else []

    def admitted(self, r, prompt: int) -> None:
        self.names[r] = f"arrival-{len(self.names)}"
        self.rt.admit(r)
        self.prompt[r] = prompt

    # ---- the engine's steps ----------------------------------------------------------------------
    @precondition(lambda self: len(self.running()) < ROWS)
    @rule(prompt=st.integers(1, 20))
    def admit(self, prompt):
        blocks = self.fresh(prompt)
        if blocks is None:
            return
        r, self.next_id = self.next_id, self.next_id + 1
        self.admitted(r, prompt)
        assert self.rt.sync_many([(r, blocks, prompt)]) == [[b * S + o for b in blocks for o in range(S)][:prompt]]

    @precondition(lambda self: 0 < len(self.running()) < ROWS)
    @rule(holder=st.integers(0, 63), shared=st.integers(1, 4), extra=st.integers(0, 9))
    def admit_with_a_prefix_hit(self, holder, shared, extra):
        """A prefix-cache hit: the first full blocks of a running request (before its cursor), shared in the pool."""
        holder = self.pick(holder)
        k = min(shared, self.rt.write_pos(holder) // S)
        if k == 0:
            return
        head = self.rt.block_ids(holder)[:k]
        tail = self.fresh(extra) if extra else []
        if tail is None:
            return
        for b in head:
            self.pool.share(b)
        r, self.next_id = self.next_id, self.next_id + 1
        self.admitted(r, k * S + extra)
        self.rt.sync_many([(r, head + tail, k * S + extra)])
        EVENTS["prefix_shares"] += 1

    @precondition(lambda self: len(self.running()) < ROWS - 1)
    @rule(blocks=st.integers(1, 3), extra=st.integers(0, 6))
    def admit_two_sharing_in_one_step(self, blocks, extra):
        """vLLM caches a block once its tokens are scheduled, so a later request of the same step can hit it: a and b
        arrive together, b's first blocks are the ones a's prompt fills in this very sync."""
        head = self.fresh(blocks * S)
        if head is None:
            return
        tail = self.fresh(extra) if extra else []
        if tail is None:
            self.pool.free(head)
            return
        for b in head:
            self.pool.share(b)
        a, b, self.next_id = self.next_id, self.next_id + 1, self.next_id + 2
        self.admitted(a, blocks * S)
        self.admitted(b, blocks * S + extra)
        self.rt.sync_many([(a, head, blocks * S), (b, head + tail, blocks * S + extra)])
        assert self.rt.shared_blocks(b) == head
        EVENTS["prefix_shares_within_a_step"] += 1

    @precondition(lambda self: self.running())
    @rule(batch=st.integers(1, 2**ROWS - 1), tokens=st.lists(st.sampled_from([1, 1, 1, 2, 5]), min_size=ROWS,
                                                             max_size=ROWS),
          pressure=st.sampled_from([0, 0, 0, 1, 3]), check=st.sampled_from([False, False, True]))
    def step(self, batch, tokens, pressure, check):
        """One engine step: the requests of ``batch`` (a bit per running request) get their tokens, synced in one
        call (on the gather path their read-list changes are taken then, as vLLM's scheduler sends them, with the
        whole lists under ``check``, strict verify's); then,
        under ``pressure`` (blocks the engine is short of), the decoding ones evict and reclaim."""
        ids = self.running()
        members = [r for i, r in enumerate(ids) if batch >> i & 1] or ids[:1]
        items = []
        for r, n in zip(members, tokens):
            new = self.grow(r, n) if self.rt.total_len(r) + n <= TOKENS else None
            if new is not None:
                items.append((r, new, self.rt.total_len(r) + n))
        self.rt.sync_many(items)
        synced = {r for r, _, _ in items}
        if self.path != "dense" and items:
            self.patch_read_lists([r for r, _, _ in items], check)
        decoding = [r for r in self.running() if r in synced and self.rt.total_len(r) >= self.prompt[r]]
        self.rt.set_pressure(pressure)
        victims = self.rt.evict_and_reclaim(decoding)
        EVENTS["steps"] += 1
        EVENTS["pressure_steps"] += pressure > 0
        EVENTS["evictions"] += sum(map(len, victims.values()))
        commits = self.rt.take_commits()
        EVENTS["plans_committed"] += commits.plans
        EVENTS["releases_committed"] += commits.releases
        if self.path != "dense":
            EVENTS["packs_committed"] += commits.densified
            EVENTS["compacts_committed"] += commits.plans - commits.densified

    def patch_read_lists(self, req_ids: list, check: bool) -> None:
        """The step's read-list changes (``read_step``: the fast path's against the core's, request by request),
        patched into the workers' copy as ``WorkerTokens`` patches it (``ReadTable.apply``, under ``check`` with the
        whole lists compared), by the kernel and by its numpy reference: both copies must be the table's read lists."""
        reads = self.rt.read_step(req_ids, check)
        removed = [table.apply(reads) for table in self.reads]
        if removed[0].tolist() != removed[1].tolist():
            raise E.InvariantViolation("V2", f"the positions the evicted tokens held: {removed[0].tolist()} "
                                             f"(compiled) against {removed[1].tolist()} (numpy)")
        for r in req_ids:
            want = self.rt.fast.read_lists(r)
            for table in self.reads:
                slots, ids = table.lists(r)
                if (ids.tolist(), slots.tolist()) != want:
                    raise E.InvariantViolation("V2", f"request {r!r}: the read list patched by its changes "
                                                     f"({'compiled' if table.compiled else 'numpy'}), ids "
                                                     f"{ids[:8].tolist()}..., is not the table's")
        batches = [[a.tolist() for a in table.batch(req_ids)] for table in self.reads]  # what attention reads
        if batches[0] != batches[1]:
            raise E.InvariantViolation("V2", "the workers' batch: the compiled table's is not numpy's")
        for r, slots, ids in zip(req_ids, *batches[0]):
            n = len(self.rt.fast.read_lists(r)[0])
            if (ids[:n], slots[:n]) != self.rt.fast.read_lists(r) or set(ids[n:]) - {PAD} or set(slots[n:]) - {0}:
                raise E.InvariantViolation("V2", f"request {r!r}: the workers' batch row is not its read list, padded")
        EVENTS["read_lists_rebuilt"] += int((reads.whole == REPLACE).sum())
        EVENTS["read_lists_patched"] += int((reads.whole != REPLACE).sum())

    @precondition(lambda self: self.running())
    @rule(index=st.integers(0, 63), blocks=st.integers(1, 3))
    def cache_full_blocks(self, index, blocks):
        """vLLM hashes a block once full: the first full, private blocks of a request before its cursor become
        prefix-cached (compact leaves them unless it packs under pressure)."""
        r = self.pick(index)
        full = self.rt.block_ids(r)[:min(blocks, self.rt.write_pos(r) // S)]
        for b in full:
            if self.pool.ref_count(b) == 1 and not self.pool.is_cached(b):
                self.pool.cache(b)
                EVENTS["blocks_cached"] += 1

    @precondition(lambda self: self.running())
    @rule(index=st.integers(0, 63))
    def leave(self, index):
        """Finish or preemption: the runtime forgets the request, the engine frees its blocks."""
        r = self.pick(index)
        blocks = self.rt.detach(r)
        self.pool.free(blocks)
        for table in self.reads:
            table.forget(r)
        EVENTS["detached"] += 1

    # ---- refused calls: the same error on both sides, nothing changed -----------------------------
    @precondition(lambda self: self.running())
    @rule(kind=st.integers(0, 2), index=st.integers(0, 63))
    def refused(self, kind, index):
        """A free block synced, an unknown request, a request admitted or named twice."""
        r = self.pick(index)
        if kind == 0:
            free = self.pool.free_block_ids()
            if free and self.rt.total_len(r) < TOKENS:
                self._refused(E.BlockNotOwnedError,
                              lambda: self.rt.sync_many([(r, [free[0]], self.rt.total_len(r) + 1)]))
        elif kind == 1:
            self._refused(E.UnknownRequestError, lambda: self.rt.evict_and_reclaim([10_000]))
            self._refused(E.UnknownRequestError, lambda: self.rt.sync_many([(10_000, [], 1)]))
        else:
            self._refused(E.DuplicateRequestError, lambda: self.rt.admit(r))
            self._refused(E.InvalidArgumentError, lambda: self.rt.evict_and_reclaim([r, r]))

    @staticmethod
    def _refused(error: type, call) -> None:
        try:
            call()
        except error:
            EVENTS["rejected_calls"] += 1
            return
        raise AssertionError(f"{error.__name__} expected")

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def the_fast_views_recount(self):
        if self.rt is not None:
            self.rt.table.check_views()
            EVENTS["invariant_checks"] += 1 + self.rt.calls - self._compared  # the recount, and each compared call
            self._compared = self.rt.calls
        EVENTS["machine_steps"] += 1

    @invariant()
    def the_gauges_are_the_cores(self):
        """vLLM's stats read the fast path's gauges every step: the core's, computed request by request."""
        if self.rt is not None:
            for gauge in ("waste_ratio", "retained_vs_ideal"):
                want, got = getattr(self.rt.core, gauge)(), getattr(self.rt.fast, gauge)()
                if want != got:
                    raise E.InvariantViolation("V6", f"the fast path's {gauge}() is {got!r}, the core's {want!r}")

    @invariant()
    def the_pool_holds_what_the_tables_list(self):
        listed: dict[int, int] = {}
        for r in self.running():
            for b in self.rt.block_ids(r):
                listed[b] = listed.get(b, 0) + 1
        for b in range(NUM_BLOCKS):
            if self.pool.ref_count(b) != listed.get(b, 0):
                raise E.InvariantViolation("P1", f"block {b}: the pool counts {self.pool.ref_count(b)} references, "
                                                 f"the tables list it {listed.get(b, 0)} times")


# ---- planted bugs ---------------------------------------------------------------------------------------------
def _wrap(name: str, after) -> dict:
    """A kernel entry point whose answer ``after(args, answer)`` corrupts (the kernels are numba functions: their
    module attribute is what ``FastTable`` calls)."""
    real = getattr(K, name)

    def kernel(*args):
        out = real(*args)
        after(args, out)
        return out
    return {(K, name): kernel}


def _slot_off_by_one() -> dict:
    def after(args, out):  # sync_step(..., record, apply): the first write slot reported one past the written
        n = args[13].shape[0]  # the record: n + 1 slot starts, then the slots (``out[3]`` words in all)
        if out[0] == K.OK and args[-1] and out[3] > n + 1:
            args[-2][n + 1] += 1
    return _wrap("sync_step", after)


def _live_bit_kept_on_eviction() -> dict:
    def after(args, out):  # evict_densify_batch: the first victim's live bit stays set
        live_bits, rows, vstart, victims = args[10], args[13], args[18], args[19]
        if rows.shape[0] and vstart[1] > 0:
            t = int(victims[0])
            live_bits[rows[0], t // 64] |= np.uint64(1) << np.uint64(t % 64)
    return _wrap("evict_densify_batch", after)


def _counts_miss_a_move() -> dict:
    def after(args, out):  # evict_densify_batch: the first plan's last move is not counted at its destination
        blocks, counts, meta, holders, block_live = args[2], args[3], args[4], args[5], args[6]
        rows, moves, move_start, status = args[13], args[21], args[22], args[25]
        S_ = holders.shape[0] // block_live.shape[0]
        for i in range(rows.shape[0]):
            if status[i] == K.PLANNED and move_start[i + 1] > move_start[i]:
                dst = moves[move_start[i + 1] - 1, 2] // S_
                row = rows[i]
                listed = list(blocks[row, :meta[row, M_NBLOCKS]])
                if dst in listed:
                    counts[row, listed.index(dst)] -= 1
                return
    return _wrap("evict_densify_batch", after)


def _rank_off_by_one() -> dict:
    real = K.evict_densify_batch

    def kernel(*args):  # StreamingLLM's choice one rank past the sinks' end
        args = list(args)
        if args[14] == K.STREAMING:
            args[15] += 1
        return real(*args)
    return {(K, "evict_densify_batch"): kernel}


def _draw_of_another_state() -> dict:
    real = K.evict_densify_batch

    def kernel(*args):  # Random draws the first row's victims from another state (one bit flipped)
        args = list(args)
        if args[14] == K.RANDOM and args[13].shape[0]:
            args[17] = args[17].copy()
            args[17][args[13][0]] ^= np.uint64(1)
        return real(*args)
    return {(K, "evict_densify_batch"): kernel}


def _shared_block_densified() -> dict:
    real = K.evict_densify_batch

    def kernel(*args):  # blocks another request lists taken for private during the eviction step
        listed = args[7]
        before = listed.copy()
        listed[before > 1] = 1
        clipped = listed.copy()
        try:
            return real(*args)
        finally:
            listed[:] = before - (clipped - listed)
    return {(K, "evict_densify_batch"): kernel}


def _runtime_commit(change) -> dict:
    real = fast_runtime.FastRuntime._commit

    def commit(self, step, committed, refused):  # committed: (admission number, request, row of step or Plan)
        return change(self, step, committed, refused, real)
    return {(fast_runtime.FastRuntime, "_commit"): commit}


def _tail_block_kept() -> dict:
    class KeepsTheLast:
        def __init__(self, pool):
            self.real = pool

        def __getattr__(self, name):
            return getattr(self.real, name)

        def free(self, blocks):
            self.real.free(list(blocks)[:-1])

    def change(self, step, committed, refused, real):  # each plan's last released block is not freed
        pool, self.pool = self.pool, KeepsTheLast(self.pool)
        try:
            real(self, step, committed, refused)
        finally:
            self.pool = pool
    return _runtime_commit(change)


def _plans_out_of_order() -> dict:
    return _runtime_commit(lambda self, step, committed, refused, real: real(self, step, committed[::-1], refused))


def _dropped_move() -> dict:
    def change(self, step, committed, refused, real):  # each copy loses its first move
        engine = self.engine
        submit = engine.submit_ordered
        engine.submit_ordered = lambda copies: submit([(tuple(moves)[1:], req_id) for moves, req_id in copies])
        try:
            real(self, step, committed, refused)
        finally:
            del engine.submit_ordered
    return _runtime_commit(change)


# ---- planted bugs in the gather path's kernels (issue #46): ``FastGather`` calls them through the module ------------
def _block_size(args) -> int:
    """A kernel's block size, from its layout arguments (holders: one per slot; block_live: one per block)."""
    return args[5].shape[0] // args[6].shape[0]


def _candidate_above_the_cutoff(real):
    """compact_candidates: a full block (live count S) is a candidate too (the count cutoff off by one)."""
    def compact_candidates(*args):
        code, n, b = real(*args)
        blocks, counts, meta, (row, k, movable, idx, cnt) = args[2], args[3], args[4], args[13:]
        S_ = _block_size(args)
        end = min(meta[row, M_WRITE_POS] // S_, meta[row, M_NBLOCKS])
        full = [i for i in range(end) if counts[row, i] == S_ and movable[blocks[row, i]]]
        if full and n < k:
            idx[n], cnt[n] = full[0], S_
            n += 1
        return code, n, b
    return compact_candidates


def _pops_the_emptiest(real):
    """compact_gate: the set shrinks emptiest first (the candidates read in reverse)."""
    def compact_gate(idx, cnt, n, size, budget, out):
        return real(idx[:n][::-1].copy(), cnt[:n][::-1].copy(), n, size, budget, out)
    return compact_gate


def _destination_is_a_source(real):
    """compact_fill: the first destination's moves land in the first source block instead."""
    def compact_fill(*args):
        code, m, b = real(*args)
        blocks, (row, sources, _, dsts, moves) = args[2], args[13:]
        if code == GK.PLANNED and m:
            moves[:m, 3][moves[:m, 3] == dsts[0]] = blocks[row, sources[0]]
        return code, m, b
    return compact_fill


def _drops_the_last_token(real):
    """compact_fill: the last token in logical order is not moved."""
    def compact_fill(*args):
        code, m, b = real(*args)
        return code, max(m - 1, 0), b
    return compact_fill


def _releases_a_live_block(real):
    """dead_blocks: a block holding a live token of the row is released with the dead ones."""
    def dead_blocks(*args):
        code, n, b = real(*args)
        blocks, counts, meta, (row, private, _, _, out) = args[2], args[3], args[4], args[13:]
        end = min(meta[row, M_WRITE_POS] // _block_size(args), meta[row, M_NBLOCKS])
        live = [blocks[row, i] for i in range(end) if counts[row, i] and private[blocks[row, i]]]
        if live:
            out[n] = live[0]
            n += 1
        return code, n, b
    return dead_blocks


def _count_stale_after_a_move(real):
    """commit_compact: the block the last move lands in keeps its count from before the move."""
    def commit_compact(*args):
        code, a, b = real(*args)
        blocks, counts, meta, (row, _, _, _, moves, apply, _) = args[2], args[3], args[4], args[13:]
        if code == GK.OK and apply and moves.shape[0]:
            listed = blocks[row, :meta[row, M_NBLOCKS]].tolist()
            if moves[-1, 3] in listed:
                counts[row, listed.index(moves[-1, 3])] -= 1
        return code, a, b
    return commit_compact


def _stale_plan_committed(real):
    """commit_compact: the plan's layout version is not compared with the row's (a stale plan commits)."""
    def commit_compact(*args):
        args = list(args)
        args[14] = args[4][args[13], M_LAYOUT_VERSION]
        return real(*args)
    return commit_compact


def _movers_out_of_order(real):
    """densify_plan: the movers fill the holes in reverse logical order (the pack breaks the order of the tokens)."""
    def densify_plan(*args):
        code, m, b = real(*args)
        moves = args[16]
        if code == GK.PLANNED and m > 1:
            moves[:m, 3:] = moves[:m, 3:][::-1].copy()
        return code, m, b
    return densify_plan


def _cursor_left_behind(real):
    """commit_densify: the cursor stays where it was (the tail is released, the cursor not rewound to n_live)."""
    def commit_densify(*args):
        meta, row = args[4], args[13]
        pos = meta[row, M_WRITE_POS]
        code, m, k = real(*args)
        if code == GK.OK and args[19]:
            meta[row, M_WRITE_POS] = meta[row, M_RUN_POS] = min(pos, meta[row, M_NBLOCKS] * _block_size(args))
        return code, m, k
    return commit_densify


def _stale_pack_committed(real):
    """commit_densify: the plan's (version, total_len) is not compared with the row's (a stale pack commits)."""
    def commit_densify(*args):
        args = list(args)
        args[14], args[15] = args[4][args[13], M_LAYOUT_VERSION], args[4][args[13], M_TOTAL_LEN]
        return real(*args)
    return commit_densify


def _ties_in_reverse(real):
    """excess_order: requests of equal excess are ordered last given first."""
    def excess_order(meta, rows, S_, out):
        n = real(meta, rows[::-1].copy(), S_, out)
        out[:n] = rows.shape[0] - 1 - out[:n]
        return n
    return excess_order


GATHER_KERNEL_BUGS = {  # name: (the gather kernel, the plant: real kernel -> planted one)
    "ties_in_reverse": ("excess_order", _ties_in_reverse),
    "candidate_above_the_cutoff": ("compact_candidates", _candidate_above_the_cutoff),
    "pops_the_emptiest": ("compact_gate", _pops_the_emptiest),
    "destination_is_a_source": ("compact_fill", _destination_is_a_source),
    "drops_the_last_token": ("compact_fill", _drops_the_last_token),
    "releases_a_live_block": ("dead_blocks", _releases_a_live_block),
    "count_stale_after_a_move": ("commit_compact", _count_stale_after_a_move),
    "stale_plan_committed": ("commit_compact", _stale_plan_committed),
    "movers_out_of_order": ("densify_plan", _movers_out_of_order),
    "cursor_left_behind": ("commit_densify", _cursor_left_behind),
    "stale_pack_committed": ("commit_densify", _stale_pack_committed)}




def _round_candidates_by_row(*args):
    """``round_candidates`` one row at a time through ``GK.compact_candidates`` (planted or not)."""
    L, (rows, width, movable, idx, cnt, n) = args[:13], args[13:]
    for k in range(len(rows)):
        n[k] = GK.compact_candidates(*L, rows[k], width, movable, idx[k], cnt[k])[1]
    return GK.OK, 0, 0


def _round_gates_by_row(idx, cnt, n, S_, budget, max_plans, src, out):
    """``round_gates`` one row at a time through ``GK.compact_gate`` (planted or not)."""
    plans = 0
    for k in range(len(n)):
        if plans >= max_plans:
            return k
        out[k] = code, a, b = GK.compact_gate(idx[k], cnt[k], n[k], S_, budget, src[k])
        if code == GK.OK:
            budget -= -(-b // S_)
            plans += 1
    return len(n)


# a planted single-row kernel reaches the round's batched one: it runs row by row through the planted kernel
ROUND_BY_ROW = {"compact_candidates": ("round_candidates", _round_candidates_by_row),
                "compact_gate": ("round_gates", _round_gates_by_row)}


def _gather_kernel_bug(name: str) -> PlantedBug:
    kernel, plant = GATHER_KERNEL_BUGS[name]

    def patches() -> dict:
        out = {(GK, kernel): plant(getattr(GK, kernel))}
        if kernel in ROUND_BY_ROW:
            batched, by_row = ROUND_BY_ROW[kernel]
            out[(GK, batched)] = by_row
        return out
    return PlantedBug(f"fast_gather_{name}", f"{kernel}: {plant.__doc__.split(': ', 1)[1].rstrip('.')}", patches)


def _release_while_a_plan_is_in_flight() -> dict:
    real = gather_runtime.GatherRuntime._release_dead

    def release_dead(self, positions, emptied):  # this step's plans are taken out of flight for the search
        g = self.gather
        held, g.inflight = g.inflight, {}
        try:
            real(self, positions, emptied)
        finally:
            g.inflight = {**held, **g.inflight}
    return {(gather_runtime.GatherRuntime, "_release_dead"): release_dead}


def _moves_not_logged() -> dict:
    real = gather_runtime._ChangeLogs.log

    def log(self, n, log, rows, starts, ids):  # a commit's moved tokens never reach the read-list change log
        if n is not self.mv_n:
            real(self, n, log, rows, starts, ids)
    return {(gather_runtime._ChangeLogs, "log"): log}


def _evictions_taken_twice() -> dict:
    real = RK.take_reads

    def take_reads(*args):  # the eviction logs are not emptied: a step's evictions are listed again next time
        ev_n, rows = args[6], args[4]
        kept = ev_n[rows].copy()
        real(*args)
        ev_n[rows] = kept
    return {(RK, "take_reads"): take_reads}


def _patch_skips_the_last_eviction() -> dict:
    real = RK.patch_reads

    def patch_reads(*args):  # the workers' patch keeps each request's last evicted token in its read list
        args = list(args)
        ev_at, ev = args[9], args[10]
        keep = np.ones(len(ev), bool)
        keep[ev_at[1:][np.diff(ev_at) > 0] - 1] = False
        args[9] = np.concatenate(([0], np.cumsum([keep[a:b].sum() for a, b in zip(ev_at[:-1], ev_at[1:])])))
        args[10], args[21] = ev[keep], args[21][:int(keep.sum())]
        return real(*args)
    return {(RK, "patch_reads"): patch_reads}


def _ideal_blocks_floored() -> dict:
    real = FastTable.retained_vs_ideal

    def retained_vs_ideal(self):  # the ideal footprint rounds live / S down: a partly live block is not needed
        retained, _ = real(self)
        meta = self.layout.meta[list(self._rows.values())]
        return retained, int((meta[:, M_NUM_LIVE] // self.block_size).sum())
    return {(FastTable, "retained_vs_ideal"): retained_vs_ideal}


FAST_BUGS: dict[str, PlantedBug] = {b.name: b for b in (
    PlantedBug("fast_slot_off_by_one", "the batched sync reports the first write slot one past the slot written",
               _slot_off_by_one),
    PlantedBug("fast_live_bit_kept_on_eviction", "the eviction step leaves the first victim's live bit set",
               _live_bit_kept_on_eviction),
    PlantedBug("fast_counts_miss_a_move", "densify's commit does not count a plan's last move at its destination",
               _counts_miss_a_move),
    PlantedBug("fast_rank_off_by_one", "StreamingLLM's choice in the kernel starts one rank past the sinks",
               _rank_off_by_one),
    PlantedBug("fast_draw_of_another_state", "Random's kernel draws a request's victims from another request's state",
               _draw_of_another_state),
    PlantedBug("fast_shared_block_densified", "the eviction step takes blocks other requests list for private",
               _shared_block_densified),
    PlantedBug("fast_tail_block_kept", "a committed plan's last released block is not freed", _tail_block_kept),
    PlantedBug("fast_plans_out_of_order", "a step's plans are committed and submitted in reverse admission order",
               _plans_out_of_order),
    PlantedBug("fast_dropped_move", "each submitted copy loses its first move", _dropped_move),
    # NOTE: the stale commits (``stale_plan_committed``, ``stale_pack_committed``) cannot happen here: the runtime
    # commits every plan in the call that makes it. tests/test_fastpath_gather.py commits later and catches them
    *map(_gather_kernel_bug, sorted(set(GATHER_KERNEL_BUGS) - {"stale_plan_committed", "stale_pack_committed"})),
    PlantedBug("fast_gather_release_while_a_plan_is_in_flight", "Naive-Evict's release does not wait for the "
               "request's plan of this step's round", _release_while_a_plan_is_in_flight),
    PlantedBug("fast_gather_moves_not_logged", "a commit's moved tokens never reach the read-list change log",
               _moves_not_logged),
    PlantedBug("fast_reads_evictions_taken_twice", "taking a step's read-list changes leaves the eviction logs "
               "full: the next step lists them again", _evictions_taken_twice),
    PlantedBug("fast_reads_patch_skips_the_last_eviction", "the workers' compiled patch keeps each request's last "
               "evicted token in its read list", _patch_skips_the_last_eviction),
    PlantedBug("fast_ideal_blocks_floored", "the ideal footprint vLLM's stats read rounds live / S down",
               _ideal_blocks_floored),
)}
