"""``ShadowedRuntime``: the fast path and the core's runtime in lockstep, compared after every call (V6).

The fast runtime drives the engine: its copies go to the engine, its freed blocks to the pool. Beside it the core's
``VTokenRuntime`` (the reference, configured as the fast runtime's domain: the dense read path with densify, or the
gather path with compact or Naive-Evict alone; EVENT ordering) runs every call on a ``ReplayAllocator``, which
answers from the same pool and frees nothing, and a ``ShadowEngine``, which orders every copy and runs none. After
each call the shadow compares what the two answered (write slots, victims, plans in order, the copies submitted, the
blocks freed, errors by class and message, read-list changes) and the whole table state (``TokenTable.state()``'s
shape); a difference raises ``InvariantViolation("V6", ...)`` naming the step, the call and what differs.

NOTE: the core runs first in every call, so each of its checks reads the pool as the fast path found it (the fast
path frees blocks; the replay frees none). Blocks the core allocates (compaction's destinations) it takes from the
real pool, and the fast path is handed exactly those, in order, when it asks for as many: two runtimes that plan
alike get the same blocks, and one that asks for other counts diverges there. While they wait, the fast path's pool
counts them as free, as the core's pool did when it chose. Cost: the core's own cost plus O(requests x tokens) for
the state comparison per call: a staging and test setting (strict verify), not a serving one.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Iterable, Mapping, Sequence

from vtoken.core.copy_engine import CopyHandle, CopyStatus
from vtoken.core.errors import InvariantViolation, VTokenError
from vtoken.core.plan import PlanKind
from vtoken.core.policies.base import RenamedRequests
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig, ReclaimStats
from vtoken.core.runtime import ReadPath, VTokenRuntime

from .commits import NO_COMMITS, StepCommits, kept_destinations
from .gather_runtime import GatherRuntime
from .moves import copy_pairs
from .reads import StepReads, take_step_reads
from .runtime import FastRuntime

# the dense path's runtime counts these of the manager's (it runs no rounds); the gather path's counts them all
_DENSE_STATS = ("plans_made", "plans_committed", "moves_committed", "moves_dropped", "blocks_released", "no_plan",
                "plans_aborted")
_ALL_STATS = tuple(f.name for f in fields(ReclaimStats))


class ReplayAllocator:
    """The core's pool in the shadow: every query answered by the real pool, every free recorded and not made, every
    allocation made in the real pool and queued for the fast path (``handoff``)."""

    def __init__(self, pool) -> None:
        self.real = pool
        self.num_blocks, self.block_size, self.headroom = pool.num_blocks, pool.block_size, pool.headroom
        self.freed: list[list[int]] = []
        self.handoff: list[list[int]] = []  # allocated by the core, not yet asked for by the fast path

    num_free = property(lambda self: self.real.num_free)
    num_allocated = property(lambda self: self.real.num_allocated)

    def can_allocate(self, n, purpose) -> bool:
        return self.real.can_allocate(n, purpose)

    def allocate(self, n, purpose) -> list[int]:
        blocks = self.real.allocate(n, purpose)
        self.handoff.append(list(blocks))
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        block_ids = list(block_ids)
        if block_ids:  # an empty free changes nothing (the fast path makes none)
            self.freed.append(block_ids)

    def share(self, block_id: int) -> None:
        raise InvariantViolation("V6", "the shadow core shared a block: requests are admitted empty on this path")

    def ref_count(self, block_id: int) -> int:
        return self.real.ref_count(block_id)

    def is_cached(self, block_id: int) -> bool:
        return self.real.is_cached(block_id)


class ShadowEngine:
    """The core's copy engine in the shadow: records each submitted copy, orders it at once (EVENT), runs none."""

    def __init__(self) -> None:
        self.submitted: list[tuple[object, tuple]] = []
        self._next = 0

    def submit(self, moves, req_id=None) -> CopyHandle:
        self.submitted.append((req_id, tuple(moves)))
        self._next += 1
        return CopyHandle(self._next)

    def submit_ordered(self, copies) -> list[CopyStatus]:
        """``submit``, ``order_before_compute`` and ``release`` of each (moves, request) (the fast path's call)."""
        return [self.order_before_compute(self.submit(moves, req_id)) for moves, req_id in copy_pairs(copies)]

    def poll(self, handle) -> CopyStatus:
        return CopyStatus.ORDERED

    def order_before_compute(self, handle) -> CopyStatus:
        return CopyStatus.ORDERED

    def wait(self, handle) -> CopyStatus:
        return CopyStatus.ORDERED

    def release(self, handle) -> None:
        return None

    def before_compute(self) -> None:
        return None


