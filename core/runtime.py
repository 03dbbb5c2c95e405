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
from dataclasses import dataclass
from typing import Mapping, Sequence

from .block_pool import BlockAllocator, Purpose, blocks_needed
from .copy_engine import CopyEngine
from .errors import (
    AdmissionClosedError,
    BlockNotOwnedError,
    ConfigError,
    DuplicateRequestError,
    InvariantViolation,
    PlanConflictError,
    PoolExhaustedError,
    UnknownRequestError,
    VTokenError,
)
from .plan import PlanKind
from .policies.base import EvictionPolicy, RequestView
from .reclamation import Ordering, ReclaimConfig, ReclamationManager
from .scores import TokenScores
from .token_table import NO_SLOT, TokenTable


def check_budget(budget: object) -> None:
    """A ``ConfigError`` naming the value unless ``budget`` is a ratio in (0, 1] (float) or a count >= 1 (int)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) \
            or (isinstance(budget, float) and not 0.0 < budget <= 1.0) or (isinstance(budget, int) and budget < 1):
        raise ConfigError(f"budget must be a ratio in (0, 1] (a float) or a token count >= 1 (an int), got {budget!r}")


class ReadPath(enum.Enum):
    GATHER = "gather"
    DENSE = "dense"


@dataclass(frozen=True)
class StepRequest:
    """One request's inputs for one forward."""

    req_id: object
    new_tokens: range  # logical ids appended this step
    write_slots: list[int]  # where their K/V goes (NO_SLOT: skip the write)
    read_slots: list[int]  # what attention reads, in read order
    read_tokens: list[int]  # the logical token at each read slot


@dataclass(frozen=True)
class StepInputs:
    iteration: int
    requests: dict[object, StepRequest]


