"""Oracles for function and progress: what the fuzzer checks beyond the safety invariants I1-I7.

The safety checkers (core/reference/invariants.py) pass on a core that chooses the wrong victims, computes F
with the wrong denominator, keeps a block too many, never aborts a failed copy or leaks a copy
handle: every such state is *legal*. Each oracle here recomputes one decision of the core from its
definition (docs/spec.md, the seed) and from plain reads of the state, never by calling the code it
checks, and raises ``OracleViolation`` naming itself when the core's answer differs:

  policy       the victims are a set the policy's rule allows, given the same scores (a small
               reference model per shipped policy), and the scores are the ones a shadow accumulates
               from the attention rows the fuzzer fed in;
  eq1          F = 1 - live slots / (allocated blocks x S), recounted from the pool and the tables;
  trigger      should_reclaim's decision, recomputed from theta_F, the low watermark, K and (adaptive
               trigger) the burst rule;
  blocks       every request holds exactly ceil(write_pos / S) blocks, grows by what its next write
               needs, and the pool's free count and admission answers follow P3;
  headroom     with headroom H > 0 the destinations outstanding plans hold never exceed H, and the
               destination budget is what the definition gives;
  planner      a compact plan fills every destination but the last; a densify plan leaves
               ceil(n_live / S) blocks; no planner says "no plan" when the definition has one;
  progress     after every settle no plan is COPYING a settled copy and no orphan waits on one;
               after every launch no plan is still PLANNED;
  stream       the device model is one stream: a copy settles only after every earlier one;
  quiescence   no copy handle outlives its plan; once every request has finished and every copy
               settled, the pool is whole (all blocks free, no plan, no orphan, no copy handle, no live
               slot, no scores, headroom intact);
  stats        every counter of ``manager.stats`` equals what the oracles count from the calls they see:
               plans made, committed and aborted (by reason), no-plan answers (by reason), moves committed
               and dropped, blocks released (a committed request's block count before minus after), rounds,
               bursts and burst rounds (the trigger reference's);
  round        plan_round tries requests in order of decreasing excess blocks, and tries every request
               with an excess unless it made ``max_plans_per_round`` plans;
  admission    can_admit(p) is "admission open and ceil(p / S) blocks fit outside the headroom";
  no-plan      a planner's "no plan" names the request in its detail.

``Oracles.attach`` wraps the manager's entry points *on the instance*, so a planted bug (which
patches the class) still runs underneath, and the runtime, which calls ``self.manager.x``, goes
through the wrapper.
"""

from __future__ import annotations

from array import array
from collections import Counter
from typing import Callable

from vtoken.core.block_pool import Purpose
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.plan import NoPlanReason, Plan, PlanKind
from vtoken.core.policies.base import RequestView
from vtoken.core.policies.h2o import H2O
from vtoken.core.policies.knorm import Knorm
from vtoken.core.policies.random_policy import RandomPolicy
from vtoken.core.policies.scissorhands import Scissorhands
from vtoken.core.policies.snapkv import SnapKV
from vtoken.core.policies.streaming_llm import StreamingLLM
from vtoken.core.policies.tova import TOVA
from vtoken.core.reclamation import PlanRecord, PlanState
from vtoken.core.runtime import ReadPath


class OracleViolation(AssertionError):
    """A functional or progress oracle disagrees with the core; ``oracle`` names which one."""

    def __init__(self, oracle: str, message: str) -> None:
        super().__init__(f"{oracle}: {message}")
        self.oracle = oracle


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


# ---- policy: reference victim rules ----------------------------------------------------------------
def _evictable(view: RequestView, newest_kept: int) -> list[int]:
    """Live tokens outside the newest ``newest_kept`` and not protected, oldest first."""
    live = list(view.live)
    return [t for t in live[: max(0, len(live) - newest_kept)] if t not in view.protected]


def _lowest_first(name: str, victims: list[int], pool: list[int], key: Callable[[int], tuple], want: int) -> None:
    """``victims`` must be ``want`` members of ``pool`` none of whose keys exceeds a spared member's (ties free)."""
    vs = set(victims)
    if len(vs) != want or not vs <= set(pool):
        raise OracleViolation("policy", f"{name}: victims {sorted(vs)[:12]} are not {want} of the evictable "
                                        f"{pool[:12]}{'…' if len(pool) > 12 else ''}")
    spared = [t for t in pool if t not in vs]
    if vs and spared:
        worst, best = max(vs, key=key), min(spared, key=key)
        if key(worst) > key(best):
            raise OracleViolation("policy", f"{name}: evicted {worst} (score {key(worst)}) but kept {best} "
                                            f"(score {key(best)}), which ranks lower")


