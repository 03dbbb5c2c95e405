"""Inductive proofs: every transition of the token tables and the pool preserves I1, I2 and the pool invariants.

The state is symbolic and unbounded: any number of requests, tokens per
request and blocks (N) in the pool, any block size (S). Slots are modelled as
(block, offset) pairs, so no multiplication appears and the logic stays linear.

State (per step):
  ref[b], free[b]              pool ref counts and free flags
  nb[r], lst[r][i]             request r's block list (index i < nb[r])
  mem[r][b], pos[r][b]         b is in r's list, at index pos[r][b]
  wi[r], wo[r]                 the append cursor (block index, offset)
  len[r], live[r][t]           synced tokens and liveness
  ix[r][t], off[r][t]          a live token's slot: block lst[r][ix], offset off
  C[b][o]                      the content tag stored in slot (b, o)
  E[r][t]                      the tag token t of r must read back (I1)

Invariants (docs/spec.md): P1 (free iff ref 0), PL (listed blocks are
allocated, distinct, in range, indexed by pos), I2 (a live token's slot is in
its list, before the cursor, and unique within the request), SH (a block in
two requests' lists lies before both cursors: appends never write a shared
block), I1 (each live token's slot holds its tag).

Each obligation is Inv ∧ Pre ∧ Tr ⇒ Inv_k' for one transition and one
invariant group k, with the universally quantified conclusion instantiated at
fresh witnesses, so a counterexample names the request, token and block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import z3

from .obligations import COUNTEREXAMPLE, PROVED, UNKNOWN, Obligation, Outcome, prove

I = z3.IntSort()
B = z3.BoolSort()
A2I = z3.ArraySort(I, z3.ArraySort(I, I))
A2B = z3.ArraySort(I, z3.ArraySort(I, B))


@dataclass
class State:
    ref: z3.ArrayRef
    free: z3.ArrayRef
    nb: z3.ArrayRef
    lst: z3.ArrayRef
    mem: z3.ArrayRef
    pos: z3.ArrayRef
    wi: z3.ArrayRef
    wo: z3.ArrayRef
    len: z3.ArrayRef
    live: z3.ArrayRef
    ix: z3.ArrayRef
    off: z3.ArrayRef
    C: z3.ArrayRef
    rank: z3.ArrayRef  # ghost: holders of b have distinct ranks in [1, ref[b]], so ref[b] >= #holders

    @staticmethod
    def fresh(tag: str) -> "State":
        a = lambda n, s: z3.Const(f"{n}{tag}", s)  # noqa: E731
        return State(
            ref=a("ref", z3.ArraySort(I, I)), free=a("free", z3.ArraySort(I, B)), nb=a("nb", z3.ArraySort(I, I)),
            lst=a("lst", A2I), mem=a("mem", A2B), pos=a("pos", A2I), wi=a("wi", z3.ArraySort(I, I)),
            wo=a("wo", z3.ArraySort(I, I)), len=a("len", z3.ArraySort(I, I)), live=a("live", A2B),
            ix=a("ix", A2I), off=a("off", A2I), C=a("C", A2I), rank=a("rank", A2I),
        )

    def slot_block(self, r, t):
        return self.lst[r][self.ix[r][t]]

    def same_as(self, other: "State") -> z3.BoolRef:
        """The z3 formula saying every component equals the other's (never Python ``==``: that is structural)."""
        return z3.And([getattr(self, k) == getattr(other, k) for k in self.__dataclass_fields__])

    def replace(self, **kw) -> "State":
        d = dict(self.__dict__)
        d.update(kw)
        return State(**d)


N, S = z3.Ints("N S")
E = z3.Array("E", I, z3.ArraySort(I, I))  # expected tags: fixed for the whole run


def before_cursor(s: State, r, i, o):
    return z3.Or(i < s.wi[r], z3.And(i == s.wi[r], o < s.wo[r]))


# ---- invariant groups, as functions of a state and witnesses ---------------------------------------------
def inv_p1(s: State, b):
    """P1: within the pool, a block is free iff its ref count is 0; counts are never negative."""
    return z3.Implies(z3.And(0 <= b, b < N), z3.And(s.ref[b] >= 0, s.free[b] == (s.ref[b] == 0)))


