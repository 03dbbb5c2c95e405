"""Bounded model of the Stage 4 copy protocol: the host timeline, the relocation stream, the compute stream.

Bounded model checking in the style of mypyvy's ``bmc``: the state variables are
copied once per step, the transition relation is unrolled N times, and each
claim is checked at every step of every trace of up to N transitions (an
``idle`` transition lets a trace stop early, so "length N" means "length <= N").
A claim holds *for the bound* when the query "a trace reaches a violation at
step k" is unsat for every k < N; otherwise the shortest violating trace (the
lexicographically least one, so the text is stable) is printed, one transition
per line. After a clean BMC the same transition relation is also given to
Spacer as constrained Horn clauses: the outcome is PROVED (every depth) only
when Spacer finds an inductive invariant, and BOUNDED ("N transitions")
when Spacer gives no answer in time or is not asked. ``witness`` shows the behaviours the
proofs quantify over are reachable (no vacuity), and ``successors`` lets the
tests run the core and the model side by side.

The scene (docs/spec.md §State, seed §3.3 Stage 4 and §3.4): one request R, one
token of R that a compact plan moves from block A (the source) into block D
(the destination, reserved from the pool); every other block is "elsewhere".

State per step
  ph       host phase: between steps | slot mapping built (begin_step done) | forward done
  req      R is running (not finished / preempted)
  pl       R's plan: none | copying (in flight) | committed | aborted
  orphan   an orphan record holds blocks of the departed R until its copy settles
  cp       the copy on the relocation stream: not submitted | queued | sources read | done | failed
  ordered  the compute stream waits on the copy's event (EVENT's order_before_compute)
  tbl      where R's token table says the token lives: A | D
  own[X]   who holds block X in {A, D}: free (in the pool) | R's list | the plan (reserved
           destination) | an orphan record | new tokens (reallocated to a writer)
  rd, wr   the slot mapping of the step in progress: where attention reads R's token
           (A | D | nowhere if R is gone) and where new K/V goes (A | D | elsewhere)

Transitions (one per step; the GPU's two streams interleave freely with the host)
  begin_step      host: settle (commit / abort / release orphans), allocate blocks for the
                  step's new tokens (any free block, A and D included, may be handed out),
                  build the slot mapping from the table as it now stands
  forward         compute stream: write the new K/V (wr), attention reads R's token (rd);
                  with the pre-attention wait it cannot start while an ordered copy runs.
                  end_step consumes the forward's attention output, so the forward has
                  finished on the device before end_step (and before any launch)
  end_step        host: optionally plan A->D (D reserved from the pool) and launch the copy
                  on the relocation stream, after the forward; EVENT also orders all later
                  compute after the copy (GPU wait_event), POLL does not
  settle          host, at any point (the simulator and the fuzzer also call it on its own)
  remove_request  host: R finishes or is preempted (on_request_removed)
  copy_read       relocation stream: the copy reads A
  copy_write      relocation stream: the copy writes D; it is complete
  copy_fail       relocation stream: the copy fails (writes nothing more); an ordered copy
                  cannot fail (the in-memory engine refuses to, a CUDA copy has no such outcome)
  idle            nothing happens

Settle follows ReclamationManager.settle: POLL (commit-at-completion) commits when the
engine reports DONE; EVENT (commit-at-launch) commits as soon as the copy is ORDERED,
i.e. at the first settle after the launch, typically before the copy ran; a FAILED copy
aborts (destination freed); a settled copy whose request's layout changed meanwhile is
aborted as stale (the model chooses staleness freely). Commit points R's table at D,
hands D to R's list and frees A. Removal follows on_request_removed: with the copy
settled (DONE, FAILED or ORDERED) everything is freed at once; otherwise A and D are
held by an orphan record until the copy settles.

Claims, each checked for both orderings (obligations()):
  I3  attention never reads D (a destination) before the copy writing it is complete;
  I5  no new K/V lands in A (a source) while the copy reading it is unfinished;
  I6  no new K/V lands in D (a destination, reallocated after an abort, an orphan's
      release or R's departure) while the copy can still write it.
``Protocol`` flags plant the bugs these claims exist to catch (``PLANTED``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

import z3

from .obligations import BOUNDED, COUNTEREXAMPLE, PROVED, UNKNOWN, Obligation, Outcome

DEFAULT_BOUND = 12  # transitions per trace (states 0..N)

# ---- finite domains (z3 Ints constrained to their range) --------------------------------
IDLE, BEGIN, FORWARD, END, SETTLE, REMOVE, COPY_READ, COPY_WRITE, COPY_FAIL = range(9)
ACTIONS = ("idle", "begin_step", "forward", "end_step", "settle", "remove_request",
           "copy_read", "copy_write", "copy_fail")
BETWEEN, BUILT, FORWARDED = range(3)  # host phase
PHASES = ("between steps", "mapping built", "forward done")
FREE, REQ, PLAN, HELD, NEW = range(5)  # block owner
OWNERS = ("free", "R", "plan", "orphan", "new tokens")
P_NONE, COPYING, COMMITTED, ABORTED = range(4)  # plan state
PLANS = ("none", "copying", "committed", "aborted")
NOT_SUBMITTED, QUEUED, SRC_READ, DONE, FAILED = range(5)  # copy on the relocation stream
COPIES = ("not submitted", "queued", "sources read", "done", "failed")
NOWHERE, A, D = range(3)  # locations
LOCS = ("elsewhere", "A", "D")

INVARIANTS = ("I3", "I5", "I6")
CLAIMS = {
    "I3": "attention never reads a slot of the destination D before the copy writing it has completed",
    "I5": "no new K/V lands in the source block A while the copy reading it is unfinished",
    "I6": "no new K/V lands in the destination block D (reallocated after an abort, an orphan's "
          "release or the request's departure) while the copy can still write it",
}


@dataclass(frozen=True)
class Protocol:
    """One variant of the protocol. The defaults are the core as written; the other flags plant bugs."""

    ordering: str = "event"  # "event": commit-at-launch, "poll": commit-at-completion
    gpu_wait: bool = True  # EVENT: the forward waits on the copy's event (pre-attention hook)
    hold_on_removal: bool = True  # on_request_removed holds what a pending copy touches
    commit_before_done: bool = False  # planted: POLL's settle commits a copy that is still PENDING
    free_src_at_launch: bool = False  # planted: the source goes back to the pool when the copy launches
    abort_pending: bool = False  # planted: settle may abort a PENDING copy (a timeout), freeing D
    ordered_may_fail: bool = False  # assumption probe: an ordered copy fails after the commit

    def __post_init__(self) -> None:
        if self.ordering not in ("event", "poll"):
            raise ValueError(f"ordering must be 'event' or 'poll', got {self.ordering!r}")

    @property
    def transition(self) -> str:
        return "protocol commit-at-launch" if self.ordering == "event" else "protocol commit-at-completion"

    @property
    def name(self) -> str:
        base = self.transition
        default = Protocol(ordering=self.ordering)
        changed = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                   if f.name != "ordering" and getattr(self, f.name) != getattr(default, f.name)]
        return base + (f" [{', '.join(changed)}]" if changed else "")


EVENT = Protocol("event")
POLL = Protocol("poll")

# planted bugs: (name, variant, invariants it must break)
PLANTED: dict[str, tuple[Protocol, tuple[str, ...]]] = {
    "event without the pre-attention wait": (replace(EVENT, gpu_wait=False), ("I3", "I5", "I6")),
    "poll commits before the copy completed": (replace(POLL, commit_before_done=True), ("I3", "I5")),
    "source freed at launch": (replace(POLL, free_src_at_launch=True), ("I5",)),
    "poll frees held blocks at request removal": (replace(POLL, hold_on_removal=False), ("I5", "I6")),
    "poll aborts a pending copy (timeout)": (replace(POLL, abort_pending=True), ("I6",)),
    "event: an ordered copy may fail": (replace(EVENT, ordered_may_fail=True), ("I3",)),
}

_STATE = ("ph", "req", "pl", "orphan", "cp", "ordered", "tbl", "ownA", "ownD", "rd", "wr")
_BOOLS = {"req", "orphan", "ordered"}
_DOMAIN = {"ph": 3, "pl": 4, "cp": 5, "tbl": 3, "ownA": 5, "ownD": 5, "rd": 3, "wr": 3}
_CHOICES = ("act", "stale", "timeout", "alloc_a", "alloc_d", "plan")  # per transition


class _S:
    """The state variables (or expressions) of one step."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)

    def with_(self, **kw) -> _S:
        return _S({**self.__dict__, **kw})


