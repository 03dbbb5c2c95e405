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


# ---- batched transitions: what one call of the code does, as the refinement check (spec/refinement.py) sees it --
def lex_lt(i, o, j, p):
    """Position (i, o) (block index, offset) lies before (j, p)."""
    return z3.Or(i < j, z3.And(i == j, o < p))


def lex_le(i, o, j, p):
    return z3.Or(lex_lt(i, o, j, p), z3.And(i == j, o == p))


def successor(i, o, j, p):
    """(j, p) is the position right after (i, o) in blocks of S slots (linear: no multiplication by S)."""
    return z3.If(o + 1 == S, z3.And(j == i + 1, p == 0), z3.And(j == i, p == o + 1))


def live_keep_content(s: State, C2):
    """Every live token's slot holds the same content in ``C2`` as in ``s.C``: a write touched no slot a token reads."""
    p, u = z3.Ints("kp ku")
    return z3.ForAll([p, u], z3.Implies(
        z3.And(0 <= u, u < s.len[p], s.live[p][u]),
        C2[s.slot_block(p, u)][s.off[p][u]] == s.C[s.slot_block(p, u)][s.off[p][u]]))


def tr_sync_batch(s: State, s2: State, r, k, nbk, isnew, at, L, ni, no, wi2, wo2, C2):
    """T2b sync_new_tokens + the forward's writes, batched (T1 k times and T2 L times in one call).

    k free blocks ``nbk[0..k)`` join the end of r's list (``isnew``/``at`` is their inverse: b is new at
    ``at[b]``); tokens len..len+L-1 become live at consecutive positions (``ni``, ``no``) from the cursor, each
    slot receiving the token's tag; the cursor moves to (wi2, wo2), the position after the last. ``C2`` is the
    content after the forward: the new tokens' slots hold their tags and no live token's slot changed.
    Consecutive positions are a successor chain; that they increase (what the proofs need, and no solver
    derives by induction) is stated alongside it, and the refinement check shows the code satisfies both.
    """
    j, b, t, u = z3.Ints("sj sb st su")
    n0, l0 = s.nb[r], s.len[r]
    nb2 = n0 + k
    lst2 = z3.Lambda([j], z3.If(z3.And(n0 <= j, j < nb2), nbk[j - n0], s.lst[r][j]))
    new = lambda x: z3.And(l0 <= x, x < l0 + L)  # noqa: E731
    last = l0 + L - 1
    blocks = z3.And(
        k >= 0,
        z3.ForAll([j], z3.Implies(z3.And(0 <= j, j < k), z3.And(
            0 <= nbk[j], nbk[j] < N, s.free[nbk[j]], isnew[nbk[j]], at[nbk[j]] == j))),
        z3.ForAll([b], z3.Implies(isnew[b], z3.And(0 <= at[b], at[b] < k, nbk[at[b]] == b))),
    )
    tokens = z3.And(
        L >= 0, 0 <= wo2, wo2 < S, wi2 <= nb2,
        z3.If(L == 0, z3.And(wi2 == s.wi[r], wo2 == s.wo[r]), z3.And(ni[l0] == s.wi[r], no[l0] == s.wo[r])),
        z3.ForAll([t], z3.Implies(new(t), z3.And(
            0 <= no[t], no[t] < S, ni[t] < nb2,
            successor(ni[t], no[t], z3.If(t < last, ni[t + 1], wi2), z3.If(t < last, no[t + 1], wo2)),
            lex_le(s.wi[r], s.wo[r], ni[t], no[t]), lex_lt(ni[t], no[t], wi2, wo2)))),
        z3.ForAll([t, u], z3.Implies(z3.And(new(t), new(u), t < u), lex_lt(ni[t], no[t], ni[u], no[u]))),
    )
    writes = z3.And(z3.ForAll([t], z3.Implies(new(t), C2[lst2[ni[t]]][no[t]] == E[r][t])), live_keep_content(s, C2))
    post = s2.same_as(s.replace(
        ref=z3.Lambda([b], z3.If(isnew[b], 1, s.ref[b])), free=z3.Lambda([b], z3.And(s.free[b], z3.Not(isnew[b]))),
        lst=z3.Store(s.lst, r, lst2), nb=z3.Store(s.nb, r, nb2),
        mem=z3.Store(s.mem, r, z3.Lambda([b], z3.Or(s.mem[r][b], isnew[b]))),
        pos=z3.Store(s.pos, r, z3.Lambda([b], z3.If(isnew[b], n0 + at[b], s.pos[r][b]))),
        rank=z3.Store(s.rank, r, z3.Lambda([b], z3.If(isnew[b], 1, s.rank[r][b]))),
        len=z3.Store(s.len, r, l0 + L), live=z3.Store(s.live, r, z3.Lambda([t], z3.Or(s.live[r][t], new(t)))),
        ix=z3.Store(s.ix, r, z3.Lambda([t], z3.If(new(t), ni[t], s.ix[r][t]))),
        off=z3.Store(s.off, r, z3.Lambda([t], z3.If(new(t), no[t], s.off[r][t]))),
        wi=z3.Store(s.wi, r, wi2), wo=z3.Store(s.wo, r, wo2), C=C2,
    ))
    return z3.And(blocks, tokens, writes), post