def inv_pl(s: State, r, b, i, j):
    """PL: r's list holds distinct allocated in-range blocks, and mem/pos index it exactly."""
    return z3.And(
        s.nb[r] >= 0,
        z3.Implies(z3.And(0 <= i, i < s.nb[r]),
                   z3.And(0 <= s.lst[r][i], s.lst[r][i] < N, s.mem[r][s.lst[r][i]], s.pos[r][s.lst[r][i]] == i)),
        z3.Implies(s.mem[r][b], z3.And(0 <= s.pos[r][b], s.pos[r][b] < s.nb[r], s.lst[r][s.pos[r][b]] == b,
                                       s.ref[b] >= 1)),
        z3.Implies(z3.And(0 <= i, i < j, j < s.nb[r]), s.lst[r][i] != s.lst[r][j]),
        0 <= s.wi[r], 0 <= s.wo[r], s.wo[r] < S, s.wi[r] <= s.nb[r], s.len[r] >= 0,
    )


def inv_rc(s: State, r, q, b):
    """RC: each request listing b holds a distinct rank in [1, ref[b]]: ref[b] counts at least its holders."""
    return z3.And(
        z3.Implies(s.mem[r][b], z3.And(1 <= s.rank[r][b], s.rank[r][b] <= s.ref[b])),
        z3.Implies(z3.And(r != q, s.mem[r][b], s.mem[q][b]), s.rank[r][b] != s.rank[q][b]),
    )


def inv_i2(s: State, r, t, u):
    """I2: a live token maps into its list, before the cursor, and no two live tokens share a slot."""
    wf = z3.Implies(
        z3.And(0 <= t, t < s.len[r], s.live[r][t]),
        z3.And(0 <= s.ix[r][t], s.ix[r][t] < s.nb[r], 0 <= s.off[r][t], s.off[r][t] < S,
               before_cursor(s, r, s.ix[r][t], s.off[r][t])),
    )
    unique = z3.Implies(
        z3.And(0 <= t, t < s.len[r], 0 <= u, u < s.len[r], t != u, s.live[r][t], s.live[r][u]),
        z3.Or(s.ix[r][t] != s.ix[r][u], s.off[r][t] != s.off[r][u]),
    )
    dead_beyond = z3.Implies(z3.Or(t < 0, t >= s.len[r]), z3.Not(s.live[r][t]))
    return z3.And(wf, unique, dead_beyond)


def inv_sh(s: State, r, q, b):
    """SH: a block in two requests' lists lies wholly before both cursors' blocks."""
    return z3.Implies(z3.And(r != q, s.mem[r][b], s.mem[q][b]),
                      z3.And(s.pos[r][b] < s.wi[r], s.pos[q][b] < s.wi[q]))


def inv_i1(s: State, r, t):
    """I1: every live token's slot holds its own tag."""
    return z3.Implies(z3.And(0 <= t, t < s.len[r], s.live[r][t]),
                      s.C[s.slot_block(r, t)][s.off[r][t]] == E[r][t])


def inv_all(s: State):
    r, q, t, u, b, i, j = z3.Ints("qr qq qt qu qb qi qj")
    return z3.And(
        N >= 1, S >= 1,
        z3.ForAll([b], inv_p1(s, b)),
        z3.ForAll([r, b, i, j], inv_pl(s, r, b, i, j)),
        z3.ForAll([r, t, u], inv_i2(s, r, t, u)),
        z3.ForAll([r, q, b], inv_sh(s, r, q, b)),
        z3.ForAll([r, q, b], inv_rc(s, r, q, b)),
        z3.ForAll([r, t], inv_i1(s, r, t)),
        # cross-request: a live token's slot in a block shared with q is q's same-content token (prefix sharing)
        z3.ForAll([r, q, t, u], z3.Implies(
            z3.And(r != q, 0 <= t, t < s.len[r], s.live[r][t], 0 <= u, u < s.len[q], s.live[q][u],
                   s.slot_block(r, t) == s.slot_block(q, u), s.off[r][t] == s.off[q][u]),
            E[r][t] == E[q][u])),
    )


