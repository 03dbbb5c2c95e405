"""Bounded model of the copy protocol with two plans on one relocation stream, in the core's order and in vLLM's.

``protocol_model`` has one request, one plan and one copy, so it cannot hold the
races that need a second copy: a copy queued behind another on the relocation
stream that writes a slot the first one reads, or two copies into one slot. Nor
does it have vLLM's step order, where the scheduler commits a plan a step before
the worker's copy lands. This model has both, with the same method (BMC over
every interleaving of up to N transitions, each claim at every transition, the
shortest and lexicographically least counterexample printed one transition per
line; then Spacer on the same transition relation as Horn clauses: PROVED when
it finds an inductive invariant, BOUNDED by N transitions when it says nothing).

The scene: two requests, R1 with one token in block A and R2 with one token in
block B, and a free block D; every other block is "elsewhere". Each request may
make one compact plan that moves its token from the block its table names into
any free block of A, B, D (reserved from the pool): plan i is copy i. So copy 2
may be queued behind copy 1 and write A, the block copy 1 reads (a chained copy
into one slot), or write D after copy 1 wrote it, once its blocks are free.
Block contents are tracked (R1's token, R2's token, new K/V, zeros, nothing)
so that strict verify's digests can be checked against what a copy moved.

Schedules (``Protocol.schedule``)

"device": the core's runtime on one GPU (``core/runtime.py`` VTokenRuntime.begin_step / end_step, the
  manager ``core/reclamation.py`` ReclamationManager.plan_request / launch / settle / on_request_removed,
  the engine ``integration/device/copy_engine.py`` TorchCopyEngine). As in ``protocol_model``: begin_step settles,
  hands free blocks to new tokens and builds the slot mapping, and its pre-attention hook
  (TorchCopyEngine.before_compute) is where the host first sees an ORDERED copy complete; the forward
  writes new K/V and reads; end_step plans and launches after the forward. Also ``plan_now``: a plan
  made and launched between steps (ReclamationManager.plan_request + launch, which the fuzzer calls,
  fuzz/machine.py VTokenMachine.plan_now), so under EVENT two ordered copies can be queued at once.
  The relocation stream is one CUDA stream: copies run in submission order, each as gather (reads its
  source; the source digest is taken from the gathered values), scatter (writes its destination) and the
  destination digest, then the event (TorchCopyEngine._launch, _digest). Ordering EVENT or POLL.

"vllm": vLLM 0.32 with vtoken's connector, one step n (vllm/v1/core/sched/scheduler.py,
  vllm/v1/worker/gpu_model_runner.py GPUModelRunner.execute_model):
    schedule       Scheduler.schedule: free blocks go to new tokens (and, when the KV cache needs it, onto
                   ``new_block_ids_to_zero``); then VTokenConnector.build_connector_meta ->
                   SchedulerTokens.on_schedule sends the outbox (WorkerCopyEngine.take_outbox: the copies
                   planned after step n-1) and the slot mapping comes from the tables as they now stand
    copy_*         the worker: execute_model -> VTokenConnector.handle_preemptions -> WorkerTokens.apply
                   runs the sent copies, in order, each to completion (TorchCopyEngine.submit + wait)
    update_states  GPUModelRunner._update_states zeroes the step's new blocks (_zero_block_ids)
    forward        writes the step's new K/V, attention reads
    update         Scheduler.update_from_output -> VTokenConnector.update_connector_output ->
                   SchedulerTokens.after_step: plan (compact: destinations from vLLM's pool) and launch
                   into the outbox, where WorkerCopyEngine makes the copy ORDERED at once (EVENT), so the
                   same call's settle commits it: the table points at the destination and the source goes
                   back to vLLM's pool one step before the worker's copy runs
    remove_request a request finishes (update_from_output frees it before update_connector_output) or is
                   preempted or aborted (during schedule, before build_connector_meta):
                   SchedulerTokens.forget drops its unsent copies (WorkerCopyEngine.drop_request)
  vLLM runs one step at a time here (``compat`` refuses async scheduling), so the worker's phases follow
  the scheduler's in lockstep; what interleaves is which blocks go where and who leaves when.

Claims (``INVARIANTS``), at every transition:
  I3  attention never reads a request's token at its plan's destination before the copy writing it is
      complete (device: DONE; vllm: the worker ran it: a copy that ran and failed verification is
      quarantined, integration/vllm/connector.py quarantine_before_outputs);
  I5  nothing (new K/V, vLLM's zeroing of a new block, another copy) is written into a copy's source
      while that copy is unfinished;
  I6  nothing else (new K/V, vLLM's zeroing, a copy submitted after it) is written into a copy's
      destination before that copy's scatter, which would bury it. A copy submitted *before* it does
      not count: its plan lost the block (aborted, orphan released, request gone) before this plan could
      reserve it, so what it writes is nobody's, and the one stream puts this copy's scatter after it;
  V   (device) strict verify's digests of a copy are of the content that copy read: the source digest
      equals what it gathered and the destination digest what its scatter left, not what later work (a
      chained copy, new K/V) wrote into those slots before the host saw the copy complete. The host sees
      it (and verify compares, TorchCopyEngine._complete) in begin_step (settle's polls and the
      pre-attention hook, which look at every copy), in settle (plans in flight, orphans) and in
      on_request_removed (the leaving request's plan).
``Protocol`` flags plant the bugs (``PLANTED``): the late digest of issue #15 (the destination digest taken
when the host first sees the copy complete, TorchCopyEngine before 98d5d85), a late source digest, a second
relocation stream (no FIFO order between copies), and in vLLM the copies run after _update_states or
after the forward while the scheduler has already committed.

Bounds and proofs: BMC to 13 transitions (device, EVENT), 11 (device, POLL, whose forwards overlap the
copies and multiply the interleavings) and 16 (vLLM, four transitions a step), on bit-vectors bit-blasted to
SAT, one query for every depth at once (a shortest trace is searched only once one exists); I3/I5/I6 leave
the contents and digests out (no guard reads them). Spacer then gets the same relation over integers with a
deterministic budget (``SPACER_RLIMIT``): what it proves is PROVED, the rest BOUNDED by the BMC's depth.

Limits: one token per request and one plan per request (a request never plans twice); one spare block, so
under POLL two copies are never in flight at once (the second plan needs a block the first frees only once
its copy is seen done); no stale abort: a compact plan's layout changes only by its own commit (the other
callers of TokenTable.apply_moves / set_layout, vLLM's relocation drill, run with no plan in flight), so
ReclamationManager._commit's staleness check never fires here and a plan aborts only when its copy fails
or its request leaves (densify, made stale by appends, is not in the scene); vLLM's zeroing is assumed on
(more writes: the harder case); a request whose copy failed in vLLM keeps running in the model (quarantine not modelled:
more behaviours, not fewer); densify (moves within a request's own blocks) is not in the scene.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace

import z3

from .obligations import BOUNDED, COUNTEREXAMPLE, PROVED, UNKNOWN, Obligation, Outcome

# transitions per trace, per schedule: as deep as the time budget allows (the BMC's cost grows ~2.5x per
# transition under POLL, whose forwards overlap the copies). Every planted race is found within 9.
BOUNDS = {"device event": 13, "device poll": 11, "vllm event": 16}  # vLLM: 4 transitions per step
# Spacer's budget per obligation, in z3 resource units (deterministic, unlike a timeout: the same claims are
# proved on a loaded machine; ~1 s here). Silence means bounded, so this buys proofs, never soundness
SPACER_RLIMIT = 1_500_000

# ---- finite domains ------------------------------------------------------------------------------------
ACTIONS = ("idle", "begin_step", "forward", "end_step", "plan_now", "settle", "remove_request", "copy_read",
           "copy_write", "copy_digest", "copy_fail", "schedule", "update_states", "update")
(IDLE, BEGIN, FORWARD, END, PLAN_NOW, SETTLE, REMOVE, COPY_READ, COPY_WRITE, COPY_DIGEST, COPY_FAIL, SCHEDULE,
 UPDATE_STATES, UPDATE) = range(len(ACTIONS))
DEVICE_ACTIONS = (IDLE, BEGIN, FORWARD, END, PLAN_NOW, SETTLE, REMOVE, COPY_READ, COPY_WRITE, COPY_DIGEST, COPY_FAIL)
VLLM_ACTIONS = (IDLE, SCHEDULE, COPY_READ, COPY_WRITE, COPY_DIGEST, COPY_FAIL, UPDATE_STATES, FORWARD, UPDATE,
                REMOVE)
BETWEEN, BUILT, ZEROED, FORWARDED = range(4)  # host phase (ZEROED: vLLM's _update_states ran)
A, B, D, NOWHERE = range(4)  # blocks
BLOCKS = (A, B, D)
LOCS = ("A", "B", "D", "elsewhere")
FREE, NEW, R1, R2, PLAN1, PLAN2, HELD1, HELD2 = range(8)  # block owner
OWNERS = ("free", "new tokens", "R1", "R2", "plan 1", "plan 2", "orphan 1", "orphan 2")
P_NONE, COPYING, COMMITTED, ABORTED = range(4)
PLANS = ("none", "copying", "committed", "aborted")
NOT_SUBMITTED, QUEUED, SRC_READ, WRITTEN, DONE, FAILED, DROPPED = range(7)
COPIES = ("not submitted", "queued", "gathered", "scattered", "done", "failed", "dropped")
EMPTY, TOK1, TOK2, NEWKV, ZEROS, NO_DIGEST = range(6)  # block content; NO_DIGEST only for a digest not taken
CONTENTS = ("nothing", "R1's token", "R2's token", "new K/V", "zeros", "no digest")
REQS = (1, 2)


def _req(i):
    return R1 if i == 1 else R2


def _plan(i):
    return PLAN1 if i == 1 else PLAN2


def _held(i):
    return HELD1 if i == 1 else HELD2


INVARIANTS = ("I3", "I5", "I6", "V")
CLAIMS = {
    "I3": "attention never reads a request's token at its plan's destination before the copy writing it "
          "has completed",
    "I5": "nothing (new K/V, vLLM's zeroing of a new block, another copy) is written into a copy's source "
          "block while that copy is unfinished",
    "I6": "nothing else (new K/V, vLLM's zeroing, another copy) is written into a copy's destination block "
          "while that copy is unfinished",
    "V": "strict verify's digests of a copy are of the content the copy read (source: what it gathered; "
         "destination: what its scatter wrote), never of what later work wrote into those slots",
}


@dataclass(frozen=True)
class Protocol:
    """One variant. The defaults are the code as written; the other values plant bugs."""

    schedule: str = "device"  # "device": the core's runtime on a GPU; "vllm": vLLM's scheduler and worker
    ordering: str = "event"  # device: "event" (commit-at-launch) or "poll" (commit-at-completion); vllm: event
    late_digest: str = ""  # planted (device): "destination" (issue #15) or "source": taken when the host sees it done
    fifo: bool = True  # planted False (device): copies on two streams, a later one may run first
    worker_copies_at: str = "top of step"  # planted (vllm): "after update_states" | "after forward"
    drop_on_removal: bool = True  # vllm: a leaving request's unsent copies are dropped (forget)

    def __post_init__(self) -> None:
        if self.schedule not in ("device", "vllm"):
            raise ValueError(f"schedule must be 'device' or 'vllm', got {self.schedule!r}")
        if self.ordering not in ("event", "poll"):
            raise ValueError(f"ordering must be 'event' or 'poll', got {self.ordering!r}")
        if self.schedule == "vllm" and self.ordering != "event":
            raise ValueError("vLLM's scheduler commits at launch (EVENT, scheduler_tokens.reclaim_config)")
        if self.late_digest not in ("", "destination", "source"):
            raise ValueError(f"late_digest must be '', 'destination' or 'source', got {self.late_digest!r}")
        if self.worker_copies_at not in ("top of step", "after update_states", "after forward"):
            raise ValueError(f"worker_copies_at must be 'top of step', 'after update_states' or 'after forward', "
                             f"got {self.worker_copies_at!r}")

    @property
    def transition(self) -> str:
        if self.schedule == "vllm":
            return "two plans, vLLM step order"
        return f"two plans, commit-at-{'launch' if self.ordering == 'event' else 'completion'}"

    @property
    def tag(self) -> str:
        """The obligation id's suffix: ``x2/commit-at-launch``, ``x2/commit-at-completion``, ``x2/vllm``."""
        return "x2/" + ("vllm" if self.schedule == "vllm" else self.transition.removeprefix("two plans, "))

    @property
    def name(self) -> str:
        default = Protocol(self.schedule, self.ordering)
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if f.name not in ("schedule", "ordering") and getattr(self, f.name) != getattr(default, f.name)]
        return f"protocol {self.transition}" + (f" [{', '.join(changed)}]" if changed else "")

    @property
    def bound(self) -> int:
        return BOUNDS[f"{self.schedule} {self.ordering}"]

    @property
    def invariants(self) -> tuple[str, ...]:
        # vLLM's worker digests inside submit and compares in the wait right after (WorkerTokens._copy): nothing
        # runs in between, so V is a device claim
        return INVARIANTS if self.schedule == "device" else INVARIANTS[:3]