def tr_move_batch(s: State, s2: State, r, mv, di, do):
    """T4b apply_moves, one batch: every token t with ``mv[t]`` moves to (lst[r][di[t]], do[t]) at once.

    Precondition as commit and the table check it: each moved token is live and its copy has landed (the
    destination already holds the source's content: the copy engine wrote it, transition T9); destinations
    are in r's list, before the cursor, distinct, and unclaimed except by a token of the same batch (a move
    may take a slot another move vacates); no block a move reads or writes is in another request's list
    (I4's shared clause). Only the mapping changes.
    """
    t, u, p = z3.Ints("mt mu mp")
    dst = lambda x: s.lst[r][di[x]]  # noqa: E731
    each = z3.ForAll([t], z3.Implies(mv[t], z3.And(
        0 <= t, t < s.len[r], s.live[r][t], 0 <= di[t], di[t] < s.nb[r], 0 <= do[t], do[t] < S,
        before_cursor(s, r, di[t], do[t]), s.C[dst(t)][do[t]] == s.C[s.slot_block(r, t)][s.off[r][t]])))
    distinct = z3.ForAll([t, u], z3.Implies(z3.And(mv[t], mv[u], t != u), z3.Or(di[t] != di[u], do[t] != do[u])))
    vacant = z3.ForAll([t, p, u], z3.Implies(
        z3.And(mv[t], 0 <= u, u < s.len[p], s.live[p][u], s.slot_block(p, u) == dst(t), s.off[p][u] == do[t]),
        z3.And(p == r, mv[u])))
    unshared = z3.ForAll([t, p], z3.Implies(z3.And(mv[t], p != r), z3.And(
        z3.Not(s.mem[p][s.slot_block(r, t)]), z3.Not(s.mem[p][dst(t)]))))
    post = s2.same_as(s.replace(
        ix=z3.Store(s.ix, r, z3.Lambda([t], z3.If(mv[t], di[t], s.ix[r][t]))),
        off=z3.Store(s.off, r, z3.Lambda([t], z3.If(mv[t], do[t], s.off[r][t]))),
    ))
    return z3.And(each, distinct, vacant, unshared), post