def init_state(s: State):
    r, b = z3.Ints("ir ib")
    return z3.And(
        N >= 1, S >= 1,
        z3.ForAll([b], z3.And(s.ref[b] == 0, s.free[b])),
        z3.ForAll([r], z3.And(s.nb[r] == 0, s.len[r] == 0, s.wi[r] == 0, s.wo[r] == 0)),
        z3.ForAll([r, b], z3.And(z3.Not(s.mem[r][b]), z3.Not(s.live[r][b]))),
    )


# ---- transitions: (precondition, relation) on (s, s2) with parameters ---------------------------------------
def tr_allocate_block(s: State, s2: State, r, b):
    """T1 allocate + sync's block append: a free block joins the end of r's list with ref count 1."""
    pre = z3.And(0 <= b, b < N, s.free[b])
    post = s2.same_as(s.replace(
        ref=z3.Store(s.ref, b, 1), free=z3.Store(s.free, b, False),
        lst=z3.Store(s.lst, r, z3.Store(s.lst[r], s.nb[r], b)), nb=z3.Store(s.nb, r, s.nb[r] + 1),
        mem=z3.Store(s.mem, r, z3.Store(s.mem[r], b, True)), pos=z3.Store(s.pos, r, z3.Store(s.pos[r], b, s.nb[r])),
        rank=z3.Store(s.rank, r, z3.Store(s.rank[r], b, 1)),
    ))
    return pre, post


def tr_append_token(s: State, s2: State, r):
    """T2 sync_new_tokens + the forward's write: one token at the cursor, its tag written there."""
    t = s.len[r]
    b = s.lst[r][s.wi[r]]
    wrap = s.wo[r] + 1 == S
    pre = s.wi[r] < s.nb[r]  # the list is long enough (BlockListTooShortError otherwise)
    post = s2.same_as(s.replace(
        len=z3.Store(s.len, r, t + 1), live=z3.Store(s.live, r, z3.Store(s.live[r], t, True)),
        ix=z3.Store(s.ix, r, z3.Store(s.ix[r], t, s.wi[r])), off=z3.Store(s.off, r, z3.Store(s.off[r], t, s.wo[r])),
        wi=z3.Store(s.wi, r, z3.If(wrap, s.wi[r] + 1, s.wi[r])), wo=z3.Store(s.wo, r, z3.If(wrap, 0, s.wo[r] + 1)),
        C=z3.Store(s.C, b, z3.Store(s.C[b], s.wo[r], E[r][t])),
    ))
    return pre, post


def tr_evict(s: State, s2: State, r, t):
    """T3 evict_token: metadata only."""
    pre = z3.And(0 <= t, t < s.len[r], s.live[r][t])
    post = s2.same_as(s.replace(live=z3.Store(s.live, r, z3.Store(s.live[r], t, False))))
    return pre, post


def tr_move(s: State, s2: State, r, t, i, o, holders_free):
    """T4 copy completes + apply_moves (one move): t's K/V is copied to (lst[r][i], o), then the table points there.

    Precondition as the table checks it: t live; the destination is in r's list,
    before the cursor, and no live token of any request occupies it
    (``holders_free``: the pool-wide occupancy count is 0).
    """
    src_b, src_o = s.slot_block(r, t), s.off[r][t]
    dst_b = s.lst[r][i]
    pre = z3.And(0 <= t, t < s.len[r], s.live[r][t], 0 <= i, i < s.nb[r], 0 <= o, o < S,
                 before_cursor(s, r, i, o), holders_free(dst_b, o))
    post = s2.same_as(s.replace(
        ix=z3.Store(s.ix, r, z3.Store(s.ix[r], t, i)), off=z3.Store(s.off, r, z3.Store(s.off[r], t, o)),
        C=z3.Store(s.C, dst_b, z3.Store(s.C[dst_b], o, s.C[src_b][src_o])),
    ))
    return pre, post


