"""spec/protocol_model.py: the bounded model of the Stage 4 copy protocol (host, relocation stream, compute stream).

Four groups:
  * the six obligations (I3, I5, I6 x commit-at-launch / commit-at-completion) are proved;
  * every planted protocol bug yields a counterexample whose trace names the offending read or write;
  * the model is not vacuous: the behaviours the proofs quantify over (reads of D, reuse of A and
    D, aborts, orphans, overlap of copy and forward) are reachable, and the ones the protocol
    forbids are not;
  * the model's host side is the core's: scripted runs of ``VTokenRuntime`` with an
    ``InMemoryCopyEngine`` stay related, step by step, to the model's unique successor state.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import z3
from vtoken.core.block_pool import BlockPool
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.errors import VTokenError
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig
from vtoken.core.runtime import VTokenRuntime
from vtoken.spec import protocol_model as pm
from vtoken.spec.obligations import BOUNDED, COUNTEREXAMPLE, PROVED, run

# ---- the obligations -------------------------------------------------------------------------------
OBLIGATIONS = pm.obligations()


def test_six_obligations_one_per_invariant_and_ordering():
    assert [(ob.invariant, ob.transition) for ob in OBLIGATIONS] == [
        (inv, tr) for tr in ("protocol commit-at-launch", "protocol commit-at-completion")
        for inv in ("I3", "I5", "I6")
    ]
    assert len({ob.id for ob in OBLIGATIONS}) == 6
    for ob in OBLIGATIONS:
        assert ob.id == f"{ob.invariant}/{ob.transition.removeprefix('protocol ')}"  # e.g. I3/commit-at-launch
        assert f"up to {pm.DEFAULT_BOUND} transitions" in ob.claim
        assert f"else bounded by {pm.DEFAULT_BOUND} transitions" in ob.claim  # the claim states its bound


@pytest.fixture(scope="module")
def results() -> dict:
    """Each obligation run once (the test below and the time budget share it; a module fixture, so that on two
    workers the tests that share it run in one: tests/conftest.py)."""
    return {ob.id: run(ob) for ob in OBLIGATIONS}


@pytest.mark.parametrize("ob", OBLIGATIONS, ids=lambda ob: ob.id)
def test_obligation_is_proved(ob, results):
    result = results[ob.id]
    assert result.outcome.status == PROVED, result.outcome.detail
    assert f"up to {pm.DEFAULT_BOUND} transitions" in result.outcome.detail
    # the same transition relation as Horn clauses: Spacer proves it for traces of any length
    assert "inductive invariant" in result.outcome.detail


def test_all_obligations_fit_the_time_budget(results):
    assert sum(r.seconds for r in results.values()) < 60


# ---- planted bugs: the checks have teeth ------------------------------------------------------------
OFFENDING = {
    "I3": "attention reads R's token at D",
    "I5": "writes new K/V into A",
    "I6": "writes new K/V into D",
}
# what else the trace of each planted bug must show (the action that opens the race)
CAUSE = {
    "event without the pre-attention wait": "commit while copy queued|abort \\(stale layout\\) while copy queued|"
                                            "R leaves with copy queued: frees A, D",
    "poll commits before the copy completed": "commit while copy queued",
    "source freed at launch": "A freed at launch",
    "poll frees held blocks at request removal": "remove_request +R leaves with copy queued: frees A, D",
    "poll aborts a pending copy (timeout)": "abort \\(timeout\\) while copy queued: D freed",
    "event: an ordered copy may fail": "copy_fail",
}
PLANTED = [(name, inv) for name, (_, invs) in pm.PLANTED.items() for inv in invs]
STEP = re.compile(r"^  step +(\d+): (\S+) ")


def parse(trace: str) -> list[tuple[int, str]]:
    return [(int(m.group(1)), m.group(2)) for m in map(STEP.match, trace.splitlines()) if m]


@pytest.mark.parametrize("name,inv", PLANTED, ids=[f"{n}/{i}" for n, i in PLANTED])
def test_planted_bug_gives_a_readable_counterexample(name, inv):
    p, _ = pm.PLANTED[name]
    out = pm.check(p, inv)
    assert out.status == COUNTEREXAMPLE, out.detail
    trace = out.detail
    lines = trace.splitlines()
    assert lines[0] == f"{p.name}: {inv} violated after {parse(trace)[-1][0] + 1} transitions"
    assert lines[1].startswith("  init: plan=none copy=not submitted table=A A=R D=free")
    steps = parse(trace)
    assert [n for n, _ in steps] == sorted(n for n, _ in steps)
    assert all(a in pm.ACTIONS and a != "idle" for _, a in steps)  # idle transitions are left out
    # the copy was launched after a forward, and the violating transition is a forward
    acts = [a for _, a in steps]
    assert "end_step" in acts and acts.index("forward") < acts.index("end_step")
    assert "launch the copy on the relocation stream" in trace
    last = lines[-1]
    assert STEP.match(last).group(2) == "forward"
    assert OFFENDING[inv] in last
    assert f"<== {inv} VIOLATED" in last
    assert re.search(CAUSE[name], trace), trace


def test_missing_wait_trace_is_the_shortest_race():
    """The seed's own hazard: commit at launch, reuse the freed source, no wait: five transitions."""
    out = pm.check(replace(pm.EVENT, gpu_wait=False), "I3")
    assert [a for _, a in parse(out.detail)] == ["begin_step", "forward", "end_step", "begin_step", "forward"]
    assert "settle: commit while copy queued (table -> D, A freed)" in out.detail
    assert "attention reads R's token at D (copy queued)" in out.detail


