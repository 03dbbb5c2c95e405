"""z3 proofs that the relocation planners only make valid plans (I4, I7), for every block size and block count.

``core/compact.py`` and ``core/densify.py`` are modelled as constraints over one symbolic
``RequestSnapshot``; every plan the constraints allow is checked against the plan-level properties of
I4 (plan validity) and I7 (dense prefix). The proofs are *parametric*: the block size S and the
number of blocks are z3 integers, so each proof covers every S >= 1, every block list, every token
id, block id, shared set, cursor and eviction pattern, any ``max_sources`` and destination budget.

How (a template model, instantiated two ways):
  Every constraint of the model is a *template* over one index: a block-list entry i, a slot (i, o),
  a move j or (compact) a reserved destination d, guarded by its range (0 <= i < NB, 0 <= o < S,
  0 <= j < number of moves, 0 <= d < budget). The premise is the universal closure of the
  templates: "for every index in range, the template holds".
  - *Bounded* (``Bound(S, NB)``): the templates are instantiated at every concrete index, and the
    counts (num_live, a block's live count, the number of sources k, of moved tokens T, of movers,
    a token's rank, a hole's rank) are defined as sums. This is the model that
    ``tests/test_spec_planners.py`` pins to concrete snapshots and compares with the code (S = 1, 2,
    4, 8, and S = 16 with 8 blocks; S = 32 with 4 in its slow sample), and that finds readable
    counterexamples when a planted bug breaks a property. The code's plan satisfying it means it
    satisfies the templates, which is what the proofs need. (The ranks also fix the order of the
    moves, so a bug planted in ``order`` alone is refuted by the parametric proof but has no
    counterexample in the bounded model.)
  - *Parametric* (``SnapshotModel(None)``): S and NB are symbolic, and each property's violation is
    stated at fresh symbolic indices (a move j, a pair j1 < j2, a slot (i, o), an entry i). Its
    negation is unsatisfiable together with the templates instantiated at the finitely many index
    terms the violation reaches (``instances``: the violation's indices, the slots a move reads and
    writes, the move that reads a slot, an entry's slot, two rounds deep). Every instance is implied
    by the universal premise, so unsatisfiability proves the property for every S and block count.
    Counts are left free: dropping their definitions only weakens the premise, so it stays sound;
    the properties never need them. Where a property needs a fact about *all* earlier moves (the
    moved tokens increase pairwise, not only from one move to the next), that fact is proved by
    induction over the move index from the template itself (base and step checked by z3), and only
    then used.
  Products i*S (a slot's position) are nonlinear when S is symbolic; z3's nonlinear arithmetic
  handles the few monotonicity facts the proofs need (i >= keep implies i*S >= keep*S).

The symbolic snapshot (``SnapshotModel``):
  num_blocks nb, NB    the block list's length, 0 <= nb <= NB (NB: the entries the model has)
  block_id(i)          the id of entry i; index_of is its inverse, so ids are distinct
  shared(i)            entry i is in ``shared_blocks`` (ref count > 1)
  write_pos w          the append cursor, 0 <= w <= nb*S
  live(i, o), token(i, o)  slot (entry i, offset o), at position i*S + o, holds a live token (bit o
                       of masks[i]) whose logical id is token(i, o); ids are pairwise distinct (they
                       have inverses entry_of, offset_of), so a dead token is an id held by no slot
It assumes what the token table maintains (T1, T2, I2): the masks are the recomputation of the
slots, live tokens lie before the cursor, num_live is the number of live slots.

A plan is data (``ZPlan``): move j (``ZMove``, guarded by j < number of moves), source block of
entry i (guarded), destination d (compact) and the new cursor (densify). The properties read it in
the ids a real ``Plan`` carries (token ids, block ids, offsets), looking slots and blocks up the way
the token table does.

The planners are *nondeterministic* where the code makes a heuristic choice, and each proof covers
every plan the relaxed model allows:
  compact  the sources are ANY set of eligible blocks (wholly before the cursor's block, not shared,
           not full) of 1 <= k <= max_sources blocks whose T live tokens give ceil(T/S) <= the
           destination budget and ceil(T/S) < k. The code's greedy choice (lowest utilization
           first, ties by index, shrunk to the budget) is one of them; ``exact=True`` (bounded only)
           adds it (``CompactModel.greedy``) so the differential test pins the model to the code's
           choice. Move j reads a live token of a source, tokens strictly increase with j, every
           source token is read by some move, and move j writes (reserved[j // S], j % S).
  densify  move j reads a mover (live at a position >= num_live) and writes a hole (free, below
           num_live); tokens and hole positions strictly increase with j, every mover is moved and
           the holes filled are the first ones: exactly ``zip(movers, holes)``. The sources are
           blocks [ceil(n/S), ceil(w/S)); a plan is made unless the request is already dense or a
           block it touches (holes, movers, released blocks, the new cursor's block) is shared.

Each model is a class whose template methods a test may override to plant a bug
(tests/test_spec_planners.py plants one per property).
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable

import z3

from .obligations import COUNTEREXAMPLE, PROVED, UNKNOWN, Obligation, Outcome, prove

TIMEOUT_MS = 60_000
_I, _B = z3.IntSort(), z3.BoolSort()
ENTRY, SLOT, MOVE, RESERVED = "entry", "slot", "move", "reserved"  # the index kinds of the templates
INSTANCE_ROUNDS = 2  # how far from a violation's indices the parametric proof instantiates templates


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


#: Where a failed parametric proof looks for a concrete counterexample to print.
SEARCH_BOUNDS: tuple[Bound, ...] = (Bound(1, 6), Bound(2, 5), Bound(4, 4))
#: Where every proof checks that the model makes plans at all (a production block size).
WITNESS_BOUND = Bound(16, 4)


def bounds_text(bounds: Iterable[Bound]) -> str:
    return "; ".join(str(b) for b in bounds)


def _iv(x) -> z3.ArithRef:
    return z3.IntVal(x) if isinstance(x, int) else x


def _divmod(j: z3.ArithRef, S: z3.ArithRef) -> tuple[z3.ArithRef, z3.ArithRef]:
    """(j // S, j % S): Python arithmetic when both are numbers (bounded), z3's div and mod otherwise."""
    if z3.is_int_value(j) and z3.is_int_value(S):
        q, r = divmod(j.as_long(), S.as_long())
        return z3.IntVal(q), z3.IntVal(r)
    return j / S, j % S


# ---- the snapshot ----------------------------------------------------------------------------------------
class SnapshotModel:
    """One request's ``RequestSnapshot``, symbolic: within a ``Bound``, or for every S and NB (``bound=None``)."""

    def __init__(self, bound: Bound | None) -> None:
        self.bound = bound
        if bound is None:
            self.S, self.NB = z3.Int("S"), z3.Int("max_blocks")
        else:
            self.S, self.NB = z3.IntVal(bound.block_size), z3.IntVal(bound.max_blocks)
        self.nb = z3.Int("num_blocks")
        self.w = z3.Int("write_pos")
        self.n_live = z3.Int("num_live")
        self.block_id = z3.Function("block_id", _I, _I)
        self.index_of = z3.Function("index_of", _I, _I)
        self.shared_at = z3.Function("shared", _I, _B)
        self.live_at = z3.Function("live", _I, _I, _B)
        self.token_at = z3.Function("token", _I, _I, _I)
        self.entry_of = z3.Function("entry_of_token", _I, _I)
        self.offset_of = z3.Function("offset_of_token", _I, _I)
        self.live_count = z3.Function("live_count", _I, _I)  # live tokens of entry i (a count)
        self._ind: dict[int, z3.ArithRef] = {}
        self.defs: list[z3.BoolRef] = []  # bounded: definitions of 0/1 indicators and of the counts
        self.domain: list[z3.BoolRef] = []  # parametric: the ranges of the properties' index variables
        self.seeds: list[tuple[str, tuple]] = []  # parametric: (kind, index) the properties quantify over
        self._vars = itertools.count()
        if bound is not None:
            self.defs.append(self.n_live == self.count([self.live_at(i, o) for i, o in self.slots()], "live"))
            self.defs += [self.live_count(i) == self.count([self.live_at(i, o) for o in self.offsets()], "live")
                          for i in self.entries()]

    @property
    def parametric(self) -> bool:
        return self.bound is None

    # -- the concrete indices of a bound --
    def entries(self) -> list[z3.ArithRef]:
        return [z3.IntVal(i) for i in range(self.bound.max_blocks)]

    def offsets(self) -> list[z3.ArithRef]:
        return [z3.IntVal(o) for o in range(self.bound.block_size)]

    def slots(self) -> list[tuple[z3.ArithRef, z3.ArithRef]]:
        return [(i, o) for i in self.entries() for o in self.offsets()]

    def move_indices(self) -> list[z3.ArithRef]:
        """A move reads a distinct live slot, so there are at most S*NB of them."""
        return [z3.IntVal(j) for j in range(self.bound.positions)]

    # -- counting (bounded) --
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

    # -- the properties' index variables: every concrete index (bounded) or one fresh variable (parametric) --
    def var(self, name: str, lo: z3.ArithRef, hi: z3.ArithRef | None = None) -> z3.ArithRef:
        x = z3.Int(f"{name}!{next(self._vars)}")
        self.domain.append(lo <= x if hi is None else z3.And(lo <= x, x < hi))
        return x

    def seed(self, kind: str, *idx: z3.ArithRef) -> None:
        self.seeds.append((kind, idx))

    def each_entry(self) -> list[z3.ArithRef]:
        if not self.parametric:
            return self.entries()
        i = self.var("i", z3.IntVal(0), self.NB)
        self.seed(ENTRY, i)
        return [i]

    def each_slot_of(self, i: z3.ArithRef) -> list[tuple[z3.ArithRef, z3.ArithRef]]:
        if not self.parametric:
            return [(i, o) for o in self.offsets()]
        o = self.var("o", z3.IntVal(0), self.S)
        self.seed(SLOT, i, o)
        return [(i, o)]

    def each_slot(self) -> list[tuple[z3.ArithRef, z3.ArithRef]]:
        return [slot for i in self.each_entry() for slot in self.each_slot_of(i)]

    # -- templates --
    def facts(self) -> z3.BoolRef:
        """What holds of the whole snapshot. (num_live >= 0: a count, implied by its bounded definition.)"""
        return z3.And(self.S >= 1, 0 <= self.nb, self.nb <= self.NB, 0 <= self.w, self.w <= self.nb * self.S,
                      self.n_live >= 0)

    def entry_facts(self, i: z3.ArithRef) -> z3.BoolRef:
        """Block ids are distinct (index_of inverts block_id); a live count is within [0, S]."""
        return z3.Implies(z3.And(0 <= i, i < self.NB),
                          z3.And(self.index_of(self.block_id(i)) == i, self.block_id(i) >= 0,
                                 0 <= self.live_count(i), self.live_count(i) <= self.S))

    def slot_facts(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """Token ids are distinct (entry_of, offset_of invert token); a live token lies before the cursor (T2)."""
        t = self.token_at(i, o)
        return z3.Implies(self.in_range(i, o),
                          z3.And(t >= 0, self.entry_of(t) == i, self.offset_of(t) == o,
                                 z3.Implies(self.live_at(i, o), self.pos(i, o) < self.w)))

    def in_range(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """(i, o) addresses a slot of the model: 0 <= i < NB, 0 <= o < S."""
        return z3.And(0 <= i, i < self.NB, 0 <= o, o < self.S)

    def pos(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.ArithRef:
        return i * self.S + o

    # -- lookups by block id, as the token table does them --
    def listed(self, b: z3.ArithRef) -> z3.BoolRef:
        """Block id b is in the request's block list (same as: b == block_id(i) for some i < nb)."""
        i = self.index_of(b)
        return z3.And(0 <= i, i < self.nb, self.block_id(i) == b)

    def is_slot(self, b: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        return z3.And(self.listed(b), 0 <= o, o < self.S)

    def position_of(self, b: z3.ArithRef, o: z3.ArithRef) -> z3.ArithRef:
        """The position of slot (b, o), or -1 if it is not a slot of the request (for explanations)."""
        return z3.If(self.is_slot(b, o), self.raw_position(b, o), -1)

    def raw_position(self, b: z3.ArithRef, o: z3.ArithRef) -> z3.ArithRef:
        """index_of(b) * S + o: the position of (b, o) when it is a slot (``is_slot``)."""
        return self.index_of(b) * self.S + o

    def slot_before(self, b: z3.ArithRef, o: z3.ArithRef, k: z3.ArithRef) -> z3.BoolRef:
        """(b, o) is a slot of the request at a position below k."""
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
    at: z3.ArithRef  # the move's index in the plan
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
    """The plan a model makes: functions from an index to a move, a source (guard, block id), a destination.

    The lengths of its lists are sums of guards over a bound's indices, or (parametric) the model's
    symbols for them (``lengths``: how many indices in range pass the guard, by the symbol's definition).
    """

    snap: SnapshotModel
    exists: z3.BoolRef  # the planner returns a Plan (not a NoPlan)
    move: Callable[[z3.ArithRef], ZMove]
    src: Callable[[z3.ArithRef], tuple[z3.BoolRef, z3.ArithRef]]  # entry i -> (is a source, block id)
    is_src: Callable[[z3.ArithRef], z3.BoolRef]  # block id b is one of the sources
    # slot (i, o) -> (guard, token) of the move the model says reads it: where to instantiate "no move names
    # this token", an instance the solver would not guess quickly
    witness: Callable[[z3.ArithRef, z3.ArithRef], tuple[z3.BoolRef, z3.ArithRef]]
    lengths: dict[str, z3.ArithRef]  # parametric: "moves", "src", "dst" as the model's symbols
    dst: Callable[[z3.ArithRef], tuple[z3.BoolRef, z3.ArithRef]] | None = None  # compact: d -> (used, id)
    dense_write_pos: z3.ArithRef | None = None  # densify: the cursor after commit

    # -- the lists (bounded) --
    @property
    def moves(self) -> list[ZMove]:
        return [self.move(j) for j in self.snap.move_indices()]

    @property
    def src_blocks(self) -> list[tuple[z3.BoolRef, z3.ArithRef]]:
        return [self.src(i) for i in self.snap.entries()]

    @property
    def dst_blocks(self) -> list[tuple[z3.BoolRef, z3.ArithRef]]:
        return [self.dst(d) for d in self.snap.entries()] if self.dst else []

    def _length(self, name: str, guards: Callable[[], list[z3.BoolRef]]) -> z3.ArithRef:
        return self.lengths[name] if self.snap.parametric else self.snap.count(guards(), "plan")

    @property
    def num_moves(self) -> z3.ArithRef:
        return self._length("moves", lambda: [m.guard for m in self.moves])

    @property
    def num_src(self) -> z3.ArithRef:
        return self._length("src", lambda: [g for g, _ in self.src_blocks])

    @property
    def num_dst(self) -> z3.ArithRef:
        return self._length("dst", lambda: [g for g, _ in self.dst_blocks])

    # -- what the properties quantify over: every element (bounded) or one at fresh indices (parametric) --
    def each_move(self) -> list[ZMove]:
        if not self.snap.parametric:
            return self.moves
        return [self._move_var("j")]

    def each_pair(self) -> list[tuple[ZMove, ZMove]]:
        """Every two moves, the earlier first."""
        if not self.snap.parametric:
            ms = self.moves
            return [(a, b) for n, a in enumerate(ms) for b in ms[n + 1:]]
        a = self._move_var("j1")
        b = self._move_var("j2", lo=a.at + 1)
        return [(a, b)]

    def each_consecutive(self) -> list[tuple[ZMove, ZMove]]:
        if not self.snap.parametric:
            ms = self.moves
            return list(zip(ms, ms[1:]))
        a = self._move_var("j")
        self.snap.seed(MOVE, a.at + 1)
        return [(a, self.move(a.at + 1))]

    def _move_var(self, name: str, lo: z3.ArithRef | None = None) -> ZMove:
        j = self.snap.var(name, z3.IntVal(0) if lo is None else lo)
        self.snap.seed(MOVE, j)
        return self.move(j)

    def each_src(self) -> list[tuple[z3.BoolRef, z3.ArithRef, z3.ArithRef]]:
        """(is a source, block id, entry) for every entry."""
        return [(*self.src(i), i) for i in self.snap.each_entry()]

    def each_dst(self) -> list[tuple[z3.BoolRef, z3.ArithRef]]:
        if not self.snap.parametric:
            return self.dst_blocks
        d = self.snap.var("d", z3.IntVal(0))
        self.snap.seed(RESERVED, d)
        return [self.dst(d)]

    def each_dst_pair(self) -> list[tuple[tuple, tuple]]:
        if not self.snap.parametric:
            ds = self.dst_blocks
            return [(a, b) for n, a in enumerate(ds) for b in ds[n + 1:]]
        d1 = self.snap.var("d1", z3.IntVal(0))
        d2 = self.snap.var("d2", d1 + 1)
        self.snap.seed(RESERVED, d1)
        self.snap.seed(RESERVED, d2)
        return [(self.dst(d1), self.dst(d2))]

    def not_moved(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """No move of the plan names the token at slot (i, o). Parametric: its instance at the model's witness
        move (implied by it, so the violation only gets weaker and the proof stays sound); bounded: every
        move, conjoined with that instance (equivalent, and quick to refute)."""
        token = self.snap.token_at(i, o)
        g, t = self.witness(i, o)
        at_witness = z3.Implies(g, t != token)
        if self.snap.parametric:
            return at_witness
        return z3.And(at_witness, *[z3.Implies(mv.guard, mv.token != token) for mv in self.moves])


def _ceil_div(q: z3.ArithRef, x: z3.ArithRef, S: z3.ArithRef) -> z3.BoolRef:
    """q = ceil(x / S) for x >= 0."""
    return z3.And(q * S >= x, q * S - S < x)


def _ranks(members: list[z3.BoolRef], tokens: list[z3.ArithRef]) -> list[z3.ArithRef]:
    """For each slot, how many members hold a smaller token: its place in logical order.
    NOTE: relies on token ids being distinct (``slot_facts``), so one comparison per pair serves both orders."""
    one, zero = z3.IntVal(1), z3.IntVal(0)
    n = len(tokens)
    lt = {(p, q): tokens[p] < tokens[q] for p in range(n) for q in range(p + 1, n)}
    return [z3.Sum([z3.If(z3.And(members[q], lt[q, p] if q < p else z3.Not(lt[p, q])), one, zero)
                    for q in range(n) if q != p]) if n > 1 else zero for p in range(n)]


class PlannerModel:
    """What both planner models share: the premise assembled from templates, in either instantiation."""

    kind = ""
    snap: SnapshotModel

    # a model defines facts() and gate_facts() (no index), template() and gate_template() (per index kind)
    def facts(self) -> z3.BoolRef:
        raise NotImplementedError

    def gate_facts(self) -> z3.BoolRef:
        raise NotImplementedError

    def template(self, kind: str, *idx) -> z3.BoolRef:
        raise NotImplementedError

    def gate_template(self, kind: str, *idx) -> z3.BoolRef:
        raise NotImplementedError

    def successors(self, kind: str, *idx) -> list[tuple[str, tuple]]:
        raise NotImplementedError

    def definitions(self) -> list[z3.BoolRef]:
        """Bounded: the counts' definitions (sums). The parametric proof leaves the counts free."""
        return []

    def increasing(self) -> list[tuple[str, Callable[[z3.ArithRef], z3.ArithRef], z3.ArithRef]]:
        """(name, f, n): f(j) < f(j + 1) for every 0 <= j < j + 1 < n follows from the move template; the
        parametric proof uses its pairwise form, proved by induction (``increasing_lemma``)."""
        return []

    def indices(self) -> list[tuple[str, tuple]]:
        """Every (kind, index) of the bound."""
        s = self.snap
        out = [(ENTRY, (i,)) for i in s.entries()] + [(SLOT, slot) for slot in s.slots()]
        return out + [(MOVE, (j,)) for j in s.move_indices()]

    def planned(self) -> z3.BoolRef:
        """Bounded: the snapshot is well formed and the planner's steps are taken (whether or not the gate
        lets it return a Plan: that is ``plan().exists``)."""
        return z3.And(self.facts(), *[self.template(k, *idx) for k, idx in self.indices()],
                      *self.definitions(), *self.snap.defs)

    def gate(self) -> z3.BoolRef:
        """Bounded: the planner returns a Plan."""
        return z3.And(self.gate_facts(), *[self.gate_template(k, *idx) for k, idx in self.indices()])


# ---- compact ------------------------------------------------------------------------------------------------
class CompactModel(PlannerModel):
    """``plan_compaction(snap, reserved[:budget], max_sources)`` as templates. Override a method to plant a bug.

    Move j (j < T) reads the live token at slot (src_entry(j), src_offset(j)) of a chosen block; tokens
    strictly increase with j; every live token of a chosen block is read by the move move_of(i, o); and
    move j writes (reserved[j // S], j % S), exactly as ``plan_compaction`` enumerates them.
    """

    kind = "compact"

    def __init__(self, bound: Bound | None, exact: bool = False) -> None:
        assert not (exact and bound is None), "the code's greedy choice is modelled within a bound only"
        self.snap = SnapshotModel(bound)
        self.exact = exact
        self.max_sources = z3.Int("max_sources")
        self.budget = z3.Int("dst_budget")  # len(dst_blocks) passed to plan_compaction
        self.reserved_at = z3.Function("reserved_dst", _I, _I)  # the caller's fresh blocks, in order
        self.reserved_index = z3.Function("reserved_index", _I, _I)  # its inverse
        self.chosen_at = z3.Function("chosen", _I, _B)  # block-list entry i is a source
        self.num_dst = z3.Int("num_dst")
        self.src_entry = z3.Function("src_entry", _I, _I)  # move j reads slot (src_entry(j), src_offset(j))
        self.src_off = z3.Function("src_offset", _I, _I)
        self.move_of = z3.Function("move_of", _I, _I, _I)  # which move reads source slot (i, o)
        self.k = z3.Int("num_sources")  # counts: sums within a bound, free in the parametric proof
        self.T = z3.Int("num_moved")
        self.eligible_count = z3.Int("num_eligible")

    # -- the planner, one method per step of core/compact.py --
    def eligible(self, i: z3.ArithRef) -> z3.BoolRef:
        """eligible_sources: wholly before the cursor's block (i < w // S), in the list, not shared, not full."""
        s = self.snap
        return z3.And(0 <= i, i < s.nb, i * s.S + s.S <= s.w, z3.Not(s.shared_at(i)), s.live_count(i) < s.S)

    def is_source(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """plan_compaction moves the live tokens of the chosen blocks."""
        return z3.And(self.snap.live_at(i, o), self.chosen_at(i))

    def params(self, d: z3.ArithRef) -> z3.BoolRef:
        """The reserved destinations are distinct, fresh blocks (plan_compaction's precondition, for every
        d < budget; a bound instantiates it at d < NB, all the destinations a plan within it can use)."""
        r = self.reserved_at(d)
        return z3.Implies(z3.And(0 <= d, d < self.budget),
                          z3.And(self.reserved_index(r) == d, r >= 0, z3.Not(self.snap.listed(r))))

    def num_dst_rule(self) -> z3.BoolRef:
        return _ceil_div(self.num_dst, self.T, self.snap.S)

    def choice(self) -> z3.BoolRef:
        """choose_sources, relaxed: any eligible set of at most max_sources blocks whose destinations fit the
        budget (each chosen block eligible: ``template(ENTRY, i)``)."""
        return z3.And(self.k <= self.max_sources, self.num_dst_rule(), self.num_dst <= self.budget)

    def greedy(self) -> z3.BoolRef:
        """The code's exact choice: a prefix of eligible_sources' order (utilization, index), the longest
        prefix of at most max_sources blocks whose ceil(T/S) fits the budget."""
        s, cnt = self.snap, self.snap.live_count
        before = lambda i, j: z3.Or(cnt(i) < cnt(j), z3.And(cnt(i) == cnt(j), i < j))  # noqa: E731
        closed = [z3.Implies(z3.And(self.chosen_at(i), self.eligible(j), z3.Not(self.chosen_at(j))), before(i, j))
                  for i in s.entries() for j in s.entries() if i.as_long() != j.as_long()]
        cap = z3.If(self.max_sources < self.eligible_count, self.max_sources, self.eligible_count)
        next_too_big = z3.And([z3.Implies(z3.And(self.eligible(j), z3.Not(self.chosen_at(j))),
                                          self.T + cnt(j) > self.budget * s.S) for j in s.entries()])
        return z3.And(*closed, z3.Or(self.k == cap, next_too_big))

    def gate_facts(self) -> z3.BoolRef:
        """Plan only if there is a source and ceil(T/S) < k (the strict decrease)."""
        return z3.And(self.k >= 1, self.num_dst < self.k)

    def gate_template(self, kind: str, *idx) -> z3.BoolRef:
        return z3.BoolVal(True)

    def selects(self, j: z3.ArithRef) -> z3.BoolRef:
        """Move j reads a live token of a chosen block."""
        s, i, o = self.snap, self.src_entry(j), self.src_off(j)
        return z3.And(s.in_range(i, o), s.live_at(i, o), self.chosen_at(i))

    def token(self, j: z3.ArithRef) -> z3.ArithRef:
        return self.snap.token_at(self.src_entry(j), self.src_off(j))

    def order(self, j: z3.ArithRef) -> z3.BoolRef:
        """Tokens are taken in logical order."""
        return self.token(j) < self.token(j + 1)

    def covers(self, i: z3.ArithRef, o: z3.ArithRef) -> z3.BoolRef:
        """Source slot (i, o) is read by some move."""
        m = self.move_of(i, o)
        return z3.And(0 <= m, m < self.T, self.src_entry(m) == i, self.src_off(m) == o)

    def dst_slot(self, j: z3.ArithRef) -> tuple[z3.ArithRef, z3.ArithRef]:
        """The j-th moved token goes to (dsts[j // S], j % S)."""
        q, r = _divmod(j, self.snap.S)
        return self.reserved_at(q), r

    def facts(self) -> z3.BoolRef:
        s = self.snap
        parts = [s.facts(), self.max_sources >= 1, self.budget >= 0, self.T >= 0, self.k >= 0, self.choice()]
        return z3.And(*parts, *([self.greedy()] if self.exact else []))

    def template(self, kind: str, *idx) -> z3.BoolRef:
        s = self.snap
        if kind == ENTRY:
            (i,) = idx
            return z3.And(s.entry_facts(i), z3.Implies(z3.And(0 <= i, i < s.NB, self.chosen_at(i)), self.eligible(i)))
        if kind == SLOT:
            i, o = idx
            return z3.And(s.slot_facts(i, o), z3.Implies(z3.And(s.in_range(i, o), self.is_source(i, o)),
                                                         self.covers(i, o)))
        if kind == MOVE:
            (j,) = idx
            return z3.And(z3.Implies(z3.And(0 <= j, j < self.T), self.selects(j)),
                          z3.Implies(z3.And(0 <= j, j + 1 < self.T), self.order(j)))
        assert kind == RESERVED
        return self.params(*idx)

    def indices(self) -> list[tuple[str, tuple]]:
        return super().indices() + [(RESERVED, (d,)) for d in self.snap.entries()]

    def successors(self, kind: str, *idx) -> list[tuple[str, tuple]]:
        if kind == MOVE:
            (j,) = idx
            return [(SLOT, (self.src_entry(j), self.src_off(j))), (RESERVED, (_divmod(j, self.snap.S)[0],))]
        if kind == SLOT:
            i, o = idx
            return [(ENTRY, (i,)), (MOVE, (self.move_of(i, o),))]
        return []

    def definitions(self) -> list[z3.BoolRef]:
        """k, T, the eligible count and each source token's move (its rank among the source tokens)."""
        s = self.snap
        slots = s.slots()
        out = [self.k == s.count([self.chosen_at(i) for i in s.entries()], "chosen"),
               self.T == s.count([self.is_source(i, o) for i, o in slots], "moved"),
               self.eligible_count == s.count([self.eligible(i) for i in s.entries()], "eligible")]
        sources = [self.is_source(i, o) for i, o in slots]
        ranks = _ranks(sources, [s.token_at(i, o) for i, o in slots])
        return out + [z3.Implies(src, self.move_of(i, o) == r) for src, (i, o), r in zip(sources, slots, ranks)]

    def increasing(self):
        return [("the moved tokens", self.token, self.T)]

    # -- the plan it makes --
    def plan(self) -> ZPlan:
        s = self.snap

        def move(j):
            j = _iv(j)
            return ZMove(j, z3.And(0 <= j, j < self.T), self.token(j), s.block_id(self.src_entry(j)),
                         self.src_off(j), *self.dst_slot(j))

        return ZPlan(snap=s, exists=self.gate() if not s.parametric else self.gate_facts(), move=move,
                     src=lambda i: (self.chosen_at(i), s.block_id(i)),
                     is_src=lambda b: z3.And(s.listed(b), self.chosen_at(s.index_of(b))),
                     witness=self._witness,
                     lengths={"moves": self.T, "src": self.k, "dst": z3.If(self.num_dst > 0, self.num_dst, 0)},
                     dst=lambda d: (z3.And(0 <= d, d < self.num_dst), self.reserved_at(d)))

    def _witness(self, i, o) -> tuple[z3.BoolRef, z3.ArithRef]:
        m = self.move_of(i, o)
        return z3.And(0 <= m, m < self.T), self.token(m)

    def in_dst(self, b: z3.ArithRef) -> z3.BoolRef:
        """b is one of the plan's destination blocks (same as: b == reserved[d] for some d < num_dst)."""
        d = self.reserved_index(b)
        return z3.And(0 <= d, d < self.num_dst, self.reserved_at(d) == b)

    def describe_params(self, m: z3.ModelRef) -> str:
        ev = _ev(m)
        nd = max(0, min(ev(self.budget), self.snap.bound.max_blocks))
        return (f"compact(max_sources={ev(self.max_sources)}, "
                f"dst_blocks={[ev(self.reserved_at(d)) for d in range(nd)]}{'...' if ev(self.budget) > nd else ''})")


# ---- densify ------------------------------------------------------------------------------------------------
class DensifyModel(PlannerModel):
    """``plan_densify(snap)`` as templates. Override a method to plant a bug.

    Move j (j < num_moves) moves the token at mover slot (src_entry(j), src_offset(j)) into hole slot
    (dst_entry(j), dst_offset(j)): every mover is read by some move, tokens strictly increase and hole
    positions strictly increase with j, and the holes filled are a prefix of the holes in position order,
    exactly as ``zip(movers, holes)``. The model has one plan per snapshot: it is exact.
    """

    kind = "densify"
    exact = True

    def __init__(self, bound: Bound | None) -> None:
        self.snap = s = SnapshotModel(bound)
        self.n = s.n_live
        self.keep = z3.Int("keep")  # ceil(n_live / S)
        self.written = z3.Int("written")  # ceil(write_pos / S)
        self.num_moves = z3.Int("num_moves")
        self.src_entry, self.src_off = z3.Function("src_entry", _I, _I), z3.Function("src_offset", _I, _I)
        self.dst_entry, self.dst_off = z3.Function("dst_entry", _I, _I), z3.Function("dst_offset", _I, _I)
        self.move_of = z3.Function("move_of", _I, _I, _I)  # which move reads mover slot (i, o)
        self.move_into = z3.Function("move_into", _I, _I, _I)  # which move fills hole slot (i, o)

    def src_pos(self, j) -> z3.ArithRef:
        return self.snap.pos(self.src_entry(j), self.src_off(j))

    def dst_pos(self, j) -> z3.ArithRef:
        return self.snap.pos(self.dst_entry(j), self.dst_off(j))

    def token(self, j) -> z3.ArithRef:
        return self.snap.token_at(self.src_entry(j), self.src_off(j))

    def mover_slot(self, i, o) -> z3.BoolRef:
        """A live token at or after position n_live."""
        return z3.And(self.snap.live_at(i, o), self.snap.pos(i, o) >= self.n)

    def hole_slot(self, i, o) -> z3.BoolRef:
        """A free position below n_live."""
        return z3.And(z3.Not(self.snap.live_at(i, o)), self.snap.pos(i, o) < self.n)

    def touches_shared(self, i, o) -> z3.BoolRef:
        """plan_densify touches the blocks of all holes and movers."""
        return z3.And(z3.Or(self.hole_slot(i, o), self.mover_slot(i, o)), self.snap.shared_at(i))

    def is_src_block(self, i) -> z3.BoolRef:
        return z3.And(self.keep <= i, i < self.written)

    def is_cursor_block(self, i) -> z3.BoolRef:
        """Entry i holds the new cursor n_live mid-block (n % S != 0 and i = n // S < nb): the next appends write
        its tail, so plan_densify refuses it shared."""
        s = self.snap
        return z3.And(i < s.nb, s.pos(i, 0) < self.n, self.n < s.pos(i, 0) + s.S)

    def bounds_rule(self) -> z3.BoolRef:
        S = self.snap.S
        return z3.And(_ceil_div(self.keep, self.n, S), _ceil_div(self.written, self.snap.w, S))

    def selects(self, j) -> z3.BoolRef:
        """Move j reads a mover: a live token at a position >= n_live."""
        i, o = self.src_entry(j), self.src_off(j)
        return z3.And(self.snap.in_range(i, o), self.mover_slot(i, o))

    def targets(self, j) -> z3.BoolRef:
        """Move j writes a hole: a free position < n_live."""
        i, o = self.dst_entry(j), self.dst_off(j)
        return z3.And(self.snap.in_range(i, o), self.hole_slot(i, o))

    def order(self, j) -> z3.BoolRef:
        """Movers in logical order go to holes in position order."""
        return z3.And(self.token(j) < self.token(j + 1), self.dst_pos(j) < self.dst_pos(j + 1))

    def covers(self, i, o) -> z3.BoolRef:
        """Every mover is moved; the holes filled are the first ones: the hole with h holes before it (h =
        move_into, a count) is filled by move h if h < num_moves."""
        m, h, nm = self.move_of(i, o), self.move_into(i, o), self.num_moves
        return z3.And(
            z3.Implies(self.mover_slot(i, o), z3.And(0 <= m, m < nm, self.src_entry(m) == i, self.src_off(m) == o)),
            z3.Implies(z3.And(self.hole_slot(i, o), 0 <= h, h < nm),
                       z3.And(self.dst_entry(h) == i, self.dst_off(h) == o)),
        )

    def facts(self) -> z3.BoolRef:
        return z3.And(self.snap.facts(), self.bounds_rule(), 0 <= self.num_moves)

    def template(self, kind: str, *idx) -> z3.BoolRef:
        s = self.snap
        if kind == ENTRY:
            return s.entry_facts(*idx)
        if kind == SLOT:
            i, o = idx
            return z3.And(s.slot_facts(i, o), z3.Implies(s.in_range(i, o), self.covers(i, o)))
        assert kind == MOVE
        (j,) = idx
        return z3.And(z3.Implies(z3.And(0 <= j, j < self.num_moves), z3.And(self.selects(j), self.targets(j))),
                      z3.Implies(z3.And(0 <= j, j + 1 < self.num_moves), self.order(j)))

    def gate_facts(self) -> z3.BoolRef:
        """Not already dense: some mover, or the cursor is not n_live. (An existential: the parametric proof,
        which does not need it, leaves it out, only weakening the premise.)"""
        if self.snap.parametric:
            return z3.BoolVal(True)
        s = self.snap
        already_dense = z3.And(*[z3.Not(self.mover_slot(i, o)) for i, o in s.slots()], s.w == self.n)
        return z3.Not(already_dense)

    def gate_template(self, kind: str, *idx) -> z3.BoolRef:
        """No block the plan touches is shared: holes' and movers' blocks, released blocks, the new cursor's."""
        s = self.snap
        if kind == ENTRY:
            (i,) = idx
            return z3.Implies(z3.And(0 <= i, i < s.NB, s.shared_at(i)),
                              z3.Not(z3.Or(self.is_src_block(i), self.is_cursor_block(i))))
        if kind == SLOT:
            return z3.Implies(s.in_range(*idx), z3.Not(self.touches_shared(*idx)))
        return z3.BoolVal(True)

    def successors(self, kind: str, *idx) -> list[tuple[str, tuple]]:
        if kind == MOVE:
            (j,) = idx
            return [(SLOT, (self.src_entry(j), self.src_off(j))), (SLOT, (self.dst_entry(j), self.dst_off(j)))]
        if kind == SLOT:
            i, o = idx
            return [(ENTRY, (i,)), (MOVE, (self.move_of(i, o),)), (MOVE, (self.move_into(i, o),))]
        return []

    def definitions(self) -> list[z3.BoolRef]:
        """One move per mover; the move that reads a mover is its rank among the movers in logical order; the
        move that fills a hole is the number of holes before it."""
        s = self.snap
        slots = s.slots()
        movers = [self.mover_slot(i, o) for i, o in slots]
        out = [self.num_moves == s.count(movers, "mover")]
        out += [z3.Implies(m, self.move_of(i, o) == r)
               for m, (i, o), r in zip(movers, slots, _ranks(movers, [s.token_at(i, o) for i, o in slots]))]
        holes_before = z3.IntVal(0)
        for i, o in slots:
            hole = self.hole_slot(i, o)
            out.append(z3.Implies(hole, self.move_into(i, o) == holes_before))
            holes_before = holes_before + z3.If(hole, 1, 0)
        return out

    def plan(self) -> ZPlan:
        s = self.snap

        def move(j):
            j = _iv(j)
            return ZMove(j, z3.And(0 <= j, j < self.num_moves), self.token(j), s.block_id(self.src_entry(j)),
                         self.src_off(j), s.block_id(self.dst_entry(j)), self.dst_off(j))

        return ZPlan(snap=s, exists=self.gate() if not s.parametric else z3.BoolVal(True), move=move,
                     src=lambda i: (self.is_src_block(i), s.block_id(i)),
                     is_src=lambda b: z3.And(s.listed(b), self.is_src_block(s.index_of(b))),
                     witness=self._witness, lengths={"moves": self.num_moves}, dense_write_pos=self.n)

    def _witness(self, i, o) -> tuple[z3.BoolRef, z3.ArithRef]:
        m = self.move_of(i, o)
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
    return (f"moves[{ev(mv.at)}]=Move(t{ev(mv.token)}, src=(block {ev(mv.src_block)}, offset {ev(mv.src_offset)}), "
            f"dst=(block {ev(mv.dst_block)}, offset {ev(mv.dst_offset)}))")


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
    nd, ns = plan.num_dst, plan.num_src
    return [(lambda m: f"the plan takes {_ev(m)(nd)} destination block(s) to free {_ev(m)(ns)} source block(s)",
             z3.Or(ns < 1, nd >= ns)),
            (lambda m: f"the plan takes {_ev(m)(nd)} destination blocks, over the budget {_ev(m)(model.budget)}",
             nd > model.budget)]


def v_dst_capacity(model: CompactModel) -> list[Violation]:
    plan, S = model.plan(), model.snap.S
    nd, T = plan.num_dst, plan.num_moves
    out: list[Violation] = [(lambda m: f"{_ev(m)(T)} moves but {_ev(m)(nd)} destination blocks of {_ev(m)(S)} "
                             f"slots (want ceil({_ev(m)(T)}/{_ev(m)(S)}))", z3.Not(_ceil_div(nd, T, S)))]
    for mv in plan.each_move():
        bad = z3.And(mv.guard, z3.Or(mv.dst_offset < 0, mv.dst_offset >= S, z3.Not(model.in_dst(mv.dst_block))))
        out.append((lambda m, mv=mv: f"{_mv(m, mv)}: not a slot of the plan's destination blocks of {_ev(m)(S)} "
                    f"slots", bad))
    return out


def v_injective(model: CompactModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = [_same_dst(a, b) for a, b in plan.each_pair()]
    for g, b in plan.each_dst():
        out.append((lambda m, b=b: f"destination block {_ev(m)(b)} is in the request's block list",
                    z3.And(g, s.listed(b))))
    for (g1, b1), (g2, b2) in plan.each_dst_pair():
        out.append((lambda m, b=b1: f"destination block {_ev(m)(b)} is twice in the plan", z3.And(g1, g2, b1 == b2)))
    return out


def v_live_sources(model: CompactModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = []
    for mv in plan.each_move():
        out.append(_reads_live_slot(s, mv))
        out.append((lambda m, mv=mv: f"{_mv(m, mv)}: reads a block that is not a source of the plan",
                    z3.And(mv.guard, z3.Not(plan.is_src(mv.src_block)))))
    out += [_same_token(a, b) for a, b in plan.each_pair()]
    for i, o in s.each_slot():
        b = s.block_id(i)
        out.append((lambda m, i=i, o=o, b=b: f"live token t{_ev(m)(s.token_at(i, o))} in source block {_ev(m)(b)} "
                    f"(offset {_ev(m)(o)}) is not moved, so the block cannot be freed",
                    z3.And(s.live_at(i, o), plan.is_src(b), plan.not_moved(i, o))))
    return out


def v_eligible_sources(model: CompactModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    out: list[Violation] = [(lambda m: f"{_ev(m)(plan.num_src)} source blocks, over "
                             f"max_sources={_ev(m)(model.max_sources)}", plan.num_src > model.max_sources)]
    for g, b, _ in plan.each_src():
        idx = s.index_of(b)
        bad = z3.And(g, z3.Or(z3.Not(s.listed(b)), s.is_shared(b), idx * s.S + s.S > s.w))
        out.append((lambda m, b=b, idx=idx: f"source block {_ev(m)(b)} (list index {_ev(m)(idx)}) is unlisted, "
                    f"shared, or not wholly before the cursor {_ev(m)(s.w)}: the append block or later", bad))
    return out


def v_logical_order(model: CompactModel) -> list[Violation]:
    plan, S = model.plan(), model.snap.S

    def seq(mv: ZMove) -> z3.ArithRef:  # place in the destination sequence: index in dst_blocks * S + offset
        return model.reserved_index(mv.dst_block) * S + mv.dst_offset

    out: list[Violation] = []
    for a, b in plan.each_pair():
        for x, y in ((a, b), (b, a)):
            out.append((lambda m, x=x, y=y: f"logical order lost: t{_ev(m)(x.token)} < t{_ev(m)(y.token)} but "
                        f"{_mv(m, x)} lands at or after {_mv(m, y)}",
                        z3.And(x.guard, y.guard, x.token < y.token, seq(x) >= seq(y))))
    return out


def _increasing(plan: ZPlan) -> list[Violation]:
    """Consecutive moves have strictly increasing tokens and destination positions: no token is moved twice
    and no two moves share a destination (pairwise, by transitivity)."""
    s, out = plan.snap, []
    for a, b in plan.each_consecutive():
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
    for i, o in s.each_slot():
        out.append((lambda m, i=i, o=o: f"live token t{_ev(m)(s.token_at(i, o))} at position {_ev(m)(s.pos(i, o))} "
                    f">= n_live={_ev(m)(n)} is not moved", z3.And(s.live_at(i, o), s.pos(i, o) >= n,
                                                                  plan.not_moved(i, o))))
    for mv in plan.each_move():
        dpos = s.position_of(mv.dst_block, mv.dst_offset)
        out.append((lambda m, mv=mv, dpos=dpos: f"{_mv(m, mv)} lands at position {_ev(m)(dpos)}, not below "
                    f"n_live={_ev(m)(n)} (-1 = not a slot of the request)",
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
    for mv in plan.each_move():
        dpos, spos = s.position_of(mv.dst_block, mv.dst_offset), s.position_of(mv.src_block, mv.src_offset)
        src_above = z3.And(s.is_slot(mv.src_block, mv.src_offset), s.raw_position(mv.src_block, mv.src_offset) >= n)
        out.append((lambda m, mv=mv, dpos=dpos, spos=spos: f"{_mv(m, mv)}: destination position {_ev(m)(dpos)} "
                    f"and source position {_ev(m)(spos)} are not on either side of n_live={_ev(m)(n)} "
                    f"(so a destination may be another move's source; -1 = not a slot)",
                    z3.And(mv.guard, z3.Not(z3.And(s.slot_before(mv.dst_block, mv.dst_offset, n), src_above)))))
    return out + _increasing(plan)


def v_freed_blocks(model: DensifyModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    S, n = s.S, s.n_live
    out: list[Violation] = []
    for g, b, i in plan.each_src():
        want = z3.And(i < s.nb, i * S >= n, i * S < s.w)  # entry i starts at or after n_live and before the cursor
        out.append((lambda m, i=i, b=b, g=g: f"block {_ev(m)(b)} (index {_ev(m)(i)}) released={_ev(m)(g)}, but it "
                    f"starts at {_ev(m)(i * S)}, against [n_live={_ev(m)(n)}, cursor={_ev(m)(s.w)})", g != want))
        out.append((lambda m, b=b: f"released block {_ev(m)(b)} is shared", z3.And(g, s.shared_at(i))))
        for _, o in s.each_slot_of(i):
            out.append((lambda m, i=i, o=o, b=b: f"released block {_ev(m)(b)} keeps live token "
                        f"t{_ev(m)(s.token_at(i, o))} (offset {_ev(m)(o)}): no move takes it out",
                        z3.And(g, s.live_at(i, o), plan.not_moved(i, o))))
        for mv in plan.each_move():
            out.append((lambda m, mv=mv, b=b: f"{_mv(m, mv)} writes released block {_ev(m)(b)}",
                        z3.And(g, mv.guard, mv.dst_block == b)))
    return out


def v_densify_moves(model: DensifyModel) -> list[Violation]:
    plan, s = model.plan(), model.snap
    n = s.n_live
    out: list[Violation] = []
    for mv in plan.each_move():
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
    for g, b, i in plan.each_src():
        out.append((lambda m, b=b: f"releases shared block {_ev(m)(b)}", z3.And(g, s.shared_at(i))))
    for i in s.each_entry():
        b = s.block_id(i)
        mid_block = z3.And(i < s.nb, i * s.S < n, n < i * s.S + s.S)  # n_live lies inside entry i
        out.append((lambda m, b=b: f"the new cursor n_live={_ev(m)(n)} lies inside shared block {_ev(m)(b)}, whose "
                    f"tail the next appends write", z3.And(mid_block, s.shared_at(i))))
    return out


# ---- the parametric proof ------------------------------------------------------------------------------------
def instances(model: PlannerModel, rounds: int = INSTANCE_ROUNDS) -> dict[str, list[tuple]]:
    """The index terms the parametric proof instantiates the templates at: the properties' seeds, then, for
    ``rounds`` rounds, the successors of what was reached (a move's slots, a slot's entry and its moves)."""
    seen: dict[str, dict[tuple, tuple]] = {k: {} for k in (ENTRY, SLOT, MOVE, RESERVED)}
    frontier = list(model.snap.seeds)
    for depth in range(rounds + 1):
        nxt = []
        for kind, idx in frontier:
            key = tuple(z3.simplify(x).get_id() for x in idx)
            if key in seen[kind]:
                continue
            seen[kind][key] = idx
            if depth < rounds:
                nxt += model.successors(kind, *idx)
        frontier = nxt
    return {k: list(v.values()) for k, v in seen.items()}


def _increasing_claim(f, n, a, b) -> z3.BoolRef:
    return z3.Implies(z3.And(0 <= a, a < b, b < n), f(a) < f(b))


def increasing_lemma(model: PlannerModel, name: str, f, n) -> Outcome:
    """Prove "0 <= a < b < n implies f(a) < f(b)" by induction on b from the move template: the base
    b = a + 1 from the template at a, the step b -> b + 1 from the claim at b and the template at b."""
    a, b = z3.Ints("induction_a induction_b")
    base = z3.Implies(z3.And(model.facts(), model.template(MOVE, a)), _increasing_claim(f, n, a, a + 1))
    step = z3.Implies(z3.And(model.facts(), b >= a + 1, _increasing_claim(f, n, a, b), model.template(MOVE, b)),
                      _increasing_claim(f, n, a, b + 1))
    for part, claim in (("base", base), ("step", step)):
        out = prove(claim, timeout_ms=TIMEOUT_MS)
        if out.status != PROVED:
            return Outcome(out.status, f"the induction {part} for '{name} increase pairwise' fails: {out.detail[:300]}")
    return Outcome(PROVED)


def parametric_premise(model: PlannerModel) -> tuple[z3.BoolRef, int, list[str]]:
    """The templates at ``instances`` (call after building the violations: they seed the instances), the
    pairwise increase lemmas that their induction proves, and the ranges of the properties' variables.
    Returns (premise, number of template instances, the lemmas used)."""
    inst = instances(model)
    parts = [model.facts(), model.gate_facts(), *model.snap.domain]
    for kind, idxs in inst.items():
        parts += [z3.And(model.template(kind, *idx), model.gate_template(kind, *idx)) for idx in idxs]
    used = []
    moves = [j for (j,) in inst[MOVE]]
    for name, f, n in model.increasing():
        if len(moves) > 1 and increasing_lemma(model, name, f, n).status == PROVED:
            used.append(name)
            parts += [_increasing_claim(f, n, a, b) for a in moves for b in moves if a is not b]
    return z3.And(parts), sum(len(v) for v in inst.values()), used


def prove_parametric(factory: Callable[[Bound | None], PlannerModel], prop: Callable) -> tuple[Outcome, str]:
    """Prove ``prop`` for every S and block count. Returns the outcome and a line on what the proof used."""
    model = factory(None)
    violations = prop(model)
    premise, n, lemmas = parametric_premise(model)
    claim = z3.Implies(premise, z3.Not(z3.Or([v for _, v in violations])))
    out = prove(claim, timeout_ms=TIMEOUT_MS)
    used = f"{len(violations)} violation templates, {n} template instances" + (
        f", the pairwise increase of {', '.join(lemmas)} (by induction)" if lemmas else "")
    return out, used


# ---- the bounded model: counterexamples, non-vacuity -------------------------------------------------------------
def describe(model: PlannerModel, m: z3.ModelRef) -> str:
    """The snapshot and the plan of a z3 model of the bounded model, in the project's terms."""
    s, ev = model.snap, _ev(m)
    S, nb, w = s.bound.block_size, ev(s.nb), ev(s.w)
    plan = model.plan()
    lines = [f"snapshot: S={S}, blocks={[ev(s.block_id(i)) for i in range(nb)]}, write_pos={w} (block index "
             f"{w // S}, offset {w % S}), num_live={ev(s.n_live)}, "
             f"shared_blocks={sorted(ev(s.block_id(i)) for i in range(nb) if ev(s.shared_at(i)))}"]
    for i in range(nb):
        toks = [f"{o}:t{ev(s.token_at(i, o))}" for o in range(S) if ev(s.live_at(i, o))]
        lines.append(f"  block {ev(s.block_id(i))} (index {i}): live {{{', '.join(toks)}}}")
    lines.append(f"{model.describe_params(m)} -> " + ("Plan" if ev(plan.exists) else "NoPlan"))
    lines.append(f"  src_blocks={[ev(b) for g, b in plan.src_blocks if ev(g)]}"
                 + (f", dst_blocks={[ev(b) for g, b in plan.dst_blocks if ev(g)]}" if plan.dst else "")
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

    The default tactic preprocesses the bounded model's counting constraints into bit-level circuits on
    which the solver takes minutes; the SMT core answers in milliseconds. The global parameter is
    restored on exit.
    """
    saved = {k: z3.get_param(k) for k in _SMT_PARAMS}
    z3.set_param(**_SMT_PARAMS)
    try:
        yield
    finally:
        z3.set_param(**saved)


ModelFactory = Callable[[Bound | None], PlannerModel]
PropertyFn = Callable[[PlannerModel], list[Violation]]


def search(factory: ModelFactory, prop: PropertyFn, bound: Bound) -> Outcome:
    """Look for a plan of the bounded model that violates ``prop``: COUNTEREXAMPLE (explained), or PROVED
    meaning "none within ``bound``"."""
    model = factory(bound)
    violations = prop(model)
    claim = z3.Implies(z3.And(model.planned(), model.plan().exists), z3.Not(z3.Or([v for _, v in violations])))
    with smt_core():
        return prove(claim, timeout_ms=TIMEOUT_MS, explain=make_explain(model, violations))


@lru_cache(maxsize=None)
def makes_plans(factory: ModelFactory, bound: Bound) -> bool | None:
    """Does the bounded planner model make any plan at all? (If not, a proof about it says nothing.)"""
    model = factory(bound)
    solver = z3.SimpleSolver()
    solver.set("timeout", TIMEOUT_MS)
    solver.add(model.planned(), model.plan().exists)
    r = solver.check()
    return None if r == z3.unknown else r == z3.sat


def check_property(factory: ModelFactory, prop: PropertyFn, search_bounds: Iterable[Bound] = SEARCH_BOUNDS,
                   witness: Bound = WITNESS_BOUND) -> Outcome:
    """Prove ``prop`` for every S and block count; if that fails, find a concrete counterexample in the bounded
    model; if the proof holds, check that the model makes plans (within ``witness``)."""
    t0 = time.perf_counter()
    out, used = prove_parametric(factory, prop)
    if out.status != PROVED:
        for bound in search_bounds:
            found = search(factory, prop, bound)
            if found.status == COUNTEREXAMPLE:
                return Outcome(COUNTEREXAMPLE, f"[{bound}] {found.detail}")
        why = f"the parametric proof is {out.status} ({out.detail[:300]})"
        if not any(makes_plans(factory, b) for b in search_bounds):
            return Outcome(UNKNOWN, f"{why}; vacuous: the {factory(Bound(1, 1)).kind} model makes no plan at all "
                           f"within {bounds_text(search_bounds)}")
        return Outcome(UNKNOWN, f"{why}; no counterexample within {bounds_text(search_bounds)}")
    nonvacuous = makes_plans(factory, witness)
    if not nonvacuous:
        kind = factory(Bound(1, 1)).kind
        return Outcome(UNKNOWN, f"vacuous: the {kind} model makes no plan at all at {witness}" if nonvacuous is False
                       else f"could not decide whether the {kind} model makes a plan at {witness}")
    return Outcome(PROVED, f"every S >= 1 and block count ({used}; {time.perf_counter() - t0:.2f} s); the model "
                   f"makes plans at {witness}")


@dataclass(frozen=True)
class Property:
    id: str
    invariant: str
    planner: str  # "compact" or "densify"
    claim: str
    violations: PropertyFn


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
             v_no_chain),
    Property("I7/densify/freed-blocks", "I7", "densify",
             "densify releases exactly the blocks starting in [n_live, cursor), none shared, and none holds a live "
             "token after the moves", v_freed_blocks),
    Property("I4/densify/moves", "I4", "densify",
             "every densify move reads its live token's own slot and writes a free slot below n_live and the "
             "cursor; no block it reads, writes or releases is shared, nor the block the new cursor lies inside",
             v_densify_moves),
)

MODELS: dict[str, type] = {"compact": CompactModel, "densify": DensifyModel}


def property_by_id(pid: str) -> Property:
    return next(p for p in PROPERTIES if p.id == pid)


def obligation(prop: Property, model_cls: type | None = None, bounds: tuple[Bound, ...] = SEARCH_BOUNDS) -> Obligation:
    """The obligation for ``prop`` over ``model_cls`` (default: the faithful model; tests pass planted variants).
    ``bounds``: where a failed proof looks for a counterexample."""
    cls = model_cls or MODELS[prop.planner]

    def check() -> Outcome:
        return check_property(cls, prop.violations, bounds)

    how = ("for every set of eligible sources that passes the gate (the code's greedy choice is one of them)"
           if prop.planner == "compact" else
           "for every map of movers to holes increasing from logical to position order (the code's zip is one)")
    claim = f"{prop.claim}; for every block size S >= 1 and every number of blocks, {how}"
    return Obligation(prop.id, prop.invariant, f"planner {prop.planner}, parametric in S", claim, check)


def obligations() -> list[Obligation]:
    return [obligation(p) for p in PROPERTIES]