def tr_drop_block(s: State, s2: State, r, p):
    """T5 commit's set_layout + free: an emptied block at index p < cursor block leaves r's list, one ref dropped."""
    b = s.lst[r][p]
    k, q = z3.Ints("dk dq")
    shift = lambda j: z3.If(j >= p, j - 1, j)  # noqa: E731
    ok_empty = z3.ForAll([k], z3.Implies(z3.And(0 <= k, k < s.len[r], s.live[r][k]), s.ix[r][k] != p))
    pre = z3.And(0 <= p, p < s.wi[r], ok_empty)
    newlst = z3.Lambda([q], z3.If(q >= p, s.lst[r][q + 1], s.lst[r][q]))
    newpos = z3.Lambda([q], shift(s.pos[r][q]))
    newix = z3.Lambda([q], shift(s.ix[r][q]))
    post = s2.same_as(s.replace(
        lst=z3.Store(s.lst, r, newlst), nb=z3.Store(s.nb, r, s.nb[r] - 1),
        mem=z3.Store(s.mem, r, z3.Store(s.mem[r], b, False)), pos=z3.Store(s.pos, r, newpos),
        ix=z3.Store(s.ix, r, newix), wi=z3.Store(s.wi, r, s.wi[r] - 1),
        ref=z3.Store(s.ref, b, s.ref[b] - 1), free=z3.Store(s.free, b, s.ref[b] == 1),
        rank=z3.Lambda([q], z3.Store(s.rank[q], b, z3.If(s.rank[q][b] == s.ref[b], s.rank[r][b], s.rank[q][b]))),
    ))
    return pre, post


def tr_attach_block(s: State, s2: State, r, p, b):
    """T6 commit attaches a fresh destination block at index p <= cursor block (cursor shifts by one block)."""
    q = z3.Int("aq")
    shift = lambda j: z3.If(j >= p, j + 1, j)  # noqa: E731
    pre = z3.And(0 <= p, p <= s.wi[r], 0 <= b, b < N, s.free[b])
    newlst = z3.Lambda([q], z3.If(q == p, b, z3.If(q > p, s.lst[r][q - 1], s.lst[r][q])))
    post = s2.same_as(s.replace(
        lst=z3.Store(s.lst, r, newlst), nb=z3.Store(s.nb, r, s.nb[r] + 1),
        mem=z3.Store(s.mem, r, z3.Store(s.mem[r], b, True)),
        pos=z3.Store(s.pos, r, z3.Store(z3.Lambda([q], shift(s.pos[r][q])), b, p)),
        ix=z3.Store(s.ix, r, z3.Lambda([q], shift(s.ix[r][q]))), wi=z3.Store(s.wi, r, s.wi[r] + 1),
        ref=z3.Store(s.ref, b, 1), free=z3.Store(s.free, b, False),
        rank=z3.Store(s.rank, r, z3.Store(s.rank[r], b, 1)),
    ))
    return pre, post


def tr_finish(s: State, s2: State, r):
    """T7 finish / preemption: r's table is emptied; each block it lists loses one reference."""
    b, q = z3.Ints("fb fq")
    pre = z3.BoolVal(True)
    post = s2.same_as(s.replace(
        ref=z3.Lambda([b], z3.If(s.mem[r][b], s.ref[b] - 1, s.ref[b])),
        free=z3.Lambda([b], z3.Or(s.free[b], z3.And(s.mem[r][b], s.ref[b] == 1))),
        mem=z3.Store(s.mem, r, z3.K(I, z3.BoolVal(False))), nb=z3.Store(s.nb, r, 0),
        len=z3.Store(s.len, r, 0), live=z3.Store(s.live, r, z3.K(I, z3.BoolVal(False))),
        wi=z3.Store(s.wi, r, 0), wo=z3.Store(s.wo, r, 0),
        rank=z3.Lambda([q], z3.Lambda([b], z3.If(z3.And(s.mem[r][b], s.rank[q][b] == s.ref[b]),
                                                 s.rank[r][b], s.rank[q][b]))),
    ))
    return pre, post


