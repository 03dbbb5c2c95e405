"""The planner model: proved for every block size, tied to core's planners by a differential test, with teeth.

The differential test pins the bounded model's symbolic snapshot to a concrete one (up to S = 16 with 8
blocks; S = 32 with 4 under VTOKEN_SLOW_TESTS=1), runs the Python planner on the same snapshot, and
requires the model to make exactly the code's plan (the ``exact`` models) or at least to allow it (the
relaxed compact model that the proofs quantify over). The bounded model is the parametric one's templates
instantiated at every index, so the test ties the proved templates to the code.
"""

from __future__ import annotations

from array import array
from functools import lru_cache

import pytest
import z3
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vtoken.core.reference.compact import plan_compaction
from vtoken.core.densify import plan_densify
from vtoken.core.plan import NoPlan, Plan
from vtoken.core.token_table import NO_SLOT, Move, RequestSnapshot
from vtoken.spec import planner_model as PM
from vtoken.spec.obligations import COUNTEREXAMPLE, PROVED, UNKNOWN, prove, run

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
    cs = [s.nb == len(snap.blocks), s.w == snap.write_pos, s.n_live == snap.num_live]
    for i, b in enumerate(snap.blocks):
        cs += [s.block_id(i) == b, s.shared_at(i) == (b in snap.shared_blocks), s.live_count(i) == snap.live_count(i)]
    for i, o in s.slots():
        p = i.as_long() * S + o.as_long()
        cs.append(s.live_at(i, o) == (p in at))
        if p in at:
            cs.append(s.token_at(i, o) == at[p])
    return cs


def same_plan(model, snap: RequestSnapshot, plan: Plan) -> z3.BoolRef:
    """The model's plan is ``plan``: the same moves in the same order, sources and destinations."""
    zp = model.plan()
    eq = [zp.exists, zp.num_moves == len(plan.moves)]
    for zm, m in zip(zp.moves, plan.moves):
        eq += [f == v for f, v in zip(zm.fields(), m)]
    for i, (g, _) in enumerate(zp.src_blocks):
        eq.append(g == (i < len(snap.blocks) and snap.blocks[i] in plan.src_blocks))
    for d, (g, _) in enumerate(zp.dst_blocks):
        eq.append(g == (d < len(plan.dst_blocks)))
    if zp.dense_write_pos is not None:
        eq.append(zp.dense_write_pos == plan.dense_write_pos)
    return z3.And(eq)


def compact_params(model: PM.CompactModel, max_sources: int, budget: int) -> list[z3.BoolRef]:
    return [model.max_sources == max_sources, model.budget == budget,
            *[model.reserved_at(d) == FRESH + d for d in range(model.snap.bound.max_blocks)]]


def _premise(model) -> tuple[z3.BoolRef, int]:
    """The bounded model's premise, built once per model (building it at S = 16 with 8 blocks takes seconds),
    after the plan's counts so that their indicators are defined in it. Returns it and how many
    indicator definitions it includes."""
    if not hasattr(model, "_premise"):
        zp = model.plan()
        zp.num_moves, zp.num_src, zp.num_dst  # noqa: B018 (defines their indicators)
        model._premise = (model.planned(), len(model.snap.defs))
    return model._premise


@lru_cache(maxsize=None)
def shared_model(kind: str, bound: PM.Bound, exact: bool = True):
    """One model per (planner, bound, exactness) for all the examples of a run: the premise is built once."""
    return PM.CompactModel(bound, exact=exact) if kind == "compact" else PM.DensifyModel(bound)


def _pinned(formula: z3.BoolRef, pins: list[z3.BoolRef]) -> z3.BoolRef:
    """``formula`` with the pinned terms replaced by their values and simplified (the pins themselves are
    asserted too, so symbolic reads such as live(src_entry(j), o) still find the values): the same
    constraints, which the solver then takes in milliseconds instead of seconds."""
    return z3.simplify(z3.substitute(formula, *[(c.arg(0), c.arg(1)) for c in pins]))