def test_counterexample_is_deterministic():
    a = pm.check(pm.PLANTED["poll frees held blocks at request removal"][0], "I6").detail
    b = pm.check(pm.PLANTED["poll frees held blocks at request removal"][0], "I6").detail
    assert a == b


def test_event_needs_no_holding_at_removal_because_the_wait_covers_it():
    """The core frees everything at once when an EVENT request leaves (ORDERED counts as settled)."""
    p = replace(pm.EVENT, hold_on_removal=False)
    for inv in pm.INVARIANTS:
        out = pm.check(p, inv, unbounded=False)
        # the BMC alone claims no more than its bound (issue #16: a bounded run is never printed as proved)
        assert (out.status, out.bound, out.label) == (BOUNDED, "12 transitions", "bounded (12 transitions)")
        assert "Spacer not asked" in out.detail


def test_a_silent_spacer_leaves_the_claim_bounded(monkeypatch):
    """A clean BMC whose unbounded step gives no answer is BOUNDED by the BMC's depth, not PROVED."""
    monkeypatch.setattr(pm, "chc_check", lambda *a, **k: z3.unknown)  # Spacer's "no answer", whatever the cause
    out = pm.check(pm.EVENT, "I3")
    assert (out.status, out.bound) == (BOUNDED, f"{pm.DEFAULT_BOUND} transitions")
    assert out.detail == (f"BMC: no violation in any trace of up to {pm.DEFAULT_BOUND} transitions "
                          f"({pm.DEFAULT_BOUND + 1} states); unbounded: Spacer (CHC) gave no answer")
    assert out.passed


def test_planted_variants_also_fail_the_unbounded_check():
    for name, (p, invs) in pm.PLANTED.items():
        for inv in invs:
            assert pm.chc_check(p, inv) == z3.sat, (name, inv)


# ---- non-vacuity: what the proofs quantify over is reachable --------------------------------------
REACHABLE = {
    "event": {"attention reads D", "new K/V written into A", "new K/V written into D", "D written after an abort",
              "commit while the copy is running", "removal while the copy is running"},
    "poll": {"attention reads D", "new K/V written into A", "new K/V written into D", "D written after an abort",
             "D written after an orphan's release", "forward while the copy is running",
             "removal while the copy is running"},
}
UNREACHABLE = {
    # commit-at-launch: an ordered copy never overlaps a forward, and a departing request leaves no orphan
    "event": {"forward while the copy is running", "D written after an orphan's release"},
    # commit-at-completion: the table moves only once the copy is done
    "poll": {"commit while the copy is running"},
}


@pytest.mark.parametrize("ordering", ["event", "poll"])
def test_witnesses(ordering):
    p = pm.Protocol(ordering)
    assert REACHABLE[ordering] | UNREACHABLE[ordering] == set(pm.WITNESS_GOALS)
    for goal in sorted(REACHABLE[ordering]):
        trace = pm.witness(p, goal)
        assert trace is not None, goal
        assert parse(trace), trace
    for goal in sorted(UNREACHABLE[ordering]):
        assert pm.witness(p, goal) is None, goal


def test_orphan_witness_trace_reads_like_the_protocol():
    trace = pm.witness(pm.POLL, "D written after an orphan's release")
    acts = [a for _, a in parse(trace)]
    assert acts[:3] == ["begin_step", "forward", "end_step"]
    assert "remove_request" in acts and acts[-1] == "forward"
    assert "holds A, D in an orphan record" in trace
    assert "orphan's copy settled: held blocks freed" in trace
    assert "copy_write" in acts or "copy_fail" in acts  # the orphan is released only once its copy settled


def test_explain_reconstructs_a_model():
    u = pm.Unrolling(pm.POLL, 6)
    s = z3.Solver()
    s.add(*u.constraints, u.choices[2].act == pm.END, u.choices[2].plan, u.choices[3].act == pm.COPY_READ)
    assert s.check() == z3.sat
    text = pm.explain(s.model(), pm.POLL, 6)
    assert text.splitlines()[0] == "protocol commit-at-completion: trace of 6 transitions"
    acts = [a for _, a in parse(text)]
    assert acts[:4] == ["begin_step", "forward", "end_step", "copy_read"]
    assert "relocation stream: copy reads A" in text


