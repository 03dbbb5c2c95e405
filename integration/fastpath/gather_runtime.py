"""``GatherRuntime``: ``FastRuntime`` on the gather read path, its compaction, Naive-Evict release and pressure pack
through ``FastGather``'s kernels (issue #46, part 2).

The core's ``VTokenRuntime`` with ``ReadPath.GATHER`` stays the reference; ``ShadowedRuntime`` runs the two side by
side and compares every answer and the whole state after every call. The domain, fixed: reclamation compact (a
``ReclaimConfig`` with the compact planner) or none (``config=None``: the paper's Naive-Evict, dead blocks released
and nothing moved), ordering EVENT; the policy none, StreamingLLM or Random (chosen in the kernel, nothing
protected: the gather path reads any slot); requests admitted empty (a prefix hit arrives as ``sync`` of blocks
another request lists); ``detach`` when they leave.

A step, in the core's order (``VTokenRuntime._evict_and_reclaim``): the due requests' victims are chosen and evicted
in one kernel call; with compaction on, the manager's trigger (``should_reclaim``) or the engine's pressure runs a
round over every request (``plan_round``: compact, and under pressure the pack of requests compact cannot shrink,
with the step's victims' positions); then Naive-Evict releases the wholly dead blocks where the step's evictions
emptied one (a request with a plan from this round waits for the next step, searched whole then); then each plan's
copy is submitted, in the order the plans were made, in one ``submit_ordered``, and every plan commits. Under EVENT
ordering the core commits them at the ``settle`` right after (``take_commits``), with nothing between that could
see the difference, so no plan is ever in flight between calls here.

The workers keep each request's read list and patch it by what changed (``read_step``: every scheduled request's
changes in one kernel call, one flat ``StepReads``): the evictions, the moves of committed plans and the tokens
synced since the previous call, logged per row as the core's table logs them (``TokenTable.take_changes``: the same
entries, the same bound past which the next call says "rebuilt"), in fixed arrays (``read_kernels``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from vtoken.core import token_table
from vtoken.core.block_pool import BlockAllocator
from vtoken.core.checks import as_list
from vtoken.core.copy_engine import CopyEngine
from vtoken.core.errors import ConfigError
from vtoken.core.plan import Plan, PlanKind
from vtoken.core.policies.random_policy import RandomPolicy
from vtoken.core.policies.streaming_llm import StreamingLLM
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadChanges

from . import read_kernels as RK
from .commits import NO_COMMITS, StepCommits
from .gather import COMMITTED, FastGather
from .reads import StepReads
from .runtime import FastRuntime


class GatherRuntime(FastRuntime):
    """See the module docstring. As ``FastRuntime``, with ``config``: the compact planner's ``ReclaimConfig``
    (ordering EVENT), or None for Naive-Evict alone."""

    def __init__(self, pool: BlockAllocator, engine: CopyEngine, policy: StreamingLLM | RandomPolicy | None,
                 budget: float | int, rows: int, tokens: int, config: ReclaimConfig | None,
                 evict_every: int = 1, seed: int = 0, names: dict | None = None) -> None:
        if config is not None and (not isinstance(config, ReclaimConfig) or config.planner is not PlanKind.COMPACT
                                   or config.ordering is not Ordering.EVENT):
            raise ConfigError(f"the gather path's fast runtime compacts with EVENT ordering, or reclaims nothing "
                              f"(None); got {config!r}")
        super().__init__(pool, engine, policy, budget, rows, tokens, evict_every, seed, names)
        self.compacts = config is not None
        self.gather = FastGather(self.table, pool, config or ReclaimConfig(ordering=Ordering.EVENT))
        self.reclaim_stats = self.gather.stats  # NOTE: one object: FastGather counts into it
        self._release_deferred: dict[object, None] = {}  # requests whose dead blocks wait for their plan to commit
        self.reads = _ChangeLogs(rows, token_table.CHANGE_LOG_LIMIT)

    # ---- requests -------------------------------------------------------------------------
    def admit(self, req_id: object) -> None:
        """As ``FastRuntime.admit``. NOTE: a deferred release of a request detached under the same id stays deferred,
        as the core's does: a request readmitted under that id before the next step is searched whole then."""
        super().admit(req_id)
        self.reads.reset(self.table._rows[req_id])

    # ---- a step ---------------------------------------------------------------------------
    def evict_and_reclaim(self, req_ids: Sequence[object], attention: Mapping | None = None,
                          key_norms: Mapping | None = None, observed: Mapping | None = None) -> dict[object, list[int]]:
        """Algorithm 1 lines 2, 3 and 5 for ``req_ids`` on the gather path (the module docstring's step). Returns
        each request's victims (ascending ids). Validated first; nothing changes on a refusal."""
        ids, rows = self._step_rows(req_ids, attention, key_norms, observed)
        victims: dict[object, list[int]] = {}
        positions: dict[object, list[int]] = {}
        emptied: dict = {}
        if self.policy is not None and ids:
            victims, positions, emptied, flat = self.table.evict_gather_step(rows, self.budget, self.evict_every,
                                                                             self.policy, self._draw_states, ids)
            self.reads.log(self.reads.ev_n, self.reads.ev_log, *flat)
        g = self.gather
        if self.compacts:
            due = g.should_reclaim(self.iteration)  # first: the adaptive trigger reads F every iteration
            if due or self.pressure:
                g.stats.pressure_rounds += not due
                g.round(self.table.request_ids(), bool(self.pressure), positions if self.pressure else {})
        self._release_dead(positions, emptied)
        self._launch_and_commit()
        self.iteration += 1
        return victims

    def read_step(self, req_ids: Sequence[object], check: bool = False) -> StepReads:
        """``reads.take_step_reads`` of the core (each request's ``read_changes``, in order, and its whole list where
        it is rebuilt, or everywhere under ``check``) for all of ``req_ids`` in one kernel call. O(evicted + moved +
        joined), and O(live) for a whole list."""
        ids = as_list("req_ids", req_ids)
        return self.reads.take(self.table, self.table.rows_of(ids), ids, check)

    def read_changes(self, req_id: object) -> ReadChanges:
        """``VTokenRuntime.read_changes``: ``read_step`` of one request."""
        return self.read_step([req_id]).changes(0)

    def read_lists(self, req_id: object) -> tuple[list[int], list[int]]:
        """(live token ids, their slots) in logical order."""
        return self.table.read_lists(req_id)

    # ---- helpers ------------------------------------------------------------------------------
    def _release_dead(self, positions: Mapping[object, list[int]], emptied: Mapping) -> None:
        """``VTokenRuntime._release_dead``: Naive-Evict's release of wholly dead private blocks, looked for where this
        step's evictions were in the requests whose evictions emptied a block, and whole in a request deferred by an
        earlier step's plan; a request with a plan in flight (this step's round) is deferred to the next step.
        ``emptied``: the requests whose evictions emptied a block, in ``positions``' order (a dict's keys)."""
        S, deferred, g = self.table.block_size, self._release_deferred, self.gather
        self._release_deferred = {}
        # NOTE: the core's order, ``positions``' then the deferred others; a request that lost tokens without
        # emptying a block (no count reached 0) and was not deferred has no dead block to look for
        order = emptied if not deferred else [*(r for r in positions if r in emptied or r in deferred),
                                               *(r for r in deferred if r not in positions)]
        for r in order:
            if r not in self.table:
                continue  # left since: its blocks went with it
            among = None if r in deferred else [p // S for p in positions[r]]
            if r in g.inflight:
                self._release_deferred[r] = None
                continue
            g.plan_release(r, among)

    def _launch_and_commit(self) -> None:
        """The core's ``launch`` (each plan's copy submitted and ordered before the next compute step, in the order
        the plans were made; here in one ``submit_ordered``) and its ``settle`` under EVENT ordering (every plan
        commits, in the same order); the step's commits kept for ``take_commits``."""
        g = self.gather
        if not g.inflight:
            self._commits = NO_COMMITS
            return
        plans: list[Plan] = list(g.inflight.values())
        copies = [(p.moves, p.req_id) for p in plans if p.moves]
        if copies:
            self._submit_ordered(copies)
        committed, kept, moved_by = [], [], []
        try:
            for p in plans:
                status, d = g.commit_counted(p.req_id)
                if status == COMMITTED:
                    committed.append(p)
                    kept.append(d)
                    if p.moves:
                        moved_by.append(p)
        finally:  # NOTE: what committed before a refusal is logged too: the workers' lists must follow the table
            self._log_moves(moved_by)
        self._commits = StepCommits.of_plans(committed, kept)

    def _log_moves(self, plans: list[Plan]) -> None:
        """Each committed plan's moved token ids (a ``MoveArray``'s first field) into its row's log, in one call."""
        if not plans:
            return
        ids = np.frombuffer(b"".join(p.moves.fields for p in plans), np.int64)[0::5]
        starts = np.zeros(len(plans) + 1, np.int64)
        np.cumsum([len(p.moves) for p in plans], out=starts[1:])
        self.reads.log(self.reads.mv_n, self.reads.mv_log, self.table.rows_of([p.req_id for p in plans]), starts, ids)


class _ChangeLogs:
    """Per row, what its read list lost (``ev_log``: ``ev_n`` entries, -1 once more than the core's log keeps) and
    which of its tokens moved (``mv_log``, ``mv_n``) since the previous take, and the layout version and synced
    length at it (``since``: -1 before the first, which says "rebuilt"). Logs of ``limit`` int32 token ids (the
    core's ``CHANGE_LOG_LIMIT`` at construction: a test may lower it after, never raise it). ``take``'s outputs
    are views of one buffer, fresh each step (the record outlives the step: it travels to the workers, or is
    compared)."""

    def __init__(self, rows: int, limit: int) -> None:
        self.limit = limit
        self.ev_n, self.mv_n = np.zeros(rows, np.int64), np.zeros(rows, np.int64)
        self.ev_log, self.mv_log = np.zeros((rows, limit), np.int32), np.zeros((rows, limit), np.int32)
        self.since, self.joined_from = np.full(rows, -1, np.int64), np.zeros(rows, np.int64)

    def reset(self, row: int) -> None:
        self.ev_n[row] = self.mv_n[row] = self.joined_from[row] = 0
        self.since[row] = -1

    def log(self, n: np.ndarray, log: np.ndarray, rows: np.ndarray, starts: np.ndarray, ids: np.ndarray) -> None:
        limit = token_table.CHANGE_LOG_LIMIT  # read each time: a test may lower it
        assert limit <= self.limit, "the core's change log bound was raised after the fast path's logs were sized"
        RK.log_append(n, log, rows, starts, ids, limit)

    def take(self, table, rows: np.ndarray, req_ids: list, check: bool) -> StepReads:
        meta, R = table.layout.meta, len(rows)
        ev, mv, jn, live = RK.read_sizes(meta, rows, check, self.ev_n, self.mv_n, self.since, self.joined_from)
        sizes = (R, R, R + 1, ev, R + 1, mv, mv, R + 1, jn, jn, R + 1, live, live)
        out, parts, at = np.empty(sum(sizes), np.int64), [], 0
        for size in sizes:
            parts.append(out[at:at + size])
            at += size
        version, since, ev_at, ev, mv_at, mv, mv_slots, jn_at, jn, jn_slots, ls_at, ls_ids, ls_slots = parts
        whole = np.empty(R, np.int8)
        RK.take_reads(table.layout.tok_pos, table.layout.blocks, meta, table.block_size, rows, check, self.ev_n,
                      self.ev_log, self.mv_n, self.mv_log, self.since, self.joined_from, version, since, whole,
                      ev_at, ev, mv_at, mv, mv_slots, jn_at, jn, jn_slots, ls_at, ls_ids, ls_slots)
        cut = lambda a, starts: a[:starts.item(R)]  # noqa: E731  (the rows' entries: a bound, not a count)
        return StepReads(req_ids, version, since, whole, ev_at, cut(ev, ev_at), mv_at, cut(mv, mv_at),
                         cut(mv_slots, mv_at), jn_at, cut(jn, jn_at), cut(jn_slots, jn_at), ls_at, cut(ls_ids, ls_at),
                         cut(ls_slots, ls_at))
