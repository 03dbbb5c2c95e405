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

The workers keep each request's read list and patch it by what changed (``read_changes``): the evictions, the moves
of committed plans and the tokens synced since the previous call, logged here as the core's table logs them
(``TokenTable.take_changes``: the same entries, the same bound past which the next call says "rebuilt").
"""

from __future__ import annotations

from array import array
from typing import Mapping, Sequence

import numpy as np

from vtoken.core import token_table
from vtoken.core.block_pool import BlockAllocator
from vtoken.core.copy_engine import CopyEngine
from vtoken.core.errors import ConfigError
from vtoken.core.plan import Plan, PlanKind
from vtoken.core.policies.random_policy import RandomPolicy
from vtoken.core.policies.streaming_llm import StreamingLLM
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadChanges

from .commits import NO_COMMITS, StepCommits
from .gather import COMMITTED, FastGather
from .layout import NO_POS
from .runtime import FastRuntime

_EVICTED, _MOVED = 0, 1  # a request's change log (``read_changes``): evicted ids, moved ids, version, synced length


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
        # per request, what its read list lost, which tokens moved (None: more than the core's log keeps), and the
        # layout version and synced length at the previous ``read_changes``
        self._log: dict[object, list] = {}

    # ---- requests -------------------------------------------------------------------------
    def admit(self, req_id: object) -> None:
        super().admit(req_id)
        self._log[req_id] = [array('q'), array('q'), -1, 0]

    def detach(self, req_id: object) -> list[int]:
        """As ``FastRuntime.detach``. NOTE: a deferred release of ``req_id`` stays deferred, as the core's does: a
        request readmitted under the same id before the next step is searched whole then."""
        blocks = super().detach(req_id)
        del self._log[req_id]
        return blocks

    # ---- a step ---------------------------------------------------------------------------
    def evict_and_reclaim(self, req_ids: Sequence[object], attention: Mapping | None = None,
                          key_norms: Mapping | None = None, observed: Mapping | None = None) -> dict[object, list[int]]:
        """Algorithm 1 lines 2, 3 and 5 for ``req_ids`` on the gather path (the module docstring's step). Returns
        each request's victims (ascending ids). Validated first; nothing changes on a refusal."""
        ids, rows = self._step_rows(req_ids, attention, key_norms, observed)
        victims: dict[object, list[int]] = {}
        positions: dict[object, list[int]] = {}
        emptied: set = set()
        if self.policy is not None and ids:
            victims, positions, emptied = self.table.evict_gather_step(rows, self.budget, self.evict_every,
                                                                       self.policy, self._draw_states, ids)
            for r, chosen in victims.items():
                self._log_entries(r, _EVICTED, chosen)
        g = self.gather
        if self.compacts:
            due = g.should_reclaim(self.iteration)  # first: the adaptive trigger reads F every iteration
            if due or self.pressure:
                g.stats.pressure_rounds += not due
                g.plan_round(self.table.request_ids(), pack=bool(self.pressure),
                             evicted_positions=positions if self.pressure else {})
        self._release_dead(positions, emptied)
        self._launch_and_commit()
        self.iteration += 1
        return victims

    def read_changes(self, req_id: object) -> ReadChanges:
        """``VTokenRuntime.read_changes``: how the request's read list changed since the previous call (the core's
        answer, entry for entry). O(evicted + moved + joined)."""
        row = self.table._row(req_id)
        log = self._log[req_id]
        evicted, moved, since, joined_from = log
        version, total = self.table.layout_version(req_id), self.table.total_len(req_id)
        log[:] = [array('q'), array('q'), version, total]
        if evicted is None or moved is None or since == -1:
            return ReadChanges(version, since, True)
        if len(evicted) > 16:  # a burst: one vector pass
            gone = np.frombuffer(evicted, np.int64)
            evicted = tuple(gone[gone < joined_from].tolist())
        else:
            evicted = tuple(t for t in evicted if t < joined_from)
        moved_ids, moved_slots = (), ()
        if moved:
            if len(moved) > 16:  # a compaction's moves: one vector pass
                ids = np.unique(np.frombuffer(moved, np.int64))
                ids = ids[ids < joined_from].tolist()
            else:
                ids = sorted({t for t in moved if t < joined_from})
            slots = self._slots(row, ids)
            moved_ids = tuple(t for t, s in zip(ids, slots) if s >= 0)
            moved_slots = tuple(s for s in slots if s >= 0)
        joined = range(joined_from, total)
        slots = self._slots(row, joined)
        return ReadChanges(version, since, False, evicted, tuple(t for t, s in zip(joined, slots) if s >= 0),
                           tuple(s for s in slots if s >= 0), moved_ids, moved_slots)

    def _slots(self, row: int, ids) -> list[int]:
        """The slot of each token of ``ids`` (NO_SLOT: evicted): a few read one by one (a decode step joins one
        token), many in one vector pass."""
        if len(ids) > 16:
            return self.table.token_slots(row, np.asarray(ids, np.int64)).tolist()
        tok_pos, blocks, S = self.table.layout.tok_pos, self.table.layout.blocks, self.table.block_size
        out = []
        for t in ids:
            p = tok_pos.item(row, t)
            out.append(-1 if p == NO_POS else blocks.item(row, p // S) * S + p % S)
        return out

    def read_lists(self, req_id: object) -> tuple[list[int], list[int]]:
        """(live token ids, their slots) in logical order."""
        return self.table.read_lists(req_id)

    # ---- helpers ------------------------------------------------------------------------------
    def _log_entries(self, r: object, which: int, ids) -> None:
        """The core's change log: ``ids`` appended, or the log dropped (None) once it holds more than it keeps."""
        log = self._log[r]
        entries = log[which]
        if entries is not None:
            entries.extend(ids)
            if len(entries) > token_table.CHANGE_LOG_LIMIT:  # read each time: a test may lower it
                log[which] = None

    def _release_dead(self, positions: Mapping[object, list[int]], emptied: set) -> None:
        """``VTokenRuntime._release_dead``: Naive-Evict's release of wholly dead private blocks, looked for where this
        step's evictions were in the requests whose evictions emptied a block, and whole in a request deferred by an
        earlier step's plan; a request with a plan in flight (this step's round) is deferred to the next step."""
        S, deferred, g = self.table.block_size, self._release_deferred, self.gather
        self._release_deferred = {}
        for r in [*positions, *(r for r in deferred if r not in positions)]:
            if r not in self.table:
                continue  # left since: its blocks went with it
            among = None if r in deferred else [p // S for p in positions[r]]
            if among is not None and r not in emptied:
                continue  # no count reached 0, so no block among these is dead
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
        committed = []
        for p in plans:
            if g.commit(p.req_id) == COMMITTED:
                committed.append(p)
                if p.moves:
                    self._log_entries(p.req_id, _MOVED, p.moves.fields[0::5])  # a MoveArray's token ids
        t = self.table
        self._commits = StepCommits.of_plans(committed, lambda p: len(set(p.dst_blocks) & set(t.block_ids(p.req_id))))
