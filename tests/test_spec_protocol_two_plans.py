"""spec/protocol_two_plans.py: two plans on one relocation stream, in the core's order and in vLLM's (issue #16).

Five groups:
  * the eleven obligations (I3, I5, I6, V x commit-at-launch / commit-at-completion, I3, I5, I6 in vLLM's
    step order) hold: proved where Spacer finds an invariant within its budget, else bounded, and the
    claim and the outcome both state the bound;
  * every planted race yields a short counterexample whose last line names the offending read, write
    or digest: the late digest of issue #15 (and a late source digest), a second relocation stream, and
    in vLLM copies that run after the scheduler's commit has let the slot be zeroed or read;
  * variants that look risky but are not: the late digests under commit-at-completion, vLLM without
    dropping a leaving request's unsent copies;
  * non-vacuity: two copies in flight on one stream, chained copies into one block, a commit ahead of
    its copy are reachable where the code allows them, and unreachable where it does not;
  * the core does what the model assumes of the stream: ordered copies run in submission order.
"""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import pytest
from vtoken.core.block_pool import BlockPool, Purpose, blocks_needed
from vtoken.core.copy_engine import CopyStatus
from vtoken.core.sim.inmemory import InMemoryCopyEngine, TagStore
from vtoken.core.reclamation import Ordering, PlanState, ReclaimConfig, ReclamationManager
from vtoken.core.token_table import TokenTable
from vtoken.spec import protocol_two_plans as tp
from vtoken.spec.obligations import BOUNDED, COUNTEREXAMPLE, PROVED, run

STEP = re.compile(r"^  step +(\d+): (\S+) ")


def acts(trace: str) -> list[str]:
    return [m.group(2) for m in map(STEP.match, trace.splitlines()) if m]


# ---- the obligations ---------------------------------------------------------------------------------------
OBLIGATIONS = tp.obligations()
# NOTE: Spacer's budget is in z3 resource units, so which claims it settles does not depend on the machine's load
EXPECTED = {
    "I3/x2/commit-at-launch": PROVED, "I5/x2/commit-at-launch": BOUNDED, "I6/x2/commit-at-launch": BOUNDED,
    "V/x2/commit-at-launch": BOUNDED,
    "I3/x2/commit-at-completion": BOUNDED, "I5/x2/commit-at-completion": BOUNDED,
    "I6/x2/commit-at-completion": BOUNDED, "V/x2/commit-at-completion": BOUNDED,
    "I3/x2/vllm": PROVED, "I5/x2/vllm": BOUNDED, "I6/x2/vllm": PROVED,
}


def test_obligations_name_their_model_and_state_their_bound():
    assert [ob.id for ob in OBLIGATIONS] == list(EXPECTED)
    assert {ob.transition for ob in OBLIGATIONS} == {"protocol two plans, commit-at-launch",
                                                     "protocol two plans, commit-at-completion",
                                                     "protocol two plans, vLLM step order"}
    bounds = {"commit-at-launch": 13, "commit-at-completion": 11, "vllm": 16}
    for ob in OBLIGATIONS:
        n = bounds[ob.id.rsplit("/", 1)[1]]
        assert f"up to {n} transitions" in ob.claim and f"else bounded by {n} transitions" in ob.claim, ob.claim


@pytest.mark.parametrize("ob", OBLIGATIONS, ids=lambda ob: ob.id)
def test_obligation_holds(ob):
    out = run(ob).outcome  # each obligation in its own test: on two workers they spread (a shared cache ran all twice)
    assert out.status == EXPECTED[ob.id], out.detail
    n = tp.Protocol(*(("vllm", "event") if ob.id.endswith("vllm") else
                      ("device", "event" if ob.id.endswith("launch") else "poll"))).bound
    assert out.detail.startswith(f"BMC: no violation in any trace of up to {n} transitions ({n + 1} states); ")
    if out.status == PROVED:
        assert "Spacer (CHC) found an inductive invariant" in out.detail
    else:
        assert out.bound == f"{n} transitions" and out.label == f"bounded ({n} transitions)"
        assert f"Spacer (CHC) gave no answer within {tp.SPACER_RLIMIT} resource units" in out.detail


