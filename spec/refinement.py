"""Refinement: the state model's transitions are the code's (issue #16).

``RefinementDriver`` runs the real core (``VTokenRuntime`` with its ``BlockPool``, ``TokenTable``,
``ReclamationManager`` and an ``InMemoryCopyEngine`` over a ``TagStore``). After every *unit* (a call of the
core, or a part of one: ``Observer.unit``) it maps the concrete state to a concrete value of
spec/state_model.py's ``State`` (``abstract``, ``to_z3``) and asks z3 whether the model path the call
stands for leads from the state before to the state after (``matches``):

  begin_step's syncs        T2b once per request that grew         (T1 + T2, batched)
  end_step's evictions      T3 once per token evicted
  launch, before_compute,   T9                                     (a copy writes slots no live token reads)
  a copy completing, failing or being ordered
  a compact commit          T6 per destination, T4b, T5 per source
  a densify commit          T4b, T10                               (the cursor rewinds to n_live)
  finish / preempt          T7
  admit sharing k blocks    T8b                                    (T8, batched)
  everything else           a stutter (no abstract change)

A unit that changes nothing abstract is a stutter; one that raised a ``VTokenError`` must be one (spec §2: a
refused call changes nothing). The initial state must satisfy the model's ``Init``. And a plan is a proposed
transition: when ``plan_request`` makes one, its commit, with the copy landed (``planned_commit``), must be a
model path (T9 then the commit's) from the state it was planned in. Anything else raises
``RefinementViolation`` naming the call and the abstract components that changed.

The abstraction (docs/spec.md §4):
  ref[b], free[b]    the pool's ref count and free-queue membership, less the references plans hold outside
                     every list (a compact plan's destinations until commit attaches them, an orphan's held
                     blocks): those belong to the protocol model. Such a block with no other reference is
                     abstractly free.
  nb, lst, mem, pos  each request's block list (absent and empty requests alike: the defaults)
  wi, wo             divmod(write_pos, S)
  len, live, ix, off synced length; a token is live iff its slot is not NO_SLOT; a live token's slot as
                     (index in its list, offset)
  C[b][o]            the tag the next attention read sees: the TagStore with ordered copies applied
                     (``next_read_view``), and the tags this step's forward is about to write
  E[r][t]            the tag the driver gave token t of r
Components no concrete state determines are left free: list entries past nb, pos of unlisted blocks, ix and
off of dead tokens, and the ghost ``rank``. NOTE: no precondition and no listed part of a post reads them, so
choosing them afresh in every state is the same as carrying them from step to step.

The abstraction is defined only on states whose redundant encodings agree with the slot arrays (per-block
masks, live counts, pool-wide occupancy, listed counts, a duplicate-free free queue, live slots inside the
list: ``representation_errors``); a unit that leaves any of them inconsistent is flagged as a state with
no abstraction.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import z3
from z3.z3 import _to_expr_ref as _to_expr

from vtoken.core.block_pool import BlockPool, Purpose
from vtoken.core.errors import (
    AdmissionClosedError,
    BlockNotOwnedError,
    PlanConflictError,
    PoolExhaustedError,
    VTokenError,
)
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.reference.invariants import next_read_view
from vtoken.core.plan import PlanKind
from vtoken.core.reclamation import Ordering, ReclaimConfig
from vtoken.core.runtime import ReadPath, VTokenRuntime
from vtoken.core.sim.simulator import attention_weights
from vtoken.core.token_table import NO_SLOT, Move

from . import state_model as M

A1I = z3.ArraySort(M.I, M.I)
A1B = z3.ArraySort(M.I, M.B)
SOLVER_TIMEOUT_MS = 20_000


class RefinementViolation(AssertionError):
    """A real transition the model's transition relation does not allow, or a state with no abstraction."""


class RefinementUndecided(AssertionError):
    """z3 gave up on a match (a timeout): neither allowed nor refuted, and reported as such."""


# ---- the abstraction ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestAbs:
    blocks: tuple[int, ...]
    cursor: int  # write_pos
    length: int  # synced tokens
    live: tuple[tuple[int, int, int], ...]  # (token, index in blocks, offset), ascending


@dataclass(frozen=True)
class Abstract:
    """A concrete value of the model's State (what ``to_z3`` encodes), in plain Python."""

    N: int
    S: int
    ref: tuple[int, ...]
    free: tuple[bool, ...]
    reqs: tuple[tuple[object, RequestAbs], ...]  # registered requests, in table order
    C: tuple[tuple[int, int, int], ...]  # (block, offset, tag) of every slot whose tag is not 0

    @property
    def requests(self) -> dict[object, RequestAbs]:
        return dict(self.reqs)


def plan_holds(rt: VTokenRuntime) -> Counter:
    """References plans hold on blocks outside every list: in-flight destinations not attached yet, and
    orphans' held blocks (the departed request's reference passed to the orphan, plus its destinations)."""
    holds: Counter = Counter()
    for r, rec in rt.manager.inflight.items():
        listed = set(rt.table.block_ids(r)) if r in rt.table else set()
        holds.update(b for b in rec.plan.dst_blocks if b not in listed)
    for rec in rt.manager.orphans:
        holds.update(rec.held)
    return holds