def tr_share_first_block(s: State, s2: State, r, q):
    """T8 admit with a shared prefix: an empty request q takes r's first block, all S tokens live in place."""
    b = s.lst[r][0]
    k = z3.Int("sk")
    full = z3.ForAll([k], z3.Implies(z3.And(0 <= k, k < S),
                                     z3.And(k < s.len[r], s.live[r][k], s.ix[r][k] == 0, s.off[r][k] == k)))
    pre = z3.And(r != q, s.nb[r] >= 1, s.wi[r] >= 1, full, s.nb[q] == 0, s.len[q] == 0,
                 s.wi[q] == 0, s.wo[q] == 0,
                 z3.ForAll([k], z3.And(z3.Not(s.mem[q][k]), z3.Not(s.live[q][k]))),
                 z3.ForAll([k], z3.Implies(z3.And(0 <= k, k < S), E[q][k] == E[r][k])))  # same prefix content
    post = s2.same_as(s.replace(
        ref=z3.Store(s.ref, b, s.ref[b] + 1),
        lst=z3.Store(s.lst, q, z3.Store(s.lst[q], 0, b)), nb=z3.Store(s.nb, q, 1),
        mem=z3.Store(s.mem, q, z3.Store(s.mem[q], b, True)), pos=z3.Store(s.pos, q, z3.Store(s.pos[q], b, 0)),
        len=z3.Store(s.len, q, S), live=z3.Store(s.live, q, z3.Lambda([k], z3.And(0 <= k, k < S))),
        ix=z3.Store(s.ix, q, z3.K(I, z3.IntVal(0))), off=z3.Store(s.off, q, z3.Lambda([k], k)),
        wi=z3.Store(s.wi, q, 1), wo=z3.Store(s.wo, q, 0),
        rank=z3.Store(s.rank, q, z3.Store(s.rank[q], b, s.ref[b] + 1)),
    ))
    return pre, post


# ---- obligations -------------------------------------------------------------------------------------------
def _holders_free(s: State):
    """No live token of any request occupies (b, o)."""
    def free(b, o):
        r, t = z3.Ints("hr ht")
        return z3.ForAll([r, t], z3.Implies(
            z3.And(0 <= t, t < s.len[r], s.live[r][t]), z3.Or(s.slot_block(r, t) != b, s.off[r][t] != o)))
    return free


def _transitions(s: State, s2: State):
    r, q, t, i, o, b, p = z3.Ints("xr xq xt xi xo xb xp")
    params = {"r": r, "q": q, "t": t, "i": i, "o": o, "b": b, "p": p}
    return params, {
        "T1 allocate block": tr_allocate_block(s, s2, r, b),
        "T2 sync_new_tokens": tr_append_token(s, s2, r),
        "T3 evict_token": tr_evict(s, s2, r, t),
        "T4 copy + apply_moves": tr_move(s, s2, r, t, i, o, _holders_free(s)),
        "T5 commit drops a source": tr_drop_block(s, s2, r, p),
        "T6 commit attaches a destination": tr_attach_block(s, s2, r, p, b),
        "T7 finish / preempt": tr_finish(s, s2, r),
        "T8 admit sharing a prefix block": tr_share_first_block(s, s2, r, q),
    }


_WITNESS = z3.Ints("wr wq wt wu wb wi wj")


def _goals(s2: State):
    r, q, t, u, b, i, j = _WITNESS
    return {
        "P1": inv_p1(s2, b),
        "PL": inv_pl(s2, r, b, i, j),
        "I2": inv_i2(s2, r, t, u),
        "SH": inv_sh(s2, r, q, b),
        "RC": inv_rc(s2, r, q, b),
        "I1": inv_i1(s2, r, t),
    }


def _explain(transition: str, params: dict, s: State, s2: State) -> Callable[[z3.ModelRef], str]:
    r, q, t, u, b, i, j = _WITNESS

    def explain(m: z3.ModelRef) -> str:
        ev = lambda x: m.eval(x, model_completion=True)  # noqa: E731
        lines = [f"after {transition} with " + ", ".join(f"{k}={ev(v)}" for k, v in params.items()),
                 f"  pool N={ev(N)}, block size S={ev(S)}",
                 f"  request {ev(r)}: blocks nb={ev(s2.nb[r])}, cursor=({ev(s2.wi[r])},{ev(s2.wo[r])}), len={ev(s2.len[r])}"]
        for name, tok in (("t", t), ("u", u)):
            lines.append(f"  token {name}={ev(tok)}: live {ev(s.live[r][tok])} -> {ev(s2.live[r][tok])}, "
                         f"slot (block {ev(s.slot_block(r, tok))}, offset {ev(s.off[r][tok])}) -> "
                         f"(block {ev(s2.slot_block(r, tok))}, offset {ev(s2.off[r][tok])})")
        lines.append(f"  block {ev(b)}: ref {ev(s.ref[b])} -> {ev(s2.ref[b])}, free {ev(s.free[b])} -> {ev(s2.free[b])}")
        return "\n".join(lines)

    return explain


