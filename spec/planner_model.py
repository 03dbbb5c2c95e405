"""Bounded z3 proofs that the relocation planners only make valid plans (I4, I7).

``core/compact.py`` and ``core/densify.py`` are modelled as constraints over one
symbolic ``RequestSnapshot``; every plan the constraints allow is checked
against the plan-level properties of I4 (plan validity) and I7 (dense prefix).
The proofs are *bounded*: they cover every snapshot with block size S and at
most NB blocks in the request's block list, for each ``Bound`` in ``BOUNDS``
(all token ids, block ids, shared flags, cursors and eviction patterns within
that bound, any ``max_sources`` and destination budget), and nothing larger.

The symbolic snapshot (``SnapshotModel``), for block size S and NB blocks:
  num_blocks           the block list's length nb, 0 <= nb <= NB
  block_id(i)          the id of block-list entry i; index_of is its inverse, so ids are distinct
  shared(i)            entry i is in ``shared_blocks`` (ref count > 1)
  write_pos            the append cursor w, a position, 0 <= w <= nb*S
  live(p), token(p)    position p = i*S + o (entry i, offset o) holds a live token
                       (bit o of masks[i]) whose logical id is token(p); ids are pairwise
                       distinct, so a dead token is an id held by no position
It assumes what the token table maintains (T1, T2, I2): the masks are the
recomputation of the slots, live tokens lie before the cursor, num_live is the
number of live positions. Slot (b, o) of the request is position index_of(b)*S + o.
Arrays of the snapshot are z3 functions, so a symbolic index (a destination
position, a block id) reads them by congruence instead of by case splits.

A plan is data (``ZPlan``): one guarded ``ZMove`` per position (the move of the
token there, if the planner moves it), the source blocks (guarded, in block-list
order), the destination blocks (compact) and the new cursor (densify). The
properties read this data in the ids a real ``Plan`` carries (token ids, block
ids, offsets), looking slots and blocks up the way the token table does.

The planners are *nondeterministic* where a faithful symbolic sort would be
costly, and each proof covers every plan the relaxed model allows:
  compact  the sources are ANY set of eligible blocks (wholly before the cursor's
           block, not shared, not full) of 1 <= k <= max_sources blocks whose T
           live tokens give ceil(T/S) <= the destination budget and ceil(T/S) < k.
           The code's greedy choice (lowest utilization first, ties by index,
           shrunk to the budget) is one of them; ``exact=True`` adds it
           (``CompactModel.greedy``) so the differential test can pin the model
           to the code's choice. Moved tokens get ranks in [0, T), strictly
           increasing in logical order (a monotone injection into [0, T) is
           exactly the rank), and rank r goes to (reserved[r // S], r % S).
  densify  movers (live at positions >= n_live) go to holes (free positions
           < n_live) by ANY map strictly increasing from logical order to position
           order (exactly the code's zip, as |movers| = |holes|); the sources are
           blocks [ceil(n/S), ceil(w/S)); a plan is made unless the request is
           already dense or a touched block is shared.

Each model is a class whose constraint methods a test may override to plant a
bug (tests/test_spec_planners.py plants one per property).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Iterable

import z3

from .obligations import PROVED, UNKNOWN, Obligation, Outcome, prove

TIMEOUT_MS = 60_000
_I, _B = z3.IntSort(), z3.BoolSort()


@dataclass(frozen=True)
class Bound:
    """Every snapshot of block size ``block_size`` with at most ``max_blocks`` blocks in its list."""

    block_size: int
    max_blocks: int

    @property
    def positions(self) -> int:
        return self.block_size * self.max_blocks

    def __str__(self) -> str:
        return f"S={self.block_size} with <= {self.max_blocks} blocks"


# Every property is proved for BASE_BOUNDS (up to 8 blocks, S up to 4); those whose proofs stay fast at
# vLLM's block sizes are also proved for WIDE_BOUNDS (S = 8, 16 and 32). The two densify move-level
# properties (no-chain, moves) take 0.5 s to over 60 s at S = 8, depending on z3's term order (that is,
# on what ran before them), and time out at S >= 16; their larger cases rest on the differential test
# (tests/test_spec_planners.py, up to S = 8) and the fuzzer.
BASE_BOUNDS: tuple[Bound, ...] = (Bound(1, 8), Bound(2, 8), Bound(4, 6))
WIDE_BOUNDS: tuple[Bound, ...] = BASE_BOUNDS + (Bound(8, 4), Bound(8, 6), Bound(16, 3), Bound(32, 2))
BOUNDS = WIDE_BOUNDS


def bounds_text(bounds: Iterable[Bound] = BOUNDS) -> str:
    return "; ".join(str(b) for b in bounds)


# ---- the snapshot ----------------------------------------------------------------------------------------
class SnapshotModel:
    """One request's ``RequestSnapshot``, symbolic, within a ``Bound`` (see the module docstring).

    A slot of the request is addressed by (entry i, offset o) of its block list; position i*S + o is used
    only for comparisons. Everything read at a symbolic slot is a z3 function of (i, o), so the solver
    finds it by congruence rather than by arithmetic.
    """

    def __init__(self, bound: Bound) -> None:
        S, NB = bound.block_size, bound.max_blocks
        self.bound, self.S, self.NB, self.P = bound, S, NB, S * NB
        self.nb = z3.Int("num_blocks")
        self.w = z3.Int("write_pos")
        self.block_id = z3.Function("block_id", _I, _I)
        self.index_of = z3.Function("index_of", _I, _I)
        self.shared_at = z3.Function("shared", _I, _B)
        self.live_at = z3.Function("live", _I, _I, _B)
        self.token_at = z3.Function("token", _I, _I, _I)
        self.bid = [self.block_id(i) for i in range(NB)]
        self.shared = [self.shared_at(i) for i in range(NB)]
        self.live = [self.live_at(p // S, p % S) for p in range(self.P)]
        self.tok = [self.token_at(p // S, p % S) for p in range(self.P)]
        self._ind: dict[int, z3.ArithRef] = {}
        self.defs: list[z3.BoolRef] = []  # definitions of 0/1 indicators (each fixed by its condition)
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
        """A snapshot the token table can produce (T1, T2, I2 hold in it). Includes every indicator defined so far."""
        S = self.S
        entry_of, offset_of = z3.Function("entry_of_token", _I, _I), z3.Function("offset_of_token", _I, _I)
        return z3.And(
            0 <= self.nb, self.nb <= self.NB, 0 <= self.w, self.w <= self.nb * S,
            *[z3.And(self.index_of(b) == i, b >= 0) for i, b in enumerate(self.bid)],  # distinct ids
            *[z3.And(t >= 0, entry_of(t) == p // S, offset_of(t) == p % S) for p, t in enumerate(self.tok)],
            *[z3.Implies(self.live[p], p < self.w) for p in range(self.P)],
            *self.defs,
        )

    def index_lemma(self, i: z3.ArithRef) -> z3.BoolRef:
        """index_of(block_id(i)) = i for a symbolic entry i: valid, as it holds for each concrete i < NB."""
        return z3.Implies(z3.And(0 <= i, i < self.NB), self.index_of(self.block_id(i)) == i)

    def is_entry_offset(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """(i, o) addresses a slot of the bound: 0 <= i < NB, 0 <= o < S (with the case splits and the index
        lemma that let the solver read per-entry and per-slot facts at it by congruence)."""
        return z3.And(0 <= i, i < self.NB, 0 <= o, o < self.S, _cases(i, self.NB), _cases(o, self.S),
                      self.index_lemma(i))

    def lemmas(self) -> z3.BoolRef:
        """Counting facts implied by ``wf`` (tests check it): positions before the cursor number w, and a live
        position is one of them; hence num_live <= w without the solver counting case by case."""
        before = [self.ind(z3.IntVal(p) < self.w, "before") for p in range(self.P)]
        return z3.And(z3.Sum(before) == self.w,
                      *[self.ind(self.live[p], "live") <= before[p] for p in range(self.P)])

    def before_cursor(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """T2 at slot (i, o): a live token there lies before the cursor (an instance of ``wf`` in range)."""
        return z3.Implies(self.live_at(i, o), i * self.S + o < self.w)

    def slot(self, p: int) -> tuple[z3.ArithRef, z3.ArithRef]:
        return self.bid[p // self.S], z3.IntVal(p % self.S)

    def listed(self, b: z3.ArithRef) -> z3.BoolRef:
        """Block id b is in the request's block list (same as: b == block_id(i) for some i < nb)."""
        i = self.index_of(b)
        return z3.And(0 <= i, i < self.nb, self.block_id(i) == b)

    def is_slot(self, b: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        return z3.And(self.listed(b), 0 <= o, o < self.S)

    def position_of(self, b: z3.ArithRef, o: z3.ArithRef) -> z3.ArithRef:
        """The position of slot (b, o), or P (past every position) if it is not a slot of the request."""
        return z3.If(self.is_slot(b, o), self.raw_position(b, o), self.P)

    def raw_position(self, b: z3.ArithRef, o: z3.ArithRef) -> z3.ArithRef:
        """index_of(b) * S + o: the position of (b, o) when it is a slot (``is_slot``)."""
        return self.index_of(b) * self.S + o

    def slot_before(self, b: z3.ArithRef, o: z3.ArithRef, k: z3.ArithRef) -> z3.BoolRef:
        """(b, o) is a slot of the request at a position below k (no ``If``: the solver handles it better)."""
        return z3.And(self.is_slot(b, o), self.raw_position(b, o) < k)

    def holds(self, token: z3.ArithRef, b: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """The table maps live token ``token`` to slot (b, o)."""
        i = self.index_of(b)
        return z3.And(self.is_slot(b, o), self.live_at(i, o), self.token_at(i, o) == token)

    def occupied(self, b: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        return z3.And(self.is_slot(b, o), self.live_at(self.index_of(b), o))

    def is_shared(self, b: z3.ArithRef) -> z3.BoolRef:
        return z3.And(self.listed(b), self.shared_at(self.index_of(b)))


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
    dst: list[tuple[z3.BoolRef, z3.ArithRef]] = field(default_factory=list)  # compact: (is used, id), in order
    dense_write_pos: z3.ArithRef | None = None  # densify: the cursor after commit
    snap: SnapshotModel | None = None

    def count(self, guarded: list) -> z3.ArithRef:
        return self.snap.count([g for g, *_ in guarded], "plan")

    @property
    def num_moves(self) -> z3.ArithRef:
        return self.snap.count([m.guard for m in self.moves], "plan")

    src_test: Callable[[z3.ArithRef], z3.BoolRef] | None = None  # an equivalent, cheaper form of is_src
    # for position q: the (guard, token) of the move the model says reads q, a witness for "q is moved"
    witness: Callable[[int], tuple[z3.BoolRef, z3.ArithRef]] | None = None

    def is_src(self, b: z3.ArithRef) -> z3.BoolRef:
        """b is one of the plan's source blocks."""
        if self.src_test is not None:
            return self.src_test(b)
        return z3.Or([z3.And(g, b == x) for g, x in self.src])


def _ceil_div(q: z3.ArithRef, x: z3.ArithRef, S: int) -> z3.BoolRef:
    """q = ceil(x / S) for x >= 0."""
    return z3.And(q * S >= x, (q - 1) * S < x)


def _cases(x: z3.ArithRef, n: int) -> z3.BoolRef:
    """x is one of 0 .. n-1 (stated as equalities, so the solver can rewrite f(x) to f(j) by congruence;
    valid wherever 0 <= x < n holds)."""
    return z3.Or([x == j for j in range(n)])


def _order(tok_p, tok_q, a, b) -> z3.BoolRef:
    """a, b are strictly increasing with the token ids."""
    return z3.And(z3.Implies(tok_p < tok_q, a < b), z3.Implies(tok_q < tok_p, b < a))


# ---- compact ------------------------------------------------------------------------------------------------
class CompactModel:
    """``plan_compaction(snap, reserved[:budget], max_sources)`` as constraints. Override a method to plant a bug.

    Move j of the plan (j < T) moves the token at source position sel(j): the moves read every live token
    of the chosen blocks (each source position p is sel(inv_p)), in strictly increasing token order, and
    move j writes (reserved[j // S], j % S), exactly as ``plan_compaction`` enumerates them.
    """

    kind = "compact"

    def __init__(self, bound: Bound, exact: bool = False) -> None:
        self.snap = s = SnapshotModel(bound)
        self.exact = exact
        NB, P = s.NB, s.P
        self.max_sources = z3.Int("max_sources")
        self.budget = z3.Int("dst_budget")  # len(dst_blocks) passed to plan_compaction
        self.reserved_at = z3.Function("reserved_dst", _I, _I)  # the caller's fresh blocks, in order
        self.reserved_index = z3.Function("reserved_index", _I, _I)  # its inverse
        self.reserved = [self.reserved_at(d) for d in range(NB)]
        self.chosen_at = z3.Function("chosen", _I, _B)  # block-list entry i is a source
        self.chosen = [self.chosen_at(i) for i in range(NB)]
        self.num_dst = z3.Int("num_dst")
        self.src_entry = z3.Function("src_entry", _I, _I)  # move j reads slot (src_entry(j), src_offset(j))
        self.src_off = z3.Function("src_offset", _I, _I)
        self.move_of = [z3.Int(f"move_of@{p}") for p in range(P)]  # which move reads source position p
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
        """max_sources >= 1; the reserved destinations are distinct, fresh blocks (the code asserts freshness)."""
        s = self.snap
        return z3.And(
            self.max_sources >= 1, self.budget >= 0,
            *[z3.And(self.reserved_index(r) == d, r >= 0, z3.Not(s.listed(r))) for d, r in enumerate(self.reserved)],
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

    def selects(self, j: int) -> z3.BoolRef:
        """Move j reads a live token of a chosen block."""
        s, i, o = self.snap, self.src_entry(j), self.src_off(j)
        return z3.And(s.is_entry_offset(i, o), s.live_at(i, o), self.chosen_at(i))

    def token(self, j) -> z3.ArithRef:
        return self.snap.token_at(self.src_entry(j), self.src_off(j))

    def order(self, j: int) -> z3.BoolRef:
        """Tokens are taken in logical order."""
        return self.token(j) < self.token(j + 1)

    def covers(self, p: int) -> z3.BoolRef:
        """Source position p is read by some move."""
        m, S = self.move_of[p], self.snap.S
        return z3.And(0 <= m, m < self.T, self.src_entry(m) == p // S, self.src_off(m) == p % S,
                      _cases(m, self.snap.P))

    def dst_slot(self, j: int) -> tuple[z3.ArithRef, z3.ArithRef]:
        """The i-th moved token goes to (dsts[i // S], i % S)."""
        S = self.snap.S
        return self.reserved_at(j // S), z3.IntVal(j % S)

    def placement(self, cover: bool = True) -> z3.BoolRef:
        P = self.snap.P
        return z3.And(
            *[z3.Implies(j < self.T, self.selects(j)) for j in range(P)],
            *[z3.Implies(j + 1 < self.T, self.order(j)) for j in range(P - 1)],
            *([z3.Implies(self.is_source(p), self.covers(p)) for p in range(P)] if cover else []),
        )

    def planned(self, cover: bool = True) -> z3.BoolRef:
        """The snapshot is well formed and the planner's choices are made (``plan().exists``: it is a Plan).
        ``cover=False`` drops "every source token is moved": more plans, for proofs that do not need it."""
        parts = [self.snap.wf(), self.params(), self.choice(), self.placement(cover)]
        if self.exact:
            parts.append(self.greedy())
        return z3.And(parts)

    def lemmas(self) -> z3.BoolRef:
        """Instances of T2 at the moves' source slots: valid consequences of ``planned()`` (tests check it)."""
        s = self.snap
        return z3.And(s.lemmas(), *[z3.Implies(j < self.T, s.before_cursor(self.src_entry(j), self.src_off(j)))
                                    for j in range(s.P)])

    # -- the plan it makes --
    def plan(self) -> ZPlan:
        s = self.snap
        moves = [ZMove(j, j < self.T, self.token(j), s.block_id(self.src_entry(j)), self.src_off(j),
                       *self.dst_slot(j)) for j in range(s.P)]
        return ZPlan(exists=self.gate(), moves=moves, src=list(zip(self.chosen, s.bid)),
                     dst=[(d < self.num_dst, r) for d, r in enumerate(self.reserved)], snap=s,
                     src_test=lambda b: z3.And(s.listed(b), self.chosen_at(s.index_of(b))),
                     witness=self._witness)

    def _witness(self, q: int) -> tuple[z3.BoolRef, z3.ArithRef]:
        m = self.move_of[q]
        return z3.And(0 <= m, m < self.T), self.token(m)

    def in_dst(self, b: z3.ArithRef) -> z3.BoolRef:
        """b is one of the plan's destination blocks (same as: b == reserved[d] for some d < num_dst)."""
        d = self.reserved_index(b)
        return z3.And(0 <= d, d < self.num_dst, self.reserved_at(d) == b)

    def describe_params(self, m: z3.ModelRef) -> str:
        ev = _ev(m)
        nd = max(0, min(ev(self.budget), self.snap.NB))
        return (f"compact(max_sources={ev(self.max_sources)}, dst_blocks={[ev(r) for r in self.reserved[:nd]]}"
                f"{'...' if ev(self.budget) > nd else ''})")


# ---- densify ------------------------------------------------------------------------------------------------
class DensifyModel:
    """``plan_densify(snap)`` as constraints. Override a method to plant a bug.

    Move j (j < num_moves) moves the token at mover slot (src_entry(j), src_offset(j)) into hole slot
    (dst_entry(j), dst_offset(j)): every mover is read by some move, tokens strictly increase and hole
    positions strictly increase with j, and the holes filled are a prefix of the holes in position order,
    exactly as ``zip(movers, holes)``.
    """

    kind = "densify"

    def __init__(self, bound: Bound, exact: bool = False) -> None:
        self.snap = s = SnapshotModel(bound)
        self.exact = exact  # no effect: the densify model has a single plan per snapshot already
        P = s.P
        self.n = s.n_live
        self.keep = z3.Int("keep")  # ceil(n_live / S)
        self.written = z3.Int("written")  # ceil(write_pos / S)
        self.num_moves = z3.Int("num_moves")
        self.src_entry, self.src_off = z3.Function("src_entry", _I, _I), z3.Function("src_offset", _I, _I)
        self.dst_entry, self.dst_off = z3.Function("dst_entry", _I, _I), z3.Function("dst_offset", _I, _I)
        self.move_of = [z3.Int(f"move_of@{p}") for p in range(P)]  # which move reads mover position p
        self.move_into = [z3.Int(f"move_into@{p}") for p in range(P)]  # which move fills hole position p

    def src_pos(self, j) -> z3.ArithRef:
        return self.src_entry(j) * self.snap.S + self.src_off(j)

    def dst_pos(self, j) -> z3.ArithRef:
        return self.dst_entry(j) * self.snap.S + self.dst_off(j)

    def token(self, j) -> z3.ArithRef:
        return self.snap.token_at(self.src_entry(j), self.src_off(j))

    def mover_slot(self, i, o) -> z3.BoolRef:
        """A live token at or after position n_live."""
        return z3.And(self.snap.live_at(i, o), i * self.snap.S + o >= self.n)

    def hole_slot(self, i, o) -> z3.BoolRef:
        """A free position below n_live."""
        return z3.And(z3.Not(self.snap.live_at(i, o)), i * self.snap.S + o < self.n)

    def mover(self, p: int) -> z3.BoolRef:
        return self.mover_slot(p // self.snap.S, p % self.snap.S)

    def hole(self, p: int) -> z3.BoolRef:
        return self.hole_slot(p // self.snap.S, p % self.snap.S)

    def touches_shared(self, i, o) -> z3.BoolRef:
        """plan_densify touches the blocks of all holes and movers."""
        return z3.And(z3.Or(self.hole_slot(i, o), self.mover_slot(i, o)), self.snap.shared_at(i))

    def is_src_block(self, i: int) -> z3.BoolRef:
        return z3.And(self.keep <= i, i < self.written)

    def bounds_rule(self) -> z3.BoolRef:
        S = self.snap.S
        return z3.And(_ceil_div(self.keep, self.n, S), _ceil_div(self.written, self.snap.w, S))

    def selects(self, j: int) -> z3.BoolRef:
        """Move j reads a mover: a live token at a position >= n_live."""
        i, o = self.src_entry(j), self.src_off(j)
        return z3.And(self.snap.is_entry_offset(i, o), self.mover_slot(i, o))

    def targets(self, j: int) -> z3.BoolRef:
        """Move j writes a hole: a free position < n_live."""
        i, o = self.dst_entry(j), self.dst_off(j)
        return z3.And(self.snap.is_entry_offset(i, o), self.hole_slot(i, o))

    def order(self, j: int) -> z3.BoolRef:
        """Movers in logical order go to holes in position order."""
        return z3.And(self.token(j) < self.token(j + 1), self.dst_pos(j) < self.dst_pos(j + 1))

    def covers(self, p: int) -> z3.BoolRef:
        """Every mover is moved; the holes filled are the first ones."""
        m, h, nm, S, P = self.move_of[p], self.move_into[p], self.num_moves, self.snap.S, self.snap.P
        return z3.And(
            z3.Implies(self.mover(p), z3.And(0 <= m, m < nm, self.src_entry(m) == p // S, self.src_off(m) == p % S,
                                             _cases(m, P))),
            z3.Implies(z3.And(self.hole(p), nm >= 1, p < self.dst_pos(nm - 1)),
                       z3.And(0 <= h, h < nm, self.dst_entry(h) == p // S, self.dst_off(h) == p % S, _cases(h, P))),
        )

    def placement(self, cover: bool = True) -> z3.BoolRef:
        P = self.snap.P
        return z3.And(
            0 <= self.num_moves, self.num_moves <= P,
            *[z3.Implies(j < self.num_moves, z3.And(self.selects(j), self.targets(j))) for j in range(P)],
            *[z3.Implies(j + 1 < self.num_moves, self.order(j)) for j in range(P - 1)],
            *([self.covers(p) for p in range(P)] if cover else []),
        )

    def touched_shared(self) -> z3.BoolRef:
        s = self.snap
        return z3.Or(
            *[self.touches_shared(p // s.S, p % s.S) for p in range(s.P)],
            *[z3.And(self.is_src_block(i), s.shared[i]) for i in range(s.NB)],
        )

    def lemmas(self) -> z3.BoolRef:
        """Instances of the premise's per-slot facts (T2, the shared-block gate) at the moves' slots: valid
        consequences of ``planned() & plan().exists`` (tests check it), stated so the solver need not find
        which concrete slot a move's symbolic slot is."""
        s, out = self.snap, []
        for j in range(s.P):
            for i, o in ((self.src_entry(j), self.src_off(j)), (self.dst_entry(j), self.dst_off(j))):
                out.append(z3.Implies(j < self.num_moves, z3.And(s.before_cursor(i, o),
                                                                 z3.Not(self.touches_shared(i, o)))))
        return z3.And(s.lemmas(), *out)

    def gate(self) -> z3.BoolRef:
        already_dense = z3.And(*[z3.Not(self.mover(p)) for p in range(self.snap.P)], self.snap.w == self.n)
        return z3.And(z3.Not(already_dense), z3.Not(self.touched_shared()))

    def planned(self, cover: bool = True) -> z3.BoolRef:
        """``cover=False`` drops "every mover is moved, the first holes are filled": more plans."""
        return z3.And(self.snap.wf(), self.bounds_rule(), self.placement(cover))

    def plan(self) -> ZPlan:
        s = self.snap
        moves = [ZMove(j, j < self.num_moves, self.token(j), s.block_id(self.src_entry(j)), self.src_off(j),
                       s.block_id(self.dst_entry(j)), self.dst_off(j)) for j in range(s.P)]
        return ZPlan(exists=self.gate(), moves=moves, src=[(self.is_src_block(i), b) for i, b in enumerate(s.bid)],
                     dense_write_pos=self.n, snap=s, witness=self._witness)

    def _witness(self, q: int) -> tuple[z3.BoolRef, z3.ArithRef]:
        m = self.move_of[q]
        return z3.And(0 <= m, m < self.num_moves), self.token(m)

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
    return (f"moves[{mv.at}]=Move(t{ev(mv.token)}, src=(block {ev(mv.src_block)}, offset {ev(mv.src_offset)}), "
            f"dst=(block {ev(mv.dst_block)}, offset {ev(mv.dst_offset)}))")


def _pairs(plan: ZPlan):
    ms = plan.moves
    return [(a, b) for i, a in enumerate(ms) for b in ms[i + 1:]]


def _not_moved(plan: ZPlan, q: int) -> z3.BoolRef:
    """No move of the plan names the token at position q. Conjoined with its own instance at the model's
    witness move (implied by it, so the formula is equivalent), which the solver cannot guess quickly."""
    token = plan.snap.tok[q]
    none = z3.And([z3.Implies(mv.guard, mv.token != token) for mv in plan.moves])
    if plan.witness is None:
        return none
    g, t = plan.witness(q)
    return z3.And(none, z3.Implies(g, t != token))


def _reads_live_slot(s: SnapshotModel, mv: ZMove) -> Violation:
    return (lambda m, mv=mv: f"{_mv(m, mv)}: token t{_ev(m)(mv.token)} is not live at that slot",
            z3.And(mv.guard, z3.Not(s.holds(mv.token, mv.src_block, mv.src_offset))))


def _same_dst(a: ZMove, b: ZMove) -> Violation:
    return (lambda m, a=a, b=b: f"two moves to one slot: {_mv(m, a)} and {_mv(m, b)}",
            z3.And(a.guard, b.guard, a.dst_block == b.dst_block, a.dst_offset == b.dst_offset))


def _same_token(a: ZMove, b: ZMove) -> Violation:
    return (lambda m, a=a, b=b: f"token moved twice: {_mv(m, a)} and {_mv(m, b)}",
            z3.And(a.guard, b.guard, a.token == b.token))


def v_strict_decrease(model: CompactModel) -> list[Violation]:
    plan = model.plan()
    nd, ns = plan.count(plan.dst), plan.count(plan.src)
    return [(lambda m: f"the plan takes {_ev(m)(nd)} destination block(s) to free {_ev(m)(ns)} source block(s)",
             z3.Or(ns < 1, nd >= ns)),
            (lambda m: f"the plan takes {_ev(m)(nd)} destination blocks, over the budget {_ev(m)(model.budget)}",
             nd > model.budget)]


def v_dst_capacity(model: CompactModel) -> list[Violation]:
    plan, S = model.plan(), model.snap.S
    nd, T = plan.count(plan.dst), plan.num_moves
    out: list[Violation] = [(lambda m: f"{_ev(m)(T)} moves but {_ev(m)(nd)} destination blocks of {S} slots "
                             f"(want ceil({_ev(m)(T)}/{S}))", z3.Not(_ceil_div(nd, T, S)))]
    for mv in plan.moves:
        bad = z3.And(mv.guard, z3.Or(mv.dst_offset < 0, mv.dst_offset >= S, z3.Not(model.in_dst(mv.dst_block))))
        out.append((lambda m, mv=mv: f"{_mv(m, mv)}: not a slot of the plan's destination blocks of {S} slots", bad))
    return out


def v_injective(model: CompactModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = [_same_dst(a, b) for a, b in _pairs(plan)]
    for d, (g, b) in enumerate(plan.dst):
        twice = z3.Or([z3.And(g2, b2 == b) for g2, b2 in plan.dst[d + 1:]])
        out.append((lambda m, b=b: f"destination block {_ev(m)(b)} is in the request's block list or twice in the plan",
                    z3.And(g, z3.Or(s.listed(b), twice))))
    return out


def v_live_sources(model: CompactModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = []
    for mv in plan.moves:
        out.append(_reads_live_slot(s, mv))
        out.append((lambda m, mv=mv: f"{_mv(m, mv)}: reads a block that is not a source of the plan",
                    z3.And(mv.guard, z3.Not(plan.is_src(mv.src_block)))))
    out += [_same_token(a, b) for a, b in _pairs(plan)]
    for q in range(s.P):
        b = s.bid[q // s.S]
        out.append((lambda m, q=q, b=b: f"live token t{_ev(m)(s.tok[q])} in source block {_ev(m)(b)} (offset "
                    f"{q % s.S}) is not moved, so the block cannot be freed",
                    z3.And(s.live[q], plan.is_src(b), _not_moved(plan, q))))
    return out


def v_eligible_sources(model: CompactModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = [(lambda m: f"{_ev(m)(plan.count(plan.src))} source blocks, over "
                             f"max_sources={_ev(m)(model.max_sources)}", plan.count(plan.src) > model.max_sources)]
    for g, b in plan.src:
        idx = s.index_of(b)
        bad = z3.And(g, z3.Or(z3.Not(s.listed(b)), s.is_shared(b), (idx + 1) * s.S > s.w))
        out.append((lambda m, b=b, idx=idx: f"source block {_ev(m)(b)} (list index {_ev(m)(idx)}) is unlisted, "
                    f"shared, or not wholly before the cursor {_ev(m)(s.w)}: the append block or later", bad))
    return out


def v_logical_order(model: CompactModel) -> list[Violation]:
    plan, S = model.plan(), model.snap.S

    def seq(mv: ZMove) -> z3.ArithRef:  # place in the destination sequence: index in dst_blocks * S + offset
        return model.reserved_index(mv.dst_block) * S + mv.dst_offset

    out: list[Violation] = []
    for a, b in _pairs(plan):
        for x, y in ((a, b), (b, a)):
            out.append((lambda m, x=x, y=y: f"logical order lost: t{_ev(m)(x.token)} < t{_ev(m)(y.token)} but "
                        f"{_mv(m, x)} lands at or after {_mv(m, y)}",
                        z3.And(x.guard, y.guard, x.token < y.token, seq(x) >= seq(y))))
    return out


def _increasing(plan: ZPlan) -> list[Violation]:
    """Consecutive moves have strictly increasing tokens and destination positions: no token is moved twice
    and no two moves share a destination (pairwise, by transitivity)."""
    s, out = plan.snap, []
    for a, b in zip(plan.moves, plan.moves[1:]):
        pa = s.raw_position(a.dst_block, a.dst_offset)
        increasing = z3.And(s.is_slot(a.dst_block, a.dst_offset), s.is_slot(b.dst_block, b.dst_offset),
                            s.raw_position(b.dst_block, b.dst_offset) > pa, b.token > a.token)
        out.append((lambda m, a=a, b=b: f"{_mv(m, a)} then {_mv(m, b)}: tokens or destination positions do not "
                    f"increase (a token moved twice or two moves to one slot?)",
                    z3.And(a.guard, b.guard, z3.Not(increasing))))
    return out


def v_dense_prefix(model: DensifyModel) -> list[Violation]:
    """Violations of: after the moves, the n live tokens sit at distinct positions below n.

    apply_moves relocates each named token from its slot (I4/densify/moves: the slot it names) to the
    destination. So it suffices that every live token at or above n is named by a move (V1), every
    destination is a slot below n (V2) that no live token holds before the batch (V3), and tokens and
    destinations strictly increase along the move list (V4: no token moves twice, no slot receives two):
    unmoved tokens stay below n, moved ones land below n, and no two tokens meet. n distinct positions
    below n are exactly [0, n).
    """
    plan, s = model.plan(), model.snap
    n = s.n_live
    out: list[Violation] = [(lambda m: f"cursor after commit {_ev(m)(plan.dense_write_pos)} != n_live {_ev(m)(n)}",
                             plan.dense_write_pos != n)]
    for q in range(s.P):
        out.append((lambda m, q=q: f"live token t{_ev(m)(s.tok[q])} at position {q} >= n_live={_ev(m)(n)} is "
                    f"not moved", z3.And(s.live[q], q >= n, _not_moved(plan, q))))
    for mv in plan.moves:
        dpos = s.position_of(mv.dst_block, mv.dst_offset)
        out.append((lambda m, mv=mv, dpos=dpos: f"{_mv(m, mv)} lands at position {_ev(m)(dpos)}, not below "
                    f"n_live={_ev(m)(n)} ({s.P} = not a slot of the request)",
                    z3.And(mv.guard, z3.Not(s.slot_before(mv.dst_block, mv.dst_offset, n)))))
        out.append((lambda m, mv=mv: f"{_mv(m, mv)} lands on a live token",
                    z3.And(mv.guard, s.occupied(mv.dst_block, mv.dst_offset))))
    return out + _increasing(plan)


def v_no_chain(model: DensifyModel) -> list[Violation]:
    """Every destination is a slot below n_live and every source a slot at or above it, so no destination
    is any move's source; destinations strictly increase, so they are distinct."""
    plan, s = model.plan(), model.snap
    n = s.n_live
    out: list[Violation] = []
    for mv in plan.moves:
        dpos, spos = s.position_of(mv.dst_block, mv.dst_offset), s.position_of(mv.src_block, mv.src_offset)
        src_above = z3.And(s.is_slot(mv.src_block, mv.src_offset), s.raw_position(mv.src_block, mv.src_offset) >= n)
        out.append((lambda m, mv=mv, dpos=dpos, spos=spos: f"{_mv(m, mv)}: destination position {_ev(m)(dpos)} "
                    f"and source position {_ev(m)(spos)} are not on either side of n_live={_ev(m)(n)} "
                    f"(so a destination may be another move's source; {s.P} = not a slot)",
                    z3.And(mv.guard, z3.Not(z3.And(s.slot_before(mv.dst_block, mv.dst_offset, n), src_above)))))
    return out + _increasing(plan)


def v_freed_blocks(model: DensifyModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    S, n = s.S, s.n_live
    out: list[Violation] = []
    for i, (g, b) in enumerate(plan.src):
        want = z3.And(i < s.nb, i * S >= n, i * S < s.w)  # entry i starts at or after n_live and before the cursor
        out.append((lambda m, i=i, b=b, g=g: f"block {_ev(m)(b)} (index {i}) released={_ev(m)(g)}, but it starts "
                    f"at {i * S}, against [n_live={_ev(m)(n)}, cursor={_ev(m)(s.w)})", g != want))
        out.append((lambda m, b=b: f"released block {_ev(m)(b)} is shared", z3.And(g, s.shared[i])))
        for q in range(i * S, (i + 1) * S):
            out.append((lambda m, q=q, b=b: f"released block {_ev(m)(b)} keeps live token t{_ev(m)(s.tok[q])} "
                        f"(offset {q % S}): no move takes it out", z3.And(g, s.live[q], _not_moved(plan, q))))
        for mv in plan.moves:
            out.append((lambda m, mv=mv, b=b: f"{_mv(m, mv)} writes released block {_ev(m)(b)}",
                        z3.And(g, mv.guard, mv.dst_block == b)))
    return out


def v_densify_moves(model: DensifyModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    n = s.n_live
    out: list[Violation] = []
    for mv in plan.moves:
        dpos = s.position_of(mv.dst_block, mv.dst_offset)
        out += [
            _reads_live_slot(s, mv),
            (lambda m, mv=mv, dpos=dpos: f"{_mv(m, mv)}: destination position {_ev(m)(dpos)} is not a free slot "
             f"below n_live={_ev(m)(n)} and the cursor {_ev(m)(s.w)}",
             z3.And(mv.guard, z3.Or(z3.Not(s.slot_before(mv.dst_block, mv.dst_offset, n)),
                                    z3.Not(s.slot_before(mv.dst_block, mv.dst_offset, s.w)),
                                    s.occupied(mv.dst_block, mv.dst_offset)))),
            (lambda m, mv=mv: f"{_mv(m, mv)}: touches a shared block",
             z3.And(mv.guard, z3.Or(s.is_shared(mv.src_block), s.is_shared(mv.dst_block)))),
        ]
    for i, (g, b) in enumerate(plan.src):
        out.append((lambda m, b=b: f"releases shared block {_ev(m)(b)}", z3.And(g, s.shared[i])))
    return out


# ---- explanations and checks ------------------------------------------------------------------------------------
def describe(model, m: z3.ModelRef) -> str:
    """The snapshot and the plan of a z3 model, in the project's terms."""
    s, ev = model.snap, _ev(m)
    S, nb, w = s.S, ev(s.nb), ev(s.w)
    plan = model.plan()
    lines = [f"snapshot: S={S}, blocks={[ev(b) for b in s.bid[:nb]]}, write_pos={w} (block index {w // S}, "
             f"offset {w % S}), num_live={ev(s.n_live)}, "
             f"shared_blocks={sorted(ev(s.bid[i]) for i in range(nb) if ev(s.shared[i]))}"]
    for i in range(nb):
        toks = [f"{o}:t{ev(s.tok[i * S + o])}" for o in range(S) if ev(s.live[i * S + o])]
        lines.append(f"  block {ev(s.bid[i])} (index {i}): live {{{', '.join(toks)}}}")
    lines.append(f"{model.describe_params(m)} -> " + ("Plan" if ev(plan.exists) else "NoPlan"))
    lines.append(f"  src_blocks={[ev(b) for g, b in plan.src if ev(g)]}"
                 + (f", dst_blocks={[ev(b) for g, b in plan.dst if ev(g)]}" if plan.dst else "")
                 + (f", dense_write_pos={ev(plan.dense_write_pos)}" if plan.dense_write_pos is not None else ""))
    lines += [f"  {_mv(m, mv)}" for mv in plan.moves if ev(mv.guard)]
    return "\n".join(lines)


def make_explain(model, violations: list[Violation]) -> Callable[[z3.ModelRef], str]:
    def explain(m: z3.ModelRef) -> str:
        hit = [say(m) for say, v in violations if z3.is_true(m.eval(v, model_completion=True))]
        return describe(model, m) + "\nviolated: " + ("; ".join(hit[:3]) or "(none evaluated true)")
    return explain


_SMT_PARAMS = {"tactic.default_tactic": "smt", "smt.arith.solver": 2}


@contextmanager
def smt_core():
    """Make ``z3.Solver()`` (what ``obligations.prove`` builds) run z3's SMT core directly.

    The default tactic preprocesses these bounded counting constraints into bit-level circuits on which
    unsatisfiability takes minutes (it times out at S=4 with 6 blocks); the SMT core proves the same
    claims in milliseconds. The global parameter is restored on exit.
    """
    saved = {k: z3.get_param(k) for k in _SMT_PARAMS}
    z3.set_param(**_SMT_PARAMS)
    try:
        yield
    finally:
        z3.set_param(**saved)


ModelFactory = Callable[[Bound], object]
PropertyFn = Callable[[object], list[Violation]]


def premise(model, cover: bool = True, lemmas: bool = True) -> z3.BoolRef:
    """The model made a plan. Build the violations first: they may define indicators that ``wf`` includes."""
    exists = model.plan().exists
    hints = model.lemmas() if lemmas else z3.BoolVal(True)
    return z3.And(model.planned(cover), exists, hints)


@lru_cache(maxsize=None)
def makes_plans(factory: ModelFactory, bound: Bound) -> bool | None:
    """Does the planner model make any plan at all within ``bound``? (If not, every proof about it is vacuous.)"""
    model = factory(bound)
    solver = z3.SimpleSolver()
    solver.set("timeout", TIMEOUT_MS)
    solver.add(premise(model))
    r = solver.check()
    return None if r == z3.unknown else r == z3.sat


def check_property(factory: ModelFactory, prop: PropertyFn, bounds: Iterable[Bound] = BOUNDS) -> Outcome:
    """Prove that every plan the model makes, from every snapshot within each bound, violates nothing in ``prop``."""
    covered = []
    for bound in bounds:
        t0 = time.perf_counter()
        model = factory(bound)
        violations = prop(model)
        claim = z3.Implies(premise(model), z3.Not(z3.Or([v for _, v in violations])))
        with smt_core():
            out = prove(claim, timeout_ms=TIMEOUT_MS, explain=make_explain(model, violations))
        if out.status != PROVED:
            return Outcome(out.status, f"[{bound}] {out.detail}")
        nonvacuous = makes_plans(factory, bound)
        if not nonvacuous:
            return Outcome(UNKNOWN, f"[{bound}] vacuous: the {model.kind} model makes no plan at all"
                           if nonvacuous is False else f"[{bound}] could not decide whether the model makes a plan")
        covered.append(f"{bound} ({time.perf_counter() - t0:.1f} s)")
    return Outcome(PROVED, "no counterexample for " + "; ".join(covered))


@dataclass(frozen=True)
class Property:
    id: str
    invariant: str
    planner: str  # "compact" or "densify"
    claim: str
    violations: PropertyFn
    bounds: tuple[Bound, ...] = WIDE_BOUNDS


PROPERTIES: tuple[Property, ...] = (
    Property("I4/compact/strict-decrease", "I4", "compact",
             "a compact plan has at least one source and strictly fewer destination blocks than source blocks, "
             "within the destination budget", v_strict_decrease),
    Property("I4/compact/dst-capacity", "I4", "compact",
             "a compact plan with T moves uses ceil(T/S) destination blocks, and every move's destination is a "
             "slot of one of them (offset in [0, S))", v_dst_capacity),
    Property("I4/compact/injective-dst", "I4", "compact",
             "no two moves of a compact plan share a destination slot; its destination blocks are distinct and in "
             "none of the request's blocks", v_injective),
    Property("I4/compact/live-sources", "I4", "compact",
             "a compact plan moves only live tokens, each once, from the token's own slot in a source block, and "
             "moves every live token of its source blocks (so they can be freed)", v_live_sources),
    Property("I4/compact/eligible-sources", "I4", "compact",
             "a compact plan has at most max_sources source blocks, all in the request's list, none shared and "
             "none the append (cursor's) block or a later one", v_eligible_sources),
    Property("I4/compact/logical-order", "I4", "compact",
             "a compact plan keeps logical order: of two moved tokens the smaller id gets the earlier destination "
             "slot (destination block's index in dst_blocks * S + offset)", v_logical_order),
    Property("I7/densify/dense-prefix", "I7", "densify",
             "after a densify plan's moves the n_live live tokens have distinct positions, all below n_live (so "
             "they occupy exactly [0, n_live)), and the cursor after commit is n_live", v_dense_prefix),
    Property("I4/densify/no-chain", "I4", "densify",
             "densify destinations are distinct and none is the source slot of any move (moves never chain)",
             v_no_chain, BASE_BOUNDS),
    Property("I7/densify/freed-blocks", "I7", "densify",
             "densify releases exactly the blocks starting in [n_live, cursor), none shared, and none holds a live "
             "token after the moves", v_freed_blocks),
    Property("I4/densify/moves", "I4", "densify",
             "every densify move reads its live token's own slot and writes a free slot below n_live and the "
             "cursor; no block it reads, writes or releases is shared", v_densify_moves, BASE_BOUNDS),
)

MODELS: dict[str, type] = {"compact": CompactModel, "densify": DensifyModel}


def property_by_id(pid: str) -> Property:
    return next(p for p in PROPERTIES if p.id == pid)


def obligation(prop: Property, model_cls: type | None = None, bounds: tuple[Bound, ...] | None = None) -> Obligation:
    """The obligation for ``prop`` over ``model_cls`` (default: the faithful model; tests pass planted variants)."""
    cls = model_cls or MODELS[prop.planner]
    bounds = bounds or prop.bounds

    def check() -> Outcome:
        return check_property(cls, prop.violations, bounds)

    how = ("for every set of eligible sources that passes the gate (the code's greedy choice is one of them)"
           if prop.planner == "compact" else
           "for every map of movers to holes increasing from logical to position order (the code's zip is one)")
    claim = f"{prop.claim}; bounded: every snapshot with {bounds_text(bounds)}, {how}"
    return Obligation(prop.id, prop.invariant, f"planner {prop.planner}", claim, check)


def obligations() -> list[Obligation]:
    return [obligation(p) for p in PROPERTIES]