class Unrolling:
    """States 0..n and transitions 0..n-1 of one protocol variant, as z3 constraints."""

    def __init__(self, protocol: Protocol, n: int = DEFAULT_BOUND) -> None:
        self.p, self.n = protocol, n
        self.states = [self._fresh_state(i) for i in range(n + 1)]
        self.choices = [self._fresh_choices(i) for i in range(n)]
        self.constraints: list[z3.BoolRef] = [self._init(self.states[0])]
        for i, s in enumerate(self.states):
            self.constraints += self._domain(s)
        for i in range(n):
            self.constraints.append(self._trans(self.states[i], self.choices[i], self.states[i + 1]))

    # ---- variables --------------------------------------------------------------------
    @staticmethod
    def _fresh_state(i: int) -> _S:
        return _S({v: (z3.Bool if v in _BOOLS else z3.Int)(f"{v}@{i}") for v in _STATE})

    @staticmethod
    def _fresh_choices(i: int) -> _S:
        return _S({"act": z3.Int(f"act@{i}"), **{c: z3.Bool(f"{c}@{i}") for c in _CHOICES[1:]}})

    @staticmethod
    def _domain(s: _S) -> list[z3.BoolRef]:
        return [z3.And(0 <= getattr(s, v), getattr(s, v) < k) for v, k in _DOMAIN.items()]

    @staticmethod
    def _init(s: _S) -> z3.BoolRef:
        return z3.And(s.ph == BETWEEN, s.req, s.pl == P_NONE, z3.Not(s.orphan), s.cp == NOT_SUBMITTED,
                      z3.Not(s.ordered), s.tbl == A, s.ownA == REQ, s.ownD == FREE, s.rd == NOWHERE,
                      s.wr == NOWHERE)

    # ---- the host's view of the copy (CopyEngine.poll) ------------------------------------
    @staticmethod
    def _running(s: _S) -> z3.BoolRef:
        return z3.Or(s.cp == QUEUED, s.cp == SRC_READ)

    def _settled(self, s: _S) -> z3.BoolRef:
        """ORDERED, DONE and FAILED are settled (CopyStatus.settled)."""
        return z3.Or(s.cp == DONE, s.cp == FAILED, z3.And(s.ordered, self._running(s)))

    # ---- host actions ----------------------------------------------------------------
    def _settle(self, s: _S, c: _S) -> _S:
        """ReclamationManager.settle: commit or abort the in-flight plan, release a settled orphan."""
        p, running = self.p, self._running(s)
        inflight = s.pl == COPYING
        commit_ok = z3.Or(s.cp == DONE, z3.And(s.ordered, running))  # DONE or ORDERED
        if p.commit_before_done:
            commit_ok = z3.Or(commit_ok, running)
        abort = z3.And(inflight, z3.Or(s.cp == FAILED, z3.And(commit_ok, c.stale),
                                       z3.And(running, c.timeout) if p.abort_pending else False))
        commit = z3.And(inflight, commit_ok, z3.Not(abort))
        release = z3.And(s.orphan, self._settled(s))
        own_a = z3.If(z3.And(commit, s.ownA == REQ), FREE,
                      z3.If(z3.And(release, s.ownA == HELD), FREE, s.ownA))
        own_d = z3.If(z3.And(commit, s.ownD == PLAN), REQ,
                      z3.If(z3.Or(z3.And(abort, s.ownD == PLAN), z3.And(release, s.ownD == HELD)), FREE, s.ownD))
        return s.with_(pl=z3.If(commit, COMMITTED, z3.If(abort, ABORTED, s.pl)), tbl=z3.If(commit, D, s.tbl),
                       ownA=own_a, ownD=own_d, orphan=z3.And(s.orphan, z3.Not(release)))

    def _begin(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        m = self._settle(s, c)
        own_a = z3.If(z3.And(m.ownA == FREE, c.alloc_a), NEW, m.ownA)
        own_d = z3.If(z3.And(m.ownD == FREE, c.alloc_d), NEW, m.ownD)
        wr_ok = z3.Or(t.wr == NOWHERE, z3.And(t.wr == A, own_a == NEW), z3.And(t.wr == D, own_d == NEW))
        return z3.And(s.ph == BETWEEN, wr_ok,
                      self._eq(t, m.with_(ph=BUILT, ownA=own_a, ownD=own_d, rd=z3.If(s.req, m.tbl, NOWHERE)),
                               skip=("wr",)))

    def _forward(self, s: _S, t: _S) -> z3.BoolRef:
        guard = s.ph == BUILT
        if self.p.gpu_wait:  # wait_event: nothing on the compute stream starts before an ordered copy ends
            guard = z3.And(guard, z3.Implies(s.ordered, z3.Or(s.cp == DONE, s.cp == FAILED)))
        return z3.And(guard, self._eq(t, s.with_(ph=FORWARDED, rd=NOWHERE, wr=NOWHERE)))  # mapping consumed

    def _end(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        can_plan = z3.And(s.req, s.pl == P_NONE, s.ownD == FREE)
        own_a = s.ownA
        if self.p.free_src_at_launch:
            own_a = z3.If(z3.And(c.plan, s.ownA == REQ), FREE, s.ownA)
        n = s.with_(ph=BETWEEN, pl=z3.If(c.plan, COPYING, s.pl), ownD=z3.If(c.plan, PLAN, s.ownD), ownA=own_a,
                    cp=z3.If(c.plan, QUEUED, s.cp),
                    ordered=z3.Or(s.ordered, z3.And(c.plan, self.p.ordering == "event")))
        return z3.And(s.ph == FORWARDED, z3.Implies(c.plan, can_plan), self._eq(t, n))

    def _remove(self, s: _S, t: _S) -> z3.BoolRef:
        """on_request_removed: free what no pending copy touches, hold the rest in an orphan record."""
        inflight = s.pl == COPYING
        hold = z3.And(inflight, z3.Not(self._settled(s))) if self.p.hold_on_removal else z3.BoolVal(False)
        own_a = z3.If(s.ownA == REQ, z3.If(hold, HELD, FREE), s.ownA)
        own_d = z3.If(s.ownD == REQ, FREE, z3.If(s.ownD == PLAN, z3.If(hold, HELD, FREE), s.ownD))
        n = s.with_(req=False, pl=z3.If(inflight, ABORTED, s.pl), orphan=z3.Or(s.orphan, hold), ownA=own_a, ownD=own_d)
        return z3.And(s.req, self._eq(t, n))

    # ---- device actions ----------------------------------------------------------------
    def _copy(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        can_fail = self._running(s) if self.p.ordered_may_fail else z3.And(self._running(s), z3.Not(s.ordered))
        return z3.And(
            z3.Implies(c.act == COPY_READ, z3.And(s.cp == QUEUED, self._eq(t, s.with_(cp=SRC_READ)))),
            z3.Implies(c.act == COPY_WRITE, z3.And(s.cp == SRC_READ, self._eq(t, s.with_(cp=DONE)))),
            z3.Implies(c.act == COPY_FAIL, z3.And(can_fail, self._eq(t, s.with_(cp=FAILED)))),
        )

    def _trans(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        a = c.act
        return z3.And(
            0 <= a, a < len(ACTIONS),
            z3.Implies(a == IDLE, self._eq(t, s)),
            z3.Implies(a == BEGIN, self._begin(s, c, t)),
            z3.Implies(a == FORWARD, self._forward(s, t)),
            z3.Implies(a == END, self._end(s, c, t)),
            z3.Implies(a == SETTLE, self._eq(t, self._settle(s, c))),  # the manager may settle at any time
            z3.Implies(a == REMOVE, self._remove(s, t)),
            self._copy(s, c, t),
            # choices only mean something for the action that reads them (readable traces)
            z3.Implies(c.plan, a == END),
            z3.Implies(z3.Or(c.alloc_a, c.alloc_d), a == BEGIN),
            z3.Implies(z3.Or(c.stale, c.timeout), z3.Or(a == BEGIN, a == SETTLE)),
        )

    @staticmethod
    def _eq(t: _S, n: _S, skip: tuple[str, ...] = ()) -> z3.BoolRef:
        return z3.And([getattr(t, v) == getattr(n, v) for v in _STATE if v not in skip])

    # ---- claims ------------------------------------------------------------------------
    def bad(self, invariant: str, i: int) -> z3.BoolRef:
        """Transition i violates the invariant (every claim is about what a forward reads or writes)."""
        s, c = self.states[i], self.choices[i]
        fwd = c.act == FORWARD
        if invariant == "I3":
            return z3.And(fwd, s.rd == D, s.cp != DONE)
        if invariant == "I5":
            return z3.And(fwd, s.wr == A, self._running(s))
        if invariant == "I6":
            return z3.And(fwd, s.wr == D, self._running(s))
        raise ValueError(f"unknown invariant {invariant!r}")

    # ---- counterexamples ---------------------------------------------------------------------
    def explain(self, model: z3.ModelRef, upto: int | None = None, violated: str | None = None) -> str:
        """The trace in ``model`` as one line per transition (idle ones left out), up to transition ``upto``."""
        last = self.n - 1 if upto is None else upto

        def val(e) -> int:
            v = model.eval(e, model_completion=True)
            return bool(z3.is_true(v)) if z3.is_bool(v) else v.as_long()

        st = [{v: val(getattr(s, v)) for v in _STATE} for s in self.states[: last + 2]]
        ch = [{k: val(getattr(c, k)) for k in _CHOICES} for c in self.choices[: last + 1]]
        lines = [f"{self.p.name}: " + (f"{violated} violated after {last + 1} transitions"
                                        if violated else f"trace of {last + 1} transitions")]
        lines.append(f"  init: {_summary(st[0])}")
        for i in range(last + 1):
            a = ch[i]["act"]
            if a == IDLE:
                continue
            line = f"  step {i:2d}: {ACTIONS[a]:<14} {_describe(a, st[i], ch[i], st[i + 1], self.p)}"
            line += f"  [{_summary(st[i + 1])}]"
            if violated and i == last:
                line += f"  <== {violated} VIOLATED: {_why(violated, st[i])}"
            lines.append(line)
        return "\n".join(lines)


# ---- trace text ------------------------------------------------------------------------------
def _summary(s: dict) -> str:
    return (f"plan={PLANS[s['pl']]} copy={COPIES[s['cp']]}{' (ordered)' if s['ordered'] else ''} "
            f"table={LOCS[s['tbl']]} A={OWNERS[s['ownA']]} D={OWNERS[s['ownD']]}"
            f"{' orphan' if s['orphan'] else ''}{'' if s['req'] else ' R gone'}")


def _settle_text(s: dict, c: dict, t: dict) -> str:
    parts = []
    if s["pl"] == COPYING and t["pl"] == COMMITTED:
        parts.append(f"commit while copy {COPIES[s['cp']]} (table -> D, A freed)")
    elif s["pl"] == COPYING and t["pl"] == ABORTED:
        why = "copy failed" if s["cp"] == FAILED else "stale layout" if c["stale"] else "timeout"
        parts.append(f"abort ({why}) while copy {COPIES[s['cp']]}: D freed")
    if s["orphan"] and not t["orphan"]:
        parts.append("orphan's copy settled: held blocks freed")
    return "; ".join(parts) or "nothing to settle"


def _describe(a: int, s: dict, c: dict, t: dict, p: Protocol) -> str:
    if a == BEGIN:
        alloc = [f"{x} reallocated to new tokens" for x, k in (("A", "ownA"), ("D", "ownD"))
                 if s[k] != NEW and t[k] == NEW]
        reads = f"R reads its token at {LOCS[t['rd']]}" if t["rd"] != NOWHERE else "R not in the batch"
        return "; ".join([f"settle: {_settle_text(s, c, t)}", *alloc,
                          f"mapping: {reads}, new K/V -> {LOCS[t['wr']]}"])
    if a == FORWARD:
        wait = "after waiting on the copy's event; " if p.gpu_wait and s["ordered"] else ""
        reads = f"attention reads R's token at {LOCS[s['rd']]}" if s["rd"] != NOWHERE else "R not read"
        writes = f"writes new K/V into {LOCS[s['wr']]}" if s["wr"] != NOWHERE else "writes new K/V elsewhere"
        return f"compute stream {wait}{writes}; {reads} (copy {COPIES[s['cp']]})"
    if a == END:
        if not c["plan"]:
            return "no plan"
        how = "compute stream will wait on its event (EVENT)" if p.ordering == "event" else "polled later (POLL)"
        extra = "; A freed at launch" if s["ownA"] == REQ and t["ownA"] == FREE else ""
        return f"plan A->D (D reserved from the pool); launch the copy on the relocation stream, {how}{extra}"
    if a == SETTLE:
        return _settle_text(s, c, t)
    if a == REMOVE:
        held = [x for x, k in (("A", "ownA"), ("D", "ownD")) if t[k] == HELD and s[k] != HELD]
        freed = [x for x, k in (("A", "ownA"), ("D", "ownD")) if t[k] == FREE and s[k] != FREE]
        return (f"R leaves with copy {COPIES[s['cp']]}: frees {', '.join(freed) or 'nothing of A/D'}"
                + (f", holds {', '.join(held)} in an orphan record" if held else ""))
    if a == COPY_READ:
        return "relocation stream: copy reads A"
    if a == COPY_WRITE:
        return "relocation stream: copy writes D (copy complete)"
    if a == COPY_FAIL:
        return "relocation stream: copy fails (writes nothing more)"
    return ""


def _why(invariant: str, s: dict) -> str:
    if invariant == "I3":
        return f"attention reads D while the copy writing it is {COPIES[s['cp']]}"
    if invariant == "I5":
        return f"new K/V written into A while the copy reading it is {COPIES[s['cp']]}"
    return f"new K/V written into D while the copy writing it is {COPIES[s['cp']]}"


# ---- checking --------------------------------------------------------------------------------
def _solver(u: Unrolling, timeout_ms: int) -> z3.Solver:
    s = z3.Solver()
    s.set("timeout", timeout_ms)
    s.add(u.constraints)
    return s


def _canonical(s: z3.Solver, u: Unrolling, k: int) -> z3.ModelRef:
    """The lexicographically least trace (action, then choices, per transition) among the solver's models.

    z3 may return any of several models; fixing the least one makes printed
    traces identical from run to run (every next state is a function of the
    action and the choices, so these values determine the whole trace).
    """
    for i in range(k + 1):
        c = u.choices[i]
        for e in (c.act, u.states[i + 1].wr, *(getattr(c, x) for x in _CHOICES[1:])):
            cur = s.model().eval(e, model_completion=True)
            if z3.is_bool(e):
                # NOTE: pinned either way: a value left free could change under a later choice's query
                if z3.is_true(cur):
                    s.push()
                    s.add(z3.Not(e))
                    if s.check() != z3.sat:
                        s.pop()
                        s.add(e)
                else:
                    s.add(z3.Not(e))
                s.check()
                continue
            while True:
                s.push()
                s.add(e < cur)
                if s.check() != z3.sat:
                    s.pop()
                    s.add(e == cur)
                    s.check()
                    break
                cur = s.model().eval(e, model_completion=True)
    return s.model()


def check(protocol: Protocol, invariant: str, n: int = DEFAULT_BOUND, timeout_ms: int = 30_000,
          unbounded: bool = True) -> Outcome:
    """BMC: is there a trace of at most n transitions whose k-th transition violates the invariant?

    Deepens k from 0, so a counterexample is a shortest one. When the bounded
    query is unsat for every k and ``unbounded`` is set, the same transition
    relation is also handed to Spacer as constrained Horn clauses. PROVED only
    when Spacer proves it (unsat: an inductive invariant, every depth); a clean
    BMC alone, or one Spacer cannot settle in ``timeout_ms``, is BOUNDED by
    ``n transitions``; a violation Spacer finds deeper is a COUNTEREXAMPLE.
    """
    u = Unrolling(protocol, n)
    s = _solver(u, timeout_ms)
    for k in range(n):
        s.push()
        s.add(u.bad(invariant, k))
        r = s.check()
        if r == z3.sat:
            return Outcome(COUNTEREXAMPLE, u.explain(_canonical(s, u, k), upto=k, violated=invariant))
        if r != z3.unsat:
            return Outcome(UNKNOWN, f"BMC step {k}: {s.reason_unknown()}")
        s.pop()
    detail = f"BMC: no violation in any trace of up to {n} transitions ({n + 1} states)"
    if not unbounded:
        return Outcome(BOUNDED, detail + "; Spacer not asked", bound=f"{n} transitions")
    r = chc_check(protocol, invariant, timeout_ms)
    if r == z3.unsat:
        return Outcome(PROVED, detail + "; unbounded: Spacer (CHC) found an inductive invariant, so no trace "
                                        "of any length violates it")
    if r == z3.sat:
        deeper = check(protocol, invariant, 3 * n, timeout_ms, unbounded=False)
        return Outcome(COUNTEREXAMPLE, deeper.detail if deeper.status == COUNTEREXAMPLE else
                       f"Spacer (CHC) reaches a violation beyond {3 * n} transitions")
    # NOTE: silence is not a proof: without Spacer's invariant only the BMC's bound is claimed
    return Outcome(BOUNDED, detail + "; unbounded: Spacer (CHC) gave no answer", bound=f"{n} transitions")


def chc_check(protocol: Protocol, invariant: str, timeout_ms: int = 30_000) -> z3.CheckSatResult:
    """Unbounded: Reach(init); Reach(s) and T(s, s') imply Reach(s'); query Reach(s) and bad(s). unsat = safe."""
    u = Unrolling(protocol, 1)
    s0, s1 = u.states
    [c0] = u.choices
    sorts = [z3.BoolSort() if v in _BOOLS else z3.IntSort() for v in _STATE]
    reach = z3.Function("Reach", *sorts, z3.BoolSort())
    fp = z3.Fixedpoint()
    fp.set(engine="spacer", timeout=timeout_ms)
    fp.register_relation(reach)
    fp.declare_var(*[getattr(x, v) for x in (s0, s1) for v in _STATE], *[getattr(c0, k) for k in _CHOICES])
    r0, r1 = (reach(*[getattr(x, v) for v in _STATE]) for x in (s0, s1))
    init, *rest = u.constraints
    trans = rest[-1]
    fp.rule(r0, [init, *u._domain(s0)])
    fp.rule(r1, [r0, trans, *u._domain(s1)])
    return fp.query(z3.And(r0, trans, u.bad(invariant, 0)))


# goals for the non-vacuity witnesses: behaviours the proofs must not have ruled out (each about transition k)
def _goals(u: Unrolling, k: int) -> dict[str, z3.BoolRef]:
    s, c, t = u.states[k], u.choices[k], u.states[k + 1]
    fwd, running = c.act == FORWARD, u._running(s)
    return {
        "attention reads D": z3.And(fwd, s.rd == D),
        "new K/V written into A": z3.And(fwd, s.wr == A),
        "new K/V written into D": z3.And(fwd, s.wr == D),
        "D written after an abort": z3.And(fwd, s.wr == D, s.pl == ABORTED, s.req),
        "D written after an orphan's release": z3.And(fwd, s.wr == D, z3.Not(s.orphan),
                                                      z3.Or([u.states[j].orphan for j in range(k)] or [False])),
        "commit while the copy is running": z3.And(s.pl == COPYING, t.pl == COMMITTED, running),
        "forward while the copy is running": z3.And(fwd, running),
        "removal while the copy is running": z3.And(c.act == REMOVE, s.pl == COPYING, running),
    }


WITNESS_GOALS = tuple(_goals(Unrolling(EVENT, 1), 0))


def witness(protocol: Protocol, goal: str, n: int = DEFAULT_BOUND, timeout_ms: int = 30_000) -> str | None:
    """A shortest trace of the variant whose last transition reaches ``goal``, or None.

    The bounded proofs are only as good as the behaviours the model allows; the
    tests use these witnesses to show the model does reach them (no vacuity).
    """
    u = Unrolling(protocol, n)
    s = _solver(u, timeout_ms)
    for k in range(n):
        s.push()
        s.add(_goals(u, k)[goal])
        if s.check() == z3.sat:
            return u.explain(_canonical(s, u, k), upto=k)
        s.pop()
    return None


INITIAL = {"ph": BETWEEN, "req": True, "pl": P_NONE, "orphan": False, "cp": NOT_SUBMITTED, "ordered": False,
           "tbl": A, "ownA": REQ, "ownD": FREE, "rd": NOWHERE, "wr": NOWHERE}


def successors(protocol: Protocol, state: dict, action: str, **choices: bool) -> list[dict]:
    """Every state one ``action`` can lead to from the concrete ``state`` (keys as in ``INITIAL``).

    Unnamed choices (stale, timeout, alloc_a, alloc_d, plan) are False. Used by
    the conformance tests, which run the core and this model side by side.
    """
    u = Unrolling(protocol, 1)
    s0, s1 = u.states
    [c] = u.choices
    solver = z3.Solver()
    solver.add(u.constraints[1:])  # domains and the transition, not the initial state
    solver.add([getattr(s0, v) == state[v] for v in _STATE])
    solver.add(c.act == ACTIONS.index(action))
    solver.add([getattr(c, k) == bool(choices.get(k, False)) for k in _CHOICES[1:]])
    out = []
    while solver.check() == z3.sat:
        m = solver.model()
        nxt = {v: (z3.is_true(m.eval(getattr(s1, v), model_completion=True)) if v in _BOOLS
                   else m.eval(getattr(s1, v), model_completion=True).as_long()) for v in _STATE}
        out.append(nxt)
        solver.add(z3.Or([getattr(s1, v) != nxt[v] for v in _STATE]))
    return out


def obligations(n: int = DEFAULT_BOUND) -> list[Obligation]:
    obs = []
    for p in (EVENT, POLL):
        for inv in INVARIANTS:
            obs.append(Obligation(
                id=f"{inv}/{p.transition.removeprefix('protocol ')}", invariant=inv, transition=p.transition,
                claim=f"{CLAIMS[inv]}, in every interleaving of the host, the relocation stream and the compute "
                      f"stream of up to {n} transitions (one request, one plan, one copy); of any length where "
                      f"Spacer finds an inductive invariant (then proved, else bounded by {n} transitions)",
                check=lambda p=p, inv=inv: check(p, inv, n)))
    return obs


def planted_obligations(n: int = DEFAULT_BOUND) -> list[tuple[str, Obligation]]:
    """The planted bugs as obligations expected to fail (the checks have teeth)."""
    out = []
    for name, (p, invs) in PLANTED.items():
        for inv in invs:
            out.append((name, Obligation(id=f"{inv}/{p.name}", invariant=inv, transition=p.name,
                                         claim=CLAIMS[inv], check=lambda p=p, inv=inv: check(p, inv, n))))
    return out


def explain(model: z3.ModelRef, protocol: Protocol = EVENT, n: int = DEFAULT_BOUND) -> str:
    """Reconstruct the trace of a model of ``Unrolling(protocol, n).constraints`` (the variable names are shared)."""
    return Unrolling(protocol, n).explain(model)


if __name__ == "__main__":  # pragma: no cover
    from .obligations import run

    t0 = time.perf_counter()
    for ob in obligations():
        r = run(ob)
        print(f"{ob.id:<40} {r.outcome.status:<14} {r.seconds:6.2f}s")
    for name, ob in planted_obligations():
        r = run(ob)
        print(f"planted {name} / {ob.invariant}: {r.outcome.status} {r.seconds:.2f}s")
        print(r.outcome.detail)
    print(f"total {time.perf_counter() - t0:.2f}s")