class _Recording:
    """The fast runtime's pool or engine, forwarding every call, recording frees and submits. As the pool, it hands
    out the blocks the core allocated (``replay.handoff``) and counts them free until it does (``num_free``: what
    the fast path's destination budget reads; it asks nothing else of the pool's free count)."""

    def __init__(self, real, replay: ReplayAllocator | None = None) -> None:
        self.real, self.replay = real, replay
        self.freed: list[list[int]] = []
        self.submitted: list[tuple[object, tuple]] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    @property
    def num_free(self) -> int:
        return self.real.num_free + sum(map(len, self.replay.handoff))

    @property
    def num_allocated(self) -> int:
        return self.real.num_allocated - sum(map(len, self.replay.handoff))

    def allocate(self, n, purpose) -> list[int]:
        queue = self.replay.handoff
        if not queue or len(queue[0]) != n:
            raise InvariantViolation("V6", f"the fast path allocated {n!r} block(s) where the core allocated "
                                           f"{[len(q) for q in queue] or 'none'}")
        return queue.pop(0)

    def free(self, block_ids) -> None:
        block_ids = list(block_ids)
        self.real.free(block_ids)
        if block_ids:
            self.freed.append(block_ids)

    def submit(self, moves, req_id=None):
        h = self.real.submit(moves, req_id=req_id)
        self.submitted.append((req_id, tuple(moves)))
        return h

    def submit_ordered(self, copies):
        copies = list(copies)
        statuses = self.real.submit_ordered(copies)
        self.submitted += [(req_id, tuple(moves)) for moves, req_id in copies]
        return statuses