EVENT = Protocol("device", "event")
POLL = Protocol("device", "poll")
VLLM = Protocol("vllm")
VARIANTS = (EVENT, POLL, VLLM)

# planted bugs: (name, variant, invariants it must break)
PLANTED: dict[str, tuple[Protocol, tuple[str, ...]]] = {
    "late destination digest (issue #15)": (replace(EVENT, late_digest="destination"), ("V",)),
    "late source digest": (replace(EVENT, late_digest="source"), ("V",)),
    "second relocation stream (no FIFO)": (replace(EVENT, fifo=False), ("I5",)),
    "vllm: copies after update_states": (replace(VLLM, worker_copies_at="after update_states"), ("I5",)),
    "vllm: copies after the forward (commit before copy)": (replace(VLLM, worker_copies_at="after forward"),
                                                            ("I3", "I5")),
}

_PER_REQ = ("req", "tbl", "pl", "src", "dst", "cp", "ord", "orph", "got", "dd", "seen", "sent", "rd")
_PER_BLOCK = ("own", "cont", "fresh")
_STATE = ("ph", "first", "wr", *(f"{v}{i}" for i in REQS for v in _PER_REQ),
          *(f"{v}{LOCS[x]}" for x in BLOCKS for v in _PER_BLOCK))
_BOOLS = {f"{v}{i}" for i in REQS for v in ("req", "ord", "orph", "seen", "sent")} | {f"fresh{LOCS[x]}" for x in BLOCKS}
_RANGE = {"ph": 4, "first": 3, "wr": 4, **{f"{v}{i}": k for i in REQS for v, k in
                                          (("tbl", 3), ("pl", 4), ("src", 4), ("dst", 4), ("cp", 7), ("got", 5),
                                           ("dd", 6), ("rd", 4))},
          **{f"{v}{LOCS[x]}": k for x in BLOCKS for v, k in (("own", 8), ("cont", 5))}}
# what only strict verify's digests read: left out of the I3/I5/I6 queries (cone of influence; no guard reads them)
_CONTENT = {f"{v}{i}" for i in REQS for v in ("got", "dd", "seen")} | {f"cont{LOCS[x]}" for x in BLOCKS}
_CHOICES = ("act", "who", "plan1", "plan2", "to1", "to2", "allocA", "allocB", "allocD")
_CHOICE_INTS = {"act", "who", "to1", "to2"}
_WIDTH = 4  # bits of every finite-domain variable (the largest domain, the actions, has 14 values)