def check_policy_choice(policy: object, view: RequestView, victims: list[int]) -> None:
    """The victims of one shipped policy for one view are a set its rule (seed §4.1, each paper) allows."""
    live, budget = list(view.live), view.budget
    excess = max(0, len(live) - budget)
    name = getattr(policy, "name", type(policy).__name__)
    if excess == 0:
        if victims:
            raise OracleViolation("policy", f"{name}: evicted {victims[:8]} from request {view.req_id!r}, "
                                            f"which is within its budget ({len(live)} <= {budget})")
        return
    if isinstance(policy, StreamingLLM):
        # the first min(sinks, budget - 1) live tokens are sinks; the newest budget - sinks form the window;
        # the oldest tokens between them leave first
        n_sinks = min(policy.sinks, budget - 1)
        sinks = set(live[:n_sinks])
        middle = [t for t in _evictable(view, budget - n_sinks) if t not in sinks]
        want = middle[:excess]
        if sorted(victims) != want:
            raise OracleViolation("policy", f"{name} (sinks {n_sinks}, window {budget - n_sinks}): request "
                                            f"{view.req_id!r} evicted {sorted(victims)[:12]}, the rule evicts "
                                            f"{want[:12]} (the oldest non-sink tokens outside the window)")
    elif isinstance(policy, H2O):
        pool = _evictable(view, max(1, int(budget * policy.recent_fraction)))
        _lowest_first(name, victims, pool, lambda t: (view.accumulated(t),), min(excess, len(pool)))
    elif isinstance(policy, Scissorhands):
        pool = _evictable(view, max(1, int(budget * policy.recent_fraction)))
        _lowest_first(name, victims, pool, lambda t: (view.persistence(t), view.accumulated(t)),
                      min(excess, len(pool)))
    elif isinstance(policy, RandomPolicy):
        pool = _evictable(view, policy.keep_recent)
        _lowest_first(name, victims, pool, lambda t: (), min(excess, len(pool)))
    elif isinstance(policy, TOVA):  # the newest query's weights only
        pool = _evictable(view, policy.keep_recent)
        _lowest_first(name, victims, pool, lambda t: (view.latest(t),), min(excess, len(pool)))
    elif isinstance(policy, Knorm):  # the largest key norms leave first
        pool = _evictable(view, policy.keep_recent)
        _lowest_first(name, victims, pool, lambda t: (-view.key_norm(t),), min(excess, len(pool)))
    elif isinstance(policy, SnapKV):  # the least observed by the prompt's window, outside the window
        pool = _evictable(view, policy.window)
        _lowest_first(name, victims, pool, lambda t: (view.observed(t),), min(excess, len(pool)))
    else:
        raise OracleViolation("policy", f"no reference rule for policy {name!r}")


