"""``FastRuntime``: the dense path's ``VTokenRuntime`` for an engine that allocates and schedules itself (vLLM), on
``FastTable`` and its kernels, one kernel call per phase of a step for all its requests.

The core's runtime stays the reference (``core/runtime.py``); this is a second implementation of the part of it
that the vLLM plugin drives on the dense read path, and ``ShadowedRuntime`` (``shadow.py``) runs the two side by side
and compares every answer and the whole state after every call. Its domain, fixed:

  read path dense, reclamation densify, ordering EVENT (a plan commits as soon as its copy is ordered before the
  next compute step: ``WorkerCopyEngine``); the policy none, StreamingLLM or Random (chosen in the kernel); requests
  admitted empty (a prefix-cache hit arrives as ``sync`` of blocks another request lists); ``detach`` when they leave.

Anything else is refused when the runtime is built (``ConfigError``), never per request.

A step, as the core runs it: ``sync`` the step's tokens; after the forward ``evict_and_reclaim`` chooses each due
request's victims, evicts them and densifies every request that is not dense, in admission order; ``settle``
returns the committed plans. Here the kernel commits each densify plan in the same call that makes it: under EVENT
ordering the core commits at the ``settle`` right after, with nothing between that could see the difference; the
step's commits are then read as ``take_commits()`` (``commits.StepCommits``: counts, and a ``Plan`` made only for a
plan someone reads). The
pool receives the core's frees in the core's order; the copy engine the same copies in the same order, as one call
per step (``submit_ordered``: each copy submitted, ordered before the next compute step and released, which is what
the core's launch and EVENT settle do to it; the step's copies as one ``PackedCopies`` record), so the engine must
offer that call (vLLM's ``WorkerCopyEngine``, the shadow's engine).
"""

from __future__ import annotations

import math
from array import array
from operator import itemgetter
from typing import Mapping, Sequence

import numpy as np

from vtoken.core.block_pool import BlockAllocator
from vtoken.core.checks import as_list, check_int, check_mapping, check_request_id
from vtoken.core.copy_engine import CopyEngine, CopyStatus
from vtoken.core.errors import (BlockNotOwnedError, ConfigError, DuplicateRequestError, InvalidArgumentError,
                                InvariantViolation, UnknownRequestError)
from vtoken.core.occupancy import waste_ratio
from vtoken.core.plan import NoPlan, NoPlanReason
from vtoken.core.policies.random_policy import RandomPolicy, request_state
from vtoken.core.policies.streaming_llm import StreamingLLM
from vtoken.core.reclamation import ReclaimStats
from vtoken.core.runtime import check_budget

from .layout import M_NUM_LIVE, M_WRITE_POS, P_LIVE_SLOTS
from .commits import NO_COMMITS, StepCommits
from .moves import PackedCopies
from .table import EvictStep, FastTable