class _S:
    """The variables (or expressions) of one state, or one transition's choices."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)

    def with_(self, **kw) -> _S:
        return _S({**self.__dict__, **kw})

    def r(self, v: str, i: int):
        return getattr(self, f"{v}{i}")

    def b(self, v: str, x: int):
        return getattr(self, f"{v}{LOCS[x]}")

    def at(self, v: str, loc):
        """Per-block variable ``v`` at the (symbolic) block ``loc``."""
        e = self.b(v, D)  # NOTE: callers pass a block (a copy's ends, a plan's target), never NOWHERE
        for x in (A, B):
            e = z3.If(loc == x, self.b(v, x), e)
        return e


def _const(like, v: int):
    """The constant ``v`` in the sort of ``like`` (for an If whose branches are both constants)."""
    return z3.BitVecVal(v, like.size()) if z3.is_bv(like) else z3.IntVal(v)


def _running(cp) -> z3.BoolRef:
    return z3.Or(cp == QUEUED, cp == SRC_READ, cp == WRITTEN)


class Unrolling:
    """States 0..n and transitions 0..n-1 of one variant, as z3 constraints."""

    def __init__(self, protocol: Protocol, n: int | None = None, bitvectors: bool = True,
                 content: bool = True) -> None:
        # NOTE: bit-vectors for the BMC (bit-blasted, many times faster on these small domains), integers for
        # Spacer (whose engine is linear arithmetic); the constraints are the same either way. Without
        # ``content`` the block contents and digests are constants no transition updates: no guard reads them,
        # so the control behaviours (all I3, I5 and I6 talk about) are exactly those of the full model
        self.p, self.n, self.bv = protocol, protocol.bound if n is None else n, bitvectors
        self.vars = tuple(v for v in _STATE if content or v not in _CONTENT)
        self.states = [self._fresh_state(i) for i in range(self.n + 1)]
        self.choices = [self._fresh_choices(i) for i in range(self.n)]
        self.init = self._init(self.states[0])
        self.domains = [c for s in self.states for c in self._domain(s)]
        self.trans = [self._trans(self.states[i], self.choices[i], self.states[i + 1]) for i in range(self.n)]

    @property
    def constraints(self) -> list[z3.BoolRef]:
        return [self.init, *self.domains, *self.trans]

    # ---- variables ----------------------------------------------------------------------------------
    def _int(self, name: str):
        return z3.BitVec(name, _WIDTH) if self.bv else z3.Int(name)

    def below(self, e, k: int) -> z3.BoolRef:
        """0 <= e < k."""
        return z3.ULT(e, k) if self.bv else z3.And(0 <= e, e < k)

    def _fresh_state(self, i: int) -> _S:
        def var(v: str):
            if v not in self.vars:
                return z3.BoolVal(False) if v in _BOOLS else (z3.BitVecVal(0, _WIDTH) if self.bv else z3.IntVal(0))
            return z3.Bool(f"{v}@{i}") if v in _BOOLS else self._int(f"{v}@{i}")

        return _S({v: var(v) for v in _STATE})

    def _fresh_choices(self, i: int) -> _S:
        return _S({k: self._int(f"{k}@{i}") if k in _CHOICE_INTS else z3.Bool(f"{k}@{i}") for k in _CHOICES})

    def _domain(self, s: _S) -> list[z3.BoolRef]:
        return [self.below(getattr(s, v), k) for v, k in _RANGE.items() if v in self.vars]

    def _init(self, s: _S) -> z3.BoolRef:
        values = {"ph": BETWEEN, "first": 0, "wr": NOWHERE, "tbl1": A, "tbl2": B, "ownA": R1, "ownB": R2,
                  "ownD": FREE, "contA": TOK1, "contB": TOK2, "contD": EMPTY,
                  **{f"fresh{LOCS[x]}": False for x in BLOCKS},
                  **{f"{v}{i}": x for i in REQS for v, x in (
                      ("req", True), ("pl", P_NONE), ("src", NOWHERE), ("dst", NOWHERE), ("cp", NOT_SUBMITTED),
                      ("ord", False), ("orph", False), ("got", EMPTY), ("dd", NO_DIGEST), ("seen", False),
                      ("sent", False), ("rd", NOWHERE))}}
        return z3.And([getattr(s, v) == x for v, x in values.items() if v in self.vars])

    # ---- shared pieces -------------------------------------------------------------------------------
    @staticmethod
    def _settled(s: _S, i: int) -> z3.BoolRef:
        """CopyStatus.settled: DONE, FAILED, or ORDERED (ordered and still running)."""
        cp = s.r("cp", i)
        return z3.Or(cp == DONE, cp == FAILED, cp == DROPPED, z3.And(s.r("ord", i), _running(cp)))

    def _fifo_ok(self, s: _S, k: int) -> z3.BoolRef:
        """One relocation stream: copy k starts only once the copy submitted before it has finished."""
        if not self.p.fifo:
            return z3.BoolVal(True)
        j = 3 - k
        return z3.Not(z3.And(s.first == j, _running(s.r("cp", j))))

    def _plans(self, s: _S, c: _S, commit: bool) -> tuple[z3.BoolRef, dict]:
        """Plan (and launch) the chosen requests: each moves its token into the chosen free block.

        ``commit``: vLLM's after_step, whose settle commits the ORDERED copy in the same call."""
        ok, upd = [], {}
        for i in REQS:
            plan, to = c.r("plan", i), c.r("to", i)
            ok.append(z3.Implies(plan, z3.And(s.r("req", i), s.r("pl", i) == P_NONE, to != NOWHERE,
                                              s.at("own", to) == FREE)))
            upd[f"pl{i}"] = z3.If(plan, COMMITTED if commit else COPYING, s.r("pl", i))
            upd[f"src{i}"] = z3.If(plan, s.r("tbl", i), s.r("src", i))
            upd[f"dst{i}"] = z3.If(plan, to, s.r("dst", i))
            upd[f"cp{i}"] = z3.If(plan, QUEUED, s.r("cp", i))
            upd[f"ord{i}"] = z3.Or(s.r("ord", i), z3.And(plan, self.p.ordering == "event"))
            if commit:
                upd[f"tbl{i}"] = z3.If(plan, to, s.r("tbl", i))
        ok.append(z3.Implies(z3.And(c.plan1, c.plan2), c.to1 != c.to2))
        for x in BLOCKS:
            o = s.b("own", x)
            for i in REQS:
                plan = z3.And(c.r("plan", i), c.r("to", i) == x)
                o = z3.If(plan, _req(i) if commit else _plan(i), o)
                if commit:  # the source goes back to the pool at the commit
                    o = z3.If(z3.And(c.r("plan", i), s.b("own", x) == _req(i)), FREE, o)
            upd[f"own{LOCS[x]}"] = o
        upd["first"] = z3.If(s.first != 0, s.first, z3.If(c.plan1, 1, z3.If(c.plan2, 2, _const(s.first, 0))))
        return z3.And(ok), upd

    def _allocate(self, m: _S, c: _S, t: _S) -> tuple[dict, z3.BoolRef]:
        """Free blocks the allocator hands to new tokens; the step's new K/V goes to one of them or elsewhere."""
        upd = {f"own{LOCS[x]}": z3.If(z3.And(m.b("own", x) == FREE, c.b("alloc", x)), NEW, m.b("own", x))
               for x in BLOCKS}
        wr_ok = z3.Or(t.wr == NOWHERE, *[z3.And(t.wr == x, upd[f"own{LOCS[x]}"] == NEW) for x in BLOCKS])
        return upd, wr_ok

    @staticmethod
    def _mapping(m: _S) -> dict:
        return {f"rd{i}": z3.If(m.r("req", i), m.r("tbl", i), NOWHERE) for i in REQS}

    @staticmethod
    def _write(s: _S, loc, value) -> dict:
        return {f"cont{LOCS[x]}": z3.If(loc == x, value, s.b("cont", x)) for x in BLOCKS}

    # ---- device: the host ------------------------------------------------------------------------------
    def observes(self, s: _S, c: _S, i: int) -> z3.BoolRef:
        """The host sees copy i complete in this transition, and verify compares its digests (TorchCopyEngine
        ._complete): begin_step's settle and pre-attention hook look at every copy, settle polls the plans in
        flight and the orphans, on_request_removed polls the leaving request's plan."""
        if self.p.schedule != "device":
            return z3.BoolVal(False)
        new = z3.And(s.r("cp", i) == DONE, z3.Not(s.r("seen", i)))
        polled = z3.Or(s.r("pl", i) == COPYING, s.r("orph", i))
        return z3.And(new, z3.Or(c.act == BEGIN, z3.And(c.act == SETTLE, polled),
                                 z3.And(c.act == REMOVE, c.who == i, s.r("pl", i) == COPYING)))

    def _seen(self, s: _S, c: _S) -> dict:
        return {f"seen{i}": z3.Or(s.r("seen", i), self.observes(s, c, i)) for i in REQS}

    def _settle(self, s: _S, c: _S) -> _S:
        """ReclamationManager.settle: commit DONE or ORDERED copies, abort FAILED ones,
        release orphans whose copy settled."""
        commit, abort, release, upd = {}, {}, {}, {}
        for i in REQS:
            cp, inflight = s.r("cp", i), s.r("pl", i) == COPYING
            ok = z3.Or(cp == DONE, z3.And(s.r("ord", i), _running(cp)))
            abort[i] = z3.And(inflight, cp == FAILED)  # NOTE: never stale in the scene (module docstring)
            commit[i] = z3.And(inflight, ok, z3.Not(abort[i]))
            release[i] = z3.And(s.r("orph", i), self._settled(s, i))
            upd[f"pl{i}"] = z3.If(commit[i], COMMITTED, z3.If(abort[i], ABORTED, s.r("pl", i)))
            upd[f"tbl{i}"] = z3.If(commit[i], s.r("dst", i), s.r("tbl", i))
            upd[f"orph{i}"] = z3.And(s.r("orph", i), z3.Not(release[i]))
        for x in BLOCKS:
            o, e = s.b("own", x), s.b("own", x)
            for i in REQS:
                # NOTE: a request owns one block of the scene, its token's: the commit frees it (the source)
                e = z3.If(z3.And(o == _req(i), commit[i]), FREE, e)
                e = z3.If(z3.And(o == _plan(i), commit[i]), _req(i), e)
                e = z3.If(z3.And(o == _plan(i), abort[i]), FREE, e)
                e = z3.If(z3.And(o == _held(i), release[i]), FREE, e)
            upd[f"own{LOCS[x]}"] = e
        return s.with_(**upd, **self._seen(s, c))

    def _begin(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        m = self._settle(s, c)
        own, wr_ok = self._allocate(m, c, t)
        n = m.with_(ph=BUILT, **own, **self._mapping(m))
        return z3.And(s.ph == BETWEEN, wr_ok, self._eq(t, n, skip=("wr",)))

    def _device_forward(self, s: _S, t: _S) -> z3.BoolRef:
        guard = s.ph == BUILT
        if self.p.ordering == "event":  # before_compute: the compute stream waits on every ORDERED copy
            guard = z3.And(guard, *[z3.Not(z3.And(s.r("ord", i), _running(s.r("cp", i)))) for i in REQS])
        n = s.with_(ph=FORWARDED, wr=NOWHERE, rd1=NOWHERE, rd2=NOWHERE, **self._write(s, s.wr, NEWKV))
        return z3.And(guard, self._eq(t, n))

    def _end(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        ok, upd = self._plans(s, c, commit=False)
        return z3.And(s.ph == FORWARDED, ok, self._eq(t, s.with_(ph=BETWEEN, **upd)))

    def _plan_now(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        ok, upd = self._plans(s, c, commit=False)
        return z3.And(s.ph == BETWEEN, z3.Or(c.plan1, c.plan2), z3.Not(z3.And(c.plan1, c.plan2)), ok,
                      self._eq(t, s.with_(**upd)))

    def _device_remove(self, s: _S, c: _S, t: _S, i: int) -> z3.BoolRef:
        """on_request_removed: free what no pending copy touches, hold the rest in an orphan record."""
        inflight = s.r("pl", i) == COPYING
        hold = z3.And(inflight, z3.Not(self._settled(s, i)))
        upd = {f"own{LOCS[x]}": z3.If(z3.Or(s.b("own", x) == _req(i), s.b("own", x) == _plan(i)),
                                      z3.If(hold, _held(i), _const(s.ownA, FREE)), s.b("own", x)) for x in BLOCKS}
        n = s.with_(**{f"req{i}": False, f"pl{i}": z3.If(inflight, ABORTED, s.r("pl", i)),
                       f"orph{i}": z3.Or(s.r("orph", i), hold)}, **upd, **self._seen(s, c))
        return z3.And(s.r("req", i), self._eq(t, n))

    # ---- vLLM: scheduler and worker -------------------------------------------------------------------
    def _copy_phase(self) -> int:
        return {"top of step": BUILT, "after update_states": ZEROED, "after forward": FORWARDED}[
            self.p.worker_copies_at]

    def _worker_idle(self, s: _S) -> z3.BoolRef:
        """Every copy sent to the worker this step has run (WorkerTokens.apply waits for each)."""
        return z3.And([z3.Implies(s.r("sent", i), z3.Not(_running(s.r("cp", i)))) for i in REQS])

    def _schedule(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        own, wr_ok = self._allocate(s, c, t)
        fresh = {f"fresh{LOCS[x]}": z3.And(s.b("own", x) == FREE, c.b("alloc", x)) for x in BLOCKS}
        sent = {f"sent{i}": z3.Or(s.r("sent", i), s.r("cp", i) == QUEUED) for i in REQS}  # take_outbox
        n = s.with_(ph=BUILT, **own, **fresh, **sent, **self._mapping(s))
        return z3.And(s.ph == BETWEEN, wr_ok, self._eq(t, n, skip=("wr",)))

    def _update_states(self, s: _S, t: _S) -> z3.BoolRef:
        guard = s.ph == BUILT
        if self._copy_phase() == BUILT:
            guard = z3.And(guard, self._worker_idle(s))
        zeroed = {f"cont{LOCS[x]}": z3.If(s.b("fresh", x), ZEROS, s.b("cont", x)) for x in BLOCKS}
        n = s.with_(ph=ZEROED, **zeroed, **{f"fresh{LOCS[x]}": False for x in BLOCKS})
        return z3.And(guard, self._eq(t, n))

    def _vllm_forward(self, s: _S, t: _S) -> z3.BoolRef:
        guard = s.ph == ZEROED
        if self._copy_phase() != FORWARDED:
            guard = z3.And(guard, self._worker_idle(s))
        n = s.with_(ph=FORWARDED, wr=NOWHERE, rd1=NOWHERE, rd2=NOWHERE, **self._write(s, s.wr, NEWKV))
        return z3.And(guard, self._eq(t, n))

    def _update(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        ok, upd = self._plans(s, c, commit=True)
        return z3.And(s.ph == FORWARDED, self._worker_idle(s), ok, self._eq(t, s.with_(ph=BETWEEN, **upd)))

    def _vllm_remove(self, s: _S, t: _S, i: int) -> z3.BoolRef:
        """SchedulerTokens.forget (no plan is ever in flight across steps: after_step commits at once)."""
        upd = {f"own{LOCS[x]}": z3.If(s.b("own", x) == _req(i), FREE, s.b("own", x)) for x in BLOCKS}
        cp = s.r("cp", i)
        if self.p.drop_on_removal:  # WorkerCopyEngine.drop_request: an unsent copy never runs
            cp = z3.If(z3.And(cp == QUEUED, z3.Not(s.r("sent", i))), DROPPED, cp)
        when = z3.Or(s.ph == BETWEEN, z3.And(s.ph == FORWARDED, self._worker_idle(s)))
        return z3.And(s.r("req", i), when, self._eq(t, s.with_(**{f"req{i}": False, f"cp{i}": cp}, **upd)))

    # ---- the copies (relocation stream, or vLLM's worker) --------------------------------------------------
    def _copy(self, s: _S, c: _S, t: _S, k: int) -> z3.BoolRef:
        cp, a = s.r("cp", k), c.act
        if self.p.schedule == "vllm":
            where = z3.And(s.ph == self._copy_phase(), s.r("sent", k))
            can_fail = _running(cp)  # the worker reports a copy that failed (or failed verification)
        else:
            where = z3.BoolVal(True)
            can_fail = z3.And(_running(cp), z3.Not(s.r("ord", k)))  # an ordered copy cannot fail
        late_dst = self.p.late_digest == "destination"
        dst_digest = NO_DIGEST if late_dst else s.at("cont", s.r("dst", k))  # right after the scatter
        return z3.Or(
            z3.And(a == COPY_READ, cp == QUEUED, where, self._fifo_ok(s, k),
                   self._eq(t, s.with_(**{f"cp{k}": SRC_READ, f"got{k}": s.at("cont", s.r("src", k))}))),
            z3.And(a == COPY_WRITE, cp == SRC_READ, where,
                   self._eq(t, s.with_(**{f"cp{k}": WRITTEN}, **self._write(s, s.r("dst", k), s.r("got", k))))),
            z3.And(a == COPY_DIGEST, cp == WRITTEN, where,
                   self._eq(t, s.with_(**{f"cp{k}": DONE, f"dd{k}": dst_digest}))),
            z3.And(a == COPY_FAIL, can_fail, where, self._eq(t, s.with_(**{f"cp{k}": FAILED}))),
        )

    # ---- the transition relation --------------------------------------------------------------------------
    def _trans(self, s: _S, c: _S, t: _S) -> z3.BoolRef:
        a, vllm = c.act, self.p.schedule == "vllm"
        allowed = VLLM_ACTIONS if vllm else DEVICE_ACTIONS
        per_who = [z3.And(c.who == k, z3.Or(self._copy(s, c, t, k),
                                            z3.And(a == REMOVE, self._vllm_remove(s, t, k) if vllm
                                                   else self._device_remove(s, c, t, k)))) for k in REQS]
        steps = [z3.And(a == IDLE, self._eq(t, s)), *per_who]
        if vllm:
            steps += [z3.And(a == SCHEDULE, self._schedule(s, c, t)),
                      z3.And(a == UPDATE_STATES, self._update_states(s, t)),
                      z3.And(a == FORWARD, self._vllm_forward(s, t)), z3.And(a == UPDATE, self._update(s, c, t))]
        else:
            steps += [z3.And(a == BEGIN, self._begin(s, c, t)), z3.And(a == FORWARD, self._device_forward(s, t)),
                      z3.And(a == END, self._end(s, c, t)), z3.And(a == PLAN_NOW, self._plan_now(s, c, t)),
                      z3.And(a == SETTLE, self._eq(t, self._settle(s, c)))]
        uses_who = z3.Or(a == REMOVE, a == COPY_READ, a == COPY_WRITE, a == COPY_DIGEST, a == COPY_FAIL)
        plans = (END, PLAN_NOW, UPDATE)
        return z3.And(
            z3.Or([a == x for x in allowed]), z3.Or(steps),
            # a choice only means something for the action that reads it (stable, readable traces)
            z3.If(uses_who, z3.Or(c.who == 1, c.who == 2), c.who == 0),
            *[z3.Implies(c.r("plan", i), z3.Or([a == x for x in plans])) for i in REQS],
            *[z3.Implies(z3.Not(c.r("plan", i)), c.r("to", i) == NOWHERE) for i in REQS],
            *[self.below(c.r("to", i), 4) for i in REQS],
            self.below(c.act, len(ACTIONS)),
            *[z3.Implies(c.b("alloc", x), z3.Or(a == BEGIN, a == SCHEDULE)) for x in BLOCKS],
        )

    def _eq(self, t: _S, n: _S, skip: tuple[str, ...] = ()) -> z3.BoolRef:
        return z3.And([getattr(t, v) == getattr(n, v) for v in self.vars if v not in skip])

    # ---- claims ---------------------------------------------------------------------------------------
    def writes(self, s: _S, c: _S) -> list[tuple[z3.BoolRef, object, int]]:
        """(happens, block, writer copy or 0) for every write transition ``c`` makes from ``s``."""
        out = [(c.act == FORWARD, s.wr, 0)]
        out += [(z3.And(c.act == UPDATE_STATES, s.b("fresh", x)), x, 0) for x in BLOCKS]
        out += [(z3.And(c.act == COPY_WRITE, c.who == k), s.r("dst", k), k) for k in REQS]
        return out

    def violation(self, invariant: str, s: _S, c: _S) -> z3.BoolRef:
        """Transition ``c`` from ``s`` violates the invariant."""
        if invariant == "I3":
            pending = ((lambda cp: _running(cp)) if self.p.schedule == "vllm"
                       else (lambda cp: z3.And(cp != NOT_SUBMITTED, cp != DONE, cp != DROPPED)))
            return z3.And(c.act == FORWARD, z3.Or([z3.And(s.r("rd", i) == s.r("dst", i), s.r("rd", i) != NOWHERE,
                                                          pending(s.r("cp", i))) for i in REQS]))
        if invariant == "I5":  # before the copy is finished: its gather must see the source as planned
            return z3.Or([z3.And(happens, _running(s.r("cp", k)), s.r("src", k) == loc)
                          for happens, loc, by in self.writes(s, c) for k in REQS if by != k])
        if invariant == "I6":
            # before the copy's scatter, which would bury the other write. NOTE: a copy submitted before copy k
            # is left out: its plan lost the block before k's plan could reserve it (aborted, orphan released,
            # request gone), so what it writes is nobody's, and one stream puts k's scatter after it
            return z3.Or([z3.And(happens, z3.Or(s.r("cp", k) == QUEUED, s.r("cp", k) == SRC_READ),
                                 s.r("dst", k) == loc, z3.BoolVal(True) if by == 0 else s.first == k)
                          for happens, loc, by in self.writes(s, c) for k in REQS if by != k])
        if invariant == "V":
            return z3.Or([z3.And(self.observes(s, c, k), z3.Or(self.src_digest(s, k) != s.r("got", k),
                                                                self.dst_digest(s, k) != s.r("got", k)))
                          for k in REQS])
        raise ValueError(f"unknown invariant {invariant!r}")

    def src_digest(self, s: _S, k: int):
        """What verify compares as copy k's source: the gathered values, or (late) the source slots now."""
        return s.at("cont", s.r("src", k)) if self.p.late_digest == "source" else s.r("got", k)

    def dst_digest(self, s: _S, k: int):
        return s.at("cont", s.r("dst", k)) if self.p.late_digest == "destination" else s.r("dd", k)

    def bad(self, invariant: str, i: int) -> z3.BoolRef:
        return self.violation(invariant, self.states[i], self.choices[i])

    # ---- counterexamples -------------------------------------------------------------------------------
    def values(self, model: z3.ModelRef, upto: int) -> tuple[list[dict], list[dict]]:
        def val(e):
            v = model.eval(e, model_completion=True)
            return bool(z3.is_true(v)) if z3.is_bool(v) else v.as_long()

        st = [{v: val(getattr(s, v)) for v in _STATE} for s in self.states[: upto + 2]]
        ch = [{k: val(getattr(c, k)) for k in _CHOICES} for c in self.choices[: upto + 1]]
        return st, ch

    def explain(self, model: z3.ModelRef, upto: int | None = None, violated: str | None = None) -> str:
        """The trace in ``model``, one line per transition (idle ones left out), up to transition ``upto``."""
        last = self.n - 1 if upto is None else upto
        st, ch = self.values(model, last)
        lines = [f"{self.p.name}: " + (f"{violated} violated after {last + 1} transitions" if violated
                                        else f"trace of {last + 1} transitions"),
                 f"  init: {_summary(st[0])}"]
        for i in range(last + 1):
            a = ch[i]["act"]
            if a == IDLE:
                continue
            line = f"  step {i:2d}: {ACTIONS[a]:<14} {_describe(self.p, st[i], ch[i], st[i + 1])}"
            line += f"  [{_summary(st[i + 1])}]"
            if violated and i == last:
                line += f"  <== {violated} VIOLATED: {_why(self.p, violated, st[i], ch[i], st[i + 1])}"
            lines.append(line)
        return "\n".join(lines)


# ---- trace text ----------------------------------------------------------------------------------------------
def _copy_summary(s: dict, i: int) -> str:
    if s[f"cp{i}"] == NOT_SUBMITTED:
        return "no plan" if s[f"pl{i}"] == P_NONE else f"plan {PLANS[s[f'pl{i}']]}"
    ordered = ", ordered" if s[f"ord{i}"] and s[f"cp{i}"] in (QUEUED, SRC_READ, WRITTEN) else ""
    return (f"plan {i} {LOCS[s[f'src{i}']]}->{LOCS[s[f'dst{i}']]} {PLANS[s[f'pl{i}']]}, "
            f"copy {i} {COPIES[s[f'cp{i}']]}{ordered}")


def _summary(s: dict) -> str:
    reqs = " | ".join(f"R{i} {'at ' + LOCS[s[f'tbl{i}']] if s[f'req{i}'] else 'gone'}: {_copy_summary(s, i)}"
                      f"{' (orphan)' if s[f'orph{i}'] else ''}" for i in REQS)
    blocks = ", ".join(f"{LOCS[x]} {OWNERS[s['own' + LOCS[x]]]} ({CONTENTS[s['cont' + LOCS[x]]]})" for x in BLOCKS)
    return f"{reqs} | {blocks}"


def _settle_text(s: dict, t: dict, c: dict) -> list[str]:
    out = []
    for i in REQS:
        if s[f"pl{i}"] == COPYING and t[f"pl{i}"] == COMMITTED:
            out.append(f"commit plan {i} while copy {i} {COPIES[s[f'cp{i}']]} "
                       f"(R{i}'s table -> {LOCS[s[f'dst{i}']]}, {LOCS[s[f'src{i}']]} freed)")
        elif s[f"pl{i}"] == COPYING and t[f"pl{i}"] == ABORTED:
            out.append(f"abort plan {i} (copy {i} failed): {LOCS[s[f'dst{i}']]} freed")
        if s[f"orph{i}"] and not t[f"orph{i}"]:
            out.append(f"orphan {i}'s copy settled: its held blocks freed")
    return out


def _verify_text(p: Protocol, s: dict, t: dict) -> list[str]:
    out = []
    for k in REQS:
        if t[f"seen{k}"] and not s[f"seen{k}"]:
            src = CONTENTS[s["cont" + LOCS[s[f"src{k}"]]] if p.late_digest == "source" else s[f"got{k}"]]
            dst = CONTENTS[s["cont" + LOCS[s[f"dst{k}"]]] if p.late_digest == "destination" else s[f"dd{k}"]]
            late = f" ({p.late_digest} digested now, late)" if p.late_digest else ""
            out.append(f"host sees copy {k} complete: verify compares source digest of {src} with destination "
                       f"digest of {dst}{late}")
    return out


def _mapping_text(t: dict) -> str:
    reads = ", ".join(f"R{i} reads its token at {LOCS[t[f'rd{i}']]}" for i in REQS if t[f"rd{i}"] != NOWHERE)
    return f"mapping: {reads or 'no request read'}, new K/V -> {LOCS[t['wr']]}"


def _alloc_text(s: dict, t: dict, vllm: bool) -> list[str]:
    zero = " (on vLLM's zero list)" if vllm else ""
    return [f"{LOCS[x]} handed to new tokens{zero}" for x in BLOCKS
            if s["own" + LOCS[x]] != NEW and t["own" + LOCS[x]] == NEW]


def _plan_text(p: Protocol, s: dict, c: dict) -> list[str]:
    out = []
    for i in REQS:
        if not c[f"plan{i}"]:
            continue
        src, dst = LOCS[s[f"tbl{i}"]], LOCS[c[f"to{i}"]]
        if p.schedule == "vllm":
            out.append(f"plan {i}: R{i}'s token {src}->{dst} ({dst} from vLLM's pool), copy {i} into the outbox "
                       f"(ORDERED), committed at once: R{i}'s table -> {dst}, {src} back to vLLM's pool")
            continue
        other = 3 - i
        running = s[f"cp{other}"] in (QUEUED, SRC_READ, WRITTEN)
        stream = ("on the relocation stream" if p.fifo or not running else
                  f"on a second relocation stream (not ordered after copy {other})")
        behind = f" behind copy {other}" if running and p.fifo else ""
        how = "ordered before compute (EVENT)" if p.ordering == "event" else "polled later (POLL)"
        out.append(f"plan {i}: R{i}'s token {src}->{dst} ({dst} reserved from the pool); launch copy {i}{behind} "
                   f"{stream}, {how}")
    return out


def _describe(p: Protocol, s: dict, c: dict, t: dict) -> str:
    a, k, vllm = c["act"], c["who"], p.schedule == "vllm"
    if a == BEGIN:
        return "; ".join([f"settle: {'; '.join(_settle_text(s, t, c)) or 'nothing to settle'}",
                          *_alloc_text(s, t, False), _mapping_text(t), *_verify_text(p, s, t)])
    if a == SETTLE:
        return "; ".join(_settle_text(s, t, c) + _verify_text(p, s, t)) or "nothing to settle"
    if a == SCHEDULE:
        sent = [f"copy {i}" for i in REQS if t[f"sent{i}"] and not s[f"sent{i}"]]
        return "; ".join(["scheduler", *_alloc_text(s, t, True),
                          f"build_connector_meta sends {', '.join(sent) if sent else 'no copy'} to the worker",
                          _mapping_text(t)])
    if a == UPDATE_STATES:
        zeroed = [LOCS[x] for x in BLOCKS if s["fresh" + LOCS[x]]]
        return f"worker: _update_states zeroes {', '.join(zeroed) if zeroed else 'no new block'}"
    if a == FORWARD:
        waits = [i for i in REQS if s[f"ord{i}"] and s[f"cp{i}"] != NOT_SUBMITTED]
        wait = "after waiting on the copies' events; " if not vllm and p.ordering == "event" and waits else ""
        writes = f"writes new K/V into {LOCS[s['wr']]}" if s["wr"] != NOWHERE else "writes new K/V elsewhere"
        reads = ", ".join(f"attention reads R{i}'s token at {LOCS[s[f'rd{i}']]}" for i in REQS
                          if s[f"rd{i}"] != NOWHERE) or "no request read"
        return f"{'worker' if vllm else 'compute stream'} {wait}{writes}; {reads}"
    if a in (END, PLAN_NOW, UPDATE):
        where = {END: "after the forward", PLAN_NOW: "between steps (plan_request + launch)",
                 UPDATE: "scheduler: update_from_output -> after_step"}[a]
        return f"{where}: " + ("; ".join(_plan_text(p, s, c)) or "no plan")
    if a == REMOVE:
        freed = [LOCS[x] for x in BLOCKS if t["own" + LOCS[x]] == FREE and s["own" + LOCS[x]] != FREE]
        held = [LOCS[x] for x in BLOCKS if t["own" + LOCS[x]] == _held(k) and s["own" + LOCS[x]] != _held(k)]
        dropped = "; its unsent copy dropped" if t[f"cp{k}"] == DROPPED and s[f"cp{k}"] != DROPPED else ""
        return (f"R{k} leaves with copy {k} {COPIES[s[f'cp{k}']]}: frees {', '.join(freed) or 'nothing of A, B, D'}"
                + (f", holds {', '.join(held)} in orphan record {k}" if held else "") + dropped
                + "".join("; " + v for v in _verify_text(p, s, t)))
    who = "worker" if vllm else "relocation stream"
    if a == COPY_READ:
        return f"{who}: copy {k} gathers {LOCS[s[f'src{k}']]} ({CONTENTS[t[f'got{k}']]}), source digest taken"
    if a == COPY_WRITE:
        return f"{who}: copy {k} scatters {CONTENTS[s[f'got{k}']]} into {LOCS[s[f'dst{k}']]}"
    if a == COPY_DIGEST:
        if p.late_digest == "destination":
            return f"{who}: copy {k} records its event: complete (destination digest left for the host)"
        return (f"{who}: copy {k} digests {LOCS[s[f'dst{k}']]} ({CONTENTS[t[f'dd{k}']]}) and records its event: "
                f"complete")
    if a == COPY_FAIL:
        return f"{who}: copy {k} fails"
    return ""


def _why(p: Protocol, invariant: str, s: dict, c: dict, t: dict) -> str:
    """The offending read, write or digest of the last transition, in words (mirrors ``Unrolling.violation``)."""
    if invariant == "I3":
        i = next(i for i in REQS if s[f"rd{i}"] == s[f"dst{i}"] and s[f"rd{i}"] != NOWHERE)
        return (f"attention reads R{i}'s token at {LOCS[s[f'dst{i}']]} while copy {i} writing it is "
                f"{COPIES[s[f'cp{i}']]}")
    if invariant == "V":
        for k in REQS:
            if t[f"seen{k}"] and not s[f"seen{k}"]:  # compared in this transition
                src = s["cont" + LOCS[s[f"src{k}"]]] if p.late_digest == "source" else s[f"got{k}"]
                dst = s["cont" + LOCS[s[f"dst{k}"]]] if p.late_digest == "destination" else s[f"dd{k}"]
                for what, d in (("source", src), ("destination", dst)):
                    if d != s[f"got{k}"]:
                        return (f"copy {k} moved {CONTENTS[s[f'got{k}']]}, but verify's {what} digest is of "
                                f"{CONTENTS[d]} (later work's)")
        return ""
    a, k0 = c["act"], c["who"]
    writes = ([(s["wr"], "new K/V")] if a == FORWARD else
              [(x, "vLLM's zeroing") for x in BLOCKS if s["fresh" + LOCS[x]]] if a == UPDATE_STATES else
              [(s[f"dst{k0}"], f"copy {k0}'s scatter")] if a == COPY_WRITE else [])
    end, role = ("src", "source") if invariant == "I5" else ("dst", "destination")
    open_ = (QUEUED, SRC_READ, WRITTEN) if invariant == "I5" else (QUEUED, SRC_READ)
    for loc, by in writes:
        for k in REQS:
            if k != k0 or a != COPY_WRITE:
                if s[f"cp{k}"] in open_ and s[f"{end}{k}"] == loc:
                    return f"{by} lands in {LOCS[loc]} while copy {k} ({role} {LOCS[loc]}) is {COPIES[s[f'cp{k}']]}"
    return ""


# ---- checking ------------------------------------------------------------------------------------------------
def _relevant(act: int) -> tuple[str, ...]:
    """The choices action ``act`` reads (the others are pinned by ``_trans``)."""
    if act in (REMOVE, COPY_READ, COPY_WRITE, COPY_DIGEST, COPY_FAIL):
        return ("who",)
    if act in (END, PLAN_NOW, UPDATE):
        return ("plan1", "plan2", "to1", "to2")
    if act in (BEGIN, SCHEDULE):
        return ("allocA", "allocB", "allocD")
    return ()


def _lower(s: z3.Solver, e) -> None:
    """Fix ``e`` to its least value (False before True) among the solver's models."""
    cur = s.model().eval(e, model_completion=True)
    if z3.is_bool(e):
        # NOTE: pinned either way: a value left free could change under a later choice's query
        if z3.is_true(cur):
            s.push()
            s.add(z3.Not(e))
            if s.check() == z3.sat:
                return
            s.pop()
            s.add(e)
        else:
            s.add(z3.Not(e))
        s.check()
        return
    while True:
        s.push()
        s.add(z3.ULT(e, cur) if z3.is_bv(e) else e < cur)
        if s.check() != z3.sat:
            s.pop()
            s.add(e == cur)
            s.check()
            return
        cur = s.model().eval(e, model_completion=True)


def _canonical(s: z3.Solver, u: Unrolling, k: int) -> z3.ModelRef:
    """The lexicographically least trace (action, then its choices, per transition): stable trace text."""
    for i in range(k + 1):
        c = u.choices[i]
        _lower(s, c.act)
        act = s.model().eval(c.act, model_completion=True).as_long()
        for name in _relevant(act):
            _lower(s, getattr(c, name))
        if act in (BEGIN, SCHEDULE):
            _lower(s, u.states[i + 1].wr)
    return s.model()


def _sat_solver(timeout_ms: int) -> z3.Solver:
    """Bit-blast to SAT: on these small finite domains many times faster than the incremental SMT solver."""
    return z3.TryFor(z3.Then("simplify", "solve-eqs", "bit-blast", "sat"), timeout_ms).solver()


def _prefix(u: Unrolling, k: int) -> list[z3.BoolRef]:
    """The initial state and transitions 0..k (the later ones left out: the same traces, a smaller query)."""
    return [u.init, *[c for s in u.states[: k + 2] for c in u._domain(s)], *u.trans[: k + 1]]


def _shortest(u: Unrolling, at, timeout_ms: int, full=None) -> tuple[str, int, z3.ModelRef | None]:
    """("none", -1, None) when no transition k < n satisfies ``at(k)``; ("unknown", k, None) when the solver
    gave up; else ("found", k, model) with k least and the model's trace the lexicographically least.

    ``full``: () -> (the model with contents, its ``at``), for the trace once ``u`` (without them) has found
    the depth: both have the same control behaviours, so the same least k. Built only then (it takes time)."""
    s = _sat_solver(timeout_ms)
    s.add(*u.constraints, z3.Or([at(k) for k in range(u.n)]))  # one query settles the clean case
    r = s.check()
    if r == z3.unsat:
        return "none", -1, None
    if r != z3.sat:
        return "unknown", u.n - 1, None
    for k in range(u.n):  # a trace exists: deepen for the shortest
        s = _sat_solver(timeout_ms)
        s.add(*_prefix(u, k), at(k))
        r = s.check()
        if r == z3.unknown:
            return "unknown", k, None
        if r == z3.sat:
            v, v_at = full() if full is not None else (u, at)
            inc = z3.Solver()  # incremental, for the least trace's many small queries
            inc.set("timeout", timeout_ms)
            inc.add(*_prefix(v, k), v_at(k))
            if inc.check() != z3.sat:
                raise AssertionError(f"{u.p.name}: a trace of {k + 1} transitions without contents has none with them")
            return "found", k, _canonical(inc, v, k)
    raise AssertionError("the query over every depth was sat, but no single depth is")


def bmc(protocol: Protocol, invariant: str, n: int | None = None, timeout_ms: int = 30_000) -> Outcome | None:
    """A shortest counterexample of at most n transitions, UNKNOWN, or None when there is none."""
    u = Unrolling(protocol, n, content=invariant == "V")
    models = [u]

    def full():
        models.append(u if invariant == "V" else Unrolling(protocol, n))
        return models[-1], lambda k: models[-1].bad(invariant, k)

    how, k, model = _shortest(u, lambda k: u.bad(invariant, k), timeout_ms, full)
    if how == "found":
        return Outcome(COUNTEREXAMPLE, models[-1].explain(model, upto=k, violated=invariant))
    if how == "unknown":
        return Outcome(UNKNOWN, f"BMC up to transition {k}: the SAT solver gave up after {timeout_ms} ms")
    return None


def check(protocol: Protocol, invariant: str, n: int | None = None, timeout_ms: int = 30_000,
          spacer_rlimit: int | None = SPACER_RLIMIT) -> Outcome:
    """BMC to n transitions (the variant's bound by default), then (``spacer_rlimit`` not None) Spacer: PROVED
    only on Spacer's unsat, BOUNDED when it says nothing within its budget, COUNTEREXAMPLE when either finds
    a violation (Spacer's beyond the bound is re-found by a deeper BMC, for its trace)."""
    if invariant not in protocol.invariants:
        raise ValueError(f"{invariant!r} is not a claim of {protocol.name} (its claims: {protocol.invariants})")
    n = protocol.bound if n is None else n
    found = bmc(protocol, invariant, n, timeout_ms)
    if found is not None:
        return found
    detail = f"BMC: no violation in any trace of up to {n} transitions ({n + 1} states)"
    if spacer_rlimit is None:
        return Outcome(BOUNDED, detail + "; Spacer not asked", bound=f"{n} transitions")
    r = chc_check(protocol, invariant, spacer_rlimit)
    if r == z3.unsat:
        return Outcome(PROVED, detail + "; unbounded: Spacer (CHC) found an inductive invariant, so no trace of "
                                        "any length violates it")
    if r == z3.sat:
        deeper = bmc(protocol, invariant, 3 * n, timeout_ms)
        return deeper if deeper is not None and deeper.status == COUNTEREXAMPLE else Outcome(
            COUNTEREXAMPLE, f"Spacer (CHC) reaches a violation beyond {3 * n} transitions")
    # NOTE: silence is not a proof: without Spacer's invariant only the BMC's bound is claimed
    return Outcome(BOUNDED, detail + f"; unbounded: Spacer (CHC) gave no answer within {spacer_rlimit} resource units",
                   bound=f"{n} transitions")


def chc_check(protocol: Protocol, invariant: str, rlimit: int = SPACER_RLIMIT) -> z3.CheckSatResult:
    """Unbounded: Reach(init); Reach(s) and T(s, s') imply Reach(s'); query Reach(s) and bad(s). unsat = safe.

    NOTE: in a fresh z3 context. Spacer's search, and so the resource units it spends, depends on the context's
    history (the terms made before it, and their ids): I3/x2/vllm, proved within ~1,000,000 units in a fresh
    process, once spent more than its 1,500,000 in a test worker that had run other proofs first."""
    saved = z3.z3._main_ctx
    z3.z3._main_ctx = None  # z3py makes a new one on first use
    try:
        return _chc_check(protocol, invariant, rlimit)
    finally:
        z3.z3._main_ctx = saved


def _chc_check(protocol: Protocol, invariant: str, rlimit: int) -> z3.CheckSatResult:
    u = Unrolling(protocol, 1, bitvectors=False, content=invariant == "V")
    s0, s1 = u.states
    [c0] = u.choices
    sorts = [z3.BoolSort() if v in _BOOLS else z3.IntSort() for v in u.vars]
    reach = z3.Function("Reach2", *sorts, z3.BoolSort())
    fp = z3.Fixedpoint()
    fp.set(engine="spacer", rlimit=rlimit)
    fp.register_relation(reach)
    fp.declare_var(*[getattr(x, v) for x in (s0, s1) for v in u.vars], *[getattr(c0, k) for k in _CHOICES])
    r0, r1 = (reach(*[getattr(x, v) for v in u.vars]) for x in (s0, s1))
    fp.rule(r0, [u.init, *u._domain(s0)])
    fp.rule(r1, [r0, u.trans[0], *u._domain(s1)])
    try:
        return fp.query(z3.And(r0, u.trans[0], u.bad(invariant, 0)))
    except z3.Z3Exception as e:  # Spacer reports a spent budget as an error
        if "resource limit" not in str(e) and "canceled" not in str(e):
            raise
        return z3.unknown


# ---- non-vacuity: behaviours the proofs quantify over ---------------------------------------------------------
def _goals(u: Unrolling, k: int) -> dict[str, z3.BoolRef]:
    s, c, t = u.states[k], u.choices[k], u.states[k + 1]
    submitted = {i: z3.And(s.r("cp", i) != NOT_SUBMITTED, s.r("cp", i) != DROPPED) for i in REQS}  # it runs

    def chained(into: str) -> z3.BoolRef:
        """A copy writes the block the other copy reads (``src``) or wrote (``dst``)."""
        return z3.Or([z3.And(c.act == COPY_WRITE, c.who == i, submitted[3 - i], s.r("dst", i) == s.r(into, 3 - i))
                      for i in REQS])

    return {
        "two copies in flight on one stream": z3.And(_running(s.cp1), _running(s.cp2)),
        "a copy queued behind one that reads its destination": z3.Or(
            [z3.And(_running(s.r("cp", 3 - i)), s.r("cp", i) == QUEUED, s.first == 3 - i,
                    s.r("dst", i) == s.r("src", 3 - i)) for i in REQS]),
        "a chained copy writes the other copy's source": chained("src"),
        "two copies write one block": chained("dst"),
        "commit before the copy ran": z3.Or([z3.And(t.r("pl", i) == COMMITTED, t.r("cp", i) == QUEUED)
                                             for i in REQS]),
        "a source handed to new tokens before its copy ran": z3.Or(
            [z3.And(z3.Or(c.act == BEGIN, c.act == SCHEDULE), s.r("cp", i) == QUEUED,
                    t.at("own", s.r("src", i)) == NEW, s.at("own", s.r("src", i)) != NEW) for i in REQS]),
        "attention reads a destination": z3.And(c.act == FORWARD, z3.Or(
            [z3.And(s.r("rd", i) == s.r("dst", i), s.r("rd", i) != NOWHERE) for i in REQS])),
        "new K/V written into a copy's source": z3.And(c.act == FORWARD, z3.Or(
            [z3.And(submitted[i], s.wr == s.r("src", i)) for i in REQS])),
        "new K/V written into a copy's destination": z3.And(c.act == FORWARD, z3.Or(
            [z3.And(submitted[i], s.wr == s.r("dst", i)) for i in REQS])),
        "verify compares a copy": z3.Or([u.observes(s, c, i) for i in REQS]),
        "verify compares a copy whose blocks the other copy rewrote": z3.Or(
            [z3.And(u.observes(s, c, i), z3.Or(s.at("cont", s.r("src", i)) == (TOK2 if i == 1 else TOK1),
                                               s.at("cont", s.r("dst", i)) == (TOK2 if i == 1 else TOK1)))
             for i in REQS]),
        "forward while a copy is unfinished": z3.And(c.act == FORWARD, z3.Or(_running(s.cp1), _running(s.cp2))),
    }


WITNESS_GOALS = tuple(_goals(Unrolling(EVENT, 1), 0))


def witness(protocol: Protocol, goal: str, n: int | None = None, timeout_ms: int = 30_000,
            also: str | None = None) -> str | None:
    """A shortest trace whose last transition reaches ``goal`` (and, given, violates claim ``also``), or None."""
    return witnesses(protocol, [goal], n, timeout_ms, also)[goal]


def witnesses(protocol: Protocol, goals: list[str], n: int | None = None, timeout_ms: int = 30_000,
              also: str | None = None) -> dict[str, str | None]:
    """``witness`` for several goals over one unrolling (building it is a good part of the cost)."""
    u = Unrolling(protocol, n)
    out = {}
    for goal in goals:
        def at(k: int, goal=goal) -> z3.BoolRef:
            return z3.And(_goals(u, k)[goal], u.bad(also, k) if also is not None else True)

        how, k, model = _shortest(u, at, timeout_ms)
        if how == "unknown":
            raise TimeoutError(f"witness {goal!r} of {protocol.name}: the SAT solver gave up at transition {k}")
        out[goal] = None if how == "none" else u.explain(model, upto=k, violated=also)
    return out


def obligations() -> list[Obligation]:
    return [Obligation(
        id=f"{inv}/{p.tag}", invariant=inv, transition=f"protocol {p.transition}",
        claim=f"{CLAIMS[inv]}, in every interleaving of up to {p.bound} transitions of two requests with one plan "
              f"each (their copies on one relocation stream{', in vLLM step order' if p.schedule == 'vllm' else ''}) "
              f"over blocks A, B, D; of any length where Spacer finds an inductive invariant (then proved, else "
              f"bounded by {p.bound} transitions)",
        check=lambda p=p, inv=inv: check(p, inv)) for p in VARIANTS for inv in p.invariants]


if __name__ == "__main__":  # pragma: no cover
    from .obligations import run

    t0 = time.perf_counter()
    for ob in obligations():
        r = run(ob)
        print(f"{ob.id:<28} {r.outcome.label:<26} {r.seconds:6.2f}s")
    for name, (p, invs) in PLANTED.items():
        for inv in invs:
            t1 = time.perf_counter()
            out = check(p, inv, spacer_rlimit=None)
            print(f"planted {name} / {inv}: {out.status} {time.perf_counter() - t1:.2f}s\n{out.detail}")
    print(f"total {time.perf_counter() - t0:.2f}s")