def test_spacer_not_asked_is_bounded():
    out = tp.check(tp.VLLM, "I3", n=8, spacer_rlimit=None)
    assert (out.status, out.bound) == (BOUNDED, "8 transitions")
    assert out.detail == "BMC: no violation in any trace of up to 8 transitions (9 states); Spacer not asked"


# ---- planted races: readable counterexamples ---------------------------------------------------------------
PLANTED = [(name, inv) for name, (_, invs) in tp.PLANTED.items() for inv in invs]
# what the last line must say, and the actions of the whole trace (the shortest, lexicographically least)
LAST = {
    ("late destination digest (issue #15)", "V"):
        "host sees copy 2 complete: verify compares source digest of R2's token with destination digest of new "
        "K/V (destination digested now, late)",
    ("late source digest", "V"):
        "host sees copy 2 complete: verify compares source digest of new K/V with destination digest of R2's "
        "token (source digested now, late)",
    ("second relocation stream (no FIFO)", "I5"): "I5 VIOLATED: copy 1's scatter lands in B while copy 2 "
                                                  "(source B) is queued",
    ("vllm: copies after update_states", "I5"): "I5 VIOLATED: vLLM's zeroing lands in B while copy 2 (source B) "
                                                "is queued",
    ("vllm: copies after the forward (commit before copy)", "I3"):
        "I3 VIOLATED: attention reads R2's token at D while copy 2 writing it is queued",
    ("vllm: copies after the forward (commit before copy)", "I5"):
        "I5 VIOLATED: vLLM's zeroing lands in B while copy 2 (source B) is queued",
}
VLLM_STEP = ["schedule", "update_states", "forward", "update"]


@functools.cache
def planted(name: str, inv: str):
    return tp.check(tp.PLANTED[name][0], inv, spacer_rlimit=None)


@pytest.mark.parametrize("name,inv", PLANTED, ids=[f"{n}/{i}" for n, i in PLANTED])
def test_planted_race_gives_a_readable_counterexample(name, inv):
    p = tp.PLANTED[name][0]
    out = planted(name, inv)
    assert out.status == COUNTEREXAMPLE, out.detail
    lines = out.detail.splitlines()
    steps = acts(out.detail)
    assert lines[0] == f"{p.name}: {inv} violated after {len(steps)} transitions"  # no idle transition
    assert lines[1] == ("  init: R1 at A: no plan | R2 at B: no plan | A R1 (R1's token), B R2 (R2's token), "
                        "D free (nothing)")
    assert len(steps) <= 9
    assert f"<== {inv} VIOLATED" in lines[-1] and LAST[(name, inv)] in lines[-1], lines[-1]


def test_late_destination_digest_trace_is_issue_15():
    """EVENT frees an ORDERED copy's blocks at once when its request leaves; the next forward, after waiting on
    the copy, writes the destination; the host, seeing the copy complete only at the next step's
    pre-attention hook, digests the new K/V: a false mismatch."""
    out = planted("late destination digest (issue #15)", "V").detail
    assert acts(out) == ["plan_now", "remove_request", "begin_step", "copy_read", "copy_write", "copy_digest",
                         "forward", "end_step", "begin_step"]
    assert "remove_request R2 leaves with copy 2 queued: frees B, D" in out
    assert "settle: nothing to settle; D handed to new tokens; mapping: R1 reads its token at A, new K/V -> D" in out
    assert "copy 2 records its event: complete (destination digest left for the host)" in out
    assert "compute stream after waiting on the copies' events; writes new K/V into D" in out
    assert out.splitlines()[-1].endswith("V VIOLATED: copy 2 moved R2's token, but verify's destination digest is "
                                         "of new K/V (later work's)")