def _arr(default, entries: dict, sort=I):
    a = z3.K(I, default if isinstance(default, z3.ExprRef) else z3.IntVal(default) if sort == I else z3.BoolVal(default))
    for k, v in entries.items():
        a = z3.Store(a, k, v)
    return a


def witness_state(full_first_block: bool) -> tuple[State, dict]:
    """A concrete state (S=2, N=6): request 0 lists blocks [0, 1, 2]; request 1 is empty.

    Tokens of request 0: t0 at (block 0, offset 0), t1 at (0, 1) — dead unless
    ``full_first_block`` —, t2 at (2, 0); block 1 is empty; the cursor is (2, 1).
    """
    live0 = {0: True, 1: full_first_block, 2: True}
    C = _arr(_arr(0, {}), {0: _arr(0, {0: E[0][0], 1: E[0][1]}), 2: _arr(0, {0: E[0][2]})})
    st = State(
        ref=_arr(0, {0: 1, 1: 1, 2: 1}), free=_arr(True, {0: False, 1: False, 2: False}, B),
        nb=_arr(0, {0: 3}), lst=_arr(_arr(0, {}), {0: _arr(0, {0: 0, 1: 1, 2: 2})}),
        mem=_arr(_arr(False, {}, B), {0: _arr(False, {0: True, 1: True, 2: True}, B)}),
        pos=_arr(_arr(0, {}), {0: _arr(0, {0: 0, 1: 1, 2: 2})}),
        wi=_arr(0, {0: 2}), wo=_arr(0, {0: 1}), len=_arr(0, {0: 3}),
        live=_arr(_arr(False, {}, B), {0: _arr(False, live0, B)}),
        ix=_arr(_arr(0, {}), {0: _arr(0, {0: 0, 1: 0, 2: 2})}), off=_arr(_arr(0, {}), {0: _arr(0, {0: 0, 1: 1, 2: 0})}),
        C=C, rank=_arr(_arr(0, {}), {0: _arr(0, {0: 1, 1: 1, 2: 1})}),
    )
    return st, {"N": 6, "S": 2}


#: concrete parameters that enable each transition in the witness state
WITNESS_PARAMS = {
    "T1 allocate block": dict(r=0, b=3),
    "T2 sync_new_tokens": dict(r=0),
    "T3 evict_token": dict(r=0, t=0),
    "T4 copy + apply_moves": dict(r=0, t=0, i=0, o=1),
    "T5 commit drops a source": dict(r=0, p=1),
    "T6 commit attaches a destination": dict(r=0, p=1, b=3),
    "T7 finish / preempt": dict(r=0),
    "T8 admit sharing a prefix block": dict(r=0, q=1),
}


def vacuity_obligation(transition: str, build=_transitions) -> Obligation:
    """Non-vacuity: a concrete state satisfies every invariant and enables the transition."""
    def check() -> Outcome:
        s, consts = witness_state(full_first_block=transition.startswith("T8"))
        s2 = State.fresh("'")
        params, trs = build(s, s2)
        pre, _ = trs[transition]
        fix = [N == consts["N"], S == consts["S"]] + [params[k] == v for k, v in WITNESS_PARAMS[transition].items()]
        fix += [E[1][k] == E[0][k] for k in range(consts["S"])]  # request 1 would share request 0's prefix content
        out = prove(z3.Implies(z3.And(fix), z3.And(inv_all(s), pre)), timeout_ms=30_000)
        if out.status == PROVED:
            return Outcome(PROVED, f"witness: S=2, N=6, {WITNESS_PARAMS[transition]}")
        if out.status == COUNTEREXAMPLE:
            return Outcome(COUNTEREXAMPLE, f"the witness state does not satisfy the invariants or enable {transition}")
        return out

    return Obligation(f"enabled/{transition.split()[0]}", "non-vacuity", transition,
                      f"{transition} is enabled in a concrete state satisfying every invariant", check)