def disagreement(model, snap: RequestSnapshot, result: Plan | NoPlan, params: list[z3.BoolRef] = ()) -> str | None:
    """Why the model and ``result`` (the planner's output on ``snap``) disagree, or None if they agree.

    The exact model must make ``result`` and nothing else (NoPlan: no plan at all); the relaxed model
    must at least allow ``result`` when it is a Plan.
    """
    premise, ndefs = _premise(model)
    eq = same_plan(model, snap, result) if result else None
    pins = [*pin(model.snap, snap), *params]
    solver = z3.Solver()
    with PM.smt_core():
        solver.add(_pinned(z3.And(premise, *model.snap.defs[ndefs:]), pins), *pins)
        if solver.check() != z3.sat:
            return "the model rejects the snapshot as not well formed"
        exists = _pinned(model.plan().exists, pins)
        if result:
            eq = _pinned(eq, pins)
            if solver.check(eq) != z3.sat:
                return f"the model cannot make the code's plan {result}"
            if model.exact and solver.check(exists, z3.Not(eq)) != z3.unsat:
                return f"the model makes a plan other than the code's {result}:\n{PM.describe(model, solver.model())}"
        elif model.exact and solver.check(exists) != z3.unsat:
            return f"the code says {result} but the model makes a plan:\n{PM.describe(model, solver.model())}"
    return None


SMALL_BOUNDS = [PM.Bound(1, 6), PM.Bound(2, 5), PM.Bound(4, 4), PM.Bound(8, 3)]
PRODUCTION = PM.Bound(16, 8)  # vLLM's default block size, 8 blocks (128 positions)
DIFF_BOUNDS = [*SMALL_BOUNDS, PRODUCTION, pytest.param(PM.Bound(32, 4), marks=pytest.mark.slow)]
DIFF = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _draw_compact(data, bound: PM.Bound):
    snap = data.draw(snapshots(bound))
    max_sources = data.draw(st.integers(1, bound.max_blocks + 1), label="max_sources")
    budget = data.draw(st.integers(0, bound.max_blocks), label="budget")
    return snap, max_sources, budget, plan_compaction(snap, [FRESH + d for d in range(budget)], max_sources)


@pytest.mark.parametrize("bound", DIFF_BOUNDS, ids=str)
@DIFF
@given(data=st.data())
def test_the_exact_compact_model_makes_exactly_the_codes_plan(bound, data):
    snap, max_sources, budget, result = _draw_compact(data, bound)
    model = shared_model("compact", bound)
    why = disagreement(model, snap, result, compact_params(model, max_sources, budget))
    assert why is None, why


@pytest.mark.parametrize("bound", SMALL_BOUNDS, ids=str)
@DIFF
@given(data=st.data())
def test_the_relaxed_compact_model_allows_the_codes_plan(bound, data):
    """The proofs quantify over the relaxed model; it must allow the code's plan. (Implied by the exact
    test, as exact = relaxed + the greedy choice; checked directly at the small bounds.)"""
    snap, max_sources, budget, result = _draw_compact(data, bound)
    model = shared_model("compact", bound, exact=False)
    why = disagreement(model, snap, result, compact_params(model, max_sources, budget))
    assert why is None, why


@pytest.mark.parametrize("bound", DIFF_BOUNDS, ids=str)
@DIFF
@given(data=st.data())
@example(data=None)  # replaced below by a fixed, plan-making snapshot
def test_the_densify_model_makes_exactly_the_codes_plan(bound, data):
    if data is None:  # holes at 0 and 1, movers at the end: a plan with moves and a released block
        S = bound.block_size
        snap = make_snapshot(S, list(range(bound.max_blocks)), {p: p for p in range(2, S * 2)}, S * 2)
    else:
        snap = data.draw(snapshots(bound))
    why = disagreement(shared_model("densify", bound), snap, plan_densify(snap))
    assert why is None, why


def _production_snapshot() -> RequestSnapshot:
    """S = 16, 8 blocks, cursor 100: every third position of [0, 100) evicted, 66 live tokens whose ids are out of
    position order."""
    live = [p for p in range(100) if p % 3]
    ids = [(p * 37) % 200 for p in live]  # distinct: 37 is invertible mod 200
    return make_snapshot(16, [40 + 3 * i for i in range(8)], dict(zip(live, ids)), 100, total_len=200)


def test_the_differential_test_sees_plans_at_the_production_bound():
    """At S = 16 with 8 blocks both planners make big plans, and the models make exactly them."""
    snap = _production_snapshot()
    compact = plan_compaction(snap, [FRESH + d for d in range(8)], 8)
    assert isinstance(compact, Plan) and compact.src_blocks == (40, 43, 46, 49, 52, 55)
    assert len(compact.moves) == 64 and compact.dst_blocks == (FRESH, FRESH + 1, FRESH + 2, FRESH + 3)
    model = shared_model("compact", PRODUCTION)
    assert disagreement(model, snap, compact, compact_params(model, 8, 8)) is None
    densify = plan_densify(snap)
    assert isinstance(densify, Plan) and densify.dense_write_pos == 66 and len(densify.moves) == 22
    assert densify.src_blocks == (55, 58)  # entries [ceil(66/16), ceil(100/16)) = [5, 7)
    assert disagreement(shared_model("densify", PRODUCTION), snap, densify) is None
    swapped = _swap_dsts(densify)
    assert "cannot make the code's plan" in disagreement(shared_model("densify", PRODUCTION), snap, swapped)


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


