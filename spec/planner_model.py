"""Bounded z3 proofs that the relocation planners only make valid plans (I4, I7).

``core/compact.py`` and ``core/densify.py`` are modelled as constraints over one
symbolic ``RequestSnapshot``; every plan the constraints allow is checked
against the plan-level properties of I4 (plan validity) and I7 (dense prefix).
The proofs are *bounded*: they cover every snapshot with block size S and at
most NB blocks in the request's block list, for each ``Bound`` in ``BOUNDS``
(all token ids, block ids, shared flags, cursors and eviction patterns within
that bound), with no other limit.

The symbolic snapshot (``SnapshotModel``), for block size S and NB blocks:
  num_blocks           the block list's length nb, 0 <= nb <= NB
  block_id[i]          its block ids, pairwise distinct (i < NB; ids past nb are unused)
  shared[i]            block i is in ``shared_blocks`` (ref count > 1)
  write_pos            the append cursor w, a position, 0 <= w <= nb*S
  live@p, token@p      position p = i*S + o (block-list index i, offset o) holds a live
                       token (bit o of masks[i]) with logical id token@p; ids are
                       pairwise distinct, so a dead token is an id held by no position
It assumes what the token table maintains (T1, T2, I2): the masks are the
recomputation of the slots, live tokens lie before the cursor, num_live is the
number of live positions. A token's slot is (block_id[p // S], p % S).

A plan is data (``ZPlan``): one guarded ``ZMove`` per position (the move of the
token there, if the planner moves it), the source blocks (guarded, in block-list
order), the destination blocks (compact) and the new cursor (densify). Properties
read only this data, in the ids a real ``Plan`` carries: they apply moves by
token id and find blocks by block id, never by the model's own indices.

The planners are *nondeterministic* where a faithful symbolic sort would be
costly, and each proof covers every plan the relaxed model allows:
  compact  the sources are ANY set of eligible blocks (wholly before the cursor's
           block, not shared, not full) with 1 <= k <= max_sources blocks and
           T live tokens such that ceil(T/S) <= the destination budget and
           ceil(T/S) < k. The code's greedy choice (lowest utilization first,
           ties by index, shrunk to the budget) is one of them. Moved tokens get
           ranks in [0, T) that are strictly increasing in logical order (a
           monotone injection into [0, T) is exactly the rank), and rank r goes
           to (reserved[r // S], r % S).
           ``exact=True`` adds the greedy choice itself (``greedy``), used by the
           differential test to pin the model to the code's exact choice.
  densify  movers (live at positions >= n_live) go to holes (free positions
           < n_live) by ANY map that is strictly increasing from logical order to
           position order (again exactly the code's zip, as |movers| = |holes|);
           sources are blocks [ceil(n/S), ceil(w/S)); a plan is made unless the
           request is already dense or a touched block is shared.

Each model is a class whose constraint methods a test may override to plant a
bug (tests/test_spec_planners.py does, one per property).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable

import z3

from .obligations import COUNTEREXAMPLE, PROVED, UNKNOWN, Obligation, Outcome, prove

TIMEOUT_MS = 60_000


@dataclass(frozen=True)
class Bound:
    """Every snapshot of block size ``block_size`` with at most ``max_blocks`` blocks in its list."""

    block_size: int
    max_blocks: int

    def __str__(self) -> str:
        return f"S={self.block_size} with <= {self.max_blocks} blocks"


# Chosen so that all obligations together solve in well under a minute on two loaded cores
# (tests/test_spec_planners.py times them). Positions = S * blocks: 8, 16, 24, 32, 32, 64.
BOUNDS: tuple[Bound, ...] = (
    Bound(1, 8), Bound(2, 8), Bound(4, 6), Bound(8, 4), Bound(16, 2), Bound(32, 2),
)


def bounds_text(bounds: Iterable[Bound] = BOUNDS) -> str:
    return "; ".join(str(b) for b in bounds)


# ---- the snapshot ----------------------------------------------------------------------------------------
class SnapshotModel:
    """One request's ``RequestSnapshot``, symbolic, within a ``Bound`` (see the module docstring)."""

    def __init__(self, bound: Bound) -> None:
        S, NB = bound.block_size, bound.max_blocks
        self.bound, self.S, self.NB, self.P = bound, S, NB, S * NB
        self.nb = z3.Int("num_blocks")
        self.w = z3.Int("write_pos")
        self.bid = [z3.Int(f"block_id[{i}]") for i in range(NB)]
        self.shared = [z3.Bool(f"shared[{i}]") for i in range(NB)]
        self.live = [z3.Bool(f"live@{p}") for p in range(self.P)]
        self.tok = [z3.Int(f"token@{p}") for p in range(self.P)]
        self._ind: dict[int, z3.ArithRef] = {}
        self.defs: list[z3.BoolRef] = []  # definitions of the 0/1 indicators below (conservative: each is unique)
        self.cnt = [self.count(self.live[i * S:(i + 1) * S], "live") for i in range(NB)]
        self.n_live = self.count(self.live, "live")

    def ind(self, cond: z3.BoolRef, name: str = "ind") -> z3.ArithRef:
        """A 0/1 integer equal to ``cond`` (one per distinct condition). Counting with bounded indicators, not
        bare ``If`` terms, lets the solver bound and compare sums without splitting on every term."""
        key = cond.get_id()
        if key not in self._ind:
            x = z3.Int(f"{name}#{len(self._ind)}")
            self.defs.append(z3.And(0 <= x, x <= 1, (x == 1) == cond))
            self._ind[key] = x
        return self._ind[key]

    def count(self, conds: list[z3.BoolRef], name: str = "ind") -> z3.ArithRef:
        return z3.Sum([self.ind(c, name) for c in conds]) if conds else z3.IntVal(0)

    def wf(self) -> z3.BoolRef:
        """A snapshot the token table can produce (T1, T2, I2 hold in it)."""
        S = self.S
        return z3.And(
            0 <= self.nb, self.nb <= self.NB, 0 <= self.w, self.w <= self.nb * S,
            z3.Distinct(*self.bid) if self.NB > 1 else z3.BoolVal(True), *[b >= 0 for b in self.bid],
            z3.Distinct(*self.tok) if self.P > 1 else z3.BoolVal(True), *[t >= 0 for t in self.tok],
            *[z3.Implies(self.live[p], p < self.w) for p in range(self.P)],
            *self.defs,
        )

    def slot(self, p: int) -> tuple[z3.ArithRef, int]:
        return self.bid[p // self.S], p % self.S

    def index_of(self, block_id: z3.ArithRef, default: int) -> z3.ArithRef:
        """The block-list index of ``block_id``, or ``default`` if it is not in the list."""
        out: z3.ArithRef = z3.IntVal(default)
        for i in reversed(range(self.NB)):
            out = z3.If(z3.And(i < self.nb, block_id == self.bid[i]), i, out)
        return out

    def position_of(self, block_id: z3.ArithRef, offset: z3.ArithRef) -> z3.ArithRef:
        """Position of slot (block_id, offset) in the request's list; P (past every position) if not listed."""
        return z3.If(self.index_of(block_id, -1) >= 0, self.index_of(block_id, -1) * self.S + offset, self.P)

    def is_shared(self, block_id: z3.ArithRef) -> z3.BoolRef:
        return z3.Or([z3.And(i < self.nb, block_id == self.bid[i], self.shared[i]) for i in range(self.NB)])

    def token_at(self, token: z3.ArithRef) -> list[tuple[int, z3.BoolRef]]:
        """(position, "token lives there") for each position: the table's slot lookup, by token id."""
        return [(p, z3.And(self.live[p], self.tok[p] == token)) for p in range(self.P)]


# ---- plans as data ------------------------------------------------------------------------------------------
@dataclass
class ZMove:
    at: int  # model position of the token this move is generated for (explanations only)
    guard: z3.BoolRef  # the plan contains this move
    token: z3.ArithRef
    src_block: z3.ArithRef
    src_offset: z3.ArithRef
    dst_block: z3.ArithRef
    dst_offset: z3.ArithRef

    def fields(self) -> tuple:
        return (self.token, self.src_block, self.src_offset, self.dst_block, self.dst_offset)


@dataclass
class ZPlan:
    exists: z3.BoolRef  # the planner returns a Plan (not a NoPlan)
    moves: list[ZMove]
    src: list[tuple[z3.BoolRef, z3.ArithRef]]  # (is a source, block id), in block-list order
    dst: list[tuple[z3.BoolRef, z3.ArithRef]]  # (is a destination, block id), in plan order (compact)
    dense_write_pos: z3.ArithRef | None = None  # densify's cursor after commit

    snap: SnapshotModel | None = None

    def count(self, guarded: list) -> z3.ArithRef:
        return self.snap.count([g for g, *_ in guarded], "plan")

    @property
    def num_moves(self) -> z3.ArithRef:
        return self.snap.count([m.guard for m in self.moves], "plan")


def _ceil_div(q: z3.ArithRef, x: z3.ArithRef, S: int) -> z3.BoolRef:
    """q = ceil(x / S) for x >= 0."""
    return z3.And(q * S >= x, (q - 1) * S < x)


def _lookup(table: list[z3.ArithRef], index: z3.ArithRef, default: z3.ArithRef) -> z3.ArithRef:
    out = default
    for d in reversed(range(len(table))):
        out = z3.If(index == d, table[d], out)
    return out


# ---- compact ------------------------------------------------------------------------------------------------
class CompactModel:
    """``plan_compaction(snap, reserved[:budget], max_sources)`` as constraints. Override a method to plant a bug."""

    kind = "compact"

    def __init__(self, bound: Bound, exact: bool = False) -> None:
        self.snap = s = SnapshotModel(bound)
        self.exact = exact
        S, NB, P = s.S, s.NB, s.P
        self.max_sources = z3.Int("max_sources")
        self.budget = z3.Int("dst_budget")  # len(dst_blocks) passed to plan_compaction
        self.reserved = [z3.Int(f"reserved_dst[{d}]") for d in range(NB)]
        self.unreserved = z3.Int("reserved_dst[beyond]")  # what an out-of-range index reads
        self.chosen = [z3.Bool(f"chosen[{i}]") for i in range(NB)]
        self.num_dst = z3.Int("num_dst")
        self.rank = [z3.Int(f"rank@{p}") for p in range(P)]
        self.dst_index = [z3.Int(f"dst_index@{p}") for p in range(P)]
        self.dst_offset = [z3.Int(f"dst_offset@{p}") for p in range(P)]
        self.k = s.count(self.chosen, "chosen")
        self.T = s.count([self.is_source(p) for p in range(P)], "moved")  # live tokens in the sources
        self.eligible_count = s.count([self.eligible(i) for i in range(NB)], "eligible")

    # -- the planner, one method per step of core/compact.py --
    def eligible(self, i: int) -> z3.BoolRef:
        """eligible_sources: wholly before the cursor's block (i < w // S), in the list, not shared, not full."""
        s = self.snap
        return z3.And(i < s.nb, (i + 1) * s.S <= s.w, z3.Not(s.shared[i]), s.cnt[i] < s.S)

    def is_source(self, p: int) -> z3.BoolRef:
        """plan_compaction moves the live tokens of the chosen blocks."""
        return z3.And(self.snap.live[p], self.chosen[p // self.snap.S])

    def params(self) -> z3.BoolRef:
        s = self.snap
        return z3.And(
            self.max_sources >= 1, self.budget >= 0,
            z3.Distinct(*self.reserved) if len(self.reserved) > 1 else z3.BoolVal(True),
            *[r >= 0 for r in self.reserved],
            *[r != b for r in self.reserved for b in s.bid],  # fresh: in no block list (asserted by the code)
        )

    def num_dst_rule(self) -> z3.BoolRef:
        return _ceil_div(self.num_dst, self.T, self.snap.S)

    def choice(self) -> z3.BoolRef:
        """choose_sources, relaxed: any eligible set of at most max_sources blocks whose destinations fit the budget."""
        return z3.And(
            *[z3.Implies(self.chosen[i], self.eligible(i)) for i in range(self.snap.NB)],
            self.k <= self.max_sources, self.num_dst_rule(), self.num_dst <= self.budget,
        )

    def greedy(self) -> z3.BoolRef:
        """The code's exact choice: a prefix of eligible_sources' order (utilization, index), the longest
        prefix of at most max_sources blocks whose ceil(T/S) fits the budget."""
        s, NB = self.snap, self.snap.NB
        before = lambda i, j: z3.Or(s.cnt[i] < s.cnt[j], z3.And(s.cnt[i] == s.cnt[j], i < j))  # noqa: E731
        closed = [z3.Implies(z3.And(self.chosen[i], self.eligible(j), z3.Not(self.chosen[j])), before(i, j))
                  for i in range(NB) for j in range(NB) if i != j]
        cap = z3.If(self.max_sources < self.eligible_count, self.max_sources, self.eligible_count)
        next_too_big = z3.And([z3.Implies(z3.And(self.eligible(j), z3.Not(self.chosen[j])),
                                          self.T + s.cnt[j] > self.budget * s.S) for j in range(NB)])
        return z3.And(*closed, z3.Or(self.k == cap, next_too_big))

    def gate(self) -> z3.BoolRef:
        """Plan only if there is a source and ceil(T/S) < k (the strict decrease)."""
        return z3.And(self.k >= 1, self.num_dst < self.k)

    def rank_range(self, p: int) -> z3.BoolRef:
        S = self.snap.S
        return z3.And(0 <= self.rank[p], self.rank[p] < self.T,
                      self.rank[p] == self.dst_index[p] * S + self.dst_offset[p],
                      0 <= self.dst_offset[p], self.dst_offset[p] < S)

    def order(self, p: int, q: int) -> z3.BoolRef:
        """Tokens are taken in logical order: ranks strictly increase with token ids."""
        tok, rank = self.snap.tok, self.rank
        return z3.And(z3.Implies(tok[p] < tok[q], rank[p] < rank[q]), z3.Implies(tok[q] < tok[p], rank[q] < rank[p]))

    def placement(self) -> z3.BoolRef:
        P = self.snap.P
        cons = [z3.Implies(self.is_source(p), self.rank_range(p)) for p in range(P)]
        cons += [z3.Implies(z3.And(self.is_source(p), self.is_source(q)), self.order(p, q))
                 for p in range(P) for q in range(p + 1, P)]
        return z3.And(cons)

    def planned(self) -> z3.BoolRef:
        """The snapshot is well formed and the planner returned ``plan()``."""
        parts = [self.snap.wf(), self.params(), self.choice(), self.gate(), self.placement()]
        if self.exact:
            parts.append(self.greedy())
        return z3.And(parts)

    def choice_made(self) -> z3.BoolRef:
        """Exact mode only: the greedy choice was made (whether or not it passes the gate)."""
        return z3.And(self.snap.wf(), self.params(), self.choice(), self.greedy())

    # -- the plan it makes --
    def plan(self) -> ZPlan:
        s = self.snap
        moves = []
        for p in range(s.P):
            sb, so = s.slot(p)
            moves.append(ZMove(p, self.is_source(p), s.tok[p], sb, z3.IntVal(so),
                               _lookup(self.reserved, self.dst_index[p], self.unreserved), self.dst_offset[p]))
        return ZPlan(
            exists=self.gate(),
            moves=moves,
            src=[(self.chosen[i], s.bid[i]) for i in range(s.NB)],
            dst=[(d < self.num_dst, self.reserved[d]) for d in range(s.NB)],
            snap=s,
        )

    def describe_params(self, m: z3.ModelRef) -> str:
        ev = _ev(m)
        nd = max(0, min(ev(self.budget), self.snap.NB))
        return (f"compact with max_sources={ev(self.max_sources)}, destination budget {ev(self.budget)} "
                f"(reserved fresh blocks {[ev(r) for r in self.reserved[:nd]]})")


# ---- densify ------------------------------------------------------------------------------------------------
class DensifyModel:
    """``plan_densify(snap)`` as constraints. Override a method to plant a bug."""

    kind = "densify"

    def __init__(self, bound: Bound, exact: bool = False) -> None:
        self.snap = s = SnapshotModel(bound)
        self.exact = exact  # densify's model is already exact up to the order-preserving map (see module doc)
        S, NB, P = s.S, s.NB, s.P
        self.n = s.n_live
        self.keep = z3.Int("keep")  # ceil(n_live / S)
        self.written = z3.Int("written")  # ceil(write_pos / S)
        self.dst_pos = [z3.Int(f"dst_pos@{p}") for p in range(P)]
        self.dst_index = [z3.Int(f"dst_index@{p}") for p in range(P)]
        self.dst_offset = [z3.Int(f"dst_offset@{p}") for p in range(P)]
        self.unlisted = z3.Int("block_id[beyond]")

    def mover(self, p: int) -> z3.BoolRef:
        return z3.And(self.snap.live[p], p >= self.n)

    def hole(self, p: int) -> z3.BoolRef:
        return z3.And(z3.Not(self.snap.live[p]), p < self.n)

    def is_src_block(self, i: int) -> z3.BoolRef:
        return z3.And(self.keep <= i, i < self.written)

    def bounds_rule(self) -> z3.BoolRef:
        S = self.snap.S
        return z3.And(_ceil_div(self.keep, self.n, S), _ceil_div(self.written, self.snap.w, S))

    def hits_hole(self, p: int) -> z3.BoolRef:
        return z3.Or([z3.And(self.dst_pos[p] == h, self.hole(h)) for h in range(self.snap.P)])

    def order(self, p: int, q: int) -> z3.BoolRef:
        """Movers in logical order go to holes in position order."""
        tok, d = self.snap.tok, self.dst_pos
        return z3.And(z3.Implies(tok[p] < tok[q], d[p] < d[q]), z3.Implies(tok[q] < tok[p], d[q] < d[p]))

    def placement(self) -> z3.BoolRef:
        S, P = self.snap.S, self.snap.P
        cons = [z3.Implies(self.mover(p), z3.And(
            self.hits_hole(p), self.dst_pos[p] == self.dst_index[p] * S + self.dst_offset[p],
            0 <= self.dst_offset[p], self.dst_offset[p] < S)) for p in range(P)]
        cons += [z3.Implies(z3.And(self.mover(p), self.mover(q)), self.order(p, q))
                 for p in range(P) for q in range(p + 1, P)]
        return z3.And(cons)

    def touched_shared(self) -> z3.BoolRef:
        s = self.snap
        return z3.Or(
            *[z3.And(self.hole(h), s.shared[h // s.S]) for h in range(s.P)],
            *[z3.And(self.mover(p), s.shared[p // s.S]) for p in range(s.P)],
            *[z3.And(self.is_src_block(i), s.shared[i]) for i in range(s.NB)],
        )

    def gate(self) -> z3.BoolRef:
        already_dense = z3.And(*[z3.Not(self.mover(p)) for p in range(self.snap.P)], self.snap.w == self.n)
        return z3.And(z3.Not(already_dense), z3.Not(self.touched_shared()))

    def planned(self) -> z3.BoolRef:
        return z3.And(self.snap.wf(), self.bounds_rule(), self.gate(), self.placement())

    def plan(self) -> ZPlan:
        s = self.snap
        moves = []
        for p in range(s.P):
            sb, so = s.slot(p)
            moves.append(ZMove(p, self.mover(p), s.tok[p], sb, z3.IntVal(so),
                               _lookup(s.bid, self.dst_index[p], self.unlisted), self.dst_offset[p]))
        return ZPlan(exists=self.gate(), moves=moves,
                     src=[(self.is_src_block(i), s.bid[i]) for i in range(s.NB)], dst=[],
                     dense_write_pos=self.n, snap=s)

    def describe_params(self, m: z3.ModelRef) -> str:
        return "densify"


# ---- properties: (what is violated, violation) pairs over plan data ----------------------------------------------
Violation = tuple[Callable[[z3.ModelRef], str], z3.BoolRef]


def _ev(m: z3.ModelRef):
    def ev(x):
        v = m.eval(x, model_completion=True)
        return z3.is_true(v) if z3.is_bool(v) else v.as_long()
    return ev


def _mv(m: z3.ModelRef, mv: ZMove) -> str:
    ev = _ev(m)
    return (f"move token t{ev(mv.token)}: (block {ev(mv.src_block)}, offset {ev(mv.src_offset)}) -> "
            f"(block {ev(mv.dst_block)}, offset {ev(mv.dst_offset)})")


def _final(snap: SnapshotModel, plan: ZPlan, q: int) -> tuple[z3.ArithRef, z3.ArithRef]:
    """Block id and offset of the live token at q after the plan's moves are applied (found by token id)."""
    blk, off = snap.slot(q)
    fb, fo = blk, z3.IntVal(off)
    for mv in reversed(plan.moves):
        hit = z3.And(mv.guard, mv.token == snap.tok[q])
        fb, fo = z3.If(hit, mv.dst_block, fb), z3.If(hit, mv.dst_offset, fo)
    return fb, fo


def _pairs(plan: ZPlan):
    ms = plan.moves
    return [(a, b) for i, a in enumerate(ms) for b in ms[i + 1:]]


def v_strict_decrease(model) -> list[Violation]:
    plan = model.plan()
    nd, ns = plan.count(plan.dst), plan.count(plan.src)
    return [(lambda m: f"the plan takes {_ev(m)(nd)} destination block(s) to free {_ev(m)(ns)} source block(s)",
             z3.Or(ns < 1, nd >= ns)),
            (lambda m: f"the plan takes {_ev(m)(nd)} destination blocks, over the budget {_ev(m)(model.budget)}",
             nd > model.budget)]


def v_dst_capacity(model) -> list[Violation]:
    plan, S = model.plan(), model.snap.S
    nd, T = plan.count(plan.dst), plan.num_moves
    out: list[Violation] = [(lambda m: f"{_ev(m)(T)} moved tokens but {_ev(m)(nd)} destination blocks of {S} "
                             f"(want ceil({_ev(m)(T)}/{S}))", z3.Not(_ceil_div(nd, T, S)))]
    for mv in plan.moves:
        in_plan = z3.Or([z3.And(g, mv.dst_block == b) for g, b in plan.dst])
        bad = z3.And(mv.guard, z3.Or(mv.dst_offset < 0, mv.dst_offset >= S, z3.Not(in_plan)))
        out.append((lambda m, mv=mv: f"{_mv(m, mv)}: outside the plan's destination blocks of {S} slots", bad))
    return out


def v_injective(model) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = []
    for a, b in _pairs(plan):
        out.append((lambda m, a=a, b=b: f"two moves to one slot: {_mv(m, a)} and {_mv(m, b)}",
                    z3.And(a.guard, b.guard, a.dst_block == b.dst_block, a.dst_offset == b.dst_offset)))
    for d, (g, b) in enumerate(plan.dst):
        listed = z3.Or([z3.And(i < s.nb, b == s.bid[i]) for i in range(s.NB)])
        twice = z3.Or([z3.And(g2, b2 == b) for g2, b2 in plan.dst[d + 1:]])
        out.append((lambda m, b=b: f"destination block {_ev(m)(b)} is listed by the request or twice in the plan",
                    z3.And(g, z3.Or(listed, twice))))
    return out


def v_live_sources(model) -> list[Violation]:
    """Only live tokens move, each once, from its own slot; every live token of a source block moves."""
    plan, s = model.plan(), model.snap
    out: list[Violation] = []
    for mv in plan.moves:
        at_slot = z3.Or([z3.And(hit, s.bid[q // s.S] == mv.src_block, mv.src_offset == q % s.S)
                         for q, hit in s.token_at(mv.token)])
        in_src = z3.Or([z3.And(g, b == mv.src_block) for g, b in plan.src])
        out.append((lambda m, mv=mv: f"{_mv(m, mv)}: token t{_ev(m)(mv.token)} is not live at that slot",
                    z3.And(mv.guard, z3.Not(at_slot))))
        if plan.dst:  # compact: every move reads a source block
            out.append((lambda m, mv=mv: f"{_mv(m, mv)}: reads a block that is not a source of the plan",
                        z3.And(mv.guard, z3.Not(in_src))))
    for a, b in _pairs(plan):
        out.append((lambda m, a=a, b=b: f"token moved twice: {_mv(m, a)} and {_mv(m, b)}",
                    z3.And(a.guard, b.guard, a.token == b.token)))
    if plan.dst:
        for q in range(s.P):
            src_here = z3.Or([z3.And(g, b == s.bid[q // s.S]) for g, b in plan.src])
            moved = z3.Or([z3.And(mv.guard, mv.token == s.tok[q]) for mv in plan.moves])
            out.append((lambda m, q=q: f"live token t{_ev(m)(s.tok[q])} in source block {_ev(m)(s.bid[q // s.S])} "
                        f"(offset {q % s.S}) is not moved, so the block cannot be freed",
                        z3.And(s.live[q], src_here, z3.Not(moved))))
    return out


def v_eligible_sources(model) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = [(lambda m: f"{_ev(m)(plan.count(plan.src))} source blocks, over "
                             f"max_sources={_ev(m)(model.max_sources)}", plan.count(plan.src) > model.max_sources)]
    for g, b in plan.src:
        idx = s.index_of(b, -1)
        bad = z3.And(g, z3.Or(idx < 0, s.is_shared(b), (idx + 1) * s.S > s.w))
        out.append((lambda m, b=b, idx=idx: f"source block {_ev(m)(b)} (list index {_ev(m)(idx)}) is unlisted, "
                    f"shared, or not wholly before the cursor {_ev(m)(s.w)} (the append block or later)", bad))
    return out


def v_logical_order(model) -> list[Violation]:
    plan, S = model.plan(), model.snap.S
    out: list[Violation] = []

    def index_in_dst(mv: ZMove) -> z3.ArithRef:
        out_ = z3.IntVal(len(plan.dst))
        for d in reversed(range(len(plan.dst))):
            out_ = z3.If(mv.dst_block == plan.dst[d][1], d, out_)
        return out_ * S + mv.dst_offset

    for a, b in _pairs(plan):
        for x, y in ((a, b), (b, a)):
            out.append((lambda m, x=x, y=y: f"logical order lost: t{_ev(m)(x.token)} < t{_ev(m)(y.token)} but "
                        f"{_mv(m, x)} lands after {_mv(m, y)}",
                        z3.And(x.guard, y.guard, x.token < y.token, index_in_dst(x) >= index_in_dst(y))))
    return out


def v_dense_prefix(model) -> list[Violation]:
    """After the moves the n live tokens have distinct positions, all < n (so exactly [0, n)); cursor = n."""
    plan, s = model.plan(), model.snap
    n = s.n_live
    final = {q: s.position_of(*_final(s, plan, q)) for q in range(s.P)}
    out: list[Violation] = [(lambda m: f"cursor after commit {_ev(m)(plan.dense_write_pos)} != n_live {_ev(m)(n)}",
                             plan.dense_write_pos != n)]
    for q in range(s.P):
        out.append((lambda m, q=q: f"live token t{_ev(m)(s.tok[q])} ends at position {_ev(m)(final[q])} "
                    f">= n_live={_ev(m)(n)}", z3.And(s.live[q], final[q] >= n)))
    for q in range(s.P):
        for r in range(q + 1, s.P):
            out.append((lambda m, q=q, r=r: f"live tokens t{_ev(m)(s.tok[q])} and t{_ev(m)(s.tok[r])} both end at "
                        f"position {_ev(m)(final[q])}", z3.And(s.live[q], s.live[r], final[q] == final[r])))
    return out


def v_no_chain(model) -> list[Violation]:
    """Destinations are distinct and none is any move's source (moves never chain)."""
    plan = model.plan()
    out: list[Violation] = []
    for a in plan.moves:
        for b in plan.moves:
            out.append((lambda m, a=a, b=b: f"{_mv(m, a)} writes the source of {_mv(m, b)}",
                        z3.And(a.guard, b.guard, a.dst_block == b.src_block, a.dst_offset == b.src_offset)))
    for a, b in _pairs(plan):
        out.append((lambda m, a=a, b=b: f"two moves to one slot: {_mv(m, a)} and {_mv(m, b)}",
                    z3.And(a.guard, b.guard, a.dst_block == b.dst_block, a.dst_offset == b.dst_offset)))
    return out


def v_freed_blocks(model) -> list[Violation]:
    """The blocks densify releases are [ceil(n/S), ceil(w/S)), none shared, and hold no live token after the moves."""
    plan, s = model.plan(), model.snap
    S, n = s.S, s.n_live
    out: list[Violation] = []
    for i, (g, b) in enumerate(plan.src):
        want = z3.And(i < s.nb, i * S >= n, i * S < s.w)  # block i starts at or after n and before w
        out.append((lambda m, i=i, b=b: f"block {_ev(m)(b)} (index {i}) is released: {_ev(m)(g)}, but it "
                    f"should be exactly when it starts in [n_live={_ev(m)(n)}, cursor={_ev(m)(s.w)})",
                    g != want))
        out.append((lambda m, b=b: f"released block {_ev(m)(b)} is shared", z3.And(g, s.shared[i])))
        for q in range(s.P):
            fb, _ = _final(s, plan, q)
            out.append((lambda m, q=q, b=b: f"released block {_ev(m)(b)} still holds live token t{_ev(m)(s.tok[q])} "
                        f"after the moves", z3.And(g, s.live[q], fb == b)))
    return out


def v_densify_moves(model) -> list[Violation]:
    """Each move reads its live token's own slot and writes a free slot below n_live (so below the cursor);
    no block it reads, writes or releases is shared."""
    plan, s = model.plan(), model.snap
    n = s.n_live
    out: list[Violation] = []
    for mv in plan.moves:
        at_slot = z3.Or([z3.And(hit, s.bid[q // s.S] == mv.src_block, mv.src_offset == q % s.S)
                         for q, hit in s.token_at(mv.token)])
        dpos = s.position_of(mv.dst_block, mv.dst_offset)
        occupied = z3.Or([z3.And(s.live[q], s.bid[q // s.S] == mv.dst_block, mv.dst_offset == q % s.S)
                          for q in range(s.P)])
        out += [
            (lambda m, mv=mv: f"{_mv(m, mv)}: token is not live at that slot", z3.And(mv.guard, z3.Not(at_slot))),
            (lambda m, mv=mv, dpos=dpos: f"{_mv(m, mv)}: destination position {_ev(m)(dpos)} is not below "
             f"n_live={_ev(m)(n)} <= cursor={_ev(m)(s.w)}, or is occupied",
             z3.And(mv.guard, z3.Or(dpos >= n, dpos >= s.w, dpos < 0, mv.dst_offset < 0, mv.dst_offset >= s.S,
                                    occupied))),
            (lambda m, mv=mv: f"{_mv(m, mv)}: touches a shared block",
             z3.And(mv.guard, z3.Or(s.is_shared(mv.src_block), s.is_shared(mv.dst_block)))),
        ]
    for i, (g, b) in enumerate(plan.src):
        out.append((lambda m, b=b: f"releases shared block {_ev(m)(b)}", z3.And(g, s.shared[i])))
    return out


@contextmanager
def smt_core():
    """Make ``z3.Solver()`` (what ``obligations.prove`` builds) run z3's SMT core directly.

    The default tactic for these bounded integer formulas preprocesses counting constraints into
    bit-level circuits on which unsatisfiability takes minutes (it times out at S=4 with 6 blocks);
    the SMT core proves the same claims in milliseconds. The global parameter is restored on exit.
    """
    old = z3.get_param("tactic.default_tactic")
    z3.set_param("tactic.default_tactic", "smt")
    try:
        yield
    finally:
        z3.set_param("tactic.default_tactic", old)


# ---- explanations and checks ------------------------------------------------------------------------------------
def describe(model, m: z3.ModelRef) -> str:
    """The snapshot and the plan of a model, in the project's terms."""
    s, ev = model.snap, _ev(m)
    S, nb, w = s.S, ev(s.nb), ev(s.w)
    plan = model.plan()
    lines = [f"snapshot: block size S={S}, block list {[ev(b) for b in s.bid[:nb]]}, cursor write_pos={w} "
             f"(block index {w // S}, offset {w % S}), num_live={ev(s.n_live)}, "
             f"shared_blocks={sorted(ev(s.bid[i]) for i in range(nb) if ev(s.shared[i]))}"]
    for i in range(nb):
        toks = [f"{o}:t{ev(s.tok[i * S + o])}" for o in range(S) if ev(s.live[i * S + o])]
        lines.append(f"  block {ev(s.bid[i])} (index {i}): live offsets {{{', '.join(toks)}}}")
    lines.append(f"{model.describe_params(m)} -> " + ("Plan" if ev(plan.exists) else "NoPlan"))
    lines.append(f"  sources {[ev(b) for g, b in plan.src if ev(g)]}, destinations {[ev(b) for g, b in plan.dst if ev(g)]}"
                 + (f", cursor after commit {ev(plan.dense_write_pos)}" if plan.dense_write_pos is not None else ""))
    for mv in sorted((mv for mv in plan.moves if ev(mv.guard)), key=lambda mv: ev(mv.token)):
        lines.append(f"  {_mv(m, mv)}")
    return "\n".join(lines)


def make_explain(model, violations: list[Violation]) -> Callable[[z3.ModelRef], str]:
    def explain(m: z3.ModelRef) -> str:
        hit = [say(m) for say, v in violations if z3.is_true(m.eval(v, model_completion=True))]
        return describe(model, m) + "\nviolated: " + ("; ".join(hit[:3]) or "(none evaluated true)")
    return explain


ModelFactory = Callable[[Bound], object]
PropertyFn = Callable[[object], list[Violation]]


@lru_cache(maxsize=None)
def _nonvacuous(factory: ModelFactory, bound: Bound) -> bool | None:
    """Does the planner model make any plan at all within ``bound``? (else every proof about it is vacuous)"""
    model = factory(bound)
    solver = z3.SimpleSolver()
    solver.set("timeout", TIMEOUT_MS)
    exists = model.plan().exists
    solver.add(model.planned(), exists)
    r = solver.check()
    return None if r == z3.unknown else r == z3.sat


def check_property(factory: ModelFactory, prop: PropertyFn, bounds: Iterable[Bound] = BOUNDS) -> Outcome:
    """Prove: every plan the model makes, from every snapshot within each bound, has no violation of ``prop``."""
    covered = []
    for bound in bounds:
        model = factory(bound)
        violations = prop(model)  # first: it may define indicators that planned() then includes
        exists = model.plan().exists
        claim = z3.Implies(z3.And(model.planned(), exists), z3.Not(z3.Or([v for _, v in violations])))
        with smt_core():
            out = prove(claim, timeout_ms=TIMEOUT_MS, explain=make_explain(model, violations))
        if out.status != PROVED:
            return Outcome(out.status, f"[{bound}] {out.detail}")
        nv = _nonvacuous(factory, bound)
        if not nv:
            return Outcome(UNKNOWN, f"[{bound}] vacuous: the {model.kind} model makes no plan at all" if nv is False
                           else f"[{bound}] could not decide whether the model makes any plan")
        covered.append(str(bound))
    return Outcome(PROVED, "bounds: " + "; ".join(covered))


@dataclass(frozen=True)
class Property:
    id: str
    invariant: str
    planner: str  # "compact" or "densify"
    claim: str
    violations: PropertyFn


PROPERTIES: tuple[Property, ...] = (
    Property("I4/compact/strict-decrease", "I4", "compact",
             "a compact plan has >= 1 source and strictly fewer destination blocks than source blocks, "
             "within the destination budget", v_strict_decrease),
    Property("I4/compact/dst-capacity", "I4", "compact",
             "a compact plan uses ceil(T/S) destination blocks for its T moves, and every move's destination "
             "is one of them at an offset in [0, S)", v_dst_capacity),
    Property("I4/compact/injective-dst", "I4", "compact",
             "no two moves of a compact plan share a destination slot; its destination blocks are distinct and "
             "in no block list of the request", v_injective),
    Property("I4/compact/live-sources", "I4", "compact",
             "a compact plan moves only live tokens, each once and from its own slot in a source block, and moves "
             "every live token of its source blocks (so they can be freed)", v_live_sources),
    Property("I4/compact/eligible-sources", "I4", "compact",
             "a compact plan's sources are at most max_sources listed blocks, none shared and none the append "
             "(cursor's) block or later", v_eligible_sources),
    Property("I4/compact/logical-order", "I4", "compact",
             "a compact plan keeps logical order: a token with a smaller id lands earlier in the sequence of "
             "destination slots (destination index * S + offset)", v_logical_order),
    Property("I7/densify/dense-prefix", "I7", "densify",
             "after a densify plan's moves the n_live live tokens have distinct positions all below n_live "
             "(i.e. occupy exactly [0, n_live)) and the new cursor is n_live", v_dense_prefix),
    Property("I4/densify/no-chain", "I4", "densify",
             "densify destinations are distinct and none is the source of any move (moves never chain)", v_no_chain),
    Property("I7/densify/freed-blocks", "I7", "densify",
             "densify releases exactly the blocks starting in [n_live, cursor), none shared, and none holds a "
             "live token after the moves", v_freed_blocks),
    Property("I4/densify/moves", "I4", "densify",
             "every densify move reads its live token's own slot and writes a free slot below n_live (so below "
             "the cursor); no block it reads, writes or releases is shared", v_densify_moves),
)

MODELS: dict[str, type] = {"compact": CompactModel, "densify": DensifyModel}


def obligation(prop: Property, model_cls: type | None = None, bounds: tuple[Bound, ...] = BOUNDS) -> Obligation:
    """The obligation for ``prop`` over ``model_cls`` (default: the faithful model; tests pass planted variants)."""
    cls = model_cls or MODELS[prop.planner]

    def check() -> Outcome:
        return check_property(cls, prop.violations, bounds)

    nondet = ("for every set of eligible sources passing the gate (the code's greedy choice is one)"
              if prop.planner == "compact" else "for every order-preserving map of movers to holes (the code's zip is the one)")
    claim = f"{prop.claim}; for every snapshot with {bounds_text(bounds)}, {nondet}"
    return Obligation(prop.id, prop.invariant, f"planner {prop.planner}", claim, check)


def property_by_id(pid: str) -> Property:
    return next(p for p in PROPERTIES if p.id == pid)


def obligations() -> list[Obligation]:
    return [obligation(p) for p in PROPERTIES]