def ground_instances(s: State, params: dict):
    """The invariants instantiated at the witnesses and the transition's parameters.

    Sound to add (they are instances of the universally quantified invariant) and
    they give e-matching the ground terms it needs, turning most obligations from
    timeouts into sub-second proofs.
    """
    wr, wq, wt, wu, wb, wi, wj = _WITNESS
    R = [wr, wq, params["r"], params["q"]]
    T = [wt, wu, params["t"], s.len[params["r"]]]
    Bk = [wb, params["b"]] + [s.slot_block(r, t) for r in R[:2] for t in T[:2]] + [s.lst[params["r"]][params["p"]]]
    Ix = [wi, wj, params["i"], params["p"], params["p"] + 1, wi + 1, wj + 1, wi - 1, wj - 1]
    out = []
    for r in R:
        for b in Bk:
            out.append(inv_p1(s, b))
            for i in Ix[:4]:
                out.append(inv_pl(s, r, b, i, i + 1))
            for q in R:
                out.append(inv_sh(s, r, q, b))
                out.append(inv_rc(s, r, q, b))
        for t in T:
            out.append(inv_i1(s, r, t))
            for u in T:
                out.append(inv_i2(s, r, t, u))
    return z3.And(out)


def witness_search(transition: str, invariant: str, build=_transitions) -> Outcome:
    """Search for a violation from the concrete witness state, over every enabled choice of parameters.

    Quantifiers over a concrete state are cheap for z3, so this finds a
    concrete counterexample within seconds where the symbolic query could
    only time out. A clean result here proves nothing; the symbolic proof does.
    """
    s, consts = witness_state(full_first_block=transition.startswith("T8"))
    s2 = State.fresh("w'")
    params, trs = build(s, s2)
    pre, rel = trs[transition]
    fix = [N == consts["N"], S == consts["S"]] + [E[1][k] == E[0][k] for k in range(consts["S"])]
    out = prove(z3.Implies(z3.And(fix + [pre, rel]), _goals(s2)[invariant]), timeout_ms=20_000,
                explain=_explain(transition, params, s, s2))
    if out.status == COUNTEREXAMPLE:
        return Outcome(COUNTEREXAMPLE, "from the witness state (S=2, N=6):\n" + out.detail)
    return out


def inductive_obligation(transition: str, invariant: str, build=_transitions) -> Obligation:
    def check() -> Outcome:
        quick = witness_search(transition, invariant, build)
        if quick.status == COUNTEREXAMPLE:
            return quick
        s, s2 = State.fresh(""), State.fresh("'")
        params, trs = build(s, s2)
        pre, rel = trs[transition]
        claim = z3.Implies(z3.And(inv_all(s), ground_instances(s, params), pre, rel), _goals(s2)[invariant])
        return prove(claim, timeout_ms=60_000, explain=_explain(transition, params, s, s2))

    return Obligation(f"{invariant}/{transition.split()[0]}", invariant, transition,
                      f"{transition} preserves {invariant} (any number of requests, tokens and blocks, any S)", check)


def init_obligation(invariant: str) -> Obligation:
    def check() -> Outcome:
        s = State.fresh("0")
        return prove(z3.Implies(init_state(s), _goals(s)[invariant]), timeout_ms=30_000)

    return Obligation(f"{invariant}/T0", invariant, "T0 init", f"the empty system satisfies {invariant}", check)


TRANSITIONS = ["T1 allocate block", "T2 sync_new_tokens", "T3 evict_token", "T4 copy + apply_moves",
               "T5 commit drops a source", "T6 commit attaches a destination", "T7 finish / preempt",
               "T8 admit sharing a prefix block"]
INVARIANTS = ["P1", "PL", "RC", "I2", "SH", "I1"]


def obligations() -> list[Obligation]:
    return [init_obligation(k) for k in INVARIANTS] + [vacuity_obligation(tr) for tr in TRANSITIONS] + [
        inductive_obligation(tr, k) for tr in TRANSITIONS for k in INVARIANTS
    ]