def tr_share_prefix(s: State, s2: State, r, q, k, L):
    """T8b admit sharing k prefix blocks (T8 for any k >= 1): an empty request q takes r's first k blocks.

    As ``VTokenRuntime.admit(share_prefix_of=r, shared_blocks=k)`` checks: the blocks lie before r's cursor
    block, and r's tokens 0..L-1 are live in place (token 0 at (0, 0), each next token at the next position,
    the last followed by (k, 0): L = k·S, stated without multiplication). q gets them live, at the same slots,
    with the same content; each shared block gains a reference.
    """
    t, b = z3.Ints("pt pb")
    shared = lambda x: z3.And(s.mem[r][x], 0 <= s.pos[r][x], s.pos[r][x] < k)  # noqa: E731
    last = L - 1
    in_place = z3.And(
        L >= 1, s.ix[r][0] == 0, s.off[r][0] == 0,
        z3.ForAll([t], z3.Implies(z3.And(0 <= t, t < L), z3.And(
            t < s.len[r], s.live[r][t], 0 <= s.ix[r][t], s.ix[r][t] < k,
            successor(s.ix[r][t], s.off[r][t], z3.If(t < last, s.ix[r][t + 1], k), z3.If(t < last, s.off[r][t + 1], 0)),
            E[q][t] == E[r][t]))),  # same prefix content
    )
    pre = z3.And(r != q, 1 <= k, k <= s.wi[r], in_place, s.nb[q] == 0, s.len[q] == 0, s.wi[q] == 0, s.wo[q] == 0,
                 z3.ForAll([b], z3.And(z3.Not(s.mem[q][b]), z3.Not(s.live[q][b]))))
    post = s2.same_as(s.replace(
        ref=z3.Lambda([b], z3.If(shared(b), s.ref[b] + 1, s.ref[b])),
        lst=z3.Store(s.lst, q, s.lst[r]), nb=z3.Store(s.nb, q, k),
        mem=z3.Store(s.mem, q, z3.Lambda([b], shared(b))), pos=z3.Store(s.pos, q, s.pos[r]),
        len=z3.Store(s.len, q, L), live=z3.Store(s.live, q, z3.Lambda([t], z3.And(0 <= t, t < L))),
        ix=z3.Store(s.ix, q, s.ix[r]), off=z3.Store(s.off, q, s.off[r]),
        wi=z3.Store(s.wi, q, k), wo=z3.Store(s.wo, q, 0),
        rank=z3.Store(s.rank, q, z3.Lambda([b], z3.If(shared(b), s.ref[b] + 1, s.rank[q][b]))),
    ))
    return pre, post


def tr_copy_lands(s: State, s2: State, C2):
    """T9 a copy writes (completes, fails part-way, or is ordered before the next read): content changes only in
    slots no live token reads (I3, I6: destinations are fresh blocks or holes)."""
    return live_keep_content(s, C2), s2.same_as(s.replace(C=C2))