def test_late_source_digest_with_a_chained_copy():
    """The chained race of the issue: copy 1 is launched behind copy 2 and scatters into B, the block copy 2
    gathered; a source digest taken when the host first sees copy 2 complete reads R1's token."""
    p = tp.PLANTED["late source digest"][0]
    trace = tp.witness(p, "verify compares a copy whose blocks the other copy rewrote", also="V")
    assert acts(trace) == ["plan_now", "settle", "plan_now", "copy_read", "copy_write", "copy_digest", "copy_read",
                           "copy_write", "begin_step"]
    assert "commit plan 2 while copy 2 queued (R2's table -> D, B freed)" in trace
    assert "plan 1: R1's token A->B (B reserved from the pool); launch copy 1 behind copy 2" in trace
    assert "relocation stream: copy 1 scatters R1's token into B" in trace
    assert trace.splitlines()[-1].endswith("V VIOLATED: copy 2 moved R2's token, but verify's source digest is of "
                                           "R1's token (later work's)")


def test_commit_before_copy_trace_in_vllm_order():
    """The scheduler commits in after_step; if the worker ran the copy after the forward, step n+1's attention
    would read the destination before the copy landed."""
    out = planted("vllm: copies after the forward (commit before copy)", "I3").detail
    assert acts(out) == VLLM_STEP + VLLM_STEP[:3]
    assert ("plan 2: R2's token B->D (D from vLLM's pool), copy 2 into the outbox (ORDERED), committed at once: "
            "R2's table -> D, B back to vLLM's pool") in out
    assert ("build_connector_meta sends copy 2 to the worker; mapping: R1 reads its token at A, R2 reads its token "
            "at D") in out


def test_counterexamples_are_deterministic():
    p = tp.PLANTED["second relocation stream (no FIFO)"][0]
    assert tp.check(p, "I5", spacer_rlimit=None).detail == planted("second relocation stream (no FIFO)", "I5").detail


# ---- variants that look risky and are not ---------------------------------------------------------------------
@pytest.mark.parametrize("late", ["destination", "source"])
def test_late_digests_are_harmless_under_commit_at_completion(late):
    """POLL frees a copy's blocks only once the host has seen it complete, i.e. after verify compared."""
    out = tp.check(replace(tp.POLL, late_digest=late), "V", n=9, spacer_rlimit=None)  # the EVENT race needs 8
    assert (out.status, out.bound) == (BOUNDED, "9 transitions")


def test_vllm_needs_no_drop_of_unsent_copies_for_i5_i6():
    """A leaving request's copy, if still sent, runs at the top of the next step, before _update_states zeroes
    the blocks vLLM handed on and before the forward writes them: dropping it saves work, not safety."""
    p = replace(tp.VLLM, drop_on_removal=False)
    for inv in ("I5", "I6"):  # 12 transitions: three steps, a leaving request's copy sent in the last
        assert tp.check(p, inv, n=12, spacer_rlimit=None).label == "bounded (12 transitions)"


# ---- non-vacuity ------------------------------------------------------------------------------------------------
# per variant: (depth, reachable goals, goals no trace of that depth reaches). Depths are kept small, as the cost
# grows with them; the late-digest tests above add a chained copy under EVENT (9 transitions)
WITNESSES = {
    "event": (6, {"two copies in flight on one stream", "a copy queued behind one that reads its destination",
                  "two copies write one block", "commit before the copy ran",
                  "a source handed to new tokens before its copy ran", "verify compares a copy"},
              # the forward waits on every ordered copy
              {"forward while a copy is unfinished"}),
    "poll": (8, {"a chained copy writes the other copy's source", "two copies write one block",
                 "forward while a copy is unfinished", "new K/V written into a copy's destination"},
             # the table moves, and the source is freed, only once the host has seen the copy done; and with
             # one spare block a second plan needs a block the first frees only then
             {"commit before the copy ran", "a source handed to new tokens before its copy ran",
              "two copies in flight on one stream"}),
    "vllm": (12, {"a chained copy writes the other copy's source", "commit before the copy ran"},
             # after_step commits what it plans before the next round, and the worker runs a step's copies
             {"a copy queued behind one that reads its destination", "forward while a copy is unfinished"}),
}
VARIANT = {"event": tp.EVENT, "poll": tp.POLL, "vllm": tp.VLLM}