class FastRuntime:
    """See the module docstring. ``policy``: None (nothing evicted), a ``StreamingLLM`` or a ``RandomPolicy``;
    ``budget``, ``seed``, ``evict_every`` as the core's; ``rows`` and ``tokens``: the layout's capacity (vLLM's
    max_num_seqs and max_model_len); ``names``: the name each request's draws use (Random; the core's
    ``RenamedRequests``: a request without one draws by its id). The caller keeps ``names`` and names a request
    before admitting it."""

    def __init__(self, pool: BlockAllocator, engine: CopyEngine, policy: StreamingLLM | RandomPolicy | None,
                 budget: float | int, rows: int, tokens: int, evict_every: int = 1, seed: int = 0,
                 names: dict | None = None) -> None:
        if policy is not None and type(policy) not in (StreamingLLM, RandomPolicy):
            raise ConfigError(f"the fast path chooses victims for StreamingLLM and Random only, not {policy!r}")
        if not callable(getattr(engine, "submit_ordered", None)):
            raise ConfigError(f"the fast path hands a step's copies to its engine in one submit_ordered call, which "
                              f"{type(engine).__name__} does not offer")
        check_budget(budget)
        check_int("evict_every", evict_every, 1, error=ConfigError)
        check_int("seed", seed, error=ConfigError)
        self.pool, self.engine, self.policy = pool, engine, policy
        self.budget, self.evict_every, self.seed = budget, evict_every, seed
        self.table = FastTable(pool.num_blocks, pool.block_size, rows, tokens)
        self.names: dict = {} if names is None else names
        self._draw_states = np.zeros(rows, np.uint64)  # per row: Random's request_state of its request
        self.iteration = 0
        self.pressure = 0
        self.reclaim_stats = ReclaimStats()
        self._admission = np.zeros(rows, np.int64)  # per row: its request's admission number (plans commit in that order)
        self._admitted = 0
        self._holey: set[object] = set()  # requests left with holes below their cursor (a densify NoPlan)
        self._commits = NO_COMMITS  # committed by the last evict_and_reclaim, for take_commits()

    # ---- requests -------------------------------------------------------------------------
    def admit(self, req_id: object) -> None:
        check_request_id(req_id)
        if req_id in self.table:
            raise DuplicateRequestError(f"request {req_id!r} is already admitted")
        self.table.add_request(req_id)
        if type(self.policy) is RandomPolicy:
            self._draw_states[self.table._rows[req_id]] = request_state(self.seed, self.names.get(req_id, req_id))
        self._admission[self.table._rows[req_id]] = self._admitted
        self._admitted += 1

    def detach(self, req_id: object) -> list[int]:
        """Forget a request whose blocks the engine frees itself; returns its block list. No plan is ever in flight
        here (each commits in the call that makes it), so this never waits."""
        if req_id not in self.table:
            raise UnknownRequestError(f"unknown request {req_id!r}")
        blocks = self.table.remove_request(req_id)
        self._holey.discard(req_id)
        return blocks

    def set_pressure(self, blocks_short: int) -> None:
        """Recorded as the core records it; on the dense path pressure changes nothing (densify runs every step)."""
        check_int("blocks_short", blocks_short, 0)
        self.pressure = blocks_short

    # ---- a step ---------------------------------------------------------------------------
    def sync(self, req_id: object, new_blocks: Sequence[int], total_len: int) -> list[int]:
        return self.sync_many([(req_id, new_blocks, total_len)])[0]

    def sync_many(self, items: Sequence[tuple[object, Sequence[int], int]]) -> list[list[int]]:
        """``VTokenRuntime.sync`` for each (request, new blocks, total_len), in one kernel call, all or none; returns
        each request's write slots. Besides the table's checks, each new block must be allocated in the pool and, if
        other requests list it (a shared prefix block), referenced there once per holder (the core's messages)."""
        items = list(items)
        if any(map(bool, map(itemgetter(1), items))):
            problem = self._pool_problem(items)
            if problem is not None:
                # the core checks each item's table before its pool: a table refusal up to that item comes first
                self.table.sync_many(items[:problem[0] + 1], check_only=True)
                raise problem[1]
        return self.table.sync_many(items)

    def evict_and_reclaim(self, req_ids: Sequence[object], attention: Mapping | None = None,
                          key_norms: Mapping | None = None, observed: Mapping | None = None) -> dict[object, list[int]]:
        """Algorithm 1 lines 2, 3 and 5 for ``req_ids``: each request due by its budget and the cadence loses
        the policy's victims, then every request with holes is densified, its plan committed, its copy submitted
        and its emptied tail blocks freed, in admission order. Returns each request's victims (ascending ids, the
        core's order). Validated first (the core's checks and messages); nothing changes on a refusal."""
        ids, rows = self._step_rows(req_ids, attention, key_norms, observed)
        step = self.table.evict_step(rows, self.budget, self.evict_every, self.policy, self._draw_states,
                                     self._admission, ids) if self.policy is not None and ids else None
        due = step.due if step is not None else []
        holey = sorted(self._holey - set(due), key=self._admitted_as) if self._holey else []
        victims: dict[object, list[int]] = {}
        refused: list[tuple[object, NoPlan]] = []  # the NoPlans the core counts (not ALREADY_DENSE)
        committed: range | list = []
        if step is not None:
            victims = step.victims_by_request()
            refused += [(due[k], step.plan(k)) for k in step.refused]
            committed = range(len(step))  # NOTE: the step's commits, in admission order already (``K.step_record``)
        if holey:  # every plan, the step's and these, in admission order: (admission number, request, made)
            made = [(self._admitted_as(due[k]), due[k], j) for j, k in enumerate(step.committed_rows())] \
                if step is not None else []
            for r, plan in zip(holey, self.table.densify_many([(r, None) for r in holey])):
                if plan:
                    made.append((self._admitted_as(r), r, plan))
                elif plan.reason is not NoPlanReason.ALREADY_DENSE:
                    refused.append((r, plan))
            made.sort()  # admission numbers are distinct: nothing after them is compared
            committed = made
        self._commit(step, committed, refused)
        self.iteration += 1
        return victims

    def _step_rows(self, req_ids: Sequence[object], attention: Mapping | None, key_norms: Mapping | None,
                   observed: Mapping | None) -> tuple[list, np.ndarray]:
        """``evict_and_reclaim``'s checks (the core's, with its messages): the request ids as a list and their rows."""
        ids = as_list("req_ids", req_ids)
        for what, given in (("attention", attention), ("key_norms", key_norms), ("observed", observed)):
            if given is not None:
                check_mapping(what, given)
        try:
            rows = self.table.rows_of(ids)  # NOTE: the usual call names only known requests: one pass finds them all
            known = True
        except UnknownRequestError:
            known = False
        if not known or attention or key_norms or observed:
            unknown = [r for r in ids + list(attention or {}) + list(key_norms or {}) + list(observed or {})
                       if r not in self.table]
            if unknown:
                raise UnknownRequestError(f"unknown request(s) {unknown[:5]}")
        if len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"req_ids name a request twice: {ids[:8]}")
        if attention or key_norms or observed:
            raise InvalidArgumentError(f"the fast path records no attention rows, key norms or votes: its policy "
                                       f"({self.policy.name if self.policy else 'none'}) reads none")
        return ids, rows

    def take_commits(self) -> StepCommits:
        """The plans the last ``evict_and_reclaim`` committed, in the order they were made (what the core's
        ``settle`` returns under EVENT ordering, as ``StepCommits``); each step's once."""
        done, self._commits = self._commits, NO_COMMITS
        return done

    # ---- read-only queries (``VTokenRuntime``'s, for the plugin and the strict checks) ------------
    def __contains__(self, req_id: object) -> bool:
        return req_id in self.table

    def running(self) -> list[object]:
        return self.table.request_ids()

    def total_len(self, req_id: object) -> int:
        return self.table.total_len(req_id)

    def write_pos(self, req_id: object) -> int:
        return self.table.write_pos(req_id)

    def gap(self, req_id: object) -> int:
        return self.table.gap(req_id)

    def num_live(self, req_id: object) -> int:
        return self.table.num_live(req_id)

    def bridge(self, req_ids: Sequence[object]) -> tuple[list[int], list[int], list[int]]:
        """For each request: its synced length, how many blocks it lists and the last of them (-1 for none), read
        for all of them at once (what the engine's bridge checks compare before a step's sync)."""
        return self.table.bridge(req_ids)

    def gaps(self, req_ids: Sequence[object]) -> list[int]:
        """``gap`` of each request, read for all of them at once."""
        return self.table.gaps(req_ids)

    def block_ids(self, req_id: object) -> list[int]:
        return self.table.block_ids(req_id)

    def num_blocks_of(self, req_id: object) -> int:
        return self.table.num_blocks_of(req_id)

    def block_at(self, req_id: object, index: int) -> int:
        return self.table.block_at(req_id, index)

    def shared_blocks(self, req_id: object) -> list[int]:
        return self.table.shared_blocks(req_id)

    def slot_of(self, req_id: object, token_id: int) -> int:
        return self.table.slot_of(req_id, token_id)

    def block_live_counts(self, req_id: object) -> dict[int, int]:
        return self.table.block_live_counts(req_id)

    def waste_ratio(self) -> float:
        return waste_ratio(int(self.table.layout.pool[P_LIVE_SLOTS]), self.pool.num_allocated, self.pool.block_size)

    def retained_vs_ideal(self) -> tuple[int, int]:
        return self.table.retained_vs_ideal()

    def copies_in_flight(self) -> set:
        return set()  # every plan commits in the call that makes it

    def plans_outstanding(self) -> int:
        return 0

    def token_budget(self, total_len: int) -> int:
        check_int("total_len", total_len, 0)
        return self.budget if isinstance(self.budget, int) else max(1, math.ceil(self.budget * total_len))

    # ---- helpers ------------------------------------------------------------------------------
    def _commit(self, step: EvictStep | None, committed: range | list[tuple[int, object, object]],
                refused: list[tuple[object, NoPlan]]) -> None:
        """What the core's launch and settle do for each plan, in order: submit its copy (if it moves anything) and
        order it before the next compute step, release the handle, free the emptied tail blocks. NoPlans are
        counted, and a request left with holes is densified again at the next step. The step's copies go to the
        engine in one call, in the plans' order (``submit_ordered``). A plan the kernel made stays the kernel's
        record (``step``'s commit) until someone reads it (``StepCommits``).

        ``committed``: the plans in commit order, as ``step``'s commits (their indices: the usual step, read
        whole), or as (admission number, request, commit of ``step`` or ``Plan``) when densify's retries join them."""
        stats, holey = self.reclaim_stats, self._holey
        for r, no_plan in refused:
            stats.no_plan[no_plan.reason] += 1
            holey.add(r)
        if committed.__class__ is range:
            copies, relists, moves, released, plan_of = self._step_commits(step, committed)
        else:
            copies, relists, moves, released, plans = [], [], 0, 0, []
            for _, r, made in committed:
                if holey:
                    holey.discard(r)
                plan = step.plan_of(made) if made.__class__ is int else made  # commit ``made`` of the step, or a Plan
                plans.append(plan)
                if plan.moves:
                    copies.append((plan.moves, r))
                if plan.src_blocks:  # NOTE: an empty free changes nothing; the shadow's recorders drop them too
                    self.pool.free(list(plan.src_blocks))
                moves += len(plan.moves)
                released += len(plan.src_blocks)
                relists.append(bool(plan.src_blocks))
            plan_of = plans.__getitem__
        n = len(relists)
        stats.plans_made += n
        stats.plans_committed += n
        stats.moves_committed += moves
        stats.blocks_released += released
        self._commits = StepCommits(n, 0, n, moves, released, relists, plan_of)
        if copies:
            self._submit_ordered(copies)
        if holey:
            self._holey = {r for r in holey if r in self.table and not self._is_dense(r)}

    def _submit_ordered(self, copies) -> None:
        """The step's copies to the engine in one call, each submitted, ordered before the next compute step and
        released. NOTE: the plans commit in this call; an engine that cannot order a copy before the next step (the
        core would keep the plan in flight) is outside this runtime's domain."""
        statuses = self.engine.submit_ordered(copies)
        if statuses.count(CopyStatus.ORDERED) != len(statuses):
            for (_, r), status in zip(copies, statuses):
                if status is not CopyStatus.ORDERED and not status.settled:
                    raise InvariantViolation("V6", f"request {r!r}: the fast path committed a plan whose copy the "
                                                   f"engine left {status.value}; it needs EVENT ordering")

    def _step_commits(self, step: EvictStep, js: range) -> tuple:
        """``_commit`` of ``step``'s commits ``js``, in that order (all of them, in the record's order, but for a
        planted bug's reordering), read from its record: frees each one's released blocks (few commits release
        any), and answers (the copies as one ``PackedCopies``, relists, moves, blocks released, plan_of)."""
        due, every = step.due, js == range(len(step))
        if self._holey:
            self._holey.difference_update(map(due.__getitem__, step.committed_rows()))
        relists = step.relists()
        if not every:
            relists = [relists[j] for j in js]
        if any(relists):
            for j, relist in zip(js, relists):
                if relist:
                    self.pool.free(step.released_by(j))
        if every:
            copies = PackedCopies(list(map(due.__getitem__, step.copy_rows)), array("q", step.copy_starts),
                                  step.fields) if step.copy_rows else []
        else:
            rows, starts, fields = [], array("q", [0]), array("q")
            for j in js:
                if step.fields_of(j):
                    fields.extend(step.fields_of(j))
                    rows.append(due[step.commits[8 * j]])
                    starts.append(len(fields) // 5)
            copies = PackedCopies(rows, starts, fields) if rows else []
        return copies, relists, step.moves, step.released, lambda i: step.plan_of(js[i])

    def _admitted_as(self, r: object) -> int:
        return self._admission.item(self.table._rows[r])

    def _is_dense(self, r: object) -> bool:
        row = self.table._rows[r]
        meta = self.table.layout.meta
        return meta[row, M_WRITE_POS] == meta[row, M_NUM_LIVE]

    def _pool_problem(self, items) -> tuple[int, Exception] | None:
        """The core's ``_check_pool_blocks`` over every new block of ``items``: the first item it refuses and the
        error it raises, or None. No plan is ever in flight here, so no block is reserved by one."""
        listed = self.table.layout.listed
        earlier: dict[int, list] = {}  # blocks the items before this one append: their requests list them by then
        for i, (r, new, _) in enumerate(items):
            for b in new:
                if not isinstance(b, (int, np.integer)) or not 0 <= b < self.pool.num_blocks:
                    return None  # the table refuses it first
                ref = self.pool.ref_count(b)
                if ref < 1:
                    return i, BlockNotOwnedError(f"request {r!r}: block {b} is free in the pool; sync only blocks "
                                                 f"allocated for the request")
                holders = listed[b] + len(earlier.get(b, ()))
                if holders and ref < holders + 1:
                    owners = self.table.owners(b) + earlier.get(b, [])
                    return i, BlockNotOwnedError(
                        f"request {r!r}: block {b} belongs to request {owners[0]!r} and the pool counts {ref} "
                        f"reference(s) for {len(owners) + 1} holders; a block is in two block lists only when it is "
                        f"shared in the pool")
            for b in new:
                earlier.setdefault(b, []).append(r)
        return None