def tr_densify_rewind(s: State, s2: State, r, wi2, wo2):
    """T10 densify's commit, after its moves: the cursor moves back to (wi2, wo2) = n_live, and the blocks written
    beyond it, [keep, written), leave r's list, one reference each; later blocks move down.

    Precondition: no live token of r lies at or after the new cursor (commit's layout check), and no block
    released, nor the new cursor's block (the appends that follow write its tail), is in another request's list.
    """
    t, b, q, j = z3.Ints("dt db dq dj")
    keep = wi2 + z3.If(wo2 > 0, 1, 0)
    written = s.wi[r] + z3.If(s.wo[r] > 0, 1, 0)
    d = written - keep
    drop = lambda x: z3.And(s.mem[r][x], keep <= s.pos[r][x], s.pos[r][x] < written)  # noqa: E731
    pre = z3.And(
        0 <= wi2, 0 <= wo2, wo2 < S, lex_le(wi2, wo2, s.wi[r], s.wo[r]), written <= s.nb[r],
        z3.ForAll([t], z3.Implies(z3.And(0 <= t, t < s.len[r], s.live[r][t]),
                                  lex_lt(s.ix[r][t], s.off[r][t], wi2, wo2))),
        z3.ForAll([q, b], z3.Implies(q != r, z3.And(
            z3.Implies(wo2 > 0, z3.Not(s.mem[q][s.lst[r][wi2]])), z3.Implies(drop(b), z3.Not(s.mem[q][b]))))),
    )
    post = s2.same_as(s.replace(
        lst=z3.Store(s.lst, r, z3.Lambda([j], z3.If(j < keep, s.lst[r][j], s.lst[r][j + d]))),
        nb=z3.Store(s.nb, r, s.nb[r] - d),
        mem=z3.Store(s.mem, r, z3.Lambda([b], z3.And(s.mem[r][b], z3.Not(drop(b))))),
        pos=z3.Store(s.pos, r, z3.Lambda([b], z3.If(s.pos[r][b] >= written, s.pos[r][b] - d, s.pos[r][b]))),
        ref=z3.Lambda([b], z3.If(drop(b), s.ref[b] - 1, s.ref[b])),
        free=z3.Lambda([b], z3.If(drop(b), s.ref[b] == 1, s.free[b])),
        wi=z3.Store(s.wi, r, wi2), wo=z3.Store(s.wo, r, wo2),
        rank=z3.Lambda([q], z3.Lambda([b], z3.If(z3.And(drop(b), s.rank[q][b] == s.ref[b]),
                                                 s.rank[r][b], s.rank[q][b]))),
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


A1I = z3.ArraySort(I, I)
A1B = z3.ArraySort(I, B)


def _batch_params() -> dict:
    """The batched transitions' own parameters (arrays where a call names many blocks, tokens or slots)."""
    k, L, wi2, wo2 = z3.Ints("xk xL xwi2 xwo2")
    c = lambda n, sort: z3.Const(n, sort)  # noqa: E731
    return {"k": k, "L": L, "wi2": wi2, "wo2": wo2, "nbk": c("xnbk", A1I), "isnew": c("xisnew", A1B),
            "at": c("xat", A1I), "ni": c("xni", A1I), "no": c("xno", A1I), "C2": c("xC2", A2I),
            "mv": c("xmv", A1B), "di": c("xdi", A1I), "do": c("xdo", A1I)}


def batched_transitions(s: State, s2: State, params: dict) -> dict:
    """T2b, T4b, T8b, T9, T10: {name: (pre, post)} over ``params`` (``_transitions``' names plus ``_batch_params``)."""
    P = params
    return {
        "T2b sync_new_tokens, batched": tr_sync_batch(s, s2, P["r"], P["k"], P["nbk"], P["isnew"], P["at"], P["L"],
                                                      P["ni"], P["no"], P["wi2"], P["wo2"], P["C2"]),
        "T4b apply_moves, one batch": tr_move_batch(s, s2, P["r"], P["mv"], P["di"], P["do"]),
        "T8b admit sharing k prefix blocks": tr_share_prefix(s, s2, P["r"], P["q"], P["k"], P["L"]),
        "T9 a copy writes unread slots": tr_copy_lands(s, s2, P["C2"]),
        "T10 densify commit rewinds the cursor": tr_densify_rewind(s, s2, P["r"], P["wi2"], P["wo2"]),
    }


def _batched(s: State, s2: State):
    """The batched transitions, built apart from ``_transitions`` so the proofs of T1-T8 create the same z3 terms
    as before they existed (z3's search depends on the terms a context holds)."""
    r, q, t, i, o, b, p = z3.Ints("xr xq xt xi xo xb xp")
    params = {"r": r, "q": q, "t": t, "i": i, "o": o, "b": b, "p": p, **_batch_params()}
    return params, batched_transitions(s, s2, params)


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


# NOTE: z3py builds terms slowly: before this cache, making the ~1,500 ground instances of an inductive obligation,
# its transitions, invariants and goals took 90 % of the obligation's time and the solver 5 %. Every obligation of
# one transition (six invariants) and every witness search from one state shares them. z3 hash-conses terms, so a
# cached term is the very term a rebuild would make (the same AST id); the cache keeps them, and their context, alive.
_TERMS: dict[tuple, object] = {}


def _terms(make: Callable, *args):
    """``make(*args)``, built once per context and arguments (States, z3 terms; ``make`` by identity)."""
    key = (make, id(z3.main_ctx()), *(
        tuple(getattr(a, f).get_id() for f in a.__dataclass_fields__) if isinstance(a, State) else a.get_id()
        for a in args))
    made = _TERMS.get(key)
    if made is None:
        made = _TERMS[key] = make(*args)
    return made


def ground_instances(s: State, params: dict):
    """The invariants instantiated at the witnesses and the transition's parameters.

    Sound to add (they are instances of the universally quantified invariant) and
    they give e-matching the ground terms it needs, turning most obligations from
    timeouts into sub-second proofs.
    """
    return _terms(_ground_instances, s, params["r"], params["q"], params["t"], params["b"], params["i"], params["p"])


def _ground_instances(s: State, r, q, t, b, i, p):
    params = {"r": r, "q": q, "t": t, "b": b, "i": i, "p": p}
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
    params, trs = _terms(build, s, s2)
    pre, rel = trs[transition]
    fix = [N == consts["N"], S == consts["S"]] + [E[1][k] == E[0][k] for k in range(consts["S"])]
    out = prove(z3.Implies(z3.And(fix + [pre, rel]), _terms(_goals, s2)[invariant]), timeout_ms=20_000,
                explain=_explain(transition, params, s, s2))
    if out.status == COUNTEREXAMPLE:
        return Outcome(COUNTEREXAMPLE, "from the witness state (S=2, N=6):\n" + out.detail)
    return out


def inductive_obligation(transition: str, invariant: str, build=_transitions, search=None) -> Obligation:
    """``Inv ∧ Pre ∧ Tr ⇒ Inv_k'`` for one transition; ``search`` finds a quick counterexample first
    (``witness_search`` for T0-T8, ``batch_witness_search`` for the batched transitions)."""
    search = search or witness_search

    def check() -> Outcome:
        quick = search(transition, invariant, build)
        if quick.status == COUNTEREXAMPLE:
            return quick
        s, s2 = State.fresh(""), State.fresh("'")
        params, trs = _terms(build, s, s2)
        pre, rel = trs[transition]
        claim = z3.Implies(z3.And(_terms(inv_all, s), ground_instances(s, params), pre, rel),
                           _terms(_goals, s2)[invariant])
        return prove(claim, timeout_ms=60_000, explain=_explain(transition, params, s, s2))

    return Obligation(f"{invariant}/{transition.split()[0]}", invariant, transition,
                      f"{transition} preserves {invariant} (any number of requests, tokens and blocks, any S)", check)


def init_obligation(invariant: str) -> Obligation:
    def check() -> Outcome:
        s = State.fresh("0")
        return prove(z3.Implies(init_state(s), _goals(s)[invariant]), timeout_ms=30_000)

    return Obligation(f"{invariant}/T0", invariant, "T0 init", f"the empty system satisfies {invariant}", check)


def _store(a, k, v):
    return z3.Store(a, k, v)


def _batch_witness(transition: str) -> tuple[State, dict, dict]:
    """(state, constants, parameters) enabling a batched transition: the witness state of ``witness_state``,
    adjusted where the transition needs it. Request 0 lists blocks [0, 1, 2], cursor (2, 1); request 1 is empty."""
    s, consts = witness_state(full_first_block=transition.startswith("T8"))
    C, ints, bools = s.C, (lambda d: _arr(0, d)), (lambda d: _arr(False, d, B))
    if transition.startswith("T2b"):  # block 3 joins; tokens 3, 4 land at (2, 1) and (3, 0); cursor (3, 1)
        C2 = _store(_store(C, 2, _store(C[2], 1, E[0][3])), 3, _store(C[3], 0, E[0][4]))
        params = dict(r=0, k=1, nbk=ints({0: 3}), isnew=bools({3: True}), at=ints({3: 0}), L=2,
                      ni=ints({3: 2, 4: 3}), no=ints({3: 1, 4: 0}), wi2=3, wo2=1, C2=C2)
    elif transition.startswith("T4b"):  # token 0's copy has landed in (1, 0); the batch moves it there
        s = s.replace(C=_store(C, 1, _store(C[1], 0, E[0][0])))
        params = dict(r=0, mv=bools({0: True}), di=ints({0: 1}), do=ints({0: 0}))
    elif transition.startswith("T8b"):
        params = dict(r=0, q=1, k=1, L=2)
    elif transition.startswith("T9"):  # a copy writes (1, 1), a slot of the empty block 1
        params = dict(C2=_store(C, 1, _store(C[1], 1, z3.IntVal(7))))
    else:  # T10: only token 0 is live; the cursor goes back to (0, 1), releasing blocks 1 and 2
        s = s.replace(live=_arr(_arr(False, {}, B), {0: _arr(False, {0: True}, B)}))
        params = dict(r=0, wi2=0, wo2=1)
    return s, consts, params


def batch_vacuity_obligation(transition: str, build=None) -> Obligation:
    """Non-vacuity of a batched transition: a concrete state satisfying every invariant enables it, and the
    transition relation (whose writes constrain the successor's content) has a successor there."""
    build = build or _batched

    def check() -> Outcome:
        s, consts, fixed = _batch_witness(transition)
        s2 = State.fresh("'")
        params, trs = build(s, s2)
        pre, post = trs[transition]
        fix = [N == consts["N"], S == consts["S"]] + [params[k] == v for k, v in fixed.items()]
        fix += [E[1][k] == E[0][k] for k in range(consts["S"])]
        out = prove(z3.Implies(z3.And(fix), z3.And(inv_all(s), pre)), timeout_ms=30_000)
        if out.status == COUNTEREXAMPLE:
            return Outcome(COUNTEREXAMPLE, f"the witness state does not satisfy the invariants or enable {transition}")
        if out.status != PROVED:
            return out
        succ = z3.Solver()
        succ.set("timeout", 30_000)
        succ.add(fix + [pre, post])
        verdict = succ.check()
        # NOTE: over quantified arrays z3 may answer unknown, and which way its search goes can depend on what the
        # process asked it before (seen once in a full `make test`, never alone): retried with other seeds, and an
        # unknown is reported as one, never as "no successor"
        for seed in range(1, 4):
            if verdict != z3.unknown:
                break
            succ.set("random_seed", seed)
            verdict = succ.check()
        if verdict == z3.unknown:
            return Outcome(UNKNOWN, f"{transition}: z3 neither found a successor nor ruled one out "
                                    f"({succ.reason_unknown()})")
        if verdict != z3.sat:
            return Outcome(COUNTEREXAMPLE, f"{transition} is enabled in the witness state but has no successor")
        return Outcome(PROVED, f"witness: S=2, N=6, {', '.join(f'{k}={v}' for k, v in fixed.items() if k != 'C2')}")

    return Obligation(f"enabled/{transition.split()[0]}", "non-vacuity", transition,
                      f"{transition} is enabled in a concrete state satisfying every invariant", check)


def shared_witness_state() -> tuple[State, dict]:
    """A concrete state (S=2, N=6) with a shared prefix block: request 0 lists [0, 1, 2] with only token 0 live,
    at (0, 0), cursor (2, 1); request 1 took block 0 (T8) and has tokens 0, 1 live at (0, 0), (0, 1), cursor
    (1, 0). Block 0 has two references. Only here can a batched transition break SH or the shared-slot clause."""
    s, consts = witness_state(full_first_block=True)
    lst0 = _arr(0, {0: 0, 1: 1, 2: 2})
    C = s.C
    return s.replace(
        ref=_arr(0, {0: 2, 1: 1, 2: 1}), nb=_arr(0, {0: 3, 1: 1}), lst=_arr(_arr(0, {}), {0: lst0, 1: _arr(0, {0: 0})}),
        mem=_arr(_arr(False, {}, B), {0: _arr(False, {0: True, 1: True, 2: True}, B), 1: _arr(False, {0: True}, B)}),
        pos=_arr(_arr(0, {}), {0: lst0, 1: _arr(0, {0: 0})}),
        wi=_arr(0, {0: 2, 1: 1}), wo=_arr(0, {0: 1, 1: 0}), len=_arr(0, {0: 3, 1: 2}),
        live=_arr(_arr(False, {}, B), {0: _arr(False, {0: True}, B), 1: _arr(False, {0: True, 1: True}, B)}),
        ix=_arr(_arr(0, {}), {0: _arr(0, {0: 0, 1: 0, 2: 2}), 1: _arr(0, {})}),
        off=_arr(_arr(0, {}), {0: _arr(0, {0: 0, 1: 1, 2: 0}), 1: _arr(0, {0: 0, 1: 1})}),
        C=C, rank=_arr(_arr(0, {}), {0: _arr(0, {0: 1, 1: 1, 2: 1}), 1: _arr(0, {0: 2})}),
    ), consts


def _small_batches(transition: str, s: State, params: dict) -> list[list]:
    """Alternative shapes binding a batched transition's array parameters to a few free integers (one or two
    blocks, tokens, moves or writes). Each is searched on its own: z3 answers each concrete-state query in
    milliseconds, while their disjunction sends its quantifier instantiation astray."""
    a0, a1, c0, c1, m0, m1, n0, x0, x1, y0, y1, v0, v1 = z3.Ints("wa0 wa1 wc0 wc1 wm0 wm1 wn0 wx0 wx1 wy0 wy1 wv0 wv1")
    t, b = z3.Int("wt_"), z3.Int("wb_")
    P = params
    C1 = z3.Store(s.C, x0, z3.Store(s.C[x0], y0, v0))
    writes = [C1, z3.Store(C1, x1, z3.Store(C1[x1], y1, v1))]
    if transition.startswith("T2b"):  # the forward writes exactly the new tokens' slots (blocks: listed or n0)
        r, l0 = P["r"], s.len[P["r"]]
        block = lambda i: z3.If(i < s.nb[r], s.lst[r][i], n0)  # noqa: E731
        W1 = z3.Store(s.C, block(a0), z3.Store(s.C[block(a0)], c0, E[r][l0]))
        W2 = z3.Store(W1, block(a1), z3.Store(W1[block(a1)], c1, E[r][l0 + 1]))
        tokens = [P["ni"] == z3.Lambda([t], z3.If(t == l0, a0, a1)), P["no"] == z3.Lambda([t], z3.If(t == l0, c0, c1))]
        return [[P["k"] == k, P["L"] == L, P["nbk"] == z3.K(I, n0), P["at"] == z3.K(I, z3.IntVal(0)),
                 P["isnew"] == z3.Lambda([b], z3.And(k == 1, b == n0)), P["C2"] == (W1, W2)[L - 1]] + tokens
                for k, L in ((0, 1), (1, 2))]
    if transition.startswith("T4b"):
        return [[P["mv"] == z3.Lambda([t], z3.Or(t == m0, z3.And(two, t == m1))),
                 P["di"] == z3.Lambda([t], z3.If(t == m0, a0, a1)), P["do"] == z3.Lambda([t], z3.If(t == m0, c0, c1))]
                for two in (False, True)]
    if transition.startswith("T9"):
        return [[P["C2"] == w] for w in writes]
    return [[]]


def _search_points(transition: str) -> list[tuple[tuple[State, dict], int]]:
    """(witness state, request) pairs to search from: the transition's own witness, and request 0 of the
    shared-prefix state (where SH and the shared-slot clause can break); T8b needs its empty request 1."""
    own = (_batch_witness(transition)[:2], 0)
    if transition.startswith("T8b"):
        return [own]
    return [own, (shared_witness_state(), 0)]


def batch_witness_search(transition: str, invariant: str, build=None) -> Outcome:
    """``witness_search`` for a batched transition: from each concrete witness state (plain, first block full,
    a shared prefix block, the transition's own witness) and request, over small batches (``_small_batches``).
    A clean result proves nothing; the symbolic proof does."""
    build = build or _batched
    for (s, consts), r in _search_points(transition):
        s2 = State.fresh("w'")
        params, trs = _terms(build, s, s2)
        pre, rel = trs[transition]
        fix = [N == consts["N"], S == consts["S"], params["r"] == r, params["q"] == 1 - r]
        fix += [E[1][k] == E[0][k] for k in range(consts["S"])]
        for shape in _small_batches(transition, s, params):
            out = prove(z3.Implies(z3.And(fix + shape + [pre, rel]), _terms(_goals, s2)[invariant]), timeout_ms=2_000,
                        explain=_explain(transition, params, s, s2))
            if out.status == COUNTEREXAMPLE:
                return Outcome(COUNTEREXAMPLE, "from a witness state (S=2, N=6):\n" + out.detail)
    return Outcome(UNKNOWN, "no counterexample from the witness states")


def batch_inductive_obligation(transition: str, invariant: str, build=None) -> Obligation:
    return inductive_obligation(transition, invariant, build or _batched, batch_witness_search)


TRANSITIONS = ["T1 allocate block", "T2 sync_new_tokens", "T3 evict_token", "T4 copy + apply_moves",
               "T5 commit drops a source", "T6 commit attaches a destination", "T7 finish / preempt",
               "T8 admit sharing a prefix block"]
#: the batched transitions: one call of the code each, as the refinement check (spec/refinement.py) matches them
BATCHED = ["T2b sync_new_tokens, batched", "T4b apply_moves, one batch", "T8b admit sharing k prefix blocks",
           "T9 a copy writes unread slots", "T10 densify commit rewinds the cursor"]
INVARIANTS = ["P1", "PL", "RC", "I2", "SH", "I1"]


def obligations() -> list[Obligation]:
    return [init_obligation(k) for k in INVARIANTS] + [vacuity_obligation(tr) for tr in TRANSITIONS] + [
        inductive_obligation(tr, k) for tr in TRANSITIONS for k in INVARIANTS
    ] + batched_obligations()


def batched_obligations() -> list[Obligation]:
    return [batch_vacuity_obligation(tr) for tr in BATCHED] + [
        batch_inductive_obligation(tr, k) for tr in BATCHED for k in INVARIANTS]