@pytest.mark.parametrize("variant", list(WITNESSES))
def test_witnesses(variant):
    depth, reachable, unreachable = WITNESSES[variant]
    assert not reachable & unreachable and reachable | unreachable <= set(tp.WITNESS_GOALS)
    found = tp.witnesses(VARIANT[variant], sorted(reachable | unreachable), n=depth)
    for goal in reachable:
        assert found[goal] is not None and acts(found[goal]), goal
    for goal in unreachable:
        assert found[goal] is None, (goal, found[goal])
    if variant == "vllm":  # the chain runs across steps: copy 1 into B a step after copy 2 ran from it
        chain = found["a chained copy writes the other copy's source"]
        assert acts(chain) == VLLM_STEP + ["schedule", "copy_fail"] + VLLM_STEP[1:] + [
            "schedule", "copy_read", "copy_write"], chain
        assert "plan 1: R1's token A->B (B from vLLM's pool)" in chain and "copy 1 scatters R1's token into B" in chain


def test_vllm_commit_runs_a_step_ahead_of_the_copy():
    trace = tp.witness(tp.VLLM, "a source handed to new tokens before its copy ran")
    assert acts(trace) == VLLM_STEP + ["schedule"]
    assert trace.splitlines()[-1].startswith("  step  4: schedule       scheduler; B handed to new tokens (on "
                                             "vLLM's zero list); build_connector_meta sends copy 2 to the worker")


def test_bad_variants_and_claims_are_refused():
    for kw in ({"schedule": "gpu"}, {"ordering": "force_sync"}, {"late_digest": "never"},
               {"worker_copies_at": "later"}, {"schedule": "vllm", "ordering": "poll"}):
        with pytest.raises(ValueError):
            tp.Protocol(**kw)
    with pytest.raises(ValueError, match="not a claim"):
        tp.check(tp.VLLM, "V")  # vLLM's worker compares right after each copy: no V obligation there


# ---- the core's stream order, which the model's FIFO assumes ---------------------------------------------------
S = 4


def chained_copies_on_the_core():
    """Requests a and b each hold 14 tokens in 4 blocks, 8 evicted; a's plan commits at launch (EVENT) and
    frees its sources, so b's plan, made next (as the fuzzer's plan_now does), takes a's first source as its
    destination: copy b writes a block copy a has not read yet."""
    pool = BlockPool(9, S, 0)
    table = TokenTable(9, S)
    store = TagStore(9, S)
    engine = InMemoryCopyEngine(store, auto_complete=False)
    mgr = ReclamationManager(pool, table, engine, ReclaimConfig(ordering=Ordering.EVENT))
    for base, r in ((1000, "a"), (2000, "b")):
        table.add_request(r)
        slots = table.sync_new_tokens(r, pool.allocate(blocks_needed(14, S), Purpose.ADMISSION), 14)
        for t, slot in enumerate(slots):
            store.write(slot, base + t)
        for t in (1, 2, 3, 4, 5, 6, 10, 11):
            table.evict_token(r, t)
    rec_a = mgr.plan_request("a")
    mgr.launch()
    copy_a = rec_a.handle
    assert [r.state for r in mgr.settle()] == [PlanState.COMMITTED]  # ORDERED: commit at launch, sources freed
    rec_b = mgr.plan_request("b")
    mgr.launch()
    return engine, store, table, rec_a, copy_a, rec_b


def test_core_runs_ordered_copies_in_submission_order():
    engine, store, table, rec_a, copy_a, rec_b = chained_copies_on_the_core()
    assert rec_a.plan.src_blocks == (0, 1, 2) and rec_a.plan.dst_blocks == (8,)
    assert rec_b.plan.dst_blocks == (0,)  # the chained copy: it writes block 0, which copy a reads
    assert engine.pending() == [copy_a, rec_b.handle]  # two copies in flight, in submission order
    assert engine.poll(copy_a) is engine.poll(rec_b.handle) is CopyStatus.ORDERED
    engine.complete(rec_b.handle)  # the later copy first, as the fuzzer may: the engine runs a's before it
    assert engine.pending() == []
    for r, base in (("a", 1000), ("b", 2000)):
        live = table.live_token_ids(r)
        assert [store.read(table.slot_of(r, t)) for t in live] == [base + t for t in live]
