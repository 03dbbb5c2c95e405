"""The inductive state model proves every transition, and each proof has teeth (planted bugs)."""

import multiprocessing

import pytest
import z3

from vtoken.spec import state_model as M
from vtoken.spec.obligations import COUNTEREXAMPLE, PROVED, run


def test_every_state_obligation_is_proved():
    results = [run(ob) for ob in M.obligations()]
    assert len(results) == 6 + 13 + 13 * 6
    bad = [(r.obligation.id, r.outcome.status, r.outcome.detail[:200]) for r in results if r.outcome.status != PROVED]
    assert bad == []


def _with(transition, replace):
    """A copy of the transition table in which one transition is replaced by a buggy one."""
    def build(s, s2):
        params, trs = M._transitions(s, s2)
        trs = dict(trs)
        trs[transition] = replace(s, s2, params)
        return params, trs
    return build


PLANTED = {
    # invariant: (transition, buggy (pre, post) builder, what the bug is)
    "P1": ("T7 finish / preempt",
           lambda s, s2, p: _finish_never_frees(s, s2, p),
           "finish drops references but never marks blocks free"),
    "PL": ("T1 allocate block",
           lambda s, s2, p: (z3.And(0 <= p["b"], p["b"] < M.N), M.tr_allocate_block(s, s2, p["r"], p["b"])[1]),
           "allocation does not require the block to be free"),
    "RC": ("T8 admit sharing a prefix block",
           lambda s, s2, p: (M.tr_share_first_block(s, s2, p["r"], p["q"])[0],
                             _share_without_ref(s, s2, p)),
           "a shared block's ref count is not incremented"),
    "I2": ("T2 sync_new_tokens",
           lambda s, s2, p: _append_without_advancing(s, s2, p),
           "appending does not advance the cursor"),
    "SH": ("T8 admit sharing a prefix block",
           lambda s, s2, p: _share_open_block(s, s2, p),
           "the block still receiving appends is shared instead of the first one"),
    "I1": ("T4 copy + apply_moves",
           lambda s, s2, p: _move_without_copy(s, s2, p),
           "the table is updated but the K/V is not copied"),
}


def _finish_never_frees(s, s2, p):
    r = p["r"]
    b = z3.Int("fb")
    return z3.BoolVal(True), s2.same_as(s.replace(
        ref=z3.Lambda([b], z3.If(s.mem[r][b], s.ref[b] - 1, s.ref[b])),
        mem=z3.Store(s.mem, r, z3.K(z3.IntSort(), z3.BoolVal(False))), nb=z3.Store(s.nb, r, 0),
        len=z3.Store(s.len, r, 0), live=z3.Store(s.live, r, z3.K(z3.IntSort(), z3.BoolVal(False))),
        wi=z3.Store(s.wi, r, 0), wo=z3.Store(s.wo, r, 0),
    ))


def _share_without_ref(s, s2, p):
    _, post = M.tr_share_first_block(s, s2, p["r"], p["q"])
    b = s.lst[p["r"]][0]
    return z3.substitute(post, (s.ref[b] + 1, s.ref[b]))


def _append_without_advancing(s, s2, p):
    return M.tr_append_token(s, s2, p["r"])[0], _append_cursor_fixed(s, s2, p)


def _append_cursor_fixed(s, s2, p):
    r = p["r"]
    t = s.len[r]
    b = s.lst[r][s.wi[r]]
    return s2.same_as(s.replace(
        len=z3.Store(s.len, r, t + 1), live=z3.Store(s.live, r, z3.Store(s.live[r], t, True)),
        ix=z3.Store(s.ix, r, z3.Store(s.ix[r], t, s.wi[r])), off=z3.Store(s.off, r, z3.Store(s.off[r], t, s.wo[r])),
        C=z3.Store(s.C, b, z3.Store(s.C[b], s.wo[r], M.E[r][t])),
    ))


def _share_open_block(s, s2, p):
    """Shares the block at r's cursor (still receiving appends) instead of its first, full block."""
    pre, post = M.tr_share_first_block(s, s2, p["r"], p["q"])
    r = p["r"]
    return pre, z3.substitute(post, (s.lst[r][0], s.lst[r][s.wi[r]]))


def _move_without_copy(s, s2, p):
    pre, _ = M.tr_move(s, s2, p["r"], p["t"], p["i"], p["o"], M._holders_free(s))
    r, t, i, o = p["r"], p["t"], p["i"], p["o"]
    return pre, s2.same_as(s.replace(ix=z3.Store(s.ix, r, z3.Store(s.ix[r], t, i)),
                                     off=z3.Store(s.off, r, z3.Store(s.off[r], t, o))))


def _planted_outcome(invariant: str):
    transition, buggy, _ = PLANTED[invariant]
    return run(M.inductive_obligation(transition, invariant, build=_with(transition, buggy))).outcome


@pytest.mark.parametrize("invariant", sorted(PLANTED))
def test_a_planted_bug_in_a_transition_yields_a_counterexample(invariant):
    """Each in a fresh interpreter: z3's search depends on the terms its global context created before (the
    planner proofs earlier in a pytest session made the witness search for RC and SH miss and time out)."""
    transition, _, what = PLANTED[invariant]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        out = pool.apply(_planted_outcome, (invariant,))
    assert out.status == COUNTEREXAMPLE, f"{what}: {out.status} {out.detail[:300]}"
    assert f"after {transition} with" in out.detail and "request" in out.detail and "block" in out.detail


def test_the_unbugged_builder_still_proves_the_same_obligations():
    for invariant, (transition, _, _) in PLANTED.items():
        assert run(M.inductive_obligation(transition, invariant)).outcome.status == PROVED


def test_a_move_into_an_occupied_slot_breaks_unique_mapping():
    def no_occupancy_check(s, s2, p):
        return M.tr_move(s, s2, p["r"], p["t"], p["i"], p["o"], lambda b, o: z3.BoolVal(True))
    ob = M.inductive_obligation("T4 copy + apply_moves", "I2", build=_with("T4 copy + apply_moves", no_occupancy_check))
    assert run(ob).outcome.status == COUNTEREXAMPLE


def test_non_vacuity_has_teeth():
    """A transition that can never fire under the invariant is reported, not silently 'proved'."""
    def never(s, s2, p):
        return z3.BoolVal(False), s2.same_as(s)
    ob = M.vacuity_obligation("T3 evict_token", build=_with("T3 evict_token", never))
    assert run(ob).outcome.status == COUNTEREXAMPLE