def test_densify_refuses_a_shared_block_holding_the_new_cursor_and_so_does_the_model():
    """n_live = 3 lies inside block 11 (S = 2), which no hole, mover or released block touches: the code
    refuses the plan because the next appends would write the shared block's tail, and the model agrees."""
    snap = make_snapshot(2, [10, 11, 12], {0: 0, 1: 1, 2: 2}, 5, shared={11})
    result = plan_densify(snap)
    assert isinstance(result, NoPlan) and result.reason.name == "SHARED_BLOCK"
    assert disagreement(PM.DensifyModel(PM.Bound(2, 3)), snap, result) is None
    unshared = make_snapshot(2, [10, 11, 12], {0: 0, 1: 1, 2: 2}, 5)
    plan = plan_densify(unshared)
    assert isinstance(plan, Plan) and plan.src_blocks == (12,) and plan.moves == ()
    assert disagreement(PM.DensifyModel(PM.Bound(2, 3)), unshared, plan) is None


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
def test_every_planner_obligation_is_proved_for_every_block_size():
    obs = PM.obligations()
    for ob in obs:
        out = run(ob).outcome
        assert out.status == PROVED, (ob.id, out.status, out.detail[:400])
        assert out.detail.startswith("every S >= 1 and block count") and f"plans at {PM.WITNESS_BOUND}" in out.detail


def test_the_spec_check_registers_the_planner_model_with_its_claims():
    from vtoken.spec.cli import MODULES
    assert "planner_model" in MODULES
    obs = PM.obligations()
    assert [o.id for o in obs] == [p.id for p in PM.PROPERTIES] and len(obs) == 10
    assert all("for every block size S >= 1 and every number of blocks" in o.claim for o in obs)


@pytest.mark.parametrize("pid", [p.id for p in PM.PROPERTIES])
def test_the_parametric_premise_is_satisfiable(pid):
    """The template instances a proof uses hold together (at S = 16, with a plan of two or more moves), so the
    proof does not follow from a contradiction among them."""
    prop = PM.property_by_id(pid)
    model = PM.MODELS[prop.planner](None)
    prop.violations(model)
    premise, instances, _ = PM.parametric_premise(model)
    solver = z3.Solver()
    solver.add(premise, model.snap.S == 16, model.plan().num_moves >= 2)
    assert instances > 0 or pid in ("I4/compact/strict-decrease", "I4/compact/eligible-sources")
    assert solver.check() == z3.sat


def test_the_pairwise_increase_is_proved_by_induction_and_fails_for_tokens_in_any_order():
    model = PM.CompactModel(None)
    [(name, f, n)] = model.increasing()
    assert PM.increasing_lemma(model, name, f, n).status == PROVED
    any_order = _bug(PM.CompactModel, order=lambda m, j: m.token(j) != m.token(j + 1))(None)
    out = PM.increasing_lemma(any_order, name, any_order.token, any_order.T)
    assert out.status != PROVED and "induction base" in out.detail


def test_the_scaling_fact_the_proofs_rely_on_is_valid():
    """The parametric proofs compare positions i*S + o; they need a <= b => a*S <= b*S for S >= 1 (z3's
    nonlinear arithmetic supplies it). Checked on its own, for every a, b, S."""
    a, b, S = z3.Ints("a b S")
    assert prove(z3.Implies(z3.And(S >= 1, a <= b), a * S <= b * S)).status == PROVED


def test_a_bug_only_at_block_sizes_beyond_the_differential_bounds_fails_the_proof():
    """The proof is not a bounded one in disguise: compact writing offset S - 1 twice only when S >= 64 (no
    snapshot within any bound the tests or the search use) is not proved."""
    def dst_slot(m, j):
        q, r = PM._divmod(j, m.snap.S)
        return m.reserved_at(q), z3.If(z3.And(m.snap.S >= 64, r == m.snap.S - 2), r + 1, r)
    out = run(PM.obligation(PM.property_by_id("I4/compact/injective-dst"), _bug(PM.CompactModel, dst_slot=dst_slot),
                            bounds=SMALL)).outcome
    assert out.status == UNKNOWN and "no counterexample within S=2 with <= 4 blocks" in out.detail


def _bug(base, **methods):
    return type(f"Buggy{base.__name__}", (base,), methods)