class VTokenRuntime:
    """The vToken substrate for one pool: token tables, scores, policy, reclamation.

    Args:
        pool: the block allocator.
        engine: the copy engine.
        policy: the eviction policy (None: never evict, i.e. native full retention).
        budget: live tokens a request may keep: a ratio of its tokens in (0, 1] (float) or a count (int).
        reclaim: the reclamation configuration (None: Naive-Evict, no reclamation).
        read_path: how attention reads KV.
        seed: passed to randomized policies.
    """

    def __init__(self, pool: BlockAllocator, engine: CopyEngine, policy: EvictionPolicy | None = None,
                 budget: float | int = 1.0, reclaim: ReclaimConfig | None = None,
                 read_path: ReadPath = ReadPath.GATHER, seed: int = 0, score_window: int = 32) -> None:
        check_budget(budget)
        if not isinstance(read_path, ReadPath):
            raise ConfigError(f"read_path must be one of {[p.value for p in ReadPath]}, got {read_path!r}")
        if read_path is ReadPath.DENSE and policy is not None:
            if reclaim is None or reclaim.planner is not PlanKind.DENSIFY:
                raise ConfigError("read_path 'dense' needs reclaim planner 'densify': stock kernels cannot skip holes")
            if reclaim.ordering is Ordering.POLL:
                raise ConfigError("read_path 'dense' needs ordering 'event' or 'force_sync', not 'poll'")
        self.pool = pool
        self.engine = engine
        self.policy = policy
        self.budget = budget
        self.read_path = read_path
        self.seed = seed
        self.table = TokenTable(pool.num_blocks, pool.block_size)
        self.scores = TokenScores(score_window)
        self.reclaim = reclaim
        self.manager = ReclamationManager(pool, self.table, engine, reclaim or ReclaimConfig())
        self.iteration = 0
        self._last: StepInputs | None = None
        # the name a policy sees (and seeds with) for a request, when its id is not reproducible
        # (vLLM appends a random suffix to request ids)
        self.policy_names: dict[object, object] = {}

    def set_budget(self, budget: float) -> None:
        """Change the eviction budget from the next victim selection on (checked as at construction; a bad
        value raises ``ConfigError`` and changes nothing). Lowering it makes every request evict its new
        excess at once: an eviction burst."""
        check_budget(budget)
        self.budget = budget

    # ---- requests -----------------------------------------------------------------
    def can_admit(self, prompt_len: int) -> bool:
        return self.manager.admission_open() and self.pool.can_allocate(
            blocks_needed(prompt_len, self.pool.block_size), Purpose.ADMISSION
        )

    def admit(self, req_id: object, share_prefix_of: object = None, shared_blocks: int = 0) -> None:
        """Register a request; its prompt arrives as the appends of the next ``begin_step``.

        With ``share_prefix_of``, the first ``shared_blocks`` blocks of that
        request are shared (prefix-cache hit): their tokens are registered as
        already computed. Only blocks whose S tokens are all live in their
        original slots can be shared.
        """
        if req_id in self.table:
            raise DuplicateRequestError(f"request {req_id!r} is already admitted")
        if not self.manager.admission_open():
            raise AdmissionClosedError(f"admission of {req_id!r} waits for in-flight reclamation")
        prefix: list[int] = []
        if share_prefix_of is not None:
            prefix = self._shareable_prefix(share_prefix_of, shared_blocks)
        self.table.add_request(req_id)
        self.scores.add_request(req_id)
        for b in prefix:
            self.pool.share(b)
        if prefix:
            self.table.sync_new_tokens(req_id, prefix, len(prefix) * self.pool.block_size)
            self.scores.extend(req_id, len(prefix) * self.pool.block_size)

    def finish(self, req_id: object) -> None:
        self._remove(req_id)

    def preempt(self, req_id: object) -> int:
        """Drop the request's KV for recomputation; returns its length (to re-prefill)."""
        n = self.table.total_len(req_id)
        self._remove(req_id)
        return n

    def running(self) -> list[object]:
        return self.table.request_ids()

    # ---- Algorithm 1 -------------------------------------------------------------------
    def blocks_to_grow(self, req_id: object, n_new: int) -> int:
        S = self.pool.block_size
        return max(0, blocks_needed(self.table.write_pos(req_id) + n_new, S) - len(self.table.block_ids(req_id)))

    def begin_step(self, appends: Mapping[object, int]) -> StepInputs:
        """Settle copies, sync this step's new tokens, and build every running request's slots."""
        self.manager.settle()
        need = {}
        for r, n in appends.items():
            if r not in self.table:
                raise UnknownRequestError(f"unknown request {r!r}")
            if not isinstance(n, int) or n < 0:
                raise VTokenError(f"request {r!r}: cannot append {n!r} tokens")
            need[r] = self.blocks_to_grow(r, n)
        total = sum(need.values())
        if not self.pool.can_allocate(total, Purpose.ADMISSION):
            raise PoolExhaustedError(
                f"step {self.iteration}: appends need {total} blocks, {self.pool.num_free} free "
                f"with {self.pool.headroom} reserved; preempt a request first"
            )
        for r, n in appends.items():
            self.sync(r, self.pool.allocate(need[r], Purpose.ADMISSION), self.table.total_len(r) + n)
        reqs = {}
        for r in self.table.request_ids():
            start = self.table.total_len(r) - appends.get(r, 0)
            new = range(start, self.table.total_len(r))
            write = self.table.write_slots(r)[-len(new):] if len(new) else []
            slots, tokens = self._read_slots(r)
            reqs[r] = StepRequest(r, new, write, slots, tokens)
        self._last = StepInputs(self.iteration, reqs)
        self.engine.before_compute()  # pre-attention hook: the forward waits on ordered copies (I3)
        return self._last

    def end_step(self, attention: Mapping[object, Sequence[float]] | None = None) -> dict[object, list[int]]:
        """Record this step's attention, select victims and evict, plan and launch reclamation.

        This step's rows are recorded before victims are chosen, so the
        policy sees every attention row computed so far (Algorithm 1 line 2
        reads the scores of the decode that preceded it). In particular a
        request's first eviction, right after its prefill and usually its
        largest, ranks tokens by the prefill's row rather than by zeros.
        Everything is validated first: a bad attention row or a policy
        returning invalid victims raises and changes nothing, the recorded
        rows included (the step can be ended again). Returns each request's
        victims.
        """
        if self._last is None:
            raise VTokenError("end_step without begin_step")
        step = self._last
        rows = {}
        for r, weights in (attention or {}).items():
            if r not in self.table:
                continue  # finished during the step
            if r not in step.requests or len(weights) != len(step.requests[r].read_tokens):
                raise VTokenError(
                    f"request {r!r}: attention row of {len(weights)} weights for "
                    f"{len(step.requests[r].read_tokens) if r in step.requests else 'no'} read tokens"
                )
            rows[r] = (step.requests[r].read_tokens, weights)
        victims = self._record_and_choose(self.table.request_ids(), rows)
        # -- validated; mutate --
        self._evict_and_reclaim(victims)
        self._last = None
        return victims

    # ---- for engines that allocate and schedule themselves (vLLM) -----------------------
    def sync(self, req_id: object, new_blocks: Sequence[int], total_len: int) -> list[int]:
        """Algorithm 1 line 1 with blocks the engine allocated: register tokens up to ``total_len``
        (appending ``new_blocks`` to the block list); returns their write slots."""
        slots = self.table.sync_new_tokens(req_id, new_blocks, total_len)
        self.scores.extend(req_id, self.table.total_len(req_id))
        return slots

    def evict_and_reclaim(self, req_ids: Sequence[object],
                          attention: Mapping[object, tuple[Sequence[int], Sequence[float]]] | None = None
                          ) -> dict[object, list[int]]:
        """Algorithm 1 lines 2, 3 and 5 for ``req_ids`` after a forward: record this step's attention rows
        (request -> (token ids read, weights)), select victims (from every row so far, this step's included),
        evict, plan and launch reclamation. Validated first: a bad row or an invalid policy answer raises and
        changes nothing."""
        unknown = [r for r in list(req_ids) + list(attention or {}) if r not in self.table]
        if unknown:
            raise UnknownRequestError(f"unknown request(s) {unknown[:5]}")
        for r, (ids, weights) in (attention or {}).items():
            if len(ids) != len(weights) or any(not 0 <= t < self.table.total_len(r) for t in ids):
                raise VTokenError(f"request {r!r}: attention row of {len(weights)} weights for {len(ids)} tokens "
                                  f"(ids must be < {self.table.total_len(r)})")
        victims = self._record_and_choose(req_ids, attention or {})
        self._evict_and_reclaim(victims)
        return victims

    def detach(self, req_id: object) -> list[int]:
        """Forget a request whose blocks the engine frees itself (finish, abort, preemption).

        Returns its block list. Only when no plan of it is in flight: a pending copy would still
        touch those blocks (I5, I6), and only this runtime could hold them back.
        """
        if self.manager.in_flight(req_id) is not None:
            raise PlanConflictError(f"request {req_id!r} has a plan in flight; its blocks cannot be handed back yet")
        blocks = self.table.remove_request(req_id)
        self.scores.remove_request(req_id)
        return blocks

    # ---- helpers ----------------------------------------------------------------------
    def _record_and_choose(self, req_ids: Sequence[object],
                           rows: Mapping[object, tuple[Sequence[int], Sequence[float]]]) -> dict[object, list[int]]:
        """Record validated rows, then choose victims; if choosing raises, the rows are taken back."""
        saved = {r: self.scores.save(r, ids) for r, (ids, _) in rows.items()}
        for r, (ids, weights) in rows.items():
            self.scores.record(r, ids, weights)
        try:
            return self._choose_victims(req_ids)
        except BaseException:
            for r, (ids, _) in rows.items():
                self.scores.restore(r, ids, saved[r])
            raise

    def token_budget(self, total_len: int) -> int:
        """Live tokens a request of ``total_len`` tokens may keep."""
        if isinstance(self.budget, int):
            return self.budget
        return max(1, math.ceil(self.budget * total_len))

    def _choose_victims(self, req_ids: Sequence[object]) -> dict[object, list[int]]:
        victims: dict[object, list[int]] = {}
        if self.policy is not None:
            for r in req_ids:
                chosen = self._select(r)
                if chosen:
                    victims[r] = chosen
        return victims

    def _evict_and_reclaim(self, victims: Mapping[object, list[int]]) -> None:
        for r, chosen in victims.items():
            for t in chosen:
                self.table.evict_token(r, t)
        self._reclaim()
        self.manager.launch()
        self.iteration += 1

    def _select(self, r: object) -> list[int]:
        live = self.table.live_token_ids(r)
        total = self.table.total_len(r)
        view = RequestView(
            req_id=self.policy_names.get(r, r), live=live, total_len=total,
            budget=self.token_budget(total),
            accumulated=lambda t: self.scores.accumulated(r, t),
            persistence=lambda t: self.scores.persistence(r, t),
            seed=self.seed, step=self.iteration, protected=self._protected(r),
        )
        victims = list(self.policy.select_victims(view))
        bad = [t for t in victims if not isinstance(t, int) or t in view.protected
               or not 0 <= t < total or not self.table.is_live(r, t)]
        if bad or len(set(victims)) != len(victims) or len(victims) > view.excess:
            raise VTokenError(
                f"policy {self.policy.name!r} returned invalid victims for request {r!r}: "
                f"{victims[:8]} (bad: {bad[:8]}, excess allowed {view.excess})"
            )
        return victims

    def _protected(self, r: object) -> frozenset[int]:
        """On the dense path, tokens in shared blocks stay: densify cannot fill holes there."""
        if self.read_path is not ReadPath.DENSE:
            return frozenset()
        S = self.pool.block_size
        shared = {b for b in self.table.block_ids(r) if self.pool.ref_count(b) > 1}
        if not shared:
            return frozenset()
        return frozenset(t for t in self.table.live_token_ids(r) if self.table.slot_of(r, t) // S in shared)

    def _reclaim(self) -> None:
        if self.reclaim is None:
            return
        if self.read_path is ReadPath.DENSE:
            for r in self.table.request_ids():
                if r not in self.manager.inflight and not self._is_dense(r):
                    self.manager.plan_request(r)
        elif self.manager.should_reclaim(self.iteration):
            self.manager.plan_round(self.table.request_ids())

    def _is_dense(self, r: object) -> bool:
        return self.table.write_pos(r) == self.table.num_live(r)

    def _read_slots(self, r: object) -> tuple[list[int], list[int]]:
        tokens = self.table.live_token_ids(r)
        slots = self.table.attention_slots(r)
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
        if not isinstance(k, int) or not 0 < k <= len(blocks) or k * S > self.table.write_pos(other):
            raise BlockNotOwnedError(f"request {other!r} has no {k!r} full blocks to share")
        for i, b in enumerate(blocks[:k]):
            for o in range(S):
                t = i * S + o
                if self.table.slot_of(other, t) != b * S + o:  # t < k*S <= cursor <= total_len
                    raise BlockNotOwnedError(
                        f"request {other!r}: block {b} no longer holds logical tokens "
                        f"[{i * S}, {(i + 1) * S}) in place; it cannot be shared"
                    )
        return blocks[:k]

    def _remove(self, req_id: object) -> None:
        blocks = self.table.remove_request(req_id)
        self.scores.remove_request(req_id)
        self.manager.on_request_removed(req_id, blocks)


__all__ = ["ReadPath", "StepInputs", "StepRequest", "VTokenRuntime", "AdmissionClosedError", "NO_SLOT", "check_budget"]