class ScoreShadow:
    """The scores a policy must see: each step's attention rows accumulated by the definitions of
    docs/spec.md (H2O: the sum of a token's weights; Scissorhands: a decayed count of the rows in which it
    got at least the row's mean; TOVA: the weight in the newest row that read it). Kept in float32, as the
    core stores them, so the two agree exactly. Key norms (Knorm) are a function of a token's content, which
    the caller gives ``check_view``."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.acc: dict[object, dict[int, float]] = {}
        self.per: dict[object, dict[int, float]] = {}
        self.lat: dict[object, dict[int, float]] = {}
        self.obs: dict[object, dict[int, float]] = {}
        self._undo: list = []

    def forget(self, req: object) -> None:
        for d in (self.acc, self.per, self.lat, self.obs):
            d.pop(req, None)

    def apply(self, rows: dict[object, tuple[list[int], list[float]]],
              votes: dict[object, tuple[list[int], list[float]]] = {}) -> None:
        """Record one step's rows and observations (SnapKV's votes: each replaces the last); ``undo`` takes them
        back (the step was refused)."""
        self._undo = [(r, *(dict(d.get(r, {})) for d in (self.acc, self.per, self.lat, self.obs)))
                      for r in {*rows, *votes}]
        f32 = array("f", [0.0])
        for r, (ids, values) in votes.items():
            obs = self.obs.setdefault(r, {})
            for t, v in zip(ids, values):
                f32[0] = v
                obs[t] = f32[0]
        for r, (ids, weights) in rows.items():
            if not ids:
                continue
            acc, per, lat = self.acc.setdefault(r, {}), self.per.setdefault(r, {}), self.lat.setdefault(r, {})
            mean = 1.0 / len(ids)
            for t, w in zip(ids, weights):
                f32[0] = acc.get(t, 0.0) + w
                acc[t] = f32[0]
                f32[0] = per.get(t, 0.0) * self.decay + (1.0 if w >= mean else 0.0)
                per[t] = f32[0]
                f32[0] = w
                lat[t] = f32[0]

    def undo(self) -> None:
        for r, acc, per, lat, obs in self._undo:
            self.acc[r], self.per[r], self.lat[r], self.obs[r] = acc, per, lat, obs
        self._undo = []

    def check_view(self, req: object, view: RequestView, statistics: tuple[str, ...] = (),
                   key_norm: Callable[[int], float] | None = None) -> None:
        """The view's scores are the shadow's: accumulated and persistence always, and the optional
        ``statistics`` the policy reads (``latest``; ``key_norm`` against ``key_norm(t)``, in float32)."""
        acc, per, lat, obs = (d.get(req, {}) for d in (self.acc, self.per, self.lat, self.obs))
        f32 = array("f", [0.0])
        for t in view.live:
            got, want = (view.accumulated(t), view.persistence(t)), (acc.get(t, 0.0), per.get(t, 0.0))
            if got != want:
                raise OracleViolation("policy", f"request {req!r} token {t}: the policy sees accumulated, "
                                                f"persistence {got}; the attention rows give {want}")
            if "latest" in statistics and view.latest(t) != lat.get(t, 0.0):
                raise OracleViolation("policy", f"request {req!r} token {t}: the policy sees latest "
                                                f"{view.latest(t)}; the newest row that read it gives {lat.get(t, 0.0)}")
            if "observed" in statistics and view.observed(t) != obs.get(t, 0.0):
                raise OracleViolation("policy", f"request {req!r} token {t}: the policy sees observed "
                                                f"{view.observed(t)}; its prompt's observation gives {obs.get(t, 0.0)}")
            if "key_norm" in statistics and key_norm is not None:
                f32[0] = key_norm(t)
                if view.key_norm(t) != f32[0]:
                    raise OracleViolation("policy", f"request {req!r} token {t}: the policy sees key norm "
                                                    f"{view.key_norm(t)}; its key gives {f32[0]}")


# ---- the trigger ---------------------------------------------------------------------------------
class TriggerReference:
    """should_reclaim by its definition (core/reclamation.py docstring, seed §3.3 Stage 1).

    Fixed: a round runs on every K-th iteration when F > theta_F and free blocks <= the low watermark.
    Adaptive (burst_df): F rising by >= burst_df within one iteration while F > theta_F starts burst mode,
    in which a round runs every iteration (watermark and theta_F still gate it); it ends once F <= theta_F
    or a round makes no plan with none in flight. F is re-read after each plan (its destinations are no burst).
    """

    def __init__(self, config) -> None:
        self.c = config
        self.f_prev: float | None = None
        self.burst = False
        self.bursts = 0  # bursts detected (stats.bursts)
        self.burst_rounds = 0  # rounds run off the K cadence (stats.burst_rounds)

    def decide(self, iteration: int, f: float, free: int) -> bool:
        c = self.c
        gated = c.low_watermark is not None and free > c.low_watermark
        if c.burst_df is None:
            return iteration % c.check_every == 0 and not gated and f > c.theta_f
        if self.f_prev is not None and f - self.f_prev >= c.burst_df and f > c.theta_f:
            self.bursts += not self.burst
            self.burst = True
        self.f_prev = f
        if self.burst and f <= c.theta_f:
            self.burst = False
        on_cadence = iteration % c.check_every == 0
        run = not gated and f > c.theta_f and (on_cadence or self.burst)
        self.burst_rounds += run and not on_cadence
        return run

    def planned(self, f_after: float) -> None:
        if self.f_prev is not None:
            self.f_prev = f_after

    def round_done(self, made_any: bool, in_flight: bool) -> None:
        if self.burst and not made_any and not in_flight:
            self.burst = False


# ---- statistics -------------------------------------------------------------------------------------
class StatsReference:
    """What ``ReclaimStats`` should read, counted from the manager calls the oracles see."""

    COUNTERS = ("rounds", "plans_made", "plans_committed", "plans_aborted", "no_plan", "moves_committed",
                "moves_dropped", "blocks_released", "releases_made", "releases_committed", "packs_made")

    def __init__(self) -> None:
        self.rounds = self.plans_made = self.plans_committed = self.releases_made = self.releases_committed = 0
        self.packs_made = 0
        self.moves_committed = self.moves_dropped = self.blocks_released = 0
        self.plans_aborted: Counter = Counter()
        self.no_plan: Counter = Counter()


# ---- the oracles, attached to one runtime ----------------------------------------------------------
class Oracles:
    def __init__(self, rt, engine) -> None:
        self.rt, self.m, self.pool, self.table, self.engine = rt, rt.manager, rt.pool, rt.table, engine
        self.S = rt.pool.block_size
        self.scores = ScoreShadow(rt.scores.decay)
        cfg = self.m.config if rt.reclaim is not None else None
        self.trigger = TriggerReference(cfg) if cfg is not None else None
        self.events: dict[str, int] = {}
        self.stats = StatsReference()
        self._round: list[tuple[object, int]] | None = None  # (request, excess) plan_round tried, in order

    def attach(self) -> "Oracles":
        m = self.m
        cls = type(m)
        stats = self.stats

        def should_reclaim(iteration):
            want = self.trigger.decide(iteration, self.waste_ratio(), self._free()) if self.trigger else None
            got = cls.should_reclaim(m, iteration)
            if want is not None and got != want:
                raise OracleViolation("trigger", f"iteration {iteration}: should_reclaim says {got}, the definition "
                                                 f"{want} (F {self.waste_ratio():.4f}, theta_F {m.config.theta_f}, "
                                                 f"free {self._free()}, watermark {m.config.low_watermark}, "
                                                 f"K {m.config.check_every}, burst_df {m.config.burst_df})")
            return got

        def plan_request(req_id, evicted_positions=None, pack=False):
            before = self._planning_view(req_id)
            if before is not None and pack:
                before["cached"] = set()  # a pressure round may pack prefix-cached blocks too
            if self._round is not None and before is not None:
                self._round.append((req_id, self._excess(req_id)))
            out = cls.plan_request(m, req_id, evicted_positions, pack)
            if isinstance(out, PlanRecord):
                stats.plans_made += 1
            else:
                stats.no_plan[out.reason] += 1
            if before is not None:
                self._check_plan(before, out)
                if isinstance(out, PlanRecord) and self.trigger:
                    self.trigger.planned(self.waste_ratio())
            if not isinstance(out, PlanRecord) and not out.detail.startswith(f"request {req_id!r}"):
                raise OracleViolation("no-plan", f"plan_request({req_id!r}) answered {out.reason.name} with "
                                                 f"detail {out.detail!r}, which does not name the request")
            return out

        def plan_relocation(req_id, index):
            """The drill's plan by its definition: a plan iff the block is private and a destination is free;
            it moves exactly the block's live tokens, each to its own offset of one fresh block."""
            before = self._planning_view(req_id)
            budget = self.destination_budget()
            out = cls.plan_relocation(m, req_id, index)  # raises for a bad id, a plan in flight, a bad index
            if isinstance(out, PlanRecord):
                stats.plans_made += 1
            else:
                stats.no_plan[out.reason] += 1
            src = before["blocks"][index]
            want = NoPlanReason.SHARED_BLOCK if src in before["shared"] else \
                NoPlanReason.NOT_ENOUGH_HEADROOM if budget < 1 else None
            got = out.reason if not isinstance(out, PlanRecord) else None
            if got is not want:
                raise OracleViolation("relocate", f"plan_relocation({req_id!r}, {index}) answered {got} "
                                                  f"(want {want}: block {src}, budget {budget})")
            if isinstance(out, PlanRecord):
                if self.trigger:
                    self.trigger.planned(self.waste_ratio())  # its destination counts as waste, and is no burst
                p, S = out.plan, self.S
                [dst] = p.dst_blocks
                wanted = sorted((t, pos % S) for t, pos in before["pos"].items() if pos // S == index)
                if sorted((mv.token_id, mv.src_offset) for mv in p.moves) != wanted or p.src_blocks != (src,) \
                        or any(mv.dst_block != dst or mv.dst_offset != mv.src_offset for mv in p.moves) \
                        or dst in before["blocks"]:
                    raise OracleViolation("relocate", f"plan_relocation({req_id!r}, {index}): {p} does not move "
                                                      f"the live tokens {wanted} of block {src} in place")
            return out

        def plan_release(req_id, among=None):
            """Naive-Evict's release by its definition (the paper's): exactly the blocks of the list (of ``among``'s
            indices, when given) wholly before the cursor's block that hold no live token and no other request
            holds, in list order; a plan iff there is one."""
            before = self._planning_view(req_id)
            out = cls.plan_release(m, req_id, among)  # raises for a bad id, a plan in flight
            if isinstance(out, PlanRecord):
                stats.releases_made += 1
            if before is not None:
                S, blocks = self.S, before["blocks"]
                holding = {pos // S for pos in before["pos"].values()}
                end = min(before["write_pos"] // S, len(blocks))  # blocks wholly before the cursor's
                looked = range(end) if among is None else sorted(set(among))
                want = tuple(blocks[i] for i in looked
                             if 0 <= i < end and i not in holding and blocks[i] not in before["shared"])
                got = out.plan.src_blocks if isinstance(out, PlanRecord) else ()
                if got != want or isinstance(out, PlanRecord) and (out.plan.moves or out.plan.dst_blocks
                                                                  or out.plan.kind is not PlanKind.RELEASE):
                    raise OracleViolation("release", f"plan_release({req_id!r}, {among!r}) released {got} "
                                                     f"({out!r:.120}); the wholly dead private blocks before the "
                                                     f"cursor's are {want}")
            return out

        def plan_pack(req_id, evicted_positions=None):
            before = self._planning_view(req_id)
            if self._round is not None and before is not None and (not self._round or self._round[-1][0] != req_id):
                self._round.append((req_id, self._excess(req_id)))
            out = cls.plan_pack(m, req_id, evicted_positions)
            if isinstance(out, PlanRecord):
                stats.plans_made += 1
                stats.packs_made += 1
            else:
                stats.no_plan[out.reason] += 1
            if before is not None:  # densify's definition, whatever the configured planner
                self._check_plan(dict(before, kind=PlanKind.DENSIFY), out)
                if isinstance(out, PlanRecord) and self.trigger:
                    self.trigger.planned(self.waste_ratio())
            return out

        def plan_round(req_ids, pack=False, evicted_positions=None):
            outer, self._round = self._round, []
            try:
                made = cls.plan_round(m, req_ids, pack, evicted_positions)
                stats.rounds += 1
                self._check_round(req_ids, self._round, made, pack)
            finally:
                self._round = outer
            if self.trigger:
                self.trigger.round_done(bool(made), bool(m.inflight))
            return made

        def settle():
            before = {r: (len(self.table.block_ids(r)), [mv.token_id for mv in rec.plan.moves])
                      for r, rec in m.inflight.items()}
            done = cls.settle(m)
            for rec in done:
                r = rec.plan.req_id
                if rec.state is PlanState.COMMITTED:
                    n_blocks, moved = before[r]
                    kept = sum(self.table.is_live(r, t) for t in moved)
                    if rec.plan.kind is PlanKind.RELEASE:
                        stats.releases_committed += 1
                    else:
                        stats.plans_committed += 1
                    stats.moves_committed += kept
                    stats.moves_dropped += len(moved) - kept
                    stats.blocks_released += n_blocks - len(self.table.block_ids(r))
                else:
                    stats.plans_aborted[rec.abort_reason] += 1
            self._check_settled()
            return done

        def launch():
            refused = cls.launch(m)
            for rec in refused:
                stats.plans_aborted[rec.abort_reason] += 1
            stuck = [r for r, rec in m.inflight.items() if rec.state is PlanState.PLANNED]
            if stuck:
                raise OracleViolation("progress", f"after launch the plans of {stuck} are still PLANNED")
            return refused

        def on_request_removed(req_id, blocks):
            rec = m.inflight.get(req_id) if self._hashable(req_id) else None
            cls.on_request_removed(m, req_id, blocks)
            if rec is not None:
                stats.plans_aborted[rec.abort_reason] += 1

        for f in (should_reclaim, plan_request, plan_pack, plan_relocation, plan_release, plan_round, settle, launch,
                  on_request_removed):
            setattr(m, f.__name__, f)
        return self

    @staticmethod
    def _hashable(x) -> bool:
        try:
            hash(x)
        except TypeError:
            return False
        return True

    def _excess(self, r) -> int:
        """Blocks a request holds beyond the ceil(n_live / S) its live tokens need."""
        return len(self.table.block_ids(r)) - _ceil(self.table.num_live(r), self.S)

    def _gap(self, r) -> int:
        """Holes before the request's cursor: write_pos - n_live."""
        return self.table.write_pos(r) - self.table.num_live(r)

    def _check_round(self, req_ids, tried: list[tuple[object, int]], made, pack: bool = False) -> None:
        """The round's order and reach by definition: the largest excess first (packing: then the most holes before
        the cursor), and, below the plan limit, every request without a plan in flight that holds an excess
        block (packing: or a hole before its cursor) tried."""
        keys = [(e, self._gap(r) if pack else 0) for r, e in tried]
        if any(a < b for a, b in zip(keys, keys[1:])):
            raise OracleViolation("round", f"plan_round tried {[(r, e) for r, e in tried][:8]} (request, excess)"
                                           f"{' packing' if pack else ''}: not the largest excess first")
        if len(made) < self.m.config.max_plans_per_round:
            seen = {r for r, _ in tried}
            missed = [r for r in req_ids if r not in seen and r not in self.m.inflight
                      and (self._excess(r) > 0 or pack and self._gap(r) > 0)]
            if missed:
                raise OracleViolation("round", f"plan_round made {len(made)} plans (limit "
                                               f"{self.m.config.max_plans_per_round}) and never tried requests "
                                               f"{missed[:8]}, which hold excess blocks"
                                               f"{' or holes before the cursor' if pack else ''}")

    def check_can_admit(self, prompt_len: int, got: bool) -> None:
        """can_admit by its definition: admission open (no plan has borrowed the headroom) and the prompt's
        ceil(p / S) blocks fit outside the headroom. A release borrows nothing."""
        m, pool = self.m, self.pool
        open_ = self._free() >= pool.headroom or all(rec.plan.kind is PlanKind.RELEASE for rec in m.inflight.values())
        want = open_ and _ceil(prompt_len, self.S) <= self._free() - pool.headroom
        if got != want:
            raise OracleViolation("admission", f"can_admit({prompt_len}) is {got}; {self._free()} blocks free, "
                                               f"headroom {pool.headroom}, admission {'open' if open_ else 'closed'} "
                                               f"and the prompt needs {_ceil(prompt_len, self.S)}")

    def _check_stats(self) -> None:
        got, want = self.m.stats, self.stats
        for name in StatsReference.COUNTERS:
            g, w = getattr(got, name), getattr(want, name)
            if isinstance(w, Counter):
                g, w = +Counter(g), +w  # +: drop zero counts
            if g != w:
                raise OracleViolation("stats", f"manager.stats.{name} is {g!r}; the calls made give {w!r}")
        if self.trigger is not None:
            for name in ("bursts", "burst_rounds"):
                g, w = getattr(got, name), getattr(self.trigger, name)
                if g != w:
                    raise OracleViolation("stats", f"manager.stats.{name} is {g}; the trigger's definition "
                                                   f"counts {w}")

    # ---- reads ----------------------------------------------------------------------------------
    def check_protected(self, req, view: RequestView) -> None:
        """``protected``: the tokens a policy must spare are, on the dense path, the request's live tokens in
        blocks the pool counts more than one reference to (a scan of its block list against the pool, the
        definition the runtime's O(shared) listing replaced); elsewhere none."""
        want: frozenset = frozenset()
        if self.rt.read_path is ReadPath.DENSE:
            shared = {b for b in self.table.block_ids(req) if self.pool.ref_count(b) > 1}
            want = frozenset(t for t in self.table.live_token_ids(req)
                             if self.table.slot_of(req, t) // self.S in shared)
        if view.protected != want:
            raise OracleViolation("protected", f"request {req!r}: the policy was told to spare "
                                               f"{sorted(view.protected)[:12]}, the pool's shared blocks hold the "
                                               f"live tokens {sorted(want)[:12]}")

    def _free(self) -> int:
        return sum(self.pool.ref_count(b) == 0 for b in range(self.pool.num_blocks))

    def waste_ratio(self) -> float:
        """Eq. 1 recounted: F = 1 - (slots holding a live token) / (allocated blocks x S)."""
        allocated = self.pool.num_blocks - self._free()
        if allocated == 0:
            return 0.0
        live = {s for r in self.table.request_ids() for s in self.table.attention_slots(r)}
        return 1.0 - len(live) / (allocated * self.S)

    def _held_destinations(self) -> int:
        return sum(len(r.plan.dst_blocks) for r in list(self.m.inflight.values()) + list(self.m.orphans))

    def destination_budget(self) -> int:
        """Stage 2: H = 0, any free block; H > 0, what the outstanding plans leave of H, never above free."""
        free, H = self._free(), self.pool.headroom
        return free if H == 0 else max(0, min(free, H - self._held_destinations()))

    # ---- invariants checked after every rule ------------------------------------------------------
    def check_state(self) -> None:
        self._check_eq1()
        self._check_blocks()
        self._check_headroom()
        self._check_stream()
        self._check_handles()
        self._check_stats()

    def _check_handles(self) -> None:
        """Every copy the engine still holds belongs to a plan in flight or an orphan: none leaks."""
        statuses = getattr(self.engine, "statuses", None)
        if statuses is None:
            return
        owned = {r.handle for r in list(self.m.inflight.values()) + list(self.m.orphans)}
        leaked = [h for h, _, released in statuses() if not released and h not in owned]
        if leaked:
            raise OracleViolation("quiescence", f"copies {leaked[:8]} are registered with the engine but no plan "
                                                f"or orphan holds them: their handles leaked")

    def _check_eq1(self) -> None:
        want, got = self.waste_ratio(), self.m.waste_ratio()
        if abs(got - want) > 1e-12:
            raise OracleViolation("eq1", f"waste_ratio() is {got!r}; Eq. 1 gives {want!r} "
                                         f"({self.pool.num_blocks - self._free()} allocated blocks of {self.S})")

    def _check_blocks(self) -> None:
        S, t = self.S, self.table
        for r in t.request_ids():
            n, w = len(t.block_ids(r)), t.write_pos(r)
            if n != _ceil(w, S):
                raise OracleViolation("blocks", f"request {r!r} holds {n} blocks; its write position {w} needs "
                                                f"{_ceil(w, S)} (S = {S})")
            grow = self.rt.blocks_to_grow(r, 1)
            if grow != max(0, _ceil(w + 1, S) - n):
                raise OracleViolation("blocks", f"request {r!r}: blocks_to_grow(1) is {grow} at write position {w} "
                                                f"with {n} blocks; one more token needs {_ceil(w + 1, S) - n}")
        free, H = self._free(), self.pool.headroom
        if self.pool.num_free != free:
            raise OracleViolation("blocks", f"the pool says {self.pool.num_free} blocks are free; {free} have ref 0")
        for n in {0, 1, free - H, free - H + 1, free, free + 1}:
            if n < 0:
                continue
            for purpose, reserve in ((Purpose.ADMISSION, H), (Purpose.EVACUATION, 0)):
                want = n == 0 or n <= free - reserve
                if self.pool.can_allocate(n, purpose) != want:
                    raise OracleViolation("blocks", f"can_allocate({n}, {purpose.name}) is {not want} with {free} "
                                                    f"free and headroom {H} (P3: {want})")

    def _check_headroom(self) -> None:
        H = self.pool.headroom
        held = self._held_destinations()
        if H and held > H:
            raise OracleViolation("headroom", f"outstanding plans hold {held} destination blocks, above the "
                                              f"headroom H = {H} (Stage 2's bound)")
        got, want = self.m.destination_budget(), self.destination_budget()
        if got != want:
            raise OracleViolation("headroom", f"destination_budget() is {got}; with {self._free()} free, H = {H} "
                                              f"and {held} held it is {want}")

    def _check_stream(self) -> None:
        """One relocation stream: a copy settles only after every copy submitted before it."""
        statuses = getattr(self.engine, "statuses", None)
        if statuses is None or not getattr(self.engine, "one_stream", False):
            return
        open_before = None
        for h, st, _ in statuses():
            ran = st in (CopyStatus.DONE, CopyStatus.FAILED)  # ORDERED is settled for commit, but has not run
            if ran and open_before is not None:
                raise OracleViolation("stream", f"copy {h} is {st.value} while the earlier copy {open_before} "
                                                f"has not run: one stream runs copies in submission order")
            if not ran and open_before is None:
                open_before = h

    def _check_settled(self) -> None:
        for r, rec in self.m.inflight.items():
            if rec.state is PlanState.COPYING:
                st = CopyStatus.DONE if rec.handle is None else self.engine.poll(rec.handle)
                if st is not CopyStatus.PENDING:
                    raise OracleViolation("progress", f"after settle the plan of {r!r} is still COPYING a copy "
                                                      f"that is {st.value}: it should have "
                                                      f"{'aborted' if st is CopyStatus.FAILED else 'committed'}")
        for rec in self.m.orphans:
            st = self.engine.poll(rec.handle) if rec.handle is not None else CopyStatus.DONE
            if st.settled:
                raise OracleViolation("progress", f"after settle an orphan of {rec.plan.req_id!r} still holds "
                                                  f"blocks {list(rec.held)} for a copy that is {st.value}")

    # ---- planner quality ------------------------------------------------------------------------
    def _planning_view(self, r):
        t = self.table
        try:
            if r not in t or r in self.m.inflight:
                return None
        except TypeError:
            return None
        S = self.S
        blocks = t.block_ids(r)
        index = {b: i for i, b in enumerate(blocks)}
        pos = {tok: index[s // S] * S + s % S for tok, s in zip(t.live_token_ids(r), t.attention_slots(r))}
        shared = {b for b in blocks if self.pool.ref_count(b) > 1}
        return dict(req=r, blocks=blocks, write_pos=t.write_pos(r), pos=pos, shared=shared,
                    cached={b for b in blocks if self.pool.is_cached(b)},
                    budget=self.destination_budget(), max_sources=self.m.config.max_sources,
                    kind=self.m.config.planner)

    def _check_plan(self, v: dict, out) -> None:
        plan = out.plan if isinstance(out, PlanRecord) else None
        if v["kind"] is PlanKind.DENSIFY:
            self._check_densify(v, plan, out)
        else:
            self._check_compact(v, plan, out)

    def _check_compact(self, v: dict, plan: Plan | None, out) -> None:
        S, r, blocks = self.S, v["req"], v["blocks"]
        counts = [0] * len(blocks)
        for p in v["pos"].values():
            counts[p // S] += 1
        cursor_block = v["write_pos"] // S
        eligible = sorted(counts[i] for i in range(min(cursor_block, len(blocks)))
                          if blocks[i] not in v["shared"] | v["cached"] and counts[i] < S)
        feasible = None
        for k in range(1, min(v["max_sources"], len(eligible)) + 1):
            need = _ceil(sum(eligible[:k]), S)
            if need < k and need <= v["budget"]:
                feasible = (k, need)
                break
        if plan is None:
            if feasible:
                raise OracleViolation("planner", f"compact made no plan for {r!r} ({out.reason.name}), yet its "
                                                 f"{feasible[0]} emptiest eligible blocks fit in {feasible[1]} "
                                                 f"(destination budget {v['budget']})")
            return
        taken = sorted(set(plan.src_blocks) & (v["shared"] | v["cached"]))
        if taken:
            raise OracleViolation("planner", f"compact plan of {r!r} takes blocks {taken}, which another request "
                                             f"holds or may map through the prefix cache")
        per_dst = [sum(m.dst_block == d for m in plan.moves) for d in plan.dst_blocks]
        T = len(plan.moves)
        if len(plan.dst_blocks) != _ceil(T, S) or any(c != S for c in per_dst[:-1]):
            raise OracleViolation("planner", f"compact plan of {r!r} puts {per_dst} of its {T} moves into "
                                             f"{len(plan.dst_blocks)} destinations; every one but the last must be "
                                             f"full ({S}) and there must be ceil({T}/{S}) = {_ceil(T, S)}")

    def _check_densify(self, v: dict, plan: Plan | None, out) -> None:
        S, r, blocks, w = self.S, v["req"], v["blocks"], v["write_pos"]
        n = len(v["pos"])
        dense = w == n and all(p < n for p in v["pos"].values())
        holes = set(range(n)) - set(v["pos"].values())
        movers = [p for p in v["pos"].values() if p >= n]
        keep = _ceil(n, S)
        released = blocks[keep:_ceil(w, S)]
        touched = {blocks[p // S] for p in holes | set(movers)} | set(released)
        if n % S and n // S < len(blocks):
            touched.add(blocks[n // S])  # the new cursor's block is written by the next appends
        if plan is None:
            why = out.reason
            if why is NoPlanReason.ALREADY_DENSE and dense:
                return
            if why is NoPlanReason.SHARED_BLOCK and touched & v["shared"]:
                return
            raise OracleViolation("planner", f"densify made no plan for {r!r} ({why.name}); it is "
                                             f"{'dense' if dense else 'not dense'} and the blocks it would touch "
                                             f"{sorted(touched & v['shared'])} are the shared ones")
        if plan.dense_write_pos != n or list(plan.src_blocks) != released:
            raise OracleViolation("planner", f"densify plan of {r!r}: cursor {plan.dense_write_pos}, releases "
                                             f"{list(plan.src_blocks)}; with {n} live tokens the cursor is {n} and "
                                             f"blocks {released} go, leaving ceil({n}/{S}) = {keep}")

    # ---- quiescence ------------------------------------------------------------------------------------
    def check_quiescent(self) -> None:
        pool, m = self.pool, self.m
        problems = []
        if self.table.request_ids():
            problems.append(f"requests {self.table.request_ids()} still in the table")
        if m.inflight or m.orphans:
            problems.append(f"{len(m.inflight)} plans in flight, {len(m.orphans)} orphans")
        held = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
        if held or pool.num_free != pool.num_blocks:
            problems.append(f"blocks {held[:12]} still allocated ({pool.num_free}/{pool.num_blocks} free)")
        copies = list(getattr(self.engine, "statuses", lambda: [])())
        if copies:
            problems.append(f"copies {[h for h, _, _ in copies][:8]} still registered with the engine")
        if self.table.occupancy.live_slots:
            problems.append(f"{self.table.occupancy.live_slots} slots still counted live")
        if any(r in self.rt.scores for r in list(self.rt.scores._acc)):
            problems.append(f"scores kept for {list(self.rt.scores._acc)[:8]}")
        if not pool.can_allocate(pool.num_blocks - pool.headroom, Purpose.ADMISSION):
            problems.append("the headroom is not whole")
        if problems:
            raise OracleViolation("quiescence", "after every request finished and every copy settled: "
                                  + "; ".join(problems))