def _selects_any_live(m, j):
    i, o = m.src_entry(j), m.src_off(j)
    return z3.And(m.snap.in_range(i, o), m.snap.live_at(i, o))


def _reserved_may_be_listed(m, d):
    r = m.reserved_at(d)
    return z3.Implies(z3.And(0 <= d, d < m.budget), z3.And(m.reserved_index(r) == d, r >= 0))


PLANTED = {
    # property id: (buggy model, what the bug is)
    "I4/compact/strict-decrease": (_bug(PM.CompactModel, gate_facts=lambda m: m.k >= 1),
                                   "plans even when packing frees nothing"),
    "I4/compact/dst-capacity": (_bug(PM.CompactModel, dst_slot=lambda m, j: (
        m.reserved_at(j / (m.snap.S + 1)), j % (m.snap.S + 1))), "fills S+1 slots per destination block"),
    "I4/compact/injective-dst": (_bug(PM.CompactModel, params=_reserved_may_be_listed),
                                 "a destination may be one of the request's own blocks"),
    "I4/compact/live-sources": (_bug(PM.CompactModel, covers=lambda m, i, o: z3.BoolVal(True),
                                     selects=_selects_any_live),
                                "moves take any T live tokens of the request, not those of the sources"),
    "I4/compact/eligible-sources": (_bug(PM.CompactModel, eligible=lambda m, i: z3.And(
        0 <= i, i < m.snap.nb, i * m.snap.S + m.snap.S <= m.snap.w, m.snap.live_count(i) < m.snap.S)),
        "shared blocks are eligible"),
    "I4/compact/logical-order": (_bug(PM.CompactModel, dst_slot=lambda m, j: (
        m.reserved_at((m.T - 1 - j) / m.snap.S), (m.T - 1 - j) % m.snap.S)), "destinations are filled from the end"),
    "I7/densify/dense-prefix": (_bug(PM.DensifyModel, mover_slot=lambda m, i, o: z3.And(
        m.snap.live_at(i, o), m.snap.pos(i, o) > m.n)), "a live token exactly at n_live is not moved"),
    "I4/densify/no-chain": (_bug(PM.DensifyModel, targets=lambda m, j: z3.And(
        m.snap.in_range(m.dst_entry(j), m.dst_off(j)), z3.Not(m.snap.live_at(m.dst_entry(j), m.dst_off(j)))),
        covers=lambda m, i, o: z3.BoolVal(True)), "movers go to any free slot, not only holes below n_live"),
    "I7/densify/freed-blocks": (_bug(PM.DensifyModel, is_src_block=lambda m, i: z3.And(
        m.keep - 1 <= i, i < m.written)), "the last block kept is released too"),
    "I4/densify/moves": (_bug(PM.DensifyModel, touches_shared=lambda m, i, o: z3.BoolVal(False)),
                         "shared blocks are not checked"),
}
MORE_PLANTED = [
    ("I4/densify/moves", _bug(PM.DensifyModel, is_cursor_block=lambda m, i: z3.BoolVal(False)),
     "the block the new cursor lies inside is not checked for sharing"),
]


def test_every_property_has_a_planted_bug():
    assert sorted(PLANTED) == sorted(p.id for p in PM.PROPERTIES)


@pytest.mark.parametrize("pid, model_cls, what", [(pid, *PLANTED[pid]) for pid in sorted(PLANTED)] + MORE_PLANTED,
                         ids=[*sorted(PLANTED), *[f"{pid} ({what})" for pid, _, what in MORE_PLANTED]])
def test_a_planted_model_bug_yields_a_readable_counterexample(pid, model_cls, what):
    out = run(PM.obligation(PM.property_by_id(pid), model_cls, bounds=SMALL)).outcome
    assert out.status == COUNTEREXAMPLE, f"{what}: {out.status} {out.detail[:400]}"
    assert "snapshot: S=2" in out.detail and "violated:" in out.detail and "(none evaluated true)" not in out.detail


def test_a_model_that_never_plans_is_reported_vacuous_not_proved():
    """Counting every slot of a source block, dead or live, makes ceil(T/S) = k: no plan passes the gate."""
    def selects(m, j):
        return z3.And(m.snap.in_range(m.src_entry(j), m.src_off(j)), m.chosen_at(m.src_entry(j)))
    never = _bug(PM.CompactModel, is_source=lambda m, i, o: m.chosen_at(i), selects=selects)
    for pid in ("I4/compact/live-sources", "I4/compact/strict-decrease"):
        out = run(PM.obligation(PM.property_by_id(pid), never, bounds=SMALL)).outcome
        assert out.status == UNKNOWN and "vacuous: the compact model makes no plan at all" in out.detail, pid
