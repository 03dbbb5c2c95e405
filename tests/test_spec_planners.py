"""The bounded planner model: proved, tied to core's planners by a differential test, and with teeth.

The differential test pins the z3 model's symbolic snapshot to a concrete one, runs the Python planner
on the same snapshot, and requires the model to make exactly the code's plan (the ``exact`` model) or at
least to allow it (the relaxed model that the proofs quantify over).
"""

from __future__ import annotations

from array import array

import pytest
import z3
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vtoken.core.compact import plan_compaction
from vtoken.core.densify import plan_densify
from vtoken.core.plan import NoPlan, Plan
from vtoken.core.token_table import NO_SLOT, Move, RequestSnapshot
from vtoken.spec import planner_model as PM
from vtoken.spec.obligations import COUNTEREXAMPLE, PROVED, run

FRESH = 100  # reserved destination ids are FRESH, FRESH + 1, ...: never a block id of a generated snapshot
SMALL = (PM.Bound(2, 4),)


# ---- concrete snapshots ---------------------------------------------------------------------------------
def make_snapshot(block_size: int, blocks: list[int], layout: dict[int, int], write_pos: int,
                  shared: set[int] = frozenset(), total_len: int | None = None) -> RequestSnapshot:
    """A snapshot whose live token ``t`` sits at position ``p`` (block-list index p // S, offset p % S) for
    every ``layout[p] = t``."""
    S = block_size
    total_len = max(layout.values(), default=-1) + 1 if total_len is None else total_len
    slots = array("i", [NO_SLOT] * total_len)
    masks = [0] * len(blocks)
    for p, t in layout.items():
        assert p < write_pos and slots[t] == NO_SLOT
        slots[t] = blocks[p // S] * S + p % S
        masks[p // S] |= 1 << (p % S)
    return RequestSnapshot("r", S, tuple(blocks), tuple(masks), slots.tobytes(), write_pos, len(layout),
                           total_len, 0, frozenset(shared))


@st.composite
def snapshots(draw, bound: PM.Bound) -> RequestSnapshot:
    S = bound.block_size
    nb = draw(st.integers(0, bound.max_blocks))
    blocks = draw(st.lists(st.integers(0, FRESH - 1), min_size=nb, max_size=nb, unique=True))
    w = draw(st.integers(0, nb * S))
    live = [p for p in range(w) if draw(st.booleans())]
    total_len = len(live) + draw(st.integers(0, 4))
    ids = draw(st.permutations(range(total_len)))[: len(live)]
    shared = {b for b in blocks if draw(st.integers(0, 5)) == 0}
    return make_snapshot(S, blocks, dict(zip(live, ids)), w, shared, total_len)


# ---- pinning the model to a snapshot and comparing plans ---------------------------------------------------
def pin(snap_model: PM.SnapshotModel, snap: RequestSnapshot) -> list[z3.BoolRef]:
    s, S = snap_model, snap.block_size
    at = {}
    for t, slot in snap.live_slots():
        at[snap.blocks.index(slot // S) * S + slot % S] = t
    cs = [s.nb == len(snap.blocks), s.w == snap.write_pos]
    for i, b in enumerate(snap.blocks):
        cs += [s.bid[i] == b, s.shared[i] == (b in snap.shared_blocks)]
    for p in range(s.P):
        cs.append(s.live[p] == (p in at))
        if p in at:
            cs.append(s.tok[p] == at[p])
    return cs


def same_plan(model, snap: RequestSnapshot, plan: Plan) -> z3.BoolRef:
    """The model's plan is ``plan``: the same moves in the same order, sources and destinations."""
    zp = model.plan()
    eq = [zp.exists, zp.num_moves == len(plan.moves)]
    for zm, m in zip(zp.moves, plan.moves):
        eq += [f == v for f, v in zip(zm.fields(), m)]
    for i, (g, _) in enumerate(zp.src):
        eq.append(g == (i < len(snap.blocks) and snap.blocks[i] in plan.src_blocks))
    for d, (g, _) in enumerate(zp.dst):
        eq.append(g == (d < len(plan.dst_blocks)))
    if zp.dense_write_pos is not None:
        eq.append(zp.dense_write_pos == plan.dense_write_pos)
    return z3.And(eq)


def compact_params(model: PM.CompactModel, max_sources: int, budget: int) -> list[z3.BoolRef]:
    return [model.max_sources == max_sources, model.budget == budget,
            *[r == FRESH + d for d, r in enumerate(model.reserved)]]


def disagreement(model, snap: RequestSnapshot, result: Plan | NoPlan, params: list[z3.BoolRef] = ()) -> str | None:
    """Why the model and ``result`` (the planner's output on ``snap``) disagree, or None if they agree.

    The exact model must make ``result`` and nothing else (NoPlan: no plan at all); the relaxed model
    must at least allow ``result`` when it is a Plan.
    """
    eq = same_plan(model, snap, result) if result else None  # before planned(): it may define indicators
    solver = z3.Solver()
    with PM.smt_core():
        solver.add(model.planned(), *pin(model.snap, snap), *params)
        if solver.check() != z3.sat:
            return "the model rejects the snapshot as not well formed"
        if result:
            if solver.check(eq) != z3.sat:
                return f"the model cannot make the code's plan {result}"
            if model.exact and solver.check(model.plan().exists, z3.Not(eq)) != z3.unsat:
                return f"the model makes a plan other than the code's {result}:\n{PM.describe(model, solver.model())}"
        elif model.exact and solver.check(model.plan().exists) != z3.unsat:
            return f"the code says {result} but the model makes a plan:\n{PM.describe(model, solver.model())}"
    return None


DIFF_BOUNDS = [PM.Bound(1, 6), PM.Bound(2, 5), PM.Bound(4, 4), PM.Bound(8, 3)]
DIFF = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("bound", DIFF_BOUNDS, ids=str)
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "relaxed"])
@DIFF
@given(data=st.data())
def test_compact_model_makes_the_codes_plan(bound, exact, data):
    snap = data.draw(snapshots(bound))
    max_sources = data.draw(st.integers(1, bound.max_blocks + 1), label="max_sources")
    budget = data.draw(st.integers(0, bound.max_blocks), label="budget")
    result = plan_compaction(snap, [FRESH + d for d in range(budget)], max_sources)
    model = PM.CompactModel(bound, exact=exact)
    why = disagreement(model, snap, result, compact_params(model, max_sources, budget))
    assert why is None, why


@pytest.mark.parametrize("bound", DIFF_BOUNDS, ids=str)
@DIFF
@given(data=st.data())
@example(data=None)  # replaced below by a fixed, plan-making snapshot
def test_densify_model_makes_exactly_the_codes_plan(bound, data):
    if data is None:  # holes at 0 and 1, movers at the end: a plan with moves and a released block
        S = bound.block_size
        snap = make_snapshot(S, list(range(bound.max_blocks)), {p: p for p in range(2, S * 2)}, S * 2)
    else:
        snap = data.draw(snapshots(bound))
    result = plan_densify(snap)
    why = disagreement(PM.DensifyModel(bound), snap, result)
    assert why is None, why


def test_the_differential_test_sees_plans_not_only_noplans():
    """The generated snapshots reach every outcome, so the agreement above is not about NoPlan alone."""
    snap = make_snapshot(2, [7, 3, 9, 4], {0: 0, 2: 1, 4: 2, 6: 5}, 7)
    compact = plan_compaction(snap, [FRESH, FRESH + 1], 3)
    assert isinstance(compact, Plan) and compact.src_blocks == (7, 3, 9) and compact.dst_blocks == (FRESH, FRESH + 1)
    model = PM.CompactModel(PM.Bound(2, 4), exact=True)
    assert disagreement(model, snap, compact, compact_params(model, 3, 2)) is None
    densify = plan_densify(snap)
    assert isinstance(densify, Plan) and densify.dense_write_pos == 4
    assert [(m.token_id, m.dst_block, m.dst_offset) for m in densify.moves] == [(2, 7, 1), (5, 3, 1)]
    assert disagreement(PM.DensifyModel(PM.Bound(2, 4)), snap, densify) is None


# ---- the differential test has teeth: corrupted code results are caught ----------------------------------
def _swap_dsts(plan: Plan) -> Plan:
    a, b = plan.moves[0], plan.moves[1]
    moves = (a._replace(dst_block=b.dst_block, dst_offset=b.dst_offset),
             b._replace(dst_block=a.dst_block, dst_offset=a.dst_offset)) + plan.moves[2:]
    return Plan(plan.kind, plan.req_id, plan.version, moves, plan.src_blocks, plan.dst_blocks, plan.dense_write_pos)


CORRUPTIONS = {
    "destinations out of logical order": _swap_dsts,
    "a move dropped": lambda p: Plan(p.kind, p.req_id, p.version, p.moves[1:], p.src_blocks, p.dst_blocks,
                                     p.dense_write_pos),
    "a source block not released": lambda p: Plan(p.kind, p.req_id, p.version, p.moves, p.src_blocks[:-1],
                                                  p.dst_blocks, p.dense_write_pos),
    "a token read from the wrong offset": lambda p: Plan(
        p.kind, p.req_id, p.version, (p.moves[0]._replace(src_offset=1 - p.moves[0].src_offset),) + p.moves[1:],
        p.src_blocks, p.dst_blocks, p.dense_write_pos),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
@pytest.mark.parametrize("planner", ["compact", "densify"])
def test_a_corrupted_plan_disagrees_with_the_model(planner, corruption):
    snap = make_snapshot(2, [7, 3, 9, 4], {0: 0, 2: 1, 4: 2, 6: 5}, 7)
    bound = PM.Bound(2, 4)
    if planner == "compact":
        plan, model = plan_compaction(snap, [FRESH, FRESH + 1], 3), PM.CompactModel(bound, exact=True)
        params = compact_params(model, 3, 2)
    else:
        plan, model, params = plan_densify(snap), PM.DensifyModel(bound), []
    bad = CORRUPTIONS[corruption](plan)
    assert bad != plan
    assert disagreement(model, snap, bad, params) is not None


def test_a_planner_choosing_the_fullest_blocks_disagrees_with_the_exact_model():
    """A plausible code bug (sources taken highest utilization first) that still makes valid plans: the
    relaxed model allows its plan, the exact model pins the code's greedy choice and rejects it."""
    snap = make_snapshot(4, [7, 3, 9, 8], {0: 0, 4: 1, 5: 2, 6: 3, 8: 4, 12: 5}, 13)
    good = plan_compaction(snap, [FRESH], 2)
    assert isinstance(good, Plan) and good.src_blocks == (7, 9)
    fullest_first = Plan(good.kind, "r", good.version,
                         (Move(0, 7, 0, FRESH, 0), Move(1, 3, 0, FRESH, 1), Move(2, 3, 1, FRESH, 2),
                          Move(3, 3, 2, FRESH, 3)), (7, 3), (FRESH,))
    bound = PM.Bound(4, 4)
    exact, relaxed = PM.CompactModel(bound, exact=True), PM.CompactModel(bound)
    assert disagreement(exact, snap, good, compact_params(exact, 2, 1)) is None
    assert disagreement(relaxed, snap, fullest_first, compact_params(relaxed, 2, 1)) is None
    assert "cannot make the code's plan" in disagreement(exact, snap, fullest_first, compact_params(exact, 2, 1))


# ---- the proofs, and planted model bugs ---------------------------------------------------------------------
def test_every_planner_obligation_is_proved_at_a_small_bound():
    """The full bounds run in ``vtoken spec check`` (make test); here every property at S=2, 4 blocks."""
    for prop in PM.PROPERTIES:
        out = run(PM.obligation(prop, bounds=SMALL)).outcome
        assert out.status == PROVED, (prop.id, out.status, out.detail[:400])


def test_the_spec_check_registers_the_planner_model_with_the_stated_bounds():
    from vtoken.spec.cli import MODULES
    assert "planner_model" in MODULES
    obs = PM.obligations()
    assert [o.id for o in obs] == [p.id for p in PM.PROPERTIES] and len(obs) == 10
    wide = {p.id for p in PM.PROPERTIES if p.bounds == PM.WIDE_BOUNDS}
    assert {PM.Bound(32, 2), PM.Bound(16, 3)} <= set(PM.WIDE_BOUNDS)
    assert wide == {p.id for p in PM.PROPERTIES} - {"I4/densify/no-chain", "I4/densify/moves"}
    assert "S=32 with <= 2 blocks" in obs[0].claim


@pytest.mark.parametrize("kind", ["compact", "densify"])
def test_the_models_lemmas_follow_from_the_premise(kind):
    """``lemmas()`` are hints; they must be implied by the premise, or they would make proofs unsound."""
    for bound in (PM.Bound(1, 4), PM.Bound(2, 4), PM.Bound(4, 3)):
        model = PM.MODELS[kind](bound)
        hints = model.lemmas()  # first: it defines indicators that the premise's ``wf`` must then include
        claim = z3.Implies(PM.premise(model, lemmas=False), hints)
        with PM.smt_core():
            from vtoken.spec.obligations import prove
            assert prove(claim, timeout_ms=60_000).status == PROVED, (kind, str(bound))


def _bug(base, **methods):
    return type(f"Buggy{base.__name__}", (base,), methods)


S_ = lambda m: m.snap.S  # noqa: E731
PLANTED = {
    # property id: (buggy model, what the bug is)
    "I4/compact/strict-decrease": (_bug(PM.CompactModel, gate=lambda m: m.k >= 1),
                                   "plans even when packing frees nothing"),
    "I4/compact/dst-capacity": (_bug(PM.CompactModel, dst_slot=lambda m, j: (
        m.reserved_at(j // (S_(m) + 1)), z3.IntVal(j % (S_(m) + 1)))), "fills S+1 slots per destination block"),
    "I4/compact/injective-dst": (_bug(PM.CompactModel, params=lambda m: z3.And(m.max_sources >= 1, m.budget >= 0, *[
        z3.And(m.reserved_index(r) == d, r >= 0) for d, r in enumerate(m.reserved)])),
        "a destination may be one of the request's own blocks"),
    "I4/compact/live-sources": (_bug(PM.CompactModel, covers=lambda m, p: z3.BoolVal(True),
                                     selects=lambda m, j: z3.And(m.snap.is_entry_offset(m.src_entry(j), m.src_off(j)),
                                                                 m.snap.live_at(m.src_entry(j), m.src_off(j)))),
                                "moves take any T live tokens of the request, not those of the sources"),
    "I4/compact/eligible-sources": (_bug(PM.CompactModel, eligible=lambda m, i: z3.And(
        i < m.snap.nb, (i + 1) * m.snap.S <= m.snap.w, m.snap.cnt[i] < m.snap.S)), "shared blocks are eligible"),
    "I4/compact/logical-order": (_bug(PM.CompactModel, order=lambda m, j: m.token(j) != m.token(j + 1)),
                                 "tokens are taken in any order"),
    "I7/densify/dense-prefix": (_bug(PM.DensifyModel, order=lambda m, j: m.token(j) < m.token(j + 1)),
                                "holes are not taken in position order (two moves may fill one)"),
    "I4/densify/no-chain": (_bug(PM.DensifyModel, targets=lambda m, j: z3.And(
        m.snap.is_entry_offset(m.dst_entry(j), m.dst_off(j)), z3.Not(m.snap.live_at(m.dst_entry(j), m.dst_off(j)))),
        covers=lambda m, p: z3.BoolVal(True)), "movers go to any free slot, not only holes below n_live"),
    "I7/densify/freed-blocks": (_bug(PM.DensifyModel, is_src_block=lambda m, i: z3.And(
        m.keep - 1 <= i, i < m.written)), "the last block kept is released too"),
    "I4/densify/moves": (_bug(PM.DensifyModel, touches_shared=lambda m, i, o: z3.BoolVal(False)),
                         "shared blocks are not checked"),
}


def test_every_property_has_a_planted_bug():
    assert sorted(PLANTED) == sorted(p.id for p in PM.PROPERTIES)


@pytest.mark.parametrize("pid", sorted(PLANTED))
def test_a_planted_model_bug_yields_a_readable_counterexample(pid):
    model_cls, what = PLANTED[pid]
    out = run(PM.obligation(PM.property_by_id(pid), model_cls, bounds=SMALL)).outcome
    assert out.status == COUNTEREXAMPLE, f"{what}: {out.status} {out.detail[:400]}"
    assert "snapshot: S=2" in out.detail and "violated:" in out.detail and "(none evaluated true)" not in out.detail


def test_a_model_that_never_plans_is_reported_vacuous_not_proved():
    """Counting every slot of a source block, dead or live, makes ceil(T/S) = k: no plan passes the gate."""
    never = _bug(PM.CompactModel, is_source=lambda m, p: m.chosen[p // m.snap.S],
                 selects=lambda m, j: z3.And(m.snap.is_entry_offset(m.src_entry(j), m.src_off(j)),
                                             m.chosen_at(m.src_entry(j))))
    out = run(PM.obligation(PM.property_by_id("I4/compact/live-sources"), never, bounds=SMALL)).outcome
    assert out.status != PROVED and "vacuous: the compact model makes no plan at all" in out.detail