def test_protocol_rejects_unknown_ordering():
    with pytest.raises(ValueError):
        pm.Protocol("force_sync")


# ---- conformance: the core and the model side by side ---------------------------------------------
# The core's scene: request "a" with 14 tokens in blocks 0-3 of a 6x4 pool (headroom 2); step 0 evicts
# 1-6, 10, 11 and the compact planner moves tokens 0, 7, 8, 9 from blocks 0, 1, 2 (the model's A)
# into block 4 (the model's D).
EVICT = [1, 2, 3, 4, 5, 6, 10, 11]
SRC, DST, MOVED = (0, 1, 2), 4, (0, 7, 8, 9)


class Scripted:
    name = "scripted"

    def __init__(self, victims):
        self.victims = victims

    def select_victims(self, view):
        return list(self.victims.get((view.req_id, view.step), []))


class Side:
    """Runs the core and the model together; after every action the core abstracts to the model's state."""

    def __init__(self, ordering: str) -> None:
        self.p = pm.Protocol(ordering)
        self.pool = BlockPool(6, 4, 2)
        self.engine = InMemoryCopyEngine(TagStore(6, 4), auto_complete=False)
        cfg = ReclaimConfig(ordering=Ordering.EVENT if ordering == "event" else Ordering.POLL)
        self.rt = VTokenRuntime(self.pool, self.engine, Scripted({("a", 0): EVICT}), budget=0.4, reclaim=cfg)
        self.rt.admit("a")
        self.rec = None
        self.handle = None
        self.inputs = None
        self.appends = {"a": 14}
        self.m = dict(pm.INITIAL)
        self.log: list[str] = []

    # the core's side of each model action
    def do(self, action: str, **choices) -> None:
        rt, eng = self.rt, self.engine
        ran_before = eng.events["completed"]
        if action == "begin_step":
            self.inputs = rt.begin_step(self.appends)
            self.appends = {}
        elif action == "forward":
            eng.before_compute()  # the pre-attention wait (a no-op for POLL: nothing is ordered)
            store = eng.store
            for req in self.inputs.requests.values():
                for t, slot in zip(req.new_tokens, req.write_slots):
                    store.write(slot, 1000 + t)
                for t, slot in zip(req.read_tokens, req.read_slots):
                    assert store.read(slot) == 1000 + t, f"I1: token {t} at slot {slot}"
        elif action == "end_step":
            rt.end_step()
            if self.rec is None:
                self.rec = rt.manager.in_flight("a")
                if self.rec is not None:
                    assert self.rec.plan.src_blocks == SRC and self.rec.plan.dst_blocks == (DST,)
                    self.handle = self.rec.handle
                    choices["plan"] = True
        elif action == "settle":
            rt.manager.settle()
        elif action == "remove_request":
            rt.finish("a")
        elif action == "copy_read":
            pass  # the in-memory engine copies in one go; the model's two halves map to one
        elif action == "copy_write":
            eng.complete(self.handle)
        elif action == "copy_fail":
            eng.fail(self.handle)
        self._advance(action, **choices)
        if action == "begin_step" and eng.events["completed"] > ran_before:
            # begin_step ends with the pre-attention wait (engine.before_compute), which runs an
            # ordered copy there and then: in the model, the copy's two halves happen next
            self._advance("copy_read")
            self._advance("copy_write")
        self.agree()

    def _advance(self, action: str, **choices) -> None:
        nxt = pm.successors(self.p, self.m, action, **choices)
        assert len(nxt) == 1, f"{action} from {self.m}: {len(nxt)} successors"
        self.m = nxt[0]
        self.log.append(action)

    def abstract(self) -> dict:
        rt, pool, eng, mgr = self.rt, self.pool, self.engine, self.rt.manager
        req = "a" in rt.running()
        blocks = rt.table.block_ids("a") if req else []
        held = {b for o in mgr.orphans for b in o.held}
        ev = eng.events
        out = {
            "req": req,
            "orphan": bool(mgr.orphans),
            "cp": pm.FAILED if ev["failed"] else pm.DONE if ev["completed"] else
            pm.QUEUED if ev["submitted"] else pm.NOT_SUBMITTED,
            "ordered": self.p.ordering == "event" and ev["submitted"] > 0,
        }
        if self.rec is None:
            out["pl"] = pm.P_NONE
        else:
            out["pl"] = {PlanState.COPYING: pm.COPYING, PlanState.COMMITTED: pm.COMMITTED,
                         PlanState.ABORTED: pm.ABORTED}[self.rec.state]
        if req:
            where = {rt.table.slot_of("a", t) // 4 for t in MOVED}
            assert where in ({*SRC}, {DST}), where
            out["tbl"] = pm.D if where == {DST} else pm.A

        def owner(b: int) -> int:
            if b in blocks:
                return pm.REQ
            if b in held:
                return pm.HELD
            if self.rec is not None and self.rec.state is PlanState.COPYING and b == DST:
                return pm.PLAN
            return pm.FREE if pool.ref_count(b) == 0 else pm.NEW

        src = {owner(b) for b in SRC}
        assert len(src) == 1, src
        out["ownA"], out["ownD"] = src.pop(), owner(DST)
        if self.m["ph"] == pm.BUILT:
            reads = self.inputs.requests.get("a")
            out["rd"] = pm.NOWHERE if reads is None else (
                pm.D if {s // 4 for s, t in zip(reads.read_slots, reads.read_tokens) if t in MOVED} == {DST} else pm.A)
        return out

    def agree(self) -> None:
        core = self.abstract()
        model = dict(self.m)
        if model["cp"] == pm.SRC_READ:
            model["cp"] = pm.QUEUED  # the core cannot tell "sources read" from "queued"
        for k, v in core.items():
            assert model[k] == v, f"after {self.log}: {k} is {v} in the core, {model[k]} in the model ({model})"


def run_script(ordering: str, script: list) -> Side:
    side = Side(ordering)
    for item in script:
        action, choices = (item, {}) if isinstance(item, str) else item
        side.do(action, **choices)
    return side


STEP0 = ["begin_step", "forward", "end_step"]  # step 0: prompt, eviction, plan + launch


def test_core_commit_at_launch_matches_the_model():
    side = run_script("event", STEP0 + ["settle"])
    assert side.rec.state is PlanState.COMMITTED and side.engine.poll(1) is CopyStatus.ORDERED
    assert side.m["cp"] == pm.QUEUED and side.m["pl"] == pm.COMMITTED  # committed before the copy ran
    # the model forbids the forward until the copy finished; the core's begin_step ends with the
    # pre-attention wait, which runs it (the harness then advances the model through the copy)
    assert pm.successors(side.p, side.m, "forward") == []
    for action in ["begin_step", "forward", "end_step", "remove_request", "begin_step", "forward"]:
        side.do(action)
    assert side.m["ownA"] == pm.FREE and side.m["ownD"] == pm.FREE


def test_core_event_removal_frees_at_once_matches_the_model():
    side = run_script("event", STEP0 + ["remove_request"])
    assert side.m["ownA"] == side.m["ownD"] == pm.FREE and not side.m["orphan"]
    assert side.engine.pending() == [1]  # still to run: only the wait keeps the freed blocks safe
    side.do("begin_step")  # the pre-attention wait runs the copy before any new K/V lands
    assert side.engine.pending() == [] and side.m["cp"] == pm.DONE
    side.do("forward")


def test_core_commit_at_completion_matches_the_model():
    side = run_script("poll", STEP0 + ["settle", "begin_step", "forward", "end_step", "copy_read",
                                       "begin_step", "forward", "end_step", "copy_write", "settle",
                                       "begin_step", "forward", "end_step"])
    assert side.rec.state is PlanState.COMMITTED and side.m["tbl"] == pm.D


def test_core_settle_between_mapping_and_forward_matches_the_model():
    """A commit after the slot mapping was built frees A, but nothing can reuse it before the forward ran."""
    side = run_script("poll", STEP0 + ["begin_step", "copy_read", "copy_write", "settle"])
    assert side.m["pl"] == pm.COMMITTED and side.m["rd"] == pm.A and side.m["ownA"] == pm.FREE
    for action in ["forward", "end_step", "begin_step", "forward"]:  # the forward's I1 check reads A intact
        side.do(action)


def test_core_orphan_matches_the_model():
    side = run_script("poll", STEP0 + ["remove_request", "settle", "begin_step", "forward", "end_step",
                                       "copy_read"])
    assert side.m["orphan"] and side.m["ownA"] == side.m["ownD"] == pm.HELD
    side.do("copy_write")
    side.do("settle")
    assert not side.m["orphan"] and side.m["ownA"] == side.m["ownD"] == pm.FREE
    assert side.pool.num_free == 6


def test_core_failed_copy_matches_the_model():
    side = run_script("poll", STEP0 + ["copy_read", "copy_fail", "begin_step", "forward"])
    assert side.rec.state is PlanState.ABORTED and side.m["pl"] == pm.ABORTED
    assert side.m["tbl"] == pm.A and side.m["ownD"] == pm.FREE


def test_core_refuses_to_fail_an_ordered_copy():
    """The model's commit-at-launch proofs assume an ordered copy cannot fail (see the planted probe)."""
    side = run_script("event", STEP0)
    with pytest.raises(VTokenError):
        side.engine.fail(side.rec.handle)