class ShadowedRuntime:
    """``FastRuntime``'s interface; every mutation runs on the core first, then on the fast path, then both are
    compared (see the module docstring). Queries are the fast path's (its state equals the core's after every call)."""

    def __init__(self, pool, engine, policy, budget, rows: int, tokens: int, evict_every: int = 1, seed: int = 0,
                 names: dict | None = None, read_path: ReadPath = ReadPath.DENSE,
                 config: ReclaimConfig | None = None) -> None:
        """``names``: as ``FastRuntime``'s; the core's policy draws by the same names (``RenamedRequests``).
        ``read_path``: the dense path (densify; ``config`` unused) or the gather path, whose ``config`` is the compact
        planner's ``ReclaimConfig`` (EVENT ordering) or None (Naive-Evict alone): ``GatherRuntime``'s."""
        self.replay, self.shadow_engine = ReplayAllocator(pool), ShadowEngine()
        self._pool, self._engine = _Recording(pool, self.replay), _Recording(engine)
        self.gather = read_path is ReadPath.GATHER
        if self.gather:
            self.fast = GatherRuntime(self._pool, self._engine, policy, budget, rows, tokens, config, evict_every,
                                      seed, names)
        else:
            self.fast = FastRuntime(self._pool, self._engine, policy, budget, rows, tokens, evict_every, seed, names)
            config = ReclaimConfig(PlanKind.DENSIFY, ordering=Ordering.EVENT)
        core_policy = RenamedRequests(policy, self.fast.names) if policy is not None and names is not None else policy
        self.core = VTokenRuntime(self.replay, self.shadow_engine, core_policy, budget, config, read_path, seed=seed,
                                  evict_every=evict_every, ordering=Ordering.EVENT if config is None else None)
        self._stats = _ALL_STATS if self.gather else _DENSE_STATS
        self.calls = 0  # compared calls so far: a divergence names the call
        self._commits = NO_COMMITS  # the fast path's, taken in the comparison of its last evict_and_reclaim

    # ---- mutations: both, then compared ---------------------------------------------------
    def admit(self, req_id: object) -> None:
        self._both("admit", lambda rt: rt.admit(req_id))

    def detach(self, req_id: object) -> list[int]:
        return self._both("detach", lambda rt: rt.detach(req_id))

    def set_pressure(self, blocks_short: int) -> None:
        self._both("set_pressure", lambda rt: rt.set_pressure(blocks_short))

    def sync(self, req_id: object, new_blocks: Sequence[int], total_len: int) -> list[int]:
        return self.sync_many([(req_id, new_blocks, total_len)])[0]

    def sync_many(self, items: Sequence[tuple[object, Sequence[int], int]]) -> list[list[int]]:
        items = [(r, list(new) if isinstance(new, (list, tuple)) else new, total) for r, new, total in items]

        # NOTE: the core syncs one request after another; the fast path all or none. They differ only after a refusal
        # that is not the first item's (the core keeps the items before it): a divergence, reported as one
        return self._both("sync_many", lambda rt: rt.sync_many(items) if rt is self.fast
                          else [rt.sync(r, new, total) for r, new, total in items])

    def evict_and_reclaim(self, req_ids: Sequence[object], attention: Mapping | None = None,
                          key_norms: Mapping | None = None, observed: Mapping | None = None) -> dict[object, list[int]]:
        def run(rt) -> tuple:
            victims = rt.evict_and_reclaim(req_ids, attention, key_norms, observed)
            # the core commits at its settle (EVENT: at once); the fast path did in the call: compare the plans now,
            # and their counts as the scheduler reads them
            if rt is self.core:
                plans = [rec.plan for rec in rt.settle() if rec.state is PlanState.COMMITTED]
                commits = StepCommits.of_plans(plans, [kept_destinations(rt, p) for p in plans])
            else:
                commits = self._commits = rt.take_commits()
                plans = commits.all_plans()
            return victims, plans, _counts(commits), [p for p, relist in zip(plans, commits.relists) if relist]
        return self._both("evict_and_reclaim", run)[0]

    def read_changes(self, req_id: object):
        """Both runtimes' change logs taken, their answers compared (the logs are not part of ``state()``)."""
        return self._both("read_changes", lambda rt: rt.read_changes(req_id), state=False)

    def read_lists(self, req_id: object) -> tuple[list[int], list[int]]:
        return self._both("read_lists", lambda rt: rt.read_lists(req_id), state=False)

    def read_step(self, req_ids: Sequence[object], check: bool = False) -> StepReads:
        """The fast path's ``read_step`` against the core's answers request by request (``take_step_reads``)."""
        return self._both("read_step", lambda rt: rt.read_step(req_ids, check) if rt is self.fast
                          else take_step_reads(rt, req_ids, check), state=False)

    def take_commits(self) -> StepCommits:
        done, self._commits = self._commits, NO_COMMITS
        return done

    # ---- queries: the fast path's ------------------------------------------------------------
    def __getattr__(self, name):
        return getattr(self.fast, name)

    def __contains__(self, req_id: object) -> bool:
        return req_id in self.fast

    # ---- the comparison ----------------------------------------------------------------------
    def _both(self, call: str, run, state: bool = True):
        """``run`` on the core, then on the fast path; their errors, answers, copies, frees and blocks handed over
        compared, and (``state``) their counters and whole table states."""
        self.calls += 1
        want, want_error = self._run(run, self.core)
        got, got_error = self._run(run, self.fast)
        if (type(want_error), str(want_error)) != (type(got_error), str(got_error)):
            self._diverged(call, "error", want_error, got_error)
        if want_error is None and want != got:
            if isinstance(want, StepReads):  # name the request and the change
                self._diverged(call, "read lists", want.first_difference(got), "")
            self._diverged(call, "answer", want, got)
        for what, core_side, fast_side in (("copies submitted", self.shadow_engine, self._engine),
                                           ("blocks freed", self.replay, self._pool)):
            log = "submitted" if what == "copies submitted" else "freed"
            if getattr(core_side, log) != getattr(fast_side, log):
                self._diverged(call, what, getattr(core_side, log), getattr(fast_side, log))
            getattr(core_side, log).clear()
            getattr(fast_side, log).clear()
        if self.replay.handoff:
            left, self.replay.handoff = self.replay.handoff, []
            self._diverged(call, "blocks allocated", f"{left} more", "none")
        if state:
            cs, fs = self.core.reclaim_stats, self.fast.reclaim_stats
            for name in self._stats:
                if getattr(cs, name) != getattr(fs, name):
                    self._diverged(call, f"reclaim_stats.{name}", getattr(cs, name), getattr(fs, name))
            want_state, got_state = self.core.table.state(), self.fast.table.state()
            if want_state != got_state:
                self._diverged(call, "state", _first_difference(want_state, got_state), "")
        if want_error is not None:
            raise got_error
        return got

    @staticmethod
    def _run(run, rt):
        """``run(rt)``'s answer, or the error it raised: bad input (``VTokenError``) or a failed invariant check, which
        is compared too (one side's own check failing where the other's passed is a divergence)."""
        try:
            return run(rt), None
        except (VTokenError, InvariantViolation) as e:
            return None, e

    def _diverged(self, call: str, what: str, want, got) -> None:
        raise InvariantViolation("V6", f"call {self.calls} ({call}): the fast path's {what} differs from the core's: "
                                       f"core {_short(want)}, fast {_short(got)}")


def _counts(c: StepCommits) -> tuple[int, int, int, int, int]:
    return c.plans, c.releases, c.densified, c.moves, c.blocks_released


def _short(x: object, n: int = 300) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "..."


def _first_difference(want: tuple, got: tuple) -> str:
    """Where two ``state()`` tuples first differ: a request's row (by id and field) or the pool's occupancy."""
    want_rows, got_rows = want[0], got[0]
    fields = ("id", "slots", "blocks", "shared", "write_pos", "num_live", "layout_version", "last_sync_start")
    if [r[0] for r in want_rows] != [r[0] for r in got_rows]:
        return f"requests core {[r[0] for r in want_rows][:8]}, fast {[r[0] for r in got_rows][:8]}"
    for w, g in zip(want_rows, got_rows):
        for name, a, b in zip(fields, w, g):
            if a != b:
                return f"request {w[0]!r} {name}: core {_short(a, 120)}, fast {_short(b, 120)}"
    return "the pool's occupancy (holders, per-block live counts or live slots)"