def representation_errors(rt: VTokenRuntime) -> list[str]:
    """Where the table's or the pool's redundant encodings disagree with the slot arrays (the abstraction's
    domain). NOTE: reads private fields (``_requests``, ``_listed``, the occupancy arrays): they are the
    encodings in question, and no public view exposes them unrecomputed."""
    table, S, errors = rt.table, rt.pool.block_size, []
    holders: Counter = Counter()
    listed: Counter = Counter()
    for r, req in table._requests.items():
        blocks = list(req.blocks)
        listed.update(blocks)
        if len(set(blocks)) != len(blocks):
            errors.append(f"request {r!r} lists a block twice: {blocks}")
        shared = {b for b in blocks if table._listed[b] > 1}
        if set(req.shared) != shared:
            errors.append(f"request {r!r}: masks are kept for blocks {sorted(req.shared)}, its shared blocks are "
                          f"{sorted(shared)}")
        live = [(t, s) for t, s in enumerate(req.slots) if s != NO_SLOT]
        for t, s in live:
            if s // S not in blocks:
                errors.append(f"request {r!r} token {t}: slot {s} (block {s // S}) is outside its list {blocks}")
            holders[s] += 1
        masks: dict[int, int] = {}
        for t, s in live:
            masks[s // S] = masks.get(s // S, 0) | (1 << (s % S))
        for b in blocks:
            if table.block_mask(r, b) != masks.get(b, 0):
                errors.append(f"request {r!r} block {b}: mask {table.block_mask(r, b):#b} recorded, live tokens give "
                              f"{masks.get(b, 0):#b}")
        if req.num_live != len(live):
            errors.append(f"request {r!r}: num_live {req.num_live}, {len(live)} live tokens")
    occ = table.occupancy
    for slot in range(rt.pool.num_blocks * S):
        if occ.holders(slot) != holders[slot]:
            errors.append(f"slot {slot} (block {slot // S}, offset {slot % S}): occupancy records "
                          f"{occ.holders(slot)} holder(s), the tables {holders[slot]}")
    for b in range(rt.pool.num_blocks):
        n = sum(1 for o in range(S) if holders[b * S + o])
        if occ.block_live(b) != n:
            errors.append(f"block {b}: occupancy records {occ.block_live(b)} live slots, the tables {n}")
        if table._listed[b] != listed[b]:
            errors.append(f"block {b}: the table counts {table._listed[b]} listing request(s), {listed[b]} list it")
    if occ.live_slots != len(holders):
        errors.append(f"occupancy totals {occ.live_slots} live slots, the tables {len(holders)}")
    queue = rt.pool.free_block_ids()
    if len(set(queue)) != len(queue):
        errors.append(f"the free queue holds a block twice: {queue}")
    return errors


def abstract(rt: VTokenRuntime, pending: dict[int, int]) -> Abstract:
    """The model state of ``rt``; ``pending`` maps slots this step's forward will write to their tags.

    raises: RefinementViolation when the state has no abstraction (``representation_errors``)."""
    errors = representation_errors(rt)
    if errors:
        raise RefinementViolation("a state with no abstraction: " + "; ".join(errors[:4]))
    pool, table, S = rt.pool, rt.table, rt.pool.block_size
    holds = plan_holds(rt)
    queued = set(pool.free_block_ids())
    ref = tuple(pool.ref_count(b) - holds[b] for b in range(pool.num_blocks))
    free = tuple(b in queued or (holds[b] > 0 and ref[b] == 0) for b in range(pool.num_blocks))
    reqs = []
    for r in table.request_ids():
        blocks = table.block_ids(r)
        index = {b: i for i, b in enumerate(blocks)}
        live = tuple((t, index[s // S], s % S) for t, s in table.live_slots(r))
        req = RequestAbs(tuple(blocks), table.write_pos(r), table.total_len(r), live)
        if req != _EMPTY:  # NOTE: an empty request is the model's default: registered or not, the same state
            reqs.append((r, req))
    view = next_read_view(rt)
    C = []
    for slot in range(pool.num_blocks * S):
        tag = pending.get(slot, view(slot))
        if tag:
            C.append((slot // S, slot % S, tag))
    return Abstract(pool.num_blocks, S, ref, free, tuple(reqs), tuple(C))


_EMPTY = RequestAbs((), 0, 0, ())


def _observable(a: Abstract) -> tuple:
    return a.ref, a.free, a.reqs, a.C


# ---- z3 encoding --------------------------------------------------------------------------------------------
# NOTE: the helpers below call z3's C API directly: these loops build thousands of stores, selects and
# equations per check, and the Python API's argument coercion was most of a check's time.
@functools.lru_cache(maxsize=1 << 14)
def _val(v: int | bool) -> z3.ExprRef:
    return z3.BoolVal(v) if isinstance(v, bool) else z3.IntVal(v)


def _store(a: z3.ArrayRef, k: int, v) -> z3.ArrayRef:
    v = v if isinstance(v, z3.ExprRef) else _val(v)
    return z3.ArrayRef(z3.Z3_mk_store(a.ctx.ref(), a.as_ast(), _val(k).as_ast(), v.as_ast()), a.ctx)


def _select(a: z3.ArrayRef, k: int) -> z3.ExprRef:
    return _to_expr(z3.Z3_mk_select(a.ctx.ref(), a.as_ast(), _val(k).as_ast()), a.ctx)


def _eq(x: z3.ExprRef, v) -> z3.BoolRef:
    v = v if isinstance(v, z3.ExprRef) else _val(v)
    return z3.BoolRef(z3.Z3_mk_eq(x.ctx.ref(), x.as_ast(), v.as_ast()), x.ctx)


def _iarr(default, entries: dict, base: z3.ArrayRef | None = None):
    """K(default) (or ``base``) with ``entries`` stored on top."""
    out = base if base is not None else z3.K(M.I, default if isinstance(default, z3.ExprRef) else _val(default))
    for k, v in entries.items():
        out = _store(out, k, v)
    return out


@functools.lru_cache(maxsize=4)
def _encoded(a: Abstract) -> tuple[M.State, tuple]:
    """``to_z3`` of ``a``, kept: each state is the successor of one check and the predecessor of the next."""
    st, facts = to_z3(a, "X")
    return st, tuple(facts)


def to_z3(a: Abstract, tag: str) -> tuple[M.State, list]:
    """The model state for ``a``, with its free parts (list entries past the end, unlisted blocks' pos, dead
    tokens' slots, ranks) as fresh constants; request ids are their own ids. Returns no extra facts."""
    fresh = M.State.fresh(tag)
    reqs = dict(a.reqs)
    inner = lambda name, r: z3.Const(f"{name}{tag}_{r}", z3.ArraySort(M.I, M.I))  # noqa: E731
    cblocks: dict[int, dict] = {}
    for b, o, v in a.C:
        cblocks.setdefault(b, {})[o] = v
    per = lambda f: {r: f(r, q) for r, q in reqs.items()}  # noqa: E731
    st = fresh.replace(
        ref=_iarr(0, {b: v for b, v in enumerate(a.ref) if v}),
        free=_iarr(True, {b: False for b, f in enumerate(a.free) if not f}),
        nb=_iarr(0, per(lambda r, q: len(q.blocks))),
        lst=_iarr(0, per(lambda r, q: _iarr(0, dict(enumerate(q.blocks)), inner("lst", r))), fresh.lst),
        mem=_iarr(_iarr(False, {}), per(lambda r, q: _iarr(False, {b: True for b in q.blocks}))),
        pos=_iarr(0, per(lambda r, q: _iarr(0, {b: i for i, b in enumerate(q.blocks)}, inner("pos", r))), fresh.pos),
        wi=_iarr(0, per(lambda r, q: q.cursor // a.S)),
        wo=_iarr(0, per(lambda r, q: q.cursor % a.S)),
        len=_iarr(0, per(lambda r, q: q.length)),
        live=_iarr(_iarr(False, {}), per(lambda r, q: _iarr(False, {t: True for t, _, _ in q.live}))),
        ix=_iarr(0, per(lambda r, q: _iarr(0, {t: i for t, i, _ in q.live}, inner("ix", r))), fresh.ix),
        off=_iarr(0, per(lambda r, q: _iarr(0, {t: o for t, _, o in q.live}, inner("off", r))), fresh.off),
        C=_iarr(_iarr(0, {}), {b: _iarr(0, d) for b, d in cblocks.items()}),
    )
    return st, []


def _step(kind: str, X: M.State, Y: M.State, i: int, given: dict):
    """(pre, post) of one model transition from X to Y; parameters not ``given`` are fresh, for z3 to choose."""
    n = lambda name: given.get(name, z3.Int(f"p{name}_{i}"))  # noqa: E731
    a = lambda name, sort: given.get(name, z3.Const(f"p{name}_{i}", sort))  # noqa: E731
    if kind == "T2b":
        return M.tr_sync_batch(X, Y, n("r"), n("k"), a("nbk", A1I), a("isnew", A1B), a("at", A1I), n("L"),
                               a("ni", A1I), a("no", A1I), n("wi2"), n("wo2"), a("C2", M.A2I))
    if kind == "T3":
        return M.tr_evict(X, Y, n("r"), n("t"))
    if kind == "T4b":
        return M.tr_move_batch(X, Y, n("r"), a("mv", A1B), a("di", A1I), a("do", A1I))
    if kind == "T5":
        return M.tr_drop_block(X, Y, n("r"), n("p"))
    if kind == "T6":
        return M.tr_attach_block(X, Y, n("r"), n("p"), n("b"))
    if kind == "T7":
        return M.tr_finish(X, Y, n("r"))
    if kind == "T8b":
        return M.tr_share_prefix(X, Y, n("r"), n("q"), n("k"), n("L"))
    if kind == "T9":
        return M.tr_copy_lands(X, Y, a("C2", M.A2I))
    if kind == "T10":
        return M.tr_densify_rewind(X, Y, n("r"), n("wi2"), n("wo2"))
    raise ValueError(f"no model transition {kind!r}")


Step = tuple[str, dict]  # (model transition, the parameters the real call names: request ids, a block, a token)
Path = tuple[Step, ...]


def _given(kind: str, bound: dict, before: Abstract, after: Abstract, X: M.State, C_after) -> dict:
    """The parameters of ``kind`` from ``X``: those the call names (``bound``) and those the diff forces,
    as z3 terms; the rest stay z3's to choose.

    NOTE: each is forced by the model's post (T2b's new blocks are the successor's list past the old end, its
    new tokens' positions their slots in the successor; T9's content is the successor's), or forced up to a
    choice that changes nothing: T4b's moved set up to moves of a token onto its own slot; in a path of T2b
    (one per request that grew), each may write the path's final content, since the others' new tokens'
    slots are read by no live token yet. So fixing them loses no match; it spares z3 inventing arrays under
    quantifiers, which it does slowly or not at all."""
    S = before.S
    g = {k: z3.IntVal(v) for k, v in bound.items()}
    r = bound.get("r")
    x, y = before.requests.get(r, _EMPTY), after.requests.get(r, _EMPTY)
    if kind == "T2b":
        new = y.blocks[len(x.blocks):]
        pos = {t: (i, o) for t, i, o in y.live if t >= x.length}
        g.update(k=len(new), nbk=_iarr(0, dict(enumerate(new))), isnew=_iarr(False, {b: True for b in new}),
                 at=_iarr(0, {b: j for j, b in enumerate(new)}), L=y.length - x.length,
                 ni=_iarr(0, {t: i for t, (i, o) in pos.items()}), no=_iarr(0, {t: o for t, (i, o) in pos.items()}),
                 wi2=y.cursor // S, wo2=y.cursor % S, C2=C_after)
    elif kind == "T4b":  # destinations by block (list indices shift along a commit's path): index in X's list
        bx = {t: (x.blocks[i], o) for t, i, o in x.live}
        by = {t: (y.blocks[i], o) for t, i, o in y.live}
        moved = {t: d for t, d in by.items() if bx.get(t) not in (None, d)}
        t_ = z3.Int("mvt")
        db = _iarr(-1, {t: b for t, (b, _) in moved.items()})
        g.update(mv=_iarr(False, {t: True for t in moved}), do=_iarr(0, {t: o for t, (_, o) in moved.items()}),
                 di=z3.Lambda([t_], X.pos[g["r"]][db[t_]]))
    elif kind == "T8b":
        q = after.requests.get(bound["q"], _EMPTY)
        g.update(k=len(q.blocks), L=q.length)
    elif kind == "T9":
        g["C2"] = C_after
    elif kind == "T10":
        g.update(wi2=y.cursor // S, wo2=y.cursor % S)
    return {k: (z3.IntVal(v) if isinstance(v, int) else v) for k, v in g.items()}


FIELDS = tuple(M.State.__dataclass_fields__)


def _effect(post: z3.BoolRef, s2: M.State) -> M.State:
    """The successor a transition's post names: post is ``s2.same_as(effect)``, one equality per field."""
    eqs = post.children()
    assert len(eqs) == len(FIELDS) and all(e.arg(0).eq(getattr(s2, f)) for e, f in zip(eqs, FIELDS)), post
    return M.State(**{f: e.arg(1) for f, e in zip(FIELDS, eqs)})


def _field_values(a: Abstract, f: str) -> dict:
    """Component ``f`` of ``a`` as {outer index: what the encoding stores there}, for comparing states."""
    if f in ("ref", "free"):
        return dict(enumerate(getattr(a, f)))
    if f == "C":
        out: dict = {}
        for b, o, v in a.C:
            out.setdefault(b, {})[o] = v
        return out
    pick = {"nb": lambda q: len(q.blocks), "lst": lambda q: q.blocks, "pos": lambda q: q.blocks,
            "mem": lambda q: q.blocks, "wi": lambda q: q.cursor, "wo": lambda q: q.cursor, "len": lambda q: q.length,
            "live": lambda q: (q.length, q.live), "ix": lambda q: q.live, "off": lambda q: q.live}[f]
    return {r: pick(q) for r, q in a.reqs}


def _peel(term: z3.ExprRef, base: z3.ExprRef) -> tuple[bool, set]:
    """Whether ``term`` is ``base`` under a chain of ``Store``s with numeral keys, and those keys."""
    keys: set = set()
    while not term.eq(base):
        if not (z3.is_store(term) and z3.is_int_value(term.arg(1))):
            return False, keys
        keys.add(term.arg(1).as_long())
        term = term.arg(0)
    return True, keys


def _agrees(Z: M.State, X: M.State, before: Abstract, after: Abstract) -> list:
    """``Z`` (the path's end, a term) equals ``after`` at every index a concrete state has: blocks [0, N),
    offsets [0, S), the requests of either state, their listed blocks and synced tokens. Indices where ``Z``
    is structurally ``X`` (under a few stores) and ``before`` equals ``after`` need no equation.
    NOTE: outside those indices both are the defaults (no post writes an index its parameters do not name,
    and the parameters are in range)."""
    N, S, out = after.N, after.S, []
    Y = _encoded(after)[0]
    reqs, old = after.requests, before.requests
    for f in FIELDS:
        if f == "rank":  # the ghost: no concrete counterpart
            continue
        term = getattr(Z, f)
        if f in ("ref", "free", "nb", "mem", "wi", "wo", "len", "live", "C") and term.eq(getattr(Y, f)):
            continue  # literally the successor's encoding (T2b's and T9's content)
        on_X, keys = _peel(term, getattr(X, f))
        vb, va = _field_values(before, f), _field_values(after, f)
        if on_X:
            idx = keys | {k for k in set(vb) | set(va) if vb.get(k) != va.get(k)}
        else:
            idx = set(range(N)) if f in ("ref", "free", "C") else set(reqs) | set(old)
        for k in sorted(idx):
            out += _equations(f, term, k, after, old.get(k, _EMPTY))
    return out


def _equations(f: str, term, k: int, after: Abstract, was: RequestAbs) -> list:
    """``term[k] == after's value there``: one equation per index a concrete state has."""
    N, S = after.N, after.S
    row = _select(term, k)
    if f == "ref":
        return [_eq(row, after.ref[k])]
    if f == "free":
        return [_eq(row, after.free[k])]
    if f == "C":
        cmap = {(b, o): v for b, o, v in after.C}
        return [_eq(_select(row, o), cmap.get((k, o), 0)) for o in range(S)]
    q = after.requests.get(k, _EMPTY)
    if f == "nb":
        return [_eq(row, len(q.blocks))]
    if f in ("wi", "wo"):
        return [_eq(row, q.cursor // S if f == "wi" else q.cursor % S)]
    if f == "len":
        return [_eq(row, q.length)]
    if f == "lst":
        return [_eq(_select(row, i), b) for i, b in enumerate(q.blocks)]
    if f == "pos":
        return [_eq(_select(row, b), i) for i, b in enumerate(q.blocks)]
    if f == "mem":
        return [_eq(_select(row, b), b in q.blocks) for b in range(N)]
    live = {t: (i, o) for t, i, o in q.live}
    if f == "live":
        return [_eq(_select(row, t), t in live) for t in range(max(q.length, was.length) + 1)]
    return [_eq(_select(row, t), i if f == "ix" else o) for t, (i, o) in live.items()]


def matches(before: Abstract, after: Abstract, path: Path, tags: Callable[[object, int], int]) -> str:
    """z3's answer (sat / unsat / unknown) to: does ``path`` (model transitions, each with the parameters the
    real call names) lead from ``before`` to ``after``? z3 chooses every other parameter (``_given``).

    Ground queries instead of one quantified one. Each transition's post is ``s2.same_as(effect)``: the path
    composes the effects as terms, and its end must agree with ``after`` (``_agrees``), together with the
    preconditions' quantifier-free conjuncts; then each quantified conjunct's negation (existential, so
    ground) must be unsatisfiable with them. NOTE: this is the same answer because the ground part fixes
    every value a quantified conjunct reads: the parameters (``_given``, and T5/T6's list index, in range,
    by which block leaves or joins) and the states' listed parts; what it leaves free (entries past a list's
    end, dead tokens' slots, ranks) no precondition reads. Request ids are their own model ids."""
    X, facts = _encoded(before)
    ground = [*facts, M.N == before.N, M.S == before.S]
    for a in (before, after):
        for req, q in a.reqs:
            ground += [_content_fact(req, t, tags(req, t)) for t in range(q.length)]
    C_after = _encoded(after)[0].C
    Z, pres = X, []
    for i, (kind, bound) in enumerate(path):
        successor = M.State.fresh(f"Z{i}_")
        pre, post = _step(kind, Z, successor, i, _given(kind, bound, before, after, Z, C_after))
        flat, quantified = _split(pre)
        ground += flat
        pres += quantified
        Z = _effect(post, successor)
    ground += _agrees(Z, X, before, after)
    s, ctx = _solver()
    s.add(_conjunction(ground).translate(ctx))
    answer = str(s.check())
    if answer != "sat":
        return answer
    for pre in pres:  # one by one: their negations together send z3's search astray (seconds, or a timeout)
        s.push()
        s.add(z3.Not(pre).translate(ctx))
        answer = str(s.check())
        s.pop()
        if answer != "unsat":
            return {"sat": "unsat"}.get(answer, "unknown")
    return "sat"


@functools.lru_cache(maxsize=1 << 16)
def _content_fact(req: int, t: int, tag: int) -> z3.BoolRef:
    """E[req][t] == tag, built once per token (a run asks for the same ones in every check)."""
    return _eq(_select(_select(M.E, req), t), tag)


def _conjunction(facts: list) -> z3.BoolRef:
    """``z3.And(facts)`` without the Python API's per-argument coercion (the facts are BoolRefs already)."""
    ctx = facts[0].ctx
    args = (z3.Ast * len(facts))(*[f.as_ast() for f in facts])
    return z3.BoolRef(z3.Z3_mk_and(ctx.ref(), len(facts), args), ctx)


def _split(pre: z3.BoolRef) -> tuple[list, list]:
    """A precondition's top-level conjuncts: (quantifier-free ones, quantified ones). NOTE: every quantifier
    of the model's preconditions is a conjunct of its own once the ``And``s are flattened; a nested one would
    land among the ground conjuncts, where z3 still decides it, only more slowly."""
    todo, flat, quantified = [pre], [], []
    while todo:
        e = todo.pop()
        if z3.is_and(e):
            todo += e.children()
        elif z3.is_quantifier(e):
            quantified.append(e)
        else:
            flat.append(e)
    return flat, quantified


def _solver() -> tuple[z3.Solver, z3.Context]:
    """A solver in a fresh context, for one match. NOTE: z3's search depends on the terms its context holds
    (an earlier session saw a proof time out after others had run in the same context); a context per match
    makes each answer independent of the run before it."""
    ctx = z3.Context()
    s = z3.Solver(ctx=ctx)
    s.set("timeout", SOLVER_TIMEOUT_MS)
    return s, ctx


def describe(before: Abstract, after: Abstract) -> str:
    """The abstract components a transition changed, readably."""
    out = []
    for b in range(before.N):
        if (before.ref[b], before.free[b]) != (after.ref[b], after.free[b]):
            out.append(f"block {b}: ref {before.ref[b]} -> {after.ref[b]}, free {before.free[b]} -> {after.free[b]}")
    rb, ra = before.requests, after.requests
    for r in list(rb) + [r for r in ra if r not in rb]:
        x, y = rb.get(r), ra.get(r)
        if x == y:
            continue
        if x is None or y is None:
            out.append(f"request {r!r}: {'registered' if x is None else 'removed'} "
                       f"({'' if y is None else f'blocks {list(y.blocks)}, cursor {y.cursor}, len {y.length}'}"
                       f"{'' if x is None else f'had blocks {list(x.blocks)}'})")
            continue
        if x.blocks != y.blocks:
            out.append(f"request {r!r}: blocks {list(x.blocks)} -> {list(y.blocks)}")
        if (x.cursor, x.length) != (y.cursor, y.length):
            out.append(f"request {r!r}: cursor {x.cursor} -> {y.cursor}, len {x.length} -> {y.length}")
        lx, ly = {t: (i, o) for t, i, o in x.live}, {t: (i, o) for t, i, o in y.live}
        changed = [t for t in sorted(set(lx) | set(ly)) if lx.get(t) != ly.get(t)]
        if changed:
            out.append(f"request {r!r}: tokens (index, offset) " + ", ".join(
                f"{t}: {lx.get(t, 'dead')} -> {ly.get(t, 'dead')}" for t in changed[:8])
                + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else ""))
    cb, ca = {(b, o): v for b, o, v in before.C}, {(b, o): v for b, o, v in after.C}
    slots = [k for k in sorted(set(cb) | set(ca)) if cb.get(k, 0) != ca.get(k, 0)]
    if slots:
        out.append("content " + ", ".join(f"({b},{o}): {cb.get((b, o), 0)} -> {ca.get((b, o), 0)}"
                                          for b, o in slots[:8]) + (" ..." if len(slots) > 8 else ""))
    return "\n  ".join(out) or "nothing"


def planned_commit(before: Abstract, plan) -> Abstract:
    """The state ``plan`` commits to if its copy lands now and nothing else happens: every move's
    destination holds its source's content, the moved tokens sit there, the list and cursor are
    ``plan.final_layout``'s, released sources lose a reference, attached destinations gain theirs.
    NOTE: what the commit would do, read from the plan alone (``final_layout`` is the plan's own method,
    so a planted bug in it shows here), never from ``_commit``."""
    S, r = before.S, plan.req_id
    x = before.requests.get(r, _EMPTY)
    blocks, cursor = plan.final_layout(list(x.blocks), x.cursor, S)
    index = {b: i for i, b in enumerate(blocks)}
    slot = {t: (x.blocks[i], o) for t, i, o in x.live}
    C = {(b, o): v for b, o, v in before.C}
    landed = dict(C)
    for m in plan.moves:
        landed[(m.dst_block, m.dst_offset)] = C.get((m.src_block, m.src_offset), 0)
        slot[m.token_id] = (m.dst_block, m.dst_offset)
    live = tuple(sorted((t, index.get(b, -1), o) for t, (b, o) in slot.items()))
    ref, free = list(before.ref), list(before.free)
    for b in plan.src_blocks:
        ref[b] -= 1
        free[b] = ref[b] == 0
    for b in plan.dst_blocks:
        ref[b] += 1
        free[b] = False
    reqs = tuple((q, RequestAbs(tuple(blocks), cursor, x.length, live) if q == r else v) for q, v in before.reqs)
    return Abstract(before.N, S, tuple(ref), tuple(free), reqs,
                    tuple(sorted((b, o, v) for (b, o), v in landed.items() if v)))


# ---- observing the real calls -------------------------------------------------------------------------------
Paths = Callable[[Abstract, Abstract], list[Path]]


@dataclass
class Unit:
    call: str
    paths: Paths


def stutter_only(before: Abstract, after: Abstract) -> list[Path]:
    return []


def one(kind: str, **bound) -> Paths:
    return lambda before, after: [((kind, bound),)]


def copy_writes(before: Abstract, after: Abstract) -> list[Path]:
    return [(("T9", {}),)]


def syncs(before: Abstract, after: Abstract) -> list[Path]:
    """``begin_step``'s syncs: T2b once per request whose synced length grew, in one path."""
    old = before.requests
    grew = [r for r, q in after.reqs if q.length > old.get(r, _EMPTY).length]
    return [tuple(("T2b", {"r": r}) for r in grew)]


def evictions(before: Abstract, after: Abstract) -> list[Path]:
    """``end_step``'s (or a direct) eviction: T3 once per token live before and dead after, in one path."""
    new = after.requests
    dead = [(r, t) for r, q in before.reqs for t, _, _ in q.live
            if t not in {u for u, _, _ in new.get(r, _EMPTY).live}]
    return [tuple(("T3", {"r": r, "t": t}) for r, t in dead)]


def commit_paths(rid: object, kind: PlanKind) -> Paths:
    """A compact commit is T6 once per attached destination, one T4b, T5 once per released source; a densify
    commit is T4b then T10. The blocks come from the list's diff: any path of that shape names them."""
    def paths(before: Abstract, after: Abstract) -> list[Path]:
        r = {"r": rid}
        if kind is PlanKind.DENSIFY:
            return [(("T4b", r), ("T10", r))]
        x, y = before.requests.get(rid, _EMPTY), after.requests.get(rid, _EMPTY)
        attached = [b for b in y.blocks if b not in x.blocks]
        released = [b for b in x.blocks if b not in y.blocks]
        return [tuple(("T6", {**r, "b": b}) for b in attached) + (("T4b", r),) + (("T5", r),) * len(released)]
    return paths


@dataclass
class Checked:
    """What the refinement check has seen: units observed, matches per transition path, solver time."""

    units: int = 0
    stutters: int = 0
    matched: Counter = field(default_factory=Counter)
    solver_s: float = 0.0


class Observer:
    """Checks every unit's abstract transition. Units nest: a check covers the state change since the last
    observation, attributed to the innermost open unit."""

    def __init__(self, driver: "RefinementDriver") -> None:
        self.d = driver
        self.stack: list[Unit] = []
        self.checked = Checked()
        self.last = self.now()
        self.check_init()

    def now(self) -> Abstract:
        return abstract(self.d.rt, self.d.pending)

    def check_init(self) -> None:
        X, facts = to_z3(self.last, "I")
        s = z3.Solver()
        s.add(M.N == self.last.N, M.S == self.last.S, *facts, M.init_state(X))
        if s.check() != z3.sat:
            raise RefinementViolation("the initial state does not satisfy the model's Init")

    @contextlib.contextmanager
    def unit(self, call: str, paths: Paths = stutter_only, entry: bool = True) -> Iterator[None]:
        """Check the call's transition when it returns (or raises). ``entry``: first check what changed
        before the call as part of the enclosing unit (off where the call's own arguments were computed by
        state-changing code, as ``begin_step`` allocates a sync's blocks)."""
        if entry:
            self.observe()
        self.stack.append(Unit(call, paths))
        try:
            yield
        except RefinementViolation:
            self.stack.pop()
            raise
        except BaseException as e:
            unit = self.stack.pop()
            self.observe(unit, raised=e)
            raise
        else:
            self.observe(self.stack.pop())

    def observe(self, unit: Unit | None = None, raised: BaseException | None = None) -> None:
        unit = unit or (self.stack[-1] if self.stack else Unit("(between calls)", stutter_only))
        try:
            after = self.now()
        except RefinementViolation as e:
            raise RefinementViolation(f"{unit.call} left {e}") from raised
        before, self.last = self.last, after
        self.checked.units += 1
        if _observable(before) == _observable(after):
            self.checked.stutters += 1
            return
        if raised is not None and isinstance(raised, VTokenError):
            raise RefinementViolation(f"{unit.call} raised {type(raised).__name__} but changed the state "
                                      f"(a refused call must change nothing):\n  {describe(before, after)}") from raised
        answers = []
        for path in unit.paths(before, after):
            t0 = time.perf_counter()
            answer = matches(before, after, path, self.d.tag)
            self.checked.solver_s += time.perf_counter() - t0
            name = " ".join(k for k, _ in path) or "stutter"
            if answer == "sat":
                self.checked.matched[_short(name)] += 1
                return
            answers.append((name, answer))
        tried = ", ".join(f"{n} ({a})" for n, a in answers) or "none (it must be a stutter)"
        cls = RefinementUndecided if any(a == "unknown" for _, a in answers) else RefinementViolation
        err = cls(f"{unit.call}: no model transition allows it; tried {tried}\n  {describe(before, after)}")
        err.before, err.after, err.unit = before, after, unit
        raise err


def _short(name: str) -> str:
    """'T3 T3 T3' -> 'T3^3'."""
    out: list[list] = []
    for k in name.split():
        if out and out[-1][0] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return " ".join(k if n == 1 else f"{k}^{n}" for k, n in out)


# ---- the driver ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One configuration of the core under the driver: read path, planner (None: no reclamation) and copy
    ordering, the pool, the policy and budget, and the trigger (theta_f 0.99: plans only when asked)."""

    read_path: ReadPath
    planner: PlanKind | None
    ordering: Ordering
    num_blocks: int = 16
    block_size: int = 4
    headroom: int = 1
    budget: float = 0.5
    policy: str | None = "h2o"  # None: no eviction but the driver's own
    theta_f: float = 0.0
    max_sources: int = 4


class RefinementDriver:
    """The real core, driven through its public calls, every unit checked by an ``Observer``.

    Request ids are ints (so they are their own model ids); the driver owns every token's content tag, and
    plays the forward (it writes the new tokens' tags where the runtime says) and the copy stream (it
    completes, fails or orders copies when told)."""

    def __init__(self, setup: Setup, seed: int = 0) -> None:
        self.setup = setup
        self.pool = BlockPool(setup.num_blocks, setup.block_size, setup.headroom)
        self.engine = InMemoryCopyEngine(TagStore(setup.num_blocks, setup.block_size), auto_complete=False)
        reclaim = None if setup.planner is None else ReclaimConfig(
            planner=setup.planner, theta_f=setup.theta_f, max_sources=setup.max_sources, ordering=setup.ordering)
        self.rt = VTokenRuntime(self.pool, self.engine, setup.policy, setup.budget, reclaim, setup.read_path,
                                seed=seed)
        self.S = setup.block_size
        self.content: dict[int, list[int]] = {}  # every request's tags, kept after it leaves
        self.prefill: dict[int, int] = {}
        self.waiting: list[int] = []
        self.pending: dict[int, int] = {}  # slot -> tag the forward of the open step will write
        self.next_req, self.next_tag = 0, 1
        self.obs = Observer(self)
        self._wrap()

    # ---- instrumentation: units inside the runtime's calls ------------------------------------------------
    def _wrap(self) -> None:
        """Instance attributes that open a unit around the core's inner calls. Each looks the method up on the
        class at call time, so a planted bug patched onto the class runs inside it."""
        t, m, e, obs = self.rt.table, self.rt.manager, self.engine, self.obs

        def sync_new_tokens(req_id, block_ids, total_len):
            """Records where this step's forward will write (part of the abstract content, see ``abstract``);
            the syncs are checked together, as ``begin_step``'s path ``syncs``."""
            start = t.total_len(req_id)
            slots = type(t).sync_new_tokens(t, req_id, block_ids, total_len)
            if not (obs.stack and obs.stack[-1].call.startswith("VTokenRuntime.admit")):  # a share writes nothing
                for tok, slot in zip(range(start, total_len), slots):
                    self.pending[slot] = self.tag(req_id, tok)
            return slots

        def _commit(rec):
            p = rec.plan
            call = (f"ReclamationManager._commit({p.kind.value} plan of request {p.req_id!r}: {len(p.moves)} moves, "
                    f"sources {list(p.src_blocks)}, destinations {list(p.dst_blocks)})")
            with obs.unit(call, commit_paths(p.req_id, p.kind)):
                return type(m)._commit(m, rec)

        def plan_request(req_id, evicted_positions=None, pack=False):
            out = type(m).plan_request(m, req_id, evicted_positions, pack)
            if out:
                self.check_plan(out.plan, f"plan_request({req_id!r})")
            return out

        def plan_pack(req_id, evicted_positions=None):
            out = type(m).plan_pack(m, req_id, evicted_positions)
            if out:
                self.check_plan(out.plan, f"plan_pack({req_id!r})")
            return out

        def plan_relocation(req_id, index):
            out = type(m).plan_relocation(m, req_id, index)
            if out:
                self.check_plan(out.plan, f"plan_relocation({req_id!r}, {index})")
            return out

        def _abort(rec, reason, detail=""):
            with obs.unit(f"ReclamationManager._abort(plan of request {rec.plan.req_id!r}: {reason})"):
                return type(m)._abort(m, rec, reason, detail)

        def launch():
            with obs.unit("ReclamationManager.launch()", copy_writes):
                return type(m).launch(m)

        def before_compute():
            with obs.unit("InMemoryCopyEngine.before_compute()", copy_writes):
                return type(e).before_compute(e)

        t.sync_new_tokens = sync_new_tokens
        m._commit, m._abort, m.launch, m.plan_request = _commit, _abort, launch, plan_request
        m.plan_relocation, m.plan_pack = plan_relocation, plan_pack
        e.before_compute = before_compute

    def check_plan(self, plan, call: str) -> None:
        """A plan is a proposed transition: its commit, with the copy landed (T9), must be a model path from
        the state it was planned in (``planned_commit``); else ``RefinementViolation`` before anything runs."""
        self.obs.observe()  # the state the plan was made from (a compact plan's destinations are held: free)
        before = self.obs.last
        planned = planned_commit(before, plan)
        paths = [(("T9", {}),) + p for p in commit_paths(plan.req_id, plan.kind)(before, planned)]
        answers = []
        for path in paths:
            t0 = time.perf_counter()
            answer = matches(before, planned, path, self.tag)
            self.obs.checked.solver_s += time.perf_counter() - t0
            if answer == "sat":
                self.obs.checked.matched["plan: " + _short(" ".join(k for k, _ in path))] += 1
                return
            answers.append(answer)
        cls = RefinementUndecided if "unknown" in answers else RefinementViolation
        raise cls(f"ReclamationManager.{call} made a {plan.kind.value} plan whose commit no "
                  f"model path allows ({len(plan.moves)} moves, sources {list(plan.src_blocks)}, destinations "
                  f"{list(plan.dst_blocks)}):\n  {describe(before, planned)}")

    def tag(self, req: int, tok: int) -> int:
        return self.content[req][tok]

    def _new_tags(self, n: int) -> list[int]:
        out = list(range(self.next_tag, self.next_tag + n))
        self.next_tag += n
        return out

    def running(self) -> list[int]:
        return self.rt.table.request_ids()

    # ---- the calls ----------------------------------------------------------------------------------------
    def admit(self, prompt: int) -> int | None:
        if not self.rt.can_admit(prompt):
            return None
        req, self.next_req = self.next_req, self.next_req + 1
        with self.obs.unit(f"VTokenRuntime.admit({req})"):
            self.rt.admit(req)
        self.content[req], self.prefill[req] = self._new_tags(prompt), prompt
        return req

    def admit_sharing(self, source: int, blocks: int, extra: int) -> int | None:
        req = self.next_req
        try:
            with self.obs.unit(f"VTokenRuntime.admit({req}, share_prefix_of={source}, shared_blocks={blocks})",
                               one("T8b", r=source, q=req)):
                self.content[req] = self.content[source][:blocks * self.S] + self._new_tags(extra)
                self.rt.admit(req, share_prefix_of=source, shared_blocks=blocks)
        except (BlockNotOwnedError, AdmissionClosedError, PlanConflictError):
            del self.content[req]
            return None
        self.next_req += 1
        self.prefill[req] = extra
        return req

    def leave(self, req: int, preempt: bool) -> None:
        with self.obs.unit(f"VTokenRuntime.{'preempt' if preempt else 'finish'}({req})", one("T7", r=req)):
            if preempt:
                n = self.rt.preempt(req)
            else:
                self.rt.finish(req)
        self.prefill.pop(req, None)
        if preempt:
            self.content[req] = self.content[req][:n]  # recompute re-prefills exactly what was synced
            self.waiting.append(req)

    def resume(self) -> None:
        req = self.waiting[0]
        n = len(self.content[req])
        if n and not self.rt.can_admit(n):
            return
        self.waiting.pop(0)
        if n:
            with self.obs.unit(f"VTokenRuntime.admit({req}) (resumed)"):
                self.rt.admit(req)
            self.prefill[req] = n

    def step(self) -> bool:
        """One decode iteration: begin_step, the forward's writes, end_step. False if the pool cannot fit it."""
        rt = self.rt
        appends = {r: self.prefill.get(r, 1) for r in self.running()}
        with self.obs.unit("ReclamationManager.settle()"):
            rt.manager.settle()
        need = sum(rt.blocks_to_grow(r, n) for r, n in appends.items())
        if not self.pool.can_allocate(need, Purpose.ADMISSION):
            try:
                with self.obs.unit(f"VTokenRuntime.begin_step({appends}) (must be refused)"):
                    rt.begin_step(appends)
            except PoolExhaustedError:
                return False
            raise AssertionError(f"begin_step({appends}) was accepted without room for its appends")
        for r in appends:
            if r not in self.prefill:
                self.content[r] += self._new_tags(1)
        self.prefill.clear()
        with self.obs.unit(f"VTokenRuntime.begin_step({appends})", syncs):
            inputs = rt.begin_step(appends)
        with self.obs.unit("the forward writes the new tokens"):
            for r, req in inputs.requests.items():
                for tok, slot in zip(req.new_tokens, req.write_slots):
                    self.engine.store.write(slot, self.tag(r, tok))
                    self.pending.pop(slot, None)
            self.pending.clear()
        weights = {r: attention_weights(r, req.read_tokens, rt.table.total_len(r))
                   for r, req in inputs.requests.items()}
        with self.obs.unit("VTokenRuntime.end_step(attention)", evictions):
            rt.end_step(weights)
        return True

    def evict(self, req: int, index: int) -> None:
        live = self.rt.table.live_token_ids(req)
        if live:
            tok = live[index % len(live)]
            with self.obs.unit(f"TokenTable.evict_token({req}, {tok})", evictions):
                self.rt.table.evict_token(req, tok)

    def plan(self, req: int) -> None:
        if req not in self.rt.manager.inflight:
            with self.obs.unit(f"ReclamationManager.plan_request({req})"):
                self.rt.manager.plan_request(req)

    def pack(self, req: int) -> None:
        """A pressure round's pack: densify in place whatever the planner (on the gather path too). Its commit is
        densify's (T4b, then T10 rewinds the cursor)."""
        if req not in self.rt.manager.inflight:
            with self.obs.unit(f"ReclamationManager.plan_pack({req})"):
                self.rt.manager.plan_pack(req)

    def relocate(self, req: int, index: int) -> None:
        """The relocation drill's plan: a block before the cursor's (``index`` mod their number) to a fresh
        block, in place. Its commit is T6 (the destination joins), T4b (the moves), T5 (the source leaves),
        like compact's.
        NOTE: the drill may also move the cursor's own block; the model has no path for that (T5 drops only
        blocks before the cursor's block), so the refinement check covers the other blocks only."""
        n = self.rt.table.write_pos(req) // self.S
        if n and req not in self.rt.manager.inflight:
            with self.obs.unit(f"ReclamationManager.plan_relocation({req}, {index % n})"):
                self.rt.manager.plan_relocation(req, index % n)

    def plan_again(self, req: int) -> None:
        """A second plan for a request with one in flight: refused (I4), changing nothing."""
        if req not in self.rt.manager.inflight:
            return
        try:
            with self.obs.unit(f"ReclamationManager.plan_request({req}) (a plan is in flight: must be refused)"):
                self.rt.manager.plan_request(req)
        except PlanConflictError:
            return
        raise AssertionError(f"plan_request({req}) made a second plan while one is in flight")

    def launch(self) -> None:
        self.rt.manager.launch()

    def settle(self) -> None:
        with self.obs.unit("ReclamationManager.settle()"):
            self.rt.manager.settle()

    def copy_event(self, what: str, index: int, written: int = 0) -> None:
        """Complete, fail (after ``written`` destinations) or order one pending copy."""
        hs = self.engine.pending()
        if what == "fail":
            hs = [h for h in hs if self.engine.poll(h).value == "pending"]
        if not hs:
            return
        h = hs[index % len(hs)]
        with self.obs.unit(f"InMemoryCopyEngine.{what}(copy {h})", copy_writes):
            if what == "complete":
                self.engine.complete(h)
            elif what == "fail":
                self.engine.fail(h, written % (len(self.engine.moves_of(h)) + 1))
            else:
                self.engine.order_before_compute(h)

    def refused_moves(self, req: int, index: int) -> None:
        """``apply_moves`` of a batch whose second move is invalid (the first token moved twice): it must raise
        and change nothing, although its first move alone (into a hole, its K/V never copied) would pass."""
        t = self.rt.table
        live = t.live_token_ids(req)
        holes = self._holes(req)
        if not live or not holes:
            return
        tok = live[index % len(live)]
        slot, dst = t.slot_of(req, tok), holes[index % len(holes)]
        first = Move(tok, slot // self.S, slot % self.S, dst // self.S, dst % self.S)
        try:
            with self.obs.unit(f"TokenTable.apply_moves({req}, [{tuple(first)}, the same token again]) "
                               f"(must be refused)"):
                t.apply_moves(req, [first, first])
        except VTokenError:
            return
        raise AssertionError(f"apply_moves({req}) accepted a batch moving token {tok} twice")

    def _holes(self, req: int) -> list[int]:
        """Slots before the request's cursor that no live token of any request occupies."""
        t, S = self.rt.table, self.S
        blocks = t.block_ids(req)
        return [b * S + o for p in range(t.write_pos(req)) for b, o in [(blocks[p // S], p % S)]
                if not t.occupancy.holders(b * S + o)]


# ---- programs: fixed sequences of calls (tests/test_spec_refinement.py's scenarios) ----------------------------
Program = Callable[[RefinementDriver], None]


def run_program(setup: Setup, program: Program, seed: int = 0) -> RefinementDriver:
    """A fresh driver with ``setup``, after ``program`` ran on it (every unit checked as it went)."""
    d = RefinementDriver(setup, seed)
    program(d)
    return d
